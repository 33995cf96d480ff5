"""Backward kernels (napkin/codegen/backward.py, training.py) against autograd.

Every gradient the generated module computes (through its torch op, as a
user's loss.backward() does) is compared with float64 autograd through the
module's own eager ``reference``, on random inputs and random output
gradients.  The accuracy rule is test_kernels.py's: on every entry, the
kernel's error is at most twice the same-dtype reference's error (autograd
through ``reference`` on the same 16- or 32-bit inputs) plus 4 ulps of the
gradient's dtype and 4 float32 ulps (the P it recomputes, rounded its own
way) times its scale.  Kernels run under TRITON_INTERPRET=1 with
16-row blocks, so ragged sizes cross several blocks; bf16 only on a GPU.

The rule's helpers are tests/backward_helpers.py.  Also: masks, side inputs
and edge rows (tests/test_backward_masks.py), the kernels' tiles and the sum
normalisers (tests/test_backward_kernels.py), masks composed through lets
(tests/test_backward_lets.py).
"""
from __future__ import annotations

import math
import re
import zlib
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings

import napkin
from napkin import masks, visits
from napkin.codegen import emit_module
from napkin.errors import NapkinError
from napkin.printer import to_text
from example_sizes import sizes_for
from strategies import attention_diagrams, drawn_sizes

from backward_helpers import (EXAMPLES, FAST, REPO, assert_accurate, block_rows, check, compile_text, example,
                              gradients, launcher)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("backward")


# --------------------------------------------------------------------------
# Every example: fp32 and fp16, ragged sizes.
# --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("name", EXAMPLES)
def test_example_gradients_match_float64_autograd(name, dtype, folder):
    m = example(name, folder)
    q, x = (37, 50) if dtype == torch.float32 else (50, 21)   # ragged both ways across the two
    sizes = sizes_for(name, q, x)
    rows = block_rows(napkin.load(REPO / "examples" / f"{name}.ncd"), sizes)
    check(m, sizes, dtype, label=f"{name} {dtype} q={q} x={x}", rows=rows)


def test_single_row_and_key(folder):
    for name in ("causal", "alibi", "l2_attention"):
        check(example(name, folder), sizes_for(name, 1, 1), torch.float32, label=f"{name} 1x1")


@pytest.mark.parametrize("d, dtype", [(16, torch.float32), (80, torch.float16), (256, torch.float32)])
def test_head_dims(d, dtype, folder):
    # d = 256 also blocks q by 64, as the forward's test does (shared memory)
    m = example("causal", folder, ("wire d = 64", f"wire d = {d}"), ("q by 128", "q by 64"))
    n = 45 if d < 256 else 20
    check(m, {"b": 1, "h": 2, "q": n, "x": n}, dtype, label=f"d={d}")


def test_mqa_sums_dk_dv_over_all_query_heads(folder):
    m = example("gqa", folder)
    inputs, (dq, dk, dv) = check(m, {"b": 1, "hk": 1, "g": 4, "q": 33, "x": 40}, torch.float32, label="mqa")
    assert dk.shape == inputs[1].shape == (1, 1, 40, 128)


def test_keys_shared_by_two_query_wires(folder):
    """K and V lack two of Q's wires (g and r): dK/dV's flat loop over (row block, g, r)
    decodes both from one index; causal, so it walks all three segments."""
    text = (REPO / "examples" / "gqa.ncd").read_text().replace("wire d = 128", "wire d = 16")
    text = text.replace("wire b, hk, g, q, x", "wire b, hk, g, r, q, x").replace("(hk g)", "hk, g, r")
    text = text.replace("hk, g, q", "hk, g, r, q").replace("g by 1", "g by 1, r by 1")
    text = text.replace("sum[d](Q * K) * |d|^-0.5", "where(x <= q, sum[d](Q * K) * |d|^-0.5, -inf)")
    m = compile_text(text, "two_shared", folder)
    assert "(row block, g, r) pairs" in Path(m.__file__).read_text()
    inputs, (dq, dk, dv) = check(m, {"b": 2, "hk": 2, "g": 3, "r": 2, "q": 45, "x": 37}, torch.float32,
                                 label="g and r")
    assert dk.shape == inputs[1].shape == (2, 2, 37, 16)


MLA_TEXT = """diagram mla_small
wire b, h, q, x
wire c = 32
wire r = 16
wire e = 24
in Qc[b, h, q, c] : {dt}
in Kc[b, h, x, c] : {dt}
in Qr[b, h, q, r] : {dt}
in Kr[b, h, x, r] : {dt}
in V[b, h, x, e] : {dt}
in tau[h] : fp32
S[b, h, q, x] = where(x <= q, (sum[c](Qc * Kc) + sum[r](Qr * Kr)) * tau, -inf)
O[b, h, q, e] = sum[x](softmax[x](S) * V)
lse[b, h, q] = logsumexp[x](S)
out O, lse
"""


@pytest.mark.parametrize("dt", ["fp32", "fp16"])
def test_a_score_of_two_contractions_trains(dt, folder):
    """MLA's score, sum[c](Qc * Kc) + sum[r](Qr * Kr): each pair gets its own gradient from the
    one dR (it was refused: 'holds 2 sums over inputs'), tau its own through the summed score.
    Against float64 torch written with the parts concatenated, as MLA's reference does; ragged
    sizes, causal, fp32 and fp16, the output's and the lse's gradients both."""
    m = compile_text(MLA_TEXT.format(dt=dt), f"mla_small_{dt}", folder)
    dtype = torch.float32 if dt == "fp32" else torch.float16
    g = torch.Generator().manual_seed(11)
    nq, nx = (45, 37) if dt == "fp32" else (37, 50)
    shapes = [(2, 2, nq, 32), (2, 2, nx, 32), (2, 2, nq, 16), (2, 2, nx, 16), (2, 2, nx, 24)]
    ins = [torch.randn(*sh, generator=g).to(dtype).requires_grad_() for sh in shapes]
    tau = (torch.rand(2, generator=g) * 0.3 + 0.1).requires_grad_()
    out, lse = m.mla_small(*ins, tau, block_q=16, block_x=16)
    w_o, w_l = torch.randn(out.shape, generator=g), torch.randn(lse.shape, generator=g)
    ((out.double() * w_o).sum() + (lse.double() * w_l).sum()).backward()
    xs = [t.detach().double().requires_grad_() for t in ins + [tau]]
    q, k = torch.cat([xs[0], xs[2]], -1), torch.cat([xs[1], xs[3]], -1)
    s = (q @ k.transpose(-1, -2)) * xs[5].view(1, -1, 1, 1)
    s = s.masked_fill(torch.ones(nq, nx, dtype=torch.bool).tril().logical_not(), float("-inf"))
    o, l = s.softmax(-1) @ xs[4], s.logsumexp(-1)
    ((o * w_o.double()).sum() + (l * w_l.double()).sum()).backward()
    tol = 1e-5 if dt == "fp32" else 3e-3
    for name, a, e in [("O", out, o), ("lse", lse, l)] + [
            (n, t.grad, x.grad) for n, t, x in zip(("Qc", "Kc", "Qr", "Kr", "V", "tau"), ins + [tau], xs)]:
        err = ((a.double() - e).norm() / e.norm()).item()
        assert err < tol, f"{dt} {name}: relative error {err:.3g}"


def test_a_rotary_key_shared_by_the_heads_is_declared_once_or_passed_expanded(folder):
    """DeepSeek's k_pe is one per token.  Declared so, Kr[b, x, r], every
    head reads it and the dK/dV programs' shares of its gradient (one a head)
    are summed by the launcher; declared per head and passed as
    k_pe.expand(...) (stride 0 along h), autograd sums the heads' dKr."""
    once = compile_text(MLA_TEXT.format(dt="fp32").replace("in Kr[b, h, x, r]", "in Kr[b, x, r]"),
                        "mla_small_kr_once", folder)
    per_head = compile_text(MLA_TEXT.format(dt="fp32"), "mla_small_fp32", folder)
    n = 41
    for m, widen in ((once, lambda t: t[:, 0]), (per_head, lambda t: t.expand(2, 3, n, 16))):
        g = torch.Generator().manual_seed(12)
        qc, kc, qr, v = (torch.randn(2, 3, n, w, generator=g).requires_grad_() for w in (32, 32, 16, 24))
        k_pe = torch.randn(2, 1, n, 16, generator=g).requires_grad_()
        tau = torch.full((3,), 0.2)
        out, _ = m.mla_small(qc, kc, qr, widen(k_pe), v, tau, block_q=16, block_x=16)
        w_o = torch.randn(out.shape, generator=g)
        (out * w_o).sum().backward()
        xs = [t.detach().double().requires_grad_() for t in (qc, kc, qr, k_pe, v)]
        s = (torch.cat([xs[0], xs[2]], -1) @ torch.cat([xs[1], xs[3].expand(2, 3, n, 16)], -1).transpose(-1, -2))
        s = (s * 0.2).masked_fill(torch.ones(n, n, dtype=torch.bool).tril().logical_not(), float("-inf"))
        o = s.softmax(-1) @ xs[4]
        (o * w_o.double()).sum().backward()
        assert ((out.double() - o).norm() / o.norm()).item() < 1e-5
        for name, t, x in zip(("Qc", "Kc", "Qr", "k_pe", "V"), (qc, kc, qr, k_pe, v), xs):
            assert t.grad.shape == x.grad.shape
            assert ((t.grad.double() - x.grad).norm() / x.grad.norm()).item() < 1e-5, name


@pytest.mark.parametrize("score, message", [
    ("(sum[c](Qc * Kc) + sum[c](Qc * K2)) * 0.2",
     r"input Qc: it is the query of two contractions: declare two inputs"),
    ("sum[c](Qc * Kc) * sum[r](Qr * Kr) * 0.01",
     r"holds 2 sums over inputs; the backward takes one score, a contraction like sum\[d\]\(Q \* K\), or "
     r"contractions added up"),
    ("(sum[c](Qc * Kc) + sum[r](Qr * Kr)) * tau",
     r"inputs Kc and Kr: Kc lacks h, which Kr has: the dK/dV kernel runs a program for each index of Kc's "
     r"batch wires \(declare Kc along h too and pass it expanded"),
    # the query shared by every head: it named no way out
    ("(sum[c](Qc * Kc) + sum[r](Qr * Kr)) * 0.2",
     r"input Qc: it lacks the batch wire\(s\) h of the scores: the dQ kernel writes each row's gradient once "
     r"\(declare Qc along h too and pass it expanded, qc.unsqueeze\(...\).expand\(...\)"),
])
def test_contractions_the_backward_cannot_take_apart_are_refused(score, message):
    text = MLA_TEXT.format(dt="fp32").replace("in V[b, h, x, e] : fp32", "in V[b, h, x, e] : fp32\nin K2[b, h, x, c] : fp32")
    text = text.replace("(sum[c](Qc * Kc) + sum[r](Qr * Kr)) * tau", score)
    if "tau" in score:   # the key without position declared once for every head, its rotary part per head
        text = text.replace("in Kc[b, h, x, c]", "in Kc[b, x, c]")
    elif score.endswith("sum[r](Qr * Kr)) * 0.2"):   # the query without position shared by every head
        text = text.replace("in Qc[b, h, q, c]", "in Qc[b, q, c]")
    from napkin.codegen import lower as L
    from napkin.codegen import training
    t = training.prepare(L.lower(napkin.load_text(text, "mla_small.ncd")))
    assert t.backward is None and re.search(message, t.reason), t.reason


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_differential_attention_trains_with_its_value_shared_by_the_maps(dtype, folder):
    """examples/differential_attention.ncd as its comment runs it: Q and K
    straight from a projection (each head's two halves), V declared without
    the maps' wire (each dK/dV program stores its map's share of dV, the
    launcher sums them), the maps combined in torch as A1 - lam * A2; and V
    declared along g and passed expanded (stride 0; autograd sums dV), as
    before.  Output and every gradient against float64 torch written from
    the paper's formula, over ragged lengths."""
    shared = example("differential_attention", folder)
    along_g = example("differential_attention", folder, ("in V[b, h, x, e]", "in V[b, h, g, x, e]"))
    b, h, n, d, e = 2, 2, 45, 64, 128
    for m, widen in ((shared, lambda v: v), (along_g, lambda v: v.unsqueeze(2).expand(b, h, 2, n, e))):
        gen = torch.Generator().manual_seed(31)
        q, k = (torch.randn(b, h, n, 2 * d, generator=gen).to(dtype).requires_grad_() for _ in range(2))
        v = torch.randn(b, h, n, e, generator=gen).to(dtype).requires_grad_()
        lam = torch.rand(h, generator=gen)
        a = m.differential_attention(q, k, widen(v), block_q=16, block_x=16)
        out = a[:, :, 0] - lam[:, None, None].to(dtype) * a[:, :, 1]
        w = torch.randn(out.shape, generator=gen)
        (out.float() * w).sum().backward()

        def exact(q, k, v):
            causal = torch.ones(n, n, dtype=torch.bool).tril()
            maps = []
            for half in (slice(0, d), slice(d, 2 * d)):
                s = q[..., half] @ k[..., half].transpose(-1, -2) / math.sqrt(d)
                maps.append(s.masked_fill(~causal, float("-inf")).softmax(-1))
            return (maps[0] - lam.double()[:, None, None] * maps[1]) @ v

        xs = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref = exact(*xs)
        (ref * w.double()).sum().backward()
        tol = 1e-5 if dtype == torch.float32 else 3e-3
        assert ((out.double() - ref).norm() / ref.norm()).item() < tol
        for name, t, x in zip("QKV", (q, k, v), xs):
            assert t.grad.shape == x.grad.shape and t.grad.dtype == dtype, name
            assert ((t.grad.double() - x.grad).norm() / x.grad.norm()).item() < tol, name


def test_differential_attention_written_otherwise_is_refused_with_the_way_that_trains():
    """Two score boxes: no backward, and the reason names the layout that has
    one.  K declared without the maps' wire that V has: refused, as the dK/dV
    kernel runs a program per index of K's batch wires."""
    from napkin.codegen import lower as L
    from napkin.codegen import training
    text = (REPO / "examples" / "differential_attention.ncd").read_text()
    assert training.prepare(L.lower(napkin.load_text(text, "d.ncd"))).backward is not None
    narrow = text.replace("in V[b, h, x, e]", "in V[b, h, g, x, e]").replace(
        "in K[b, h, x, (g d)]", "in K[b, h, x, d]")
    t = training.prepare(L.lower(napkin.load_text(narrow, "d.ncd")))
    assert t.backward is None and t.reason == (
        "napkin has no backward for diagram differential_attention: napkin cannot emit a backward for inputs K "
        "and V: K lacks g, which V has: the dK/dV kernel runs a program for each index of K's batch wires "
        "(declare K along g too and pass it expanded, k.unsqueeze(...).expand(...), which reads the same "
        "memory; autograd sums its gradient)")
    assert t.reason_loc.line == next(i for i, s in enumerate(narrow.splitlines(), 1) if s.startswith("in K"))
    two = """diagram two_maps
wire b, h, q, x
wire d = 16
in Q1[b, h, q, d] : fp32
in K1[b, h, x, d] : fp32
in Q2[b, h, q, d] : fp32
in K2[b, h, x, d] : fp32
in V[b, h, x, d] : fp32
S1[b, h, q, x] = sum[d](Q1 * K1)
S2[b, h, q, x] = sum[d](Q2 * K2)
O1[b, h, q, d] = sum[x](softmax[x](S1) * V)
O2[b, h, q, d] = sum[x](softmax[x](S2) * V)
O[b, h, q, d] : fp32 = O1 - 0.5 * O2
out O
"""
    t = training.prepare(L.lower(napkin.load_text(two, "two.ncd")))
    assert t.backward is None and t.reason == (
        "napkin has no backward for diagram two_maps: expected one score box contracting inputs (like "
        "sum[d](Q * K)); found S1, S2 (several attention maps, such as the two of differential attention, are "
        "one box along a wire of maps: S[b, h, g, q, x] with g = 2, as in examples/differential_attention.ncd)")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["attention", "causal", "gqa", "alibi", "l2_attention", "matmul",
                                  "differential_attention", "document_ring"])
def test_bf16_on_gpu(name, folder):
    m = example(name, folder)
    inputs = [t.cuda() for t in m.example_inputs(sizes_for(name, 200, 333), dtype=torch.bfloat16)]
    got = gradients(launcher(m), inputs)
    exact = gradients(m.reference, [t.double() if t.is_floating_point() else t for t in inputs])
    assert_accurate(got, exact, gradients(m.reference, inputs), name, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["attention", "alibi", "document_mask"])
def test_dq_beside_dkdv_on_a_second_stream_gives_the_same_bits_on_gpu(name, folder):
    """BACKWARD_OVERLAP: dQ on a second CUDA stream while dK/dV runs.  The
    kernels are the same, so every gradient (ALiBi's slope, summed after
    the join; the document mask's prepass on the side stream) must be the
    serial backward's to the bit, and match float64."""
    m = example(name, folder)
    inputs = [t.cuda() for t in m.example_inputs(sizes_for(name, 1000, 1100), dtype=torch.bfloat16)]
    if name == "document_mask":
        n = inputs[3].shape[-1]  # four documents of 300 keys (the last one shorter)
        inputs[3] = (torch.arange(n, device="cuda") // 300).to(torch.int32).expand_as(inputs[3]).contiguous()
    before = m.BACKWARD_OVERLAP
    try:
        m.BACKWARD_OVERLAP = False
        serial = gradients(launcher(m), inputs)
        m.BACKWARD_OVERLAP = True
        beside = gradients(launcher(m), inputs)
    finally:
        m.BACKWARD_OVERLAP = before
    for i, (a, b) in enumerate(zip(serial, beside)):
        assert (a is None and b is None) or torch.equal(a, b), f"{name}: gradient {i}"
    exact = gradients(m.reference, [t.double() if t.is_floating_point() else t for t in inputs])
    assert_accurate(beside, exact, gradients(m.reference, inputs), name, torch.bfloat16)


def emitted(name: str) -> str:
    text = (REPO / "examples" / f"{name}.ncd").read_text()
    return emit_module(napkin.load_text(text, f"{name}.ncd"), source_text=text, source_path=f"{name}.ncd")


def test_the_streams_fork_before_dkdv_and_join_before_dq_is_read():
    """Without CUDA the knob changes nothing (no stream to fork); the text
    puts the fork before anything of dK/dV's (its ranges prepass, its
    launch: dQ must not wait for them), dQ's prepass and launch on the second
    stream, a join when working the launches out raised, and the join before
    anything reads what dQ wrote (the side gradients' sums)."""
    src = emitted("document_mask")
    work = src.split("def _document_mask_backward(")[1].split("\ndef ")[0]
    launch = src.split("def _document_mask_backward_launch(")[1].split("\ndef ")[0]
    stream = "with torch.cuda.stream(_side) if _side is not None else contextlib.nullcontext():"
    fork = work.index("_side = _bwd_stream_fork(_dev)")
    assert fork < work.index("_kv_rng, _kv_rng_on = _document_mask_ranges_cached(mask_cache, ") \
        < work.index(stream) < work.index("_rng, _rng_on = _document_mask_ranges_cached(mask_cache, ", work.index(stream)) \
        < work.index("except BaseException:") < work.index("_bwd_stream_join(_dev, _side)") \
        < work.index("return _document_mask_backward_launch(")
    dkdv, dq = launch.index("_document_mask_bwd_dkdv_kernel["), launch.index("_document_mask_bwd_dq_kernel[")
    assert dkdv < launch.index(stream) < dq < launch.index("_bwd_stream_join(_dev, _side)") < launch.index("return (")
    alibi = emitted("alibi")
    body = alibi.split("def _alibi_backward_launch(")[1].split("\ndef ")[0]
    assert body.index("_bwd_stream_join(_dev, _side)") < body.index("_grad_slope = _part_slope.sum(")
    attention = emitted("attention")   # a plan's launch forks too
    planned = attention.split("def _attention_backward(")[1].split("\ndef ")[0]
    assert planned.index("_side = _bwd_stream_fork(_dev)") < planned.index("return _attention_backward_launch(")
    assert 'BACKWARD_OVERLAP = os.environ.get("NAPKIN_BACKWARD_OVERLAP", "") == "1"' in src


def test_the_overlap_knob_on_the_cpu_changes_nothing(folder):
    m = example("alibi", folder)
    inputs = m.example_inputs({"b": 1, "h": 2, "q": 37, "x": 29}, dtype=torch.float32)
    before = m.BACKWARD_OVERLAP
    try:
        m.BACKWARD_OVERLAP = True
        beside = gradients(launcher(m), inputs, block_q=16, block_x=16)
    finally:
        m.BACKWARD_OVERLAP = before
    serial = gradients(launcher(m), inputs, block_q=16, block_x=16)
    assert all(torch.equal(a, b) for a, b in zip(serial, beside))



# --------------------------------------------------------------------------
# The backward as an API; determinism; skipped blocks.
# --------------------------------------------------------------------------

def test_backward_callable_directly_with_need(folder):
    m = example("causal", folder)
    q, k, v = m.example_inputs({"b": 1, "h": 2, "q": 40, "x": 40}, dtype=torch.float16)
    o, lse = m.causal(q, k, v, **{k_: FAST[k_] for k_ in ("block_q", "block_x")})
    do = torch.randn_like(o)
    (delta,) = m.causal_preprocess(q, k, v, do, o, block_q=16)
    assert delta.dtype == torch.float32
    assert torch.allclose(delta, (do.float() * o.float()).sum(-1), atol=1e-5)
    dq, dk, dv = m.causal_backward(q, k, v, do, lse, delta, block_q=16, block_x=16)
    assert dq.dtype == dk.dtype == dv.dtype == torch.float32
    # True is the mask 1 to Python (dQ alone); "QKV" three truthy characters; 8 and -1 bits of no input
    for bad in (True, "QKV", 8, -1, 1.5):
        with pytest.raises(ValueError, match=r"need is a bit mask over the inputs \(0 to 7\) or one flag per "
                                             rf"input \(Q, K, V\), not {re.escape(repr(bad))}"):
            m.causal_backward(q, k, v, do, lse, delta, need=bad)
    only_v = m.causal_backward(q, k, v, do, lse, delta, block_q=16, block_x=16, need=(False, False, True))
    assert only_v[0] is None and only_v[1] is None and torch.equal(only_v[2], dv)
    with pytest.raises(ValueError, match="shape"):
        m.causal_backward(q, k, v, do[:, :, :5], lse, delta)


def test_gradients_are_bitwise_reproducible(folder):
    m = example("alibi", folder)
    inputs = m.example_inputs({"b": 1, "h": 2, "q": 50, "x": 50}, dtype=torch.float16)
    first = gradients(m.alibi, inputs, block_q=16, block_x=16)
    second = gradients(m.alibi, inputs, block_q=16, block_x=16)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_column_loop_visits_exactly_the_forward_blocks():
    """visits.row_block_range, which the dK/dV kernel renders, against the
    forward's visited set for random affine masks and ragged sizes."""
    gen = torch.Generator().manual_seed(0)

    def draw(values):
        return values[int(torch.randint(len(values), (1,), generator=gen))]

    for _ in range(3000):
        # step: a chunk's bound, x // n == q // n (row_coeff * (r // step))
        bounds = tuple(masks.Bound(draw(["upper", "lower"]), draw([-2, -1, 0, 1, 1, 2, 8]),
                                   (("", draw(list(range(-60, 61)))),), draw([1, 1, 1, 3, 8]))
                       for _ in range(draw([0, 1, 2, 3])))
        nr, nc, br, bc = draw(list(range(1, 90))), draw(list(range(1, 90))), draw([16, 32]), draw([16, 32])
        forward = visits.visited_blocks(bounds, nr, nc, br, bc)
        backward = visits.visited_blocks_by_column(bounds, nr, nc, br, bc)
        assert sorted(backward) == sorted(forward) and len(set(backward)) == len(backward), (bounds, nr, nc, br, bc)


# --------------------------------------------------------------------------
# Random diagrams (tests/strategies.py).
# --------------------------------------------------------------------------

@settings(max_examples=8, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(diagram=attention_diagrams())
def test_random_attention_diagram_gradients(diagram, folder):
    key = f"drawn_{zlib.crc32(to_text(diagram).encode())}"
    m = compile_text(to_text(diagram), key, folder, diagram)
    sizes = drawn_sizes(diagram, zlib.crc32(key.encode()))
    dtype = {"fp16": torch.float16, "fp32": torch.float32}[diagram.inputs[0].dtype]
    inputs = m.example_inputs(sizes, dtype=dtype, seed=1)
    fn = getattr(m, diagram.name)
    got = gradients(fn, inputs)  # the drawn schedule's own blocks
    exact = gradients(m.reference, [t.double() if t.is_floating_point() else t for t in inputs])
    # the drawn scores are S[b, h, q, x]: an input with neither q nor x sums every row it meets
    rows = [1 if {"q", "x"} & {w for a in t.axes for w in a} else
            math.prod(sizes[w] for w in ("b", "h", "q") if all(w not in a for a in t.axes))
            for t in diagram.inputs]
    # and every dS is P * (dP - delta), dP = dO . V and delta = rowsum(dO * O) each a sum of d
    # products, rounded in two orders: where they cancel exactly (one key, x = 1: dS = 0, which
    # the reference's autograd gets exactly) the kernel's dQ is their rounding, 5.4e-07 at d = 16
    # (4.5 ulps of the floor's scale 1; dK 1.4e-06), so the floor widens by the root of d too
    rows = [r * sizes["d"] for r in rows]
    assert_accurate(got, exact, gradients(m.reference, inputs), to_text(diagram), dtype, rows)


# --------------------------------------------------------------------------
# The cost pass's view of the backward (bytes are proved in test_bytecount.py).
# --------------------------------------------------------------------------

def test_backward_cost_flops_and_masking():
    from napkin.cost import analyse, backward_cost

    sizes = {"b": 1, "h": 2, "q": 4096, "x": 4096}
    full = backward_cost(napkin.load(REPO / "examples" / "attention.ncd"), sizes)
    # seven products of the (q, x) tile over d per visited pair: QK^T and dO V^T in both
    # kernels, then dK, dV and dQ; the forward has two
    assert full.contraction_flops == 3.5 * analyse(napkin.load(REPO / "examples" / "attention.ncd"),
                                                   sizes).flops.contraction
    causal = backward_cost(napkin.load(REPO / "examples" / "causal.ncd"), sizes)
    assert 0.5 < causal.load_bytes / full.load_bytes < 0.6     # about half the blocks are skipped
    assert causal.kernels == ("rows", "dkdv", "dq") and causal.time_s > 0


@pytest.mark.parametrize("name", ["attention_2d", "ring_attention", "decode"])
def test_the_backward_of_a_distributed_diagram_is_not_priced_under_a_per_device_report(name):
    """--backward priced the whole problem's single-device backward beside a
    forward priced per device (attention_2d's backward equalled attention's;
    decode's, which refuses gradients, was priced too; helper's hunt)."""
    from napkin.cost import backward_cost

    d = napkin.load(REPO / "examples" / f"{name}.ncd")
    sizes = {"b": 1, "h": 2, "hk": 2, "g": 2, "q": 300, "x": 300}
    with pytest.raises(NapkinError, match=rf"napkin cost --backward prices one device's training kernels, and "
                                          rf"diagram {name} has a devices level"):
        backward_cost(d, {w.name: sizes[w.name] for w in d.wires if w.size is None})


def test_cost_cli_reports_the_backward(capsys):
    from napkin.cli import main

    args = ["cost", str(REPO / "examples" / "causal.ncd"), "-D", "b=1", "-D", "h=2", "-D", "q=256", "-D", "x=256"]
    assert main(args + ["--backward"]) == 0
    assert "backward of causal: kernels rows, dkdv, dq" in capsys.readouterr().out
    assert main(args + ["--backward", "--json"]) == 0
    import json
    report = json.loads(capsys.readouterr().out)
    assert report["backward"]["store_bytes"] > 0 and report["forward"]["diagram"] == "causal"
    # a schema of its own (it had none; docs/cost.md said every --json was napkin.cost/1), its forward one
    from napkin.cost import from_json
    assert report["schema"] == "napkin.cost.backward/1" and from_json(report["forward"]).diagram == "causal"


# Tensor names whose variables (``_`` + name) are also names the kernels use
# for their own temporaries: the step's ``_s``, ``_p``, ``_m``, ``_alpha``,
# ``_t0``, the running state ``_l``/``_acc``, the offsets ``_offs_q``, the
# backward's ``_dS``, ``_qk``...  The user's tensor must get another variable.
_CLASHES = [
    {"Q": "s", "K": "p", "V": "t0"},
    {"Q": "m", "K": "l", "V": "alpha", "O": "acc", "lse": "m_new"},
    {"Q": "offs_q", "K": "qk", "V": "ok_x", "O": "dS", "lse": "m_use"},
]


@pytest.mark.parametrize("names", _CLASHES, ids=["-".join(n.values()) for n in _CLASHES])
def test_tensor_names_that_match_kernel_temporaries(names, folder):
    import re
    text = (REPO / "examples" / "causal.ncd").read_text()
    for old, new in names.items():
        text = re.sub(rf"\b{old}\b", new, text.split("schedule")[0]) + "schedule" + \
            re.sub(rf"\b{old}\b", new, text.split("schedule", 1)[1])
    m = compile_text(text, "clash_" + "_".join(names.values()), folder)
    sizes = {"b": 1, "h": 2, "q": 70, "x": 70}      # several blocks of 16 in every loop
    inputs = m.example_inputs(sizes, dtype=torch.float32, seed=3)
    fn = launcher(m)
    outs = fn(*inputs, **{k: v for k, v in FAST.items() if k in ("block_q", "block_x")})
    want = m.reference(*[t.double() for t in inputs])
    for o, w in zip(outs, want):
        assert (o.double() - w).abs().max().item() < 1e-4, names
    check(m, sizes, torch.float32, label=str(names), block_q=16, block_x=16)
