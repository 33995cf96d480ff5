"""A diagram's FlexAttention equivalent, emitted as Python source from the IR.

FlexAttention computes ``softmax(score_mod(Q K^T * scale) masked by mask_mod) V``
(plus the row log-sum-exp).  A napkin diagram of the form

    S = f(sum[d](Q * K), indices, side tensors)      (one contraction)
    O = sum[x](softmax[x](S) * V)                     (optionally lse = logsumexp[x](S))

maps onto it as follows, and ``emit(diagram)`` writes that mapping out as a
small self-contained module (``FlexSource.text``):

* scale: when the contraction is multiplied (or divided) by a constant,
  ``sum[d](Q * K) * |d|^-0.5``, the constant becomes flex_attention's
  ``scale`` and score_mod sees the already-scaled score, exactly as flex
  computes it.  Otherwise ``scale=1.0`` and score_mod applies everything, so
  the scale is never applied twice or dropped.
* mask: every ``where(pred, s, -inf)`` wrapped around the whole score (and
  not reading the score itself) becomes mask_mod, so a BlockMask can skip
  empty blocks; what is left is score_mod (None when it is the identity).
* indices: the query wire reads ``q_idx``, the key wire ``kv_idx``, the
  batch wire ``b`` and the head wire ``h``.  Grouped-query heads, ``(hk g)``
  or hk and g written apart, become ``enable_gqa=True``; there flex's ``h`` is
  the query head, so hk reads ``h // |g|`` and g reads ``h % |g|``.  Multi-query
  (K and V without a head wire) is enable_gqa with one kv head (roles.py).
  Differential attention's maps, Q[b, h, q, (g d)] and K alike with V[b, h,
  x, e], are |g| heads a head: flex's h is h * |g| + g, V repeated over g.
* side tensors are captured by the mods and indexed with those names:
  ``slope[h]``, ``doc[b, q]`` -> ``doc[b, q_idx]``.

An output that is a function of the attention and its row's logsumexp (an
attention sink's ``A * sigmoid(L - sink)``) is split off as the distributed
wrappers split it (reading.split_epilogue): flex computes A and L, and the
module's ``epilogue()`` that function in torch.

Anything else has no FlexAttention equivalent (sigmoid attention, an L2
normaliser, a matmul, a score reading V ...) and ``emit`` raises
``NoFlexEquivalent`` saying why: the benchmark reports that rather than
timing something that computes a different function.
"""
from __future__ import annotations

import hashlib
import math
import sys
import types
from dataclasses import dataclass
from typing import Optional

from .. import ir, masks, tiling
from ..codegen.pysrc import along, names_read
from ..printer import expr_text
from .roles import Analysis, NoFlexEquivalent, Roles, const, is_neg_inf, layout, replace

# The placeholder that stands for flex's ``score`` argument inside the IR: an
# underscore name, which no diagram tensor can have (one called score was
# taken for it).
SCORE = ir.TensorRef("_score")

_CALLS = {"exp": "torch.exp", "exp2": "torch.exp2", "log": "torch.log", "log2": "torch.log2",
          "sqrt": "torch.sqrt", "rsqrt": "torch.rsqrt", "tanh": "torch.tanh",
          "sigmoid": "torch.sigmoid", "abs": "torch.abs", "relu": "torch.relu"}
# The same on plain Python numbers: a part of the score made only of numbers
# and call-time wire sizes (1 / sqrt(|x|)) is not a tensor inside the mods.
# exp through the module's _exp: math.exp(800) raises where torch gives inf
# (sigmoid(-|x|) at 800 keys failed the FlexAttention row).
_SCALAR_CALLS = {"exp": "_exp({})", "exp2": "_exp(math.log(2.0) * ({}))", "log": "math.log({})",
                 "log2": "math.log2({})", "sqrt": "math.sqrt({})", "rsqrt": "(1.0 / math.sqrt({}))",
                 "tanh": "math.tanh({})", "sigmoid": "(1.0 / (1.0 + _exp(-({}))))",
                 "abs": "abs({})", "relu": "max({}, 0)", "max": "max({}, {})", "min": "min({}, {})",
                 "where": "({1} if {0} else {2})"}


@dataclass(frozen=True)
class FlexSource:
    """What ``emit`` found, and the module text.  ``causal`` / ``plain`` tell the
    SDPA baseline whether it can compute the same function (is_causal, or no
    mask and no score_mod at all)."""

    diagram: str
    text: str
    scale: float
    enable_gqa: bool
    has_score_mod: bool
    mask: Optional[str]          # the mask predicate as napkin text, None if unmasked
    causal: bool                 # the mask is exactly key <= query
    causal_part: bool            # key <= query is one of the mask's conjuncts
    side: tuple[str, ...]        # inputs the mods read
    outputs: tuple[str, ...]
    # the output that is a function of the attention and its lse (a sink's A * sigmoid(L - sink)),
    # as napkin text, computed in torch from flex's out and lse; SDPA returns no lse: no SDPA equivalent
    epilogue: Optional[str] = None

    @property
    def plain(self) -> bool:
        return not self.has_score_mod and self.mask is None and not self.side and self.epilogue is None


# --------------------------------------------------------------------------
# Rendering the score and mask expressions as Python.
# --------------------------------------------------------------------------

class _Py:
    """IR expression -> Python source over flex's (score, b, h, q_idx, kv_idx),
    named ``_score``, ``_b`` ... in the emitted mods: a name with a leading
    underscore is napkin's own (the checker refuses one in a diagram), so a
    side input called ``score``, ``h`` or ``sizes`` cannot be shadowed."""

    def __init__(self, d: ir.Diagram, roles: Roles, analysis: Analysis):
        self.d, self.roles, self.an = d, roles, analysis
        self.side: list[str] = []        # inputs read, in first-use order
        self.sizes: list[str] = []       # symbolic wire sizes needed

    def size(self, wire: str) -> str:
        w = self.d.wire(wire)
        if w is not None and w.size is not None:
            return str(w.size)
        if wire not in self.sizes:
            self.sizes.append(wire)
        return f"_size_{wire}"

    def index(self, wire: str) -> str:
        r = self.roles
        if wire == r.row:
            return "_q_idx"
        if wire == r.key:
            return "_kv_idx"
        if wire == r.batch:
            return "_b"
        if r.maps is not None and wire == r.maps:              # differential attention's map
            return f"(_h % {r.maps_size})" if r.head else "_h"
        if r.maps is not None and r.head is not None and wire == r.head[0]:
            return f"(_h // {r.maps_size})"
        if r.head is not None and r.group is None and wire == r.head[0]:
            return "_h"     # one head wire, K's own or (multi-query) Q's alone
        if r.group is not None and wire == r.head[0]:
            return f"(_h // {self.size(r.group)})"
        if r.group is not None and wire == r.group:
            return f"(_h % {self.size(r.group)})"
        self.an.refuse(f"the score reads wire {wire}, which has no FlexAttention index")

    def tensor(self, ref: ir.TensorRef) -> str:
        t = self.d.tensor(ref.name)
        if t.name in {x.name for q, k, _ in self.an.parts for x in (q, k)} | {self.an.value.name}:
            self.an.refuse(f"the score reads {t.name} outside the contraction")
        if t.name not in self.side:
            self.side.append(t.name)
        wires = list(ref.wires if ref.wires is not None else ir.axis_wires(t.axes))
        steps = list(ir.read_steps(ref)) if ref.wires is not None else [1] * len(wires)
        parts = []
        for axis in t.axes:
            read, wires = tuple(wires[:len(axis)]), wires[len(axis):]
            step, steps = tuple(steps[:len(axis)]), steps[len(axis):]
            if self.roles.group is not None and read == self.roles.head and set(step) == {1}:
                parts.append("_h")     # (hk g) flattened is exactly flex's query head
                continue
            at = [self.index(w) if k == 1 else f"({self.index(w)} // {k})" for w, k in zip(read, step)]
            text = at[0]
            for w, i in zip(axis[1:], at[1:]):   # row-major flattening, by the declared wires' sizes
                text = f"({text} * {self.size(w)} + {i})"
            parts.append(text)
        return f"{t.name}[{', '.join(parts)}]" if parts else t.name   # a scalar input: the 0-d tensor

    def __call__(self, e: ir.Expr) -> str:
        if e == SCORE:
            return "_score"
        value = const(e, self.d)
        if value is not None and not isinstance(e, ir.Num):
            return _number(value)
        if isinstance(e, ir.Num):
            return _number(e.value)
        if isinstance(e, ir.WireIndex):
            return self.index(e.wire)
        if isinstance(e, ir.WireSize):
            return self.size(e.wire)
        if isinstance(e, ir.TensorRef):
            return self.tensor(e)
        scalar = not any(isinstance(n, (ir.WireIndex, ir.TensorRef)) for n in ir.walk(e))
        if isinstance(e, ir.Unary):
            if e.op == "-":
                return f"(-{self(e.operand)})"
            return f"(not {self(e.operand)})" if scalar else f"torch.logical_not({self(e.operand)})"
        if isinstance(e, ir.Binary):
            if e.op == "^":
                exponent = const(e.rhs, self.d)
                if exponent is not None:   # a float exponent: an int index base stays legal
                    return f"({self(e.lhs)} ** {float(exponent)!r})"
                if scalar:
                    return f"({self(e.lhs)} ** {self(e.rhs)})"
                # a float base, as the reference takes: torch.pow(2, -1) of integers is 0
                return f"torch.pow({self(e.lhs)} * 1.0, {self(e.rhs)})"
            op = {"and": "&", "or": "|"}.get(e.op, e.op)
            return f"({self(e.lhs)} {op} {self(e.rhs)})"
        if isinstance(e, ir.Call):
            args = [self(a) for a in e.args]
            if scalar:
                return _SCALAR_CALLS[e.fn].format(*args)
            if e.fn == "where":
                if not any(isinstance(n, (ir.WireIndex, ir.TensorRef)) for n in ir.walk(e.args[0])):
                    return f"({args[1]} if {args[0]} else {args[2]})"   # a condition of sizes: a bool
                return f"torch.where({', '.join(args)})"
            if e.fn in ("max", "min"):  # torch.maximum wants two tensors; where takes a number
                cmp = ">=" if e.fn == "max" else "<="
                return f"torch.where({args[0]} {cmp} {args[1]}, {args[0]}, {args[1]})"
            return f"{_CALLS[e.fn]}({args[0]})"
        self.an.refuse(f"cannot express {type(e).__name__} in a score_mod")


def _number(v) -> str:
    if isinstance(v, float) and math.isinf(v):
        return "math.inf" if v > 0 else "-math.inf"
    return repr(v)


def _peel_masks(score: ir.Expr) -> tuple[list[ir.Expr], ir.Expr]:
    """Split ``where(p1, where(p2, s, -inf), -inf)`` into ([p1, p2], s), and an
    additive mask ``s + where(p, 0, -inf)`` the same way (it is where(p, s,
    -inf) for any finite s; napkin's kernels skip its blocks too, so flex gets
    it as a BlockMask, not as a dense score_mod).  A predicate that reads the
    score is data, not a mask: it stays in score_mod."""
    preds = []
    while True:
        if isinstance(score, ir.Call) and score.fn == "where":
            pred, then, other = score.args
            if is_neg_inf(other) and not is_neg_inf(then):
                keep, rest = pred, then
            elif is_neg_inf(then) and not is_neg_inf(other):
                keep, rest = masks.negate(pred), other
            else:
                break
            if any(n == SCORE for n in ir.walk(keep)):
                break
            preds.append(keep)
            score = rest
            continue
        terms = _terms(score)
        found = [_additive_mask(t) for t in terms]
        if len(terms) < 2 or all(p is None for p, _ in found):
            break
        preds += [p for p, _ in found if p is not None]
        rest = [t if p is None else kept for t, (p, kept) in zip(terms, found) if p is None or kept is not None]
        score = rest[0]
        for t in rest[1:]:
            score = ir.Binary("+", score, t)
    return preds, score


def _terms(e: ir.Expr) -> list:
    if isinstance(e, ir.Binary) and e.op == "+":
        return _terms(e.lhs) + _terms(e.rhs)
    return [e]


def _additive_mask(term: ir.Expr) -> tuple[Optional[ir.Expr], Optional[ir.Expr]]:
    """(p, what the term adds where p holds) for a term of a sum that is -inf
    off a predicate p not reading the score: ``where(p, 0, -inf)`` is (p,
    None), adding nothing; ``where(p, t, -inf)`` is (p, t), since ``where(p, s,
    -inf) + bias`` is ``where(p, s + bias, -inf)`` for a finite bias (it was
    left dense in score_mod, and its FLOPs counted dense, where napkin's
    kernels skip the blocks).  (None, None) for any other term."""
    if not (isinstance(term, ir.Call) and term.fn == "where"):
        return None, None
    pred, then, other = term.args
    zero = lambda e: isinstance(e, ir.Num) and e.value == 0   # noqa: E731
    if any(n == SCORE for n in ir.walk(pred)):
        return None, None
    if is_neg_inf(other) and not is_neg_inf(then):
        return pred, None if zero(then) else then
    if is_neg_inf(then) and not is_neg_inf(other):
        return masks.negate(pred), None if zero(other) else other
    return None, None


def _take_scale(score: ir.Expr, d: ir.Diagram) -> tuple[float, ir.Expr]:
    """(scale, score with ``SCORE * c`` replaced by SCORE) when the score is
    used once, multiplied or divided by a constant; else (1.0, score)."""
    if sum(1 for n in ir.walk(score) if n == SCORE) != 1:
        return 1.0, score
    for node in ir.walk(score):
        if isinstance(node, ir.Binary) and node.op in ("*", "/") and SCORE in (node.lhs, node.rhs):
            other = node.rhs if node.lhs == SCORE else node.lhs
            c = const(other, d)
            if c is None or c == 0 or (node.op == "/" and node.lhs != SCORE) or not math.isfinite(c):
                continue
            return (c if node.op == "*" else 1.0 / c), replace(score, node, SCORE)
    return 1.0, score


def _causal_conjunct(p: ir.Expr, roles: Roles) -> bool:
    q, x = ir.WireIndex(roles.row), ir.WireIndex(roles.key)
    return p in (ir.Binary("<=", x, q), ir.Binary(">=", q, x))


def _conjuncts(p: ir.Expr) -> list:
    if isinstance(p, ir.Binary) and p.op == "and":
        return _conjuncts(p.lhs) + _conjuncts(p.rhs)
    return [p]


def _causal_flags(preds: list, roles: Roles) -> tuple[bool, bool]:
    """(the mask is exactly key <= query, key <= query is one of its conjuncts)."""
    conjuncts = list(dict.fromkeys(c for p in preds for c in _conjuncts(p)))
    causal = [_causal_conjunct(c, roles) for c in conjuncts]
    return causal == [True], any(causal)


# --------------------------------------------------------------------------
# The emitted module.
# --------------------------------------------------------------------------

def emit(diagram: ir.Diagram) -> FlexSource:
    """The FlexAttention module for ``diagram``; NoFlexEquivalent if it has none.
    An output that is a function of the attention and its logsumexp (a sink)
    is flex's out and lse, then that function in torch (``_epilogue_lines``)."""
    user, (diagram, epi) = diagram, _split(diagram)
    an = Analysis(diagram)
    score = replace(an.run(), an.raw, SCORE)
    roles = an.roles
    preds, body = _peel_masks(score)
    # a written not taken through, as the kernels take it: not (x > q) is causal to SDPA too
    preds = [masks._without_not(p) for p in preds]
    scale, body = _take_scale(body, diagram)
    py = _Py(diagram, roles, an)
    score_text = py(body) if body != SCORE else None
    mask_text = " & ".join(py(p) for p in preds) if preds else None   # comparisons come parenthesised
    side = tuple(t.name for t in diagram.inputs if t.name in py.side)   # diagram order
    outs = tuple(o.name for o in user.outputs)
    lines = _module(diagram, an, roles, scale, score_text, mask_text, side, py.sizes,
                    outs if epi is not None else None)
    if epi is not None:
        lines += _epilogue_lines(user, diagram, epi)
    mask = " and ".join(expr_text(p) for p in preds) if preds else None
    causal, causal_part = _causal_flags(preds, roles)
    return FlexSource(diagram.name, "\n".join(lines) + "\n", scale, roles.gqa, score_text is not None,
                      mask, causal, causal_part, side, outs,
                      None if epi is None else f"{epi.output} = {expr_text(epi.expr)}")


def _split(diagram: ir.Diagram):
    """(the diagram flex computes, the epilogue or None): the distributed
    wrappers' split (napkin.distributed.reading.split_epilogue), its refusals
    reworded for flex."""
    from ..distributed.reading import split_epilogue
    from ..errors import NapkinError

    try:
        return split_epilogue(ir.plain_reads(diagram))
    except NapkinError as err:
        why = err.messages[0].replace("cannot distribute this diagram: ", "")
        raise NoFlexEquivalent(diagram.name, why) from None


def _epilogue_lines(user: ir.Diagram, core: ir.Diagram, epi) -> list[str]:
    """``epilogue(outs, _inputs)``: the user's outputs from flex's (the
    attention, its lse, any other) with the function computed as the
    reference computes it (codegen/reference.py's lines over a diagram of
    that one box), in float32 (float64 for float64 attention outputs), then
    in the output's dtype; prepare()'s _run returns it."""
    from ..codegen.emit import reference_inputs
    from ..codegen.reference import reference_lines

    o = user.tensor(epi.output)
    states = [n for n in (o.name for o in core.outputs) if isinstance(core.tensor(n), ir.Let)
              and any(isinstance(x, ir.TensorRef) and x.name == n for x in ir.walk(epi.expr))]
    inputs = [ir.Input(n, core.tensor(n).axes, "fp32") for n in states] + [user.tensor(n) for n in epi.reads]
    held = {w for t in inputs + [o] for w in ir.axis_wires(t.axes)}
    e = ir.Diagram(f"{user.name}_epilogue", tuple(w for w in user.wires if w.name in held), tuple(inputs),
                   (ir.Let(o.name, o.axes, o.dtype, epi.expr),), (ir.Output(o.name),))
    symbolic = [w.name for w in e.wires if w.size is None]
    shape = ", ".join(" * ".join(f'_sz["{w}"]' if user.wire(w).size is None else str(user.wire(w).size)
                                 for w in axis) for axis in o.axes)
    dtype = ir.TORCH_NAMES.get(tiling.tensor_dtype(user, o.name), "float32")
    names = [t.name for t in user.inputs]
    body = [f"{n} = _inputs[{names.index(n)}]" for n in epi.reads] + reference_inputs(e) + reference_lines(e)
    return [
        "",
        "",
        "def epilogue(outs, _inputs):",
        f'    """{epi.output} = {expr_text(epi.expr)}: the diagram\'s output from flex_attention\'s',
        '    (OUTPUTS from FLEX_OUTPUTS), in torch, as napkin\'s reference computes it."""',
        f"    {', '.join(c.name for c in core.outputs)}, = outs",
        f"    _sz = {_size_exprs(user, symbolic)}",
        "    _c = torch.float64 if " + " or ".join(f"{n}.dtype == torch.float64" for n in states) +
        " else torch.float32",
    ] + ["    " + line for line in body] + [
        f"    {o.name} = {o.name}.reshape({shape}).to(torch.{dtype})",
        f"    return ({', '.join(t.name for t in user.outputs)},)",
    ]


def attention_roles(diagram: ir.Diagram) -> Roles:
    """Which wire is the batch, the heads (``(hk g)`` for GQA), the queries,
    the keys and the head dims, for any streamed attention (softmax or not);
    NoFlexEquivalent when the diagram is not an attention at all."""
    return Analysis(diagram).loose()


def attention_shape(diagram: ir.Diagram, sizes) -> dict:
    """The attention's sizes in SDPA's (B, H, L, E) terms, for any streamed
    attention (softmax or not): batch, heads (query), kv_heads, q_len,
    kv_len, dim, value_dim; the causal flags; ``operands``, the names of
    Q, K and V.  ``sizes`` binds the symbolic wires."""
    an = Analysis(diagram)
    roles = an.loose()
    causal, causal_part = _causal_flags(_kept_pairs(diagram), roles)
    full = {w.name: w.size for w in diagram.wires if w.size is not None}
    full.update(sizes)
    # differential attention's maps are heads to flex and SDPA (each its own keys, V repeated)
    heads = (math.prod(full[w] for w in roles.head) if roles.head else 1) * roles.maps_size
    queries, keys = [q.name for q, _, _ in an.parts], [k.name for _, k, _ in an.parts]
    return {"batch": full[roles.batch] if roles.batch else 1, "heads": heads,
            "kv_heads": (full[roles.kv_head] if roles.kv_head else 1) * roles.maps_size,
            "q_len": full[roles.row], "kv_len": full[roles.key],
            # the score's parts side by side (MLA's c + r), as flex and SDPA take them
            "dim": sum(full[w] for w in (roles.dim,) + roles.more_dims), "value_dim": full[roles.vdim],
            # FLOPs are halved only for exactly causal masks (the usual convention)
            "causal": causal, "causal_part": causal_part,
            # what the backward differentiates: the query parts, the key parts, V
            "queries": queries, "keys": keys, "operands": queries + keys + [an.value.name]}


def _kept_pairs(diagram: ir.Diagram) -> list:
    """The mask as the kernels take it: the predicate of the (query, key)
    pairs they compute, [] for all (the code generator's, which finds every
    where(p, ..., -inf), nested or added, whose masked scores add nothing to
    the output).  Every where(..., -inf) node was once taken for a mask:
    4 * tanh(where(x <= q, s, -inf) / 4) scores a masked key -4 and keeps it,
    yet its row was called causal, its FLOPs halved and its SDPA speed
    reference run causal."""
    from ..codegen import lower

    plan = lower.lower(diagram)
    skip = getattr(plan, "skip", None)
    return [masks._without_not(skip)] if skip is not None else []


def _to_flex(name: str, axes, roles: Roles, last: str, kv: bool) -> str:
    """Python text taking tensor ``name``, laid out along ``axes``, to flex's
    (B, H, L, E): permuted to that order, GQA's apart hk and g flattened into
    one head dim, a missing batch or head dim (multi-query K and V) added."""
    if roles.maps is not None:
        return _maps_to_flex(name, axes, roles, last, kv)
    heads = ((roles.kv_head,) if roles.kv_head else ()) if kv else tuple(roles.head or ())
    together = len(heads) == 2 and not roles.apart   # Q[b, (hk g), q, d]: one axis already
    want = [(w,) for w in (roles.batch,) if w] + ([heads] if together else [(h,) for h in heads]) \
        + [(roles.key if kv else roles.row,), (last,)]
    perm = [list(axes).index(a) for a in want]
    text = name
    if perm != sorted(perm):
        text += f".permute({', '.join(map(str, perm))})"
    if len(heads) == 2 and roles.apart:
        first = 1 if roles.batch else 0
        text += f".flatten({first}, {first + 1})"
    if roles.batch is None:
        text += ".unsqueeze(0)"
    if not heads:
        text += ".unsqueeze(1)"
    return text


def _maps_to_flex(name: str, axes, roles: Roles, last: str, kv: bool) -> str:
    """_to_flex for differential attention's maps: Q's and K's (g d) axis
    split, g put after the head and flattened with it (flex's head h * |g| +
    g); V, which lacks g, repeated over it (a copy, made once by prepare)."""
    g, size, axes = roles.maps, roles.maps_size, list(axes)
    text = name
    held = (g, last) in axes
    if held:
        at = axes.index((g, last))
        text += f".unflatten({at}, ({size}, -1))"
        axes[at:at + 1] = [(g,), (last,)]
    head = [(roles.head[0],)] if roles.head else []
    want = [(w,) for w in (roles.batch,) if w] + head + ([(g,)] if held else []) \
        + [(roles.key if kv else roles.row,), (last,)]
    perm = [axes.index(a) for a in want]
    if perm != sorted(perm):
        text += f".permute({', '.join(map(str, perm))})"
    first = 1 if roles.batch else 0
    if not held:
        text += f".unsqueeze({first + len(head)}).expand({', '.join(['-1'] * (first + len(head)) + [str(size), '-1', '-1'])})"
    if head:
        text += f".flatten({first}, {first + 1})"
    if roles.batch is None:
        text += ".unsqueeze(0)"
    return text


def _side_by_side(an, roles: Roles, kv: bool) -> str:
    """Q (or K) in flex's layout: the score's one contraction's, or its parts' (MLA's Qc and
    Qr) concatenated along the feature dim, whose product is the parts' products added up."""
    parts = [_to_flex(t.name, t.axes, roles, w, kv) for t, w in ((k if kv else q, w) for q, k, w in an.parts)]
    return parts[0] if len(parts) == 1 else f"torch.cat([{', '.join(parts)}], -1)"


def _module(d, an, roles, scale, score_text, mask_text, side, sizes,
            epilogue: Optional[tuple[str, ...]] = None) -> list[str]:
    """The module's lines; ``epilogue``: the diagram's outputs when flex
    computes others (FLEX_OUTPUTS, d's) and epilogue() makes them."""
    names = [t.name for t in d.inputs]
    q, k, v = an.q.name, an.k.name, an.value.name
    if len(an.parts) > 1:   # MLA's parts, side by side
        q = "[" + ", ".join(qp.name for qp, _, _ in an.parts) + "]"
        k = "[" + ", ".join(kp.name for _, kp, _ in an.parts) + "]"
    lines = [
        f'"""FlexAttention equivalent of the napkin diagram `{d.name}`.',
        "",
        "Written by napkin.bench.flex from the diagram's IR (edit the diagram, not this",
        f"file).  flex_attention computes score = ({q} . {k}) * SCALE, applies score_mod,",
        "drops the entries mask_mod rejects (the where(..., -inf) of the diagram), and",
        f"normalises with softmax before contracting with {v}.",
        '"""',
        "import math",
        "",
        "import torch",
        "from torch.nn.attention import flex_attention as _flex",
        "",
        f"DIAGRAM = {d.name!r}",
        f"INPUTS = {tuple(names)!r}",
        f"OUTPUTS = {epilogue or tuple(o.name for o in d.outputs)!r}",
    ] + ([f"FLEX_OUTPUTS = {tuple(o.name for o in d.outputs)!r}"] if epilogue else []) + [
        f"SCALE = {scale!r}",
        f"ENABLE_GQA = {roles.gqa!r}",
        "_compiled = None  # torch.compile(flex_attention), made on first use",
        "RECOMPILES = 1024  # shapes (and modules) one process may compile flex_attention for",
        "",
        "",
        "def _exp(v):",
        "    # math.exp past its range is inf, as torch.exp's (it raised OverflowError); a test, not",
        "    # try/except: dynamo traces score_mod, and an exception there is its error",
        "    return math.exp(v) if v <= 709.782712893384 else math.inf   # log(sys.float_info.max)",
        "",
        "",
        "def _compile():",
        '    """torch.compile(flex_attention), dynamo\'s recompile limits lifted.  Every',
        "    shape compiles anew (dynamic=False), and every module's compile of the one",
        "    flex_attention counts towards the same limit (8 by default), past which",
        "    dynamo runs it eagerly, unfused, with a warning: timed as compiled, that",
        '    would be a wrong number, so a limit reached anyway is an error."""',
        "    import torch._dynamo",
        "",
        "    cfg = torch._dynamo.config",
        '    for name in ("recompile_limit", "accumulated_recompile_limit"):',
        "        if hasattr(cfg, name):",
        "            setattr(cfg, name, max(getattr(cfg, name), RECOMPILES))",
        '    if hasattr(cfg, "fail_on_recompile_limit_hit"):',
        "        cfg.fail_on_recompile_limit_hit = True",
        "    return torch.compile(_flex.flex_attention, dynamic=False)",
        "",
        "",
        f"def make_mods({''.join(s + ', ' for s in side)}_sizes):",
        '    """score_mod and mask_mod (None when there is none), closing over the side',
        "    tensors (by their diagram names) and the wire sizes they read; every other",
        '    name here starts with an underscore, which no diagram name can."""',
    ]
    lines += [f"    _size_{w} = _sizes[{w!r}]" for w in sizes]
    if score_text is None:
        lines += ["    _score_mod = None  # the score is used as flex_attention computes it"]
    else:
        lines += ["", "    def _score_mod(_score, _b, _h, _q_idx, _kv_idx):", f"        return {score_text}"]
    if mask_text is None:
        lines += ["    _mask_mod = None  # nothing is masked"]
    else:
        if not names_read(mask_text) & {"_b", "_h", "_q_idx", "_kv_idx"}:
            # a mask of sizes alone is a Python bool; flex wants a tensor
            mask_text = f"(_q_idx >= 0) & {mask_text}"
        lines += ["", "    def _mask_mod(_b, _h, _q_idx, _kv_idx):", f"        return {mask_text}"]
    lines += ["", "    return _score_mod, _mask_mod", "", ""]
    params = ", ".join(names)
    # A block mask per batch and head only where the mask reads them: one of
    # 16 heads x 16K x 16K is built through a 4 GiB boolean tensor; None
    # broadcasts one over them.
    reads = names_read(mask_text) if mask_text is not None else frozenset()
    mask_dims = ["_q.shape[0]" if "_b" in reads else "None", "_q.shape[1]" if "_h" in reads else "None"]
    # prepare() and visible() take the inputs as *_inputs and never bind a
    # diagram name (an input called q or compiled would rebind their own)
    mods = f"make_mods({''.join(f'_inputs[{names.index(s)}], ' for s in side)}_sizes)"
    if an.gate is not None:   # flex has no gate on the value: V * gate is its V
        v = f"({v} * {an.gate.name}{along(ir.axis_wires(an.gate.axes), ir.axis_wires(an.value.axes))}).to({v}.dtype)"
    arranged = (f"({_side_by_side(an, roles, kv=False)}, {_side_by_side(an, roles, kv=True)}, "
                f"{_to_flex(v, an.value.axes, roles, roles.vdim, kv=True)})")
    # flex_attention takes one dtype: 8-bit q and k in v's, which holds them exactly (the fp16
    # attention an 8-bit kernel is measured against)
    eight = any(x.dtype in ir.FACTOR_DTYPES for part in an.parts for x in part[:2])
    body = [f"    _q, _k, _v = {arranged}", "    return _q.to(_v.dtype), _k.to(_v.dtype), _v"] if eight \
        else [f"    return {arranged}"]
    lines += [f"def arrange({params}):",
              '    """(q, k, v) in the (B, H, L, E) layout flex_attention and SDPA take'
              + (', q and k in v\'s dtype."""' if eight else '."""'), *body, "", ""]
    lines += [
        "def finish(out, lse=None, kv_heads=1):",
        '    """(B, H, L, E) out and (B, H, L) lse back in the diagram\'s layouts, dtypes',
        '    and output order, as a tuple; an output not computed (lse None) is None.',
        '    kv_heads (K\'s H) splits the query heads of an output holding hk and g apart."""',
        f"    return {_outputs(d, an, roles)}",
        "",
        "",
        "def prepare(*_inputs, compiled=False, compile_mask=False):",
        '    """Arrange the inputs (in INPUTS order) and build the block mask once;',
        "    returns a callable with no arguments computing the outputs (a tuple in",
        "    OUTPUTS order), so a benchmark times flex_attention alone.  compile_mask:",
        "    create_block_mask through torch.compile too, as a loop that rebuilds the",
        '    mask each step (its lengths grew) would run it (bench/decode.py --ragged)."""',
        "    global _compiled",
        "    _q, _k, _v = arrange(*_inputs)",
        f"    _sizes = {_size_exprs(d, sizes)}",
        f"    _score_mod, _mask_mod = {mods}",
        "    _block_mask = None",
        "    if _mask_mod is not None:",
        f"        _block_mask = _flex.create_block_mask(_mask_mod, {mask_dims[0]}, {mask_dims[1]}, _q.shape[2],",
        "                                              _k.shape[2], device=_q.device, _compile=compile_mask)",
        "    _attend = _flex.flex_attention",
        "    if compiled:",
        "        if _compiled is None:",
        "            _compiled = _compile()",
        "        _attend = _compiled",
        "",
        "    def _run():",
        "        _out, _aux = _attend(_q, _k, _v, score_mod=_score_mod, block_mask=_block_mask, scale=SCALE,",
        "                             enable_gqa=ENABLE_GQA, return_aux=_flex.AuxRequest(lse=True))",
        "        return " + ("epilogue(finish(_out, _aux.lse, _k.shape[1]), _inputs)" if epilogue else
                            "finish(_out, _aux.lse, _k.shape[1])"),
        "",
        "    return _run",
        "",
        "",
        "def visible(*_inputs, rows=1024):",
        '    """The fraction of (query, key) pairs mask_mod keeps on these inputs,',
        "    counted exactly, a block of query rows at a time: the share of the",
        "    dense FLOPs a masked attention has to do.  Over every batch and head",
        '    only where the mask reads them (the block mask\'s rule above)."""',
        "    _q, _k, _v = arrange(*_inputs)",
        f"    _sizes = {_size_exprs(d, sizes)}",
        f"    _, _mask_mod = {mods}",
        "    if _mask_mod is None:",
        "        return 1.0",
        f"    _batches, _heads = {mask_dims[0].replace('None', '1')}, {mask_dims[1].replace('None', '1')}",
        "    _lq, _lk = _q.shape[2], _k.shape[2]",
        "    _kv_idx = torch.arange(_lk, device=_q.device)[None, :]",
        "    _kept = 0",
        "    for _b in range(_batches):",
        "        for _h in range(_heads):",
        "            _at = torch.tensor(_b, device=_q.device), torch.tensor(_h, device=_q.device)",
        "            for _start in range(0, _lq, rows):",
        "                _q_idx = torch.arange(_start, min(_start + rows, _lq), device=_q.device)[:, None]",
        "                _keep = torch.as_tensor(_mask_mod(*_at, _q_idx, _kv_idx), device=_q.device)",
        "                _kept += int(torch.broadcast_to(_keep, (_q_idx.shape[0], _lk)).sum())",
        "    return _kept / (_batches * _heads * _lq * _lk)",
    ]
    return lines


def _size_exprs(d: ir.Diagram, wires: list[str]) -> str:
    """A dict literal binding each needed symbolic wire to a shape lookup."""
    items = []
    for w in wires:
        items.append(f"{w!r}: {_shape_of(d, w)}")
    return "{" + ", ".join(items) + "}"


def _shape_of(d: ir.Diagram, wire: str) -> str:
    """Python reading ``wire``'s size from the inputs' shapes (``_inputs``, by
    position)."""
    for n, t in enumerate(d.inputs):
        for i, axis in enumerate(t.axes):
            if axis == (wire,):
                return f"_inputs[{n}].shape[{i}]"
    for n, t in enumerate(d.inputs):      # only inside a flattened axis: divide the others out
        for i, axis in enumerate(t.axes):
            if wire in axis:
                others = [w for w in axis if w != wire]
                div = " * ".join(_shape_of(d, w) if d.wire(w).size is None else str(d.wire(w).size)
                                 for w in others)
                return f"_inputs[{n}].shape[{i}] // ({div})"
    raise NoFlexEquivalent(d.name, f"no input shape gives the size of wire {wire}")


def _outputs(d: ir.Diagram, an: Analysis, roles: Roles) -> str:
    """finish()'s return expression: flex's (B, H, L, E) out and (B, H, L) lse
    taken back to the diagram's layouts and dtypes, in its output order."""
    parts = []
    for o in d.outputs:
        let = d.tensor(o.name)
        is_out = o.name == an.attention
        last = roles.vdim if is_out else None
        # GQA's heads as the output holds them: (hk g) as one axis, or hk and g apart
        apart = roles.group is not None and roles.head not in let.axes
        heads = [(w,) for w in roles.head] if apart else [roles.head] if roles.head else []
        heads += [(roles.maps,)] if roles.maps is not None else []   # flex's h * |g| + g
        have = [(roles.batch,)] if roles.batch else []
        have += heads + [(roles.row,)] + ([(last,)] if last else [])
        text = "out" if is_out else "lse"
        if roles.batch is None:
            text += ".squeeze(0)"
        if not heads:
            text += ".squeeze(0)"
        if apart:
            text += f".unflatten({1 if roles.batch else 0}, (kv_heads, -1))"
        if roles.maps is not None and roles.head is not None:
            text += f".unflatten({1 if roles.batch else 0}, (-1, {roles.maps_size}))"
        if sorted(let.axes) != sorted(have):
            raise NoFlexEquivalent(d.name, f"output {o.name}{layout(let.axes)} is not laid out along "
                                           f"{layout(have)}, as flex_attention returns it")
        perm = [have.index(a) for a in let.axes]
        if perm != sorted(perm):
            text += f".permute({', '.join(map(str, perm))})"
        dtype = ir.TORCH_NAMES.get(tiling.tensor_dtype(d, o.name), "float32")
        text += f".to(torch.{dtype})"
        parts.append(text if is_out else f"None if lse is None else {text}")
    return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"


def load(diagram: ir.Diagram) -> types.ModuleType:
    """The emitted module, executed.  It is registered in sys.modules under a
    name unique to its text: torch.compile (which flex_attention runs even
    when called eagerly) looks the mods' globals up by module name."""
    src = emit(diagram)
    name = f"napkin_flex_{diagram.name}_{hashlib.sha256(src.text.encode()).hexdigest()[:12]}"
    if name in sys.modules:
        return sys.modules[name]
    module = types.ModuleType(name)
    module.__dict__["FLEX_SOURCE"] = src
    sys.modules[name] = module
    try:
        exec(compile(src.text, f"<flex equivalent of {diagram.name}>", "exec"), module.__dict__)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module
