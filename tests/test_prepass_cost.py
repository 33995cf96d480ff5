"""The ranges prepass's own traffic in the cost pass (napkin/cost/prepass.py).

A launch whose mask reads data runs the prepass (scan, merge, torch's lists)
before its kernel, and the kernel reads the record.  The cost pass counts
each step as a kernel of its own; these tests hold its counts to what the
generated prepass moves (ByteCounter, under TRITON_INTERPRET=1) and to the
buffers the launcher returns, on the bundled document mask at ragged sizes,
and its full blocks (whose steps read no ids) to the prepass's own lists.
The suites that compare whole launches (test_bytecount, test_documents,
test_ranges, test_cost_lengths) hold the same buffers within the launch.
"""
from __future__ import annotations

import math
from collections import defaultdict

import pytest
import torch

import generated.document_mask as m
import generated.streaming_llm as sllm
import napkin
from backward_helpers import compile_text
from cost_helpers import GQA_DOC, REPO, backward_bytes, doc_ids, full_lists, load, run_cli, triton_transfers
from napkin import documents as D
from napkin import visits
from napkin.bytecount import ByteCounter
from napkin.codegen.ranges import index_disjuncts
from napkin.cost import analyse, with_blocks
from napkin.cost import prepass as P
from napkin.cost.backward import backward_cost
from napkin.cost.masked import attention_plan
from napkin.cost.report import format_text, from_json

DOCS = D.Documents(lengths=(37, 5, 108))
N, BLOCKS = 150, {"q": 32, "x": 16}
SIZES = {"b": 2, "h": 3, "q": N, "x": N}


def _ids() -> torch.Tensor:
    return doc_ids(DOCS, N, SIZES["b"])


def _prepass_alone(whole_rows: bool, by_col: bool):
    """The module's prepass launcher at blocks 32 x 16, counted: (loads, stores, record)."""
    doc = _ids()
    sz = {**SIZES, "d": 64}
    with ByteCounter(tensors={"doc": doc}) as bc:
        record, on = m._document_mask_ranges(doc, sz, doc.device, 32, 16, whole_rows, by_col, True)
    assert on and bc.launches == 2   # the scan and the merge; the lists are torch's
    return dict(bc.loads), dict(bc.stores), record


def _by_tensor(rows) -> tuple[dict, dict]:
    out = defaultdict(int), defaultdict(int)
    for tensor, direction, nbytes in rows:
        out[direction != "load"][tensor] += nbytes
    return dict(out[0]), dict(out[1])


def test_the_forward_prepass_is_counted_as_it_runs():
    """The scan's loads of the ids (a row block's once a chunk, the keys' every
    step) and its stores, the merge's: the report's prepass kernels, byte for
    byte; the lists' record the size of the launcher's, 2 S + 4 int32 a block."""
    report = analyse(with_blocks(load("document_mask"), BLOCKS), SIZES, docs=DOCS)
    steps = {k.index: k.prepass_step for k in report.kernels if k.prepass_of == 0}
    assert sorted(steps.values()) == sorted(P.STEPS)
    loads, stores, record = _prepass_alone(False, False)
    counted = _by_tensor((t.tensor, t.direction, t.bytes) for t in report.transfers
                         if steps.get(t.kernel) in ("scan", "merge"))
    assert counted == (loads, stores)
    lists = {(t.tensor, t.direction): t for t in report.transfers if steps.get(t.kernel) == "lists"}
    assert lists[("_ranges", "store")].elements == record.numel()
    row_blocks, key_blocks = math.ceil(N / 32), math.ceil(N / 16)
    assert record.shape == (SIZES["b"], row_blocks, 2 * key_blocks + 4)
    assert lists[("_tiles", "load")].elements == 2 * SIZES["b"] * row_blocks * key_blocks
    # the ids scanned once per batch row (doc[b, q] reads no h): three heads share the scan
    assert {t.tensor for t in report.transfers if steps.get(t.kernel) == "scan" and t.direction == "load"} == {"doc"}


@pytest.mark.parametrize("role, whole_rows, by_col", [("dq", True, False), ("dkdv", True, True)])
def test_the_backward_prepasses_are_counted_as_they_run(role, whole_rows, by_col):
    """dQ's prepass (by row, whole rows) and dK/dV's (by column): each the
    backward cost's own three kernels, the scan and merge byte for byte."""
    back = backward_cost(with_blocks(load("document_mask"), BLOCKS), SIZES, given=True, docs=DOCS)
    assert [k for k in back.kernels if k.startswith(role + " prepass")] == \
        [f"{role} prepass {s}" for s in P.STEPS]
    loads, stores, record = _prepass_alone(whole_rows, by_col)
    counted = _by_tensor((mv.tensor, mv.direction, mv.bytes) for mv in back.moves
                         if mv.kernel in (f"{role} prepass scan", f"{role} prepass merge"))
    assert counted == (loads, stores)
    listed = {(mv.tensor, mv.direction): mv.elements for mv in back.moves if mv.kernel == f"{role} prepass lists"}
    assert listed[("_ranges", "store")] == record.numel()


def test_a_warm_mask_cache_runs_no_prepass():
    """mask_cache= kept from an earlier call: the launch runs the main kernel
    alone, which reads its record, and analyse(mask_cache=True) counts that
    launch (every tensor but the ids, which a full block's step does not read)."""
    doc = _ids()
    q, k, v, _ = m.example_inputs(SIZES, dtype=torch.float16, seed=7)
    cache: dict = {}
    m.document_mask(q, k, v, doc, block_q=32, block_x=16, mask_cache=cache)
    with ByteCounter(tensors={"Q": q, "K": k, "V": v, "doc": doc}) as bc:
        m.document_mask(q, k, v, doc, block_q=32, block_x=16, mask_cache=cache)
    assert bc.launches == 1
    kept = analyse(with_blocks(load("document_mask"), BLOCKS), SIZES, docs=DOCS, mask_cache=True)
    assert all(k.prepass_of is None for k in kept.kernels)
    counted = _by_tensor((t.tensor, t.direction, t.bytes) for t in kept.transfers if t.tensor != "doc")
    assert counted == ({k: b for k, b in bc.loads.items() if k != "doc"}, dict(bc.stores))
    assert counted[0]["_ranges"] > 0
    # the cold launch moves the prepass's bytes on top, as the report without mask_cache says
    cold = analyse(with_blocks(load("document_mask"), BLOCKS), SIZES, docs=DOCS)
    extra = sum(t.bytes for t in triton_transfers(cold)) - sum(t.bytes for t in kept.transfers)
    assert extra == sum(sum(c.values()) for c in _prepass_alone(False, False)[:2])


def test_a_chunked_launch_reads_and_keeps_its_prefix_counts():
    """A launch in chunks of the keys (chunk=, the schedule's chunk to the
    cost pass) cuts each row's range: its record holds the lists' prefix
    counts besides (4 S + 6 int32 a block, the launcher's with _prefix) and
    each program reads [lo, hi) and its chunk's ends in both lists, as
    counted, the main kernel's every tensor; unchunked, the record is
    2 S + 4 and the lists' counts are read instead."""
    text = (REPO / "examples" / "document_mask.ncd").read_text().replace("stream x by 64",
                                                                        "group x by 64\n    stream x by 32")
    report = analyse(with_blocks(napkin.load_text(text, "document_mask.ncd"), BLOCKS), SIZES, docs=DOCS)
    doc = _ids()
    q, k, v, _ = m.example_inputs(SIZES, dtype=torch.float16, seed=8)
    cache: dict = {}
    m.document_mask(q, k, v, doc, block_q=32, block_x=16, chunk=64, mask_cache=cache)   # the record, kept
    (record, on), _ = next(iter(cache.values()))
    assert on and record.shape == (SIZES["b"], math.ceil(N / 32), 4 * math.ceil(N / 16) + 6)
    lists = {(t.tensor, t.direction): t for t in report.transfers
             if t.kernel in {k.index for k in report.kernels if k.prepass_step == "lists"}}
    assert lists[("_ranges", "store")].elements == record.numel()
    with ByteCounter(tensors={"Q": q, "K": k, "V": v, "doc": doc}) as bc:
        m.document_mask(q, k, v, doc, block_q=32, block_x=16, chunk=64, mask_cache=cache)
    assert bc.launches == 2   # the chunks and their merge, no prepass
    main = {k.index for k in report.kernels if k.prepass_of is None}
    counted = _by_tensor((t.tensor, t.direction, t.bytes) for t in report.transfers if t.kernel in main)
    assert counted == (dict(bc.loads), dict(bc.stores))
    whole = analyse(with_blocks(load("document_mask"), BLOCKS), SIZES, docs=DOCS)
    # 2 more int32 a program, 4 chunks of each row block's: the same visited blocks
    programs = SIZES["b"] * SIZES["h"] * math.ceil(N / 32)
    assert counted[0]["_ranges"] == sum(t.bytes for t in whole.transfers if t.tensor == "_ranges" and
                                        t.kernel == 0) + 4 * programs * (6 * math.ceil(N / 64) - 4)


def test_the_report_names_the_prepass_kernels(capsys):
    """The text report's kernel lines, and the JSON's round trip."""
    code, out, _ = run_cli("cost", str(REPO / "examples" / "document_mask.ncd"), "-D", "b=1", "-D", "h=16",
                           "-D", "q=8192", "-D", "x=8192", "--docs", "512", capsys=capsys)
    assert code == 0
    assert ("kernel 1 (ranges prepass of kernel 0, scan: each tile's state -> _tiles, _parts), grid b/1 q/128, "
            "x by 64: 704 programs x 12 steps") in out.splitlines()
    assert ("kernel 2 (ranges prepass of kernel 0, merge: each block's [lo, hi) -> _ranges), grid b/1 q/128: "
            "64 programs x 11 steps") in out.splitlines()
    assert "kernel 3 (ranges prepass of kernel 0, lists, in torch: a floor of its traffic -> _ranges)" \
        in out.splitlines()
    report = analyse(load("document_mask"), {"b": 1, "h": 16, "q": 8192, "x": 8192}, docs=D.Documents.parse("512"))
    assert from_json(report.to_json()) == report
    assert format_text(report) == out.rstrip("\n")
    code, kept, _ = run_cli("cost", str(REPO / "examples" / "document_mask.ncd"), "-D", "b=1", "-D", "h=16",
                            "-D", "q=8192", "-D", "x=8192", "--docs", "512", "--mask-cache", capsys=capsys)
    assert code == 0 and "ranges prepass of kernel" not in kept and "_ranges" in kept


def test_a_mask_of_indices_alone_keeps_its_record():
    """StreamingLLM's mask reads no tensor: the launchers keep its record in
    the module's own dict, so the report counts its reads and no prepass kernel."""
    report = analyse(load("streaming_llm"), {"b": 1, "h": 2, "q": 4096, "x": 4096})
    assert all(k.prepass_of is None for k in report.kernels)
    reads = [t for t in report.transfers if t.tensor == "_ranges"]
    assert len(reads) == 1 and reads[0].direction == "load" and reads[0].kernel == 0


@pytest.mark.parametrize("n, br, bc, whole", [(3000, 64, 32, False), (2500, 128, 64, True), (333, 32, 16, False)])
def test_full_blocks_of_a_mask_of_indices_are_the_prepass_s(n, br, bc, whole):
    """visits.prepass_full = the full list StreamingLLM's prepass makes (its
    sink block and window, the window's rows ragged at the diagonal)."""
    plan = attention_plan(load("streaming_llm"))
    sz = {"b": 1, "h": 1, "q": n, "x": n, "d": 64}
    record, on = sllm._streaming_llm_ranges(sz, torch.device("cpu"), br, bc, whole, False, True)
    got = full_lists(record[0], -(-n // bc))
    runs = visits.prepass_full(index_disjuncts(plan), n, n, br, bc, sz, whole_rows=whole)
    assert got == [tuple(j for a, z in r for j in range(a, z)) for r in runs]
    assert any(got)




def test_grouped_query_launches_on_documents_count_every_byte(tmp_path):
    """Grouped-query attention on documents (3 query heads a key head, ragged
    100 tokens): the forward, the training forward and the backward move, tensor
    by tensor, the bytes counted, the ids and every prepass buffer among them:
    dK/dV's flat loop over (row block, g) pairs reads a list entry a pair, and
    a full block's step reads no ids."""
    mod = compile_text(GQA_DOC, "prepass_gqa_doc", tmp_path)
    d = napkin.load_text(GQA_DOC, "gqa_doc.ncd")
    n, docs = 100, D.Documents(lengths=(37, 5, 58))
    ids = doc_ids(docs, n)
    sizes = {"b": 1, "hk": 2, "g": 3, "q": n, "x": n}
    q, k, v, _ = mod.example_inputs(sizes, dtype=torch.float32, seed=3)
    inputs = (q, k, v, ids)
    named = dict(zip(mod.INPUTS, inputs))
    blocked = with_blocks(d, BLOCKS)
    with ByteCounter(tensors=named) as bc:
        mod.gqa_doc(*inputs, block_q=32, block_x=16)
    assert (dict(bc.loads), dict(bc.stores)) == _report_bytes(analyse(blocked, sizes, docs=docs))
    back = backward_cost(blocked, sizes, given=True, docs=docs)
    options = tuple({"block_q": 32, "block_x": 16}.get(o) for o in mod._OPTIONS)
    with ByteCounter(tensors=named) as bc:
        outs, saved = mod._gqa_doc_forward(*inputs, *options, True)
    assert (dict(bc.loads), dict(bc.stores)) == _report_bytes(back.forward)
    grads = [torch.randn(o.shape, generator=torch.Generator().manual_seed(0)) for o in outs]
    with ByteCounter(tensors=named) as bc:
        mod._gqa_doc_grads(inputs, (*outs, *saved), grads, options, None)
    assert (dict(bc.loads), dict(bc.stores)) == (backward_bytes(back, "load"), backward_bytes(back, "store"))
    assert bc.loads["_ranges"] > 0 and bc.loads["doc"] > 0


def _report_bytes(report) -> tuple[dict, dict]:
    return _by_tensor((t.tensor, t.direction, t.bytes) for t in triton_transfers(report))


@pytest.mark.parametrize("role", ["forward", "dq", "dkdv"])
def test_a_block_sparse_scan_loads_the_keep_cells_each_tile_meets(role):
    """block_sparse's keep[b, h, q // 64, x // 64] read per (b, h) by the
    scan: each tile its distinct cells (a whole 128-row block meets two), as the
    main kernel's coarse read is counted; forward and dQ by row, dK/dV by
    column, at ragged 300 tokens, a random keep."""
    import generated.block_sparse as bs

    sizes, blocks = {"b": 1, "h": 2, "q": 300, "x": 300}, {"q": 128, "x": 32}
    keep = torch.rand(1, 2, 5, 5, generator=torch.Generator().manual_seed(5)) < 0.5
    whole_rows, by_col = {"forward": (False, False), "dq": (True, False), "dkdv": (True, True)}[role]
    d = with_blocks(load("block_sparse"), blocks)
    with ByteCounter(tensors={"keep": keep}, distinct=True) as bc:
        bs._block_sparse_ranges(keep, {**sizes, "qb": 5, "xb": 5, "d": 64}, keep.device, 128, 32, whole_rows, by_col,
                                True)
    if role == "forward":
        report = analyse(d, sizes)
        scan = {k.index for k in report.kernels if k.prepass_step in ("scan", "merge")}
        counted = _by_tensor((t.tensor, t.direction, t.bytes) for t in report.transfers if t.kernel in scan)
    else:
        back = backward_cost(d, sizes, given=True)
        counted = _by_tensor((mv.tensor, mv.direction, mv.bytes) for mv in back.moves
                             if mv.kernel in (f"{role} prepass scan", f"{role} prepass merge"))
    assert counted == (dict(bc.loads), dict(bc.stores))
    # h x the cells of each row block (rows [0, 128) meet two, [256, 300) one) x the key blocks' one each
    assert counted[0]["keep"] == 2 * (2 + 2 + 1) * 10
