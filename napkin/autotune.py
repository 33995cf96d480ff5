"""Autotuning: candidate launch configurations, and the tuning that times them.

A configuration (napkin.tunecache.Config) is what a generated launcher takes
besides its inputs: one block size per tiled wire (``block_q``,
``block_x``), ``num_warps`` and ``num_stages`` (and for an attention kernel
``tma``: TMA descriptors, ``chunk``: flash-decoding's chunks).  Tuning has
two parts here and its record in napkin.tunecache:

* ``candidates(diagram, sizes, kind=...)``: the configurations worth timing
  for one kernel (kind "" the forward, "bwd" the dQ kernel, "bwd_kv" the
  dK/dV kernel), most promising first, and the ones pruned with the reason.
  For streamed attention each kernel holds a block of one wire (its
  *resident* wire: the forward's and dQ's rows, dK/dV's keys) and steps
  over the other: resident blocks come from the cost pass (they set how
  often the streamed operand is re-read from HBM), streamed blocks are the
  sizes Hopper's MMAs run well (STREAMED_BLOCKS), each with num_warps and
  num_stages.  Pruned: shared memory over the device's, fewer than 16
  resident rows a warp, more float32 values a thread than the register
  budget (backward_hold.HELD_FP32, where spills start on sm_90), and a
  16-wide streamed block when a wider one fits.
* ``autotune(fn, candidates, bench_fn, budget_s=...)``: times candidates in
  order until the time budget is spent, keeps the fastest, and stores it in
  the cache (napkin.tunecache.Cache, keyed by diagram, device, dtypes and
  shape bucket) with how many were timed and how many skipped.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import time
import warnings
from dataclasses import dataclass, replace
from typing import Callable, Mapping, Optional, Sequence

from . import files, ir, tiling
from .errors import NapkinError
from .tunecache import Cache, Config, entry_count

WARPS = (4, 8)
STAGES = (2, 3, 4)
MIN_ROWS_PER_WARP = 16   # an mma tile is 16 rows: fewer rows per warp leaves warps idle
KINDS = {"": "forward", "bwd": "dQ", "bwd_kv": "dK/dV"}   # cache kind -> the kernel it tunes
KIND_ROLES = {"bwd": "dq", "bwd_kv": "dkdv"}   # a backward cache kind -> its kernel's role (codegen/backward.py)

# Streamed-wire blocks tried for attention: the N of each step's score
# product (and the K of its product with V).  32 to 128 are the widths
# FlashAttention kernels on Hopper step by; 16 (TINY_STREAMED) gives wgmma
# an N of 16, its least efficient shape, and pays the per-block softmax
# bookkeeping (the running max, the rescale of the accumulator) twice as
# often as 32, so it is tried only where no wider block fits.  The cost
# pass cannot rank these: its HBM bytes barely depend on the streamed block.
STREAMED_BLOCKS = (128, 64, 32)
TINY_STREAMED = 16
RESIDENT_PICKS = 2       # resident blocks from the cost pass's ranking, besides the schedule's own
# The order stages are tried in, for each block shape and warp count: 3
# keeps two tiles loading while one is used (the usual choice on Hopper),
# 2 needs the least shared memory, 4 the most and rarely pays on a
# compute-bound loop.  An order, not a filter: a budget that runs out
# loses the later ones first.
STAGE_ORDER = (3, 2, 4)

# TMA descriptor loads (the launchers' tma=, napkin/codegen/tma.py): tried for
# the forward, dQ and dK/dV at a padded head dim of TMA_MIN_HEAD_DIM or more,
# where compiled for sm_90 they free registers from the pointer kernel's: the
# forward 30-66 (which sits at the 255 cap at 128 x 128;
# bench/results/tma-sm90-2026-11-21.md; at head dim 64 they saved nothing),
# dQ at its default tile 10-77 and dK/dV 0-23, except two that take 16-17
# more on Triton 3.6 (bench/results/tma-bwd-sm90-2026-11-21.md): timings decide.
# One variant per block shape of at least TMA_MIN_RESIDENT resident rows (the
# forward's and dQ's rows, dK/dV's keys: the shapes those studies compiled;
# with fewer the pointer kernel is far from the cap), of its first (warps,
# stages): the second tier of the breadth-first order.  Untimed so far:
# counts, not timings.
# Chunks of the streamed wire (flash-decoding, the launchers' chunk=; napkin/codegen/emit.py
# chunk_state): tried for the forward when its grid has fewer programs than the device has SMs,
# aiming at CHUNK_WAVES programs per SM, each chunk at least CHUNK_MIN_BLOCKS streamed blocks
# (the merge reads every chunk's float32 state back: a chunk must amortise it).  Untimed on a GPU.
CHUNK_WAVES = 2
CHUNK_MIN_BLOCKS = 4
TMA_MIN_HEAD_DIM = 128
TMA_MIN_RESIDENT = 128
# Shared memory the TMA path adds: its mbarriers (16 B at 2 stages) and their
# alignment (1 KiB at 3 stages), as compiled for sm_90.
TMA_SMEM = 1024

# Used when the cost pass's tile search is unavailable or fails: (row, streamed)
# blocks around FlashAttention's usual choices, then matmul tiles (m, n, k).
DEFAULT_BLOCKS_2 = ((128, 64), (128, 128), (64, 64), (64, 128), (128, 32), (64, 32))
DEFAULT_BLOCKS_3 = ((128, 128, 32), (128, 64, 32), (64, 64, 32), (128, 128, 64), (64, 128, 32))


# --------------------------------------------------------------------------
# Configurations and candidates.
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class Pruned:
    config: Config
    why: str


def tiled_wires(diagram: ir.Diagram) -> list[str]:
    """The on-chip tiled wires a launcher takes a block for (not ``b by 1``)."""
    out = []
    for lv in diagram.schedule.levels if diagram.schedule else ():
        if lv.name in ("smem", "regs"):
            out += [t.wire for t in lv.tiles if not t.across and t.size != 1 and t.wire not in out]
    return out


def tiled_blocks(diagram: ir.Diagram) -> dict[str, int]:
    """The schedule's own block for each of ``tiled_wires``, in order."""
    wires = tiled_wires(diagram)
    found = {}
    for lv in diagram.schedule.levels if diagram.schedule else ():
        for t in lv.tiles:
            if t.wire in wires and not t.across and lv.name in ("smem", "regs"):
                found[t.wire] = t.size
    return {w: found[w] for w in wires if w in found}


def block_choices(diagram: ir.Diagram, sizes: Mapping[str, int], profile: Optional[str] = None,
                  top: int = 4) -> list[dict[str, int]]:
    """Block sizes to try, best first: the schedule's own, then the cost
    pass's ``top`` picks (or the default list when it cannot search)."""
    wires = tiled_wires(diagram)
    out = [tiled_blocks(diagram)]
    try:
        from .cost import tune
        ranked = [r.block for r in tune(diagram, sizes, profile, top=top)]
    except (ImportError, NapkinError):
        defaults = {2: DEFAULT_BLOCKS_2, 3: DEFAULT_BLOCKS_3}.get(len(wires), ())
        ranked = [dict(zip(wires, combo)) for combo in defaults]
    for blocks in ranked:
        blocks = {w: blocks[w] for w in wires if w in blocks}
        if len(blocks) == len(wires) and blocks not in out:
            out.append(blocks)
    return [b for b in out if len(b) == len(wires)]


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def smem_bytes(diagram: ir.Diagram, config: Config, sizes: Mapping[str, int]) -> int:
    """Shared memory the kernel's input tiles need: each tile (padded to powers
    of two, as Triton pads) once, times num_stages for a tile that carries
    the streamed wire (software pipelining keeps that many in flight).  An
    estimate: intermediates live in registers and are not counted."""
    if diagram.level("smem") is None:
        return 0
    from .cost import with_blocks

    d = with_blocks(diagram, dict(config.blocks))
    full = {w.name: w.size for w in d.wires if w.size is not None}
    full.update(sizes)
    streamed = set(tiling.streamed_wires(d, "smem"))
    read = tiling.tensors_read(d)
    total = 0
    for t in d.inputs:
        if t.name not in read:
            continue
        elements = 1
        for w in ir.axis_wires(t.axes):
            extent = tiling.tile_extent(d, "smem", w, full)
            elements *= _pow2(extent if extent is not None else full[w])
        copies = config.num_stages if streamed & set(ir.axis_wires(t.axes)) else 1
        total += elements * ir.DTYPE_BYTES[t.dtype] * copies
    return total + (TMA_SMEM if config.tma else 0)


@dataclass(frozen=True)
class KernelShape:
    """How one streamed-attention kernel holds a configuration's tiles.

    A program keeps a block of the ``resident`` wire (each MMA's M, split
    among the warps) and loops over blocks of ``streamed``.  In float32
    registers it holds its accumulators, ``widths`` columns per resident
    index ([resident, feature]: the forward's output, dQ), and one
    [resident, streamed] tile per accumulating product (``tiles``: P for
    P @ V, dS for dS @ K).  ``loads``: what it loads before the loop (once)
    and per step (num_stages copies in flight), for shared memory.  dK/dV
    is judged by its own launcher rule instead (``_rule_cut``)."""

    kind: str
    resident: str
    streamed: str
    widths: int
    tiles: int
    loads: tuple                       # codegen Load records (phase "pre" / "step")
    diagram: ir.Diagram                # whose tensors the loads read (the backward's include dO, lse, ...)
    plan: object = None                # the BackwardPlan (dK/dV)

    def held(self, blocks: Mapping[str, int], warps: int) -> float:
        """float32 values one thread holds: accumulators plus product tiles.
        Against backward_hold.HELD_FP32 (160), compiled for sm_90 with
        napkin.bench.aot (causal, d 128, bf16): forward (128, 64) at 4 warps
        (192) spilled 304 B, (128, 32) at 4 (160) and (64, 64) at 4 (96) did
        not, (128, 128) at 8 (128) spilled 4 B at 3 stages and none at 2;
        dQ (128, 64) at 4 (192) spilled 380 B, (128, 32) at 4 (160),
        (64, 128) at 4 (128), (128, 128) at 8 (128) and (64, 64) at 4 (96)
        did not."""
        return blocks[self.resident] * (self.widths + self.tiles * blocks[self.streamed]) / (32 * warps)


def _padded(diagram: ir.Diagram, wire: str, sizes: Mapping[str, int]) -> int:
    """A feature wire's block as the kernels pad it (lower.feature_block: 32 along an 8-bit product's sum)."""
    from .codegen.lower import feature_block

    return feature_block(diagram, wire, sizes)


@functools.lru_cache(maxsize=32)
def _plans(diagram: ir.Diagram):
    """(forward plan, backward plan or None) of a streamed attention
    (lower.streamed_attention), else None."""
    from .codegen import lower, training

    fplan = lower.streamed_attention(diagram)
    if fplan is None:
        return None
    return fplan, training.prepare(fplan).backward


def kernel_shape(diagram: ir.Diagram, sizes: Mapping[str, int], kind: str = "") -> Optional[KernelShape]:
    """The tiles kernel ``kind`` holds; None when the diagram is no streamed
    attention (or has no such backward kernel): its candidates are then the
    generic ones."""
    plans = _plans(diagram)
    if plans is None:
        return None
    fplan, bplan = plans
    full = {w.name: w.size for w in diagram.wires if w.size is not None}
    full.update(sizes)
    if kind == "":
        values = [a.value for a in fplan.accums if a.value is not None]
        widths = sum(_padded(diagram, v.cols, full) for v in values if v.cols)
        return KernelShape(kind, fplan.row, fplan.col, widths, len(values), fplan.loads, diagram)
    k = bplan.kernel(KIND_ROLES[kind]) if bplan is not None else None
    if k is None:
        return None
    widths = sum(_padded(bplan.diagram, g.cols, full) for g in k.grads)
    return KernelShape(kind, k.grid_wire, k.loop_wire, widths, len(k.grads), k.loads, bplan.diagram, bplan)


def kernel_smem(shape: KernelShape, config: Config, sizes: Mapping[str, int]) -> int:
    """Shared memory for one kernel's loaded tiles: each tile loaded before
    the loop once, each loaded per step num_stages times (padded to powers
    of two, as Triton pads), plus TMA_SMEM with TMA.  The forward's equals ``smem_bytes``; the
    backward kernels load other tensors (dO, lse, delta) and stream other
    wires (dK/dV streams the rows)."""
    blocks = dict(config.blocks)
    full = {w.name: w.size for w in shape.diagram.wires if w.size is not None}
    full.update(sizes)
    total = 0
    for ld in shape.loads:
        elements = 1
        for w in (ld.rows, ld.cols):
            if w is not None:
                elements *= blocks[w] if w in blocks else _padded(shape.diagram, w, full)
        copies = config.num_stages if ld.phase == "step" else 1
        total += elements * _load_bytes(shape, ld) * copies
    return total + (TMA_SMEM if config.tma else 0)


def _load_bytes(shape: KernelShape, ld) -> int:
    """Bytes per element of a loaded tile.  The backward's diagram declares
    its own tensors float32, but an output's gradient (dO: a tensor of the
    backward along a feature wire) arrives from autograd in the output's
    dtype, the inputs' for these diagrams: the first input's is counted."""
    t = shape.diagram.tensor(ld.tensor)
    forward = shape.plan.forward.diagram if shape.plan is not None else shape.diagram
    if forward.tensor(ld.tensor) is None and ld.rows is not None and ld.cols is not None and forward.inputs:
        return ir.DTYPE_BYTES[forward.inputs[0].dtype]
    return ir.DTYPE_BYTES[t.dtype]


def _rule_cut(shape: KernelShape, config: Config, sizes: Mapping[str, int]) -> Optional[str]:
    """None when the dK/dV kernel's own register rule (its launcher's default
    tile, backward_hold.dkdv_default_tile, against HELD_FP32) keeps this
    tile at these warps; else the blocks that rule would cut it to, as text.
    Asked of the rule itself, so a change to it (L2 and ReLU^2's float32
    operands count there) applies here too."""
    from .codegen.backward_hold import dkdv_default_tile

    plan, blocks = shape.plan, dict(config.blocks)
    # the rule reads the forward's blocks: keys take the row block, rows the streamed one
    fblocks = dict(plan.forward.blocks)
    fblocks[plan.row], fblocks[plan.col] = blocks[plan.col], blocks[plan.row]
    probe = replace(plan, forward=replace(plan.forward, blocks=tuple(fblocks.items())))
    full = {w.name: w.size for w in plan.diagram.wires if w.size is not None}
    full.update(sizes)
    br, bc, _ = dkdv_default_tile(probe, full, config.num_warps)
    if (br, bc) == (blocks[plan.row], blocks[plan.col]):
        return None
    return f"block_{plan.row}={br}, block_{plan.col}={bc}"


def resident_blocks(diagram: ir.Diagram, sizes: Mapping[str, int], shape: KernelShape,
                    profile: Optional[str] = None, picks: int = RESIDENT_PICKS) -> list[int]:
    """The resident wire's blocks, best first: the schedule's own (the
    forward's and dQ's rows; dK/dV's keys take the schedule's row block, as
    its default does), then the cost pass's best ``picks`` for the row wire.
    The cost pass ranks whole tiles by predicted time, ties by HBM bytes;
    a row block is as good as its best tile.  The bytes depend on the
    resident block (each resident block re-reads the whole streamed
    operand) far more than on the streamed one, and dK/dV's keys re-read
    Q and dO just as the forward's rows re-read K and V, so the same
    ranking serves its keys.  With packed rows (lower.packed_wire) the
    forward's blocks are of (g, q) pairs: the plan's, then g's group times
    each q group the search ranks."""
    from .codegen.lower import MIN_DOT

    own = tiled_blocks(diagram)
    rows = [v for v in own.values()][:1]
    plans = _plans(diagram) if shape.kind == "" else None
    pack = plans[0].pack if plans else None
    if pack is not None:   # packed rows (lower.packed_wire): the forward's rows are (g, q) pairs
        rows = [dict(plans[0].blocks)[plans[0].row]]
    try:
        from .cost import tune
        ranked = [r.block for r in tune(diagram, sizes, profile, top=10 ** 6)]     # every tile that fits
        row = tiled_wires(diagram)[0] if pack is None else plans[0].row
        # the tile search varies q's group beside g's (cost/tune.py): a packed block is their product
        order = list(dict.fromkeys(b[row] if pack is None else max(MIN_DOT, b[row] * pack[1])
                                   for b in ranked if row in b))
    except (ImportError, NapkinError, IndexError):
        order = list(dict.fromkeys(r for r, _ in DEFAULT_BLOCKS_2))
    # Rows too few for the fewest warps are pruned at every warp count (candidates) unless no
    # block reaches them (decoding's 16 rows): a pick spent on them tries nothing.  The
    # roofline ranks such blocks first where a compute-bound band is cut finer by them (a
    # window of 1024 at 8K: 16 and 32 rows, while 64 and 256 went untried).
    floor = MIN_ROWS_PER_WARP * min(WARPS)
    if max(rows + order, default=0) >= floor:
        order = [b for b in order if b >= floor]
    return rows + [b for b in order if b not in rows][:picks]


def streamed_blocks(diagram: ir.Diagram, sizes: Mapping[str, int], shape: KernelShape) -> list[int]:
    """The streamed wire's blocks, in the order tried: the schedule's own
    streamed block (forward and dQ; dK/dV streams the rows, and its own
    untuned tile leads its list anyway), then
    STREAMED_BLOCKS widest first (a wider step amortises the per-block
    bookkeeping, as long as the registers allow, which pruning checks),
    then TINY_STREAMED, kept only where nothing wider survives.  None wider
    than the wire itself (padded): a bigger block only adds masked lanes."""
    own = tiled_blocks(diagram)
    full = {w.name: w.size for w in diagram.wires if w.size is not None}
    full.update(sizes)
    cap = max(TINY_STREAMED, _pow2(full[shape.streamed])) if shape.streamed in full else None
    first = [own[shape.streamed]] if shape.streamed in own and shape.kind != "bwd_kv" else []
    out = list(dict.fromkeys(first + list(STREAMED_BLOCKS) + [TINY_STREAMED]))
    return [b for b in out if cap is None or b <= cap]


def candidates(diagram: ir.Diagram, sizes: Mapping[str, int], *, kind: str = "", lead: Sequence[Config] = (),
               capacity: Optional[int] = None, profile: Optional[str] = None, top: int = 4,
               warps: Sequence[int] = WARPS, stages: Sequence[int] = STAGES) -> tuple[list[Config], list[Pruned]]:
    """(configs to time, most promising first; configs pruned and why) for
    kernel ``kind`` ("" forward, "bwd" dQ, "bwd_kv" dK/dV).  ``lead``: the
    kernel's untuned launch, timed first and never pruned, so tuning never
    ends worse than not tuning.  capacity: shared memory per block in bytes
    (default: the profile's smem).  Deterministic."""
    if kind not in KINDS:
        raise NapkinError(f"unknown autotune kind {kind!r}: one of {', '.join(map(repr, KINDS))}")
    if capacity is None:
        capacity = tiling.level_capacity(diagram, "smem")
    shape = kernel_shape(diagram, sizes, kind)
    if shape is None:
        keep, pruned = _generic_candidates(diagram, sizes, capacity, profile, top, warps, stages)
    else:
        keep, pruned = _attention_candidates(diagram, sizes, shape, capacity, profile, warps, stages)
    lead = list(dict.fromkeys(lead))
    return lead + [c for c in keep if c not in lead], [p for p in pruned if p.config not in lead]


def _attention_candidates(diagram, sizes, shape: KernelShape, capacity, profile, warps, stages):
    """Resident blocks x streamed blocks x warps x stages, pruned, then
    ordered breadth first: every block shape at its most likely warps and
    stages before any shape's second choice, so a budget that runs out has
    still seen every shape once."""
    from .codegen.backward_hold import HELD_FP32

    res, st = shape.resident, shape.streamed
    warp_order = sorted(warps, reverse=True)       # more warps: fewer registers a thread
    stage_order = [s for s in STAGE_ORDER if s in stages] + [s for s in stages if s not in STAGE_ORDER]
    per_shape: dict[tuple, list[Config]] = {}
    pruned: list[Pruned] = []
    rblocks = resident_blocks(diagram, sizes, shape, profile)
    # rows too few for the smallest warp count (decoding's 16): the warps they fill are tried
    # too, else every candidate would be pruned and only the lead would run
    short = max(rblocks, default=0) < MIN_ROWS_PER_WARP * min(warps)
    for r in rblocks:
        for b in streamed_blocks(diagram, sizes, shape):
            blocks = {res: r, st: b}
            order = tuple((w, blocks[w]) for w in tiled_wires(diagram) if w in blocks)
            if len(order) != 2:
                continue
            survivors = per_shape.setdefault(order, [])
            for w in warp_order + ([max(r // MIN_ROWS_PER_WARP, 1)] if short else []):
                for s in stage_order:
                    c = Config(order, w, s)
                    why = _prune_reason(shape, c, sizes, capacity, HELD_FP32)
                    if why:
                        pruned.append(Pruned(c, why))
                    else:
                        survivors.append(c)
    # A 16-wide step only where no wider one survives for that resident
    # block; except in dK/dV, whose default at head dim 128 (128 keys x 32
    # rows) sits at the register budget: compiled for sm_90 by Triton 3.6
    # (the GPU machine's) it spills in gqa (36 B) and sliding_window (8 B)
    # while 128 x 16 does not (napkin.bench.aot, 2026-11-21), so 16 rows
    # stay a candidate there, last in order.
    wider = {dict(o)[res] for o, cs in per_shape.items() if cs and dict(o)[st] > TINY_STREAMED}
    for o, cs in per_shape.items():
        if dict(o)[st] == TINY_STREAMED and dict(o)[res] in wider and shape.kind != "bwd_kv":
            pruned += [Pruned(c, f"block_{st}={TINY_STREAMED} while a wider streamed block fits block_{res}="
                                 f"{dict(o)[res]}: an MMA N of 16 and twice the per-block softmax "
                                 "bookkeeping of 32") for c in cs]
            cs.clear()
    # TMA variants (head dim >= TMA_MIN_HEAD_DIM, 128 resident rows or more): each shape's first
    # survivor again with tma=True, second in its list, so the second tier
    # of the order tries them all before any shape's second (warps, stages)
    if tma_applies(shape, sizes):
        for o, cs in per_shape.items():
            if cs and dict(o)[res] >= TMA_MIN_RESIDENT:
                c = replace(cs[0], tma=True)
                why = _prune_reason(shape, c, sizes, capacity, HELD_FP32)
                if why:
                    pruned.append(Pruned(c, why))
                else:
                    cs.insert(1, c)
    # Chunk variants (the forward of a grid that leaves SMs idle: decoding): each
    # shape's first survivor again with each chunk length of chunk_lengths, after the TMA ones
    for o, cs in per_shape.items():
        for i, n in enumerate(chunk_lengths(shape, sizes, dict(o), profile) if cs else ()):
            cs.insert(2 + i, replace(cs[0], chunk=n))
    tiers = max((len(cs) for cs in per_shape.values()), default=0)
    keep = [cs[i] for i in range(tiers) for cs in per_shape.values() if i < len(cs)]
    # 16-wide steps last: tried only when the budget has seen every wider one
    keep = [c for c in keep if dict(c.blocks)[st] > TINY_STREAMED] + \
        [c for c in keep if dict(c.blocks)[st] <= TINY_STREAMED]
    return keep, pruned


def chunk_lengths(shape: KernelShape, sizes: Mapping[str, int], blocks: Mapping[str, int],
                  profile: Optional[str] = None) -> list[int]:
    """The chunk= lengths the tuner tries for the forward at ``blocks``
    (flash-decoding, the launchers' chunk=): none unless the unchunked grid
    has fewer programs than the device has SMs.  Then the power of two that
    gives about CHUNK_WAVES programs per SM, and twice it (fewer, longer
    chunks: less state to merge), each at least CHUNK_MIN_BLOCKS streamed
    blocks and shorter than the wire (one chunk runs whole).  A schedule
    that chunks also gets chunk=0, the whole wire in one program."""
    from .codegen.lower import chunk_of
    from .cost import packing
    from .cost.analysis import resolve_profile

    plans = _plans(shape.diagram) if shape.kind == "" else None
    if plans is None:
        return []
    fplan = plans[0]
    full = {w.name: w.size for w in shape.diagram.wires if w.size is not None}
    full.update(sizes)
    pack = packing.of_plan(fplan)
    if pack is not None:   # packed rows: the programs the launch runs, on the packed sizes
        full = pack.sizes(full)
    res, st = shape.resident, shape.streamed
    n = full[st]
    programs = math.ceil(full[res] / blocks[res]) * math.prod(full[w] for w in fplan.batch)
    sms = int(resolve_profile(shape.diagram, profile)["sm_count"])
    out = [0] if chunk_of(shape.diagram) is not None else []
    if programs >= sms:
        return out
    want = math.ceil(CHUNK_WAVES * sms / programs)                 # chunks per row block
    first = max(_pow2(math.ceil(n / want)), CHUNK_MIN_BLOCKS * blocks[st])
    return out + [c for c in (first, 2 * first) if c < n]


def tma_applies(shape: KernelShape, sizes: Mapping[str, int]) -> bool:
    """Whether the tuner tries TMA variants for kernel ``shape`` (forward, dQ
    or dK/dV): some tile it loads a descriptor can move
    (tma.descriptor_tile), at a padded head dim of at least TMA_MIN_HEAD_DIM."""
    from .codegen.tma import descriptor_tile

    plans = _plans(shape.diagram) if shape.plan is None else (shape.plan.forward,)
    if plans is None:
        return False
    fplan = plans[0]
    full = {w.name: w.size for w in shape.diagram.wires if w.size is not None}
    full.update(sizes)
    if not any(_padded(shape.diagram, w, full) >= TMA_MIN_HEAD_DIM for w in fplan.dims):
        return False
    return any(descriptor_tile(fplan, ld.tensor, ld.wires, ld.rows, ld.cols, shape.diagram) is not None
               for ld in shape.loads)


def _prune_reason(shape: KernelShape, c: Config, sizes, capacity: Optional[int], budget: int) -> Optional[str]:
    """Why ``c`` cannot run well in kernel ``shape`` (None: it may)."""
    blocks = dict(c.blocks)
    need = kernel_smem(shape, c, sizes)
    if capacity is not None and need > capacity:
        return f"needs {need} B of shared memory, more than {capacity} B"
    if blocks[shape.resident] < MIN_ROWS_PER_WARP * c.num_warps:
        return (f"block_{shape.resident}={blocks[shape.resident]} gives {c.num_warps} warps under "
                f"{MIN_ROWS_PER_WARP} rows each")
    # dK/dV is judged by its launcher's rule alone.  dQ's rule (which counts
    # both its product tiles as live at once) would also cut (128, 128) at 8
    # warps, which compiled without spills for sm_90; so dQ keeps the
    # estimate below, calibrated on those compiles (KernelShape.held).
    if shape.kind == "bwd_kv":
        cut = _rule_cut(shape, c, sizes)
        if cut is not None:
            return (f"registers: the dK/dV kernel's own rule (backward_hold.dkdv_default_tile, at most {budget} "
                    f"float32 values a thread) cuts this tile to {cut} at {c.num_warps} warps: it would spill")
        return None
    held = shape.held(blocks, c.num_warps)
    if held > budget:
        return (f"registers: a thread would hold {held:g} float32 values ({KINDS[shape.kind]} accumulators "
                f"[{blocks[shape.resident]}, {shape.widths}] and {shape.tiles} "
                f"[{blocks[shape.resident]}, {blocks[shape.streamed]}] tile(s) over {32 * c.num_warps} "
                f"threads), more than {budget} (backward_hold.HELD_FP32: spills start above it on sm_90)")
    return None


def _generic_candidates(diagram, sizes, capacity, profile, top, warps, stages):
    """Any other diagram (a matrix product): the schedule's blocks and the
    cost pass's ``top`` picks, crossed with warps and stages, pruned by
    shared memory and rows per warp."""
    wires = tiled_wires(diagram)
    row = wires[0] if wires else None
    keep, pruned = [], []
    for blocks in block_choices(diagram, sizes, profile, top):
        for w in warps:
            for s in stages:
                c = Config(tuple(blocks.items()), w, s)
                need = smem_bytes(diagram, c, sizes)
                if capacity is not None and need > capacity:
                    pruned.append(Pruned(c, f"needs {need} B of shared memory, more than {capacity} B"))
                elif row is not None and blocks[row] < MIN_ROWS_PER_WARP * w:
                    pruned.append(Pruned(c, f"block_{row}={blocks[row]} gives {w} warps under "
                                            f"{MIN_ROWS_PER_WARP} rows each"))
                else:
                    keep.append(c)
    return keep, pruned


# --------------------------------------------------------------------------
# Tuning.
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class Trial:
    config: Config
    ms: Optional[float]          # None: the config failed to run
    error: Optional[str] = None


@dataclass(frozen=True)
class Tuned:
    best: Config
    ms: float
    trials: tuple[Trial, ...]
    cached: bool                 # True: read from the cache, nothing was timed
    skipped: int = 0             # candidates never tried: the time budget ran out first
    budget_s: Optional[float] = None
    # A tuning that went on where a cut-short one stopped: the candidates that
    # one had tried (0: none, a fresh tuning) and how many of them it timed
    # and saw fail.  Its first trial here is that one's best, timed again.
    resumed_from: int = 0
    earlier_timed: int = 0
    earlier_failed: int = 0

    @property
    def new_trials(self) -> tuple[Trial, ...]:
        """The candidates this tuning tried first: all, less a resumed one's re-timed best."""
        return self.trials[1:] if self.resumed_from else self.trials

    def facts(self) -> dict:
        """What the result rows and the cache record of this tuning: counts over
        every candidate, those an earlier cut-short tuning tried included."""
        new = self.new_trials
        # an earlier best that fails when timed again counts as failed, no longer as timed
        lost = int(bool(self.resumed_from) and self.trials[0].ms is None)
        facts = {"candidates": self.resumed_from + len(new) + self.skipped,
                 "timed": self.earlier_timed - lost + sum(t.ms is not None for t in new),
                 "failed": self.earlier_failed + lost + sum(t.ms is None for t in new), "skipped": self.skipped,
                 "budget_s": self.budget_s, "truncated": self.skipped > 0}
        return facts | ({"resumed_from": self.resumed_from} if self.resumed_from else {})


def order_digest(configs: Sequence[Config]) -> str:
    """A candidate list's fingerprint, kept in its cache entry: a cut-short
    tuning resumes only on the very list it was cut from."""
    text = json.dumps([c.kwargs() for c in configs], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def resume_point(entry: dict, best: Config, configs: Sequence[Config]) -> int:
    """How many of ``configs`` a cached tuning that its budget cut short had
    tried (a budget only ever cuts the tail of the list, which is built the
    same way each time, most promising first), so a new tuning times the
    rest; 0 when there is nothing to go on with: the tuning was finished, or
    it ran on another list (another napkin's ranking, another device's
    shared memory).  An entry from before the fingerprint was kept passes
    when its counts fit this list and its best is among those it tried."""
    tried, total = entry.get("tried"), entry.get("candidates")
    if not entry.get("truncated") or not isinstance(tried, int) or total != len(configs) \
            or not 0 < tried < len(configs):
        return 0
    order = entry.get("order")
    if order is not None:
        return tried if order == order_digest(configs) else 0
    return tried if best in configs[:tried] else 0


def autotune(fn: Callable, configs: Sequence[Config], bench_fn: Callable[[Callable], float], *,
             cache: Optional[Cache] = None, key: Optional[str] = None, budget_s: Optional[float] = None,
             clock: Callable[[], float] = time.monotonic, resume: bool = True, **facts) -> Tuned:
    """Time ``fn(**config.kwargs())`` for each config with ``bench_fn`` (which
    takes a callable with no arguments and returns milliseconds), keep the
    fastest and, given a cache and a key, store it there.  With a cache entry
    for the key already present, return it without timing anything, unless
    its tuning was cut short by its budget and ``resume``: then time its
    best again and the candidates it never reached (``resume_point``), so
    tunings that each fit a short GPU session add up to a whole one.

    A config that raises (Triton's out-of-resources, a block the launcher
    refuses) is recorded as failed and skipped: compiling is the only way to
    learn some of those limits.

    ``budget_s``: seconds (on ``clock``) for this tuning.  Before each
    config it checks whether the trials so far, at their mean duration
    (compile plus timing), leave room for one more; if not, the rest are
    skipped and counted (``Tuned.skipped``, and in the cache entry), and the
    best so far is kept.  Configs come most promising first
    (``candidates``), so what a budget cuts is the least likely to win.
    Until some config has run, none is skipped: a tuning must end with one."""
    todo, earlier, done = list(configs), {}, 0
    if cache is not None and key is not None:
        hit = cache.get(key)
        if hit is not None:
            entry = cache.entries()[key]
            done = resume_point(entry, hit, configs) if resume else 0
            if not done:
                ms, budget = entry.get("ms"), entry.get("budget_s")
                number = (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool))
                return Tuned(hit, float(ms) if number(ms) else math.nan, (), cached=True,
                             skipped=entry_count(entry, "skipped"), budget_s=budget if number(budget) else None)
            todo, earlier = [hit, *configs[done:]], entry
    trials: list[Trial] = []
    start = clock()
    skipped = 0
    for i, c in enumerate(todo):
        spent = clock() - start
        if budget_s is not None and trials and any(t.ms is not None for t in trials) \
                and spent + spent / len(trials) > budget_s:
            skipped = len(todo) - i
            break
        options = c.kwargs()
        try:
            ms = float(bench_fn(lambda: fn(**options)))
        except Exception as err:  # noqa: BLE001 - any failure of one config just drops it
            trials.append(Trial(c, None, f"{type(err).__name__}: {err}"))
            continue
        trials.append(Trial(c, ms))
    timed = [t for t in trials if t.ms is not None]
    if not timed:
        why = "; ".join(f"{t.config.kwargs()}: {t.error}" for t in trials[:3]) or "no candidates"
        raise NapkinError(f"autotuning found no configuration that runs ({why})")
    best = min(timed, key=lambda t: (t.ms, trials.index(t)))
    tuned = Tuned(best.config, best.ms, tuple(trials), cached=False, skipped=skipped, budget_s=budget_s,
                  resumed_from=done, earlier_timed=entry_count(earlier, "timed"), earlier_failed=entry_count(earlier, "failed"))
    if cache is not None and key is not None:
        try:
            cache.put(key, best.config, ms=best.ms, tried=done + len(tuned.new_trials),
                      order=order_digest(configs), **tuned.facts(), **facts)
        except OSError as err:  # the tuning stands; only its record is lost
            # why_not: "Is a directory" alone blamed the cache for its lock file, and "File exists"
            # said nothing of a $NAPKIN_CACHE that is a file
            warnings.warn(f"the tuned config could not be cached in {cache.path}: {files.why_not(err, cache.path)}",
                          stacklevel=2)
    return tuned
