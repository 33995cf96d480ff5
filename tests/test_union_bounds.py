"""An ``or`` of bounds of one kind is one bound: the greatest of its forms.

The prefix-LM's ``x <= q or x < p[b]`` keeps for row q the keys up to
``max(q, p - 1)``: one run, as causal's.  masks._union takes such an ``or``
(every disjunct one bound, all upper or all lower, their row coefficients of
one sign) as one ``Bound`` with ``alts``, so the loops bound it by formula
and the ranges prepass (two kernels and torch's lists at every launch) is
gone.  Checked here:

* which ``or``s are one bound and which are not (a lower beside an upper:
  StreamingLLM's sinks are two runs; forms of opposite slopes; ``==``);
* by brute force over every pair, on drawn unions and conjunctions of them,
  steps included: the forward's blocks hold every kept pair and a tile of one
  union with no kept pair is never visited, dK/dV's column loop visits the
  same set, the full blocks are exactly the tiles every pair of which is kept
  (inside the edges), and pairs.rect_pairs counts the kept pairs;
* ``masks.at_values``: a union is read at the given lengths, or dropped whole;
* the prefix-LM's kernels: one launch a call, and forward and gradients
  against float64 at prefixes negative, 0, on and off the blocks, past the
  keys and int32's ends (the bound is clipped in int64).
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import napkin
from napkin import ir, masks, pairs, visits
from napkin.bytecount import ByteCounter
from napkin.codegen import bounds as B
from napkin.codegen import lower, ranges
from napkin.parse import parse
import backward_helpers as BH
import kernel_helpers as K


def _pred(src: str) -> ir.Expr:
    d = parse("diagram t\nwire b, q, x\nin A[q, x] : fp32\nin p[b] : int32\n"
              f"S[b, q, x] = where({src}, A, -inf)\nout S")
    return masks.mask_predicate(masks.mask_node(d.lets[0].expr))


@pytest.mark.parametrize("src, text", [
    ("x <= q or x < p[b]", "x <= max(q, p - 1)"),
    ("x < p[b] or x <= q", "x <= max(q, p - 1)"),                   # the form reading the row first
    ("x <= q or x < 20", "x <= max(q, 19)"),
    ("x <= q - 30 or (x < 12 or x <= 2 * q - 70)", "x <= max(q - 30, 2 * q - 70, 11)"),
    ("x >= q - 3 or x >= 40", "x >= min(q - 3, 40)"),
    ("x < 2 or x + q <= 50", "x <= max(-1 * q + 50, 1)"),               # both slopes down (or flat)
    ("not (x > q and x >= 20)", "x <= max(q, 19)"),                 # negated: an and of flips
    ("x <= q or x <= q", "x <= q"),                                  # the same form twice is one
])
def test_an_or_of_bounds_of_one_kind_is_one_bound(src, text):
    (bound,) = masks.exact_bounds(_pred(src), "q", "x", {}, frozenset({"p"}))
    assert B.text(bound, "x", "q") == text


@pytest.mark.parametrize("src", [
    "q - x < 8 or x < 4",         # a lower and an upper bound: two runs of keys (StreamingLLM's sinks)
    "x > q or x >= 50 - q",       # slopes of both signs: the least of them is no monotone bound
    "x == q or x < 4",            # == is two bounds
    "(x <= q and x >= 3) or x < 2",
    "x <= q or x * x < 4",
])
def test_other_ors_are_no_bound(src):
    assert masks.exact_bounds(_pred(src), "q", "x") is None
    assert masks.stream_bounds(_pred(src), "q", "x") == ()


def test_a_union_without_its_lengths_has_no_bound_and_one_read_at_them():
    pred = _pred("x <= q or x < p[b]")
    assert masks.exact_bounds(pred, "q", "x") is None     # p read as data, not a length here
    bounds = masks.exact_bounds(pred, "q", "x", {}, frozenset({"p"}))
    assert masks.lengths_read(bounds) == ("p",)
    (got,) = masks.at_values(bounds, {"p": 30})
    assert got.value(5, {}) == 29 and got.value(40, {}) == 40 and not got.lengths_read
    # one part left unknown would make the union tighter, no upper bound: the whole goes
    assert masks.at_values(bounds, {}) == ()


# --------------------------------------------------------------------------
# Drawn unions, by brute force over every pair.
# --------------------------------------------------------------------------

def _holds(b: masks.Bound, r: int, c: int) -> bool:
    return any((c <= p.value(r, {})) if p.kind == "upper" else (c >= p.value(r, {})) for p in b.parts)


def _draw_bound(rng: random.Random) -> masks.Bound:
    kind = rng.choice(("upper", "lower"))
    sign = rng.choice((1, -1))
    parts = [masks.Bound(kind, sign * rng.choice((0, 1, 1, 2)), (("", rng.randint(-40, 60)),),
                         rng.choice((1, 1, 3, 8))) for _ in range(rng.choice((1, 2, 2, 3)))]
    parts = [p if p.row_coeff else masks.Bound(kind, 0, p.rest) for p in parts]
    parts.sort(key=lambda p: p.row_coeff == 0)
    return masks.Bound(parts[0].kind, parts[0].row_coeff, parts[0].rest, parts[0].step, tuple(parts[1:]))


def test_drawn_unions_visit_every_kept_pair_and_their_full_blocks_exactly():
    rng = random.Random(20261207)
    for trial in range(400):
        bounds = tuple(_draw_bound(rng) for _ in range(rng.choice((1, 1, 2))))
        nr, nc = rng.randint(1, 70), rng.randint(1, 70)
        br, bc = rng.choice((4, 8, 16)), rng.choice((4, 8, 16))
        keep = [[all(_holds(b, r, c) for b in bounds) for c in range(nc)] for r in range(nr)]
        tiles = {(i, j): [keep[r][c] for r in range(i * br, min(i * br + br, nr))
                          for c in range(j * bc, min(j * bc + bc, nc))]
                 for i in range(-(-nr // br)) for j in range(-(-nc // bc))}
        live = {ij for ij, kept in tiles.items() if any(kept)}
        seen = visits.visited_blocks(bounds, nr, nc, br, bc)
        case = (trial, bounds, nr, nc, br, bc)
        assert live <= set(seen) and len(set(seen)) == len(seen), case
        if len(bounds) == 1:    # one bound's range is exact: no dead tile visited
            assert set(seen) == live, case
        assert sorted(visits.visited_blocks_by_column(bounds, nr, nc, br, bc)) == sorted(seen), case
        full = {(i, j) for (i, j), kept in tiles.items() if all(kept) and (j + 1) * bc <= nc}
        assert {(i, j) for i, j, f in visits.split_blocks(bounds, nr, nc, br, bc) if f} == full, case
        whole = {(i, j) for i, j in full if (i + 1) * br <= nr}
        assert {(i, j) for i, j, f in visits.split_blocks(bounds, nr, nc, br, bc, whole_rows=True) if f} == whole
        assert {(i, j) for i, j, f in visits.split_blocks_by_column(bounds, nr, nc, br, bc) if f} == whole, case
        kept = np.array(keep, dtype=np.int64)
        rects = [(0, nr, 0, nc)] + [tuple(sorted(rng.sample(range(nr + 1), 2)) + sorted(rng.sample(range(nc + 1), 2)))
                                    for _ in range(5) if nr > 1 and nc > 1]
        got = pairs.rect_pairs(bounds, {}, *(np.array(v) for v in zip(*rects)))
        assert [int(g) for g in got] == [int(kept[a:b, c:d].sum()) for a, b, c, d in rects], case


def test_tile_live_keeps_a_tile_where_the_union_holds_somewhere():
    """At global positions (the distributed wrappers' shares) a tile's rows and keys are any
    sets; one union bound is false at every pair iff at its loosest (visits.tile_live)."""
    rng = random.Random(7)
    for _ in range(300):
        b = _draw_bound(rng)
        rows, cols = rng.sample(range(80), rng.randint(1, 6)), rng.sample(range(80), rng.randint(1, 6))
        assert visits.tile_live((b,), rows, cols) == any(_holds(b, r, c) for r in rows for c in cols), (b, rows, cols)


# --------------------------------------------------------------------------
# The prefix-LM's kernels.
# --------------------------------------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def _folder(tmp_path_factory):
    K._FOLDER.append(tmp_path_factory.mktemp("union_bounds"))
    yield
    K._FOLDER.pop()


TEXT = (K.REPO / "examples" / "prefix_lm.ncd").read_text().replace("d = 64", "d = 16") \
    .replace("q by 128", "q by 32").replace("x by 64", "x by 16")


def test_the_prefix_lm_runs_no_prepass_one_launch_a_call():
    plan = lower.lower(napkin.load_text(TEXT, "prefix.ncd"))
    assert not ranges.applies(plan) and plan.full == plan.bounds
    assert [B.text(b, "x", "q") for b in plan.bounds] == ["x <= max(q, p - 1)"]
    m = K.compile_text(TEXT, "union_prefix")
    assert not any(name.endswith("_ranges_kernel") for name in vars(m))
    q, k, v, _ = m.example_inputs({"b": 2, "h": 1, "q": 40, "x": 40}, dtype=torch.float32, seed=1)
    with ByteCounter() as bc:
        m.prefix_lm(q, k, v, torch.tensor([3, 20], dtype=torch.int32))
    assert bc.launches == 1


@pytest.mark.parametrize("p, qx", [
    ((-5, 0, 1, 17), (45, 45)),
    ((16, 31, 45, 200), (45, 45)),                     # on the blocks, the whole sequence, past it
    ((2 ** 31 - 1, -2 ** 31, 33, 8), (37, 50)),         # int32's ends (p - 1 wraps in int32: clipped), q != x
])
def test_prefix_lm_forward_and_gradients_against_float64(p, qx):
    m = K.compile_text(TEXT, "union_prefix")
    sizes = {"b": 4, "h": 2, "q": qx[0], "x": qx[1]}
    q, k, v, _ = m.example_inputs(sizes, dtype=torch.float32, seed=sum(qx))
    n = torch.tensor(p, dtype=torch.int32)
    for dtype in (torch.float32, torch.float16):
        inputs = (q.to(dtype), k.to(dtype), v.to(dtype), n)
        (out,) = K.run(m, inputs)
        K.assert_accurate((out,), K.reference(m, inputs, torch.float64), K.reference(m, inputs))
    got = BH.gradients(m.prefix_lm, (q, k, v, n), block_q=16, block_x=16)
    exact = BH.gradients(m.reference, (q.double(), k.double(), v.double(), n))
    same = BH.gradients(m.reference, (q, k, v, n))
    BH.assert_accurate(got, exact, same, f"prefix {p}")


def test_a_union_beside_ids_bounds_the_prepass_s_loops():
    """(x <= q or x < 20) and doc[b, q] == doc: the ranges prepass finds the ids' blocks and
    the loops are cut by the union too (masks.stream_bounds); forward and gradients against
    float64 on documents off the blocks (test_documents.py counts its bytes and spans)."""
    text = (K.REPO / "examples" / "document_mask.ncd").read_text().replace(
        "where(doc[b, q] == doc,", "where((x <= q or x < 20) and doc[b, q] == doc,").replace("d = 64", "d = 16")
    plan = lower.lower(napkin.load_text(text, "doc_prefix.ncd"))
    assert ranges.applies(plan) and [B.text(b, "x", "q") for b in plan.bounds] == ["x <= max(q, 19)"]
    m = K.compile_text(text, "union_doc_prefix")
    q, k, v, _ = m.example_inputs({"b": 2, "h": 1, "q": 70, "x": 70}, dtype=torch.float32, seed=4)
    doc = torch.tensor([[0] * 30 + [1] * 7 + [2] * 33, [0] * 12 + [1] * 58], dtype=torch.int32)
    (out,) = K.run(m, (q, k, v, doc))
    K.assert_accurate((out,), K.reference(m, (q, k, v, doc), torch.float64), K.reference(m, (q, k, v, doc)))
    got = BH.gradients(m.document_mask, (q, k, v, doc), block_q=16, block_x=16)
    exact = BH.gradients(m.reference, (q.double(), k.double(), v.double(), doc))
    BH.assert_accurate(got, exact, BH.gradients(m.reference, (q, k, v, doc)), "doc prefix")
