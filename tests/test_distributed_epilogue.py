"""Across devices: an output that is a function of the attention and its lse.

An attention sink's O = A * sigmoid(L - sink) has no exact merge of its
own partial states, but A and L have: the wrappers run the diagram with A
and L as its outputs (napkin/distributed/reading.py, split_epilogue) and
compute O from each device's merged rows in torch, so autograd takes the
gradient to the merge and to the sink.  4 gloo ranks run Ring Attention and
ATTENTION2D on 2 x 2, with and without a causal mask (and decoding's tree,
forward only), in float64 (the eager
local) and float32 (the generated kernels under TRITON_INTERPRET=1); the
outputs and every gradient (the sink's summed over the ranks, as a data-
parallel all-reduce would) are compared with float64 torch written without
napkin, the sink as one more softmax column.
"""
from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import napkin
from napkin.cost import analyse
from napkin.cost import collectives as C
from napkin.errors import NapkinError
from spawn import run_ranks

REPO = Path(__file__).resolve().parent.parent
WORLD, N, DEADLINE_S = 4, 37, 400
TEXT = """diagram sinkd
wire b, h, q, x
wire d = 16
in Q[b, h, q, d] : {dt}
in K[b, h, x, d] : {dt}
in V[b, h, x, d] : {dt}
in sink[h] : {dt}
S[b, h, q, x] = {score}
A[b, h, q, d] = sum[x](softmax[x](S) * V)
L[b, h, q] = logsumexp[x](S)
O[b, h, q, d] = {output}
out O
schedule on h100 {{
  accumulate fp32
  level devices {{ {mesh} }}
  level hbm {{ hold Q, K, V, sink, O }}
  level smem {{
    group b by 1, h by 1, q by 16
    stream x by 16
    hold S, A, L
  }}
}}
"""
MESH = {"ring": "group q across 4, x across 4", "2x2": "group q across 2, x across 2"}
SCORE = {"full": "sum[d](Q * K) * |d|^-0.5", "causal": "where(x <= q, sum[d](Q * K) * |d|^-0.5, -inf)"}
CASES = [(mesh, mask, dt) for mesh in MESH for mask in SCORE for dt in ("fp64", "fp32")]
GATE_CASES = [("ring", "causal", "fp32"), ("2x2", "causal", "fp64"), ("2x2", "full", "fp32")]


def text(mesh: str, mask: str, dt: str, output: str = "A * sigmoid(L - sink)") -> str:
    mesh_text = MESH[mesh].replace("group q across 4, x across 4", "group q across 4\n    stream x across 4")
    return TEXT.format(dt=dt, score=SCORE[mask], mesh=mesh_text, output=output)


def sink_torch(q, k, v, sink, causal):
    s = q @ k.transpose(-1, -2) * 0.25
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    s = torch.cat([s, sink.reshape(1, -1, 1, 1).expand(*s.shape[:-1], 1)], -1)
    return s.softmax(-1)[..., :-1] @ v


PLUS = "A * sigmoid(L - sink) + sink * L"    # reads L outside the sigmoid: -inf on padding rows


LSE_OUT = "lse output"   # the sink's diagram with an output lse = logsumexp[x](S) beside O
GATE = "A * sigmoid(L - sink) * sigmoid(G)"   # and a gate G[b, h, q, d]: each rank's own rows


def with_gate(src: str) -> str:
    return src.replace("in sink[h]", "in G[b, h, q, d] : {}\nin sink[h]".format(
        "fp64" if "Q[b, h, q, d] : fp64" in src else "fp32")).replace("hold Q, K, V, sink, O", "hold Q, K, V, G, sink, O")


def run_case(mesh: str, mask: str, dt: str, output: str = "A * sigmoid(L - sink)") -> dict:
    import torch.distributed as dist

    from napkin.distributed import Attention2D, CommCounter, RingAttention, new_grid
    src = text(mesh, mask, dt, "A * sigmoid(L - sink)" if output == LSE_OUT else output)
    if output == LSE_OUT:
        src = src.replace("out O", "lse[b, h, q] = logsumexp[x](S)\nout O, lse")
    if output == GATE:
        src = with_gate(src)
    d = napkin.load_text(src, "sinkd.ncd")
    dtype = torch.float64 if dt == "fp64" else torch.float32
    g = torch.Generator().manual_seed(5)
    full = [torch.randn(2, 2, N, 16, generator=g, dtype=dtype) for _ in range(3)] + \
        [torch.randn(2, generator=g, dtype=dtype)]
    weight = torch.randn(2, 2, N, 16, generator=g, dtype=torch.float64)
    if mesh == "ring":
        fn, place = RingAttention(d), None
        where = {"group": None}
    else:
        fn = Attention2D(d)
        place = new_grid(2, 2)
        where = {"grid": place}
    local = [fn.shard(t, place, N, 2).clone().requires_grad_() for t in full[:3]]
    sink = full[3].clone().requires_grad_()
    row_weight = torch.randn(2, 2, N, generator=g, dtype=torch.float64)
    gate = torch.randn(2, 2, N, 16, generator=g, dtype=dtype)
    rows = {}
    if output == GATE:   # its padding rows hold NaN: what a caller leaves there must not reach dG
        mine = fn.shard(gate, place, N, 2).clone()
        part = place.part if mesh == "2x2" else dist.get_rank()
        mine[:, :, fn.layouts(WORLD, N)[0].positions(part) >= N] = float("nan")
        rows = {"G": mine.requires_grad_()}
    with CommCounter() as cc:
        out = fn(*local, **where, q_len=N, sink=sink, timeout=30.0, **rows)
        out, lse = out if isinstance(out, tuple) else (out, None)
        loss = (out.double() * fn.shard(weight, place, N, 2)).sum()
        if lse is not None:   # padding rows' lse is -inf, their weight 0: left out, not 0 * -inf
            loss = loss + torch.where(fn.shard(row_weight, place, N, 2) != 0,
                                      lse.double() * fn.shard(row_weight, place, N, 2), 0.0).sum()
        loss.backward()
    counted = {ph: cc.total(ph)[0] for ph in C.PHASES}
    got = [fn.gather(out.detach(), place, N, 2)] + [fn.gather(t.grad, place, N, 2) for t in local + list(rows.values())]
    sink_grad = sink.grad.clone()
    dist.all_reduce(sink_grad)    # each rank's rows' part, as a data-parallel all-reduce adds them
    xs = [t.double().requires_grad_() for t in full]
    want = sink_torch(*xs, mask == "causal")
    scores = xs[0] @ xs[1].transpose(-1, -2) * 0.25
    if mask == "causal":
        scores = scores.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
    if output == PLUS:
        want = want + xs[3].reshape(1, -1, 1, 1) * scores.logsumexp(-1, True)
    if output == GATE:
        xs.append(gate.double().requires_grad_())
        want = want * torch.sigmoid(xs[4])
    wanted = (want * weight).sum()
    if output == LSE_OUT:
        got.append(fn.gather(lse.detach(), place, N, 2))
        wanted = wanted + (scores.logsumexp(-1) * row_weight).sum()
    wanted.backward()
    exact = [want.detach()] + [x.grad for x in xs[:3] + xs[4:]]
    if output == LSE_OUT:
        exact.append(scores.logsumexp(-1).detach())
    errors = [(a.double() - b).abs().max().item() for a, b in zip(got + [sink_grad], exact + [xs[3].grad])]
    return {"errors": errors, "counted": counted}


def run_tree(output: str = "A * sigmoid(L - sink)") -> list[float]:
    """Decoding (the queries whole, the keys over the 4 ranks, a butterfly merge): forward only."""
    from napkin.distributed import TreeAttention
    src = TEXT.format(dt="fp64", score=SCORE["full"], mesh="group x across 4", output=output)
    d = napkin.load_text(with_gate(src) if output == GATE else src, "sinkd.ncd")
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 2, n, 16, generator=g, dtype=torch.float64) for n in (3, N, N))
    sink = torch.randn(2, generator=g, dtype=torch.float64)
    gate = torch.randn(2, 2, 3, 16, generator=g, dtype=torch.float64)
    rows = {"G": gate} if output == GATE else {}    # whole, as the queries
    fn = TreeAttention(d)
    out = fn(q, fn.shard(k, None, N, 2), fn.shard(v, None, N, 2), group=None, q_len=3, x_len=N, sink=sink,
             timeout=30.0, **rows)
    want = sink_torch(q, k, v, sink, False) * (torch.sigmoid(gate) if rows else 1)
    return [(out - want).abs().max().item()]


def run_whole_gate() -> str:
    """The gate passed whole to Ring Attention (37 rows where each rank holds 10): refused alike on
    every rank by the handshake, before any collective of the attention."""
    from napkin.distributed import RingAttention
    d = napkin.load_text(with_gate(text("ring", "full", "fp64", GATE)), "sinkd.ncd")
    fn = RingAttention(d)
    g = torch.Generator().manual_seed(7)
    full = [torch.randn(2, 2, N, 16, generator=g, dtype=torch.float64) for _ in range(4)]
    try:
        fn(*(fn.shard(t, None, N, 2) for t in full[:3]), group=None, q_len=N, timeout=30.0,
           sink=torch.zeros(2, dtype=torch.float64), G=full[3])
    except ValueError as err:
        return str(err)
    return "no error"


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
    try:
        results["plus"] = run_case("ring", "full", "fp64", PLUS)
    except Exception as err:
        results["plus"] = f"{type(err).__name__}: {err}"
    try:
        results["lse"] = run_case("2x2", "causal", "fp64", LSE_OUT)
    except Exception as err:
        results["lse"] = f"{type(err).__name__}: {err}"
    for case in GATE_CASES:
        try:
            results["gate-" + "-".join(case)] = run_case(*case, GATE)
        except Exception as err:
            results["gate-" + "-".join(case)] = f"{type(err).__name__}: {err}"
    for key, run in (("tree", run_tree), ("tree-gate", lambda: run_tree(GATE)), ("whole-gate", run_whole_gate)):
        try:
            results[key] = run()
        except Exception as err:
            results[key] = f"{type(err).__name__}: {err}"
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    try:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
    finally:
        os._exit(0)


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    return run_ranks(_worker, WORLD, tmp_path_factory.mktemp("distributed_epilogue"), DEADLINE_S)


@pytest.mark.parametrize("case", CASES, ids="-".join)
def test_a_sink_across_devices_matches_float64_torch(suite, case):
    """Output, dQ, dK, dV and the sink's gradient on every rank: within float64's or float32's
    rounding of the single-device answer."""
    tol = 1e-12 if case[2] == "fp64" else 1e-5
    for rank, results in enumerate(suite):
        got = results["-".join(case)]
        assert isinstance(got, dict), f"rank {rank}: {got}"
        assert all(e < tol for e in got["errors"]), f"rank {rank}: output, dQ, dK, dV, dsink errors {got['errors']}"


def test_padding_rows_enter_the_function_as_zeros(suite):
    """37 tokens over 4 ranks in the zigzag layout leave 3 padding rows, whose lse is -inf: an F
    that reads L outside the sigmoid (O = A * sigmoid(L - sink) + sink * L) gave the sink a NaN
    gradient there (0 * -inf) until padding rows entered F as A = 0, L = 0."""
    for rank, results in enumerate(suite):
        got = results["plus"]
        assert isinstance(got, dict), f"rank {rank}: {got}"
        assert all(e < 1e-12 for e in got["errors"]), f"rank {rank}: output, dQ, dK, dV, dsink errors {got['errors']}"


def test_a_sink_when_decoding_across_devices(suite):
    """TreeAttention's merged rows, whole on every rank, then the sink's function."""
    for rank, results in enumerate(suite):
        assert isinstance(results["tree"], list) and results["tree"][0] < 1e-12, f"rank {rank}: {results['tree']}"


@pytest.mark.parametrize("case", CASES, ids="-".join)
def test_the_cost_pass_prices_what_the_sinks_wrappers_send(suite, case):
    """The cost pass reads the same A-and-L diagram the wrappers run: its handshake, forward
    and backward bytes are the busiest rank's, counted."""
    c = analyse(napkin.load_text(text(*case), "sinkd.ncd"), {"b": 2, "h": 2, "q": N, "x": N}).devices
    cost = {"check": c.handshake_bytes, "forward": c.bytes_sent, "backward": c.backward_bytes or 0}
    for ph in C.PHASES:
        assert cost[ph] == max(results["-".join(case)]["counted"][ph] for results in suite), ph


def test_the_attention_is_distributed_and_the_function_applied_after_the_merge():
    """roles() reads the diagram with A and L as its outputs (what merges exactly) and keeps F,
    and the sink, which F alone reads, may train."""
    from napkin.distributed.reading import roles
    r = roles(napkin.load_text(text("ring", "causal", "fp32"), "sinkd.ncd"))
    assert (r.value, r.lse, r.outputs, r.side) == ("A", "L", ("A", "L"), ("sink",))
    assert r.epilogue.output == "O" and r.epilogue.only == ("sink",)
    assert [o.name for o in r.epilogue.diagram.outputs] == ["O"]


def test_an_lse_output_beside_the_sink_is_the_lse_the_function_reads(suite):
    """O = A * sigmoid(L - sink) beside an output lse = logsumexp[x](S): one lse, the output's
    (the split made a second, row_lse, and the roles refused "two log-sum-exp outputs").  On the
    2 x 2 grid, causal: O, lse and every gradient through both (lse's weighted too) match."""
    for rank, results in enumerate(suite):
        got = results["lse"]
        assert isinstance(got, dict), f"rank {rank}: {got}"
        assert all(e < 1e-12 for e in got["errors"]), f"rank {rank}: O, dQ, dK, dV, lse, dsink {got['errors']}"
    from napkin.distributed.reading import roles
    src = text("ring", "causal", "fp32").replace("out O", "lse[b, h, q] = logsumexp[x](S)\nout O, lse")
    r = roles(napkin.load_text(src.replace("hold Q, K, V, sink, O", "hold Q, K, V, sink, O, lse"), "sinkd.ncd"))
    assert (r.value, r.lse, r.outputs) == ("A", "lse", ("A", "lse"))
    assert [o.name for o in r.epilogue.diagram.outputs] == ["O", "lse"]
    assert "sigmoid(lse - sink)" in str(napkin.printer.expr_text(r.epilogue.expr))


@pytest.mark.parametrize("case", GATE_CASES, ids="-".join)
def test_a_gate_along_the_query_wire_across_devices(suite, case):
    """O = A * sigmoid(L - sink) * sigmoid(G), G[b, h, q, d] a token input the attention does
    not read: each rank passes its own rows of it, laid out as its queries, and gets their
    gradient; output, dQ, dK, dV, dG and dsink match float64 torch."""
    tol = 1e-12 if case[2] == "fp64" else 1e-5
    for rank, results in enumerate(suite):
        got = results["gate-" + "-".join(case)]
        assert isinstance(got, dict), f"rank {rank}: {got}"
        assert len(got["errors"]) == 6
        assert all(e < tol for e in got["errors"]), f"rank {rank}: O, dQ, dK, dV, dG, dsink {got['errors']}"


@pytest.mark.parametrize("case", GATE_CASES, ids="-".join)
def test_the_gate_is_never_sent(suite, case):
    """The wrappers send what they send for the sink alone: the cost pass's bytes (of the diagram
    without the gate) are the busiest rank's, counted."""
    c = analyse(napkin.load_text(with_gate(text(*case, GATE)), "sinkd.ncd"), {"b": 2, "h": 2, "q": N, "x": N}).devices
    plain = analyse(napkin.load_text(text(*case), "sinkd.ncd"), {"b": 2, "h": 2, "q": N, "x": N}).devices
    assert (c.handshake_bytes, c.bytes_sent, c.backward_bytes) == \
        (plain.handshake_bytes, plain.bytes_sent, plain.backward_bytes)
    cost = {"check": c.handshake_bytes, "forward": c.bytes_sent, "backward": c.backward_bytes or 0}
    for ph in C.PHASES:
        assert cost[ph] == max(results["gate-" + "-".join(case)]["counted"][ph] for results in suite), ph


def test_a_gate_when_decoding_is_passed_whole_as_the_queries(suite):
    for rank, results in enumerate(suite):
        got = results["tree-gate"]
        assert isinstance(got, list) and got[0] < 1e-12, f"rank {rank}: {got}"


def test_a_gate_passed_whole_to_the_ring_is_refused_by_the_handshake(suite):
    for rank, results in enumerate(suite):
        assert results["whole-gate"] == (
            "G holds 37 rows along q on each device, but 37 tokens in the zigzag layout over 4 devices need 10 "
            "(padding included); cut full tensors with napkin.distributed shard helpers"), f"rank {rank}"


def test_the_gate_leaves_the_distributed_diagram():
    from napkin.distributed.reading import roles
    r = roles(napkin.load_text(with_gate(text("2x2", "causal", "fp32", GATE)), "sinkd.ncd"))
    assert (r.tokens, r.side, r.rows, r.row_axis) == (("Q", "K", "V"), ("sink",), ("G",), (2,))
    assert [t.name for t in r.diagram.inputs] == ["Q", "K", "V", "sink"]
    assert "G" not in r.diagram.level("hbm").holds
    assert r.epilogue.reads == ("sink", "G") and set(r.epilogue.only) == {"sink", "G"}


@pytest.mark.parametrize("output, message", [
    ("A * sigmoid(L - sink) + Q", r"output O reads Q, which is split across devices, outside its sums"),
    ("A * sigmoid(L - sink) * (q + 1)", r"output O reads the index of wire q outside its sums"),
    ("A * sigmoid(L - sink) / |q|", r"output O reads \|q\| outside its sums"),
    ("A * sigmoid(L - sink) + T", r"output O is a function of box T, which is neither softmax attention"),
])
def test_functions_the_wrappers_cannot_apply_after_the_merge_are_refused(output, message):
    from napkin.distributed.reading import roles
    src = text("ring", "full", "fp32", output).replace("in sink[h]", "in G[b, h, q, d] : fp32\nin sink[h]")
    src = src.replace("O[b, h, q, d] =", "T[b, h, q, d] = A * 2\nO[b, h, q, d] =")
    with pytest.raises(NapkinError, match=message):
        roles(napkin.load_text(src, "sinkd.ncd"))


MLA_MESH = (REPO / "examples" / "mla.ncd").read_text().replace("wire c = 128", "wire c = 32").replace(
    "wire r = 64", "wire r = 16").replace("wire e = 128", "wire e = 24").replace(": fp16", ": fp32").replace(
    "  accumulate fp32", "  accumulate fp32\n  level devices { group q across 4\n    stream x across 4 }").replace(
    "q by 128", "q by 16").replace("x by 64", "x by 16")
MLA = "mla"   # examples/mla.ncd, small, over a ring of 4: two query parts, two key parts, V narrower


@pytest.mark.parametrize("runner, mesh, output", [("run_ring_attention.py", "ring", "A * sigmoid(L - sink)"),
                                                   ("run_attention_2d.py", "2x2", "A * sigmoid(L - sink)"),
                                                   ("run_attention_2d.py", "2x2", GATE),
                                                   ("run_ring_attention.py", "ring", MLA)])
def test_the_torchrun_demos_take_a_sink(tmp_path, runner, mesh, output):
    """examples/run_*.py --diagram FILE with a sink: its error against the float64 reference.
    The demo gathered the output along the merged A's query axis and compared it with A (the
    reference's first output), and crashed on the sink's O: the diagram's outputs now, both
    sides.  With a gate, each rank's rows of it.  Every rank's bytes are the predicted ones:
    the demo predicted from Q's width alone (MLA's ring: 43008 B forward where 53760 went)
    until it took the cost pass's reading of the diagram (cost.devices.moved)."""
    path = tmp_path / "sink.ncd"
    path.write_text(MLA_MESH if output == MLA else
                    with_gate(text(mesh, "causal", "fp32", output)) if output == GATE else text(mesh, "causal", "fp32"))
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                          str(REPO / "examples" / runner), "--diagram", str(path), "--tokens", "53",
                          "--timeout", "60"], capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    errors = [float(v) for v in re.findall(r"max \|(?:O|dQ) - reference\| *= (\S+)", run.stdout)]
    assert len(errors) == 2 and all(e < 1e-5 for e in errors), run.stdout
    ranks = re.findall(r"^ +\d+ +(\d+) \( *(\d+)\) +(\d+) \( *(\d+)\)", run.stdout, re.MULTILINE)
    assert len(ranks) == 4 and all(f == fp and b == bp for f, fp, b, bp in ranks), run.stdout


DIFFERENTIAL = (REPO / "examples" / "differential_attention.ncd").read_text().replace(
    "wire d = 64", "wire d = 16").replace("wire e = 128", "wire e = 16").replace(": fp16", ": fp32").replace(
    "q by 128", "q by 16").replace("x by 64", "x by 16")


@pytest.mark.parametrize("runner, mesh, ranks, backward", [
    ("run_ring_attention.py", "group q across 2\n    stream x across 2", 2, "kv"),
    ("run_ring_attention.py", "group q across 2\n    stream x across 2", 2, "burst"),
    ("run_attention_2d.py", "group q across 2, x across 2", 4, None)])
def test_the_torchrun_demos_train_a_value_shared_by_the_maps(tmp_path, runner, mesh, ranks, backward):
    """examples/differential_attention.ncd (V declared without the maps' wire g: each dK/dV
    program stores its map's share of dV, the launcher sums them) over a ring, both backwards,
    and a 2 x 2 grid: the output and the gradients of Q, K and V against the float64 reference,
    on ragged tokens, and every rank's bytes the predicted ones."""
    assert "in V[b, h, x, e]" in DIFFERENTIAL
    path = tmp_path / "differential.ncd"
    path.write_text(DIFFERENTIAL.replace("  accumulate fp32", f"  accumulate fp32\n  level devices {{\n    {mesh}\n  }}"))
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    extra = ["--backward", backward] if backward else []
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                          str(REPO / "examples" / runner), "--diagram", str(path), "--tokens", "37", "--heads", "2",
                          "--timeout", "60", *extra], capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    errors = dict(re.findall(r"max \|(O|dQ|dK|dV) - reference\| *= (\S+)", run.stdout))
    assert set(errors) == {"O", "dQ", "dK", "dV"} and all(float(e) < 1e-5 for e in errors.values()), run.stdout
    sent = re.findall(r"^ +\d+ +(\d+) \( *(\d+)\) +(\d+) \( *(\d+)\)", run.stdout, re.MULTILINE)
    assert len(sent) == ranks and all(f == fp and b == bp for f, fp, b, bp in sent), run.stdout


def test_the_generated_launcher_takes_the_gate_and_returns_the_written_output():
    """NAME_distributed takes the gate by name beside the sink, and its docstring names the
    diagram's output O (it named the A and L that merge)."""
    from napkin.distributed.emit import distributed_source
    src = distributed_source(napkin.load_text(with_gate(text("2x2", "causal", "fp32", GATE)), "sinkd.ncd"))
    assert "def sinkd_distributed(Q, K, V, mesh, *, q_len, x_len=None, timeout=300.0, sink, G):" in src
    assert "rows\n    of O; differentiable.\n    G: this rank's rows of it, laid out as the queries'." in src
