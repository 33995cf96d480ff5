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
agree on (diagram, lengths, layout), so all ranks run the same schedule.
"""
from __future__ import annotations

from typing import Optional

from .. import masks
from .layouts import TokenLayout
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


def _span(layout: TokenLayout, part: int) -> Optional[tuple[int, int]]:
    """The least and greatest real (not padding) position of a part, or None."""
    pos = layout.positions(part)
    pos = pos[pos < layout.length]
    return None if pos.numel() == 0 else (int(pos.min()), int(pos.max()))


def ring_reach(r: Roles, ql: TokenLayout, xl: TokenLayout) -> int:
    """The steps a flat ring of ``ql.parts`` ranks needs: 1 + the largest s
    for which some rank's queries may keep a key of rank r - s."""
    parts = ql.parts
    bounds = mask_bounds(r) if parts > 1 else ()
    if not bounds:
        return parts
    sizes = {r.query: ql.length, r.key: xl.length}
    rows = [_span(ql, p) for p in range(parts)]
    cols = [_span(xl, p) for p in range(parts)]
    far = 0
    for rank, span in enumerate(rows):
        if span is None:
            continue
        for s in range(parts - 1, far, -1):
            keys = cols[(rank - s) % parts]
            if keys is not None and masks.tile_live(bounds, span, keys, sizes):
                far = s
                break
    return far + 1
