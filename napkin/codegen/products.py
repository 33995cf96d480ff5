"""Constant factors of products folded into one: ``x * c1 / c2`` -> ``x * C``.

The kernels' elementwise expressions are rendered as the diagram writes
them, so a soft-cap's ``sum[d](Q * K) * |d|^-0.5 / 50`` cost two
multiplies per score (Triton hoisted 1/50 as one approximate reciprocal per
kernel, ``div.approx.f32``), and its derivative
``dS * (50 * (c * (1 - t * t)))`` two multiplies too many.  ``fold_factors``
rewrites the IR before the Triton renderer (``exprs.triton``) sees it; the
PyTorch reference is rendered without it, a literal reading of the diagram.

The rules, all of them (anything else is left as written):

* A chain is a tree of ``*`` and ``/`` (either side nested).  Its leaves
  are factors, a divisor's leaves inverted.  A leaf is constant when it reads
  no tensor, wire index, reduction or where (numbers and wire sizes).
* When the chain has two constant leaves or more, or one that divides, they
  become ONE factor C (numerators' product over divisors' product, computed
  in float64 and rounded once by the kernel).  C takes the place of the
  first multiplying constant, the chain's shape otherwise kept (no
  reassociation of the non-constant factors); when every constant divides,
  the chain is multiplied by C on the right, but only when one of them is
  a whole divisor (``x / c``, whose division C replaces): constants found
  only inside divisors' products (``x / (2 * y)``) stay, as taking them out
  would add a multiply of every element.  So a lone ``x / c`` becomes
  ``x * (1/c)``: at most an ulp from ``x / c`` (exact for a power of two),
  and Triton's float32 ``/`` is ``div.full.f32``, itself not correctly
  rounded, so nothing is lost for the division saved on every element.
* Constants that do not fold to a number (a symbolic ``|d|^-0.5``) fold with
  the numbers into one scalar expression (``sym * 0.02``), computed once
  per program rather than per element.
* A C of 0, inf, NaN or subnormal (float32; float16 when the chain
  multiplies a tensor as loaded, which may be 16-bit) is not made: the
  chain stays as written, so a product that was finite, or inf, or NaN,
  stays so (folding otherwise changes rounding only).
* Nothing crosses ``+``, ``-``, a call or a where: their arguments are
  chains of their own.  Conditions (comparisons, and/or/not, a where's
  predicate) are left untouched: masks are matched by structure
  (``lower.decided``).  Nodes ``opaque(n)`` says the kernel holds in a
  variable are leaves and never rewritten (their variable is looked up by
  the node).

With scale.py: the exponent's positive constant is taken out on the IR
first (``factor``: 50 of a soft-cap, into 50 * log2(e)); the tile t left is
then rendered, so the fold works inside t (``tanh(qk * 0.0884 / 50)``) and
never puts c back (the exponent's ``t * C`` is text the emitter writes).

Pure: a new expression, equal to ``e`` when nothing folds.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

from .. import ir

FP32_TINY = 2.0 ** -126  # smallest normal float32
FP32_MAX = 3.4028234663852886e38
FP16_TINY = 2.0 ** -14
FP16_MAX = 65504.0

_CONDITION_OPS = ir.COMPARE_OPS + ir.LOGIC_OPS


def constant(e) -> bool:
    """Whether ``e`` is the same at every element: no tensor, wire index,
    reduction or where (scale.py reads the same predicate)."""
    return all(isinstance(n, (ir.Num, ir.WireSize, ir.Unary, ir.Binary, ir.Call)) and
               not (isinstance(n, ir.Call) and n.fn == "where") for n in ir.walk(e))


def fold_factors(e, value: Callable[[object], Optional[float]],
                 opaque: Callable[[object], bool] = lambda n: False):
    """``e`` with each chain's constant factors folded into one.

    value(n): the number a constant node folds to, or None (a symbolic size:
    exprs.fold with the wires' fixed sizes); opaque(n): a node to keep as it
    is (held in a variable)."""
    return _Folder(value, opaque).expr(e)


class _Folder:
    def __init__(self, value, opaque):
        self.value, self.opaque = value, opaque

    def expr(self, e):
        if self.opaque(e) or constant(e):
            return e
        if isinstance(e, ir.Binary):
            if e.op in _CONDITION_OPS:
                return e
            if e.op in ("*", "/"):
                return self.chain(e)
            return ir.Binary(e.op, self.expr(e.lhs), self.expr(e.rhs), e.loc)
        if isinstance(e, ir.Unary):
            return e if e.op == "not" else ir.Unary(e.op, self.expr(e.operand), e.loc)
        if isinstance(e, ir.Call):
            if e.fn == "where":
                p, a, b = e.args
                return ir.Call("where", (p, self.expr(a), self.expr(b)), e.loc)
            return ir.Call(e.fn, tuple(self.expr(a) for a in e.args), e.loc)
        return e  # leaves, reductions (the kernel holds them) and the lowering's own nodes

    # -- chains ------------------------------------------------------------

    def leaves(self, e, inverted: bool, out: list, whole: bool = False) -> None:
        """The chain's leaves in source order: (node, divides?, a whole
        divisor?: the right side of a ``/`` by itself, not inside a product)."""
        if isinstance(e, ir.Binary) and e.op in ("*", "/") and not self.opaque(e) and not constant(e):
            self.leaves(e.lhs, inverted, out)
            self.leaves(e.rhs, inverted != (e.op == "/"), out, whole=e.op == "/")
        else:
            out.append((e, inverted, whole))

    def chain(self, e):
        leaves: list = []
        self.leaves(e, False, leaves)
        consts = [i for i, (n, _, _) in enumerate(leaves) if constant(n)]
        if len(consts) < 2 and not any(leaves[i][1] for i in consts):
            return self.rebuild(e, iter(range(len(leaves))), set(), None, None)
        # C needs a place that costs nothing new: a multiplying constant, or a
        # whole divisor (x / 2 becomes x * 0.5).  Constants found only inside
        # divisors' products (x / (2 * y)) stay there: taken out, they would
        # become a multiply of every element (x / y * 0.5) where 2 * y may be
        # computed once a row.
        if not any(not leaves[i][1] or leaves[i][2] for i in consts):
            return self.rebuild(e, iter(range(len(leaves))), set(), None, None)
        c = self.constant_factor([leaves[i][:2] for i in consts],
                                 narrow=any(isinstance(n, ir.TensorRef) for n, *_ in leaves))
        if c is None:
            return self.rebuild(e, iter(range(len(leaves))), set(), None, None)
        first = next((i for i in consts if not leaves[i][1]), None)
        out = self.rebuild(e, iter(range(len(leaves))), set(consts), first, c)
        return out if first is not None else ir.Binary("*", out, c, e.loc)

    def rebuild(self, e, position, dropped: set, first, c):
        """The chain with its constant leaves (by position in source order)
        dropped and C in place of the ``first``; its other leaves folded,
        its shape kept.  None when nothing of it is left."""
        if isinstance(e, ir.Binary) and e.op in ("*", "/") and not self.opaque(e) and not constant(e):
            a = self.rebuild(e.lhs, position, dropped, first, c)
            b = self.rebuild(e.rhs, position, dropped, first, c)
            if b is None:
                return a
            if a is None:  # every numerator constant dropped: 1 / b (C sits elsewhere)
                return b if e.op == "*" else ir.Binary("/", ir.Num(1), b, e.loc)
            return ir.Binary(e.op, a, b, e.loc)
        i = next(position)
        if i in dropped:
            return c if i == first else None
        return self.expr(e)

    def constant_factor(self, consts, narrow: bool):
        """C as an expression, or None where folding would make a 0, inf,
        NaN or subnormal constant."""
        num, den, sym_num, sym_den = 1, 1, [], []
        for n, inv in consts:
            v = self.value(n)
            if v is None or isinstance(v, complex):
                (sym_den if inv else sym_num).append(n)
            elif inv:
                den *= v
            else:
                num *= v
        try:
            v = num / den if den != 1 else num
            if isinstance(v, complex) or not _normal(float(v), narrow):
                return None
        except (ZeroDivisionError, OverflowError):
            return None
        return _product(sym_num, sym_den, v)


def _normal(v: float, narrow: bool) -> bool:
    """v is a normal number of the type the product is computed in."""
    if not math.isfinite(v) or v == 0:
        return False
    tiny, huge = (FP16_TINY, FP16_MAX) if narrow else (FP32_TINY, FP32_MAX)
    return tiny <= abs(v) <= huge


def _product(sym_num: list, sym_den: list, v):
    """sym_num[0] * ... / sym_den[0] / ... * v (v where the product starts
    when nothing multiplies; left out when it is 1)."""
    out = None
    for n in sym_num:
        out = n if out is None else ir.Binary("*", out, n)
    if out is None:
        out, v = ir.Num(v), 1
    for n in sym_den:
        out = ir.Binary("/", out, n)
    return out if v == 1 else ir.Binary("*", out, ir.Num(v))
