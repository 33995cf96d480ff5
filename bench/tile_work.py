"""Kept pairs against the pairs a kernel computes, tile by tile, in each ring layout.

    python bench/tile_work.py --devices 8 --docs 9000,30000,2000,24536 [--block-q 128] [--block-x 64]

napkin plan --docs and bench/cp_bench.py count the (query, key) pairs a
mask keeps on each device, as if a kernel skipped exactly the masked pairs.
A kernel skips whole tiles: it computes every pair of a tile that holds one
kept pair.  How many more that is depends on the layout.  A contiguous or
zigzag device holds runs of consecutive positions, so its tiles are
consecutive too; a cyclic device's tile of 128 rows spans 128 x P positions,
so documents shorter than that share its tiles with their neighbours.

For a causal document mask over packed documents of the given lengths
(``--docs``, repeated to fill the sequence as napkin's ``--docs`` does not:
the lengths must add up to the tokens), every device's rows in the order it
stores them are cut into tiles of ``block_q``, every device's keys into
tiles of ``block_x``, and every (query device, key device) pair, as a full
ring meets them all, is counted both ways: the pairs kept, and the pairs in
tiles holding a kept one; and the same for each device of every
ATTENTION2D grid over cyclic parts.  Printed per scheme: the busiest
device's kept pairs and computed pairs, each over the mean kept pairs a
device, and all computed over all kept.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from napkin.distributed.layouts import TokenLayout  # noqa: E402

LAYOUTS = ("contiguous", "zigzag", "cyclic")


def causal_documents(lengths: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """[lo, hi): the keys row q keeps under a causal mask inside its
    document (its document's first token to q itself)."""
    n = sum(lengths)
    starts = np.repeat(np.cumsum([0] + list(lengths[:-1])), lengths)
    return starts.astype(np.int64), np.arange(1, n + 1, dtype=np.int64)


def tile_work(lo: np.ndarray, hi: np.ndarray, rows: np.ndarray, keys: np.ndarray, block_q: int = 128,
              block_x: int = 64) -> tuple[int, int]:
    """(kept, computed): the pairs query positions ``rows`` keep with key
    positions ``keys`` (each in the ascending order a device stores them),
    and the pairs in the (block_q x block_x) tiles holding a kept one."""
    # the local indices [i0, i1) of the keys each row keeps, and the key tiles they fall in
    i0, i1 = np.searchsorted(keys, lo[rows]), np.searchsorted(keys, hi[rows])
    row_tiles, key_tiles = -(-len(rows) // block_q), -(-len(keys) // block_x)
    tile_of_row = np.arange(len(rows)) // block_q
    some = i1 > i0
    # each row's live key tiles are a run: a difference array per row tile marks their union
    marks = np.zeros((row_tiles, key_tiles + 1), dtype=np.int64)
    np.add.at(marks, (tile_of_row[some], i0[some] // block_x), 1)
    np.add.at(marks, (tile_of_row[some], (i1[some] - 1) // block_x + 1), -1)
    live = np.cumsum(marks, axis=1)[:, :key_tiles] > 0
    tall = np.minimum(block_q, len(rows) - np.arange(row_tiles) * block_q)
    wide = np.minimum(block_x, len(keys) - np.arange(key_tiles) * block_x)
    return int((i1 - i0).sum()), int((live * tall[:, None] * wide[None, :]).sum())


def device_work(lo: np.ndarray, hi: np.ndarray, kind: str, parts: int, block_q: int = 128,
                block_x: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """(kept[a], computed[a]) of a ring in the ``kind`` layout: device a's
    queries against every device's keys (a full ring meets them all)."""
    n = len(lo)
    lay = TokenLayout(kind, parts, n)
    pos = [p[p < n] for p in (lay.positions(d).numpy() for d in range(parts))]
    work = np.array([[tile_work(lo, hi, rows, keys, block_q, block_x) for keys in pos] for rows in pos])
    return work[:, :, 0].sum(1), work[:, :, 1].sum(1)


def grid_work(lo: np.ndarray, hi: np.ndarray, r: int, c: int, block_q: int = 128,
              block_x: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """(kept, computed) of each device of ATTENTION2D's R x C grid over cyclic
    parts: device (i, j) holds the queries t with (t mod RC) // C = i and the
    keys t = j modulo C (napkin/documents.py's ShardPairs.grid_pairs)."""
    t = np.arange(len(lo))
    out = [tile_work(lo, hi, t[(t % (r * c)) // c == i], t[t % c == j], block_q, block_x)
           for i in range(r) for j in range(c)]
    return np.array([k for k, _ in out]), np.array([w for _, w in out])


def report(lengths: list[int], parts: int, block_q: int = 128, block_x: int = 64) -> dict:
    lo, hi = causal_documents(lengths)
    out = {}
    runs = {f"ring, {kind}": device_work(lo, hi, kind, parts, block_q, block_x) for kind in LAYOUTS}
    runs.update({f"ATTENTION2D {r}x{parts // r}": grid_work(lo, hi, r, parts // r, block_q, block_x)
                 for r in range(1, parts + 1) if parts % r == 0})
    for name, (kept, computed) in runs.items():
        mean = kept.sum() / parts
        out[name] = {"kept_max_over_mean": kept.max() / mean, "computed_max_over_mean": computed.max() / mean,
                     "computed_over_kept": computed.sum() / kept.sum()}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--docs", required=True, help="document lengths, comma-separated, in token order")
    ap.add_argument("--block-q", type=int, default=128)
    ap.add_argument("--block-x", type=int, default=64)
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.docs.split(",")]
    print(f"{sum(lengths)} tokens, {len(lengths)} documents, {args.devices} devices, tiles of "
          f"{args.block_q} x {args.block_x}")
    print("| scheme | busiest kept / mean | busiest computed / mean kept | all computed / all kept |")
    print("|---|---|---|---|")
    for kind, r in report(lengths, args.devices, args.block_q, args.block_x).items():
        print(f"| {kind} | {r['kept_max_over_mean']:.3f} | {r['computed_max_over_mean']:.3f} | "
              f"{r['computed_over_kept']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
