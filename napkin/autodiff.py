"""Symbolic differentiation: the elementwise calculus the backward kernels come from.

Everything here is a pure function over the frozen nodes of ``napkin.ir``;
nothing is mutated and every output is deterministic.

``diff(expr, wrt) -> Expr``
    The derivative of an elementwise expression with respect to the
    sub-expression ``wrt`` (matched structurally with ``==``): a tensor
    (``TensorRef("slope")``), a placeholder, or the raw score node
    ``sum[d](Q * K)``.  The result is simplified.  A Reduce or Normalize
    that is not ``wrt`` but contains it raises ValueError: reductions are
    the normaliser layer's business (napkin/gradrules.py).  Masks stay
    NaN-free: the derivative of ``where(m, s, -inf)`` is ``where(m, 1, 0)``,
    and a product with such a masked derivative is pushed inside the where
    (``g * where(m, a, 0)`` -> ``where(m, g * a, 0)``) so a masked entry
    is selected away instead of computed as ``inf * 0``.
``simplify(expr) -> Expr``
    Constant folding and identities that keep generated code small and
    never change a value (``x * 0`` folds only when x cannot be inf/NaN).
``substitute(expr, old, new) -> Expr``
    Replace every sub-tree equal to ``old``.

This module knows nothing of attention, wires or kernels.  The backward of a
streamed attention, which differentiates through its normaliser (softmax,
or sums), is built from these functions by ``napkin/gradrules.py``; its
smart constructors (``_add``, ``_mul``, ...) are shared with that module.

tests/test_autodiff.py checks every formula here against torch.autograd in
float64, through a small wire-named interpreter of the IR (``evaluate``).
"""
from __future__ import annotations

import math
from typing import Optional

from . import ir

ZERO = ir.Num(0)
ONE = ir.Num(1)
LN2 = math.log(2.0)


def _is_num(e: ir.Expr, value) -> bool:
    return isinstance(e, ir.Num) and not isinstance(e.value, bool) and e.value == value


def _contains(e: ir.Expr, sub: ir.Expr) -> bool:
    return any(node == sub for node in ir.walk(e))


# each direct child rewritten (the rules' and this module's rewrites: ir.map_children)
_map = ir.map_children


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

def diff_read(expr: ir.Expr, refs) -> ir.Expr:
    """d expr / dT for an input T read one way, written as any of ``refs`` (tau, tau[x]
    of a tau declared [x], sq[b, h, q // 128]): each made one node to differentiate by
    (as written they were several, and a derivative by one of them silently missed the
    rest), the derivative reading T as ``refs[0]`` does."""
    plain = ir.TensorRef(refs[0].name)
    for r in refs:
        expr = substitute(expr, r, plain)
    return substitute(diff(expr, plain), plain, refs[0])


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
    if e.op not in ir.ARITH_OPS or e.op in ("//", "%"):
        return ZERO  # comparisons, logic, floor division and remainder: of whole numbers (the checker's rule)
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
    # power: torch's two rules, summed where both vary (a^b * (b' log a + b a' / a)
    # was NaN at a = 0, where b a' / a and b' log a are each 0 * inf)
    by_base = ZERO if _is_num(da, 0) else _mul(da, _mul(b, ir.Binary("^", a, _sub(b, ONE))))
    if not _is_num(by_base, 0) and not isinstance(b, ir.Num):
        # torch's: 0 where the exponent is 0 (b a^(b-1) is 0 * inf at a = 0 there)
        by_base = ir.Call("where", (ir.Binary("==", b, ZERO), ZERO, by_base))
    if _is_num(db, 0):  # a^c: c * a^(c-1) * a'
        return by_base
    # d/db a^b = a^b log a, taken as 0 where a = 0 and b >= 0 (torch's rule: 0^b is
    # flat in b there, and one NaN would poison a learned exponent's whole sum);
    # at a = 0, b < 0 it is inf * -inf = -inf, written so (no `and`: the interpreter
    # cannot take a loaded scalar's comparison & a tile's)
    at_zero = ir.Call("where", (ir.Binary(">=", b, ZERO), ZERO, ir.Num(-math.inf)))
    by_exponent = _mul(db, ir.Call("where", (ir.Binary("==", a, ZERO), at_zero, _mul(e, ir.Call("log", (a,))))))
    return _add(by_base, by_exponent)


def _constant(e: ir.Expr) -> bool:
    """Numbers and wire sizes only: what reference() computes as a Python
    number, so max(S, 0) is torch.clamp there, not torch.maximum."""
    return not any(isinstance(n, (ir.TensorRef, ir.WireIndex, ir.Reduce, ir.Normalize)) for n in ir.walk(e))


def _d_call(e: ir.Call, wrt) -> ir.Expr:
    fn, args = e.fn, e.args
    if fn == "where":  # the condition is piecewise constant
        return _where(args[0], _d(args[1], wrt), _d(args[2], wrt))
    if fn in ("max", "min"):  # subgradient: follow the selected argument, as torch does
        a, b = args
        over, under = (">", "<") if fn == "max" else ("<", ">")
        da, db = _d(a, wrt), _d(b, wrt)
        if da == db:                       # max(u, u), or both flat in wrt: no choice to make
            return da
        if _constant(a) or _constant(b):   # torch.clamp's: a tie follows the varying argument
            return _where(ir.Binary(over + "=", a, b), da, db) if _constant(b) else \
                _where(ir.Binary(under + "=", a, b), db, da)
        # torch.maximum's: a tie splits the gradient evenly
        tie = _mul(_add(da, db), ir.Num(0.5))
        return _where(ir.Binary(over, a, b), da, _where(ir.Binary(under, a, b), db, tie))
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
    if fn == "abs":   # du once: where(u < 0, -du, du) doubled it at each nested abs (2^depth nodes)
        # times sign(u), 0 at u = 0 as torch's (abs'(0) = 1 disagreed with reference() under autograd)
        sign = ir.Call("where", (ir.Binary("<", u, ZERO), ir.Num(-1),
                                 ir.Call("where", (ir.Binary(">", u, ZERO), ONE, ZERO))))
        return _mul(du, sign)
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
    if op == "^" and ((x == 0 and y < 0) or (x < 0 and not float(y).is_integer())):
        return None   # (0.0 ^ -inf and (-2.0) ^ inf are numbers to Python: kept unfolded, as before)
    try:
        r = ir.arith(op, x, y)   # x / 0, x // 0 and x % 0 raise
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
