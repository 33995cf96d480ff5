"""IR -> kernel plan: pattern-match a checked diagram into one of two families.

CONTRACTION (matmul, bmm): one output box ``C = f(sum[k](A * B))``; the two
free wires of C are blocked (one program per output tile), k is streamed.

STREAMED ATTENTION: every output is a *finalise* expression of reductions
along the streamed wire x of elementwise functions of a score tile over
(row wire q, x); the score holds contractions ``sum[d](Q * K)`` done with
tl.dot.  The lowering:

1. inlines every box into the outputs (boxes are names, not materialised);
2. rewrites ``softmax[x](E)`` as ``exp(E) / sum[x](exp(E))`` with a guarded
   division (a row that is entirely -inf gives 0, as the semantics say);
3. turns each reduction over x into an *accumulator*: x-invariant factors of
   a sum's body move outside it; a factor ``exp(E)`` makes it an "expsum",
   kept as exp(m) * acc with a running max m of E shared by every expsum of
   the same E (the online-softmax state: rescale by exp(m_old - m_new));
   ``logsumexp[x](E)`` is log of an expsum; a factor along the value wire
   (V[x, d]) makes the step a tl.dot; max / min keep a running max / min;
4. cancels exp(m) between numerator and denominator (acc / l) and renders a
   logsumexp as m + log(l), so nothing overflows.

The plan holds IR expressions whose leaves the kernel already holds are
named in ``subst`` maps (node -> kernel variable); exprs.py renders them.
Nothing here mutates the IR.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Union

from .. import ir, masks, tiling
from ..errors import Diagnostic, NapkinError

DEFAULT_BLOCK_ROW = 64
DEFAULT_BLOCK_STREAM = 64
DEFAULT_BLOCK_MATMUL = (64, 64, 32)
MIN_DOT = 16
KERNEL_DTYPES = ("fp16", "bf16", "fp32")


def unsupported(what: str, why: str, loc: ir.Loc = ir.NOLOC, hint: Optional[str] = None) -> NapkinError:
    return NapkinError([Diagnostic(f"napkin cannot emit a kernel for {what}: {why}", loc, hint)])


# --------------------------------------------------------------------------
# Internal expression nodes (the plan's own leaves; never in a Diagram).
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class Var:
    """A value the kernel holds in a variable (an accumulator, a state)."""

    name: str
    loc: ir.Loc = field(default=ir.NOLOC, compare=False, repr=False)


@dataclass(frozen=True)
class SafeDiv:
    """lhs / rhs, but 0 where rhs == 0: softmax's normaliser of a row whose
    scores are all -inf (the semantics give such a row 0, not NaN)."""

    lhs: object
    rhs: object
    loc: ir.Loc = field(default=ir.NOLOC, compare=False, repr=False)


@dataclass(frozen=True)
class _ExpSum:
    """During lowering: the value exp(m) * acc of an expsum accumulator."""

    acc: str
    group: str


@dataclass(frozen=True)
class _LogExpSum:
    acc: str
    group: str


# --------------------------------------------------------------------------
# The plan.
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class Load:
    """One tile of an input the kernel loads.  ``wires[i]`` is the wire the
    tensor's i-th declared (flattened) wire is read along; ``rows`` / ``cols``
    are the tile's two dimensions (None: size 1); the other wires are batch
    indices.  phase "pre": once per program before the loop; "step": once
    per visited step of the loop (it carries the streamed wire)."""

    var: str
    tensor: str
    wires: tuple[str, ...]
    rows: Optional[str]
    cols: Optional[str]
    phase: str


@dataclass(frozen=True)
class Dot:
    """var = lhs @ rhs^T, contracting ``wire``: lhs is (row, wire), rhs (col, wire)."""

    var: str
    lhs: Load
    rhs: Load
    wire: str


@dataclass(frozen=True)
class Accum:
    """A reduction along the streamed wire, kept as a running state.

    op "sum": acc += sum(T) or T @ V;  "expsum": acc = acc * alpha + sum(p * T)
    or (p * T) @ V with p = exp(E - m) (m shared by ``group``);  "max" / "min":
    running max / min of T.  ``tile`` None means 1.
    """

    var: str
    op: str
    tile: Optional[object]
    exponent: Optional[object]
    group: Optional[str]
    value: Optional[Load]


@dataclass(frozen=True)
class Output:
    name: str
    axes: tuple[ir.Axis, ...]
    wires: tuple[str, ...]     # flattened layout
    dtype: str                 # tiling.tensor_dtype
    expr: object               # finalise / epilogue expression
    rows: Optional[str]
    cols: Optional[str]
    subst: tuple = ()          # (node, var) pairs for the finalise context


@dataclass(frozen=True)
class AttentionPlan:
    family = "attention"
    diagram: ir.Diagram
    row: str
    col: str                           # the streamed wire
    batch: tuple[str, ...]             # grid axis 1, outermost first
    blocks: tuple[tuple[str, int], ...]  # wire -> block (row, col)
    dims: tuple[str, ...]              # untiled wires padded to a power of two (d)
    loads: tuple[Load, ...]
    dots: tuple[Dot, ...]
    tiles: tuple[tuple[str, object], ...]   # named per-step tiles (boxes), in order
    step_subst: tuple                  # (node, var) pairs for the step context
    groups: tuple[tuple[str, object], ...]  # running-max var, exponent E
    accums: tuple[Accum, ...]
    outputs: tuple[Output, ...]
    bounds: tuple[masks.Bound, ...]
    skip: Optional[object]             # the mask predicate when blocks may be skipped
    precision: str


@dataclass(frozen=True)
class ContractionPlan:
    family = "contraction"
    diagram: ir.Diagram
    row: str
    col: str
    red: str                           # the contracted, streamed wire
    batch: tuple[str, ...]
    blocks: tuple[tuple[str, int], ...]
    dims: tuple[str, ...]
    lhs: Load
    rhs: Load
    loads: tuple[Load, ...]            # epilogue side inputs (pre)
    outputs: tuple[Output, ...]
    precision: str


Plan = Union[AttentionPlan, ContractionPlan]


# --------------------------------------------------------------------------
# Helpers over expressions.
# --------------------------------------------------------------------------

def read_wires(d: ir.Diagram, ref: ir.TensorRef) -> tuple[str, ...]:
    return ref.wires if ref.wires is not None else ir.axis_wires(d.tensor(ref.name).axes)


def wires_of(d: ir.Diagram, e) -> frozenset:
    """The wires an (inlined) expression varies along."""
    if isinstance(e, ir.WireIndex):
        return frozenset([e.wire])
    if isinstance(e, ir.TensorRef):
        return frozenset(read_wires(d, e))
    if isinstance(e, ir.Unary):
        return wires_of(d, e.operand)
    if isinstance(e, (ir.Binary, SafeDiv)):
        return wires_of(d, e.lhs) | wires_of(d, e.rhs)
    if isinstance(e, ir.Call):
        return frozenset().union(*(wires_of(d, a) for a in e.args))
    if isinstance(e, ir.Reduce):
        return wires_of(d, e.body) - set(e.wires)
    if isinstance(e, ir.Normalize):
        return wires_of(d, e.body)
    return frozenset()


def children(e) -> list:
    if isinstance(e, ir.Unary):
        return [e.operand]
    if isinstance(e, (ir.Binary, SafeDiv)):
        return [e.lhs, e.rhs]
    if isinstance(e, ir.Call):
        return list(e.args)
    if isinstance(e, (ir.Reduce, ir.Normalize)):
        return [e.body]
    return []


def nodes(e):
    yield e
    for c in children(e):
        yield from nodes(c)


def _product(factors: list, start=None):
    out = start
    for f in factors:
        out = f if out is None else ir.Binary("*", out, f)
    return out


def inline(d: ir.Diagram) -> dict[str, object]:
    """Each box's expression with every box it reads substituted in."""
    env: dict[str, object] = {}

    def sub(e):
        if isinstance(e, ir.TensorRef) and e.name in env:
            let = d.tensor(e.name)
            if e.wires is not None and tuple(e.wires) != ir.axis_wires(let.axes):
                raise unsupported(f"{e.name}[{', '.join(e.wires)}]",
                                  "kernels read boxes along their own wires; only inputs can be relabelled",
                                  e.loc)
            return env[e.name]
        if isinstance(e, ir.Unary):
            return ir.Unary(e.op, sub(e.operand), e.loc)
        if isinstance(e, ir.Binary):
            return ir.Binary(e.op, sub(e.lhs), sub(e.rhs), e.loc)
        if isinstance(e, ir.Call):
            return ir.Call(e.fn, tuple(sub(a) for a in e.args), e.loc)
        if isinstance(e, ir.Reduce):
            return ir.Reduce(e.op, e.wires, sub(e.body), e.loc)
        if isinstance(e, ir.Normalize):
            return ir.Normalize(e.op, e.wire, sub(e.body), e.loc)
        return e

    for let in d.lets:
        env[let.name] = sub(let.expr)
    return env


# --------------------------------------------------------------------------
# Schedule facts.
# --------------------------------------------------------------------------

def _inner_tiles(d: ir.Diagram) -> list[ir.Tile]:
    """The block tiles (``by``) of every non-device level; the device level is
    ignored: a distributed schedule compiles as its single-device kernel."""
    out = []
    for level in d.schedule.levels if d.schedule else ():
        if level.name != "devices":
            out.extend(t for t in level.tiles if not t.across)
    return out


def _streamed(d: ir.Diagram) -> Optional[ir.Tile]:
    tiles = [t for t in _inner_tiles(d) if t.kind == "stream"]
    return tiles[-1] if tiles else None


def _group_block(d: ir.Diagram, wire: str) -> Optional[ir.Tile]:
    tiles = [t for t in _inner_tiles(d) if t.kind == "group" and t.wire == wire]
    return tiles[-1] if tiles else None


def _refuse_unfused(d: ir.Diagram) -> None:
    outputs = {o.name for o in d.outputs}
    for level in d.schedule.levels if d.schedule else ():
        if level.name not in ("hbm", "devices"):
            continue
        for name in level.holds:
            if isinstance(d.tensor(name), ir.Let) and name not in outputs:
                raise unsupported(
                    f"diagram {d.name}", f"the schedule holds the intermediate {name} in {level.name}, an "
                    "unfused schedule (written out and read back); napkin's kernels keep intermediates on chip",
                    level.loc, f"drop {name} from 'hold' in level {level.name} (the cost report can still compare both)")


def _check_dtypes(d: ir.Diagram) -> None:
    for t in d.inputs:
        if t.dtype not in KERNEL_DTYPES + ("fp64",) and t.dtype not in ir.INT_DTYPES:
            raise unsupported(f"input {t.name}", f"its dtype {t.dtype} has no Triton kernel path here; "
                              "kernels read fp16, bf16, fp32 or integer inputs", t.loc)
    acc = tiling.accumulator_dtype(d)
    if acc != "fp32":
        loc = d.schedule.loc if d.schedule else d.loc
        raise unsupported(f"diagram {d.name}", f"napkin's kernels accumulate in fp32, not {acc}", loc,
                          "write 'accumulate fp32'")


def _block(tile: Optional[ir.Tile], default: int, wire: str) -> int:
    size = tile.size if tile is not None else default
    return max(size, MIN_DOT)


def _dim_block(d: ir.Diagram, wire: str) -> Optional[int]:
    w = d.wire(wire)
    if w is None or w.size is None:
        return None
    return max(MIN_DOT, 1 << max(w.size - 1, 0).bit_length())


# --------------------------------------------------------------------------
# Entry point.
# --------------------------------------------------------------------------

def lower(d: ir.Diagram) -> Plan:
    """The kernel plan for a checked diagram; NapkinError when napkin cannot
    emit a kernel for it (with a location and the reason)."""
    _refuse_unfused(d)
    _check_dtypes(d)
    if not d.outputs:
        raise unsupported(f"diagram {d.name}", "it has no outputs", d.loc)
    exprs = inline(d)
    for out in d.outputs:
        if isinstance(d.tensor(out.name), ir.Input):
            raise unsupported(f"output {out.name}", "it is an input; a kernel computes its outputs", out.loc)
    tile = _streamed(d)
    outs = [exprs[o.name] for o in d.outputs]
    col = tile.wire if tile is not None else _outer_reduced_wire(d, outs)
    if col is None:
        raise unsupported(f"diagram {d.name}", "no output reduces a wire, so nothing can be streamed", d.loc)
    reductions = [n for e in outs for n in nodes(e)
                  if isinstance(n, (ir.Reduce, ir.Normalize)) and col in _red_wires(n)]
    if not reductions:
        loc = tile.loc if tile is not None else d.loc
        raise unsupported(f"diagram {d.name}", f"it streams {col}, but no output reduces {col}", loc)
    nested = any(isinstance(m, ir.Reduce) for r in reductions for m in nodes(r.body))
    if nested:
        return _Attention(d, exprs, col).plan()
    return _contraction(d, exprs, col)


def _red_wires(n) -> tuple[str, ...]:
    return n.wires if isinstance(n, ir.Reduce) else (n.wire,)


def _outer_reduced_wire(d, outs) -> Optional[str]:
    for e in outs:
        for n in nodes(e):
            if isinstance(n, (ir.Reduce, ir.Normalize)):
                return _red_wires(n)[0]
    return None


def _dims_and_batch(d: ir.Diagram, tiled: set[str], used: set[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Wires other than the blocked ones: batch (grid axis 1) and padded dims."""
    order = [w.name for w in d.wires]
    batch = tuple(w for w in order if w in used and w not in tiled)
    return batch, ()


def _check_batch(d: ir.Diagram, batch) -> None:
    for w in batch:
        t = _group_block(d, w)
        if t is not None and t.size != 1:
            raise unsupported(f"'group {w} by {t.size}'", f"napkin's kernels give each index of {w} its own "
                              "programs; only the row wire is blocked", t.loc, f"write 'group {w} by 1'")


# --------------------------------------------------------------------------
# CONTRACTION.
# --------------------------------------------------------------------------

def _contraction(d: ir.Diagram, exprs, red: str) -> ContractionPlan:
    if len(d.outputs) != 1:
        raise unsupported(f"diagram {d.name}", "a contraction kernel computes one output", d.outputs[1].loc)
    out = d.outputs[0]
    let = d.tensor(out.name)
    expr = exprs[out.name]
    reds = [n for n in nodes(expr) if isinstance(n, (ir.Reduce, ir.Normalize))]
    if len(reds) != 1 or not isinstance(reds[0], ir.Reduce) or reds[0].op != "sum" or reds[0].wires != (red,):
        raise unsupported(f"box {out.name}", f"a kernel streaming {red} needs one sum[{red}](A * B) "
                          "(or an attention pattern)", let.loc)
    node = reds[0]
    body = node.body
    if not (isinstance(body, ir.Binary) and body.op == "*" and isinstance(body.lhs, ir.TensorRef)
            and isinstance(body.rhs, ir.TensorRef)
            and all(isinstance(d.tensor(r.name), ir.Input) for r in (body.lhs, body.rhs))):
        raise unsupported(f"sum[{red}](...)", "the streamed contraction must multiply two inputs, A * B", node.loc)
    out_wires = ir.axis_wires(let.axes)
    lw, rw = set(read_wires(d, body.lhs)), set(read_wires(d, body.rhs))
    free = [w for w in out_wires if (w in lw) != (w in rw)]
    if len(free) != 2 or (free[0] in lw) == (free[1] in lw):
        raise unsupported(f"sum[{red}](...)", "a matrix product needs one free wire on each factor "
                          f"(got {', '.join(free) or 'none'})", node.loc)
    row, col = free
    a, b = (body.lhs, body.rhs) if row in lw else (body.rhs, body.lhs)
    tiled = {row, col, red}
    batch = tuple(w for w in (x.name for x in d.wires) if w in set(out_wires) - tiled)
    for ref, allowed in ((a, {row, red}), (b, {col, red})):
        extra = set(read_wires(d, ref)) - allowed - set(batch)
        if extra:
            raise unsupported(f"{ref.name}", f"it has wire(s) {', '.join(sorted(extra))} that the output "
                              "does not keep and the product does not contract", ref.loc)
    _check_batch(d, batch)
    dm, dn, dk = DEFAULT_BLOCK_MATMUL
    blocks = ((row, _block(_group_block(d, row), dm, row)), (col, _block(_group_block(d, col), dn, col)),
              (red, _block(_streamed(d), dk, red)))
    lhs = Load("_a", a.name, read_wires(d, a), row, red, "step")
    rhs = Load("_b", b.name, read_wires(d, b), red, col, "step")
    side = _Loads(d, "pre")
    subst = {node: "_acc"}
    epi = _finalise_leaves(d, expr, subst, side, row, col, {row, col} | set(batch), what=f"box {out.name}")
    output = Output(out.name, let.axes, out_wires, tiling.tensor_dtype(d, out.name), expr, row, col,
                    tuple(subst.items()))
    del epi
    return ContractionPlan(d, row, col, red, batch, blocks, (), lhs, rhs, tuple(side.loads), (output,),
                           _precision(d))


def _precision(d: ir.Diagram) -> str:
    return "tf32" if d.schedule is not None and d.schedule.tf32 else "ieee"


class _Loads:
    """Deduplicated loads; variable names are deterministic (first come)."""

    def __init__(self, d: ir.Diagram, phase: str, taken: Optional[set] = None):
        self.d, self.phase = d, phase
        self.loads: list[Load] = []
        self.taken = taken if taken is not None else set()

    def get(self, ref: ir.TensorRef, rows, cols, phase=None) -> Load:
        wires = read_wires(self.d, ref)
        phase = phase or self.phase
        for ld in self.loads:
            if (ld.tensor, ld.wires, ld.rows, ld.cols, ld.phase) == (ref.name, wires, rows, cols, phase):
                return ld
        var, n = f"_{ref.name}", 1
        while var in self.taken:
            var, n = f"_{ref.name}_{n}", n + 1
        self.taken.add(var)
        ld = Load(var, ref.name, wires, rows, cols, phase)
        self.loads.append(ld)
        return ld


def _finalise_leaves(d, expr, subst: dict, loads: _Loads, rows, cols, allowed: set, what: str):
    """Map every input read in a finalise/epilogue expression to a pre-loop
    load of the (rows, cols) tile; refuse wires the program does not hold."""
    for n in nodes(expr):
        if n in subst:
            continue
        if isinstance(n, ir.TensorRef):
            extra = set(read_wires(d, n)) - allowed
            if extra:
                raise unsupported(what, f"it reads {n.name} along {', '.join(sorted(extra))}, which a program "
                                  "of this kernel does not hold there", n.loc)
            subst[n] = loads.get(n, rows if rows in read_wires(d, n) else None,
                                 cols if cols in read_wires(d, n) else None, "pre").var
        elif isinstance(n, ir.WireIndex) and n.wire not in allowed:
            raise unsupported(what, f"it uses the index of {n.wire} where the kernel has none", n.loc)
        elif isinstance(n, (ir.Reduce, ir.Normalize)) and not _subst_has_inside(n, subst):
            raise unsupported(what, "a reduction that is not part of the kernel's loop", n.loc)
    return expr


def _subst_has_inside(n, subst) -> bool:
    return n in subst


# --------------------------------------------------------------------------
# STREAMED ATTENTION.
# --------------------------------------------------------------------------

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


class _Attention:
    def __init__(self, d: ir.Diagram, exprs: dict, col: str):
        self.d, self.exprs, self.col = d, exprs, col
        self.accums: list[Accum] = []
        self.groups: dict[object, str] = {}   # exponent E -> running-max var
        self.taken: set[str] = set()
        self.dots: list[Dot] = []
        self.step_subst: dict = {}

    # ---- roles of the wires ----
    def find_contractions(self, exprs) -> list[ir.Reduce]:
        found = []
        for e in exprs:
            for n in nodes(e):
                if isinstance(n, ir.Reduce) and self.col not in n.wires and n not in found:
                    found.append(n)
        return found

    def plan(self) -> AttentionPlan:
        d, col = self.d, self.col
        finals = [self.lower_final(self.exprs[o.name], d.tensor(o.name)) for o in d.outputs]
        tile_exprs = [x for a in self.accums for x in (a.exponent, a.tile) if x is not None]
        contractions = self.find_contractions(tile_exprs)
        if not contractions:
            raise unsupported(f"diagram {d.name}", "the reductions along the streamed wire need a score "
                              "contraction such as sum[d](Q * K)", d.loc)
        row = self.row_wire(contractions)
        self.row = row
        dims, batch = set(), set()
        used = set()
        for t in d.inputs:
            used |= set(ir.axis_wires(t.axes))
        for o in d.outputs:
            used |= set(ir.axis_wires(d.tensor(o.name).axes))
        for c in contractions:
            dims |= set(c.wires)
        for a in self.accums:
            if a.value is not None:
                dims |= {w for w in a.value.wires if w == a.value.cols}
        order = [w.name for w in d.wires]
        batch = tuple(w for w in order if w in used and w not in dims | {row, col})
        _check_batch(d, batch)
        self.batch = batch
        step_loads = _Loads(d, "step", self.taken)
        for i, c in enumerate(contractions):
            self.step_subst[c] = self.dot(c, i, step_loads)
        self.name_tiles(tile_exprs)
        for ref in {n for e in tile_exprs for n in nodes(e) if isinstance(n, ir.TensorRef)} - set(self.step_subst):
            pass
        self.tile_loads(tile_exprs, step_loads)
        accums = [self.bind_value(a, step_loads) for a in self.accums]
        outputs = []
        pre = _Loads(d, "pre", self.taken)
        for o, fin in zip(d.outputs, finals):
            let = d.tensor(o.name)
            wires = ir.axis_wires(let.axes)
            dv = [w for w in wires if w not in set(batch) | {row}]
            if len(dv) > 1:
                raise unsupported(f"output {o.name}", f"it keeps {', '.join(dv)} besides the row wire "
                                  f"{row}; a program holds at most one more wire", let.loc)
            cols = dv[0] if dv else None
            subst = {}
            self.final_subst(fin, subst)
            _finalise_leaves(d, fin, subst, pre, row, cols, set(batch) | {row} | set(dv), f"output {o.name}")
            outputs.append(Output(o.name, let.axes, wires, tiling.tensor_dtype(d, o.name), fin, row, cols,
                                  tuple(subst.items())))
            if cols is not None:
                dims.add(cols)
        skip, bounds = self.skipping(accums)
        blocks = ((row, _block(_group_block(d, row), DEFAULT_BLOCK_ROW, row)),
                  (col, _block(_streamed(d), DEFAULT_BLOCK_STREAM, col)))
        loads = tuple(pre.loads) + tuple(ld for ld in step_loads.loads if ld.phase == "pre") \
            + tuple(ld for ld in step_loads.loads if ld.phase == "step")
        return AttentionPlan(
            d, row, col, batch, blocks, tuple(w for w in order if w in dims), loads, tuple(self.dots),
            tuple(self.tiles), tuple(self.step_subst.items()),
            tuple((m, e) for e, m in self.groups.items()), tuple(accums), tuple(outputs), bounds, skip,
            _precision(d))

    def row_wire(self, contractions) -> str:
        d, col = self.d, self.col
        c = contractions[0]
        sides = self.sides(c)
        candidates = [w for w in read_wires(d, sides[0]) if w not in c.wires and w not in read_wires(d, sides[1])]
        grouped = [w for w in candidates if (t := _group_block(d, w)) is not None and t.size > 1]
        if grouped:
            return grouped[-1]
        if not candidates:
            raise unsupported(f"{_show(c)}", f"neither factor has a wire of its own besides {col}", c.loc)
        return candidates[-1]

    def sides(self, c: ir.Reduce) -> tuple[ir.TensorRef, ir.TensorRef]:
        """(row side, streamed side) of a score contraction sum[w](A * B)."""
        d, col = self.d, self.col
        body = c.body
        ok = (c.op == "sum" and isinstance(body, ir.Binary) and body.op == "*"
              and isinstance(body.lhs, ir.TensorRef) and isinstance(body.rhs, ir.TensorRef)
              and all(isinstance(d.tensor(r.name), ir.Input) for r in (body.lhs, body.rhs)))
        if not ok:
            raise unsupported(_show(c), "a score contraction must be sum[w](A * B) of two inputs", c.loc)
        a, b = body.lhs, body.rhs
        if col in read_wires(d, a):
            a, b = b, a
        if col in read_wires(d, a) or col not in read_wires(d, b):
            raise unsupported(_show(c), f"exactly one factor must carry the streamed wire {col}", c.loc)
        return a, b

    def dot(self, c: ir.Reduce, i: int, loads: _Loads) -> str:
        d = self.d
        if len(c.wires) != 1:
            raise unsupported(_show(c), "a score contraction joins one wire", c.loc)
        a, b = self.sides(c)
        if self.row not in read_wires(d, a):
            raise unsupported(_show(c), f"its row-side factor {a.name} lacks the row wire {self.row}", c.loc)
        (w,) = c.wires
        for ref, own in ((a, self.row), (b, self.col)):
            extra = set(read_wires(d, ref)) - {own, w} - set(self.batch)
            if extra:
                raise unsupported(_show(c), f"{ref.name} has wire(s) {', '.join(sorted(extra))} the score "
                                  "does not keep", ref.loc)
        lhs = loads.get(a, self.row, w, "pre")
        rhs = loads.get(b, self.col, w, "step")
        var = f"_qk{i}" if i else "_qk"
        self.taken.add(var)
        self.dots.append(Dot(var, lhs, rhs, w))
        return var

    def name_tiles(self, tile_exprs) -> None:
        """Per-step variables for the boxes the accumulators use (readable code)."""
        d = self.d
        used = {n for e in tile_exprs for n in nodes(e)}
        self.tiles = []
        for let in d.lets:
            e = self.exprs[let.name]
            if e in used and e not in self.step_subst and not isinstance(e, (ir.TensorRef, ir.Num)) \
                    and self.col in wires_of(d, e) and not any(isinstance(n, ir.Normalize) for n in nodes(e)) \
                    and not any(isinstance(n, ir.Reduce) and self.col in n.wires for n in nodes(e)):
                var = f"_{let.name}"
                self.taken.add(var)
                self.tiles.append((var, e))
                self.step_subst[e] = var

    def tile_loads(self, tile_exprs, loads: _Loads) -> None:
        d, row, col = self.d, self.row, self.col
        allowed = set(self.batch) | {row, col}
        for e in tile_exprs + [t for _, t in self.tiles]:
            for n in nodes(e):
                if n in self.step_subst and not isinstance(n, ir.TensorRef):
                    continue
                if isinstance(n, ir.TensorRef) and n not in self.step_subst:
                    ws = read_wires(d, n)
                    extra = set(ws) - allowed
                    if extra:
                        raise unsupported(f"{n.name}", f"it is read along {', '.join(sorted(extra))} inside the "
                                          f"score, which is a tile over ({row}, {col})", n.loc)
                    phase = "step" if col in ws else "pre"
                    ld = loads.get(n, row if row in ws else None, col if col in ws else None, phase)
                    self.step_subst[n] = ld.var
                elif isinstance(n, ir.WireIndex) and n.wire not in allowed:
                    raise unsupported(f"index {n.wire}", f"the score is a tile over ({row}, {col})", n.loc)

    def bind_value(self, a: Accum, loads: _Loads) -> Accum:
        if a.value is None:
            return a
        ref = a.value  # a TensorRef until now
        ws = read_wires(self.d, ref)
        dv = [w for w in ws if w not in set(self.batch) | {self.col}]
        if len(dv) != 1 or self.row in ws:
            raise unsupported(f"{ref.name} in sum[{self.col}](... * {ref.name})",
                              f"the value factor must be along {self.col} and one more wire", ref.loc)
        ld = loads.get(ref, self.col, dv[0], "step")
        return Accum(a.var, a.op, a.tile, a.exponent, a.group, ld)

    # ---- reductions along the streamed wire ----
    def lower_final(self, e, let):
        """Replace reductions along x by accumulator placeholders."""
        col = self.col
        if isinstance(e, ir.Reduce) and col in e.wires:
            return self.lower_reduce(e)
        if isinstance(e, ir.Normalize) and e.wire == col:
            raise unsupported(f"{e.op}[{col}]", f"its result keeps {col}; a streamed kernel can only sum it "
                              f"over {col}, as in sum[{col}](P * V)", e.loc)
        if isinstance(e, ir.Unary):
            return ir.Unary(e.op, self.lower_final(e.operand, let), e.loc)
        if isinstance(e, ir.Binary):
            return self.cancel(ir.Binary(e.op, self.lower_final(e.lhs, let), self.lower_final(e.rhs, let), e.loc))
        if isinstance(e, SafeDiv):
            return self.cancel(SafeDiv(self.lower_final(e.lhs, let), self.lower_final(e.rhs, let)))
        if isinstance(e, ir.Call):
            if e.fn == "log" and isinstance(e.args[0], ir.Reduce) and col in e.args[0].wires:
                inner = self.lower_reduce(e.args[0])
                if isinstance(inner, _ExpSum):
                    return _LogExpSum(inner.acc, inner.group)
            return ir.Call(e.fn, tuple(self.lower_final(a, let) for a in e.args), e.loc)
        if col in wires_of(self.d, e):
            raise unsupported(f"output {let.name}", f"it keeps the streamed wire {col}", let.loc)
        return e

    def lower_reduce(self, node: ir.Reduce):
        d, col = self.d, self.col
        if node.wires != (col,):
            raise unsupported(_show(node), f"it reduces {', '.join(node.wires)} at once; a streamed kernel "
                              f"reduces {col} alone", node.loc)
        body = self.softmax_to_exp(node.body)
        if node.op == "logsumexp":
            acc, group = self.accum("expsum", None, body, None)
            return _LogExpSum(acc, group)
        num, den = _factors(body)
        outside = [f for f in num if col not in wires_of(d, f)]
        outside_den = [(f, s) for f, s in den if col not in wires_of(d, f)]
        inside = [f for f in num if col in wires_of(d, f)]
        inside_den = [(f, s) for f, s in den if col in wires_of(d, f)]
        if node.op != "sum" and (outside or outside_den):
            outside, outside_den, inside, inside_den = [], [], num, den
        for f, safe in inside_den:
            if safe:
                raise unsupported(_show(node), "a softmax inside the sum is divided by another", node.loc)
        values = [f for f in inside if isinstance(f, ir.TensorRef)
                  and set(read_wires(d, f)) - {col} - set(self._batch_guess())
                  and isinstance(d.tensor(f.name), ir.Input) and not self._on_score(f)]
        if len(values) > 1:
            raise unsupported(_show(node), "it multiplies two value tensors", node.loc)
        value = values[0] if values else None
        rest = [f for f in inside if f is not value]
        if node.op != "sum" and value is not None:
            raise unsupported(_show(node), f"{node.op} of a product with a value tensor", node.loc)
        exps = [f.args[0] for f in rest if isinstance(f, ir.Call) and f.fn == "exp"] if node.op == "sum" else []
        rest = [f for f in rest if not (isinstance(f, ir.Call) and f.fn == "exp")] if exps else rest
        tile = _product(rest)
        for f, _ in inside_den:
            tile = ir.Binary("/", tile if tile is not None else ir.Num(1.0), f)
        for n in (nodes(tile) if tile is not None else []):
            if isinstance(n, (ir.Reduce, ir.Normalize)) and col in _red_wires(n):
                raise unsupported(_show(node), f"it uses a reduction over {col} inside a reduction over {col}",
                                  n.loc, f"write softmax[{col}](S) for a normalised score")
        if exps:
            exponent = exps[0]
            for e in exps[1:]:
                exponent = ir.Binary("+", exponent, e)
            acc, group = self.accum("expsum", tile, exponent, value)
            result = _ExpSum(acc, group)
        else:
            if tile is None and value is None:
                tile = ir.Num(1.0)
            acc, _ = self.accum(node.op, tile, None, value)
            result = Var(acc)
        for f in outside:
            result = ir.Binary("*", result, self.lower_final(f, None))
        for f, safe in outside_den:
            lowered = self.lower_final(f, None)
            result = SafeDiv(result, lowered) if safe else ir.Binary("/", result, lowered)
        return self.cancel(result) if isinstance(result, (SafeDiv, ir.Binary)) else result

    def _batch_guess(self):
        # Before the batch wires are known: the wires every score reads that are not row/col.
        return ()

    def _on_score(self, ref) -> bool:
        return False

    def softmax_to_exp(self, e):
        """softmax[x](E) -> exp(E) / sum[x](exp(E)), the division guarded."""
        if isinstance(e, ir.Normalize) and e.wire == self.col:
            body = self.softmax_to_exp(e.body)
            ex = ir.Call("exp", (body,), e.loc)
            return SafeDiv(ex, ir.Reduce("sum", (self.col,), ex, e.loc))
        if isinstance(e, ir.Unary):
            return ir.Unary(e.op, self.softmax_to_exp(e.operand), e.loc)
        if isinstance(e, ir.Binary):
            return ir.Binary(e.op, self.softmax_to_exp(e.lhs), self.softmax_to_exp(e.rhs), e.loc)
        if isinstance(e, ir.Call):
            return ir.Call(e.fn, tuple(self.softmax_to_exp(a) for a in e.args), e.loc)
        return e

    def accum(self, op, tile, exponent, value) -> tuple[str, Optional[str]]:
        group = None
        if op == "expsum":
            group = self.groups.get(exponent)
            if group is None:
                group = f"_m{len(self.groups)}" if self.groups else "_m"
                self.taken.add(group)
                self.groups[exponent] = group
        for a in self.accums:
            if (a.op, a.tile, a.exponent, a.value) == (op, tile, exponent, value):
                return a.var, a.group
        var = _acc_name(op, value, len(self.accums), self.taken)
        self.taken.add(var)
        self.accums.append(Accum(var, op, tile, exponent, group, value))
        return var, group

    # ---- finalise: cancel exp(m) in ratios, render states ----
    def cancel(self, e):
        if isinstance(e, (SafeDiv, ir.Binary)) and (isinstance(e, SafeDiv) or e.op == "/"):
            top, bottom = _expsum_factors(e.lhs), _expsum_factors(e.rhs)
            common = sorted({g for g in top if top.count(g) == 1} & {g for g in bottom if bottom.count(g) == 1})
            if common:
                lhs, rhs = _drop_scale(e.lhs, set(common)), _drop_scale(e.rhs, set(common))
                return SafeDiv(lhs, rhs) if isinstance(e, SafeDiv) else ir.Binary("/", lhs, rhs, e.loc)
        return e

    def final_subst(self, fin, subst: dict) -> None:
        for n in nodes(fin):
            if isinstance(n, Var):
                subst[n] = n.name

    # ---- skipping masked blocks ----
    def skipping(self, accums):
        d = self.d
        fixed = {w.name: w.size for w in d.wires if w.size is not None}
        node = None
        for a in accums:
            for x in (a.exponent, a.tile):
                if x is not None and node is None:
                    node = masks.mask_node(x)
        if node is None:
            return None, ()
        for a in accums:
            if a.op == "expsum":
                body = ir.Call("exp", (a.exponent,))
                if a.tile is not None:
                    body = ir.Binary("*", body, a.tile)
                want = 0.0
            else:
                body = a.tile if a.tile is not None else ir.Num(1.0)
                want = {"sum": 0.0, "max": float("-inf"), "min": float("inf")}[a.op]
            if masks.value_when_masked(body, node, fixed) != want:
                return None, ()
        pred = masks.mask_predicate(node)
        return pred, masks.stream_bounds(pred, self.row, self.col, fixed)


def _acc_name(op, value, i, taken) -> str:
    base = {"max": "_max", "min": "_min"}.get(op, "_acc" if value is not None else "_l")
    var, n = base, 1
    while var in taken:
        var, n = f"{base}{n}", n + 1
    return var


def _factors(e, safe_div=False):
    """e as (numerator factors, [(denominator factor, guarded)])."""
    if isinstance(e, ir.Binary) and e.op == "*":
        n1, d1 = _factors(e.lhs)
        n2, d2 = _factors(e.rhs)
        return n1 + n2, d1 + d2
    if isinstance(e, (ir.Binary, SafeDiv)) and (isinstance(e, SafeDiv) or e.op == "/"):
        n1, d1 = _factors(e.lhs)
        safe = isinstance(e, SafeDiv)
        return n1, d1 + [(e.rhs, safe)]
    return [e], []


def _expsum_factors(e) -> list[str]:
    if isinstance(e, _ExpSum):
        return [e.group]
    if isinstance(e, ir.Binary) and e.op == "*":
        return _expsum_factors(e.lhs) + _expsum_factors(e.rhs)
    return []


def _drop_scale(e, groups: set):
    if isinstance(e, _ExpSum) and e.group in groups:
        return Var(e.acc)
    if isinstance(e, ir.Binary) and e.op == "*":
        return ir.Binary("*", _drop_scale(e.lhs, groups), _drop_scale(e.rhs, groups), e.loc)
    return e


def _show(e) -> str:
    from ..check import _show as show
    return show(e)
