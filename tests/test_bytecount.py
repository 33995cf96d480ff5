"""The byte counter (napkin/bytecount.py) on small hand-written Triton kernels.

Each test predicts by hand, from the kernel's own loop structure, the bytes
its masked loads and stores move, and checks the counter agrees exactly:
masked-out lanes must not count, every call must, and bytes must land on the
right tensor.  (tests/test_cost.py uses the counter on napkin's generated
kernels.)
"""
from __future__ import annotations

import math
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the byte counter counts only under TRITON_INTERPRET=1", allow_module_level=True)

import triton
import triton.language as tl

from napkin.bytecount import ByteCounter


@triton.jit
def _scale_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < n
    x = tl.load(x_ptr + offs, mask=keep, other=0.0)
    tl.store(y_ptr + offs, x * 2, mask=keep)


@triton.jit
def _tiled_matmul(a_ptr, b_ptr, c_ptr, M, N, K,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pm, pn = tl.program_id(0), tl.program_id(1)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        a = tl.load(a_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        b = tl.load(b_ptr + rk[:, None] * N + rn[None, :], mask=(rk[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc += tl.dot(a, b)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _descriptor_copy(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    start = tl.program_id(0) * BLOCK
    src = tl.make_tensor_descriptor(x_ptr, shape=[n], strides=[1], block_shape=[BLOCK])
    dst = tl.make_tensor_descriptor(y_ptr, shape=[n], strides=[1], block_shape=[BLOCK])
    dst.store([start], src.load([start]))


@pytest.mark.parametrize("n", [1, 100, 128, 333])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_ragged_copy_counts_only_live_lanes(n, dtype):
    x = torch.randn(n, dtype=dtype)
    y = torch.empty_like(x)
    with ByteCounter(tensors={"x": x, "y": y}) as bc:
        _scale_kernel[(triton.cdiv(n, 64),)](x, y, n, BLOCK=64)
    size = x.element_size()
    assert bc.launches == 1
    assert dict(bc.loads) == {"x": n * size}
    assert dict(bc.stores) == {"y": n * size}
    assert bc.load_calls == bc.store_calls == triton.cdiv(n, 64)
    torch.testing.assert_close(y, x * 2)


@pytest.mark.parametrize("m,n,k", [(64, 64, 64), (50, 70, 40), (33, 17, 100)])
def test_tiled_matmul_rereads(m, n, k):
    """A is re-read once per column block, B once per row block: the
    textbook H = abc(1/g_a + 1/g_c) + ac, exact with ragged edges."""
    bm, bn, bk = 32, 32, 16
    a, b = torch.randn(m, k), torch.randn(k, n)
    c = torch.empty(m, n)
    with ByteCounter(tensors={"A": a, "B": b, "C": c}) as bc:
        _tiled_matmul[(triton.cdiv(m, bm), triton.cdiv(n, bn))](a, b, c, m, n, k, BM=bm, BN=bn, BK=bk)
    assert bc.loads["A"] == m * k * math.ceil(n / bn) * 4
    assert bc.loads["B"] == k * n * math.ceil(m / bm) * 4
    assert dict(bc.stores) == {"C": m * n * 4}
    torch.testing.assert_close(c, a @ b, rtol=1e-4, atol=1e-4)


def test_tensor_descriptor_loads_are_counted():
    """Descriptor loads and stores clip at the tensor's edge: the padding moves nothing."""
    n = 150
    x = torch.arange(n, dtype=torch.float32)
    y = torch.zeros_like(x)
    with ByteCounter(tensors={"x": x, "y": y}) as bc:
        _descriptor_copy[(triton.cdiv(n, 64),)](x, y, n, BLOCK=64)
    assert dict(bc.loads) == {"x": n * 4}
    assert dict(bc.stores) == {"y": n * 4}
    assert torch.equal(x, y)


def test_unnamed_tensors_fall_back_to_parameter_names_and_views_share_storage():
    x = torch.randn(2, 100)
    y = torch.empty(100)
    with ByteCounter() as bc:
        _scale_kernel[(2,)](x[1], y, 100, BLOCK=64)   # a view: bytes go to x's storage
    assert dict(bc.loads) == {"x_ptr": 400}
    assert dict(bc.stores) == {"y_ptr": 400}


def test_counter_restores_the_interpreter():
    from triton.runtime import interpreter

    before = (interpreter.InterpreterBuilder.create_masked_load,
              interpreter.InterpreterBuilder.create_masked_store,
              interpreter.GridExecutor._init_args_hst)
    with ByteCounter():
        pass
    with pytest.raises(ZeroDivisionError):
        with ByteCounter():
            1 / 0
    after = (interpreter.InterpreterBuilder.create_masked_load,
             interpreter.InterpreterBuilder.create_masked_store,
             interpreter.GridExecutor._init_args_hst)
    assert before == after
    # and nothing is counted outside the block
    x, y = torch.randn(10), torch.empty(10)
    with ByteCounter() as bc:
        pass
    _scale_kernel[(1,)](x, y, 10, BLOCK=16)
    assert bc.total == 0 and bc.launches == 0
