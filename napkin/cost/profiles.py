"""Device profiles: napkin/profiles.toml as typed records.

One data file holds every device figure the cost model uses, each with a
source (see the file's header).  The checker reads the same file for level
capacities (napkin/tiling.py), so the two never disagree.
"""
from __future__ import annotations

import functools
import tomllib
from dataclasses import dataclass, field
from typing import Optional

from ..errors import NapkinError
from ..tiling import PROFILES_TOML

# Which peak rate a contraction runs at, by its operands' dtype.
_PEAK_KEY = {"fp16": "peak_flops_fp16", "bf16": "peak_flops_bf16", "e4m3": "peak_flops_fp8",
             "e5m2": "peak_flops_fp8", "tf32": "peak_flops_tf32", "fp32": "peak_flops_fp32",
             "fp64": "peak_flops_fp32", "int8": "peak_flops_int8"}

RATE_KEYS = ("hbm_bandwidth", "peak_flops_fp16", "peak_flops_bf16", "peak_flops_tf32",
             "peak_flops_fp32", "exp_rate", "nvlink_bandwidth", "infiniband_bandwidth")


@dataclass(frozen=True)
class Profile:
    key: str                       # "h100"
    name: str                      # "NVIDIA H100 SXM5 80GB"
    figures: dict = field(compare=False)      # every number in [profiles.KEY]
    levels: dict = field(compare=False)       # capacity in bytes per level
    sources: dict = field(compare=False)      # figure name -> where it comes from

    def __getitem__(self, figure: str) -> float:
        return self.figures[figure]

    def capacity(self, level: str) -> Optional[int]:
        return self.levels.get(level)

    def contraction_rate(self, dtype: str, tf32: bool = False) -> tuple[float, str]:
        """Peak FLOP/s for a contraction over ``dtype`` operands, and the figure's
        name.  fp32 uses tf32 tensor cores only when the schedule allows tf32; a
        profile without an fp8 or int8 figure prices those operands at its fp16
        rate (upcast)."""
        key = _PEAK_KEY.get(dtype, "peak_flops_fp32")
        if dtype == "fp32" and tf32:
            key = "peak_flops_tf32"
        if key not in self.figures:
            key = "peak_flops_fp16" if key in ("peak_flops_fp8", "peak_flops_int8") else "peak_flops_fp32"
        return self.figures[key], key

    def contraction_time(self, parts, dtype: str, tf32: bool = False) -> tuple[float, float]:
        """(seconds, the FLOP/s they average) for contraction FLOPs by dtype (``parts``:
        (dtype, FLOPs) pairs), each at its own peak; with none, 0 s at ``dtype``'s peak."""
        seconds = sum(n / self.contraction_rate(t, tf32)[0] for t, n in parts)
        total = sum(n for _, n in parts)
        return seconds, total / seconds if seconds else self.contraction_rate(dtype, tf32)[0]


@functools.lru_cache(maxsize=1)
def _table() -> dict:
    with PROFILES_TOML.open("rb") as f:
        return tomllib.load(f).get("profiles", {})


def profile_names() -> tuple[str, ...]:
    return tuple(sorted(_table()))


def get_profile(key: str) -> Profile:
    """The named profile; NapkinError (listing the known ones) if there is none."""
    table = _table()
    if key not in table:
        raise NapkinError(f"unknown device profile {key!r}; known profiles: {', '.join(profile_names())}")
    body = table[key]
    figures = {k: v for k, v in body.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return Profile(key, body.get("name", key), figures, dict(body.get("levels", {})),
                   dict(body.get("sources", {})))
