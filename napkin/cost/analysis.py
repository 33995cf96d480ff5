"""``analyse(diagram, sizes, profile) -> CostReport``: the cost pass proper.

It puts the pieces together: the kernels and what they move (model.py), the
blocks a masked kernel visits (masked.py), the device level (devices.py), the
lower bound (bounds.py), the footprints (napkin/tiling.py, shared with the
checker), and a roofline on the chosen device profile.  It reads the IR and
returns a report; it never changes the diagram.  ``with_blocks`` returns a
new diagram with other block sizes (the tile search and the byte-count tests
use it).

A launch that packs rows (packing.py: a batch wire grouped beside the row
wire, grouped-query decoding) is counted as the launcher runs it: the
re-viewed problem of (g, q) pairs as rows, each masked at its own q.

With a devices level every number is per device, for the busiest device:
sizes split across devices round up, and a wire streamed across N devices is
costed as N kernel launches, one per chunk (a Ring step), each reloading the
tiles that do not carry the wire.  The merges' own hbm reads and writes are
not counted (the device table counts what they send).
"""
from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Mapping, Optional

from .. import ir, masks, tiling
from ..documents import Documents
from ..errors import Diagnostic, NapkinError
from . import bounds as bounds_mod
from . import chunks as chunks_mod
from . import packing
from . import prepass as prepass_mod
from .devices import communication
from .devices import mesh_tiles as device_tiles
from .lengths import check_lengths, describe
from .masked import (attention_plan, full_step_omits, kernel_ids, kernel_plan, lengths_note, mask_ids, prepass_note,
                     visited)
from .model import (Kernel, Tiling, access_fetches_poly, access_poly, chip_levels, contraction_numbers,
                    count_access, dram_fractions, kernel_tiling, kernel_work, kernels, tile_sym, tiling_at,
                    visited_area, work_numbers, work_polys)
from .profiles import Profile, get_profile
from .report import (SCHEMA, BoundaryTotal, CostReport, Flops, Footprint, KernelInfo, LowerBound, Resident,
                     Roofline, Transfer)
from .symbolic import Poly

DEFAULT_PROFILE = "h100"


# --------------------------------------------------------------------------
# Inputs: sizes, profile, blocks.
# --------------------------------------------------------------------------

def bind_sizes(diagram: ir.Diagram, sizes: Optional[Mapping[str, int]]) -> dict[str, int]:
    """Every wire whose size is known: fixed ones and those ``sizes`` binds.
    NapkinError for a wire the diagram lacks, a size that is not a positive
    whole number, a fixed wire given another size, or two sizes a relabel
    makes one; a relabel's wire takes the size of the wire it stands for."""
    out = {w.name: w.size for w in diagram.wires if w.size is not None}
    for name, value in (sizes or {}).items():
        wire = diagram.wire(name)
        if wire is None:
            known = ", ".join(w.name for w in diagram.wires)
            raise NapkinError(f"diagram {diagram.name} has no wire {name!r} (its wires: {known})")
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise NapkinError(f"the size of wire {name} must be a positive whole number, not {value!r}")
        if wire.size is not None and wire.size != value:
            raise NapkinError(f"wire {name} is fixed at {wire.size} in the diagram; it cannot be {value}")
        out[name] = value
    # A[n, k] of A[m, k]: n and m are one size, as the launcher binds them
    # (a missing one from the other, unequal ones refused); to a fixed point,
    # for chains of relabels
    clash = ir.tie_relabels(diagram, out)
    if clash:
        tensor, declared, read, loc = clash
        raise NapkinError([Diagnostic(f"{tensor} is read along {read} as well as {declared}, so wires "
                                      f"{read} ({out[read]}) and {declared} ({out[declared]}) must "
                                      "have equal sizes", loc)])
    coarse = ir.coarse_clash(diagram, out)
    if coarse:
        raise NapkinError([Diagnostic(*coarse)])
    return out


def resolve_profile(diagram: ir.Diagram, profile: Optional[str]) -> Profile:
    key = profile or (diagram.schedule.profile if diagram.schedule else None) or DEFAULT_PROFILE
    return get_profile(key)


def with_blocks(diagram: ir.Diagram, blocks: Mapping[str, int]) -> ir.Diagram:
    """A copy of ``diagram`` whose on-chip tiles of the named wires have the
    given block sizes (a new node; the original is untouched)."""
    if diagram.schedule is None:
        raise NapkinError(f"diagram {diagram.name} has no schedule, so it has no blocks to set")
    tiled = {t.wire for lv in diagram.schedule.levels if lv.name in ("smem", "regs")
             for t in lv.tiles if not t.across}
    for wire in blocks:
        if wire not in tiled:
            raise NapkinError(f"diagram {diagram.name} does not tile wire {wire!r} on chip; "
                              f"tiled wires: {', '.join(sorted(tiled)) or 'none'}")
    levels = []
    for lv in diagram.schedule.levels:
        if lv.name in ("smem", "regs"):
            tiles = tuple(dataclasses.replace(t, size=blocks[t.wire]) if t.wire in blocks and not t.across
                          else t for t in lv.tiles)
            lv = dataclasses.replace(lv, tiles=tiles)
        levels.append(lv)
    return dataclasses.replace(diagram, schedule=dataclasses.replace(diagram.schedule, levels=tuple(levels)))


# --------------------------------------------------------------------------
# Per-device problem pieces.
# --------------------------------------------------------------------------

def _device_split(diagram: ir.Diagram):
    groups = {t.wire: t.size for t in device_tiles(diagram) if t.kind == "group"}
    stream = next(((t.wire, t.size) for t in device_tiles(diagram) if t.kind == "stream"), None)
    return groups, stream


def _local_sizes(diagram: ir.Diagram, sizes: dict[str, int]) -> list[dict[str, int]]:
    """One size table per kernel launch on the busiest device."""
    groups, stream = _device_split(diagram)
    base = {w: (math.ceil(s / groups[w]) if w in groups else s) for w, s in sizes.items()}
    if stream is None:
        return [base]
    wire, n = stream
    chunks = [math.ceil((sizes[wire] - i) / n) for i in range(n)]  # dealt cyclically
    return [dict(base, **{wire: c}) for c in chunks if c > 0]


def _device_extent(diagram: ir.Diagram, sizes: dict[str, int], wire: str) -> int:
    groups, _ = _device_split(diagram)
    return math.ceil(sizes[wire] / groups[wire]) if wire in groups else sizes[wire]


def _wire_sym(diagram: ir.Diagram):
    split = {t.wire for t in device_tiles(diagram)}

    def sym(w: str) -> Poly:
        return Poly.sym(w) / Poly.sym(f"P_{w}") if w in split else Poly.sym(w)
    return sym


def _launches_poly(diagram: ir.Diagram) -> Poly:
    _, stream = _device_split(diagram)
    return Poly.sym(f"P_{stream[0]}") if stream else Poly.const(1)


# --------------------------------------------------------------------------
# The pass.
# --------------------------------------------------------------------------

def analyse(diagram: ir.Diagram, sizes: Optional[Mapping[str, int]] = None,
            profile: Optional[str] = None, docs: Optional[Documents] = None,
            lengths: Optional[Mapping[str, int]] = None, mask_cache: bool = False) -> CostReport:
    """The cost report for ``diagram`` (checked) at the given wire sizes.

    Symbolic wires missing from ``sizes`` leave the numeric fields None; the
    formulas are always there.  ``docs``: the lengths of the documents a mask
    comparing ids at the query and the key reads (napkin/documents.py), so
    that the blocks the kernels skip and the steps the ring runs are counted
    on them rather than every one (NapkinError where nothing priced reads ids).
    ``lengths``: length inputs read as these values at every index
    (napkin/cost/lengths.py), so that a mask reading only them is counted as
    a mask of indices alone (NapkinError where no prepass mask reads them).
    ``mask_cache``: the launch is given a warm mask_cache (the ranges
    prepass's record kept from an earlier call, as a training step's layers
    keep it): its prepass runs no kernel, and only the record's reads count.
    """
    launch = launch_schedule(diagram) if diagram.schedule is None else None
    written = diagram
    diagram = launch or diagram
    if lengths:
        if docs is not None:
            raise NapkinError("--lengths and --docs together are not priced: the documents' blocks leave the "
                              "lengths out; give one of them")
        check_lengths(diagram, lengths)
    c = _Context(diagram, resolve_profile(diagram, profile), bind_sizes(diagram, sizes), docs, lengths or {},
                 mask_cache)
    transfers, totals = _transfers(c)
    flops = _flops(c)
    bound = _lower_bound(c, totals)
    footprints = _footprints(c)
    comm = communication(diagram, c.kernels, c.full, c.prof, c.wire_sym, docs)
    if docs is not None:
        _check_documents(c, comm)
    if lengths:
        _check_lengths(c)
    notes = []
    if launch is not None:
        notes.append(f"diagram {written.name} has no schedule: priced as its untuned launch runs "
                     f"({_schedule_words(launch.schedule)})")
    elif written.schedule is None:
        notes.append(f"diagram {written.name} has no schedule and no kernel napkin emits: nothing is priced as "
                     "moved; write a schedule (docs/language.md, \"The schedule\")")
    if comm is not None:
        notes.append(f"numbers are per device (busiest of {comm.devices})"
                     "; block skipping is not modelled across devices")
        if comm.handshake_bytes is not None:
            notes.append(_device_note(comm))
    blocks = _blocks_note(c)
    if blocks:
        notes.append(blocks)
    if bound.ratio is not None and bound.ratio < 1:
        if any(f.level == bound.capacity_level and f.fits is False for f in footprints):
            notes.append(f"schedule/bound is below 1 because level {bound.capacity_level}'s tiles overflow it: "
                         "the bound holds for schedules that fit")
        else:
            notes.append(_below_bound_note(c, flops, bound))
    if c.chunk_note:
        notes.append(c.chunk_note)
    elif c.chunked and not c.known:
        notes.append(f"the formulas count the chunked launch (|{c.chunks.wire}| > c_{c.chunks.wire}, "
                     f"the chunk {c.chunks.chunk} or the stream block if longer); a launch of one chunk "
                     "runs whole, with no merge")
    if c.packs and not c.known:
        notes.append(f"the formulas count the packed launch (|{c.pack.wire}| > 1), which loads its rows' "
                     f"positions; with |{c.pack.wire}| = 1 it is the ordinary launch, without them")
    prepass = prepass_note(diagram, c.docs if c.known else None, c.bound, c.lengths)
    if prepass:
        notes.append(prepass)
    loop_lengths = lengths_note(diagram, c.lengths if c.known else {})
    if loop_lengths:
        notes.append(loop_lengths)
    if any(k.two_pass for k in c.kernels):
        notes.append("a kernel writes a normalised tensor along its streamed wire: "
                     "it reads its streamed inputs twice (statistics, then values)")
    if not c.known:
        missing = [w.name for w in diagram.wires if w.name not in c.bound]
        notes.append("give sizes for " + ", ".join(missing) + " (--size WIRE=N) for numbers")
    infos = _kernel_infos(c)
    notes += _idle_notes(c, infos)
    sizes_out = tuple((w.name, c.bound[w.name]) for w in diagram.wires if w.name in c.bound)
    return CostReport(SCHEMA, diagram.name, c.prof.key, sizes_out, comm is not None, infos,
                      tuple(transfers), tuple(totals), footprints, flops, bound,
                      _roofline(c, flops, totals, comm), comm, tuple(notes))


def launch_schedule(diagram: ir.Diagram) -> Optional[ir.Diagram]:
    """A diagram with no schedule, given the one its untuned launch runs:
    level hbm holds the inputs and outputs, level smem groups the code
    generator's blocks (a batch wire by 1: a program per index) and streams
    its streamed wire.  Without it nothing was priced as moved (hbm 0 ns,
    intensity 0 FLOP/B beside a bound of 840 MB).  None where napkin emits no
    kernel, or the checker refuses the schedule so made."""
    from ..check import check

    plan = kernel_plan(diagram)
    if plan is None or not plan.blocks:
        return None
    *groups, (stream, step) = plan.blocks
    tiles = tuple(ir.Tile(w, "group", 1) for w in plan.batch) + \
        tuple(ir.Tile(w, "group", b) for w, b in groups) + (ir.Tile(stream, "stream", step),)
    holds = tuple(t.name for t in diagram.inputs) + tuple(o.name for o in diagram.outputs)
    levels = (ir.Level("hbm", holds=holds), ir.Level("smem", tiles=tiles))
    made = dataclasses.replace(diagram, schedule=ir.Schedule(levels=levels))
    return made if not check(made) and kernel_plan(made) is not None else None


def _schedule_words(schedule: ir.Schedule) -> str:
    hbm, smem = schedule.levels
    tiles = ", ".join(f"{t.kind} {t.wire} by {t.size}" for t in smem.tiles)
    return f"level hbm holds {', '.join(hbm.holds)}; level smem: {tiles}"


def _below_bound_note(c: "_Context", flops: Flops, bound: LowerBound) -> str:
    """Why a schedule that fits can move less than the bound: the bound is
    dense attention's in the operands' element size (the paper's), and a
    mask that skips blocks, or accumulators narrower than the operands (more
    rows fit on chip than its M / (d + dv)), are outside that model."""
    why = []
    if flops.skipped_fraction:
        why.append(f"the masks skip {flops.skipped_fraction:.1%} of the (row, step) area and the bound is "
                   "dense attention's")
    acc = c.d.schedule.accumulate if c.d.schedule else None
    if acc in ir.DTYPE_BYTES and ir.DTYPE_BYTES[acc] < bound.element_bytes:
        why.append(f"the {acc} accumulators are narrower than the {bound.element_bytes}-byte operands the "
                   "bound's M counts, so more rows fit on chip than it assumes")
    return "schedule/bound is below 1: " + ("; ".join(why) if why else
                                            "the schedule moves less than the bound's model allows for")


def _check_documents(c: "_Context", comm) -> None:
    """--docs where nothing priced reads ids is a mistake to say, not to drop."""
    if not c.known:
        missing = ", ".join(w.name for w in c.d.wires if w.name not in c.bound)
        raise NapkinError(f"--docs counts blocks at given sizes: give {missing} too (--size WIRE=N)")
    if kernel_ids(c.d) is not None or (comm is not None and comm.ring_documents):
        return
    if not mask_ids(c.d):
        why = "its mask has no conjunct comparing ids at the query and the key (doc[b, q] == doc)"
    elif comm is not None:
        why = {"ring2": "a double ring runs every step, whatever the ids",
               "attention2d": "ATTENTION2D's devices compute their whole blocks, whatever the ids",
               "tree": "decoding's devices compute their whole shards, whatever the ids"}.get(
                   comm.scheme, "its devices' shares are priced whole, whatever the ids")
    else:
        why = "its kernels visit every block whatever the ids (no ranges prepass finds them)"
    raise NapkinError(f"--docs: document lengths change nothing napkin prices for diagram {c.d.name}: {why}")


def _check_lengths(c: "_Context") -> None:
    """--lengths that change nothing priced are a mistake to say, not to drop."""
    from ..codegen.ranges import index_disjuncts

    if not c.known:
        missing = ", ".join(w.name for w in c.d.wires if w.name not in c.bound)
        raise NapkinError(f"--lengths counts blocks at given sizes: give {missing} too (--size WIRE=N)")
    plan = attention_plan(c.d)
    looped = set(masks.lengths_read(plan.bounds)) if plan is not None and plan.skip is not None else set()
    if plan is None or device_tiles(c.d) or (index_disjuncts(plan, c.lengths) is None
                                             and not set(c.lengths) & looped):
        why = ("its devices' shares are priced whole, whatever the lengths" if device_tiles(c.d) else
               "no ranges prepass of its kernels reads only these lengths and indices, nor does a loop bound")
        raise NapkinError(f"--lengths: {describe(c.lengths)} changes nothing napkin prices for diagram {c.d.name}: "
                          f"{why}")


def _blocks_note(c: "_Context") -> Optional[str]:
    """A note naming the blocks the kernels' untuned launch runs where they
    differ from the kernel level's schedule, which this report prices as
    written: a row wire the level does not group runs the launcher's default
    block (a whole |q| per program is no kernel's), a group below tl.dot's
    16 runs 16, and a batch wire runs one program per index.  Where the
    sizes are known, a block that gives the same number of programs (or
    steps) is no difference."""
    plan = kernel_plan(c.d)
    if plan is None:
        return None
    level = c.levels[0] if c.levels else "smem"
    stream = plan.blocks[-1][0]
    groups = dict(c.tiles.groups)
    sizes = c.launches[0] if c.known else {}
    differ = []
    for wire, block in plan.blocks + tuple((w, 1) for w in plan.batch):
        streamed = c.tiles.stream is not None and c.tiles.stream[0] == wire
        have = (c.tiles.stream[1] if streamed else None) if wire == stream else groups.get(wire)
        n = sizes.get(wire)
        if have == block or (n is not None and -(-n // (have or n)) == -(-n // block)):
            continue
        verb = "stream" if wire == stream else "group"
        if wire in plan.batch:
            why = f"one program per index, where level {level} " + \
                  (f"groups it by {have}" if have is not None else "does not group it")
        elif have is None:
            why = f"the launcher's default: level {level} does not {verb} {wire}"
        else:
            why = f"tl.dot's least block, where level {level} {verb}s {wire} by {have}"
        differ.append(f"{wire} by {block} ({why})")
    if not differ:
        return None
    return (f"the kernels' untuned launch runs {'; '.join(differ)}, while this report prices the schedule "
            f"as written; give level {level} those blocks to price the launch")


def _idle_notes(c: "_Context", infos) -> list[str]:
    """A note for each streaming kernel whose grid leaves SMs idle: the
    roofline assumes every SM busy, so it cannot see what a longer grid
    (chunks of the streamed wire) would buy.  The merge kernel, a short
    pass over the states, is left out."""
    sms = int(c.prof["sm_count"])
    out = []
    for k in infos:
        if k.programs is None or k.stream is None or k.merges is not None or k.prepass_of is not None \
                or k.programs >= sms:
            continue
        x = k.stream[0]
        if attention_plan(c.d) is None:   # a contraction (or no kernel): no chunks, no chunk= launch option
            hint = "smaller blocks of the output's wires would give more programs" \
                if bounds_mod.bound_shape(c.d).kind != "attention" else "smaller row blocks would give more programs"
        elif k.chunks is not None and k.chunks > 1:
            hint = "shorter chunks would give more programs"
        elif c.chunks is not None:   # the schedule chunks, but |x| fits in one chunk: it runs whole
            hint = f"a chunk shorter than |{x}| (the launcher's chunk=) would give more programs"
        else:
            hint = (f"chunks of {x} (group {x} by C beside its stream, or the launcher's chunk=) or smaller "
                    "row blocks would give more programs")
        programs = f"{k.programs} program{'' if k.programs == 1 else 's'}"
        out.append(f"kernel {k.index} runs {programs} on {c.prof.key}'s {sms} SMs: the roofline assumes all of "
                   f"them busy; {hint}")
    return out


def _device_note(comm) -> str:
    """The device numbers the text table leaves out: handshake and backward."""
    out = f"devices: shape handshake {comm.handshake_bytes} B before the forward"
    if comm.ring_steps is not None:
        both = ("a zigzag rank's late chunk keeps keys of the ranks ahead of it" if comm.layout == "zigzag"
                else "its mask keeps keys on both sides of its queries")
        why = ("its mask keeps no key further back" if not comm.ring_ahead else
               f"{comm.ring_steps - comm.ring_ahead} the usual way round and {comm.ring_ahead} the other: "
               f"{both}, none further")
        if comm.ring_documents:
            why = (f"on --docs' {comm.ring_documents} no rank's queries share a document with keys further "
                   "back" if not comm.ring_ahead else
                   f"{comm.ring_steps - comm.ring_ahead} the usual way round and {comm.ring_ahead} the other: on "
                   f"--docs' {comm.ring_documents} no document reaches further")
        out = (f"devices: the ring runs {comm.ring_steps} of {comm.devices} steps over {comm.layout} shards "
               f"({why}); shape handshake {comm.handshake_bytes} B before the forward")
    elif comm.ring_documents:
        out = (f"devices: on --docs' {comm.ring_documents} the ring still runs every step: some rank's queries "
               f"share a document with keys {comm.devices - 1} steps back; shape handshake "
               f"{comm.handshake_bytes} B before the forward")
    if comm.ring_ids:
        out += (f"; the ring may run fewer steps: its mask compares {', '.join(comm.ring_ids)} at the query and the "
                f"key, and RingAttention reads the values at each call to find how far back kept keys sit (priced "
                f"here at {comm.ring_steps or comm.devices} of {comm.devices} steps; --docs LENGTHS prices them on "
                "packed documents)")
    if comm.sent_across:
        out += f"; forward sends {comm.sent_within} B within nodes, {comm.sent_across} B across"
    if comm.backward_bytes is not None:
        out += f"; backward sends {comm.backward_bytes} B"
    if comm.burst_backward_bytes is not None:
        out += f" (BurstAttention's backward: {comm.burst_backward_bytes} B)"
    return out


class _Context:
    """What every step of the pass needs: the diagram, the profile, the sizes
    (one table per kernel launch on the busiest device), the kernels, the
    tiling, and the visited steps of each kernel in each launch."""

    def __init__(self, diagram: ir.Diagram, prof: Profile, bound: dict[str, int],
                 docs: Optional[Documents] = None, lengths: Mapping[str, int] = {}, mask_cache: bool = False):
        self.d, self.prof, self.bound, self.docs, self.lengths = diagram, prof, bound, docs, lengths
        self.known = all(w.name in bound for w in diagram.wires)
        self.full = bound if self.known else None
        # packed rows (packing.py): the kernels see the re-viewed sizes and blocks; the
        # real sizes (``real``) still give the mask's positions, the tensors and the bound
        self.pack = packing.find(diagram)
        self.real = _local_sizes(diagram, bound) if self.known else []
        self.launches = [self.pack.sizes(s) for s in self.real] if self.pack else self.real
        self.wire_sym = _wire_sym(diagram)
        self.n_launch = _launches_poly(diagram)
        self.levels = chip_levels(diagram)
        self.tiles = self.tiling(tiling_at(diagram, self.levels[0])) if self.levels else Tiling("hbm")
        self.kernels = kernels(diagram)
        # whether the launch packs (|g| > 1, as every launch's |g| is): it then loads its rows' positions
        self.packs = self.pack is not None and (not self.known or self.pack.packs(self.real[0]))
        if self.packs:
            self.kernels = [self.pack.with_positions(k) if self.pack.row in k.wires else k for k in self.kernels]
        self.visits = {k.index: [visited(diagram, k, self.tiles, s, self.pack, docs, lengths) for s in self.real]
                       for k in self.kernels}
        self.working_set = 0   # the largest one-step L2 working set seen (bytes)
        # chunks of the streamed wire (chunks.py): how many each launch runs, and
        # whether any launch runs chunked (formulas alone: the chunked launch)
        self.chunks, self.chunk_note = chunks_mod.find(diagram, self.kernels, self.tiles)
        if self.chunks is not None and self.packs and self.chunks.positions:   # the merge's rows' positions
            self.chunks = dataclasses.replace(self.chunks, again=self.chunks.again + (self.pack.positions(),))
        self.counts = {k.index: [chunks_mod.launch_count(self.chunks, k, self.tiles, s) for s in self.launches]
                       for k in self.kernels}
        self.chunked = self.chunks is not None and (
            not self.known or any(n > 1 for n in self.counts[self.chunks.kernel]))
        self.merge_index = len(self.kernels)   # the merge kernel's index in the report
        # the (tensor, wires) a full block's step does not load: what only a data mask reads
        self.omits = full_step_omits(diagram)
        # a kernel whose mask reads data runs the ranges prepass at its blocks (prepass.py): its
        # launch, and the index of its first step's kernel (three each: scan, merge, lists; none
        # for a kept record, a mask of indices alone's or under mask_cache, whose reads alone count)
        self.prepasses = []
        at = len(self.kernels) + (1 if self.chunked else 0)
        for k in self.kernels:
            plan = prepass_mod.applies(diagram, k)
            if plan is not None:
                # the chunk a chunked launch cuts the keys into (none where every launch runs whole)
                chunk = self.chunks.length(kernel_tiling(k, self.tiles)[1][1]) \
                    if self.chunked and self.chunks.kernel == k.index else 0
                launch = prepass_mod.forward_launch(plan, k, self.tiles, mask_cache, chunk)
                self.prepasses.append((k, launch, None if launch.kept else at))
                at += 0 if launch.kept else len(prepass_mod.STEPS)

    def tiling(self, tiles: Tiling) -> Tiling:
        """A level's blocks as the launch runs them (packed rows: packing.py)."""
        return self.pack.tiling(tiles) if self.pack else tiles


def _transfers(c: _Context) -> tuple[list[Transfer], list[BoundaryTotal]]:
    """Every tensor crossing hbm/first on-chip level (and on-chip/regs), per
    kernel, with the totals and the DRAM estimate of the hbm boundary.  A
    chunked kernel (chunks.py) adds its state's store, and the merge kernel
    its loads and the outputs' stores."""
    boundaries = [("hbm/" + c.levels[0], c.tiles)] if c.levels else []
    if len(c.levels) > 1:
        boundaries.append((f"{c.levels[0]}/{c.levels[1]}", c.tiling(tiling_at(c.d, c.levels[1]))))
    transfers, totals = [], []
    for name, tl in boundaries:
        hbm = name.startswith("hbm/")
        loads, stores, dram = [0, 0], [0, 0], 0   # [elements, bytes]
        total_poly = Poly()
        rows = [row for k in c.kernels for row in _kernel_rows(c, k, tl, hbm)] + (_prepass_rows(c) if hbm else [])
        for kernel, acc, poly, fetches, issued, reach, size in rows:
            eb = prepass_mod.element_bytes(acc.dtype)
            total_poly = total_poly + poly * eb
            elements = None
            if c.known:
                elements = sum(issued)
                dram += sum(round(n * f.get(acc, 1.0)) for n, f in zip(issued, reach)) * eb
                side = loads if acc.kind == "load" else stores
                side[0] += elements
                side[1] += elements * eb
            transfers.append(Transfer(
                name, kernel, acc.tensor, acc.wires, acc.kind, acc.dtype, str(poly), str(fetches),
                elements, None if elements is None else elements * eb,
                None if elements is None else round(elements / size, 6) if size else 0.0))
        numbers = (*loads, *stores) if c.known else (None,) * 4
        totals.append(BoundaryTotal(name, str(total_poly), *numbers, dram if c.known and hbm else None))
    return transfers, totals


def _prepass_rows(c: _Context) -> list[tuple]:
    """The ranges prepasses' transfer rows at the hbm boundary, as _kernel_rows
    writes them (prepass.py): each main kernel's reads of its record, then
    the prepass's three steps, each its own kernel index."""
    out = []
    for k, launch, first in c.prepasses:
        index = {step: first + i for i, step in enumerate(prepass_mod.STEPS)} if first is not None else {}
        elements, poly = _main_reads(c, k, launch)
        main = prepass_mod.record_reads(launch, poly, elements, c.launches[0] if c.known else None)
        scan, at = launch.kernel(), launch.tiles
        wave, l2 = int(c.prof["sm_count"]), c.prof["l2_bytes"]
        # the scan's loads of the mask's inputs reach DRAM as any kernel's shared tiles do
        reach = [prepass_mod.reach(launch, s, wave, l2) for s in c.launches] if c.known else [{}] * len(c.launches)
        for r in [main] + prepass_mod.rows(launch, c.launches, c.wire_sym):
            if r.step == "scan" and r.access.kind == "load":
                size = math.prod(-(-_device_extent(c.d, c.full, w) // r.access.step(w)) for w in r.access.wires) \
                    if c.known else None
                fetches, rch = access_fetches_poly(r.access, scan, at, c.wire_sym), reach
            else:   # a buffer: every byte reaches DRAM
                size, rch = r.size, [{}] * len(c.launches)
                fetches = Poly.const(2 if r.step == "lists" and r.access.kind == "load" else 1)
            out.append((k.index if r.step == "main" else index[r.step], r.access, r.poly, fetches,
                        list(r.elements) if c.known else [], rch, size))
    return out


def _main_reads(c: _Context, k: Kernel, launch: prepass_mod.Launch) -> tuple[list[int], Poly]:
    """The int32 a kernel reads of its record per launch: each program its
    record's head (prepass.record_head: a chunked launch's says where its
    chunk's part of each list starts and stops) and each visited (program,
    step) pair its list entry; and those reads' formula (whole blocks,
    every step visited, as the others)."""
    groups, stream = kernel_tiling(k, c.tiles)
    out = []
    for s, n, v in zip(c.launches, c.counts[k.index], c.visits[k.index]):
        grid = math.prod(-(-s[w] // b) for w, b in groups.items())
        head = prepass_mod.record_head(prepass_mod.counts(launch, s).cut)
        out.append(head * grid * n + (grid * -(-s[stream[0]] // stream[1]) if v is None else
                                      math.prod(-(-s[w] // b) for w, b in groups.items() if w != v.row) * v.count))
    grid = Poly.const(1)
    for w, b in groups.items():
        grid = grid * c.wire_sym(w) / tile_sym(c.tiles, w, b)
    # launch.chunk is set where the launches are chunked (_Context), as the chunk formulas are
    head = grid * prepass_mod.record_head(launch.chunk > 0) * \
        (c.chunks.count_poly(c.wire_sym) if launch.chunk > 0 else Poly.const(1))
    return out, (head + grid * c.wire_sym(stream[0]) / Poly.sym(f"s_{stream[0]}")) * c.n_launch


def _kernel_rows(c: _Context, k: Kernel, tl: Tiling, hbm: bool) -> list[tuple]:
    """One kernel's transfer rows at one boundary: (kernel index, access,
    formula, fetches formula, issued elements per launch, DRAM fractions per
    launch, the tensor's size).  A chunked kernel's tiles without the streamed
    wire are loaded once per chunk; at the hbm boundary it stores its state,
    and the merge kernel (its own index) loads the states, the tiles its
    finalise reads, and stores the outputs."""
    visits = c.visits[k.index] if hbm else [visited(c.d, k, tl, s, c.pack, c.docs, c.lengths) for s in c.real]
    counts = c.counts[k.index]
    ch = c.chunks if c.chunked and c.chunks.kernel == k.index else None
    wave, l2 = int(c.prof["sm_count"]), c.prof["l2_bytes"]
    memo: dict = {}

    def fractions_of(s: dict, n: int = 1, v=None):
        # launches alike give alike fractions: a ring of P launches P times, each step's
        # sizes the same unless a mask skips (napkin cost of a ring of 32,768: 8 s, 32,768 calls)
        key = (tuple(sorted(s.items())), n, v)
        if key not in memo:
            memo[key] = dram_fractions(k, tl, s, wave, l2, chunks=n, visited=v)
        return memo[key]

    reach = [{}] * len(c.launches)
    if hbm:
        reach = []
        for s, n, v in zip(c.launches, counts, visits):
            fractions, ws = fractions_of(s, n, v if k.skips else None)
            c.working_set = max(c.working_set, ws)
            reach.append(fractions)
    main, merged = [], []
    for acc in k.accesses:
        poly = access_poly(acc, k, tl, c.wire_sym) * c.n_launch
        fetches = access_fetches_poly(acc, k, tl, c.wire_sym) * c.n_launch
        # what only the mask reads, a full block's step does not load (masked.full_step_omits)
        partial = (acc.tensor, acc.wires) in c.omits
        issued = [count_access(acc, k, tl, s, v.partial() if partial and v is not None else v)
                  for s, v in zip(c.launches, visits)] if c.known else []
        if ch is not None and acc.kind == "load" and ch.wire not in acc.wires:   # once per chunk
            poly, fetches = poly * ch.count_poly(c.wire_sym), fetches * ch.count_poly(c.wire_sym)
            issued = [i * n for i, n in zip(issued, counts)]
        # the tensor as one device holds it (all of a wire streamed across devices; a coarse read's blocks)
        size = math.prod(-(-_device_extent(c.d, c.full, w) // acc.step(w)) for w in acc.wires) \
            if c.known else None
        row = (k.index, acc, poly, fetches, issued, reach, size)
        (merged if ch is not None and acc.kind == "store" else main).append(row)
    if ch is None or not hbm:
        return main + merged
    states = [chunks_mod.state_elements(ch, k, c.tiles, s, n) for s, n in zip(c.launches, counts)]
    state_poly = chunks_mod.state_poly(ch, k, c.tiles, c.wire_sym) * c.n_launch
    size = sum(states) if c.known else None
    main.append((k.index, chunks_mod.state_access("store", k, c.tiles), state_poly, Poly.const(1), states,
                 [{}] * len(c.launches), size))
    rows = [(c.merge_index, chunks_mod.state_access("load", k, c.tiles), state_poly, Poly.const(1), states,
             [{}] * len(c.launches), size)]
    whole = [fractions_of(s)[0] for s in c.launches] if ch.again and c.known else reach
    for acc in ch.again:   # read once per merge program, as the whole kernel reads it
        issued = [count_access(acc, k, tl, s, v) if n > 1 else 0
                  for s, v, n in zip(c.launches, visits, counts)] if c.known else []
        size = math.prod(_device_extent(c.d, c.full, w) for w in acc.wires) if c.known else None
        rows.append((c.merge_index, acc, access_poly(acc, k, tl, c.wire_sym) * c.n_launch,
                     access_fetches_poly(acc, k, tl, c.wire_sym) * c.n_launch, issued, whole, size))
    return main + rows + [(c.merge_index, *row[1:]) for row in merged]


def _kernel_infos(c: _Context) -> tuple[KernelInfo, ...]:
    infos = []
    for k in c.kernels:
        groups, stream = kernel_tiling(k, c.tiles)
        programs = steps = visited_steps = None
        ch = c.chunks if c.chunks is not None and c.chunks.kernel == k.index else None
        counts = c.counts[k.index]
        if c.known:
            grid = [math.prod(math.ceil(s[w] / b) for w, b in groups.items()) for s in c.launches]
            programs = sum(g * n for g, n in zip(grid, counts))
            if stream:
                # each index of a looped wire walks the stream's blocks again
                whole = math.ceil(c.launches[0][stream[0]] / stream[1]) * math.prod(c.launches[0][w] for w in k.looped)
                # a chunked program walks at most one chunk's blocks
                steps = min(whole, ch.length(stream[1]) // stream[1]) if ch is not None and counts[0] > 1 else whole
                v = c.visits[k.index][0] if c.visits[k.index] else None
                visited_steps = sum(grid) * whole if v is None else \
                    math.prod(math.ceil(c.launches[0][w] / b) for w, b in groups.items() if w != v.row) * v.count
        chunk = None if ch is None else ch.length(stream[1])
        n_chunks = counts[0] if ch is not None and counts else None
        stores = (chunks_mod.STATE,) if ch is not None and c.chunked else k.stores
        # |g| = 1 packs nothing: the ordinary launch, at the packed block, on q
        packed = (c.pack.wire, c.pack.row) if c.packs and c.pack.row in groups else None
        infos.append(KernelInfo(k.index, k.boxes, stores, tuple(groups.items()), stream,
                                programs, steps, visited_steps, k.two_pass, chunk, n_chunks, packed=packed,
                                looped=tuple((w, c.launches[0][w]) for w in k.looped) if c.known else ()))
        if ch is not None and c.chunked:   # the merge kernel: one program per (row block, batch index)
            merge_programs = sum(math.prod(math.ceil(s[w] / b) for w, b in groups.items())
                                 for s, n in zip(c.launches, counts) if n > 1) if c.known else None
            infos.append(KernelInfo(c.merge_index, (), k.stores, tuple(groups.items()), None, merge_programs,
                                    None, None, False, chunk, n_chunks, merges=k.index, packed=packed))
    return tuple(infos) + _prepass_infos(c)


def _prepass_infos(c: _Context) -> tuple[KernelInfo, ...]:
    """The ranges prepasses' kernels (prepass.py): the scan (a program per mask
    batch index, block and chunk, walking its chunk's blocks), the merge (one
    per batch index and block), the lists (torch's ops: no grid)."""
    P = prepass_mod
    out = []
    for k, launch, first in c.prepasses:
        if launch.kept:
            continue
        n = P.counts(launch, c.launches[0]) if c.known else None
        grid = tuple((w, 1) for w in launch.batch) + (launch.outer,)
        # (stores, grid, stream, programs, steps a program walks, tiles visited) of each step
        steps = {"scan": ((P.TILES, P.PARTS), grid, launch.inner, n and n.batch * n.blocks * n.chunks,
                          n and min(P.per_chunk(n.steps), n.steps), n and n.tiles),
                 "merge": ((P.RANGES,), grid, None, n and n.batch * n.blocks, n and n.chunks, None),
                 "lists": ((P.RANGES,), (), None, None, None, None)}
        for i, step in enumerate(P.STEPS):
            stores, at, stream, programs, walked, tiles = steps[step]
            out.append(KernelInfo(first + i, (), stores, at, stream, programs, walked, tiles, False,
                                  prepass_of=k.index, prepass_step=step))
    return tuple(out)


def _flops(c: _Context) -> Flops:
    fl = {"contraction": 0, "other": 0, "exp": 0}
    fl_poly = {"contraction": Poly(), "other": Poly(), "exp": Poly()}
    parts: Counter = Counter()   # the contractions' FLOPs by dtype
    dense_area = skipped_area = 0
    for k in c.kernels:
        work = kernel_work(c.d, k)
        for cat, p in work_polys(work, c.wire_sym).items():
            fl_poly[cat] = fl_poly[cat] + p * c.n_launch
        for s, v in zip(c.launches, c.visits[k.index]):
            area = visited_area(v, k, c.tiles, s)
            for cat, n in work_numbers(work, s, area).items():
                fl[cat] += n
            parts.update(contraction_numbers(work, s, area))
            if area is not None:
                dense_area += s[area[0]] * s[area[1]]
                skipped_area += s[area[0]] * s[area[1]] - area[2]
    numbers = (fl["contraction"], fl["other"], fl["exp"]) if c.known else (None,) * 3
    return Flops(str(fl_poly["contraction"]), str(fl_poly["other"]), str(fl_poly["exp"]), *numbers,
                 bounds_mod.bound_shape(c.d).dtype, (skipped_area / dense_area) if dense_area else None,
                 tuple(sorted(parts.items())) if c.known else None)


def _footprints(c: _Context) -> tuple[Footprint, ...]:
    """The tiles resident at each level (napkin/tiling.py, as the checker sums them)."""
    out = []
    for lv in (c.d.schedule.levels if c.d.schedule else ()):
        if lv.name in ir.MESH_LEVELS:
            continue
        capacity = lv.capacity if lv.capacity is not None else c.prof.capacity(lv.name)
        try:
            res = tiling.level_footprint(c.d, lv.name, dict(c.bound))
        except tiling.UnboundWire:
            out.append(Footprint(lv.name, capacity, None, (), None))
            continue
        used = sum(b for _, _, b in res)
        out.append(Footprint(lv.name, capacity, used, tuple(Resident(*t) for t in res),
                             None if capacity is None else used <= capacity))
    return tuple(out)


def _lower_bound(c: _Context, totals: list[BoundaryTotal]) -> LowerBound:
    shape = bounds_mod.bound_shape(c.d)
    chip = c.levels[0] if c.levels else "smem"
    level = c.d.level(chip)
    cap_bytes = level.capacity if level is not None and level.capacity else c.prof.capacity(chip)
    eb = ir.DTYPE_BYTES[shape.dtype]
    groups, _ = _device_split(c.d)

    def share(w: str) -> Poly:
        """One device's problem: its share of each grouped wire, all of a streamed one."""
        return Poly.sym(w) / Poly.sym(f"P_{w}") if w in groups else Poly.sym(w)
    compulsory = Poly()
    for t in list(c.d.inputs) + [c.d.tensor(o.name) for o in c.d.outputs]:
        compulsory = compulsory + _sym(ir.axis_wires(t.axes), share)
    if not (c.known and cap_bytes):
        return LowerBound(shape.kind, bounds_mod.bound_formula(shape, share, compulsory), chip, cap_bytes, eb,
                          None, None, None, None)
    local = {w: _device_extent(c.d, c.full, w) for w in c.full}
    # No schedule moves less than every input once and every output once: the
    # formula, which assumes a program can hold rows it does not have (a
    # single query, a matmul's one output row), can fall below that.
    floor = compulsory_bytes(c.d, local)
    if shape.kind == "compulsory":   # that traffic itself, each tensor in its own dtype
        taken = bounds_mod.Bound(float(floor), 0.0, "compulsory", str(compulsory))
    else:
        taken = bounds_mod.bound_bytes(shape, local, cap_bytes, share)
    bound = float(max(taken.bytes, floor))   # a float either way (the floor is an int): JSON keeps its type
    hbm = totals[0].load_bytes + totals[0].store_bytes if totals else None
    ratio = round(hbm / bound, 6) if hbm is not None and bound else None
    return LowerBound(taken.form, taken.formula, chip, cap_bytes, eb, bound / eb, bound, taken.reread_bytes,
                      ratio, taken.bytes, float(floor))


def _roofline(c: _Context, flops: Flops, totals: list[BoundaryTotal], comm) -> Optional[Roofline]:
    """The largest of the compute, exp, other and DRAM times, plus communication;
    the bound is the largest, or communication where that takes longer."""
    if not c.known:
        return None
    prof = c.prof
    # each product at its own dtype's peak; rate the peak the mix runs at (one dtype: that dtype's)
    compute, rate = prof.contraction_time(flops.contraction_parts, flops.contraction_dtype,
                                          c.d.schedule.tf32 if c.d.schedule else False)
    dram = totals[0].dram_bytes if totals else 0
    issued = totals[0].load_bytes + totals[0].store_bytes if totals else 0
    parts = {"compute": compute, "exp": flops.exp / prof["exp_rate"],
             "other": flops.other / prof["peak_flops_fp32"], "bandwidth": dram / prof["hbm_bandwidth"]}
    which = max(parts, key=lambda key: (parts[key], key))
    t_comm = comm.time_s if comm else 0.0
    # communication is added, not overlapped: past the largest ceiling it is most of the estimate
    bound = "communication" if t_comm > parts[which] else which
    total = flops.contraction + flops.other + flops.exp
    return Roofline(prof.key, rate, parts["compute"], parts["exp"], parts["other"], parts["bandwidth"],
                    issued / prof["hbm_bandwidth"], c.working_set, t_comm, parts[which] + t_comm, bound,
                    total / dram if dram else 0.0)


def _sym(wires, wire_sym) -> Poly:
    p = Poly.const(1)
    for w in wires:
        p = p * wire_sym(w)
    return p


def compulsory_bytes(diagram: ir.Diagram, sizes: dict[str, int]) -> int:
    """Every input read once and every output written once, each in the dtype
    the transfers count it in (tiling.tensor_dtype: an undeclared lse is fp32)."""
    tensors = list(diagram.inputs) + [diagram.tensor(o.name) for o in diagram.outputs]
    return sum(math.prod(sizes[w] for w in ir.axis_wires(t.axes))
               * ir.DTYPE_BYTES[tiling.tensor_dtype(diagram, t.name)] for t in tensors)
