"""Attention on 8-bit scores: int8 Q and K with a scale per token (SageAttention's
way, examples/sage_attention.ncd) or fp8 ones, beside a float V.

The score product goes to tl.dot on the 8-bit tiles as they are (an int8 pair's
exact int32 sum made float32), the softmax weights multiply V in V's dtype.  Q
and K get no gradient; V and the scales train.  Checked against float64 of the
same values (and torch's SDPA on the dequantised tensors) on sizes ragged to
the blocks; the cost pass prices each product at its own dtype's rate.
"""
from __future__ import annotations

import pytest
import torch

import napkin
from napkin import tiling
from napkin.codegen import emit_module
from napkin.cost import analyse, backward_cost, format_text
from napkin.cost.profiles import get_profile
from backward_helpers import compile_text
from test_fp8 import REPO

SAGE = (REPO / "examples" / "sage_attention.ncd").read_text()
ATTENTION = (REPO / "examples" / "attention.ncd").read_text()
FP8_SCORES = ATTENTION.replace("in Q[b, h, q, d] : fp16", "in Q[b, h, q, d] : e4m3") \
    .replace("in K[b, h, x, d] : fp16", "in K[b, h, x, d] : e4m3")
SIZES = {"b": 1, "h": 2, "q": 37, "x": 45}   # neither a multiple of its block (128, 64)


def _quantised(shape, g):
    """int8 values and their scale per row (the last axis's max over 127), as SageAttention quantises."""
    x = torch.randn(shape, generator=g)
    scale = x.abs().amax(-1) / 127
    return torch.round(x / scale[..., None]).to(torch.int8), scale


def _sage_inputs(d: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, sq = _quantised((1, 2, 37, d), g)
    k, sk = _quantised((1, 2, 45, d), g)
    return q, k, torch.randn(1, 2, 45, d, generator=g).half(), sq, sk


def _attention64(q, k, v, scale):
    """O and lse in float64 of the values as passed, ``scale`` the scores' factor (a tensor or a number)."""
    s = torch.einsum("bhqd,bhxd->bhqx", q, k) * scale
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def test_int8_scores_match_float64_and_sdpa(tmp_path):
    m = compile_text(SAGE, "sage_attention", tmp_path)
    q, k, v, sq, sk = _sage_inputs()
    o, lse = m.sage_attention(q, k, v, sq, sk)
    qd, kd = q.double() * sq.double()[..., None], k.double() * sk.double()[..., None]
    want_o, want_lse = _attention64(qd, kd, v.double(), 64 ** -0.5)
    sdpa = torch.nn.functional.scaled_dot_product_attention(qd, kd, v.double())
    assert o.dtype == torch.float16 and lse.dtype == torch.float32
    assert (o.double() - want_o).abs().max() <= 2 ** -10 * want_o.abs().max()
    assert (o.double() - sdpa).abs().max() <= 2 ** -10 * sdpa.abs().max()
    assert (lse.double() - want_lse).abs().max() <= 1e-5 * want_lse.abs().max()
    source = emit_module(napkin.load_text(SAGE), source_text=SAGE, source_path="sage_attention.ncd")
    # the int8 tiles go to tl.dot as they are, their int32 sum made float32: in the forward's and the
    # dQ kernel's full and ragged steps, and the dK/dV kernel's
    assert source.count('_qk = tl.dot(_Q, tl.trans(_K), input_precision="ieee").to(tl.float32)') == 4
    assert source.count('_qk = tl.dot(_K, tl.trans(_Q), input_precision="ieee").to(tl.float32)') == 2


def test_int8_scores_train_v_and_the_scales_and_say_why_not_q_and_k(tmp_path):
    m = compile_text(SAGE, "sage_attention", tmp_path)
    q, k, v, sq, sk = _sage_inputs(seed=1)
    v, sq, sk = (t.detach().requires_grad_() for t in (v, sq, sk))
    do = torch.randn(1, 2, 37, 64, generator=torch.Generator().manual_seed(2)).half()
    got = torch.autograd.grad(m.sage_attention(q, k, v, sq, sk)[0], (v, sq, sk), do)
    v64, sq64, sk64 = (t.detach().double().requires_grad_() for t in (v, sq, sk))
    raw = torch.einsum("bhqd,bhxd->bhqx", q.double(), k.double())
    o64 = torch.softmax(raw * sq64[..., None] * sk64[..., None, :] * 64 ** -0.5, -1) @ v64
    want = torch.autograd.grad(o64, (v64, sq64, sk64), do.double())
    for name, g, w in zip(("dV", "dsq", "dsk"), got, want):
        assert (g.double() - w).abs().max() <= 2e-3 * w.abs().max(), name
    assert got[0].dtype == torch.float16 and got[1].dtype == torch.float32
    with pytest.raises(NotImplementedError, match=r"^napkin has no gradient for Q: it is int8, an integer tensor, "
                                                  r"which has no gradient \(line 13, column 20 of the diagram\)$"):
        m.sage_attention_backward(q, k, v, sq, sk, do, torch.zeros(1, 2, 37), torch.zeros(1, 2, 37),
                                  need=(True, False, True, True, True))
    # the dK/dV kernel stores dV alone, the dQ kernel the scales' partial sums alone
    source = emit_module(napkin.load_text(SAGE), source_text=SAGE, source_path="sage_attention.ncd")
    assert "_grad_V" in source and "_grad_Q" not in source and "_grad_K" not in source


def test_fp8_scores_beside_an_fp16_value(tmp_path):
    """e4m3 Q and K, V in fp16: the scores at the fp8 rate, the weights in fp16 as
    beside fp16 Q and K (an 8-bit input does not make the fp16 O "wider" and split
    them), V trains; with neither Q's gradient nor a side input, no dQ kernel."""
    m = compile_text(FP8_SCORES, "fp8_scores", tmp_path)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 37, 64, generator=g).to(torch.float8_e4m3fn)
    k = torch.randn(1, 2, 45, 64, generator=g).to(torch.float8_e4m3fn)
    v = torch.randn(1, 2, 45, 64, generator=g).half().requires_grad_()
    o, lse = m.attention(q, k, v)
    want_o, want_lse = _attention64(q.double(), k.double(), v.double(), 64 ** -0.5)
    assert (o.double() - want_o).abs().max() <= 2 ** -10 * want_o.abs().max()
    assert (lse.double() - want_lse).abs().max() <= 1e-5 * want_lse.abs().max()
    do = torch.randn(o.shape, generator=g).half()
    (dv,) = torch.autograd.grad(o, (v,), do)
    v64 = v.detach().double().requires_grad_()
    (want,) = torch.autograd.grad(_attention64(q.double(), k.double(), v64, 64 ** -0.5)[0], (v64,), do.double())
    assert (dv.double() - want).abs().max() <= 2e-3 * want.abs().max()
    with pytest.raises(NotImplementedError, match=r"^napkin has no gradient for K: it is e4m3, and an fp8 gradient "
                                                  r"needs scaling into its range"):
        m.attention(q, k.float().to(torch.float8_e4m3fn).requires_grad_(), v)
    source = emit_module(napkin.load_text(FP8_SCORES), source_text=FP8_SCORES, source_path="fp8_scores.ncd")
    assert "_SPLIT_WEIGHTS=_wider([O], [V])" in source
    assert "_attention_bwd_dkdv_kernel" in source and "_attention_bwd_dq_kernel" not in source
    back = backward_cost(napkin.load_text(FP8_SCORES), {"b": 4, "h": 16, "q": 4096, "x": 4096})
    assert back.kernels == ("rows", "dkdv")
    # a per-head temperature beside them trains in the dQ kernel, which is there again
    tau = FP8_SCORES.replace("in V[b, h, x, d] : fp16", "in V[b, h, x, d] : fp16\nin t[h] : fp32") \
        .replace("* |d|^-0.5", "* t").replace("hold Q, K, V, O, lse", "hold Q, K, V, t, O, lse")
    assert backward_cost(napkin.load_text(tau), {"b": 1, "h": 2, "q": 256, "x": 256}).kernels == ("rows", "dkdv", "dq")


def test_int8_scores_with_a_scale_per_block_as_sageattention_quantises(tmp_path):
    """One scale per 128 queries and per 64 keys (SageAttention's blocks), read at the
    wires' blocks (sq[b, h, q // 128]); sizes ragged to both.  The scales read so train:
    each one's gradient is the sum of its block's rows' (or keys') partials, the last
    block short."""
    text = SAGE.replace("wire b, h, q, x", "wire b, h, q, x, qb, xb") \
        .replace("in sq[b, h, q] : fp32", "in sq[b, h, qb] : fp32").replace("in sk[b, h, x] : fp32", "in sk[b, h, xb] : fp32") \
        .replace("* sq * sk *", "* sq[b, h, q // 128] * sk[b, h, x // 64] *")
    m = compile_text(text, "sage_blocks", tmp_path)
    g = torch.Generator().manual_seed(6)

    def per_block(n, block):
        x = torch.randn(1, 2, n, 64, generator=g)
        pad = -n % block
        scale = torch.nn.functional.pad(x, (0, 0, 0, pad)).reshape(1, 2, -1, block * 64).abs().amax(-1) / 127
        rows = scale.repeat_interleave(block, -1)[..., :n]
        return torch.round(x / rows[..., None]).to(torch.int8), scale, rows
    q, sq, _ = per_block(200, 128)
    k, sk, _ = per_block(150, 64)
    v = torch.randn(1, 2, 150, 64, generator=g).half()
    v, sq, sk = (t.requires_grad_() for t in (v, sq, sk))
    o = m.sage_attention(q, k, v, sq, sk)[0]
    v64, sq64, sk64 = (t.detach().double().requires_grad_() for t in (v, sq, sk))
    q_rows, k_rows = sq64.repeat_interleave(128, -1)[..., :200], sk64.repeat_interleave(64, -1)[..., :150]
    want, _ = _attention64(q.double() * q_rows[..., None], k.double() * k_rows[..., None], v64, 64 ** -0.5)
    assert sq.shape == (1, 2, 2) and sk.shape == (1, 2, 3)
    assert (o.double() - want).abs().max() <= 2 ** -10 * want.abs().max()
    do = torch.randn(o.shape, generator=g).half()
    got = torch.autograd.grad(o, (v, sq, sk), do)
    expected = torch.autograd.grad(want, (v64, sq64, sk64), do.double())
    for name, a, b in zip(("dV", "dsq", "dsk"), got, expected):
        assert a.shape == b.shape and (a.double() - b).abs().max() <= 2e-3 * b.abs().max(), name
    assert set(m._NO_GRADIENT) == {"Q", "K"}


def test_int8_q_beside_an_fp16_k_meets_it_in_fp16(tmp_path):
    """int8 by fp16 multiplies in fp16, which holds -128..127 exactly (W8A16's rule, tiling.dot_dtype)."""
    text = SAGE.replace("in K[b, h, x, d] : int8", "in K[b, h, x, d] : fp16").replace(" * sk", "") \
        .replace("in sk[b, h, x] : fp32                            # per-key scale\n", "") \
        .replace("hold Q, K, V, sq, sk, O, lse", "hold Q, K, V, sq, O, lse")
    m = compile_text(text, "sage_fp16_k", tmp_path)
    g = torch.Generator().manual_seed(4)
    q, sq = _quantised((1, 2, 37, 64), g)
    k, v = torch.randn(1, 2, 45, 64, generator=g).half(), torch.randn(1, 2, 45, 64, generator=g).half()
    o, _ = m.sage_attention(q, k, v, sq)
    want, _ = _attention64(q.double(), k.double(), v.double(), sq.double()[..., None] * 64 ** -0.5)
    assert (o.double() - want).abs().max() <= 2 ** -10 * want.abs().max()
    source = emit_module(napkin.load_text(text), source_text=text, source_path="x.ncd")
    assert '_qk = tl.dot(_Q.to(_K.dtype), tl.trans(_K), input_precision="ieee")\n' in source


@pytest.mark.parametrize("d", [16, None])
def test_an_8_bit_score_sum_pads_the_head_dim_to_32(tmp_path, d):
    """NVIDIA's 8-bit mma sums 32 at a time (tiling.least_block): a head dim of 16
    is padded to 32, in the diagram's block and at run time (a free head dim)."""
    text = SAGE.replace("wire d = 64", "wire d = 16" if d else "wire d")
    source = emit_module(napkin.load_text(text), source_text=text, source_path="x.ncd")
    if d:
        assert "_BLOCK_d=32," in source and "_AUTOTUNE_DIMS = ((\"d\", 32, 32),)" in source
    else:
        assert '_BLOCK_d=_dim_block(_sz["d"], 32)' in source and "_AUTOTUNE_DIMS = ((\"d\", None, 32),)" in source
    m = compile_text(text, f"sage_d{d}", tmp_path)
    q, k, v, sq, sk = _sage_inputs(d=16, seed=5)
    assert m._dim_block(16, 32) == 32 and m._dim_block(40, 32) == 64
    o, _ = m.sage_attention(q, k, v, sq, sk)
    want, _ = _attention64(q.double(), k.double(), v.double(),
                           sq.double()[..., None] * sk.double()[..., None, :] * 16 ** -0.5)
    assert (o.double() - want).abs().max() <= 2 ** -10 * want.abs().max()


def test_the_cost_pass_prices_each_product_at_its_dtypes_rate():
    """int8 Q . K at the int8 rate, P . V at fp16's, forward and backward (the recomputed
    scores at int8's, dP = dO V and dV = P^T dO at fp16's); a one-dtype diagram as before."""
    h100 = get_profile("h100")
    sizes = {"b": 4, "h": 16, "q": 8192, "x": 8192}
    one = 2 * 4 * 16 * 8192 * 8192 * 64          # one product's FLOPs
    r = analyse(napkin.load_text(SAGE), sizes, "h100")
    assert r.flops.contraction == 2 * one and r.flops.contraction_parts == (("fp16", one), ("int8", one))
    assert r.roofline.contraction_s == pytest.approx(one / h100["peak_flops_int8"] + one / h100["peak_flops_fp16"])
    # the dK/dV kernel recomputes the scores and takes dV; the dQ kernel recomputes them and takes dP for dS
    back = backward_cost(napkin.load_text(SAGE), sizes, "h100")
    assert back.contraction_flops == 4 * one and back.contraction_parts == (("fp16", 2 * one), ("int8", 2 * one))
    assert "  flops: 2.2T in contractions (1.1T fp16; 1.1T int8), 86G other" in back.lines()[-2]
    assert back.roofline.contraction_s == pytest.approx(2 * one / h100["peak_flops_int8"]
                                                        + 2 * one / h100["peak_flops_fp16"])
    plain = analyse(napkin.load_text(ATTENTION), sizes, "h100")
    assert plain.flops.contraction_parts == (("fp16", 2 * one),)
    assert plain.roofline.contraction_s == pytest.approx(2 * one / h100["peak_flops_fp16"])
    assert "flops: contraction 1.1T (4*b*d*h*q*x, 550G fp16; 550G int8)" in format_text(r)
    assert "flops: contraction 1.1T (4*b*d*h*q*x, fp16)" in format_text(plain)


def test_example_inputs_draw_the_int8_scales_about_one_over_127(tmp_path):
    """Drawn normal, the scales made attention's sum of 64 products of -128..127
    as large as 1e5: a one-hot softmax that tests nothing."""
    d = napkin.load_text(SAGE)
    assert tiling.int8_scales(d) == ("sq", "sk") and tiling.int8_scales(napkin.load_text(ATTENTION)) == ()
    m = compile_text(SAGE, "sage_attention", tmp_path)
    from napkin.bench.reference import example_inputs
    for q, k, v, sq, sk in (m.example_inputs(SIZES), example_inputs(d, SIZES)):
        assert q.dtype == torch.int8 and q.min() < -100 and q.max() > 100
        assert sq.dtype == torch.float32 and 0.5 / 127 <= sq.min() and sq.max() <= 1.5 / 127
        assert v.dtype == torch.float16 and v.std() > 0.5


def test_a_devices_level_refuses_8_bit_token_inputs_in_words():
    """Ring Attention or ATTENTION2D over int8 Q and K: the wrappers shard, circulate and
    train float token inputs; int8 Q and K were taken for side inputs, passed whole
    beside their split scales.  Refused at the input, with what to do."""
    ring = (REPO / "examples" / "ring_attention.ncd").read_text()
    for old, new in (("in Q[b, h, q, d] : bf16", "in Q[b, h, q, d] : int8"),
                     ("in K[b, h, x, d] : bf16", "in K[b, h, x, d] : int8\nin sq[b, h, q] : fp32\nin sk[b, h, x] : fp32"),
                     ("sum[d](Q * K) * |d|^-0.5", "sum[d](Q * K) * sq * sk * |d|^-0.5"),
                     ("hold Q, K, V, O, lse", "hold Q, K, V, sq, sk, O, lse")):
        assert old in ring
        ring = ring.replace(old, new)
    with pytest.raises(napkin.NapkinError) as err:
        emit_module(napkin.load_text(ring, "ring8.ncd"), source_text=ring, source_path="ring8.ncd")
    assert str(err.value).splitlines()[0] == (
        "ring8.ncd:11:4: cannot distribute this diagram: input Q is int8 along the query wire q: the distributed "
        "wrappers carry float token inputs only, each with a gradient, and an int8 score factor has none")
