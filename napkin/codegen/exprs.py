"""Expressions -> source text: Triton (kernels) and torch (the reference).

Pure functions over IR expressions (plus the lowering's own leaves, Var and
SafeDiv).  A ``Ctx`` says what the leaves become in the generated code:

* ``index[w]``: the index along wire w, e.g. ``_offs_q[:, None]`` (rows of a
  tile), ``_offs_x[None, :]`` (columns) or ``_i_b`` (a batch program id);
* ``size[w]``: the size of a symbolic wire (``_size_x``); fixed sizes fold;
* ``subst``: nodes the kernel already holds in a variable (a loaded tile, a
  tl.dot result, a box computed earlier in the step, an accumulator).

Constants fold at compile time (``|d|^-0.5`` with d = 64 is ``0.125``).
In the kernels (``triton``) a product's constant factors also fold into one
(products.py: ``x * c1 / c2`` is ``x * C``); the reference keeps them apart.
Every function is written with what both Triton 3.6 and 3.9 provide: tanh
and sigmoid go through exp (helpers ``_tanh`` / ``_sigmoid`` in the module),
relu is a where, max/min propagate NaN like torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Optional

from .. import ir
from .lower import LogSumExp, SafeDiv, Var, decided
from .products import fold_factors

# Python operator precedence (higher binds tighter), for minimal parentheses.
_PREC = {"|": 1, "&": 2, "cmp": 0, "+": 4, "-": 4, "*": 5, "/": 5, "//": 5, "%": 5, "neg": 6, "**": 7, "atom": 9}
_COMPARE = {"<": "<", "<=": "<=", ">": ">", ">=": ">=", "==": "==", "!=": "!="}


@dataclass(frozen=True)
class Ctx:
    index: Mapping[str, str]
    size: Mapping[str, str]
    fixed: Mapping[str, int]
    subst: Mapping[object, str] = field(default_factory=dict)
    kinds: Mapping[str, str] = field(default_factory=dict)  # input name -> "float"/"int"/"bool"
    # conditions known to hold on the whole tile (a full block's mask): a
    # where() on one renders its kept branch alone, so no mask is evaluated
    known: frozenset = frozenset()


# --------------------------------------------------------------------------
# Constant folding.
# --------------------------------------------------------------------------

_MATH = {
    "exp": math.exp, "exp2": lambda v: 2.0 ** v, "log": math.log, "log2": math.log2,
    "sqrt": math.sqrt, "rsqrt": lambda v: 1.0 / math.sqrt(v), "abs": abs,
    "tanh": math.tanh, "sigmoid": lambda v: 1.0 / (1.0 + math.exp(-v)), "relu": lambda v: max(v, 0),
    "max": max, "min": min,
}


def fold(e, fixed: Mapping[str, int]):
    """The value of a constant subexpression (numbers and fixed sizes), else None."""
    return ir.fold_constant(e, fixed, _MATH)


def number(v) -> str:
    """A Python literal for a folded constant (deterministic: repr)."""
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int) and -2 ** 63 <= v < 2 ** 63:
        return str(v)
    v = float(v) if isinstance(v, int) else v   # no kernel integer holds it (Triton refuses the literal)
    if math.isinf(v):
        return 'float("inf")' if v > 0 else 'float("-inf")'
    if math.isnan(v):
        return 'float("nan")'
    if v == int(v) and abs(v) < 1e15:
        return f"{int(v)}.0"
    return repr(float(v))


def whole_number(v) -> Optional[float]:
    """A folded constant that is a finite whole real number, as a float; else None."""
    if v is None or isinstance(v, complex) or not math.isfinite(v) or not float(v).is_integer():
        return None
    return float(v)


def integer_exponent(e, fixed) -> Optional[int]:
    v = whole_number(fold(e, fixed))
    return int(v) if v is not None and abs(v) <= 8 else None


# --------------------------------------------------------------------------
# Shared walker: renders with a table of function spellings.
# --------------------------------------------------------------------------

class _Render:
    """Returns (code, precedence, kind); kind is "int", "float" or "bool"."""

    FUN: dict = {}
    AND, OR, NOT = "&", "|", "~"

    def __init__(self, ctx: Ctx):
        self.ctx = ctx

    def __call__(self, e) -> str:
        return self.r(e)[0]

    def literal(self, v) -> str:
        return number(v)

    def wrap(self, part, prec: int) -> str:
        code, p, _ = part
        return code if p > prec else f"({code})"

    def r(self, e):
        ctx = self.ctx
        if e in ctx.subst:
            return ctx.subst[e], _PREC["atom"], self.kind_of(e)
        v = fold(e, ctx.fixed)
        if v is not None:
            code = self.literal(v)
            prec = _PREC["atom"] if not code.startswith("-") else _PREC["neg"]
            return code, prec, "int" if isinstance(v, int) else "float"
        if isinstance(e, Var):
            return e.name, _PREC["atom"], "float"
        if isinstance(e, ir.WireIndex):
            return ctx.index[e.wire], _PREC["atom"], "int"
        if isinstance(e, ir.WireSize):
            return ctx.size[e.wire], _PREC["atom"], "int"
        if isinstance(e, ir.TensorRef):
            raise KeyError(f"no variable for tensor {e.name}")  # lowering maps every read
        if isinstance(e, ir.Unary):
            x = self.r(e.operand)
            if e.op == "-":
                return f"-{self.wrap(x, _PREC['neg'] - 1)}", _PREC["neg"], x[2]
            return self.negate(x), _PREC["neg"], "bool"
        if isinstance(e, SafeDiv):
            return self.safe_div(self.r(e.lhs), self.r(e.rhs)), _PREC["atom"], "float"
        if isinstance(e, LogSumExp):
            return f"_logsumexp({e.m}, {e.l})", _PREC["atom"], "float"
        if isinstance(e, ir.Binary):
            return self.binary(e)
        if isinstance(e, ir.Call):
            return self.call(e)
        raise TypeError(f"cannot render {type(e).__name__}")

    def kind_of(self, e) -> str:
        if isinstance(e, ir.TensorRef):
            return self.ctx.kinds.get(e.name, "float")
        if isinstance(e, (ir.WireIndex, ir.WireSize)):
            return "int"
        if isinstance(e, ir.Binary) and e.op in ir.COMPARE_OPS + ir.LOGIC_OPS:
            return "bool"
        return "float"

    def binary(self, e: ir.Binary):
        op = e.op
        if op == "^":
            return self.power(e)
        if op in ("//", "%"):
            e = integral(e)
        a, b = self.r(e.lhs), self.r(e.rhs)
        if op in ir.COMPARE_OPS:
            return f"{self.wrap(a, _PREC['+'] - 1)} {op} {self.wrap(b, _PREC['+'] - 1)}", _PREC["cmp"], "bool"
        if op in ir.LOGIC_OPS:
            return self.logic(e, a, b)
        p = _PREC[op]
        kind = "float" if "float" in (a[2], b[2]) or op == "/" else "int"
        if op == "/" and a[2] != "float" and b[2] != "float":
            a = (self.to_float(a), _PREC["atom"], "float")
        if kind == "int" and (op == "*" or self.big_constant(e)):
            a, b = self.widened(a, b)
        if op == "//":
            return self.floor_div(e, a, b)
        if op == "%":
            return self.remainder(e, a, b)
        return f"{self.wrap(a, p - 1)} {op} {self.wrap(b, p)}", p, kind

    def floor_div(self, e: ir.Binary, a, b):
        """a // b of whole numbers by a positive divisor (check_floor_division):
        floor division, as Python and torch take it."""
        return f"{self.wrap(a, _PREC['//'] - 1)} // {self.wrap(b, _PREC['//'])}", _PREC["//"], "int"

    def remainder(self, e: ir.Binary, a, b):
        """a % b of whole numbers by a positive divisor: in [0, b), as Python
        and torch take it."""
        return f"{self.wrap(a, _PREC['%'] - 1)} % {self.wrap(b, _PREC['%'])}", _PREC["%"], "int"

    def logic(self, e: ir.Binary, a, b):
        sym = self.AND if e.op == "and" else self.OR
        p = _PREC["&" if e.op == "and" else "|"]
        return f"{self.wrap(a, p - 1)} {sym} {self.wrap(b, p)}", p, "bool"

    def big_constant(self, e: ir.Binary) -> bool:
        """Whether an integer sum holds a constant of 2^24 or more: an index
        plus it can pass int32 (q + 2147483646, q + 1500000000 + 1500000000
        wrapped in the kernels), so the sum is taken in int64 as a product is."""
        for n in ir.walk(e):
            v = fold(n, self.ctx.fixed) if isinstance(n, ir.Num) else None
            if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 2 ** 24:
                return True
        return False

    def widened(self, a, b):
        """The operands of an integer product, one of them made wide enough
        for it (the kernels' indices and sizes are int32: (x - q) ^ 2 passes
        2^31 at a distance of 46341, |x| * |x| at 46341 keys)."""
        return a, b

    def power(self, e: ir.Binary):
        n = integer_exponent(e.rhs, self.ctx.fixed)
        base = self.r(e.lhs)
        if n is None and base[2] == "float":   # exp2 and log2 of it below
            wide = self.wide(e.lhs, base[0])
            base = base if wide == base[0] else (wide, _PREC["atom"], "float")
        if n is not None:
            if n == 0:
                return "1.0", _PREC["atom"], "float"
            factors = [base] * abs(n)
            if base[2] == "int" and len(factors) > 1:
                factors[0], factors[1] = self.widened(base, base)
            term = " * ".join(self.wrap(f, _PREC["*"]) for f in factors)
            if n > 0:
                return term, _PREC["*"], base[2]
            return f"1.0 / ({term})", _PREC["*"], "float"
        folded = fold(e.rhs, self.ctx.fixed)
        v = whole_number(folded)
        if v is not None:   # (only the kernels' renderer comes here: the reference's has its own power)
            return self.whole_power(base, v), _PREC["atom"], "float"
        if folded is None:  # an index or a size known at run time: whole or not, odd or even, per element
            return self.varying_power(base, self.r(e.rhs)), _PREC["atom"], "float"
        return self.general_power(base, self.r(e.rhs)), _PREC["atom"], "float"

    def call(self, e: ir.Call):
        if e.fn == "where" and self.ctx.known:
            holds = decided(e.args[0], self.ctx.known)
            if holds is not None:  # (a branch lacking a wire of the tile: emit._full broadcasts it)
                return self.r(e.args[1] if holds else e.args[2])
        args = [self.r(a) for a in e.args]
        if e.fn == "where":
            c, a, b = args
            kind = "bool" if a[2] == b[2] == "bool" else "float" if "float" in (a[2], b[2]) else "int"
            return self.where(c[0], a[0], b[0]), _PREC["atom"], kind
        if e.fn in ("max", "min"):
            a, b = args
            kind = "float" if "float" in (a[2], b[2]) else "int"
            return self.FUN[e.fn].format(a[0], b[0]), _PREC["atom"], kind
        (a,) = args
        arg = a[0] if a[2] == "float" or e.fn in ("abs", "relu") else self.to_float(a)
        if e.fn not in ("abs", "relu"):
            arg = self.wide(e.args[0], arg)
        kind = a[2] if e.fn in ("abs", "relu") else "float"
        return self.FUN[e.fn].format(arg), _PREC["atom"], kind

    def wide(self, e, code: str) -> str:
        """The argument of an exp, log, sqrt, ... as the renderer takes it (the kernels'
        widens a 16-bit input's value)."""
        return code


class TritonRender(_Render):
    FUN = {
        "exp": "tl.exp({})", "exp2": "tl.exp2({})", "log": "tl.log({})", "log2": "tl.log2({})",
        "sqrt": "tl.sqrt({})", "rsqrt": "tl.rsqrt({})", "abs": "tl.abs({})",
        "tanh": "_tanh({})", "sigmoid": "_sigmoid({})", "relu": "_relu({})",
        "max": "tl.maximum({}, {}, propagate_nan=tl.PropagateNan.ALL)",
        "min": "tl.minimum({}, {}, propagate_nan=tl.PropagateNan.ALL)",
    }

    def negate(self, x) -> str:
        return f"~{self.wrap(x, _PREC['neg'])}"

    def to_float(self, x) -> str:
        return f"{self.wrap(x, _PREC['*'])} * 1.0"  # works on tensors and scalars alike

    def literal(self, v) -> str:
        """An integer past int32 as an int64 scalar: Triton gives a bare
        literal the type of the tensor it meets, and refused 4294967296
        beside an int32 index ("out of range for type int32")."""
        code = number(v)
        if isinstance(v, int) and not isinstance(v, bool) and not -2 ** 31 <= v < 2 ** 31 and code == str(v):
            return f"tl.full([], {code}, tl.int64)"
        return code

    def widened(self, a, b):
        """int64 for the product, as the reference's (torch's indices are
        int64): the left operand cast, or the right where the left is a
        literal (a literal that fits int32 is int32 to Triton).  tl.cast, not
        .to: it takes a kernel's scalar argument and a loop variable alike."""
        if _literal(a[0]) and not _literal(b[0]):
            return a, (f"tl.cast({b[0]}, tl.int64)", _PREC["atom"], "int")
        return (f"tl.cast({a[0]}, tl.int64)", _PREC["atom"], "int"), b

    def where(self, c, a, b) -> str:
        return f"tl.where({c}, {a}, {b})"

    def floor_div(self, e: ir.Binary, a, b):
        """Triton's // truncates towards zero (compiled; the interpreter's
        numpy floors): a numerator that can be negative (q - x) is divided
        as a non-negative one, so both round down alike."""
        plain = super().floor_div(e, a, b)
        if non_negative(e.lhs, self.ctx.fixed):
            return plain
        n = self.wrap(a, _PREC["+"])
        v = fold(e.rhs, self.ctx.fixed)
        less = number(int(v) - 1) if v is not None else f"{self.wrap(b, _PREC['+'])} - 1"
        return f"tl.where({n} >= 0, {plain[0]}, -(({less} - {n}) // {self.wrap(b, _PREC['//'])}))", \
            _PREC["atom"], "int"

    def remainder(self, e: ir.Binary, a, b):
        """a - b * (a // b) where the numerator can be negative: Triton's %
        takes the dividend's sign (compiled), Python's the divisor's."""
        plain = super().remainder(e, a, b)
        if non_negative(e.lhs, self.ctx.fixed):
            return plain
        floor = self.floor_div(ir.Binary("//", e.lhs, e.rhs, e.loc), a, b)
        return f"{self.wrap(a, _PREC['+'] - 1)} - {self.wrap(b, _PREC['*'] - 1)} * {self.wrap(floor, _PREC['*'])}", \
            _PREC["+"], "int"

    def logic(self, e: ir.Binary, a, b):
        """``and`` / ``or`` as a where when a side reads a tensor.  Triton's
        interpreter (3.9) keeps a loaded scalar's dtype on its comparison
        (``t > 0`` of a per-head ``t[h]`` is an fp32-typed bool), so ``&``
        of it and a tile broadcast it to float and failed in numpy's
        bitwise_and; a where takes the condition as it is.  Compiled, the
        two are one instruction; reads of wires alone keep ``&``."""
        if not any(isinstance(n, ir.TensorRef) for side in (e.lhs, e.rhs) for n in ir.walk(side)):
            return super().logic(e, a, b)
        if e.op == "and":
            return f"tl.where({a[0]}, {b[0]}, False)", _PREC["atom"], "bool"
        return f"tl.where({a[0]}, True, {b[0]})", _PREC["atom"], "bool"

    def wide(self, e, code: str) -> str:
        """``code`` as float32 where ``e`` may be a 16-bit value: a float input
        read elementwise (a reduction's result is float32).  Triton's exp,
        log, sqrt and the like take fp32 and fp64 alone: exp(T) of an fp16
        per-head T[h] (or of an fp32-declared one called with fp16) failed to
        compile ("Expected dtype ['fp32', 'fp64'] but got fp16")."""
        def narrow(n) -> bool:
            if isinstance(n, ir.TensorRef):
                return self.ctx.kinds.get(n.name) == "float"
            return not isinstance(n, (ir.Reduce, ir.Normalize)) and any(narrow(c) for c in ir.children(n))
        return f"tl.cast({code}, tl.float32)" if narrow(e) else code

    def safe_div(self, a, b) -> str:
        return f"_safe_div({a[0]}, {b[0]})"

    def general_power(self, base, exp) -> str:
        base_code = self.to_float(base) if base[2] != "float" else base[0]
        return f"tl.exp2({self.wrap(exp, _PREC['*'])} * tl.log2({base_code}))"

    def varying_power(self, base, exp) -> str:
        """base ^ e with e known only at run time: the module's _pow, torch.pow's
        values (exp2(e log2 base) alone is NaN for every negative base)."""
        b = self.to_float(base) if base[2] != "float" else base[0]
        e = self.to_float(exp) if exp[2] != "float" else exp[0]
        return f"_pow({b}, {e})"

    def whole_power(self, base, n: float) -> str:
        """base ^ n for a whole n past the unrolled products: exp2(n log2 base)
        is NaN for a negative base, so |base| ^ n, its sign put back for an
        odd n (any float past 2**53 is even)."""
        b = self.to_float(base) if base[2] != "float" else base[0]
        mag = f"tl.exp2({number(n)} * tl.log2(tl.abs({b})))"
        return mag if n % 2 == 0 else f"tl.where(({b}) < 0, -{mag}, {mag})"


def integral(e):
    """Index arithmetic (the operands of // and %: whole numbers, the
    checker's rule) with each whole float constant an int: 4.0 rendered
    as written made Triton's // a float division ("unexpected type fp32")."""
    if isinstance(e, ir.Num):
        v = e.value
        return ir.Num(int(v), e.loc) if isinstance(v, float) and math.isfinite(v) and v.is_integer() else e
    if isinstance(e, ir.Unary):
        return ir.Unary(e.op, integral(e.operand), e.loc)
    if isinstance(e, ir.Binary):
        return ir.Binary(e.op, integral(e.lhs), integral(e.rhs), e.loc)
    if isinstance(e, ir.Call):
        return ir.Call(e.fn, tuple(integral(a) for a in e.args), e.loc)
    return e


def non_negative(e, fixed: Mapping[str, int]) -> bool:
    """Whether index arithmetic ``e`` is never negative, by its form: indices,
    sizes and non-negative constants under + * // max abs, and any % (its
    divisor is positive)."""
    v = fold(e, fixed)
    if v is not None:
        return v >= 0
    if isinstance(e, (ir.WireIndex, ir.WireSize)):
        return True
    if isinstance(e, ir.Binary) and e.op == "%":
        return True    # a positive divisor's remainder (check_floor_division)
    if isinstance(e, ir.Binary) and e.op in ("+", "*", "//"):
        return non_negative(e.lhs, fixed) and non_negative(e.rhs, fixed)
    if isinstance(e, ir.Call) and e.fn in ("max", "abs"):
        return e.fn == "abs" or any(non_negative(a, fixed) for a in e.args)
    if isinstance(e, ir.Call) and e.fn in ("min", "where"):
        return all(non_negative(a, fixed) for a in (e.args[1:] if e.fn == "where" else e.args))
    return False


def _literal(code: str) -> bool:
    return code.lstrip("-").isdigit()


def triton(e, ctx: Ctx) -> str:
    """Triton source for ``e`` in context ``ctx``, each product's constant
    factors folded into one (products.py: a multiply, not a multiply and a
    division, per element).  Every kernel renders through here; the
    reference (``TorchRender``) does not, so it stays the diagram's literal
    reading.  Nodes the kernel holds in a variable are kept whole, so their
    variables are still found."""
    folded = fold_factors(e, lambda n: fold(n, ctx.fixed), lambda n: n in ctx.subst)
    return TritonRender(ctx)(folded)


class TorchRender(_Render):
    """Eager torch for the reference.  Operands are already aligned to a
    common wire order by the caller (reference.py), so this renders scalars
    and same-shaped tensors; ``scalar`` says every leaf is a Python number,
    so math functions are used instead of torch ones."""

    FUN = {
        "exp": "torch.exp({})", "exp2": "torch.exp2({})", "log": "torch.log({})", "log2": "torch.log2({})",
        "sqrt": "torch.sqrt({})", "rsqrt": "torch.rsqrt({})", "abs": "torch.abs({})",
        "tanh": "torch.tanh({})", "sigmoid": "torch.sigmoid({})", "relu": "torch.relu({})",
        "max": "_maximum({}, {})", "min": "_minimum({}, {})",
    }

    def negate(self, x) -> str:
        return f"~{self.wrap(x, _PREC['neg'])}"

    def to_float(self, x) -> str:
        return x[0]

    def where(self, c, a, b) -> str:
        # the module's _where: a condition of sizes alone (|x| > 3) is a Python bool there
        return f"_where({c}, {a}, {b})"

    def safe_div(self, a, b) -> str:
        return f"_safe_div({a[0]}, {b[0]})"

    def general_power(self, base, exp) -> str:
        return f"{self.wrap(base, _PREC['**'])} ** {self.wrap(exp, _PREC['**'] - 1)}"

    def power(self, e: ir.Binary):
        base, exp = self.r(e.lhs), self.r(e.rhs)
        return f"{self.wrap(base, _PREC['**'])} ** {self.wrap(exp, _PREC['**'] - 1)}", _PREC["**"], base[2]


class ScalarRender(TorchRender):
    """Scalars of the reference (symbolic sizes): Python numbers, and torch's
    functions on them through the module's _scalar (math.log(0) raised where
    torch.log gives -inf, as the kernels do: a sigmoid's log(|x|) at x = 0)."""

    FUN = {k: v.replace("torch.", "_scalar(torch.").replace("({})", ", {})") for k, v in TorchRender.FUN.items()}
    FUN.update({"relu": "max({}, 0)", "max": "max({}, {})", "min": "min({}, {})", "abs": "abs({})"})

    def binary(self, e: ir.Binary):
        # / and ^ as torch takes them (1 / 0 = inf, (-8) ^ (1/3) = nan), as the kernel
        # does: Python raised ZeroDivisionError or went complex (1 / (|x| - |q|) at |x| = |q|)
        if e.op == "/":
            a, b = self.r(e.lhs), self.r(e.rhs)
            return f"_scalar2(torch.div, {a[0]}, {b[0]})", _PREC["atom"], "float"
        return super().binary(e)

    def power(self, e: ir.Binary):
        base, exp = self.r(e.lhs), self.r(e.rhs)
        return f"_scalar2(torch.pow, {base[0]}, {exp[0]})", _PREC["atom"], "float"
