"""TMA descriptor loads in the forward attention kernel (the launcher's tma=);
the backward's dQ and dK/dV kernels: tests/test_tma_backward.py.

With ``tma=True`` a generated forward moves each qualifying tile (a plain
per-wire view of one tiled wire and the padded head dim: Q, K, V, O of the
examples) through a host ``TensorDescriptor`` under its constexpr _TMA, and
falls back to the pointer code, silently, where a tensor or the device
cannot take one (``_tma_last`` says which path the last launch took and
why).  Checked here under Triton's interpreter, which runs descriptors on
the CPU: the outputs are bitwise the pointer kernel's and close to the
float64 reference; the fallbacks; the launcher option's names; the tuner's
TMA candidates and the cache; and the sm_90 compile (napkin.bench.aot).
Nothing here times anything: whether TMA is faster needs an H100.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

import pytest
import torch

import napkin
from napkin import autotune, tunecache
from napkin.bench import harness
from napkin.codegen import emit_module
from napkin.errors import NapkinError

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
_MODULES: dict[str, object] = {}
TOL = {torch.float16: 4e-3, torch.float32: 2e-5}


_FOLDER = Path(tempfile.mkdtemp(prefix="napkin_tma_"))


def module(name: str, *replace: tuple[str, str]):
    """An example's generated module (its text edited first), imported once."""
    key = name + (f"_{zlib.crc32(repr(replace).encode())}" if replace else "")
    if key not in _MODULES:
        text = (EXAMPLES / f"{name}.ncd").read_text()
        for old, new in replace:
            assert old in text
            text = text.replace(old, new)
        src = emit_module(napkin.load_text(text, f"{name}.ncd"), source_text=text, source_path=f"{name}.ncd")
        path = _FOLDER / f"{key}.py"
        path.write_text(src)
        spec = importlib.util.spec_from_file_location(f"_napkin_tma_{key}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _MODULES[key] = mod
    return _MODULES[key]


def launcher(m):
    kernel = next(n for n in vars(m) if n.startswith("_") and n.endswith("_kernel") and "_bwd_" not in n
                  and not n.endswith("_ranges_kernel"))  # a data mask's prepass (codegen/ranges.py)
    return getattr(m, kernel[1:-len("_kernel")])


def outputs(got):
    return got if isinstance(got, tuple) else (got,)


def both(m, inputs, **opts):
    """(pointer outputs, TMA outputs, how the TMA call went)."""
    run = launcher(m)
    ptr = outputs(run(*inputs, tma=False, **opts))
    assert m._tma_last == {"used": False, "why": "tma not requested"}
    tma = outputs(run(*inputs, tma=True, **opts))
    return ptr, tma, dict(m._tma_last)


def reference(m, inputs):
    return outputs(m.reference(*[t.double() if t.is_floating_point() else t for t in inputs]))


def assert_same_and_accurate(m, inputs, dtype, **opts):
    ptr, tma, how = both(m, inputs, **opts)
    assert how == {"used": True, "why": None}
    ref = reference(m, inputs)
    for a, b, r in zip(ptr, tma, ref):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b), (a - b).abs().max()              # bitwise: the same tiles, the same code after
        ok = torch.isfinite(r)
        err = (b.double() - r)[ok].abs().max().item() if ok.any() else 0.0
        assert err < TOL[dtype] * max(1.0, r[ok].abs().max().item() if ok.any() else 1.0), err
        assert torch.equal(torch.isfinite(b), ok)


SIZES = {"b": 2, "h": 2, "hk": 2, "g": 2, "q": 45, "x": 45}


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("name", ["attention", "causal", "gqa", "alibi", "document_mask"])
def test_tma_is_bitwise_the_pointer_kernel(name, dtype):
    """Q, K, V loaded and O stored through descriptors (GQA's Q and O over
    [b, hk, g, q, d]: one descriptor dimension per wire of (hk g)); ALiBi's
    slopes and the document ids stay on pointers.  Ragged 45 rows on 16 / 32
    blocks: the descriptors' zero fill stands for other=0.0."""
    m = module(name)
    tiles = {t for _, t, _ in m._TMA_DESCS}
    assert tiles == {"Q", "K", "V", "O"}
    inputs = m.example_inputs(SIZES, dtype=dtype, seed=3)
    assert_same_and_accurate(m, inputs, dtype, block_q=16, block_x=32)


def test_tma_other_blocks_and_lengths():
    """Rows and keys of different lengths, the other block order; lse too."""
    m = module("causal")
    inputs = m.example_inputs({"b": 1, "h": 3, "q": 37, "x": 77}, dtype=torch.float16, seed=5)
    assert_same_and_accurate(m, inputs, torch.float16, block_q=32, block_x=16)


def test_tma_reads_strided_views():
    """A descriptor takes any 16-byte-aligned strides: Q as a [b, h, q, d]
    view of [b, q, h, d] storage, V a slice of a wider head dim."""
    m = module("attention")
    b, h, q, x, d = 1, 2, 45, 50, 64
    Q = torch.randn(b, q, h, d, dtype=torch.float16).transpose(1, 2)
    K = torch.randn(b, h, x, d, dtype=torch.float16)
    V = torch.randn(b, h, x, 2 * d, dtype=torch.float16)[..., d:]
    assert not Q.is_contiguous() and not V.is_contiguous()
    assert_same_and_accurate(m, (Q, K, V), torch.float16, block_q=16, block_x=32)


def test_tma_with_row_positions_and_under_autograd():
    """Rows at global positions keep TMA (loads stay at local rows); the
    torch op (inputs requiring gradients) takes tma= to every kernel and
    trains bitwise as the pointer kernels do."""
    m = module("causal")
    Q, K, V = m.example_inputs({"b": 1, "h": 2, "q": 40, "x": 40}, dtype=torch.float32, seed=7)
    pos = torch.arange(40) + 10
    opts = dict(block_q=16, block_x=16, positions={"q": pos}, lengths={"q": 50})
    ptr, tma, how = both(m, (Q, K, V), **opts)
    assert how["used"] and all(torch.equal(a, b) for a, b in zip(ptr, tma))
    leaves = [t.clone().requires_grad_() for t in (Q, K, V)]
    O, lse = m.causal(*leaves, block_q=16, block_x=16, tma=True)
    assert m._tma_last["used"]
    O.sum().backward()   # a dO of zero strides: the backward falls back to its pointer code
    assert m._tma_last_dq == {"used": False, "why": "dO: its last dimension is not contiguous"}
    plain = [t.clone().requires_grad_() for t in (Q, K, V)]
    O2, _ = m.causal(*plain, block_q=16, block_x=16)
    O2.sum().backward()
    assert torch.equal(O, O2) and all(torch.equal(a.grad, b.grad) for a, b in zip(leaves, plain))


def test_tma_falls_back_to_pointers_where_a_tensor_cannot_take_a_descriptor():
    """Each reason, silently (the right answer, through the pointer code),
    and said in _tma_last."""
    m = module("causal")
    run = m.causal
    Q, K, V = m.example_inputs({"b": 1, "h": 2, "q": 33, "x": 33}, dtype=torch.float16, seed=1)
    want = run(Q, K, V, block_q=16, block_x=16)

    def check(args, why, **opts):
        got = run(*args, block_q=16, block_x=16, tma=True, **opts)
        assert m._tma_last["used"] is False and why in m._tma_last["why"], m._tma_last
        if not opts:   # (positions change what is computed: compared with the pointer call below)
            ref = reference(m, args)
            assert (got[0].double() - ref[0]).abs().max() < TOL[torch.float16]
        return got

    # K's data 2 bytes past a 16-byte boundary: an odd element offset into its storage
    flat = torch.empty(K.numel() + 1, dtype=K.dtype)
    K_odd = flat[1:].view_as(K)
    K_odd.copy_(K)
    got = check((Q, K_odd, V), "K: its data is not 16-byte aligned")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # a row stride of 8 bytes: head dim 4 in fp16
    small = module("causal", ("wire d = 64", "wire d = 4"))
    Qs, Ks, Vs = small.example_inputs({"b": 1, "h": 2, "q": 33, "x": 33}, dtype=torch.float16, seed=1)
    small.causal(Qs, Ks, Vs, block_q=16, block_x=16, tma=True)
    assert small._tma_last == {"used": False, "why": "Q: a stride is not a positive multiple of 16 bytes"}
    ref = reference(small, (Qs, Ks, Vs))
    assert (small.causal(Qs, Ks, Vs, block_q=16, block_x=16, tma=True)[0].double() - ref[0]).abs().max() < 4e-3
    # keys at global positions: padding rows among them must read as zeros, as the masked loads give
    got = check((Q, K, V), "rows of x at global positions", positions={"x": torch.arange(33)}, lengths={"x": 30})
    assert torch.equal(got[0], run(Q, K, V, block_q=16, block_x=16, positions={"x": torch.arange(33)},
                                   lengths={"x": 30})[0])
    # the last dimension not contiguous
    Vt = V.transpose(2, 3).contiguous().transpose(2, 3)
    check((Q, K, Vt), "V: its last dimension is not contiguous")
    # no tma: no descriptors are built at all
    run(Q, K, V, block_q=16, block_x=16)
    assert m._tma_last == {"used": False, "why": "tma not requested"}
    with pytest.raises(ValueError, match="tma must be None, False or True"):
        run(Q, K, V, tma="yes")


@pytest.mark.parametrize("name, chunk", [("causal", None), ("flash_decoding", None), ("flash_decoding", 32)])
def test_tma_runs_under_a_length_of_the_keys_its_descriptors_ending_there(name, chunk):
    """lengths={'x': n} alone (a decode loop over a preallocated cache): the kernel stops at n, and
    the descriptors of K and V end at n too, so the rows past it read as zeros, as the masked
    loads give them.  It fell back to pointers ("rows of x at global positions").  The rows past n
    hold NaN here, a stale cache's worst: the outputs are bitwise the pointer call's and the call's
    on the cache narrowed to n."""
    m = module(name)
    run = launcher(m)
    sizes = {"b": 1, "h": 2, "hk": 2, "g": 4, "q": 3 if name == "flash_decoding" else 33, "x": 70}
    Q, K, V = m.example_inputs({w: n for w, n in sizes.items() if w in m.WIRES}, dtype=torch.float16, seed=4)
    opts = dict(block_q=16, block_x=16, **({"chunk": chunk} if chunk else {}))
    K0, V0 = K, V
    for n in (10, 33, 64):
        K, V = K0.clone(), V0.clone()
        K[..., n:, :], V[..., n:, :] = float("nan"), float("nan")
        tma = outputs(run(Q, K, V, tma=True, lengths={"x": n}, **opts))
        assert m._tma_last == {"used": True, "why": None}, (n, m._tma_last)
        ptr = outputs(run(Q, K, V, tma=False, lengths={"x": n}, **opts))
        cut = outputs(run(Q, K[..., :n, :], V[..., :n, :], tma=False, **opts))
        for a, b, c in zip(tma, ptr, cut):
            assert not torch.isnan(a).any() and torch.equal(a, b) and torch.equal(a, c), n


def test_tma_not_ready_without_hopper_or_interpreter(monkeypatch):
    m = module("causal")
    monkeypatch.delenv("TRITON_INTERPRET")
    assert m._tma_ready(torch.device("cpu")) is False       # no driver here: no TMA
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert m._tma_ready(torch.device("cpu")) is True


def test_default_launch_takes_the_pointer_code_and_the_cache_may_turn_it_on(tmp_path, monkeypatch):
    """tma=None (the default) is off; a cached config with tma true turns it
    on; an entry cached before tma= existed leaves it off."""
    m = module("causal")
    monkeypatch.setenv("NAPKIN_CACHE", str(tmp_path))
    sizes = {"b": 1, "h": 2, "q": 40, "x": 40}
    Q, K, V = m.example_inputs(sizes, dtype=torch.float16, seed=2)
    m.causal(Q, K, V, block_q=16, block_x=16)
    assert m._tma_last["used"] is False
    key = tunecache.cache_key(m.SOURCE_HASH, tunecache.device_name("cpu"), {"fp16": "float16"}, sizes,
                             ("b", "h", "q", "x"))
    cache = tunecache.Cache(tmp_path / "autotune.json")
    cache.put(key, tunecache.Config((("q", 16), ("x", 32)), 4, 2, tma=True), ms=1.0)
    assert json.loads((tmp_path / "autotune.json").read_text())["entries"][key]["config"]["tma"] is True
    assert cache.get(key).tma is True
    m.causal(Q, K, V)
    assert m._tma_last["used"] is True
    cache.put(key, tunecache.Config((("q", 16), ("x", 32)), 4, 2), ms=1.0)    # an old entry: no "tma"
    assert "tma" not in json.loads((tmp_path / "autotune.json").read_text())["entries"][key]["config"]
    assert cache.get(key) == tunecache.Config((("q", 16), ("x", 32)), 4, 2) and cache.get(key).tma is None
    m.causal(Q, K, V)
    assert m._tma_last["used"] is False


# ---- names ----

def test_an_input_named_tma_is_refused_and_a_box_named_like_a_descriptor_is_renamed(tmp_path):
    text = (EXAMPLES / "causal.ncd").read_text()
    bad = text.replace("in V[", "in tma[").replace("* V)", "* tma)").replace("hold Q, K, V,", "hold Q, K, tma,")
    with pytest.raises(NapkinError, match="parameter named tma|option named tma"):
        emit_module(napkin.load_text(bad, "c.ncd"), source_text=bad, source_path="c.ncd")
    m = module("causal", ("in V[", "in tma_Q["), ("* V)", "* tma_Q)"), ("hold Q, K, V,", "hold Q, K, tma_Q,"))
    # tma_Q's descriptor, its underscore doubled (kernel_names.part): apart from Q's second tile, _tma_Q_1
    assert {p for p, _, _ in m._TMA_DESCS} == {"_tma_Q", "_tma_K", "_tma_tma__Q", "_tma_O"}
    inputs = m.example_inputs({"b": 1, "h": 2, "q": 33, "x": 33}, dtype=torch.float32, seed=4)
    assert_same_and_accurate(m, inputs, torch.float32, block_q=16, block_x=16)


def test_an_output_named_tma_is_a_launcher_local_after_the_option():
    m = module("causal", ("O[b, h, q, d]", "tma[b, h, q, d]"), ("out O,", "out tma,"),
               ("hold Q, K, V, O,", "hold Q, K, V, tma,"))
    inputs = m.example_inputs({"b": 1, "h": 2, "q": 33, "x": 33}, dtype=torch.float32, seed=4)
    assert_same_and_accurate(m, inputs, torch.float32, block_q=16, block_x=16)


# ---- the tuner ----

def _target(name, head_dim=128):
    path = EXAMPLES / f"{name}.ncd"
    d = harness.variant(napkin.load(path), path.read_text(), "bfloat16", head_dim)[0]
    sizes = {"b": 1, "hk": 4, "g": 4, "q": 16384, "x": 16384} if name == "gqa" else \
        {"b": 1, "h": 16, "q": 16384, "x": 16384}
    return d, sizes


H100_SMEM = 232448


@pytest.mark.parametrize("name", ["attention", "causal", "sliding_window", "softcap", "alibi", "document_mask", "gqa"])
def test_candidates_try_tma_once_per_128_row_shape_in_the_second_tier(name):
    """The forward and dQ: 3 TMA variants (128 rows by 32, 64, 128 keys);
    dK/dV: 2 (128 keys by 16 and 32 rows), each a variant of a kept config."""
    d, sizes = _target(name)
    keep, pruned = autotune.candidates(d, sizes, lead=harness.untuned(d, sizes, ""), capacity=H100_SMEM)
    tma = [c for c in keep if c.tma]
    assert len(tma) == 3 and len(keep) == 22
    assert {dict(c.blocks)["q"] for c in tma} == {128}
    plain = {(c.blocks, c.num_warps, c.num_stages) for c in keep if not c.tma}
    assert all((c.blocks, c.num_warps, c.num_stages) in plain for c in tma)   # a variant of a kept config
    shapes = {c.blocks for c in keep}
    first_tma = keep.index(tma[0])
    assert len({c.blocks for c in keep[:first_tma]}) == len(shapes)   # after every shape's first
    assert keep.index(tma[-1]) < 1 + 2 * len(shapes)                   # before any shape's third
    for c in tma:
        assert autotune.kernel_smem(autotune.kernel_shape(d, sizes), c, sizes) <= H100_SMEM
        assert c.kwargs()["tma"] is True
    for kind, n, count, resident in (("bwd", 21, 3, "q"), ("bwd_kv", 14, 2, "x")):
        keep, _ = autotune.candidates(d, sizes, kind=kind, lead=harness.untuned(d, sizes, kind),
                                      capacity=H100_SMEM)
        tma = [c for c in keep if c.tma]
        assert len(keep) == n and len(tma) == count and {dict(c.blocks)[resident] for c in tma} == {128}
        plain = {(c.blocks, c.num_warps, c.num_stages) for c in keep if not c.tma}
        assert all((c.blocks, c.num_warps, c.num_stages) in plain for c in tma)
        shape = autotune.kernel_shape(d, sizes, kind)
        assert autotune.tma_applies(shape, sizes)
        assert all(autotune.kernel_smem(shape, c, sizes) <= H100_SMEM for c in tma)


def test_no_tma_candidates_at_head_dim_64():
    d, sizes = _target("causal", 64)
    for kind in ("", "bwd", "bwd_kv"):
        keep, _ = autotune.candidates(d, sizes, kind=kind, capacity=H100_SMEM)
        assert keep and not any(c.tma for c in keep)


def test_tma_smem_counts_its_barriers():
    d, sizes = _target("causal")
    c = tunecache.Config((("q", 128), ("x", 128)), 8, 3)
    shape = autotune.kernel_shape(d, sizes)
    assert autotune.kernel_smem(shape, tunecache.Config(c.blocks, 8, 3, tma=True), sizes) == \
        autotune.kernel_smem(shape, c, sizes) + autotune.TMA_SMEM
    assert autotune.smem_bytes(d, tunecache.Config(c.blocks, 8, 3, tma=True), sizes) == \
        autotune.smem_bytes(d, c, sizes) + autotune.TMA_SMEM


# ---- compiled for sm_90 ----

def test_tma_forward_compiles_for_hopper_with_tma_copies():
    """napkin.bench.aot with -O tma=1, head dim 128, 128 x 128 tiles: the
    forward's loads are TMA copies (no cp.async left for Q, K, V), it does not
    spill, and it holds fewer registers than the pointer kernel (at the 255
    cap there)."""
    pytest.importorskip("triton.backends.nvidia", reason="Triton without its NVIDIA backend cannot target sm_90")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    got = {}
    for tma in ((), ("-O", "tma=1")):
        done = subprocess.run([sys.executable, "-m", "napkin.bench.aot", str(EXAMPLES / "causal.ncd"), "--json",
                               "--head-dim", "128", "--forward-only", "-O", "block_q=128", "-O", "block_x=128",
                               "-O", "num_warps=8", "-O", "num_stages=2", *tma],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        [kernel] = json.loads(done.stdout)["diagrams"][0]["kernels"]
        got[bool(tma)] = kernel
    ptr, tma = got[False], got[True]
    assert ptr["tma"] == 0 and ptr["cp_async"] > 0
    assert tma["tma"] > 0 and tma["cp_async"] == 0
    assert tma["spill_stores"] == 0 and tma["registers"] < ptr["registers"]
