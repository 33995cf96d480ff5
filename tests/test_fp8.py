"""fp8 (e4m3, e5m2) factors of a matrix product: the forward kernel and its refusals.

tl.dot multiplies an fp8 pair as it is (the tensor cores' fp8 rate on Hopper);
mixed kinds meet in fp16, an fp8 factor beside a wider one in that one's dtype
(each holds fp8 exactly).  Products of fp8 values are exact in float32, so the
kernel is checked against float64 of the same fp8 values, on ragged sizes.
Attention, an epilogue's fp8 tile and an fp8 gradient are refused in words.
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
import torch

import napkin
from napkin.bytecount import ByteCounter
from napkin.codegen import emit_module
from napkin.cost import analyse
from napkin.errors import NapkinError
from backward_helpers import compile_text

SCALED = """diagram f8
wire m, n, k
in A[m, k] : {a}
in B[k, n] : {b}
in sa[m] : fp32
in sb[n] : fp32
C[m, n] : {out} = sum[k](A * B) * sa * sb
out C
schedule {{ level smem {{ group m by 32, n by 16
stream k by 32 }} }}
"""

REPO = Path(__file__).resolve().parent.parent
_TORCH = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "fp16": torch.float16}


def _inputs(a: str, b: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(45, 71, generator=g) * 3).to(_TORCH[a]), (torch.randn(71, 37, generator=g) * 3).to(_TORCH[b]),
            torch.rand(45, generator=g) + 0.5, torch.rand(37, generator=g) + 0.5]


def _exact(a, b, sa, sb):
    return (a.double() @ b.double()) * sa.double()[:, None] * sb.double()


@pytest.mark.parametrize("a, b, cast", [("e4m3", "e4m3", None), ("e5m2", "e5m2", None),
                                        ("e4m3", "e5m2", "_a.to(tl.float16), _b.to(tl.float16)"),
                                        ("e4m3", "fp16", "_a.to(_b.dtype), _b")])
def test_an_fp8_product_is_exact_to_float32(tmp_path, a, b, cast):
    text = SCALED.format(a=a, b=b, out="fp32")
    m = compile_text(text, f"f8_{a}_{b}", tmp_path)
    source = emit_module(napkin.load_text(text), source_text=text, source_path="f8.ncd")
    assert (f"tl.dot({cast}, _acc" in source) if cast else "tl.dot(_a, _b, _acc" in source
    ins = _inputs(a, b, seed=1)
    want = _exact(*ins)
    got = m.f8(*ins)
    assert got.dtype == torch.float32 and (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    assert (m.reference(*ins).double() - want).abs().max() <= 1e-5 * want.abs().max()
    # other blocks, and fp16 tensors where e4m3 is declared (the kernels take them as they are)
    assert (m.f8(*ins, block_m=16, block_n=32, block_k=32).double() - want).abs().max() <= 1e-5 * want.abs().max()
    wide = [t.to(torch.float16) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t for t in ins]
    assert (m.f8(*wide).double() - want).abs().max() <= 1e-3 * want.abs().max()


def bf16_within_a_unit_moving_the_costed_bytes(text: str, call, ins) -> None:
    """A scaled 8-bit product's (``text``, run by ``call`` on ``ins``, 45 x 37 by 71) bf16
    output, each entry within one bf16 unit of float64's of the same values (Triton's
    interpreter rounds float32 to bf16 toward zero), and the bytes it moved, tensor by
    tensor, the cost pass's: one byte an 8-bit element.  test_int8 shares it."""
    want = _exact(*ins)
    with ByteCounter(tensors=dict(zip(("A", "B", "sa", "sb"), ins))) as bc:
        got = call(*ins)
    assert got.dtype == torch.bfloat16 and ((got.double() - want).abs() <= 2 ** -7 * want.abs() + 1e-30).all()
    moved = defaultdict(int), defaultdict(int)
    for t in analyse(napkin.load_text(text), {"m": 45, "n": 37, "k": 71}).transfers:
        moved[t.direction == "store"][t.tensor] += t.bytes
    assert (dict(bc.loads), dict(bc.stores)) == (dict(moved[0]), dict(moved[1]))
    assert bc.loads["A"] == 45 * 71 * 3   # one byte an element, read by each of the 3 column blocks


def scales_train(call, ins, seed: int) -> None:
    """The scales' gradients of a scaled 8-bit product (``call`` on ``ins``, fp32 output)
    through autograd, against float64 autograd of the same values.  test_int8 shares it."""
    a, b, sa, sb = ins
    sa, sb = sa.detach().requires_grad_(), sb.detach().requires_grad_()
    dc = torch.randn(45, 37, generator=torch.Generator().manual_seed(seed))
    got = torch.autograd.grad(call(a, b, sa, sb), (sa, sb), dc)
    sa64, sb64 = sa.detach().double().requires_grad_(), sb.detach().double().requires_grad_()
    want = torch.autograd.grad(_exact(a, b, sa64, sb64), (sa64, sb64), dc.double())
    for g, w in zip(got, want):
        assert g.dtype == torch.float32 and (g.double() - w).abs().max() <= 1e-5 * w.abs().max()


def test_an_fp8_product_stores_bf16_and_moves_one_byte_an_element(tmp_path):
    text = SCALED.format(a="e4m3", b="e4m3", out="bf16")
    bf16_within_a_unit_moving_the_costed_bytes(text, compile_text(text, "f8_bf16", tmp_path).f8,
                                               _inputs("e4m3", "e4m3", seed=2))


def test_fp8_tensors_go_only_where_fp8_is_declared(tmp_path):
    m = compile_text(SCALED.format(a="e4m3", b="fp16", out="fp32"), "f8_e4m3_fp16", tmp_path)
    a, b, sa, sb = _inputs("e4m3", "e4m3", seed=3)
    with pytest.raises(TypeError, match=r"^B has dtype torch.float8_e4m3fn: the kernel takes float16, bfloat16 "
                                        r"or float32 \(reference\(\) also takes float64\)$"):
        m.f8(a, b, sa, sb)
    with pytest.raises(TypeError, match=r"^A has dtype torch.float64: the kernel takes float16, bfloat16 or "
                                        r"float32 \(reference\(\) also takes float64\), or float8_e4m3fn or "
                                        r"float8_e5m2 \(declared e4m3\)$"):
        m.f8(a.double(), b.half(), sa, sb)


def test_an_fp8_products_scales_train_and_its_factors_say_why_they_do_not(tmp_path):
    """An fp8 factor's gradient, stored in fp8, saturated (dA off by 450 on a max of 19):
    no factor gets one, in words; the dequantising scales do, from the recomputed sum."""
    m = compile_text(SCALED.format(a="e4m3", b="e4m3", out="fp32"), "f8_e4m3_e4m3", tmp_path)
    a, b, sa, sb = _inputs("e4m3", "e4m3", seed=4)
    scales_train(m.f8, (a, b, sa, sb), seed=7)
    with pytest.raises(NotImplementedError, match=r"^napkin has no gradient for A: it is e4m3, and an fp8 gradient "
                                                  r"needs scaling into its range, which napkin does not generate "
                                                  r"\(line 3, column 14 of the diagram\)$"):
        m.f8(a.float().to(torch.float8_e4m3fn).requires_grad_(), b, sa, sb)
    plain = SCALED.format(a="e4m3", b="e4m3", out="fp32").replace(" * sa * sb", "")
    with pytest.raises(NotImplementedError, match=r"^napkin has no backward for diagram f8: A is e4m3, and an fp8 "
                                                  r"gradient needs scaling into its range, which napkin does not "
                                                  r"generate \(the forward runs on inputs that require no "
                                                  r"gradient\) \(line 3, column 14 of the diagram\)$"):
        compile_text(plain, "f8_plain", tmp_path).f8(a.float().to(torch.float8_e4m3fn).requires_grad_(), b, sa, sb)


def _refusal(text: str) -> str:
    with pytest.raises(NapkinError) as err:
        emit_module(napkin.load_text(text, "x.ncd"), source_text=text, source_path="x.ncd")
    return str(err.value)


def test_fp8_outside_a_products_factors_is_refused_in_words():
    side = SCALED.format(a="e4m3", b="e4m3", out="fp32").replace("in sb[n] : fp32", "in sb[n] : e4m3")
    assert _refusal(side).splitlines()[0] == (
        "x.ncd:6:4: napkin cannot emit a kernel for input sb: it is e4m3: only the factors of a matrix "
        "product or of attention's scores may be fp8 (an epilogue's arithmetic on an fp8 tile has no Triton "
        "path)")
    first = _refusal((REPO / "examples" / "attention_fp8.ncd").read_text()).splitlines()
    assert first[0] == ("x.ncd:14:4: napkin cannot emit a kernel for input V: it is e4m3: "
                        "an fp8 value has no kernel path here (attention's P · V product would take P in fp8, which "
                        "needs scaling into its range: not generated; fp8 Q and K are taken)")
    assert "  hint: declare V fp16 or bf16 (napkin cost prices the fp8 diagram)" in first
    out = SCALED.format(a="e4m3", b="e4m3", out="e4m3")
    assert "napkin cannot emit a kernel for output C: its dtype e4m3 has no Triton kernel path here" in _refusal(out)


def test_e4m3_on_a_gpu_older_than_sm_89_is_refused_in_words(tmp_path, monkeypatch):
    """Triton compiles e4m3 for compute capability 8.9 and newer: for sm_80 its
    compile failed ("type fp8e4nv not supported in this architecture",
    napkin.bench.aot --arch 80), where e5m2 and float16 compile.  The launcher
    says so before Triton does.  No GPU here: a CUDA tensor's three attributes
    the check reads, and the capability, are stood in for."""
    from types import SimpleNamespace

    m = compile_text(SCALED.format(a="e4m3", b="e4m3", out="fp32"), "f8_e4m3_e4m3", tmp_path)
    gpu = SimpleNamespace(dtype=torch.float8_e4m3fn, is_cuda=True, device="cuda:0")
    for capability, refused in (((8, 0), True), ((8, 9), False), ((9, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, c=capability: c)
        if refused:
            with pytest.raises(TypeError, match=r"^A is float8_e4m3fn, which Triton compiles for GPUs of compute "
                                                r"capability 8.9 or newer, and this one is 8.0: pass it as float16 "
                                                r"or float8_e5m2 \(declared e4m3, it takes either\)$"):
                m._check_dtype("A", gpu, "e4m3", True, {})
        else:
            m._check_dtype("A", gpu, "e4m3", True, {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    m._check_dtype("A", SimpleNamespace(dtype=torch.float8_e5m2, is_cuda=True, device="cuda:0"), "e4m3", True, {})
    m._check_dtype("A", gpu, "e4m3", False, {})   # reference() runs it in torch
