"""Gradient rules of the normaliser families: a streamed attention's backward, as data.

The elementwise calculus (``diff``, ``simplify``, ``substitute``) is in
``napkin/autodiff.py``; this module takes an attention diagram's normaliser
apart and builds from that calculus the IR its backward kernels run, a
``GradRule``.  It is split from autodiff because it is about attention (wire
roles, the saved row state, FlashAttention's rows/tile split), not calculus.
Everything here is pure and deterministic, as there.

``softmax_rule(...)``, ``sums_rule(...)``: the rule from explicit pieces.
``grad_plan(diagram) -> GradRule``: recognise a diagram's streamed form
    and build its rule.  Forms:
    (a) O = sum[x](softmax[x](S) * V)            dS = P * (dP - delta)
    (b) O = F(N_i.., Z_j..), N_i = sum[x](a_i(S) * V), Z_j = sum[x](c_j(S))
                               dS = sum_i a_i'(S) dA_i + sum_j c_j'(S) dZ_j
                               dA_i = gN_i dP when each gN_i = dF/dN_i is
                               per row, else sum_f(dN_i * V)
    (c) lse = logsumexp[x](S) next to either:  dS += P * dlse
    A gate on the value, sum[x](a(S) * V * gate) with gate along x and V's
    wires alone, is either form with the value V * gate (``value_gate``).
    napkin/gradform.py takes the output apart into these pieces.
A rule's expressions are ordinary IR over the diagram's inputs plus fixed
placeholder names (``PLACEHOLDERS``, ``is_placeholder``), each with its wires
in ``GradRule.layouts``, so the backward code generator
(napkin/codegen/backward.py) turns them into Triton exactly as it does the
forward's expressions.

tests/test_autodiff.py checks every rule here against torch.autograd in
float64, through a small wire-named interpreter of the IR (``evaluate``).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Mapping, Optional, Sequence

from . import ir, masks
from .gradform import Form, NoGrad, check_gate, factors as _factors, product as _product
from .printer import expr_text
from .autodiff import ONE, ZERO, _add, _contains, _map, _mul, _neg, _sub, diff, diff_read, simplify, substitute

NEG_INF = ir.Num(float("-inf"))


def normalisers(diagram: ir.Diagram) -> list:
    """Every softmax and logsumexp node of the diagram's boxes, in order: where
    a score is normalised (grad_plan's, and training's boxing of an inline one)."""
    return [n for let in diagram.lets for n in ir.walk(let.expr)
            if isinstance(n, ir.Normalize) or (isinstance(n, ir.Reduce) and n.op == "logsumexp")]


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

PLACEHOLDERS = ("S", "R", "O", "dO", "lse", "dlse", "delta", "P", "dP", "dS", "dR", "Aw", "lseg")
_INDEXED = re.compile(r"(N|Z|A|dN|dZ|dA|gN|dT)\d+")


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
    raw       the raw contraction R stands for, or several added up (MLA's score): each
              pair's inputs take dR (None: the tile starts at S).
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
    # (input, its row value dT_i): an input the output's row function F reads (a sink, a gate)
    # gets dT_i = sum_f(dO * dF/dT) from the rows, summed in torch over the row wires it lacks
    row_grads: tuple[tuple[str, str], ...] = ()
    # (input, the wires F reads it along, their steps or None): its own wires, or others (a
    # relabelling; blocks of a wire, tau[h // 2], whose dT_i the launcher sums by blocks too)
    row_reads: tuple[tuple[str, tuple[str, ...], Optional[tuple[int, ...]]], ...] = ()
    # an input along the key wire and V's wires alone that multiplies V in every contraction
    # (sum[x](P * V * gate)): the rule's value is V * gate, which the launcher forms in torch
    # (forward: the kernel's own product; the rows and tiles are the ungated rule's)
    value_gate: Optional[str] = None

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
                 raw: Optional[ir.Expr] = None, output: Optional[ir.Expr] = None,
                 input_layouts: Optional[Mapping[str, tuple[str, ...]]] = None) -> GradRule:
    """Form (a), optionally with (c): O = sum[key](softmax[key](S) * V) [, lse].

    score: the score box's expression (then S is the tile's first binding);
    raw: the contraction in it that R stands for, with input_layouts
    (input name -> wires) to sum its inputs' gradients.
    output: O = F(N0, lse, inputs) of the attention N0 = sum[key](softmax[key](S) * V)
    and its row's lse, elementwise (an attention sink's N0 * sigmoid(lse - sink),
    a gate's N0 * sigmoid(G)); None or N0 itself: O is N0 (see _epilogue_rule).
    """
    if output is not None and output != _ref("N0"):
        return _epilogue_rule(key, score_wires, value_wires, value=value, lse_grad=lse_grad, score=score,
                              raw=raw, output=output, input_layouts=input_layouts or {})
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


def _epilogue_rule(key, score_wires, value_wires, *, value, lse_grad, score, raw, output,
                   input_layouts) -> GradRule:
    """Form (a) under a row epilogue: O = F(N0, lse, ..) with N0 = sum[key](softmax[key](S) * V).

    The chain rule through F is per row: dN0 = dO g with g = dF/dN0, and F's
    own lse adds sum_f(dO h), h = dF/dlse, to the row's dlse.  So softmax's dS
    = P (dP - delta) holds with dP = sum_f(dN0 * V) and delta = sum_f(dN0 *
    N0) - sum_f(dO h) [- dlse]: one rows pass more arithmetic, the same loop.
    Where g is one value a row (a sink's sigmoid(lse - sink)) the rows keep
    gN0 = g and the tile scales softmax's own dP = sum_f(dO * V), so dO stays
    the 16-bit operand it is; else (a gate G[.., d]) dN0 is a float32 [rows,
    feature] row state the tiles read instead of dO.  N0 and lse are saved by
    the forward (N0 is no output: F is)."""
    w = _roles(key, score_wires, value_wires)
    S, dO, P, N0, lse = _ref("S"), _ref("dO"), _ref("P"), _ref("N0"), _ref("lse")
    g, h = (_complement(simplify(diff(output, x))) for x in (N0, lse))
    if g == ZERO:
        raise NoGrad(f"the output {expr_text(output)} does not depend on the attention sum[{key}](softmax[{key}]"
                     "(S) * V)")
    forward = [("P", ir.Normalize("softmax", key, S)),
               ("N0", ir.Reduce("sum", (key,), ir.Binary("*", ir.Normalize("softmax", key, S), _ref(value)))),
               ("lse", ir.Reduce("logsumexp", (key,), S)),
               ("O", output)]
    per_row = _row_values(w, input_layouts)
    # two sums, each with its per-row factors outside: a sink's are both sum[d](dO * N0), computed once
    delta = _sub(_row_sum(w.feat, dO, _mul(g, N0), per_row), _row_sum(w.feat, dO, h, per_row))
    if lse_grad:
        delta = ir.Binary("-", delta, _ref("dlse"))
    tile = [("P", _recompute_p())]
    log_g, delta_g = _log_of(g), _without(delta, g)
    if per_row(g) and log_g is not None and delta_g is not None:
        # g > 0 one value a row, and a factor of delta: P g = exp(S - (lse - log g)), so with
        # lseg = lse - log g and delta / g as the row state the tiles are softmax's own,
        # dS = P g (dP - delta / g) and dV = sum_q(P g dO): no tile more (a sink's dK/dV at head
        # dim 128 spilled 232 B with Aw = P * gN0 beside P, compiled for sm_90; none so)
        lse0 = ir.Call("where", (ir.Binary("==", lse, NEG_INF), ZERO, lse))
        rows = [("lseg", _sub(lse0, log_g)), ("delta", delta_g)]
        tile = [("P", ir.Call("exp", (ir.Binary("-", S, _ref("lseg")),))),
                ("dP", ir.Reduce("sum", w.feat, ir.Binary("*", dO, _ref(value))))]
        ds = _mul(P, ir.Binary("-", _ref("dP"), _ref("delta")))
        dv = ir.Binary("*", P, dO)
    elif per_row(g):
        # one value a row: dP = g sum_f(dO * V), dV = sum_q(P g dO)
        gn = g if isinstance(g, ir.Num) else _ref("gN0")
        rows = ([] if isinstance(g, ir.Num) else [("gN0", g)]) + [("delta", delta)]
        tile.append(("dP", ir.Reduce("sum", w.feat, ir.Binary("*", dO, _ref(value)))))
        ds = _mul(P, ir.Binary("-", _mul(gn, _ref("dP")), _ref("delta")))
        if gn == ONE:
            dv = ir.Binary("*", P, dO)
        else:
            tile.append(("Aw", _mul(P, gn)))
            dv = ir.Binary("*", _ref("Aw"), dO)
    else:
        rows = [("dN0", _mul(dO, g)), ("delta", delta)]
        tile.append(("dP", ir.Reduce("sum", w.feat, ir.Binary("*", _ref("dN0"), _ref(value)))))
        ds = _mul(P, ir.Binary("-", _ref("dP"), _ref("delta")))
        dv = ir.Binary("*", P, _ref("dN0"))
    return _assemble("softmax", w, value, lse_grad, forward, rows, tile, ds, dv, score, raw, input_layouts,
                     epilogue=output)


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
    return _assemble("sums", w, value, lse_grad, forward, rows, tile, ds, dv, score, raw, input_layouts,
                     epilogue=output)


def _row_sum(feat: tuple[str, ...], dO: ir.Expr, g: ir.Expr, per_row=None) -> ir.Expr:
    """sum[feat](dO * g) with g's per-row factors (``per_row``, default
    _per_row) taken out of the sum: L2's dF/dZ = -N / (2 b(Z) b(Z)^2) becomes
    -1 / (2 b(Z) b(Z)^2) * sum[feat](dO * N), so the rows kernel computes its
    factor once a row, not once an element (a float32 division each) over a
    [rows, feature] tile."""
    per_row = per_row or _per_row
    factors = _factors(g)
    outside = [(f, p) for f, p in factors if per_row(f)]
    if not outside:
        return _sum(feat, _mul(dO, g))
    inside = [(f, p) for f, p in factors if not per_row(f)]
    return _mul(_product(outside), _sum(feat, _mul(dO, _product(inside)) if inside else dO))


def _log_of(g: ir.Expr) -> Optional[ir.Expr]:
    """log g where g is provably positive, a product or quotient of exp, sigmoid
    and positive constants, written so that it is finite wherever g's factors'
    arguments are (log sigmoid(u) = min(u, 0) - log(1 + exp(-|u|)): no exp of a
    large u, no log of an underflowed 0); else None."""
    total = ZERO
    for f, p in _factors(g):
        if isinstance(f, ir.Call) and f.fn == "exp":
            term = f.args[0]
        elif isinstance(f, ir.Call) and f.fn == "sigmoid":
            u = f.args[0]
            tail = ir.Call("log", (ir.Binary("+", ONE, ir.Call("exp", (_neg(ir.Call("abs", (u,))),))),))
            term = ir.Binary("-", ir.Call("min", (u, ZERO)), tail)
        elif isinstance(f, ir.Num) and f.value > 0:
            term = ir.Num(math.log(f.value))
        else:
            return None
        total = _add(total, term) if p > 0 else _sub(total, term)
    return simplify(total)


def _without(e: ir.Expr, g: ir.Expr) -> Optional[ir.Expr]:
    """e / g, where every term of the sum e has each factor of g: those factors
    taken off (no division); else None."""
    taken = _factors(g)

    def term(t):
        factors = _factors(t)
        for f in taken:
            if f not in factors:
                return None
            factors.remove(f)
        return _product(factors) if factors else ONE

    def walk(x):
        if isinstance(x, ir.Binary) and x.op in ("+", "-"):
            a, b = walk(x.lhs), walk(x.rhs)
            return None if a is None or b is None else ir.Binary(x.op, a, b)
        if isinstance(x, ir.Unary) and x.op == "-":
            a = walk(x.operand)
            return None if a is None else _neg(a)
        return term(x)
    return walk(e)


def _row_values(w: _Wires, input_layouts):
    """The per-row test of an epilogue's derivatives: no N0 and nothing along
    a feature wire (lse, a sink[h], a row index, constants and sizes are one
    value a row)."""
    feat = set(w.feat)

    def along_feature(n) -> bool:
        if isinstance(n, ir.TensorRef):
            return n.name == "N0" or bool(feat & set(n.wires or input_layouts.get(n.name, ())))
        return isinstance(n, ir.WireIndex) and n.wire in feat or isinstance(n, (ir.Reduce, ir.Normalize))
    return lambda e: not any(along_feature(n) for n in ir.walk(e))


def _complement(e: ir.Expr) -> ir.Expr:
    """1 - sigmoid(u) as sigmoid(-u): the same number, without the
    cancellation that loses it where sigmoid(u) is near 1 (a sink's
    sigmoid(lse - sink) is, lse growing with the keys: its gradient was 3e-4
    off in float32).  For the rows' expressions, computed once a row: the
    tiles keep the form that costs no second exp."""
    if isinstance(e, ir.Binary) and e.op == "-" and e.lhs == ONE and isinstance(e.rhs, ir.Call) \
            and e.rhs.fn == "sigmoid":
        return ir.Call("sigmoid", (_neg(_complement(e.rhs.args[0])),))
    return _map(e, _complement)


def _per_row(g: ir.Expr) -> bool:
    """Whether dF/dN_i is one value per row: built from constants, sizes and
    the row sums Z_j alone (no N_k, no other tensor, no wire index)."""
    return all(isinstance(n, ir.TensorRef) and re.fullmatch(r"Z\d+", n.name) and n.wires is None
               or not isinstance(n, (ir.TensorRef, ir.WireIndex, ir.Reduce, ir.Normalize)) for n in ir.walk(g))


def _row_grads(w: _Wires, output: ir.Expr, input_layouts) -> list:
    """[(input T, dT_i, expression, its wires)] for each input the output's
    row function F reads: dT_i = sum_f(dO * dF/dT) over the feature wires T
    lacks, one value a row (a sink's sink[h]) or a [rows, feature] tile (a
    gate's G[b, h, q, d]); the launcher sums it over the row wires T lacks.
    An input read along other wires, or along a wire the rows lack, gets none
    (the backward refuses its gradient, saying so)."""
    out, dO = [], _ref("dO")
    names = dict.fromkeys(n.name for n in ir.walk(output)
                          if isinstance(n, ir.TensorRef) and n.name in input_layouts and not is_placeholder(n.name))
    for name in names:
        refs = [n for n in ir.walk(output) if isinstance(n, ir.TensorRef) and n.name == name]
        reads = {ir.read_along(n, input_layouts[name]) for n in refs}
        if len(reads) > 1:   # read two ways: two partials, not emitted
            continue
        (along, steps), = reads   # its own wires, or others (tau[h // 2]: dT_i along h, summed by pairs)
        feat = tuple(f for f in w.feat if f in along)
        if not set(along) <= set(w.row) | set(w.feat) or feat not in ((), w.feat):
            continue
        try:
            dt = _complement(simplify(diff_read(output, refs)))
        except ValueError:
            continue
        if dt == ZERO:
            continue
        row_sum = _row_sum(w.feat, dO, dt, _row_values(w, input_layouts))
        out.append((name, f"dT{len(out)}", _mul(dO, dt) if feat else row_sum, w.row + feat, along, steps))
    return out


def _assemble(kind, w: _Wires, value, lse_grad, forward, rows, tile, ds, dv, score, raw,
              input_layouts, epilogue: Optional[ir.Expr] = None) -> GradRule:
    """The parts every rule shares: lse, S from R, dR, input gradients, layouts;
    and the row gradients of the inputs an ``epilogue`` F over the row values reads."""
    row_grads = _row_grads(w, epilogue, input_layouts) if epilogue is not None and input_layouts else []
    rows = list(rows) + [(n, e) for _, n, e, _, _, _ in row_grads]
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
        pairs = []
        for part in ir.terms(raw):
            body = part.body if isinstance(part, ir.Reduce) else None
            if not (isinstance(part, ir.Reduce) and part.op == "sum" and isinstance(body, ir.Binary)
                    and body.op == "*" and all(isinstance(t, ir.TensorRef) for t in (body.lhs, body.rhs))):
                raise ValueError("the raw score must be a contraction sum[w](A * B) of two inputs")
            moved = next((t for t in (body.lhs, body.rhs) if t.wires is not None), None)
            if moved is not None:   # one along its own wires written out is plain by now (ir.plain_reads)
                # placed at the read, not the output's box, and not "must be a contraction of two
                # inputs", which it is
                raise NoGrad(f"the score's contraction reads {expr_text(moved)}, input {moved.name} along other "
                             "wires than its own; the backward takes the contraction's inputs read along their "
                             "declared wires", moved.loc)
            pairs.append((body.lhs, body.rhs))
        tile.append(("dR", _mul(_ref("dS"), diff(s_of_r, _ref("R")))))
        # R = sum[w](A * B) (+ ...): dA sums dR * B over the wires of R that A lacks, and alike for B.
        grads = [(this.name, _sum(tuple(x for x in w.score if x not in input_layouts[this.name]),
                                  ir.Binary("*", _ref("dR"), other)))
                 for a, b in pairs for this, other in ((a, b), (b, a))] + grads
    own_grads = {name for name, _ in grads}   # the kernels' own: Q and K (with a raw score), V
    twice = [t for t, *_ in row_grads if t in own_grads]
    if twice:   # (a residual + Q): the kernels keep one accumulator per input, as for K = V
        raise NoGrad(f"the output reads {twice[0]} outside the attention too: its gradient would have two paths; "
                     "declare another input for that read and pass the same tensor to both (autograd adds "
                     "their gradients)")
    rows = tuple((n, simplify(e)) for n, e in rows)
    tile = tuple((n, simplify(e)) for n, e in tile)
    used = {node.name for _, e in forward + list(rows + tile) + grads for node in ir.walk(e)
            if isinstance(node, ir.TensorRef)} | {n for n, _ in forward + list(rows + tile)}
    own = {n: wires for _, n, _, wires, _, _ in row_grads}
    layouts = tuple((n, own.get(n) or w.of(n)) for n in sorted(used) if is_placeholder(n))
    # saved: forward values the backward reads and does not recompute itself (P is recomputed).
    rebound = {n for n, _ in rows + tile}
    saved = tuple(n for n, _ in forward
                  if n not in rebound and any(_contains(e, _ref(n)) for _, e in rows + tile))
    return GradRule(kind, w.key, value, lse_grad, layouts, tuple(forward), saved,
                    ("dO", "dlse") if lse_grad else ("dO",), rows, tile, tuple(grads), raw,
                    row_grads=tuple((t, n) for t, n, *_ in row_grads),
                    row_reads=tuple((t, along, steps) for t, _, _, _, along, steps in row_grads))


# --------------------------------------------------------------------------
# grad_plan: recognise the streamed form of a diagram.
# --------------------------------------------------------------------------

def grad_plan(diagram: ir.Diagram) -> GradRule:
    """The GradRule of an attention diagram, or NoGrad saying why there is none and where.

    The score box is the one box computing a raw contraction of inputs
    (``sum[d](Q * K)``).  The other boxes are inlined into the outputs, which
    must be one attention output (form a or b) and optionally
    ``logsumexp[x](S)``.
    """
    layouts = {i.name: ir.axis_wires(i.axes) for i in diagram.inputs}
    clash = sorted(name for name in layouts if is_placeholder(name))
    if clash:
        raise NoGrad(f"input {clash[0]} has the name of a value the backward computes "
                     f"({', '.join(PLACEHOLDERS)}, or N, Z, A, dN, dZ, dA, gN, dT and a number); rename it",
                     diagram.tensor(clash[0]).loc)
    lets = {let.name: let for let in diagram.lets}
    score_let, raw = _score_box(diagram, layouts)
    score_let = _grown_to_normaliser(diagram, masks.grown_score(diagram, score_let))
    lets[score_let.name] = score_let
    score_wires = ir.axis_wires(score_let.axes)

    def inline(e):
        if isinstance(e, ir.TensorRef) and e.name in lets:
            if e.wires is not None:
                raise NoGrad(f"the box {e.name} is read relabelled; grad_plan cannot inline that", e.loc)
            return _ref("S") if e.name == score_let.name else inline(lets[e.name].expr)
        return _map(e, inline)

    attention, lse_name = None, None
    for out in diagram.outputs:
        if out.name not in lets or out.name == score_let.name:
            raise NoGrad(f"output {out.name} is the score box or an input: no normaliser to differentiate", out.loc)
        at = lets[out.name].expr.loc
        e = inline(lets[out.name].expr)
        if isinstance(e, ir.Reduce) and e.op == "logsumexp":
            if len(e.wires) == 1 and e.body != _ref("S") and _contains(e.body, _ref("S")):
                shown = expr_text(substitute(e.body, _ref("S"), ir.TensorRef(score_let.name)))
                raise NoGrad(f"output {out.name}: logsumexp takes {shown}, not the score box "
                             f"{score_let.name} itself; between the contraction's box and the normaliser "
                             f"the backward takes only a mask, where(p, {score_let.name}, -inf)", at)
            if e.body != _ref("S") or len(e.wires) != 1:
                raise NoGrad(f"output {out.name}: logsumexp must be taken of the scores along one wire", at)
            lse_name, lse_wire, lse_at = out.name, e.wires[0], at
        elif attention is None:
            attention = (out.name, e)
        elif any(isinstance(n, ir.Reduce) and n.op == "logsumexp" for n in ir.walk(e)):
            # lse * 2 read as a second attention output
            raise NoGrad(f"output {out.name}: the backward takes a logsumexp output as logsumexp of the "
                         f"scores itself, not {expr_text(lets[out.name].expr)}", at)
        else:
            raise NoGrad(f"outputs {attention[0]} and {out.name}: the backward takes one attention output "
                         "(and a logsumexp of the scores beside it)", out.loc)
    if attention is None:
        raise NoGrad("no attention output: nothing contracts the scores with a value tensor",
                     diagram.outputs[0].loc if diagram.outputs else ir.NOLOC)
    form = Form(score_wires, layouts)
    at = lets[attention[0]].expr.loc
    try:
        output = form.visit(attention[1])
    except NoGrad as err:   # a part of the inlined output: its own place, else the output's box
        raise NoGrad(str(err), err.loc if err.loc.line else at) from None
    if form.v is None:
        raise NoGrad(f"output {attention[0]} contracts no value tensor with the scores", at)
    if form.gate is not None:
        check_gate(form, score_let, at)
    if lse_name is not None and lse_wire != form.key:
        raise NoGrad(f"logsumexp is along {lse_wire} but the attention sums along {form.key}", lse_at)
    common = dict(value=form.v, lse_grad=lse_name is not None, score=score_let.expr, raw=raw,
                  input_layouts=layouts)
    if form.softmax and (len(form.nums) != 1 or form.sums):
        raise NoGrad("softmax attention must be exactly sum[x](softmax[x](S) * V), or a function of it "
                     "and its logsumexp along each row", at)
    if form.lse is not None and not form.softmax:
        raise NoGrad(f"output {attention[0]} reads logsumexp[{form.key}] of the scores beside sums of them; the "
                     "backward takes a logsumexp inside an output only beside sum[x](softmax[x](S) * V)", form.lse)
    try:
        if form.softmax:
            rule = softmax_rule(form.key, score_wires, layouts[form.v], output=output, **common)
        else:
            rule = sums_rule(form.key, score_wires, layouts[form.v], form.nums, form.sums, output, **common)
    except NoGrad as err:   # without a place of its own (the output reads Q again): the output's box
        raise NoGrad(str(err), err.loc if err.loc.line else at) from None
    except ValueError as err:   # the rule builders' own (wires of the score and V): at the output's box
        raise NoGrad(str(err), at) from None
    bound = [("S", score_let.name), ("O", attention[0])] + ([("lse", lse_name)] if lse_name else [])
    if form.gate is not None:   # the forward's sums take V * gate: the saved ones (an epilogue's N0) too
        gated = ir.Binary("*", _ref(form.v), _ref(form.gate))
        rule = replace(rule, value_gate=form.gate,
                       forward=tuple((n, substitute(e, _ref(form.v), gated)) for n, e in rule.forward))
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
        # none: at the first normaliser, where a score was looked for
        where = next((n.loc for n in normalisers(diagram)), ir.NOLOC)
        maps = [n for n in normalisers(diagram) if isinstance(n, ir.Normalize)]
        two = "" if len(found) < 2 or len(maps) < 2 else (
            " (several attention maps, such as the two of differential attention, are one box along a wire "
            "of maps: S[b, h, g, q, x] with g = 2, as in examples/differential_attention.ncd)")
        raise NoGrad(f"expected one score box contracting inputs (like sum[d](Q * K)); found {names}{two}",
                     found[1][0].loc if found else where)
    let, raws = found[0]
    if len(raws) == 1:
        return let, raws[0]
    # several contractions added up (MLA's sum[c](Qc * Kc) + sum[r](Qr * Kr)): R is their sum,
    # and each pair's inputs take dR as one contraction's would
    total = ir.sum_of(let.expr, raws)
    if total is None:
        raise NoGrad(f"the box {let.name} holds {len(raws)} sums over inputs; the backward takes one score, a "
                     "contraction like sum[d](Q * K), or contractions added up (sum[c](Qc * Kc) + "
                     "sum[r](Qr * Kr)), in a box of its own or written inside one normaliser", raws[1].loc)
    return let, total


def _grown_to_normaliser(diagram: ir.Diagram, box: ir.Let) -> ir.Let:
    """The score grown through the elementwise boxes between it and the softmax
    (or logsumexp) that normalises them: ``W = sum[d](Q * K) * |d|^-0.5``,
    ``B = W + slope * (x - q)``, ``softmax[x](B)`` train as the one score ``B =
    sum[d](Q * K) * |d|^-0.5 + slope * (x - q)``, the form a bias written
    inline has.  Each box of the chain must be the previous one's only reader,
    read plainly (not relabelled), of the same layout, with no reduction, and
    no output; the chain must end in a box a normaliser takes whole.  Anything
    else leaves ``box`` as it was (sigmoid's weights box, read by a sum, stays
    the normaliser's)."""
    outputs = {o.name for o in diagram.outputs}

    def refs(e: ir.Expr, name: str) -> list:
        return [n for n in ir.walk(e) if isinstance(n, ir.TensorRef) and n.name == name]

    def normalised(name: str) -> bool:
        return any(n.body == ir.TensorRef(name) for n in normalisers(diagram))

    grown = box
    while grown.name not in outputs:
        readers = [let for let in diagram.lets if refs(let.expr, grown.name)]
        if len(readers) != 1:
            break
        (r,) = readers
        if r.name in outputs or r.axes != grown.axes or any(n.wires is not None for n in refs(r.expr, grown.name)) \
                or any(isinstance(n, (ir.Reduce, ir.Normalize)) for n in ir.walk(r.expr)):
            break
        grown = replace(r, expr=substitute(r.expr, ir.TensorRef(grown.name), grown.expr))
        if normalised(r.name):
            return grown
    return box
