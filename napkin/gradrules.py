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
A rule's expressions are ordinary IR over the diagram's inputs plus fixed
placeholder names (``PLACEHOLDERS``, ``is_placeholder``), each with its wires
in ``GradRule.layouts``, so the backward code generator
(napkin/codegen/backward.py) turns them into Triton exactly as it does the
forward's expressions.

tests/test_autodiff.py checks every rule here against torch.autograd in
float64, through a small wire-named interpreter of the IR (``evaluate``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Mapping, Optional, Sequence

from . import ir, masks
from .printer import expr_text
from .autodiff import ONE, ZERO, _add, _contains, _map, _mul, diff, simplify, substitute

NEG_INF = ir.Num(float("-inf"))


def normalisers(diagram: ir.Diagram) -> list:
    """Every softmax and logsumexp node of the diagram's boxes, in order: where
    a score is normalised (grad_plan's, and training's boxing of an inline one)."""
    return [n for let in diagram.lets for n in ir.walk(let.expr)
            if isinstance(n, ir.Normalize) or (isinstance(n, ir.Reduce) and n.op == "logsumexp")]


class NoGrad(ValueError):
    """grad_plan's refusal: why a diagram has no backward, and where in it (a
    ValueError still, for callers of the rule builders)."""

    def __init__(self, message: str, loc: ir.Loc = ir.NOLOC):
        super().__init__(message)
        self.loc = loc


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
                and all(isinstance(t, ir.TensorRef) for t in (body.lhs, body.rhs))):
            raise ValueError("the raw score must be a contraction sum[w](A * B) of two inputs")
        moved = next((t for t in (body.lhs, body.rhs) if t.wires is not None), None)
        if moved is not None:   # one along its own wires written out is plain by now (ir.plain_reads)
            # placed at the read, not the output's box, and not "must be a contraction of two
            # inputs", which it is
            raise NoGrad(f"the score's contraction reads {expr_text(moved)}, input {moved.name} along other "
                         "wires than its own; the backward takes the contraction's inputs read along their "
                         "declared wires", moved.loc)
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
                     f"({', '.join(PLACEHOLDERS)}, or N, Z, A, dN, dZ, dA, gN and a number); rename it",
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
    form = _Form(score_wires, layouts)
    at = lets[attention[0]].expr.loc
    try:
        output = form.visit(attention[1])
    except NoGrad as err:   # a part of the inlined output: its own place, else the output's box
        raise NoGrad(str(err), err.loc if err.loc.line else at) from None
    if form.v is None:
        raise NoGrad(f"output {attention[0]} contracts no value tensor with the scores", at)
    if lse_name is not None and lse_wire != form.key:
        raise NoGrad(f"logsumexp is along {lse_wire} but the attention sums along {form.key}", lse_at)
    common = dict(value=form.v, lse_grad=lse_name is not None, score=score_let.expr, raw=raw,
                  input_layouts=layouts)
    if form.softmax and (len(form.nums) != 1 or form.sums or output != _ref("N0")):
        raise NoGrad("softmax attention must be exactly sum[x](softmax[x](S) * V)", at)
    try:
        if form.softmax:
            rule = softmax_rule(form.key, score_wires, layouts[form.v], **common)
        else:
            rule = sums_rule(form.key, score_wires, layouts[form.v], form.nums, form.sums, output, **common)
    except NoGrad:
        raise
    except ValueError as err:   # the rule builders' own (wires of the score and V): at the output's box
        raise NoGrad(str(err), at) from None
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
        # none: at the first normaliser, where a score was looked for
        where = next((n.loc for n in normalisers(diagram)), ir.NOLOC)
        raise NoGrad(f"expected one score box contracting inputs (like sum[d](Q * K)); found {names}",
                     found[1][0].loc if found else where)
    let, raws = found[0]
    if len(raws) != 1:
        raise NoGrad(f"the box {let.name} holds {len(raws)} sums over inputs; the backward takes one score, a "
                     "contraction like sum[d](Q * K) in a box of its own or written inside one normaliser",
                     raws[1].loc)
    return let, raws[0]


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
            raise NoGrad("softmax must be used as sum[x](softmax[x](S) * V)", e.loc)
        if not isinstance(e, ir.Reduce):
            return _map(e, self.visit)
        if e.op != "sum" or len(e.wires) != 1 or (self.key not in (None, e.wires[0])):
            raise NoGrad(f"{e.op}[{', '.join(e.wires)}] is not a sum along the key wire", e.loc)
        self.key = e.wires[0]
        keyed, const = [], []
        for factor, power in _factors(e.body):
            (keyed if self._keyed(factor) else const).append((factor, power))
        relabelled = [f for f, _ in keyed if isinstance(f, ir.TensorRef) and f.wires is not None
                      and f.name in self.layouts]
        if relabelled:   # else its weight reads as "softmax must normalise the score box itself"
            f = relabelled[0]
            raise NoGrad(f"the sum along {self.key} reads {f.name} relabelled ({f.name}[{', '.join(f.wires)}]); "
                             "the backward takes a value tensor along its own wires", f.loc)
        vs = [f for f, p in keyed if isinstance(f, ir.TensorRef) and self._is_value(f)]
        if len(vs) > 1 or any(isinstance(f, ir.TensorRef) and self._is_value(f) and p < 0 for f, p in keyed):
            raise NoGrad("a contraction must multiply by the value tensor once", e.loc)
        rest = [(f, p) for f, p in keyed if not (vs and f == vs[0])]
        weight = _product(rest)
        reduced = [n for n in ir.walk(weight) if isinstance(n, (ir.Reduce, ir.Normalize))]
        if reduced and not self._is_softmax(weight):
            others = [f for f, _ in rest if not isinstance(f, ir.Normalize)]
            # along the keys and short of a score wire (the queries'), as V[b, h, x]; a gate has them all
            flat = [f for f in others if isinstance(f, ir.TensorRef) and f.wires is None
                    and self.key in (self.layouts.get(f.name) or ())
                    and set(self.layouts[f.name]) < set(self.score_wires)]
            if flat and len(others) < len(rest):   # V[b, h, x]: read as a gate by the rule below
                raise NoGrad(f"the value {flat[0].name} has no feature wire (a wire the scores lack, as d of "
                             f"V[b, h, x, d]): the backward takes sum[{self.key}](softmax[{self.key}](S) * V) "
                             f"with one; give {flat[0].name} a wire of size 1", e.loc)
            if others and len(others) < len(rest):   # softmax(S) * G: a gate, not another score
                raise NoGrad(f"the weights of the sum along {self.key} multiply softmax by "
                             f"{' * '.join(expr_text(f) for f in others)}; the backward takes the softmax "
                             f"weights alone, sum[{self.key}](softmax[{self.key}](S) * V)", e.loc)
            if any(isinstance(n, ir.Normalize) for n in reduced):
                raise NoGrad("softmax must normalise the score box itself: sum[x](softmax[x](S) * V)", e.loc)
            raise NoGrad("the weights inside a sum along the key wire must be elementwise in the scores", e.loc)
        if vs:
            if self.v not in (None, vs[0].name):
                raise NoGrad(f"two value tensors, {self.v} and {vs[0].name}", vs[0].loc)
            self.v = vs[0].name
            if self._is_softmax(weight):
                self.softmax = True
            table, prefix = self.nums, "N"
        else:
            if self._is_softmax(weight):
                raise NoGrad("softmax must be used as sum[x](softmax[x](S) * V)", e.loc)
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
