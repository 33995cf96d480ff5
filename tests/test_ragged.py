"""A decode batch of ragged cache lengths (examples/ragged_decode.ncd): each
sequence's cache filled to its own length n[b], an int input the mask
compares with the key index (x < n[b]).

* which integer inputs napkin takes for a length of a wire (ir.length_inputs)
  and so draws as lengths in example_inputs, not as document ids;
* the kernel against float64 and against torch's scaled_dot_product_attention
  run on each sequence's own cache cut at its length, at lengths on and off
  the block edges, one and several new tokens, chunked and whole;
* the keys past a sequence's length are never loaded (napkin.bytecount);
* gradients against float64's autograd, nothing reaching the keys past n[b].
"""
from __future__ import annotations

import math

import pytest
import torch

import napkin
from napkin import ir
from napkin.bytecount import ByteCounter
import kernel_helpers as K


@pytest.fixture(scope="module", autouse=True)
def _folder(tmp_path_factory):
    K._FOLDER.append(tmp_path_factory.mktemp("ragged"))
    yield
    K._FOLDER.pop()


HEAD = """diagram t
wire b, h, q, x
in Q[b, h, q, d] : fp32
in K[b, h, x, d] : fp32
in n[b] : int32
in m[b] : int64
in doc[b, x] : int32
in pos[b, x] : int32
wire d = 8
"""


@pytest.mark.parametrize("score, lengths", [
    ("where(x < n[b], S0, -inf)", (("n", "x"),)),
    ("where(n[b] > x, S0, -inf)", (("n", "x"),)),                                     # either side
    ("where(x <= q + n[b] - |q|, S0, -inf)", (("n", "x"),)),                          # q beside n
    ("where(q < m[b] and x < n[b], S0, -inf)", (("m", "q"), ("n", "x"))),
    ("where(doc[b, q] == doc, S0, -inf)", ()),                                        # ids, not lengths
    ("where(pos <= x, S0, -inf)", ()),                                                # read along x itself
    ("where(n[b] > 3, S0, -inf)", ()),                                                # no index
    ("S0 + n[b]", ()),                                                                # no comparison
])
def test_length_inputs_are_integers_compared_with_an_index_they_are_not_along(score, lengths):
    d = napkin.load_text(HEAD + f"S0[b, h, q, x] = sum[d](Q * K)\nS[b, h, q, x] = {score}\nout S\n", "t.ncd")
    assert ir.length_inputs(d) == lengths


def test_example_inputs_draw_lengths_up_to_the_wire_and_ids_as_before():
    m = K.example("ragged_decode")
    n = m.example_inputs({"b": 64, "hk": 1, "g": 1, "q": 1, "x": 300}, dtype=torch.float32, seed=1)[3]
    assert n.dtype == torch.int32 and n.min() >= 1 and n.max() <= 300
    assert n.max() > 100 and len(set(n.tolist())) > 32   # lengths spread over 1..300, not ids up to 300 // 16
    doc = K.example("document_mask").example_inputs({"b": 2, "h": 1, "q": 300, "x": 300}, seed=1)[3]
    assert torch.equal(doc, doc.sort(dim=-1).values) and doc.max() <= 300 // 16


def _sdpa_rows(Q, Kc, Vc, n, g):
    """Each sequence alone, its cache cut at its length: SDPA in float64, with
    the new tokens at the end of it; (output, which rows see some key) each
    (SDPA's rows that see none are NaN, napkin's lse -inf)."""
    out = []
    for i, length in enumerate(n.tolist()):
        q = Q.shape[2]
        k = Kc[i, :, :length].double().repeat_interleave(g, 0)
        v = Vc[i, :, :length].double().repeat_interleave(g, 0)
        keep = torch.arange(length)[None, :] <= torch.arange(q)[:, None] + length - q
        o = torch.nn.functional.scaled_dot_product_attention(Q[i].double(), k, v, attn_mask=keep)
        out.append((o, keep.any(dim=1)))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("q, chunk", [(1, 64), (3, 128), (3, None)])
def test_each_sequence_attends_to_its_own_cache_up_to_its_length(dtype, q, chunk):
    m = K.example("ragged_decode")
    hk, g, X = 2, 4, 300
    # on and off the 64-key blocks, one key, fewer keys than new tokens, the whole cache
    n = torch.tensor([1, 2, 63, 64, 65, 200, 299, 300], dtype=torch.int32)
    gen = torch.Generator().manual_seed(q)
    Q, Kc, Vc = (torch.randn(shape, generator=gen).to(dtype) for shape in
                 ((len(n), hk * g, q, 128), (len(n), hk, X, 128), (len(n), hk, X, 128)))
    opts = {} if chunk is None else {"chunk": chunk}
    O, lse = m.ragged_decode(Q, Kc, Vc, n, **opts)
    inputs = (Q, Kc, Vc, n)
    K.assert_accurate((O, lse), K.reference(m, inputs, torch.float64), K.reference(m, inputs), f"q={q}")
    for i, (o, seen) in enumerate(_sdpa_rows(Q, Kc, Vc, n, g)):
        assert torch.equal(torch.isinf(lse[i]), ~seen.expand(hk * g, -1)), i   # no key: lse -inf
        err = (O[i].double() - o)[:, seen].abs().max().item()
        assert err <= (1e-5 if dtype == torch.float32 else 2e-3), (i, err)


def test_the_keys_past_each_length_are_never_loaded():
    m = K.example("ragged_decode")
    hk, g, X, d = 2, 4, 300, 128
    n = torch.tensor([10, 64, 65, 300], dtype=torch.int32)
    gen = torch.Generator().manual_seed(5)
    Q, Kc, Vc = (torch.randn(shape, generator=gen) for shape in
                 ((len(n), hk * g, 1, d), (len(n), hk, X, d), (len(n), hk, X, d)))
    with ByteCounter(tensors={"K": Kc, "V": Vc}) as bc:
        m.ragged_decode(Q, Kc, Vc, n, chunk=128)
    assert bc.launches > 0
    # each sequence's 64-key blocks up to its length, the last one cut at the cache's end
    live = sum(min(math.ceil(length / 64) * 64, X) for length in n.tolist())
    assert bc.loads["K"] == bc.loads["V"] == live * hk * d * 4
    assert live < len(n) * X / 2   # less than half the cache: the check is not vacuous


def test_gradients_reach_no_key_past_its_sequence_length():
    m = K.example("ragged_decode")
    hk, g, q, X = 1, 4, 2, 150
    n = torch.tensor([1, 70, 150], dtype=torch.int32)
    gen = torch.Generator().manual_seed(11)
    leaves = [torch.randn(shape, generator=gen, dtype=torch.float64) for shape in
              ((len(n), hk * g, q, 128), (len(n), hk, X, 128), (len(n), hk, X, 128))]
    dO = torch.randn(len(n), hk * g, q, 128, generator=gen, dtype=torch.float64)
    exact = torch.autograd.grad(m.reference(*[t.requires_grad_() for t in leaves], n)[0], leaves, dO)
    ours = [t.detach().float().requires_grad_() for t in leaves]
    got = torch.autograd.grad(m.ragged_decode(*ours, n, block_x=32)[0], ours, dO.float())
    for name, a, e in zip("QKV", got, exact):
        assert (a.double() - e).abs().max().item() <= 1e-4 * max(1.0, e.abs().max().item()), name
    for i, length in enumerate(n.tolist()):
        assert not got[1][i, :, length:].any() and not got[2][i, :, length:].any(), i
        assert got[1][i, :, :length].abs().sum() > 0 or length == 1, i
