"""How far round a ring a mask reaches: the steps Ring Attention may stop after.

At step s of a flat ring, rank r holds the keys of rank r - s.  Under a mask
that keeps only keys near their query (a sliding window, causal chunks) and
tokens in the contiguous layout, rank r's queries keep no key of rank r - s
once s passes a few: every pair of those steps is masked, contributes
nothing, and the blocks need not travel that far.  ``ring_reach`` is the
number of steps that can hold a kept pair, 1 + the largest such s over every
rank; the ring runs that many steps and its blocks make one pass fewer
(chunks of 8192 tokens over shards of 8192: one step, nothing moves).

It is decided the way the kernels decide which tiles to load
(``masks.tile_live``): a pair of ranks may hold a kept pair unless one of the
mask's affine bounds is false between the least and greatest real positions
of the two; that never drops a kept pair, and for the contiguous layout it
is exact for one bound.  A bound applies only where a masked score provably
contributes nothing (``masks.value_when_masked``, the kernels' own test): a
softmax's exp(-inf) = 0, a sigmoid's sigmoid(-inf) = 0; ``S * S`` of a
masked score is +inf and that diagram's ring runs every step.  Masks on data
(a document's ids) have no bound, so those rings run every step too.

Every rank computes the same number from what the handshake has checked they
agree on (diagram, lengths, layout), so all ranks run the same schedule.  No
torch: ``napkin plan`` prices a short ring with the same function (the
layouts' spans are computed here from layouts.py's arithmetic, and the tests
hold them to its positions).
"""
from __future__ import annotations

import bisect
from typing import Optional

from .. import masks
from .reading import Roles, _inline


def mask_bounds(r: Roles) -> tuple[masks.Bound, ...]:
    """The mask's bounds on the key wire in terms of the query wire, where
    a masked pair contributes nothing to the output; () where there is no
    such mask."""
    d = r.diagram
    fixed = {w.name: w.size for w in d.wires if w.size is not None}
    if r.family == "softmax":
        expr, nothing = r.score, float("-inf")        # exp(score) = 0
    else:
        summed = _inline(d, d.tensor(r.value).expr)
        expr, nothing = summed.body, 0.0              # a zero term of the sum
    node = masks.mask_node(expr)
    if node is None or masks.value_when_masked(expr, node, fixed) != nothing:
        return ()
    return masks.stream_bounds(masks.mask_predicate(node), r.query, r.key, fixed)


def span(kind: str, parts: int, length: int, part: int) -> Optional[tuple[int, int]]:
    """The least and greatest real (not padding) position part ``part`` holds
    in a layout (layouts.TokenLayout's kind, parts, length), or None."""
    if kind == "contiguous":
        rows = -(-length // parts)
        first, last = part * rows, min((part + 1) * rows, length) - 1
    elif kind == "cyclic":
        first, last = part, part + (length - 1 - part) // parts * parts
    else:                               # zigzag: chunks part and 2P-1-part of 2P
        c = -(-length // (2 * parts))
        first = part * c
        second = (2 * parts - 1 - part) * c
        last = min(second + c, length) - 1 if second < length else min(first + c, length) - 1
    return (first, last) if first < length else None


def ring_reach(r: Roles, kind: str, parts: int, q_len: int, x_len: int) -> int:
    """The steps a flat ring of ``parts`` ranks needs, its tokens in the
    ``kind`` layout: 1 + the largest s for which some rank's queries may
    keep a key of rank r - s."""
    sizes = {r.query: q_len, r.key: x_len}
    # a bound on another wire's size (q - x < |w|) is left out: the ring knows only its lengths,
    # and a bound fewer never drops a kept pair
    bounds = tuple(b for b in mask_bounds(r) if b.sizes_read <= set(sizes)) if parts > 1 else ()
    if not bounds:
        return parts
    rows = [span(kind, parts, q_len, p) for p in range(parts)]
    cols = [span(kind, parts, x_len, p) for p in range(parts)]
    if kind == "contiguous":
        return _contiguous_reach(bounds, rows, cols, sizes)
    far = 0
    for rank, mine in enumerate(rows):
        if mine is None:
            continue
        for s in range(parts - 1, far, -1):
            keys = cols[(rank - s) % parts]
            if keys is not None and masks.tile_live(bounds, mine, keys, sizes):
                far = s
                break
    return far + 1


def _contiguous_reach(bounds, rows, cols, sizes) -> int:
    """ring_reach for contiguous shards in O(P log P) (the scan above is
    O(P^2) where few steps are live: 10^9 tile tests for napkin plan at
    32,768 devices).  The shards' least and greatest keys grow with the
    rank, so the ranks tile_live keeps for one rank's queries are those
    whose least key is at most every upper bound (a prefix) and whose
    greatest is at least every lower bound (a suffix): an interval [j0, j1],
    found by bisection.  The farthest step back is then the first of them
    after the rank itself (reached the long way round) or else j0."""
    parts = len(rows)
    real = [c for c in cols if c is not None]          # parts 0 .. k-1 hold keys
    firsts, lasts = [c[0] for c in real], [c[1] for c in real]
    far = 0
    for rank, mine in enumerate(rows):
        if mine is None:
            continue
        at = {"first": mine[0], "last": mine[1]}
        ups = [b.value(at[b.at_row()], sizes) for b in bounds if b.kind == "upper"]
        lows = [b.value(at[b.at_row()], sizes) for b in bounds if b.kind == "lower"]
        j1 = bisect.bisect_right(firsts, min(ups)) - 1 if ups else len(real) - 1
        j0 = bisect.bisect_left(lasts, max(lows)) if lows else 0
        if j0 > j1:
            continue
        far = max(far, rank + parts - max(j0, rank + 1) if j1 > rank else rank - j0)
    return far + 1
