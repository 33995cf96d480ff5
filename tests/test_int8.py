"""int8 factors of a matrix product: the forward kernel, its cost and its refusals.

An int8 pair goes to tl.dot as it is and sums in int32 (exact), made float32
for an epilogue (per-row and per-column dequantising scales) or stored as it
is where every output is an integer; an int8 factor beside a float meets it in
that float's dtype (fp16 and wider hold -128..127 exactly), beside fp8 in
fp16.  Checked against float64 of the same values on ragged sizes; the sum
past 2**24 (where float32 is no longer exact) against torch's int64 product.
Attention, an epilogue's int8 tile, an int8 output and the gradient are
refused in words.
"""
from __future__ import annotations

import pytest
import torch

import napkin
from napkin import tiling
from napkin.codegen import emit_module
from napkin.cost import analyse, backward_cost, tune
from napkin.cost.profiles import get_profile
from backward_helpers import compile_text
from test_fp8 import REPO, _exact, _refusal, bf16_within_a_unit_moving_the_costed_bytes, scales_train
from test_fp8 import SCALED as FP8_SCALED

SCALED = FP8_SCALED.replace("diagram f8", "diagram q8")

EXACT = """diagram q32
wire m, n, k
in A[m, k] : int8
in B[k, n] : int8
C[m, n] : int32 = sum[k](A * B)
out C
schedule { level smem { group m by 32, n by 16
stream k by 32 } }
"""


def _values(shape, dtype: str, g):
    if dtype == "int8":
        return torch.randint(-128, 128, shape, generator=g, dtype=torch.int8)
    torch_dtype = {"fp16": torch.float16, "e4m3": torch.float8_e4m3fn}[dtype]
    return (torch.randn(shape, generator=g) * 3).to(torch_dtype)


def _inputs(a: str, b: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [_values((45, 71), a, g), _values((71, 37), b, g),
            torch.rand(45, generator=g) / 64 + 2 ** -8, torch.rand(37, generator=g) / 64 + 2 ** -8]


@pytest.mark.parametrize("a, b, dot, acc", [
    ("int8", "int8", "tl.dot(_a, _b, _acc", "tl.int32"),
    ("fp16", "int8", "tl.dot(_a, _b.to(_a.dtype), _acc", "tl.float32"),
    ("int8", "e4m3", "tl.dot(_a.to(tl.float16), _b.to(tl.float16), _acc", "tl.float32")])
def test_an_int8_product_is_exact_to_float32(tmp_path, a, b, dot, acc):
    text = SCALED.format(a=a, b=b, out="fp32")
    m = compile_text(text, f"q8_{a}_{b}", tmp_path)
    source = emit_module(napkin.load_text(text), source_text=text, source_path="q8.ncd")
    assert dot in source and f"_acc = tl.zeros([_BLOCK_m, _BLOCK_n], dtype={acc})" in source
    # the int32 sum is made float32 before the scales, in the forward and in the sum the scales' gradients read
    assert source.count("_acc = _acc.to(tl.float32)") == (2 if acc == "tl.int32" else 0)   # and the backward's sum
    ins = _inputs(a, b, seed=1)
    want = _exact(*ins)
    scale = want.abs().max()
    got = m.q8(*ins)
    # int8 by int8: an exact int32 sum rounded once to float32, then two float32 products
    tol = 4 * 2 ** -24 if acc == "tl.int32" else 1e-5
    assert got.dtype == torch.float32 and (got.double() - want).abs().max() <= tol * scale
    assert (m.reference(*ins).double() - want).abs().max() <= tol * scale
    assert (m.q8(*ins, block_m=16, block_n=32, block_k=32).double() - want).abs().max() <= tol * scale


def test_an_int32_output_holds_the_exact_sum_past_float32s_integers(tmp_path):
    m = compile_text(EXACT, "q32", tmp_path)
    g = torch.Generator().manual_seed(2)
    # values near 127: sums of 2100 products near 3.4e7, past 2**24, where float32 skips odd integers
    a = torch.randint(96, 128, (40, 2100), generator=g, dtype=torch.int8)
    b = torch.randint(-128, -96, (2100, 19), generator=g, dtype=torch.int8)
    want = a.long() @ b.long()
    assert (want.float().long() != want).any()   # a float32 accumulator could not hold these
    got = m.q32(a, b)
    assert got.dtype == torch.int32 and torch.equal(got.long(), want)
    ref = m.reference(a, b)   # in float64 (int8 factors), stored int32
    assert ref.dtype == torch.int32 and torch.equal(ref.long(), want)
    assert "_acc = _acc.to(tl.float32)" not in emit_module(napkin.load_text(EXACT), source_text=EXACT,
                                                            source_path="q32.ncd")


def test_an_int8_product_stores_bf16_and_moves_one_byte_an_element(tmp_path):
    text = SCALED.format(a="int8", b="int8", out="bf16")
    bf16_within_a_unit_moving_the_costed_bytes(text, compile_text(text, "q8_bf16", tmp_path).q8,
                                               _inputs("int8", "int8", seed=3))


def test_int8_inputs_take_int8_tensors_alone(tmp_path):
    m = compile_text(SCALED.format(a="fp16", b="int8", out="fp32"), "q8_fp16_int8", tmp_path)
    a, b, sa, sb = _inputs("fp16", "int8", seed=4)
    with pytest.raises(TypeError, match=r"^B must be a torch.int8 tensor \(declared int8\), not torch.float16$"):
        m.q8(a, b.half(), sa, sb)
    with pytest.raises(TypeError, match=r"^A has dtype torch.int8: the kernel takes float16, bfloat16 or "
                                        r"float32 \(reference\(\) also takes float64\)$"):
        m.q8(b.t().contiguous()[:45], b, sa, sb)


def test_an_int8_products_scales_train_from_the_recomputed_int32_sum(tmp_path):
    """An int8 factor has no gradient (torch keeps none of an integer tensor; need= is told
    so in words); the dequantising scales train, their gradients from the sum recomputed
    by one more int8 product, against float64 autograd.  A product with nothing else to
    train has no backward, and says why."""
    m = compile_text(SCALED.format(a="int8", b="int8", out="fp32"), "q8_int8_int8", tmp_path)
    a, b, sa, sb = _inputs("int8", "int8", seed=5)
    scales_train(m.q8, (a, b, sa, sb), seed=8)
    dc = torch.randn(45, 37, generator=torch.Generator().manual_seed(8))
    assert m.q8_backward(a, b, sa, sb, dc, need=(False, False, True, False))[:2] == (None, None)
    # no gradient product follows the sum, so dR = dC * sa * sb, which only those read, is not computed;
    # where one does (an fp16 factor trains), it is
    sources = {pair: emit_module(napkin.load_text(SCALED.format(a=pair[0], b=pair[1], out="fp32")),
                                 source_text="", source_path="q8.ncd") for pair in (("int8", "int8"), ("fp16", "int8"))}
    assert "_epi_dR" not in sources["int8", "int8"] and "_epi_dR = " in sources["fp16", "int8"]
    # and the cost pass prices dR's store by the same rule
    stored = {pair: {m.tensor for m in backward_cost(napkin.load_text(SCALED.format(a=pair[0], b=pair[1], out="fp32")),
                                                       {"m": 45, "n": 37, "k": 71}).moves if m.direction == "store"}
              for pair in sources}
    assert "dR (C's)" not in stored["int8", "int8"] and "dR (C's)" in stored["fp16", "int8"]
    with pytest.raises(NotImplementedError, match=r"^napkin has no gradient for A: it is int8, an integer tensor, "
                                                  r"which has no gradient \(line 3, column 14 of the diagram\)$"):
        m.q8_backward(a, b, sa, sb, dc, need=(True, False, True, True))
    with pytest.raises(ValueError, match=r"^block_k must be at least 32 here, not 16"):
        m.q8_backward(a, b, sa, sb, dc, block_k=16)
    with pytest.raises(NotImplementedError, match=r"^napkin has no backward for diagram q32: A is int8, an integer "
                                                  r"tensor, which has no gradient \(the forward runs on inputs that "
                                                  r"require no gradient\) \(line 3, column 14 of the diagram\)$"):
        compile_text(EXACT, "q32", tmp_path).q32(a.float().requires_grad_(), b)


def test_int8_outside_a_products_factors_is_refused_in_words():
    side = SCALED.format(a="int8", b="int8", out="fp32").replace("in sb[n] : fp32", "in sb[n] : int8")
    assert _refusal(side).splitlines()[0] == (
        "x.ncd:6:4: napkin cannot emit a kernel for input sb: it is int8: only the factors of a matrix "
        "product or of attention's scores may be int8 (an epilogue's arithmetic on an int8 tile has no Triton "
        "path)")
    attention = (REPO / "examples" / "attention.ncd").read_text()
    first = _refusal(attention.replace("in V[b, h, x, d] : fp16", "in V[b, h, x, d] : int8")).splitlines()
    assert first[0].endswith("napkin cannot emit a kernel for input V: it is int8: an int8 value has no kernel "
                             "path here (attention's P · V product would take P in int8, which needs scaling into "
                             "its range: not generated; int8 Q and K are taken)")
    assert "  hint: declare V fp16 or bf16 (napkin cost prices the int8 diagram)" in first
    out = SCALED.format(a="int8", b="int8", out="int8")
    assert "napkin cannot emit a kernel for output C: its dtype int8 has no Triton kernel path here" in _refusal(out)


def test_tl_dots_dtype_prices_the_product():
    """The cost pass's peak rate is the dtype tl.dot runs in: an int8 pair at the
    int8 rate, int8 by fp16 at fp16's; a profile without an int8 figure upcasts."""
    assert [tiling.dot_dtype(*p) for p in [("int8", "int8"), ("int8", "fp16"), ("bf16", "int8"),
                                           ("int8", "e4m3"), ("fp16", "fp32"), ("fp16", "bf16")]] == \
        ["int8", "fp16", "bf16", "fp16", "fp32", "fp32"]
    sizes = {"m": 4096, "n": 4096, "k": 4096}
    h100 = get_profile("h100")
    for (a, b), rate in {("int8", "int8"): h100["peak_flops_int8"],
                         ("fp16", "int8"): h100["peak_flops_fp16"]}.items():
        report = analyse(napkin.load_text(SCALED.format(a=a, b=b, out="bf16")), sizes, profile="h100")
        assert report.flops.contraction_dtype == tiling.dot_dtype(a, b)
        assert report.roofline.contraction_rate == rate
    cpu = get_profile("cpu")
    assert "peak_flops_int8" not in cpu.figures
    assert cpu.contraction_rate("int8") == (cpu["peak_flops_fp16"], "peak_flops_fp16")


def test_the_demo_runs_an_int8_product_on_int8_values(tmp_path, capsys):
    from napkin.cli import main

    src = tmp_path / "q8.ncd"
    src.write_text(SCALED.format(a="int8", b="int8", out="bf16"))
    assert main(["demo", str(src), "-D", "m=40", "-D", "n=30", "-D", "k=50"]) == 0
    out = capsys.readouterr().out
    assert "float32 inputs (A, B: int8)" in out.splitlines()[0]
    assert "C[40, 30] bfloat16: max abs error" in out and "TOO LARGE" not in out
    assert "dsa[40] float32: max abs error" in out and "(ok, tolerance 0.002 x" in out


def test_an_int8_mask_input_is_told_to_be_int32():
    """int8 is a factor's dtype, not an index type: a length declared int8 is
    refused with the hint to declare it int32, as napkin's ids and lengths are."""
    text = (REPO / "examples" / "ragged_decode.ncd").read_text()
    assert "in n[b] : int32" in text
    first = _refusal(text.replace("in n[b] : int32", "in n[b] : int8")).splitlines()
    assert first[0].endswith("napkin cannot emit a kernel for input n: it is int8: only the factors of a matrix "
                             "product or of attention's scores may be int8 (an epilogue's arithmetic on an int8 "
                             "tile has no Triton path)")
    assert "  hint: declare n int32 if it holds ids or lengths, else fp16 or bf16" in first


def test_an_8_bit_products_sum_takes_32_a_step(tmp_path):
    """NVIDIA's 8-bit mma sums 32 at a time: Triton refused a product of 8-bit
    tiles with a block of 16 along its sum when compiling for sm_90
    (napkin.bench.aot), though its interpreter ran it.  The schedule's block is
    refused in words, a launch option at the call (and by the fakes' checks),
    and the tile search starts at 32 there; a product meeting in fp16 keeps 16."""
    text = SCALED.format(a="int8", b="int8", out="fp32").replace("stream k by 32", "stream k by 16")
    assert _refusal(text).splitlines()[0] == (
        "x.ncd:10:8: napkin cannot emit a kernel for 'stream k by 16': A and B are int8, and a product of "
        "8-bit tiles sums at least 32 of k a step on NVIDIA GPUs (Triton refuses a smaller block when it "
        "compiles for one)")
    assert "  hint: write 'stream k by 32' or more" in _refusal(text).splitlines()
    assert "A and B are e4m3" in _refusal(text.replace(": int8", ": e4m3"))
    emit_module(napkin.load_text(text.replace("in A[m, k] : int8", "in A[m, k] : fp16")), source_text=text,
                source_path="x.ncd")   # int8 by fp16 meets in fp16: 16 a step stands
    m = compile_text(SCALED.format(a="int8", b="int8", out="fp32"), "q8_int8_int8", tmp_path)
    ins = _inputs("int8", "int8", seed=6)
    message = r"^block_k must be at least 32 here, not 16: a product of 8-bit tiles sums 32 of k a step on NVIDIA GPUs$"
    with pytest.raises(ValueError, match=message):
        m.q8(*ins, block_k=16)
    with pytest.raises(ValueError, match=message):
        m._q8_check_options({"m": 45, "n": 37, "k": 71}, block_m=None, block_n=None, block_k=16, num_warps=None,
                             num_stages=None)
    want = _exact(*ins)
    assert (m.q8(*ins, block_k=64).double() - want).abs().max() <= 4 * 2 ** -24 * want.abs().max()
    sizes = {"m": 4096, "n": 4096, "k": 4096}
    scheduled = napkin.load_text(text)
    assert (tiling.least_block(scheduled, "k"), tiling.least_block(scheduled, "m")) == (32, 16)
    for a, least in (("int8", 32), ("fp16", 16)):
        picks = tune(napkin.load_text(SCALED.format(a=a, b="int8" if a == "int8" else "fp16", out="bf16")),
                     sizes, "h100", top=1000)
        assert min(r.block["k"] for r in picks) == least


def test_a_w8a16_layer_trains_its_activations_and_scale(tmp_path):
    """int8 weights beside fp16 activations: dX is a product of dR and the int8 weights (met
    in fp16, which holds them exactly), the scale's gradient reads the recomputed sum; the
    weights get none.  Against float64 autograd of the same values, ragged sizes."""
    text = SCALED.format(a="fp16", b="int8", out="fp16").replace("in sa[m] : fp32\n", "").replace(" * sa", "")
    m = compile_text(text, "w8a16", tmp_path)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(45, 71, generator=g).half().requires_grad_()
    w = torch.randint(-128, 128, (71, 37), generator=g, dtype=torch.int8)
    s = (torch.rand(37, generator=g) / 64 + 2 ** -8).requires_grad_()
    dc = torch.randn(45, 37, generator=g).half()
    gx, gs = torch.autograd.grad(m.q8(x, w, s), (x, s), dc)
    x64, s64 = x.detach().double().requires_grad_(), s.detach().double().requires_grad_()
    wx, ws = torch.autograd.grad((x64 @ w.double()) * s64, (x64, s64), dc.double())
    assert gx.dtype == torch.float16 and (gx.double() - wx).abs().max() <= 2 ** -9 * wx.abs().max()
    assert gs.dtype == torch.float32 and (gs.double() - ws).abs().max() <= 1e-5 * ws.abs().max()
    with pytest.raises(NotImplementedError, match=r"^napkin has no gradient for B: it is int8"):
        m.q8_backward(x, w, s, dc, need=(True, True, True))
