"""What a data mask's ranges prepass moves, as the cost pass counts it.

A kernel whose mask reads data (doc[b, q] == doc, a block-sparse keep) or is
an ``or`` of bounds no loop formula covers runs the ranges prepass at each
launch (napkin/codegen/ranges.py, templates/ranges.py.jinja), and then reads
its record.  This module counts that traffic, at the launching kernel's
blocks, so the report's bytes are every byte the launch moves:

* the scan: one program per (mask batch index, block of the outer wire,
  chunk of ``_per`` blocks of the inner wire), visiting every tile of its
  chunk.  It loads the mask's inputs as the main kernel's step does (the
  model's count of a dense kernel with the scan's grid, ``Launch.kernel``)
  and stores one int8 state a tile (``_tiles``) and each chunk's [lo, hi),
  two int32 (``_parts``);
* the merge: one program per (mask batch index, block), loading its
  chunks' [lo, hi) and storing the joined one (``_ranges``, two int32);
* the lists, in torch (``_ranges_listed``): at least a read of the states
  for each of the two lists and the record's write, 2 S + 4 int32 a block
  (4 S + 6 for a chunked launch: the lists' prefix counts besides)
  (S the inner wire's blocks).  Torch's cumsum and sort make more passes
  than these, so this part is a floor; the byte counter, which sees Triton's
  loads and stores alone, does not count it;
* the main kernel's reads of the record: four int32 a program ([lo, hi)
  and the two lists' counts; six for a chunked launch's: [lo, hi) and where
  its chunk's part of each list starts and stops) and one a visited block
  (its list entry; dK/dV's flat loop over (row block, group) pairs reads it
  once a pair).

Only the mask batch wires the predicate reads index the prepass
(ranges.batch_wires): ``doc[b, .]`` scans once per b, whatever the heads.
The symbolic formulas write whole blocks, as the others do, and ``p_x``
for the blocks of x a scan program takes (about their square root).
It reads the IR and returns values, never changing the diagram.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

from .. import ir
from .model import (Access, Kernel, Tiling, access_poly, block_sym, count_access, dram_fractions, kernel_tiling,
                    tile_sym)
from .symbolic import Poly

# The buffers, as the launcher names them (the byte counter files each under its parameter's name).
TILES, PARTS, RANGES = "_tiles", "_parts", "_ranges"
# int32 each program of the main kernel loads from its record before its loops: [lo, hi) and the two
# lists' counts (ranges.bounds_lines, ranges.list_loop); a chunked launch's: [lo, hi) and its
# chunk's pos[first], pos[stop] in each list's prefix counts
RECORD_HEAD, CUT_RECORD_HEAD = 4, 6
STEPS = ("scan", "merge", "lists")
# the tile states' dtype: a launcher's buffer, not a dtype a diagram may declare (ir.DTYPE_BYTES)
STATE_DTYPE = "int8"


def record_width(steps, cut: bool):
    """int32 a block's record holds, for ``steps`` blocks of the other wire (an int or a Poly): [lo, hi),
    two counts, two lists; with ``cut`` (a chunked launch) the lists' prefix counts, S + 1 each, too."""
    return steps * 4 + 6 if cut else steps * 2 + 4


def record_head(cut: bool) -> int:
    """int32 each program of the main kernel reads of its record before its loops."""
    return CUT_RECORD_HEAD if cut else RECORD_HEAD


def element_bytes(dtype: str) -> int:
    """Bytes an element of ``dtype`` takes: a diagram's dtypes' and the prepass's tile states'."""
    return 1 if dtype == STATE_DTYPE else ir.DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class Launch:
    """One prepass launch: the scan's grid and what it loads.  ``outer``
    (wire, block): the blocks it runs a record for (the row wire; the
    streamed wire for dK/dV's scan by column); ``inner``: the wire it scans."""

    batch: tuple[str, ...]          # the mask batch wires (the scan's grid axis 1)
    outer: tuple[str, int]
    inner: tuple[str, int]
    loads: tuple[Access, ...]       # the mask's inputs (and packed rows' positions), as the main kernel reads them
    tiles: Tiling                   # the scan's blocks: batch wires by 1, the outer wire's, the inner one streamed
    row: str = ""                   # the plan's row and key wires (by_col: the outer wire is the key wire)
    col: str = ""
    by_col: bool = False
    # a mask of indices alone: the launchers keep its record across calls (the module's own dict),
    # so a launch after the first runs no prepass and only the record's reads are counted
    kept: bool = False
    # the chunk the main kernel's launch cuts the inner wire into (0: none); a launch of more than
    # one chunk asks for the lists' prefix counts
    chunk: int = 0

    def kernel(self) -> Kernel:
        """The scan, as the model's dense kernel over its own grid."""
        wires = (*self.batch, *(w for w, _ in (self.outer, self.inner)),
                 *(w for a in self.loads for w in a.wires))
        return Kernel(-1, (), (), self.loads, tuple(dict.fromkeys(wires)), two_pass=False, skips=False)


def forward_launch(plan, kernel: Kernel, tiles: Tiling, cached: bool = False, chunk: int = 0) -> Launch:
    """The prepass a launch of ``kernel`` (the main kernel, its tiling
    ``tiles``) runs: by row at its blocks, loading the mask's inputs as the
    kernel reads them (packed rows' positions too: the scan reads each row's q).
    ``cached``: the launch is given a warm mask_cache, so its record is kept;
    ``chunk``: the kernel's chunk of the streamed wire (0: none)."""
    from ..codegen.ranges import batch_wires

    groups, stream = kernel_tiling(kernel, tiles)
    row = (plan.row, groups[plan.row])
    read = {n.name for n in ir.walk(plan.skip) if isinstance(n, ir.TensorRef)} | {f"_pos_{plan.row}"}
    loads = tuple(a for a in kernel.accesses if a.kind == "load" and a.tensor in read)
    # the batch wires by 1 (packed rows' too), which the scan's kernel narrows to those it reads
    at = {w: b for w, b in tiles.groups if b == 1 and w != plan.row}
    at[plan.row] = row[1]
    return Launch(batch_wires(plan), row, stream, loads, Tiling(tiles.level, tuple(at.items()), stream, tiles.packed),
                  plan.row, plan.col, False, cached or _kept(plan), chunk)


def backward_launch(plan, br: int, bc: int, by_col: bool, cached: bool = False) -> Launch:
    """The prepass a backward kernel at blocks ``br`` x ``bc`` runs (dQ's by
    row, dK/dV's ``by_col``), loading the mask's inputs as the diagram reads them;
    ``cached`` as forward_launch's."""
    from ..codegen.ranges import batch_wires
    from ..tiling import tensor_dtype
    from .model import ref_wires

    d = plan.diagram
    refs = [n for n in ir.walk(plan.skip) if isinstance(n, ir.TensorRef)]
    loads = tuple(dict.fromkeys(Access(r.name, ref_wires(d, r), "load", tensor_dtype(d, r.name), r.steps or ())
                                for r in refs))
    row, col = (plan.row, br), (plan.col, bc)
    outer, inner = (col, row) if by_col else (row, col)
    batch = batch_wires(plan)
    groups = {**{w: 1 for w in batch}, outer[0]: outer[1]}
    return Launch(batch, outer, inner, loads, Tiling("smem", tuple(groups.items()), inner), plan.row, plan.col,
                  by_col, cached or _kept(plan))


def _kept(plan) -> bool:
    from ..codegen.ranges import mask_tensors
    return not mask_tensors(plan)


def per_chunk(steps: int) -> int:
    """Blocks a scan program takes: the launcher's default (``_per``)."""
    return max(4, math.isqrt(max(steps - 1, 0)) + 1)


@dataclass(frozen=True)
class Counts:
    """A launch's numbers at given sizes: programs of the scan, blocks, steps, chunks."""

    batch: int      # mask batch indices
    blocks: int     # blocks of the outer wire
    steps: int      # blocks of the inner wire (S)
    chunks: int
    cut: bool = False   # the main kernel's launch runs in chunks: its record holds prefix counts

    @property
    def record(self) -> int:
        """The record's int32."""
        return self.batch * self.blocks * record_width(self.steps, self.cut)

    @property
    def tiles(self) -> int:
        return self.batch * self.blocks * self.steps


def counts(launch: Launch, sizes: dict[str, int]) -> Counts:
    (ow, ob), (iw, ib) = launch.outer, launch.inner
    steps = -(-sizes[iw] // ib)
    # as the launcher's _chunks: a wire no longer than one chunk runs whole
    return Counts(math.prod(sizes[w] for w in launch.batch), -(-sizes[ow] // ob), steps,
                  -(-steps // per_chunk(steps)), 0 < launch.chunk < sizes[iw])


@dataclass(frozen=True)
class Row:
    """One prepass transfer: ``step`` (scan, merge, lists, or "main": the
    main kernel's record reads), the access, its symbolic elements, its
    elements per launch, and the buffer's own elements (None for the mask's
    inputs, whose size is the tensor's)."""

    step: str
    access: Access
    poly: Poly
    elements: tuple[int, ...]
    size: Optional[int] = None


def rows(launch: Launch, launches: list[dict[str, int]], wire_sym: Callable[[str], Poly]) -> list[Row]:
    """The prepass's transfers over ``launches`` (one size table each), in
    its steps' order: the scan's loads and stores, the merge's, the lists';
    none for a kept record."""
    if launch.kept:
        return []
    scan, at = launch.kernel(), launch.tiles
    iw = launch.inner[0]
    n = [counts(launch, s) for s in launches]
    mb, blocks, steps = _symbols(launch, wire_sym)
    chunks = steps / Poly.sym(f"p_{iw}")

    def scan_load(a: Access) -> Row:
        # The scan loads each side's tiles with its block: the keys' (a load along the key wire alone)
        # with a key block, the rest (the rows', a batch-only p[b] too) with a row block, tiles each step.
        # A load of the outer block's side is loaded once a chunk's program; one of the inner side
        # that lacks the inner wire (p[b] scanned by column) each step, as the model counts it once.
        side = "tile" if {launch.row, launch.col} <= set(a.wires) else "col" if launch.col in a.wires else "row"
        once = side == ("col" if launch.by_col else "row")
        times, each = (chunks, lambda c: c.chunks) if once else \
            (steps, lambda c: c.steps) if iw not in a.wires else (Poly.const(1), lambda c: 1)
        return Row("scan", a, access_poly(a, scan, at, wire_sym) * times,
                   tuple(count_access(a, scan, at, s) * each(c) for s, c in zip(launches, n)))

    def buf(step: str, name: str, kind: str, poly: Poly, each, size, times: int = 1) -> Row:
        dtype = STATE_DTYPE if name == TILES else "int32"
        return Row(step, Access(name, (*launch.batch, *(w for w, _ in (launch.outer, launch.inner))), kind, dtype),
                   poly * times, tuple(each(c) * times for c in n), size(n[0]) if n else None)
    tiles, parts = (lambda c: c.tiles), (lambda c: c.batch * c.blocks * c.chunks * 2)
    joined, record = (lambda c: c.batch * c.blocks * 2), (lambda c: c.record)
    return [scan_load(a) for a in launch.loads] + [
        buf("scan", TILES, "store", mb * blocks * steps, tiles, tiles),
        buf("scan", PARTS, "store", mb * blocks * chunks * 2, parts, parts),
        buf("merge", PARTS, "load", mb * blocks * chunks * 2, parts, parts),
        buf("merge", RANGES, "store", mb * blocks * 2, joined, joined),
        buf("lists", TILES, "load", mb * blocks * steps, tiles, tiles, times=2),   # one read a list
        buf("lists", RANGES, "store", mb * blocks * record_width(steps, launch.chunk > 0), record, record)]


def _symbols(launch: Launch, wire_sym: Callable[[str], Poly]) -> tuple[Poly, Poly, Poly]:
    """(mask batch indices, blocks of the outer wire, of the inner), symbolic."""
    (ow, ob), (iw, ib) = launch.outer, launch.inner
    mb = Poly.const(1)
    for w in launch.batch:
        mb = mb * wire_sym(w)
    packed = launch.tiles.packed
    if packed is not None and ow == packed[1]:   # blocks of (g, q) pairs: |g||q| / (g_g g_q), as tile_sym writes it
        blocks = wire_sym(packed[0]) * wire_sym(ow) / tile_sym(launch.tiles, ow, ob)
    else:
        blocks = wire_sym(ow) / block_sym(ow, ob, launch.tiles.level)
    return mb, blocks, wire_sym(iw) / (Poly.sym(f"s_{iw}") if ib > 1 else Poly.const(1))


def reach(launch: Launch, sizes: dict[str, int], wave: int, l2_bytes: float) -> dict[Access, float]:
    """The fraction of each scan load's issued bytes that reaches DRAM (model.dram_fractions on
    the scan's grid: the programs of a wave share a row of doc); the buffers' every byte does."""
    return dram_fractions(launch.kernel(), launch.tiles, sizes, wave, l2_bytes)[0]


def record_reads(launch: Launch, main_poly: Poly, main_elements: list[int],
                 sizes: Optional[dict[str, int]] = None) -> Row:
    """The forward kernel's loads of the record, ``main_elements`` int32 a
    launch (analysis._main_reads: record_head a program and an entry a
    visited block; backward.py counts
    dK/dV's, whose flat loop reads the entry once a (row block, group)
    pair).  ``main_poly``: the same, symbolic (every block visited);
    ``sizes``, the first launch's, give the record's size."""
    c = counts(launch, sizes) if sizes is not None else None
    return Row("main", Access(RANGES, (*launch.batch, *(w for w, _ in (launch.outer, launch.inner))), "load", "int32"),
               main_poly, tuple(main_elements), c.record if c is not None else None)


def applies(diagram: ir.Diagram, kernel: Kernel) -> Optional[object]:
    """The attention plan when ``kernel``'s launch runs the ranges prepass
    (a single-device kernel whose plan needs one), else None."""
    from ..codegen import ranges
    from .devices import mesh_tiles
    from .masked import attention_plan

    plan = attention_plan(diagram)
    if plan is None or mesh_tiles(diagram) or not ranges.applies(plan) or not kernel.skips:
        return None
    return plan if {plan.row, plan.col} <= set(kernel.wires) else None


def step_text(step: str, of: int) -> str:
    """The report's words for a prepass kernel."""
    what = {"scan": "scan: each tile's state", "merge": "merge: each block's [lo, hi)",
            "lists": "lists, in torch: a floor of its traffic"}[step]
    return f"ranges prepass of kernel {of}, {what}"

