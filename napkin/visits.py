"""Visits: which blocks of a score matrix the kernels' loops visit.

The loops' bounds come from the mask (``masks.stream_bounds`` solves its
affine conjuncts for the streamed wire, as ``masks.Bound``s); this module
holds the pure functions, in Python, that give the very blocks the kernels
visit with them, so the code generator, the cost pass and the tests agree:

* ``stream_range(...)``: [start, stop) of the streamed wire for a block of
  rows, the formula the kernel's loop renders; ``visited_blocks(...)`` the
  (row block, col block) pairs that loop visits.
* ``row_block_range(...)`` / ``visited_blocks_by_column(...)``: the same set
  seen from a block of the streamed wire (the backward's dK/dV loop).
* ``full_blocks(...)`` / ``full_row_blocks(...)`` / ``split_blocks(...)``:
  which of those blocks are FULL (the mask true on the whole tile, inside
  the ragged edges), which the kernels run without the mask.
* ``tile_live(...)`` / ``live_blocks(...)``: with rows at global positions
  (the distributed wrappers' shares), which tiles the kernels load and
  compute, decided per tile from the positions' least and greatest.

Ranges are half-open ``(start, stop)`` like Python's ``range``.
"""
from __future__ import annotations

from typing import Mapping, Optional

from .masks import Bound, rest_value


def stream_range(bounds: tuple[Bound, ...], row_start: int, row_stop: int,
                 col_size: int, sizes: Mapping[str, int]) -> tuple[int, int]:
    """[start, stop) of the streamed index for rows [row_start, row_stop)
    (already clipped to the row size), before rounding start to a block.
    The kernel computes exactly this (see codegen's rendering of Bound)."""
    return _col_range(bounds, row_start, row_stop, col_size, sizes, tightest=False)


def _col_range(bounds: tuple[Bound, ...], row_start: int, row_stop: int, col_size: int,
               sizes: Mapping[str, int], tightest: bool) -> tuple[int, int]:
    """[start, stop) of the streamed indices meeting every bound at the rows'
    loosest end (some row of the block keeps them: the visited range) or at
    their tightest end (every row keeps them: the full range)."""
    first, last = row_start, row_stop - 1
    start, stop = 0, col_size
    for b in bounds:
        loosest_first = b.at_row() == "first"
        r = first if loosest_first != tightest else last
        value = b.value(r, sizes)
        if b.kind == "lower":
            start = max(start, value)
        else:
            stop = min(stop, value + 1)
    if not tightest and start >= col_size:
        # past the last column: no block (rounded down, start fell in a ragged last block
        # whose every pair is masked: a window with more rows than columns visited it)
        return 0, 0
    return start, stop


def visited_blocks(bounds: tuple[Bound, ...], row_size: int, col_size: int,
                   block_row: int, block_col: int,
                   sizes: Mapping[str, int] = {}) -> list[tuple[int, int]]:
    """(row block, col block) pairs the kernel's loop visits, in order.  With
    no bounds that is every pair; ``sizes`` binds the ``|w|`` in the bounds."""
    out = []
    for i in range(-(-row_size // block_row)):
        row_start = i * block_row
        start, stop = stream_range(bounds, row_start, min(row_start + block_row, row_size),
                                   col_size, sizes)
        first = (start // block_col) * block_col
        out.extend((i, j // block_col) for j in range(first, stop, block_col))
    return out


# --------------------------------------------------------------------------
# The same visited set seen from a block of the streamed wire: the backward
# pass's dK/dV kernel gives each program a block j of the streamed wire and
# loops over row blocks, and must visit exactly the (row block, j) pairs the
# forward visits (visited_blocks), no more (it would add masked work) and no
# fewer (it would drop gradient).
#
# The forward visits (i, j) iff  start_i // bc <= j  and  j * bc < stop_i,
# with start_i the largest lower bound (and 0) and stop_i the smallest upper
# bound plus one (and the column size).  Split per bound, each condition is
# monotone in the row that bound is evaluated at (a block's first or last
# row, both non-decreasing in i), so each bound keeps a half-line of row
# blocks and the visited rows of column block j are one interval [lo, hi).
# Every division below has a non-negative numerator (clamped first) and a
# positive divisor, so floor division means the same in Python and Triton.
# --------------------------------------------------------------------------

def row_block_range(bounds: tuple[Bound, ...], col_block: int, row_size: int, col_size: int,
                    block_row: int, block_col: int, sizes: Mapping[str, int] = {}) -> tuple[int, int]:
    """[lo, hi) of the row blocks whose forward loop visits column block
    ``col_block``; the code generator renders this same formula in Triton.
    A lower bound is met by the block's last real column (a ragged last
    block's ends at ``col_size``), as the forward visits no block once its
    start passes the last column."""
    nblocks = -(-row_size // block_row)
    lo, hi = 0, nblocks
    for b in bounds:
        span = _some_form([_visiting_rows(p, col_block, row_size, col_size, block_row, block_col, sizes)
                           for p in b.parts])
        if span is None:
            return 0, 0
        lo, hi = max(lo, span[0]), min(hi, span[1])
    return lo, max(lo, hi)


def _some_form(spans: list) -> Optional[tuple[int, int]]:
    """The run of row blocks where some form of a bound holds: the union of the forms'
    runs (one form's is its own), each [lo, all) or [0, hi) (a union's forms slope one
    way, masks._union, so the union is one run); None where no form has any."""
    spans = [s for s in spans if s is not None]
    return (min(s[0] for s in spans), max(s[1] for s in spans)) if spans else None


def _visiting_rows(b: Bound, col_block: int, row_size: int, col_size: int, block_row: int, block_col: int,
                   sizes: Mapping[str, int]) -> Optional[tuple[int, int]]:
    """[lo, hi) of the row blocks whose loop the one form ``b`` lets visit column
    block ``col_block`` (a half-line of them: [lo, all) or [0, hi)); None for none."""
    nblocks = -(-row_size // block_row)
    a, c = b.row_coeff, rest_value(b.rest, sizes)
    if b.kind == "upper":          # visited iff a * s + c >= j * bc, s = r // step
        need = col_block * block_col - c
    else:                          # visited iff a * s + c <= (j + 1) * bc - 1
        need = c - min((col_block + 1) * block_col, col_size) + 1
        a = -a                     # the same as -a * s - c >= -(j + 1) * bc + 1
    # now: visited iff a * s >= need, r the bound's row of the block
    if a == 0:
        return None if need > 0 else (0, nblocks)
    if a > 0:                      # s >= ceil(need / a): r is the block's last row
        t = b.first_row((max(need, 0) + a - 1) // a)
        return nblocks if t >= row_size else t // block_row, nblocks
    if need > 0:                   # s <= floor(-need / |a|): r is the block's first row
        return None
    return 0, b.last_row((-need) // (-a)) // block_row + 1


def visited_blocks_by_column(bounds: tuple[Bound, ...], row_size: int, col_size: int,
                             block_row: int, block_col: int,
                             sizes: Mapping[str, int] = {}) -> list[tuple[int, int]]:
    """(row block, col block) pairs the backward's column-major loop visits,
    column block by column block; as a set it equals ``visited_blocks``."""
    out = []
    for j in range(-(-col_size // block_col)):
        lo, hi = row_block_range(bounds, j, row_size, col_size, block_row, block_col, sizes)
        out.extend((i, j) for i in range(lo, hi))
    return out


# --------------------------------------------------------------------------
# Full blocks.  A visited block is FULL when every (row, column) pair of its
# tile satisfies every conjunct of the mask and lies inside the ragged edges;
# the kernels run full blocks through a copy of their step with the mask
# taken as true and no bounds masks on the loop wire, which removes the mask
# and bound arithmetic from them.  Partial blocks keep the masked step.
#
# Full blocks are known only when the mask is exactly a conjunction of
# affine bounds (``exact_bounds``); with no mask at all that is the empty
# conjunction, and every block inside the edges is full.  Each bound then
# holds on the whole tile iff it holds at the tile's TIGHTEST row (the other
# end from the loosest one ``stream_range`` uses) and its tightest column,
# so for one block of the rows the full blocks of the loop wire are one
# interval, which splits the visited interval into partial blocks before,
# full blocks, and partial blocks after.  The same Python formula is
# rendered in Triton by the code generator (bounds.full_bounds and
# backward_emit._bounds_dkdv), as stream_range and row_block_range are.
# --------------------------------------------------------------------------

def full_range(bounds: tuple[Bound, ...], row_start: int, row_stop: int,
               col_size: int, sizes: Mapping[str, int]) -> tuple[int, int]:
    """[start, stop) of the streamed indices inside [0, col_size) at which
    every bound holds for every row of [row_start, row_stop)."""
    return _col_range(bounds, row_start, row_stop, col_size, sizes, tightest=True)


def full_blocks(bounds: tuple[Bound, ...], row_block: int, row_size: int, col_size: int,
                block_row: int, block_col: int, sizes: Mapping[str, int] = {},
                whole_rows: bool = False) -> tuple[int, int]:
    """[lo, hi): the starts (block multiples, step block_col) of the full
    blocks row block ``row_block`` visits, clamped into its visited
    [start // block_col * block_col, stop) so that the loops [start, lo),
    [lo, hi), [hi, stop) visit exactly its visited blocks.  ``whole_rows``
    (the backward, whose tiles sum over rows): a ragged row block has none."""
    r0 = row_block * block_row
    r1 = min(r0 + block_row, row_size)
    vstart, vstop = stream_range(bounds, r0, r1, col_size, sizes)
    fstart, fstop = full_range(bounds, r0, r1, col_size, sizes)
    lo = vstart // block_col * block_col
    if any(b.kind == "lower" for b in bounds):
        lo = min(max(-(-fstart // block_col) * block_col, lo), vstop)
    hi = max(min(max(fstop, 0) // block_col * block_col, vstop), lo)
    if whole_rows and r0 + block_row > row_size:
        hi = lo
    return lo, hi


def split_blocks(bounds: tuple[Bound, ...], row_size: int, col_size: int, block_row: int, block_col: int,
                 sizes: Mapping[str, int] = {}, whole_rows: bool = False) -> list[tuple[int, int, bool]]:
    """(row block, col block, full) for each block the forward (or dQ) loops
    visit, in their order: partial blocks before, full blocks, partial
    blocks after.  As pairs this is ``visited_blocks``, order included."""
    out = []
    for i in range(-(-row_size // block_row)):
        row_start = i * block_row
        start, stop = stream_range(bounds, row_start, min(row_start + block_row, row_size), col_size, sizes)
        lo, hi = full_blocks(bounds, i, row_size, col_size, block_row, block_col, sizes, whole_rows)
        for a, b, full in ((start // block_col * block_col, lo, False), (lo, hi, True), (hi, stop, False)):
            out.extend((i, j // block_col, full) for j in range(a, b, block_col))
    return out


def full_row_blocks(bounds: tuple[Bound, ...], col_block: int, row_size: int, col_size: int,
                    block_row: int, block_col: int, sizes: Mapping[str, int] = {}) -> tuple[int, int]:
    """[lo, hi) of the row blocks whose tile with column block ``col_block``
    is full (every row and column inside the edges, every bound true at
    every pair), clamped into row_block_range's [lo, hi) as full_blocks is.

    Each bound, written ``a * r >= need`` for every row r of the block and
    the column that binds it hardest (the block's last column for an upper
    bound, its first for a lower one), keeps a half-line of row blocks:
    a > 0 binds at the block's first row, a < 0 at its last.  Numerators
    are clamped non-negative before dividing (Triton's // truncates)."""
    vlo, vhi = row_block_range(bounds, col_block, row_size, col_size, block_row, block_col, sizes)
    c0, c1 = col_block * block_col, (col_block + 1) * block_col - 1
    nblocks = -(-row_size // block_row)
    lo, hi = 0, (row_size // block_row if c1 < col_size else 0)
    for b in bounds:
        # a union (masks._union) holds at every pair where some form does at every pair
        span = _some_form([_full_rows(p, c0, c1, nblocks, block_row, sizes) for p in b.parts])
        lo, hi = (max(lo, span[0]), min(hi, span[1])) if span is not None else (lo, 0)
    lo = min(max(lo, vlo), vhi)
    return lo, max(min(hi, vhi), lo)


def _full_rows(b: Bound, c0: int, c1: int, nblocks: int, block_row: int,
               sizes: Mapping[str, int]) -> Optional[tuple[int, int]]:
    """[lo, hi) of the row blocks at every row of which the one form ``b`` holds for
    every key of [c0, c1] (a half-line of them); None for none."""
    a, c = b.row_coeff, rest_value(b.rest, sizes)
    a, need = (a, c1 - c) if b.kind == "upper" else (-a, c - c0)
    if a == 0:
        return None if need > 0 else (0, nblocks)
    if a > 0:
        t = b.first_row((max(need, 0) + a - 1) // a)       # the first row that satisfies it
        return (t + block_row - 1) // block_row, nblocks
    return None if need > 0 else (0, (b.last_row(max(-need, 0) // -a) + 1) // block_row)


def split_blocks_by_column(bounds: tuple[Bound, ...], row_size: int, col_size: int, block_row: int,
                           block_col: int, sizes: Mapping[str, int] = {}) -> list[tuple[int, int, bool]]:
    """(row block, col block, full) in the dK/dV kernel's loop order; as
    pairs this is ``visited_blocks_by_column``."""
    out = []
    for j in range(-(-col_size // block_col)):
        vlo, vhi = row_block_range(bounds, j, row_size, col_size, block_row, block_col, sizes)
        lo, hi = full_row_blocks(bounds, j, row_size, col_size, block_row, block_col, sizes)
        for a, b, full in ((vlo, lo, False), (lo, hi, True), (hi, vhi, False)):
            out.extend((i, j, full) for i in range(a, b))
    return out


# --------------------------------------------------------------------------
# Tiles at global positions.  The launcher's positions= put each local row
# of the row wire and of the streamed wire at a global index (the
# distributed wrappers' zigzag or cyclic shares): a block of local rows is
# then any set of indices, known to the kernel only once it loads them.  A
# tile is dead when no pair of it can survive the mask: it has no real row
# or no real key (indices >= the global length are padding), or one bound
# is false at every pair.  A bound is monotone in the row and in the key,
# so it is false at every pair iff false at its loosest pair: the least key
# for an upper bound (the greatest for a lower one) and the row at_row()
# names.  The kernels render this test term for term (codegen/bounds.py
# live) and load and compute only live tiles.  It is exact for one bound;
# with several (a window) a tile whose indices are not contiguous may meet
# each bound at some pair but all of them at none, and is kept.
# --------------------------------------------------------------------------

def tile_live(bounds: tuple[Bound, ...], rows, cols, sizes: Mapping[str, int] = {}) -> bool:
    """Whether a tile whose real rows and keys sit at the global indices
    ``rows`` and ``cols`` may hold a pair that survives the mask;
    ``sizes`` binds the ``|w|`` in the bounds (the global lengths)."""
    rows, cols = list(rows), list(cols)
    if not rows or not cols:
        return False
    at = {"first": min(rows), "last": max(rows)}
    for b in bounds:
        value = b.value(at[b.at_row()], sizes)
        if (min(cols) > value) if b.kind == "upper" else (max(cols) < value):
            return False
    return True


def live_blocks(bounds: tuple[Bound, ...], row_pos, col_pos, row_len: int, col_len: int,
                block_row: int, block_col: int, sizes: Mapping[str, int] = {}) -> set[tuple[int, int]]:
    """The (row block, col block) pairs of local blocks whose tile
    ``tile_live`` keeps: ``row_pos`` / ``col_pos`` give the global index of
    each local row (indices >= ``row_len`` / ``col_len`` are padding)."""
    row_pos, col_pos = [int(p) for p in row_pos], [int(p) for p in col_pos]

    def real(pos, n, block, i):
        return [p for p in pos[i * block:(i + 1) * block] if p < n]

    out = set()
    for i in range(-(-len(row_pos) // block_row)):
        rows = real(row_pos, row_len, block_row, i)
        for j in range(-(-len(col_pos) // block_col)):
            if tile_live(bounds, rows, real(col_pos, col_len, block_col, j), sizes):
                out.add((i, j))
    return out


# --------------------------------------------------------------------------
# The blocks the ranges prepass keeps (a mask with no formula for its
# blocks, codegen/ranges.py): per row block the span from the first live
# block to the last, less every dead run between two live ones (the kernels
# walk the list of live blocks).
# --------------------------------------------------------------------------

def rows_of_block(i: int, block: int, rows: int, cycle: Optional[int]) -> list[tuple[int, int]]:
    """The row positions of row block ``i`` as runs [first, stop): the rows'
    own, or with packed rows (``cycle`` = |q|, rows (g, q) at position q)
    the one or two runs of q its (g, q) pairs cover."""
    r0, r1 = i * block, min((i + 1) * block, rows)
    if cycle is None:
        return [(r0, r1)]
    if r1 - r0 >= cycle:
        return [(0, cycle)]
    a, b = r0 % cycle, (r1 - 1) % cycle + 1
    return [(a, b)] if r0 // cycle == (r1 - 1) // cycle else [(a, cycle), (0, b)]


def dead_runs(runs) -> tuple[tuple[int, int], ...]:
    """Every [g0, g1) of blocks between the [first, stop) runs (sorted by
    first) that no run holds, in order: the blocks the kernels' lists leave out."""
    out, reach = [], None
    for a, b in runs:
        if reach is not None and a > reach:
            out.append((reach, a))
        reach = b if reach is None else max(reach, b)
    return tuple(out)


def prepass_blocks(runs_of, count: int):
    """(spans, holes) of ``count`` blocks, block i's live blocks of the other
    wire the [first, stop) runs ``runs_of(i)`` hold: their span ((0, 0) for
    none) and the dead runs inside it, what the ranges prepass lists for it."""
    from .cost.model import MAX_ROW_BLOCKS, too_many

    too_many(count, MAX_ROW_BLOCKS, "a masked loop's row blocks")
    spans, holes = [], []
    for i in range(count):
        runs = sorted(r for r in runs_of(i) if r[0] < r[1])
        spans.append((runs[0][0], max(b for _, b in runs)) if runs else (0, 0))
        holes.append(dead_runs(runs))
    return tuple(spans), tuple(holes)


# A mask of indices alone (an or of cuts) is counted row by row: each row's
# kept keys are exact, where a conjunction's loop formula at a block's
# loosest rows (stream_range) is not once its bounds are loosest at opposite
# ends or leave some rows empty, and a cut with a key coefficient of 2 has no
# loop formula.  In numpy, this many rows at a time; past MAX_OR_ROWS rows
# times conjunctions it refuses.
_CHUNK = 1 << 18
MAX_OR_ROWS = 1 << 27


def prepass_visits(disjuncts, row_size: int, col_size: int, block_row: int, block_col: int,
                   sizes: Mapping[str, int], cycle: Optional[int] = None):
    """(spans, holes) per row block for a mask that is an ``or`` of
    conjunctions of cuts (masks.disjunct_cuts): a (row block, key block)
    tile is live where some conjunction holds on a real pair of it, as the
    prepass tests it, and the kernels visit each row block's live blocks.
    Each row's kept keys are one run per conjunction (each cut solved for
    the key at that row), so the live
    blocks of a row block are the union of its rows' runs.  ``cycle``:
    packed rows (g, q), each at position q, as documents.row_visits."""
    return _union_blocks(disjuncts, lambda cuts, rows: _row_keys(cuts, rows, col_size, sizes, cycle),
                         row_size, block_row, block_col)


def prepass_full(disjuncts, row_size: int, col_size: int, block_row: int, block_col: int,
                 sizes: Mapping[str, int], cycle: Optional[int] = None, whole_rows: bool = False):
    """Per row block, the runs of key blocks the prepass finds full for such a
    mask (full_runs): each row's kept keys, one run per conjunction."""
    import numpy as np

    def kept(rows):
        runs = [_row_keys(cuts, rows, col_size, sizes, cycle) for cuts in disjuncts]
        return np.stack([lo for lo, _ in runs]), np.stack([hi for _, hi in runs])
    return full_runs(kept, row_size, block_row, block_col, col_size, whole_rows)


def _row_keys(cuts, rows, col_size: int, sizes: Mapping[str, int], cycle: Optional[int]):
    """[lo, hi] per row of the keys one conjunction of cuts keeps, each row at its position."""
    pos = rows if cycle is None else rows % cycle
    return _kept(((c.col_coeff, c.col_step, c.row_coeff * (pos // c.row_step) + rest_value(c.rest, sizes))
                  for c in cuts), rows, col_size)


def prepass_column_visits(disjuncts, row_size: int, col_size: int, block_row: int, block_col: int,
                          sizes: Mapping[str, int]):
    """prepass_visits seen from the key blocks (the dK/dV kernel's loop, the
    prepass run by column): each key's kept rows are one run per
    conjunction (each cut solved for the row at that key), and a key
    block's live row blocks are the union of its keys' runs."""

    def rows(cuts, cols):
        return _kept(((c.row_coeff, c.row_step, c.col_coeff * (cols // c.col_step) + rest_value(c.rest, sizes))
                      for c in cuts), cols, row_size)
    return _union_blocks(disjuncts, rows, col_size, block_col, block_row)


def _kept(terms, lines, size: int):
    """[lo, hi] per line of the indices v in [0, size) that keep every
    ``a * (v // n) + other <= 0`` (``terms``: (a, n, other) with ``other``
    the rest of the cut at each line), empty where lo > hi."""
    import numpy as np

    lo, hi = np.zeros_like(lines), np.full_like(lines, size - 1)
    for a, n, other in terms:
        m = -other                                   # a * (v // n) <= m
        if a > 0:                                    # v // n <= floor(m / a): up to that block's last
            hi = np.minimum(hi, (m // a) * n + n - 1)
        elif a < 0:                                  # v // n >= ceil(m / a) = -floor(m / -a)
            lo = np.maximum(lo, -(m // -a) * n)
        else:                                        # no v: kept everywhere or nowhere
            hi = np.where(m >= 0, hi, -1)
    return lo, hi


def _union_blocks(disjuncts, runs_of_lines, lines: int, block: int, other_block: int):
    """(spans, holes) per block of ``block`` lines: the union over its lines
    and the conjunctions of each line's run [lo, hi] of the other wire
    (``runs_of_lines(cuts, line indices)``, empty where lo > hi), in
    blocks of ``other_block``.  Lines go ``_CHUNK`` (whole blocks) at a time:
    each chunk's runs sorted by (block, start), merged where they meet."""
    import numpy as np

    from .cost.model import too_many

    count = -(-lines // block)
    too_many(lines * len(disjuncts), MAX_OR_ROWS, "the rows of a mask of indices (once per conjunction)")
    found: dict[int, list] = {}
    chunk = max(_CHUNK // block, 1) * block
    for first in range(0, lines, chunk):
        idx = np.arange(first, min(first + chunk, lines), dtype=np.int64)
        parts = []
        for cuts in disjuncts:
            lo, hi = runs_of_lines(cuts, idx)
            keep = lo <= hi
            parts.append((idx[keep] // block, lo[keep] // other_block, hi[keep] // other_block + 1))
        blk, lo, hi = (np.concatenate(p) for p in zip(*parts))
        if not len(blk):
            continue
        # one key per (block, position): a block's runs sort after every earlier block's
        width = int(hi.max()) + 1
        order = np.lexsort((lo, blk))
        start, stop = blk[order] * width + lo[order], blk[order] * width + hi[order]
        reach = np.maximum.accumulate(stop)
        new = np.ones(len(start), dtype=bool)
        new[1:] = start[1:] > reach[:-1]
        heads = np.flatnonzero(new)
        ends = reach[np.append(heads[1:], len(start)) - 1]
        for b, a, z in zip((start[heads] // width).tolist(), (start[heads] % width).tolist(),
                           (ends - (start[heads] // width) * width).tolist()):
            found.setdefault(b, []).append((a, z))
    return prepass_blocks(lambda i: found.get(i, ()), count)


# The full blocks the prepass lists (its tile state 2): a (row block, key
# block) tile every real row of which keeps every key, the key block whole
# (inside |x|) and, for the backward (``whole_rows``), the row block whole.
# Counted from each row's kept keys, as spans are: a row's runs merged, each
# cut to the key blocks it holds whole, and a key block full where all of a
# block's rows hold it (a sweep over the runs' ends, a count per row block).

def full_runs(kept, rows: int, block_row: int, block_col: int, col_size: int, whole_rows: bool = False):
    """Per row block, the [j0, j1) runs of key blocks full in it, in order.
    ``kept(idx)``: (lo, hi) arrays [runs, len(idx)], row idx's kept keys
    [lo, hi] inclusive (empty where lo > hi), its runs in any order."""
    import numpy as np

    count = -(-rows // block_row)
    found: dict[int, list] = {}
    whole_cols = col_size // block_col
    chunk = max(_CHUNK // block_row, 1) * block_row
    for first in range(0, rows, chunk):
        idx = np.arange(first, min(first + chunk, rows), dtype=np.int64)
        lo, hi = (np.atleast_2d(a) for a in kept(idx))
        blk, j0, j1 = _whole_blocks(lo, hi, idx // block_row, block_col, whole_cols)
        if not len(blk):
            continue
        # +1 at a run's first block, -1 past its last; a block is full where the count is its rows'
        key = np.concatenate([blk, blk]) * (whole_cols + 1) + np.concatenate([j0, j1])
        pos, delta = np.unique(key, return_inverse=True)
        total = np.bincount(delta, weights=np.concatenate([np.ones(len(j0)), -np.ones(len(j1))]))
        level = np.cumsum(total)   # each row block's deltas sum to 0: the count restarts at its first key
        b, at = pos // (whole_cols + 1), pos % (whole_cols + 1)
        lines = np.minimum(block_row, rows - b * block_row)
        full = (level[:-1] == lines[:-1]) & (b[1:] == b[:-1])
        if whole_rows:
            full &= lines[:-1] == block_row
        for i, a, z in zip(b[:-1][full].tolist(), at[:-1][full].tolist(), at[1:][full].tolist()):
            found.setdefault(i, []).append((a, z))
    return tuple(tuple(found.get(i, ())) for i in range(count))


def _whole_blocks(lo, hi, blk, block_col: int, whole_cols: int):
    """(row block, j0, j1) of each row's merged runs of kept keys, cut to the
    whole key blocks [j0, j1) each holds (none dropped: j0 < j1)."""
    import numpy as np

    big = np.iinfo(np.int64).max // 4
    lo = np.where(lo <= hi, lo, big)   # an empty run sorts last and merges with nothing
    order = np.argsort(lo, axis=0, kind="stable")
    lo, hi = np.take_along_axis(lo, order, 0), np.take_along_axis(hi, order, 0)
    out = []
    cur_lo, cur_hi = lo[0], hi[0]
    for k in range(1, lo.shape[0]):   # runs in order of start: join those that touch
        joins = (lo[k] != big) & (lo[k] <= cur_hi + 1)
        out.append((cur_lo[~joins], cur_hi[~joins], blk[~joins]))
        cur_lo = np.where(joins, cur_lo, lo[k])
        cur_hi = np.where(joins, np.maximum(cur_hi, hi[k]), hi[k])
    out.append((cur_lo, cur_hi, blk))
    a, z, b = (np.concatenate(p) for p in zip(*out))
    j0, j1 = -(-a // block_col), np.minimum((z + 1) // block_col, whole_cols)
    keep = (a != big) & (j0 < j1)
    return b[keep], j0[keep], j1[keep]
