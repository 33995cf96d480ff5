"""Autotuning: candidate launch configurations and the tuned-config cache.

A configuration is what a generated launcher takes besides its inputs:
one block size per tiled wire (``block_q``, ``block_x``), ``num_warps`` and
``num_stages``.  Tuning has three parts:

* ``candidates(diagram, sizes)``: the block sizes the cost pass's tile search
  ranks best (``napkin.cost.tune``; a documented default list when it is
  unavailable), crossed with num_warps and num_stages, and pruned: a config
  whose shared memory (the pipelined input tiles) exceeds the device's
  capacity, or that gives a warp fewer than 16 rows, cannot run well (or at
  all), so it is never timed.
* ``autotune(fn, candidates, bench_fn)``: times each candidate, keeps the
  fastest, and stores it in the cache.
* the cache: one JSON file, ``$NAPKIN_CACHE/autotune.json`` (default
  ``~/.cache/napkin``), keyed by (diagram source hash, device name, shape
  bucket), the bucket being each symbolic wire's size rounded up to a power
  of two.  A new sequence length in a tuned bucket reuses the config.

The run-time half (key, path, lookup) lives in templates/autotune.py.jinja so
the code generator can inline it into a generated module, which may import
only torch and triton.  This module renders that same template and executes
it: the writer here and the reader there share one definition of the key.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from . import ir, tiling
from .errors import NapkinError

SCHEMA = "napkin-autotune/1"
WARPS = (4, 8)
STAGES = (2, 3, 4)
MIN_ROWS_PER_WARP = 16   # an mma tile is 16 rows: fewer rows per warp leaves warps idle

# Used when the cost pass's tile search is unavailable or fails: (row, streamed)
# blocks around FlashAttention's usual choices, then matmul tiles (m, n, k).
DEFAULT_BLOCKS_2 = ((128, 64), (128, 128), (64, 64), (64, 128), (128, 32), (64, 32))
DEFAULT_BLOCKS_3 = ((128, 128, 32), (128, 64, 32), (64, 64, 32), (128, 128, 64), (64, 128, 32))


# --------------------------------------------------------------------------
# The run-time snippet: rendered from the template, also used here.
# --------------------------------------------------------------------------

def runtime_source(diagram_hash: str, wires: Sequence[str]) -> str:
    """The cache-reading code for a generated module (see the template)."""
    import jinja2

    from .resources import data_dir

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(data_dir("templates"))),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    text = env.get_template("autotune.py.jinja").render(diagram_hash=diagram_hash, wires=repr(tuple(wires)))
    return text.strip("\n") + "\n"


@functools.lru_cache(maxsize=1)
def _runtime() -> dict:
    namespace: dict = {}
    exec(compile(runtime_source("", ()), "<napkin autotune runtime>", "exec"), namespace)
    return namespace


def cache_path() -> Path:
    return Path(_runtime()["_autotune_cache_path"]())


def shape_bucket(sizes: Mapping[str, int], wires: Sequence[str]) -> tuple[tuple[str, int], ...]:
    return _runtime()["_autotune_bucket"](sizes, tuple(wires))


def cache_key(diagram_hash: str, device_name: str, sizes: Mapping[str, int], wires: Sequence[str],
              kind: str = "") -> str:
    """The cache key of a launch: kind "" for the forward, "bwd" for the
    backward's dQ kernel, "bwd_kv" for its dK/dV kernel."""
    return _runtime()["_autotune_key"](diagram_hash, device_name, sizes, tuple(wires), kind)


def device_name(device) -> str:
    return _runtime()["_autotune_device_name"](device)


def diagram_hash(source_text: str) -> str:
    """sha256 of the diagram's source text: the generated module's SOURCE_HASH."""
    return hashlib.sha256(source_text.encode()).hexdigest()


def symbolic_wires(diagram: ir.Diagram) -> tuple[str, ...]:
    return tuple(w.name for w in diagram.wires if w.size is None)


# --------------------------------------------------------------------------
# Configurations and candidates.
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class Config:
    blocks: tuple[tuple[str, int], ...]   # (wire, block) in schedule order
    num_warps: int
    num_stages: int

    def kwargs(self) -> dict:
        """The launcher options: block_<wire>=..., num_warps=..., num_stages=..."""
        out = {f"block_{w}": b for w, b in self.blocks}
        out.update(num_warps=self.num_warps, num_stages=self.num_stages)
        return out

    @staticmethod
    def from_kwargs(options: Mapping[str, int]) -> "Config":
        blocks = tuple((k[len("block_"):], int(v)) for k, v in options.items() if k.startswith("block_"))
        return Config(blocks, int(options["num_warps"]), int(options["num_stages"]))


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
    return total


def candidates(diagram: ir.Diagram, sizes: Mapping[str, int], *, capacity: Optional[int] = None,
               profile: Optional[str] = None, top: int = 4, warps: Sequence[int] = WARPS,
               stages: Sequence[int] = STAGES) -> tuple[list[Config], list[Pruned]]:
    """(configs to time, configs pruned and why), both in a fixed order.
    capacity: shared memory per block in bytes (default: the profile's smem)."""
    if capacity is None:
        capacity = tiling.level_capacity(diagram, "smem")
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


def backward_candidates(configs: Sequence[Config], lead: Sequence[Config] = ()) -> list[Config]:
    """A backward kernel's configs: ``lead`` (the kernel's own default, so
    tuning never ends worse than not tuning), then the forward's, each also
    with its two blocks exchanged: the dK/dV kernel holds the key wire and
    streams the rows, so a tile the forward's pruning shaped for [rows, keys]
    is just as likely to suit it transposed.  Fixed order, no repeats."""
    out: list[Config] = list(lead)
    for c in configs:
        out.append(c)
        if len(c.blocks) == 2:
            (a, x), (b, y) = c.blocks
            out.append(Config(((a, y), (b, x)), c.num_warps, c.num_stages))
    return list(dict.fromkeys(out))


# --------------------------------------------------------------------------
# The cache file.
# --------------------------------------------------------------------------

@dataclass
class Cache:
    path: Path = field(default_factory=cache_path)

    def entries(self) -> dict:
        return _runtime()["_autotune_read"](str(self.path))

    def get(self, key: str) -> Optional[Config]:
        entry = self.entries().get(key)
        try:
            return Config.from_kwargs(entry["config"])
        except (TypeError, KeyError, ValueError):
            return None

    def put(self, key: str, config: Config, **facts) -> None:
        """Store (replace) one entry; other entries, also ones another process
        wrote meanwhile, are kept.  Written to a temporary file and renamed, so
        a reader never sees half a file."""
        entries = self.entries()
        entries[key] = {"config": config.kwargs(), **facts}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"schema": SCHEMA, "entries": dict(sorted(entries.items()))}, indent=1) + "\n"
        fd, tmp = tempfile.mkstemp(prefix=".autotune.", suffix=".tmp", dir=str(self.path.parent))
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


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


def autotune(fn: Callable, configs: Sequence[Config], bench_fn: Callable[[Callable], float], *,
             cache: Optional[Cache] = None, key: Optional[str] = None, **facts) -> Tuned:
    """Time ``fn(**config.kwargs())`` for each config with ``bench_fn`` (which
    takes a callable with no arguments and returns milliseconds), keep the
    fastest and, given a cache and a key, store it there.  With a cache entry
    for the key already present, return it without timing anything.

    A config that raises (Triton's out-of-resources, a block the launcher
    refuses) is recorded as failed and skipped: compiling is the only way to
    learn some of those limits."""
    if cache is not None and key is not None:
        hit = cache.get(key)
        if hit is not None:
            entry = cache.entries()[key]
            return Tuned(hit, float(entry.get("ms", math.nan)), (), cached=True)
    trials = []
    for c in configs:
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
    if cache is not None and key is not None:
        cache.put(key, best.config, ms=best.ms, tried=len(trials), **facts)
    return Tuned(best.config, best.ms, tuple(trials), cached=False)
