"""Chunks of the streamed wire (flash-decoding): what a chunked launch adds.

A schedule that writes ``group x by C`` beside ``stream x by B`` (folded by
the parser into one stream tile with ``ir.Tile.chunk = C``) runs, when the
launch has more than one chunk, two kernels instead of one
(templates/attention.py.jinja, napkin/codegen/chunks.py chunk_state, chunk_store,
chunk_merge; emit.merge_loads):

* the main kernel, one program per (row block, batch index, chunk): it loads
  its tiles without x once (so those loads are multiplied by the number of
  chunks), visits only the visited blocks of x inside its chunk (the union over
  chunks is the unchunked kernel's visited set: per-step loads do not change),
  and stores no output but its streaming state: float32, W values per real row
  (one per running max and per accumulator without a value wire, the padded
  block of the value wire per accumulator with one: 2 + pad(d) for softmax
  attention).  Every program stores, a chunk that visits nothing too;
* the merge kernel, one program per (row block, batch index): it loads the
  chunks' states (the same W values per row each), the tiles without x its
  finalise reads (usually none) and, where its finalise uses the rows'
  global index, the packed rows' positions, and stores the outputs as the
  whole kernel would.

The chunk a launch takes is the schedule's, grown to the stream block when a
(tuned) block is longer (the launcher's ``_chunks``); when it covers the whole
wire (|x| <= C) the launcher runs the whole, unchunked kernel, and so does
this model.  The state buffer is reported as the pseudo-tensor ``_part``, the
launcher's name for it (and the kernels' parameter name, under which the byte
counter files it).

The state's layout and the merge's loads are the code generator's (its
attention plan); a diagram the code generator does not chunk (a contraction,
an unfused schedule) is costed whole, with a note.  Analyses never change the
IR: this module only reads the plan.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

from .. import ir
from ..codegen.lower import padded_block
from .model import Access, Kernel, Tiling, kernel_tiling, tile_sym
from .symbolic import Poly

STATE = "_part"        # the launcher's buffer of the chunks' states
STATE_DTYPE = "fp32"


@dataclass(frozen=True)
class Chunks:
    """How the chunked kernel ``kernel`` splits its streamed ``wire``."""

    kernel: int                                   # the model kernel that runs chunked
    wire: str                                     # the streamed wire
    chunk: int                                    # C, as the schedule writes it
    row: str                                      # the state is per row of this wire
    parts: tuple[tuple[str, Optional[str]], ...]  # the state: (variable, value wire or None)
    again: tuple[Access, ...]                     # tiles without the wire the merge loads again
    positions: bool = False                       # whether the merge reads its rows' global positions

    def length(self, block: int) -> int:
        """The chunk a launch at stream block ``block`` takes (grown to the block)."""
        return max(self.chunk, block)

    def count(self, block: int, size: int) -> int:
        """Chunks of a wire of ``size``; 1: the launch runs whole, nothing to merge."""
        length = self.length(block)
        return 1 if size <= length else math.ceil(size / length)

    def width(self, sizes: dict[str, int]) -> int:
        """The state's float32 values per row (a value wire padded as the kernel pads it)."""
        return sum(1 if w is None else padded_block(sizes[w]) for _, w in self.parts)

    def width_poly(self) -> Poly:
        """The same, symbolic: a value wire's padded block is its size (a power of two >= 16)."""
        out = Poly()
        for _, w in self.parts:
            out = out + (Poly.const(1) if w is None else Poly.sym(w))
        return out

    def count_poly(self, wire_sym: Callable[[str], Poly]) -> Poly:
        """Chunks, symbolic: ``x/c_x`` (whole chunks, as the formulas assume whole blocks)."""
        return wire_sym(self.wire) / Poly.sym(f"c_{self.wire}")

    def describe(self) -> str:
        return " + ".join(var.lstrip("_") + (f"[{w}]" if w else "") for var, w in self.parts)


def find(diagram: ir.Diagram, kernels: list[Kernel], tiles: Tiling) -> tuple[Optional[Chunks], Optional[str]]:
    """(the chunking of ``diagram``'s kernels, None) when its schedule chunks a
    streamed wire the code generator chunks; (None, why not) when it writes a
    chunk the kernels do not take; (None, None) with no chunk."""
    chunk = _chunk(diagram)
    if chunk is None:
        return None, None
    wire = chunk[0]
    unmodelled = f"the schedule's chunks of {wire} are not modelled, the launch is costed whole: "
    plan = attention_plan(diagram)
    if plan is None or plan.col != wire:
        return None, unmodelled + "the code generator chunks only a fused attention kernel"
    from ..codegen import chunks, emit, lower

    # the chunk the kernels take: the kernel level's stream tile's, which is smem's when smem
    # tiles anything (tiling.chip_levels), so the one _chunk read
    length = lower.chunk_of(plan.diagram)
    assert length == chunk[1], (length, chunk)

    found = [k for k in kernels if k.skips and (kernel_tiling(k, tiles)[1] or ("",))[0] == wire]
    if len(found) != 1:
        return None, unmodelled + "no single kernel streams it"
    (k,) = found
    parts, _ = chunks.chunk_state(plan, None, lambda w: w)
    again = []
    for ld in emit.merge_loads(plan):
        acc = next((a for a in k.accesses if a.kind == "load" and a.tensor == ld.tensor and a.wires == ld.wires),
                   None) or next((a for a in k.accesses if a.kind == "load" and a.tensor == ld.tensor), None)
        if acc is not None and acc not in again:
            again.append(acc)
    # the merge reads its rows' positions (packed rows, distributed calls) only where its
    # finalise uses the rows' global index: the code generator's own answer
    positions = emit.attention_context(plan)["merge_rows"][0]
    return Chunks(k.index, wire, length, plan.row, tuple((v, w) for v, _, w in parts), tuple(again),
                  positions), None


def _chunk(diagram: ir.Diagram) -> Optional[tuple[str, int]]:
    """(wire, C) of the schedule's chunked stream tile at smem, or None."""
    level = diagram.level("smem")
    for t in level.tiles if level is not None else ():
        if t.kind == "stream" and not t.across and t.chunk is not None:
            return t.wire, t.chunk
    return None


def attention_plan(diagram: ir.Diagram):
    """The code generator's attention plan, which lays the state out (and
    packs rows: packing.py); for a diagram it refuses for its dtypes alone
    (fp8), the plan of the same diagram in fp16 (the state is float32
    whatever the inputs, and the launch is the same)."""
    from .masked import attention_plan as _plan

    plan = _plan(diagram)
    if plan is None:
        from .cli import recast
        plan = _plan(recast(diagram, "fp16"))
    return plan


# --------------------------------------------------------------------------
# Counting.
# --------------------------------------------------------------------------

def state_access(kind: str, kernel: Kernel, tiles: Tiling) -> Access:
    """The state buffer, as a tensor along the kernel's grid wires (one state a row)."""
    return Access(STATE, tuple(kernel_tiling(kernel, tiles)[0]), kind, STATE_DTYPE)


def state_elements(ch: Chunks, kernel: Kernel, tiles: Tiling, sizes: dict[str, int], chunks: int) -> int:
    """Values the main kernel stores (and the merge loads): W per real row, per
    batch program and chunk, as the launcher allocates the buffer."""
    groups, _ = kernel_tiling(kernel, tiles)
    if chunks <= 1:
        return 0
    programs = math.prod(math.ceil(sizes[w] / b) for w, b in groups.items() if w != ch.row)
    return chunks * programs * sizes[ch.row] * ch.width(sizes)


def state_poly(ch: Chunks, kernel: Kernel, tiles: Tiling, wire_sym: Callable[[str], Poly]) -> Poly:
    groups, _ = kernel_tiling(kernel, tiles)
    poly = ch.count_poly(wire_sym) * wire_sym(ch.row) * ch.width_poly()
    for w, b in groups.items():
        if w != ch.row:
            poly = poly * wire_sym(w) / tile_sym(tiles, w, b)
    return poly


def launch_count(ch: Optional[Chunks], kernel: Kernel, tiles: Tiling, sizes: dict[str, int]) -> int:
    """Chunks ``kernel`` runs in at ``sizes`` (1 for every other kernel, or a whole launch)."""
    if ch is None or kernel.index != ch.kernel:
        return 1
    _, stream = kernel_tiling(kernel, tiles)
    return ch.count(stream[1], sizes[ch.wire])
