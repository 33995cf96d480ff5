"""How far round a ring a mask reaches: the steps Ring Attention may stop after.

At step s of a flat ring, rank r holds the keys of rank r - s.  Under a mask
that keeps only keys near their query (a sliding window, causal chunks) and
tokens in the contiguous layout, rank r's queries keep no key of rank r - s
once s passes a few: every pair of those steps is masked, contributes
nothing, and the blocks need not travel that far.  The reach is the
number of steps that can hold a kept pair, 1 + the largest such s over every
rank; the ring runs that many steps and its blocks make one pass fewer
(chunks of 8192 tokens over shards of 8192: one step, nothing moves).  In
the zigzag layout a rank's early chunk needs the ranks just before it and
its late chunk the ranks just after it: such a ring runs a few steps each
way round (``ring_schedule``'s back and ahead).

It is decided the way the kernels decide which tiles to load
(``visits.tile_live``), run of consecutive positions against run (a
contiguous rank's shard, a zigzag rank's two chunks; a cyclic rank's span
from its first position to its last): two runs may hold a kept pair unless
one of the mask's affine bounds is false between their least and greatest
real positions; that never drops a kept pair, and is exact for one bound
(and for the bounds of one difference, a window's).  A bound applies only
where a masked score provably contributes nothing
(``masks.value_when_masked``, the kernels' own test): a softmax's exp(-inf)
= 0, a sigmoid's sigmoid(-inf) = 0; ``S * S`` of a masked score is +inf and
that diagram's ring runs every step.

A mask on data has no bound, but one conjunct of it has a test from the
data: ``doc[b, q] == doc[b, x]`` of packed documents (``same_ids``) keeps
no pair of two ranks whose queries' ids and keys' ids share no value at
any batch index.  The caller (ring.py, which holds the ids whole on every
rank) passes that test as ``meets``, on the same runs: a ring over
contiguous or zigzag shards then reaches as far as a document straddles
them, exactly where each document's tokens are contiguous (otherwise it may
keep a step too many, never one too few).  ``napkin cost`` and ``napkin
plan`` see no data and price such rings at every step, or, given document
lengths (``--docs``), with napkin/documents.py's ``ring_meets`` on them.

Every rank computes the same number from what the handshake has checked they
agree on (diagram, lengths, layout), so all ranks run the same schedule.  No
torch: ``napkin plan`` prices a short ring with the same function (the
layouts' spans are computed here from layouts.py's arithmetic, and the tests
hold them to its positions).
"""
from __future__ import annotations

import bisect
from typing import Callable, Optional

from .. import ir, masks, visits
from ..documents import SameIds, id_conjuncts, layout_chunks
from .reading import Roles, _inline

# meets(u, v): whether unit u's queries and unit v's keys may share an id (same_ids); the units are
# a contiguous or zigzag layout's chunks (documents.layout_chunks), a cyclic layout's ranks
Meets = Callable[[int, int], bool]


def _kept(r: Roles) -> Optional[ir.Expr]:
    """The predicate of the pairs the mask keeps, where a masked pair
    contributes nothing to the output; None where there is no such mask."""
    d = r.diagram
    if r.family == "softmax":
        expr, nothing = r.score, float("-inf")        # exp(score) = 0
    else:
        summed = _inline(d, d.tensor(r.value).expr)
        expr, nothing = summed.body, 0.0              # a zero term of the sum
    node = masks.mask_node(expr)
    if node is None or masks.value_when_masked(expr, node, _fixed(d)) != nothing:
        return None
    return masks.mask_predicate(node)


def _fixed(d: ir.Diagram) -> dict[str, int]:
    return {w.name: w.size for w in d.wires if w.size is not None}


def mask_bounds(r: Roles) -> tuple[masks.Bound, ...]:
    """The mask's bounds on the key wire in terms of the query wire, where
    a masked pair contributes nothing to the output; () where there is no
    such mask."""
    pred = _kept(r)
    return () if pred is None else masks.stream_bounds(pred, r.query, r.key, _fixed(r.diagram))


def same_ids(r: Roles) -> tuple[SameIds, ...]:
    """The kept predicate's conjuncts that compare ids of a side input at
    the query and at the key (documents.id_conjuncts)."""
    return id_conjuncts(r.diagram, _kept(r), r.query, r.key, r.side)


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


def ring_arms(r: Roles, kind: str, parts: int, q_len: int, x_len: int, meets: Optional[Meets] = None
              ) -> tuple[int, int]:
    """(back, ahead): the steps the ring runs (ring_schedule)."""
    return ring_schedule(r, kind, parts, q_len, x_len, meets)[1]


def ring_schedule(r: Roles, kind: str, parts: int, q_len: int, x_len: int, meets: Optional[Meets] = None
                  ) -> tuple[int, tuple[int, int]]:
    """(one way, (back, ahead)): the steps a flat ring of ``parts`` ranks,
    its tokens in the ``kind`` layout, needs running one way (1 + the
    largest s for which some rank's queries may keep a key of rank r - s),
    and the steps it runs: ``back`` the usual way (its own block included)
    and ``ahead`` the other way, 0 where one way is as few steps in all.
    ``meets``: the data's test of a pair of units (same_ids), None where the
    mask reads no ids."""
    sizes = {r.query: q_len, r.key: x_len}
    # a bound on another wire's size (q - x < |w|) is left out: the ring knows only its lengths,
    # and a bound fewer never drops a kept pair
    bounds = tuple(b for b in mask_bounds(r) if b.sizes_read <= set(sizes))
    if parts == 1 or (not bounds and meets is None):
        return parts, (parts, 0)
    if kind == "cyclic":
        # every cyclic rank holds tokens P apart from end to end: its neighbours on both sides
        # hold keys it needs under any mask, so the ring runs one way
        rows = [span(kind, parts, q_len, p) for p in range(parts)]
        cols = [span(kind, parts, x_len, p) for p in range(parts)]
        one = _farthest(bounds, rows, cols, sizes, meets) + 1
        return one, (one, 0)
    live = sorted(_chunk_offsets(bounds, kind, parts, q_len, x_len, sizes, meets))
    one = (live[-1] if live else 0) + 1
    best = (one, 0)
    # back steps b reach offsets 1 .. b - 1 (rank r - d at offset d); the other way, a steps reach
    # offsets P - a .. P - 1: every live offset must be one or the other, so b is one of 1 and
    # (each live offset) + 1, and a is P - (the first live offset b does not reach); of equal
    # totals the first, the fewest back
    for i, b in enumerate([1] + [d + 1 for d in live]):
        a = parts - live[i] if i < len(live) else 0
        if b + a < sum(best):
            best = (b, a)
    return one, best


def _farthest(bounds, rows, cols, sizes, meets: Optional[Meets]) -> int:
    """The largest s for which some rank's queries may keep a key of rank
    r - s, any layout, scanning each rank's steps from the farthest down
    (O(P^2) at worst, but it stops at the first live one and no rank
    looks below what another found)."""
    parts, far = len(rows), 0
    for rank, mine in enumerate(rows):
        if mine is None:
            continue
        for s in range(parts - 1, far, -1):
            src = (rank - s) % parts
            if cols[src] is not None and visits.tile_live(bounds, mine, cols[src], sizes) \
                    and (meets is None or meets(rank, src)):
                far = s
                break
    return far


# --------------------------------------------------------------------------
# Contiguous and zigzag shards, both ways round.  A layout of consecutive
# runs (contiguous: one a rank; zigzag: chunks r and 2P - 1 - r of 2P) is
# tested run against run: a rank's two zigzag chunks need different keys
# (an early chunk the ranks just before it, a late one the ranks just after
# it), which the span of both together cannot tell.  A mask that keeps keys
# on both sides of a query (a window |q - x| < W, documents without
# causality), or a zigzag ring under a mask of nearby keys, needs the few
# ranks just before a rank and the few just after it.  One way round, the
# ones after are reached only the long way: every step.  Sent both ways, K
# and V make ``back`` - 1 passes the usual way (from behind) and ``ahead``
# passes the other way (from ahead): 1 + 2k steps for a window of k shards a
# side, not P.
# --------------------------------------------------------------------------

def _chunk_offsets(bounds, kind: str, parts: int, q_len: int, x_len: int, sizes,
                   meets: Optional[Meets]) -> set[int]:
    """The offsets d in 1 .. P-1 for which some rank's queries may keep a key
    of rank r - d (mod P), contiguous or zigzag shards, in O(P log P) (a scan
    of every pair is O(P^2): 10^9 tile tests for napkin plan at 32,768
    devices).  Each query chunk's live key chunks are an interval
    (_key_interval), held by at most two runs of ranks (_owner_runs), whose
    offsets are marked in a difference array; with ``meets`` each chunk of
    the interval is tested (O(P^2) tests at worst), or, where meets knows the
    chunks each chunk meets as a run (``meets.run``: documents), the two
    runs' overlap is marked."""
    rows, cols = layout_chunks(kind, parts, q_len), layout_chunks(kind, parts, x_len)
    ends = [first for _, first, _ in cols], [stop - 1 for _, _, stop in cols]
    run = getattr(meets, "run", None)
    marks = [0] * (parts + 1)
    found: set[int] = set()
    for m, (rank, first, stop) in enumerate(rows):
        live = _key_interval(bounds, (first, stop - 1), ends, sizes)
        if live is None:
            continue
        j0, j1 = live
        if run is not None:
            met = run(m)
            if met is None or max(j0, met[0]) > min(j1, met[1]):
                continue
            j0, j1 = max(j0, met[0]), min(j1, met[1])
        elif meets is not None:
            found.update(d for d, j in (((rank - cols[j][0]) % parts, j) for j in range(j0, j1 + 1))
                         if d and d not in found and meets(m, j))
            continue
        for k0, k1 in _owner_runs(kind, parts, j0, j1):
            for lo, hi in ((k0, min(k1, rank - 1)), (max(k0, rank + 1), k1)):
                if lo <= hi:        # ranks lo .. hi: offsets (rank - hi) .. (rank - lo), mod P
                    marks[(rank - hi) % parts] += 1
                    marks[(rank - lo) % parts + 1] -= 1
    total = 0
    for d in range(1, parts):
        total += marks[d]
        if total > 0:
            found.add(d)
    return found


def _owner_runs(kind: str, parts: int, j0: int, j1: int) -> list[tuple[int, int]]:
    """The ranks holding chunks j0 .. j1 (layout_chunks), as runs [k0, k1]:
    contiguous chunk j is rank j's; zigzag's first P chunks are ranks 0 ..
    P - 1 in order, its last P ranks P - 1 .. 0."""
    if kind == "contiguous":
        return [(j0, j1)]
    out = [(j0, min(j1, parts - 1))] if j0 < parts else []
    if j1 >= parts:
        out.append((2 * parts - 1 - j1, 2 * parts - 1 - max(j0, parts)))
    return out


def _key_interval(bounds, mine, ends, sizes) -> Optional[tuple[int, int]]:
    """The chunks [j0, j1] whose keys tile_live keeps for queries spanning
    ``mine`` (None: none, or no queries).  The chunks' least and greatest
    keys grow with their index, so those chunks are the ones whose least key
    is at most every upper bound (a prefix) and whose greatest is at least
    every lower bound (a suffix): an interval, found by bisection over the
    chunks' ``ends``."""
    if mine is None:
        return None
    firsts, lasts = ends
    at = {"first": mine[0], "last": mine[1]}
    ups = [b.value(at[b.at_row()], sizes) for b in bounds if b.kind == "upper"]
    lows = [b.value(at[b.at_row()], sizes) for b in bounds if b.kind == "lower"]
    j1 = bisect.bisect_right(firsts, min(ups)) - 1 if ups else len(firsts) - 1
    j0 = bisect.bisect_left(lasts, max(lows)) if lows else 0
    return (j0, j1) if j0 <= j1 else None
