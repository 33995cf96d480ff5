"""The weight tiles a kernel multiplies with V: their range, and the lines
that round them to V's dtype for the product.

The forward multiplies each streamed weight tile with V in V's dtype
(``tl.dot(w.to(V.dtype), V)``).  A softmax's weights are at most 1 (the
running max is taken out first), and so are a sigmoid's; a ReLU²'s, a raw
score's or a polynomial's are not, and float16 holds no more than 65504: a
score of 300 under ReLU² is a weight of 90,000, inf once rounded, and the
row's output NaN where the float32 reference is finite.  ``fits`` says which
tiles can be rounded as they are; for the others, when V is float16 (the
launch's ``_FIT_WEIGHTS``), each row of the tile is scaled by a power of two
that takes it under FP16_SAFE and the product is scaled back: a row max and
a multiply per element more.  bfloat16 has float32's range: nothing to fit.

The range is an interval (lo, hi) per node, widened to (-inf, inf) wherever
a rule does not know better: numbers, fixed sizes, where, relu, abs, max,
min, sigmoid, tanh, exp, sqrt, +, -, *, a division by a constant and whole
powers.  Anything else (a tensor, a score product, an index, a symbolic
size) is unbounded.
"""
from __future__ import annotations

import math
from typing import Mapping

from .. import ir
from .exprs import fold, integer_exponent

FP16_SAFE = 16384.0   # a quarter of float16's largest: a sum of two rounded parts still fits
_ANY = (-math.inf, math.inf)


def fits(e, fixed: Mapping[str, int], limit: float = FP16_SAFE) -> bool:
    """Whether |e| <= limit at every element, whatever the inputs."""
    lo, hi = interval(e, fixed)
    return -limit <= lo and hi <= limit


def interval(e, fixed: Mapping[str, int]) -> tuple[float, float]:
    v = fold(e, fixed)
    if v is not None:
        return (float(v), float(v)) if isinstance(v, (int, float)) and not math.isnan(v) else _ANY
    if isinstance(e, ir.Unary) and e.op == "-":
        lo, hi = interval(e.operand, fixed)
        return -hi, -lo
    if isinstance(e, ir.Binary):
        return _binary(e, fixed)
    if isinstance(e, ir.Call):
        return _call(e, fixed)
    return _ANY


def _binary(e: ir.Binary, fixed) -> tuple[float, float]:
    a = interval(e.lhs, fixed)
    if e.op == "^":
        n = integer_exponent(e.rhs, fixed)
        if n is None or n < 0:
            return _ANY
        lo, hi = a
        if n % 2 == 1:
            return _safe(_power(lo, n), _power(hi, n))
        top = _power(max(abs(lo), abs(hi)), n)
        return (0.0 if lo <= 0 <= hi else _power(min(abs(lo), abs(hi)), n)), top
    b = interval(e.rhs, fixed)
    if e.op == "+":
        return _safe(a[0] + b[0], a[1] + b[1])
    if e.op == "-":
        return _safe(a[0] - b[1], a[1] - b[0])
    if e.op == "*":
        return _product(a, b)
    if e.op == "/" and b[0] == b[1] and b[0] != 0 and math.isfinite(b[0]):
        return _product(a, (1 / b[0], 1 / b[0]))
    return _ANY


def _call(e: ir.Call, fixed) -> tuple[float, float]:
    if e.fn in ("sigmoid", "tanh"):
        return (0.0, 1.0) if e.fn == "sigmoid" else (-1.0, 1.0)
    args = [interval(a, fixed) for a in e.args]
    if e.fn == "where":
        (_, a, b) = args
        return min(a[0], b[0]), max(a[1], b[1])
    if e.fn in ("max", "min"):
        (a, b) = args
        pick = max if e.fn == "max" else min
        return pick(a[0], b[0]), pick(a[1], b[1])
    (lo, hi) = args[0]
    if e.fn == "relu":
        return max(lo, 0.0), max(hi, 0.0)
    if e.fn == "abs":
        return (0.0 if lo <= 0 <= hi else min(abs(lo), abs(hi))), max(abs(lo), abs(hi))
    if e.fn in ("exp", "exp2"):
        base = math.e if e.fn == "exp" else 2.0
        return _safe(_power(base, lo), _power(base, hi))
    if e.fn == "sqrt" and lo >= 0:
        return math.sqrt(lo), math.sqrt(hi)
    return _ANY


def _product(a, b) -> tuple[float, float]:
    corners = [x * y for x in a for y in b]
    if any(math.isnan(c) for c in corners):   # 0 * inf: nothing known
        return _ANY
    return min(corners), max(corners)


def _power(x: float, n: float) -> float:
    """x ** n, and past float's range inf of x's sign for an odd n (a whole
    power), else inf (exp's base ** x too)."""
    try:
        return x ** n
    except OverflowError:
        return math.copysign(math.inf, x) if n % 2 else math.inf


def _safe(lo: float, hi: float) -> tuple[float, float]:
    return _ANY if math.isnan(lo) or math.isnan(hi) else (lo, hi)


def dot_lines(acc: str, before: str, w: str, v: str, j: int, precision: str, bounded: bool) -> list[str]:
    """``acc = before + w @ v`` with the weights ``w`` rounded to v's dtype,
    and under ``_SPLIT_WEIGHTS`` (a float32 output of 16-bit inputs) what the
    rounding lost added by a second product.  Unless ``bounded``, under
    ``_FIT_WEIGHTS`` a power of two per row takes |w| under FP16_SAFE first
    (exactly: the scale is a power of two, up to 2^126) and the products are
    scaled back; a row whose weights fit keeps a scale of 1."""
    def product(x: str) -> str:
        return f'tl.dot({x}, {v}, input_precision="{precision}")'

    def rounded(x: str, k: str) -> list[str]:
        scaled = "" if not k else f" * {k}"
        return [f"_w{j} = ({x}).to({v}.dtype)",
                f"{acc} = {before} + {product(f'_w{j}')}{scaled}",
                "if _SPLIT_WEIGHTS:  # weights rounded to V's 16-bit dtype: add back what rounding lost",
                f"    {acc} += {product(f'({x} - _w{j}.to(tl.float32)).to({v}.dtype)')}{scaled}"]

    if bounded:
        return rounded(w, "")
    fitted = [f"_e{j} = tl.max(tl.abs({w}), 1)[:, None] * {1 / FP16_SAFE!r}  # each row's largest |weight| over 2^14",
              f"_e{j} = tl.minimum(tl.ceil(tl.log2(tl.maximum(_e{j}, 1.0))), 126.0)  # 0 where they fit",
              f"_k{j} = tl.exp2(_e{j})",
              *rounded(f"{w} * tl.exp2(-_e{j})", f"_k{j}")]
    return (["if _FIT_WEIGHTS:  # float16 V, weights of no known bound: a power of two per row fits them"]
            + ["    " + line for line in fitted] + ["else:"] + ["    " + line for line in rounded(w, "")])
