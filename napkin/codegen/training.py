"""Training: what a generated module needs beyond its forward kernel.

``prepare(plan)`` decides, for a forward plan, how the module trains:

* ATTENTION: napkin.gradrules.grad_plan(diagram) gives the GradRule.  The
  values it saves (lse for softmax, the sums N_i, Z_j of a general
  normaliser) that are not outputs already are added to the diagram as
  float32 boxes (``_saved_lse = logsumexp[x](S)``, ...) and the forward is
  lowered again: the same kernel (the new boxes share its accumulators)
  with extra stores guarded by a constexpr _SAVE, so the plain forward's
  traffic does not change.  backward.py lowers the rule to three kernels.
* CONTRACTION ``C = f(R, ..)``, ``R = sum[k](A * B)``: the backward is two
  more contractions, dA = sum[n](dR * B) and dB = sum[m](A * dR), built as
  IR diagrams and lowered like any matrix product (strides do the
  transposes).  A constant slope f' (a scale, an added constant) multiplies
  both in their epilogues, dR being dC.  Any other f (a bias, relu, a gate,
  an index) gets an ``Epilogue``: dR = dC * f' and the side inputs'
  gradients in eager torch (``epilogue_lines``), after one more contraction
  recomputing R where they read it.

Anything else gets no backward; ``Training.reason`` says why, and the
module raises that at run time when a gradient is asked for.

``context(training, ...)`` renders templates/training.py.jinja: the
backward kernels and launchers, the public NAME_backward (and for attention
NAME_preprocess), and the torch custom ops (forward and backward, with fake
implementations) tying them to autograd and torch.compile.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Optional

from .. import autodiff, gradrules, ir, tiling
from ..autodiff import ONE
from ..errors import NapkinError
from ..printer import expr_text, layout_text
from . import launch as H
from . import ranges as R
from . import lower as L
from .kernel_names import fresh_name
from .pysrc import along, summed_to

SAVED_PREFIX = "_saved_"
# The backward launchers' keyword options (templates/training.py.jinja).
BACKWARD_OPTIONS = ("need", "grad_dtype")


@dataclass(frozen=True)
class Training:
    forward: L.Plan                    # the plan the module's forward kernel is emitted from
    saved: tuple[str, ...] = ()        # its outputs only training stores (_saved_lse, ...)
    rule: Optional[gradrules.GradRule] = None
    backward: Optional[object] = None  # backward.BackwardPlan
    grads: tuple[L.ContractionPlan, ...] = ()  # the matrix product's dA, dB (and its recomputed sum first)
    epilogue: Optional["Epilogue"] = None        # the matrix product's epilogue gradients, in torch
    # a matrix product's 8-bit factors, which get no gradient, and why (attention's: backward.ungradable)
    ungradable: tuple[tuple[str, str], ...] = ()
    reason: Optional[str] = None       # why there is no backward
    reason_loc: ir.Loc = ir.NOLOC      # and where in the diagram, when a place is to blame


def _no(plan: L.Plan, why: str, loc: ir.Loc = ir.NOLOC) -> Training:
    return Training(plan, reason=f"napkin has no backward for diagram {plan.diagram.name}: {why}", reason_loc=loc)


def located_reason(t: Training) -> Optional[str]:
    """Why there is no backward, with the diagram's line and column where a
    place is to blame: the generated module's NotImplementedError has no
    caret to show, so its words say where."""
    from .backward import located

    return None if t.reason is None else located(t.reason, t.reason_loc)


def no_gradient(t: Training) -> dict[str, str]:
    """The float inputs napkin emits no gradient for, and why: attention's (backward.ungradable)
    or a matrix product's 8-bit factors."""
    return dict(t.backward.ungradable) if t.backward is not None else dict(t.ungradable)


def prepare(plan: L.Plan) -> Training:
    # an input is a parameter of the backward's launchers, beside their options
    # (public: NAME_backward(..., need=None, grad_dtype="float32")); a box never is
    for option in BACKWARD_OPTIONS:
        if isinstance(plan.diagram.tensor(option), ir.Input):
            return _no(plan, f"its input '{option}' has the name of the backward's option; rename it",
                       plan.diagram.tensor(option).loc)
    try:
        if plan.family == "attention":
            return _attention(plan)
        return _contraction(plan)
    except NapkinError as err:
        return _no(plan, err.messages[0], err.diagnostics[0].loc)


# --------------------------------------------------------------------------
# Attention.
# --------------------------------------------------------------------------

def _score_boxed(d: ir.Diagram) -> Optional[ir.Diagram]:
    """``d`` with its score given a box of its own that reads inputs alone, or
    None when there is no one such score.  ``sum[x](softmax[x](sum[d](Q * K)
    * |d|^-0.5) * V)`` is the attention of a score box ``inline_score =
    sum[d](Q * K) * |d|^-0.5`` (boxes are names: the kernels are the same),
    and grad_plan finds a score by a box that reads inputs.  The score: what
    the softmax or logsumexp normalisers take, boxes written out (a score
    box reading a bias box B2 = bias * 2 reads bias), where that holds a
    contraction of two inputs; else, with no such normaliser (sigmoid, L2,
    ReLU² written as sums), the one contraction of two inputs itself (what
    surrounds it is a function of the score to them).  Boxes nothing reads
    any more (S, B2) are left out.  The box's name says what it is in a
    refusal that names it."""
    inputs = {i.name for i in d.inputs}
    env = L.inline(d)

    def expand(e):
        if isinstance(e, ir.TensorRef) and e.name in env and e.wires is None:
            return env[e.name]
        return autodiff._map(e, expand)

    def contraction(n) -> bool:
        return (isinstance(n, ir.Reduce) and n.op == "sum" and isinstance(n.body, ir.Binary) and n.body.op == "*"
                and all(isinstance(t, ir.TensorRef) and t.name in inputs for t in (n.body.lhs, n.body.rhs)))

    written, scores = [], []   # each normaliser's argument as written, and written out
    normalisers = gradrules.normalisers(d)
    for n in normalisers:
        e = expand(n.body)
        if any(contraction(m) for m in ir.walk(e)):
            written.append(n.body)
            scores.append(e)
    if not normalisers:
        written = scores = list(dict.fromkeys(n for let in d.lets for n in ir.walk(let.expr) if contraction(n)))
    if len(set(scores)) != 1:
        return None
    score = scores[0]
    free = L.wires_of(d, score)
    taken = {t.name for t in d.inputs + d.lets} | {w.name for w in d.wires}
    box = ir.Let(fresh_name("inline_score", taken, prefix=""),
                 tuple((w.name,) for w in d.wires if w.name in free), None, score, written[0].loc)

    def boxed(e):
        for w in set(written):
            e = autodiff.substitute(e, w, ir.TensorRef(box.name))
        return e
    lets = [box] + [dataclasses.replace(let, expr=boxed(let.expr)) for let in d.lets]
    outputs = {o.name for o in d.outputs}
    while True:   # the boxes only the score read (S, B2) are read by nothing now: gone
        read = {n.name for let in lets for n in ir.walk(let.expr) if isinstance(n, ir.TensorRef)}
        unread = [let for let in lets if let.name not in read and let.name not in outputs]
        if not unread:
            break
        lets = [let for let in lets if let not in unread]
    return dataclasses.replace(d, lets=tuple(lets))


def _stays_fp32(plan: L.AttentionPlan, name: str) -> bool:
    """Whether output ``name`` is float32 at every call: undeclared row state
    (emit.row_state_outputs), or declared fp32 where no float input is, so it
    follows no input's dtype (fp32 inputs called with fp16 ones give an fp16
    ``lse : fp32``, the module's _out_dtype)."""
    from .emit import row_state_outputs

    d = plan.diagram
    if tiling.tensor_dtype(d, name) != "fp32":
        return False
    return name in row_state_outputs(plan) or all(t.dtype != "fp32" for t in d.inputs)


def _attention(plan: L.AttentionPlan) -> Training:
    from .backward import lower_backward

    # K[b, h, x, d] of K[b, h, x, d] is K: the rules take a written relabel for a read along other
    # wires, and refused such a score as "the raw score must be a contraction sum[w](A * B) of two
    # inputs" (it is one)
    d = ir.plain_reads(plan.diagram)
    if d is not plan.diagram:
        plan = L.lower(d)
    try:
        rule = gradrules.grad_plan(d)
    except ValueError as err:   # gradrules.NoGrad, with the place to blame
        boxed = _score_boxed(d)
        if boxed is None:
            return _no(plan, str(err), getattr(err, "loc", ir.NOLOC))
        try:   # the score written inline: the same attention with its score boxed
            rule = gradrules.grad_plan(boxed)
        except ValueError as again:   # the box is napkin's: the user wrote no such name
            why = re.sub(rf"\b{boxed.lets[0].name}\b", "the score written inline", str(again))
            return _no(plan, why, getattr(again, "loc", ir.NOLOC))
        plan, d = L.lower(boxed), boxed
    bound = dict(rule.bound)
    tiles = {n for n, _ in rule.tile} | {"R"}
    for name in dict(rule.layouts):
        t = d.tensor(name)
        if name not in tiles and t is not None and bound.get(name) != name:
            return _no(plan, f"the diagram's tensor {name} has the name of a value its backward stores; rename it",
                       t.loc)
    score = bound["S"]
    out_axes = d.tensor(bound["O"]).axes
    feat = set(rule.layout("O")) - set(rule.layout("S"))
    row_axes = tuple(a for a in out_axes if not set(a) & feat)
    lets, saved, saved_axes = [], [], {}
    for name in rule.saved:
        # A forward output can stand for a saved value, with one exception: a
        # row state (lse) stored narrower than float32.  The backward rebuilds
        # every P = exp(S - lse) from it, and an fp16 lse of 20 is off by up to
        # 0.008, every P with it.  O is fine in its own dtype: it enters only
        # through delta = rowsum(dO * O), as in FlashAttention.
        if name in bound and (name == "O" or _stays_fp32(plan, bound[name])):
            continue
        expr = autodiff.substitute(rule.binding(name), ir.TensorRef("S"), ir.TensorRef(score))
        stray = {n.name for n in ir.walk(expr) if isinstance(n, ir.TensorRef) and d.tensor(n.name) is None}
        if stray:
            return _no(plan, f"its saved value {name} reads {', '.join(sorted(stray))}")
        axes = out_axes if feat & set(rule.layout(name)) else row_axes
        lets.append(ir.Let(SAVED_PREFIX + name, axes, "fp32", expr))
        saved.append(SAVED_PREFIX + name)
        saved_axes[name] = axes
    forward = plan
    if lets:
        aug = dataclasses.replace(d, lets=d.lets + tuple(lets),
                                  outputs=d.outputs + tuple(ir.Output(n) for n in saved))
        forward = L.lower(aug)
    if rule.value_gate is not None:   # formed in torch, which takes a tensor's wires one an axis
        grouped = [n for n in (rule.value, rule.value_gate) if any(len(a) > 1 for a in d.tensor(n).axes)]
        if grouped:
            return _no(plan, f"input {grouped[0]} has a grouped axis ({layout_text(d.tensor(grouped[0]).axes)}), and "
                       f"the backward forms {rule.value} * {rule.value_gate} in torch, one wire an axis",
                       d.tensor(grouped[0]).loc)
    back = lower_backward(d, plan, rule, saved_axes)
    return Training(forward, tuple(saved), rule, back)


# --------------------------------------------------------------------------
# Contraction.
# --------------------------------------------------------------------------

def _contraction(plan: L.ContractionPlan) -> Training:
    d = plan.diagram
    out = d.outputs[0]
    expr = L.inline(d)[out.name]
    a, b = plan.lhs.tensor, plan.rhs.tensor
    epi = _epilogue(d, expr, plan.red, (a, b))
    if isinstance(epi, str):
        return _no(plan, f"its output {out.name} is {epi}", d.tensor(out.name).expr.loc)
    # 8-bit factors get no gradient (an fp8 one, stored in fp8, saturated past 448 (e4m3); torch keeps
    # none of an integer tensor); the epilogue's float inputs (the dequantising scales) still train
    from .backward import eight_bit_reason, no_eight_bit_gradient

    ungradable = {t.name: no_eight_bit_gradient(t) for t in (d.tensor(a), d.tensor(b)) if t.dtype in ir.FACTOR_DTYPES}
    for name in (a, b):
        t = d.tensor(name)
        if t.dtype not in ir.FLOAT_DTYPES + ir.FACTOR_DTYPES:
            return _no(plan, f"{name} is not a float tensor", t.dtype_loc)
    if len(ungradable) == 2 and not epi.sides:   # nothing left to train
        return _no(plan, f"{a} is {eight_bit_reason(d.tensor(a))} (the forward runs on inputs that require "
                   "no gradient)", d.tensor(a).dtype_loc)
    if {plan.lhs.wires, plan.rhs.wires} != {ir.axis_wires(d.tensor(a).axes), ir.axis_wires(d.tensor(b).axes)}:
        # named, at the relabelled reference (A * A[n, k]): it named neither (contract hunt)
        ref = next((n for n in ir.walk(expr) if isinstance(n, ir.TensorRef) and n.name in (a, b)
                    and n.wires is not None and tuple(n.wires) != ir.axis_wires(d.tensor(n.name).axes)), None)
        if ref is None:   # pragma: no cover - the plan reads its factors as written
            return _no(plan, "an input is read along other wires than its own")
        return _no(plan, f"input {ref.name} is read as {expr_text(ref)}, along other wires than its own "
                         f"{layout_text(d.tensor(ref.name).axes)}; a matmul's backward takes each factor along "
                         "its own wires", ref.loc)
    # the gradient products read dR: dC itself where the slope is a constant (on their epilogues),
    # else the epilogue's torch part computes it into a buffer of dC's layout under this name
    grad_c = ir.Input(f"_grad_{out.name}", d.tensor(out.name).axes, _dc_dtype(d, out.name))
    blocks = dict(plan.blocks)
    grads = []
    if epi.recompute:
        # the slope or a side input's gradient reads the sum itself: one more product, the forward's
        # without its epilogue, into float32 (cheaper than keeping it from every forward call)
        let = ir.Let(EPI_SUM, d.tensor(out.name).axes, "fp32", epi.raw)
        g = ir.Diagram(f"{d.name}_bwd_sum", d.wires, (d.tensor(a), d.tensor(b)), (let,), (ir.Output(EPI_SUM),),
                       _grad_schedule(d, plan, blocks, plan.row, plan.col, plan.red))
        grads.append(L.lower(g))
    for target, other, keep, red in ((a, b, plan.row, plan.col), (b, a, plan.col, plan.row)):
        if target in ungradable:
            continue
        t = d.tensor(target)
        factors = (ir.TensorRef(grad_c.name), ir.TensorRef(other)) if target == a else \
            (ir.TensorRef(other), ir.TensorRef(grad_c.name))
        # a factor without a batch wire of the output (nn.Linear's weight, shared by every b): its
        # gradient sums over that wire too, each program looping over it (ContractionPlan.outer)
        shared = tuple(w for w in plan.batch if w not in ir.axis_wires(t.axes))
        body = ir.Reduce("sum", shared + (red,), ir.Binary("*", *factors))
        if epi.factor != ir.Num(1):   # dR = dC * f', f' a constant: on the gradient's epilogue, once a tile
            body = ir.Binary("*", body, epi.factor)
        let = ir.Let(f"_grad_{target}", t.axes, "fp32", body)
        # dA keeps k (B's side), dB keeps k (A's side)
        g = ir.Diagram(f"{d.name}_bwd_{target}", d.wires, (grad_c, d.tensor(other)) if target == a
                       else (d.tensor(other), grad_c), (let,), (ir.Output(let.name),),
                       _grad_schedule(d, plan, blocks, keep, plan.red, red, shared))
        gplan = L.lower(g)
        if gplan.family != "contraction" or {gplan.row, gplan.col} != {keep, plan.red}:
            return _no(plan, f"the gradient of {target} does not lower to a matrix product")
        grads.append(gplan)
    return Training(plan, (), None, None, tuple(grads), epilogue=epi if epi.torch_part else None,
                    ungradable=tuple(ungradable.items()))


def _grad_schedule(d: ir.Diagram, plan: L.ContractionPlan, blocks: dict, row: str, col: str,
                   red: str, summed: tuple[str, ...] = ()) -> ir.Schedule:
    """One product of the backward, tiled by the forward's blocks; the forward's batch wires
    ``summed`` (a shared factor's gradient adds them up) are no program's."""
    tiles = [ir.Tile(w, "group", 1) for w in plan.batch if w not in summed] + [
        ir.Tile(row, "group", blocks[row]), ir.Tile(col, "group", blocks[col]), ir.Tile(red, "stream", blocks[red])]
    return ir.Schedule(None, "fp32", d.schedule.tf32 if d.schedule else False,
                       (ir.Level("smem", None, tuple(tiles), ()),))


# The names the epilogue's torch part gives what it reads and computes (every
# other tensor there is the diagram's own input, renamed EPI_PREFIX + name).
EPI_PREFIX = "_epi_in_"
EPI_SUM = "_epi_sum"    # the recomputed sum[k](A * B), float32
EPI_DC = "_epi_dC"      # dC
EPI_DR = "_epi_dR"      # dC * f'(...), what the gradient products read
EPI_GRAD = "_epi_grad_"  # + an input's name: its gradient


@dataclass(frozen=True)
class Epilogue:
    """A matrix product's output f(R, T..), R = sum[k](A * B), taken apart
    for its backward.  ``factor``: f' when it is a constant (folded into the
    gradient products' epilogues, no torch part for dR), else ONE; ``slope``:
    f' over the renamed tensors when it varies; ``sides``: each float input T
    f reads, with df/dT; ``recompute``: whether any of those reads R."""

    raw: ir.Reduce
    factor: ir.Expr
    slope: Optional[ir.Expr]
    sides: tuple[tuple[str, ir.Expr], ...]
    reads: tuple[str, ...]                 # every input f reads (integer ones too)
    recompute: bool

    @property
    def torch_part(self) -> bool:
        return self.slope is not None or bool(self.sides)


def _epilogue(d: ir.Diagram, expr: ir.Expr, red: str, factors: tuple[str, str]):
    """``expr``'s Epilogue, or a string saying why it has none: not one sum
    over ``red`` (the product), an epilogue that reads a factor of the
    product, an input read along other wires than its own, or a function
    napkin cannot differentiate."""
    raws = [n for n in ir.walk(expr) if isinstance(n, ir.Reduce)]
    if not raws or raws[0].op != "sum" or red not in raws[0].wires or any(n != raws[0] for n in raws):
        return f"not a sum[{red}] of the two inputs"
    raw = raws[0]
    if expr == raw:
        return Epilogue(raw, ir.Num(1), None, (), (), False)
    r = ir.TensorRef(EPI_SUM)
    f = autodiff.substitute(expr, raw, r)
    reads: list[str] = []
    for n in ir.walk(f):
        if isinstance(n, ir.TensorRef) and n.name != EPI_SUM:
            if n.name in factors:
                return f"{expr_text(expr)}, whose epilogue reads {n.name}, a factor of the product"
            if n.wires is not None and tuple(n.wires) != ir.axis_wires(d.tensor(n.name).axes):
                return f"{expr_text(expr)}, whose epilogue reads {expr_text(n)} along other wires than its own"
            if n.name not in reads:
                reads.append(n.name)
    # every input read by its own name, so that d/dT finds each read of T
    f = _renamed(f)
    try:
        slope = autodiff.diff(f, r)
        sides = tuple((t, autodiff.diff(f, ir.TensorRef(EPI_PREFIX + t))) for t in reads
                      if d.tensor(t).dtype in ir.FLOAT_DTYPES)
    except ValueError as err:
        return f"{expr_text(expr)}, whose epilogue napkin cannot differentiate ({err})"
    varies = any(isinstance(n, (ir.TensorRef, ir.WireIndex)) for n in ir.walk(slope))
    recompute = any(n == r for e in (slope, *(e for _, e in sides)) for n in ir.walk(e))
    return Epilogue(raw, ONE if varies else slope, slope if varies else None, sides, tuple(reads), recompute)


def writes_dr(t: Training) -> bool:
    """Whether the epilogue's torch part computes dR = dC * f': where the slope varies
    and a gradient product reads it (none where both factors are 8-bit: the scales alone
    train).  The cost pass prices its store by the same rule."""
    return t.epilogue.slope is not None and any(g.diagram.outputs[0].name != EPI_SUM for g in t.grads)


def epilogue_lines(t: Training) -> list[str]:
    """The backward's torch part for a matrix product's epilogue: from dC (and
    the recomputed sum), dR = dC * f' into dC's variable where the slope
    varies, and each side input's gradient, sum over the wires it lacks of
    dC * df/dT, float32 (float64 for float64 inputs), as EPI_GRAD + T.
    Rendered as the reference is, from an IR diagram of those boxes."""
    epi, d = t.epilogue, t.forward.diagram
    out = d.tensor(d.outputs[0].name)
    c_wires = ir.axis_wires(out.axes)
    ins = [ir.Input(EPI_DC, out.axes, "fp32")]
    if epi.recompute:
        ins.append(ir.Input(EPI_SUM, out.axes, "fp32"))
    ins += [dataclasses.replace(d.tensor(n), name=EPI_PREFIX + n) for n in epi.reads]
    dc = ir.TensorRef(EPI_DC)
    lets = []
    dr = writes_dr(t)
    if dr:
        lets.append(ir.Let(EPI_DR, out.axes, "fp32", ir.Binary("*", dc, epi.slope)))
    outs = [x.name for x in lets]
    for name, deriv in epi.sides:
        # a bias's gradient is dR summed: relu(R + bias)'s where(R + bias > 0, 1, 0) once
        body = ir.TensorRef(EPI_DR) if dr and deriv == epi.slope else \
            autodiff.simplify(ir.Binary("*", dc, deriv))
        lacking = tuple(w for w in c_wires if w not in ir.axis_wires(d.tensor(name).axes))
        if lacking:
            if not isinstance(body, ir.TensorRef):
                # the product a box of its own, then summed: an einsum of dC and where(c, 1, 0) (a
                # slope of relu's) met a float tensor and an integer one, which torch refuses
                lets.append(ir.Let(f"_epi_t_{name}", out.axes, "fp32", body))
                body = ir.TensorRef(lets[-1].name)
            body = ir.Reduce("sum", lacking, body)
        lets.append(ir.Let(EPI_GRAD + name, d.tensor(name).axes, "fp32", body))
        outs.append(lets[-1].name)
    e = ir.Diagram(f"{d.name}_epilogue", d.wires, tuple(ins), tuple(lets), tuple(ir.Output(x) for x in outs))
    from .emit import reference_inputs
    from .reference import reference_lines
    # computed in float32, float64 where the inputs are (as the reference)
    head = ["_c = torch.float64 if torch.float64 in _cls.values() else torch.float32",
            f"{EPI_DC} = _grad_{out.name}"] + [f"{EPI_PREFIX}{n} = {n}" for n in epi.reads]
    body = reference_inputs(e) + reference_lines(e)   # the reference's _c: the dtype they compute in
    tail = []
    for name, _ in epi.sides:
        # contiguous, as the torch op's fake says (a T[n, m]'s gradient came out a transposed view)
        tail.append(f'{EPI_GRAD}{name} = {EPI_GRAD}{name}.reshape(_shape("{name}", _sz)).to('
                    f'{name}.dtype if _like else torch.float32).contiguous() '
                    f'if _need[{_input_index(d, name)}] else None')
    if dr:   # an argument of the products below, in dC's dtype
        tail.append(f'_grad_{out.name} = {EPI_DR}.reshape(_shape("{out.name}", _sz)).to(_dc)')
    # only where a gradient is asked (the sum it may read is launched so); the side inputs' None else
    nothing = [f"{EPI_GRAD}{name} = None" for name, _ in epi.sides]
    return nothing + ["if any(_need):"] + ["    " + line for line in head + body + tail]


def _input_index(d: ir.Diagram, name: str) -> int:
    """Input ``name``'s position among d's inputs: its parameter's, and its flag's in ``_need``."""
    return [t.name for t in d.inputs].index(name)


def _renamed(e: ir.Expr) -> ir.Expr:
    """``e`` with every input read by its own wires and renamed EPI_PREFIX + name."""
    if isinstance(e, ir.TensorRef) and e.name != EPI_SUM:
        return ir.TensorRef(EPI_PREFIX + e.name)
    return ir.map_children(e, _renamed)


def _dc_dtype(d: ir.Diagram, name: str) -> str:
    from .. import tiling

    dtype = tiling.tensor_dtype(d, name)
    return dtype if dtype in L.KERNEL_DTYPES else "fp32"


# --------------------------------------------------------------------------
# The module's training part (templates/training.py.jinja).
# --------------------------------------------------------------------------

def _axes_repr(axes) -> str:
    from .emit import _layout_repr
    return _layout_repr(axes)


def backward_layouts(t: Training) -> str:
    """``_BACKWARD_LAYOUTS``: the layout of every tensor only training moves."""
    d = t.forward.diagram
    table = {}
    for name in t.saved:
        table[name] = d.tensor(name).axes
    if t.backward is not None:
        for name, axes in t.backward.axes:
            table.setdefault(name, axes)
    for g in t.grads:
        for tensor in list(g.diagram.inputs) + [g.diagram.tensor(g.diagram.outputs[0].name)]:
            table.setdefault(tensor.name, tensor.axes)
    if t.grads:   # a matrix product's dC, read by the epilogue's torch part where no product takes it
        out = d.outputs[0].name
        table.setdefault(f"_grad_{out}", d.tensor(out).axes)
    own = {x.name for x in d.inputs} | {o.name for o in d.outputs if o.name not in t.saved}  # in _LAYOUTS
    rows = [f'    "{n}": {_axes_repr(a)},\n' for n, a in table.items() if n not in own]
    return "{\n" + "".join(rows) + "}" if rows else "{}"


def context(t: Training, *, name: str, options: list[str], source_hash: str) -> dict:
    """The template variables of the training part of a module."""
    from .emit import environment

    d = t.forward.diagram
    inputs = [x.name for x in d.inputs]
    user_outputs = [o.name for o in d.outputs if o.name not in t.saved]
    floats = [x.dtype in ir.FLOAT_DTYPES for x in d.inputs]
    ctx = {
        "name": name, "inputs": inputs, "outputs": user_outputs, "saved": list(t.saved),
        "floats": floats, "options": options, "op_base": f"{name}_{source_hash[:8]}",
        "reason": located_reason(t), "family": None, "kernels": [], "grad_kernels": [],
        "ungradable": no_gradient(t),
        "inference": isinstance(t.forward, L.AttentionPlan),   # its launcher takes out_dtype= and chunk=
    }
    if t.backward is not None:
        ctx.update(_attention_context(t, user_outputs))
    elif t.grads:
        ctx.update(_contraction_context(t))
    return {"training": environment().get_template("training.py.jinja").render(**ctx).rstrip("\n")}


def _attention_context(t: Training, user_outputs: list[str]) -> dict:
    from .backward_emit import kernel_context, tiled_reads
    from .backward_hold import rows_round_do

    b, rule = t.backward, t.rule
    bound = {v: k for k, v in rule.bound}          # diagram name -> placeholder
    saved = [n[len(SAVED_PREFIX):] for n in t.saved]
    # an output whose saved float32 twin the backward reads instead is not unpacked
    outs = ["_" if bound.get(n) in saved else bound.get(n, "_") for n in user_outputs] + saved
    grads = [f"d{bound[n]}" if n in bound else "_" for n in user_outputs]
    if "dlse" in b.row_inputs + b.state and "dlse" not in grads:
        raise AssertionError("dlse is read but lse is no output")
    row_grads = _row_grads(b)
    # (input, wires read, steps) of each gradient summed by blocks: a side input's dQ part, a row gradient
    blocked = [(s.tensor, s.wires, s.steps) for s in b.sides if s.steps] + \
        [(r["tensor"], r["along"], r["steps"]) for r in row_grads if r["steps"]]
    # an input the rows read (sum[x](S * tau * V)'s tau) is a parameter already: listed again the
    # preprocess was def _t_preprocess(Q, K, V, tau, dO, tau, ...), no valid module
    row_inputs = [n for n in b.row_inputs if b.forward.diagram.tensor(n) is None or
                  not isinstance(b.forward.diagram.tensor(n), ir.Input)]
    inputs = [x.name for x in t.forward.diagram.inputs]
    grad_buffers = [f"_grad_{n}" for n in b.trained]
    tiled = any(tiled_reads(b, s) for s in b.sides)
    return {
        "family": "attention", "bw": b, "row": b.row, "col": b.col,
        # each gradient buffer's dtype: the input's under grad_dtype="input", else float32; a shared
        # input's shares (one a dK/dV program, summed after the kernels) float32 either way
        "grad_dtypes": {n: "torch.float32" if n in dict(b.shared) else f"{n}.dtype if _like else torch.float32"
                        for n in b.trained},
        "shared": [{"name": n, "wires": ", ".join(w), "dims": repr(tuple(range(len(w))))} for n, w in b.shared],
        # NAME_backward's given blocks, as the forward's launch checks them (a given block_x=32768 at
        # head dim 64 failed in Triton); tuned ones passed the same test in the lookup
        "tile_check": H.tile_fits(b.row, b.col, "_br", "_bc", GIVEN),
        "kernels": [kernel_context(b, k) for k in b.kernels],
        "unpack_outs": ", ".join(outs) + ("," if len(outs) == 1 else ""),
        "unpack_grads": ", ".join(grads) + ("," if len(grads) == 1 else ""),
        "row_inputs": row_inputs,
        "row_outputs": list(b.row_outputs), "aliases": list(b.aliases),
        "state": list(b.state), "grad_names": list(b.grads),
        "grid_batch": " * ".join(f'_sz["{w}"]' for w in b.batch) or "1",
        "kv_batch": " * ".join(f'_sz["{w}"]' for w in b.kernel("dkdv").batch) or "1",
        "sides": [{"tensor": s.tensor, "buffer": s.buffer, "index": _input_index(b.diagram, s.tensor),
                   "shape": _side_shape(b, s), "sum": _side_sum(b, s)} for s in b.sides],
        # a side input read at blocks of the tile's wires, its partial summed inside the tile (_tile_sum)
        "tiled": tiled,
        "row_grads": row_grads,
        # a gradient read at blocks of a wire is summed by them: the helper, where one is
        "by_blocks": bool(blocked),
        # (input, positional wire) where that gradient sums by blocks of the wire: refused with positions
        "blocked_reads": sorted({(n, w) for n, wires, steps in blocked for w, st in zip(wires, steps)
                                 if st > 1 and w in (b.row, b.col)}),
        # a mask that reads data: a launch plan's call runs its ranges prepasses again (mask_cache)
        "ranges": R.applies(b.forward),
        "grad_buffers": grad_buffers,
        # the launch functions' parameters: what the work (or a plan) hands them
        "launch_params": ", ".join([*inputs, *b.state, *grad_buffers, *(s.buffer for s in b.sides),
                                    "_need", "_like", "_sz", "_dev", "_runs", "_side"]
                                   + (["_br", "_bc"] if tiled else [])),   # the granules follow from them
        "optional": ["dlse"] if "dlse" in b.row_inputs else [],
        "preprocess_params": ", ".join([*inputs, *row_inputs, *b.row_outputs, "_run"]),
        "round_do": "dO" in b.row_inputs and rows_round_do(b),
        "gate": _gate_context(b) if b.gate else None,
    }


def _gate_context(b) -> dict:
    """The launcher's torch around the kernels of a gated value (BackwardPlan.gate):
    the gate put along V's axes (its own permuted to their order, None where it
    lacks one of V's wires), and dgate's sum of dW * V over those wires, put
    back in the gate's order."""
    d = b.forward.diagram
    vw, gw = ir.axis_wires(d.tensor(b.v).axes), ir.axis_wires(d.tensor(b.gate).axes)
    inputs = [t.name for t in d.inputs]
    # the kernels' arguments: the product in V's place
    args = ", ".join(f"({n}.to(torch.float32) * _g).to({n}.dtype)" if n == b.v else n for n in inputs)
    return {"name": b.gate, "value": b.v, "view": along(gw, vw), "sum": summed_to(vw, gw), "args": args,
            "iv": inputs.index(b.v), "ig": inputs.index(b.gate)}


def _row_grads(b) -> list:
    """The gradients of inputs the output's row function reads (GradRule.row_grads),
    as torch over their row values dT_i: summed over the stored wires the input
    lacks, put in its wires' order, shaped as it.  ``side``: it is also a side
    input of the scores, whose dQ-kernel part the launcher adds to this."""
    out, axes = [], dict(b.axes)
    sides = {s.tensor for s in b.sides}
    reads = {t: (along, steps) for t, along, steps in b.rule.row_reads}
    for tensor, state in b.rule.row_grads:
        stored = [w for a in axes[state] for w in a]
        own, steps = reads[tensor]   # the wires the row function reads it along
        shape = ", ".join(f'_sz["{w}"]' for w in stored)
        text = f"{state}.reshape([{shape}])"
        if set(stored) <= set(own) and state in dict(b.aliases):
            text += ".clone()"   # dO itself (a residual's dT = dO), nothing summed: the op may not return an input
        text += summed_to(stored, own)
        if steps:
            text = f"_by_blocks({text}, {steps!r})"
        out.append({"tensor": tensor, "state": state, "side": tensor in sides, "expr": text,
                    "index": _input_index(b.diagram, tensor), "steps": steps, "along": own})
    return out


def _side_sum(b, s) -> str:
    """A side input's gradient from its dQ-kernel partial: summed over the
    buffer's leading axes (row blocks, batch wires it lacks) and, read at
    blocks of a wire, by those blocks (of granules, where the kernel summed
    granules of the wire)."""
    text = s.buffer + (f".sum(dim={tuple(range(len(s.extra)))})" if s.extra else "")
    if not s.steps:
        return text
    from .backward_emit import granule_of
    grans = granule_of(b, s)
    steps = [f"{st} // {grans[w]}" if w in grans else str(st) for w, st in zip(s.wires, s.steps)]
    return f"_by_blocks({text}, ({', '.join(steps)}{',' if len(steps) == 1 else ''}))"


def _side_shape(b, s) -> str:
    from .backward_emit import granule_of
    grans = granule_of(b, s)
    parts = [f'_cdiv(_sz["{b.row}"], _br)' if w == "_blocks" else f'_sz["{w}"]' for w in s.extra]
    parts += [f'_cdiv(_sz["{w}"], {grans[w]})' if w in grans else f'_sz["{w}"]' for w in s.wires]
    return "[" + ", ".join(parts) + "]"


# a backward launcher's option as the caller gave it (None: not given), a format of the wire's name
GIVEN = '_given["block_{}"]'


def _contraction_context(t: Training) -> dict:
    from .contraction import contraction_context
    from .emit import environment

    kernels, launches = [], []
    template = environment().get_template("contraction_kernel.py.jinja")
    for g in t.grads:
        c = contraction_context(g)
        kernels.append(template.render(**c).rstrip("\n"))
        gd = g.diagram
        tensors = [x.name for x in gd.inputs] + [gd.outputs[0].name]
        sizes = [f'_sz["{w.name}"]' for w in gd.wires if w.size is None]
        strides = [f'*_wire_strides({x}, "{x}", _sz)' for x in tensors]
        # each block once per launch (_block_size checks the option), then by name
        wires = {"_br": g.row, "_bc": g.col, "_bk": g.red}
        block_line = ", ".join(wires) + " = " + ", ".join(
            f'_block_size(_opts["block_{w}"], "{w}", "block_{w}")' for w in wires.values())
        blocks = [f"_BLOCK_{w}={v}" for v, w in wires.items()] + [f"_INT64=_int64_offsets({', '.join(tensors)})",
                                                                  "_GROUP=_GROUP_ROWS"]
        # 8 warps when a tile it loads per step (the streamed wire by either output wire: dC's, the
        # forward's output tile) is 128 x 128, as the forward's launch: at 4 warps matmul's dA held 255
        # registers and spilled 12 B on Triton 3.6 (napkin.bench.aot, aot-sm90-2026-11-21-4.md); or when
        # its accumulator is, as the forward's rule: the recomputed sum of a 128 x 128 forward at
        # block 64 of k held 255 registers at 4 warps (napkin.bench.aot, Triton 3.9)
        buffer = gd.outputs[0].name
        if buffer == EPI_SUM:   # the sum the epilogue's gradients read, float32, whenever a gradient is asked
            cond, dtype, index = "any(_need)", "torch.float32", None
        else:
            target = buffer[len("_grad_"):]
            index = _input_index(t.forward.diagram, target)
            cond, dtype = f"_need[{index}]", f"{target}.dtype if _like else torch.float32"
        launches.append({
            "kernel": c["kernel"], "buffer": buffer, "cond": cond, "dtype": dtype, "before": [],
            "what": "the sum the epilogue's gradients read" if index is None else f"d{target}",
            "warps": "(8 if max(_br * _bc, _bk * max(_br, _bc)) >= 128 * 128 else 4)", "blocks": block_line,
            "grid": '(_cdiv(_sz["' + g.row + '"], _br), _cdiv(_sz["' + g.col + '"], _bc), '
                    + (" * ".join(f'_sz["{w}"]' for w in g.batch) or "1") + ")",
            "args": ",\n".join([", ".join(tensors)] + ([", ".join(sizes)] if sizes else []) + strides
                                       + [", ".join(blocks)]),
            "index": index,
        })
    after = []
    if t.epilogue is not None:   # after the sum it reads, before the products that read its dR
        at = 1 if t.epilogue.recompute else 0
        if at < len(launches):
            launches[at]["before"] = epilogue_lines(t)
        else:   # no product reads it: 8-bit factors, whose scales alone train
            after = epilogue_lines(t)
    d = t.forward.diagram
    out = d.outputs[0].name
    # the public NAME_backward(A, B, dC) names C's gradient dC, unless an input
    # is called that (a duplicate parameter): then dC_1, dC_2, ...
    param = fresh_name(f"d{out}", {x.name for x in d.inputs}, prefix="")
    # gradients come back in the inputs' order, whatever order the product
    # names them in (sum[k](X * W) with W declared first swapped dW and dX)
    by_index = {g["index"]: g["buffer"] for g in launches if g["index"] is not None}
    for name, _ in t.epilogue.sides if t.epilogue is not None else ():
        by_index[_input_index(d, name)] = EPI_GRAD + name
    returns = [by_index.get(i, "None") for i in range(len(d.inputs))]
    # NAME_backward's given blocks pairwise, as the forward's launch checks them: its launches tile
    # them two at a time, and block_m=65536, block_k=32 given failed in Triton
    f = t.forward
    pairs = ((f.row, f.col), (f.row, f.red), (f.red, f.col))
    checks = H.given_blocks([f.row, f.col, f.red], '_opts["block_{}"]') + \
        H.least_block(f.red, tiling.least_block(d, f.red)) + [H.tile_fits(x, y, given=GIVEN) for x, y in pairs]
    return {"family": "contraction", "grad_kernels": kernels, "launches": launches, "after": after,
            "grad_out": f"_grad_{out}",
            "grad_param": param, "returns": returns, "tile_checks": checks}
