"""Masks that read data (document ids, bool masks): the ranges prepass.

Such a mask has no formula for its blocks, so a generated prepass kernel
(napkin/codegen/ranges.py) evaluates the whole predicate on every tile and
gives each row block (each key block, for dK/dV) the span of its live
blocks and a run of full ones; the kernels loop over those.  Checked here:

* the prepass's numbers against a brute-force torch computation of live and
  full tiles (so a prepass that marked everything live would fail);
* the forward and the gradients against the float64 reference on ragged
  sizes and id layouts: contiguous documents, unsorted / interleaved ids,
  one document, every key its own document, batches with different layouts;
  a causal document mask (the affine conjunct inside the prepass) and a bool
  mask input;
* that dead tiles are skipped: K bytes loaded (napkin.bytecount) drop to the
  live blocks;
* that rows at global positions (the distributed wrappers) keep every block.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import napkin
from napkin.bytecount import ByteCounter
from napkin.codegen import lower as L
from napkin.codegen import ranges as R
from napkin.codegen.kernel_names import internal_names
from backward_helpers import assert_accurate, compile_text, gradients

REPO = Path(__file__).resolve().parent.parent
DOC = (REPO / "examples" / "document_mask.ncd").read_text()
CAUSAL_DOC = DOC.replace("where(doc[b, q] == doc,", "where(x <= q and doc[b, q] == doc,")
BOOL_MASK = """diagram bool_mask
wire b, h, q, x
wire d = 32
in Q[b, h, q, d] : fp32
in K[b, h, x, d] : fp32
in V[b, h, x, d] : fp32
in keep[b, q, x] : bool
S[b, h, q, x] = where(keep, sum[d](Q * K) * |d|^-0.5, -inf)
P[b, h, q, x] = softmax[x](S)
O[b, h, q, d] : fp32 = sum[x](P * V)
out O
schedule on h100 {
  accumulate fp32
  level hbm { hold Q, K, V, keep, O }
  level smem {
    group b by 1, h by 1, q by 64
    stream x by 32
    hold S, P
  }
}
"""
# A mask of indices alone that is no conjunction of bounds (causal with 4 sink keys every
# query sees): no formula either, so the prepass finds its blocks; it reads no tensor.
SINKS = DOC.replace("where(doc[b, q] == doc,", "where(x <= q or x < 4,")
BLOCKS = {"block_q": 16, "block_x": 32}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("ranges")


def _module(text, key, folder):
    return compile_text(text, key, folder)


def _ids(layout: str, n: int, gen) -> torch.Tensor:
    """One sequence's document ids."""
    if layout == "contiguous":   # ~4 documents of random lengths, in order
        return torch.sort(torch.randint(0, 4, (n,), generator=gen)).values
    if layout == "interleaved":  # unsorted: each document's keys scattered
        return torch.randint(0, 3, (n,), generator=gen)
    if layout == "one":
        return torch.zeros(n, dtype=torch.long)
    if layout == "each":         # every key its own document
        return torch.arange(n)
    if layout == "runs":         # documents that come back: 0 0 1 1 0 0 2 2 ...
        return (torch.arange(n) // 9) % 3
    raise ValueError(layout)


def _doc(layouts, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([_ids(lay, n, gen) for lay in layouts]).to(torch.int32)


def _brute(pred, nr, nc, br, bc, whole_rows, by_col):
    """[lo, hi, flo, fhi] per block of the program wire from a boolean
    [rows, cols] matrix: live (some pair true), full (every real row true,
    the key block whole, and the row block too with whole_rows)."""
    nrb, ncb = -(-nr // br), -(-nc // bc)
    live = torch.zeros(nrb, ncb, dtype=torch.bool)
    full = torch.zeros(nrb, ncb, dtype=torch.bool)
    for i in range(nrb):
        for j in range(ncb):
            t = pred[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
            live[i, j] = bool(t.any())
            whole = (j + 1) * bc <= nc and (not whole_rows or (i + 1) * br <= nr)
            full[i, j] = whole and bool(t.all())
    if by_col:
        live, full = live.T, full.T
    return live, full


def _check_ranges(got, live, full):
    """The prepass's numbers against the brute force: [lo, hi) the first and
    last live block, [flo, fhi) a longest run of full blocks inside it."""
    for p in range(live.shape[0]):
        lo, hi, flo, fhi = got[p].tolist()
        idx = live[p].nonzero().flatten().tolist()
        assert (lo, hi) == ((idx[0], idx[-1] + 1) if idx else (0, 0)), p
        best, run = 0, 0
        for f in full[p].tolist():
            run = run + 1 if f else 0
            best = max(best, run)
        assert fhi - flo == best, p
        assert lo <= flo <= fhi <= hi, p
        assert bool(full[p, flo:fhi].all()), p


def test_only_masks_that_read_data_get_a_prepass():
    got = {}
    for name in ("document_mask", "causal", "sliding_window", "attention", "alibi"):
        got[name] = R.applies(L.lower(napkin.load(REPO / "examples" / f"{name}.ncd")))
    assert got == {"document_mask": True, "causal": False, "sliding_window": False, "attention": False,
                   "alibi": False}
    plan = L.lower(napkin.load_text(CAUSAL_DOC, "causal_doc.ncd"))
    assert R.applies(plan) and len(plan.bounds) == 1 and R.batch_wires(plan) == ("b",)
    assert R.batch_wires(L.lower(napkin.load_text(BOOL_MASK, "bool_mask.ncd"))) == ("b",)
    sinks = L.lower(napkin.load_text(SINKS, "sinks.ncd"))
    assert R.applies(sinks) and sinks.full is None and R.batch_wires(sinks) == ()


def test_a_mask_of_indices_alone(folder):
    """x <= q or x < 4: the prepass reads no tensor and has no batch wire;
    its ranges are the brute force's, and the kernels agree with the
    reference (forward and gradients)."""
    m = _module(SINKS, "ranges_sinks", folder)
    n, rows = 70, torch.arange(70)
    pred = (rows[None, :] <= rows[:, None]) | (rows[None, :] < 4)
    doc = torch.zeros(2, n, dtype=torch.int32)  # declared, unread by this mask
    for whole_rows, by_col in [(False, False), (True, False), (True, True)]:
        got, _ = m._document_mask_ranges({"b": 2, "h": 1, "q": n, "x": n, "d": 64}, doc.device,
                                         16, 16, whole_rows, by_col, True)
        assert got.shape[0] == 1  # one row of ranges serves every (b, h)
        _check_ranges(got[0], *_brute(pred, n, n, 16, 16, whole_rows, by_col))
    q, k, v, _ = m.example_inputs({"b": 2, "h": 1, "q": n, "x": n}, dtype=torch.float32, seed=16)
    _forward_check(m, m.document_mask, (q, k, v, doc), BLOCKS, "sinks")
    # the first rows see one to four keys: dV errs 5.1e-6 here, and main's kernels (every
    # block, masked) by the same 5.1e-6, just over test_backward's rule: an absolute bound
    _grad_check(m, m.document_mask, (q, k, v, doc), BLOCKS, "sinks", within=1e-5)


@pytest.mark.parametrize("whole_rows, by_col", [(False, False), (True, False), (True, True)])
def test_prepass_matches_brute_force(folder, whole_rows, by_col):
    m = _module(DOC, "ranges_doc", folder)
    n, br, bc = 83, 16, 16
    for seed, layouts in enumerate([("contiguous", "interleaved"), ("runs", "each"), ("one", "contiguous")]):
        doc = _doc(layouts, n, seed)
        sz = {"b": 2, "h": 3, "q": n, "x": n, "d": 64}
        got, on = m._document_mask_ranges(doc, sz, doc.device, br, bc, whole_rows, by_col, True)
        assert on and tuple(got.shape) == (2, -(-n // (bc if by_col else br)), 4)  # per b, not per (b, h)
        for b in range(2):
            pred = doc[b][:, None] == doc[b][None, :]
            _check_ranges(got[b], *_brute(pred, n, n, br, bc, whole_rows, by_col))


@pytest.mark.parametrize("per", [1, 2, 3, 100])
def test_chunks_of_the_scan_join_into_the_same_ranges(folder, per):
    """The scan takes _per blocks a program and the merge joins them: full
    runs that cross chunk edges (documents 40 keys long over 8-key blocks),
    chunks all full, none live, and one chunk for the whole row (100)."""
    m = _module(DOC, "ranges_doc", folder)
    n, br, bc = 91, 8, 8
    doc = torch.stack([torch.arange(n) // 40, torch.arange(n) % 5, torch.zeros(n, dtype=torch.long)]).to(torch.int32)
    for whole_rows, by_col in [(False, False), (True, False), (True, True)]:
        got, _ = m._document_mask_ranges(doc, {"b": 3, "h": 1, "q": n, "x": n, "d": 64}, doc.device, br, bc,
                                         whole_rows, by_col, True, _per=per)
        for b in range(3):
            pred = doc[b][:, None] == doc[b][None, :]
            _check_ranges(got[b], *_brute(pred, n, n, br, bc, whole_rows, by_col))


def test_prepass_honours_the_affine_conjuncts(folder):
    m = _module(CAUSAL_DOC, "ranges_causal_doc", folder)
    n, br, bc = 70, 16, 16
    doc = _doc(("contiguous", "one"), n, 3)
    rows = torch.arange(n)
    for whole_rows, by_col in [(False, False), (True, True)]:
        got, _ = m._document_mask_ranges(doc, {"b": 2, "h": 1, "q": n, "x": n, "d": 64}, doc.device,
                                         br, bc, whole_rows, by_col, True)
        for b in range(2):
            pred = (doc[b][:, None] == doc[b][None, :]) & (rows[None, :] <= rows[:, None])
            _check_ranges(got[b], *_brute(pred, n, n, br, bc, whole_rows, by_col))


def _forward_check(m, fn, inputs, opts, label):
    got = fn(*inputs, **opts)
    want = m.reference(*[t.double() if t.is_floating_point() else t for t in inputs])
    err = (got.double() - want).abs().max().item()
    assert err < 2e-5, f"{label}: {err}"


@pytest.mark.parametrize("layouts", [("contiguous", "interleaved"), ("one", "each"), ("runs", "contiguous")])
def test_document_mask_forward_matches_float64(folder, layouts):
    m = _module(DOC, "ranges_doc", folder)
    n = 75
    q, k, v, _ = m.example_inputs({"b": 2, "h": 2, "q": n, "x": n}, dtype=torch.float32, seed=1)
    _forward_check(m, m.document_mask, (q, k, v, _doc(layouts, n, 5)), BLOCKS, str(layouts))


def test_causal_document_and_bool_mask_forward(folder):
    m = _module(CAUSAL_DOC, "ranges_causal_doc", folder)
    n = 61
    q, k, v, _ = m.example_inputs({"b": 2, "h": 2, "q": n, "x": n}, dtype=torch.float32, seed=2)
    _forward_check(m, m.document_mask, (q, k, v, _doc(("contiguous", "runs"), n, 7)), BLOCKS, "causal doc")
    b = _module(BOOL_MASK, "ranges_bool", folder)
    q, k, v, keep = b.example_inputs({"b": 2, "h": 2, "q": 45, "x": 70}, dtype=torch.float32, seed=3)
    keep = torch.zeros(2, 45, 70, dtype=torch.bool)
    keep[0, :, 20:50] = True                              # a band of keys: blocks outside it skipped
    keep[1] = torch.rand(45, 70, generator=torch.Generator().manual_seed(4)) < 0.3
    keep[1, 7] = False                                    # a row that sees nothing: output 0
    _forward_check(b, b.bool_mask, (q, k, v, keep), BLOCKS, "bool mask")


def _k_bytes(m, inputs, **opts):
    with ByteCounter(tensors={"K": inputs[1]}) as bc:
        m.document_mask(*inputs, **opts)
    assert bc.launches >= 1
    return bc.loads["K"]


def test_dead_blocks_are_not_loaded(folder):
    """Four documents of 32 ids, blocks of 16: each row block meets 2 of the 8
    key blocks, so K is loaded a quarter as often as with every block; rows
    at global positions (the distributed path) still load every block."""
    m = _module(DOC, "ranges_doc", folder)
    n = 128
    q, k, v, _ = m.example_inputs({"b": 1, "h": 2, "q": n, "x": n}, dtype=torch.float32, seed=0)
    doc = (torch.arange(n) // 32).to(torch.int32)[None]
    opts = {"block_q": 16, "block_x": 16}
    tile = 16 * 64 * 4
    assert _k_bytes(m, (q, k, v, doc), **opts) == 2 * 8 * 2 * tile        # (b, h) x row blocks x 2 blocks
    every = _k_bytes(m, (q, k, v, doc), positions={"q": torch.arange(n), "x": torch.arange(n)},
                     lengths={"q": n, "x": n}, **opts)
    assert every == 2 * 8 * 8 * tile


def _grad_check(m, fn, inputs, opts, label, dtype=torch.float32, within=None):
    """test_backward's rule; ``within``: an absolute bound instead (see the "each" case)."""
    got = gradients(fn, inputs, **opts)
    exact = gradients(m.reference, [t.double() if t.is_floating_point() else t for t in inputs])
    if within is None:
        assert_accurate(got, exact, gradients(m.reference, inputs), label, dtype)
        return
    for i, (g, e) in enumerate(zip(got, exact)):
        if e is not None:
            assert (g.double() - e).abs().max().item() <= within, (label, i)


@pytest.mark.parametrize("layouts, dtype", [(("contiguous", "interleaved"), torch.float32),
                                            (("one", "each"), torch.float32),
                                            (("runs", "contiguous"), torch.float16)], ids=["fp32a", "fp32b", "fp16"])
def test_document_mask_gradients_match_float64_autograd(folder, layouts, dtype):
    """dQ at its blocks (rows ragged: no full block in the last), dK/dV over
    the transposed ranges."""
    m = _module(DOC, "ranges_doc", folder)
    n = 53
    q, k, v, _ = m.example_inputs({"b": 2, "h": 2, "q": n, "x": n}, dtype=dtype, seed=6)
    # every key its own document: each row sees one key, its P is 1 to a rounding, and dP - delta
    # cancels to that rounding (the reference's single-element softmax is exactly 1); main's
    # kernels, which visit every block, err by the same 2.2e-6 here: an absolute bound instead
    within = 1e-5 if "each" in layouts else None
    _grad_check(m, m.document_mask, (q, k, v, _doc(layouts, n, 8)), BLOCKS, str(layouts), dtype, within)


def test_causal_document_and_bool_mask_gradients(folder):
    m = _module(CAUSAL_DOC, "ranges_causal_doc", folder)
    n = 50
    q, k, v, _ = m.example_inputs({"b": 2, "h": 1, "q": n, "x": n}, dtype=torch.float32, seed=9)
    _grad_check(m, m.document_mask, (q, k, v, _doc(("contiguous", "interleaved"), n, 10)), BLOCKS, "causal doc")
    b = _module(BOOL_MASK, "ranges_bool", folder)
    q, k, v, _ = b.example_inputs({"b": 2, "h": 1, "q": 40, "x": 57}, dtype=torch.float32, seed=11)
    keep = torch.zeros(2, 40, 57, dtype=torch.bool)
    keep[0, :20, :30] = True                              # two blocks of documents
    keep[0, 20:, 30:] = True
    keep[1] = torch.rand(40, 57, generator=torch.Generator().manual_seed(12)) < 0.4
    _grad_check(b, b.bool_mask, (q, k, v, keep), BLOCKS, "bool mask")


def test_backward_skips_dead_blocks(folder):
    """The backward's loads of the loop operand drop as the forward's: dQ
    loads K from 2 of 8 key blocks per row block, dK/dV Q from 2 of 8 row
    blocks per key block; with positions every block is loaded."""
    m = _module(DOC, "ranges_doc", folder)
    n, tile = 128, 16 * 64 * 4
    q, k, v, _ = m.example_inputs({"b": 1, "h": 2, "q": n, "x": n}, dtype=torch.float32, seed=0)
    doc = (torch.arange(n) // 32).to(torch.int32)[None]
    rows = [torch.randn(q.shape), torch.zeros(q.shape[:-1]), torch.zeros(q.shape[:-1])]
    opts = {"block_q": 16, "block_x": 16}
    at = {"positions": {"q": torch.arange(n), "x": torch.arange(n)}, "lengths": {"q": n, "x": n}}
    for extra, blocks in [({}, 2), (at, 8)]:
        with ByteCounter(tensors={"K": k}) as bc:
            m.document_mask_backward(q, k, v, doc, *rows, need=(True, False, False, False), **opts, **extra)
        assert bc.loads["K"] == 2 * 8 * blocks * tile, ("dQ", blocks)
        with ByteCounter(tensors={"Q": q}) as bc:
            m.document_mask_backward(q, k, v, doc, *rows, need=(False, True, True, False), **opts, **extra)
        assert bc.loads["Q"] == 2 * 8 * blocks * tile, ("dK/dV", blocks)


@pytest.mark.parametrize("name", ["keep", "ranges", "rg", "run", "best", "steps", "mb", "j"])
def test_ids_named_like_the_prepass_variables(folder, name):
    """The prepass's own variables (ranges.NAMES, in kernel_names.internal_names)
    never take a user's name: ids called ``keep`` load as ``_keep_1``; the
    kernels still agree with the reference (two of them run)."""
    from napkin.check import hostile_name
    from napkin.codegen import emit_module

    assert hostile_name(name) is None
    text = DOC.replace("doc", name).replace(f"diagram {name}ument_mask", "diagram document_mask")
    d = napkin.load_text(text, f"ids_{name}.ncd")
    plan = L.lower(d)
    var = next(ld.var for ld in plan.loads if ld.tensor == name)
    assert f"_{name}" in R.NAMES and f"_{name}" in internal_names(d)
    assert var == f"_{name}_1"
    compile(emit_module(d, source_text=text, source_path=f"ids_{name}.ncd"), "ids.py", "exec")
    if name in ("keep", "ranges"):
        m = _module(text, f"ranges_ids_{name}", folder)
        n = 40
        q, k, v, _ = m.example_inputs({"b": 1, "h": 2, "q": n, "x": n}, dtype=torch.float32, seed=13)
        _forward_check(m, m.document_mask, (q, k, v, _doc(("contiguous",), n, 14)), BLOCKS, name)
        _grad_check(m, m.document_mask, (q, k, v, _doc(("runs",), n, 15)), BLOCKS, name)
