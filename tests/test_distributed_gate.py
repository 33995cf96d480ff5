"""Across devices: a gate on the value, sum[x](softmax[x](S) * V * gate).

The gate lies along the keys, so the wrappers split it with K and V (Ring
Attention sends it round with them; ATTENTION2D's columns hold their share)
and each device's local backward (NAME_backward, whose launcher forms V *
gate for its kernels: tests/test_value_gate.py) returns its keys' dV and
dgate.  4 gloo ranks run the ring and a 2 x 2 grid, causal, in float64 (the
eager local) and float32 (the generated kernels under TRITON_INTERPRET=1,
counted); the output and every gradient, the gate's included, against
float64 torch written here, on 37 tokens (padding rows in the shards).
"""
from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

import pytest
import torch

import napkin
from spawn import run_ranks

WORLD, N, DEADLINE_S = 4, 37, 300
TEXT = """diagram gated_d
wire b, h, q, x
wire d = 16
in Q[b, h, q, d] : {dt}
in K[b, h, x, d] : {dt}
in V[b, h, x, d] : {dt}
in gate[b, h, x] : {dt}
S[b, h, q, x] = where(x <= q, sum[d](Q * K) * |d|^-0.5, -inf)
O[b, h, q, d] = sum[x](softmax[x](S) * V * gate)
out O
schedule on h100 {{
  accumulate fp32
  level devices {{ {mesh} }}
  level hbm {{ hold Q, K, V, gate, O }}
  level smem {{
    group b by 1, h by 1, q by 16
    stream x by 16
    hold S
  }}
}}
"""
MESH = {"ring": "group q across 4\n    stream x across 4", "2x2": "group q across 2, x across 2"}
CASES = [(mesh, dt) for mesh in MESH for dt in ("fp64", "fp32")]


def run_case(mesh: str, dt: str) -> dict:
    from napkin.distributed import Attention2D, RingAttention, new_grid

    d = napkin.load_text(TEXT.format(dt=dt, mesh=MESH[mesh]), "gated_d.ncd")
    dtype = torch.float64 if dt == "fp64" else torch.float32
    g = torch.Generator().manual_seed(5)
    full = [torch.randn(2, 2, N, 16, generator=g, dtype=dtype) for _ in range(3)] + \
        [torch.rand(2, 2, N, generator=g, dtype=dtype) * 2 - 0.5]    # a gate of either sign
    weight = torch.randn(2, 2, N, 16, generator=g, dtype=torch.float64)
    if mesh == "ring":
        fn, place, where = RingAttention(d), None, {"group": None}
    else:
        place = new_grid(2, 2)
        fn, where = Attention2D(d), {"grid": place}
    local = [fn.shard(t, place, N, 2).clone().requires_grad_() for t in full]
    out = fn(*local, **where, q_len=N, timeout=30.0)
    (out.double() * fn.shard(weight, place, N, 2)).sum().backward()
    got = [fn.gather(out.detach(), place, N, 2)] + [fn.gather(t.grad, place, N, 2) for t in local]
    xs = [t.double().requires_grad_() for t in full]
    s = (xs[0] @ xs[1].transpose(-1, -2) * 0.25).masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1),
                                                             float("-inf"))
    want = s.softmax(-1) @ (xs[2] * xs[3][..., None])
    (want * weight).sum().backward()
    exact = [want.detach()] + [x.grad for x in xs]
    return {"errors": [(a.double() - b).abs().max().item() for a, b in zip(got, exact)],
            "scales": [b.abs().max().item() for b in exact],
            "backward_launches": getattr(fn.local, "backward_launches", 0)}


def _worker(rank: int, world: int, init: str, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ["TRITON_INTERPRET"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    results = {}
    for case in CASES:
        try:
            results["-".join(case)] = run_case(*case)
        except Exception as err:  # recorded, so one broken case does not hide the others
            results["-".join(case)] = f"{type(err).__name__}: {err}"
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    try:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
    finally:
        os._exit(0)


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    return run_ranks(_worker, WORLD, tmp_path_factory.mktemp("distributed_gate"), DEADLINE_S)


@pytest.mark.parametrize("case", CASES, ids="-".join)
def test_a_gated_value_across_devices_matches_float64_torch(suite, case):
    """O, dQ, dK, dV and dgate on every rank; float32's backward from the generated kernels (one
    local backward launch a step at least: the ring's four, the grid's one)."""
    tol = 1e-12 if case[1] == "fp64" else 2e-5
    for rank, res in enumerate(suite):
        got = res["-".join(case)]
        assert isinstance(got, dict), f"rank {rank}: {got}"
        for name, err, scale in zip(("O", "dQ", "dK", "dV", "dgate"), got["errors"], got["scales"]):
            assert err <= tol * max(1.0, scale), f"rank {rank}: {name} off by {err:.3g} (scale {scale:.3g})"
        if case[1] == "fp32":
            assert got["backward_launches"] >= 1, f"rank {rank}"
