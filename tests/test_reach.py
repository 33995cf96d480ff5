"""Ring Attention cut short (napkin/distributed/reach.py): the steps a mask
of nearby keys reaches over the ring's layout, against every pair of
positions; the byte model of a short ring; bench/cp_bench.py's short ring;
napkin plan's short-ring candidates; and the torchrun demo running one.  The multi-process runs of short rings
(outputs, gradients and bytes counted on every rank) are cases of
test_distributed2.py's suite."""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import pytest

import napkin
from napkin.cost import collectives as C
from napkin.printer import to_text
from ring_diagrams import PLAIN, REPO, diagram_text, fewest_arms


_REACH_MASKS = {   # predicate text -> what it keeps, written independently
    "x <= q and q - x < 5": lambda q, x: x <= q and q - x < 5,
    "q - x < 4 and x - q < 4": lambda q, x: abs(q - x) < 4,
    "x // 6 == q // 6": lambda q, x: x // 6 == q // 6,
    "x <= q and x // 7 == q // 7": lambda q, x: x <= q and x // 7 == q // 7,
    "x <= q": lambda q, x: x <= q,
    "x == q": lambda q, x: x == q,
    "x >= q": lambda q, x: x >= q,
    "x >= q and x - q < 3": lambda q, x: q <= x < q + 3,
    "(q - x) % 2 == 0": lambda q, x: (q - x) % 2 == 0,      # no affine bound: every step
}


@pytest.mark.parametrize("pred", list(_REACH_MASKS), ids=list(_REACH_MASKS))
def test_ring_reach_never_drops_a_kept_pair_and_is_exact_on_contiguous_and_zigzag_shards(pred):
    """RingAttention.reach and .arms (reach.ring_schedule) against every
    pair of positions: never fewer steps than some rank's kept pair needs
    (any layout), and exactly as many on contiguous and zigzag shards for
    masks with an affine bound, over ragged lengths; both ways round, the
    fewest steps of any split (cyclic shards run one way)."""
    from napkin.distributed import RingAttention
    from napkin.distributed.layouts import TokenLayout
    text = diagram_text("attention", "full", "fp64", "ring").replace(PLAIN, f"where({pred}, {PLAIN}, -inf)", 1)
    keep = _REACH_MASKS[pred]
    for layout in ("contiguous", "zigzag", "cyclic"):
        fn = RingAttention(napkin.load_text(text, "reach.ncd"), layout=layout)
        for parts in (2, 3, 4, 5):
            for n_q, n_x in ((13, 13), (16, 16), (29, 29), (11, 23)):
                ql, xl = TokenLayout(layout, parts, n_q), TokenLayout(layout, parts, n_x)
                live = set()
                for rank in range(parts):
                    mine = [int(q) for q in ql.positions(rank) if q < n_q]
                    for s in range(1, parts):
                        theirs = [int(x) for x in xl.positions((rank - s) % parts) if x < n_x]
                        if any(keep(q, x) for q in mine for x in theirs):
                            live.add(s)
                got, want = fn.reach(parts, n_q, n_x), max(live, default=0) + 1
                where = (layout, parts, n_q, n_x)
                assert got >= want, where
                if layout != "cyclic" and "%" not in pred:
                    assert got == want, where
                    assert fn.arms(parts, n_q, n_x) == fewest_arms(live, parts, got), where
                else:
                    assert fn.arms(parts, n_q, n_x) == (got, 0), where


def test_a_ring_reaches_every_step_where_a_masked_pair_still_counts():
    """S * S of a masked score is +inf, not nothing: the ring cannot skip its
    masked steps (the kernels' own test, masks.value_when_masked)."""
    from napkin.distributed import RingAttention
    text = diagram_text("sigmoid_attention", "window", "fp64", "ring")
    assert RingAttention(napkin.load_text(text, "w.ncd"), layout="contiguous").reach(4, 16) == 2
    squared = text.replace("P[b, h, q, x] = sigmoid(S - log(|x|))", "P[b, h, q, x] = S * S")
    assert squared != text
    assert RingAttention(napkin.load_text(squared, "sq.ncd"), layout="contiguous").reach(4, 16) == 4


def test_short_ring_model_counts_its_passes():
    """The model of a ring cut to s steps: s - 1 block passes, s - 1
    accumulator passes and one hop home; the other way round for Burst;
    nothing at one step; and a double ring cannot be cut."""
    m = dataclasses.replace(C.Moved.attention(dict(b=1, hq=4, hkv=2, d=8, q=64), "fp16"), layout="contiguous")
    kv_block, acc_block = 16 * m.key_row, 16 * 2 * 2 * 8 * 4
    for s in (1, 2, 3, 4):
        short = dataclasses.replace(m, reach=s)
        assert C.rank_bytes("ring", (4,), short, "forward") == [((s - 1) * kv_block,) * 2] * 4
        want = (s - 1) * kv_block + (s - 1) * acc_block + (acc_block if s > 1 else 0)
        assert C.rank_bytes("ring", (4,), short, "backward") == [(want, want)] * 4, s
    assert C.rank_bytes("ring", (4,), dataclasses.replace(m, reach=4), "backward") == \
        C.rank_bytes("ring", (4,), m, "backward")
    groups = [t.group for t in C.terms("burst", (4,), dataclasses.replace(m, reach=3), "backward")]
    assert groups == ["ring reversed", "ring reversed", "home 2"]
    pl = C.Placement("burst", (4,), gpus_per_node=2)
    assert [pl.peer(g, True)(1) for g in groups] == [0, 0, 3]
    with pytest.raises(ValueError, match="flat ring"):
        C.terms("ring2", (2, 2), dataclasses.replace(m, reach=2), "forward")


def test_a_ring_both_ways_counts_each_arms_passes():
    """2 steps back and 1 ahead of 4: one K, V pass each way forward; each
    arm's backward makes one block pass, one accumulator pass and one hop
    home, the ahead arm's the other way round (Ring's blocks from ahead,
    Burst's query blocks to the ranks ahead); its time is the two arms one
    after the other."""
    m = dataclasses.replace(C.Moved.attention(dict(b=1, hq=4, hkv=2, d=8, q=64), "fp16"), layout="contiguous")
    kv, acc = 16 * m.key_row, 16 * 2 * 2 * 8 * 4
    both = dataclasses.replace(m, reach=2, ahead=1)
    assert C.ring_steps("ring", (4,), both) == 3
    assert C.rank_bytes("ring", (4,), both, "forward") == [(2 * kv,) * 2] * 4
    assert C.rank_bytes("ring", (4,), both, "backward") == [(2 * kv + 4 * acc,) * 2] * 4
    assert [t.group for t in C.terms("ring", (4,), both, "forward")] == ["ring", "ring reversed"]
    assert [t.group for t in C.terms("ring", (4,), both, "backward")] == \
        ["ring", "ring", "home -1", "ring reversed", "ring reversed", "home 1"]
    assert [t.group for t in C.terms("burst", (4,), both, "backward")] == \
        ["ring reversed", "ring reversed", "home 1", "ring", "ring", "home -1"]
    links = C.Links(within=1e9, across=1e9)
    pl = C.Placement("ring", (4,))
    t = C.scheme_seconds(pl, both, links, [1.0, 1.0, 1.0], [2.0, 2.0, 2.0])
    assert t.forward_s == pytest.approx(3.0) and t.backward_s > 6.0    # the hops home are not hidden
    with pytest.raises(ValueError, match="3 compute steps"):
        C.scheme_seconds(pl, both, links, [1.0] * 4)


def test_cp_bench_prices_the_short_ring_from_the_wrapper_and_the_model():
    """bench/cp_bench.py's short ring: the steps the wrapper reaches (the
    window of N/8 over 8 contiguous shards: 2), the bytes of the model at
    that reach (one K, V pass forward; one pass, one chain pass and one hop
    home backward); the causal document mask reaches as far back as a
    document straddles shards (counted here from its ids), and the shared
    question, which every answer reads, every step.  Zigzag Ring and Burst
    run the steps the wrapper cuts them to, both ways round."""
    import numpy as np

    from bench import cp_bench as B
    rec = {r["mask"]: r for r in B.predict(8, 8, masks=("sliding_window", "document", "shared_question"))}
    short, ring = rec["sliding_window"]["short"], rec["sliding_window"]["ring"]
    n = 8 * B.TOKENS_PER_GPU
    shard = np.arange(n) // (n // 8)
    ids = B.doc_ids("document", n)
    straddles = max(shard[ids == i].max() - shard[ids == i].min() for i in np.unique(ids))
    assert short["steps"] == 2 and rec["document"]["short"]["steps"] == 1 + straddles == 3
    assert rec["shared_question"]["short"]["steps"] == 8
    m = dataclasses.replace(C.Moved.attention(dict(b=1, hq=B.HQ, hkv=B.HKV, d=B.D, q=n), "bf16"),
                            layout="contiguous")
    rows = n // 8
    kv, acc = rows * m.key_row, rows * 2 * B.HKV * B.D * 4
    assert short["MB"] * 1e6 == pytest.approx(kv + kv + 2 * acc)
    assert short["MB"] < ring["MB"] / 2
    # zigzag Ring and Burst run the steps the wrapper cuts them to: the window of N/8 spans two
    # chunks of N/16 each way, 3 steps back and 2 ahead, four K, V passes forward (two each way),
    # where the cyclic ring (every step) sends Ring's seven
    assert ring["steps"] == rec["sliding_window"]["burst"]["steps"] == 5
    pl, cut = C.Placement("ring", (8,), 8), dataclasses.replace(m, layout="zigzag", reach=3, ahead=2)
    sent = [C.traffic(pl, cut, ph)[0].sent for ph in ("forward", "backward")]
    assert sent[0] == 4 * kv and ring["MB"] * 1e6 == pytest.approx(sum(sent))
    assert ring["MB"] < rec["sliding_window"]["cyclic"]["MB"] and rec["document"]["ring"]["steps"] == 8
    assert "| Ring steps |" in B.predict_markdown(list(rec.values()))
    # the ring over cyclic shards: Ring's bytes, every step balanced (the zigzag ring's busiest
    # device does 1.9x the mean work under the document mask), so faster than Ring and ATTENTION2D
    doc = rec["document"]
    assert doc["cyclic"]["MB"] == doc["ring"]["MB"] and doc["cyclic"]["imbalance"] < 1.001 < 1.5 < doc["ring_imbalance"]
    assert doc["cyclic"]["ms"] < doc["a2d"]["ms"] < doc["ring"]["ms"]
    assert "| Cyclic ring ms |" in B.predict_markdown(list(rec.values()))


def test_the_ring_demo_runs_a_short_ring_under_torchrun(tmp_path):
    """examples/run_ring_attention.py --layout contiguous on a window of 8
    over 53 tokens (14 rows a rank): the ring runs 2 of 4 steps with
    BurstAttention's backward (the ring the other way), matches the float64
    reference, and every rank sent the bytes the model predicts at that
    reach."""
    text = (REPO / "examples" / "sliding_window.ncd").read_text()
    assert "q - x < 256" in text
    path = tmp_path / "window8.ncd"
    path.write_text(text.replace("q - x < 256", "q - x < 8").replace(": bf16", ": fp32").replace(": fp16", ": fp32"))
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                          str(REPO / "examples" / "run_ring_attention.py"), "--diagram", str(path), "--tokens", "53",
                          "--layout", "contiguous", "--backward", "burst", "--timeout", "60"],
                         capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "contiguous layout: the ring runs 2 of 4 steps" in run.stdout, run.stdout
    errors = [float(v) for v in re.findall(r"max \|(?:O|dQ) - reference\| *= (\S+)", run.stdout)]
    assert len(errors) == 2 and all(e < 1e-5 for e in errors), run.stdout
    ranks = re.findall(r"^ +\d+ +(\d+) \( *(\d+)\) +(\d+) \( *(\d+)\)", run.stdout, re.MULTILINE)
    assert len(ranks) == 4 and all(f == fp and b == bp and int(f) > 0 for f, fp, b, bp in ranks), run.stdout


def test_layout_spans_are_the_least_and_greatest_real_positions():
    """reach.span (torch-free, for napkin plan) against TokenLayout.positions."""
    from napkin.distributed.layouts import TokenLayout
    from napkin.distributed.reach import span
    for kind in ("contiguous", "zigzag", "cyclic"):
        for parts in (1, 2, 3, 4, 7):
            for length in (1, 2, 5, 13, 16, 29, 100):
                lay = TokenLayout(kind, parts, length)
                for part in range(parts):
                    pos = [int(p) for p in lay.positions(part) if p < length]
                    want = (min(pos), max(pos)) if pos else None
                    assert span(kind, parts, length, part) == want, (kind, parts, length, part)


def test_a_bound_on_another_wires_size_is_left_out_not_a_crash():
    """q - x < |h| bounds the keys by a size the ring is not told: that bound
    is dropped (never a kept pair lost), x <= q stays, and the ring runs
    every step of a causal mask over contiguous shards."""
    from napkin.distributed import RingAttention
    text = diagram_text("attention", "full", "fp64", "ring").replace(
        PLAIN, f"where(x <= q and q - x < |h|, {PLAIN}, -inf)", 1)
    fn = RingAttention(napkin.load_text(text, "h.ncd"), layout="contiguous")
    assert fn.reach(4, 16) == 4
    window = RingAttention(napkin.load_text(text.replace("|h|", "3"), "w.ncd"), layout="contiguous")
    assert window.reach(4, 16) == 2


def test_plan_offers_short_rings_where_the_mask_reaches_few_steps():
    """napkin plan: a window of 256 over 8 shards of 8192 tokens adds the
    flat ring and its Burst variant over contiguous shards, 2 of 8 steps;
    their bytes are the plain ring's passes cut to one (forward) and to one
    block pass, one accumulator pass and one hop home (Ring's backward), and
    one of them wins.  The zigzag ring is cut too, 2 steps back and 1 ahead
    (a rank's late chunk needs the rank ahead): one K, V pass each way, and
    each way's backward a block pass, an accumulator pass and a hop home.  A
    causal mask cuts none."""
    from napkin import plan as P
    sizes = dict(b=1, h=32, q=65536, x=65536)
    options = P.plan(napkin.load("examples/sliding_window.ncd"), 8, sizes)
    short = {(o.scheme, o.layout): o for o in options if o.reach is not None}
    assert set(short) == {(s, lay) for s in ("ring", "burst") for lay in ("contiguous", None)}
    assert [short[s, "contiguous"].arms for s in ("ring", "burst")] == [(2, 0)] * 2
    assert [short[s, None].arms for s in ("ring", "burst")] == [(2, 1)] * 2
    assert short["ring", "contiguous"].label == "Ring of 8 over contiguous shards, 2 of 8 steps"
    assert short["ring", None].label == "Ring of 8, 3 of 8 steps (2 back, 1 ahead)"
    # the plain ring's bytes, priced as before: every step
    whole = P.Pricing.of(napkin.load("examples/sliding_window.ncd"), 8, sizes, None, True)
    plain = dataclasses.replace(whole, zigzag_arms=None).option(C.Placement("ring", (8,), 8), 8)
    assert plain.reach is None
    kv = plain.forward_bytes // 7                       # one K, V pass of the plain ring's seven
    acc = (plain.backward_bytes - 7 * kv) // 8          # one dK, dV pass of its eight
    cut, zig = short["ring", "contiguous"], short["ring", None]
    assert cut.forward_bytes == kv and cut.backward_bytes == kv + 2 * acc
    assert zig.forward_bytes == 2 * kv and zig.backward_bytes == 2 * kv + 4 * acc
    assert options[0].reach == 2 and options[0].layout == "contiguous"
    causal = P.plan(napkin.load("examples/causal.ncd"), 8, sizes)
    assert all(o.reach is None for o in causal)


def test_plan_emits_a_short_ring_that_the_wrappers_and_napkin_cost_read(capsys, tmp_path):
    """--emit writes the winner's tiles with 'contiguous': the wrapper made
    from the emitted file runs 1 of 8 steps with no layout= given, and napkin
    cost prices the emitted diagram as plan did (no note)."""
    from napkin import plan as P
    from napkin.cli import main
    from napkin.cost import analyse
    out = tmp_path / "short.ncd"
    argv = ["plan", "examples/chunked_attention.ncd", "--devices", "8", "-D", "b=1", "-D", "h=16",
            "-D", "q=65536", "-D", "x=65536", "--forward", "--top", "1", "--emit", str(out)]
    assert main(argv) == 0
    got = capsys.readouterr().out
    assert "1  Ring of 8 over contiguous shards, 1 of 8 steps" in got, got
    assert f"wrote {out}: Ring of 8 over contiguous shards, 1 of 8 steps\n" in got and "note:" not in got, got
    assert "group q across 8 contiguous" in out.read_text() and "stream x across 8 contiguous" in out.read_text()
    from napkin.distributed import RingAttention
    fn = RingAttention(napkin.load(str(out)))
    assert fn.layout == "contiguous" and fn.reach(8, 65536) == 1
    # a window over 8 shards, trained: every short option's emitted diagram costs as plan priced it,
    # the zigzag ring's (which names no layout: RingAttention's own) both ways round
    sizes = dict(b=1, h=32, q=65536, x=65536)
    d = napkin.load("examples/sliding_window.ncd")
    for option in (o for o in P.plan(d, 8, sizes) if o.reach is not None):
        emitted = napkin.load_text(to_text(P.emit(d, option)), "emitted.ncd")
        rep = analyse(emitted, sizes).devices
        assert (rep.ring_steps, rep.ring_ahead) == (option.reach, option.arms[1]), option.label
        assert rep.layout == (option.layout or "zigzag"), option.label
        assert rep.bytes_sent == option.forward_bytes, option.label
        back = rep.burst_backward_bytes if option.scheme == "burst" else rep.backward_bytes
        assert back == option.backward_bytes, option.label
        assert P.emitted_placement_note(option, emitted, sizes) is None, option.label


def _mesh(text: str, mesh: str) -> str:
    """examples/sliding_window.ncd's schedule with ``mesh`` as its devices level."""
    return text.replace("  level hbm", f"  level devices {{ {mesh} }}\n  level hbm", 1)


@pytest.mark.parametrize("mesh, message, at, hint", [
    ("group q across 2 contiguous, x across 2", "ATTENTION2D cannot lay q out contiguous: it deals tokens "
     "cyclically", "contiguous", "write 'cyclic' or no layout"),
    ("group x across 4 zigzag", "decoding's tree cannot lay x out zigzag: it deals tokens in contiguous shares",
     "zigzag", "write 'contiguous' or no layout"),
    ("group q across 4 contiguous\n    stream x across 4 zigzag", "x is laid out zigzag but q contiguous: the "
     "mesh deals every split wire's tokens one way", "zigzag", "write 'contiguous' here too, or the layout once"),
])
def test_a_layout_the_scheme_cannot_run_is_refused_where_it_is_written(mesh, message, at, hint):
    from napkin.cost import analyse
    from napkin.distributed import roles
    from napkin.errors import NapkinError
    text = _mesh((REPO / "examples" / "sliding_window.ncd").read_text(), mesh)
    with pytest.raises(NapkinError) as err:
        roles(napkin.load_text(text, "bad.ncd"))
    with pytest.raises(NapkinError, match=message):      # not the generic model's numbers
        analyse(napkin.load_text(text, "bad.ncd"), dict(b=1, h=2, q=16, x=16))
    d = err.value.diagnostics[0]
    line, written = next((i, s) for i, s in enumerate(text.splitlines(), 1) if f" {at}" in s and "across" in s)
    assert (d.message, d.loc.line, d.loc.col, d.hint) == (
        f"cannot distribute this diagram: {message}", line, written.index(f" {at}") + 2, hint)


def test_the_diagrams_layout_is_the_wrappers_launchers_and_costs_default():
    """stream x across 4 contiguous: RingAttention and the generated launcher
    default to it (layout= still overrides), napkin cost prices the ring cut
    short, and zigzag written out prices as no layout does: cut both ways
    round, as RingAttention runs it."""
    from napkin.cost import analyse
    from napkin.distributed import RingAttention
    from napkin.distributed.emit import distributed_source
    base = (REPO / "examples" / "sliding_window.ncd").read_text().replace("q - x < 256", "q - x < 3")
    text = _mesh(base, "group q across 4\n    stream x across 4 contiguous")
    d = napkin.load_text(text, "short.ncd")
    assert RingAttention(d).layout == "contiguous" and RingAttention(d).reach(4, 16) == 2
    assert RingAttention(d, layout="zigzag").reach(4, 16) == 4
    src = distributed_source(d)
    assert 'def sliding_window_distributed(Q, K, V, group=None, *, q_len, x_len=None, timeout=300.0, ' \
           'layout="contiguous"):' in src
    sizes = dict(b=1, h=2, q=16, x=16)
    rep = analyse(d, sizes).devices
    assert (rep.layout, rep.ring_steps) == ("contiguous", 2)
    m = dataclasses.replace(C.Moved.attention(dict(b=1, hq=2, hkv=2, d=64, q=16), "fp16"), layout="contiguous")
    assert rep.bytes_sent == 4 * m.key_row                       # one pass of 4 rows of K, V
    plain = analyse(napkin.load_text(_mesh(base, "group q across 4\n    stream x across 4"), "z.ncd"), sizes)
    zig = analyse(napkin.load_text(_mesh(base, "group q across 4 zigzag\n    stream x across 4"), "z.ncd"), sizes)
    # zigzag, named or not: 2 steps back and 1 ahead (a late chunk needs the rank ahead), one pass
    # of 4 rows each way
    assert plain.devices == zig.devices
    assert (zig.devices.layout, zig.devices.ring_steps, zig.devices.ring_ahead) == ("zigzag", 3, 1)
    assert zig.devices.bytes_sent == 2 * 4 * m.key_row
    assert RingAttention(d, layout="zigzag").arms(4, 16) == (2, 1)


# ---- a reach from the ids: document masks ----------------------------------------------------

_DOC = (REPO / "examples" / "document_mask.ncd").read_text()
_DOC_SCORE = "where(doc[b, q] == doc, sum[d](Q * K) * |d|^-0.5, -inf)"
_DOC_MASKS = {   # predicate text -> what it keeps besides equal ids, written independently
    "doc[b, q] == doc": lambda q, x: True,
    "x <= q and doc[b, q] == doc": lambda q, x: x <= q,
    "doc == doc[b, q] and q - x < 6 and x <= q": lambda q, x: 0 <= q - x < 6,
}


def _doc_ring(pred: str, layout: str):
    from napkin.distributed import RingAttention
    assert _DOC_SCORE in _DOC
    text = _mesh(_DOC.replace(_DOC_SCORE, _DOC_SCORE.replace("doc[b, q] == doc", pred)),
                 "group q across 4\n    stream x across 4")
    return RingAttention(napkin.load_text(text, "docs.ncd"), layout=layout)


def _documents(gen, n: int, longest: int):
    """Ids of packed documents of 1 .. longest tokens, in order."""
    import torch
    lens = torch.randint(1, longest + 1, (n,), generator=gen)
    return torch.repeat_interleave(torch.arange(n), lens)[:n]


@pytest.mark.parametrize("pred", list(_DOC_MASKS), ids=list(_DOC_MASKS))
def test_a_document_mask_reaches_as_far_as_its_ids_say(pred):
    """RingAttention.reach given the ids (side=) against every pair of
    positions, two batch rows of fresh random documents over ragged lengths:
    never fewer steps than a kept pair needs, in any layout, and exactly as
    many on contiguous shards when each document's tokens are contiguous;
    ids scattered at random still never lose a kept pair."""
    import torch
    from napkin.distributed.layouts import TokenLayout
    keep = _DOC_MASKS[pred]
    gen = torch.Generator().manual_seed(2026)
    rings = {layout: _doc_ring(pred, layout) for layout in ("contiguous", "zigzag", "cyclic")}
    seen = set()
    for trial in range(12):
        n = int(torch.randint(9, 41, (1,), generator=gen))
        parts = 2 + trial % 4
        scattered = trial % 3 == 2
        rows = [torch.randint(0, 4, (n,), generator=gen) if scattered else _documents(gen, n, 2 + trial)
                for _ in range(2)]
        doc = torch.stack(rows).to(torch.int32)
        for layout, fn in rings.items():
            lay = TokenLayout(layout, parts, n)
            real = [[int(p) for p in lay.positions(r) if p < n] for r in range(parts)]
            far = max((s for r in range(parts) for s in range(1, parts)
                       if any(keep(q, x) and doc[b, q] == doc[b, x]
                              for b in range(2) for q in real[r] for x in real[(r - s) % parts])), default=0)
            got = fn.reach(parts, n, n, side={"doc": doc})
            where = (trial, layout, parts, n, doc.tolist())
            assert far + 1 <= got <= parts, where
            if layout == "contiguous" and not scattered:
                assert got == far + 1, where
                seen.add(got < parts)
                live = {s for r in range(parts) for s in range(1, parts)
                        if any(keep(q, x) and doc[b, q] == doc[b, x]
                               for b in range(2) for q in real[r] for x in real[(r - s) % parts])}
                assert fn.arms(parts, n, n, side={"doc": doc}) == fewest_arms(live, parts, got), where
            # without the ids the ring cannot tell: the mask's bounds alone
            assert fn.reach(parts, n, n) >= got, where
    assert seen == {True, False}      # some rings cut short, some not


def test_same_ids_reads_only_comparisons_of_one_input_at_query_and_key():
    """reach.same_ids: the conjuncts doc[b, q] == doc[b, x] (either side,
    either reading) with everything else equal; not a disjunction, not !=,
    not two inputs, not ids at other batch wires, not a merged axis."""
    from napkin.distributed import roles
    from napkin.distributed.reach import SameIds, same_ids

    def ids(pred: str, decl: str = "in doc[b, x] : int32", extra: str = ""):
        text = _DOC.replace(_DOC_SCORE, _DOC_SCORE.replace("doc[b, q] == doc", pred))
        text = text.replace("in doc[b, x] : int32", decl + extra)
        return same_ids(roles(napkin.load_text(_mesh(text, "group q across 4\n    stream x across 4"), "i.ncd")))

    want = (SameIds("doc", 1, ("b",)),)
    assert ids("doc[b, q] == doc") == want
    assert ids("doc[b, x] == doc[b, q] and x <= q") == want
    assert ids("doc[b, q] != doc") == ()
    assert ids("doc[b, q] == doc or x <= q") == ()
    assert ids("doc[b, q] == other", extra="\nin other[b, x] : int32") == ()
    assert ids("doc[q, b] == doc[x, b]", "in doc[x, b] : int32") == (SameIds("doc", 0, ("b",)),)
    # ids per head as well: the batch wires are read alike on both sides
    assert ids("doc[b, h, q] == doc", "in doc[b, h, x] : int32") == (SameIds("doc", 2, ("b", "h")),)


def test_napkin_cost_says_the_ids_may_cut_a_ring():
    """The cost pass sees no data: it prices a document mask's ring at every
    step and says the ids may cut it (RingAttention reads them in any
    layout), and how to price them on documents."""
    from napkin.cost import analyse
    sizes = dict(b=1, h=2, q=64, x=64)
    contiguous = analyse(napkin.load_text(_mesh(_DOC, "group q across 4\n    stream x across 4 contiguous"),
                                          "c.ncd"), sizes)
    assert contiguous.devices.ring_ids == ("doc",) and contiguous.devices.ring_steps is None
    note = next(n for n in contiguous.notes if n.startswith("devices:"))
    assert ("the ring may run fewer steps: its mask compares doc at the query and the key, and RingAttention "
            "reads the values at each call to find how far back kept keys sit (priced here at 4 of 4 steps; "
            "--docs LENGTHS prices them on packed documents)") in note
    zigzag = analyse(napkin.load_text(_mesh(_DOC, "group q across 4\n    stream x across 4"), "z.ncd"), sizes)
    assert zigzag.devices.ring_ids == ("doc",) and "may run fewer" in " ".join(zigzag.notes)
    grid = analyse(napkin.load_text(_mesh(_DOC, "group q across 2\n    group x across 2"), "g.ncd"), sizes)
    assert grid.devices.ring_ids == () and "may run fewer" not in " ".join(grid.notes)


def test_the_ring_demo_reads_packed_documents_under_torchrun():
    """examples/run_ring_attention.py on examples/document_ring.ncd (causal
    packed documents, a ring of 4 over contiguous shards), 253 tokens: the
    demo packs documents (integer inputs become sorted ids), the ring reads
    them and runs fewer than 4 steps, matches the float64 reference, and
    every rank sent the bytes the model predicts at that reach."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                          str(REPO / "examples" / "run_ring_attention.py"), "--diagram",
                          str(REPO / "examples" / "document_ring.ncd"), "--tokens", "253", "--timeout", "60"],
                         capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    steps = re.search(r"contiguous layout: the ring runs (\d) of 4 steps", run.stdout)
    assert steps and 1 <= int(steps.group(1)) < 4, run.stdout
    errors = [float(v) for v in re.findall(r"max \|(?:O|dQ) - reference\| *= (\S+)", run.stdout)]
    assert len(errors) == 2 and all(e < 1e-5 for e in errors), run.stdout
    ranks = re.findall(r"^ +\d+ +(\d+) \( *(\d+)\) +(\d+) \( *(\d+)\)", run.stdout, re.MULTILINE)
    assert len(ranks) == 4 and all(f == fp and b == bp and int(f) > 0 for f, fp, b, bp in ranks), run.stdout


def test_a_document_reach_is_read_once_per_set_of_ids(monkeypatch):
    """RingAttention.reach keeps the reach of each set of id values (by a
    crc32 of them, the handshake's own): the same ids again, even in another
    tensor, read nothing; other ids are read, and their own reach returned."""
    import torch
    from napkin.distributed import ring as R
    fn = _doc_ring("x <= q and doc[b, q] == doc", "contiguous")
    read = []
    real = R.id_meets
    monkeypatch.setattr(R, "id_meets", lambda *a: read.append(1) or real(*a))
    short = torch.repeat_interleave(torch.arange(8), 4)[None].to(torch.int32)    # 32 tokens, documents of 4
    assert fn.reach(4, 32, side={"doc": short}) == 1 and len(read) == 1
    assert fn.reach(4, 32, side={"doc": short.clone()}) == 1 and len(read) == 1
    long = torch.repeat_interleave(torch.arange(2), 16)[None].to(torch.int32)    # documents of 16
    assert fn.reach(4, 32, side={"doc": long}) == 2 and len(read) == 2
    assert fn.reach(4, 32, side={"doc": short}) == 1 and len(read) == 2


def test_cost_and_plan_price_a_ring_both_ways_for_keys_on_both_sides():
    """A window |q - x| < 256 over 8 contiguous shards of 8192 tokens: napkin
    cost says the ring runs 3 of 8 steps, 2 the usual way and 1 the other,
    and prices two K, V passes forward; napkin plan offers it both ways, and
    the diagram it emits costs what it priced."""
    from napkin import plan as P
    from napkin.cost import analyse
    base = (REPO / "examples" / "sliding_window.ncd").read_text()
    assert "x <= q and q - x < 256" in base
    two = base.replace("x <= q and q - x < 256", "q - x < 256 and x - q < 256")
    sizes = dict(b=1, h=32, q=65536, x=65536)
    d = napkin.load_text(_mesh(two, "group q across 8\n    stream x across 8 contiguous"), "two.ncd")
    rep = analyse(d, sizes)
    assert (rep.devices.ring_steps, rep.devices.ring_ahead) == (3, 1)
    note = next(n for n in rep.notes if n.startswith("devices:"))
    assert note.startswith("devices: the ring runs 3 of 8 steps over contiguous shards (2 the usual way round "
                           "and 1 the other: its mask keeps keys on both sides of its queries, none further)"), note
    m = dataclasses.replace(C.Moved.attention(dict(b=1, hq=32, hkv=32, d=64, q=65536), "fp16"), layout="contiguous")
    assert rep.devices.bytes_sent == 2 * 8192 * m.key_row
    options = P.plan(napkin.load_text(two, "two.ncd"), 8, sizes)
    short = [o for o in options if o.arms is not None]
    assert {o.arms for o in short} == {(2, 1)} and {o.scheme for o in short} == {"ring", "burst"}
    assert short[0].label.endswith("over contiguous shards, 3 of 8 steps (2 back, 1 ahead)"), short[0].label
    for option in short:
        emitted = napkin.load_text(to_text(P.emit(napkin.load_text(two, "two.ncd"), option)), "emitted.ncd")
        back = analyse(emitted, sizes).devices
        assert back.bytes_sent == option.forward_bytes, option.label
        assert (back.burst_backward_bytes if option.scheme == "burst" else back.backward_bytes) == \
            option.backward_bytes, option.label
