"""A contraction kernel's programs run in groups of row blocks (tiling.grouped_program).

The launch runs grid axis 0 (row blocks) fastest; a plain order had every wave
of programs read all of one factor.  The kernels (templates/contraction_kernel.py.jinja)
take their (row block, column block) from their program ids in groups of
``_GROUP_ROWS`` row blocks, and the cost pass's L2 model (cost/model.py) walks
the programs in the same order.  Checked here: the order is a bijection on
ragged grids, the kernel's own lines compute tiling.grouped_program, every group
size gives the product and its gradients (float64 reference, sizes no block
divides, groups left short), and the model prices the order.
"""
from __future__ import annotations

import itertools
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import napkin
from napkin import tiling
from napkin.codegen import emit_module
from napkin.cost import analyse
from napkin.cost.model import kernels
from backward_helpers import compile_text, gradients
from test_contraction_sums import LINEAR

MATMUL = """diagram mmg
wire m, n, k
in A[m, k] : fp32
in B[k, n] : fp32
C[m, n] : fp32 = sum[k](A * B)
out C
schedule { level smem { group m by 16, n by 16
stream k by 16 } }
"""



@pytest.mark.parametrize("group", [1, 2, 3, 4, 8])
def test_the_grouped_order_is_a_bijection_on_ragged_grids(group):
    for rows, cols in itertools.product(range(1, 12), range(1, 6)):
        r, c = np.divmod(np.arange(rows * cols), cols)
        got_r, got_c = tiling.grouped_program(r, c, rows, cols, group)
        assert sorted(zip(got_r.tolist(), got_c.tolist())) == sorted(zip(r.tolist(), c.tolist()))


def test_the_order_walks_a_group_of_row_blocks_across_every_column_first():
    # 10 row blocks by 3 column blocks, groups of 4: launch order (axis 0 fastest) 0, 1, 2, ...
    rows, cols = 10, 3
    order = [tuple(int(v) for v in tiling.grouped_program(n % rows, n // rows, rows, cols, 4))
             for n in range(rows * cols)]
    assert order[:12] == [(r, c) for c in range(3) for r in range(4)]
    assert order[24:] == [(r, c) for c in range(3) for r in (8, 9)]   # the last group: the 2 left


class _Tl:
    """The two program-id calls of the kernel's order lines, on given numbers."""

    def __init__(self, pid, grid):
        self.pid, self.grid = pid, grid

    def program_id(self, axis):
        return self.pid[axis]

    def num_programs(self, axis):
        return self.grid[axis]

    @staticmethod
    def minimum(a, b):
        return min(a, b)

    @staticmethod
    def arange(start, stop):
        return 0


def test_the_kernels_lines_compute_tiling_grouped_program():
    """The generated kernel's own lines (the forward's and the gradients'), run in Python on
    every program id of a ragged grid, give tiling.grouped_program's blocks."""
    source = emit_module(napkin.load_text(MATMUL), source_text=MATMUL, source_path="mmg.ncd")
    kernels_src = re.findall(r"    _rows = tl\.num_programs\(0\)\n(?:    .*\n)*?    _ok_\w+ = .*\n(?:    .*\n)", source)
    assert len(kernels_src) == 3   # C, dA, dB
    for body in kernels_src:
        lines = [line.strip() for line in body.splitlines() if not line.strip().startswith("_ok")]
        row, col = (re.match(r"(_offs_\w+) =", line).group(1) for line in lines if line.startswith("_offs"))
        for rows, cols, group in ((10, 3, 4), (11, 4, 4), (7, 5, 3), (2, 9, 4)):
            for r, c in itertools.product(range(rows), range(cols)):
                env = {"tl": _Tl((r, c), (rows, cols)), "_GROUP": group}
                env.update({f"_BLOCK_{w}": 1 for w in "mnk"})
                exec("\n".join(lines), env)
                assert (env[row], env[col]) == tuple(int(v) for v in tiling.grouped_program(r, c, rows, cols, group))


@pytest.mark.parametrize("group", [1, 3, 4, 64])
def test_every_group_size_gives_the_product_and_its_gradients(tmp_path, group, monkeypatch):
    """10 row blocks by 4 column blocks (16 x 16 of 149 x 49): groups of 3 leave one row block
    over, of 4 two; 1 takes one row block across every column, 64 is the plain order."""
    m = compile_text(MATMUL, "mm_group", tmp_path)
    monkeypatch.setattr(m, "_GROUP_ROWS", group)
    g = torch.Generator().manual_seed(11 + group)
    a, b = torch.randn(16 * 9 + 5, 37, generator=g), torch.randn(37, 16 * 3 + 1, generator=g)
    want = a.double() @ b.double()
    got = m.mmg(a, b)
    assert (got.double() - want).abs().max() < 1e-5 * want.abs().max()
    for got_g, want_g in zip(gradients(m.mmg, [a, b]), gradients(lambda x, y: x @ y, [a.double(), b.double()])):
        assert (got_g.double() - want_g).abs().max() < 1e-5 * want_g.abs().max()


def test_a_shared_weights_gradient_groups_its_k_blocks(tmp_path, monkeypatch):
    """dW's programs (rows k, columns n, looping over b) in groups of 2 of 3 k blocks."""
    m = compile_text(LINEAR, "lin_group", tmp_path)
    monkeypatch.setattr(m, "_GROUP_ROWS", 2)
    g = torch.Generator().manual_seed(12)
    x, w, dy = torch.randn(3, 21, 45, generator=g), torch.randn(45, 37, generator=g), torch.randn(3, 21, 37, generator=g)
    dx, dw = m.lin_backward(x, w, dy)
    want = torch.einsum("bmk,bmn->kn", x.double(), dy.double())
    assert (dw.double() - want).abs().max() < 1e-5 * want.abs().max()
    assert (dx.double() - dy.double() @ w.double().T).abs().max() < 1e-5 * dx.abs().max()


def test_the_cost_model_walks_the_programs_in_the_kernels_order(monkeypatch):
    """Kernel.grouped names the kernel's grid axes 0 and 1 as codegen picks them (the first
    factor's free wire first, whatever the schedule's order), and the L2 model takes the
    grouped order: at 8192^3 in 128 x 128 tiles a wave of the plain order reads all of A."""
    d = napkin.load(Path(__file__).resolve().parent.parent / "examples" / "matmul.ncd")
    assert [k.grouped for k in kernels(d)] == [("m", "n")]
    swapped = napkin.load_text(MATMUL.replace("group m by 16, n by 16", "group n by 16, m by 16"))
    assert [k.grouped for k in kernels(swapped)] == [("m", "n")]
    sizes = {"m": 8192, "n": 8192, "k": 8192}

    def dram() -> int:
        return analyse(d, sizes).totals[0].dram_bytes

    grouped = dram()
    monkeypatch.setattr(tiling, "GROUP_ROWS", 10 ** 6)   # one group: the plain order
    plain = dram()
    assert grouped < 0.7 * plain
