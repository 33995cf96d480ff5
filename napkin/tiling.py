"""Tiles and residency: what lives at each memory level under a schedule.

Pure functions from the IR (plus a table of wire sizes) to numbers.  The
checker uses them to reject schedules whose tiles overflow a level; the cost
model uses them for M_l, the data resident at level l.

Vocabulary (see docs/SEMANTICS-DRAFT.md, "Schedule"):

* The *extent* of wire w at level L is how much of w one processor of L sees:
  the block size N if L tiles w ``by N``, ceil(outer extent / N) if L tiles w
  ``across N``, otherwise the extent at the enclosing level.  Above the
  first level the extent is the full size of w.  A block larger than the
  wire is still a whole block (the kernel masks the tail), so it counts at N.
* The *home* of a tensor is the level that holds it (``hold``); otherwise
  inputs and outputs live in hbm and an intermediate is fused into the
  innermost level that has tiles (hbm when no level has any).
* A level is *on chip* when it is smem, or regs with tiles of its own.  Every
  tensor a box reads passes through the on-chip levels below its home, so its
  tile is resident there; so is an accumulator (in the accumulator dtype) for
  each box that reduces the wire streamed at that level.
"""
from __future__ import annotations

import functools
import math
import tomllib
from pathlib import Path
from typing import Optional

from . import ir

# Used when napkin/profiles.toml is absent or lacks an entry: bytes per level.
FALLBACK_CAPACITIES = {
    "h100": {"smem": 232448, "regs": 65536 * 4},
    "h200": {"smem": 232448, "regs": 65536 * 4},
    "a100": {"smem": 166912, "regs": 65536 * 4},
    "cpu": {"smem": 1048576},
}

PROFILES_TOML = Path(__file__).resolve().parent / "profiles.toml"


class UnboundWire(LookupError):
    """A footprint needs the size of a symbolic wire that no level tiles and
    that ``sizes`` does not give.  ``wire`` names it."""

    def __init__(self, wire: str):
        super().__init__(f"the size of wire {wire!r} is not known")
        self.wire = wire


# --------------------------------------------------------------------------
# Device profiles.
# --------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def profile_table() -> dict[str, dict[str, int]]:
    """Capacities in bytes per profile and level: profiles.toml over the fallback."""
    table = {name: dict(levels) for name, levels in FALLBACK_CAPACITIES.items()}
    if PROFILES_TOML.is_file():
        with PROFILES_TOML.open("rb") as f:
            data = tomllib.load(f)
        for name, body in data.get("profiles", {}).items():
            levels = body.get("levels", {}) if isinstance(body, dict) else {}
            entry = table.setdefault(name, {})
            for level, value in levels.items():
                if isinstance(value, int) and not isinstance(value, bool):
                    entry[level] = value
    return table


def level_capacity(diagram: ir.Diagram, level_name: str, profile: Optional[str] = None) -> Optional[int]:
    """The level's own ``capacity``, else its profile's (``profile``, a
    device the costs were run for, else the schedule's), else None (unknown)."""
    level = diagram.level(level_name)
    if level is not None and level.capacity is not None:
        return level.capacity
    profile = profile or (diagram.schedule.profile if diagram.schedule else None)
    if profile is None:
        return None
    return profile_table().get(profile, {}).get(level_name)


# --------------------------------------------------------------------------
# Extents, homes, dtypes.
# --------------------------------------------------------------------------

def _levels_through(level_name: str) -> tuple[str, ...]:
    """The levels from the outermost down to ``level_name`` (a nodes level,
    when present, splits wires before the devices level does)."""
    if level_name not in ir.ALL_LEVELS:
        raise ValueError(f"unknown level {level_name!r}")
    return ir.ALL_LEVELS[: ir.ALL_LEVELS.index(level_name) + 1]


def tile_extent(diagram: ir.Diagram, level_name: str, wire: str,
                sizes: dict[str, int]) -> Optional[int]:
    """How much of ``wire`` one processor of ``level_name`` sees (None: unknown).

    A fixed wire's declared size wins over ``sizes``; ``sizes`` binds the
    symbolic ones.
    """
    declared = diagram.wire(wire)
    extent = declared.size if declared is not None and declared.size is not None else sizes.get(wire)
    for name in _levels_through(level_name):
        level = diagram.level(name)
        for tile in level.tiles if level else ():
            if tile.wire != wire:
                continue
            if not tile.across:
                extent = tile.size
            elif extent is not None:
                extent = math.ceil(extent / tile.size)
    return extent


def tensor_dtype(diagram: ir.Diagram, name: str) -> str:
    """The element type of a tensor: an input's own; a box's declared one, else
    the accumulator's (so an undeclared lse output is fp32, as FlashAttention's is:
    partial results merged across devices need it)."""
    tensor = diagram.tensor(name)
    if isinstance(tensor, ir.Input):
        return tensor.dtype
    if tensor is not None and tensor.dtype is not None:
        return tensor.dtype
    return accumulator_dtype(diagram)


def dot_dtype(a: str, b: str) -> str:
    """The dtype tl.dot multiplies two factors of declared dtypes ``a`` and
    ``b`` in (codegen's emit.dot_operands; the cost pass's peak rate): one
    dtype as it is; two different 8-bit ones (fp8, int8) in fp16, which holds
    both exactly; an 8-bit factor in the other's dtype (fp16 and wider hold it
    exactly); else the wider, and fp16 beside bf16, neither holding the
    other, in fp32."""
    if a == b:
        return a
    if a in ir.FACTOR_DTYPES and b in ir.FACTOR_DTYPES:
        return "fp16"
    if a in ir.FACTOR_DTYPES or b in ir.FACTOR_DTYPES:
        return b if a in ir.FACTOR_DTYPES else a
    if ir.DTYPE_BYTES[a] != ir.DTYPE_BYTES[b]:
        return max(a, b, key=ir.DTYPE_BYTES.__getitem__)
    return "fp32"


def product_dtype(diagram: ir.Diagram, factors) -> str:
    """The dtype a tensor core product of ``factors`` runs in: a factor read
    from inputs is loaded in the narrowest of their dtypes, a computed one
    (attention's P, a box) is cast to the other's; two meet in dot_dtype's.
    The cost pass prices each product at its dtype's peak: SageAttention's
    int8 Q . K at the int8 rate, its P . V at V's fp16.  With no input in
    either, the narrowest float input."""
    def narrowest(dtypes):
        return min(dtypes, key=lambda t: (ir.DTYPE_BYTES[t], t))
    loaded = []
    for f in factors:
        refs = [r for r in ir.walk(f) if isinstance(r, ir.TensorRef)]
        if refs and all(isinstance(diagram.tensor(r.name), ir.Input) for r in refs):
            loaded.append(narrowest(diagram.tensor(r.name).dtype for r in refs))
    if len(loaded) == 2:
        return dot_dtype(*loaded)
    if loaded:
        return loaded[0]
    return narrowest([t.dtype for t in diagram.inputs if t.dtype in ir.FLOAT_DTYPES] or ["fp32"])


def accumulator_dtype(diagram: ir.Diagram) -> str:
    return diagram.schedule.accumulate if diagram.schedule else "fp32"


def innermost_tiled_level(diagram: ir.Diagram) -> str:
    """Where intermediates held nowhere are fused: the innermost level with tiles."""
    tiled = [lv.name for lv in diagram.schedule.levels if lv.tiles] if diagram.schedule else []
    tiled = [name for name in ir.LEVELS if name in tiled]
    return tiled[-1] if tiled else "hbm"


def chip_levels(diagram: ir.Diagram) -> list[str]:
    """The tiled levels below hbm, outermost first (smem, then regs).  The
    first is where a kernel's programs are counted: the cost pass's grid
    and codegen's blocks (codegen/lower.py _kernel_level) both read it."""
    if diagram.schedule is None:
        return []
    return [lv.name for lv in diagram.schedule.levels
            if lv.name in ("smem", "regs") and any(not t.across for t in lv.tiles)]


def home_level(diagram: ir.Diagram, name: str) -> str:
    """The level a tensor lives at (see the module docstring)."""
    for level in diagram.schedule.levels if diagram.schedule else ():
        if name in level.holds:
            return level.name
    if isinstance(diagram.tensor(name), ir.Input) or any(o.name == name for o in diagram.outputs):
        return "hbm"
    return innermost_tiled_level(diagram)


def is_on_chip(diagram: ir.Diagram, level_name: str) -> bool:
    level = diagram.level(level_name)
    return level_name == "smem" or (level_name == "regs" and level is not None and bool(level.tiles))


def streamed_wires(diagram: ir.Diagram, level_name: str) -> tuple[str, ...]:
    level = diagram.level(level_name)
    return tuple(t.wire for t in level.tiles if t.kind == "stream") if level else ()


def ring_over_group(diagram: ir.Diagram, group_wire: str, stream_wire: str) -> bool:
    """Whether a ring streaming ``stream_wire`` across N devices can pass its
    chunks round the devices of ``group N across`` ``group_wire`` (then they
    are the same N devices, Ring Attention's layout): no input the ring
    passes has ``group_wire``, so each device's chunk is the whole slice the
    others need.  K and V lack q: a ring of P; a matmul's B[k, n] lacks m."""
    return all(group_wire not in ir.axis_wires(t.axes) for t in diagram.inputs
               if stream_wire in ir.axis_wires(t.axes))


def shares_a_group(diagram: ir.Diagram, level: ir.Level, tile: ir.Tile) -> bool:
    """Whether ``tile``, a ring (``stream W across N``), runs on the devices
    of a group of the same count at the same mesh level whose wire its chunks
    lack (ring_over_group): then it adds no devices.  Per level: a ring of 4
    in the devices level beside a group of 2 there and 2 more in the nodes
    level is a dimension of its own (16 devices), as the checker counts."""
    return tile.across and tile.kind == "stream" and any(
        g.across and g.kind == "group" and g.size == tile.size and ring_over_group(diagram, g.wire, tile.wire)
        for g in level.tiles)


def mesh_devices(diagram: ir.Diagram) -> int:
    """The devices the mesh levels make: their across counts multiplied, but
    for a ring that shares a group's devices (shares_a_group)."""
    n = 1
    for level in diagram.schedule.levels if diagram.schedule else ():
        if level.name in ir.MESH_LEVELS:
            n *= math.prod(t.size for t in level.tiles if t.across and not shares_a_group(diagram, level, t))
    return n


def reduced_wires(expr: ir.Expr) -> set[str]:
    """Every wire some reduction in ``expr`` removes."""
    return {w for node in ir.walk(expr) if isinstance(node, ir.Reduce) for w in node.wires}


# tl.dot needs every matrix dimension >= 16: a block of rows smaller than this
# is refused (check.py) unless packed rows make it up (packs_rows)
MIN_DOT_BLOCK = 16
# NVIDIA's 8-bit mma sums 32 at a time: Triton refuses a smaller block along an
# 8-bit product's sum when it compiles for a GPU (its interpreter runs one)
EIGHT_BIT_DOT_BLOCK = 32


def _product_meets_in(diagram: ir.Diagram, n: ir.Expr) -> Optional[str]:
    """The dtype a sum of two inputs' product (``n``: sum[k](A * B)) meets in (dot_dtype), else None."""
    if not (isinstance(n, ir.Reduce) and n.op == "sum"):
        return None
    dtypes = [diagram.tensor(r.name).dtype for r in ir.walk(n.body)
              if isinstance(r, ir.TensorRef) and isinstance(diagram.tensor(r.name), ir.Input)]
    return dot_dtype(*dtypes) if len(dtypes) == 2 else None


def least_block(diagram: ir.Diagram, wire: str) -> int:
    """The least block tl.dot takes along ``wire``: EIGHT_BIT_DOT_BLOCK where a
    product of two inputs meeting in 8 bits (dot_dtype: e4m3 by e4m3, int8 by
    int8) sums over it; else MIN_DOT_BLOCK.  The code generator refuses a
    schedule below it, the launcher a block option, the tile search skips it."""
    for let in diagram.lets:
        for n in ir.walk(let.expr):
            if isinstance(n, ir.Reduce) and wire in n.wires and _product_meets_in(diagram, n) in ir.FACTOR_DTYPES:
                return EIGHT_BIT_DOT_BLOCK
    return MIN_DOT_BLOCK


def int8_scales(diagram: ir.Diagram) -> tuple[str, ...]:
    """The float inputs that multiply an int8 product's sum (sum[k](A * B) * sa * sb,
    sum[d](Q * K) * sq * sk): its dequantising scales.  Example inputs draw them
    about 1/127, a quantised -1..1: drawn normal as other floats, attention's
    sum of 64 products of -128..127 reached 1e5, a one-hot softmax."""
    out = []
    for let in diagram.lets:
        for n in ir.walk(let.expr):
            if not (isinstance(n, ir.Binary) and n.op == "*"):
                continue
            fs = ir.factors(n)
            if any(_product_meets_in(diagram, f) == "int8" for f in fs):
                out += [f.name for f in fs if isinstance(f, ir.TensorRef) and isinstance(diagram.tensor(f.name), ir.Input)
                        and diagram.tensor(f.name).dtype in ir.FLOAT_DTYPES]
    return tuple(dict.fromkeys(out))


def packs_rows(diagram: ir.Diagram, packed: str, row: str) -> bool:
    """The rule of packed rows (docs/language.md, "Packed rows"), the one
    the checker lets groups under a tl.dot block pass by and codegen
    (codegen/lower.py packed_wire) runs: at level smem, where a program's
    row block is formed, ``group packed by G`` and ``group row by R``, both
    more than 1 and G * R at least MIN_DOT_BLOCK rows, and an input holds
    ``packed`` right before ``row`` (``Q[b, (hk g), q, d]``: g, q)."""
    level = diagram.level("smem")
    if level is None:
        return False
    groups = {t.wire: t.size for t in level.tiles if t.kind == "group" and not t.across and t.chunk is None}
    g, r = groups.get(packed, 1), groups.get(row, 1)
    if g <= 1 or r <= 1 or g * r < MIN_DOT_BLOCK:
        return False
    for x in diagram.inputs:
        wires = ir.axis_wires(x.axes)
        if packed in wires and row in wires and wires.index(packed) + 1 == wires.index(row):
            return True
    return False


def tensors_read(diagram: ir.Diagram) -> set[str]:
    """Names of the tensors some box reads."""
    return {node.name for let in diagram.lets for node in ir.walk(let.expr)
            if isinstance(node, ir.TensorRef)}


# --------------------------------------------------------------------------
# Footprints.
# --------------------------------------------------------------------------

def looped_wires(diagram: ir.Diagram, level_name: str, boxes=None) -> set[str]:
    """The wires a sum reduces beside one the level streams, which the level does not tile:
    a program walks them index by index around its stream (sum[k, j](A * B) streaming j: k;
    codegen's ContractionPlan.outer), so a tile, and a step of the L2 model, holds one index
    of each.  ``boxes``: those of one kernel (cost/model.py), else every box."""
    streamed = set(streamed_wires(diagram, level_name))
    level = diagram.level(level_name)
    tiled = {t.wire for t in level.tiles} if level is not None else set()
    lets = diagram.lets if boxes is None else [diagram.tensor(n) for n in boxes]
    return {w for let in lets for n in ir.walk(let.expr) if isinstance(n, ir.Reduce)
            and streamed & set(n.wires) for w in n.wires if w not in streamed and w not in tiled}


# A contraction kernel's programs in groups of this many row blocks (grouped_program).  4, not
# Triton's tutorial's 8: the cost pass's L2 model (cost/model.py) finds 4 no worse than the plain
# order on every case docs/cost.md lists, where 8 re-read the batch's factor on some (a group of
# 8 spanned more waves than L2 holds); priced, not timed.
GROUP_ROWS = 4


def grouped_program(r, c, rows: int, cols: int, group: int):
    """The (row block, column block) a contraction kernel's program (r, c) of a
    rows x cols launch grid computes (templates/contraction_kernel.py.jinja renders
    the same lines).  The launch runs grid axis 0 fastest, so its n-th program
    is r + rows * c; programs are taken in groups of ``group`` row blocks, each
    group walking every column block, its row blocks fastest: the programs
    running at once share a few row tiles of one factor and column tiles of the
    other, which L2 keeps, where the plain order had each wave read every row
    tile.  A bijection (the last group holds the rows left); ints or numpy
    arrays alike."""
    import numpy as np

    linear = c * rows + r
    in_group = group * cols
    first = linear // in_group * group
    size = np.minimum(rows - first, group)   # the last group's: the rows left
    return first + linear % in_group % size, linear % in_group // size


def tile_elements(diagram: ir.Diagram, level_name: str, name: str, sizes: dict[str, int],
                  looped: frozenset = frozenset(), coarse=None) -> int:
    """Elements of one tile of tensor ``name`` at a level, one index of each ``looped`` wire;
    raises UnboundWire.  ``coarse``: ir.coarse_reads(diagram), when the caller has it."""
    # a wire the tensor is read at blocks of another along (B[h, q // 64, x // 64] of B[h, qb, xb]):
    # a tile holds the blocks a tile of the read wire meets, not the whole declared wire
    reads: dict[str, list] = {}
    for tensor, declared, read, step, _ in ir.coarse_reads(diagram) if coarse is None else coarse:
        if tensor == name:
            reads.setdefault(declared, []).append((read, step))
    count = 1
    for wire in ir.axis_wires(diagram.tensor(name).axes):
        extent = 1 if wire in looped else tile_extent(diagram, level_name, wire, sizes)
        if wire in reads and wire not in looped:
            met = []
            for read, step in reads[wire]:
                block = tile_extent(diagram, level_name, read, sizes)
                if block is None:
                    raise UnboundWire(read)
                met.append(coarse_extent(block, step))
            extent = max(met) if extent is None else min(extent, max(met))
        if extent is None:
            raise UnboundWire(wire)
        count *= extent
    return count


def coarse_extent(block: int, step: int) -> int:
    """The most blocks of ``step`` a tile of ``block`` entries meets, the tiles
    starting at multiples of ``block``: 2 for 128 at 64, 4 for 128 at 40."""
    period = step // math.gcd(block, step)   # the tiles' offsets modulo step repeat after these many
    return max(((k + 1) * block - 1) // step - k * block // step + 1 for k in range(period))


def level_footprint(diagram: ir.Diagram, level_name: str,
                    sizes: dict[str, int]) -> list[tuple[str, int, int]]:
    """The tiles resident at a level: (tensor name, elements, bytes), in
    declaration order, each tensor once.

    Raises UnboundWire when a tile's extent depends on a symbolic wire that
    neither a tile nor ``sizes`` bounds.  Assumes a checked diagram (known
    names and dtypes).
    """
    depth = ir.ALL_LEVELS.index(level_name)
    on_chip = is_on_chip(diagram, level_name)
    read = tensors_read(diagram)
    streamed = set(streamed_wires(diagram, level_name))
    looped = frozenset(looped_wires(diagram, level_name)) if on_chip else frozenset()
    coarse = ir.coarse_reads(diagram)
    out = []
    for tensor in diagram.inputs + diagram.lets:
        name = tensor.name
        home = home_level(diagram, name)
        reduces_stream = isinstance(tensor, ir.Let) and bool(streamed & reduced_wires(tensor.expr))
        if on_chip and reduces_stream:
            dtype = accumulator_dtype(diagram)
        elif home == level_name or (on_chip and name in read and ir.ALL_LEVELS.index(home) < depth):
            dtype = tensor_dtype(diagram, name)
        else:
            continue
        elements = tile_elements(diagram, level_name, name, sizes, looped, coarse)
        out.append((name, elements, elements * ir.DTYPE_BYTES[dtype]))
    return out
