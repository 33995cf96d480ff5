"""The mask's affine bounds (napkin/masks.py's ``Bound``) rendered in Triton.

Each function here is one of napkin/visits.py's formulas written out term for term,
so a kernel visits exactly the blocks the Python side computes (the cost
pass counts with it, the tests brute-force it):

* ``loop_bounds``: the streamed range [_lo, _hi) of a block of rows
  (visits.stream_range), then the full blocks [_flo, _fhi) among them
  (``full_bounds``, visits.full_blocks): the forward's and the dQ kernel's.
  Rows at global positions give the range from the least and greatest real
  row (exact: the bounds are monotone in the row index).
* ``live``: for a tile whose loop-wire positions were just loaded, whether
  some pair of it can survive the mask (visits.tile_live): the loads and the
  step of a dead tile are skipped.  Positions are known only once loaded,
  so this is decided per tile at run time, where the range decides it
  before the loop without positions.

A mask that reads data (document ids) has no bound here: its blocks come
from the ranges prepass at run time (ranges.py).

``extremes`` renders the least and greatest real global index of a block
at positions, which both read.  The dK/dV kernel's row-block range is
backward_emit._bounds_dkdv (visits.row_block_range).
"""
from __future__ import annotations

from .. import masks

# Above any global index: the least of an empty set of rows.
_NONE_LEAST = 2 ** 62


# A bound that reads a length input (masks.length_key) is computed in int64 from the length's
# load and clipped before it meets int32 block arithmetic: a length is data, and w = 2**31 - 1
# for "no window" is a fair value, whose q + w wraps in int32.  Clipping to [-2**30, 2**30] keeps
# every comparison with an index below 2**29 (as the constants' _BOUND_LIMIT presumes) as it was.
_CLIP = 2 ** 30


def length_vars(bounds, loads) -> dict[str, str]:
    """{``@n``: variable} for the lengths ``bounds`` read: each one's load before the loop
    (phase "pre": it has neither tile wire), which the masked step reads too, and which the
    emitter's _Names renders in place of a size (emit._Names.read_lengths)."""
    out = {}
    for name in masks.lengths_read(bounds):
        var = next((ld.var for ld in loads if ld.tensor == name and ld.phase == "pre"), None)
        if var is None:
            raise AssertionError(f"the bounds read the length {name}, which the kernel does not load before its loop")
        out[masks.length_key(name)] = var
    return out


def _term(key: str, size) -> str:
    """One key of a rest: a size ``|w|`` by ``size(w)``, a length ``@n`` by ``size("@n")``
    (the emitter's _Names: its load's variable, widened to int64)."""
    return f"{size(key)}.to(tl.int64)" if key.startswith("@") else size(key[1:-1])


def _rest_terms(b: masks.Bound, size) -> list[str]:
    return [str(v) if key == "" else _term(key, size) if v == 1 else
            f"-{_term(key, size)}" if v == -1 and key.startswith("@") else f"{v} * {_term(key, size)}"
            for key, v in b.rest]


def _sum(terms: list[str]) -> str:
    return (" + ".join(terms) or "0").replace("+ -", "- ")


def _clipped(b: masks.Bound, value: str) -> str:
    """``value`` as int32, clipped to [-_CLIP, _CLIP] where the bound reads a length (_CLIP)."""
    return f"tl.minimum(tl.maximum({value}, {-_CLIP}), {_CLIP}).to(tl.int32)" if b.lengths_read else value


def row_term(b: masks.Bound, r: str) -> list[str]:
    """row_coeff * (r // step), no term when row_coeff is 0; ``r`` is a row
    index (never negative: Triton's // truncates, Python's floors)."""
    r = r if b.step == 1 else f"({r} // {b.step})"
    return [] if b.row_coeff == 0 else [r if b.row_coeff == 1 else f"{b.row_coeff} * {r}"]


def affine(b: masks.Bound, r: str, size) -> str:
    """row_coeff * (r // step) + rest, the sizes rendered by ``size`` (clipped: _CLIP); of a
    union (masks.Bound.alts) its parts' greatest (upper) or least (lower), each at ``r``:
    the rows' end that is loosest or tightest for one part is for every part."""
    values = [_clipped(p, _sum(row_term(p, r) + _rest_terms(p, size))) for p in b.parts]
    pick = "tl.maximum" if b.kind == "upper" else "tl.minimum"
    out = values[0]
    for v in values[1:]:
        out = f"{pick}({out}, {v})"
    return out


def rest(b: masks.Bound, size) -> str:
    """The bound's terms without the row, in parentheses: ``(|x| - |q|)``
    with the sizes rendered by ``size`` (clipped: _CLIP)."""
    return f"({_clipped(b, _sum(_rest_terms(b, size)))})"


def text(b: masks.Bound, col: str, row: str) -> str:
    """The bound as a comment reads it: ``x <= q + |x| - |q|``, ``x <= n - 1``, a union's
    ``x <= max(q, p - 1)``."""
    def term(key, v):
        name = key[1:] if key.startswith("@") else key
        return str(v) if key == "" else name if v == 1 else f"-{name}" if v == -1 and name != key \
            else f"{v} * {name}"

    def form(p):
        terms = [term(key, v) for key, v in sorted(p.rest, key=lambda kv: kv[0] == "")]   # the constant last
        return _sum(row_term(p, row) + terms)
    forms = ", ".join(form(p) for p in b.parts)
    return f"{col} {'>=' if b.kind == 'lower' else '<='} " + \
        (f"{'max' if b.kind == 'upper' else 'min'}({forms})" if b.alts else forms)


def ends(bounds, side: str) -> set:
    """Which extremes ("first": least, "last": greatest) of the rows
    (``side`` "row") or of the keys ("col") the bounds read: a bound is
    loosest at the row its at_row() names, and an upper bound on the key
    binds at the least key, a lower one at the greatest."""
    if side == "row":
        return {b.at_row() for b in bounds if b.row_coeff != 0}
    return {"first" if b.kind == "upper" else "last" for b in bounds}


def extremes(side: str, wire: str, real: str, need) -> list[str]:
    """_<side>_first / _<side>_last: the least and greatest global index
    _idx_<wire> where ``real`` holds (2**62 / -1 when nowhere).  The greatest
    is always computed: it is how a block of padding alone is told."""
    lines = [f"_{side}_first = tl.min(tl.where({real}, _idx_{wire}, {_NONE_LEAST}), 0)"] if "first" in need else []
    return lines + [f"_{side}_last = tl.max(tl.where({real}, _idx_{wire}, -1), 0)"]


def loop_bounds(names, plan, whole_rows: bool = False) -> str:
    """The streamed range [_lo, _hi) from the mask's affine bounds: the same
    formula as napkin.visits.stream_range, so the kernel visits exactly
    visits.visited_blocks; then the full blocks among them (full_bounds).
    With rows at positions a program of padding rows alone visits nothing;
    with keys at positions the range is every block and the loop tests each
    tile (``live``)."""
    row, col = plan.row, plan.col
    lines = ["_lo = 0", f"_hi = {names.size(col)}"]
    need = ends(plan.bounds, "row")
    if not plan.bounds:
        lines[0] += f"  # {'no mask' if plan.skip is None else 'the mask has no affine bound'}: every block"
    if "first" in need:
        lines.append("_row_first = _row0")
    if "last" in need:
        lines.append(f"_row_last = tl.minimum(_row0 + {names.block(row)}, {names.size(row)}) - 1")
    lines.append(f"if _POS_{row}:  # rows at global positions: the least and greatest real one")
    lines += ["    " + line for line in extremes("row", row, f"_gok_{row}", need)]
    lines.append("    _hi = tl.where(_row_last < 0, 0, _hi)  # padding rows alone: no block")
    if not plan.bounds:
        return "\n".join(lines + full_bounds(names, plan, whole_rows, need))
    # keys at global positions: a block's are known only once loaded, so
    # the range is every block and the loop tests each tile (live())
    lines.append(f"if not _POS_{col}:")
    indent = len(lines)
    lower = False
    for b in plan.bounds:
        r = "_row_first" if b.at_row() == "first" else "_row_last"
        value = affine(b, r, names.length)
        why = f"{text(b, col, row)}, loosest at the block's {b.at_row()} row"
        if b.kind == "lower":
            lower = True
            lines.append(f"_lo = tl.maximum(_lo, {value})  # {why}")
        else:
            lines.append(f"_hi = tl.minimum(_hi, {value} + 1)  # {why}")
    if lower:
        # a start past the last key: no block (rounded down it fell in a ragged last block
        # of masked pairs alone); visits.stream_range's (0, 0)
        lines.append(f"_hi = tl.where(_lo >= {names.size(col)}, 0, _hi)  # starts past the last {col}: no block")
        lines.append(f"_lo = _lo // {names.block(col)} * {names.block(col)}")
    lines[indent:] = ["    " + line for line in lines[indent:]]
    return "\n".join(lines + full_bounds(names, plan, whole_rows, need))


def full_bounds(names, plan, whole_rows: bool, have: set) -> list[str]:
    """[_flo, _fhi): the full blocks among the visited ones, the formula of
    napkin.visits.full_blocks term for term (each bound at the block's
    tightest row).  None when keys sit at global positions: the partial
    loops then cover [_lo, _hi).  Rows at positions (packed rows, a device's
    share) bound the tile by their least and greatest real position, as
    the affine bounds are monotone in the row.  ``whole_rows``: the
    backward's, where a ragged block of rows has none, nor has a block of
    rows at positions.  ``have``: the extremes of the rows ("first",
    "last") loop_bounds already set for every program, with or without
    positions; only the others are computed here.  _flo is only defined
    when a lower bound can put partial blocks first."""
    if plan.full is None:
        return []
    row, col = plan.row, plan.col
    br, bc = names.block(row), names.block(col)
    lower = any(b.kind == "lower" for b in plan.full)
    first = "_flo" if lower else "_lo"
    lines = ["# Of those, the full blocks [_flo, _fhi): the mask holds at every (row, column) pair of the",
             "# tile and it lies inside the edges (visits.full_blocks): they skip the mask and bound arithmetic."]
    lines += ["_flo = _lo"] if lower else []
    if whole_rows:
        lines += ["_fhi = _lo  # rows or keys at global positions: none known full",
                  f"if not _POS_{row}:", f"    if not _POS_{col}:"]
    else:  # rows at positions bound the tile by their least and greatest real one
        lines += ["_fhi = _lo  # keys at global positions: none known full", f"if not _POS_{col}:"]
    inner = ["_flo = 0"] if lower else []
    tight = {"last" if b.at_row() == "first" else "first" for b in plan.full or () if b.row_coeff != 0}
    row_first = "_row0"
    if not whole_rows and tight:
        # the rows' least and greatest index: their offsets, or with rows at positions their
        # real ones'; those loop_bounds set already (``have``) hold the same values.  An end set
        # here is set whole, so with rows at positions a _row_last loop_bounds took only there
        # (extremes always takes it) is taken again: the same value, where skipping it would
        # need a branch on _POS for the offsets' alone
        row_first = "_row_first" if "first" in tight else row_first
        again = tight - set(have)
        if again:
            inner += (["_row_first = _row0"] if "first" in again else []) \
                + ([f"_row_last = tl.minimum(_row0 + {br}, {names.size(row)}) - 1"] if "last" in again else []) \
                + [f"if _POS_{row}:"] + ["    " + line for line in extremes("row", row, f"_gok_{row}", again)
                                        if "last" in again or not line.startswith("_row_last")]
    if not plan.full:
        inner.append(f"_fhi = {names.size(col)} // {bc} * {bc}  # no mask: every block but a ragged last one")
    else:
        inner.append(f"_fhi = {names.size(col)}")
        if whole_rows and "last" not in have and "last" in tight:
            inner.append(f"_row_last = tl.minimum(_row0 + {br}, {names.size(row)}) - 1")
        for b in plan.full:
            tight_at = "last" if b.at_row() == "first" else "first"
            value = affine(b, "_row_last" if tight_at == "last" else row_first, names.length)
            why = f"{text(b, col, row)} at every row: tightest at the block's {tight_at}"
            if b.kind == "lower":
                inner.append(f"_flo = tl.maximum(_flo, {value})  # {why}")
            else:
                inner.append(f"_fhi = tl.minimum(_fhi, {value} + 1)  # {why}")
        if lower:
            inner.append(f"_flo = tl.minimum(tl.maximum(tl.cdiv(_flo, {bc}) * {bc}, _lo), _hi)")
        inner.append(f"_fhi = tl.maximum(tl.minimum(tl.maximum(_fhi, 0) // {bc} * {bc}, _hi), {first})")
    if whole_rows:
        inner.append(f"_fhi = tl.where(_row0 + {br} <= {names.size(row)}, _fhi, {first})"
                     "  # summed over rows: a ragged block of them has none")
    return lines + [("        " if whole_rows else "    ") + line for line in inner]


def live(names, plan, loop: str) -> list[str]:
    """Lines setting _live, for the tile just reached whose ``loop`` wire
    (the keys in the forward and dQ loops, the rows in dK/dV's) sits at
    positions loaded this step: visits.tile_live term for term.  The tile is
    dead when it has no real row of the loop wire (the other side's
    emptiness empties the whole range) or when one bound is false at every
    pair, which it is iff false at the pair where it is loosest: the least
    key for an upper bound, the greatest for a lower one, and the row its
    at_row() names.  The other side's extremes come from the program's
    bounds (loop_bounds, backward_emit._bounds_dkdv): its positions'
    when it has them, else its offsets'.  Only the bounds of a mask whose
    masked scores contribute nothing are there (plan.bounds is empty
    otherwise): then only emptiness skips."""
    row, col = plan.row, plan.col
    side = "row" if loop == row else "col"
    real = f"_gok_{row}" if side == "row" else f"_ok_{col}"
    lines = [f"# a dead tile (no real {loop}, or a bound of the mask false at every pair): no load, no step"]
    lines += extremes(side, loop, real, ends(plan.bounds, side))
    lines.append(f"_live = _{side}_last >= 0  # some real {loop}")
    least = {"first": "least", "last": "greatest"}
    for b in plan.bounds:
        value = affine(b, f"_row_{b.at_row()}", names.length)
        key = "first" if b.kind == "upper" else "last"
        test = f"_col_first <= {value}" if b.kind == "upper" else f"_col_last >= {value}"
        lines.append(f"_live = _live & ({test})  # {text(b, col, row)} somewhere: at the {least[key]} {col} "
                     f"and the {least[b.at_row()]} {row}")
    return lines
