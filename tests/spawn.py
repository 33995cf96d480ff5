"""Run a multi-process gloo test worker and collect what each rank wrote.

Shared by the distributed test files: each worker(rank, world, init_file,
out_dir) writes out_dir/rank<r>.json and exits; the ranks are killed if they
have not all finished by the deadline, so a bug can never hang the suite.
``max_error`` is how both compare a rank's results with the reference.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest


def run_ranks(worker, world: int, out: Path, deadline_s: float) -> list:
    """Spawn ``world`` ranks of ``worker``; each rank's JSON results, in rank order."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(worker, args=(world, str(out / "init"), str(out)), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + deadline_s
    try:
        while not ctx.join(timeout=2):
            if time.monotonic() > deadline:
                pytest.fail(f"the {world} ranks did not finish within {deadline_s} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def max_error(a, b) -> float:
    """Max abs difference; inf when the -inf entries differ, nan on NaN."""
    import torch

    a, b = a.detach().double(), b.detach().double()
    if torch.isnan(a).any() or torch.isnan(b).any():
        return float("nan")
    if not torch.equal(torch.isinf(a), torch.isinf(b)) or not torch.equal(a[torch.isinf(a)], b[torch.isinf(b)]):
        return float("inf")
    fin = torch.isfinite(a)
    return float((a[fin] - b[fin]).abs().max()) if fin.any() else 0.0
