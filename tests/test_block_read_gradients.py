"""Gradients of float inputs the scores read along other wires than their own:
at a wire's blocks (a temperature per group of heads ``tau[h // 2]``, a bias
per 64 x 32 tile ``B[h, q // 64, x // 32]``) or relabelled (a bias read
transposed, ``B[h, x, q]``).  The dQ kernel stores its partial along the
wires read; the launcher sums it by blocks (the last one short on a ragged
wire).  Checked against float64 autograd of the generated reference and of
a hand-written one, on sizes ragged to every block; the reads napkin does
not differentiate are refused in words.
"""
from __future__ import annotations

import math

import pytest
import torch

from backward_helpers import assert_accurate, compile_text, gradients, launcher
from test_eight_bit_scores import ATTENTION

FAST = {"block_q": 16, "block_x": 16}


def _variant(*replace: tuple[str, str]) -> str:
    text = ATTENTION
    for old, new in replace:
        assert old in text
        text = text.replace(old, new)
    return text


HEAD_GROUPS = _variant(("wire b, h, q, x", "wire b, h, q, x, hg"),
                       ("in V[b, h, x, d] : fp16", "in V[b, h, x, d] : fp16\nin tau[hg] : fp32"),
                       ("* |d|^-0.5", "* tau[h // 2]"), ("hold Q, K, V, O", "hold Q, K, V, tau, O"))
TILE_BIAS = _variant(("wire b, h, q, x", "wire b, h, q, x, qb, xb"),
                     ("in V[b, h, x, d] : fp16", "in V[b, h, x, d] : fp16\nin B[h, qb, xb] : fp32"),
                     ("* |d|^-0.5", "* |d|^-0.5 + B[h, q // 64, x // 32]"), ("hold Q, K, V, O", "hold Q, K, V, B, O"))
TRANSPOSED = _variant(("in V[b, h, x, d] : fp16", "in V[b, h, x, d] : fp16\nin B[h, q, x] : fp32"),
                      ("* |d|^-0.5", "* |d|^-0.5 + B[h, x, q]"), ("hold Q, K, V, O", "hold Q, K, V, B, O"))


def _check(m, sizes, dtype, seed, rows=None, **opts):
    """backward_helpers.check with ``rows``: a side input's gradient adds up whole
    rows of dS (tau[h // 2]: every b, q and x of two heads), whose delta roundings
    grow as the root of their count (assert_accurate)."""
    inputs = m.example_inputs(sizes, dtype=dtype, seed=seed)
    got = gradients(launcher(m), inputs, **opts)
    exact = gradients(m.reference, [t.double() for t in inputs])
    assert_accurate(got, exact, gradients(m.reference, inputs), dtype=dtype, rows=rows)
    return inputs, got


def _by_hand(q, k, v, scores):
    """O and lse in float64, ``scores`` mapping the raw q . k products to S."""
    s = scores(torch.einsum("bhqd,bhxd->bhqx", q, k))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def test_a_temperature_per_group_of_heads_trains(tmp_path):
    """tau[h // 2] over 3 heads: two groups, the last of one head; its partial is
    stored per head and summed by pairs."""
    m = compile_text(HEAD_GROUPS, "head_groups", tmp_path)
    assert m._by_blocks is not None and not hasattr(m, "_NO_GRADIENT")
    inputs, got = _check(m, {"b": 2, "h": 3, "q": 37, "x": 45}, torch.float16, seed=3, rows=[1, 1, 1, 2 * 37 * 2])
    assert inputs[3].shape == (2,)
    want = gradients(lambda *xs: _by_hand(*xs[:3], lambda r: r * xs[3].repeat_interleave(2)[:3, None, None]),
                     [t.double() for t in inputs])
    for name, g, w in zip("QKV", got[:3], want[:3]):
        assert (g.double() - w).abs().max() <= 4e-3 * w.abs().max(), name
    assert (got[3].double() - want[3]).abs().max() <= 1e-3 * want[3].abs().max()


def test_a_gate_per_group_of_heads_on_the_output_trains(tmp_path):
    """tau[h // 2] read by the scores and by the output's function (O = N0 * tau[h // 2]):
    the dQ kernel's partial and the rows' dT_i, each summed by pairs of heads, add up.
    (The rows kernel had no variable for the read: an internal KeyError at compile.)"""
    text = HEAD_GROUPS.replace("O[b, h, q, d] : fp16 = sum[x](P * V)", "O[b, h, q, d] : fp16 = sum[x](P * V) * tau[h // 2]")
    m = compile_text(text, "head_group_gate", tmp_path)
    inputs, got = _check(m, {"b": 2, "h": 3, "q": 37, "x": 45}, torch.float32, seed=4, rows=[1, 1, 1, 2 * 37 * 2])

    def attention(q, k, v, tau):
        t = tau.repeat_interleave(2)[:3, None, None]
        o, lse = _by_hand(q, k, v, lambda r: r * t)
        return o * t, lse
    want = gradients(attention, [t.double() for t in inputs])[3]
    assert (got[3].double() - want).abs().max() <= 1e-4 * want.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_bias_per_tile_trains_on_ragged_blocks(tmp_path, dtype):
    """B[h, q // 64, x // 32] at q = 100, x = 77: blocks of 64 x 32 cut short at both
    edges, and the kernel's own 16 x 16 tiles lying inside them."""
    m = compile_text(TILE_BIAS, "tile_bias", tmp_path)
    sizes = {"b": 2, "h": 2, "q": 100, "x": 77}
    inputs, got = _check(m, sizes, dtype, seed=5, rows=[1, 1, 1, 2 * 64], **FAST)
    assert got[3].shape == (2, 2, 3) and got[3].dtype == torch.float32
    def attention(q, k, v, bias):
        tiles = bias.repeat_interleave(64, 1)[:, :100].repeat_interleave(32, 2)[:, :, :77]
        return _by_hand(q, k, v, lambda r: r * 64 ** -0.5 + tiles)
    want = gradients(attention, [t.double() for t in inputs])[3]
    # the same random output weights as check's kernel call (gradients' seed), so the same dB
    assert (got[3].double() - want).abs().max() <= 2e-3 * want.abs().max()


def _tiles(sq: int, sx: int) -> str:
    """A bias per sq x sx tile, B[h, q // sq, x // sx] (a step of 1 reads the wire whole)."""
    read = f"B[h, {'q' if sq == 1 else f'q // {sq}'}, {'x' if sx == 1 else f'x // {sx}'}]"
    held = f"B[h, {'q' if sq == 1 else 'qb'}, {'x' if sx == 1 else 'xb'}]"
    coarse = "".join(f", {w}" for w, st in (("qb", sq), ("xb", sx)) if st > 1)
    return _variant(("wire b, h, q, x", f"wire b, h, q, x{coarse}"),
                    ("in V[b, h, x, d] : fp16", f"in V[b, h, x, d] : fp16\nin {held} : fp32"),
                    ("* |d|^-0.5", f"* |d|^-0.5 + {read}"), ("hold Q, K, V, O", "hold Q, K, V, B, O"))


@pytest.mark.parametrize("steps, blocks, stored", [
    ((64, 32), (16, 16), (7, 5)),     # each 16 x 16 tile inside one block: a float a tile
    ((8, 4), (16, 32), (13, 20)),     # each tile holds whole blocks: a float a block
    ((8, 64), (32, 16), (13, 5)),     # one of each
    ((40, 48), (16, 32), (13, 5)),    # neither divides: granules of their gcd, 8 rows and 16 keys
    ((3, 5), (16, 16), (100, 77)),    # coprime: a float a score, summed in torch
    ((1, 16), (16, 32), (100, 5)),    # along q whole: a row a score, the keys by blocks
])
def test_the_dq_kernel_sums_a_tile_bias_inside_the_tile(tmp_path, monkeypatch, steps, blocks, stored):
    """The partial of a bias read at blocks of both the rows and the keys is summed
    inside each tile by granules of the step and block's gcd (_granule): the buffer the
    launcher zeroes is ``stored`` entries along q and x, not one per score (at 16K
    tokens and 16 heads that was 17 GB of float32); the gradient as float64 autograd's."""
    sq, sx = steps
    m = compile_text(_tiles(sq, sx), f"tiles_{sq}_{sx}", tmp_path)
    sizes = {"b": 2, "h": 2, "q": 100, "x": 77}
    zeroed = []

    def spy(*shape, **kw):
        t = real(*shape, **kw)
        zeroed.append(tuple(t.shape))
        return t
    real = torch.zeros
    monkeypatch.setattr(torch, "zeros", spy)
    inputs, got = _check(m, sizes, torch.float32, seed=11, rows=[1, 1, 1, 2 * sq * sx],
                         block_q=blocks[0], block_x=blocks[1])
    monkeypatch.undo()
    assert (sizes["b"], sizes["h"], *stored) in zeroed
    assert max(math.prod(z) for z in zeroed) == sizes["b"] * sizes["h"] * math.prod(stored)
    # a second call of the signature launches from the plan, at the plan's blocks: the same bits
    again = gradients(launcher(m), inputs, block_q=blocks[0], block_x=blocks[1])
    assert all(torch.equal(a, b) for a, b in zip(again, got))

    def attention(q, k, v, bias):
        tiles = bias.repeat_interleave(sq, 1)[:, :100].repeat_interleave(sx, 2)[:, :, :77]
        return _by_hand(q, k, v, lambda r: r * 64 ** -0.5 + tiles)
    want = gradients(attention, [t.double() for t in inputs])[3]
    assert (got[3].double() - want).abs().max() <= 1e-4 * want.abs().max()


def test_a_key_block_bias_is_summed_inside_the_tile(tmp_path):
    """B[h, x // 8] (a bias per block of keys, every row alike): the dQ kernel sums
    each tile's rows and its keys by blocks of 8, one float a block and row block."""
    text = _variant(("wire b, h, q, x", "wire b, h, q, x, xb"),
                    ("in V[b, h, x, d] : fp16", "in V[b, h, x, d] : fp16\nin B[h, xb] : fp32"),
                    ("* |d|^-0.5", "* |d|^-0.5 + B[h, x // 8]"), ("hold Q, K, V, O", "hold Q, K, V, B, O"))
    m = compile_text(text, "key_blocks", tmp_path)
    assert "_tile_sum" in m.__dict__
    inputs, got = _check(m, {"b": 1, "h": 3, "q": 41, "x": 70}, torch.float32, seed=12, rows=[1, 1, 1, 41 * 8],
                         block_q=16, block_x=32)
    want = gradients(lambda *xs: _by_hand(*xs[:3], lambda r: r * 64 ** -0.5
                                          + xs[3].repeat_interleave(8, 1)[:, None, :70]),
                     [t.double() for t in inputs])[3]
    assert (got[3].double() - want).abs().max() <= 1e-4 * want.abs().max()


def test_a_bias_read_transposed_trains(tmp_path):
    """B[h, x, q] of B[h, q, x]: dB[h, i, j] is the score (q=j, x=i)'s dS."""
    m = compile_text(TRANSPOSED, "transposed_bias", tmp_path)
    inputs, got = _check(m, {"b": 2, "h": 2, "q": 45, "x": 45}, torch.float32, seed=8, rows=[1, 1, 1, 2], **FAST)
    want = gradients(lambda *xs: _by_hand(*xs[:3], lambda r: r * 64 ** -0.5 + xs[3].transpose(1, 2)),
                     [t.double() for t in inputs])[3]
    assert (got[3].double() - want).abs().max() <= 1e-4 * want.abs().max()


def test_a_bias_read_two_ways_is_refused_in_words(tmp_path):
    """B[h, x, q] + B[h, q, x] (a symmetric bias): its gradient would add two reads'
    partials, which napkin does not emit; Q, K and V still train.  (A read along one
    wire twice, B[h, q, q], the checker refuses.)"""
    why = ("it is read as B[h, q, x] and B[h, x, q]: a float input read two ways gets no gradient here "
           "(declare one input per read and pass the same tensor to each)")
    text = _variant(("in V[b, h, x, d] : fp16", "in V[b, h, x, d] : fp16\nin B[h, q, x] : fp32"),
                    ("* |d|^-0.5", "* |d|^-0.5 + B[h, x, q] + B[h, q, x]"), ("hold Q, K, V, O", "hold Q, K, V, B, O"))
    m = compile_text(text, "read_two_ways", tmp_path)
    assert m._NO_GRADIENT == {"B": f"napkin cannot emit a backward for input B: {why} (line 14, column 4 of the diagram)"}
    inputs = m.example_inputs({"b": 1, "h": 2, "q": 20, "x": 20}, dtype=torch.float32, seed=1)
    q, k, v = (t.detach().requires_grad_() for t in inputs[:3])
    o, _ = launcher(m)(q, k, v, inputs[3], **FAST)   # Q, K, V still train
    assert all(g is not None and g.abs().max() > 0 for g in torch.autograd.grad(o.sum(), (q, k, v)))
    with pytest.raises(NotImplementedError, match="read"):
        gradients(launcher(m), inputs, **FAST)


def test_an_output_function_reading_an_input_two_ways_is_refused_its_gradient(tmp_path):
    """tau read by the scores and twice by the output's function, at blocks of 2 and of 3
    heads: the rows' dT_i would be two partials, which napkin does not emit, so the dQ
    kernel's part alone would be a wrong gradient.  Refused in words; Q, K, V train."""
    text = HEAD_GROUPS.replace("O[b, h, q, d] : fp16 = sum[x](P * V)",
                               "O[b, h, q, d] : fp16 = sum[x](P * V) * (tau[h // 2] + tau[h // 3])")
    m = compile_text(text, "gate_two_ways", tmp_path)
    assert m._NO_GRADIENT == {"tau": "napkin cannot emit a backward for input tau: its gradient would also go "
                              "through O, gN0, delta past the score box, which napkin does not emit for this "
                              "read; an input the score box alone reads gets one (line 14, column 4 of the diagram)"}
