"""--docs: document masks priced on document lengths (napkin/documents.py).

A mask comparing ids at the query and the key has its blocks found at run
time (the ranges prepass) and its ring cut at run time (RingAttention reading
the ids).  Given the documents' lengths, napkin cost and napkin plan count
what those do.  Checked here against what runs, not against a second copy
of the arithmetic:

* the spans per row block (and per key block, dK/dV's) against the ranges
  prepass kernel's own output on ids built from the lengths, ragged sizes,
  several masks (documents alone, causal, a window, both ways) and blocks;
* the bytes the cost pass predicts on the documents against the bytes the
  kernels move (napkin.bytecount), forward, backward and a packed launch;
* a ring's meets against ring.id_meets on the same ids in every layout, and
  the steps napkin cost and napkin plan price against RingAttention.arms;
* the kept pairs napkin plan's compute uses, per device in every scheme's
  token layout (the positions distributed/layouts.py gives each rank),
  against a brute force; plan's zigzag ring cut by the documents against
  napkin cost's and RingAttention's steps;
* the option's refusals, with their exact words.
"""
from __future__ import annotations

import dataclasses
import random
from collections import defaultdict
from pathlib import Path

import pytest
import torch

import napkin
from napkin import documents as D
from napkin import visits
from napkin.bytecount import ByteCounter
from napkin.cost import analyse, from_json, with_blocks
from napkin.cost.masked import attention_plan as _plan
from napkin.cost.backward import backward_cost
from napkin.errors import NapkinError
from backward_helpers import compile_text
from cost_helpers import backward_bytes, doc_ids, full_lists, triton_transfers

REPO = Path(__file__).resolve().parent.parent
DOC = (REPO / "examples" / "document_mask.ncd").read_text()
SCORE = "where(doc[b, q] == doc,"
MASKS = {
    "documents": DOC,
    "causal": DOC.replace(SCORE, "where(x <= q and doc[b, q] == doc,"),
    "window": DOC.replace(SCORE, "where(x <= q and q - x < 24 and doc[b, q] == doc,"),
    "both_ways": DOC.replace(SCORE, "where(q - x < 20 and x - q < 20 and doc[b, q] == doc,"),
    # an or of two upper bounds beside the ids: one bound, x <= max(q, 39) (masks._union)
    "prefix": DOC.replace(SCORE, "where((x <= q or x < 40) and doc[b, q] == doc,"),
}
# a packed launch: 4 query heads of a key/value head beside 4 queries in one 16-row block
PACKED = """diagram packed_documents
wire b, hk, g, q, x
wire d = 32
in Q[b, (hk g), q, d] : fp16
in K[b, hk, x, d] : fp16
in V[b, hk, x, d] : fp16
in doc[b, x] : int32
S[b, hk, g, q, x] = where(x <= q and doc[b, q] == doc, sum[d](Q * K) * |d|^-0.5, -inf)
P[b, hk, g, q, x] = softmax[x](S)
O[b, (hk g), q, d] : fp16 = sum[x](P * V)
out O
schedule on h100 {
  accumulate fp32
  level hbm { hold Q, K, V, doc, O }
  level smem {
    group b by 1, hk by 1, g by 4, q by 4
    stream x by 16
    hold S, P
  }
}
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("documents")


def _random_docs(n: int, seed: int) -> D.Documents:
    """Fresh random lengths adding up to n: a few long, some of a token or two."""
    rnd = random.Random(seed)
    out, left = [], n
    while left:
        take = min(left, rnd.choice([1, 2, rnd.randint(3, 40), rnd.randint(1, n)]))
        out.append(take)
        left -= take
    return D.Documents(lengths=tuple(out)) if len(out) > 1 else D.Documents(every=n)


DOCS = [D.Documents(every=32), D.Documents(every=9), D.Documents(lengths=(50, 1, 30, 2)),
        _random_docs(83, 1), _random_docs(83, 2)]


# --------------------------------------------------------------------------
# The spans against the prepass.
# --------------------------------------------------------------------------

@pytest.mark.parametrize("mask", sorted(MASKS))
def test_spans_are_the_prepass_ranges(folder, mask):
    """row_visits = the prepass's [lo, hi) per row block and its lists of
    live blocks (contiguous documents: no dead run, the lists the span); column_spans = its [lo, hi) per key
    block when run by column (dK/dV's), on ragged sizes."""
    m = compile_text(MASKS[mask], f"documents_{mask}", folder)
    plan = _plan(napkin.load_text(MASKS[mask], "m.ncd"))
    n = 83
    for docs in DOCS:
        if docs.lengths and sum(docs.lengths) != n:
            docs = D.Documents(lengths=docs.lengths + (n - sum(docs.lengths),))
        doc = doc_ids(docs, n, rows=2)
        sz = {"b": 2, "h": 1, "q": n, "x": n, "d": 64}
        for br, bc in [(16, 16), (16, 32), (32, 8)]:
            spans, holes = D.row_visits(docs, tuple(plan.bounds), n, n, br, bc, sz, n)
            got, _ = m._document_mask_ranges(doc, sz, doc.device, br, bc, False, False, True)
            assert [tuple(r[:2]) for r in got[1].tolist()] == list(spans), (mask, docs, br, bc)
            assert list(holes) == [()] * len(spans)
            partial, full = got[1, :, 2], got[1, :, 3]   # each list's count
            assert (partial + full).tolist() == [hi - lo for lo, hi in spans], (mask, docs, br, bc)
            cols, _ = m._document_mask_ranges(doc, sz, doc.device, br, bc, True, True, True)
            assert [tuple(r[:2]) for r in cols[0].tolist()] == list(D.column_spans(spans, -(-n // bc))), \
                (mask, docs, br, bc)


@pytest.mark.parametrize("mask", sorted(MASKS))
def test_full_blocks_are_the_prepass_s(folder, mask):
    """row_full = the prepass's list of full blocks per row block, forward
    (a ragged block of rows may be full) and backward (whole rows: never),
    on random documents at ragged sizes: the blocks whose steps the cost
    pass counts without the ids' loads."""
    m = compile_text(MASKS[mask], f"documents_{mask}", folder)
    plan = _plan(napkin.load_text(MASKS[mask], "m.ncd"))
    n, seen = 83, 0
    for docs in DOCS:
        if docs.lengths and sum(docs.lengths) != n:
            docs = D.Documents(lengths=docs.lengths + (n - sum(docs.lengths),))
        doc = doc_ids(docs, n)
        sz = {"b": 1, "h": 1, "q": n, "x": n, "d": 64}
        for (br, bc), whole in [((16, 16), False), ((16, 8), True), ((32, 8), False), ((32, 16), True)]:
            got, _ = m._document_mask_ranges(doc, sz, doc.device, br, bc, whole, False, True)
            runs = D.row_full(docs, tuple(plan.bounds), n, n, br, bc, sz, n, whole_rows=whole)
            want = [tuple(j for a, z in r for j in range(a, z)) for r in runs]
            assert full_lists(got[0], -(-n // bc)) == want, (mask, docs, br, bc, whole)
            seen += sum(map(len, want))
    assert seen > 0


@pytest.mark.parametrize("score, exact", [("x < q", True), ("x > q and x - q < 5", True), ("2 * x <= q", False)])
def test_spans_where_rows_keep_nothing_or_a_conjunct_bounds_no_loop(folder, score, exact):
    """Rows that keep nothing (a document's first row under x < q, its last
    under x > q) leave the spans exact.  A conjunct the kernels' loops cannot
    read as a bound (2 * x <= q: x's coefficient is 2) is not counted: the
    prepass evaluates it and finds fewer blocks, inside the spans."""
    text = DOC.replace(SCORE, f"where({score} and doc[b, q] == doc,")
    m = compile_text(text, f"documents_keep_{len(score)}", folder)
    plan = _plan(napkin.load_text(text, "m.ncd"))
    n, sz, differ = 83, {"b": 1, "h": 1, "q": 83, "x": 83, "d": 64}, 0
    for docs in (D.Documents(every=9), D.Documents(lengths=(50, 1, 30, 2)), _random_docs(n, 1)):
        doc = doc_ids(docs, n)
        for br, bc in [(16, 16), (32, 8)]:
            spans = D.row_spans(docs, tuple(plan.bounds), n, n, br, bc, sz, n)
            got, _ = m._document_mask_ranges(doc, sz, doc.device, br, bc, False, False, True)
            found = [tuple(r[:2]) for r in got[0].tolist()]
            assert all(a == b or (a[0] == a[1] or b[0] <= a[0] <= a[1] <= b[1]) for a, b in zip(found, spans))
            differ += found != list(spans)
    assert (differ == 0) == exact, differ


def test_dead_runs_between_runs_of_blocks():
    """Every run of blocks no run holds, in order, runs sorted by first and
    overlapping or touching ones joined: what the prepass's lists leave out."""
    assert visits.dead_runs([]) == ()
    assert visits.dead_runs([(2, 5)]) == ()
    assert visits.dead_runs([(0, 1), (1, 3), (3, 4)]) == ()
    assert visits.dead_runs([(0, 1), (4, 6), (5, 7), (9, 10)]) == ((1, 4), (7, 9))
    assert visits.dead_runs([(0, 8), (2, 3), (10, 11), (12, 15)]) == ((8, 10), (11, 12))  # (2, 3) inside (0, 8)
    assert visits.dead_runs([(0, 1), (3, 4), (6, 7)]) == ((1, 3), (4, 6))


def test_column_spans_of_spans_with_gaps():
    """column_spans takes the first and last row block holding each key block,
    whatever order the spans come in; a key block no row block holds is (0, 0)."""
    spans = ((2, 4), (0, 1), (0, 0), (3, 6), (1, 2))
    want = []
    for j in range(7):
        rows = [i for i, (a, b) in enumerate(spans) if a <= j < b]
        want.append((rows[0], rows[-1] + 1) if rows else (0, 0))
    assert D.column_spans(spans, 7) == tuple(want)


# --------------------------------------------------------------------------
# The bytes against what the kernels move.
# --------------------------------------------------------------------------

def _predicted(report) -> tuple[dict, dict]:
    """A report's bytes per tensor, the prepass's buffers among them, its lists (torch's) apart."""
    loads, stores = defaultdict(int), defaultdict(int)
    for t in triton_transfers(report):
        (loads if t.direction == "load" else stores)[t.tensor] += t.bytes
    return dict(loads), dict(stores)


@pytest.mark.parametrize("mask", ["documents", "causal", "both_ways", "prefix"])
def test_predicted_bytes_are_the_bytes_moved(folder, mask):
    """The forward at given blocks, and the backward's three kernels (the
    training forward too), on documents that are not the blocks' multiples."""
    text = MASKS[mask]
    m = compile_text(text, f"documents_{mask}", folder)
    d = napkin.load_text(text, "m.ncd")
    n, docs = 90, D.Documents(lengths=(37, 5, 48))
    sizes = {"b": 1, "h": 2, "q": n, "x": n}
    q, k, v, _ = m.example_inputs(sizes, dtype=torch.float16, seed=3)
    inputs = (q, k, v, doc_ids(docs, n))
    blocks = {"q": 32, "x": 16}
    with ByteCounter(tensors=dict(zip(m.INPUTS, inputs))) as bc:
        m.document_mask(*inputs, block_q=32, block_x=16)
    assert (dict(bc.loads), dict(bc.stores)) == \
        _predicted(analyse(with_blocks(d, blocks), sizes, docs=docs))
    # every block would load K 3 x 6 times a head: these documents leave fewer
    dense = _predicted(analyse(with_blocks(d, blocks), sizes))[0]["K"]
    assert bc.loads["K"] < dense

    back = backward_cost(with_blocks(d, blocks), sizes, given=True, docs=docs)
    options = tuple({"block_q": 32, "block_x": 16}.get(o) for o in m._OPTIONS)
    with ByteCounter(tensors=dict(zip(m.INPUTS, inputs))) as bc:
        outs, saved = m._document_mask_forward(*inputs, *options, True)
    assert (dict(bc.loads), dict(bc.stores)) == _predicted(back.forward)
    grads = [torch.randn(o.shape, generator=torch.Generator().manual_seed(0)).to(o.dtype) for o in outs]
    with ByteCounter(tensors=dict(zip(m.INPUTS, inputs))) as bc:
        m._document_mask_grads(inputs, (*outs, *saved), grads, options, None)
    assert (dict(bc.loads), dict(bc.stores)) == \
        (dict(backward_bytes(back, "load")), dict(backward_bytes(back, "store")))


def test_packed_rows_on_documents(folder):
    """A packed launch (4 heads x 4 queries a block): each block of (g, q)
    rows is live where some row's document meets the key block."""
    m = compile_text(PACKED, "documents_packed", folder)
    d = napkin.load_text(PACKED, "p.ncd")
    n, docs = 45, D.Documents(lengths=(7, 20, 1, 17))
    sizes = {"b": 1, "hk": 2, "g": 4, "q": n, "x": n}
    q, k, v, _ = m.example_inputs(sizes, dtype=torch.float16, seed=4)
    inputs = (q, k, v, doc_ids(docs, n))
    with ByteCounter(tensors=dict(zip(m.INPUTS, inputs))) as bc:
        m.packed_documents(*inputs)
    report = analyse(d, sizes, docs=docs)
    loads, stores = _predicted(report)
    # the packed rows' positions (int64, one per (g, q)): the prepass's scan reads them too, counted
    assert (dict(bc.loads), dict(bc.stores)) == (loads, stores)
    assert _predicted(report)[0]["K"] < _predicted(analyse(d, sizes))[0]["K"]


def test_chunks_of_packed_rows_on_documents(folder):
    """flash_decoding's chunked launch (chunks of 32 keys, 4 heads x 4
    queries a block) with a causal document mask: each chunk visits its own
    part of the spans, and the merge reads every chunk's state.  A block's
    queries may sit in two documents apart: the kernels step over the dead
    key blocks between (row_visits' holes; counted, K and V match)."""
    text = (REPO / "examples" / "flash_decoding.ncd").read_text()
    for old, new in [("in V[b, hk, x, d] : bf16", "in V[b, hk, x, d] : bf16\nin doc[b, x] : int32"),
                     ("where(x <= q + |x| - |q|,", "where(x <= q + |x| - |q| and doc[b, q] == doc,"),
                     ("hold Q, K, V, O, lse", "hold Q, K, V, doc, O, lse"), ("group x by 1024", "group x by 32"),
                     ("stream x by 64", "stream x by 16"), ("wire d = 128", "wire d = 32")]:
        assert old in text
        text = text.replace(old, new)
    m = compile_text(text, "documents_chunks", folder)
    d = napkin.load_text(text, "c.ncd")
    n, docs = 70, D.Documents(lengths=(37, 5, 28))
    sizes = {"b": 1, "hk": 2, "g": 4, "q": n, "x": n}
    q, k, v, _ = m.example_inputs(sizes, dtype=torch.float16, seed=5)
    inputs = (q, k, v, doc_ids(docs, n))
    with ByteCounter(tensors=dict(zip(m.INPUTS, inputs))) as bc:
        m.flash_decoding(*inputs)
    loads, stores = _predicted(analyse(d, sizes, docs=docs))
    assert loads["K"] < _predicted(analyse(d, sizes))[0]["K"]
    # the positions of the packed rows, the prepass's reads among them
    assert (dict(bc.loads), dict(bc.stores)) == (loads, stores)


# --------------------------------------------------------------------------
# The ring.
# --------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["contiguous", "zigzag", "cyclic"])
def test_ring_meets_are_id_meets(kind):
    """ring_meets on lengths = ring.id_meets on the ids they make = whether
    the units' positions share a document, counted one by one, every pair
    of units (a contiguous or zigzag layout's chunks, cyclic's ranks),
    ragged lengths, rings of 2 to 8, one batch row and two."""
    from napkin.distributed.layouts import TokenLayout
    from napkin.distributed.reach import SameIds
    from napkin.distributed.ring import _units, id_meets

    for seed, (parts, n) in enumerate([(2, 37), (3, 100), (4, 64), (8, 203)]):
        for docs in (_random_docs(n, seed), D.Documents(every=5), D.Documents(every=n)):
            lay = TokenLayout(kind, parts, n)
            units = [u.tolist() for u in _units(lay)]
            assert sorted(p for u in units for p in u) == list(range(n))
            ids = doc_ids(docs, n)
            doc = ids[0].tolist()
            brute = [[bool({doc[p] for p in a} & {doc[p] for p in b}) for b in units] for a in units]
            got = D.ring_meets(docs, kind, parts, n, n, n)
            want = id_meets((SameIds("doc", 1, ("b",)),), {"doc": ids}, lay, lay)
            pairs = range(len(units))
            assert [[got(a, b) for b in pairs] for a in pairs] == brute, (kind, parts, docs)
            assert [[want(a, b) for b in pairs] for a in pairs] == brute, (kind, parts, docs)
            # a second batch row of other documents: a pair meets where either row's ids meet
            other = torch.flip(ids, [1])
            rows = id_meets((SameIds("doc", 1, ("b",)),), {"doc": torch.cat([ids, other])}, lay, lay)
            back = other[0].tolist()
            flipped = [[bool({back[p] for p in a} & {back[p] for p in b}) for b in units] for a in units]
            assert [[rows(a, b) for b in pairs] for a in pairs] == \
                [[x or y for x, y in zip(r, f)] for r, f in zip(brute, flipped)], (kind, parts, docs)
            # chunks: the key chunks each chunk meets as one run (what reach marks at once)
            for a in (pairs if kind != "cyclic" else ()):
                met = [b for b in pairs if brute[a][b]]
                assert got.run(a) == ((met[0], met[-1]) if met else None), (parts, docs, a)
                assert met == list(range(met[0], met[-1] + 1)) if met else True
            assert (got.run is None) == (kind == "cyclic")


RING = (REPO / "examples" / "document_ring.ncd").read_text()


@pytest.mark.parametrize("score", ["x <= q and doc[b, q] == doc", "doc[b, q] == doc"])
def test_cost_and_plan_run_the_steps_ring_attention_runs(score):
    """The steps napkin cost and napkin plan price on documents are the ones
    RingAttention runs on the same ids (both ways round without causality)."""
    from napkin.distributed.ring import RingAttention
    from napkin.plan import emit, plan
    from napkin.printer import to_text

    text = RING.replace("x <= q and doc[b, q] == doc", score)
    text = text.replace("across 4", "across 8")
    d = napkin.load_text(text, "r.ncd")
    ring = RingAttention(d)
    n = 8000
    sizes = {"b": 1, "h": 2, "q": n, "x": n}
    seen = set()
    for docs in (D.Documents(every=1000), D.Documents(every=1500), D.Documents(lengths=(900, 3000, 2100, 2000)),
                 D.Documents(every=n), _random_docs(n, 7)):
        back, ahead = ring.arms(8, n, n, side={"doc": doc_ids(docs, n)})
        report = analyse(d, sizes, docs=docs)
        comm = report.devices
        assert ((comm.ring_steps or 8), comm.ring_ahead) == (back + ahead, ahead)
        assert comm.ring_documents == docs.describe(n) and from_json(report.to_json()) == report
        cut = [o for o in plan(d, 8, sizes, docs=docs) if o.layout == "contiguous"]
        assert [o.arms for o in cut] == ([(back, ahead)] * 2 if back + ahead < 8 else [])
        seen.add((back, ahead))
    # a ring that names no layout runs zigzag, and the cost pass says so on documents
    zigzag = napkin.load_text(text.replace("across 8 contiguous", "across 8"), "z.ncd")
    for docs in (D.Documents(every=500), D.Documents(every=1000), _random_docs(n, 7)):
        steps = RingAttention(zigzag).arms(8, n, n, side={"doc": doc_ids(docs, n)})
        comm = analyse(zigzag, sizes, docs=docs).devices
        assert (comm.layout, comm.ring_steps or 8) == ("zigzag", sum(steps))
        # plan's Ring (zigzag: the layout it emits no word for) runs those steps too, and napkin
        # cost prices the diagram it emits as plan did
        options = [o for o in plan(zigzag, 8, sizes, docs=docs) if o.scheme in ("ring", "burst")]
        rings = [o for o in options if not o.layout]
        assert [o.arms for o in rings] == [steps if sum(steps) < 8 else None] * 2, docs
        # and every ring it offers, the cyclic one too, is priced by napkin cost as plan did
        assert {o.layout for o in options} >= {None, "cyclic"}
        for o in options:
            comm = analyse(napkin.load_text(to_text(emit(zigzag, o)), "e.ncd"), sizes, docs=docs).devices
            back = comm.burst_backward_time_s if o.scheme == "burst" else comm.backward_time_s
            assert comm.time_s + back == pytest.approx(o.comm_s, rel=1e-9), (o.label, docs)
    # the documents make the ring run different steps (both ways round without causality)
    assert len(seen) >= 4 and any(a for _, a in seen) == ("x <= q" not in score)


# --------------------------------------------------------------------------
# The pairs napkin plan's compute counts.
# --------------------------------------------------------------------------

def _kept(mask: str, docs: D.Documents, n: int) -> torch.Tensor:
    """[n, n] bool: the pairs MASKS[mask] keeps on these documents, evaluated pair by pair."""
    ids, pos = doc_ids(docs, n)[0], torch.arange(n)
    q, x = pos[:, None], pos[None, :]
    affine = {"documents": torch.ones(n, n, dtype=torch.bool), "causal": x <= q,
              "window": (x <= q) & (q - x < 24), "both_ways": (q - x < 20) & (x - q < 20),
              "prefix": (x <= q) | (x < 40)}[mask]
    return (ids[:, None] == ids[None, :]) & affine


@pytest.mark.parametrize("mask", sorted(MASKS))
def test_kept_pairs_are_counted_pairs(mask):
    from napkin.distributed.reach import mask_bounds
    from napkin.distributed.reading import roles

    text = MASKS[mask].replace("  level hbm", "  level devices { group q across 2\n    stream x across 2 }\n"
                                              "  level hbm", 1)
    r = roles(napkin.load_text(text, "m.ncd"))
    for n in (1, 77, 130):
        for docs in (_random_docs(n, n), D.Documents(every=16)):
            sizes = {"b": 1, "h": 1, "q": n, "x": n, "d": 64}
            got = D.ShardPairs.on_documents(docs, mask_bounds(r), n, n, sizes, n).total
            assert got == int(_kept(mask, docs, n).sum()), (mask, n, docs)


# --------------------------------------------------------------------------
# The option's words.
# --------------------------------------------------------------------------

def test_documents_parse_and_describe():
    assert D.Documents.parse("512") == D.Documents(every=512)
    assert D.Documents.parse("3, 4,5") == D.Documents(lengths=(3, 4, 5))
    assert D.Documents(every=512).describe(8192) == "16 documents of 512 tokens"
    assert D.Documents(every=500).describe(1200) == "3 documents of 500 tokens, the last of 200"
    assert D.Documents(every=4096).describe(100) == "1 document of 100 tokens"
    assert D.Documents(lengths=tuple(range(1, 9))).describe(36) == "8 documents of 1, 2, 3, 4, 5, 6, ... tokens"
    assert D.Documents(every=3).starts(7) == [0, 3, 6, 7]
    for bad in ("0", "x", "3,,4", "-2", ""):
        with pytest.raises(NapkinError) as err:
            D.Documents.parse(bad)
        item = bad if bad in ("0", "x", "-2") else ""
        assert str(err.value) == (f"napkin: --docs: {item!r} is not a positive whole number of tokens (give a length, 512, "
                                  "or the lengths in order, 1000,3000,4192)")


@pytest.mark.parametrize("args, message", [
    (["examples/document_mask.ncd", "-D", "b=1", "-D", "h=2", "-D", "q=300", "-D", "x=300", "--docs", "100,100"],
     "--docs: the lengths add up to 200 tokens, but the ids cover |x| = 300"),
    (["examples/document_mask.ncd", "--docs", "64"],
     "--docs counts blocks at given sizes: give b, h, q, x too (--size WIRE=N)"),
    (["examples/causal.ncd", "-D", "b=1", "-D", "h=2", "-D", "q=300", "-D", "x=300", "--docs", "64"],
     "--docs: document lengths change nothing napkin prices for diagram causal: its mask has no conjunct "
     "comparing ids at the query and the key (doc[b, q] == doc)"),
    (["examples/document_mask.ncd", "-D", "b=1", "-D", "h=2", "-D", "q=300", "-D", "x=300", "--docs", "64",
      "--dtypes", "fp32"], "--docs prices the schedule or a tile search; --dtypes prints another report"),
])
def test_cost_refuses_documents_it_cannot_use(capsys, args, message):
    from napkin.cli import main

    import os
    here = os.getcwd()
    os.chdir(REPO)
    try:
        assert main(["cost", *args]) == 1
    finally:
        os.chdir(here)
    assert capsys.readouterr().err.strip() == f"{args[0]}: {message}"


def test_attention2d_prices_no_documents(tmp_path):
    """ATTENTION2D's devices run their whole blocks: --docs would change nothing, and says why."""
    text = RING.replace("    group q across 4\n    stream x across 4 contiguous", "    group q across 2, x across 2")
    d = napkin.load_text(text, "a2d.ncd")
    with pytest.raises(NapkinError) as err:
        analyse(d, {"b": 1, "h": 2, "q": 256, "x": 256}, docs=D.Documents(every=64))
    assert str(err.value) == ("napkin: --docs: document lengths change nothing napkin prices for diagram "
                              "document_ring: ATTENTION2D's devices compute their whole blocks, whatever the ids")


def test_cost_note_and_counts_on_documents():
    """16 documents of 512 over 8192 tokens: each row block of 128 keeps the
    8 key blocks of its document, 1024 programs x 8 steps; the note says so."""
    d = napkin.load(REPO / "examples" / "document_mask.ncd")
    sizes = {"b": 1, "h": 16, "q": 8192, "x": 8192}
    report = analyse(d, sizes, docs=D.Documents(every=512))
    dense = analyse(d, sizes)
    k = {t.tensor: t.bytes for t in report.transfers if t.direction == "load"}["K"]
    k_dense = {t.tensor: t.bytes for t in dense.transfers if t.direction == "load"}["K"]
    assert (k, k_dense) == (16 * 64 * 8 * 64 * 64 * 2, 16 * 64 * 128 * 64 * 64 * 2)
    assert any(n.startswith("the counts are the blocks the ranges prepass finds live when doc holds --docs' 16 "
                            "documents of 512 tokens in every batch row") for n in report.notes)
    assert report.roofline.estimate_s < dense.roofline.estimate_s / 4


def test_report_and_render_count_on_documents(tmp_path, capsys):
    """napkin report and napkin render take --docs as napkin cost does: the
    report's note and transfers are the documents', the picture's edges too."""
    from napkin.cli import main

    path = str(REPO / "examples" / "document_mask.ncd")
    sizes = ["-D", "b=1", "-D", "h=16", "-D", "q=8192", "-D", "x=8192"]
    assert main(["report", path, *sizes, "--docs", "512", "-o", str(tmp_path / "docs.html")]) == 0
    assert main(["report", path, *sizes, "-o", str(tmp_path / "dense.html")]) == 0
    docs, dense = ((tmp_path / f"{n}.html").read_text() for n in ("docs", "dense"))
    assert "16 documents of 512 tokens" in docs and "documents of" not in dense
    k_row = '<td>K</td><td>load</td><td>fp16</td><td><code>b*d*h*q*x/g_q</code></td><td class="num">{}</td>'
    assert k_row.format("33.6M") in docs and k_row.format("537M") in dense
    assert main(["render", path, *sizes, "--docs", "512", "-o", str(tmp_path / "p.dot")]) == 0
    assert main(["render", path, *sizes, "-o", str(tmp_path / "q.dot")]) == 0
    assert (tmp_path / "p.dot").read_text() != (tmp_path / "q.dot").read_text()
    capsys.readouterr()
    assert main(["render", path, "--docs", "512", "--no-costs", "-o", str(tmp_path / "r.dot")]) == 1
    assert capsys.readouterr().err.strip() == \
        "napkin: --docs prices the byte counts on the edges, which --no-costs leaves off: give one"


def _shard_pairs(keep: torch.Tensor, rows: list, cols: list) -> list[list[int]]:
    """W[a][b]: the pairs ``keep`` holds between positions rows[a] and cols[b]."""
    return [[int(keep[r][:, c].sum()) for c in cols] for r in rows]


@pytest.mark.parametrize("mask", sorted(MASKS))
def test_shard_pairs_are_counted_pairs(mask):
    """ShardPairs' busiest device of each scheme = the most pairs the whole
    mask keeps between the positions distributed/layouts.py gives a device
    (ragged shards): each ring step in the contiguous, zigzag and cyclic
    layouts and each step of a double ring (the blocks groups.ring_origin
    says a rank holds), ATTENTION2D's grid rows and columns of cyclic parts,
    the tree's contiguous keys."""
    from napkin.distributed.groups import ring_origin
    from napkin.distributed.layouts import TokenLayout
    from napkin.distributed.reach import mask_bounds
    from napkin.distributed.reading import roles

    text = MASKS[mask].replace("  level hbm", "  level devices { group q across 2\n    stream x across 2 }\n"
                                              "  level hbm", 1)
    r = roles(napkin.load_text(text, "m.ncd"))
    n = 101

    def parts(kind, p):
        return [pos[pos < n] for pos in (TokenLayout(kind, p, n).positions(a) for a in range(p))]
    for docs in (_random_docs(n, 3), D.Documents(every=30)):
        keep = _kept(mask, docs, n)
        got = D.ShardPairs.on_documents(docs, mask_bounds(r), n, n, {"q": n, "x": n}, n)
        assert got.total == int(keep.sum())
        for kind in ("contiguous", "zigzag", "cyclic"):
            for p in (1, 3, 4, 7):
                w = _shard_pairs(keep, parts(kind, p), parts(kind, p))
                assert got.ring_steps(kind, p) == tuple(max(w[a][(a - s) % p] for a in range(p)) for s in range(p)), \
                    (mask, docs, kind, p)
        for p, nodes in ((4, 1), (4, 2), (6, 3), (6, 2), (8, 4)):
            w = _shard_pairs(keep, parts("zigzag", p), parts("zigzag", p))
            assert got.ring_steps("zigzag", p, nodes) == tuple(
                max(w[a][ring_origin(a, s, nodes, p // nodes)] for a in range(p)) for s in range(p)), (p, nodes)
            # BurstAttention's backward: rank b's keys against the query blocks of origin(b, s)
            assert got.ring_steps("zigzag", p, nodes, queries=True) == tuple(
                max(w[ring_origin(b, s, nodes, p // nodes)][b] for b in range(p)) for s in range(p)), (p, nodes)
        for rows, cols in ((1, 4), (2, 2), (3, 2), (2, 3)):
            cyc = parts("cyclic", rows * cols)
            mine = [torch.cat([cyc[i * cols + j] for j in range(cols)]) for i in range(rows)]
            theirs = [torch.cat([cyc[i * cols + j] for i in range(rows)]) for j in range(cols)]
            assert got.grid_busiest(rows, cols) == max(map(max, _shard_pairs(keep, mine, theirs))), (rows, cols)
        for p in (1, 2, 5):
            assert got.tree_busiest(p) == max(_shard_pairs(keep, [torch.arange(n)], parts("contiguous", p))[0])


def test_plan_prices_each_scheme_at_its_busiest_device():
    """Each scheme's steps wait for their busiest device.  Documents that fill
    every shard alike price as the even split did; one long document (30,000
    of 65,536 tokens over 8) loads some ranks of both rings, contiguous and
    zigzag, at some step, where ATTENTION2D's cyclic parts share it out: the
    grid now ranks first, where the even split put Ring there."""
    from napkin.cost import collectives as C
    from napkin.plan import Pricing, placements, plan

    d = napkin.load(REPO / "examples" / "document_ring.ncd")
    sizes = {"b": 1, "h": 16, "q": 65536, "x": 65536}
    candidates = placements(8, 8, True)
    rings = [pl for pl in candidates if pl.scheme in ("ring", "burst")]
    even = Pricing.of(d, 8, sizes, None, True, D.Documents(every=4096))
    assert sum(even.arms) == sum(even.zigzag_arms) == 1
    flat = dataclasses.replace(even, kept=None)
    for pl in rings:
        assert even.option(pl, 8, "contiguous") == flat.option(pl, 8, "contiguous")
    docs = D.Documents(lengths=(9000, 30000, 2000, 24536))
    skewed = Pricing.of(d, 8, sizes, None, True, docs)
    flat = dataclasses.replace(skewed, kept=None)
    per_device = skewed.kept.total / 8
    for pl in candidates:
        for layout in (None, "contiguous", "cyclic") if pl.scheme in ("ring", "burst") else (None,):
            steps = skewed.kept.ring_steps(layout or "zigzag", 8)
            busiest = sum(steps[:skewed.arms[0]]) if layout == "contiguous" else sum(steps) \
                if pl.scheme in C.RINGS else skewed.kept.grid_busiest(*pl.grid)
            assert skewed.option(pl, 8, layout).compute_s == pytest.approx(
                flat.option(pl, 8, layout).compute_s * busiest / per_device), (pl, layout)
            # the zigzag and contiguous rings' busiest steps hold over 2x the mean, the cyclic
            # ring's and the grids' within 0.1% of it
            assert busiest / per_device > 2 if layout != "cyclic" and pl.scheme in C.RINGS \
                else busiest / per_device < 1.001, (pl, layout)
    # a double ring of 2 nodes x 4 works through its blocks in rounds, each step at its busiest rank
    for pl in placements(8, 4, True):
        if pl.scheme in ("ring2", "burst2"):
            busiest = sum(skewed.kept.ring_steps("zigzag", 8, 2))
            assert busiest / per_device > 2
            assert skewed.option(pl, 4).compute_s == pytest.approx(flat.option(pl, 4).compute_s * busiest / per_device)
    ranked = [o.label for o in plan(d, 8, sizes, docs=docs)]
    assert ranked[:3] == ["Ring + BurstAttention backward of 8 over cyclic shards", "Ring of 8 over cyclic shards",
                          "ATTENTION2D 2x4"]
    assert ranked.index("Ring of 8 over contiguous shards, 4 of 8 steps") < ranked.index("Ring of 8")
    evenly = [flat.option(pl, 8) for pl in candidates if pl.scheme in ("ring", "attention2d")]
    assert min(evenly, key=lambda o: o.total_s).scheme == "ring"


def test_tile_work_counts_tiles_one_by_one():
    """bench/tile_work.py (the pairs a kernel computes, tile by tile, beside
    the pairs kept) against a count of every pair and every tile, for rings
    in the three layouts and every ATTENTION2D grid, causal documents of
    fresh random lengths, ragged tiles; its kept pairs are ShardPairs'."""
    import numpy as np

    from bench import tile_work as T
    from napkin.distributed.layouts import TokenLayout

    def brute(rows, keys, lo, hi, bq, bx):
        keep = (keys[None, :] >= lo[rows][:, None]) & (keys[None, :] < hi[rows][:, None])
        nq, nk = -(-len(rows) // bq), -(-len(keys) // bx)
        pad = np.zeros((nq * bq, nk * bx), dtype=bool)
        pad[:len(rows), :len(keys)] = keep
        live = pad.reshape(nq, bq, nk, bx).any(axis=(1, 3))
        real = np.zeros_like(pad)
        real[:len(rows), :len(keys)] = True
        return int(keep.sum()), int((np.repeat(np.repeat(live, bq, 0), bx, 1) & real).sum())

    for seed, (n, parts, bq, bx) in enumerate([(203, 4, 8, 4), (97, 3, 4, 8), (64, 2, 16, 16)]):
        docs = _random_docs(n, seed + 11)
        lengths = list(docs.lengths) if docs.lengths else [n]
        lo, hi = T.causal_documents(lengths)
        pairs = D.ShardPairs(n, n, [(lo, hi)])
        for kind in T.LAYOUTS:
            lay = TokenLayout(kind, parts, n)
            pos = [p[p < n].numpy() for p in (lay.positions(d) for d in range(parts))]
            want = np.array([[brute(r, k, lo, hi, bq, bx) for k in pos] for r in pos]).sum(1)
            kept, computed = T.device_work(lo, hi, kind, parts, bq, bx)
            assert kept.tolist() == want[:, 0].tolist() == pairs.part_pairs(kind, parts).sum(1).tolist()
            assert computed.tolist() == want[:, 1].tolist(), (kind, n, parts)
            assert (computed >= kept).all()
        for r in (1, parts):
            c = parts // r
            t = np.arange(n)
            want = [brute(t[(t % parts) // c == i], t[t % c == j], lo, hi, bq, bx) for i in range(r) for j in range(c)]
            kept, computed = T.grid_work(lo, hi, r, c, bq, bx)
            assert kept.tolist() == [k for k, _ in want] == pairs.grid_pairs(r, c).ravel().tolist()
            assert computed.tolist() == [w for _, w in want]


def test_counting_ends_below_edges_either_way_round_is_searchsorted():
    """ShardPairs._below counts a rank's row ends below each edge searching whichever of the two
    is shorter among the other (plan at 8192 ranks: 128 ends, 16K edges); both ways are
    np.searchsorted(ends, edges), ties and repeats included."""
    import numpy as np

    rng = np.random.default_rng(7)
    for _ in range(500):
        ends = np.sort(rng.integers(0, 60, rng.integers(0, 40)))
        edges = np.sort(rng.integers(0, 70, rng.integers(1, 40)))
        want = np.searchsorted(ends, edges, side="left")
        assert (D._below_each(np, ends, edges) == want).all(), (ends, edges)
