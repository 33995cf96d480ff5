"""The cost report: plain records, their JSON form, and the table people read.

Every record is a frozen dataclass of JSON-native values (str, int, float,
bool, None, tuples of those or of records), so ``to_json`` is mechanical and
``from_json(to_json(r)) == r`` holds.  The JSON carries ``schema`` so
consumers can tell versions apart; bump SCHEMA when a field changes meaning.
"""
from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import dataclass
from typing import Optional

from ..units import three_figures
from .devices import CommRow, DeviceComm

SCHEMA = "napkin.cost/1"


@dataclass(frozen=True)
class Transfer:
    """One tensor crossing one level boundary in one kernel."""

    boundary: str            # "hbm/smem": outer level / inner level
    kernel: int
    tensor: str
    wires: tuple[str, ...]   # the wires it is read or written along
    direction: str           # "load" or "store"
    dtype: str
    formula: str             # elements, symbolic (whole blocks, no skipping)
    fetches_formula: str     # times each element crosses, symbolic
    elements: Optional[int]  # exact for the sizes given (ragged edges, skipped blocks)
    bytes: Optional[int]
    fetches: Optional[float]  # elements / the tensor's size


@dataclass(frozen=True)
class BoundaryTotal:
    boundary: str
    formula_bytes: str
    load_elements: Optional[int]
    load_bytes: Optional[int]
    store_elements: Optional[int]
    store_bytes: Optional[int]
    dram_bytes: Optional[int]   # estimate: re-reads served by L2 when they fit (hbm boundary only)


@dataclass(frozen=True)
class Resident:
    tensor: str
    elements: int
    bytes: int


@dataclass(frozen=True)
class Footprint:
    level: str
    capacity: Optional[int]
    bytes: Optional[int]     # None: a symbolic wire it depends on is unbound
    tiles: tuple[Resident, ...]
    fits: Optional[bool]


@dataclass(frozen=True)
class Flops:
    contraction_formula: str
    other_formula: str
    exp_formula: str
    contraction: Optional[int]
    other: Optional[int]
    exp: Optional[int]
    contraction_dtype: str
    skipped_fraction: Optional[float]  # share of the dense (row, step) area skipped by masks
    # the contractions' FLOPs by the dtype each product runs in (tiling.product_dtype), each priced at
    # its own peak: SageAttention's int8 Q . K and fp16 P . V; None where sizes are unknown
    contraction_parts: Optional[tuple[tuple[str, int], ...]] = None


@dataclass(frozen=True)
class Roofline:
    profile: str
    contraction_rate: float
    contraction_s: float
    exp_s: float
    other_s: float
    hbm_s: float             # the DRAM estimate at hbm bandwidth
    hbm_issued_s: float      # every issued byte at hbm bandwidth (no L2 reuse)
    l2_working_set: int      # bytes one step of the first wave shares (must fit l2_bytes)
    communication_s: float
    estimate_s: float
    bound: str               # "compute", "exp", "other", "bandwidth"; "communication" past all four
    intensity: float         # FLOPs per DRAM byte (the estimate)


@dataclass(frozen=True)
class LowerBound:
    kind: str                # "attention", "two matmuls" (its unfused form), "matmul", "compulsory"
    formula: str             # in elements, M = capacity in elements
    capacity_level: str
    capacity_bytes: Optional[int]
    element_bytes: int
    elements: Optional[float]
    bytes: Optional[float]
    reread_bytes: Optional[float]   # the capacity-dependent term alone
    ratio: Optional[float]          # schedule's hbm bytes / bound bytes
    # The formula's bytes, and the compulsory traffic (each input read, each output
    # written once, in its own dtype): the bound is the larger, since the formula
    # can fall below it (one query row, or one output row of a matmul).
    formula_bytes: Optional[float] = None
    compulsory_bytes: Optional[float] = None

    @property
    def floored(self) -> bool:
        """Whether the compulsory traffic, not the formula, is the bound."""
        return self.compulsory_bytes is not None and self.formula_bytes is not None \
            and self.compulsory_bytes > self.formula_bytes


@dataclass(frozen=True)
class KernelInfo:
    index: int
    boxes: tuple[str, ...]
    stores: tuple[str, ...]
    grid: tuple[tuple[str, int], ...]   # wire, block
    stream: Optional[tuple[str, int]]
    programs: Optional[int]
    # the steps a program runs: blocks of the streamed wire (one chunk's if chunked), times each
    # index of a wire it loops over around them (``looped``)
    steps: Optional[int]
    visited_steps: Optional[int]        # (program, step) pairs run, after block skipping
    two_pass: bool
    # chunks of the streamed wire (napkin/cost/chunks.py): the chunk a launch
    # takes and how many (1: the launch runs whole); on the merge kernel too,
    # whose ``merges`` is the index of the kernel whose chunks' states it folds
    chunk: Optional[int] = None
    chunks: Optional[int] = None
    merges: Optional[int] = None
    # packed rows (napkin/cost/packing.py): (packed wire, row wire) when the
    # grid's row blocks are blocks of their pairs (the packed wire's block is 1)
    packed: Optional[tuple[str, str]] = None
    # the ranges prepass of a data mask (napkin/cost/prepass.py): the kernel whose blocks
    # it lists, and which step this is ("scan", "merge", "lists": torch's ops, a floor)
    prepass_of: Optional[int] = None
    prepass_step: Optional[str] = None
    # the wires a program loops over around its stream (sum[k, j](A * B) streaming j: k), with sizes
    looped: tuple[tuple[str, int], ...] = ()


def kernel_words(k: KernelInfo) -> str:
    """What a kernel runs, for the tables: its boxes, or whose helper it is."""
    from .prepass import step_text

    merges, of = getattr(k, "merges", None), getattr(k, "prepass_of", None)   # a report read back from JSON
    if merges is not None:
        return f"merge of kernel {merges}'s chunks"
    if of is not None:
        return step_text(k.prepass_step, of)
    return ", ".join(k.boxes)


def grid_text(k: KernelInfo) -> str:
    """``b/1 h/1 q/64``: each grid wire over its block; packed rows read
    ``(g q)/16`` (blocks of (g, q) pairs), the packed wire's 1 left out."""
    packed = k.packed
    parts = []
    for w, b in k.grid:
        if packed and w == packed[0]:
            continue
        parts.append(f"({packed[0]} {w})/{b}" if packed and w == packed[1] else f"{w}/{b}")
    return " ".join(parts) or "one program"


@dataclass(frozen=True)
class CostReport:
    schema: str
    diagram: str
    profile: str
    sizes: tuple[tuple[str, int], ...]   # every bound wire, declaration order
    per_device: bool                     # numbers are per device (a devices level exists)
    kernels: tuple[KernelInfo, ...]
    transfers: tuple[Transfer, ...]
    totals: tuple[BoundaryTotal, ...]
    footprints: tuple[Footprint, ...]
    flops: Flops
    bound: LowerBound
    roofline: Optional[Roofline]
    devices: Optional[DeviceComm]
    notes: tuple[str, ...]

    @property
    def hbm_bytes(self) -> Optional[int]:
        """Bytes crossing the hbm boundary (loads + stores), per device."""
        t = next((t for t in self.totals if t.boundary.startswith("hbm/")), None)
        if t is None or t.load_bytes is None:
            return None
        return t.load_bytes + t.store_bytes

    def to_dict(self) -> dict:
        return _plain(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)


def _plain(value):
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def from_json(text_or_dict) -> CostReport:
    """Rebuild a CostReport from ``to_json`` output (checks the schema)."""
    data = json.loads(text_or_dict) if isinstance(text_or_dict, str) else text_or_dict
    if data.get("schema") != SCHEMA:
        raise ValueError(f"not a {SCHEMA} report: schema {data.get('schema')!r}")
    return _build(CostReport, data)


_TYPES = {c.__name__: c for c in (Transfer, BoundaryTotal, Resident, Footprint, Flops, Roofline,
                                  LowerBound, KernelInfo, CostReport, CommRow, DeviceComm)}


def _build(tp, value):
    if value is None:
        return None
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return _build(inner[0], value)
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_build(args[0], v) for v in value)
        return tuple(_build(a, v) for a, v in zip(args, value))
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp, globalns={**globals(), **_TYPES})
        # a field added since the JSON was written takes its default
        return tp(**{f.name: _build(hints[f.name], value[f.name]) for f in dataclasses.fields(tp)
                     if f.name in value or (f.default is dataclasses.MISSING
                                            and f.default_factory is dataclasses.MISSING)})
    if tp is float and isinstance(value, int):
        return float(value)
    return value


# --------------------------------------------------------------------------
# Text.
# --------------------------------------------------------------------------

def bound_terms(b: "LowerBound") -> str:
    """The bound's kind and what its formula is in, for the one-line reports."""
    if b.kind == "compulsory":   # no capacity term: each tensor once, in its own dtype
        return "compulsory: every input read and every output written once, each in its own dtype"
    return f"{b.kind}, M = {human(b.capacity_bytes, 'B')} of {b.capacity_level} / {b.element_bytes} B"


def human(n: Optional[float], unit: str = "") -> str:
    """1234567 -> '1.23M'; exact below 10000.  The suffix is chosen after
    rounding to three digits (999698 is '1M', not '1e+03k')."""
    if n is None:
        return "?"
    if not math.isfinite(n):
        return f"{n}{unit}"
    if abs(n) < 10000:
        return (f"{n:g}" if isinstance(n, float) else str(n)) + unit
    return three_figures(n, ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))) + unit


def seconds(t: Optional[float]) -> str:
    if t is None:
        return "?"
    return three_figures(t, ((1, " s"), (1e-3, " ms"), (1e-6, " us"), (1e-9, " ns")))   # 0.9996 ms is '1 ms'


_NUMERIC = {"k", "elements", "bytes", "fetches", "group", "received", "sent"}


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Left-aligned text columns, right-aligned number columns."""
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]

    def fmt(r):
        return "  ".join(c.rjust(w) if h in _NUMERIC else c.ljust(w)
                         for c, w, h in zip(r, widths, header)).rstrip()
    return [fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]


def format_text(r: CostReport) -> str:
    out = [f"napkin cost: diagram {r.diagram} on {r.profile}"
           + (", sizes " + " ".join(f"{k}={v}" for k, v in r.sizes) if r.sizes else ", symbolic sizes")
           + (" (per device)" if r.per_device else "")]
    for k in r.kernels:
        grid = grid_text(k)
        if k.packed:
            grid += f" (packed rows: ({k.packed[0]}, {k.packed[1]}) pairs, each masked at its {k.packed[1]})"
        if k.merges is not None:
            run = "" if k.programs is None else f": {k.programs} programs"
            each = "" if k.chunks is None or k.programs is None else f", each folding {k.chunks} chunks' states"
            out.append(f"kernel {k.index} (merge of kernel {k.merges}'s chunks -> {', '.join(k.stores)}): "
                       f"grid {grid}{run}{each}")
            continue
        if k.prepass_of is not None:
            run = "" if k.programs is None else f": {k.programs} programs" + (
                "" if k.steps is None else f" x {k.steps} steps")
            where = f", grid {grid}" + (f", {k.stream[0]} by {k.stream[1]}" if k.stream else "") \
                if k.prepass_step != "lists" else ""
            out.append(f"kernel {k.index} ({kernel_words(k)} -> {', '.join(k.stores)}){where}{run}")
            continue
        stream = f", stream {k.stream[0]} by {k.stream[1]}" if k.stream else ""
        if k.chunk is not None and k.stream:
            stream += f", {k.stream[0]} in chunks of {k.chunk}" + (
                "" if k.chunks is None else
                f": {k.chunks} chunks" if k.chunks > 1 else ": 1 chunk, so it runs whole")
        run = ""
        if k.programs is not None:
            run = f": {k.programs} programs"
            if k.steps is not None:
                run += f" x {k.steps} steps"
                loops = math.prod(n for _, n in k.looped)
                if k.looped and loops and k.stream:
                    run += (f" ({' x '.join(f'{n} of {w}' for w, n in k.looped)}, each {k.steps // loops} "
                            f"of {k.stream[0]})")
                if k.visited_steps is not None and k.visited_steps != k.programs * k.steps:
                    run += f", {k.visited_steps} (program, step) pairs visited" + (
                        ": each chunk its own steps" if k.chunk is not None else " after block skipping")
        out.append(f"kernel {k.index} ({', '.join(k.boxes)} -> {', '.join(k.stores)}): grid {grid}{stream}{run}"
                   + (" [two passes]" if k.two_pass else ""))
    out.append("")
    out.append("transfers")
    rows = [[t.boundary, str(t.kernel), t.tensor, t.direction, t.dtype, t.formula, human(t.elements),
             human(t.bytes, "B"), "?" if t.fetches is None else f"{t.fetches:.4g}"] for t in r.transfers]
    out += _table(["boundary", "k", "tensor", "dir", "dtype", "elements (symbolic)", "elements",
                   "bytes", "fetches"], rows)
    for t in r.totals:
        out.append(f"total {t.boundary}: loads {human(t.load_bytes, 'B')}, stores {human(t.store_bytes, 'B')}"
                   f"  = {t.formula_bytes} bytes")
        if t.dram_bytes is not None and t.dram_bytes != t.load_bytes + t.store_bytes:
            out.append(f"  of which reach DRAM (re-reads hit L2): {human(t.dram_bytes, 'B')}")
    if r.devices:
        d = r.devices
        out.append("")
        laid = f", tokens laid out {d.layout}" if d.layout else ""
        out.append(f"devices: {d.devices} ("
                   + ", ".join(f"{k} {w} across {n}" for w, k, n in d.grid) + f"), link {d.link}{laid}")
        rows = [[c.tensor, c.collective, str(c.group), c.dtype, c.formula, human(c.bytes_received, "B"),
                 human(c.bytes_sent, "B")] for c in d.rows]
        out += _table(["tensor", "collective", "group", "dtype", "received (symbolic bytes)", "received",
                       "sent"], rows)
        out.append(f"per device: received {human(d.bytes_received, 'B')}, sent {human(d.bytes_sent, 'B')}, "
                   f"{d.steps} communication steps, {seconds(d.time_s)} on {d.link}")
    out.append("")
    out.append("resident per level")
    for f in r.footprints:
        cap = human(f.capacity, "B") if f.capacity else "unknown"
        used = human(f.bytes, "B")
        tiles = ", ".join(f"{t.tensor} {human(t.bytes, 'B')}" for t in f.tiles)
        status = "" if f.fits is None else (" fits" if f.fits else " DOES NOT FIT")
        out.append(f"  {f.level}: {used} of {cap}{status} ({tiles})")
    fl = r.flops
    out.append("")
    parts = fl.contraction_dtype if len(fl.contraction_parts or ()) < 2 else \
        "; ".join(f"{human(n)} {dtype}" for dtype, n in fl.contraction_parts)
    out.append(f"flops: contraction {human(fl.contraction)} ({fl.contraction_formula}, {parts}), "
               f"other {human(fl.other)}, exp {human(fl.exp)} ({fl.exp_formula})")
    if fl.skipped_fraction:
        out.append(f"  block skipping drops {fl.skipped_fraction:.1%} of the (row, step) area")
    b = r.bound
    value = f"{human(b.formula_bytes, 'B')}, below the compulsory traffic (each input read and each output " \
        f"written once): {human(b.bytes, 'B')}" if b.floored else human(b.bytes, "B")
    out.append(f"lower bound ({bound_terms(b)}): {b.formula} = {value}"
               + (f"; schedule/bound = {b.ratio:.3g}" if b.ratio is not None else ""))
    if r.roofline:
        rf = r.roofline
        out.append(f"roofline on {rf.profile}: {seconds(rf.estimate_s)}, {rf.bound}-bound "
                   f"(compute {seconds(rf.contraction_s)}, exp {seconds(rf.exp_s)}, other {seconds(rf.other_s)}, "
                   f"hbm {seconds(rf.hbm_s)}"
                   + (f" [{seconds(rf.hbm_issued_s)} if no re-read hit L2]" if rf.hbm_issued_s != rf.hbm_s else "")
                   + (f", communication {seconds(rf.communication_s)}" if rf.communication_s else "")
                   + f"); intensity {rf.intensity:.3g} FLOP/B")
    for note in r.notes:
        out.append(f"note: {note}")
    return "\n".join(out)
