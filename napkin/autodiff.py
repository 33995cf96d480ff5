"""Symbolic differentiation: what napkin's backward kernels are derived from.

Everything here is a pure function over the frozen nodes of ``napkin.ir``;
nothing is mutated and every output is deterministic.

Elementwise layer
    ``diff(expr, wrt) -> Expr``
        The derivative of an elementwise expression with respect to the
        sub-expression ``wrt`` (matched structurally with ``==``): a tensor
        (``TensorRef("slope")``), a placeholder, or the raw score node
        ``sum[d](Q * K)``.  The result is simplified.  A Reduce or Normalize
        that is not ``wrt`` but contains it raises ValueError: reductions are
        the normaliser layer's business (below).  Masks stay NaN-free: the
        derivative of ``where(m, s, -inf)`` is ``where(m, 1, 0)``, and a
        product with such a masked derivative is pushed inside the where
        (``g * where(m, a, 0)`` -> ``where(m, g * a, 0)``) so a masked entry
        is selected away instead of computed as ``inf * 0``.
    ``simplify(expr) -> Expr``
        Constant folding and identities that keep generated code small and
        never change a value (``x * 0`` folds only when x cannot be inf/NaN).
    ``substitute(expr, old, new) -> Expr``
        Replace every sub-tree equal to ``old``.

Normaliser layer (pure data: a ``GradRule``)
    ``softmax_rule(...)``, ``sums_rule(...)``: the rule from explicit pieces.
    ``grad_plan(diagram) -> GradRule``: recognise a diagram's streamed form
        and build its rule.  Forms:
        (a) O = sum[x](softmax[x](S) * V)            dS = P * (dP - delta)
        (b) O = F(N_i.., Z_j..), N_i = sum[x](a_i(S) * V), Z_j = sum[x](c_j(S))
                                   dS = sum_i a_i'(S) dA_i + sum_j c_j'(S) dZ_j
                                   dA_i = gN_i dP when each gN_i = dF/dN_i is
                                   per row, else sum_f(dN_i * V)
        (c) lse = logsumexp[x](S) next to either:  dS += P * dlse
    A rule's expressions are ordinary IR over the diagram's inputs plus fixed
    placeholder names (``PLACEHOLDERS``), each with its wires in
    ``GradRule.layouts``, so the backward code generator turns them into
    Triton exactly as it does the forward's expressions.

tests/test_autodiff.py checks every formula here against torch.autograd in
float64, through a small wire-named interpreter of the IR (``evaluate``).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Mapping, Optional, Sequence

from . import ir

ZERO = ir.Num(0)
ONE = ir.Num(1)
NEG_INF = ir.Num(float("-inf"))
LN2 = math.log(2.0)


def _is_num(e: ir.Expr, value) -> bool:
    return isinstance(e, ir.Num) and not isinstance(e.value, bool) and e.value == value


def _contains(e: ir.Expr, sub: ir.Expr) -> bool:
    return any(node == sub for node in ir.walk(e))


def _map(e: ir.Expr, f) -> ir.Expr:
    """``e`` with ``f`` applied to each direct child (location kept)."""
    if isinstance(e, ir.Unary):
        return replace(e, operand=f(e.operand))
    if isinstance(e, ir.Binary):
        return replace(e, lhs=f(e.lhs), rhs=f(e.rhs))
    if isinstance(e, ir.Call):
        return replace(e, args=tuple(f(a) for a in e.args))
    if isinstance(e, (ir.Reduce, ir.Normalize)):
        return replace(e, body=f(e.body))
    return e


def substitute(expr: ir.Expr, old: ir.Expr, new: ir.Expr) -> ir.Expr:
    """``expr`` with every sub-tree equal to ``old`` replaced by ``new``."""
    if expr == old:
        return new
    return _map(expr, lambda child: substitute(child, old, new))


# --------------------------------------------------------------------------
# Builders used while differentiating.  A Num(0) here means "this term is
# identically zero because nothing in it depends on wrt", so it annihilates
# any product outright (even with a factor that may be inf): the term is
# absent from the true derivative, not a 0 to be multiplied in.
# --------------------------------------------------------------------------

def _where(c, a, b):
    return a if a == b else ir.Call("where", (c, a, b))


def _masked(e) -> bool:
    """A where with a zero branch: products must go inside it (see _mul)."""
    return (isinstance(e, ir.Call) and e.fn == "where"
            and (_is_num(e.args[1], 0) or _is_num(e.args[2], 0)))


def _neg(x):
    if isinstance(x, ir.Num):
        return ir.Num(-x.value)
    if isinstance(x, ir.Unary) and x.op == "-":
        return x.operand
    if isinstance(x, ir.Call) and x.fn == "where":
        return _where(x.args[0], _neg(x.args[1]), _neg(x.args[2]))
    return ir.Unary("-", x)


def _same_cond_wheres(x, y) -> bool:
    return (isinstance(x, ir.Call) and x.fn == "where" and isinstance(y, ir.Call)
            and y.fn == "where" and x.args[0] == y.args[0])


def _add(x, y):
    if _is_num(x, 0):
        return y
    if _is_num(y, 0):
        return x
    if _same_cond_wheres(x, y):  # exact: where(c,a,b) + where(c,d,e) = where(c, a+d, b+e)
        return _where(x.args[0], _add(x.args[1], y.args[1]), _add(x.args[2], y.args[2]))
    return ir.Binary("+", x, y)


def _sub(x, y):
    if _is_num(y, 0):
        return x
    if _is_num(x, 0):
        return _neg(y)
    if _same_cond_wheres(x, y):
        return _where(x.args[0], _sub(x.args[1], y.args[1]), _sub(x.args[2], y.args[2]))
    return ir.Binary("-", x, y)


def _mul(x, y):
    if _is_num(x, 0) or _is_num(y, 0):
        return ZERO
    if _is_num(x, 1):
        return y
    if _is_num(y, 1):
        return x
    # Push the product into a masked derivative so a masked entry selects 0
    # rather than computing inf * 0 = NaN.
    if _masked(y):
        return _where(y.args[0], _mul(x, y.args[1]), _mul(x, y.args[2]))
    if _masked(x):
        return _where(x.args[0], _mul(x.args[1], y), _mul(x.args[2], y))
    return ir.Binary("*", x, y)


def _div(x, y):
    if _is_num(x, 0):
        return ZERO
    if _is_num(y, 1):
        return x
    if _masked(x):
        return _where(x.args[0], _div(x.args[1], y), _div(x.args[2], y))
    return ir.Binary("/", x, y)


# --------------------------------------------------------------------------
# diff
# --------------------------------------------------------------------------

def diff(expr: ir.Expr, wrt: ir.Expr) -> ir.Expr:
    """d expr / d wrt for an elementwise ``expr`` (see the module docstring)."""
    return simplify(_d(expr, wrt))


def _d(e: ir.Expr, wrt: ir.Expr) -> ir.Expr:
    if e == wrt:
        return ONE
    if not _contains(e, wrt):
        return ZERO  # constants, wire indices and sizes, other tensors
    if isinstance(e, (ir.Reduce, ir.Normalize)):
        what = f"{e.op}[{', '.join(e.wires) if isinstance(e, ir.Reduce) else e.wire}]"
        raise ValueError(
            f"cannot differentiate through {what}(...) elementwise: it contains the variable; "
            "reductions and normalisers go through grad_plan")
    if isinstance(e, ir.Unary):
        return _neg(_d(e.operand, wrt)) if e.op == "-" else ZERO  # `not`: boolean
    if isinstance(e, ir.Binary):
        return _d_binary(e, wrt)
    if isinstance(e, ir.Call):
        return _d_call(e, wrt)
    raise ValueError(f"cannot differentiate {type(e).__name__}")  # pragma: no cover


def _d_binary(e: ir.Binary, wrt) -> ir.Expr:
    if e.op not in ir.ARITH_OPS:
        return ZERO  # comparisons and logic are piecewise constant
    a, b = e.lhs, e.rhs
    da, db = _d(a, wrt), _d(b, wrt)
    if e.op == "+":
        return _add(da, db)
    if e.op == "-":
        return _sub(da, db)
    if e.op == "*":
        return _add(_mul(da, b), _mul(a, db))
    if e.op == "/":
        return _sub(_div(da, b), _div(_mul(a, db), _mul(b, b)))
    # power
    if _is_num(db, 0):  # a^c: c * a^(c-1) * a'
        return _mul(da, _mul(b, ir.Binary("^", a, _sub(b, ONE))))
    if _is_num(da, 0):  # c^b: c^b * log(c) * b'
        return _mul(db, _mul(e, ir.Call("log", (a,))))
    # a^b = exp(b log a): a^b * (b' log a + b a' / a)
    return _mul(e, _add(_mul(db, ir.Call("log", (a,))), _div(_mul(b, da), a)))


def _d_call(e: ir.Call, wrt) -> ir.Expr:
    fn, args = e.fn, e.args
    if fn == "where":  # the condition is piecewise constant
        return _where(args[0], _d(args[1], wrt), _d(args[2], wrt))
    if fn in ("max", "min"):  # subgradient: follow the selected argument
        a, b = args
        pick = ir.Binary(">=" if fn == "max" else "<=", a, b)
        return _where(pick, _d(a, wrt), _d(b, wrt))
    u = args[0]
    du = _d(u, wrt)
    if _is_num(du, 0):
        return ZERO
    if fn == "exp":
        return _mul(du, e)
    if fn == "exp2":
        return _mul(du, _mul(e, ir.Num(LN2)))
    if fn == "log":
        return _div(du, u)
    if fn == "log2":
        return _div(du, _mul(u, ir.Num(LN2)))
    if fn == "sqrt":  # 1 / (2 sqrt u)
        return _div(du, _mul(ir.Num(2), e))
    if fn == "rsqrt":  # -1/2 u^(-3/2) = -0.5 * rsqrt(u) / u
        return _mul(du, _div(_mul(ir.Num(-0.5), e), u))
    if fn == "tanh":
        return _mul(du, _sub(ONE, _mul(e, e)))
    if fn == "sigmoid":
        return _mul(du, _mul(e, _sub(ONE, e)))
    if fn == "abs":
        return _where(ir.Binary("<", u, ZERO), _neg(du), du)
    if fn == "relu":
        return _where(ir.Binary(">", u, ZERO), du, ZERO)
    raise ValueError(f"no derivative rule for function {fn!r}")


# --------------------------------------------------------------------------
# simplify: every rule keeps the value exactly (inf and NaN included), up to
# the rounding of folded constants and the sign of a zero.
# --------------------------------------------------------------------------

def simplify(expr: ir.Expr) -> ir.Expr:
    """Fold constants and drop identities bottom-up; see the rules below."""
    new = _map(expr, simplify)
    if isinstance(new, ir.Unary):
        new = _s_unary(new)
    elif isinstance(new, ir.Binary):
        new = _s_binary(new)
    elif isinstance(new, ir.Call):
        new = _s_call(new)
    elif isinstance(new, ir.Reduce) and new.op == "sum" and _is_num(new.body, 0):
        new = ZERO
    return expr if new == expr else new  # unchanged: keep the original (and its location)


def _s_unary(e: ir.Unary) -> ir.Expr:
    if e.op == "-":
        if isinstance(e.operand, ir.Num):
            return ir.Num(-e.operand.value)
        if isinstance(e.operand, ir.Unary) and e.operand.op == "-":
            return e.operand.operand
    return e


# Functions that map finite values to finite values: a product of 0 with an
# expression built only from these (and finite constants, wire indices and
# sizes) is 0.  Anything reading a tensor may hold inf, so it is never folded.
_FINITE_CALLS = ("where", "max", "min", "abs", "relu", "tanh", "sigmoid")
_FINITE_OPS = ("+", "-", "*") + ir.COMPARE_OPS + ir.LOGIC_OPS


def _finite_safe(e: ir.Expr) -> bool:
    for node in ir.walk(e):
        if isinstance(node, ir.Num):
            if not math.isfinite(node.value):
                return False
        elif isinstance(node, ir.Binary):
            if node.op not in _FINITE_OPS:
                return False
        elif isinstance(node, ir.Call):
            if node.fn not in _FINITE_CALLS:
                return False
        elif not isinstance(node, (ir.WireIndex, ir.WireSize, ir.Unary)):
            return False
    return True


def _s_binary(e: ir.Binary) -> ir.Expr:
    op, a, b = e.op, e.lhs, e.rhs
    if isinstance(a, ir.Num) and isinstance(b, ir.Num):
        folded = _fold(op, a.value, b.value)
        if folded is not None:
            return folded
    if op == "+":
        if _is_num(a, 0):
            return b
        if _is_num(b, 0):
            return a
        if a == b:  # x + x = 2 * x exactly, inf and NaN included
            return ir.Binary("*", ir.Num(2), a)
        if isinstance(b, ir.Unary) and b.op == "-":
            return _s_binary(ir.Binary("-", a, b.operand))
    elif op == "-":
        if _is_num(b, 0):
            return a
        if _is_num(a, 0):
            return _s_unary(ir.Unary("-", b))
        if isinstance(b, ir.Unary) and b.op == "-":
            return _s_binary(ir.Binary("+", a, b.operand))
    elif op == "*":
        for x, y in ((a, b), (b, a)):
            if _is_num(x, 1):
                return y
            if _is_num(x, 0) and _finite_safe(y):
                return ZERO
            if _is_num(x, -1):
                return _s_unary(ir.Unary("-", y))
            if isinstance(y, ir.Binary) and y.op == "/" and _is_num(y.lhs, 1):  # x * (1/z) = x / z
                return _s_binary(ir.Binary("/", x, y.rhs))
    elif op == "/":
        if _is_num(b, 1):
            return a
    elif op == "^":
        if _is_num(b, 1):
            return a
        if _is_num(b, 0) or _is_num(a, 1):  # IEEE pow: x^0 = 1 and 1^y = 1, even for NaN
            return ONE
    return e


def _fold(op: str, x, y) -> Optional[ir.Num]:
    """x op y for two constants, or None when it is not a plain finite-or-inf number."""
    if op not in ir.ARITH_OPS or isinstance(x, bool) or isinstance(y, bool):
        return None
    try:
        if op == "+":
            r = x + y
        elif op == "-":
            r = x - y
        elif op == "*":
            r = x * y
        elif op == "/":
            if y == 0:
                return None
            r = x / y
        else:
            if (x == 0 and y < 0) or (x < 0 and not float(y).is_integer()):
                return None
            r = x ** y
    except (OverflowError, ZeroDivisionError, ValueError):
        return None
    if isinstance(r, complex) or (isinstance(r, float) and math.isnan(r)):
        return None
    if isinstance(r, int) and abs(r) > 2 ** 53:
        return None
    return ir.Num(r)


_MATH = {
    "exp": math.exp, "exp2": lambda v: 2.0 ** v, "log": math.log, "log2": math.log2,
    "sqrt": math.sqrt, "rsqrt": lambda v: 1.0 / math.sqrt(v), "tanh": math.tanh,
    "sigmoid": lambda v: 1.0 / (1.0 + math.exp(-v)), "abs": abs, "relu": lambda v: max(v, 0),
    "max": max, "min": min,
}


def _s_call(e: ir.Call) -> ir.Expr:
    if e.fn == "where":
        return e.args[1] if e.args[1] == e.args[2] else e
    if e.fn in _MATH and all(isinstance(a, ir.Num) and not isinstance(a.value, bool) for a in e.args):
        try:
            r = _MATH[e.fn](*(a.value for a in e.args))
        except (OverflowError, ValueError, ZeroDivisionError):
            return e
        if not (isinstance(r, float) and math.isnan(r)):
            return ir.Num(r)
    return e


# --------------------------------------------------------------------------
# The normaliser layer: backward rules for streamed attention, as data.
#
# Execution model of a GradRule (what a backward kernel does with it):
#   forward      how the forward defines the saved values (N_i, Z_j, O, lse);
#                the forward kernel must write every name in ``saved``.
#   rows         once per query row before the key loop (FlashAttention's
#                "preprocess"), e.g. delta = rowsum(dO * O).
#   tile         per (query block, key block), in order.  When ``raw`` is set
#                the tile first computes R = raw (the contraction Q.K), then
#                S from R, ... and ends with dR; otherwise it starts from S
#                and ends with dS.
#   input_grads  per input, its gradient as a sum over one of the tile's
#                wires (dQ = sum[x](dR * K), dK and dV sum over the query
#                wires): the kernel accumulates it over the loop.
# Placeholder names are fixed; ``layouts`` gives each one's wires.  Diagram
# inputs keep their own names (and may not use a placeholder name).
# --------------------------------------------------------------------------

PLACEHOLDERS = ("S", "R", "O", "dO", "lse", "dlse", "delta", "P", "dP", "dS", "dR", "Aw")
_INDEXED = re.compile(r"(N|Z|A|dN|dZ|dA|gN)\d+")


def is_placeholder(name: str) -> bool:
    return name in PLACEHOLDERS or _INDEXED.fullmatch(name) is not None


def _ref(name: str) -> ir.TensorRef:
    return ir.TensorRef(name)


@dataclass(frozen=True)
class GradRule:
    """The backward of one streamed attention, as IR (see the comment above).

    kind      "softmax" (form a) or "sums" (form b); lse_grad: (c) is added.
    key       the streamed wire the normaliser reduces (x).
    value     the name of the value input V.
    layouts   placeholder -> its wires, for every placeholder the rule uses.
    forward, rows, tile, input_grads: (name, expression) bindings, in order.
    saved     forward values the backward reads; grads_in: ("dO"[, "dlse"]).
    raw       the raw contraction R stands for (None: the tile starts at S).
    bound     placeholder -> the diagram's name for it (S, O, lse), from grad_plan.
    """

    kind: str
    key: str
    value: str
    lse_grad: bool
    layouts: tuple[tuple[str, tuple[str, ...]], ...]
    forward: tuple[tuple[str, ir.Expr], ...]
    saved: tuple[str, ...]
    grads_in: tuple[str, ...]
    rows: tuple[tuple[str, ir.Expr], ...]
    tile: tuple[tuple[str, ir.Expr], ...]
    input_grads: tuple[tuple[str, ir.Expr], ...]
    raw: Optional[ir.Expr] = None
    bound: tuple[tuple[str, str], ...] = ()

    def layout(self, name: str) -> tuple[str, ...]:
        return dict(self.layouts)[name]

    def binding(self, name: str) -> ir.Expr:
        """The expression bound to ``name`` in forward, rows or tile (the last one wins)."""
        return dict(self.forward + self.rows + self.tile)[name]


@dataclass(frozen=True)
class _Wires:
    """The wire roles of an attention, from the score's and V's layouts."""

    key: str
    score: tuple[str, ...]   # S, P, dS: (b, h, q, x)
    value: tuple[str, ...]   # V: (b, h, x, d)

    @property
    def row(self):           # one softmax row: (b, h, q)
        return tuple(w for w in self.score if w != self.key)

    @property
    def feat(self):          # V's wires the score lacks: (d,)
        return tuple(w for w in self.value if w not in self.score)

    @property
    def query(self):         # the score's wires V lacks, summed for dV and dK: (q,)
        return tuple(w for w in self.score if w not in self.value)

    def of(self, placeholder: str) -> tuple[str, ...]:
        """A placeholder's wires: score-shaped (S, P, A_i, Aw and their gradients),
        output-shaped (row + feat: O, N_i, dN_i) or one per row (lse, delta, Z_j, gN_i)."""
        base = placeholder[1:] if placeholder.startswith("d") and placeholder != "delta" else placeholder
        if base in ("S", "R", "P") or base[0] == "A":
            return self.score
        if base == "O" or base[0] == "N":
            return self.row + self.feat
        return self.row  # lse, delta, Z_j


def _roles(key, score_wires, value_wires) -> _Wires:
    w = _Wires(key, tuple(score_wires), tuple(value_wires))
    if key not in w.score or key not in w.value:
        raise ValueError(f"the key wire {key!r} must be a wire of both the score {w.score} and V {w.value}")
    if not w.feat:
        raise ValueError(f"V {w.value} has no wire the score {w.score} lacks: nothing to contract into")
    return w


def _sum(wires: tuple[str, ...], body: ir.Expr) -> ir.Expr:
    return ir.Reduce("sum", tuple(wires), body) if wires else body


def _recompute_p() -> ir.Expr:
    """P = exp(S - lse), and 0 on a fully masked row: there lse = -inf and every
    S = -inf, so lse is replaced by 0 and S - lse is -inf (never -inf - -inf,
    a NaN even where a where would select it away)."""
    S, lse = _ref("S"), _ref("lse")
    return ir.Call("exp", (ir.Binary("-", S, ir.Call("where", (ir.Binary("==", lse, NEG_INF), ZERO, lse))),))


def softmax_rule(key: str, score_wires: Sequence[str], value_wires: Sequence[str], *,
                 value: str = "V", lse_grad: bool = False, score: Optional[ir.Expr] = None,
                 raw: Optional[ir.Expr] = None,
                 input_layouts: Optional[Mapping[str, tuple[str, ...]]] = None) -> GradRule:
    """Form (a), optionally with (c): O = sum[key](softmax[key](S) * V) [, lse].

    score: the score box's expression (then S is the tile's first binding);
    raw: the contraction in it that R stands for, with input_layouts
    (input name -> wires) to sum its inputs' gradients.
    """
    w = _roles(key, score_wires, value_wires)
    S, O, dO, P = _ref("S"), _ref("O"), _ref("dO"), _ref("P")
    forward = [("P", ir.Normalize("softmax", key, S)),
               ("O", ir.Reduce("sum", (key,), ir.Binary("*", P, _ref(value)))),
               ("lse", ir.Reduce("logsumexp", (key,), S))]
    # dS = P (dP - delta) + P dlse = P (dP - (delta - dlse)): fold dlse into delta.
    delta = ir.Reduce("sum", w.feat, ir.Binary("*", dO, O))
    if lse_grad:
        delta = ir.Binary("-", delta, _ref("dlse"))
    tile = [("P", _recompute_p()), ("dP", ir.Reduce("sum", w.feat, ir.Binary("*", dO, _ref(value))))]
    ds = ir.Binary("*", P, ir.Binary("-", _ref("dP"), _ref("delta")))
    return _assemble("softmax", w, value, lse_grad, forward, [("delta", delta)], tile, ds,
                     ir.Binary("*", P, dO), score, raw, input_layouts)


def sums_rule(key: str, score_wires: Sequence[str], value_wires: Sequence[str],
              contractions: Sequence[ir.Expr], rowsums: Sequence[ir.Expr], output: ir.Expr, *,
              value: str = "V", lse_grad: bool = False, score: Optional[ir.Expr] = None,
              raw: Optional[ir.Expr] = None,
              input_layouts: Optional[Mapping[str, tuple[str, ...]]] = None) -> GradRule:
    """Form (b), optionally with (c); the keyword arguments as for softmax_rule.

    contractions: a_i, elementwise in TensorRef("S"), with N_i = sum[key](a_i * V);
    rowsums: c_j with Z_j = sum[key](c_j); output: F over TensorRef("N0").., ("Z0")..
    """
    w = _roles(key, score_wires, value_wires)
    if not contractions:
        raise ValueError("an attention output needs at least one contraction with V")
    S, dO, V = _ref("S"), _ref("dO"), _ref(value)
    A = [(_ref(f"A{i}"), a) for i, a in enumerate(contractions)]
    forward = [(f"N{i}", ir.Reduce("sum", (key,), ir.Binary("*", a, V))) for i, a in enumerate(contractions)]
    forward += [(f"Z{j}", ir.Reduce("sum", (key,), c)) for j, c in enumerate(rowsums)]
    forward.append(("O", output))
    # dZ_j = rowsum(dO dF/dZ_j), Z_j having no feature wire.
    rows = [(f"dZ{j}", _row_sum(w.feat, dO, simplify(diff(output, _ref(f"Z{j}"))))) for j in range(len(rowsums))]
    tile = [(a_ref.name, a) for a_ref, a in A]
    ds, dv = ZERO, ZERO
    g = [simplify(diff(output, _ref(f"N{i}"))) for i in range(len(A))]
    if all(_per_row(gi) for gi in g):
        # Each g_i = dF/dN_i is one number per row (it reads only Z_j and constants: L2, ReLU^2,
        # sigmoid), so dA_i = sum_f(dO g_i * V) = g_i dP with one dP = sum_f(dO * V) for every i, a
        # product of two 16-bit tiles as softmax's; and dV = sum_q (sum_i A_i g_i) dO, whose weight
        # tile Aw is softmax's P.  The rows kernel keeps g_i (gN_i) per row, not dO g_i per element:
        # nothing [rows, feature] is written or streamed; a constant g_i (sigmoid: 1) is no row value.
        # equal factors (O = (N0 + N1) / b(Z)) share the first one's row value
        gn = [gi if isinstance(gi, ir.Num) else _ref(f"gN{g.index(gi)}") for gi in g]
        rows = [(f"gN{i}", gi) for i, gi in enumerate(g) if not isinstance(gi, ir.Num) and g.index(gi) == i] + rows
        tile.append(("dP", ir.Reduce("sum", w.feat, ir.Binary("*", dO, V))))
        weight = ZERO
        for (a_ref, a), gi in zip(A, gn):
            ds = _add(ds, _mul(substitute(diff(a, S), a, a_ref), _mul(gi, _ref("dP"))))
            weight = _add(weight, _mul(a_ref, gi))
        if not isinstance(weight, ir.TensorRef):  # a tile of its own, so dV is sum_q(tile * dO)
            tile.append(("Aw", weight))
            weight = _ref("Aw")
        dv = ir.Binary("*", weight, dO)
    else:
        # Some g_i reads an N_k: dN_i = dO g_i is a [rows, feature] tile of its own (float32 row
        # state), dA_i = sum_f(dN_i * V) and dV = sum_q sum_i A_i dN_i.
        rows = [(f"dN{i}", _mul(dO, gi)) for i, gi in enumerate(g)] + rows
        for i, (a_ref, a) in enumerate(A):
            dn, da = _ref(f"dN{i}"), _ref(f"dA{i}")
            tile.append((da.name, ir.Reduce("sum", w.feat, ir.Binary("*", dn, V))))
            ds = _add(ds, _mul(substitute(diff(a, S), a, a_ref), da))
            dv = _add(dv, ir.Binary("*", a_ref, dn))
    # dS = sum_i a_i'(S) dA_i + sum_j c_j'(S) dZ_j; a_i inside a_i' is read back as A_i.
    for j, c in enumerate(rowsums):
        ds = _add(ds, _mul(diff(c, S), _ref(f"dZ{j}")))
    return _assemble("sums", w, value, lse_grad, forward, rows, tile, ds, dv, score, raw, input_layouts)


def _row_sum(feat: tuple[str, ...], dO: ir.Expr, g: ir.Expr) -> ir.Expr:
    """sum[feat](dO * g) with g's per-row factors (_per_row) taken out of the
    sum: L2's dF/dZ = -N / (2 b(Z) b(Z)^2) becomes -1 / (2 b(Z) b(Z)^2) *
    sum[feat](dO * N), so the rows kernel computes its factor once a row, not
    once an element (a float32 division each) over a [rows, feature] tile."""
    factors = _factors(g)
    outside = [(f, p) for f, p in factors if _per_row(f)]
    if not outside:
        return _sum(feat, _mul(dO, g))
    inside = [(f, p) for f, p in factors if not _per_row(f)]
    return _mul(_product(outside), _sum(feat, _mul(dO, _product(inside)) if inside else dO))


def _per_row(g: ir.Expr) -> bool:
    """Whether dF/dN_i is one value per row: built from constants, sizes and
    the row sums Z_j alone (no N_k, no other tensor, no wire index)."""
    return all(isinstance(n, ir.TensorRef) and re.fullmatch(r"Z\d+", n.name) and n.wires is None
               or not isinstance(n, (ir.TensorRef, ir.WireIndex, ir.Reduce, ir.Normalize)) for n in ir.walk(g))


def _assemble(kind, w: _Wires, value, lse_grad, forward, rows, tile, ds, dv, score, raw,
              input_layouts) -> GradRule:
    """The parts every rule shares: lse, S from R, dR, input gradients, layouts."""
    if lse_grad:
        if kind == "sums":  # softmax folded dlse into delta already
            forward = forward + [("lse", ir.Reduce("logsumexp", (w.key,), _ref("S")))]
            tile = [("P", _recompute_p())] + tile
            ds = _add(ds, _mul(_ref("P"), _ref("dlse")))
    tile = tile + [("dS", simplify(ds))]
    grads = [(value, _sum(w.query, dv))]
    if score is not None:
        s_of_r = substitute(score, raw, _ref("R")) if raw is not None else score
        tile = [("S", s_of_r)] + tile
    if raw is not None:
        if score is None or input_layouts is None:
            raise ValueError("a raw contraction needs the score expression and the input layouts")
        body = raw.body if isinstance(raw, ir.Reduce) else None
        if not (raw.op == "sum" and isinstance(body, ir.Binary) and body.op == "*"
                and all(isinstance(t, ir.TensorRef) and t.wires is None for t in (body.lhs, body.rhs))):
            raise ValueError("the raw score must be a contraction sum[w](A * B) of two inputs")
        tile.append(("dR", _mul(_ref("dS"), diff(s_of_r, _ref("R")))))
        # R = sum[w](A * B): dA sums dR * B over the wires of R that A lacks, and alike for B.
        grads = [(this.name, _sum(tuple(x for x in w.score if x not in input_layouts[this.name]),
                                  ir.Binary("*", _ref("dR"), other)))
                 for this, other in ((body.lhs, body.rhs), (body.rhs, body.lhs))] + grads
    rows = tuple((n, simplify(e)) for n, e in rows)
    tile = tuple((n, simplify(e)) for n, e in tile)
    used = {node.name for _, e in forward + list(rows + tile) + grads for node in ir.walk(e)
            if isinstance(node, ir.TensorRef)} | {n for n, _ in forward + list(rows + tile)}
    layouts = tuple((n, w.of(n)) for n in sorted(used) if is_placeholder(n))
    # saved: forward values the backward reads and does not recompute itself (P is recomputed).
    rebound = {n for n, _ in rows + tile}
    saved = tuple(n for n, _ in forward
                  if n not in rebound and any(_contains(e, _ref(n)) for _, e in rows + tile))
    return GradRule(kind, w.key, value, lse_grad, layouts, tuple(forward), saved,
                    ("dO", "dlse") if lse_grad else ("dO",), rows, tile, tuple(grads), raw)


# --------------------------------------------------------------------------
# grad_plan: recognise the streamed form of a diagram.
# --------------------------------------------------------------------------

def grad_plan(diagram: ir.Diagram) -> GradRule:
    """The GradRule of an attention diagram, or ValueError saying why there is none.

    The score box is the one box computing a raw contraction of inputs
    (``sum[d](Q * K)``).  The other boxes are inlined into the outputs, which
    must be one attention output (form a or b) and optionally
    ``logsumexp[x](S)``.
    """
    layouts = {i.name: ir.axis_wires(i.axes) for i in diagram.inputs}
    clash = sorted(name for name in layouts if is_placeholder(name))
    if clash:
        raise ValueError(f"input {clash[0]} has a name grad_plan uses for its own values; rename it")
    lets = {let.name: let for let in diagram.lets}
    score_let, raw = _score_box(diagram, layouts)
    score_wires = ir.axis_wires(score_let.axes)

    def inline(e):
        if isinstance(e, ir.TensorRef) and e.name in lets:
            if e.wires is not None:
                raise ValueError(f"the box {e.name} is read relabelled; grad_plan cannot inline that")
            return _ref("S") if e.name == score_let.name else inline(lets[e.name].expr)
        return _map(e, inline)

    attention, lse_name = None, None
    for out in diagram.outputs:
        if out.name not in lets or out.name == score_let.name:
            raise ValueError(f"output {out.name} is the score box or an input: "
                             "no normaliser to differentiate")
        e = inline(lets[out.name].expr)
        if isinstance(e, ir.Reduce) and e.op == "logsumexp":
            if e.body != _ref("S") or len(e.wires) != 1:
                raise ValueError(f"output {out.name}: logsumexp must be taken of the scores along one wire")
            lse_name, lse_wire = out.name, e.wires[0]
        elif attention is None:
            attention = (out.name, e)
        else:
            raise ValueError(f"outputs {attention[0]} and {out.name}: grad_plan handles one attention output")
    if attention is None:
        raise ValueError("no attention output: nothing contracts the scores with a value tensor")
    form = _Form(score_wires, layouts)
    output = form.visit(attention[1])
    if form.v is None:
        raise ValueError(f"output {attention[0]} contracts no value tensor with the scores")
    if lse_name is not None and lse_wire != form.key:
        raise ValueError(f"logsumexp is along {lse_wire} but the attention sums along {form.key}")
    common = dict(value=form.v, lse_grad=lse_name is not None, score=score_let.expr, raw=raw,
                  input_layouts=layouts)
    if form.softmax:
        if len(form.nums) != 1 or form.sums or output != _ref("N0"):
            raise ValueError("softmax attention must be exactly sum[x](softmax[x](S) * V)")
        rule = softmax_rule(form.key, score_wires, layouts[form.v], **common)
    else:
        rule = sums_rule(form.key, score_wires, layouts[form.v], form.nums, form.sums, output, **common)
    bound = [("S", score_let.name), ("O", attention[0])] + ([("lse", lse_name)] if lse_name else [])
    return replace(rule, bound=tuple(bound))


def _score_box(diagram: ir.Diagram, layouts) -> tuple:
    """The box holding the raw contraction of two inputs, and that contraction."""
    found = []
    for let in diagram.lets:
        refs = {n.name for n in ir.walk(let.expr) if isinstance(n, ir.TensorRef)}
        if not refs <= set(layouts):
            continue  # reads another box: not the first layer
        raws = []
        for node in ir.walk(let.expr):
            if isinstance(node, ir.Reduce) and node.op == "sum" and node not in raws:
                raws.append(node)
        if raws:
            found.append((let, raws))
    if len(found) != 1:
        names = ", ".join(let.name for let, _ in found) or "none"
        raise ValueError(f"expected one score box contracting inputs (like sum[d](Q * K)); found {names}")
    let, raws = found[0]
    if len(raws) != 1:
        raise ValueError(f"the score box {let.name} holds {len(raws)} different contractions; expected one")
    return let, raws[0]


class _Form:
    """Walks an inlined attention output and takes it apart into form (a) or (b).

    Each ``sum[x](...)`` becomes a placeholder times the factors of its body
    that do not depend on x (they are constant along the sum, so they come
    out of it: ``sum[x](S / sqrt(Z) * V)`` = ``N / sqrt(Z)``).  A body with V
    is a contraction N_i = sum[x](a_i(S) * V), one without is a row sum Z_j.
    """

    def __init__(self, score_wires, layouts):
        self.score_wires, self.layouts = score_wires, layouts
        self.key = self.v = None
        self.softmax = False
        self.nums, self.sums = [], []

    def visit(self, e: ir.Expr) -> ir.Expr:
        if isinstance(e, ir.Normalize):
            raise ValueError("softmax must be used as sum[x](softmax[x](S) * V)")
        if not isinstance(e, ir.Reduce):
            return _map(e, self.visit)
        if e.op != "sum" or len(e.wires) != 1 or (self.key not in (None, e.wires[0])):
            raise ValueError(f"{e.op}[{', '.join(e.wires)}] is not a sum along the key wire")
        self.key = e.wires[0]
        keyed, const = [], []
        for factor, power in _factors(e.body):
            (keyed if self._keyed(factor) else const).append((factor, power))
        vs = [f for f, p in keyed if isinstance(f, ir.TensorRef) and self._is_value(f)]
        if len(vs) > 1 or any(isinstance(f, ir.TensorRef) and self._is_value(f) and p < 0 for f, p in keyed):
            raise ValueError("a contraction must multiply by the value tensor once")
        rest = [(f, p) for f, p in keyed if not (vs and f == vs[0])]
        weight = _product(rest)
        reduced = [n for n in ir.walk(weight) if isinstance(n, (ir.Reduce, ir.Normalize))]
        if reduced and not self._is_softmax(weight):
            if any(isinstance(n, ir.Normalize) for n in reduced):
                raise ValueError("softmax must normalise the score box itself: sum[x](softmax[x](S) * V)")
            raise ValueError("the weights inside a sum along the key wire must be elementwise in the scores")
        if vs:
            if self.v not in (None, vs[0].name):
                raise ValueError(f"two value tensors, {self.v} and {vs[0].name}")
            self.v = vs[0].name
            if self._is_softmax(weight):
                self.softmax = True
            table, prefix = self.nums, "N"
        else:
            if self._is_softmax(weight):
                raise ValueError("softmax must be used as sum[x](softmax[x](S) * V)")
            table, prefix = self.sums, "Z"
        if weight not in table:
            table.append(weight)
        held = _ref(f"{prefix}{table.index(weight)}")
        outside = [(self.visit(f), p) for f, p in const]
        return _product([(held, 1)] + outside) if outside else held

    def _is_softmax(self, e) -> bool:
        return isinstance(e, ir.Normalize) and e.wire == self.key and e.body == _ref("S")

    def _is_value(self, t: ir.TensorRef) -> bool:
        """V: an input along the key wire that also has a wire the scores lack (d)."""
        wires = self.layouts.get(t.name)
        return (t.wires is None and wires is not None and self.key in wires
                and any(w not in self.score_wires for w in wires))

    def _keyed(self, e: ir.Expr) -> bool:
        """Does e vary along the key wire?  A sum over it does not."""
        if isinstance(e, ir.TensorRef):
            wires = e.wires or self.layouts.get(e.name) or self.score_wires  # S is along the scores' wires
            return self.key in wires
        if isinstance(e, ir.WireIndex):
            return e.wire == self.key
        if isinstance(e, ir.Reduce) and self.key in e.wires:
            return False
        return any(self._keyed(c) for c in ir.children(e))


def _factors(e: ir.Expr, power: int = 1) -> list:
    """A product/quotient as [(factor, +1 or -1)]."""
    if isinstance(e, ir.Binary) and e.op in ("*", "/"):
        return _factors(e.lhs, power) + _factors(e.rhs, power if e.op == "*" else -power)
    if isinstance(e, ir.Unary) and e.op == "-":
        return [(ir.Num(-1), 1)] + _factors(e.operand, power)
    return [(e, power)]


def _product(factors) -> ir.Expr:
    num = [f for f, p in factors if p > 0]
    den = [f for f, p in factors if p < 0]
    out = num[0] if num else ONE
    for f in num[1:]:
        out = ir.Binary("*", out, f)
    for f in den:
        out = ir.Binary("/", out, f)
    return simplify(out)
