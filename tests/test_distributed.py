"""ATTENTION2D and Ring Attention across processes (gloo on the CPU).

The multi-process part runs once per module: a fixture spawns 4 ranks, each
runs every case below (forward, backward, byte counts) and the error cases,
and writes what it saw to a JSON file; the tests then assert on those
results, one test per case and property.  Every wait has a timeout and the
fixture kills the ranks after a deadline, so a bug cannot hang the suite.

References are independent of napkin: explicit float64 torch math (with
autograd for gradients) and scaled_dot_product_attention.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import napkin
from spawn import max_error, run_ranks
from napkin.cost import collectives as C
from napkin.distributed import (Attention2D, CommCounter, RingAttention, TokenLayout, merge_softmax,
                                predicted_comm, roles)
from napkin.errors import NapkinError

REPO = Path(__file__).resolve().parent.parent
WORLD = 4
D = 16
DEADLINE_S = 240

# --------------------------------------------------------------------------
# Diagrams: the shipped examples with a small head dim, and two variants.
# --------------------------------------------------------------------------

# each variant: its example, then the (old, new) replacements made in it
_VARIANTS = {
    # grouped-query attention with a causal mask
    "gqa_causal": ("gqa", ("S[b, hk, g, q, x] = sum[d](Q * K) * |d|^-0.5",
                           "S[b, hk, g, q, x] = where(x <= q, sum[d](Q * K) * |d|^-0.5, -inf)")),
    # a strict mask: query 0 sees no key at all (O = 0, lse = -inf, no NaN)
    "strict": ("causal", ("where(x <= q,", "where(x < q,")),
    # chunks of 4 (examples/chunked_attention.ncd's mask, shorter): a share's tiles across a chunk's
    # edge are dead, decided from the positions by the chunk bounds
    "chunked": ("causal", ("where(x <= q,", "where(x <= q and x // 4 == q // 4,")),
    # a scalar input (a learned temperature), passed whole to every rank as slope[h] is
    "temperature": ("causal", ("sum[d](Q * K) * |d|^-0.5", "sum[d](Q * K) * t"),
                    ("in V[b, h, x, d] : fp16", "in V[b, h, x, d] : fp16\nin t : fp32")),
}


def diagram_text(name: str) -> str:
    base, *replace = _VARIANTS.get(name, (name,))
    text = (REPO / "examples" / f"{base}.ncd").read_text()
    for old, new in replace:
        assert old in text
        text = text.replace(old, new)
    for fixed in ("wire d = 64", "wire d = 128"):
        text = text.replace(fixed, f"wire d = {D}")
    return text


def load(name: str):
    return napkin.load_text(diagram_text(name), f"{name}.ncd")


# --------------------------------------------------------------------------
# The cases every rank runs.
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    scheme: str        # "2x2", "1x4", "4x1" (ATTENTION2D grids) or "ring"
    diagram: str
    n_q: int
    n_x: int
    dtype: str = "float64"

    @property
    def name(self) -> str:
        return f"{self.scheme}-{self.diagram}-q{self.n_q}-x{self.n_x}-{self.dtype}"

    @property
    def heads(self) -> tuple[int, int]:
        return (4, 2) if self.diagram.startswith("gqa") else (2, 2)

    @property
    def causal(self) -> bool:
        return self.diagram in ("causal", "gqa_causal", "alibi", "chunked", "temperature")

    @property
    def family(self) -> str:
        return "sum" if self.diagram == "sigmoid_attention" else "softmax"

    @property
    def grid(self):
        return (WORLD,) if self.scheme == "ring" else tuple(int(v) for v in self.scheme.split("x"))


def cases() -> list[Case]:
    out = []
    for scheme in ("2x2", "1x4", "4x1", "ring"):
        for diagram in ("attention", "causal", "gqa", "gqa_causal"):
            for n in (16, 13):
                out.append(Case(scheme, diagram, n, n))
    for scheme in ("2x2", "ring"):
        out += [Case(scheme, "attention", 13, 19), Case(scheme, "alibi", 13, 13),
                Case(scheme, "sigmoid_attention", 13, 13), Case(scheme, "strict", 13, 13),
                Case(scheme, "causal", 13, 13, "float32"), Case(scheme, "temperature", 13, 13)]
    # float32: the forward runs the generated Triton kernel (interpreted here)
    out += [Case("2x2", "gqa_causal", 13, 19, "float32"), Case("ring", "alibi", 13, 13, "float32"),
            Case("ring", "chunked", 13, 13, "float32"), Case("2x2", "chunked", 13, 13, "float32"),
            Case("ring", "temperature", 13, 13, "float32")]
    return out


CASES = cases()
CASE_IDS = [c.name for c in CASES]


def reference(case: Case, q, k, v, slope=None, t=None):
    """Explicit float64 attention, independent of napkin."""
    hq, hkv = q.shape[1], k.shape[1]
    kk, vv = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    s = q @ kk.transpose(-1, -2) * (1 / math.sqrt(q.shape[-1]) if t is None else t)
    qi = torch.arange(q.shape[2])[:, None]
    xi = torch.arange(k.shape[2])[None, :]
    if case.diagram == "sigmoid_attention":
        return torch.sigmoid(s - math.log(k.shape[2])) @ vv, None
    if case.diagram == "alibi":
        s = s + slope[None, :, None, None] * (xi - qi)
    if case.causal:
        s = s.masked_fill(xi > qi, float("-inf"))
    if case.diagram == "strict":
        s = s.masked_fill(xi >= qi, float("-inf"))
    if case.diagram == "chunked":
        s = s.masked_fill(xi // 4 != qi // 4, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.where(torch.isneginf(lse)[..., None], torch.zeros_like(s), torch.softmax(s, -1).nan_to_num(0.0))
    return p @ vv, lse


def run_case(case: Case, grids: dict, rank: int) -> dict:
    dtype = getattr(torch, case.dtype)
    gen = torch.Generator().manual_seed(1234)
    hq, hkv = case.heads
    q = torch.randn(1, hq, case.n_q, D, generator=gen, dtype=torch.float64)
    k = torch.randn(1, hkv, case.n_x, D, generator=gen, dtype=torch.float64)
    v = torch.randn(1, hkv, case.n_x, D, generator=gen, dtype=torch.float64)
    g_out = torch.randn(1, hq, case.n_q, D, generator=gen, dtype=torch.float64)
    g_lse = torch.randn(1, hq, case.n_q, generator=gen, dtype=torch.float64)
    side = {"alibi": {"slope": torch.tensor([0.5, 0.25], dtype=torch.float64)},
            "temperature": {"t": torch.tensor(0.375, dtype=torch.float64)}}.get(case.diagram, {})

    # reference: float64 autograd
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref_o, ref_lse = reference(case, *leaves, **side)
    torch.autograd.backward([ref_o] + ([ref_lse] if ref_lse is not None else []),
                            [g_out] + ([g_lse] if ref_lse is not None else []))
    ref_grads = [t.grad for t in leaves]
    if case.diagram in ("attention", "causal", "gqa", "gqa_causal"):
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=case.causal, enable_gqa=True)
    else:
        sdpa = None

    diagram = load(case.diagram)
    ring = case.scheme == "ring"
    fn = RingAttention(diagram) if ring else Attention2D(diagram)
    where = dict(group=None) if ring else dict(grid=grids[case.scheme])
    place = where["group"] if ring else where["grid"]

    def shard(t, n):
        return fn.shard(t.to(dtype), place, n, 2)

    mine = [shard(q, case.n_q).requires_grad_(True), shard(k, case.n_x).requires_grad_(True),
            shard(v, case.n_x).requires_grad_(True)]
    side = {n: t.to(dtype) for n, t in side.items()}
    # a scalar passes as a Python number too (split_side makes it a tensor on the tokens' device)
    given = {n: float(t) for n, t in side.items()} if case.diagram == "temperature" and ring else side
    with CommCounter() as cc:
        out = fn(*mine, q_len=case.n_q, x_len=case.n_x, timeout=30.0, **given, **where)
        o, lse = (out if isinstance(out, tuple) else (out, None))
        if lse is None and ref_lse is not None:   # the diagram does not output lse
            ref_lse_check = None
        else:
            ref_lse_check = ref_lse
        full_o = fn.gather(o.detach(), place, case.n_q, 2, timeout=30.0)
        full_lse = fn.gather(lse.detach(), place, case.n_q, 2, timeout=30.0) if lse is not None else None
        outs, grads = [o], [shard(g_out, case.n_q)]
        if lse is not None:
            outs.append(lse)
            grads.append(shard(g_lse, case.n_q))
        if lse is None and ref_lse is not None:
            # the loss only reaches O: redo the reference gradient without lse
            leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
            r_o, _ = reference(case, *leaves, **{n: t.double() for n, t in side.items()})
            r_o.backward(g_out)
            ref_grads = [t.grad for t in leaves]
        torch.autograd.backward(outs, grads)
        full_grads = [fn.gather(t.grad, place, n, 2, timeout=30.0)
                      for t, n in zip(mine, (case.n_q, case.n_x, case.n_x))]
    sizes = dict(b=1, hq=hq, hkv=hkv, d=D, q=case.n_q, x=case.n_x)
    scheme = "ring" if ring else "attention2d"
    moved = C.Moved.attention(sizes, case.dtype.replace("float", "fp"), case.family)
    steps = 1
    if ring:        # a zigzag ring its mask cuts short (chunks) runs fewer steps, both ways round
        back, ahead = fn.arms(WORLD, case.n_q, case.n_x)
        steps = back + ahead
        if steps < WORLD:
            moved = dataclasses.replace(moved, layout=fn.layout, reach=back, ahead=ahead)
    return {
        "steps": steps,
        "kernel_launches": getattr(fn.local, "launches", 0),
        "backward_launches": getattr(fn.local, "backward_launches", 0),
        "o": max_error(full_o, ref_o),
        "lse": max_error(full_lse, ref_lse_check) if ref_lse_check is not None else 0.0,
        "sdpa": max_error(full_o, sdpa) if sdpa is not None else 0.0,
        "grads": [max_error(a, b) for a, b in zip(full_grads, ref_grads)],
        "counted": {ph: list(cc.total(ph)) for ph in ("check", "forward", "backward")},
        "predicted": {ph: list(C.rank_bytes(scheme, case.grid, moved, ph)[rank])
                      for ph in ("check", "forward", "backward")},
    }


def _expect_error(fn) -> str:
    try:
        fn()
    except (ValueError, RuntimeError) as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def error_cases(grids: dict, rank: int) -> dict:
    import torch.distributed as dist
    gen = torch.Generator().manual_seed(7)
    full = torch.randn(1, 2, 16, D, generator=gen, dtype=torch.float64)
    a2d = Attention2D(load("attention"))
    rg = RingAttention(load("attention"))
    mesh = grids["2x2"]
    out = {}
    q = a2d.shard(full, mesh, 16, 2)
    bad = q[:, :1] if rank == 3 else q             # rank 3 has one head fewer
    out["mismatch"] = _expect_error(lambda: a2d(bad, q, q, grid=mesh, q_len=16, timeout=20.0))
    out["rows"] = _expect_error(lambda: a2d(q, q, q, grid=mesh, q_len=9, timeout=20.0))
    rq = rg.shard(full, None, 16, 2)
    rk = rq.float() if rank == 1 else rq
    out["dtype"] = _expect_error(lambda: rg(rq, rk, rq, q_len=16, timeout=20.0))
    from napkin.distributed import new_grid
    out["grid"] = _expect_error(lambda: new_grid(2, 3))      # 6 ranks asked of 4: refused before any group
    out["ndim"] = _expect_error(lambda: rg(rq[0], rq[0], rq[0], q_len=16, timeout=20.0))   # it was an IndexError
    alibi = RingAttention(load("alibi"))
    slope = torch.rand(2, dtype=torch.float64, generator=gen).requires_grad_()
    out["side_grad"] = _expect_error(lambda: alibi(rq, rq, rq, slope=slope, q_len=16, timeout=20.0))
    # rank 2's slope one ulp off: its shapes agree, so only the values tell
    other = torch.nextafter(slope.detach(), torch.ones(())) if rank == 2 else slope.detach()
    out["side_values"] = _expect_error(lambda: alibi(rq, rq, rq, slope=other, q_len=16, timeout=20.0))
    # O requires grad: its gather (the docs' own usage, after O.backward) failed in gloo, reported as a timeout
    o, _ = rg(rq.clone().requires_grad_(), rq, rq, q_len=16, timeout=20.0)
    ref = torch.nn.functional.scaled_dot_product_attention(full, full, full)
    out["gather_grad"] = max_error(rg.gather(o, None, 16, 2, timeout=20.0), ref)
    # the gradient of (lse ** 2).sum() is inf on padding rows (lse = -inf there): the float64
    # path made delta inf and the NaN of 0 * inf reached real rows' dK on every rank (helper's hunt)
    causal, q13 = load("causal"), torch.randn(1, 2, 13, D, generator=gen, dtype=torch.float64)
    leaves = [q13.clone().requires_grad_() for _ in range(3)]
    ref_o, ref_lse = reference(Case("ring", "causal", 13, 13), *leaves)
    (ref_o.sum() + (ref_lse ** 2).sum()).backward()
    for name, fn, where, place in (("padding_dlse_ring", RingAttention(causal), dict(group=None), None),
                                   ("padding_dlse_2x2", Attention2D(causal), dict(grid=mesh), mesh)):
        mine = [fn.shard(q13, place, 13, 2).requires_grad_() for _ in range(3)]
        o, lse = fn(*mine, q_len=13, timeout=20.0, **where)
        (o.sum() + (lse ** 2).sum()).backward()
        got = [fn.gather(t.grad, place, 13, 2, timeout=20.0) for t in mine]
        out[name] = [max_error(a, b.grad) for a, b in zip(got, leaves)]
    # x_len=0 was taken as x_len=q_len (x_len or q_len): 16 keys where none were said
    out["x_len_0"] = _expect_error(lambda: rg(rq, rq, rq, q_len=16, x_len=0, timeout=20.0))
    # ranks that disagree on the token layout, or on the diagram, computed another function together
    lay = RingAttention(load("attention"), layout="contiguous" if rank == 1 else "zigzag")
    out["layout"] = _expect_error(lambda: lay(rq, rq, rq, q_len=16, timeout=20.0))
    other = RingAttention(load("causal" if rank == 2 else "attention"))
    out["diagram"] = _expect_error(lambda: other(rq, rq, rq, q_len=16, timeout=20.0))
    # last: rank 0 never calls; the others must give up after the timeout
    fresh = dist.new_group(list(range(WORLD)))
    t0 = time.monotonic()
    if rank == 0:
        out["timeout"] = "skipped"
    else:
        out["timeout"] = _expect_error(lambda: rg(rq, rq, rq, group=fresh, q_len=16, timeout=2.0))
    out["timeout_s"] = time.monotonic() - t0
    return out


def emitted_case(grids: dict) -> dict:
    """The function emitted into generated modules, run for real."""
    from napkin.distributed.emit import distributed_source
    ns: dict = {}
    exec(compile(distributed_source(load("attention_2d")), "<emitted>", "exec"), ns)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 13, D, generator=gen, dtype=torch.float64) for _ in range(3))
    mesh = grids["2x2"]
    shard = ns["attention_2d_distributed_shard"]
    o, lse = ns["attention_2d_distributed"](shard(q, mesh, 13, 2), shard(k, mesh, 13, 2), shard(v, mesh, 13, 2),
                                            mesh, q_len=13, timeout=20.0)
    full = ns["attention_2d_distributed_gather"](o, mesh, 13, 2, timeout=20.0)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    # Ring Attention over a 1-D DeviceMesh instead of a process group
    from torch.distributed.device_mesh import init_device_mesh
    ring, line = RingAttention(load("ring_attention")), init_device_mesh("cpu", (WORLD,))
    o2, _ = ring(*(ring.shard(t, line, 13, 2) for t in (q, k, v)), group=line, q_len=13, timeout=20.0)
    # the function the code generator appended to generated/attention_2d.py
    # (d = 64), float32: its forward runs the module's kernel
    from generated.attention_2d import attention_2d_distributed, attention_2d_distributed_gather
    q3, k3, v3 = (torch.randn(1, 2, 13, 64, generator=gen, dtype=torch.float64) for _ in range(3))
    o3, _ = attention_2d_distributed(*(shard(t.float(), mesh, 13, 2) for t in (q3, k3, v3)), mesh, q_len=13,
                                     timeout=20.0)
    full3 = attention_2d_distributed_gather(o3, mesh, 13, 2, timeout=20.0)
    return {"o": max_error(full, ref), "ring_mesh": max_error(ring.gather(o2, line, 13, 2, timeout=20.0), ref),
            "generated": max_error(full3, torch.nn.functional.scaled_dot_product_attention(q3, k3, v3))}


def _worker(rank: int, world: int, init: str, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from napkin.distributed import new_grid
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    grids = {"2x2": init_device_mesh("cpu", (2, 2)), "1x4": new_grid(1, 4), "4x1": new_grid(4, 1)}
    results = {}
    for case in CASES:
        try:
            results[case.name] = run_case(case, grids, rank)
        except Exception as err:  # recorded, so one broken case does not hide the others
            results[case.name] = {"error": f"{type(err).__name__}: {err}"}
    try:
        results["emitted"] = emitted_case(grids)
    except Exception as err:
        results["emitted"] = {"error": f"{type(err).__name__}: {err}"}
    results["errors"] = error_cases(grids, rank)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    # ranks 1..3 left a handshake pending on the timed-out group: leave
    # without tearing the groups down collectively
    os._exit(0)


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    return run_ranks(_worker, WORLD, tmp_path_factory.mktemp("distributed"), DEADLINE_S)


# --------------------------------------------------------------------------
# Multi-process tests.
# --------------------------------------------------------------------------

def _tol(case: Case) -> float:
    return 1e-10 if case.dtype == "float64" else 2e-5


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_forward_matches_reference(suite, case):
    for rank, res in enumerate(suite):
        got = res[case.name]
        assert "error" not in got, f"rank {rank}: {got.get('error')}"
        assert got["o"] <= _tol(case), f"rank {rank}: O error {got['o']}"
        assert got["lse"] <= _tol(case), f"rank {rank}: lse error {got['lse']}"
        assert got["sdpa"] <= _tol(case), f"rank {rank}: O vs SDPA {got['sdpa']}"


@pytest.mark.parametrize("case", [c for c in CASES if c.dtype == "float32"],
                         ids=[c.name for c in CASES if c.dtype == "float32"])
def test_float32_forward_runs_the_generated_kernel(suite, case):
    """float64 goes to the eager local (the reference path); float32 to the
    generated Triton kernel, once per local attention call (ring: one per
    step it runs; the chunked mask cuts the zigzag ring to 3 of 4, 2 steps
    back and 1 ahead)."""
    for rank, res in enumerate(suite):
        got = res[case.name]
        assert "error" not in got, f"rank {rank}: {got.get('error')}"
        assert got["kernel_launches"] == got["steps"], f"rank {rank}"
        assert got["steps"] == (3 if case.diagram == "chunked" and case.scheme == "ring" else
                                WORLD if case.scheme == "ring" else 1), f"rank {rank}"


@pytest.mark.parametrize("case", [c for c in CASES if c.dtype == "float32"],
                         ids=[c.name for c in CASES if c.dtype == "float32"])
def test_float32_backward_runs_the_generated_kernels(suite, case):
    """float32 gradients come from the generated backward kernels (given the
    merged lse and delta), once per local backward call (ring: one per step);
    test_backward_matches_reference checks their values.  alibi's local
    kernel adds lse = logsumexp[x](...) with the score written inline: it
    trains since the inline score is boxed (it had no backward, and its
    gradients were autograd of the eager local)."""
    for rank, res in enumerate(suite):
        got = res[case.name]
        assert "error" not in got, f"rank {rank}: {got.get('error')}"
        assert got["backward_launches"] == got["steps"], f"rank {rank}"


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_backward_matches_reference(suite, case):
    for rank, res in enumerate(suite):
        got = res[case.name]
        assert "error" not in got, f"rank {rank}: {got.get('error')}"
        for name, e in zip("QKV", got["grads"]):
            assert e <= 10 * _tol(case), f"rank {rank}: d{name} error {e}"


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_counted_bytes_equal_prediction(suite, case):
    for rank, res in enumerate(suite):
        got = res[case.name]
        assert "error" not in got, f"rank {rank}: {got.get('error')}"
        assert got["counted"] == got["predicted"], f"rank {rank}"


def test_attention2d_sends_fewer_bytes_than_ring_multihead(suite):
    a2d = suite[0][Case("2x2", "attention", 16, 16).name]["counted"]["forward"][0]
    ring = suite[0][Case("ring", "attention", 16, 16).name]["counted"]["forward"][0]
    assert 0 < a2d < ring


def test_emitted_function_and_ring_over_a_device_mesh(suite):
    for rank, res in enumerate(suite):
        got = res["emitted"]
        assert "error" not in got, f"rank {rank}: {got.get('error')}"
        assert got["o"] <= 1e-10, f"rank {rank}: {got['o']}"
        assert got["ring_mesh"] <= 1e-10, f"rank {rank}: {got['ring_mesh']}"
        assert got["generated"] <= 2e-5, f"rank {rank}: {got['generated']}"


def test_mismatched_shapes_raise_on_every_rank(suite):
    for rank, res in enumerate(suite):
        msg = res["errors"]["mismatch"]
        assert msg.startswith("ValueError") and "differs across devices" in msg, f"rank {rank}: {msg}"


def test_rows_that_do_not_fit_the_layout_raise_on_every_rank(suite):
    for rank, res in enumerate(suite):
        msg = res["errors"]["rows"]
        assert msg.startswith("ValueError") and "need 3" in msg, f"rank {rank}: {msg}"


def test_a_grid_larger_than_the_world_is_refused_in_words(suite):
    for rank, res in enumerate(suite):
        msg = res["errors"]["grid"]
        assert msg == ("ValueError: a 2 x 3 grid needs ranks 0..5, but the default group has 4: launch 6 "
                       "processes (torchrun --nproc-per-node 6) or ask for a grid of at most 4 ranks"), msg


def test_mismatched_dtypes_raise_on_every_rank(suite):
    for rank, res in enumerate(suite):
        msg = res["errors"]["dtype"]
        assert msg.startswith("ValueError") and "float32" in msg, f"rank {rank}: {msg}"


def test_inputs_of_another_rank_and_side_inputs_wanting_gradients_are_refused_in_words(suite):
    for rank, res in enumerate(suite):
        assert res["errors"]["ndim"] == "ValueError: Q has 3 dimensions on each device, but the diagram declares 4"
        assert res["errors"]["side_grad"] == (
            "ValueError: side input(s) slope require gradients, which the distributed wrappers do not compute "
            "(their .grad would stay empty): pass them detached"), res["errors"]["side_grad"]
        assert res["errors"]["side_values"] == (
            "ValueError: side input slope holds other values on ring rank 2 than on ring rank 0 (a crc32 of its "
            "bytes differs): side inputs are passed whole, the same on every device"), res["errors"]["side_values"]


def test_padding_rows_lse_gradient_stays_on_padding_rows(suite):
    """dlse on padding rows is inf for (lse ** 2).sum(); delta there is zero now."""
    for rank, res in enumerate(suite):
        for name in ("padding_dlse_ring", "padding_dlse_2x2"):
            assert all(e <= 1e-10 for e in res["errors"][name]), (rank, name, res["errors"][name])


def test_disagreeing_lengths_layouts_and_diagrams_raise_on_every_rank(suite):
    for rank, res in enumerate(suite):
        errors = res["errors"]
        assert errors["x_len_0"] == "ValueError: a sequence needs at least one token, not 0", (rank, errors["x_len_0"])
        for what in ("layout", "diagram"):
            part = 1 if what == "layout" else 2
            assert errors[what].startswith(f"ValueError: ring rank {part} called with scheme/lengths/layout/diagram"), \
                (rank, what, errors[what])


def test_side_inputs_named_like_the_schemes_keywords_are_refused_at_compile_time():
    """A side input called grid crashed the compiler (keyword argument
    repeated), one called self or q_pos failed every call, delta or dO the
    backward (helper's hunt).  SIDE_KEYWORDS holds every keyword of the
    functions side inputs travel through."""
    import inspect

    from napkin.distributed import emit, local, tree
    from napkin.distributed.attention2d import Attention2D as A2
    from napkin.distributed.ring import RingAttention as RA
    text = diagram_text("ring_attention").replace("in V[b, h, x, d] : bf16", "in V[b, h, x, d] : bf16\nin side[h] : fp32")
    text = text.replace("sum[d](Q * K) * |d|^-0.5", "sum[d](Q * K) * |d|^-0.5 + side[h] * (x - q)")
    emit.distributed_source(napkin.load_text(text, "side.ncd"))   # a side input of another name: fine
    refused = []
    for name in emit.SIDE_KEYWORDS:
        try:
            d = napkin.load_text(text.replace("side", name), f"{name}.ncd")
        except NapkinError as err:   # group: a reserved word; lse: this diagram's output
            assert "is a reserved word" in str(err) or "duplicate name 'lse'" in str(err), err
            continue
        refused.append(name)
        with pytest.raises(NapkinError, match=rf"napkin cannot emit a distributed launcher for side input {name}: "
                                              rf"the distributed schemes pass side inputs by name beside their own "
                                              rf"keyword {name}"):
            emit.distributed_source(d)
    assert {"grid", "self", "q_pos", "delta", "dO"} <= set(refused), refused
    keywords = set()
    for fn in (A2.__call__, RA.__call__, tree.TreeAttention.__call__, local.KernelLocal.__call__,
               local.KernelLocal.backward, local.EagerLocal.__call__):
        keywords |= {p.name for p in inspect.signature(fn).parameters.values()
                     if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    assert keywords - set(emit.LAUNCHER_PARAMETERS) <= set(emit.SIDE_KEYWORDS), keywords


def test_an_output_that_requires_grad_gathers(suite):
    for rank, res in enumerate(suite):
        assert res["errors"]["gather_grad"] <= 1e-10, f"rank {rank}: {res['errors']['gather_grad']}"


def test_a_missing_peer_times_out_instead_of_hanging(suite):
    for rank, res in enumerate(suite[1:], start=1):
        msg = res["errors"]["timeout"]
        assert msg.startswith("RuntimeError") and "(timeout 2 s)" in msg and "failed after " in msg, \
            f"rank {rank}: {msg}"
        assert res["errors"]["timeout_s"] < 15


# --------------------------------------------------------------------------
# Single-process tests: layouts, merge, roles, predictions.
# --------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["cyclic", "zigzag", "contiguous"])
@pytest.mark.parametrize("n", [1, 7, 16, 19])
def test_layout_round_trip_and_cover(kind, n):
    lay = TokenLayout(kind, 4, n)
    full = torch.arange(n * 3, dtype=torch.float32).reshape(1, n, 3)
    parts = lay.shards(full, 1)
    assert all(p.shape == (1, lay.rows, 3) for p in parts)
    assert torch.equal(lay.unshard(parts, 1), full)
    pos = torch.sort(lay.all_positions()).values
    assert torch.equal(pos, torch.arange(lay.padded))     # every position exactly once
    for p in range(4):                                     # padding rows are zeros
        pad = lay.positions(p) >= n
        assert torch.all(parts[p][:, pad] == 0)


def test_layout_positions():
    assert TokenLayout("cyclic", 4, 10).positions(1).tolist() == [1, 5, 9]
    assert TokenLayout("zigzag", 2, 8).positions(0).tolist() == [0, 1, 6, 7]
    assert TokenLayout("zigzag", 2, 8).positions(1).tolist() == [2, 3, 4, 5]
    assert TokenLayout("contiguous", 4, 10).positions(3).tolist() == [9, 10, 11]


def test_merge_equals_softmax_over_all_keys():
    gen = torch.Generator().manual_seed(0)
    s = torch.randn(3, 5, 12, generator=gen, dtype=torch.float64) * 30     # large scores
    v = torch.randn(12, 4, generator=gen, dtype=torch.float64)
    s[0, 0, :] = float("-inf")                                              # a row with no key
    s[1, 2, :6] = float("-inf")                                             # a part with no key
    parts = [slice(0, 6), slice(6, 9), slice(9, 12)]
    outs, lses = [], []
    for sl in parts:
        lse = torch.logsumexp(s[..., sl], -1)
        p = torch.softmax(s[..., sl], -1).nan_to_num(0.0)
        outs.append(p @ v[sl])
        lses.append(lse)
    o, lse = merge_softmax(torch.stack(outs), torch.stack(lses))
    full_lse = torch.logsumexp(s, -1)
    full_o = (torch.softmax(s, -1).nan_to_num(0.0)) @ v
    assert torch.equal(torch.isneginf(lse), torch.isneginf(full_lse))
    fin = torch.isfinite(full_lse)
    assert torch.allclose(lse[fin], full_lse[fin], rtol=0, atol=1e-12)
    assert torch.allclose(o, full_o, rtol=0, atol=1e-12)
    assert not torch.isnan(o).any()


def test_merge_does_not_overflow_in_fp32():
    outs = torch.ones(2, 1, 3)
    lses = torch.tensor([[1000.0], [999.0]])
    o, lse = merge_softmax(outs, lses)
    assert torch.isfinite(o).all() and torch.allclose(o, torch.ones(1, 3))
    assert abs(float(lse) - (1000.0 + math.log1p(math.exp(-1.0)))) < 1e-3


def test_merge_refuses_half_precision_states():
    with pytest.raises(ValueError, match="float32 or float64"):
        merge_softmax(torch.ones(2, 1, 3, dtype=torch.bfloat16), torch.zeros(2, 1))


def test_roles_read_the_devices_level():
    assert roles(load("attention_2d")).scheme == ("attention2d", (2, 2))
    assert roles(load("ring_attention")).scheme == ("ring", (4,))
    r = roles(load("gqa"))
    assert (r.tokens, r.token_wire, r.lse, r.family) == (("Q", "K", "V"), ("q", "x", "x"), "lse", "softmax")
    assert roles(load("sigmoid_attention")).family == "sum"
    assert roles(load("alibi")).side == ("slope",)


def test_kernel_local_takes_only_the_options_both_launchers_take():
    """KernelLocal(roles, chunk=16) ran the forward, then NAME_backward refused chunk= with a Ring
    pass in flight and the group broken (dist2 hunt); positions=/lengths=/out_dtype= are its own."""
    from napkin.distributed.local import KernelLocal

    r = roles(load("ring_attention"))
    for bad in ({"chunk": 16}, {"out_dtype": torch.float16}, {"positions": None}, {"block_d": 16}):
        with pytest.raises(TypeError, match="KernelLocal takes the launch options block_q, block_x, num_warps, "
                                            "num_stages, tma, not " + next(iter(bad))):
            KernelLocal(r, **bad)
    assert KernelLocal(r, block_q=16, block_x=16, num_warps=2, tma=False).options["block_q"] == 16


def test_side_inputs_hold_the_global_lengths_and_a_relabel_makes_them_equal(monkeypatch):
    """doc[b, q] of doc[b, x] through Ring with q_len 19 and x_len 13: the float64 local raised torch's
    index error and the float32 kernel accepted a 19-row doc, each with a pass in flight; an 18-row doc
    for 13 tokens passed the kernel (dist2 hunt).  The handshake's table refuses both, on every rank."""
    from napkin.distributed import common

    r = roles(load("document_mask"))
    assert r.side == ("doc",)
    monkeypatch.setattr(common.G, "shape_at", lambda table, k: table[k])
    table = [None, None, None, (2, 13)]                     # Q, K, V, then doc[b, x]
    common._check_side_lengths(r, table, 3, {"q": 13, "x": 13})
    with pytest.raises(ValueError, match="side input doc holds 18 entries along x, but x's global length is 13"):
        common._check_side_lengths(r, [None, None, None, (2, 18)], 3, {"q": 13, "x": 13})
    with pytest.raises(ValueError, match=r"side input doc is read along q as well as x, so q_len \(19\) and "
                                         r"x_len \(13\) must be equal"):
        common._check_side_lengths(r, table, 3, {"q": 19, "x": 13})


def test_roles_refuse_what_cannot_be_merged():
    with pytest.raises(NapkinError, match="query and key wires"):
        roles(load("matmul"))
    text = diagram_text("attention").replace("out O, lse", "M[b, h, q] = max[x](S)\nout O, M")
    with pytest.raises(NapkinError, match="neither a sum nor a logsumexp"):
        roles(napkin.load_text(text))
    # a ratio of sums on a 2 x 2 grid was blamed on the levels ("ATTENTION2D
    # needs exactly one device-split wire reduced by the output")
    l2 = (REPO / "examples" / "l2_attention.ncd").read_text().replace(
        "level hbm", "level devices {\n    group q across 2\n    group x across 2\n  }\n  level hbm")
    with pytest.raises(NapkinError) as err:
        roles(napkin.load_text(l2, "l2.ncd"))
    # named after the file the diagram was loaded from (the IR keeps no file names: napkin.located)
    assert str(err.value).splitlines()[:3] == [
        "l2.ncd:15:1: cannot distribute this diagram: output O is not a sum over the key wire",
        "    O[b, h, q, d] : fp16 = sum[x](S * V) / sqrt(sum[x](S * S) + 1e-6)", "    ^"]


def test_prediction_ratio_grows_with_devices():
    """Ring / ATTENTION2D forward bytes for multi-head attention, square
    grids: the per-device traffic of ATTENTION2D falls like 1/sqrt(P)."""
    sizes = dict(b=1, hq=32, hkv=32, d=128, q=8192)
    ratios = []
    for side in (2, 4, 8):
        p = side * side
        a2d = predicted_comm("attention2d", (side, side), sizes, "bf16")[0][0]
        ring = predicted_comm("ring", (p,), sizes, "bf16")[0][0]
        ratios.append(ring / a2d)
    assert ratios[0] < ratios[1] < ratios[2]


def test_predicted_comm_one_by_one_grid_sends_nothing():
    sizes = dict(b=1, hq=2, hkv=2, d=16, q=13)
    assert predicted_comm("attention2d", (1, 1), sizes, "fp32") == [(0, 0)]


def test_emitted_source_is_deterministic_and_only_for_device_levels():
    from napkin.distributed.emit import distributed_source
    a = distributed_source(load("ring_attention"))
    assert a == distributed_source(load("ring_attention"))
    compile(a, "<emitted>", "exec")
    assert "def ring_attention_distributed(Q, K, V, group=None, *, q_len" in a
    assert distributed_source(load("attention")) == ""


def test_a_matrix_products_epilogue_is_told_to_run_in_torch():
    """A function of one sum and no softmax (a linear layer's tanh(sum[k](X * W) + bias)) was
    refused with attention's hint about softmax and ratios of sums; it says what to do instead."""
    text = ("diagram lg\nwire m, n, k\nin X[m, k] : fp16\nin W[k, n] : fp16\nin bias[n] : fp16\n"
            "Y[m, n] : fp16 = tanh(sum[k](X * W) + bias)\nout Y\n")
    with pytest.raises(NapkinError) as err:
        roles(napkin.load_text(text, "lg.ncd"))
    assert str(err.value).splitlines()[0] == "lg.ncd:6:1: cannot distribute this diagram: output Y is not a sum " \
                                            "over the key wire"
    assert "  hint: the wrappers apply a function after the merge to softmax attention alone: make sum[k](...) " \
           "the output and apply the rest in torch" in str(err.value).splitlines()
