"""Packed rows: a batch wire packed into the row block (grouped-query decoding).

``group g by 4`` beside ``group q by 4`` at smem, where every tensor along
either holds g right before q (napkin/codegen/lower.py ``packed_wire``, the
plan's ``pack``), gives each program a block of 16 (g, q) pairs: the 4 query
heads of a key/value head with 4 queries each, so K and V (without g) are
read once a program for all of them.  What the launcher runs
(templates/attention.py.jinja ``_pack``) is the unpacked kernel on a
re-viewed problem, and this module is that view, for the cost pass (and
for the tuner, which counts a packed launch's programs by ``Packing.sizes``):

* sizes: g of size 1, q of |g||q| rows (the (g, q) pairs, g-major), every
  other wire as it is;
* the row block B: the plan's (group(g) * group(q), at least 16), which is
  the launcher's default ``block_q``: it blocks the packed rows.  The grid
  is ceil(|g||q| / B) x (the other batch wires) (x the chunks);
* positions: packed row r sits at r % |q| and the mask's |q| is the real one
  (the launcher's ``lengths``), so every row is masked as its own query.
  With rows at positions the kernel visits, for a block, the key range of
  its least and greatest real position (napkin/codegen/bounds.py
  loop_bounds: visits.stream_range over [least, greatest + 1)); full blocks
  load what partial ones load, so only the range matters to the bytes;
* the positions themselves are loaded: each program of the main kernel
  reads its block's, 8 bytes a row (``positions``, pseudo-tensor
  ``_pos_q``), and each of the merge where its finalise uses the rows'
  global index (chunks.Chunks.positions);
* with |g| = 1 nothing is packed (no positions): the ordinary launch at
  block B on q, which this view counts the same (r % |q| = r) but for the
  positions it does not load.

The backward is not packed: its kernels run g as a batch wire (one program
per index) at the row block B, which napkin/cost/backward.py reads from the
code generator's backward plan as it is.

The formulas stay the dense ones: a block of packed rows is ``g_g*g_q``
rows (the schedule's groups, model.tile_sym), so K's ``b*d*g*hk*q*x/(g_g*g_q)``
is the packed launch's count when blocks are whole, as a dense formula
assumes; only the numbers need this view.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Mapping, Optional

from .. import ir
from .model import MAX_ROW_BLOCKS, Access, Kernel, Tiling, step_span, too_many

POSITION_DTYPE = "int64"   # the launcher's positions (torch.arange(|q|).repeat(|g|))


@dataclass(frozen=True)
class Packing:
    """How a launch packs ``wire`` into the rows of ``row``."""

    wire: str                 # the batch wire packed into the rows (g)
    row: str                  # the row wire (q)
    block: int                # B: packed rows a program holds (the launcher's block_q)
    groups: tuple[int, int]   # the schedule's groups of wire and row (the formulas' g_g, g_q)

    def sizes(self, sizes: Mapping[str, int]) -> dict[str, int]:
        """The sizes the kernels see: the packed wire 1, the rows |g||q|."""
        return {**sizes, self.wire: 1, self.row: sizes[self.wire] * sizes[self.row]}

    def tiling(self, tiles: Tiling) -> Tiling:
        """The launch's blocks: the packed wire by 1, the rows by B."""
        groups = dict(tiles.groups)
        groups.update({self.wire: 1, self.row: self.block})
        return dataclasses.replace(tiles, groups=tuple(groups.items()),
                                   packed=(self.wire, self.row, *self.groups))

    def spans(self, bounds, sizes: Mapping[str, int], col: str, block_col: int) -> tuple[tuple[int, int], ...]:
        """Per block of packed rows, the [first, stop) steps along ``col``
        the kernel visits (``sizes``: the real ones, which the mask reads).
        A block holding a whole cycle of q, or the end of one head's rows
        and the start of the next, holds positions 0 and |q| - 1: the range
        of the whole wire; any other block is a run of one head's q."""
        n = sizes[self.row]
        rows = sizes[self.wire] * n
        too_many(math.ceil(rows / self.block), MAX_ROW_BLOCKS, "a masked loop's blocks of packed rows")
        out = []
        for i in range(math.ceil(rows / self.block)):
            r0, r1 = i * self.block, min((i + 1) * self.block, rows)
            least, greatest = (0, n - 1) if r1 - r0 >= n or r0 // n != (r1 - 1) // n else (r0 % n, (r1 - 1) % n)
            out.append(step_span(bounds, least, greatest + 1, sizes[col], block_col, sizes))
        return tuple(out)

    def packs(self, sizes: Mapping[str, int]) -> bool:
        """Whether a launch at ``sizes`` (the real ones) packs: |g| > 1."""
        return sizes[self.wire] > 1

    def positions(self) -> Access:
        """The packed rows' positions, as a load: the launcher's int64 tensor
        of one position per (g, q) pair, which every program of the kernel
        (and of the merge, where it reads them) loads for its block of rows.  Named as the
        kernels' parameter ``_pos_q``, under which the byte counter files it."""
        return Access(f"_pos_{self.row}", (self.wire, self.row), "load", POSITION_DTYPE)

    def with_positions(self, kernel: Kernel) -> Kernel:
        """``kernel`` (the model's, a new record) loading the positions too,
        after its tensors' loads: a tile without the streamed wire, like Q."""
        loads = tuple(a for a in kernel.accesses if a.kind == "load")
        stores = tuple(a for a in kernel.accesses if a.kind != "load")
        return dataclasses.replace(kernel, accesses=loads + (self.positions(),) + stores)


def find(diagram: ir.Diagram) -> Optional[Packing]:
    """The packing of ``diagram``'s forward launch, or None (no plan, or no
    wire packed).  Analyses never change the IR: this reads the plan."""
    from .chunks import attention_plan

    if diagram.schedule is None:
        return None
    return of_plan(attention_plan(diagram))


def of_plan(plan) -> Optional[Packing]:
    """The packing of a forward attention plan (codegen's lower.AttentionPlan),
    or None (no plan, or no wire packed).  For a caller that holds the plan
    already: the tuner (napkin/autotune.py) sizes its packed programs by it."""
    if plan is None or plan.pack is None:
        return None
    from ..codegen.lower import _group_block   # the row wire's tile, as the plan reads it

    wire, group = plan.pack
    block = dict(plan.blocks)[plan.row]
    tile = _group_block(plan.diagram, plan.row)
    return Packing(wire, plan.row, block, (group, tile.size if tile is not None else block // group))


def schedule_blocks(diagram: ir.Diagram, options: Mapping[str, int]) -> dict[str, int]:
    """The blocks to give ``with_blocks`` for a launch at the launcher's
    block options ``options`` ({wire: block}, as block_<wire>=): as they are,
    except that with packed rows block_<row> is the packed block, so the row
    wire's group is it over the packed wire's group."""
    p = find(diagram)
    if p is None or p.row not in options:
        return dict(options)
    return {**options, p.row: max(1, options[p.row] // p.groups[0])}
