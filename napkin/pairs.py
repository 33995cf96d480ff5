"""Exact counts of the (query, key) pairs a mask of bounds keeps, in closed form.

A mask that is a conjunction of affine bounds on the key (masks.exact_bounds:
causal, windows, chunks, masks.Bound) keeps for row q the keys [lo(q), hi(q)):
lo the greatest lower bound, hi the least upper bound plus one.  A bound of
step s reads q // s, so it is constant on each run of s rows; on a run of rows
where every bound is affine in q, the count max(0, hi - lo) clipped to a range
of keys is the least of some lines less the greatest of others, clipped at 0:
piecewise linear.  Between two of its breakpoints (where two of the lines
cross) it is affine, so its sum over the integers there is an arithmetic
series: n (first + last) / 2, an integer.  So a rectangle of rows
and keys costs a few dozen array elements whatever its size, and numpy counts
a batch of rectangles at once.

napkin plan counts with it a mask of bounds over 2^28 tokens (``kept``; a pass
over every row took seconds) and every rank's pairs at each step of a ring the
mask cuts short (``ring_steps``; a pass over each counted rank's rows had to
sample the ranks beyond 512).  The tests hold both to a count of every pair.
"""
from __future__ import annotations

import itertools
import math
from typing import Mapping, Sequence

import numpy as np

from .masks import Bound

# rectangles (or runs of rows a bound of step s > 1 cuts them into) counted at once: a
# batch holds a few dozen int64 arrays of this length
BATCH = 1 << 16


def rect_pairs(bounds: Sequence[Bound], sizes: Mapping[str, int], q0, q1, k0, k1) -> np.ndarray:
    """Elementwise over the arrays (or ints): the pairs the bounds keep with
    the query in [q0, q1) and the key in [k0, k1); an empty range counts 0."""
    q0, q1, k0, k1 = (np.atleast_1d(np.asarray(v, dtype=np.int64)) for v in (q0, q1, k0, k1))
    q0, q1, k0, k1 = np.broadcast_arrays(q0, q1, k0, k1)
    q1, k1 = np.maximum(q1, q0), np.maximum(k1, k0)
    # a bound of step s > 1 is constant on each run of s rows, so the rows are cut at the
    # multiples of the steps' gcd (those of every step among them)
    steps = [p.step for b in bounds for p in b.parts if p.step > 1 and p.row_coeff != 0]
    if not steps:
        return _batched(bounds, sizes, q0, q1, k0, k1)
    g = math.gcd(*steps)
    first, stop = q0 // g, -(-q1 // g)
    runs = np.where(q1 > q0, stop - first, 0)
    owner = np.repeat(np.arange(len(q0)), runs)
    # the m-th run of rectangle i: rows [max(q0, (first + m) g), min(q1, (first + m + 1) g))
    m = np.arange(len(owner)) - np.repeat(np.cumsum(runs) - runs, runs)
    at = (first[owner] + m) * g
    counts = _batched(bounds, sizes, np.maximum(q0[owner], at), np.minimum(q1[owner], at + g),
                      k0[owner], k1[owner])
    out = np.zeros(len(q0), dtype=np.int64)
    np.add.at(out, owner, counts)
    return out


def _batched(bounds, sizes, q0, q1, k0, k1) -> np.ndarray:
    return np.concatenate([_affine_runs(bounds, sizes, *(v[i:i + BATCH] for v in (q0, q1, k0, k1)))
                           for i in range(0, len(q0), BATCH)] or [np.zeros(0, dtype=np.int64)])


def _affine_runs(bounds, sizes, q0, q1, k0, k1) -> np.ndarray:
    """rect_pairs where no bound's q // step changes within [q0, q1)."""
    n = len(q0)
    # each line A q + B: A one int for every rectangle, B an array (a stepped bound's value is
    # read at its run's first row); a bound is a group of lines, one a form of it (a union,
    # masks._union, is the greatest of its upper lines or the least of its lower ones)
    uppers = [[(0, k1)]]
    lowers = [[(0, k0)]]
    for b in bounds:
        group = []
        for p in b.parts:
            if p.step > 1 and p.row_coeff != 0:
                a, c = 0, np.broadcast_to(np.asarray(p.value(q0, sizes), dtype=np.int64), (n,))
            else:
                a, c = p.row_coeff, np.full(n, p.value(0, sizes), dtype=np.int64)
            group.append((a, c) if b.kind == "lower" else (a, c + 1))
        (lowers if b.kind == "lower" else uppers).append(group)
    # the count is affine between consecutive crossings of the lines: cut the rows at the row
    # after each crossing t, floor(t) + 1, so that a piece's rows [a, c) lie all at or before t
    # (c - 1 <= t) or all after it, and the count is one affine function on each piece
    cuts = [q0, q1]
    for (a1, c1), (a2, c2) in itertools.combinations([line for g in uppers + lowers for line in g], 2):
        if a1 != a2:
            num, den = (c2 - c1, a1 - a2) if a1 > a2 else (c1 - c2, a2 - a1)
            cuts.append(np.clip(num // den + 1, q0, q1))
    cuts = np.sort(np.stack(cuts, axis=1), axis=1)
    first, stop = cuts[:, :-1], cuts[:, 1:]

    def lines(group, q, pick):
        return pick(np.stack([a * q + c[:, None] for a, c in group]), axis=0)

    def count(q):
        hi = np.min(np.stack([lines(g, q, np.max) for g in uppers]), axis=0)
        lo = np.max(np.stack([lines(g, q, np.min) for g in lowers]), axis=0)
        return np.maximum(hi - lo, 0)

    rows = stop - first
    return (rows * (count(first) + count(np.maximum(stop - 1, first))) // 2).sum(axis=1)


def kept(bounds: Sequence[Bound], sizes: Mapping[str, int], q_len: int, x_len: int) -> int:
    """The pairs of a q_len x x_len score matrix the bounds keep."""
    return int(rect_pairs(bounds, sizes, 0, q_len, 0, x_len)[0])


def layout_runs(kind: str, parts: int, length: int) -> tuple[np.ndarray, np.ndarray]:
    """(first, stop), each parts x runs: the positions each part holds as runs
    [first, stop), in layouts.py's arithmetic (documents._part_runs, every
    part at once): contiguous shards one run a part, zigzag's parts chunks p
    and 2P - 1 - p of 2P; empty runs past the end.  Not cyclic."""
    p = np.arange(parts, dtype=np.int64)
    if kind == "contiguous":
        size = -(-length // parts)
        first = (p * size)[:, None]
    elif kind == "zigzag":
        size = -(-length // (2 * parts))
        first = np.stack([p * size, (2 * parts - 1 - p) * size], axis=1)
    else:
        raise ValueError(f"layout_runs: no runs for a {kind} layout")
    first = np.minimum(first, length)
    return first, np.minimum(first + size, length)


def ring_steps(bounds: Sequence[Bound], sizes: Mapping[str, int], kind: str, parts: int, q_len: int, x_len: int,
               offsets: Sequence[int]) -> tuple[int, ...]:
    """For each offset d, the most pairs any rank keeps at the step of a flat
    ring holding the keys of rank r - d (mod P), in the ``kind`` layout
    (contiguous or zigzag): documents.ShardPairs.ring_steps at those steps,
    every rank counted.  O(offsets x P) rectangles."""
    q_first, q_stop = layout_runs(kind, parts, q_len)
    x_first, x_stop = layout_runs(kind, parts, x_len)
    ranks = np.arange(parts)
    out = []
    for d in offsets:
        src = (ranks - d) % parts
        total = np.zeros(parts, dtype=np.int64)
        for i, j in itertools.product(range(q_first.shape[1]), range(x_first.shape[1])):
            total += rect_pairs(bounds, sizes, q_first[:, i], q_stop[:, i], x_first[src, j], x_stop[src, j])
        out.append(int(total.max()))
    return tuple(out)
