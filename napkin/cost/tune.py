"""Tile search: the block sizes that fit every level and cost least.

The search space is every on-chip tile whose block is not 1 (``b by 1``
stays: it is a batch index, not a block), each taking the powers of two the
Triton backend accepts for a matrix dimension (16 to 256), capped at the
first power of two covering the wire (a bigger block only adds masked
lanes).  With packed rows (packing.py) the row wire's group is searched
so that the packed block (the packed wire's group times it) takes those
powers of two over the |g||q| rows; the packed wire's group stays.  A
candidate survives when the tiles resident at every level fit that
level's capacity (napkin/tiling.py, the same sum the checker uses).
Survivors are ranked by the roofline's predicted time (``objective="time"``)
or by hbm bytes (``"transfers"``).  Times within 1% of the best count as
equal: the roofline knows nothing of how well small tiles use the tensor
cores, so a 0.2% gain from finer mask skipping must not buy 16-row blocks
that double the traffic.  Ties go to fewer hbm bytes, then the smaller
footprint, then the blocks themselves, so the order is deterministic.

The code generator calls ``tune`` for its default blocks and to prune its
autotuning configurations.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Mapping, Optional

from .. import ir, tiling
from ..errors import NapkinError
from . import packing
from .analysis import analyse, bind_sizes, resolve_profile, with_blocks

BLOCKS = (16, 32, 64, 128, 256)
TIME_TOLERANCE = 0.01   # predicted times this close (relative to the best) tie


@dataclass(frozen=True)
class TuneResult:
    blocks: tuple[tuple[str, int], ...]      # (wire, block) in schedule order
    time_s: float                           # roofline estimate
    hbm_bytes: int
    bound: str                              # what limits the estimate
    footprint: tuple[tuple[str, int, int], ...]  # (level, bytes, capacity)

    @property
    def block(self) -> dict[str, int]:
        return dict(self.blocks)


def searchable(diagram: ir.Diagram) -> list[str]:
    """The on-chip tiled wires whose blocks the search varies.  A wire packed
    into the rows (packing.py) is not one: the launch depends only on the
    packed block, its group times the row wire's, which the row wire's
    group varies."""
    pack = packing.find(diagram)
    out = []
    for lv in diagram.schedule.levels if diagram.schedule else ():
        if lv.name in ("smem", "regs"):
            out += [t.wire for t in lv.tiles if not t.across and t.size != 1 and t.wire not in out
                    and (pack is None or t.wire != pack.wire)]
    return out


def _choices(size: int) -> list[int]:
    cap = max(BLOCKS[0], 1 << max(size - 1, 0).bit_length())
    return [b for b in BLOCKS if b <= cap]


def _wire_choices(diagram: ir.Diagram, wire: str, sizes: Mapping[str, int]) -> list[int]:
    """The blocks tried for ``wire``: the Triton blocks covering it (from 32
    along an 8-bit product's sum, tiling.least_block); for the
    row wire of packed rows, the groups giving those packed blocks of the
    |g||q| rows (the packed wire's group fixed)."""
    pack = packing.find(diagram)
    if pack is None or wire != pack.row:
        least = tiling.least_block(diagram, wire)   # 32 along an 8-bit product's sum
        return [b for b in _choices(sizes[wire]) if b >= least] or [least]
    return sorted({max(1, b // pack.groups[0]) for b in _choices(sizes[pack.wire] * sizes[wire])})


def tune(diagram: ir.Diagram, sizes: Mapping[str, int], profile: Optional[str] = None,
         top: int = 5, objective: str = "time", docs=None, lengths=None) -> list[TuneResult]:
    """The ``top`` best block choices, best first (empty when nothing fits);
    ``docs``: each choice priced on those documents, ``lengths`` at those
    length inputs' values (analyse's)."""
    if objective not in ("time", "transfers"):
        raise NapkinError(f"unknown tuning objective {objective!r}: use 'time' or 'transfers'")
    prof = resolve_profile(diagram, profile)
    full = bind_sizes(diagram, sizes)
    missing = [w.name for w in diagram.wires if w.name not in full]
    if missing:
        raise NapkinError("the tile search needs every wire's size; missing: " + ", ".join(missing))
    wires = searchable(diagram)
    results = []
    for combo in itertools.product(*(_wire_choices(diagram, w, full) for w in wires)):
        blocks = dict(zip(wires, combo))
        candidate = with_blocks(diagram, blocks)
        footprint = _fits(candidate, full, prof)
        if footprint is None:
            continue
        r = analyse(candidate, full, prof.key, docs, lengths)
        results.append(TuneResult(tuple(blocks.items()), r.roofline.estimate_s, r.hbm_bytes,
                                  r.roofline.bound, footprint))
    if not results:
        return []
    best = min(t.time_s for t in results)

    def slack(t: TuneResult) -> int:
        """How many 1%-of-best steps slower than the best."""
        return math.floor((t.time_s - best) / (TIME_TOLERANCE * best)) if best > 0 else 0
    key = (lambda t: (slack(t), t.hbm_bytes)) if objective == "time" else (lambda t: (t.hbm_bytes, t.time_s))
    results.sort(key=lambda t: (*key(t), sum(b for _, b, _ in t.footprint), t.blocks))
    return results[:top]


def _fits(diagram: ir.Diagram, sizes: dict[str, int], prof) -> Optional[tuple]:
    out = []
    for lv in diagram.schedule.levels:
        if lv.name == "devices":
            continue
        capacity = lv.capacity if lv.capacity is not None else prof.capacity(lv.name)
        used = sum(b for _, _, b in tiling.level_footprint(diagram, lv.name, sizes))
        if capacity is not None and used > capacity:
            return None
        out.append((lv.name, used, capacity or 0))
    return tuple(out)
