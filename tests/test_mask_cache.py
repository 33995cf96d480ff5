"""mask_cache=: a data mask's ranges prepass results kept across calls.

A diagram whose mask reads data (document ids) runs a ranges prepass before
each kernel (napkin/codegen/ranges.py): the forward's, and the backward's
dK/dV (by column) and dQ ones.  A caller's dict passed as ``mask_cache``
keeps them, as FlexAttention's BlockMask is built once.  Checked here, under
the interpreter on ragged sizes and fresh random inputs: a warm cache gives
the cold results bit for bit (forward and gradients, and those match the
float64 reference), runs no prepass kernel (the module's ranges function,
spied), keeps launches at other blocks or of other kernels apart in one dict,
refuses a mask_cache that is no dict, and is accepted (left empty) by a
diagram with no prepass.
"""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from backward_helpers import assert_accurate, compile_text, gradients

REPO = Path(__file__).resolve().parent.parent
DOC = (REPO / "examples" / "document_mask.ncd").read_text()
CAUSAL = (REPO / "examples" / "causal.ncd").read_text()
BLOCKS = {"block_q": 16, "block_x": 32}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("mask_cache")


@pytest.fixture
def doc_module(folder):
    return compile_text(DOC, "mask_cache_doc", folder)


@pytest.fixture
def prepasses(doc_module, monkeypatch):
    """The prepass runs counted: the launchers call the module's ranges function by its global name."""
    calls = []
    real = doc_module._document_mask_ranges

    def spy(*args, **kwargs):
        if args[7]:   # on: a prepass runs (not with rows at positions)
            calls.append(args[3:7])   # blocks, whole-rows, by-column (after doc, sizes, device)
        return real(*args, **kwargs)

    monkeypatch.setattr(doc_module, "_document_mask_ranges", spy)
    return calls


def _inputs(m, n, dtype, b=2, h=2):
    """Fresh random inputs (a new seed each run) and about four contiguous documents a sequence."""
    seed = random.randrange(1 << 30)
    q, k, v, _ = m.example_inputs({"b": b, "h": h, "q": n, "x": n}, dtype=dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    doc = torch.sort(torch.randint(0, 4, (b, n), generator=gen), dim=1).values.to(torch.int32)
    return (q, k, v, doc), seed


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_warm_forward_is_cold_forward_without_prepass(doc_module, prepasses, dtype):
    m = doc_module
    inputs, seed = _inputs(m, 75, dtype)          # 75: ragged against both blocks
    cold = m.document_mask(*inputs, **BLOCKS)
    assert len(prepasses) == 1
    cache = {}
    first = m.document_mask(*inputs, **BLOCKS, mask_cache=cache)
    assert len(prepasses) == 2 and len(cache) == 1
    warm = m.document_mask(*inputs, **BLOCKS, mask_cache=cache)
    assert len(prepasses) == 2, "a warm cache ran the prepass"
    assert torch.equal(first, cold) and torch.equal(warm, cold), seed
    want = m.reference(*[t.double() if t.is_floating_point() else t for t in inputs])
    assert (warm.double() - want).abs().max().item() < (2e-5 if dtype == torch.float32 else 2e-3), seed


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_warm_training_step_runs_no_prepass(doc_module, prepasses, dtype):
    """Autograd carries the forward's dict to the backward: the first step fills
    the forward's, dK/dV's and dQ's entries, the second runs none."""
    m = doc_module
    inputs, seed = _inputs(m, 53, dtype)
    cold = gradients(m.document_mask, inputs, **BLOCKS)
    assert len(prepasses) == 3   # forward, dK/dV by column, dQ by row
    assert {(w, c) for _, _, w, c in prepasses} == {(False, False), (True, True), (True, False)}
    cache = {}
    first = gradients(m.document_mask, inputs, **BLOCKS, mask_cache=cache)
    assert len(prepasses) == 6 and len(cache) == 3
    warm = gradients(m.document_mask, inputs, **BLOCKS, mask_cache=cache)
    assert len(prepasses) == 6, "a warm cache ran a prepass in the forward or backward"
    for c, f, w in zip(cold, first, warm):
        assert (c is None and f is None and w is None) or (torch.equal(c, f) and torch.equal(c, w)), seed
    exact = gradients(m.reference, [t.double() if t.is_floating_point() else t for t in inputs])
    assert_accurate(warm, exact, gradients(m.reference, inputs), f"warm cache, seed {seed}", dtype)


def test_a_planned_launch_finds_each_calls_own_ranges(doc_module, prepasses, monkeypatch):
    """The launchers keep a plan per signature (codegen/launch_plan.py); for a
    mask that reads data, a plan's call runs its ranges prepasses again:
    other ids of the same shape give that call's outputs and gradients, bit
    for bit those of launchers that plan nothing, and the plans hold no
    call's ranges."""
    m = doc_module
    (q, k, v, doc), seed = _inputs(m, 45, torch.float32)
    other = torch.flip(doc.max() - doc, dims=[1]).contiguous()   # other documents, the same shape
    assert not torch.equal(other, doc)
    monkeypatch.setattr(m, "_LAUNCH_PLANS", {})
    planned = [gradients(m.document_mask, (q, k, v, d), **BLOCKS) for d in (doc, other, doc)]
    outputs = [m.document_mask(q, k, v, d, **BLOCKS) for d in (doc, other, doc)]
    plans = [v for key, v in m._LAUNCH_PLANS.items() if "backward" in key]
    assert len(plans) == 1 and all(r is None or r[2]["_ranges"] is None for r in plans[0][1][5]), seed
    assert all(p[1][5]["_ranges"] is None for key, p in m._LAUNCH_PLANS.items()   # the forwards' (_fixed)
               if "backward" not in key and "preprocess" not in key)
    runs = len(prepasses)
    monkeypatch.setattr(m, "_launch_plan", lambda key: (None, None))
    whole = [gradients(m.document_mask, (q, k, v, d), **BLOCKS) for d in (doc, other)]
    assert len(prepasses) - runs == (runs - 3) * 2 // 3   # a plan's call ran as many prepasses as a whole one
    for got, want in zip(planned, whole + whole[:1]):
        assert all(torch.equal(a, b) for a, b in zip(got, want) if a is not None), seed
    for got, d in zip(outputs, (doc, other, doc)):
        assert torch.equal(got, m.document_mask(q, k, v, d, **BLOCKS)), seed


def test_forward_only_entry_serves_training_forward(doc_module, prepasses):
    """An inference call and a training call at the same blocks share the forward's entry."""
    m = doc_module
    inputs, _ = _inputs(m, 40, torch.float32)
    cache = {}
    m.document_mask(*inputs, **BLOCKS, mask_cache=cache)
    gradients(m.document_mask, inputs, **BLOCKS, mask_cache=cache)
    assert [p[2:] for p in prepasses] == [(False, False), (True, True), (True, False)]


def test_blocks_and_kernels_do_not_collide(doc_module, prepasses):
    """One dict across block sizes: each launch its own entry, each result the cold one."""
    m = doc_module
    inputs, seed = _inputs(m, 70, torch.float32)
    tiles = [{"block_q": 16, "block_x": 32}, {"block_q": 32, "block_x": 16}, {"block_q": 16, "block_x": 16}]
    cold = [m.document_mask(*inputs, **t) for t in tiles]
    del prepasses[:]
    cache = {}
    for _ in range(2):
        for t, want in zip(tiles, cold):
            assert torch.equal(m.document_mask(*inputs, **t, mask_cache=cache), want), (t, seed)
    assert len(prepasses) == 3 and len(cache) == 3
    # the backward's kernels at the forward's blocks: by column and whole rows are other entries
    gradients(m.document_mask, inputs, **tiles[0], mask_cache=cache)
    assert len(prepasses) == 5 and len(cache) == 5


def test_direct_backward_takes_the_cache(doc_module, prepasses):
    m = doc_module
    inputs, seed = _inputs(m, 45, torch.float32, b=1)
    q, k, v, doc = inputs
    O = m.document_mask(*inputs, **BLOCKS)
    dO = torch.randn_like(O)
    _, lse = m._document_mask_forward(*inputs, 16, 32, None, None, None, True)
    lse = lse[0]
    delta, = m.document_mask_preprocess(*inputs, dO, O, block_q=16)
    cold = m.document_mask_backward(*inputs, dO, lse, delta, **BLOCKS)
    cache = {}
    m.document_mask_backward(*inputs, dO, lse, delta, **BLOCKS, mask_cache=cache)
    n = len(prepasses)
    warm = m.document_mask_backward(*inputs, dO, lse, delta, **BLOCKS, mask_cache=cache)
    assert len(prepasses) == n and len(cache) == 2
    assert all(torch.equal(a, b) for a, b in zip(cold[:3], warm[:3])), seed


def test_rows_at_positions_keep_nothing(doc_module, prepasses):
    """With positions= the kernels test every tile: no prepass, nothing kept."""
    m = doc_module
    inputs, _ = _inputs(m, 33, torch.float32)
    cache = {}
    where = {"positions": {"q": torch.arange(33), "x": torch.arange(33)}, "lengths": {"q": 33, "x": 33}}
    got = m.document_mask(*inputs, **BLOCKS, **where, mask_cache=cache)
    assert cache == {} and prepasses == []
    assert torch.equal(got, m.document_mask(*inputs, **BLOCKS))


@pytest.mark.parametrize("bad", [[], 0, "cache", ()], ids=["list", "int", "str", "tuple"])
def test_mask_cache_must_be_a_dict(doc_module, folder, bad):
    m = doc_module
    inputs, _ = _inputs(m, 20, torch.float32, b=1, h=1)
    for call in (lambda: m.document_mask(*inputs, **BLOCKS, mask_cache=bad),
                 lambda: gradients(m.document_mask, inputs, **BLOCKS, mask_cache=bad)):
        with pytest.raises(TypeError, match="mask_cache must be a dict"):
            call()
    c = compile_text(CAUSAL, "mask_cache_causal", folder)
    with pytest.raises(TypeError, match="mask_cache must be a dict"):
        c.causal(*c.example_inputs({"b": 1, "h": 1, "q": 20, "x": 20}, dtype=torch.float32), mask_cache=bad)


def test_diagram_without_prepass_accepts_and_ignores_the_cache(folder):
    """A causal mask has its blocks by formula: the dict stays empty, the result is the same."""
    c = compile_text(CAUSAL, "mask_cache_causal", folder)
    inputs = c.example_inputs({"b": 1, "h": 2, "q": 37, "x": 37}, dtype=torch.float32,
                              seed=random.randrange(1 << 30))
    cache = {}
    opts = {"block_q": 16, "block_x": 16}
    out = c.causal(*inputs, **opts, mask_cache=cache)
    out, want = (out, c.causal(*inputs, **opts)) if torch.is_tensor(out) else (out[0], c.causal(*inputs, **opts)[0])
    assert torch.equal(out, want)
    assert all(g is None or torch.isfinite(g).all() for g in gradients(c.causal, inputs, **opts, mask_cache=cache))
    assert cache == {}


def test_traced_call_refuses_the_cache(doc_module):
    """Meta inputs go through the torch op's fake, as under torch.compile: no dict crosses it."""
    m = doc_module
    inputs = [t.to("meta") for t in _inputs(m, 20, torch.float32, b=1, h=1)[0]]
    with pytest.raises(ValueError, match="mask_cache= is not supported under torch.compile"):
        m.document_mask(*inputs, **BLOCKS, mask_cache={})


def test_bench_napkin_row_passes_a_fresh_warm_cache(doc_module, prepasses, folder):
    """napkin bench's napkin row (harness._napkin_prepare): a fresh dict per
    prepare (per set of inputs), filled by its first call (the check's or the
    timing's warm-up), so the calls timed after run no prepass; a diagram with
    no prepass gets no mask_cache= at all."""
    from napkin.bench import harness

    m = doc_module
    inputs, _ = _inputs(m, 40, torch.float32, b=1)
    seen = []
    real = m.document_mask

    def launcher(*args, **kwargs):
        seen.append(kwargs.get("mask_cache"))
        return real(*args, **kwargs)

    launcher.__name__ = real.__name__
    launcher.__signature__ = __import__("inspect").signature(real)
    prepare = harness._napkin_prepare(launcher, harness.uses_mask_cache(launcher, m))
    go = prepare(inputs, {}, "cpu")
    go()
    assert len(prepasses) == 1
    for _ in range(3):   # the timed calls
        go()
    assert len(prepasses) == 1 and isinstance(seen[0], dict) and all(c is seen[0] for c in seen)
    prepare(inputs, {}, "cpu")()   # another set of inputs (the check's, say): its own dict
    assert len(prepasses) == 2 and seen[-1] is not seen[0]
    c = compile_text(CAUSAL, "mask_cache_causal", folder)
    assert not harness.uses_mask_cache(c.causal, c) and harness.uses_mask_cache(real, m)


def test_packed_rows_keep_their_own_entries(folder):
    """A grouped-query document mask packs (g, q) rows in the forward (its prepass on the
    packed rows, codegen/packed.py) but not in the backward: each its own entries in one
    dict, warm results the cold ones, and a warm step runs no prepass."""
    from test_packing import DOC as PACKED
    m = compile_text(PACKED, "mask_cache_packed", folder)
    seed = random.randrange(1 << 30)
    sizes = {"b": 2, "hk": 2, "g": 3, "q": 7, "x": 45}
    Q, Kt, V, _, _ = m.example_inputs(sizes, dtype=torch.float32, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    qdoc = torch.randint(0, 4, (2, 7), generator=gen).sort(-1).values.int()
    kdoc = torch.randint(0, 4, (2, 45), generator=gen).sort(-1).values.int()
    inputs, opts = (Q, Kt, V, qdoc, kdoc), {"block_q": 16, "block_x": 16}
    cold_out = m.packed_docs(*inputs, **opts)
    cold = gradients(m.packed_docs, inputs, **opts)
    cache, runs = {}, []
    real = m._packed_docs_ranges
    m._packed_docs_ranges = lambda *a, **k: runs.append(a[4:8]) or real(*a, **k)
    try:
        for _ in range(2):
            assert torch.equal(m.packed_docs(*inputs, **opts, mask_cache=cache), cold_out), seed
            warm = gradients(m.packed_docs, inputs, **opts, mask_cache=cache)
            assert all(c is None or torch.equal(c, w) for c, w in zip(cold, warm)), seed
    finally:
        m._packed_docs_ranges = real
    assert len(runs) == 3 == len(cache)   # packed forward, dK/dV, dQ: once each


def test_in_place_edit_runs_the_prepass_again(doc_module, prepasses):
    """An entry follows its mask input's version counter: a buffer refilled in place
    (the next batch's ids copied into it) runs the prepass again, replaces the
    entry, and gives the new layout's result, not the stale one."""
    m = doc_module
    inputs, seed = _inputs(m, 61, torch.float32)
    q, k, v, doc = inputs
    cache = {}
    before = m.document_mask(*inputs, **BLOCKS, mask_cache=cache)
    assert len(prepasses) == 1
    doc.copy_(torch.flip(doc, dims=[1]).neg())   # reversed documents: other live blocks
    want = m.document_mask(*inputs, **BLOCKS)    # cold, on the new ids
    assert len(prepasses) == 2
    got = m.document_mask(*inputs, **BLOCKS, mask_cache=cache)
    assert len(prepasses) == 3 and len(cache) == 1, "the entry was not replaced"
    assert torch.equal(got, want) and not torch.equal(got, before), seed
    m.document_mask(*inputs, **BLOCKS, mask_cache=cache)
    assert len(prepasses) == 3, "the replaced entry was not reused"
    # through autograd too: the backward's entries follow the edited ids
    gradients(m.document_mask, inputs, **BLOCKS, mask_cache=cache)
    doc[:, : doc.shape[1] // 2] = doc.min() - 1                  # a new first document
    cold = gradients(m.document_mask, inputs, **BLOCKS)
    n = len(prepasses)
    warm = gradients(m.document_mask, inputs, **BLOCKS, mask_cache=cache)
    assert len(prepasses) == n + 3 and len(cache) == 3
    assert all(c is None or torch.equal(c, w) for c, w in zip(cold, warm)), seed


def test_other_tensor_runs_the_prepass_again(doc_module, prepasses):
    """Another tensor object (a new batch's ids) is not trusted to hold the same
    values, even with the same shape: it runs the prepass and replaces the entry.
    The dict holds its tensors weakly: a dropped batch's ids are freed."""
    import gc
    import weakref

    m = doc_module
    inputs, seed = _inputs(m, 50, torch.float32)
    q, k, v, doc = inputs
    cache = {}
    m.document_mask(q, k, v, doc, **BLOCKS, mask_cache=cache)
    other = torch.sort(torch.randint(0, 7, doc.shape), dim=1).values.to(torch.int32)
    got = m.document_mask(q, k, v, other, **BLOCKS, mask_cache=cache)
    assert len(prepasses) == 2 and len(cache) == 1
    assert torch.equal(got, m.document_mask(q, k, v, other, **BLOCKS)), seed
    alive = weakref.ref(other)
    del other, got
    gc.collect()
    assert alive() is None, "mask_cache kept the mask input alive"
    m.document_mask(q, k, v, doc.clone(), **BLOCKS, mask_cache=cache)   # equal values, new tensor
    assert len(prepasses) == 4 and len(cache) == 1


def test_inference_tensors_are_kept_by_identity(doc_module, prepasses):
    """Inference tensors have no version counter: their entries are kept and
    reused by the tensor object alone (documented), without an error."""
    m = doc_module
    inputs, seed = _inputs(m, 30, torch.float32, b=1)
    cache = {}
    with torch.inference_mode():
        doc = inputs[3].clone()
        assert doc.is_inference()
        first = m.document_mask(*inputs[:3], doc, **BLOCKS, mask_cache=cache)
        warm = m.document_mask(*inputs[:3], doc, **BLOCKS, mask_cache=cache)
    assert len(prepasses) == 1 and torch.equal(first, warm), seed


STREAM = (REPO / "examples" / "streaming_llm.ncd").read_text().replace("q - x < 1024", "q - x < 24")


def test_a_mask_of_indices_alone_keeps_its_ranges_without_a_dict(folder, monkeypatch):
    """StreamingLLM's mask reads no tensor, so its ranges follow from the key
    alone: with no mask_cache the module keeps them (_STREAMING_LLM_RANGES_KEPT),
    and a loop's later calls, forward and training step, run no prepass; their
    results are a cold call's bit for bit (and near float64's).  Other sizes
    get their own entries, up to _RANGES_KEPT_MAX, then the dict starts again.
    A mask that reads ids keeps nothing of its own: its ids may change."""
    m = compile_text(STREAM, "mask_cache_stream", folder)
    kept = m._STREAMING_LLM_RANGES_KEPT
    kept.clear()
    runs, real = [], m._streaming_llm_ranges
    monkeypatch.setattr(m, "_streaming_llm_ranges", lambda *a, **k: runs.append(a[2:6]) or real(*a, **k))
    seed = random.randrange(1 << 30)
    inputs = m.example_inputs({"b": 1, "h": 2, "q": 70, "x": 70}, dtype=torch.float32, seed=seed)
    first = m.streaming_llm(*inputs, **BLOCKS)
    assert len(runs) == 1 and len(kept) == 1
    again = m.streaming_llm(*inputs, **BLOCKS)
    assert len(runs) == 1, "a mask of indices alone ran its prepass again"
    kept.clear()
    assert torch.equal(again, first) and torch.equal(m.streaming_llm(*inputs, **BLOCKS), first), seed
    want = m.reference(*[t.double() for t in inputs])
    assert (first.double() - want).abs().max().item() < 2e-5, seed
    cold = gradients(m.streaming_llm, inputs, **BLOCKS)
    assert len(runs) == 4 and len(kept) == 3          # the forward's entry, then dK/dV's and dQ's
    warm = gradients(m.streaming_llm, inputs, **BLOCKS)
    assert len(runs) == 4 and all(torch.equal(c, w) for c, w in zip(cold, warm)), seed
    monkeypatch.setattr(m, "_RANGES_KEPT_MAX", 2)
    kept.clear()
    for n in (30, 40, 50):
        m.streaming_llm(*m.example_inputs({"b": 1, "h": 1, "q": n, "x": n}, dtype=torch.float32, seed=seed), **BLOCKS)
    assert len(runs) == 7 and len(kept) == 1          # cleared at the third size
    d = compile_text(DOC, "mask_cache_doc", folder)
    assert d._DOCUMENT_MASK_RANGES_KEPT is None
