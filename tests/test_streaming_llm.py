"""StreamingLLM's attention (examples/streaming_llm.ncd): a causal window of
the last W tokens plus the first 4 (the attention sinks), the mask
`x <= q and (q - x < W or x < 4)`, an `or` of bounds of indices alone.

* the kernel against torch's scaled_dot_product_attention given the same
  mask as a bool tensor, in float64, and against the float64 reference, on a
  length that is no multiple of a block, with a window the blocks cut;
* the kernel steps over the dead key blocks between the sinks and the
  window: K loaded from the live blocks alone (napkin.bytecount), fewer than
  the causal blocks, and as many as the cost pass counts;
* gradients against float64's autograd;
* FlexAttention's equivalent takes the mask as the reference computes it.
"""
from __future__ import annotations

from collections import defaultdict

import pytest
import torch

import napkin
from napkin.bench import flex, reference
from napkin.bytecount import ByteCounter
from napkin.cost import analyse, with_blocks
import backward_helpers as B
import kernel_helpers as K

N, W = 300, 100                            # no multiple of a block; a window the 16-key blocks cut
SMALL = ("q - x < 1024", f"q - x < {W}")    # the example's window, cut to fit a CPU test


@pytest.fixture(scope="module", autouse=True)
def _folder(tmp_path_factory):
    K._FOLDER.append(tmp_path_factory.mktemp("streaming_llm"))
    yield
    K._FOLDER.pop()


def _mask(n, window=W):
    """(n, n) bool: key x is seen by query q when x <= q and (q - x < window or x < 4)."""
    idx = torch.arange(n)
    q, x = idx[:, None], idx[None, :]
    return (x <= q) & ((q - x < window) | (x < 4))


def _inputs(dtype, b=2, h=2, n=N, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, 64, generator=gen).to(dtype) for _ in range(3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_streaming_llm_matches_sdpa_with_the_same_mask_and_float64(dtype):
    m = K.example("streaming_llm", SMALL)
    inputs = _inputs(dtype)
    (O,) = K.run(m, inputs, block_q=32, block_x=16)
    K.assert_accurate((O,), K.reference(m, inputs, torch.float64), K.reference(m, inputs))
    Q, Kt, V = (t.double() for t in inputs)
    want = torch.nn.functional.scaled_dot_product_attention(Q, Kt, V, attn_mask=_mask(N))
    assert (O.double() - want).abs().max().item() <= (1e-5 if dtype == torch.float32 else 2e-3)
    # the sinks matter: the last row without them differs
    no_sinks = torch.nn.functional.scaled_dot_product_attention(Q, Kt, V, attn_mask=_mask(N) & (torch.arange(N) >= 4))
    assert (O.double()[..., -1, :] - no_sinks[..., -1, :]).abs().max().item() > 1e-2


def test_the_kernel_loads_the_live_key_blocks_the_cost_pass_counts():
    """Blocks of 32 rows and 16 keys: a row block past the window sees the
    sink block and the window's 7 or 8 blocks; the loop steps over the rest."""
    m = K.example("streaming_llm", SMALL)
    Q, Kt, V = _inputs(torch.float32, b=1, h=1, seed=3)
    with ByteCounter(tensors={"Q": Q, "K": Kt, "V": V}) as bc:
        m.streaming_llm(Q, Kt, V, block_q=32, block_x=16)
    pred = _mask(N)
    live = 0   # keys loaded: every 16-key block some row of a 32-row block sees, the last cut at N
    causal = 0
    for qb in range(-(-N // 32)):
        for xb in range(-(-N // 16)):
            keys = min(16, N - xb * 16)
            live += keys * bool(pred[qb * 32:(qb + 1) * 32, xb * 16:(xb + 1) * 16].any())
            causal += keys * (xb * 16 <= min(qb * 32 + 31, N - 1))
    assert bc.loads["K"] == live * 64 * 4 and live < causal
    text = (K.REPO / "examples" / "streaming_llm.ncd").read_text().replace(*SMALL).replace(": fp16", ": fp32")
    report = analyse(with_blocks(napkin.load_text(text, "s.ncd"), {"q": 32, "x": 16}),
                     {"b": 1, "h": 1, "q": N, "x": N})
    counted = defaultdict(int)
    for t in report.transfers:
        if t.direction == "load":
            counted[t.tensor] += t.bytes
    loads = dict(bc.loads)
    # the main kernel reads 8 B of ranges a row block, 8 B of counts (its full and its partial
    # blocks') and 4 B of list a block it visits, as counted.  This first call also ran the prepass (its
    # merge reads the scan's chunks); a later one does not: the mask reads no tensor, so the module
    # keeps the record, and the report, pricing that later call, lists no prepass kernel
    rec, _ = m._streaming_llm_ranges({"b": 1, "h": 1, "q": N, "x": N, "d": 64}, Q.device, 32, 16, False, False, True)
    partial, full = rec[..., 2].sum().item(), rec[..., 3].sum().item()
    assert partial > 0 and full > 0
    assert loads["_ranges"] == counted["_ranges"] == 16 * -(-N // 32) + 4 * (partial + full)
    assert loads.pop("_parts") > 0 and all(k.prepass_of is None for k in report.kernels)
    assert dict(counted) == {k: v for k, v in loads.items() if v}


def test_gradients_match_float64():
    """backward_helpers' rule: the kernel's error at most twice float32 torch's, plus ulps."""
    m = K.example("streaming_llm", SMALL)
    Q, Kt, V = _inputs(torch.float32, b=1, h=2, n=230, seed=7)
    got = B.gradients(m.streaming_llm, (Q, Kt, V), block_q=32, block_x=16)
    exact = B.gradients(m.reference, (Q.double(), Kt.double(), V.double()))
    same = B.gradients(m.reference, (Q, Kt, V))
    B.assert_accurate(got, exact, same, "streaming_llm")


@pytest.mark.usefixtures("quiet_flex")
def test_flex_takes_the_streaming_mask():
    text = (K.REPO / "examples" / "streaming_llm.ncd").read_text().replace(*SMALL).replace(": fp16", ": fp32")
    d = napkin.load_text(text)
    src = flex.emit(d)
    assert src.mask == f"x <= q and (q - x < {W} or x < 4)"
    sizes = {"b": 1, "h": 2, "q": 250, "x": 250}
    inputs = [t.double() for t in reference.example_inputs(d, sizes, seed=2)]
    got = flex.load(d).prepare(*inputs)()[0]
    want = reference.reference(d, inputs, sizes)[0]
    assert float((got - want).abs().max()) < 1e-6
