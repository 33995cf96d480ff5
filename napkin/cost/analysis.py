"""``analyse(diagram, sizes, profile) -> CostReport``: the cost pass proper.

It puts the pieces together: the kernels and what they move (model.py), the
device level (devices.py), the lower bound (bounds.py), the footprints
(napkin/tiling.py, shared with the checker), and a roofline on the chosen
device profile.  It reads the IR and returns a report; it never changes the
diagram.  ``with_blocks`` returns a new diagram with other block sizes (the
tile search and the byte-count tests use it).

With a devices level every number is per device, for the busiest device:
sizes split across devices round up, and a wire streamed across N devices is
costed as N kernel launches, one per chunk (a Ring step), each reloading the
tiles that do not carry the wire.  The merges' own hbm reads and writes are
not counted (the device table counts what they send).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from fractions import Fraction
from typing import Mapping, Optional

from .. import ir, masks, tiling
from ..errors import NapkinError
from . import bounds as bounds_mod
from .devices import communication, device_count
from .model import (Kernel, Tiling, Visited, access_fetches_poly, access_poly, chip_levels, count_access,
                    device_tiles, kernel_tiling, kernel_work, kernels, dram_fractions, tiling_at, visited_area,
                    work_numbers, work_polys)
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
    whole number, or a fixed wire given another size."""
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


def _visited(diagram: ir.Diagram, kernel: Kernel, tiles: Tiling, sizes: dict[str, int]) -> Optional[Visited]:
    """The (row block, step) pairs a masked kernel visits (napkin/masks.py),
    or None when it visits every pair.

    Whether a kernel may skip at all is the code generator's decision (a
    masked score must contribute nothing downstream: exp(-inf) = 0 does,
    S * S does not), so its plan is asked first; for a schedule it cannot
    emit, a kernel whose mask bounds the streamed wire skips."""
    groups, stream = kernel_tiling(kernel, tiles)
    if not kernel.skips or stream is None or device_tiles(diagram):
        return None
    col, chunk = stream
    decided = _codegen_bounds(diagram)
    if decided is not None:
        row, found = decided
        if not found or row not in groups or col != decided_col(diagram):
            return None
        return Visited(row, frozenset(masks.visited_blocks(found, sizes[row], sizes[col], groups[row],
                                                           chunk, sizes)))
    node = next((masks.mask_node(diagram.tensor(b).expr) for b in kernel.boxes
                 if masks.mask_node(diagram.tensor(b).expr) is not None), None)
    if node is None:
        return None
    pred = masks.mask_predicate(node)
    for row, block in groups.items():
        found = masks.stream_bounds(pred, row, col, sizes)
        if found:
            return Visited(row, frozenset(masks.visited_blocks(found, sizes[row], sizes[col], block, chunk,
                                                               sizes)))
    return None


@functools.lru_cache(maxsize=64)
def _plan(diagram: ir.Diagram):
    """The code generator's attention plan, or None (no codegen, not attention,
    or a schedule it refuses)."""
    try:
        from ..codegen import lower
    except ImportError:
        return None
    try:
        plan = lower.lower(diagram)
    except NapkinError:
        return None
    return plan if getattr(plan, "family", None) == "attention" else None


def _codegen_bounds(diagram: ir.Diagram):
    """(row wire, loop bounds) from the generated kernel's plan: empty bounds
    when it visits every block; None when there is no plan to ask."""
    plan = _plan(diagram)
    if plan is None:
        return None
    return plan.row, (tuple(plan.bounds) if plan.skip is not None else ())


def decided_col(diagram: ir.Diagram) -> Optional[str]:
    plan = _plan(diagram)
    return plan.col if plan is not None else None


# --------------------------------------------------------------------------
# The pass.
# --------------------------------------------------------------------------

def analyse(diagram: ir.Diagram, sizes: Optional[Mapping[str, int]] = None,
            profile: Optional[str] = None) -> CostReport:
    """The cost report for ``diagram`` (checked) at the given wire sizes.

    Symbolic wires missing from ``sizes`` leave the numeric fields None; the
    formulas are always there.
    """
    prof = resolve_profile(diagram, profile)
    bound_sizes = bind_sizes(diagram, sizes)
    known = all(w.name in bound_sizes for w in diagram.wires)
    full = bound_sizes if known else None
    launches = _local_sizes(diagram, full) if known else []
    wire_sym = _wire_sym(diagram)
    n_launch = _launches_poly(diagram)
    levels = chip_levels(diagram)
    tiles = tiling_at(diagram, levels[0]) if levels else Tiling("hbm")
    ks = kernels(diagram)
    notes: list[str] = []

    # -- transfers across hbm / first on-chip level (and on-chip / regs) -------
    boundaries = [("hbm/" + levels[0], tiles)] if levels else []
    if len(levels) > 1:
        boundaries.append((f"{levels[0]}/{levels[1]}", tiling_at(diagram, levels[1])))
    transfers, totals, infos = [], [], []
    visited_by_kernel: dict[int, list] = {}
    window = int(prof["sm_count"])
    working_set = 0
    dram = 0
    for name, tl in boundaries:
        load_e = load_b = store_e = store_b = 0
        total_poly = Poly()
        for k in ks:
            visits = [_visited(diagram, k, tl, s) for s in launches]
            visited_by_kernel.setdefault(k.index, visits)
            reach = []
            if name.startswith("hbm/"):
                for s in launches:
                    fractions, ws = dram_fractions(k, tl, s, window, prof["l2_bytes"])
                    working_set = max(working_set, ws)
                    reach.append(fractions)
            for acc in k.accesses:
                eb = ir.DTYPE_BYTES[acc.dtype]
                poly = access_poly(acc, k, tl, wire_sym) * n_launch
                total_poly = total_poly + poly * eb
                elements = sum(count_access(acc, k, tl, s, v) for s, v in zip(launches, visits)) \
                    if known else None
                # the tensor as one device holds it (all of a wire streamed across devices)
                size = math.prod(_device_extent(diagram, full, w) for w in acc.wires) if known else None
                transfers.append(Transfer(
                    name, k.index, acc.tensor, acc.wires, acc.kind, acc.dtype, str(poly),
                    str(access_fetches_poly(acc, k, tl, wire_sym) * n_launch),
                    elements, None if elements is None else elements * eb,
                    None if elements is None else round(elements / size, 6)))
                if known and name.startswith("hbm/"):
                    for s, v, fractions in zip(launches, visits, reach):
                        issued = count_access(acc, k, tl, s, v)
                        dram += round(issued * fractions.get(acc, 1.0)) * eb
                if known:
                    if acc.kind == "load":
                        load_e, load_b = load_e + elements, load_b + elements * eb
                    else:
                        store_e, store_b = store_e + elements, store_b + elements * eb
        totals.append(BoundaryTotal(name, str(total_poly), *(
            (load_e, load_b, store_e, store_b) if known else (None,) * 4),
            dram if known and name.startswith("hbm/") else None))

    for k in ks:
        groups, stream = kernel_tiling(k, tiles)
        programs = steps = visited_steps = None
        if known:
            programs = sum(math.prod(math.ceil(s[w] / b) for w, b in groups.items()) for s in launches)
            steps = math.ceil(launches[0][stream[0]] / stream[1]) if stream else None
            visits = visited_by_kernel.get(k.index, [])
            if stream and visits and visits[0] is not None:
                other = math.prod(math.ceil(full[w] / b) for w, b in groups.items() if w != visits[0].row)
                visited_steps = other * len(visits[0].pairs)
            elif stream:
                visited_steps = programs * steps
        infos.append(KernelInfo(k.index, k.boxes, k.stores, tuple(groups.items()), stream,
                                programs, steps, visited_steps, k.two_pass))

    # -- FLOPs ------------------------------------------------------------------
    fl = {"contraction": 0, "other": 0, "exp": 0}
    fl_poly = {"contraction": Poly(), "other": Poly(), "exp": Poly()}
    dense_area = skipped_area = 0
    for k in ks:
        work = kernel_work(diagram, k)
        for cat, p in work_polys(work, wire_sym).items():
            fl_poly[cat] = fl_poly[cat] + p * n_launch
        for s, v in zip(launches, visited_by_kernel.get(k.index, [None] * len(launches))):
            area = visited_area(v, k, tiles, s)
            for cat, n in work_numbers(work, s, area).items():
                fl[cat] += n
            if area is not None:
                dense_area += s[area[0]] * s[area[1]]
                skipped_area += s[area[0]] * s[area[1]] - area[2]
    shape = bounds_mod.bound_shape(diagram)
    flops = Flops(str(fl_poly["contraction"]), str(fl_poly["other"]), str(fl_poly["exp"]),
                  *((fl["contraction"], fl["other"], fl["exp"]) if known else (None,) * 3),
                  shape.dtype, (skipped_area / dense_area) if dense_area else None)

    # -- footprints -------------------------------------------------------------
    footprints = []
    for lv in (diagram.schedule.levels if diagram.schedule else ()):
        if lv.name == "devices":
            continue
        capacity = lv.capacity if lv.capacity is not None else prof.capacity(lv.name)
        try:
            res = tiling.level_footprint(diagram, lv.name, dict(bound_sizes))
        except tiling.UnboundWire:
            footprints.append(Footprint(lv.name, capacity, None, (), None))
            continue
        used = sum(b for _, _, b in res)
        footprints.append(Footprint(lv.name, capacity, used, tuple(Resident(*t) for t in res),
                                    None if capacity is None else used <= capacity))

    # -- lower bound ------------------------------------------------------------
    chip = levels[0] if levels else "smem"
    cap_level = diagram.level(chip)
    cap_bytes = cap_level.capacity if cap_level is not None and cap_level.capacity else prof.capacity(chip)
    eb = ir.DTYPE_BYTES[shape.dtype]
    compulsory = Poly()
    for t in diagram.inputs:
        compulsory = compulsory + _sym(ir.axis_wires(t.axes), wire_sym)
    for o in diagram.outputs:
        compulsory = compulsory + _sym(ir.axis_wires(diagram.tensor(o.name).axes), wire_sym)
    formula = bounds_mod.bound_formula(shape, wire_sym, compulsory)
    hbm_bytes = None
    if totals and known:
        hbm_bytes = totals[0].load_bytes + totals[0].store_bytes
    if known and cap_bytes:
        local = launches[0] if len(launches) == 1 else dict(launches[0], **{
            _device_split(diagram)[1][0]: full[_device_split(diagram)[1][0]]})
        comp = compulsory_elements(diagram, local)
        elements, reread = bounds_mod.bound_elements(shape, local, cap_bytes / eb, comp)
        ratio = hbm_bytes / (elements * eb) if hbm_bytes is not None and elements else None
        bound = LowerBound(shape.kind, formula, chip, cap_bytes, eb, elements, elements * eb, reread * eb,
                           None if ratio is None else round(ratio, 6))
    else:
        bound = LowerBound(shape.kind, formula, chip, cap_bytes, eb, None, None, None, None)

    # -- devices and roofline ---------------------------------------------------
    comm = communication(diagram, ks, full, prof, wire_sym)
    roof = None
    if known:
        rate, _ = prof.contraction_rate(shape.dtype, diagram.schedule.tf32 if diagram.schedule else False)
        t_c = fl["contraction"] / rate
        t_e = fl["exp"] / prof["exp_rate"]
        t_o = fl["other"] / prof["peak_flops_fp32"]
        dram_bytes = totals[0].dram_bytes if totals else 0
        t_m = dram_bytes / prof["hbm_bandwidth"]
        t_issued = (hbm_bytes or 0) / prof["hbm_bandwidth"]
        t_comm = comm.time_s if comm else 0.0
        parts = {"compute": t_c, "exp": t_e, "other": t_o, "bandwidth": t_m}
        which = max(parts, key=lambda key: (parts[key], key))
        total_flops = fl["contraction"] + fl["other"] + fl["exp"]
        roof = Roofline(prof.key, rate, t_c, t_e, t_o, t_m, t_issued, working_set, t_comm,
                        parts[which] + t_comm, which, total_flops / dram_bytes if dram_bytes else 0.0)
    if comm is not None:
        notes.append(f"numbers are per device (busiest of {device_count(diagram)})"
                     "; block skipping is not modelled across devices")
    if any(k.two_pass for k in ks):
        notes.append("a kernel writes a normalised tensor along its streamed wire: "
                     "it reads its streamed inputs twice (statistics, then values)")
    if not known:
        missing = [w.name for w in diagram.wires if w.name not in bound_sizes]
        notes.append("give sizes for " + ", ".join(missing) + " (--size WIRE=N) for numbers")
    sizes_out = tuple((w.name, bound_sizes[w.name]) for w in diagram.wires if w.name in bound_sizes)
    return CostReport(SCHEMA, diagram.name, prof.key, sizes_out, comm is not None, tuple(infos),
                      tuple(transfers), tuple(totals), tuple(footprints), flops, bound, roof, comm,
                      tuple(notes))


def _sym(wires, wire_sym) -> Poly:
    p = Poly.const(1)
    for w in wires:
        p = p * wire_sym(w)
    return p


def compulsory_elements(diagram: ir.Diagram, sizes: dict[str, int]) -> int:
    """Every input read once and every output written once."""
    total = sum(math.prod(sizes[w] for w in ir.axis_wires(t.axes)) for t in diagram.inputs)
    total += sum(math.prod(sizes[w] for w in ir.axis_wires(diagram.tensor(o.name).axes))
                 for o in diagram.outputs)
    return total
