"""Lowering of an attention diagram's BACKWARD: GradRule (napkin/gradrules.py)
-> three kernel plans in the FlashAttention-2 style, recomputing every
score tile from Q, K and the saved row state instead of storing it.

* ROWS (the "preprocess"): one program per (block of rows, batch index);
  computes the rule's per-row values (delta = rowsum(dO * O) - dlse for
  softmax; for a sum of weights dZ_j and the factors gN_i = dF/dN_i, one
  float32 value a row each, or dN_i = dO dF/dN_i, a float32 [rows, feature]
  tile, where some dF/dN_i reads an N_k) from dO and the saved state.  A
  rule with no computed row value (sigmoid attention: dF/dN_0 = 1) has no
  rows kernel.
* DKDV: one program per (block of the streamed wire x, index of each batch
  wire K and V have); loops over the batch wires they lack (the g query
  heads of a GQA group) and over exactly the row blocks whose forward loop
  visits this block (visits.row_block_range), accumulating dK and dV.  Its
  tiles are transposed, [x, rows] (see ``Kernel``).
* DQ: one program per (block of rows, batch index); loops over the x blocks
  the forward visits (the forward's own bounds), accumulating dQ and the
  per-program partial gradients of side inputs (an ALiBi slope, a bias),
  which the launcher sums in torch: no atomics anywhere, so the backward is
  deterministic by construction.

Every tile expression is the rule's IR; exprs.py renders it exactly as the
forward's.  A rule's ``sum[f](X * Y)`` over a feature wire becomes a tl.dot
(``Dot``), and each input gradient ``sum[w](T * Y)`` a tl.dot accumulated
over the loop (``Grad``).  Anything outside that shape raises NapkinError
("napkin cannot emit a backward for ..."); the module then keeps its forward
and refuses gradients at run time with that message.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .. import autodiff, gradrules, ir
from ..errors import Diagnostic, NapkinError
from .exprs import fold
from .kernel_names import joined, stride
from .lower import AttentionPlan, Load, Var, _Loads, nodes
from .products import constant
from .weights import fits
from .scale import LOG2E, factor, log2_scale

# Names the kernels define themselves; loads of user inputs never take them.
FIXED_NAMES = {"_pid", "_batch", "_row0", "_col0", "_lo", "_hi", "_rb", "_start", "_it", "_o", "_ok", "_qk",
               "_need", "_t", "_row_first", "_row_last", "_col_first", "_col_last", "_live", "_flo", "_fhi",
               "_scale", "_ds_rows"}


def refuse(what: str, why: str, loc: ir.Loc = ir.NOLOC) -> NapkinError:
    return NapkinError([Diagnostic(f"napkin cannot emit a backward for {what}: {why}", loc)])


def located(message: str, loc: ir.Loc) -> str:
    """A refusal as a generated module says it, with no caret to show: the
    diagram's line and column in words, where a place is to blame."""
    return message if loc.line <= 0 else f"{message} (line {loc.line}, column {loc.col} of the diagram)"


def eight_bit_reason(t: ir.Input) -> str:
    """Why an 8-bit factor ``t`` (a matrix product's, attention's Q or K) gets
    no gradient, after "A is"."""
    return f"{t.dtype}, " + ("an integer tensor, which has no gradient" if t.dtype == "int8" else
                             "and an fp8 gradient needs scaling into its range, which napkin does not generate")


def no_eight_bit_gradient(t: ir.Input) -> str:
    """The generated module's _NO_GRADIENT entry for an 8-bit factor ``t``, located."""
    return located(f"napkin has no gradient for {t.name}: it is {eight_bit_reason(t)}", t.dtype_loc)


# --------------------------------------------------------------------------
# The plan.
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class Dot:
    """var = lhs @ rhs^T over a feature wire: lhs along the tile's rows (the
    kernel's resident wire), rhs along its columns (the loop's wire): Q @ K^T
    in the dQ kernel, K @ Q^T in the dK/dV kernel."""

    var: str
    lhs: Load
    rhs: Load


@dataclass(frozen=True)
class Grad:
    """An input gradient accumulated over the loop: ``tile @ operand`` (the
    tile's rows are the kernel's resident wire, its columns the loop's, which
    the product contracts); stored to ``buffer`` (float32, the input's layout)
    along (rows, cols)."""

    tensor: str
    buffer: str
    var: str
    tile: str
    operand: Load
    rows: str
    cols: str
    scale: Optional[float] = None       # the tile's constant factor, applied once at the store
    wide: bool = False                  # the tile may leave float16's range: its product in float32 (_wide_tile)


@dataclass(frozen=True)
class SideGrad:
    """The gradient of a side input T (read along its own wires) in the dQ
    kernel: the tile ``expr`` (dS times dS/dT) summed over the tile's axes T
    lacks.  ``extra`` are the buffer's leading dimensions, summed in torch:
    "_blocks" (one per row block, when T lacks the row wire) and the batch
    wires T lacks.  With the streamed wire, a partial is stored per step;
    without it, accumulated over the loop and stored once."""

    tensor: str
    buffer: str
    expr: object
    wires: tuple[str, ...]       # T's flattened wires
    extra: tuple[str, ...]
    has_row: bool
    has_col: bool
    # P * dS/dT, summed per row beside dS itself where delta's error can be taken out (see
    # side_input); None where it cannot (T along the keys; a logsumexp output's dlse; sums rules)
    centre: Optional[object] = None
    # a read at a wire's blocks (sq[b, h, q // 128]): each wire's step, the partial stored along the
    # read wires and summed by blocks of it in torch; None where T is read whole along its wires
    steps: Optional[tuple[int, ...]] = None


@dataclass(frozen=True)
class Store:
    """A tile a kernel writes once, after its loop."""

    tensor: str
    value: str
    rows: Optional[str]
    cols: Optional[str]


@dataclass(frozen=True)
class Kernel:
    """One backward kernel.  The tiles of a loop kernel are oriented
    [grid_wire, loop_wire]: [rows, x] in dQ (as the forward's), [x, rows] in
    dK/dV, so that each gradient is ``tile @ operand`` with the tile as it
    comes out of the score product: FlashAttention-2's S^T = K Q^T.  A tile
    transposed in registers to feed the product (dK += dS^T Q) costs
    registers and shared memory, enough to make the kernel spill on Hopper."""

    role: str                           # "rows", "dkdv" or "dq"
    name: str
    grid_wire: str                      # blocked on grid axis 0
    loop_wire: Optional[str]            # streamed by the loop (None: no loop)
    batch: tuple[str, ...]              # grid axis 1, outermost first
    outer: tuple[str, ...]              # whole indices looped over (GQA's g), dkdv only
    loads: tuple[Load, ...]             # phase "pre" (once) or "step" (per visited step)
    lines: tuple[tuple[str, object], ...]  # (var, expr) tile computations, in order
    dots: tuple[Dot, ...]
    reduces: tuple[tuple[str, object], ...]  # rows kernel: (var, body) rowsums over the feature wire
    grads: tuple[Grad, ...]
    sides: tuple[SideGrad, ...]
    stores: tuple[Store, ...]
    subst: tuple = ()                   # (node, var): what the kernel holds in variables
    # (var, expr, phase): per-row values (and per-program scalars) computed once where the loads
    # they read are: phase "pre" before the loop, "step" at the top of each step (before the tiles)
    row_lines: tuple[tuple[str, object, str], ...] = ()


@dataclass(frozen=True)
class BackwardPlan:
    diagram: ir.Diagram                 # the forward diagram, plus the backward's tensors as inputs
    forward: AttentionPlan
    rule: gradrules.GradRule
    row: str
    col: str
    batch: tuple[str, ...]
    dims: tuple[str, ...]               # padded feature wires, declaration order
    qs: tuple[str, ...]                 # the row-side factor of each of the score's contractions (Q;
    ks: tuple[str, ...]                 # several added up for MLA's), and the streamed one (K)
    v: str
    state: tuple[str, ...]              # what the main kernels read besides the inputs (dO, lse, delta)
    row_inputs: tuple[str, ...]         # what the rows kernel reads (dO, O, dlse)
    row_outputs: tuple[str, ...]        # what it writes (delta), each stored as float32
    aliases: tuple[tuple[str, str], ...]  # row values that are another placeholder (a dN_i = dO)
    grads: tuple[str, ...]              # float inputs that get a gradient, in input order
    kernels: tuple[Kernel, ...]
    axes: tuple[tuple[str, tuple[ir.Axis, ...]], ...]  # backward tensor -> its stored layout
    # float inputs napkin emits no gradient for, and why (with the diagram's line and column):
    # a call that wants one is refused, the others train
    ungradable: tuple[tuple[str, str], ...] = ()
    # key-side inputs that lack batch wires K has (differential attention's V), and those wires: their
    # gradients are stored along the wires first, a share per dK/dV program, and summed by the launcher
    shared: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @property
    def gate(self) -> Optional[str]:   # a gate on the value: the kernels' V is V * gate (GradRule.value_gate)
        return self.rule.value_gate

    @property
    def q(self) -> str:
        """Q: the first contraction's row-side factor."""
        return self.qs[0]

    @property
    def trained(self) -> tuple[str, ...]:
        """Q, K and V that get a gradient from the loop kernels, as they
        store them: all but 8-bit score factors."""
        return tuple(n for n in self.qs + self.ks + (self.v,) if n not in dict(self.ungradable))

    @property
    def typed(self) -> str:
        """The input whose dtype the kernels' products take: Q's, or V's where
        Q is 8-bit (SageAttention's int8 Q and K beside a float V: dP = dO V
        and dV = P^T dO are V's products)."""
        return self.v if self.diagram.tensor(self.q).dtype in ir.FACTOR_DTYPES else self.q

    @property
    def k(self) -> str:
        return self.ks[0]

    def kernel(self, role: str) -> Optional[Kernel]:
        return next((k for k in self.kernels if k.role == role), None)

    @property
    def sides(self) -> tuple:
        """The side inputs' gradients, which the dQ kernel sums (none without one)."""
        dq = self.kernel("dq")
        return dq.sides if dq is not None else ()


# --------------------------------------------------------------------------
# Building it.
# --------------------------------------------------------------------------

def lower_backward(d: ir.Diagram, fplan: AttentionPlan, rule: gradrules.GradRule,
                   saved_axes: dict) -> BackwardPlan:
    """The backward plan of a checked attention diagram, whose forward plan is
    ``fplan`` and GradRule ``rule``; ``saved_axes`` gives the stored layout of
    every saved value that is not a diagram output (the forward writes it)."""
    return _Builder(d, fplan, rule, saved_axes).build()


def _bare_ds(t: ir.Expr) -> bool:
    """dS itself, or dS masked (where(p, dS, 0)): a tile of dS's own range."""
    if isinstance(t, ir.Call) and t.fn == "where":
        return any(_bare_ds(a) for a in t.args[1:]) and any(isinstance(a, ir.Num) and a.value == 0
                                                             for a in t.args[1:])
    return t == ir.TensorRef("dS")


class _Builder:
    def __init__(self, d, fplan, rule, saved_axes):
        self.d, self.f, self.rule, self.saved_axes = d, fplan, rule, dict(saved_axes)
        self.row, self.col, self.batch = fplan.row, fplan.col, fplan.batch
        self.fixed = {w.name: w.size for w in d.wires if w.size is not None}  # wires of a fixed size

    def build(self) -> BackwardPlan:
        d, f, rule = self.d, self.f, self.rule
        # the score's contractions (one, or several added up: MLA's) as (Q_i, K_i) pairs
        self.pairs = tuple((dot.lhs.tensor, dot.rhs.tensor) for dot in f.dots)
        self.qs, self.ks = tuple(q for q, _ in self.pairs), tuple(k for _, k in self.pairs)
        self.q, self.k, self.v = self.qs[0], self.ks[0], rule.value
        roles = [(n, "query") for n in self.qs] + [(n, "key") for n in self.ks] + [(self.v, "value")]
        for i, (name, one) in enumerate(roles):
            other = next((r for n, r in roles[i + 1:] if n == name), None)
            if other is not None:
                # its gradient is the sum of two paths, each with its own kernel's accumulator;
                # the kernels keep one per input (the dK of K = V lost its score path)
                what = f"both the {one} and the {other}" if other != one else f"the {one} of two contractions"
                raise refuse(f"input {name}", f"it is {what}: declare two inputs "
                             "and pass the same tensor to both (autograd adds their gradients)", d.tensor(name).loc)
        valued = [a.value for a in f.accums if a.value is not None]
        if not valued or any(ld.tensor != self.v for ld in valued):
            raise refuse(f"diagram {d.name}", f"its weights must contract with {self.v} alone", d.loc)
        self.fv, self.fq = valued[0].cols, tuple(dot.wire for dot in f.dots)
        for name in self.qs + self.ks + (self.v,):
            t = d.tensor(name)
            if any(isinstance(n, ir.TensorRef) and n.name == name and n.wires is not None
                   and tuple(n.wires) != ir.axis_wires(t.axes) for let in d.lets for n in ir.walk(let.expr)):
                raise refuse(f"input {name}", "it is read along other wires than its own", t.loc)
        kw = set(ir.axis_wires(d.tensor(self.k).axes))
        for q in self.qs:
            qw = set(ir.axis_wires(d.tensor(q).axes))
            if not set(self.batch) <= qw:
                missing = ", ".join(w for w in self.batch if w not in qw)
                raise refuse(f"input {q}", f"it lacks the batch wire(s) {missing} of the scores: the dQ kernel "
                             f"writes each row's gradient once (declare {q} along {missing} too and pass it "
                             f"expanded, {q.lower()}.unsqueeze(...).expand(...), which reads the same memory; "
                             "autograd sums its gradient)", d.tensor(q).loc)
        # an input of the key side (V, or a key part such as MLA's rotary key) that lacks batch wires K
        # has is read by every index of them: differential attention's V, shared by its two maps.  Each
        # dK/dV program (one per index of K's batch wires) writes its own share of that input's
        # gradient; the launcher sums the shares (``shared``).  K lacking wires the other has would
        # need a loop over them inside the program, which the kernel has for the queries only (GQA).
        kb = kw & set(self.batch)
        self.shared = {}
        for name in dict.fromkeys(self.ks[1:] + (self.v,)):
            nb = set(ir.axis_wires(d.tensor(name).axes)) & set(self.batch)
            if nb - kb:
                wires = [w for w in self.batch if w in nb - kb]
                raise refuse(f"inputs {self.k} and {name}", f"{self.k} lacks {', '.join(wires)}, which {name} has: "
                             f"the dK/dV kernel runs a program for each index of {self.k}'s batch wires (declare "
                             f"{self.k} along {', '.join(wires)} too and pass it expanded, "
                             f"{self.k.lower()}.unsqueeze(...).expand(...), which reads the same memory; autograd "
                             "sums its gradient)", d.tensor(self.k).loc)
            if kb - nb:
                self.shared[name] = tuple(w for w in self.batch if w in kb - nb)
        self.kv_batch = tuple(w for w in self.batch if w in kw)
        self.outer = tuple(w for w in self.batch if w not in kw)
        self.axes = self.layouts()
        self.bd = _with_tensors(d, self.axes)
        tile = dict(rule.tile)
        self.tile_names = [n for n, _ in rule.tile]
        self.ungradable: list[tuple[str, str]] = []
        # 8-bit score factors (SageAttention's int8 Q and K) get no gradient: torch keeps none of an
        # integer tensor, and an fp8 one needs scaling into its range; V and the scales still train
        for name in dict.fromkeys(self.qs + self.ks):
            t = d.tensor(name)
            if t.dtype in ir.FACTOR_DTYPES:
                self.ungradable.append((name, no_eight_bit_gradient(t)))
        self.sides = self.side_inputs(tile)
        grads = dict(rule.input_grads)
        self.state = self.state_names()
        # V is a float (codegen/operands.py refuses an 8-bit one): dK/dV always has a gradient to take
        kernels = [k for k in (self.rows_kernel(), self.dkdv_kernel(grads), self.dq_kernel(grads)) if k]
        dims = tuple(w.name for w in d.wires if w.name in set(self.fq) | {self.fv})
        floats = [t.name for t in d.inputs if t.dtype in ir.FLOAT_DTYPES]
        grad_names = tuple(n for n in floats if n in self.qs + self.ks + (self.v,) or n in {s.tensor for s in self.sides}
                           or n in dict(rule.row_grads))
        rows = self.rule.rows
        return BackwardPlan(self.bd, f, rule, self.row, self.col, self.batch, dims, self.qs, self.ks, self.v,
                            self.state, self.row_inputs, tuple(n for n, e in rows if not _alias(e)),
                            tuple((n, e.name) for n, e in rows if _alias(e)), grad_names, tuple(kernels),
                            tuple(self.axes.items()), tuple(self.ungradable), tuple(self.shared.items()))

    # ---- the stored layout of every backward tensor ----
    def layouts(self) -> dict:
        d, rule = self.d, self.rule
        bound = dict(rule.bound)
        out_axes = d.tensor(bound["O"]).axes
        rows = set(rule.layout("S")) - {rule.key}
        feat = set(rule.layout("O")) - rows
        row_axes = tuple(a for a in out_axes if not set(a) & feat)
        if any(set(a) & feat and len(a) > 1 for a in out_axes):
            raise refuse(f"output {bound['O']}", "its feature wire is part of a grouped axis",
                         d.tensor(bound["O"]).loc)
        axes = {}
        for name, wires in rule.layouts:
            if name in ("S", "R", "P", "dP", "dS", "dR") or name[:1] == "A" or name[:2] == "dA":
                continue  # tiles: never stored
            if name in self.saved_axes:          # before bound: a float32 twin of an output
                axes[name] = self.saved_axes[name]
            elif name in bound and name != "S":
                axes[name] = d.tensor(bound[name]).axes
            elif name == "dlse" and "lse" in bound:
                axes[name] = d.tensor(bound["lse"]).axes
            else:
                axes[name] = out_axes if self.fv in wires else row_axes
        for t in d.inputs:
            if t.dtype in ir.FLOAT_DTYPES:
                # a shared input's gradient is stored along the wires it lacks too (first), one share a
                # dK/dV program, and summed over them by the launcher
                axes[f"_grad_{t.name}"] = tuple((w,) for w in self.shared.get(t.name, ())) + t.axes
        return axes

    # ---- side inputs ----
    def side_inputs(self, tile: dict) -> list[SideGrad]:
        """The side inputs' gradients the dQ kernel sums.  One napkin has no
        kernel for is put in ``self.ungradable`` with the reason: Q, K, V and
        the other side inputs still train, and a call that wants that one
        gradient is refused (a fixed temperature need not stop training)."""
        out = []
        for t in self.d.inputs:
            if t.name in self.qs + self.ks + (self.v, self.rule.value_gate) or t.dtype not in ir.FLOAT_DTYPES:
                continue
            try:
                side = self.side_input(t, tile.get("S"))
            except NapkinError as err:
                self.ungradable.append((t.name, located(err.messages[0], err.diagnostics[0].loc)))
                continue
            if side is not None:
                out.append(side)
        return out

    def side_input(self, t: ir.Input, s_expr) -> Optional[SideGrad]:
        """Side input t's gradient, None when it has none (read by no tile:
        a mask's condition), or a refusal saying why napkin emits none."""
        refs = [n for _, e in self.rule.tile for n in ir.walk(e)
                if isinstance(n, ir.TensorRef) and n.name == t.name]
        # read past the score box (sum[x](S * tau * V): O = N0 * tau): the rows' dT_i is that
        # path's gradient where the output's row function has one (row_grads), else none is emitted
        past = [n for n, e in self.rule.forward + self.rule.rows
                if any(isinstance(x, ir.TensorRef) and x.name == t.name for x in ir.walk(e))]
        if not refs:
            if t.name in dict(self.rule.row_grads):
                return None   # read by the output's row function alone: the rows' dT_i is its gradient
            if past:   # a gradient no kernel computes: refused, where its .grad was silently zero
                raise refuse(f"input {t.name}", f"its gradient would go through {', '.join(past)} past the "
                             "score box, which napkin does not emit; an input the score box alone reads "
                             "gets one", t.loc)
            return None
        # the wires the tiles read t along (its own, or a relabelling: dt along the read wires is
        # dt along its own) and their steps, at a wire's blocks; one wire twice the checker refuses
        reads = {ir.read_along(r, ir.axis_wires(t.axes)) for r in refs}
        if len(reads) > 1:   # two partials, each along its own wires
            shown = " and ".join(sorted(expr_text(ir.TensorRef(t.name, w, steps=st)) for w, st in reads))
            raise refuse(f"input {t.name}", f"it is read as {shown}: a float input read two ways gets no "
                         "gradient here (declare one input per read and pass the same tensor to each)", t.loc)
        (own, steps), = reads
        # Its gradient is dS * dS/dt: whole only when the score box is the one
        # forward tile that reads t.  dR = dS * dS/dR may read it too (a
        # temperature multiplying the contraction): that is S's derivative.
        # every way the tiles write the one read is one node (autodiff.diff_read)
        plain = ir.TensorRef(t.name)

        def canon(e):
            for r in refs:
                e = autodiff.substitute(e, r, plain)
            return e
        elsewhere = sorted(n for n, e in self.rule.tile
                           if n not in ("S", "dR") and _contains(canon(e), plain))
        if s_expr is None:
            raise refuse(f"input {t.name}", "only inputs of the score box get gradients here", t.loc)
        if elsewhere:
            raise refuse(f"input {t.name}", "its gradient would need the path past the score box (the "
                         f"backward's {', '.join(elsewhere)} read it), which napkin does not emit; "
                         "an input the score box alone reads gets one", t.loc)
        if past and t.name not in dict(self.rule.row_grads):   # the output's function reads it too
            raise refuse(f"input {t.name}", f"its gradient would also go through {', '.join(past)} past the "
                         "score box, which napkin does not emit for this read; an input the score box alone "
                         "reads gets one", t.loc)
        try:
            deriv = autodiff.diff_read(s_expr, refs)
        except ValueError as err:
            raise refuse(f"input {t.name}", str(err), t.loc) from None
        extra = tuple(["_blocks"] if self.row not in own else []) + tuple(w for w in self.batch if w not in own)
        bad = set(own) - set(self.batch) - {self.row, self.col}
        if bad:
            raise refuse(f"input {t.name}", f"its wire(s) {', '.join(sorted(bad))} are not the scores'", t.loc)
        expr = autodiff.simplify(ir.Binary("*", ir.TensorRef("dS"), deriv))
        if any(isinstance(n, ir.Num) and math.isinf(n.value) for n in ir.walk(deriv)):
            # a masked score times t (where(p, R, -inf) * tau): dS/dt is -inf where the
            # mask is, and dS 0 there, so 0 * inf made the whole sum NaN; such a score
            # is flat in t, its term 0
            expr = ir.Call("where", (ir.Binary("==", ir.TensorRef("S"), ir.Num(-math.inf)), ir.Num(0), expr))
        return SideGrad(t.name, joined("part", t.name), expr, own, extra, self.row in own, self.col in own,
                        self.centre(deriv, own), steps)

    def centre(self, deriv, own) -> Optional[ir.Expr]:
        """P * dS/dT, for the rows' correction of a softmax side gradient.
        delta = rowsum(dO * O) reads the O the forward stored (fp16), so it
        misses sum[x](P * dP) by a row's rounding e, and dS = P (dP - delta)
        carries P * e: summed against dS/dT that is large and of one sign
        along a row (ALiBi's x - q, a per-query temperature) it was 5.8e-2 of
        the slope's gradient (edges hunt).  sum[x](dS) is 0 in exact
        arithmetic, so the dQ kernel sums it per row beside P * dS/dT and takes
        sum[x](dS) * sum[x](P dS/dT) off: e cancels.  Not for T along the keys
        (its sum over rows ends before a row's e is known), a logsumexp output
        or an output reading the lse (sum[x](dS) is its dlse then) or the sums
        rules (no such identity)."""
        forward = dict(self.rule.forward)
        reads_lse = "N0" in forward and _contains(forward["O"], ir.TensorRef("lse"))
        if self.rule.kind != "softmax" or self.rule.lse_grad or reads_lse or self.col in own or \
                "P" not in self.tile_names:
            return None
        weighted = autodiff.simplify(ir.Binary("*", ir.TensorRef("P"), deriv))
        if any(isinstance(n, ir.Num) and math.isinf(n.value) for n in ir.walk(deriv)):
            weighted = ir.Call("where", (ir.Binary("==", ir.TensorRef("S"), ir.Num(-math.inf)), ir.Num(0), weighted))
        return weighted

    def state_names(self) -> tuple[str, ...]:
        """Placeholders the main kernels read that no tile binds, canonical order."""
        bound = set(self.tile_names) | {"R"}
        used = []
        for _, e in self.rule.tile + self.rule.input_grads:
            for n in ir.walk(e):
                if isinstance(n, ir.TensorRef) and gradrules.is_placeholder(n.name) and n.name not in bound:
                    used.append(n.name)
        first = ["dO", "lse", "delta", "dlse"]
        first += [n for n, _ in self.rule.rows if n not in first]  # then the row values, in order
        # last, the row gradients of inputs the output's row function reads: no kernel reads them,
        # the launcher sums them (NAME_backward takes them as it takes the rest of the state)
        return tuple(n for n in first if n in used) + tuple(sorted(set(used) - set(first))) \
            + tuple(n for _, n in self.rule.row_grads)

    # ---- kernels ----
    def taken(self, extra=()) -> set:
        """Variable names loads of user inputs must not take (placeholders
        need no reserving: no input may have a placeholder's name)."""
        floats = [t.name for t in self.d.inputs]
        buffers = [f"_grad_{n}" for n in floats] + [joined("part", n) for n in floats] + list(gradrules.PLACEHOLDERS)
        wires = [w.name for w in self.d.wires] + ["_blocks"]
        return set(FIXED_NAMES) | {f"_{n}" for n in self.tile_names} | set(extra) \
            | {f"_{p}2" for p in gradrules.PLACEHOLDERS} \
            | {f"_{p}_{n}" for p in ("acc", "grad") for n in floats} \
            | {joined(p, n) for p in ("part", "part_acc") for n in floats} \
            | {stride(b, w) for b in buffers for w in wires} \
            | {f"_dot{i}" for i in range(8)} | {f"_sum{i}" for i in range(8)}

    def rows_kernel(self) -> Optional[Kernel]:
        rule = self.rule
        computed = [(n, e) for n, e in rule.rows if not _alias(e)]
        used = []
        for _, e in rule.rows:
            for n in ir.walk(e):   # once each, also when one expression reads it twice (Z0 / Z0)
                if isinstance(n, ir.TensorRef) and n.name not in used:
                    used.append(n.name)
        # dO first (the public NAME_preprocess's order), then the rest as the row values read them
        self.row_inputs = tuple(n for n in ["dO"] if n in used) + tuple(n for n in used if n != "dO")
        if not computed:
            return None
        loads = _Loads(self.bd, "pre", self.taken({f"_{n}" for n, _ in rule.rows}))
        subst, reduces, lines = {}, [], []
        # each read as written: an input the output's function reads at blocks (tau[h // 2]) or
        # along other wires is loaded so (keyed on the bare name, it had no variable)
        for ref in dict.fromkeys(n for _, e in rule.rows for n in ir.walk(e) if isinstance(n, ir.TensorRef)):
            subst[ref] = self._load(loads, ref, "pre").var
        for name, e in computed:
            for node in nodes(e):
                if isinstance(node, ir.Reduce) and node not in subst:
                    if node.wires != (self.fv,):
                        raise refuse(f"row value {name}", f"it sums over {', '.join(node.wires)}")
                    var = f"_sum{len(reduces)}"
                    reduces.append((var, node.body))
                    subst[node] = var
            lines.append((f"_{name}", e))
        stores = tuple(Store(n, f"_{n}", self.row, self.fv if self.fv in rule.layout(n) else None)
                       for n, _ in computed)
        return Kernel("rows", f"_{self.d.name}_bwd_rows_kernel", self.row, None, self.batch, (),
                      tuple(loads.loads), tuple(lines), (), tuple(reduces), (), (), stores, tuple(subst.items()))

    def gradable(self, names) -> list[str]:
        """``names`` but the ungradable (8-bit score factors)."""
        return [n for n in names if n not in dict(self.ungradable)]

    def dkdv_kernel(self, grads: dict) -> Kernel:
        targets = [self.grad(n, grads[n], "dkdv") for n in self.gradable(self.ks + (self.v,))]
        return self.loop_kernel("dkdv", self.col, self.row, self.kv_batch, self.outer, targets, [])

    def dq_kernel(self, grads: dict) -> Optional[Kernel]:
        """The dQ kernel, None where it has nothing to compute (8-bit Q and no side input)."""
        targets = [self.grad(q, grads[q], "dq") for q in self.gradable(self.qs)]
        if not targets and not self.sides:
            return None
        return self.loop_kernel("dq", self.row, self.col, self.batch, (), targets, self.sides)

    def grad(self, name: str, e, role: str):
        """(input, tile name, operand ref, store rows, store cols) of sum[w](tile * operand)."""
        # dK/dV: a shared input's gradient sums over the wires it lacks too, one share a program
        want = (self.col,) if role == "dq" else tuple(sorted((self.row,) + self.outer + self.shared.get(name, ())))
        ok = (isinstance(e, ir.Reduce) and e.op == "sum" and tuple(sorted(e.wires)) == want
              and isinstance(e.body, ir.Binary) and e.body.op == "*")
        if ok:
            a, b = e.body.lhs, e.body.rhs
            if isinstance(b, ir.TensorRef) and b.name in self.tile_names:
                a, b = b, a
            ok = isinstance(a, ir.TensorRef) and a.name in self.tile_names and isinstance(b, ir.TensorRef)
        if not ok:
            raise refuse(f"the gradient of {name}", "it is not a sum over the loop of a tile times a tensor")
        wires = ir.axis_wires(self.d.tensor(name).axes)
        lead = self.col if role == "dkdv" else self.row
        feat = [w for w in wires if w not in set(self.batch) | {self.row, self.col}]
        if lead not in wires or len(feat) != 1:
            raise refuse(f"the gradient of {name}", f"{name} must be along {lead}, one feature wire and batch wires")
        return name, a.name, b, lead, feat[0]

    def _wide_tile(self, tile_name: str, tile: dict, scales: dict) -> bool:
        """Whether a gradient's tile is the forward's weights as a function of
        the scores alone, with no bound on them: a chain of matmuls' C
        (E = sum[n](C * D)) or an unnormalised ReLU², or one whose constant
        factor of 1 or more grad_scales took out beside more than dS.  The forward scales such
        rows into float16 (weights.py, _FIT_WEIGHTS); rounded as they were,
        dD = C^T dE was inf past 65504, so the product is taken in float32
        (tf32 range).  Softmax's P and a normalised sum's weighted tile read
        row state (lse, the normaliser's factor): bounded by it, kept narrow."""
        if abs(scales.get(tile_name, 0.0)) >= 1 and not _bare_ds(tile[tile_name]):
            return True
        source = dict(self.rule.tile).get(tile_name)
        if source is None:
            return False
        reads = {n.name for n in ir.walk(source) if isinstance(n, ir.TensorRef)}
        return reads <= {"S", "R"} and not fits(source, self.fixed)

    def loop_kernel(self, role, grid_wire, loop_wire, batch, outer, targets, sides) -> Kernel:
        """The dK/dV or dQ kernel: the tile chain its targets need, and its loads
        (phase "step" when they carry the loop wire or an outer wire)."""
        tile = dict(self.rule.tile)
        need = {t[1] for t in targets} | ({"dS"} if sides else set())
        for s in sides:   # dS * R for S = R * tau: the raw score too, where no target's chain reads it
            need |= {n.name for n in ir.walk(s.expr) if isinstance(n, ir.TensorRef)
                     and (n.name in self.tile_names or n.name == "R")}
        order = []
        for name in reversed(self.tile_names):
            if name in need:
                order.append(name)
                need |= {n.name for n in ir.walk(tile[name]) if isinstance(n, ir.TensorRef)}
        order.reverse()
        tile, order, rows = self.exp2(tile, order, {t[1] for t in targets}, sides)
        tile, scales = self.grad_scales(tile, order, {t[1] for t in targets}, sides)
        loads = _Loads(self.bd, "pre", self.taken())

        tile_axes = (grid_wire, loop_wire)  # the tiles' [rows, cols]

        def load(ref: ir.TensorRef) -> Load:
            ws = self._read(ref)
            return self._load(loads, ref, "step" if loop_wire in ws or set(outer) & set(ws) else "pre", tile_axes)

        subst, dots, lines = {}, [], []
        if "R" in need:   # the score's contractions, each added into _qk (backward_emit._tile_lines)
            for qn, kn in self.pairs:
                q, k = load(ir.TensorRef(qn)), load(ir.TensorRef(kn))
                dots.append(Dot("_qk", *((q, k) if grid_wire == self.row else (k, q))))
            subst[ir.TensorRef("R")] = "_qk"
        row_lines = []
        for name in order:
            e = tile[name]
            for node in nodes(e):
                if isinstance(node, ir.Reduce) and node not in subst:
                    var = f"_{name}" if node == e else f"_dot{len(dots) - 1}"
                    dots.append(self.dot(node, var, load, grid_wire == self.col))
                    subst[node] = var
                elif isinstance(node, ir.TensorRef) and node not in subst and node.name not in self.tile_names:
                    subst[node] = load(node).var
            for var, row_e in rows.get(name, ()):  # its per-row values, computed where what they read is loaded
                refs = [n for n in nodes(row_e) if isinstance(n, ir.TensorRef)]
                read = [load(n) for n in refs]
                subst.update((n, ld.var) for n, ld in zip(refs, read))
                row_lines.append((var, row_e, "step" if any(ld.phase == "step" for ld in read) else "pre"))
            if isinstance(e, ir.TensorRef) and e.name in self.tile_names:  # another tile's value (dR = dS)
                subst[ir.TensorRef(name)] = subst[e]
                continue
            if subst.get(e) != f"_{name}":
                lines.append((f"_{name}", e))
            subst[ir.TensorRef(name)] = f"_{name}"
        grads = []
        for name, tile_name, operand, lead, feat in targets:
            if constant(tile[tile_name]):  # sum[d](Q * K) * 0: nothing of the tile varies, no product to take
                raise refuse(f"the gradient of {name}", f"the scores do not depend on {name} (the tile "
                             f"{tile_name} its gradient sums is the constant {expr_text(tile[tile_name])})")
            grads.append(Grad(name, f"_grad_{name}", f"_acc_{name}", subst[ir.TensorRef(tile_name)],
                              load(operand), lead, feat, scales.get(tile_name), self._wide_tile(tile_name, tile, scales)))
        for s in sides:
            for node in nodes(s.expr):
                if isinstance(node, ir.TensorRef) and node not in subst:
                    subst[node] = load(node).var
        ordered = tuple(ld for ld in loads.loads if ld.phase == "pre") + \
            tuple(ld for ld in loads.loads if ld.phase == "step")
        return Kernel(role, f"_{self.d.name}_bwd_{role}_kernel", grid_wire, loop_wire, batch, outer, ordered,
                      tuple(lines), tuple(dots), (), tuple(grads), tuple(sides), (), tuple(subst.items()),
                      tuple(row_lines))

    def exp2(self, tile: dict, order: list, grad_tiles: set, sides) -> tuple[dict, list, list]:
        """The recomputed P = exp(S - lse') (lse' the row state, -inf replaced)
        as exp2(t * C - lse2): lse2 = lse' * log2(e) once per row, C the
        score's positive scale (scale.py) times log2(e), one constant, so each
        score is one FMA and one exp2, as the forward's.  The tile S is
        opened (its line goes) when only P reads it; else t is S and C is
        log2(e).  Returns (tile, order, {tile name: its per-row lines [(var, expr)]})."""
        fixed = self.fixed
        rows, tile = {}, dict(tile)
        for name in list(order):
            e = tile[name]
            if not (isinstance(e, ir.Call) and e.fn == "exp" and isinstance(e.args[0], ir.Binary)
                    and e.args[0].op == "-"):
                continue
            a, b = e.args[0].lhs, e.args[0].rhs
            refs = {n.name for n in nodes(b) if isinstance(n, ir.TensorRef)}
            per_row = len(refs) == 1 and not (refs & set(self.tile_names)) and self.col not in self._wires(b)
            if not per_row:
                continue  # not a row value subtracted: left as it is
            readers = [tile[n] for n in order if n != name] + [s.expr for s in sides]
            only_here = [n for n in order if n != name and n not in grad_tiles and ir.TensorRef(n) in set(nodes(a))
                         and not any(ir.TensorRef(n) in set(nodes(r)) for r in readers)]
            opened = a
            for n in only_here:
                opened = autodiff.substitute(opened, ir.TensorRef(n), tile[n])
            c, t = factor(opened, fixed, lambda n: isinstance(n, (ir.TensorRef, ir.Reduce)))
            if c is None:
                t = a
            else:
                order = [n for n in order if n not in only_here or ir.TensorRef(n) in set(nodes(t))]
            k, mine = log2_scale(c, fixed), rows.setdefault(name, [])
            if not isinstance(k, float):  # a symbolic size: one scalar per program
                mine.append(("_scale", k))
                k = Var("_scale")
            lse2 = f"_{refs.pop()}2"
            mine.append((lse2, ir.Binary("*", b, ir.Num(LOG2E))))
            tile[name] = ir.Call("exp2", (ir.Binary("-", ir.Binary("*", t, k if isinstance(k, Var) else ir.Num(k)),
                                                     Var(lse2)),), e.loc)
        return tile, order, rows

    def grad_scales(self, tile: dict, order: list, grad_tiles: set, sides) -> tuple[dict, dict]:
        """A constant factor out of each tile only gradients accumulate:
        dR = where(p, dS * |d|^-0.5, 0) is |d|^-0.5 * where(p, dS, 0), and
        dK = sum over the loop of dR Q = |d|^-0.5 * (sum of where(p, dS, 0) Q):
        the accumulator is scaled once at its store, not each score of each
        step (one multiply a score fewer, as FlashAttention's dK *= scale).
        Returns (tile with the factor out, {tile name: the factor})."""
        fixed = self.fixed
        tile, scales = dict(tile), {}
        for name in sorted(grad_tiles):
            ref = ir.TensorRef(name)
            if any(ref in set(nodes(tile[n])) for n in order if n != name) \
                    or any(ref in set(nodes(s.expr)) for s in sides):
                continue  # read by another tile or a side gradient: it keeps its value
            c, t = factor(tile[name], fixed, lambda n: isinstance(n, (ir.TensorRef, ir.Reduce, Var)), (0.0,))
            v = fold(c, fixed) if c is not None else None
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v != 1):
                continue
            # A factor of 1 or more waits for the store in float16 (_small), right for dS * 64,
            # whose dS is the well-ranged tile; but what is left of 1000 * log(R / 4 + 1000)'s
            # dR is dS times 1e-3, and (R / 4 + 100.5)^-3 * 1e6's dS times 1e-8: rounded to
            # float16 before the factor, it flushed to zero (dQ 0.52 off, or exactly 0), and
            # kept in the tile 1000 * abs(R)'s overflowed.  Such a tile's product is float32
            # (_wide_tile).
            tile[name], scales[name] = t, float(v)
        return tile, scales

    def _wires(self, e) -> set:
        """The wires an expression of the rule varies along."""
        out = set()
        for n in nodes(e):
            if isinstance(n, ir.TensorRef):
                out |= set(self._read(n))
            elif isinstance(n, ir.WireIndex):
                out.add(n.wire)
        return out

    def dot(self, node: ir.Reduce, var: str, load, transposed: bool) -> Dot:
        """sum[f](X * Y) of a row tile X and a key tile Y: X @ Y^T, or Y @ X^T
        in a ``transposed`` kernel (tiles [x, rows])."""
        body = node.body
        ok = (node.op == "sum" and len(node.wires) == 1 and isinstance(body, ir.Binary) and body.op == "*"
              and all(isinstance(x, ir.TensorRef) for x in (body.lhs, body.rhs)))
        if ok:
            a, b = body.lhs, body.rhs
            if self.col in self._read(a):
                a, b = b, a
            ok = self.row in self._read(a) and self.col in self._read(b) and self.col not in self._read(a)
        if not ok:
            raise refuse(expr_text(node), "a backward contraction must be sum[f](X * Y) of a row tile and a "
                         "key tile")
        a, b = load(a), load(b)
        return Dot(var, b, a) if transposed else Dot(var, a, b)

    # ---- loads ----
    def _read(self, ref: ir.TensorRef) -> tuple[str, ...]:
        if gradrules.is_placeholder(ref.name):
            return self.rule.layout(ref.name)
        return ref.wires if ref.wires is not None else ir.axis_wires(self.bd.tensor(ref.name).axes)

    def _load(self, loads: _Loads, ref: ir.TensorRef, phase: str, tile=None) -> Load:
        """A tile of ``ref``: (rows, cols) from the wires it carries, in the
        kernel's orientation ``tile`` (its [rows, cols] wires; default [row,
        col]): a [row, col] tensor as the tile, a product's operand [row or
        col, feature], a vector along row or col on the tile's axis of that
        wire ([row, 1] or [1, row]; [col, 1] or [1, col])."""
        ws = self._read(ref)
        row, col = self.row, self.col
        tile = tile or (row, col)
        feats = [w for w in ws if w in self.fq + (self.fv,)]
        if row in ws and col in ws:
            rows, cols = tile
        elif (row in ws or col in ws) and feats:
            rows, cols = (row if row in ws else col), feats[0]
        elif row in ws or col in ws:
            w = row if row in ws else col
            rows, cols = (w, None) if tile[0] == w else (None, w)
        elif feats:   # along the feature wire alone (an output scale c[d] the rows read): [1, feature]
            rows, cols = None, feats[0]
        else:
            rows, cols = None, None
        if gradrules.is_placeholder(ref.name):
            stored = ir.axis_wires(self.bd.tensor(ref.name).axes)
            if sorted(stored) != sorted(ws):
                raise refuse(ref.name, "its stored layout does not hold its wires")
        return loads.get(ref, rows, cols, phase)


def _alias(e) -> bool:
    return isinstance(e, ir.TensorRef) and gradrules.is_placeholder(e.name)


def _contains(e, sub) -> bool:
    return any(n == sub for n in ir.walk(e))


def expr_text(e) -> str:
    from ..printer import expr_text as text
    return text(e)


def _with_tensors(d: ir.Diagram, axes: dict) -> ir.Diagram:
    """``d`` with every backward tensor declared as an input (float32, or the
    dtype of what it stands for), so pointers, strides and loads treat them
    like the diagram's own tensors."""
    from dataclasses import replace

    have = {t.name for t in d.inputs}
    extra = []
    for name, ax in axes.items():
        if name in have:
            continue
        extra.append(ir.Input(name, ax, "fp32"))
    return replace(d, inputs=d.inputs + tuple(extra))
