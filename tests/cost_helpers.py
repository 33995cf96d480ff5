"""What the cost pass's test files share: the bundled examples, a printed
formula evaluated exactly, the CLI run in-process, and a report's bytes per
tensor beside the ByteCounter's."""
from __future__ import annotations

from collections import defaultdict
from fractions import Fraction
from pathlib import Path

import napkin
from napkin import ir

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "examples").glob("*.ncd"))


def load(name: str) -> ir.Diagram:
    return napkin.load(REPO / "examples" / f"{name}.ncd")


def sizes_for(d: ir.Diagram, n: int, heads: int = 2) -> dict[str, int]:
    """n for every sequence-like symbolic wire, ``heads`` for head wires, 1 for b."""
    small = {"b": 1, "h": heads, "hk": heads, "g": 2}
    return {w.name: small.get(w.name, n) for w in d.wires if w.size is None and w.name not in coarse_wires(d)}


def coarse_wires(d: ir.Diagram) -> set[str]:
    """The wires a coarse read's blocks lie along (qb of keep[.., q // 64, ..]):
    their sizes follow from the wires read (ceil(|q| / 64)), so the sizes the
    tests give leave them out, for the cost pass and example_inputs to derive."""
    return {declared for _, declared, _, _, _ in ir.coarse_reads(d)}


def evaluate(formula: str, env) -> Fraction:
    """Evaluate a printed formula (a*b/c + ... with ^) exactly."""
    expr = formula.replace("^", "**")
    return Fraction(eval(expr, {"__builtins__": {}}, {k: Fraction(v) for k, v in env.items()}))


def run_cli(*argv, capsys):
    from napkin.cli import main
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def predicted_bytes(report, *without) -> tuple[dict, dict]:
    """A report's (loads, stores) bytes per tensor, as the ByteCounter keys
    them (triton_transfers), less the tensors ``without``."""
    out = (defaultdict(int), defaultdict(int))
    for t in triton_transfers(report):
        out[t.direction != "load"][t.tensor] += t.bytes
    return tuple(without_tensors(c, *without) for c in out)


def triton_transfers(report) -> list:
    """A report's transfers but those of the ranges prepass's lists, which
    torch's ops make (the ByteCounter sees Triton's loads and stores alone)."""
    torch_made = {k.index for k in report.kernels if k.prepass_step == "lists"}
    return [t for t in report.transfers if t.kernel not in torch_made]


# the backward's kernels torch's ops make, which the ByteCounter does not see
TORCH_MADE = ("prepass lists", "(torch)")


def backward_bytes(back, direction: str) -> dict:
    """A backward cost's bytes per tensor in one direction, as the ByteCounter
    sees them: torch's left out (the prepasses' lists, a gated value's product
    and gradients)."""
    out: dict = defaultdict(int)
    for m in back.moves:
        if m.direction == direction and not m.kernel.endswith(TORCH_MADE):
            out[m.tensor] += m.bytes
    return dict(out)


def triton_launches(back) -> int:
    """The backward's Triton launches: its kernels less torch's."""
    return sum(not k.endswith(TORCH_MADE) for k in back.kernels)


def gathered_reads(d: ir.Diagram) -> set[str]:
    """The float tensors read at a wire's blocks (tile_bias's B[h, q // 64, x // 64]): the
    kernel loads one a lane of the score tile, which the interpreter counts, where the cost
    pass counts the distinct cells a tile meets, the repeats served by the cache.  The
    counted-bytes tests leave their loads out."""
    return {n for n, *_ in ir.coarse_reads(d) if d.tensor(n).dtype in ir.FLOAT_DTYPES}


def without_tensors(counts, *names) -> dict:
    """Bytes per tensor less ``names`` and the zeros."""
    return {k: v for k, v in counts.items() if k not in names and v}


def doc_ids(docs, n: int, rows: int = 1):
    """[rows, n] int32 ids of ``docs`` (napkin.documents.Documents) over n
    tokens, the same documents in every row: what a document mask reads."""
    import torch

    starts = docs.starts(n)
    ids = torch.zeros(n, dtype=torch.int32)
    for k, (a, b) in enumerate(zip(starts, starts[1:])):
        ids[a:b] = k
    return ids.repeat(rows, 1)


def record_rows(record, steps: int) -> list[tuple]:
    """Each block's (lo, hi, partial blocks, full blocks, prefix counts), as a
    ranges prepass's record ([blocks, 2 S + 4] int32, S = ``steps``:
    ranges.bounds_lines) holds them: [lo, hi), the two counts, the two lists,
    and a chunked launch's ([blocks, 4 S + 6]) two lists' prefix counts
    pos[0..S] (else None)."""
    out = []
    for r in record.tolist():
        assert len(r) in (2 * steps + 4, 4 * steps + 6), (len(r), steps)
        prefix = (r[4 + 2 * steps:5 + 3 * steps], r[5 + 3 * steps:]) if len(r) > 2 * steps + 4 else None
        out.append((r[0], r[1], tuple(r[4:4 + r[2]]), tuple(r[4 + steps:4 + steps + r[3]]), prefix))
    return out


def full_lists(record, steps: int) -> list[tuple[int, ...]]:
    """Each block's full blocks, as a ranges prepass's record lists them."""
    return [full for _, _, _, full, _ in record_rows(record, steps)]


# Grouped-query attention on documents, the query heads g of a key/value head: dK/dV's flat loop
# over (row block, g) pairs walks the prepass's list (test_ranges, test_prepass_cost).
GQA_DOC = """diagram gqa_doc
wire b, hk, g, q, x
wire d = 32
in Q[b, (hk g), q, d] : fp32
in K[b, hk, x, d] : fp32
in V[b, hk, x, d] : fp32
in doc[b, x] : int32
S[b, hk, g, q, x] = where(doc[b, q] == doc, sum[d](Q * K) * |d|^-0.5, -inf)
P[b, hk, g, q, x] = softmax[x](S)
O[b, (hk g), q, d] : fp32 = sum[x](P * V)
out O
schedule on h100 {
  accumulate fp32
  level hbm { hold Q, K, V, doc, O }
  level smem {
    group b by 1, hk by 1, g by 1, q by 64
    stream x by 32
    hold S, P
  }
}
"""
