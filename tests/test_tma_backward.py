"""TMA descriptors in the backward's dQ and dK/dV kernels (codegen/tma.py).

The launcher's tma= reaches the backward through the torch op (and
NAME_backward takes it directly); None takes each kernel's own tuned config
(kinds "bwd" and "bwd_kv"), else off.  dQ moves Q, dO (once) and K, V (per
step) and stores dQ through descriptors; dK/dV moves K, V (once) and Q, dO
(per step) and stores dK, dV; the row state (lse, delta), side inputs and
side gradients stay on pointers.  Under Triton's interpreter: the gradients
with tma=True are bitwise the pointer kernels' and as accurate against float64
autograd as test_backward.py requires, on ragged sizes; the fallbacks, each
said in _tma_last_dq / _tma_last_dkdv; the per-kernel cached choice; and the
sm_90 compile (napkin.bench.aot).  Nothing here times anything.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from example_sizes import sizes_for
from napkin import tunecache
from backward_helpers import REPO, assert_accurate, example, gradients, launcher

KERNELS = ("_tma_last", "_tma_last_dq", "_tma_last_dkdv")
USED = {"used": True, "why": None}
OFF = {"used": False, "why": "tma not requested"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("tma_backward")


def lasts(m) -> dict:
    return {k: dict(getattr(m, k)) for k in KERNELS}


def both(m, inputs, **opts):
    """(pointer gradients, TMA gradients, how each kernel of the TMA call went),
    outputs and gradients of the two runs compared bitwise."""
    fn = launcher(m)
    ptr_out = fn(*inputs, tma=False, **opts)
    ptr = gradients(fn, inputs, tma=False, **opts)
    assert lasts(m) == dict.fromkeys(KERNELS, OFF)
    tma_out = fn(*inputs, tma=True, **opts)
    got = gradients(fn, inputs, tma=True, **opts)
    how = lasts(m)
    for a, b in zip(*(o if isinstance(o, tuple) else (o,) for o in (ptr_out, tma_out))):
        assert torch.equal(a, b)
    for i, (a, b) in enumerate(zip(ptr, got)):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), \
            (i, None if a is None else (a.double() - b.double()).abs().max())
    return ptr, got, how


def sizes(name: str, q: int = 45, x: int = 45) -> dict:
    return sizes_for(name, q, x)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("name", ["attention", "causal", "gqa", "alibi", "document_mask"])
def test_tma_gradients_are_bitwise_the_pointer_kernels(name, dtype, folder):
    """Every kernel takes its descriptors (GQA's dK/dV reads Q and dO of each
    head of the group through 5-D ones; ALiBi's slope gradient and the
    document ids stay on pointers); 45 rows and keys on 16 / 32 blocks are
    ragged in both kernels (dK/dV's tile is [32 keys, 16 rows])."""
    m = example(name, folder)
    assert {t for _, t, _ in m._TMA_DESCS_DQ} == {"Q", "dO", "K", "V", "_grad_Q"}
    assert {t for _, t, _ in m._TMA_DESCS_DKDV} == {"K", "V", "Q", "dO", "_grad_K", "_grad_V"}
    inputs = m.example_inputs(sizes(name), dtype=dtype, seed=3)
    _, got, how = both(m, inputs, block_q=16, block_x=32)
    assert how == dict.fromkeys(KERNELS, USED)
    exact = gradients(m.reference, [t.double() if t.is_floating_point() else t for t in inputs])
    assert_accurate(got, exact, gradients(m.reference, inputs), f"{name} tma", dtype)


def test_tma_gradients_other_lengths_and_blocks(folder):
    """Rows and keys of different lengths, the other block order."""
    m = example("causal", folder)
    inputs = m.example_inputs(sizes("causal", 37, 77), dtype=torch.float16, seed=5)
    _, got, how = both(m, inputs, block_q=32, block_x=16)
    assert how == dict.fromkeys(KERNELS, USED)
    exact = gradients(m.reference, [t.double() for t in inputs])
    assert_accurate(got, exact, gradients(m.reference, inputs), "causal 37 x 77", torch.float16)


def _state(m, inputs, seed=9):
    """(O, lse, dO, delta) for NAME_backward: the forward, a random dO, the rows kernel."""
    O, lse = m.causal(*inputs, block_q=16, block_x=16)
    dO = torch.randn(O.shape, generator=torch.Generator().manual_seed(seed)).to(O.dtype)
    (delta,) = m.causal_preprocess(*inputs, dO, O, block_q=16)
    return O, lse, dO, delta


def test_backward_launcher_takes_tma_and_positions_send_it_back(folder):
    """causal_backward(..., tma=True): both kernels use descriptors; rows of q
    or keys at global positions send both back to pointers (their padding
    rows must read as zeros, which a descriptor cannot mask:
    test_positions.py's padded-rows test); the results equal the pointer code's."""
    m = example("causal", folder)
    inputs = m.example_inputs({"b": 1, "h": 2, "q": 40, "x": 40}, dtype=torch.float32, seed=7)
    _, lse, dO, delta = _state(m, inputs)
    for pos, why in (({}, None), ({"q": torch.arange(40) + 10}, "rows of q at global positions"),
                     ({"x": torch.arange(40)}, "rows of x at global positions")):
        lengths = {w: 50 for w in pos}
        opts = dict(block_q=16, block_x=16, positions=pos or None, lengths=lengths or None)
        ptr = m.causal_backward(*inputs, dO, lse, delta, tma=False, **opts)
        got = m.causal_backward(*inputs, dO, lse, delta, tma=True, **opts)
        for k in ("_tma_last_dq", "_tma_last_dkdv"):
            assert getattr(m, k)["used"] is (why is None) and (why is None or why in getattr(m, k)["why"])
        assert all(torch.equal(a, b) for a, b in zip(ptr, got))
    with pytest.raises(ValueError, match="tma must be None, False or True"):
        m.causal_backward(*inputs, dO, lse, delta, tma="yes")


def test_backward_falls_back_where_a_tensor_cannot_take_a_descriptor(folder):
    """A dO 2 bytes off 16-byte alignment, or of zero strides (what
    O.sum().backward() hands down), sends each kernel back to its pointer
    code, silently, with the same gradients; a bad tma= is refused in words
    before the torch op (whose schema takes an int)."""
    m = example("causal", folder)
    inputs = m.example_inputs({"b": 1, "h": 2, "q": 33, "x": 33}, dtype=torch.float16, seed=1)
    _, lse, dO, delta = _state(m, inputs)
    want = m.causal_backward(*inputs, dO, lse, delta, block_q=16, block_x=16)
    flat = torch.empty(dO.numel() + 1, dtype=dO.dtype)
    odd = flat[1:].view_as(dO)
    odd.copy_(dO)
    got = m.causal_backward(*inputs, odd, lse, delta, block_q=16, block_x=16, tma=True)
    assert m._tma_last_dq == m._tma_last_dkdv == {"used": False, "why": "dO: its data is not 16-byte aligned"}
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    leaves = [t.clone().requires_grad_() for t in inputs]
    O, _ = m.causal(*leaves, block_q=16, block_x=16, tma=True)
    O.sum().backward()
    assert m._tma_last["used"] and m._tma_last_dkdv == {"used": False, "why": "dO: its last dimension is not contiguous"}
    with pytest.raises(ValueError, match="tma must be None, False or True"):
        m.causal(*leaves, tma=2)


def test_each_backward_kernel_takes_its_own_cached_tma(tmp_path, monkeypatch, folder):
    """tma=None: dQ reads its "bwd" entry, dK/dV its "bwd_kv" one, the
    forward its own; an entry without tma leaves that kernel off."""
    m = example("causal", folder)
    monkeypatch.setenv("NAPKIN_CACHE", str(tmp_path))
    sz = {"b": 1, "h": 2, "q": 40, "x": 40}
    inputs = m.example_inputs(sz, dtype=torch.float16, seed=2)
    cache = tunecache.Cache(tmp_path / "autotune.json")
    config = tunecache.Config((("q", 16), ("x", 32)), 4, 2)
    for kind, tma in (("", None), ("bwd", True), ("bwd_kv", None)):
        key = tunecache.cache_key(m.SOURCE_HASH, tunecache.device_name("cpu"), {"fp16": "float16"}, sz,
                                 ("b", "h", "q", "x"), kind)
        cache.put(key, tunecache.Config(config.blocks, 4, 2, tma=tma), ms=1.0)
    got = gradients(launcher(m), inputs)
    assert lasts(m) == {"_tma_last": OFF, "_tma_last_dq": USED, "_tma_last_dkdv": OFF}
    want = gradients(launcher(m), inputs, tma=False, block_q=16, block_x=32, num_warps=4, num_stages=2)
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_tma_backward_compiles_for_hopper_with_tma_copies():
    """napkin.bench.aot -O tma=1, head dim 128, the default tiles: dQ and
    dK/dV load through TMA copies (dQ has no cp.async left; dK/dV keeps them
    for its per-step lse and delta vectors) and neither spills."""
    pytest.importorskip("triton.backends.nvidia", reason="Triton without its NVIDIA backend cannot target sm_90")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    got = {}
    for tma in ((), ("-O", "tma=1")):
        done = subprocess.run([sys.executable, "-m", "napkin.bench.aot", str(REPO / "examples" / "causal.ncd"),
                               "--json", "--head-dim", "128", *tma],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        got[bool(tma)] = {k["kernel"]: k for k in json.loads(done.stdout)["diagrams"][0]["kernels"]}
    for kernel in ("_causal_bwd_dq_kernel", "_causal_bwd_dkdv_kernel"):
        ptr, tma = got[False][kernel], got[True][kernel]
        assert ptr["tma"] == 0 and ptr["cp_async"] > 0, kernel
        assert tma["tma"] > 0 and tma["cp_async"] < ptr["cp_async"], kernel
        assert tma["spill_stores"] == 0 and ptr["spill_stores"] == 0, kernel
    assert got[True]["_causal_bwd_dq_kernel"]["cp_async"] == 0


def test_a_kernel_the_call_does_not_launch_says_so_not_the_last_launchs_answer(folder):
    """A backward with no query rows (or need= leaving out dQ) launches no dQ kernel: its
    _tma_last_dq kept the previous call's {"used": True} (edges hunt)."""
    m = example("causal", folder)
    inputs = m.example_inputs({"b": 1, "h": 2, "q": 20, "x": 20}, dtype=torch.float32, seed=3)
    gradients(launcher(m), inputs, tma=True, block_q=16, block_x=16)
    assert lasts(m) == dict.fromkeys(KERNELS, USED)
    empty = m.example_inputs({"b": 1, "h": 2, "q": 0, "x": 20}, dtype=torch.float32, seed=3)
    gradients(launcher(m), empty, tma=True, block_q=16, block_x=16)
    assert lasts(m)["_tma_last_dq"] == {"used": False, "why": "not launched by the last call: no gradient it "
                                        "computes was needed, or there was nothing to compute"}
    _, lse, dO, delta = _state(m, inputs)
    m.causal_backward(*inputs, dO, lse, delta, tma=True, block_q=16, block_x=16)
    assert lasts(m)["_tma_last_dq"] == USED
    m.causal_backward(*inputs, dO, lse, delta, tma=True, block_q=16, block_x=16, need=[True, False, False])
    assert lasts(m)["_tma_last_dq"] == USED and lasts(m)["_tma_last_dkdv"]["why"].startswith("not launched")
