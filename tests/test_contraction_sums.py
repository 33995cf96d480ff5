"""A contraction whose sum runs over more than the streamed wire (ContractionPlan.outer).

``sum[k, j](A * B)`` streaming j: each program loops over k index by index around
its stream of j (it was refused, "a contraction kernel streams one wire", with a
hint to flatten (k j) by hand).  The same loop gives the gradient of a factor
shared along a batch wire, nn.Linear's weight W[k, n] beside X[b, m, k]: dW sums
over b as well as m, in one launch and no scratch.  Numerics against float64
torch on ragged sizes (no block divides them), gradients included; bytes counted
in the interpreter against the cost pass, forward and backward.
"""
from __future__ import annotations

from collections import defaultdict

import pytest
import torch

import napkin
from napkin import tiling
from backward_helpers import compile_text, gradients
from napkin.bytecount import ByteCounter
from napkin.cost import analyse, backward_cost
from napkin.cost.model import kernels

TWO_WIRES = """diagram mm2
wire m, n, k, j
in A[m, k, j] : {dt}
in B[k, j, n] : {dt}
C[m, n] : {dt} = sum[k, j](A * B) * 0.5
out C
schedule {{ level smem {{ group m by 16, n by 16
stream j by 16 }} }}
"""

LINEAR = """diagram lin
wire b, m, n, k
in X[b, m, k] : fp32
in W[k, n] : fp32
Y[b, m, n] : fp32 = sum[k](X * W)
out Y
schedule { level smem { group b by 1, m by 16, n by 16
stream k by 16 } }
"""


def _two_wire_inputs(dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(37, 3, 45, generator=g).to(dtype), torch.randn(3, 45, 29, generator=g).to(dtype)]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float16, 2e-2)], ids=["fp32", "fp16"])
def test_a_sum_over_two_wires_runs_and_trains(tmp_path, dtype, tol):
    m = compile_text(TWO_WIRES.format(dt="fp32" if dtype == torch.float32 else "fp16"), f"mm2_{dtype}", tmp_path)
    ins = _two_wire_inputs(dtype, seed=3)

    def exact(a, b):
        return torch.einsum("mkj,kjn->mn", a, b) * 0.5

    want = exact(*(t.double() for t in ins))
    got = m.mm2(*ins)
    assert got.shape == (37, 29) and (got.double() - want).abs().max() <= tol * want.abs().max()
    other = m.mm2(*ins, block_m=32, block_n=16, block_j=32)   # other blocks, the same sums
    assert (other.double() - want).abs().max() <= tol * want.abs().max()
    grads = gradients(m.mm2, ins)
    for g, e in zip(grads, gradients(exact, [t.double() for t in ins])):
        assert g.shape == e.shape and (g.double() - e).abs().max() <= tol * e.abs().max()


def test_a_sum_over_two_wires_moves_the_bytes_the_cost_pass_counts(tmp_path):
    """Each program reads its rows of A and its columns of B over every (k, j) once: the cost
    pass's transfers, byte for byte, at blocks that do not divide the sizes."""
    d = napkin.load_text(TWO_WIRES.format(dt="fp32"))
    m = compile_text(TWO_WIRES.format(dt="fp32"), "mm2_bytes", tmp_path)
    ins = _two_wire_inputs(torch.float32, seed=4)
    with ByteCounter(tensors={"A": ins[0], "B": ins[1]}) as bc:
        m.mm2(*ins)
    want = defaultdict(int), defaultdict(int)
    for t in analyse(d, {"m": 37, "n": 29, "k": 3, "j": 45}).transfers:
        want[t.direction == "store"][t.tensor] += t.bytes
    assert (dict(bc.loads), dict(bc.stores)) == (dict(want[0]), dict(want[1]))
    assert bc.launches == 1
    # a step of the L2 model holds one k (model.dram_fractions), as a step of the loop does, and so
    # does a tile in smem: 16 x 16 of A and of B, not 16 x |k| x 16 ("8.4MB DOES NOT FIT" at k = 512)
    assert [k.looped for k in kernels(d)] == [("k",)]
    resident = {name: nbytes for name, _, nbytes in tiling.level_footprint(d, "smem", {"m": 37, "n": 29, "k": 3,
                                                                                      "j": 45})}
    assert resident == {"A": 16 * 16 * 4, "B": 16 * 16 * 4, "C": 16 * 16 * 4}


def test_the_report_counts_each_index_of_a_looped_wire_as_more_steps():
    """A program of sum[k, j](A * B) streaming j walks j's blocks once for each k: the report's
    steps (and the (program, step) pairs) count them all, and say how (they counted j's alone)."""
    from napkin.cost.report import format_text, from_json

    d = napkin.load_text(TWO_WIRES.format(dt="fp32"))
    report = analyse(d, {"m": 4096, "n": 4096, "k": 8, "j": 4096})
    (info,) = report.kernels
    assert (info.programs, info.steps, info.visited_steps, info.looped) == (256 * 256, 8 * 256, 256 * 256 * 8 * 256,
                                                                           (("k", 8),))
    assert from_json(report.to_json()).kernels[0].looped == (("k", 8),)
    assert "stream j by 16: 65536 programs x 2048 steps (8 of k, each 256 of j)" in format_text(report)


def test_a_weight_shared_by_the_batch_takes_its_gradient_in_one_launch(tmp_path):
    """dW = sum over b and m of X * dY: one product whose programs loop over b (it had no
    backward: "W lacks the batch wire(s) b").  Against float64 torch, and its bytes (the
    two gradient products, nothing in torch) against backward_cost's."""
    m = compile_text(LINEAR, "lin_shared", tmp_path)
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(3, 37, 45, generator=g), torch.randn(45, 29, generator=g)
    dy = torch.randn(3, 37, 29, generator=g)
    with ByteCounter(tensors={"X": x, "W": w}) as bc:
        dx, dw = m.lin_backward(x, w, dy)
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    (xd @ wd).backward(dy.double())
    assert (dx.double() - xd.grad).abs().max() < 1e-5 * xd.grad.abs().max()
    assert (dw.double() - wd.grad).abs().max() < 1e-5 * wd.grad.abs().max()
    back = backward_cost(napkin.load_text(LINEAR), {"b": 3, "m": 37, "n": 29, "k": 45})
    assert back.kernels == ("_grad_X", "_grad_W")
    want = defaultdict(int), defaultdict(int)
    for mv in back.moves:
        want[mv.direction == "store"][mv.tensor] += mv.bytes
    assert (dict(bc.loads), dict(bc.stores)) == (dict(want[0]), dict(want[1]))
    assert dict(bc.stores)["_grad_W"] == 4 * 45 * 29 and bc.launches == 2


def test_a_weight_shared_by_two_batch_wires_loops_over_both(tmp_path):
    """dW sums over b, h and m: the loop decodes two wires from one index (h innermost), so a
    wrong split of it (one wire's indices twice, the other's never) shows in dW."""
    text = LINEAR.replace("wire b, m, n, k", "wire b, h, m, n, k").replace("X[b, m, k]", "X[b, h, m, k]") \
        .replace("Y[b, m, n]", "Y[b, h, m, n]").replace("group b by 1,", "group b by 1, h by 1,")
    m = compile_text(text, "lin_two", tmp_path)
    g = torch.Generator().manual_seed(6)
    x, w = torch.randn(2, 3, 21, 45, generator=g), torch.randn(45, 29, generator=g)
    dy = torch.randn(2, 3, 21, 29, generator=g)
    dx, dw = m.lin_backward(x, w, dy)
    want = torch.einsum("bhmk,bhmn->kn", x.double(), dy.double())
    assert (dw.double() - want).abs().max() < 1e-5 * want.abs().max()
    assert (dx.double() - dy.double() @ w.double().T).abs().max() < 1e-5 * dx.abs().max()
