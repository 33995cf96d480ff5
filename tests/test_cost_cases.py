"""The cost pass, case by case (tests/test_cost.py has its formulas, counts,
bounds, devices, tuning and CLI): chunks of the streamed wire and packed
rows, the notes a report gives and the bound beside them, the backward's
counts, and rings and nodes levels."""
from __future__ import annotations

import dataclasses
import math

import pytest

import napkin
from napkin import ir, tiling
from napkin.cost import analyse, from_json, summary_lines, tune, with_blocks
from napkin.cost import model, packing, profiles
from napkin.cost.masked import visited as _visited
from napkin.errors import NapkinError

from cost_helpers import EXAMPLES, REPO, evaluate as _eval, load, run_cli, sizes_for


# --------------------------------------------------------------------------
# Chunks of the streamed wire (flash-decoding, napkin/cost/chunks.py).  The
# counts are checked against the generated kernels' bytes in
# tests/test_bytecount.py; here the report's rows, formulas and the launch
# of a single chunk.
# --------------------------------------------------------------------------

FD_SIZES = {"b": 1, "hk": 8, "g": 4, "q": 4, "x": 32768}


def test_chunked_report_prints_the_state_and_the_merge_kernel():
    from napkin.cost import format_text
    r = analyse(load("flash_decoding"), FD_SIZES)
    text = format_text(r).splitlines()
    # packed rows (napkin/cost/packing.py): the 4 heads' 4 queries are one block of 16 rows per (b, hk)
    packed = "grid b/1 hk/1 (g q)/16 (packed rows: (g, q) pairs, each masked at its q)"
    blocks = math.ceil(FD_SIZES["g"] * FD_SIZES["q"] / 16)
    programs = FD_SIZES["b"] * FD_SIZES["hk"] * blocks            # a chunk's, and the merge's
    chunks, width = 32, 2 + 128   # m, acc[d], l per row
    assert text[1] == (f"kernel 0 (S, P, O, lse -> _part): {packed}, stream x by 64, "
                       f"x in chunks of 1024: 32 chunks: {programs * chunks} programs x 16 steps")
    assert text[2] == (f"kernel 1 (merge of kernel 0's chunks -> O, lse): {packed}: {programs} programs, "
                       "each folding 32 chunks' states")
    rows = [line.split() for line in text if line.startswith("hbm/smem")]
    assert [r_[1:5] for r_ in rows] == [["0", "Q", "load", "bf16"], ["0", "K", "load", "bf16"],
                                       ["0", "V", "load", "bf16"], ["0", "_pos_q", "load", "int64"],
                                       ["0", "_part", "store", "fp32"],
                                       # the merge loads no positions: its finalise reads no row's index
                                       ["1", "_part", "load", "fp32"],
                                       ["1", "O", "store", "bf16"], ["1", "lse", "store", "fp32"]]
    state = "b*d*g*hk*q*x/c_x + 2*b*g*hk*q*x/c_x"
    assert [line for line in text if "_part" in line and "hbm/smem" in line] == [
        f"hbm/smem  0  _part   store  fp32   {state}      532k  2.13MB        1",
        f"hbm/smem  1  _part   load   fp32   {state}      532k  2.13MB        1"]
    by = {(t.kernel, t.tensor, t.direction): t for t in r.transfers}
    rows_real = FD_SIZES["b"] * FD_SIZES["hk"] * FD_SIZES["g"] * FD_SIZES["q"]
    assert by[0, "_part", "store"].bytes == by[1, "_part", "load"].bytes == chunks * rows_real * width * 4
    assert by[0, "Q", "load"].bytes == chunks * rows_real * 128 * 2 and by[0, "Q", "load"].fetches == chunks
    assert by[0, "Q", "load"].formula == "b*d*g*hk*q*x/c_x"
    # K and V once per (b, hk) row block for all 4 heads: the point of packing
    assert by[0, "K", "load"].bytes == programs * FD_SIZES["x"] * 128 * 2
    assert by[0, "K", "load"].formula == "b*d*g*hk*q*x/(g_g*g_q)"
    # each program reads its rows' positions (int64); the merge's do not (no row index in its finalise)
    assert by[0, "_pos_q", "load"].bytes == chunks * rows_real * 8 and (1, "_pos_q", "load") not in by
    whole = analyse(with_blocks(load("flash_decoding"), {}), {**FD_SIZES, "x": 1024})
    assert by[0, "K", "load"].bytes == 32 * whole.transfers[1].bytes   # per-step loads unchanged
    k0, k1 = r.kernels
    assert (k0.chunk, k0.chunks, k0.merges, k1.merges, k1.programs) == (1024, 32, None, 0, programs)
    assert (k0.packed, k1.packed) == (("g", "q"), ("g", "q"))
    assert r.totals[0].store_bytes == by[0, "_part", "store"].bytes + 4 * 32 * 128 * 2 + 4 * 32 * 4
    assert by[0, "_part", "store"].bytes * 2 < r.totals[0].dram_bytes < r.hbm_bytes
    assert from_json(r.to_json()) == r


@pytest.mark.parametrize("g,q,x,block,step", [(4, 1, 100, 16, 16), (7, 5, 333, 16, 16), (3, 37, 333, 32, 16),
                                               (3, 60, 50, 16, 16), (5, 9, 40, 64, 32), (1, 37, 70, 16, 16)])
def test_packed_spans_are_the_key_blocks_some_row_sees(g, q, x, block, step):
    """Packed rows (napkin/cost/packing.py): a block of (g, q) pairs visits
    the key blocks holding a key some row of it sees, each row masked at its
    own q (x <= q + |x| - |q|): brute force over the rows, against the
    spans the cost pass counts from the block's least and greatest q."""
    d = with_blocks(load("flash_decoding"), {"q": block // 4, "x": step})
    pack = packing.find(d)
    assert (pack.wire, pack.row, pack.block) == ("g", "q", block)
    sizes = {"b": 1, "hk": 1, "g": g, "q": q, "x": x, "d": 128}
    (kernel,) = model.kernels(d)
    visited = _visited(d, kernel, pack.tiling(model.tiling_at(d, "smem")), sizes, pack)
    rows = [r % q for r in range(g * q)]
    for i, (first, stop) in enumerate(visited.spans):
        seen = {k // step for r in rows[i * block:(i + 1) * block] for k in range(x) if k <= r + x - q}
        assert set(range(first, stop)) == seen, i


def test_the_tile_search_varies_the_packed_block():
    """The search keeps g's group and varies q's, over the packed blocks of
    16 to 256 rows covering |g||q| (64 here); each result is analyse's."""
    d = load("flash_decoding")
    sizes = {**FD_SIZES, "q": 16}
    results = tune(d, sizes, top=100)
    assert {r.block["q"] * 4 for r in results} == {16, 32, 64} and all("g" not in r.block for r in results)
    for r in results[:3]:
        assert r.hbm_bytes == analyse(with_blocks(d, r.block), sizes).hbm_bytes


def _unchunked(d: ir.Diagram) -> ir.Diagram:
    levels = tuple(dataclasses.replace(lv, tiles=tuple(dataclasses.replace(t, chunk=None) for t in lv.tiles))
                   for lv in d.schedule.levels)
    return dataclasses.replace(d, schedule=dataclasses.replace(d.schedule, levels=levels))


@pytest.mark.parametrize("x", [1, 700, 1024])
def test_a_single_chunk_runs_the_whole_kernel(x):
    """|x| <= C: the launcher runs the unchunked kernel, and the model counts it."""
    d = load("flash_decoding")
    sizes = {**FD_SIZES, "x": x}
    r, whole = analyse(d, sizes), analyse(_unchunked(d), sizes)
    assert r.transfers == whole.transfers and r.totals == whole.totals
    (k,) = r.kernels
    assert (k.chunk, k.chunks, k.stores) == (1024, 1, ("O", "lse"))
    from napkin.cost import format_text
    assert "x in chunks of 1024: 1 chunk, so it runs whole" in format_text(r)


def test_a_block_longer_than_the_chunk_grows_it():
    """As the launcher's _chunks: a (tuned) stream block longer than the chunk is the chunk."""
    d = with_blocks(load("flash_decoding"), {"x": 256})   # the tile search keeps the chunk
    assert [t.chunk for t in d.level("smem").tiles if t.wire == "x"] == [1024]
    assert analyse(d, FD_SIZES).kernels[0].chunk == 1024
    text = (REPO / "examples" / "causal.ncd").read_text().replace(
        "stream x by 64", "group x by 128\n    stream x by 64")
    c = with_blocks(napkin.load_text(text, "c.ncd"), {"x": 256})
    k = analyse(c, {"b": 1, "h": 1, "q": 64, "x": 1000}).kernels[0]
    assert (k.chunk, k.chunks, k.steps) == (256, 4, 1)


def test_chunked_formulas_equal_counts_when_blocks_and_chunks_divide():
    d = load("flash_decoding")
    sizes = {**FD_SIZES, "q": 32, "x": 8192}
    r = analyse(d, sizes)
    groups = {t.wire: t.size for t in d.level("smem").tiles if t.kind == "group" and t.chunk is None}
    env = {**dict(r.sizes), "g_g": groups["g"], "g_q": groups["q"], "c_x": 1024}   # g_g*g_q: packed rows
    for t in r.transfers:   # (the decode mask skips no whole block of 64 here)
        assert t.elements == _eval(t.formula, env), t
    assert analyse(d).notes[0].startswith("the formulas count the chunked launch")


def test_a_chunk_the_kernels_do_not_take_is_costed_whole_with_a_note():
    """The code generator chunks only attention: a matmul's chunked stream runs whole."""
    text = (REPO / "examples" / "matmul.ncd").read_text().replace(
        "stream k by 32", "group k by 256\n    stream k by 32")
    d = napkin.load_text(text, "m.ncd")
    sizes = {"m": 300, "n": 200, "k": 1000}
    r = analyse(d, sizes)
    assert r.transfers == analyse(load("matmul"), sizes).transfers
    assert any("chunks of k are not modelled" in n for n in r.notes)


# --------------------------------------------------------------------------
# The blocks priced, the notes a report gives, the bound beside them.
# --------------------------------------------------------------------------

def _blocks_notes(d, sizes=None):
    return [n for n in analyse(d, sizes).notes if n.startswith("the kernels' untuned launch")]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_the_examples_price_the_blocks_their_kernels_run(path):
    d = napkin.load(path)
    assert _blocks_notes(d) == []
    assert _blocks_notes(d, sizes_for(d, 300)) == []


def test_blocks_the_schedule_leaves_to_the_launcher_get_a_note():
    """The cost pass prices the schedule as written; where the kernels'
    untuned launch blocks a wire otherwise (codegen's plan), a note names
    the blocks and why, unless the known sizes make them the same grid."""
    causal = (REPO / "examples" / "causal.ncd").read_text()
    tail = ", while this report prices the schedule as written; give level smem those blocks to price the launch"
    d = napkin.load_text(causal.replace("group b by 1, h by 1, q by 128", "group b by 1, h by 1"), "c.ncd")
    assert _blocks_notes(d) == [
        "the kernels' untuned launch runs q by 64 (the launcher's default: level smem does not group q)" + tail]
    assert _blocks_notes(d, {"b": 1, "h": 2, "q": 50, "x": 300}) == []     # one block of q either way
    assert len(_blocks_notes(d, {"b": 1, "h": 2, "q": 65, "x": 300})) == 1
    d = napkin.load_text(causal.replace("group b by 1, h by 1, q by 128", "group h by 1, q by 1"), "c.ncd")
    assert _blocks_notes(d) == [
        "the kernels' untuned launch runs q by 16 (tl.dot's least block, where level smem groups q by 1); "
        "b by 1 (one program per index, where level smem does not group it)" + tail]
    assert _blocks_notes(d, {"b": 1, "h": 2, "q": 1, "x": 300}) == []      # decoding one query of one batch
    matmul = (REPO / "examples" / "matmul.ncd").read_text()
    d = napkin.load_text(matmul.replace("group m by 128, n by 128", "group n by 128")
                         .replace("stream k by 32", ""), "m.ncd")
    assert _blocks_notes(d) == [
        "the kernels' untuned launch runs m by 64 (the launcher's default: level smem does not group m); "
        "k by 32 (the launcher's default: level smem does not stream k)" + tail]


def test_a_bound_above_an_overflowing_schedule_gets_a_note():
    """The lower bound holds for schedules whose tiles fit level smem; one
    that overflows it (every query of a head in one program) may beat it."""
    causal = (REPO / "examples" / "causal.ncd").read_text()
    d = napkin.load_text(causal.replace("group b by 1, h by 1, q by 128", "group b by 1, h by 1"), "c.ncd")
    r = analyse(d, {"b": 4, "h": 16, "q": 4096, "x": 4096})
    assert r.bound.ratio < 1
    assert "schedule/bound is below 1 because level smem's tiles overflow it: the bound holds for " \
           "schedules that fit" in r.notes
    r = analyse(load("causal"), {"b": 4, "h": 16, "q": 4096, "x": 4096})
    assert r.bound.ratio >= 1 and not any(n.startswith("schedule/bound") for n in r.notes)


def test_a_schedule_below_the_bound_that_fits_says_why():
    """The bound is dense attention's in the operands' element size: a mask
    that skips blocks, or fp16 accumulators beside fp32 operands (more rows
    fit than M / (d + dv)), take a fitting schedule below it (a helper's
    hunt: ratios 0.209 and 0.89 with no note)."""
    sizes = {"b": 1, "h": 16, "q": 16384, "x": 16384}
    r = analyse(load("sliding_window"), sizes)
    assert r.bound.ratio < 1 and all(f.fits for f in r.footprints)
    assert "schedule/bound is below 1: the masks skip 97.7% of the (row, step) area and the bound is " \
           "dense attention's" in r.notes
    text = (REPO / "examples" / "attention.ncd").read_text()
    for a, b in (("fp16", "fp32"), ("accumulate fp32", "accumulate fp16"), ("q by 128", "q by 512"),
                 ("stream x by 64", "stream x by 1")):
        assert a in text
        text = text.replace(a, b)
    r = analyse(napkin.load_text(text, "narrow.ncd"), sizes)
    assert r.bound.ratio < 1 and all(f.fits for f in r.footprints)
    assert "schedule/bound is below 1: the fp16 accumulators are narrower than the 4-byte operands the " \
           "bound's M counts, so more rows fit on chip than it assumes" in r.notes


@pytest.mark.parametrize("name, sizes", [("matmul", {"m": 1, "n": 4096, "k": 4096}),
                                         ("attention", {"b": 1, "h": 16, "q": 1, "x": 32768}),
                                         ("matmul", {"m": 1, "n": 1, "k": 1})])
def test_the_bound_is_never_below_the_compulsory_traffic(name, sizes, capsys):
    """The formula assumes a program holds rows a problem may not have (one
    query, one output row): it fell to 205kB where B alone is 33.5MB, and a
    schedule reading everything once scored 165x its bound."""
    r = analyse(load(name), sizes)
    d = load(name)
    tensors = list(d.inputs) + [d.tensor(o.name) for o in d.outputs]
    need = sum(math.prod(sizes.get(w, d.wire(w).size or 0) for w in ir.axis_wires(t.axes))
               * ir.DTYPE_BYTES[tiling.tensor_dtype(d, t.name)] for t in tensors)   # lse: fp32
    assert need == r.bound.compulsory_bytes == r.bound.bytes
    assert 1 <= r.bound.ratio < 1.1
    code, out, _ = run_cli("cost", str(REPO / "examples" / f"{name}.ncd"),
                           *[a for w, n in sizes.items() for a in ("-D", f"{w}={n}")], capsys=capsys)
    assert code == 0
    if name == "attention":   # the paper's form, below the floor, which the report names
        assert r.bound.formula_bytes < need
        assert ", below the compulsory traffic (each input read and each output written once): " in out
    else:                     # a matmul's own form is never below its compulsory traffic: it is that
        assert r.bound.formula_bytes == need and r.bound.formula == "k*m + k*n + m*n"
        assert "lower bound (matmul, M = 232kB of smem / 2 B): k*m + k*n + m*n = " in out


def test_rounding_picks_the_suffix_after_it_rounds():
    from napkin.cost.report import human, seconds
    assert human(999698, "B") == "1MB" and human(999_499, "B") == "999kB" and human(12_345) == "12.3k"
    assert human(9999) == "9999" and human(999.6e12) == "1P" and human(None) == "?"
    assert seconds(0.9996e-3) == "1 ms" and seconds(0.9996) == "1 s" and seconds(0.9994) == "999 ms"
    assert seconds(2.5e-10) == "0.25 ns" and seconds(3) == "3 s"
    assert human(float("nan"), "B") == "nanB" and human(float("inf")) == "inf"


def test_the_html_report_says_when_the_compulsory_traffic_is_the_bound():
    from napkin.render.report import report_html
    d = load("attention")
    page = report_html(d, analyse(d, {"b": 1, "h": 16, "q": 1, "x": 32768}), None)
    assert ", below the compulsory traffic (each input read and each output written once), 134 MB, " \
           "which is the bound" in page.replace("&nbsp;", " ")


def test_a_grid_that_leaves_sms_idle_gets_a_note():
    """The roofline assumes a full GPU: a streaming kernel with fewer programs
    than SMs is named in a note, with what would lengthen its grid."""
    def idle(d, sizes):
        return [n for n in analyse(d, sizes).notes if " on h100's 132 SMs" in n]
    d = load("flash_decoding")
    (note,) = idle(d, {**FD_SIZES, "q": 1, "x": 512})         # one chunk covers the cache: 8 programs
    assert note.startswith("kernel 0 runs 8 programs on h100's 132 SMs") and "a chunk shorter than |x|" in note
    assert idle(d, {**FD_SIZES, "q": 1}) == []                  # 32 chunks: 256 programs (the merge not counted)
    (note,) = idle(load("attention"), {"b": 1, "h": 8, "q": 1024, "x": 1024})
    assert "runs 64 programs" in note and "chunks of x (group x by C" in note
    assert idle(load("attention"), {"b": 8, "h": 16, "q": 4096, "x": 4096}) == []
    # a matmul has no chunks to offer (it was told to use them, and "1 programs")
    (note,) = idle(load("matmul"), {"m": 100, "n": 100, "k": 1000})
    assert note == ("kernel 0 runs 1 program on h100's 132 SMs: the roofline assumes all of them busy; smaller "
                    "blocks of the output's wires would give more programs")


def test_sizes_past_what_the_pass_walks_are_refused_in_words():
    """q = x = 10**12 ran out of memory (attention: one array entry per
    program) or ran for hours (causal: one Python step per row block)."""
    big = {"b": 1, "h": 1, "q": 10 ** 12, "x": 10 ** 12}
    with pytest.raises(NapkinError, match=r"the cost pass walks the programs of the launch grid one by one: "
                                          r"7,812,500,000 here, more than the 16,777,216 it takes"):
        analyse(load("attention"), big)
    with pytest.raises(NapkinError, match=r"a masked loop's row blocks one by one: 7,812,500,000 here"):
        analyse(load("causal"), big)
    # packed rows (flash_decoding, g q): their spans had no limit (2**40 rows: 2 GB and growing)
    with pytest.raises(NapkinError, match=r"a masked loop's blocks of packed rows one by one: 68,719,476,736 here"):
        analyse(load("flash_decoding"), {"b": 1, "hk": 1, "g": 1, "q": 2 ** 40, "x": 64})
    # a mask of indices alone (streaming_llm's or), counted row by row (visits.prepass_visits): its own limit
    # on rows, below the row blocks' (2**27 rows are 2**20 row blocks of 128)
    with pytest.raises(NapkinError, match=r"walks the rows of a mask of indices \(once per conjunction\) one by one: "
                                          r"268,435,456 here, more than the 134,217,728 it takes"):
        analyse(load("streaming_llm"), {"b": 1, "h": 1, "q": 2 ** 27, "x": 2 ** 27})


LET_WINDOW = """diagram let_window
wire b, h, q, x
wire d = 16
in Q[b, h, q, d] : fp32
in K[b, h, x, d] : fp32
in V[b, h, x, d] : fp32
SCORE
P[b, h, q, x] = softmax[x](S)
O[b, h, q, d] : fp32 = sum[x](P * V)
out O
schedule { level smem { group b by 1, h by 2, q by 16
stream x by 16
hold S, P } }
"""


def test_a_window_through_a_let_is_counted_whole_where_codegen_refuses_the_schedule():
    """group h by 2 is a schedule the code generator refuses, so the cost pass finds the mask itself:
    it took the first box's (W's window alone, 34 pairs at 100) and left out S = where(x <= q, W,
    -inf); the one-where window visits 13."""
    one = "S[b, h, q, x] = where(x <= q and q - x < 8, sum[d](Q * K) * |d|^-0.5, -inf)"
    let = ("W[b, h, q, x] = where(q - x < 8, sum[d](Q * K) * |d|^-0.5, -inf)\n"
           "S[b, h, q, x] = where(x <= q, W, -inf)")
    sizes = {"b": 1, "h": 2, "q": 100, "x": 100}
    visited = [[k.visited_steps for k in analyse(napkin.load_text(LET_WINDOW.replace("SCORE", s)), sizes).kernels]
               for s in (one, let)]
    assert visited == [[13], [13]]


def test_compare_says_dash_where_a_device_count_has_no_two_dimensional_grid(capsys):
    # a prime P raised min() of an empty list; P = 1 divided by zero; --tokens 0 and e4m3 were tracebacks
    from napkin.cost import compare
    assert compare.best_grid(7, 4096, 4, 8, 64, "bf16") is None
    assert compare.main(["--devices", "7,8", "--tokens", "4096", "--dim", "64"]) == 0
    rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| MHA |")]
    assert [r.split(" | ")[6] for r in rows] == ["-", "4x2"]
    for bad in (["--devices", "1"], ["--tokens", "0"], ["--dtype", "e4m3"]):
        with pytest.raises(SystemExit) as stop:
            compare.main(bad)
        assert stop.value.code == 2


def test_a_mask_the_kernels_find_by_prepass_is_said_to_be_counted_dense():
    """x * q <= 9000 (no affine comparison) and a data mask bound no block by formula: the
    report counted every block with no word, while the kernels skip blocks with a ranges prepass
    whose two launches and traffic it does not count.  x * 2 <= q (a coefficient on the streamed
    index) has no loop formula either, but compares indices alone: counted as the prepass finds it."""
    causal = (REPO / "examples" / "causal.ncd").read_text()
    sizes = {"b": 1, "h": 1, "q": 512, "x": 512}
    for text, says in ((causal.replace("where(x <= q, ", "where(x * q <= 9000, "), True),
                       ((REPO / "examples" / "document_mask.ncd").read_text(), True), (causal, False),
                       (causal.replace("where(x <= q, ", "where(x * 2 <= q, "), False)):
        notes = napkin.cost.analyse(napkin.load_text(text), sizes).notes
        assert any("bounds no block by formula" in n and "ranges prepass" in n for n in notes) == says
    slope = napkin.cost.analyse(napkin.load_text(causal.replace("where(x <= q, ", "where(x * 2 <= q, ")), sizes)
    assert any(n.startswith("the mask x * 2 <= q compares indices alone: the counts are the blocks the kernels' "
                            "ranges prepass finds live") for n in slope.notes)
    assert slope.hbm_bytes < napkin.cost.analyse(napkin.load_text(causal), sizes).hbm_bytes
    # a data mask beside a formula the counts bound (136 of 256 blocks at q = x = 1024, blocks 64) said
    # it bounded no block (novel2 hunt)
    both = (REPO / "examples" / "document_mask.ncd").read_text().replace(
        "where(doc[b, q] == doc, ", "where(doc[b, q] == doc and x <= q, ")
    report = napkin.cost.analyse(napkin.load_text(both), sizes)
    assert [n for n in report.notes if "ranges prepass" in n][0].startswith(
        "the mask doc[b, q] == doc and x <= q: the counts are the blocks its formula part bounds (")
    dense = napkin.cost.analyse(napkin.load_text((REPO / "examples" / "document_mask.ncd").read_text()), sizes)
    assert report.hbm_bytes < dense.hbm_bytes


def test_a_floored_bound_round_trips_through_json_as_it_was():
    """The floor is an int, the formula's value a float: bytes changed type through JSON (170508 in,
    170508.0 out).  It is a float either way now."""
    from napkin.cost.report import from_json
    r = napkin.cost.analyse(napkin.load(REPO / "examples" / "alibi.ncd"), {"b": 3, "h": 3, "q": 37, "x": 37})
    assert r.bound.floored and isinstance(r.bound.bytes, float)
    assert from_json(r.to_json()).to_json() == r.to_json()


def test_a_run_that_communication_dominates_is_called_communication_bound():
    """The headline said compute-bound for decoding across devices, where
    communication (added, not overlapped) is 150 of the 185 us."""
    rf = analyse(load("decode"), {"b": 1, "hk": 8, "g": 2, "q": 4096, "x": 4096}).roofline
    assert rf.communication_s > max(rf.contraction_s, rf.exp_s, rf.other_s, rf.hbm_s)
    assert rf.bound == "communication"
    rf = analyse(load("ring_attention"), {"b": 1, "h": 16, "q": 65536, "x": 65536}).roofline
    assert 0 < rf.communication_s < rf.contraction_s and rf.bound == "compute"


def test_the_demos_summary_says_when_the_compulsory_traffic_is_the_bound():
    """The demo printed the bound's formula beside the compulsory traffic's value (206kB beside a
    formula worth 125kB), never saying the one replaced the other."""
    from napkin.cost.report import human

    d = napkin.load(str(REPO / "examples" / "attention.ncd"))
    small = next(x for x in summary_lines(d, {"b": 1, "h": 2, "q": 64, "x": 64}) if x.startswith("lower bound"))
    r = analyse(d, {"b": 1, "h": 2, "q": 64, "x": 64})
    assert r.bound.floored and small.endswith(
        f"elements ({human(r.bound.formula_bytes, 'B')}; the compulsory traffic, {human(r.bound.bytes, 'B')}, "
        "is the bound)"), small
    big = next(x for x in summary_lines(d, {"b": 1, "h": 16, "q": 4096, "x": 4096}) if x.startswith("lower bound"))
    assert big.endswith("elements (92.5MB)"), big


@pytest.mark.parametrize("text, written", [
    ("diagram bt\nwire m, n, k\nin A[m, k] : fp16\nin B[n, k] : fp16\nC[m, n] : fp16 = sum[k](A * B)\nout C\n",
     "schedule {\n  level hbm { hold A, B, C }\n  level smem {\n    group m by 64, n by 64\n    stream k by 32\n  }\n}\n"),
    ((REPO / "examples" / "attention.ncd").read_text().split("\nschedule")[0] + "\n",
     "schedule {\n  level hbm { hold Q, K, V, O, lse }\n  level smem {\n    group b by 1, h by 1, q by 64\n"
     "    stream x by 64\n  }\n}\n"),
])
def test_a_diagram_without_a_schedule_is_priced_as_its_launch_runs(text, written):
    """With no schedule the report priced nothing as moved: hbm 0 ns and intensity 0 FLOP/B beside a
    lower bound of 840 MB (contract hunt).  It is now the report of the launch's own schedule,
    written out here by hand, and a note says so."""
    sizes = dict(m=4096, n=4096, k=4096) if text.startswith("diagram bt") else dict(b=1, h=8, q=4096, x=4096)
    bare, scheduled = analyse(napkin.load_text(text), sizes), analyse(napkin.load_text(text + written), sizes)
    assert bare.transfers == scheduled.transfers and bare.roofline == scheduled.roofline
    assert bare.hbm_bytes > bare.bound.bytes > 0
    assert bare.notes[0].startswith(f"diagram {bare.diagram} has no schedule: priced as its untuned launch runs "
                                    "(level hbm holds ")


# --------------------------------------------------------------------------
# The backward's counts; rings and nodes levels.
# --------------------------------------------------------------------------

@pytest.mark.parametrize("name, per_score", [("attention", 2), ("sigmoid_attention", 2), ("softcap", 4)])
def test_the_backwards_exps_are_the_ones_its_kernels_compute(name, per_score):
    """The dK/dV and dQ kernels each recompute the forward's transcendentals once per score:
    sigmoid_attention's _sigmoid(_S - tl.log(_len_x * 1.0)), softcap's _tanh and exp2.  The
    backward counted tl.log(|x|), one value a program, once a score (4 per score), and softcap's
    _tanh(_qk * c) three times a kernel, once in P and twice in dR = dS * (1 - t * t), where the
    compiled kernel computes it once (8 per score; costback hunt)."""
    from napkin.cost import backward_cost

    sizes = {"b": 1, "h": 1, "q": 128, "x": 128}   # one block each way: every pair visited
    d = load(name)
    scores = 128 * 128
    back = backward_cost(d, sizes)
    assert back.exp_flops == per_score * scores
    # each of the two kernels as many as the forward's step (attention's adds lse's log a row)
    assert back.exp_flops == 2 * (analyse(d, sizes).flops.exp // scores) * scores


def test_a_subtree_written_twice_is_counted_once_forward_and_backward():
    """The forward counted tanh(R / 50) * 25 + tanh(R / 50) * 25 as two tanh (three exps a score
    with the softmax's), where the kernel's _tanh(_R * 0.02) * 25 + _tanh(_R * 0.02) * 25 is
    compiled to one tanh and one product: it costs what 50 * tanh(R / 50) costs and one add."""
    from napkin.cost import backward_cost

    text = (REPO / "examples" / "softcap.ncd").read_text()
    written_once = text.replace("S[b, h, q, x] = 50 * tanh(sum[d](Q * K) * |d|^-0.5 / 50)",
                                "R[b, h, q, x] = sum[d](Q * K) * |d|^-0.5\nS[b, h, q, x] = 50 * tanh(R / 50)")
    twice = written_once.replace("S[b, h, q, x] = 50 * tanh(R / 50)",
                                 "S[b, h, q, x] = tanh(R / 50) * 25 + tanh(R / 50) * 25")
    assert written_once != text and twice != written_once
    sizes = {"b": 1, "h": 2, "q": 256, "x": 256}
    scores = 2 * 256 * 256
    once, two = (analyse(napkin.load_text(t), sizes).flops for t in (written_once, twice))
    assert (two.exp, two.exp_formula) == (once.exp, once.exp_formula) == (2 * scores, "2*b*h*q*x")
    assert (two.other, two.other_formula) == (once.other + scores, "8*b*h*q*x")
    assert backward_cost(napkin.load_text(twice), sizes).exp_flops == 4 * scores


def test_the_backwards_roofline_prices_the_bytes_that_reach_dram_as_the_forwards_does():
    """The backward's time priced every issued byte at hbm bandwidth: attention's dQ re-reads K
    and V once a row block and dK/dV Q and dO once a key block, re-reads the forward's model
    serves from L2, so at 16K it came out hbm-bound at 5.30 ms (17.8 GB / 3.35 TB/s) where its
    contractions take 3.89 ms and the forward was compute-bound (costback hunt)."""
    from napkin.cost import backward_cost

    d = load("attention")
    back = backward_cost(d, {"b": 1, "h": 16, "q": 16384, "x": 16384}, "h100")
    prof = profiles.get_profile("h100")
    rf = back.roofline
    issued = back.load_bytes + back.store_bytes
    assert rf.hbm_issued_s == pytest.approx(issued / prof["hbm_bandwidth"])
    assert back.dram_bytes < issued / 10 and rf.hbm_s == pytest.approx(back.dram_bytes / prof["hbm_bandwidth"])
    assert rf.bound == "compute" and back.time_s == rf.contraction_s
    assert back.time_s == pytest.approx(back.contraction_flops / prof.contraction_rate("fp16", False)[0])
    # one wave (16 programs a kernel on 132 SMs): every tensor a kernel reads reaches DRAM once
    n, b, h = 1024, 1, 2
    back = backward_cost(d, {"b": b, "h": h, "q": n, "x": n}, "h100")
    big, row = b * h * n * 64 * 2, b * h * n * 4    # an fp16 [b, h, n, 64] tensor; an fp32 [b, h, n] one
    assert back.dram == (2 * big + 2 * row,         # rows: dO, O, dlse (lse is an output); delta stored
                         4 * big + 2 * row + 2 * big,   # dK/dV: K, V, Q, dO, lse, delta; dK, dV
                         4 * big + 2 * row + big)   # dQ: Q, dO, K, V, lse, delta; dQ
    assert back.dram_bytes < back.load_bytes + back.store_bytes


@pytest.mark.parametrize("name", ["relu2_attention", "l2_attention", "attention", "sigmoid_attention", "causal"])
def test_the_training_forward_does_the_forwards_work(name):
    """The training forward also stores what the backward reads (relu2's saved numerator
    sum[x](relu(S)^2 * V) and sum sum[x](relu(S)^2), attention's lse); its kernel takes them
    from the accumulators the output already has.  The cost counted each saved sum as a second
    contraction (ReLU²: 6*b*d*h*q*x where the kernel does 4)."""
    from napkin.cost import backward_cost

    sizes = {"b": 1, "h": 2, "q": 200, "x": 136}
    d = load(name)
    plain, training = analyse(d, sizes).flops, backward_cost(d, sizes).forward.flops
    assert training == plain


def test_a_ring_alone_counts_its_devices_and_a_nodes_level_its_link():
    """'level devices { stream x across 8 }' alone said 'devices: 1' (the count multiplied the
    grouped wires only), and a ring over 2 nodes of 4 devices said NVLink where its passes cross
    nodes (render hunt).  Neither deals Q: a ring passes K and V, 7 chunks of 8 each."""
    body = (REPO / "examples" / "attention.ncd").read_text().split("\nschedule")[0] + "\n"
    mesh = {"devices": "  level devices { stream x across 8 }\n",
            "nodes": "  level nodes { stream x across 2 }\n  level devices { stream x across 4 }\n"}
    sizes = dict(b=1, h=16, q=4096, x=4096)
    for key, levels in mesh.items():
        text = body + ("schedule on h100 {\n" + levels + "  level hbm { hold Q, K, V, O, lse }\n"
                       "  level smem {\n    group b by 1, h by 1, q by 128\n    stream x by 64\n  }\n}\n")
        comm = analyse(napkin.load_text(text), sizes).devices
        assert comm.devices == 8
        assert [(r.tensor, r.collective, r.bytes_received) for r in comm.rows] == [
            (t, "ring pass", 7 * 4096 * 64 * 16 * 2 // 8) for t in ("K", "V")]
        assert comm.link == ("InfiniBand" if key == "nodes" else "NVLink")
    # beside a group of another wire the ring is a dimension of its own: each device holds K/8 (it
    # said 4 devices), and a nodes level that splits nothing keeps the link NVLink (today5 hunt)
    for levels, devices, link in (("  level devices {\n    group h across 2\n    stream x across 4\n  }\n", 8,
                                   "NVLink"),
                                  ("  level nodes { group b across 1 }\n  level devices { stream x across 8 }\n", 8,
                                   "NVLink")):
        text = body + ("schedule on h100 {\n" + levels + "  level hbm { hold Q, K, V, O, lse }\n"
                       "  level smem {\n    group b by 1, h by 1, q by 128\n    stream x by 64\n  }\n}\n")
        report = analyse(napkin.load_text(text), sizes)
        assert (report.devices.devices, report.devices.link) == (devices, link)
        assert f"numbers are per device (busiest of {devices})" in " ".join(report.notes)


def test_a_box_read_along_its_own_wires_written_out_is_one_accumulator():
    """sum[x](W[b, h, q, x] * V) beside sum[x](W * V) is one accumulator in the kernel
    (_out_O = _acc / ..., _out_P = _acc / ...); the cost counted it twice, 6*b*d*h*q*x
    (today5 hunt)."""
    text = ("diagram dupw\nwire b, h, q, x\nwire d = 32\nin Q[b, h, q, d] : fp16\nin K[b, h, x, d] : fp16\n"
            "in V[b, h, x, d] : fp16\nS[b, h, q, x] = where(x <= q, sum[d](Q * K) * |d|^-0.5, -inf)\n"
            "W[b, h, q, x] = relu(S)^2\nO[b, h, q, d] : fp16 = sum[x](W * V) / (sum[x](W) + 1e-6)\n"
            "P[b, h, q, d] : fp16 = sum[x](W[b, h, q, x] * V) / (sum[x](W[b, h, q, x]) + 2)\nout O, P\n")
    flops = analyse(napkin.load_text(text), {"b": 1, "h": 1, "q": 256, "x": 256}).flops
    assert flops.contraction_formula == "4*b*d*h*q*x"


@pytest.mark.parametrize("name", ["causal", "sliding_window"])
def test_dram_estimate_of_a_masked_backward_reads_each_input_once(name):
    """The backward's kernels took the forward's DRAM rule without its masked
    loop: every program counted as reading the stream's average share, so
    causal's dK/dV and dQ reached DRAM with fewer bytes than reading their
    inputs once (21.2 of 25.4 MB, 17.2 of 21.2 MB here; the window's 17.6
    and 13.6).  With each program's span, a wave reads the hull of its
    programs' spans: at this size, where L2 holds a head's K and V, each
    input exactly once, as plain attention's kernels do."""
    from napkin.cost.backward import backward_cost

    sizes = {"b": 1, "h": 8, "q": 4096, "x": 4096}
    c = backward_cost(load(name), sizes)
    plain = backward_cost(load("attention"), sizes)
    rows, row_state = 8 * 4096 * 64 * 2, 8 * 4096 * 4
    want = {"dkdv": 4 * rows + 2 * row_state + 2 * rows,   # K, V, Q, dO, lse, delta; dK, dV stored
            "dq": 4 * rows + 2 * row_state + rows}         # Q, dO, K, V, lse, delta; dQ stored
    got = dict(zip(c.kernels, c.dram))
    assert {k: got[k] for k in want} == want == {k: dict(zip(plain.kernels, plain.dram))[k] for k in want}


def test_dram_estimate_ignores_where_an_empty_span_would_start():
    """A program whose masked loop visits nothing reads nothing: its span
    must not stretch its wave's hull wherever it nominally starts.  Written
    (0, 0) it pulled the hull back to step 0, written (n, n) out to step n,
    so the same empty programs gave two different estimates (the backward's
    key blocks past the last query of a causal mask are such programs)."""
    d = load("causal")
    sizes = {"b": 1, "h": 8, "q": 4096, "x": 4096, "d": 64}
    (kernel,) = model.kernels(d)
    tiles = model.tiling_at(d, "smem")
    spans = list(_visited(d, kernel, tiles, sizes, None).spans)
    n = spans[-1][1]
    k = next(a for a in kernel.accesses if a.tensor == "K")
    got = {}
    for at in (0, n // 2, n):
        emptied = tuple((at, at) if i % 5 == 3 else s for i, s in enumerate(spans))
        fractions, _ = model.dram_fractions(kernel, tiles, sizes, 132, 2e6, visited=model.Visited("q", emptied))
        got[at] = fractions[k]
    assert got[0] == got[n // 2] == got[n], got


def test_a_ring_prices_the_l2_reach_of_alike_launches_once(monkeypatch):
    """A ring of P launches its kernel P times, every step the same sizes: the DRAM fractions
    (model.dram_fractions, a pass over the launch grid) are computed once for them, where they
    were computed P times (napkin cost of a ring of 32,768 devices: 7.3 s, now 1.5 s)."""
    from napkin.cost import analysis
    calls = []
    real = analysis.dram_fractions
    monkeypatch.setattr(analysis, "dram_fractions", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    rep = analyse(napkin.load("examples/ring_attention.ncd"), dict(b=1, h=4, q=4000, x=4000))
    assert len(calls) == 1 and rep.devices.devices == 4
    assert rep.kernels[0].programs == 4 * 4 * -(-1000 // 128)     # still 4 launches' programs


def test_a_ring_over_a_group_of_a_wire_its_chunks_lack_runs_on_that_group(tmp_path):
    """A matmul's group m across 4 beside stream n across 4 is a ring of 4 devices, each
    holding rows m_i of A and passing B's chunks of n (the per-device work the model counts:
    2*k*m*n/P_m); it said 16 devices and so InfiniBand (503 us of communication where NVLink
    takes 56).  A group over a wire the chunks carry (k of B) or of another count stays a
    dimension of its own."""
    body = (REPO / "examples" / "matmul.ncd").read_text().split("\nschedule")[0] + "\n"
    sizes = dict(m=4096, n=4096, k=4096)

    def comm(devices: str):
        text = body + ("schedule on h100 {\n  level devices {\n" + devices + "\n  }\n  level hbm { hold A, B, C }\n"
                       "  level smem {\n    group m by 128, n by 128\n    stream k by 32\n  }\n}\n")
        report = analyse(napkin.load_text(text), sizes)
        return report.devices.devices, report.devices.link, report.devices.bytes_received

    ring = comm("    group m across 4\n    stream n across 4")
    assert ring[:2] == (4, "NVLink") and ring[2] == 3 * 4096 * 4096 // 4 * 2     # B's 3 other chunks
    assert comm("    group k across 4\n    stream n across 4")[:2] == (16, "InfiniBand")
    assert comm("    group m across 2\n    stream n across 4")[:2] == (8, "NVLink")


def test_a_nodes_level_of_across_1_puts_the_generic_models_devices_on_one_node():
    """The generic model read more than 8 devices as one GPU a node even under a nodes level
    that splits nothing ('across 1': all on one node, as the scheme model reads it and as
    napkin plan --emit writes 16 GPUs of one node)."""
    body = (REPO / "examples" / "matmul.ncd").read_text().split("\nschedule")[0] + "\n"
    sizes = dict(m=4096, n=4096, k=4096)

    def link(nodes: str) -> tuple[int, str]:
        text = body + ("schedule on h100 {\n" + nodes + "  level devices {\n    group k across 4\n"
                       "    stream n across 4\n  }\n  level hbm { hold A, B, C }\n"
                       "  level smem {\n    group m by 128, n by 128\n    stream k by 32\n  }\n}\n")
        c = analyse(napkin.load_text(text), sizes).devices
        return c.devices, c.link

    assert link("") == (16, "InfiniBand")
    assert link("  level nodes { group k across 1 }\n") == (16, "NVLink")
    assert link("  level nodes { group m across 2 }\n") == (32, "InfiniBand")


def test_a_ring_shares_a_groups_devices_only_at_its_own_mesh_level():
    """The generic model matched a ring's count against a group's parts over both mesh
    levels, the checker per level: 'group m across 2' in the nodes level and 'group m
    across 2, stream n across 4' in the devices level were 4 devices to cost (m's 4 parts
    beside the ring of 4) and 16 to the checker.  Per level, as the checker and the
    language's 'a wire's parts multiply over the levels' have it: 16."""
    body = (REPO / "examples" / "matmul.ncd").read_text().split("\nschedule")[0] + "\n"

    def devices(levels: str) -> int:
        text = body + ("schedule on h100 {\n" + levels + "  level hbm { hold A, B, C }\n"
                       "  level smem {\n    group m by 128, n by 128\n    stream k by 32\n  }\n}\n")
        d = napkin.load_text(text)
        assert tiling.mesh_devices(d) == analyse(d, dict(m=4096, n=4096, k=4096)).devices.devices
        return tiling.mesh_devices(d)

    assert devices("  level nodes { group m across 2 }\n"
                   "  level devices {\n    group m across 2\n    stream n across 4\n  }\n") == 16
    assert devices("  level nodes { stream n across 2 }\n"
                   "  level devices {\n    group m across 4\n    stream n across 2\n  }\n") == 16
    # a double ring: each level's ring shares that level's group
    assert devices("  level nodes {\n    group m across 2\n    stream n across 2\n  }\n"
                   "  level devices {\n    group m across 2\n    stream n across 2\n  }\n") == 4
    assert devices("  level devices {\n    group m across 4\n    stream n across 4\n  }\n") == 4


def test_the_backward_of_a_matmul_epilogue_counts_its_recompute_and_its_torch_part():
    """relu(A @ B + bias) in fp16: the backward recomputes the sum (a float32 store), then the
    torch part reads dC, the sum and the bias and writes dR and the bias's gradient; napkin cost
    --backward failed on the recompute's buffer (it looked for an input called 'sum')."""
    from napkin.cost import backward_cost
    text = ("diagram mmrb\nwire m, n, k\nin A[m, k] : fp16\nin B[k, n] : fp16\nin bias[n] : fp32\n"
            "C[m, n] : fp16 = relu(sum[k](A * B) + bias)\nout C\n")
    m, n, k = 300, 200, 100
    back = backward_cost(napkin.load_text(text), dict(m=m, n=n, k=k))
    assert back.kernels == ("_epi_sum", "_grad_A", "_grad_B", "epilogue (torch)")
    stores = {(x.kernel, x.tensor): x.bytes for x in back.moves if x.direction == "store"}
    assert stores[("_epi_sum", "_epi_sum")] == 4 * m * n
    torch_part = {(x.tensor, x.direction): x.bytes for x in back.moves if x.kernel == "epilogue (torch)"}
    assert torch_part == {("dC", "load"): 2 * m * n, ("_epi_sum", "load"): 4 * m * n, ("bias", "load"): 4 * n,
                          ("dR (C's)", "store"): 2 * m * n, ("_grad_bias", "store"): 4 * n}
    assert back.contraction_flops == 3 * 2 * m * n * k      # the recompute and the two gradient products
