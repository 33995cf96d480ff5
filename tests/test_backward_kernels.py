"""The backward kernels' shapes: the dK/dV kernel's orientation and default
tile, and the sum normalisers (L2, ReLU²), whose products are widened to
float32 for the row state; numerics by tests/test_backward.py's rule."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import napkin
from napkin.codegen import emit_module
from example_sizes import sizes_for

from backward_helpers import (EXAMPLES, REPO, assert_accurate, check, compile_text, example, gradients,
                              launcher)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("backward_kernels")


# --------------------------------------------------------------------------
# The dK/dV kernel's orientation and default tile (backward_emit.py).
# --------------------------------------------------------------------------

def _kernel_source(module_text: str, name: str) -> str:
    import re
    found = re.search(rf"def {name}\(.*?(?=\n@triton\.jit|\ndef _\w+_preprocess)", module_text, re.S)
    assert found, name
    return found.group(0)


@pytest.mark.parametrize("name", [n for n in EXAMPLES if n != "matmul"])
def test_dkdv_kernel_computes_transposed_tiles(name):
    """The dK/dV kernel's tiles are [x, rows]: the scores come out as
    K @ Q^T and every gradient is tile @ operand, with no tile transposed in
    registers; the row state loads as [1, rows].  The dQ kernel keeps the
    forward's [rows, x]."""
    from napkin.codegen import lower as L
    from napkin.codegen import training

    path = REPO / "examples" / f"{name}.ncd"
    d = napkin.load(path)
    b = training.prepare(L.lower(d)).backward
    dkdv, dq = b.kernel("dkdv"), b.kernel("dq")
    assert (dkdv.grid_wire, dkdv.loop_wire) == (b.col, b.row) and (dq.grid_wire, dq.loop_wire) == (b.row, b.col)
    assert (dkdv.dots[0].lhs.tensor, dkdv.dots[0].rhs.tensor) == (b.k, b.q)
    assert (dq.dots[0].lhs.tensor, dq.dots[0].rhs.tensor) == (b.q, b.k)
    text = emit_module(d, source_text=path.read_text(), source_path=str(path))
    source = _kernel_source(text, dkdv.name)
    k, q = dkdv.dots[0].lhs.var, dkdv.dots[0].rhs.var
    assert f"_qk = tl.dot({k}, tl.trans({q})" in source or f"_qk = tl.dot({k}.to(" in source
    accumulations = [line.strip() for line in source.splitlines() if "+= tl.dot(" in line
                     and line.strip().startswith("_acc_")]   # not the scores' second contraction (MLA)
    # K and V, but 8-bit K (examples/sage_attention.ncd), which gets no gradient
    assert len(accumulations) >= len(dkdv.grads) == len(set(b.trained) - set(b.qs))
    assert not any("tl.trans(" in line for line in accumulations), accumulations
    assert f"_ok = _ok_{b.col}[:, None] & _gok_{b.row}[None, :]" in source
    for ld in dkdv.loads:
        if ld.wires and b.row in ld.wires and b.col not in ld.wires and ld.cols not in b.dims:
            assert (ld.rows, ld.cols) == (None, b.row), ld       # row state: [1, rows]
    dq_source = _kernel_source(text, dq.name)
    assert f"_qk = tl.dot({dq.dots[0].lhs.var}, tl.trans(" in dq_source


class _Launches:
    """Stands in for a Triton kernel: records each launch's grid and options."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((grid, kw))


def _backward_launches(m, name, sizes, monkeypatch, **options):
    dkdv, dq = _Launches(), _Launches()
    monkeypatch.setattr(m, f"_{name}_bwd_dkdv_kernel", dkdv)
    monkeypatch.setattr(m, f"_{name}_bwd_dq_kernel", dq)
    inputs = m.example_inputs(sizes, dtype=torch.float16)
    q = inputs[0]
    do, lse, delta = torch.randn_like(q), torch.zeros(q.shape[:-1]), torch.zeros(q.shape[:-1])
    getattr(m, f"{name}_backward")(*inputs, do, lse, delta, **options)
    [(_, kv)], [(_, qq)] = dkdv.calls, dq.calls
    pick = ("_BLOCK_q", "_BLOCK_x", "num_warps", "num_stages")
    return tuple(kv[p] for p in pick), tuple(qq[p] for p in pick)


def test_dkdv_default_tile_is_the_forward_tile_transposed(folder, monkeypatch):
    """No block given: dK/dV's keys take the schedule's row block (128) and
    its rows the streamed block (64), halved while a thread would hold more
    than HELD_FP32 float32 values (head dim 128: 32 rows); 8 warps when
    either block is 128 or more.  Blocks given apply to every kernel as
    given.  dQ keeps the forward's blocks and warps, its keys halved past
    HELD_FP32 too (with 4 warps given: 32 keys)."""
    from napkin.codegen.backward_hold import HELD_FP32

    assert HELD_FP32 == 160
    causal = example("causal", folder)
    sizes = {"b": 1, "h": 2, "q": 40, "x": 50}
    kv, dq = _backward_launches(causal, "causal", sizes, monkeypatch)
    assert kv == (64, 128, 8, 2) and dq == (128, 64, 8, 2)
    kv, dq = _backward_launches(causal, "causal", sizes, monkeypatch, num_warps=4, num_stages=3)
    # 4 warps: dK/dV's rows halve to 32, then its keys to 64 (64 x (64 + 64 + 2 * 32)); dQ's keys to 32
    assert kv == (32, 64, 4, 3) and dq == (128, 32, 4, 3)
    kv, dq = _backward_launches(causal, "causal", sizes, monkeypatch, block_q=16, block_x=32)
    assert kv == dq == (16, 32, 4, 2)
    kv, dq = _backward_launches(causal, "causal", sizes, monkeypatch, block_x=32)
    assert kv == dq == (128, 32, 8, 2)
    kv, dq = _backward_launches(causal, "causal", sizes, monkeypatch, block_q=64, block_x=128)
    assert kv == (64, 128, 8, 2) and dq == (64, 128, 4, 2)       # dK/dV: 8 warps when either block is 128
    gqa = example("gqa", folder)    # head dim 128
    kv, dq = _backward_launches(gqa, "gqa", {"b": 1, "hk": 1, "g": 2, "q": 40, "x": 50}, monkeypatch)
    assert kv == (32, 128, 8, 2) and dq == (128, 64, 8, 2)
    # the cost pass evaluates the same rule (backward_hold.dkdv_default_tile)
    from napkin.codegen import lower, training
    from napkin.codegen.backward_hold import dkdv_default_tile

    for stem, sizes, tile in (("causal", sizes, (64, 128, 8)), ("gqa", {"q": 40, "x": 50}, (32, 128, 8))):
        plan = training.prepare(lower.lower(napkin.load(REPO / "examples" / f"{stem}.ncd"))).backward
        assert dkdv_default_tile(plan, sizes) == tile
        br, bc, _ = dkdv_default_tile(plan, sizes, num_warps=4)
        assert br * bc < tile[0] * tile[1]    # fewer threads: a smaller tile
    # decode's 16 rows make 16 keys: mma.sync, its operands in registers HELD_FP32 does not count;
    # the rows go to 32 (64 spilled on sm_90, Triton 3.6 and 3.9)
    plan = training.prepare(lower.lower(napkin.load(REPO / "examples" / "decode.ncd"))).backward
    assert dkdv_default_tile(plan, {"q": 40, "x": 50}) == (32, 16, 4)


def test_each_backward_kernel_takes_its_own_tuned_config(folder, monkeypatch, tmp_path):
    """napkin bench tunes dQ (cache kind "bwd") and dK/dV ("bwd_kv") apart:
    with both entries cached, each kernel launches with its own; options
    given explicitly still apply to both."""
    import json

    from napkin import tunecache

    causal = example("causal", folder)
    sizes = {"b": 1, "h": 2, "q": 40, "x": 50}
    wires = ("b", "h", "q", "x")
    key = {kind: tunecache.cache_key(causal.SOURCE_HASH, "cpu", {"fp16": "float16"}, sizes, wires, kind) for kind in ("bwd", "bwd_kv")}
    entries = {key["bwd"]: {"config": {"block_q": 64, "block_x": 16, "num_warps": 4, "num_stages": 3}},
               key["bwd_kv"]: {"config": {"block_q": 16, "block_x": 64, "num_warps": 8, "num_stages": 2}}}
    (tmp_path / "autotune.json").write_text(json.dumps({"schema": tunecache.SCHEMA, "entries": entries}))
    monkeypatch.setenv("NAPKIN_CACHE", str(tmp_path))
    kv, dq = _backward_launches(causal, "causal", sizes, monkeypatch)
    assert dq == (64, 16, 4, 3) and kv == (16, 64, 8, 2)
    kv, dq = _backward_launches(causal, "causal", sizes, monkeypatch, block_q=32, block_x=32, num_warps=4,
                                num_stages=2)
    assert kv == dq == (32, 32, 4, 2)


@pytest.mark.parametrize("name, blocks", [("alibi", (16, 32)), ("document_mask", (16, 32)),
                                          ("gqa", (32, 16)), ("sliding_window", (32, 16))])
def test_dkdv_gradients_with_non_square_blocks(name, blocks, folder):
    """Masked diagrams with side inputs, document ids and a GQA group sum,
    ragged sizes, rectangular blocks both ways: the [x, rows] tiles' masks,
    row state and bounds against float64 autograd."""
    m = example(name, folder)
    bq, bx = blocks
    check(m, sizes_for(name, 45, 70), torch.float32, label=f"{name} {blocks}", block_q=bq, block_x=bx)


def test_dkdv_default_tile_gradients(folder):
    """The launch with no options (dK/dV at 128 keys by 64 rows, dQ at the
    forward's 128 by 64), a ragged size, against float64 autograd."""
    m = example("causal", folder)
    inputs = m.example_inputs({"b": 1, "h": 1, "q": 70, "x": 150}, dtype=torch.float32, seed=2)
    got = gradients(m.causal, inputs)
    exact = gradients(m.reference, [t.double() for t in inputs])
    assert_accurate(got, exact, gradients(m.reference, inputs), "causal, default blocks")


# --------------------------------------------------------------------------
# Sum normalisers (L2, ReLU²): products widened to float32 for the row state.
# --------------------------------------------------------------------------

SUM_NORMALISED = ["l2_attention", "relu2_attention"]
HEAD_128 = ("wire d = 64", "wire d = 128")


def _all_launches(m, name, sizes, monkeypatch, **options):
    """{kernel role: (block of q, block of x or None, num_warps)} of a launch
    through autograd; the backward kernels only recorded."""
    calls = {role: _Launches() for role in ("rows", "dkdv", "dq")}
    for role, stub in calls.items():
        monkeypatch.setattr(m, f"_{name}_bwd_{role}_kernel", stub)
    gradients(launcher(m), m.example_inputs(sizes, dtype=torch.float16), **options)
    out = {}
    for role, stub in calls.items():
        [(_, kw)] = stub.calls
        out[role] = (kw["_BLOCK_q"], kw.get("_BLOCK_x"), kw["num_warps"])
    return out, calls


@pytest.mark.parametrize("name", SUM_NORMALISED)
def test_sum_normaliser_default_tiles(name, folder, monkeypatch):
    """dF/dN = 1 / b(Z) is one float32 value a row (gN0), so dA = gN0 * dP
    with dP = dO . V a 16-bit product as softmax's, and dV's weight tile
    A0 * gN0 enters its product in the kernel dtype as softmax's P: nothing
    is held in float32 beyond softmax's tiles, and the default tiles are
    softmax's (head dim 64: dK/dV 128 keys by 64 rows; 128: by 32 rows; dQ
    128 rows by 64 keys; the rows kernel holds no [rows, feature] tile past
    its row sum: 128 rows).  No product is widened to float32 (no _WIDE).
    The launcher runs the rule dkdv_default_tile evaluates for the cost pass."""
    from napkin.codegen import lower, training
    from napkin.codegen.backward_hold import dkdv_default_tile, dq_default_tile

    sizes = {"b": 1, "h": 2, "q": 40, "x": 50}
    for replace, kv, dq, rows in (((), (64, 128, 8), (128, 64, 8), (128, None, 4)),
                                  ((HEAD_128,), (32, 128, 8), (128, 64, 8), (128, None, 4))):
        m = example(name, folder, *replace)
        got, calls = _all_launches(m, name, sizes, monkeypatch)
        assert got == {"rows": rows, "dkdv": kv, "dq": dq}, replace
        assert "_WIDE" not in calls["dkdv"].calls[0][1] and "_WIDE" not in calls["dq"].calls[0][1]
        text = (REPO / "examples" / f"{name}.ncd").read_text()
        for old, new in replace:
            text = text.replace(old, new)
        plan = training.prepare(lower.lower(napkin.load_text(text, f"{name}.ncd"))).backward
        assert dkdv_default_tile(plan, sizes) == kv and dq_default_tile(plan, sizes) == dq
        assert plan.row_outputs == ("gN0", "dZ0") and plan.state == ("dO", "gN0", "dZ0")
    # blocks given still apply to every kernel as given
    got, _ = _all_launches(m, name, sizes, monkeypatch, block_q=16, block_x=32)
    assert got == {"rows": (16, None, 4), "dkdv": (16, 32, 4), "dq": (16, 32, 4)}


@pytest.mark.parametrize("name, head, dtype", [
    (name, head, dtype) for name in SUM_NORMALISED
    for head, dtype in [(64, torch.float32), (64, torch.float16), (128, torch.float16), (128, torch.float32)]
    if (name, head, dtype) != ("relu2_attention", 128, torch.float32)],
    ids=lambda v: v if isinstance(v, str) else f"d{v}" if isinstance(v, int) else str(v).replace("torch.", ""))
def test_sum_normaliser_default_tile_gradients(name, head, dtype, folder):
    """The launch with no options (softmax's tiles: head dim 64, dK/dV at 128
    keys by 64 rows; 128: by 32 rows; dQ at 128 rows by 64 keys),
    ragged sizes that leave partial blocks of both wires, against float64
    autograd.  (ReLU² at head dim 128 in fp32 is left out: seed 3 puts a row
    with a single positive score there, where its weight gradient cancels at
    any block size and the float32 reference's own error is a matter of
    summation order (docs/training.md, "Float32 and ReLU² attention"): the
    rule holds for seed 3 with today's tiles and failed with earlier ones,
    and fails for some seeds either way.)"""
    m = example(name, folder, *((HEAD_128,) if head == 128 else ()))
    inputs = m.example_inputs({"b": 1, "h": 1, "q": 70, "x": 150}, dtype=dtype, seed=3)
    got = gradients(launcher(m), inputs)
    exact = gradients(m.reference, [t.double() for t in inputs])
    assert_accurate(got, exact, gradients(m.reference, inputs), f"{name} d{head} {dtype}, default blocks", dtype)


@pytest.mark.parametrize("name", SUM_NORMALISED)
def test_sum_normaliser_weights_past_float16_train(name, folder):
    """Inputs times 20: ReLU² weights near 10^5, raw scores past 2^14.  The
    forward rounded them to float16 for the product with V (inf, the rows
    NaN, and every gradient through delta = rowsum(dO * O) with them); its
    rows are scaled by a power of two first now (codegen/weights.py)."""
    m = example(name, folder)
    inputs = [t * 20 for t in m.example_inputs({"b": 1, "h": 2, "q": 45, "x": 70}, dtype=torch.float16, seed=4)]
    s = torch.einsum("bhqd,bhxd->bhqx", inputs[0].double(), inputs[1].double()) / 8
    assert s.max() > 300   # a ReLU² weight past float16's 65504
    (out,) = [launcher(m)(*inputs)]
    assert_accurate([out], [m.reference(*[t.double() for t in inputs])], [m.reference(*inputs)], f"{name} x20")
    got = gradients(launcher(m), inputs)
    exact = gradients(m.reference, [t.double() for t in inputs])
    for k, e in zip(got, exact):
        # not the 4-ulp floor: dS is rounded to float16 for its products, as FlashAttention's
        # is, and these peaked rows cancel in dK (0.03 of 6.1 already at x5, nothing past 2^14)
        assert torch.isfinite(k).all() and (k.double() - e).abs().max() < 0.01 * e.abs().max()


# dF/dN0 = 2 N0 / (Z0 + 1) reads N0: no per-row factor, so the backward keeps
# dN0 = dO dF/dN0 as float32 [rows, d] row state and widens the products it
# enters (dA0 = dN0 . V, dV += A0^T dN0) to float32 (gradrules.sums_rule).
N_SQUARED = """
diagram n_squared
wire b, h, q, x
wire d = 64
in Q[b, h, q, d] : fp16
in K[b, h, x, d] : fp16
in V[b, h, x, d] : fp16
S[b, h, q, x] = sum[d](Q * K) * |d|^-0.5
N[b, h, q, d] = sum[x](S * V)
O[b, h, q, d] : fp16 = N * N / (sum[x](S * S) + 1)
out O
"""


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_factor_reading_n_keeps_float32_dn(dtype, folder):
    """The dN form: the rows kernel stores dN0 [rows, d] in float32, the
    main kernels take its products in float32 (_WIDE: tf32 for 16-bit
    inputs), and the gradients meet the rule, at given and default tiles."""
    m = compile_text(N_SQUARED, "n_squared", folder)
    src = Path(m.__file__).read_text()
    assert "_dA0 = tl.dot(" in src and ".to(tl.float32)" in src and "_dP" not in src
    assert m._n_squared_preprocess.__doc__.startswith("(dN0, dZ0)")
    sizes = {"b": 1, "h": 2, "q": 70, "x": 150}
    check(m, sizes, dtype, seed=3, label=f"n_squared {dtype}", block_q=16, block_x=32)
    inputs = m.example_inputs(sizes, dtype=dtype, seed=3)
    got = gradients(launcher(m), inputs)
    exact = gradients(m.reference, [t.double() for t in inputs])
    assert_accurate(got, exact, gradients(m.reference, inputs), f"n_squared {dtype}, default blocks", dtype)


def test_widened_tf32_products_are_accurate_enough(folder, monkeypatch):
    """With 16-bit inputs the products widened to float32 (the dN form,
    N_SQUARED) run as tf32 on tensor cores (backward_hold.wide_precision).
    The interpreter computes every product in full float32, so here its tf32
    products take operands truncated to tf32's 10 stored mantissa bits
    (coarser than the hardware's rounding): fp16 gradients still meet the
    rule of the module docstring."""
    import numpy as np
    from triton.runtime import interpreter

    real = interpreter.InterpreterBuilder.create_dot
    seen = []

    def tf32_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if "TF32" in str(input_precision).upper() and "X3" not in str(input_precision).upper():
            seen.append(a.data.dtype)
            a = interpreter.TensorHandle(_tf32(a.data), a.dtype) if a.data.dtype == np.float32 else a
            b = interpreter.TensorHandle(_tf32(b.data), b.dtype) if b.data.dtype == np.float32 else b
        return real(self, a, b, d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", tf32_dot)
    m = compile_text(N_SQUARED.replace("wire d = 64", "wire d = 128"), "n_squared_128", folder)
    inputs = m.example_inputs({"b": 1, "h": 1, "q": 70, "x": 150}, dtype=torch.float16, seed=4)
    got = gradients(launcher(m), inputs)
    assert seen, "no product ran as tf32"
    exact = gradients(m.reference, [t.double() for t in inputs])
    assert_accurate(got, exact, gradients(m.reference, inputs), "n_squared, tf32 products", torch.float16)


def _tf32(x):
    """float32 values truncated to tf32 (10 mantissa bits)."""
    import numpy as np

    return (np.ascontiguousarray(x).view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)


WHOLE_TILE_BIAS = """
diagram bias_{name}
wire b, h, q, x
wire d = 32
in Q[b, h, q, d] : fp16
in K[b, h, x, d] : fp16
in V[b, h, x, d] : fp16
in bias[{axes}] : fp32
S[b, h, q, x] = sum[d](Q * K) * |d|^-0.5 + bias
P[b, h, q, x] = softmax[x](S)
O[b, h, q, d] : fp16 = sum[x](P * V)
out O
"""


@pytest.mark.parametrize("axes", ["b, h, q, x", "h, q, x", "q, x"])
def test_side_input_gradient_over_the_whole_tile(axes, folder):
    """A score bias with both tile wires: with every batch wire too its
    partial sums need no summing afterwards (the launcher summed over no
    axes, which torch reads as all of them: a reshape error); with fewer,
    the missing batch wires are summed away."""
    name = axes.replace(", ", "")
    m = compile_text(WHOLE_TILE_BIAS.format(name=name, axes=axes), f"bias_{name}", folder)
    check(m, {"b": 2, "h": 3, "q": 37, "x": 45}, torch.float32, label=f"bias[{axes}]", block_q=16, block_x=32)
