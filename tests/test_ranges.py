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
from cost_helpers import GQA_DOC, backward_bytes, record_rows, triton_transfers

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
# the keys at and after the row and 4 sinks: an or of a lower and an upper bound, two runs a row (an
# or of bounds of one kind, x <= q or x < 4, is one bound: the loops', tests/test_union_bounds.py)
SINKS = DOC.replace("where(doc[b, q] == doc,", "where(x >= q or x < 4,")
# StreamingLLM's: 4 sink keys and a causal window of 24; the keys between are dead, one run a row
STREAM = DOC.replace("where(doc[b, q] == doc,", "where(x <= q and (q - x < 24 or x < 4),")
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
    if layout == "apart":        # runs of 20 that come back 40 keys on: dead blocks between live ones
        return (torch.arange(n) // 20) % 3
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


def _check_ranges(got, live, full, prefix: bool = False):
    """The prepass's record against the brute force: [lo, hi) the first and
    last live block, then the counts and the lists, ascending, of the
    partial blocks (live, not full) and of the full ones (what the kernels'
    two loops walk); with ``prefix`` (a chunked launch's) each list's
    prefix counts pos[0..S] after them."""
    steps = live.shape[1]
    assert got.shape[-1] == (4 * steps + 6 if prefix else 2 * steps + 4)
    for p, (lo, hi, partial, whole, pos) in enumerate(record_rows(got, steps)):
        idx = live[p].nonzero().flatten().tolist()
        assert (lo, hi) == ((idx[0], idx[-1] + 1) if idx else (0, 0)), p
        for k, (want, listed) in enumerate(((live[p] & ~full[p], partial), (full[p], whole))):
            blocks = want.nonzero().flatten().tolist()
            assert list(listed) == blocks, (p, k)
            if prefix:
                assert pos[k] == [sum(j < b for j in blocks) for b in range(steps + 1)], (p, k)


def _dead(got):
    """Per block of a record: the dead blocks inside [lo, hi), which neither list holds."""
    return got[..., 1] - got[..., 0] - got[..., 2] - got[..., 3]


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
    """x >= q or x < 4: the prepass reads no tensor and has no batch wire;
    its ranges are the brute force's, and the kernels agree with the
    reference (forward and gradients)."""
    m = _module(SINKS, "ranges_sinks", folder)
    n, rows = 70, torch.arange(70)
    pred = (rows[None, :] >= rows[:, None]) | (rows[None, :] < 4)
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


@pytest.mark.parametrize("whole_rows, by_col, prefix", [(False, False, False), (True, False, False),
                                                        (True, True, False), (False, False, True)])
def test_prepass_matches_brute_force(folder, whole_rows, by_col, prefix):
    """The record of each document layout; ``prefix``: a chunked forward's, which holds the lists' prefix counts."""
    m = _module(DOC, "ranges_doc", folder)
    n, br, bc = 83, 16, 16
    for seed, layouts in enumerate([("contiguous", "interleaved"), ("runs", "each"), ("one", "contiguous")]):
        doc = _doc(layouts, n, seed)
        sz = {"b": 2, "h": 3, "q": n, "x": n, "d": 64}
        got, on = m._document_mask_ranges(doc, sz, doc.device, br, bc, whole_rows, by_col, True, prefix)
        steps = -(-n // (br if by_col else bc))
        width = 4 * steps + 6 if prefix else 2 * steps + 4
        assert on and tuple(got.shape) == (2, -(-n // (bc if by_col else br)), width)  # per b, not per (b, h)
        for b in range(2):
            pred = doc[b][:, None] == doc[b][None, :]
            _check_ranges(got[b], *_brute(pred, n, n, br, bc, whole_rows, by_col), prefix)


@pytest.mark.parametrize("per", [1, 2, 3, 100])
def test_chunks_of_the_scan_join_into_the_same_ranges(folder, per):
    """The scan takes _per blocks a program and the merge joins them: full
    runs that cross chunk edges (documents 40 keys long over 8-key blocks),
    chunks all full, none live, and one chunk for the whole row (100)."""
    m = _module(DOC, "ranges_doc", folder)
    n, br, bc = 91, 8, 8
    doc = torch.stack([torch.arange(n) // 40, torch.arange(n) % 5, torch.zeros(n, dtype=torch.long),
                       _ids("apart", n, None)]).to(torch.int32)
    for whole_rows, by_col in [(False, False), (True, False), (True, True)]:
        got, _ = m._document_mask_ranges(doc, {"b": 4, "h": 1, "q": n, "x": n, "d": 64}, doc.device, br, bc,
                                         whole_rows, by_col, True, _per=per)
        assert _dead(got[3]).max() == 5  # dead blocks inside a span, across chunk edges at _per < 5
        for b in range(4):
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


@pytest.mark.parametrize("layouts", [("contiguous", "interleaved"), ("one", "each"), ("runs", "contiguous"),
                                     ("apart", "runs")])
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
                                            (("runs", "apart"), torch.float16)], ids=["fp32a", "fp32b", "fp16"])
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


@pytest.mark.parametrize("name", ["keep", "ranges", "rg", "rl", "fp", "pa", "tiles", "steps", "mb", "j"])
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


def test_the_dead_run_between_sinks_and_window_is_skipped(folder):
    """StreamingLLM's mask (x <= q and (q - x < 24 or x < 4)) has one dead run
    a row block, between the sink block and the window (a key block's rows
    are one run: dK/dV has none to skip): the prepass finds it
    (brute force, chunked scans too), the kernels step over it (K loaded
    from the live blocks alone, forward, dQ and dK/dV's Q likewise) and agree
    with the float64 reference, forward and gradients, at a ragged length."""
    m = _module(STREAM, "ranges_stream", folder)
    n, blk = 150, 16
    rows = torch.arange(n)
    pred = (rows[None, :] <= rows[:, None]) & ((rows[:, None] - rows[None, :] < 24) | (rows[None, :] < 4))
    doc = torch.zeros(1, n, dtype=torch.int32)  # declared, unread by this mask
    sz = {"b": 1, "h": 2, "q": n, "x": n, "d": 64}
    for whole_rows, by_col in [(False, False), (True, False), (True, True)]:
        live, full = _brute(pred, n, n, blk, blk, whole_rows, by_col)
        for per in (1, 3, None):
            got, _ = m._document_mask_ranges(sz, doc.device, blk, blk, whole_rows, by_col, True, _per=per)
            _check_ranges(got[0], live, full)
            # the last row blocks skip 6 blocks; a key block's live rows are one run (no dead one)
            assert _dead(got[0]).max() == (0 if by_col else 6), per
    live = _brute(pred, n, n, blk, blk, False, False)[0]
    q, k, v, _ = m.example_inputs({"b": 1, "h": 2, "q": n, "x": n}, dtype=torch.float32, seed=17)
    opts = {"block_q": blk, "block_x": blk}
    # the bytes of the live tiles' loop operand, x 2 heads: its block's real rows (the last has 6) x d x 4 B
    def tiles(axis):
        return 2 * sum(min(blk, n - int(i) * blk) for i in live.nonzero()[:, axis]) * 64 * 4

    assert _k_bytes(m, (q, k, v, doc), **opts) == tiles(1)
    ranges, _ = m._document_mask_ranges(sz, doc.device, blk, blk, False, False, True)
    spans = (ranges[0, :, 1] - ranges[0, :, 0]).sum().item()
    assert spans > live.sum()  # without the skip: the dead blocks inside each span too
    rows_in = [torch.randn(q.shape), torch.zeros(q.shape[:-1]), torch.zeros(q.shape[:-1])]
    with ByteCounter(tensors={"K": k}) as bc:
        m.document_mask_backward(q, k, v, doc, *rows_in, need=(True, False, False, False), **opts)
    assert bc.loads["K"] == tiles(1), "dQ"
    with ByteCounter(tensors={"Q": q}) as bc:
        m.document_mask_backward(q, k, v, doc, *rows_in, need=(False, True, True, False), **opts)
    assert bc.loads["Q"] == tiles(0), "dK/dV"
    _forward_check(m, m.document_mask, (q, k, v, doc), BLOCKS, "stream")
    _grad_check(m, m.document_mask, (q, k, v, doc), BLOCKS, "stream")




def test_grouped_query_dkdv_steps_over_dead_row_blocks(folder):
    """dK/dV of grouped-query attention loops over (row block, g) pairs in one
    flat loop (backward_emit); documents of 40 keys that come back 80 keys on
    leave each key block a dead run of row blocks, which that loop steps
    over too: Q loaded from the live tiles alone, gradients against float64."""
    m = _module(GQA_DOC, "ranges_gqa_doc", folder)
    assert "_rb = _it // _size_g" in m.__loader__.get_data(m.__file__).decode()  # the flat loop is there
    n, blk = 200, 16
    doc = ((torch.arange(n) // 40) % 3).to(torch.int32)[None]
    live = _brute(doc[0][:, None] == doc[0][None, :], n, n, blk, blk, True, True)[0]  # [key block, row block]
    assert any((r.nonzero().flatten().diff() > 1).any() for r in live)  # dead runs between live rows
    q, k, v, _ = m.example_inputs({"b": 1, "hk": 2, "g": 2, "q": n, "x": n}, dtype=torch.float32, seed=18)
    opts = {"block_q": blk, "block_x": blk}
    rows_in = [torch.randn(q.shape), torch.zeros(q.shape[:-1]), torch.zeros(q.shape[:-1])]
    with ByteCounter(tensors={"Q": q}) as bc:
        m.gqa_doc_backward(q, k, v, doc, *rows_in, need=(False, True, True, False), **opts)
    # every (key block, hk) program loads g = 2 heads' rows of each live row block: x 2 hk x 2 g
    assert bc.loads["Q"] == 4 * sum(min(blk, n - int(i) * blk) for i in live.nonzero()[:, 1]) * 32 * 4
    _grad_check(m, m.gqa_doc, (q, k, v, doc), opts, "gqa doc")


def _counted(counts: dict) -> dict:
    """Bytes per tensor, less the declared ids this mask never reads."""
    return {k: v for k, v in counts.items() if k != "doc" and v}


@pytest.mark.parametrize("key, mask", [("stream", "x <= q and (q - x < 24 or x < 4)"),
                                       ("bands", "x < 20 or x > q + 30 or q - x == 7"),
                                       ("sinks", "x >= q or x < 4"),
                                       # two lower bounds loosest at opposite ends of a block:
                                       # a block's loosest-row range holds a dead block
                                       ("crossed", "(x >= q - 5 and x >= 100 - q) or x < 2"),
                                       # no loop formula at all: a key coefficient of 2, and a !=
                                       ("slope", "2 * x <= q"),
                                       ("unequal", "x <= q and q // 32 != x // 16")])
def test_the_cost_pass_counts_what_a_mask_of_indices_moves(folder, key, mask):
    """A mask of indices alone, an or of cuts (StreamingLLM's, bands apart,
    causal with sinks, bounds that cross, a slope of 2, a !=): the cost
    pass finds the prepass's blocks row by row (visits.prepass_visits: each
    row's keys per conjunction, a block's span less its dead runs),
    so its bytes are the kernels' (ByteCounter), forward and the backward's
    kernels, at ragged sizes and blocks 32 x 16."""
    from collections import defaultdict

    from napkin.cost import analyse, with_blocks
    from napkin.cost.backward import backward_cost

    text = DOC.replace("where(doc[b, q] == doc,", f"where({mask},")
    m = _module(text, f"ranges_or_{key}", folder)
    d = napkin.load_text(text, "or.ncd")
    n, blocks = 150, {"q": 32, "x": 16}
    sizes = {"b": 1, "h": 2, "q": n, "x": n}
    q, k, v, _ = m.example_inputs(sizes, dtype=torch.float16, seed=19)
    inputs = (q, k, v, torch.zeros(1, n, dtype=torch.int32))

    def predicted(report):   # the prepass's buffers among them, its lists (torch's) apart
        out = (defaultdict(int), defaultdict(int))
        for t in triton_transfers(report):
            out[t.direction != "load"][t.tensor] += t.bytes
        return tuple(_counted(c) for c in out)

    report = analyse(with_blocks(d, blocks), sizes)
    assert "compares indices alone: the counts are the blocks the kernels' ranges prepass finds live" in " ".join(report.notes)
    # the record is kept across calls (the module's own dict): a launch after the first reads it alone,
    # as counted; the first also runs the prepass's scan and merge
    m.document_mask(*inputs, block_q=32, block_x=16)
    with ByteCounter(tensors=dict(zip(m.INPUTS, inputs))) as bc:
        m.document_mask(*inputs, block_q=32, block_x=16)
    assert bc.launches == 1 and report.kernels[-1].prepass_of is None
    assert (_counted(bc.loads), _counted(bc.stores)) == predicted(report)
    back = backward_cost(with_blocks(d, blocks), sizes, given=True)
    options = tuple({"block_q": 32, "block_x": 16}.get(o) for o in m._OPTIONS)
    with ByteCounter(tensors=dict(zip(m.INPUTS, inputs))) as bc:
        outs, saved = m._document_mask_forward(*inputs, *options, True)
    assert (_counted(bc.loads), _counted(bc.stores)) == predicted(back.forward)
    grads = [torch.randn(o.shape, generator=torch.Generator().manual_seed(0)).to(o.dtype) for o in outs]
    m._document_mask_grads(inputs, (*outs, *saved), grads, options, None)
    with ByteCounter(tensors=dict(zip(m.INPUTS, inputs))) as bc:
        m._document_mask_grads(inputs, (*outs, *saved), grads, options, None)
    assert (_counted(bc.loads), _counted(bc.stores)) == \
        (_counted(backward_bytes(back, "load")), _counted(backward_bytes(back, "store")))
    assert bc.launches == len(back.kernels) == 3 and "_ranges" in bc.loads


def test_which_masks_the_cost_pass_reads_as_an_or_of_bounds():
    """ranges.index_disjuncts: the conjunctions of cuts of a prepass mask of
    indices alone; None where a comparison is no cut (a fraction, two terms
    of the key, a product), a tensor is read (ids), or the ors distribute to
    more than masks.MAX_DISJUNCTS."""
    from napkin import masks

    def disjuncts(mask):
        return R.index_disjuncts(L.lower(napkin.load_text(DOC.replace("where(doc[b, q] == doc,", f"where({mask},"),
                                                          "m.ncd")))

    got = disjuncts("x <= q and (q - x < 24 or x < 4)")
    # x - q <= 0 and (-x + q - 23 <= 0 or x - 3 <= 0)
    assert [[(c.col_coeff, c.row_coeff, c.rest) for c in conj] for conj in got] == \
        [[(1, -1, ()), (-1, 1, (("", -23),))], [(1, -1, ()), (1, 0, (("", -3),))]]
    assert len(disjuncts("(x < 3 or x > 9) and (q - x < 5 or q + x > 70)")) == 4
    assert disjuncts("x <= q or doc[b, q] == doc") is None
    # any whole key coefficient and floor steps (no loop formula renders them); != is < or >
    assert [[(c.col_coeff, c.col_step, c.row_coeff, c.row_step) for c in conj]
            for conj in disjuncts("2 * x <= q // 3 or x // 4 != q")] == [[(2, 1, -1, 3)], [(1, 4, -1, 1)], [(-1, 4, 1, 1)]]
    assert disjuncts("2 * x <= q and x > 0.5 * q") is None      # a fraction
    assert disjuncts("x + x // 4 <= q") is None                 # two terms of the key
    assert disjuncts("x * q <= 70") is None                     # no affine form
    # a not pushed in (masks.negate): StreamingLLM's mask written as what it drops
    assert disjuncts("x <= q and not (q - x >= 24 and x >= 4)") == got
    assert disjuncts("x <= q and not (sqrt(q - x) > 2.5)") is None  # NaN-prone: its not is no flip
    many = " or ".join(f"x == {i}" for i in range(masks.MAX_DISJUNCTS + 1))
    assert disjuncts(many) is None and len(disjuncts(many.rsplit(" or ", 1)[0])) == masks.MAX_DISJUNCTS
    assert disjuncts("x <= q and q - x < 24") is None  # a conjunction: no prepass, the loops' formula


def _or_of_cuts(rng):
    """A drawn or of one to four conjunctions of one to three cuts (key and
    row coefficients -3..3, steps 1, 2, 3 or 5, constant -30..60) and a
    Python predicate of (row position, key) that is exactly it."""
    from napkin.masks import Cut

    def cut():
        return Cut(rng.randint(-3, 3), rng.choice((1, 1, 2, 3, 5)), rng.randint(-3, 3), rng.choice((1, 1, 2, 3, 5)),
                   (("", rng.randint(-30, 60)),))

    disjuncts = tuple(tuple(cut() for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 4)))

    def keep(q, x):
        return any(all(c.col_coeff * (x // c.col_step) + c.row_coeff * (q // c.row_step) + c.rest[0][1] <= 0
                       for c in conj) for conj in disjuncts)
    return disjuncts, keep


def _spans_and_holes(live):
    """What the prepass writes for each row of a [blocks, blocks of the other
    wire] liveness matrix: the span of its live blocks and every dead run inside it."""
    from napkin.visits import dead_runs

    out = ([], [])
    for row in live:
        idx = row.nonzero().flatten().tolist()
        out[0].append((idx[0], idx[-1] + 1) if idx else (0, 0))
        out[1].append(dead_runs([(j, j + 1) for j in idx]))
    return tuple(map(tuple, out))


def test_an_or_of_cuts_is_counted_tile_by_tile(monkeypatch):
    """visits.prepass_visits / prepass_column_visits (the cost pass's blocks
    of an or of cuts) against every pair of drawn masks (_or_of_cuts),
    sizes, blocks and packed rows: a tile is live where some pair is, as the
    prepass tests it (_brute).  Chunks of 8 lines (rounded up to whole
    blocks) run many chunks a call."""
    import random

    from napkin import visits

    monkeypatch.setattr(visits, "_CHUNK", 8)
    rng = random.Random(45)
    for trial in range(300):
        disjuncts, keep = _or_of_cuts(rng)
        nq, nx = rng.randint(1, 70), rng.randint(1, 70)
        br, bc = rng.choice((1, 4, 8, 16)), rng.choice((1, 4, 8, 16))
        cycle = rng.choice((None, None, max(nq // rng.randint(1, 3), 1)))
        pred = torch.tensor([[keep(p if cycle is None else p % cycle, x) for x in range(nx)] for p in range(nq)])
        rows = visits.prepass_visits(disjuncts, nq, nx, br, bc, {}, cycle)
        assert rows == _spans_and_holes(_brute(pred, nq, nx, br, bc, False, False)[0]), (trial, disjuncts, cycle)
        if cycle is None:
            cols = visits.prepass_column_visits(disjuncts, nq, nx, br, bc, {})
            assert cols == _spans_and_holes(_brute(pred, nq, nx, br, bc, False, True)[0]), (trial, disjuncts)
