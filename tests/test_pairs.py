"""napkin/pairs.py: the pairs a mask of bounds keeps, in closed form, against
a count of every pair (rectangles of rows and keys, whole matrices, and every
rank of a ring at each step, as documents.ShardPairs counts them row by row)."""
from __future__ import annotations

import random

import numpy as np
import pytest

from napkin import pairs
from napkin.documents import ShardPairs
from napkin.masks import Bound


def _lower(coeff, const, step=1):
    return Bound("lower", coeff, (("", const),), step)


def _upper(coeff, const, step=1):
    return Bound("upper", coeff, (("", const),), step)


# name -> bounds (key c kept when every lower <= c <= every upper, each read at row r);
# Bound.value is the one definition both sides share, so each mask is also written out
MASKS = {
    "causal": ((_upper(1, 0),), lambda q, x: x <= q),
    "window 5": ((_upper(1, 0), _lower(1, -4)), lambda q, x: q - 5 < x <= q),
    "two-sided 3": ((_upper(1, 3), _lower(1, -3)), lambda q, x: abs(q - x) <= 3),
    "ahead 3": ((_lower(1, 0), _upper(1, 2)), lambda q, x: q <= x < q + 3),
    "chunks of 6": ((_lower(6, 0, 6), _upper(6, 5, 6)), lambda q, x: x // 6 == q // 6),
    "causal chunks of 7": ((_upper(1, 0), _lower(7, 0, 7), _upper(7, 6, 7)),
                           lambda q, x: x <= q and x // 7 == q // 7),
    "chunks of 4 and of 6": ((_lower(4, 0, 4), _upper(4, 3, 4), _lower(6, 0, 6), _upper(6, 5, 6)),
                             lambda q, x: x // 4 == q // 4 and x // 6 == q // 6),
    "a sink's floor, causal": ((_lower(0, 3), _upper(1, 2)), lambda q, x: 3 <= x <= q + 2),
    "falling": ((_upper(-1, 20), _lower(-2, 30)), lambda q, x: 30 - 2 * q <= x <= 20 - q),
    "steep": ((_upper(3, -5), _lower(2, 1)), lambda q, x: 2 * q + 1 <= x <= 3 * q - 5),
    "empty": ((_upper(1, -40),), lambda q, x: x <= q - 40),
}


def _matrix(keep, nq, nx):
    return np.array([[keep(q, x) for x in range(nx)] for q in range(nq)], dtype=np.int64)


@pytest.mark.parametrize("name", list(MASKS))
def test_rectangles_are_counted_pair_by_pair(name):
    """Random rectangles, empty ones and ones past a bound's crossing
    included, square, cross and ragged sizes: every count equals the pairs
    of the matrix written from the mask's formula."""
    bounds, keep = MASKS[name]
    rng = random.Random(name)
    for nq, nx in ((13, 13), (29, 31), (11, 40), (40, 7)):
        kept = _matrix(keep, nq, nx)
        # the bounds and the formula agree on every pair (so the check below counts the mask)
        for q in range(nq):
            lo = max([0] + [b.value(q, {}) for b in bounds if b.kind == "lower"])
            hi = min([nx - 1] + [b.value(q, {}) for b in bounds if b.kind == "upper"])
            assert kept[q].sum() == max(0, hi - lo + 1), (name, q)
        rects = []
        for _ in range(150):
            a, b, c, d = rng.randrange(nq + 1), rng.randrange(nq + 1), rng.randrange(nx + 1), rng.randrange(nx + 1)
            rects.append((min(a, b), max(a, b), min(c, d), max(c, d)))
        got = pairs.rect_pairs(bounds, {}, *(np.array(v) for v in zip(*rects)))
        assert [int(g) for g in got] == [int(kept[a:b, c:d].sum()) for a, b, c, d in rects], (name, nq, nx)
        assert pairs.kept(bounds, {}, nq, nx) == kept.sum()


def test_a_bound_reads_the_sizes_it_names():
    """x <= q + |x| - |q| (the keys' end aligned with the queries'): rest
    reads the sizes, so the count follows them."""
    bounds = (Bound("upper", 1, (("|x|", 1), ("|q|", -1))),)
    for nq, nx in ((10, 10), (6, 15), (15, 6)):
        want = sum(x <= q + nx - nq for q in range(nq) for x in range(nx))
        assert pairs.kept(bounds, {"q": nq, "x": nx}, nq, nx) == want


def test_a_huge_matrix_costs_no_pass_over_its_rows():
    """A causal window of 256 over 2^28 tokens, and chunks of 3000 with
    causal: the counts are the formulas' (a per-row pass took seconds)."""
    n, w = 1 << 28, 256
    window = (_upper(1, 0), _lower(1, 1 - w))
    assert pairs.kept(window, {}, n, n) == w * (w + 1) // 2 + (n - w) * w
    c = 3000
    chunks = (_upper(1, 0), _lower(c, 0, c), _upper(c, c - 1, c))
    whole, rest = divmod(n, c)
    assert pairs.kept(chunks, {}, n, n) == whole * c * (c + 1) // 2 + rest * (rest + 1) // 2


@pytest.mark.parametrize("kind", ["contiguous", "zigzag"])
@pytest.mark.parametrize("name", ["causal", "window 5", "two-sided 3", "causal chunks of 7", "falling"])
def test_ring_steps_count_every_rank_as_shard_pairs_does(kind, name):
    """pairs.ring_steps against ShardPairs.ring_steps (each rank's rows
    against each part's keys, one row at a time), every step, P = 2..6,
    ragged and cross lengths."""
    bounds, keep = MASKS[name]
    for nq, nx in ((37, 37), (23, 41), (50, 19)):
        lo = np.array([next((x for x in range(nx) if keep(q, x)), 0) for q in range(nq)])
        hi = np.array([max([x + 1 for x in range(nx) if keep(q, x)], default=0) for q in range(nq)])
        # every mask here keeps one run of keys a row: [lo, hi)
        assert all(_matrix(keep, nq, nx)[q].sum() == max(0, hi[q] - lo[q]) for q in range(nq))
        rows = ShardPairs(nq, nx, [(lo, np.maximum(hi, lo))])
        for p in range(2, 7):
            want = rows.ring_steps(kind, p)
            assert pairs.ring_steps(bounds, {}, kind, p, nq, nx, range(p)) == want, (p, nq, nx)


def test_layout_runs_are_the_layouts_positions():
    """Each part's runs hold the positions layouts.py gives it (a part's run
    list, documents._part_runs), empty ones past the end."""
    from napkin.documents import _part_runs
    for kind in ("contiguous", "zigzag"):
        for parts, length in ((4, 13), (3, 3), (5, 100), (8, 5)):
            first, stop = pairs.layout_runs(kind, parts, length)
            for p in range(parts):
                got = [(int(a), int(b)) for a, b in zip(first[p], stop[p]) if b > a]
                assert got == [r for r in _part_runs(kind, parts, length, p) if r[1] > r[0]], (kind, parts, p)
    with pytest.raises(ValueError, match="cyclic"):
        pairs.layout_runs("cyclic", 4, 16)


def test_random_conjunctions_of_bounds_are_counted_pair_by_pair():
    """Drawn conjunctions of one to four bounds, each lower or upper, its
    row coefficient -3..3, its step 1..5 and a constant -20..20 (so crossings
    fall inside, outside and between rows), over drawn rectangles: every
    count equals the pairs where every bound holds, each pair tested."""
    rng = random.Random(2026)
    for trial in range(300):
        bounds = tuple(Bound(rng.choice(("lower", "upper")), rng.randint(-3, 3), (("", rng.randint(-20, 20)),),
                             rng.choice((1, 1, 2, 3, 5))) for _ in range(rng.randint(1, 4)))
        nq, nx = rng.randint(1, 30), rng.randint(1, 30)
        kept = np.array([[all((x >= b.value(q, {})) if b.kind == "lower" else (x <= b.value(q, {})) for b in bounds)
                          for x in range(nx)] for q in range(nq)], dtype=np.int64)
        rects = []
        for _ in range(20):
            a, b, c, d = rng.randrange(nq + 1), rng.randrange(nq + 1), rng.randrange(nx + 1), rng.randrange(nx + 1)
            rects.append((min(a, b), max(a, b), min(c, d), max(c, d)))
        got = pairs.rect_pairs(bounds, {}, *(np.array(v) for v in zip(*rects)))
        assert [int(g) for g in got] == [int(kept[a:b, c:d].sum()) for a, b, c, d in rects], (trial, bounds)
