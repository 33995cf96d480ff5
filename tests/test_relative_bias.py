"""A relative-position bias table (T5's, Swin's): a learned rel[h, r] read at
r = q - x + |x| - 1.  napkin reads tensors along wires, so an index computed
from wires is refused by the parser (test_grammar.py, "gather"); the recipe
docs/language.md gives is to expand the table in torch and pass the bias
along both wires, in bias[h, q, x].  Checked here: the kernel against SDPA
given the same additive float mask and against float64, and the table's
gradient, which autograd carries from the kernel's dbias back through the
expansion, against float64's autograd.
"""
from __future__ import annotations

import pytest
import torch

import backward_helpers as B
import kernel_helpers as K

DIAGRAM = """diagram relbias

wire b, h, q, x
wire d = 32

in Q[b, h, q, d] : fp32
in K[b, h, x, d] : fp32
in V[b, h, x, d] : fp32
in bias[h, q, x] : fp32

S[b, h, q, x] = sum[d](Q * K) * |d|^-0.5 + bias
O[b, h, q, d] : fp32 = sum[x](softmax[x](S) * V)
out O

schedule on h100 {
  accumulate fp32
  level hbm { hold Q, K, V, bias, O }
  level smem {
    group b by 1, h by 1, q by 32
    stream x by 16
    hold S
  }
}
"""


@pytest.fixture(scope="module", autouse=True)
def _folder(tmp_path_factory):
    K._FOLDER.append(tmp_path_factory.mktemp("relbias"))
    yield
    K._FOLDER.pop()


def expand(rel, n_q, n_x):
    """rel[h, r] read at r = q - x + n_x - 1, as bias[h, q, x] (a gather in torch, differentiable)."""
    r = torch.arange(n_q)[:, None] - torch.arange(n_x)[None, :] + n_x - 1
    return rel[:, r]


def test_an_expanded_relative_bias_table_matches_sdpa_and_trains_the_table():
    m = K.compile_text(DIAGRAM, "relbias")
    h, n_q, n_x = 3, 45, 37                    # ragged: no multiple of the 32-row or 16-key blocks
    gen = torch.Generator().manual_seed(13)
    Q = torch.randn(2, h, n_q, 32, generator=gen)
    Kt, V = (torch.randn(2, h, n_x, 32, generator=gen) for _ in range(2))
    rel = torch.randn(h, n_q + n_x - 1, generator=gen)

    def ours(Q, K, V, rel):
        return m.relbias(Q, K, V, expand(rel, n_q, n_x))

    def sdpa(Q, K, V, rel):
        return torch.nn.functional.scaled_dot_product_attention(Q, K, V, attn_mask=expand(rel, n_q, n_x)[None])

    wide = [t.double() for t in (Q, Kt, V, rel)]
    assert (ours(Q, Kt, V, rel).double() - sdpa(*wide)).abs().max().item() < 1e-5
    # backward_helpers' rule, the table's gradient (through torch's gather) among them
    got = B.gradients(ours, (Q, Kt, V, rel))
    B.assert_accurate(got, B.gradients(sdpa, wide), B.gradients(sdpa, (Q, Kt, V, rel)), "relbias")
    assert got[3].abs().sum() > 0   # the table does receive a gradient
