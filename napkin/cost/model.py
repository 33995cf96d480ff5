"""The kernel model: which kernels a schedule runs, what each moves, what it computes.

This is the part of the cost pass that must agree with the code generator
byte for byte (tests/test_bytecount.py checks it against counted bytes).

Kernels.  A box whose result lives in hbm (an output, or an intermediate the
schedule holds in hbm) is *materialised*: written out, read back by whoever
uses it.  Every other box is fused into the kernel of the materialised boxes
that use it.  Materialised boxes sharing a fused box share a kernel (O and
lse both read S and P in FlashAttention: one kernel).  An unfused schedule
(S and P held in hbm) therefore runs several kernels, each costed alone.

Loads and stores, per kernel.  One program per block of the wires grouped at
the tiling level; the streamed wire, if the kernel has it, is walked in
chunks (steps).  A program loads every tensor tile that lacks the streamed
wire once before the loop, every tile that has it once per visited step, and
stores each output tile once (per step if the output itself has the streamed
wire, as an unfused S does).  A tile is clipped at ragged edges, so the
elements a tensor moves are the sum over visited (program, step) pairs of
its clipped tile extent.  A tensor read through a relabel (doc[b, q]) is a
load of its own.  A kernel that writes a tensor along the streamed wire but
needs a statistic over that wire first (softmax written out) reads its
streamed inputs twice: one pass for the statistics, one to write.

Block skipping.  With an affine mask (causal, sliding window) the kernel
skips the steps whose block is wholly masked; napkin/visits.py says which.
Only kernels that store nothing along the streamed wire may skip.

FLOPs, per box element as written: a contraction sum[k](A * B) costs 2 per
element of its operand grid; every other arithmetic, comparison or
selection 1; exp, log, tanh, sigmoid, sqrt and rsqrt run on the
special-function unit (counted apart: it is a separate ceiling); softmax costs
4 plus one exp per element, logsumexp 3 plus one exp (a logsumexp of the same
scores a softmax in the same kernel already normalises costs only its final
log).  The online softmax's rescaling is not counted.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional

from .. import ir, tiling
from ..errors import NapkinError
from .symbolic import Poly

TRANSCENDENTAL = {"exp": 1, "exp2": 1, "log": 1, "log2": 1, "sqrt": 1, "rsqrt": 1,
                  "tanh": 1, "sigmoid": 1}
_SIGMOID_EXTRA = 2  # sigmoid(x) = 1 / (1 + exp(-x)): one exp and two more ops


# --------------------------------------------------------------------------
# The tiling a kernel runs under.
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class Tiling:
    """Blocks of one on-chip level: grouped wires (grid) and the streamed wire.

    ``packed``: with packed rows (napkin/cost/packing.py) the groups are the
    launch's (the packed wire by 1, the row wire by the packed block), and
    this names (packed wire, row wire, their groups in the schedule), so the
    formulas write the packed block as the schedule does: g_g*g_q."""

    level: str
    groups: tuple[tuple[str, int], ...] = ()
    stream: Optional[tuple[str, int]] = None
    packed: Optional[tuple[str, str, int, int]] = None


# the tiled levels below hbm, outermost first: the rule codegen's kernel level shares (tiling.py)
chip_levels = tiling.chip_levels


def tiling_at(diagram: ir.Diagram, level_name: str) -> Tiling:
    """The effective blocks at an on-chip level: for each wire, the innermost
    on-chip level down to this one that tiles it decides (a regs level's
    smaller blocks refine smem's)."""
    groups: dict[str, int] = {}
    stream = None
    for name in chip_levels(diagram):
        for t in diagram.level(name).tiles:
            if t.across:
                continue
            if t.kind == "group":
                groups[t.wire] = t.size
                if stream and stream[0] == t.wire:
                    stream = None
            else:
                stream = (t.wire, t.size)
                groups.pop(t.wire, None)
        if name == level_name:
            break
    return Tiling(level_name, tuple(groups.items()), stream)


def device_tiles(diagram: ir.Diagram) -> tuple[ir.Tile, ...]:
    level = diagram.level("devices")
    return tuple(t for t in level.tiles if t.across) if level else ()


# --------------------------------------------------------------------------
# Kernels.
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class Access:
    """One tensor moved by a kernel: read along ``wires`` (a relabel reads
    other wires than the declared ones) or written."""

    tensor: str
    wires: tuple[str, ...]
    kind: str          # "load" or "store"
    dtype: str
    # a coarse read's step per wire (keep[.., q // 64, ..]: ir.TensorRef.steps), () for none: a
    # tile loads the distinct blocks its rows meet (coarse_cells), its lanes' repeats coalescing
    steps: tuple[int, ...] = ()

    def step(self, wire: str) -> int:
        return self.steps[self.wires.index(wire)] if self.steps else 1


@dataclass(frozen=True)
class Kernel:
    index: int
    boxes: tuple[str, ...]       # every box computed, in declaration order
    stores: tuple[str, ...]      # the materialised ones
    accesses: tuple[Access, ...]  # loads then stores
    wires: tuple[str, ...]       # every wire the kernel's boxes touch
    two_pass: bool               # streamed inputs read twice (see module doc)
    skips: bool                  # may skip masked blocks
    # the other wires of a sum over the streamed one (sum[b, m](X * dY) streaming m: b), which a
    # program walks index by index around its stream (tiling.looped_wires): a step holds one
    # index of each
    looped: tuple[str, ...] = ()
    # a contraction kernel's row and column wires (codegen's grid axes 0 and 1: the free wire of
    # the product's first factor, then of its second), whose blocks its programs take in groups
    # (tiling.grouped_program); () for any other kernel, whose grid axes launch_order gives
    grouped: tuple[str, ...] = ()


def is_materialised(diagram: ir.Diagram, name: str) -> bool:
    return tiling.home_level(diagram, name) in ("devices", "hbm")


def refs(expr: ir.Expr) -> list[ir.TensorRef]:
    return [n for n in ir.walk(expr) if isinstance(n, ir.TensorRef)]


def ref_wires(diagram: ir.Diagram, ref: ir.TensorRef) -> tuple[str, ...]:
    return ref.wires if ref.wires is not None else ir.axis_wires(diagram.tensor(ref.name).axes)


def kernels(diagram: ir.Diagram) -> list[Kernel]:
    """The kernels a schedule runs, in order of their first box."""
    lets = {let.name: let for let in diagram.lets}
    order = [let.name for let in diagram.lets]
    mat = [n for n in order if is_materialised(diagram, n)]

    def fused_closure(name: str) -> set[str]:
        seen, todo = {name}, [name]
        while todo:
            for r in refs(lets[todo.pop()].expr):
                if r.name in lets and r.name not in seen and not is_materialised(diagram, r.name):
                    seen.add(r.name)
                    todo.append(r.name)
        return seen

    # Union materialised boxes whose fused closures share a box.
    groups: list[tuple[set[str], set[str]]] = []  # (materialised, all boxes)
    for name in mat:
        closure = fused_closure(name)
        merged_mat, merged_all = {name}, set(closure)
        rest = []
        for g_mat, g_all in groups:
            if (g_all - g_mat) & (closure - {name}):
                merged_mat |= g_mat
                merged_all |= g_all
            else:
                rest.append((g_mat, g_all))
        groups = rest + [(merged_mat, merged_all)]
    groups.sort(key=lambda g: min(order.index(n) for n in g[1]))

    out = []
    for index, (g_mat, g_all) in enumerate(groups):
        boxes = tuple(n for n in order if n in g_all)
        loads: dict[tuple, Access] = {}
        wires: set[str] = set()
        for n in boxes:
            let = lets[n]
            wires |= set(ir.axis_wires(let.axes)) | tiling.reduced_wires(let.expr)
            for r in refs(let.expr):
                if r.name in g_all:
                    continue
                w = ref_wires(diagram, r)
                wires |= set(w)
                loads.setdefault((r.name, w, r.steps), Access(r.name, w, "load", tiling.tensor_dtype(diagram, r.name),
                                                               r.steps or ()))
        stores = tuple(n for n in boxes if n in g_mat)
        accesses = tuple(loads.values()) + tuple(
            Access(n, ir.axis_wires(lets[n].axes), "store", tiling.tensor_dtype(diagram, n)) for n in stores)
        ordered = tuple(w.name for w in diagram.wires if w.name in wires)
        out.append(_finish(diagram, index, boxes, stores, accesses, ordered))
    return out


def _finish(diagram, index, boxes, stores, accesses, wires) -> Kernel:
    levels = chip_levels(diagram)
    tiles = tiling_at(diagram, levels[0]) if levels else None
    stream = tiles.stream if tiles else None
    s = stream[0] if stream and stream[0] in wires else None
    stores_along = s is not None and any(s in a.wires for a in accesses if a.kind == "store")
    needs_stat = s is not None and any(
        (isinstance(node, ir.Reduce) and s in node.wires) or (isinstance(node, ir.Normalize) and node.wire == s)
        for n in boxes for node in ir.walk(diagram.tensor(n).expr))
    looped = tiling.looped_wires(diagram, levels[0], boxes) if s is not None else set()
    return Kernel(index, boxes, stores, accesses, wires,
                  two_pass=stores_along and needs_stat, skips=s is not None and not stores_along,
                  looped=tuple(w for w in wires if w in looped),
                  grouped=_grouped_axes(diagram, boxes, tiles, s) if s else ())


def _grouped_axes(diagram, boxes, tiles: Tiling, s: str) -> tuple[str, ...]:
    """(row, column) of a contraction kernel: a sum over the streamed wire of two
    factors, each with one blocked grid wire the other lacks (the first factor's
    is grid axis 0, as lower._contraction's row); () otherwise.  Attention kernels
    block one wire (their rows), so this picks out the contraction family."""
    blocked = {w for w, b in tiles.groups if b > 1}
    if len(blocked) != 2:
        return ()
    for n in boxes:
        for node in ir.walk(diagram.tensor(n).expr):
            factors = contraction_factors(node, diagram) if isinstance(node, ir.Reduce) and s in node.wires else None
            if factors:
                own = [(node_wires(diagram, a) - node_wires(diagram, b)) & blocked for a, b in (factors, factors[::-1])]
                if all(len(o) == 1 for o in own):
                    return (*own[0], *own[1])
    return ()


# --------------------------------------------------------------------------
# Counting what a kernel moves.
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class Visited:
    """The steps a masked kernel visits: for row block i of the grouped wire
    ``row`` the mask reads (with packed rows, block i of the launch's (g, q)
    pairs: packing.py), the steps ``spans[i] = (first, stop)`` along the
    streamed wire (a contiguous range, as the kernel's loop runs), less
    ``holes[i]``, the runs (g0, g1) of dead steps inside it, in order, that
    the loop's list leaves out (the ranges prepass's, ranges.py; () or no
    holes at all: none)."""

    row: str
    spans: tuple[tuple[int, int], ...]
    holes: tuple[tuple[tuple[int, int], ...], ...] = ()
    # per row block, the runs of its visited steps known full (the prepass's full list), in order;
    # () where none is known: a data mask's full step reads none of what only the mask reads
    full: tuple[tuple[tuple[int, int], ...], ...] = ()

    def partial(self) -> "Visited":
        """The steps that run the masked step: these less the full runs."""
        if not self.full:
            return self
        holes = []
        for i in range(len(self.spans)):
            runs = []
            for a, b in sorted((*(self.holes[i] if self.holes else ()), *self.full[i])):
                if runs and a <= runs[-1][1]:
                    runs[-1] = (runs[-1][0], max(runs[-1][1], b))
                else:
                    runs.append((a, b))
            holes.append(tuple(runs))
        return Visited(self.row, self.spans, tuple(holes))

    def parts(self, i: int) -> tuple[tuple[int, int], ...]:
        """Row block i's visited steps as [first, stop) runs, one more than its holes."""
        out, at = [], self.spans[i][0]
        for g0, g1 in self.holes[i] if self.holes else ():
            out.append((at, g0))
            at = g1
        return (*out, (at, self.spans[i][1]))

    @property
    def pairs(self) -> frozenset:
        """Every visited (row block, step) pair."""
        return frozenset((i, j) for i in range(len(self.spans)) for a, b in self.parts(i) for j in range(a, b))

    @property
    def count(self) -> int:
        return sum(max(0, b - a) for i in range(len(self.spans)) for a, b in self.parts(i))


# The pass walks the programs of a grid one by one (the visited spans of a
# masked loop, the DRAM estimate's wave order): `napkin cost` of the causal
# example at q = x = 2**28 (2**21 row blocks) took 11 s here, so past these
# it stops and says so, rather than hang or run out of memory (a q of 10**12
# asked for eight billion).
MAX_ROW_BLOCKS = 2 ** 22
MAX_PROGRAMS = 2 ** 24


def too_many(count: int, limit: int, what: str) -> None:
    if count > limit:
        raise NapkinError(f"the cost pass walks {what} one by one: {count:,} here, more than the {limit:,} it "
                          "takes; ask for smaller sizes")


def visited_spans(bounds, row_size: int, col_size: int, block_row: int, block_col: int,
                  sizes) -> tuple[tuple[int, int], ...]:
    """Per row block, the [first, stop) steps the kernel's loop visits: the
    range napkin/visits.py's stream_range gives, its start rounded down to a
    block, exactly as visits.visited_blocks enumerates it (a test checks they
    agree), without listing every pair."""
    too_many(-(-row_size // block_row), MAX_ROW_BLOCKS, "a masked loop's row blocks")
    return tuple(step_span(bounds, i * block_row, min((i + 1) * block_row, row_size), col_size, block_col, sizes)
                 for i in range(-(-row_size // block_row)))


def step_span(bounds, row_first: int, row_stop: int, col_size: int, block_col: int, sizes) -> tuple[int, int]:
    """[first, stop) of the steps the loop visits for rows [row_first,
    row_stop) (indices the mask sees: the rows' own, or their positions)."""
    from .. import visits

    start, stop = visits.stream_range(bounds, row_first, row_stop, col_size, sizes)
    first = start // block_col
    return first, max(first, -(-stop // block_col))


def clipped_sum(size: int, block: int, first: int, stop: int) -> int:
    """sum(clip(size, block, j) for j in range(first, stop))."""
    if stop <= first:
        return 0
    return max(0, min(stop * block, size) - first * block)


def clip(size: int, block: int, index: int) -> int:
    """Elements of block ``index`` of a wire of ``size`` cut in ``block``s."""
    return max(0, min(block, size - index * block))


def coarse_cells(size: int, block: int, index: int, step: int) -> int:
    """The distinct ``// step`` indices block ``index`` of a wire meets: what a
    tile of a coarse read (keep[.., q // 64, ..]) loads along it; ``clip`` at step 1."""
    first, end = index * block, min((index + 1) * block, size)
    return 0 if end <= first else (end - 1) // step - first // step + 1


def coarse_sum(size: int, block: int, step: int, first: int, stop: int) -> int:
    """sum(coarse_cells(size, block, j, step) for j in range(first, stop)) without
    the loop: a whole block's cells repeat every step / gcd(block, step) blocks."""
    if step == 1:
        return clipped_sum(size, block, first, stop)
    stop = min(stop, -(-size // block))
    if stop <= first:
        return 0
    period = step // math.gcd(block, step)
    pattern = [coarse_cells(period * block, block, k, step) for k in range(period)]
    prefix = [0]
    for c in pattern:
        prefix.append(prefix[-1] + c)

    def whole(m: int) -> int:   # blocks [0, m), all whole
        return (m // period) * prefix[-1] + prefix[m % period]
    wholes = size // block
    total = whole(max(first, min(stop, wholes))) - whole(min(first, wholes))
    if first <= wholes < stop and size % block:
        total += coarse_cells(size, block, wholes, step)
    return total


def kernel_tiling(kernel: Kernel, tiles: Tiling) -> tuple[dict[str, int], Optional[tuple[str, int]]]:
    """The grid wires and the stream restricted to the kernel's wires."""
    groups = {w: b for w, b in tiles.groups if w in kernel.wires}
    stream = tiles.stream if tiles.stream and tiles.stream[0] in kernel.wires else None
    return groups, stream


def count_access(access: Access, kernel: Kernel, tiles: Tiling, sizes: dict[str, int],
                 visited: Optional[Visited] = None) -> int:
    """Elements ``access`` moves: the sum over visited (program, step) pairs of
    its clipped tile.  Every factor is exact for the given sizes."""
    groups, stream = kernel_tiling(kernel, tiles)
    s = stream[0] if stream else None
    carries_s = s is not None and s in access.wires
    passes = 2 if (kernel.two_pass and carries_s and access.kind == "load") else 1

    def total(w: str, block: int) -> int:   # the elements every block of w loads, summed
        return coarse_sum(sizes[w], block, access.step(w), 0, -(-sizes[w] // block))
    count = 1
    for w in access.wires:
        if w not in groups and w != s:
            count *= -(-sizes[w] // access.step(w))
    row = visited.row if (visited is not None and kernel.skips) else None
    for w, block in groups.items():
        if w == row:
            continue
        count *= total(w, block) if w in access.wires else math.ceil(sizes[w] / block)
    if row is None:
        return count * (total(s, stream[1]) if carries_s else 1) * passes
    rblock = groups[row]
    r_extent = (lambda i: coarse_cells(sizes[row], rblock, i, access.step(row))) if row in access.wires \
        else (lambda i: 1)
    if carries_s:
        chunk, step = stream[1], access.step(s)
        pair_sum = sum(r_extent(i) * coarse_sum(sizes[s], chunk, step, a, b)
                       for i in range(len(visited.spans)) for a, b in visited.parts(i))
    else:
        pair_sum = sum(r_extent(i) for i in range(math.ceil(sizes[row] / rblock)))
    return count * pair_sum * passes


def access_poly(access: Access, kernel: Kernel, tiles: Tiling, wire_sym: Callable[[str], Poly]) -> Poly:
    """The symbolic count (dense, assuming every block is whole): the tile's
    wires times, for each grid wire the tensor lacks, the number of blocks."""
    groups, stream = kernel_tiling(kernel, tiles)
    s = stream[0] if stream else None
    poly = Poly.const(2 if (kernel.two_pass and s in access.wires and access.kind == "load") else 1)
    for w in access.wires:
        poly = poly * wire_sym(w)
        step, block = access.step(w), _coarse_block(access, w, groups, stream, tiles)
        if step != 1:   # a coarse read: a block within one cell loads one cell, a longer one a cell a step
            poly = poly / (block[1] if block is not None and block[0] <= step else Poly.const(step))
    for w, block in groups.items():
        if w not in access.wires:
            poly = poly * wire_sym(w) / tile_sym(tiles, w, block)
    return poly


def tile_sym(tiles: Tiling, wire: str, block: int) -> Poly:
    """The symbol of ``wire``'s block in ``tiles``: block_sym's, except that a
    block of packed rows is the packed wire's group times the row wire's
    (``g_g*g_q``), the rows the schedule gives a program."""
    if tiles.packed is not None and wire == tiles.packed[1]:
        packed, row, packed_group, row_group = tiles.packed
        return block_sym(packed, packed_group, tiles.level) * block_sym(row, row_group, tiles.level)
    return block_sym(wire, block, tiles.level)


def block_sym(wire: str, block: int, level: str = "smem") -> Poly:
    """``g_q`` for a real block (``g_q_regs`` for a regs level's); a block of 1
    (one program per index) is just 1."""
    if block == 1:
        return Poly.const(1)
    return Poly.sym(f"g_{wire}" if level == "smem" else f"g_{wire}_{level}")


def access_fetches_poly(access: Access, kernel: Kernel, tiles: Tiling, wire_sym) -> Poly:
    """How many times each element of the tile is fetched (the re-read factor)."""
    groups, stream = kernel_tiling(kernel, tiles)
    s = stream[0] if stream else None
    poly = Poly.const(2 if (kernel.two_pass and s in access.wires and access.kind == "load") else 1)
    for w, block in groups.items():
        if w not in access.wires:
            poly = poly * wire_sym(w) / tile_sym(tiles, w, block)
    for w in access.wires:   # a coarse read's cell is met by each block within it
        block = _coarse_block(access, w, groups, stream, tiles)
        if block is not None and block[0] < access.step(w):
            poly = poly * Poly.const(access.step(w)) / block[1]
    return poly


def _coarse_block(access: Access, w: str, groups: dict, stream, tiles: Tiling) -> Optional[tuple[int, Poly]]:
    """(block, its symbol) along ``w`` for a coarse read: the grid's block
    (``g_q``), else the stream's (``s_x``); None for a read of the wire
    itself or a wire the kernel holds whole."""
    block = groups.get(w, stream[1] if stream and w == stream[0] else None)
    if access.step(w) == 1 or block is None:
        return None
    return block, tile_sym(tiles, w, block) if w in groups else Poly.sym(f"s_{w}")


def visited_area(visited: Optional[Visited], kernel: Kernel, tiles: Tiling,
                 sizes: dict[str, int]) -> Optional[tuple[str, str, int]]:
    """(row wire, streamed wire, visited row x step area) for a skipping kernel."""
    groups, stream = kernel_tiling(kernel, tiles)
    if visited is None or not kernel.skips or stream is None or visited.row not in groups:
        return None
    row, s = visited.row, stream[0]
    area = sum(clip(sizes[row], groups[row], i) * clipped_sum(sizes[s], stream[1], a, b)
               for i in range(len(visited.spans)) for a, b in visited.parts(i))
    return row, s, area


# --------------------------------------------------------------------------
# FLOPs.
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class Work:
    """Operations as (category, wires, multiplier, dtype) items; category is
    "contraction", "other" or "exp"; dtype the one a contraction's tensor
    core product runs in (tiling.product_dtype), None for the others."""

    items: tuple[tuple[str, frozenset, int, Optional[str]], ...]


def node_wires(diagram: ir.Diagram, e: ir.Expr) -> frozenset:
    if isinstance(e, ir.WireIndex):
        return frozenset([e.wire])
    if isinstance(e, ir.TensorRef):
        return frozenset(ref_wires(diagram, e))
    if isinstance(e, ir.Unary):
        return node_wires(diagram, e.operand)
    if isinstance(e, ir.Binary):
        return node_wires(diagram, e.lhs) | node_wires(diagram, e.rhs)
    if isinstance(e, ir.Call):
        return frozenset().union(*(node_wires(diagram, a) for a in e.args))
    if isinstance(e, ir.Reduce):
        return node_wires(diagram, e.body) - set(e.wires)
    if isinstance(e, ir.Normalize):
        return node_wires(diagram, e.body)
    return frozenset()


def contraction_factors(e: ir.Expr, diagram: ir.Diagram):
    """(A, B) for sum[k](A * B) with both factors varying, else None."""
    if isinstance(e, ir.Reduce) and e.op == "sum" and isinstance(e.body, ir.Binary) and e.body.op == "*":
        if node_wires(diagram, e.body.lhs) and node_wires(diagram, e.body.rhs):
            return e.body.lhs, e.body.rhs
    return None


def kernel_work(diagram: ir.Diagram, kernel: Kernel) -> Work:
    items: list[tuple[str, frozenset, int, Optional[str]]] = []

    def add(*counted: tuple[str, frozenset, int], dtype: Optional[str] = None) -> None:
        items.extend((*c, dtype) for c in counted)
    softmaxed = {(n.wire, n.body) for b in kernel.boxes for n in ir.walk(diagram.tensor(b).expr)
                 if isinstance(n, ir.Normalize)}
    # elementwise subtrees already counted: one written twice in the kernel's
    # expressions (tanh(R / 50) * 25 + tanh(R / 50) * 25) is computed once, as
    # the compiler merges the copies (backward._ops counts the backward so too)
    seen: set = set()
    # reductions already counted, keyed by their body with the kernel's boxes
    # read through: the training forward's saved sum[x](relu(S)^2 * V) is the
    # sum[x](W * V) the output already accumulates, one accumulator in the kernel
    inlined: dict[str, tuple] = {}   # box -> (its expression read through, its own wires)
    for b in kernel.boxes:
        let = diagram.tensor(b)
        inlined[b] = (_read_through(let.expr, inlined), ir.axis_wires(let.axes))
    reduced: set = set()

    def visit(e: ir.Expr) -> None:
        wires = node_wires(diagram, e)
        if isinstance(e, (ir.Num, ir.WireIndex, ir.WireSize, ir.TensorRef)) or \
                (not wires and not isinstance(e, ir.Reduce)):
            return  # leaves, and constants computed once (|d|^-0.5, log(|x|))
        if isinstance(e, (ir.Unary, ir.Binary, ir.Call)):
            if e in seen:
                return
            seen.add(e)
        if isinstance(e, ir.Reduce):
            key = _read_through(e, inlined)
            if key in reduced:
                return
            reduced.add(key)
        factors = contraction_factors(e, diagram)
        if factors:
            add(("contraction", node_wires(diagram, e.body), 2), dtype=tiling.product_dtype(diagram, factors))
            visit(factors[0])
            visit(factors[1])
            return
        if isinstance(e, ir.Reduce):
            body = node_wires(diagram, e.body)
            if e.op == "logsumexp":
                if not (len(e.wires) == 1 and (e.wires[0], e.body) in softmaxed):
                    add(("other", body, 3), ("exp", body, 1))
                add(("exp", wires, 1), ("other", wires, 1))   # log(l) + m
            else:
                add(("other", body, 1))
            visit(e.body)
            return
        if isinstance(e, ir.Normalize):
            add(("other", wires, 4), ("exp", wires, 1))
            visit(e.body)
            return
        if isinstance(e, ir.Call) and e.fn in TRANSCENDENTAL:
            add(("exp", wires, 1))
            if e.fn == "sigmoid":
                add(("other", wires, _SIGMOID_EXTRA))
        else:
            add(("other", wires, 1))
        for child in (e.operand,) if isinstance(e, ir.Unary) else \
                (e.lhs, e.rhs) if isinstance(e, ir.Binary) else e.args:
            visit(child)

    for b in kernel.boxes:
        visit(diagram.tensor(b).expr)
    return Work(tuple(items))


def _read_through(e: ir.Expr, boxes: dict[str, tuple]) -> ir.Expr:
    """e with every read of a box in ``boxes`` along its own wires (W, or W[b, h, q, x]
    written out) replaced by its expression."""
    if isinstance(e, ir.TensorRef) and e.name in boxes and e.wires in (None, boxes[e.name][1]):
        return boxes[e.name][0]
    return ir.map_children(e, lambda child: _read_through(child, boxes))


def work_numbers(work: Work, sizes: dict[str, int], area: Optional[tuple[str, str, int]]) -> dict[str, int]:
    """Operations per category; items over both masked wires count the visited area only."""
    out = {"contraction": 0, "other": 0, "exp": 0}
    for cat, wires, mult, _ in work.items:
        out[cat] += _count(wires, mult, sizes, area)
    return out


def contraction_numbers(work: Work, sizes: dict[str, int], area: Optional[tuple[str, str, int]]) -> dict[str, int]:
    """The contractions' operations per dtype their products run in (each at its own peak rate)."""
    out: Counter = Counter()
    for cat, wires, mult, dtype in work.items:
        if cat == "contraction":
            out[dtype] += _count(wires, mult, sizes, area)
    return out


def _count(wires: frozenset, mult: int, sizes: dict[str, int], area: Optional[tuple[str, str, int]]) -> int:
    n = mult
    if area is not None and area[0] in wires and area[1] in wires:
        n *= area[2]
        wires = wires - {area[0], area[1]}
    for w in wires:
        n *= sizes[w]
    return n


def work_polys(work: Work, wire_sym: Callable[[str], Poly]) -> dict[str, Poly]:
    out = {"contraction": Poly(), "other": Poly(), "exp": Poly()}
    for cat, wires, mult, _ in work.items:
        p = Poly.const(mult)
        for w in sorted(wires):
            p = p * wire_sym(w)
        out[cat] = out[cat] + p
    return out



# --------------------------------------------------------------------------
# What reaches DRAM: re-reads that stay in L2.
#
# The transfers above are what the kernel issues (and what the byte counter
# measures).  DRAM sees less: programs run in waves of one per SM, in launch
# order, and the programs of a wave walk the streamed wire roughly in step,
# so a tile several programs of one wave read comes from DRAM once per wave
# and from L2 after that, as long as one step's shared tiles fit in L2.
# Across waves a tile survives as long as the waves between its two reads
# touch no more than L2 holds: with a wave's whole footprint W (every tile its
# programs read or write, over the whole stream), a tile read again within
# floor(L2 / W) waves is an L2 hit.  (Without that rule, plain attention at
# 16K tokens, whose head's 128 row blocks straddle two waves of 132, came out
# at 1.40x the DRAM bytes Nsight Compute measured on an H100, and at 0.95x
# with it: docs/bench.md, "Measured: H100".)  A loop that skips masked steps
# keeps the rule of one read a wave (causal: 1.01x).  A two-pass kernel's
# second pass is assumed to miss.  This is an estimate, used only for the roofline.
# --------------------------------------------------------------------------

def launch_order(groups: dict[str, int], grouped: tuple[str, ...] = ()) -> list[str]:
    """Grid wires, fastest-varying first, as the kernels launch them: the
    blocked wires (grid axis 0, then 1) in schedule order, a contraction's
    in its (row, column) order (``grouped``: Kernel.grouped), then the batch
    wires (block 1) flattened with the last one fastest."""
    blocked = list(grouped) or [w for w, b in groups.items() if b > 1]
    batch = [w for w, b in groups.items() if b == 1]
    return blocked + batch[::-1]


def shared_loads(kernel: Kernel, tiles: Tiling, chunks: int = 1) -> list[Access]:
    """Loads several programs read: those lacking a grid wire (or, with the
    streamed wire in ``chunks`` > 1 chunks, lacking that wire)."""
    groups, stream = kernel_tiling(kernel, tiles)
    axes = list(groups) + ([stream[0]] if chunks > 1 and stream else [])
    return [a for a in kernel.accesses if a.kind == "load" and any(w not in a.wires for w in axes)]


def dram_fractions(kernel: Kernel, tiles: Tiling, sizes: dict[str, int], wave: int, l2_bytes: float,
                   chunks: int = 1, visited: Optional[Visited] = None) -> tuple[dict[Access, float], int]:
    """For each shared load, the fraction of its issued bytes that reaches
    DRAM; and one step's shared working set of the first wave, in bytes.
    ``chunks`` > 1: the grid's last (slowest) axis is the chunks of the
    streamed wire (napkin/cost/chunks.py), which the loads along that wire
    carry.  ``visited``: the steps a masked loop's row blocks read (else each
    program reads the whole stream)."""
    import numpy as np

    groups, stream = kernel_tiling(kernel, tiles)
    order = launch_order(groups, kernel.grouped)
    counts = [-(-sizes[w] // groups[w]) for w in order]   # whole numbers: a float ceil misstated 10^26 / 128
    carried = list(order)   # the wire that carries each grid axis
    if chunks > 1 and stream:
        order, counts, carried = order + ["#chunks"], counts + [chunks], carried + [stream[0]]
    too_many(math.prod(counts), MAX_PROGRAMS, "the programs of the launch grid")
    linear = np.arange(math.prod(counts), dtype=np.int64)
    index, rest = {}, linear
    for w, n in zip(order, counts):
        index[w], rest = rest % n, rest // n
    if kernel.grouped:   # the contraction's programs in groups of row blocks, as its kernel takes them
        (row, col), (rows, cols) = order[:2], counts[:2]
        index[row], index[col] = tiling.grouped_program(index[row], index[col], rows, cols, tiling.GROUP_ROWS)
    waves = linear // wave
    first = linear < wave
    shared = shared_loads(kernel, tiles, chunks)
    tile_of, step_bytes, wave_bytes = {}, 0, 0
    for acc in kernel.accesses:
        key = np.zeros_like(linear)
        for w, n, wire in zip(order, counts, carried):
            if wire in acc.wires:
                key = key * n + index[w]
        tile_of[acc] = key
        # one program's tile, a step's (shared loads) and the whole stream's (the footprint)
        extent = {w: groups[w] if w in groups else sizes[w] for w in acc.wires}
        extent = {w: n if acc.step(w) == 1 else tiling.coarse_extent(n, acc.step(w)) for w, n in extent.items()}
        width = ir.DTYPE_BYTES[acc.dtype]
        tiles_in_first = np.unique(key[first]).size if acc in shared else int(first.sum())
        wave_bytes += tiles_in_first * math.prod(extent.values()) * width
        if acc in shared:
            per_step = math.prod((stream[1] if acc.step(w) == 1 else tiling.coarse_extent(stream[1], acc.step(w)))
                                 if stream and w == stream[0] else 1 if w in kernel.looped else extent[w]
                                 for w in acc.wires)
            step_bytes += tiles_in_first * per_step * width
    if step_bytes > l2_bytes:
        return {a: 1.0 for a in shared}, step_bytes
    # Each program's steps [lo, hi) along the stream: its row block's span
    # when a masked loop skips steps, else one step standing for all of them
    # (with holes, Visited.parts' runs between them, each wave's hull taken of each k-th run; a row
    # block with fewer runs pads with empty ones at its end)
    unit = lo, hi = np.zeros_like(linear), np.ones_like(linear)
    runs = [unit]
    if visited is not None and chunks == 1 and visited.row in index and visited.spans:
        spans = np.array(visited.spans, dtype=np.int64).reshape(-1, 2)[index[visited.row]]
        lo, hi = spans[:, 0], np.maximum(spans[:, 1], spans[:, 0])
        runs = [(lo, hi)]
        if any(visited.holes):
            parts = [visited.parts(i) for i in range(len(visited.spans))]
            most = max(map(len, parts))
            padded = [list(p) + [(p[-1][1], p[-1][1])] * (most - len(p)) for p in parts]
            cut = np.array(padded, dtype=np.int64).reshape(-1, most, 2)[index[visited.row]]
            runs = [(cut[:, k, 0], np.maximum(cut[:, k, 0], cut[:, k, 1])) for k in range(most)]
    # how many waves back a tile is still in L2 (0: only within its own wave)
    reach_back = int(l2_bytes // wave_bytes) if wave_bytes else 0
    n_waves = int(waves[-1]) + 1
    fractions = {}
    for acc in shared:
        along = stream is not None and stream[0] in acc.wires
        parts = runs if along else [unit]
        issued = sum(int((b - a).sum()) for a, b in parts)
        if not issued:
            fractions[acc] = 0.0
            continue
        fractions[acc] = sum(_fresh_steps(tile_of[acc], waves, n_waves, reach_back, a, b) for a, b in parts) / issued
    return fractions, step_bytes


def _fresh_steps(tile_of, waves, n_waves: int, reach_back: int, a, b) -> int:
    """Steps of each tile the programs reading [a, b) (arrays, one per program)
    fetch from DRAM: per tile and wave the hull of its programs' runs, less
    what a recent wave read of the same tile (still in L2)."""
    import numpy as np

    # the steps each wave reads of each tile: the hull of its programs' spans; an empty
    # span (a program whose loop visits nothing, at whatever step it would start) reads
    # nothing and must not stretch the hull
    pairs, inverse = np.unique(tile_of * n_waves + waves, return_inverse=True)   # by tile, then wave
    never = np.iinfo(np.int64).max
    first_step = np.full(pairs.size, never, dtype=np.int64)
    last_step = np.zeros(pairs.size, dtype=np.int64)
    live = b > a
    np.minimum.at(first_step, inverse, np.where(live, a, never))
    np.maximum.at(last_step, inverse, np.where(live, b, 0))
    read = np.maximum(last_step - first_step, 0)
    # ... less what a wave at most reach_back before read of the same tile (still in L2)
    tile, at = pairs // n_waves, pairs % n_waves
    warm = np.zeros(pairs.size, dtype=bool)
    warm[1:] = (tile[1:] == tile[:-1]) & (at[1:] - at[:-1] <= reach_back)
    overlap = np.zeros(pairs.size, dtype=np.int64)
    overlap[1:] = np.maximum(np.minimum(last_step[1:], last_step[:-1])
                             - np.maximum(first_step[1:], first_step[:-1]), 0)
    fresh = read - np.where(warm, np.minimum(overlap, read), 0)
    return int(fresh.sum())
