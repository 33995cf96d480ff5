"""Full and partial blocks: the kernels' loops split into masked edge blocks
and an unmasked fast loop (napkin/masks.py: exact_bounds, full_blocks,
full_row_blocks; codegen: bounds.loop_bounds/full_bounds, backward_emit._bounds_dkdv).

The interval functions are checked by brute force against classify_block,
block by block; the generated kernels against the float64 reference on
sizes that put blocks in every segment, and their source for the split.
"""
from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path

import pytest
import torch

import napkin
from napkin import ir, masks, visits
from napkin.codegen import emit_module, lower as L
from napkin.parse import parse
from spies import heaviest_first, program_block

REPO = Path(__file__).resolve().parent.parent
C = masks.BlockClass


def _pred(src: str) -> ir.Expr:
    d = parse("diagram t\nwire b, h, q, x\nwire d = 16\n"
              f"in A[q, x] : fp32\nS[q, x] = where({src}, A, -inf)\nout S")
    return masks.mask_predicate(masks.mask_node(d.lets[0].expr))


# --------------------------------------------------------------------------
# The full-block intervals, by brute force against classify_block.
# --------------------------------------------------------------------------

AFFINE = ["x <= q", "x <= q and q - x < 5", "x <= q and q - x < 40", "x <= q + |x| - |q|", "x >= q",
          "x == q", "x <= 2 * q", "x >= q - 3 and x <= q + 7", "x + q <= 50", "x >= 20 - q and x < 30",
          "x >= 9",
          # an or of bounds of one kind is one bound, their greatest (least) (masks._union)
          "x <= q or x < 20", "x <= q - 30 or x < 12 or x <= 2 * q - 70", "x >= q - 3 or x >= 40",
          "(x <= q or x < 20) and q - x < 30", "x < 2 or x + q <= 50"]
# chunks (x // n, q // n: a non-decreasing term of an index, masks.Bound.step)
FLOORED = ["x // 8 == q // 8", "x <= q and x // 8 == q // 8", "x // 5 <= q // 5", "x // 4 >= q // 4",
           "x // 8 == q // 8 and q - x < 5", "x >= q // 4 * 4", "x <= q // 3", "x // 3 < q // 7 + 2",
           "x // 6 == q", "x == q // 3", "x // 4 > q - 20", "x < 2 * (q // 5) + 1",
           "x // 8 <= q // 8 or x < 12", "x <= q // 3 or x <= q - 25"]
SHAPES = [(37, 100), (100, 37), (64, 64), (1, 1), (23, 9)]
BLOCKS = [(16, 16), (8, 4), (4, 8), (3, 5)]
TRUE = ir.Binary("<=", ir.Num(0), ir.Num(1))  # classify_block's stand-in for "no mask"


def _is_full(pred, r0, r1, c0, c1, nq, nx, whole_rows):
    """The definition: the tile inside the edges, the mask true at every pair."""
    if c1 > nx or (whole_rows and r1 > nq):
        return False
    ranges = {"q": (r0, min(r1, nq)), "x": (c0, c1)}
    return masks.classify_block(pred, ranges, {"q": nq, "x": nx}) is C.FULL


def _cases():
    for src, (nq, nx), (br, bc) in itertools.product(AFFINE + FLOORED + [None], SHAPES, BLOCKS):
        yield src, nq, nx, br, bc


@pytest.mark.parametrize("whole_rows", [False, True], ids=["forward", "dq"])
def test_full_blocks_are_exactly_the_blocks_classify_calls_full(whole_rows):
    for src, nq, nx, br, bc in _cases():
        pred = _pred(src) if src else TRUE
        sizes = {"q": nq, "x": nx}
        bounds = masks.exact_bounds(_pred(src) if src else None, "q", "x", sizes)
        assert bounds == masks.stream_bounds(pred, "q", "x", sizes) if src else bounds == ()
        split = visits.split_blocks(bounds, nq, nx, br, bc, sizes, whole_rows)
        # the same blocks as the loop visits today, in the same order
        assert [(i, j) for i, j, _ in split] == visits.visited_blocks(bounds, nq, nx, br, bc, sizes), src
        for i, j, full in split:
            want = _is_full(pred, i * br, i * br + br, j * bc, j * bc + bc, nq, nx, whole_rows)
            assert full == want, (src, nq, nx, br, bc, i, j)
        # partial blocks before, full blocks, partial blocks after: one run of full blocks per row block
        for i in range(-(-nq // br)):
            flags = "".join("F" if f else "p" for r, _, f in split if r == i)
            assert re.fullmatch("p*F*p*", flags), (src, i, flags)


def test_full_row_blocks_of_the_dkdv_loop_by_brute_force():
    for src, nq, nx, br, bc in _cases():
        pred = _pred(src) if src else TRUE
        sizes = {"q": nq, "x": nx}
        bounds = masks.exact_bounds(_pred(src) if src else None, "q", "x", sizes)
        split = visits.split_blocks_by_column(bounds, nq, nx, br, bc, sizes)
        assert [(i, j) for i, j, _ in split] == visits.visited_blocks_by_column(bounds, nq, nx, br, bc, sizes)
        for i, j, full in split:
            assert full == _is_full(pred, i * br, i * br + br, j * bc, j * bc + bc, nq, nx, True), \
                (src, nq, nx, br, bc, i, j)


def test_a_start_past_the_last_column_visits_no_block():
    """A window with more rows than columns (q - x < 32, 200 rows, 70 columns, blocks 128 x 64):
    rows 128..199 start at column 97 or later, past the last; rounded down, the forward visited
    the ragged block [64, 70) of masked pairs alone, and dK/dV (its block's nominal last column
    127 >= 97) its rows (costback hunt).  Both visit exactly the blocks with a live pair, as a
    brute force over every pair says, and the same set."""
    bounds = masks.exact_bounds(_pred("x <= q and q - x < 32"), "q", "x")
    for (nq, nx), (br, bc) in itertools.product([(200, 70), (70, 200), (131, 40), (64, 64)],
                                                [(128, 64), (64, 128), (16, 16), (32, 8)]):
        live = {(i, j) for i in range(-(-nq // br)) for j in range(-(-nx // bc))
                if any(x <= q and q - x < 32 for q in range(i * br, min(i * br + br, nq))
                       for x in range(j * bc, min(j * bc + bc, nx)))}
        forward = visits.visited_blocks(bounds, nq, nx, br, bc)
        assert set(forward) == live, (nq, nx, br, bc)
        assert set(visits.visited_blocks_by_column(bounds, nq, nx, br, bc)) == live, (nq, nx, br, bc)


def _keeps(src: str, q: int, x: int) -> bool:
    """The mask at one pair, by Python's own arithmetic (// floors)."""
    return eval(src, {"q": q, "x": x})


@pytest.mark.parametrize("src", FLOORED)
def test_chunked_masks_visit_exactly_the_blocks_with_a_kept_pair(src):
    """Each floored mask is a conjunction of bounds (exact_bounds), so the forward's loop and
    the dK/dV kernel's visit exactly the blocks holding a pair the mask keeps, by brute force
    over every pair, and a block is full exactly when it keeps every pair inside the edges."""
    pred = _pred(src)
    assert masks.exact_bounds(pred, "q", "x") is not None
    for (nq, nx), (br, bc) in itertools.product(SHAPES + [(70, 70)], BLOCKS + [(5, 3)]):
        bounds = masks.exact_bounds(pred, "q", "x")
        tiles = {(i, j): [_keeps(src, q, x) for q in range(i * br, min(i * br + br, nq))
                          for x in range(j * bc, min(j * bc + bc, nx))]
                 for i in range(-(-nq // br)) for j in range(-(-nx // bc))}
        live = {ij for ij, kept in tiles.items() if any(kept)}
        assert set(visits.visited_blocks(bounds, nq, nx, br, bc)) == live, (src, nq, nx, br, bc)
        assert sorted(visits.visited_blocks_by_column(bounds, nq, nx, br, bc)) == sorted(live)
        full = {(i, j) for (i, j), kept in tiles.items() if all(kept) and (j + 1) * bc <= nx}
        assert {(i, j) for i, j, f in visits.split_blocks(bounds, nq, nx, br, bc) if f} == full
        whole = {(i, j) for i, j in full if (i + 1) * br <= nq}
        assert {(i, j) for i, j, f in visits.split_blocks(bounds, nq, nx, br, bc, whole_rows=True) if f} == whole
        assert {(i, j) for i, j, f in visits.split_blocks_by_column(bounds, nq, nx, br, bc) if f} == whole


def test_a_chunk_is_two_bounds_on_the_chunk_of_the_row():
    """x // 128 == q // 128 keeps x in [128 * (q // 128), 128 * (q // 128) + 127]; a chunk
    length of a fixed wire folds; a symbolic one, an index not alone under //, or a floored
    index beside itself in one comparison gives no bound (every block visited, the mask applied)."""
    assert masks.exact_bounds(_pred("x // 128 == q // 128"), "q", "x") == (
        masks.Bound("upper", 128, (("", 127),), 128), masks.Bound("lower", 128, (), 128))
    assert masks.exact_bounds(_pred("x // |d| == q // |d|"), "q", "x", {"d": 16}) == (
        masks.Bound("upper", 16, (("", 15),), 16), masks.Bound("lower", 16, (), 16))
    for src in ["x // |h| == q // |h|", "x // 8 <= (q + 3) // 8", "x // 8 == q // 8 + q", "x + x // 2 <= q"]:
        assert masks.exact_bounds(_pred(src), "q", "x") is None, src


def test_small_cases_by_hand():
    causal = masks.exact_bounds(_pred("x <= q"), "q", "x")
    # rows 32..63 against 16-key blocks: keys 0..31 are full, 32..47 and 48..63 the diagonal
    assert visits.full_blocks(causal, 1, 100, 100, 32, 16) == (0, 32)
    assert visits.split_blocks(causal, 64, 64, 32, 16)[-4:] == [(1, 0, True), (1, 1, True), (1, 2, False),
                                                               (1, 3, False)]
    # no mask: every block but the ragged last one is full
    assert visits.split_blocks((), 10, 40, 16, 16) == [(0, 0, True), (0, 1, True), (0, 2, False)]
    # a window of 60 over 16-key blocks: rows 96..127 visit keys 32..127, of which only 80..95 are full
    window = masks.exact_bounds(_pred("x <= q and q - x < 60"), "q", "x")
    assert [f for i, _, f in visits.split_blocks(window, 128, 128, 32, 16) if i == 3] == \
        [False, False, False, True, False, False]
    # a window narrower than a block of rows has no full block
    narrow = masks.exact_bounds(_pred("x <= q and q - x < 20"), "q", "x")
    assert not any(f for *_, f in visits.split_blocks(narrow, 128, 128, 32, 16))
    # dK/dV of causal: per key block, the diagonal row blocks first, then full ones, the ragged rows last
    assert visits.split_blocks_by_column(causal, 70, 64, 16, 16)[:5] == \
        [(0, 0, False), (1, 0, True), (2, 0, True), (3, 0, True), (4, 0, False)]


def test_non_affine_or_inexact_masks_have_no_full_blocks():
    for src in ["doc[b, q] == doc", "x <= q and doc[b, q] == doc", "x <= q or x > q + 5", "x != q",
                "q >= 3 and x <= q", "x <= q + b", "not (x > q + b)"]:
        d = parse("diagram t\nwire b, h, q, x\nwire d = 16\nin doc[b, x] : int32\n"
                  f"in A[b, q, x] : fp32\nS[b, q, x] = where({src}, A, -inf)\nout S")
        pred = masks.mask_predicate(masks.mask_node(d.lets[0].expr))
        assert masks.exact_bounds(pred, "q", "x") is None, src


def test_a_written_not_has_the_bounds_of_its_flipped_comparison():
    # not (x > q) had none (every block partial); mask_predicate takes it through negate now
    bounds = []
    for src in ("not (x > q)", "x <= q"):
        d = parse(f"diagram t\nwire q, x\nin A[q, x] : fp32\nS[q, x] = where({src}, A, -inf)\nout S")
        bounds.append(masks.exact_bounds(masks.mask_predicate(masks.mask_node(d.lets[0].expr)), "q", "x"))
    assert bounds[0] is not None and bounds[0] == bounds[1]


# --------------------------------------------------------------------------
# The generated kernels.  Loads without a mask are a full block's (every
# other load of K or Q is masked): a spy on the interpreter's create_load
# tells which blocks each program ran through the unmasked loop.
# --------------------------------------------------------------------------

import contextlib  # noqa: E402

import numpy as np  # noqa: E402

import backward_helpers as tb  # noqa: E402  (its compile_text / accuracy rule)
import kernel_helpers as tk  # noqa: E402

FWD = {"block_q": 32, "block_x": 16}
BWD = {"block_q": 16, "block_x": 16}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("split")


def _module(name: str, folder, *replace):
    text = (REPO / "examples" / f"{name}.ncd").read_text()
    for old, new in replace:
        assert old in text
        text = text.replace(old, new)
    key = "split_" + re.sub(r"\W", "_", f"{name}_{replace}")
    return tb.compile_text(text, key, folder), napkin.load_text(text, f"{key}.ncd")


@contextlib.contextmanager
def _unmasked_loads(**watch):
    """{name: set of (program's block along grid axis 0, block along dim)} of
    the loads without a mask of each watched (tensor, dim, block[, reversed]):
    ``reversed`` when the kernel that loads it takes its blocks heaviest first
    (masks.program_order), whose program i then owns block n - 1 - i."""
    from triton.runtime import interpreter

    seen = {name: set() for name in watch}
    original = interpreter.InterpreterBuilder.create_load

    def spy(builder, ptr, *rest, **kw):
        addr = np.asarray(ptr.data).ravel().astype(np.int64)
        for name, (t, dim, block, *rev) in watch.items():
            pid = program_block(builder, bool(rev and rev[0]))
            start = t.data_ptr()
            inside = addr[(addr >= start) & (addr < start + t.numel() * t.element_size())]
            for off in set(((inside - start) // t.element_size()).tolist()):
                seen[name].add((pid, off // t.stride(dim) % t.shape[dim] // block))
        return original(builder, ptr, *rest, **kw)

    interpreter.InterpreterBuilder.create_load = spy
    try:
        yield seen
    finally:
        interpreter.InterpreterBuilder.create_load = original


def _split(diagram, sizes, br, bc, whole_rows=False, by_column=False):
    """visits.split_blocks (by_column: split_blocks_by_column) of the diagram's
    full bounds; a mask with none (a remainder is not a bound) finds its full
    blocks with the ranges prepass at run time, and the cases here give it
    none (a remainder keeps half the pairs of every tile): every visited block
    masked."""
    plan = L.lower(diagram)
    all_sizes = {w.name: w.size for w in diagram.wires if w.size is not None} | sizes
    nq, nx = sizes["q"], sizes["x"]
    if plan.full is None:
        visit = visits.visited_blocks_by_column if by_column else visits.visited_blocks
        return [(i, j, False) for i, j in visit(plan.bounds, nq, nx, br, bc, all_sizes)]
    if by_column:
        return visits.split_blocks_by_column(plan.full, nq, nx, br, bc, all_sizes)
    return visits.split_blocks(plan.full, nq, nx, br, bc, all_sizes, whole_rows)


WINDOW = "q - x < 256"
CAUSAL_GQA = ("sum[d](Q * K) * |d|^-0.5", "where(x <= q, sum[d](Q * K) * |d|^-0.5, -inf)")
CASES = [  # (example, text edits, sizes, which loops have full blocks): every segment, ragged edges, |q| != |x|
    ("attention", (), {"q": 37, "x": 100}, "fwd bwd"),
    ("attention", (), {"q": 20, "x": 64}, "fwd bwd"),            # no ragged key block: all full in the forward
    ("causal", (), {"q": 37, "x": 100}, "fwd bwd"),
    ("causal", (), {"q": 100, "x": 37}, "fwd bwd"),
    ("sliding_window", ((WINDOW, "q - x < 40"),), {"q": 100, "x": 100}, "fwd bwd"),  # width not a block multiple
    ("sliding_window", ((WINDOW, "q - x < 70"),), {"q": 70, "x": 100}, "fwd bwd"),
    ("sliding_window", ((WINDOW, "q - x < 48"),), {"q": 96, "x": 96}, "fwd bwd"),    # edges on block boundaries
    ("sliding_window", ((WINDOW, "q - x < 47"),), {"q": 96, "x": 96}, "bwd"),
    ("sliding_window", ((WINDOW, "q - x < 24"),), {"q": 90, "x": 90}, ""),           # straddles: none full
    ("decode", (), {"q": 5, "x": 100}, "fwd"),                   # x <= q + |x| - |q|; 5 rows: no whole row block
    ("decode", (), {"q": 37, "x": 100}, "fwd bwd"),
    ("decode", (), {"q": 37, "x": 51}, "fwd bwd"),                # row 0 sees 15 keys: one short of a block
    ("decode", (), {"q": 37, "x": 52}, "fwd bwd"),                # ... and exactly one
    ("gqa", (), {"q": 37, "x": 53}, "fwd bwd"),
    ("gqa", (CAUSAL_GQA,), {"q": 70, "x": 45}, "fwd bwd"),
    ("sliding_window", ((WINDOW, "x // 48 == q // 48"),), {"q": 100, "x": 100}, "fwd bwd"),  # chunked causal
    ("sliding_window", (("x <= q and " + WINDOW, "x // 48 == q // 48"),), {"q": 90, "x": 100}, "fwd bwd"),
    ("sliding_window", ((WINDOW, "q - x < 40 and (x - q) % 3 == 0"),), {"q": 100, "x": 90}, ""),  # dilated: no full
    # a prefix of 40 seen by every row (a prefix-LM's): x <= max(q, 39), one bound (masks._union)
    ("causal", (("x <= q", "x <= q or x < 40"),), {"q": 100, "x": 100}, "fwd bwd"),
    ("causal", (("x <= q", "x <= q or x < 48"),), {"q": 70, "x": 90}, "fwd bwd"),
    # whole float constants in index arithmetic: Triton's // of 48.0 was a float division (a crash)
    ("sliding_window", ((WINDOW, "x // 48.0 == q // 48 and (q - x) % 2.0 == 0"),), {"q": 100, "x": 100}, ""),
]


def _ids(case):
    name, edits, sizes, _ = case
    mark = "_causal" if CAUSAL_GQA in edits else "_" + re.sub(r"\D", "", edits[0][1]) if edits else ""
    return f"{name}{mark}_{sizes['q']}x{sizes['x']}"


@pytest.mark.parametrize("case", CASES, ids=[_ids(c) for c in CASES])
def test_forward_runs_exactly_the_full_blocks_unmasked_and_matches_float64(case, folder):
    name, edits, sizes, has_full = case
    m, diagram = _module(name, folder, *edits)
    sizes = {"b": 1, "h": 1, "hk": 1, "g": 2, **sizes}
    split = _split(diagram, sizes, FWD["block_q"], FWD["block_x"])
    for dtype in (torch.float32, torch.float16):
        inputs = m.example_inputs(sizes, dtype=dtype, seed=3)
        k = inputs[[t.name for t in diagram.inputs].index("K")]
        with _unmasked_loads(K=(k, 2, FWD["block_x"], heaviest_first(L.lower(diagram).bounds)[0])) as seen:
            out = tk.run(m, inputs, **FWD)
        assert seen["K"] == {(i, j) for i, j, full in split if full}
        tk.assert_accurate(out, tk.reference(m, inputs, torch.float64), tk.reference(m, inputs), _ids(case))
    assert any(full for *_, full in split) == ("fwd" in has_full)
    assert all(full for *_, full in split) == (name == "attention" and sizes["x"] % FWD["block_x"] == 0)


@pytest.mark.parametrize("case", [c for c in CASES if c[0] != "attention" or c[2]["x"] == 100],
                         ids=[_ids(c) for c in CASES if c[0] != "attention" or c[2]["x"] == 100])
def test_backward_runs_exactly_the_full_blocks_unmasked_and_matches_float64(case, folder):
    name, edits, sizes, has_full = case
    m, diagram = _module(name, folder, *edits)
    sizes = {"b": 1, "h": 1, "hk": 1, "g": 2, **sizes}
    br, bc = BWD["block_q"], BWD["block_x"]
    inputs = m.example_inputs(sizes, dtype=torch.float32, seed=5)
    xs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = tb.launcher(m)(*xs, **BWD)
    out = out if isinstance(out, tuple) else (out,)
    gen = torch.Generator().manual_seed(7)
    loss = sum(torch.where(torch.isfinite(o.double()), o.double() * torch.randn(o.shape, generator=gen,
                                                                                  dtype=torch.float64), 0.0).sum()
               for o in out)
    names = [t.name for t in diagram.inputs]
    q, k = xs[names.index("Q")], xs[names.index("K")]
    rows_reversed, keys_reversed = heaviest_first(L.lower(diagram).bounds)
    with _unmasked_loads(Q=(q, 2, br, keys_reversed), K=(k, 2, bc, rows_reversed)) as seen:
        loss.backward()
    dq_full = {(i, j) for i, j, full in _split(diagram, sizes, br, bc, whole_rows=True) if full}
    dkdv_full = {(j, i) for i, j, full in _split(diagram, sizes, br, bc, by_column=True) if full}
    assert seen["K"] == dq_full and seen["Q"] == dkdv_full
    assert bool(dq_full) == bool(dkdv_full) == ("bwd" in has_full)
    exact = tb.gradients(m.reference, [t.double() for t in inputs])
    tb.assert_accurate([x.grad for x in xs], exact, tb.gradients(m.reference, inputs), _ids(case))


def _kernel_loop_list(source: str, kernel: str) -> list:
    """[((range start, range stop), loop body source)] of a kernel's loops, in order."""
    fn = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == kernel)
    return [(tuple(ast.unparse(a) for a in node.iter.args[:2]), "\n".join(ast.unparse(s) for s in node.body))
            for node in ast.walk(fn)
            if isinstance(node, ast.For) and isinstance(node.iter, ast.Call) and len(node.iter.args) >= 2]


def _kernel_loops(source: str, kernel: str) -> dict:
    """{(range start, range stop): loop body source} of a kernel's loops."""
    return dict(_kernel_loop_list(source, kernel))


def _emit(name: str) -> str:
    path = REPO / "examples" / f"{name}.ncd"
    return emit_module(napkin.load(path), source_text=path.read_text(), source_path=str(path))


def test_causal_source_has_an_unmasked_loop_then_the_diagonal():
    source = _emit("causal")
    mask = "tl.where(_idx_x[None, :] <= _idx_q[:, None]"
    transposed = "tl.where(_idx_x[:, None] <= _idx_q[None, :]"  # dK/dV's tiles are [x, q]
    # -inf only in the guards that do not depend on the mask: the forward's all -inf running max;
    # dK/dV's lse of -inf, on each row block's lse (dQ guards its rows' lse once, before the loop)
    for kernel, full, partial, mask, guards in [
            ("_causal_kernel", ("_lo", "_fhi"), ("_fhi", "_hi"), mask, 1),
            ("_causal_bwd_dq_kernel", ("_lo", "_fhi"), ("_fhi", "_hi"), mask, 0),
            ("_causal_bwd_dkdv_kernel", ("_flo", "_fhi"), ("_lo", "_flo"), transposed, 1)]:
        loops = _kernel_loops(source, kernel)
        # no mask, no bounds: no where() on an index or a bounds mask, no masked load
        assert not re.search(r"tl\.where\(\(?_(idx|ok)", loops[full]) and "_ok" not in loops[full], kernel
        assert "mask=" not in loops[full], kernel
        assert loops[full].count("float('-inf')") == guards, kernel
        assert mask in loops[partial] and "mask=" in loops[partial], kernel
    # the forward: no partial blocks before the full ones (causal has no lower bound)
    assert set(_kernel_loops(source, "_causal_kernel")) == {("_lo", "_fhi"), ("_fhi", "_hi")}
    # a sliding window has partial blocks on both sides
    window = _kernel_loops(_emit("sliding_window"), "_sliding_window_kernel")
    assert set(window) == {("_lo", "_flo"), ("_flo", "_fhi"), ("_fhi", "_hi")}
    assert window[("_flo", "_fhi")].count("float('-inf')") == 1  # the running max's guard only
    assert all(window[k].count("float('-inf')") == 3 for k in [("_lo", "_flo"), ("_fhi", "_hi")])


def test_document_mask_loops_over_the_ranges_prepass():
    """A mask that reads data has no formula for its blocks: the ranges
    prepass (codegen/ranges.py) finds them, and the forward walks its two
    lists (from _pa to _pb): the full blocks, with a step that reads no ids
    and has no mask, then the partial ones, masked."""
    source = _emit("document_mask")
    assert "def _document_mask_ranges_kernel(" in source
    loops = _kernel_loop_list(source, "_document_mask_kernel")
    assert [key for key, _ in loops] == [("_pa", "_pb"), ("_pa", "_pb")]
    full, partial = (body for _, body in loops)
    assert full.startswith("_start = tl.load(_fl + _iv) * _BLOCK_x if _RANGES else _iv\n")
    assert "_doc" not in full and "mask=" not in full and "_ok" not in full
    assert partial.startswith("_start = tl.load(_rl + _iv) * _BLOCK_x if _RANGES else _iv\n")
    assert "_doc == _doc_1" in partial


def test_attention_runs_all_but_the_ragged_last_block_unmasked(folder):
    m, _ = _module("attention", folder)
    for nx, want in [(100, range(6)), (96, range(6)), (15, range(0))]:
        inputs = m.example_inputs({"b": 1, "h": 1, "q": 40, "x": nx}, dtype=torch.float32)
        with _unmasked_loads(K=(inputs[1], 2, 16)) as seen:
            tk.run(m, inputs, **FWD)
        assert seen["K"] == {(i, j) for i in range(2) for j in want}, nx


def test_rows_at_positions_keep_the_full_blocks_keys_at_positions_mask_every_block(folder):
    """Rows at positions bound a tile by their least and greatest real
    position (the mask's bounds are monotone in the row), so at their own
    offsets they find the plain launch's full blocks; keys at positions are
    known only once loaded: every block is masked."""
    m, _ = _module("causal", folder)
    q, k, v = m.example_inputs({"b": 1, "h": 1, "q": 48, "x": 48}, dtype=torch.float32)
    with _unmasked_loads(K=(k, 2, 16)) as seen:
        plain = m.causal(q, k, v, **FWD)
    assert seen["K"]
    for wire, unmasked in (("q", seen["K"]), ("x", set())):
        with _unmasked_loads(K=(k, 2, 16)) as seen_at:
            got = m.causal(q, k, v, **FWD, positions={wire: torch.arange(48)}, lengths={wire: 48})
        assert seen_at["K"] == unmasked, wire
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, plain))
    # rows at other positions: the later half of a sequence of 96, each block's keys up to its rows
    with _unmasked_loads(K=(k, 2, 16)) as seen_at:
        got = m.causal(q, k, v, **FWD, positions={"q": torch.arange(48) + 48}, lengths={"q": 96})
    assert seen_at["K"] == {(i, j) for i in range(2) for j in range(3)}   # every key block, whole
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
    torch.testing.assert_close(got[0].double(), want, rtol=1e-5, atol=1e-5)   # they see every key


def test_a_kept_branch_without_the_tiles_wires_is_broadcast(folder):
    """In a full block where(x <= q, 2.0, 1.0) is the scalar 2.0: the step
    broadcasts it back to the tile (emit._full, with the mask as known)."""
    text = """diagram weighted
wire b, h, q, x
wire d = 16
in Q[b, h, q, d] : fp32
in K[b, h, x, d] : fp32
in V[b, h, x, d] : fp32
S[b, h, q, x] = where(x <= q, sum[d](Q * K) * |d|^-0.5, -inf)
W[b, h, q, x] = exp(S) * where(x <= q, 2.0, 1.0)
O[b, h, q, d] = sum[x](W * V) / sum[x](W)
n[b, h, q] = sum[x](W)
out O, n
schedule on h100 {
  accumulate fp32
  level hbm { hold Q, K, V, O, n }
  level smem {
    group b by 1, h by 1, q by 32
    stream x by 16
    hold S, W
  }
}
"""
    m = tb.compile_text(text, "split_weighted", folder)
    assert L.lower(napkin.load_text(text, "w.ncd")).full  # the split applies
    loops = _kernel_loops((folder / "split_weighted.py").read_text(), "_weighted_kernel")
    assert "tl.full([_BLOCK_q, _BLOCK_x], 2.0, tl.float32)" in loops[("_lo", "_fhi")]
    inputs = m.example_inputs({"b": 1, "h": 2, "q": 45, "x": 70}, dtype=torch.float32)
    out = tk.run(m, inputs, **FWD)
    tk.assert_accurate(out, tk.reference(m, inputs, torch.float64), tk.reference(m, inputs), "weighted")


# --------------------------------------------------------------------------
# Program order: the heaviest blocks first (masks.work_grows / program_order).
# --------------------------------------------------------------------------

def _per_block(pairs, axis):
    counts = {}
    for pair in pairs:
        counts[pair[axis]] = counts.get(pair[axis], 0) + 1
    return counts


@pytest.mark.parametrize("src", AFFINE)
def test_work_grows_only_where_later_blocks_visit_at_least_as_many(src):
    bounds = masks.stream_bounds(_pred(src), "q", "x")
    for grid, axis in (("row", 0), ("col", 1)):
        if not masks.work_grows(bounds, grid):
            continue
        for (nq, nx), (br, bc) in itertools.product(SHAPES, BLOCKS):
            sizes = {"q": nq, "x": nx}
            pairs = visits.visited_blocks(bounds, nq, nx, br, bc, sizes)
            n = -(-(nq if axis == 0 else nx) // (br if axis == 0 else bc))
            counts = [_per_block(pairs, axis).get(i, 0) for i in range(n)]
            whole = counts[:-1] if (nq if axis == 0 else nx) % (br if axis == 0 else bc) else counts
            assert whole == sorted(whole), (src, grid, nq, nx, br, bc, counts)


def test_program_order_reverses_causal_rows_and_nothing_else():
    order = {src: tuple(masks.work_grows(masks.stream_bounds(_pred(src), "q", "x"), g) for g in ("row", "col"))
             for src in ("x <= q", "x >= q", "x >= q - 3 and x <= q + 7", "x == q", "x >= 9")}
    assert order == {"x <= q": (True, False), "x >= q": (False, True), "x >= q - 3 and x <= q + 7": (False, False),
                     "x == q": (False, False), "x >= 9": (False, False)}
    assert masks.program_order((), "row") == "tl.program_id(0)"
    causal, window = ((REPO / "examples" / f"{n}.ncd").read_text() for n in ("causal", "sliding_window"))
    causal = emit_module(napkin.load_text(causal, "causal.ncd"), source_text=causal, source_path="causal.ncd")
    window = emit_module(napkin.load_text(window, "w.ncd"), source_text=window, source_path="w.ncd")
    reversed_pid = "_pid = tl.num_programs(0) - 1 - tl.program_id(0)"
    # the forward and dQ kernels (one program per row block) start with the longest rows; dK/dV
    # (one per key block) already does: its first key block visits every row block
    assert causal.count(reversed_pid) == 2
    dkdv = causal[causal.index("def _causal_bwd_dkdv_kernel"):causal.index("def _causal_bwd_dq_kernel")]
    assert reversed_pid not in dkdv and "_pid = tl.program_id(0)" in dkdv
    assert reversed_pid not in window
