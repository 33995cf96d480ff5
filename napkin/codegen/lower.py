"""IR -> kernel plan: pattern-match a checked diagram into one of two families.

CONTRACTION (matmul, bmm): one output box ``C = f(sum[k](A * B))``; the two
free wires of C are blocked (one program per output tile, the rest of C's
wires are batch wires), k is streamed; f is an elementwise epilogue.

STREAMED ATTENTION (attention.py): every output is a *finalise* expression of
reductions along the streamed wire x of elementwise functions of a score
tile over (row wire q, x) holding contractions ``sum[d](Q * K)`` (tl.dot).

``lower(diagram)`` inlines every box into the outputs (boxes are names, not
materialised), picks the family, and returns a frozen plan: IR expressions
plus the lowering's own leaves (``Var``, ``SafeDiv``, ``LogSumExp``), with
``subst`` maps naming the nodes the kernel already holds in variables.
exprs.py renders expressions, emit.py the module.  Nothing here mutates the
IR.  A diagram napkin cannot emit raises NapkinError("napkin cannot emit a
kernel for ...: why") at the offending node.

Device levels (``across``) are ignored: a distributed schedule compiles as
its single-device kernel.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from .. import ir, masks, tiling
from ..errors import Diagnostic, NapkinError
from ..printer import layout_text
from .kernel_names import fresh_name, internal_names

DEFAULT_BLOCK_ROW = 64
DEFAULT_BLOCK_STREAM = 64
DEFAULT_BLOCK_MATMUL = (64, 64, 32)
MIN_DOT = tiling.MIN_DOT_BLOCK  # tl.dot's least block
KERNEL_DTYPES = ("fp16", "bf16", "fp32")
# A matrix product's two factors may also be fp8 or int8 (ir.FACTOR_DTYPES; refused elsewhere
# by operands.py): tl.dot takes them at the tensor cores' 8-bit rates.


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
class LogSumExp:
    """A finished logsumexp: m * ln 2 + log(l), -inf where l == 0 (m is the
    running max in log2 units, l the sum of 2^(E log2 e - m))."""

    m: str
    l: str
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
    steps: tuple[int, ...] = ()         # a coarse read's step per wire (ir.TensorRef.steps); () none


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
    # the bounds whose conjunction is exactly the mask (() with no mask):
    # blocks where all hold on the whole tile skip the mask (visits.full_blocks);
    # None when no block is known full (a non-affine conjunct, a mask that
    # cannot be skipped)
    full: Optional[tuple[masks.Bound, ...]] = None
    # (g, its group) when a batch wire shares the row block (packed_wire): the launcher packs
    # the (g, row) pairs into one row wire and passes each row's own index as its position
    pack: Optional[tuple[str, int]] = None


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
    # the sum's other wires (sum[k, j](A * B) streaming j: k), looped over index by index in each
    # program around the stream loop; a weight shared by the batch: its gradient's batch wires
    outer: tuple[str, ...] = ()


Plan = Union[AttentionPlan, ContractionPlan]


# --------------------------------------------------------------------------
# Helpers over expressions.
# --------------------------------------------------------------------------

def read_wires(d: ir.Diagram, ref: ir.TensorRef) -> tuple[str, ...]:
    return ref.wires if ref.wires is not None else ir.axis_wires(d.tensor(ref.name).axes)


def wires_of(d: ir.Diagram, e, known: frozenset = frozenset()) -> frozenset:
    """The wires an (inlined) expression varies along; ``known``: conditions
    that hold (see ``decided``), whose where() is its kept branch alone."""
    if isinstance(e, ir.WireIndex):
        return frozenset([e.wire])
    if isinstance(e, ir.TensorRef):
        return frozenset(read_wires(d, e))
    if isinstance(e, ir.Unary):
        return wires_of(d, e.operand, known)
    if isinstance(e, (ir.Binary, SafeDiv)):
        return wires_of(d, e.lhs, known) | wires_of(d, e.rhs, known)
    if isinstance(e, ir.Call):
        holds = decided(e.args[0], known) if e.fn == "where" and known else None
        if holds is not None:
            return wires_of(d, e.args[1] if holds else e.args[2], known)
        return frozenset().union(*(wires_of(d, a, known) for a in e.args))
    if isinstance(e, ir.Reduce):
        return wires_of(d, e.body, known) - set(e.wires)
    if isinstance(e, ir.Normalize):
        return wires_of(d, e.body, known)
    return frozenset()


def decided(c, known: frozenset) -> Optional[bool]:
    """True / False when condition ``c`` follows from ``known`` (conditions
    true on a whole tile: a full block's mask and its conjuncts), else None."""
    if c in known:
        return True
    if masks.negate(c) in known:   # where(x > q, -inf, s) in a block known x <= q
        return False
    if isinstance(c, ir.Unary) and c.op == "not":
        inner = decided(c.operand, known)
        return None if inner is None else not inner
    if isinstance(c, ir.Binary) and c.op in ("and", "or"):
        a, b = decided(c.lhs, known), decided(c.rhs, known)
        if c.op == "and":
            return True if a is True and b is True else False if False in (a, b) else None
        return True if True in (a, b) else False if a is False and b is False else None
    return None


def children(e) -> list:
    """ir.children, plus the codegen's own SafeDiv node."""
    if isinstance(e, SafeDiv):
        return [e.lhs, e.rhs]
    return list(ir.children(e))


def nodes(e):
    yield e
    for c in children(e):
        yield from nodes(c)


def _product(factors: list, start=None):
    out = start
    for f in factors:
        out = f if out is None else ir.Binary("*", out, f)
    return out


def _refuse_deep_chains(d: ir.Diagram) -> None:
    """The parser bounds each box's expression at MAX_DEPTH levels; the kernels
    inline the boxes a box reads, and the backward differentiates the result,
    so a chain of boxes (S1 = exp(S), S2 = exp(S1), ...) nested without bound
    and crashed the code generator (RecursionError, or emitted Python too
    deeply nested to compile).  The bound holds for the inlined expression."""
    from ..parse import MAX_DEPTH

    depth: dict[str, int] = {}

    def of(e) -> int:   # each box's own expression is at most MAX_DEPTH deep: recursion is safe
        if isinstance(e, ir.TensorRef):
            return depth.get(e.name, 1)
        return 1 + max((of(c) for c in ir.children(e)), default=0)

    for let in d.lets:
        depth[let.name] = of(let.expr)
        if depth[let.name] > MAX_DEPTH:
            raise unsupported(f"box {let.name}", f"with the boxes it reads inlined, its expression nests "
                              f"{depth[let.name]} levels deep, more than the {MAX_DEPTH} a kernel takes", let.loc,
                              "make a box of the chain an output (a kernel of its own), or shorten the chain")


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

def _kernel_level(d: ir.Diagram) -> Optional[ir.Level]:
    """The level whose tiles are the kernels' blocks: smem, or regs where smem
    tiles nothing.  The checker and the cost pass count a kernel's programs
    there (tiling.chip_levels: the outermost tiled on-chip level), so
    codegen must too; _refuse_off_smem refuses a tile inside it that says
    otherwise."""
    levels = tiling.chip_levels(d)
    return d.level(levels[0]) if levels else None


def _inner_tiles(d: ir.Diagram) -> list[ir.Tile]:
    """The block tiles (``by``) of the kernel level (_kernel_level).  The
    checker allows no other level above it a block (devices and nodes split
    ``across``, which a distributed schedule's single-device kernel ignores;
    hbm takes none), and _refuse_off_smem refuses one inside it that differs."""
    kernel = _kernel_level(d)
    return [t for t in kernel.tiles if not t.across] if kernel is not None else []


def _streamed(d: ir.Diagram) -> Optional[ir.Tile]:
    tiles = [t for t in _inner_tiles(d) if t.kind == "stream"]
    return tiles[-1] if tiles else None


def chunk_of(d: ir.Diagram) -> Optional[int]:
    """The schedule's chunk of the streamed wire (ir.Tile.chunk), or None."""
    t = _streamed(d)
    return t.chunk if t is not None else None


def _group_block(d: ir.Diagram, wire: str) -> Optional[ir.Tile]:
    tiles = [t for t in _inner_tiles(d) if t.kind == "group" and t.wire == wire]
    return tiles[-1] if tiles else None


def _refuse_all(errors: list[NapkinError]) -> None:
    """Independent refusals (each at its own place) raised together, as the checker's are."""
    if errors:
        raise NapkinError([dg for err in errors for dg in err.diagnostics])


def _refuse_unfused(d: ir.Diagram) -> None:
    outputs = {o.name for o in d.outputs}
    errors = []
    for level in d.schedule.levels if d.schedule else ():
        if level.name not in ("hbm", "devices"):
            continue
        held = [name for name in level.holds if isinstance(d.tensor(name), ir.Let) and name not in outputs]
        if held:   # one refusal a level, naming every intermediate it holds
            names = ", ".join(held)
            what = f"the intermediate {names}" if len(held) == 1 else f"the intermediates {names}"
            errors.append(unsupported(
                f"diagram {d.name}", f"the schedule holds {what} in {level.name}, an "
                "unfused schedule (written out and read back); napkin's kernels keep intermediates on chip",
                level.loc,
                f"drop {names} from 'hold' in level {level.name} (the cost report can still compare both)"))
    _refuse_all(errors)


def _check_dtypes(d: ir.Diagram) -> None:
    errors = []
    for t in d.inputs:
        if t.dtype not in KERNEL_DTYPES + ir.FACTOR_DTYPES + ("fp64",) and t.dtype not in ir.INT_DTYPES:
            errors.append(unsupported(f"input {t.name}", f"its dtype {t.dtype} has no Triton kernel path here; "
                                      "kernels read fp16, bf16, fp32 or integer inputs", t.loc))
    for out in d.outputs:
        dtype = tiling.tensor_dtype(d, out.name)
        if dtype not in KERNEL_DTYPES + ("fp64",) + ir.INT_DTYPES:
            errors.append(unsupported(f"output {out.name}", f"its dtype {dtype} has no Triton kernel path here",
                                      out.loc))
    acc = tiling.accumulator_dtype(d)
    if acc != "fp32":   # at the accumulate line itself (it pointed at the schedule's first line)
        s = d.schedule
        loc = s.accumulate_loc if s and s.accumulate_loc != ir.NOLOC else s.loc if s else d.loc
        errors.append(unsupported(f"diagram {d.name}", f"napkin's kernels accumulate in fp32, not {acc}", loc,
                                  "write 'accumulate fp32'"))
    _refuse_all(errors)


def _block(tile: Optional[ir.Tile], default: int) -> int:
    """A block size from the schedule (tl.dot needs at least 16)."""
    size = tile.size if tile is not None else default
    return max(size, MIN_DOT)


def padded_block(n: int, least: int = MIN_DOT) -> int:
    """A feature wire's block in the kernels: its size padded to a power of
    two, at least ``least`` (tl.dot's: MIN_DOT, or 32 along an 8-bit
    product's sum, tiling.least_block); the launchers' _dim_block at run time."""
    return max(least, 1 << max(int(n) - 1, 0).bit_length())


def _dim_block(d: ir.Diagram, wire: str) -> Optional[int]:
    w = d.wire(wire)
    if w is None or w.size is None:
        return None
    return padded_block(w.size, tiling.least_block(d, wire))


def feature_block(d: ir.Diagram, wire: str, sizes) -> int:
    """A feature wire's block: fixed by the diagram, else at its size in ``sizes``."""
    return _dim_block(d, wire) or padded_block(sizes[wire], tiling.least_block(d, wire))


# --------------------------------------------------------------------------
# Entry point.
# --------------------------------------------------------------------------

def lower(d: ir.Diagram) -> Plan:
    """The kernel plan for a checked diagram; NapkinError when napkin cannot
    emit a kernel for it (with a location and the reason)."""
    from .operands import refuse_operands   # it reads this module's plans

    _refuse_unfused(d)
    _check_dtypes(d)
    _refuse_deep_chains(d)
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
        from .attention import lower_attention
        return refuse_operands(_refuse_off_smem(_refuse_unsplit(lower_attention(d, exprs, col))))
    if tile is not None and tile.chunk is not None:
        raise unsupported(f"'group {col} by {tile.chunk}'", f"chunks of the streamed wire (programs merging "
                          f"partial states) are generated for attention kernels only; this diagram's kernel is a "
                          f"contraction over {col}", tile.chunk_loc, f"drop 'group {col} by {tile.chunk}'")
    return refuse_operands(_refuse_off_smem(_refuse_unsplit(_contraction(d, exprs, col))))


def streamed_attention(d: ir.Diagram) -> Optional[AttentionPlan]:
    """The plan of ``d``'s forward kernel when it is a streamed attention,
    else None (a contraction, or a diagram ``lower`` refuses): what the cost
    pass (cost/analysis.py), the tuner (autotune.py) and the benchmark
    harness read the launch from, where a refusal is not theirs to report."""
    try:
        plan = lower(d)
    except NapkinError:
        return None
    return plan if plan.family == "attention" else None


def _refuse_unsplit(plan: Plan) -> Plan:
    """``plan``, unless the kernel level groups a wire the kernels do not
    split across programs: refused at that tile.  Their programs are blocks
    of the row wire (and, for a contraction, of the column wire), one per
    index of a batch wire (packed rows: the packed wire too); each holds a
    feature wire whole and loops over the whole streamed one.  The checker
    and the cost pass would count the group's programs (d/32 of them for
    'group d by 32'), which no launch runs."""
    kernel = _kernel_level(plan.diagram)
    split = {plan.row, *plan.batch} | ({plan.col} if plan.family == "contraction" else set())
    if getattr(plan, "pack", None) is not None:
        split.add(plan.pack[0])
    stream = plan.red if plan.family == "contraction" else plan.col
    for t in kernel.tiles if kernel is not None else ():
        if t.across or t.kind != "group" or t.wire in split:
            continue
        w, tile = t.wire, f"group {t.wire} by {t.size}"
        hint = f"drop '{tile}' from level {kernel.name}"
        if w != stream:
            why = f"each holds all of {w}"
        elif plan.family == "attention":
            why = f"each loops over all of {w}, the streamed wire"
            hint = f"for chunks of {w} (one per program, merged after: flash-decoding) stream {w} beside it " \
                   f"('stream {w} by 64'); else " + hint
        else:
            why = f"each loops over all of {w}, the streamed wire"
            hint += " (chunks of a streamed wire are generated for attention only)"
        raise unsupported(f"'{tile}'", "the kernels' programs are blocks of "
                          + " and ".join(w for w in (plan.row, plan.col) if w in split)
                          + (", one per index of " + ", ".join(plan.batch) if plan.batch else "")
                          + f", and {why}: no launch splits {w} into the blocks of {t.size} the cost pass "
                          f"would count",
                          t.loc, hint)
    return plan


def _refuse_off_smem(plan: Plan) -> Plan:
    """``plan``, unless a level inside level smem (regs) tiles a wire other
    than smem does: refused at that tile.  The kernels' blocks are smem's
    (_kernel_level), where the checker and the cost pass count the
    programs; codegen reads no tile inside it, so one that differs would
    be priced but not run (regs 'q by 64' under smem 'q by 128': the cost
    report's q/128 programs), and one equal to smem's changes nothing.
    Where smem does not tile the wire, only 'group w by 1' of a batch wire
    says what the kernels do anyway (one program per index); any other
    would name a block that codegen's default (64 rows, say) is not."""
    d, kernel = plan.diagram, _kernel_level(plan.diagram)
    if kernel is None or kernel.name != "smem":
        return plan
    pack = getattr(plan, "pack", None)
    for level in d.schedule.levels[d.schedule.levels.index(kernel) + 1:]:
        for t in level.tiles:
            own = next((u for u in kernel.tiles if u.wire == t.wire and not u.across), None)
            # smem's chunks are its programs' split of the wire, which regs cannot make (the checker): a
            # regs stream of smem's block repeats it
            if t.across or (own is None and (t.kind, t.size, t.wire in plan.batch) == ("group", 1, True)) or \
                    (own is not None and (own.kind, own.size) == (t.kind, t.size) and t.chunk in (None, own.chunk)):
                continue
            w, tile = t.wire, f"{t.kind} {t.wire} by {t.size}"
            there = (f"does not {t.kind} {w}" if own is None else f"{own.kind}s {w} by {own.size}"
                     + (f" in chunks of {own.chunk}" if own.chunk is not None else ""))
            if pack is not None and w in (pack[0], plan.row) and t.kind == "group":
                raise unsupported(f"'{tile}'", f"packed rows ({pack[0]} grouped beside {plan.row}) are formed "
                                  f"in level smem, which {there}; a group of {w} in level {level.name} would give "
                                  f"the kernels other row blocks than that level's", t.loc,
                                  f"group {w} in level smem alone: drop '{tile}' from level {level.name}")
            raise unsupported(f"'{tile}'", f"the kernels' blocks are level smem's (its groups are the grid's "
                              f"programs, as the checker and the cost pass count them), and level smem {there}; "
                              f"a {t.kind} of {w} in level {level.name} would give the kernels other blocks than "
                              f"that level's", t.loc, f"drop '{tile}' from level {level.name}, or {tile} in level "
                              f"smem" + (f" in place of '{own.kind} {w} by {own.size}'" if own is not None else ""))
    return plan


def _red_wires(n) -> tuple[str, ...]:
    return n.wires if isinstance(n, ir.Reduce) else (n.wire,)


def _outer_reduced_wire(d, outs) -> Optional[str]:
    """The wire streamed where the schedule streams none: the outermost reduction's; of a sum
    over several wires its last (sum[k, j](A * B): j, innermost as written, k looped around it)."""
    for e in outs:
        for n in nodes(e):
            if isinstance(n, (ir.Reduce, ir.Normalize)):
                return _red_wires(n)[-1]
    return None


def _check_batch(d: ir.Diagram, batch) -> None:
    for w in batch:
        t = _group_block(d, w)
        if t is not None and t.size != 1:
            raise unsupported(f"'group {w} by {t.size}'", f"napkin's kernels give each index of {w} its own "
                              "programs; only the row wire is blocked", t.loc, f"write 'group {w} by 1'")


def packed_wire(d: ir.Diagram, batch, row: str) -> Optional[tuple[str, int]]:
    """The batch wire packed into the row block, and its group: (g, 4) for
    ``group g by 4`` beside ``group q by 4`` (16 rows: 4 heads x 4 queries),
    else None.  The launcher views every tensor along q as (g q) pairs,
    g-major, one row wire of |g||q| rows (g of size 1), and gives each row its
    q as a position: so K and V, which lack g, are read once per program for
    all the heads it packs (grouped-query decoding).  That view is a reshape
    only when g sits right before q in every tensor along either, and the
    kernel must not need g itself (its index, its size): refused otherwise,
    at the group.  Integer inputs along q are read at the rows' positions,
    so they must lack g (one that holds g is refused).  The groups are
    level smem's, as tiling.packs_rows reads them (_group_block reads no
    level inside smem; lower refuses one there that differs: _refuse_off_smem)."""
    grouped = [(w, t) for w in batch if (t := _group_block(d, w)) is not None and t.size != 1]
    rt = _group_block(d, row)
    short = rt is not None and 1 < rt.size < MIN_DOT
    if not grouped:
        if short:  # the checker passes it only as packed rows (tiling.packs_rows): not these
            raise unsupported(f"'group {row} by {rt.size}'", f"its blocks of {rt.size} rows are short of a tl.dot "
                              f"block of {MIN_DOT}, and no wire packs into them", rt.loc,
                              f"write 'group {row} by {MIN_DOT}'")
        return None
    w, t = grouped[0]
    what = f"'group {w} by {t.size}'"
    hint = f"write 'group {w} by 1'"
    if len(grouped) > 1:
        w2, t2 = grouped[1]
        raise unsupported(f"'group {w2} by {t2.size}'", f"only one wire may share the rows of {row} "
                          f"(group {w} by {t.size} packs {w} already)", t2.loc, f"write 'group {w2} by 1'")
    if (short or t.size < MIN_DOT) and not tiling.packs_rows(d, w, row):
        raise unsupported(what, f"it packs {w} into the rows of {row} with groups short of a tl.dot block of "
                          f"{MIN_DOT}, which only packed rows make up: both grouped in level smem, {w} right "
                          f"before {row} in an input, together {MIN_DOT} rows or more", t.loc, hint)
    for x in list(d.inputs) + [d.tensor(o.name) for o in d.outputs]:
        wires = ir.axis_wires(x.axes)
        if w not in wires and row not in wires:
            continue
        if isinstance(x, ir.Input) and x.dtype in ir.INT_DTYPES:
            if w in wires:  # the launcher views float tensors only: this one would be read with |g| = 1
                raise unsupported(what, f"an integer input that holds {w} cannot be packed (integer inputs are "
                                  f"read at the rows' positions of {row}); {x.name} is [{', '.join(wires)}]",
                                  t.loc, hint)
            # read with the packed sizes, a dimension (hk q) would step hk by |g||q| rows, not |q|
            if any(row in a and len(a) > 1 for a in x.axes):
                raise unsupported(what, f"an integer input that flattens {row} with other wires cannot be "
                                  f"packed (integer inputs are read at the rows' positions of {row}); "
                                  f"{x.name} is {layout_text(x.axes)}", t.loc,
                                  f"{hint}; or give {row} a dimension of its own in {x.name}")
            continue  # read at the rows' positions (their q)
        if not (w in wires and row in wires and wires.index(w) + 1 == wires.index(row)):
            raise unsupported(what, f"it packs {w} into the rows of {row}, so every tensor along either "
                              f"holds {w} right before {row}; {x.name} is [{', '.join(wires)}]", t.loc, hint)
    for let in d.lets:
        for n in nodes(let.expr):
            if isinstance(n, (ir.WireIndex, ir.WireSize)) and n.wire == w:
                used = f"|{w}|" if isinstance(n, ir.WireSize) else f"the index {w}"
                # the row wire is the innermost grouped one: a layout with q before g makes g the rows
                raise unsupported(what, f"box {let.name} uses {used}, which packed rows do not keep "
                                  f"(the kernel sees {w} as size 1)", t.loc,
                                  f"{hint}; or, to pack {row} into the rows of {w}, hold {row} right before "
                                  f"{w} in every tensor")
    return w, t.size


# --------------------------------------------------------------------------
# CONTRACTION.
# --------------------------------------------------------------------------

def _contraction(d: ir.Diagram, exprs, red: str) -> ContractionPlan:
    if len(d.outputs) != 1:
        raise unsupported(f"diagram {d.name}", "a contraction kernel computes one output", d.outputs[1].loc)
    out = d.outputs[0]
    let = d.tensor(out.name)
    expr = exprs[out.name]
    # Y * sigmoid(Y), Y = sum[k](A * B) inlined, reads one sum twice: one node, one accumulator
    reds = list(dict.fromkeys(n for n in nodes(expr) if isinstance(n, (ir.Reduce, ir.Normalize))))
    if len(reds) > 1 and all(isinstance(r, ir.Reduce) and r.op == "sum" and red in r.wires for r in reds):
        # sum[k](A * B) + sum[k](A * A): two products (one sum read twice is one: reds holds each once)
        raise unsupported(f"box {out.name}", f"its expression uses {len(reds)} different sums over {red}; a "
                          "contraction kernel computes one product, and its epilogue reads that sum", let.loc)
    if len(reds) != 1 or not isinstance(reds[0], ir.Reduce) or reds[0].op != "sum" or red not in reds[0].wires:
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
    # sum[k, j](A * B) streaming j: each program loops over k index by index around its stream of j
    outer = tuple(w.name for w in d.wires if w.name in node.wires and w.name != red)
    # The blocked wires: on each factor, the free wire the schedule groups by
    # more than 1, else the last free wire; any other output wire is a batch
    # wire (one program per index), broadcast over the factor that lacks it.
    own = [[w for w in out_wires if w in side and w not in other] for side, other in ((lw, rw), (rw, lw))]
    if not all(own):
        raise unsupported(f"sum[{red}](...)", "a matrix product needs a free wire on each factor", node.loc)
    row, col = (next((w for w in reversed(ws) if (t := _group_block(d, w)) is not None and t.size > 1), ws[-1])
                for ws in own)
    a, b = body.lhs, body.rhs
    tiled = {row, col, red}
    batch = tuple(w for w in (x.name for x in d.wires) if w in set(out_wires) - tiled)
    for ref, allowed in ((a, {row, red, *outer}), (b, {col, red, *outer})):
        extra = set(read_wires(d, ref)) - allowed - set(batch)
        if extra:
            raise unsupported(f"{ref.name}", f"it has wire(s) {', '.join(sorted(extra))} that the output "
                              "does not keep and the product does not contract", ref.loc)
    _check_batch(d, batch)
    dm, dn, dk = DEFAULT_BLOCK_MATMUL
    blocks = ((row, _block(_group_block(d, row), dm)), (col, _block(_group_block(d, col), dn)),
              (red, _block(_streamed(d), dk)))
    lhs = Load("_a", a.name, read_wires(d, a), row, red, "step", a.steps or ())
    rhs = Load("_b", b.name, read_wires(d, b), red, col, "step", b.steps or ())
    side = _Loads(d, "pre", {"_a", "_b", "_acc"})
    subst = {node: "_acc"}
    _finalise_leaves(d, expr, subst, side, row, col, {row, col} | set(batch), what=f"box {out.name}")
    output = Output(out.name, let.axes, out_wires, tiling.tensor_dtype(d, out.name), expr, row, col,
                    tuple(subst.items()))
    return ContractionPlan(d, row, col, red, batch, blocks, (), lhs, rhs, tuple(side.loads), (output,),
                           _precision(d), outer)


def _precision(d: ir.Diagram) -> str:
    return "tf32" if d.schedule is not None and d.schedule.tf32 else "ieee"


class _Loads:
    """Deduplicated loads; variable names are deterministic (first come)."""

    def __init__(self, d: ir.Diagram, phase: str, taken: Optional[set] = None):
        self.d, self.phase = d, phase
        self.loads: list[Load] = []
        self.taken = taken if taken is not None else set()
        self.reserved = internal_names(d)

    def get(self, ref: ir.TensorRef, rows, cols, phase=None) -> Load:
        wires, steps = read_wires(self.d, ref), ref.steps or ()
        phase = phase or self.phase
        for ld in self.loads:
            if (ld.tensor, ld.wires, ld.rows, ld.cols, ld.phase, ld.steps) == \
                    (ref.name, wires, rows, cols, phase, steps):
                return ld
        var = fresh_name(ref.name, self.taken, self.reserved)
        self.taken.add(var)
        ld = Load(var, ref.name, wires, rows, cols, phase, steps)
        self.loads.append(ld)
        return ld


def _finalise_leaves(d, expr, subst: dict, loads: _Loads, rows, cols, allowed: set, what: str) -> None:
    """Map every input read in a finalise/epilogue expression to a pre-loop
    load of its (rows, cols) tile; refuse wires the program does not hold."""
    for n in walk_until(expr, subst):
        if isinstance(n, ir.TensorRef):
            ws = read_wires(d, n)
            extra = set(ws) - allowed
            if extra:
                raise unsupported(what, f"it reads {n.name} along {', '.join(sorted(extra))}, which a program "
                                  "of this kernel does not hold there", n.loc)
            subst[n] = loads.get(n, rows if rows in ws else None, cols if cols in ws else None, "pre").var
        elif isinstance(n, ir.WireIndex) and n.wire not in allowed:
            raise unsupported(what, f"it uses the index of {n.wire} where the kernel has none", n.loc)
        elif isinstance(n, (ir.Reduce, ir.Normalize)):
            raise unsupported(what, f"{_show(n)} is not part of the kernel's loop", n.loc)


def walk_until(e, subst, skip_root=False):
    """Nodes of e, parents first, not descending into nodes named in subst."""
    if e in subst and not skip_root:
        return
    yield e
    for c in children(e):
        yield from walk_until(c, subst)


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


def _show(e) -> str:
    """An expression as the user wrote it, for messages."""
    from ..printer import expr_text
    return expr_text(e)
