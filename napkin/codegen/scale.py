"""A softmax exponent as (positive constant) x (tile): the scale the
kernels fold into log2(e), so each score costs one FMA and one exp2.

The kernels keep the softmax state in log2 units: the exponent E enters as
E * log2(e).  When E = c * t with c a constant provably > 0 (``|d|^-0.5``,
``50`` in a soft-cap's ``50 * tanh(...)``), the tile stays in t's units and
the two constants fold into one, C = c * log2(e):

    m_new = max(m, rowmax(t) * C)        exp2(t * C - m_use)

which ptxas contracts into one FFMA per element (the forward's), where
E * log2(e) - m took a multiply by c, a multiply by log2(e) and a
subtract.  Only c > 0: then rounding t * C is monotone in t (the row max
is the same), c * -inf is -inf (a masked score stays masked), and
+inf / NaN scores stay +inf / NaN.

``factor`` takes c out of products, quotients by a constant and
``where(p, ., -inf)`` fills (the mask), looking through the named tiles it
is allowed to open (a box such as S, when nothing else reads it).  The
backward takes the same c out of an accumulated gradient tile, whose
masked fill is 0 (``fills``): dK += (c dS) Q becomes dK = c (sum of dS Q),
one multiply a program instead of one a score (backward.grad_scales; float16
operands keep the per-score multiply: the unscaled tile could overflow them).  Anything
else (a sum, as ALiBi's score; a factor of unknown sign, a tensor) stays
in t: c is then 1 and only log2(e) is folded.
"""
from __future__ import annotations

import math
from typing import Callable

from .. import ir
from .exprs import fold
from .lower import children, nodes
from .products import constant  # the same at every element: numbers and wire sizes only

LOG2E = math.log2(math.e)


def positive(e, fixed) -> bool:
    """Whether the constant ``e`` is provably > 0 (and finite when it folds):
    a positive number, a wire size, a power of a positive base, a product or
    quotient of positives."""
    if not constant(e):
        return False
    v = fold(e, fixed)
    if v is not None:
        return not isinstance(v, complex) and math.isfinite(v) and v > 0
    if isinstance(e, ir.WireSize):
        return True
    if isinstance(e, ir.Binary) and e.op == "^":
        return positive(e.lhs, fixed)
    if isinstance(e, ir.Binary) and e.op in ("*", "/"):
        return positive(e.lhs, fixed) and positive(e.rhs, fixed)
    return False


NEG_INF = (float("-inf"),)


def _is_fill(e, fixed, fills) -> bool:
    """Whether e is a constant among ``fills``: values c * v leaves alone."""
    return constant(e) and fold(e, fixed) in fills


def _times(a, b):
    """a * b of optional factors (None is 1)."""
    return b if a is None else a if b is None else ir.Binary("*", a, b)


def factor(e, fixed, opaque: Callable[[object], bool] = lambda n: False, fills=NEG_INF):
    """(c, t) with e = c * t, c a positive constant expression or None (1), t
    an expression (e itself when nothing comes out).  ``opaque(n)``: a node
    the kernel holds in a variable that must be read as it is (a load, a
    product, a named tile that stays); other nodes are looked into.
    ``fills``: the where-fills c passes through (-inf for a score; a
    gradient's 0 where its mask is false)."""
    c, t = _factor(e, fixed, opaque, fills)
    if c is None or t is None:  # nothing out, or e is all constant: leave it
        return None, e
    return c, t


def _factor(e, fixed, opaque, fills):
    if opaque(e):
        return None, e
    if positive(e, fixed):
        return e, None
    if isinstance(e, ir.Binary) and e.op == "*":
        c1, t1 = _factor(e.lhs, fixed, opaque, fills)
        c2, t2 = _factor(e.rhs, fixed, opaque, fills)
        if c1 is None and c2 is None:
            return None, e
        return _times(c1, c2), _times(t1, t2)
    if isinstance(e, ir.Binary) and e.op == "/" and positive(e.rhs, fixed):
        c, t = _factor(e.lhs, fixed, opaque, fills)
        return ir.Binary("/", c if c is not None else ir.Num(1), e.rhs), t
    if isinstance(e, ir.Call) and e.fn == "where":
        p, a, b = e.args
        for keep, fill, kept_first in ((a, b, True), (b, a, False)):
            if _is_fill(fill, fixed, fills):
                c, t = _factor(keep, fixed, opaque, fills)
                if c is None or t is None:
                    return None, e
                return c, ir.Call("where", (p, t, fill) if kept_first else (p, fill, t), e.loc)
    return None, e


def log2_scale(c, fixed):
    """C = c * log2(e): a float when c folds, else the expression."""
    if c is None:
        return LOG2E
    v = fold(c, fixed)
    return v * LOG2E if v is not None else ir.Binary("*", c, ir.Num(LOG2E))


def opened(e, t, tiles) -> list:
    """The named tiles (expressions) ``factor`` looked into: those among
    ``tiles`` that occur in ``e`` but no longer in ``t``."""
    inside_t = set(nodes(t))
    seen = set(nodes(e))
    return [x for x in tiles if x in seen and x not in inside_t]


def plan_exponents(exponents, tiles, readers, fixed, held: Callable[[object], bool]):
    """Factor each exponent, opening a named tile only where nothing else
    reads it (else it would be computed twice, scaled and unscaled).

    exponents: each group's E; tiles: the named tiles' expressions, in
    order (each may read earlier ones); readers: the other expressions the
    step renders with every named tile (accumulator tiles); ``held(n)``: n
    is a load or a product (never opened).  Returns ([(c, t)] per exponent,
    the opened tiles: nothing reads them any more, so their lines go)."""
    allowed = set(tiles)
    while True:
        shut = set(tiles) - allowed
        out = [factor(e, fixed, lambda n: held(n) or n in shut) for e in exponents]
        opens = {x for e, (c, t) in zip(exponents, out) for x in opened(e, t, tiles)}
        # what is still rendered: the exponents' t, the readers, every tile kept
        roots = [t for _, t in out] + list(readers) + [_Inner(x) for x in tiles if x not in opens]
        clash = opens & _needed(roots, set(tiles))
        if not clash:
            return out, [x for x in tiles if x in opens]
        allowed -= clash


class _Inner:
    """A tile's own expression, read past its root (which names the tile)."""

    def __init__(self, e):
        self.e = e


def _needed(roots, tiles: set) -> set:
    """The named tiles the roots read, directly or through tiles they read."""
    need: set = set()
    todo = list(roots)
    while todo:
        for n in _reads(todo.pop(), tiles):
            if n not in need:
                need.add(n)
                todo.append(_Inner(n))
    return need


def _reads(e, tiles: set) -> list:
    """The named tiles an expression reads (not descending into them)."""
    if isinstance(e, _Inner):
        return [n for c in children(e.e) for n in _reads(c, tiles)]
    if e in tiles:
        return [e]
    return [n for c in children(e) for n in _reads(c, tiles)]
