"""Masks: which blocks of a score matrix a kernel may skip.

A masked score is written ``where(pred, s, -inf)``.  When a masked score
contributes nothing to any reduction downstream (see ``value_when_masked``),
a block of (row range, streamed range) on which ``pred`` is false everywhere
need not be loaded or computed.  This module holds the pure functions both
sides need, so the kernel and the cost pass agree on what is visited:

* ``mask_node(expr)``: the first ``where(pred, s, -inf)`` in a score, and
  ``mask_predicate(node)`` what it keeps (nested masks joined by ``and``).
* ``classify_block(pred, ranges, sizes)``: EMPTY / PARTIAL / FULL for a block,
  by interval arithmetic over affine comparisons (``and``/``or``/``not``
  combine; anything data-dependent, like ``doc[b, q] == doc``, is PARTIAL).
* ``stream_bounds(pred, row, col, sizes)``: the affine conjuncts of ``pred``
  that bound the streamed wire ``col`` in terms of the row wire, as
  ``Bound``s (an ``or`` of bounds of one kind is one, the greatest of its
  forms: the prefix-LM's ``x <= max(q, p - 1)``, ``Bound.alts``).  The
  kernel's loop runs over ``[start rounded down to a block, stop)``
  computed from them (codegen renders the very same formula in Triton);
  ``exact_bounds`` gives them only when they are the whole mask
  (then blocks can be known FULL), and with ``data`` takes terms that read
  those length inputs too, which the kernels load at run time and the
  Python side reads at given values (``at_values``: cost's --lengths) or
  leaves out.
* which blocks those bounds make a loop visit, which are full and which
  live: ``napkin/visits.py``, in Python, with the same formulas.
* ``disjunct_cuts(pred, row, col, sizes)``: a mask of indices alone that no
  loop formula covers (an ``or`` of a lower and an upper bound, ``!=``,
  ``2 * x <= q``) as an ``or`` of
  conjunctions of ``Cut``s, which the cost pass counts row by row as the
  ranges prepass finds them.

Ranges are half-open ``(start, stop)`` like Python's ``range``.
"""
from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass, replace
from typing import Mapping, Optional

from . import ir
from .autodiff import substitute

NEG_INF = float("-inf")


class BlockClass(enum.Enum):
    EMPTY = "empty"      # pred false everywhere: skippable
    PARTIAL = "partial"  # pred true somewhere, or unknown
    FULL = "full"        # pred true everywhere


# --------------------------------------------------------------------------
# Finding the mask.
# --------------------------------------------------------------------------

def _is_neg_inf(e: ir.Expr) -> bool:
    return isinstance(e, ir.Num) and e.value == NEG_INF


def is_mask(e: ir.Expr) -> bool:
    """Whether ``e`` is ``where(pred, s, -inf)`` or ``where(pred, -inf, s)``."""
    return isinstance(e, ir.Call) and e.fn == "where" and (_is_neg_inf(e.args[1]) or _is_neg_inf(e.args[2]))


def mask_node(expr: ir.Expr) -> Optional[ir.Call]:
    """The outermost ``where(pred, s, -inf)`` (or ``where(pred, -inf, s)``) in
    ``expr``, parents first; None when the score is not masked."""
    return next((node for node in ir.walk(expr) if is_mask(node)), None)


_FLIP = {"<": ">=", "<=": ">", ">": "<=", ">=": "<", "==": "!=", "!=": "=="}


def negate(pred: ir.Expr) -> ir.Expr:
    """not pred, with a comparison of affine index arithmetic flipped (not
    x > q is x <= q) and not (a or b) taken as (not a) and (not b), so that
    a mask written ``where(x > q, -inf, s)`` has the affine bounds of
    ``where(x <= q, s, -inf)`` (under a bare ``not`` it had none: every
    block was visited, or found by a prepass at each launch).  Any other
    comparison keeps its ``not``: a NaN compares false both ways, and one
    can come from a tensor or from indices alone (``sqrt(q - x) > 2.5`` is
    NaN above the diagonal, where its flip would drop keys it keeps)."""
    if isinstance(pred, ir.Binary) and pred.op in ("and", "or"):
        return ir.Binary("or" if pred.op == "and" else "and", negate(pred.lhs), negate(pred.rhs))
    if isinstance(pred, ir.Binary) and pred.op in _FLIP and _finite_affine(pred.lhs) and _finite_affine(pred.rhs):
        return ir.Binary(_FLIP[pred.op], pred.lhs, pred.rhs)
    if isinstance(pred, ir.Unary) and pred.op == "not":
        return pred.operand
    return ir.Unary("not", pred)


def _finite_affine(e: ir.Expr) -> bool:
    form = affine(e)
    return form is not None and all(math.isfinite(v) for v in form.values())


def mask_predicate(node: ir.Call) -> ir.Expr:
    """The condition under which the masked score is kept (not -inf): the
    node's own, and that of each mask directly inside its kept branch.
    ``where(x <= q, where(q - x < 256, s, -inf), -inf)`` (masks composed
    through lets: W = a window, S = causal W) keeps s where x <= q and
    q - x < 256, and is -inf wherever that is false: the node's value is
    -inf when either holds -inf, so what ``value_when_masked`` proves of the
    node holds of the whole conjunction.  The outer predicate alone had the
    kernels visit every causal block of such a window (11x the work at 8K)."""
    pred, then, other = node.args
    own, kept = (negate(pred), other) if _is_neg_inf(then) else (pred, then)
    own = _without_not(own)
    return ir.Binary("and", own, mask_predicate(kept)) if is_mask(kept) else own


def _without_not(pred: ir.Expr) -> ir.Expr:
    """pred with each written ``not`` taken through ``negate``: ``where(not x >
    q, s, -inf)`` keeps what ``where(x <= q, s, -inf)`` keeps, and now skips the
    same blocks (under the bare ``not`` it visited every block).  A ``not``
    negate cannot flip (a comparison that can be NaN) stays."""
    if isinstance(pred, ir.Unary) and pred.op == "not":
        inner = _without_not(pred.operand)
        return negate(inner)
    if isinstance(pred, ir.Binary) and pred.op in ("and", "or"):
        return ir.Binary(pred.op, _without_not(pred.lhs), _without_not(pred.rhs))
    return pred


def grown_score(diagram: ir.Diagram, box: ir.Let) -> ir.Let:
    """The box grown by the masks composed on it through lets: ``W =
    where(q - x < 256, sum[d](Q * K), -inf)`` and ``S = where(x <= q, W,
    -inf)`` are one score S = where(x <= q, where(q - x < 256, ...)).  The
    backward takes it as the score softmax normalises, and the cost pass's
    own mask search (schedules codegen refuses) its nested predicate.  A box
    grows only into a reader that is exactly ``where(p, box, -inf)`` (or
    ``where(p, -inf, box)``) of its own layout, with p not reading the box,
    when that reader is its only one and neither is an output.  Other
    elementwise boxes (sigmoid's, ReLU²'s weights) stay the normaliser's,
    as their kernels are written."""
    outputs = {o.name for o in diagram.outputs}

    def reads(e: ir.Expr) -> bool:
        return any(isinstance(n, ir.TensorRef) and n.name == box.name for n in ir.walk(e))

    while box.name not in outputs:
        readers = [let for let in diagram.lets if reads(let.expr)]
        if len(readers) != 1:
            return box
        (r,) = readers
        ref = ir.TensorRef(box.name)
        if not is_mask(r.expr) or ref not in r.expr.args[1:] or r.name in outputs or r.axes != box.axes \
                or reads(r.expr.args[0]):
            return box
        box = replace(r, expr=substitute(r.expr, ref, box.expr))
    return box


# --------------------------------------------------------------------------
# Does a masked score contribute nothing?  A tiny abstract interpreter: the
# mask node is -inf, every other leaf is "some finite number" (None).
# --------------------------------------------------------------------------

def value_when_masked(expr: ir.Expr, node: ir.Expr, sizes: Mapping[str, int] = {}) -> Optional[float]:
    """The value ``expr`` takes wherever ``node`` is -inf, when that value is a
    constant whatever the other (finite) leaves are; else None.

    exp(-inf) = 0, sigmoid(-inf) = 0, relu(-inf)^2 = 0 and 0 * finite = 0, so a
    softmax, a sigmoid or a squared-relu of a masked score contributes 0 to a
    sum; ``S * S`` is +inf, so it does not, and that diagram visits every block.
    """
    return _Masked(node, sizes).eval(expr)


class _Masked:
    def __init__(self, node, sizes):
        self.node, self.sizes = node, sizes

    def eval(self, e: ir.Expr) -> Optional[float]:
        if e == self.node:
            return NEG_INF
        if isinstance(e, ir.Num):
            return float(e.value)
        if isinstance(e, ir.WireSize) and e.wire in self.sizes:
            return float(self.sizes[e.wire])
        if isinstance(e, ir.Unary) and e.op == "-":
            v = self.eval(e.operand)
            return None if v is None else -v
        if isinstance(e, ir.Binary) and e.op in ir.ARITH_OPS:
            return self.arith(e.op, self.eval(e.lhs), self.eval(e.rhs))
        if isinstance(e, ir.Call):
            return self.call(e)
        return None  # indices, tensors, reductions, booleans: unknown

    @staticmethod
    def arith(op, a, b) -> Optional[float]:
        if a is not None and b is not None:
            try:
                v = ir.arith(op, a, b)
            except (ZeroDivisionError, OverflowError, ValueError):
                return None
            return None if isinstance(v, complex) or math.isnan(v) else float(v)
        known = a if a is not None else b
        if known is None:
            return None
        # one side is an unknown finite number
        if op in "+-" and math.isinf(known):
            return known if (op == "+" or a is not None) else -known
        if op == "*" and known == 0:
            return 0.0
        if op == "/" and a == 0:
            return 0.0  # 0 / finite (the unknown divisor is assumed nonzero, as in the reference)
        return None

    def call(self, e: ir.Call) -> Optional[float]:
        if e.fn == "where":
            a, b = self.eval(e.args[1]), self.eval(e.args[2])
            return a if a is not None and a == b else None
        args = [self.eval(a) for a in e.args]
        if e.fn in ("max", "min"):
            a, b = args
            pick = max if e.fn == "max" else min
            if a is not None and b is not None:
                return pick(a, b)
            known = a if a is not None else b
            # max(-inf, finite) is the finite one: unknown; min(-inf, .) = -inf
            if known == NEG_INF and e.fn == "min":
                return NEG_INF
            if known == -NEG_INF and e.fn == "max":
                return -NEG_INF
            return None
        (v,) = args
        if v is None:
            return None
        fns = {"exp": lambda t: math.exp(t) if t < 700 else math.inf,
               "exp2": lambda t: 2.0 ** t if t < 1000 else math.inf,
               "sigmoid": lambda t: 0.0 if t == NEG_INF else 1.0 if t == -NEG_INF else 1 / (1 + math.exp(-t)),
               "relu": lambda t: max(t, 0.0), "abs": abs,
               "tanh": math.tanh,
               "log": lambda t: NEG_INF if t == 0 else math.log(t),
               "log2": lambda t: NEG_INF if t == 0 else math.log2(t),
               "sqrt": math.sqrt,
               "rsqrt": lambda t: math.inf if t == 0 else 1 / math.sqrt(t)}
        try:
            out = fns[e.fn](v)
        except (ValueError, OverflowError, KeyError):
            return None
        return None if math.isnan(out) else float(out)


# --------------------------------------------------------------------------
# Affine forms: {wire: coeff} for indices, {"|w|": coeff} for sizes still
# symbolic, {"": const}, and {"w//n": coeff} for an index floor-divided by a
# whole constant n >= 2 (a chunk's number: x // 128 == q // 128 keeps the
# pairs of one chunk), which every function below takes as one more
# non-decreasing term of its index.  With ``data`` named, {"@n": coeff} for a
# read of such an input: a length the kernel loads once per program (n[b] of
# x < n[b], a scalar w of q - x < w), a term its loop bounds read at run time
# as they read a size (``length_key``).
# --------------------------------------------------------------------------

Affine = dict


def length_key(name: str) -> str:
    """The affine form's key of a read of length input ``name``."""
    return f"@{name}"


def affine(e: ir.Expr, sizes: Mapping[str, int] = {}, data: frozenset = frozenset()) -> Optional[Affine]:
    """``e`` as an affine form over wire indices and symbolic sizes, or None;
    reads of the inputs named in ``data`` are terms of their own (length_key)."""
    if isinstance(e, ir.TensorRef) and e.name in data and e.steps is None:
        return {length_key(e.name): 1}
    if isinstance(e, ir.Num):
        return None if math.isinf(e.value) else {"": e.value}
    if isinstance(e, ir.WireIndex):
        return {e.wire: 1}
    if isinstance(e, ir.WireSize):
        return {"": sizes[e.wire]} if e.wire in sizes else {f"|{e.wire}|": 1}
    if isinstance(e, ir.Unary) and e.op == "-":
        a = affine(e.operand, sizes, data)
        return None if a is None else _scale(a, -1)
    if isinstance(e, ir.Binary) and e.op == "//":
        a, n = affine(e.lhs, sizes, data), ir.fold_constant(e.rhs, sizes)
        if a is None or n is None or len(a) != 1 or not float(n).is_integer() or n < 1:
            return None
        ((key, coeff),), n = a.items(), int(n)
        if n == 1 or key == "":
            return a if n == 1 else {"": a[""] // n} if a[""] // n else {}
        return {floor_key(key, n): 1} if coeff == 1 and not key.startswith(("|", "@")) and "//" not in key else None
    if isinstance(e, ir.Binary) and e.op in ("+", "-", "*"):
        a, b = affine(e.lhs, sizes, data), affine(e.rhs, sizes, data)
        if a is None or b is None:
            return None
        if e.op == "*":
            if set(a) <= {""}:
                return _scale(b, a.get("", 0))
            if set(b) <= {""}:
                return _scale(a, b.get("", 0))
            return None
        return _add(a, _scale(b, -1) if e.op == "-" else b)
    return None


def floor_key(wire: str, n: int) -> str:
    """The affine form's key of ``wire // n``."""
    return f"{wire}//{n}"


def floor_of(key: str) -> Optional[tuple[str, int]]:
    """(wire, n) of a ``wire // n`` key, else None."""
    if "//" not in key:
        return None
    wire, n = key.split("//")
    return wire, int(n)


def _index_term(key: str) -> tuple[str, int]:
    """(wire, n) of an index key: ``w`` is (w, 1), ``w//n`` is (w, n); the
    size, length and constant keys are ("", 1)."""
    if key == "" or key.startswith(("|", "@")):
        return "", 1
    return floor_of(key) or (key, 1)


def _scale(a: Affine, k) -> Affine:
    return {key: v * k for key, v in a.items() if v * k != 0}


def _add(a: Affine, b: Affine) -> Affine:
    out = dict(a)
    for key, v in b.items():
        out[key] = out.get(key, 0) + v
    return {key: v for key, v in out.items() if v != 0}


def _range_of(form: Affine, ranges, sizes) -> Optional[tuple[float, float]]:
    """Inclusive [lo, hi] of an affine form over half-open index ranges."""
    lo = hi = 0.0
    for key, c in form.items():
        if key == "":
            lo, hi = lo + c, hi + c
        elif key.startswith("|"):
            wire = key[1:-1]
            if wire not in sizes:
                return None
            lo, hi = lo + c * sizes[wire], hi + c * sizes[wire]
        else:
            wire, n = _index_term(key)
            if wire not in ranges:
                return None
            start, stop = ranges[wire]
            a, b = c * (start // n), c * ((stop - 1) // n)
            lo, hi = lo + min(a, b), hi + max(a, b)
    return lo, hi


# --------------------------------------------------------------------------
# Classifying one block.
# --------------------------------------------------------------------------

def classify_block(pred: ir.Expr, ranges: Mapping[str, tuple[int, int]],
                   sizes: Mapping[str, int]) -> BlockClass:
    """EMPTY when ``pred`` is false at every point of the block, FULL when true
    at every point, else PARTIAL.  ``ranges`` maps wires to half-open index
    ranges (a wire missing from it is unknown); ``sizes`` binds ``|w|``."""
    truth = _truth(pred, ranges, sizes)
    return {False: BlockClass.EMPTY, True: BlockClass.FULL}.get(truth, BlockClass.PARTIAL)


def _truth(e: ir.Expr, ranges, sizes) -> Optional[bool]:
    """True / False when ``e`` has that value on the whole block, else None."""
    if isinstance(e, ir.Unary) and e.op == "not":
        t = _truth(e.operand, ranges, sizes)
        return None if t is None else not t
    if isinstance(e, ir.Binary) and e.op in ("and", "or"):
        a, b = _truth(e.lhs, ranges, sizes), _truth(e.rhs, ranges, sizes)
        if e.op == "and":
            return False if False in (a, b) else True if a is True and b is True else None
        return True if True in (a, b) else False if a is False and b is False else None
    if isinstance(e, ir.Binary) and e.op in ir.COMPARE_OPS:
        la, ra = affine(e.lhs, sizes), affine(e.rhs, sizes)
        if la is None or ra is None:
            return None
        span = _range_of(_add(la, _scale(ra, -1)), ranges, sizes)
        if span is None:
            return None
        lo, hi = span  # of lhs - rhs
        if e.op == "<":
            return True if hi < 0 else False if lo >= 0 else None
        if e.op == "<=":
            return True if hi <= 0 else False if lo > 0 else None
        if e.op == ">":
            return True if lo > 0 else False if hi <= 0 else None
        if e.op == ">=":
            return True if lo >= 0 else False if hi < 0 else None
        if e.op == "==":
            return True if lo == hi == 0 else False if lo > 0 or hi < 0 else None
        return False if lo == hi == 0 else True if lo > 0 or hi < 0 else None
    return None


# --------------------------------------------------------------------------
# Loop bounds along the streamed wire.
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class Bound:
    """One affine conjunct solved for the streamed index c:

    lower: c >= row_coeff * (r // step) + rest;   upper: c <= row_coeff * (r // step) + rest.
    ``rest`` is an affine form over symbolic sizes, lengths (``@n``: the
    kernel's load of a length input, ``lengths_read``) and a constant (ints).
    ``step`` is 1 (r itself) or a chunk's length (x // 128 == q // 128 is
    c >= 128 * (r // 128) and c <= 128 * (r // 128) + 127).  r // step does
    not decrease with r, so over a block of rows [r0, r1] a lower bound is
    smallest at r0 when row_coeff > 0 (else at r1); an upper bound is
    largest at r1 when row_coeff > 0 (else at r0).
    """

    kind: str
    row_coeff: int
    rest: tuple[tuple[str, int], ...]
    step: int = 1
    # An ``or`` of bounds of one kind (``_union``): the bound is the greatest of its
    # parts' values (an upper one; the least, a lower one).  Every part's row_coeff
    # has one sign or is 0, and a part reading the row comes first, so row_coeff's
    # sign and at_row() are the union's: the max of non-decreasing forms does not
    # decrease, and a block's loosest and tightest rows are every part's.
    alts: tuple["Bound", ...] = ()

    @property
    def parts(self) -> tuple["Bound", ...]:
        """The forms whose greatest (upper) or least (lower) value is the bound: itself alone,
        or for an ``or`` each disjunct's (``alts``), each with no alts of its own."""
        return (replace(self, alts=()), *self.alts) if self.alts else (self,)

    @property
    def sizes_read(self) -> frozenset[str]:
        """The wires whose sizes ``rest`` reads (``value`` needs them)."""
        return frozenset(key[1:-1] for p in self.parts for key, _ in p.rest if key.startswith("|"))

    @property
    def lengths_read(self) -> frozenset[str]:
        """The length inputs ``rest`` reads: known at run time alone (``at_values``)."""
        return frozenset(key[1:] for p in self.parts for key, _ in p.rest if key.startswith("@"))

    def value(self, r, sizes: Mapping[str, int]):
        """The bound at row r: row_coeff * (r // step) + rest, of a union its parts'
        greatest (upper) or least (lower); ``r`` an int or a numpy array of rows."""
        if not self.alts:
            return self.row_coeff * (r // self.step) + rest_value(self.rest, sizes)
        values = [p.value(r, sizes) for p in self.parts]
        if all(isinstance(v, int) for v in values):
            return (max if self.kind == "upper" else min)(values)
        import numpy as np   # a row array (documents.bound_interval, pairs)

        return functools.reduce(np.maximum if self.kind == "upper" else np.minimum, values)

    def first_row(self, t: int) -> int:
        """The least row r with r // step >= t (t >= 0)."""
        return t * self.step

    def last_row(self, u: int) -> int:
        """The greatest row r with r // step <= u (u >= 0)."""
        return u * self.step + self.step - 1

    def at_row(self) -> str:
        """Which end of the row block gives the loosest bound: "first" or "last"."""
        if self.kind == "lower":
            return "first" if self.row_coeff > 0 else "last"
        return "last" if self.row_coeff > 0 else "first"


def work_grows(bounds: tuple[Bound, ...], grid: str) -> bool:
    """Whether a program's loop visits more blocks the later its block along
    the grid's wire ("row": the forward and dQ kernels, one program per row
    block; "col": dK/dV, one per key block): its range widens and never
    narrows.  Causal (c <= r): rows grow, key blocks shrink.  A sliding
    window moves both ends (no growth); no bounds, none."""
    grows = shrinks = False
    for b in bounds:
        if b.row_coeff == 0:  # the same for every row; for keys, a cap leaves the last key blocks none
            shrinks = shrinks or (grid == "col" and b.kind == "upper")
            continue
        if grid == "row":   # c <= a r + k widens with r when a > 0; c >= a r + k when a < 0
            wider = (b.kind == "upper") == (b.row_coeff > 0)
        else:               # for key c, the rows a lower bound admits grow with c, an upper bound's shrink
            wider = b.kind == "lower"
        grows, shrinks = grows or wider, shrinks or not wider
    return grows and not shrinks


def program_order(bounds: tuple[Bound, ...], grid: str) -> str:
    """The Triton expression of a kernel's block index along grid axis 0:
    reversed when later blocks carry more work (work_grows), so the longest
    programs start first and the short ones fill the last wave instead of
    leaving it to a few long ones (longest processing time first, the list
    scheduling rule).  Only the order changes: every block is still one
    program, so results and bytes are the same."""
    if work_grows(bounds, grid):
        return "tl.num_programs(0) - 1 - tl.program_id(0)  # heaviest blocks first (masks.program_order)"
    return "tl.program_id(0)"


def conjuncts(e: ir.Expr) -> tuple[ir.Expr, ...]:
    """The operands of ``e``'s top-level ``and`` chain (``(e,)`` for any other ``e``)."""
    return tuple(_conjuncts(e))


def _conjuncts(e: ir.Expr, op: str = "and"):
    """The operands of ``e``'s top-level chain of ``op`` (``and``; ``or``: its disjuncts)."""
    if isinstance(e, ir.Binary) and e.op == op:
        yield from _conjuncts(e.lhs, op)
        yield from _conjuncts(e.rhs, op)
    else:
        yield e


def stream_bounds(pred: ir.Expr, row: str, col: str,
                  sizes: Mapping[str, int] = {}) -> tuple[Bound, ...]:
    """The conjuncts of ``pred`` that bound index ``col`` by an integer affine
    function of index ``row`` (coefficient of col +-1, integer coefficients,
    no other index).  ``sizes`` are the fixed wire sizes folded to numbers."""
    bounds = []
    for c in _conjuncts(pred):
        bounds += [b for b in _conjunct_bounds(c, row, col, sizes) or () if b is not None]
    return tuple(bounds)


def _conjunct_bounds(c: ir.Expr, row: str, col: str, sizes,
                     data: frozenset = frozenset()) -> Optional[list[Optional[Bound]]]:
    """One conjunct as bounds on ``col``: one entry per ``form <= 0`` it
    amounts to (two for ``==``), None where a form is not such a bound; an
    ``or`` of bounds of one kind is one bound (``_union``); None for anything
    else."""
    if isinstance(c, ir.Binary) and c.op == "or":
        return [_union(c, row, col, sizes, data)]
    forms = _forms(c, sizes, data)
    return None if forms is None else [_solve(form, row, col) for form in forms]


def _union(c: ir.Expr, row: str, col: str, sizes, data: frozenset) -> Optional[Bound]:
    """An ``or`` whose every disjunct is one bound, all upper (or all lower), their
    row coefficients of one sign or 0, as one bound: ``c <= f1(r) or c <= f2(r)`` is
    ``c <= max(f1(r), f2(r))`` (Bound.alts), exact.  The prefix-LM's ``x <= q or
    x < p[b]`` is ``x <= max(q, p - 1)``: one interval of keys per row, which the
    loops bound by formula.  Of one sign so that the greatest of the forms is
    monotone in the row as each is (a block's loosest and tightest rows are every
    form's, and dK/dV's rows meeting the union are one run: the union of runs that
    all end, or all start, at an end of the rows).  None for any other ``or``
    (StreamingLLM's ``q - x < w or x < 4`` mixes a lower and an upper bound: two
    intervals, the ranges prepass's)."""
    parts = []
    for d in _conjuncts(c, "or"):
        got = _conjunct_bounds(d, row, col, sizes, data)
        if got is None or len(got) != 1 or got[0] is None:
            return None
        if got[0] not in parts:
            parts.append(got[0])
    if len({p.kind for p in parts}) != 1 or len({(p.row_coeff > 0) - (p.row_coeff < 0) for p in parts} - {0}) > 1:
        return None
    parts.sort(key=lambda p: p.row_coeff == 0)   # a part reading the row first: row_coeff and at_row() are the union's
    return replace(parts[0], alts=tuple(parts[1:]))


def _forms(c: ir.Expr, sizes, data: frozenset = frozenset()) -> Optional[list[Affine]]:
    """An affine comparison as the forms ``form <= 0`` it amounts to (two
    for ``==``; integer ones: ``<`` is ``<= -1``), else None."""
    if not (isinstance(c, ir.Binary) and c.op in ("<", "<=", ">", ">=", "==")):
        return None
    la, ra = affine(c.lhs, sizes, data), affine(c.rhs, sizes, data)
    if la is None or ra is None:
        return None
    diff = _add(la, _scale(ra, -1))  # lhs - rhs
    return {"<": [_add(diff, {"": 1})], "<=": [diff], ">": [_add(_scale(diff, -1), {"": 1})],
            ">=": [_scale(diff, -1)], "==": [diff, _scale(diff, -1)]}[c.op]


@dataclass(frozen=True)
class Cut:
    """One affine comparison of the row and key indices r and c, as the
    cost pass counts a prepass mask by (visits.prepass_visits):

        col_coeff * (c // col_step) + row_coeff * (r // row_step) + rest <= 0

    A ``Bound`` is the kernels' loop formula, its key coefficient +-1; a cut
    takes any whole coefficients (``2 * x <= q``), which no loop formula
    renders but a row's kept keys (a key's kept rows) are still one run."""

    col_coeff: int
    col_step: int
    row_coeff: int
    row_step: int
    rest: tuple[tuple[str, int], ...]


def _cut(form: Affine, row: str, col: str) -> Optional[Cut]:
    """One ``form <= 0`` as a cut, None where a coefficient is no whole
    number, another index is read, or a wire has two terms (x + x // 4)."""
    if any(not float(v).is_integer() for v in form.values()):
        return None
    if any(_index_term(k)[0] not in ("", row, col) for k in form):
        return None   # another index
    terms = [[k for k in form if _index_term(k)[0] == w] for w in (col, row)]
    if any(len(t) > 1 for t in terms):
        return None
    (ck, cc, cn), (rk, rc, rn) = ((t[0], int(form[t[0]]), _index_term(t[0])[1]) if t else (None, 0, 1)
                                  for t in terms)
    return Cut(cc, cn, rc, rn, tuple(sorted((k, int(v)) for k, v in form.items() if k not in (ck, rk))))


# A term of 2^30 or more is no bound a real sequence reaches (the mask's where
# still applies it entry by entry): q - x < 99999999999999999999 rendered its
# constant into the block bounds, a literal Triton refuses, and 2147483647
# overflowed the bounds' int32 arithmetic (_row_last + c + 1).
_BOUND_LIMIT = 2 ** 30


def _solve(form: Affine, row: str, col: str) -> Optional[Bound]:
    """One ``form <= 0`` as a bound on ``col``: a cut whose key coefficient is
    +-1, solved for the key; None for any other form."""
    cut = _cut(form, row, col)
    if cut is None or cut.col_coeff not in (1, -1):
        return None
    # cc * (c // n) + cr * (r // step) + rest <= 0, every term a whole number
    n, cr, rest = cut.col_step, cut.row_coeff, dict(cut.rest)
    if cut.col_coeff == 1:   # c // n <= -cr * (r // step) - rest: c <= n * (that) + n - 1
        cr, rest = -n * cr, {k: -n * v for k, v in rest.items()}
        rest[""] = rest.get("", 0) + n - 1
        kind = "upper"
    else:                    # c // n >= cr * (r // step) + rest: c >= n * (that)
        cr, rest = n * cr, {k: n * v for k, v in rest.items()}
        kind = "lower"
    if any(abs(v) >= _BOUND_LIMIT for v in (cr, *rest.values())):
        return None   # no bound within any real length; the kernels' int32 block arithmetic could not hold it
    return Bound(kind, cr, tuple(sorted((k, v) for k, v in rest.items() if v)), cut.row_step if cr else 1)


def rest_value(rest, sizes) -> int:
    """``rest`` at these sizes; a length's term has no value here (``at_values`` gives it one)."""
    total = 0
    for key, v in rest:
        if key.startswith("@"):
            raise ValueError(f"the bound reads the length {key[1:]}, known at run time alone (masks.at_values)")
        total += v if key == "" else v * sizes[key[1:-1]]
    return total


def lengths_read(bounds) -> tuple[str, ...]:
    """The length inputs any of ``bounds`` reads (Bound.lengths_read), sorted."""
    return tuple(sorted({n for b in bounds or () for n in b.lengths_read}))


def at_values(bounds: tuple[Bound, ...], values: Mapping[str, int]) -> tuple[Bound, ...]:
    """The bounds as the Python side counts them (the cost pass, visits):
    a length given in ``values`` (cost's --lengths) read as that number at
    every index; a bound reading one not given dropped, so what is counted
    is an upper bound of what the kernel visits (its loop is at most the
    others' range)."""
    out = []
    for b in bounds:
        if not b.lengths_read:
            out.append(b)
        elif b.lengths_read <= set(values):
            # a union's parts each (one part dropped would make it tighter, no upper bound:
            # without every length the whole union goes)
            read = [_read_at(p, values) for p in b.parts]
            out.append(replace(read[0], alts=tuple(read[1:])))
    return tuple(out)


def _read_at(b: Bound, values: Mapping[str, int]) -> Bound:
    """One part with each length it reads replaced by its value."""
    rest = dict(b.rest)
    for name in b.lengths_read:
        rest[""] = rest.get("", 0) + rest.pop(length_key(name)) * values[name]
    return replace(b, rest=tuple(sorted((k, v) for k, v in rest.items() if v)))


# An `or` of conjunctions past this many is left to the prepass alone: the
# cost pass would walk every row once per conjunction.
MAX_DISJUNCTS = 16


def disjunct_cuts(pred: ir.Expr, row: str, col: str,
                  sizes: Mapping[str, int] = {}) -> Optional[tuple[tuple[Cut, ...], ...]]:
    """``pred`` as an ``or`` of conjunctions of cuts (its ``and``s
    distributed over its ``or``s, ``!=`` as ``<`` or ``>``), or None when
    some comparison is no cut (an id, a tensor, another index, a fraction)
    or there are more than MAX_DISJUNCTS.  StreamingLLM's ``x <= q and
    (q - x < w or x < 4)`` is ``(x <= q, x > q - w) or (x <= q, x < 4)``:
    a tile is live where some conjunction holds on a pair of it, so its live
    blocks are the union of the conjunctions' (visits.prepass_visits)."""
    out = []
    for atoms in _dnf(pred):
        found = []
        for c in atoms:
            got = _cuts(c, row, col, sizes)
            if got is None:
                return None
            found += got
        out.append(tuple(found))
    return tuple(out) if 0 < len(out) <= MAX_DISJUNCTS else None


def _cuts(c: ir.Expr, row: str, col: str, sizes) -> Optional[list[Cut]]:
    """One comparison as cuts (two for ``==``), None for anything else."""
    forms = _forms(c, sizes)
    cuts = None if forms is None else [_cut(form, row, col) for form in forms]
    return None if cuts is None or None in cuts else cuts


def _dnf(e: ir.Expr) -> list[tuple[ir.Expr, ...]]:
    """The conjunctions whose ``or`` is ``e`` (``not`` pushed in by ``negate``); more than
    MAX_DISJUNCTS cut short (the caller refuses)."""
    if isinstance(e, ir.Binary) and e.op == "or":
        return (_dnf(e.lhs) + _dnf(e.rhs))[:MAX_DISJUNCTS + 1]
    if isinstance(e, ir.Binary) and e.op == "and":
        return [a + b for a in _dnf(e.lhs) for b in _dnf(e.rhs)][:MAX_DISJUNCTS + 1]
    if isinstance(e, ir.Binary) and e.op == "!=":
        return [(replace(e, op="<"),), (replace(e, op=">"),)]
    if isinstance(e, ir.Unary) and e.op == "not":
        pushed = negate(e.operand)   # through and / or to flipped comparisons (not of a NaN-prone one stays)
        return [(e,)] if isinstance(pushed, ir.Unary) else _dnf(pushed)
    return [(e,)]


def exact_bounds(pred: Optional[ir.Expr], row: str, col: str,
                 sizes: Mapping[str, int] = {}, data: frozenset = frozenset()) -> Optional[tuple[Bound, ...]]:
    """The bounds whose conjunction is exactly ``pred`` (``()`` for no mask,
    pred None), or None when a conjunct is anything else (a document mask's
    ``doc[b, q] == doc``, an ``or``, another index): then no block is known
    full.  In ``stream_bounds`` order, so the same bounds as the loop's.
    ``data``: the length inputs a bound may read (affine: their reads are
    terms of their own)."""
    if pred is None:
        return ()
    out = []
    for c in _conjuncts(pred):
        got = _conjunct_bounds(c, row, col, sizes, data)
        if got is None or None in got:
            return None
        out += got
    return tuple(out)
