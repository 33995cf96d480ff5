"""How long a napkin bench run may take, and each tuned kernel's share of it.

``--tune-budget`` gives every tuned kernel a fixed number of seconds; without
it each grid point's tuning gets its share of what the run's time limit
leaves (``TuneShare``), so that a run fits the device command it is given
(bench/device.sh sets ``$NAPKIN_BENCH_SECONDS`` to a stage's share).
"""
from __future__ import annotations

import math
import os
import time
from typing import Optional

from ..errors import NapkinError

# --tune-budget's default: a run is meant to fit its time limit
# (--time-limit, else $NAPKIN_BENCH_SECONDS, which bench/device.sh sets to a
# stage's share of a device command, else RUN_S: one 10-minute command less
# a minute spare, as a tuning may overrun its budget by part of a trial).
# The seconds left after start-up and the untuned work of each grid point
# still to run (the module's compile, the checks, FlexAttention's
# torch.compile, the timed rows) are shared equally by the kernels still to
# tune, again before each point (TuneShare), so time a point did not use
# goes to the next and one that ran long takes from them.  STARTUP_S and
# POINT_S are measured (H200, 2026-11-26, bench/results/logs/2026-11-26-*):
# a stage spent 6-14 s before its first point, and a point 6-16 s on its
# checks and timed rows (FlexAttention's compiles included), 22-30 s with a
# cached config, whose compiles fall there too, and its tuning overran its
# budget by 2-5 s.  A tuning always times its first candidate, the untuned
# launch, whatever the budget; MIN_TUNE_S is the least it is given.
RUN_S, STARTUP_S, POINT_S, MIN_TUNE_S = 540, 15, 25, 10
TIME_LIMIT_ENV = "NAPKIN_BENCH_SECONDS"


def time_limit(args) -> float:
    """The seconds the run may take: --time-limit, else $NAPKIN_BENCH_SECONDS, else RUN_S."""
    if args.time_limit is not None:
        value, what, given = args.time_limit, "--time-limit", args.time_limit
    elif (given := os.environ.get(TIME_LIMIT_ENV)) is not None:
        what = f"${TIME_LIMIT_ENV}"
        try:
            value = float(given)
        except ValueError:
            value = math.nan
    else:
        return float(RUN_S)
    if not 0 < value < math.inf:
        raise NapkinError(f"{what} expects a positive number of seconds, not {given!r}")
    return float(value)


def tune_budget(points: int, kernels_per_point: int, seconds: float = RUN_S - STARTUP_S) -> float:
    """The default seconds per tuned kernel when ``points`` grid points of
    ``kernels_per_point`` tuned kernels each are still to run in ``seconds``
    (see RUN_S)."""
    left = seconds - POINT_S * points
    return float(max(MIN_TUNE_S, left // (points * kernels_per_point)))


class TuneShare:
    """The tuning budget of each grid point in turn (``next()``, once before
    each point): --tune-budget when given, else what is left of the time
    limit, start-up the first time, shared by the points still to run."""

    def __init__(self, limit_s: float, points: int, kernels_per_point: int, fixed: Optional[float] = None,
                 clock=time.monotonic):
        self.limit_s, self.points, self.kernels, self.fixed, self.clock = \
            limit_s, points, kernels_per_point, fixed, clock
        self.start, self.done = clock(), 0

    def next(self) -> float:
        if self.fixed is not None:
            return float(self.fixed)
        left = self.limit_s - (self.clock() - self.start) - (STARTUP_S if self.done == 0 else 0)
        budget = tune_budget(max(1, self.points - self.done), self.kernels, left)
        self.done += 1
        return budget

    def passed(self, points: int) -> None:
        """At least ``points`` points are behind (run, or skipped by a failure)."""
        self.done = max(self.done, points)
