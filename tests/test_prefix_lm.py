"""Prefix-LM attention (examples/prefix_lm.ncd): the first p[b] tokens of
each sequence see each other both ways, the rest is causal; p is an int
input, a length of x (ir.length_inputs), and the mask an `or` of a static
part and a data part: one bound, x <= max(q, p - 1), which the loops read
(masks._union; tests/test_union_bounds.py).

* the kernel against torch's scaled_dot_product_attention given the same
  mask as a bool tensor, in float64, and against the float64 reference, at
  prefixes on and off the blocks, none (causal) and the whole sequence, on a
  length that is no multiple of a block;
* the kernel loads exactly the live key blocks, the union of the causal
  triangle and the prefix's square, in one launch (napkin.bytecount);
* gradients against float64's autograd;
* FlexAttention's equivalent takes the mask as the reference computes it.
"""
from __future__ import annotations

import math

import pytest
import torch

import napkin
from napkin import ir
from napkin.bench import flex, reference
from napkin.bytecount import ByteCounter
import backward_helpers as B
import kernel_helpers as K

PREFIXES = [0, 1, 63, 64, 70, 150, 200]    # none (causal), on and off the 64-key blocks, the whole sequence
N = 200                                     # no multiple of the 128-row or 64-key blocks


@pytest.fixture(scope="module", autouse=True)
def _folder(tmp_path_factory):
    K._FOLDER.append(tmp_path_factory.mktemp("prefix_lm"))
    yield
    K._FOLDER.pop()


def _mask(p, n):
    """(b, 1, n, n) bool: key x is seen by query q when x <= q or x < p[b]."""
    idx = torch.arange(n)
    return ((idx[None, :] <= idx[:, None]) | (idx[None, None, :] < p.long()[:, None, None]))[:, None]


def _inputs(dtype, h=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    Q, Kt, V = (torch.randn(len(PREFIXES), h, N, 64, generator=gen).to(dtype) for _ in range(3))
    return Q, Kt, V, torch.tensor(PREFIXES, dtype=torch.int32)


def test_the_prefix_is_a_length_of_the_keys():
    assert ir.length_inputs(napkin.load(K.REPO / "examples" / "prefix_lm.ncd")) == (("p", "x"),)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefix_lm_matches_sdpa_with_the_same_mask_and_float64(dtype):
    m = K.example("prefix_lm")
    inputs = _inputs(dtype)
    (O,) = K.run(m, inputs)
    K.assert_accurate((O,), K.reference(m, inputs, torch.float64), K.reference(m, inputs))
    Q, Kt, V, p = inputs
    want = torch.nn.functional.scaled_dot_product_attention(Q.double(), Kt.double(), V.double(),
                                                            attn_mask=_mask(p, N))
    assert (O.double() - want).abs().max().item() <= (1e-5 if dtype == torch.float32 else 2e-3)
    # a prefix changes rows: row 0 of the whole-prefix sequence sees every key, of the causal one only key 0
    assert not torch.allclose(O[-1, :, 0].double(), O[0, :, 0].double(), atol=1e-2)


def test_the_kernel_loads_exactly_the_live_key_blocks():
    m = K.example("prefix_lm")
    Q, Kt, V, p = _inputs(torch.float32, h=1, seed=3)
    with ByteCounter(tensors={"K": Kt}) as bc:
        m.prefix_lm(Q, Kt, V, p, block_q=64, block_x=64)
    assert bc.launches == 1   # no ranges prepass: the loops' bound reads p
    blocks = math.ceil(N / 64)
    live = 0   # keys loaded: every 64-key block some row of a 64-row block sees, the last cut at N
    for prefix in PREFIXES:
        for qb in range(blocks):
            last_row = min(qb * 64 + 63, N - 1)
            for xb in range(blocks):
                if xb * 64 <= last_row or xb * 64 < prefix:
                    live += min(64, N - xb * 64)
    assert bc.loads["K"] == live * 64 * 4
    causal = sum(min(64, N - xb * 64) for qb in range(blocks) for xb in range(qb + 1)) * len(PREFIXES)
    assert causal < live < len(PREFIXES) * blocks * N   # the prefixes add blocks, and some are still skipped


def test_gradients_match_float64():
    """backward_helpers' rule: the kernel's error at most twice float32 torch's, plus ulps."""
    m = K.example("prefix_lm")
    gen = torch.Generator().manual_seed(7)
    p = torch.tensor([0, 70, 130], dtype=torch.int32)
    Q, Kt, V = (torch.randn(len(p), 1, 130, 64, generator=gen) for _ in range(3))
    got = B.gradients(m.prefix_lm, (Q, Kt, V, p), block_q=32, block_x=16)
    exact = B.gradients(m.reference, (Q.double(), Kt.double(), V.double(), p))
    same = B.gradients(m.reference, (Q, Kt, V, p))
    B.assert_accurate(got, exact, same, "prefix_lm")


@pytest.mark.usefixtures("quiet_flex")
def test_flex_takes_the_prefix_mask():
    d = napkin.load_text((K.REPO / "examples" / "prefix_lm.ncd").read_text().replace(": fp16", ": fp32"))
    src = flex.emit(d)
    assert src.mask == "x <= q or x < p" and not src.causal   # p along its own wire, b
    sizes = {"b": 3, "h": 2, "q": 80, "x": 80}
    inputs = reference.example_inputs(d, sizes, seed=2)
    inputs = [t.double() if t.is_floating_point() else t for t in inputs]
    got = flex.load(d).prepare(*inputs)()[0]
    want = reference.reference(d, inputs, sizes)[0]
    assert float((got - want).abs().max()) < 1e-6
