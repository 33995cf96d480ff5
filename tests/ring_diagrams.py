"""The ring and mesh diagrams the multi-process suites run
(test_distributed2.py) and test_plan.py and test_reach.py read: the shipped
examples at a small head dim, a mask, a dtype and mesh levels set per case
(so the cost pass sees what the wrappers run), and what each mask keeps,
written independently of napkin.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

REPO = Path(__file__).resolve().parent.parent
D = 16

MASKS = {
    "full": None,
    "causal": "where(x <= q, sum[d](Q * K) * |d|^-0.5, -inf)",
    "strict": "where(x < q, sum[d](Q * K) * |d|^-0.5, -inf)",       # query 0 sees no key
    "decode": "where(x <= q + |x| - |q|, sum[d](Q * K) * |d|^-0.5, -inf)",
    # masks that keep only nearby keys: a ring over contiguous shards stops early (reach.py)
    "window": "where(x <= q and q - x < 3, sum[d](Q * K) * |d|^-0.5, -inf)",
    "chunks": "where(x // 4 == q // 4, sum[d](Q * K) * |d|^-0.5, -inf)",
    "causal_chunks": "where(x <= q and x // 8 == q // 8, sum[d](Q * K) * |d|^-0.5, -inf)",
    # packed documents (examples/document_mask.ncd): a ring over contiguous shards reads the ids
    "document": "where(doc[b, q] == doc, sum[d](Q * K) * |d|^-0.5, -inf)",
    "causal_document": "where(x <= q and doc[b, q] == doc, sum[d](Q * K) * |d|^-0.5, -inf)",
    # keys on both sides of a query: a ring over contiguous shards runs both ways (reach.ring_arms)
    "two_sided": "where(q - x < 3 and x - q < 3, sum[d](Q * K) * |d|^-0.5, -inf)",
    "documents_across": "where(doc[b, q] == doc, sum[d](Q * K) * |d|^-0.5, -inf)",
    # documents over zigzag shards: a rank's early chunk reads the rank behind, its late one the rank
    # ahead (both ways round, causal or not)
    "zigzag_document": "where(x <= q and doc[b, q] == doc, sum[d](Q * K) * |d|^-0.5, -inf)",
    "zigzag_documents": "where(doc[b, q] == doc, sum[d](Q * K) * |d|^-0.5, -inf)",
}
# the document masks' document lengths: over 16 tokens on 4 ranks none straddles a shard (one
# step); over 13, documents of 5 and 3 tokens straddle one boundary each (two steps, causal)
DOC_LENGTHS = {"document": (2, 2, 4, 1, 3, 4), "causal_document": (2, 5, 3, 3), "documents_across": (2, 5, 3, 3),
                # over 13 zigzag tokens (chunks of 2, on ranks 0 1 2 3 3 2 1): 2 steps back, 1 ahead
                "zigzag_document": (3, 3, 4, 3), "zigzag_documents": (3, 3, 4, 3)}


def doc_ids(mask: str) -> Optional[torch.Tensor]:
    """doc[b, x] of a document mask (None for the others)."""
    if mask not in DOC_LENGTHS:
        return None
    lens = torch.tensor(DOC_LENGTHS[mask])
    return torch.repeat_interleave(torch.arange(len(lens)), lens).to(torch.int32)[None]


def fewest_arms(live: set[int], parts: int, one_way: int) -> tuple[int, int]:
    """(back, ahead) by brute force: of the splits that reach every live
    offset s back (s < back) or the other way (parts - s <= ahead), the
    fewest steps (of equal ones, the fewest back), where fewer than one way
    round."""
    splits = [(b + a, b, a) for b in range(1, parts + 1) for a in range(parts)
              if all(s < b or parts - s <= a for s in live)]
    steps, back, ahead = min(splits)
    return (back, ahead) if steps < one_way else (one_way, 0)


def keeps(mask: str, qi, xi):
    """What each mask of MASKS keeps, written independently of napkin."""
    doc = doc_ids(mask)
    same = (doc[0][qi] == doc[0][xi]) if doc is not None else None
    return {"full": xi >= 0, "causal": xi <= qi, "strict": xi < qi,
            "window": (xi <= qi) & (qi - xi < 3), "chunks": xi // 4 == qi // 4,
            "causal_chunks": (xi <= qi) & (xi // 8 == qi // 8),
            "document": same, "causal_document": same & (xi <= qi) if same is not None else None,
            "two_sided": (qi - xi < 3) & (xi - qi < 3), "documents_across": same,
            "zigzag_document": same & (xi <= qi) if same is not None else None, "zigzag_documents": same}[mask]


PLAIN = "sum[d](Q * K) * |d|^-0.5"

MESHES = {
    "ring": "level devices {\n    group q across 4\n    stream x across 4\n  }",
    "2x2": "level devices {\n    group q across 2\n    group x across 2\n  }",
    "tree4": "level devices { group x across 4 }",
    "tree3": "level devices { group x across 3 }",
    # two nodes of two GPUs: rows inside nodes / columns inside nodes / a ring
    "rows-in-nodes": "level nodes { group q across 2 }\n  level devices { group x across 2 }",
    "cols-in-nodes": "level nodes { group x across 2 }\n  level devices { group q across 2 }",
    # the flat ring's diagram, run on ranks counted as two nodes of two
    "flat-ring-2-nodes": "level devices {\n    group q across 4\n    stream x across 4\n  }",
    # a ring over two nodes of two: the double ring
    "ring-nodes": ("level nodes {\n    group q across 2\n    stream x across 2\n  }\n"
                   "  level devices {\n    group q across 2\n    stream x across 2\n  }"),
    # what napkin plan writes where cost's reading of a devices level alone is not
    # what it assumed (plan.mesh_levels): four nodes of one GPU (a ring: the
    # double ring of 4 x 1), and one node of all four ('across 1' at the nodes level)
    "ring-nodes-of-1": "level nodes {\n    group q across 4\n    stream x across 4\n  }",
    "ring-one-node": ("level nodes {\n    group q across 1\n    stream x across 1\n  }\n"
                      "  level devices {\n    group q across 4\n    stream x across 4\n  }"),
    "2x2-nodes-of-1": "level nodes { group q across 2, x across 2 }\n"
                      "  level devices { group q across 1, x across 1 }",
}
# GPUs a node of the meshes that say so (a nodes level) or are counted so
PER_NODE = {"ring-nodes-of-1": 1, "ring-one-node": 4, "2x2-nodes-of-1": 1}


def diagram_text(base: str, mask: str, dtype: str, mesh: str) -> str:
    """examples/BASE.ncd with d = 16, the given mask, every floating dtype
    set to ``dtype`` and the given mesh levels."""
    text = (REPO / "examples" / f"{base}.ncd").read_text()
    for fixed in ("wire d = 64", "wire d = 128"):
        text = text.replace(fixed, f"wire d = {D}")
    for old in list(MASKS.values())[1:]:
        text = text.replace(old, PLAIN)
    if MASKS[mask] is not None:
        assert PLAIN in text
        text = text.replace(PLAIN, MASKS[mask], 1)
    for dt in ("bf16", "fp16", "fp32"):
        text = text.replace(f": {dt}", f": {dtype}")
    end = text.index("  level hbm")
    start = text.find("  level devices")
    start = end if start < 0 else start
    return text[:start] + "  " + MESHES[mesh] + "\n" + text[end:]
