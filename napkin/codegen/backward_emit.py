"""Backward plan (backward.py) -> the text of its kernels and launchers.

Each kernel is a fixed skeleton (templates/training.py.jinja: program ids,
offsets, pre-loop loads, the loop nest, stores) around generated code: the
rule's tile expressions rendered by exprs.py exactly as the forward's are,
the tl.dot contractions, the gradient accumulations and the loop bounds.

A loop kernel's tiles are oriented [resident wire, loop wire] (backward.Kernel):
[rows, x] in the dQ kernel, as the forward's (q -> ``_offs_q[:, None]``,
x -> ``_offs_x[None, :]``), and [x, rows] in the dK/dV kernel, which
computes the transposed scores S^T = K Q^T as FlashAttention-2 does (x ->
``_offs_x[:, None]``, q -> ``_offs_q[None, :]``; the row state, lse and
delta, loads as [1, rows]).  Either way every gradient is
``tile @ operand``, a product over the loop's wire with the tile as the
score product leaves it: transposing an accumulated tile to feed the
product (dK += dS^T Q in the [rows, x] orientation) costs registers and
shared memory, and made the dK/dV kernel spill on Hopper.  One rendering,
parameterised by the orientation (``_tile``), serves both.  Outside the
ragged edges a tile factor is zeroed before it enters a product, so padded
rows and keys add nothing (not even a NaN from exp of a padded score
against a real row's lse).  Every product is taken in the kernel dtype (the
first input's: fp16 / bf16 inputs give 16-bit tensor core dots, as the
forward's) and accumulated in float32.

The loops split as the forward's (emit.segments): full blocks, whose every
row and key is real and whose mask holds on the whole tile, run the step
without the mask and without _ok; the partial ones around them the masked
step.  Both loops load the same tiles, but a full step nothing only the
mask reads (a data mask's ids).  A mask that reads data takes its ranges
from the prepass (ranges.py), at dQ's and dK/dV's own blocks.
"""
from __future__ import annotations

import math
from typing import Optional

from .. import ir, masks
from . import bounds as B
from . import emit as E
from . import lower as L
from . import ranges as R
from . import tma as T
from .backward import BackwardPlan, Kernel
from .backward_hold import (DEFAULT_TILE, HELD_FP32, grad_dt, held_terms, product_dt, wide_operands,
                            wide_precision, widens)
from .exprs import triton
from .kernel_names import joined, stride


# The dQ kernel's per-row sum of dS, for the centred side gradients (backward._Builder.centre).
DS_ROWS = "_ds_rows"


class _BackwardNames(E._Names):
    """emit._Names for the backward kernels, where the row wire may lie on
    either axis of a tile: an integer input read along the rows at global
    positions is masked by ``_gok_<row>`` (real and inside the global
    length) on whichever axis it lies; along x by ``_ok_x``, which the
    kernels set that way."""

    def __init__(self, d: ir.Diagram, dims, positional, row: str):
        super().__init__(d, dims, positional)
        self.row = row

    def mask(self, rows, cols, glob: bool = False, inside=(), unit: bool = False) -> list[str]:
        parts = []
        for w, axis in ((rows, self.axis(True, unit)), (cols, self.axis(False, unit))):
            if w is None or w in inside:
                continue
            if glob and w == self.row and w in self.positional:
                parts.append(f"_gok_{w}{axis}")  # also inside the global length
            elif not self.exact(w):
                parts.append(f"_ok_{w}{axis}")
        return parts


def _step_load(d: ir.Diagram, names: E._Names, ld: L.Load, inside: tuple, tma: Optional[T.Tma],
               loop_wire: str) -> str:
    """A step's load (its statement lines, newline-separated), padded query
    rows dropped (emit._load's drop_padding); ``inside``: wires in bounds.
    A float row vector along the loop wire (the dK/dV kernel's lse and
    delta, [1, rows]) is loaded as [1, rows, 1] and summed
    over its unit axis: the same values, but the sum stops Triton's layout
    propagation at the load.  Loaded as [1, rows], Triton 3.6 gives it the
    layout of the score tile it meets, the wgmma accumulator's: 8 values a
    thread at 32 rows, each with an address of its own and a cp.async of 4
    bytes (Triton 3.9 copies it one value a thread into shared memory and
    reads it back in that layout).  That spilled the dK/dV kernels of GQA
    and sliding window on 3.6 at head dim 128.  Behind the sum the load is
    one value a thread on both; the sum's result then moves to the tile's
    layout through shared memory.  Compiled for sm_90 (napkin.bench.aot,
    bench/results/aot-sm90-2026-11-21-4.md), registers a thread of the
    bundled dK/dV kernels: at head dim 128, 3.6 -24 to +16 (document mask
    222 -> 238) and 3.9 -8 to +10; at 64, 3.6 -36 to +6 and 3.9 -18 to +20
    (ReLU^2 223 -> 243); no new spill.  Loaded as a column [rows, 1] and
    transposed instead, 3.9 was unchanged at 128, but 3.6 spilled GQA's
    dK/dV at 64 (372 B)."""
    if ld.rows is not None or ld.cols != loop_wire or E._kinds(d).get(ld.tensor) != "float":
        # the plain load, or both forms under _TMA (codegen/tma.py)
        return E._load(d, names, ld, inside, tma, drop_padding=True)["code"]
    load = E._load(d, names, ld, inside, drop_padding=True, unit=True)
    return f"{ld.var} = tl.sum(tl.load({load['ptr']}{load['mask']}), 2)  # one value a thread: backward_emit._step_load"


def _tile(k: Kernel) -> tuple[str, str]:
    """A loop kernel's tile orientation, its [rows, cols] wires: the resident
    (grid) wire, then the loop's."""
    return k.grid_wire, k.loop_wire


def _real(plan: BackwardPlan, w: str) -> str:
    """The mask of w's real indices: padded rows of q are dropped by _gok_q,
    padded keys by _ok_x (both set in _globals)."""
    return f"_gok_{w}" if w == plan.row else f"_ok_{w}"


def _dot(a: str, b: str, plan: BackwardPlan, dt: str = "") -> str:
    if widens(plan, dt):  # the launcher's choice: wide_precision
        return f"tl.dot({a}, {b}, input_precision=_WIDE)"
    return f'tl.dot({a}, {b}, input_precision="{plan.forward.precision}")'


def _tensors(plan: BackwardPlan, k: Kernel) -> list[str]:
    """Pointer arguments: what the kernel loads, then what it stores; a loop
    kernel also takes Q, whose dtype is its products' (product_dt), loaded or not
    (an unnormalised sum[x](S * V) has a dQ that never reads Q)."""
    out = []
    for name in [ld.tensor for ld in k.loads] + [g.buffer for g in k.grads] + [s.buffer for s in k.sides] \
            + [st.tensor for st in k.stores] + ([plan.typed] if k.role != "rows" else []):
        if name not in out:
            out.append(name)
    return out


def _params(plan: BackwardPlan, k: Kernel, blocks: list[str]) -> tuple[list[str], list[str]]:
    d = plan.diagram
    tensors = _tensors(plan, k)
    sizes = [f"_size_{w.name}" for w in d.wires if w.size is None]
    strides = []
    for t in tensors:
        if t.startswith("_part_"):
            side = next(s for s in k.sides if s.buffer == t)
            strides += [stride(t, w) for w in side.extra + side.wires]
        else:
            strides += [stride(t, w) for w in ir.axis_wires(d.tensor(t).axes)]
    return tensors + sizes + strides + [f"{b}: tl.constexpr" for b in blocks], sizes


def _offsets(names: E._Names, w: str, start: str) -> list[str]:
    return [f"_offs_{w} = {start} + tl.arange(0, {names.block(w)})",
            f"_ok_{w} = _offs_{w} < {names.size(w)}"]


def _globals(w: str, row: str, live=()) -> list[str]:
    """The global index _idx_w of each local row of w (the launcher's
    positions, else its offset), as the forward kernel sets it.  Keys at
    positions outside [0, |x|) are padding: _ok_x drops them (their loads read zeros).
    Query rows there are padding too, but their dQ must still be stored:
    _gok_q drops them from the tiles (and masks integer loads) instead.
    ``live``: w is the loop's wire, and these lines (bounds.live) set _live
    from its positions; without them _live is the constant True."""
    if w == row:
        lines = [f"if _POS_{w}:  # the global index of each row, given by the launcher",
                 f"    _idx_{w} = tl.load(_pos_{w} + _offs_{w}, mask=_ok_{w}, other=0)",
                 f"    _gok_{w} = _ok_{w} & (_idx_{w} >= 0) & (_idx_{w} < _len_{w})"]
        other = [f"    _idx_{w} = _offs_{w}", f"    _gok_{w} = _ok_{w}"]
    else:
        lines = [f"if _POS_{w}:  # global positions; rows outside [0, |{w}|) are padding",
                 f"    _idx_{w} = tl.load(_pos_{w} + _offs_{w}, mask=_ok_{w}, other=0)",
                 f"    _ok_{w} = _ok_{w} & (_idx_{w} >= 0) & (_idx_{w} < _len_{w})"]
        other = [f"    _idx_{w} = _offs_{w}"]
    return lines + ["    " + line for line in live] + ["else:"] + other \
        + ([f"    {E.LIVE_CONSTANT}"] if live else [])


def _dims(names: E._Names, dims) -> list[str]:
    lines = []
    for w in dims:
        lines.append(f"_offs_{w} = tl.arange(0, {names.block(w)})")
        if not names.exact(w):
            lines.append(f"_ok_{w} = _offs_{w} < {names.size(w)}  # {w} padded to a power of two")
    return lines


def _ctx(plan: BackwardPlan, names: E._Names, k: Kernel, skip: str = "", full: bool = False):
    subst = {n: v for n, v in k.subst if v != skip}
    known = E.known(plan.forward) if full else frozenset()
    return names.ctx(*_tile(k), subst, E._kinds(plan.diagram), known)


def _tile_lines(plan: BackwardPlan, names: E._Names, k: Kernel, full: bool = False) -> list[str]:
    """The step: recompute the score tile, then each binding the kernel needs.
    ``full``: a full block's step, the same text with the mask taken as true
    and no bounds masks (_ok): every row and key of its tile is real."""
    lines = _row_lines(plan, names, k, "step")
    d = plan.diagram
    scores = 0
    for dot in k.dots:
        dt = product_dt(plan, dot.lhs.tensor, dot.rhs.tensor)
        lhs, rhs = dot.lhs.var, dot.rhs.var
        if dot.var == "_qk":  # the scores, taken as the forward's are (E.dot_operands: in the wider dtype)
            lhs, rhs = E.dot_operands(lhs, d.tensor(dot.lhs.tensor).dtype, rhs, d.tensor(dot.rhs.tensor).dtype)
            # several contractions (MLA's) add up in one tile, as the forward's do
            exact = E.as_float(d.tensor(dot.lhs.tensor).dtype, d.tensor(dot.rhs.tensor).dtype)
            lines.append(f"{dot.var} {'+=' if scores else '='} {_dot(lhs, f'tl.trans({rhs})', plan)}{exact}")
            scores += 1
        else:
            lines.append(f"{dot.var} = {_dot(f'{lhs}.to({dt})', f'tl.trans({rhs}.to({dt}))', plan, dt)}")
    for var, e in k.lines:
        lines.append(f"{var} = {triton(e, _ctx(plan, names, k, skip=var, full=full))}")
    rows, cols = _tile(k)
    if not full:
        lines.append(f"_ok = {_real(plan, rows)}[:, None] & {_real(plan, cols)}[None, :]"
                     "  # padded rows and keys add nothing")

    def kept(value: str) -> str:
        return value if full else f"tl.where(_ok, {value}, 0.0)"

    for g in k.grads:  # [resident, loop] @ [loop, feature]: the tile as it is, no transpose
        dt = grad_dt(plan, g)
        # a factor under 1 in size may keep to the tile in float16 (_operand_grad); a larger one waits for
        # the store in every dtype: there c * dS is the tile that overflows float16 (a score times 64)
        tile = f"_operand_grad({kept(g.tile)}, {g.scale!r}, {dt})" if _small(g.scale) \
            else f"{kept(g.tile)}.to({dt})"
        lines.append(f"{g.var} += {_dot(tile, f'{g.operand.var}.to({dt})', plan, dt)}")
    # side gradients: the dQ kernel's alone, whose tiles are [rows, x]
    assert not k.sides or (rows, cols) == (plan.row, plan.col)
    centred = [s for s in k.sides if s.centre is not None]
    if centred:   # sum[x](dS) per row, for the centred side gradients (backward._Builder.centre)
        dS = triton(ir.TensorRef("dS"), _ctx(plan, names, k, full=full))
        lines += [f"if {' or '.join(f'_NEED_{s.tensor}' for s in centred)}:",
                  f"    {DS_ROWS} += tl.sum({kept(dS)}, 1)[:, None]"]
    for s in k.sides:
        code = triton(s.expr, _ctx(plan, names, k, full=full))
        value = kept(code)
        if s.centre is not None:   # per row: the rows' correction comes after the loop
            weighted = kept(triton(s.centre, _ctx(plan, names, k, full=full)))
            lines += [f"if _NEED_{s.tensor}:", f"    {joined('part_acc', s.tensor)} += tl.sum({value}, 1)[:, None]",
                      f"    {joined('part_pg', s.tensor)} += tl.sum({weighted}, 1)[:, None]"]
            continue
        if not s.has_row:
            value = f"tl.sum({value}, 0)[None, :]"
        if not s.has_col:
            value = f"tl.sum({value}, 1)[:, None]"
        if s.has_col:
            tiles = dict(tiled_reads(plan, s))
            if tiles:   # summed inside the tile by blocks of the read (_tile_sum), stored once a block
                gr, gc = (granule(s, w) if w in tiles else "1" for w in (plan.row, plan.col))
                value = f"_tile_sum({value}, {names.block(plan.row) if s.has_row else 1}, " \
                        f"{names.block(plan.col)}, {gr}, {gc})"
            lines += [f"if _NEED_{s.tensor}:",
                      f"    tl.store({_side_ptr(plan, names, s)}, {value}{_side_masks(plan, names, s, full)})"]
        else:
            lines += [f"if _NEED_{s.tensor}:", f"    {joined('part_acc', s.tensor)} += {value}"]
    return lines


def _row_lines(plan: BackwardPlan, names: E._Names, k: Kernel, phase: str) -> list[str]:
    """The per-row values (lse * log2(e)) and per-program scalars computed
    where what they read is loaded: before the loop ("pre") or at the top of
    each step, on the row vector, not on each score of the tile."""
    return [f"{var} = {triton(e, _ctx(plan, names, k))}" for var, e, at in k.row_lines if at == phase]


def tiled_reads(plan: BackwardPlan, s) -> tuple[tuple[str, int], ...]:
    """(wire, step) of the tile's wires a side input stored per step (one
    along the keys) is read at blocks of (B[h, q // 64, x // 32]): the dQ
    kernel sums its partial inside the tile by ``granule`` entries of each,
    so that the buffer is not one float per score (16 GiB at 16K tokens and 16
    heads) but one per granule; the launcher sums the granules by blocks."""
    if not s.has_col or not s.steps:
        return ()
    return tuple((w, st) for w, st in zip(s.wires, s.steps)
                 if st > 1 and (w == plan.col or (w == plan.row and s.has_row)))


def granule_size(step: int, block: int) -> int:
    """The launcher's _granule (templates/training.py.jinja), for the cost
    pass: how many entries of a tile's wire one entry of the partial sums."""
    return math.gcd(step, block)


def granule(s, w: str) -> str:
    """The dQ kernel's constexpr: how many entries of w one entry of s's partial sums."""
    return joined("G", s.tensor, w)


def granule_of(plan: BackwardPlan, s) -> dict[str, str]:
    """Each wire s's dQ partial is summed by granules of: the launcher's value of the
    granule (_granule of the read's step and the dQ kernel's block of the wire)."""
    return {w: f"_granule({st}, {'_br' if w == plan.row else '_bc'})" for w, st in tiled_reads(plan, s)}


def _granules_met(names: E._Names, s, w: str) -> str:
    """The granules of w a tile covers, a vector (_coarse)."""
    return f"_coarse(_offs_{w}, {names.block(w)}, {granule(s, w)})"


def _side_ptr(plan: BackwardPlan, names: E._Names, s) -> str:
    terms = []
    for w in s.extra:
        terms.append(f"_ix(_pid, _INT64) * {stride(s.buffer, w)}" if w == "_blocks"
                     else f"_ix(_i_{w}, _INT64) * {stride(s.buffer, w)}")
    tiles = dict(tiled_reads(plan, s))
    for w in s.wires:
        idx = names.index(w, plan.row if s.has_row else None, plan.col if s.has_col else None)
        if w in tiles:   # the granules the tile covers (_coarse)
            idx = f"{_granules_met(names, s, w)}{names.axis(w == plan.row)}"
        terms.append(f"_ix({idx}, _INT64) * {stride(s.buffer, w)}")
    return f"{s.buffer} + " + " + ".join(terms) if terms else s.buffer


def _side_masks(plan: BackwardPlan, names: E._Names, s, full: bool = False) -> str:
    inside = (plan.row, plan.col) if full else ()
    tiles = dict(tiled_reads(plan, s))
    parts = []
    for w, on in ((plan.row, s.has_row), (plan.col, s.has_col)):
        if not on or w in inside:
            continue
        if w in tiles:   # a granule is real where it holds a real entry
            parts.append(f"({_granules_met(names, s, w)} < tl.cdiv({names.size(w)}, {granule(s, w)}))"
                         f"{names.axis(w == plan.row)}")
        else:
            parts += names.mask(w if w == plan.row else None, w if w == plan.col else None)
    return f", mask={' & '.join(parts)}" if parts else ""


def _bounds_dkdv(plan: BackwardPlan, names: E._Names) -> str:
    """[_lo, _hi) of the row blocks whose forward loop visits this key block:
    napkin.visits.row_block_range rendered in Triton, term for term, with the
    block's least and greatest key (_col_first, _col_last: its first and
    nominal last offset, or the least and greatest real key at positions;
    padding keys alone visit nothing).  Rows at positions: a row block's
    are known only once loaded, so the range is every block and the loop
    tests each tile (bounds.live)."""
    row, col = plan.row, plan.col
    br, bc, nq = names.block(row), names.block(col), names.size(row)
    bounds = plan.forward.bounds
    lines = ["_lo = 0", f"_hi = tl.cdiv({nq}, {br})"]
    if not bounds:
        lines[0] += f"  # {'no mask' if plan.forward.skip is None else 'the mask has no affine bound'}: every block"
    need = B.ends(bounds, "col")
    if "first" in need:
        lines.append("_col_first = _col0")
    if "last" in need:
        lines.append(f"_col_last = tl.minimum(_col0 + {bc}, {names.size(col)}) - 1  # the block's last real one "
                     "(visits.row_block_range)")
    lines.append(f"if _POS_{col}:  # keys at global positions: the least and greatest real one")
    lines += ["    " + line for line in B.extremes("col", col, f"_ok_{col}", need)]
    lines.append("    _hi = tl.where(_col_last < 0, 0, _hi)  # padding keys alone: no block")
    if not bounds:
        return "\n".join(lines + _full_dkdv(plan, names) + _ranges_dkdv(plan, names))
    lines.append(f"if not _POS_{row}:")
    indent = len(lines)
    # |w| as the expressions read it: the global length when keys sit at positions
    every = f"tl.cdiv({nq}, {br})"
    for b in bounds:
        if b.alts:
            lines += _union_rows(b, B.text(b, col, row), every, "_lo", "_hi",
                                 lambda p: _visit_need(p, names, row, col),
                                 f"tl.where(_t >= {nq}, {every}, _t // {br})", "{last} // " + br + " + 1")
            continue
        a, need, why = _visit_need(b, names, row, col)
        lines.append(f"_need = {need}  # {why}")
        if a == 0:
            lines.append("_hi = tl.where(_need > 0, 0, _hi)")
        elif a > 0:
            lines.append(f"_t = {_first_row(b, a)}  # the first row reaching it; rows past the end: no block")
            lines.append(f"_lo = tl.maximum(_lo, tl.where(_t >= {nq}, tl.cdiv({nq}, {br}), _t // {br}))")
        else:
            lines.append(f"_hi = tl.where(_need > 0, 0, tl.minimum(_hi, {_last_row(b, a)} // {br} + 1))")
    lines.append("_hi = tl.maximum(_lo, _hi)")
    lines[indent:] = ["    " + line for line in lines[indent:]]
    return "\n".join(lines + _full_dkdv(plan, names) + _ranges_dkdv(plan, names))


def _visit_need(b, names, row: str, col: str) -> tuple[int, str, str]:
    """(a, _need, why) of one form: visits.row_block_range's ``a * (r // step) >= need``."""
    if b.kind == "upper":
        return (b.row_coeff, f"_col_first - {B.rest(b, names.length)}",
                f"{B.text(b, col, row)}: visited while that reaches the block's least {col}")
    return (-b.row_coeff, f"{B.rest(b, names.length)} - _col_last",
            f"{B.text(b, col, row)}: visited while that starts by the block's greatest {col}")


def _union_rows(b, text: str, every: str, lo: Optional[str], hi: str, need_of, start: str, stop: str) -> list[str]:
    """A union's (masks._union) run of row blocks, the union of its forms' runs (each all
    of the rows from one on, or up to one, or all or none: their union is one run), met
    with [lo, hi) (no ``lo`` where no bound can raise it; ``text``, the bound's, for the
    comment): visits.row_block_range and full_row_blocks' union (visits._some_form),
    term for term.  ``need_of``: a form's
    (a, _need, why); a form with a > 0 runs from ``start`` (of _t, its first row), one
    with a < 0 up to ``stop`` (of ``{last}``, its last row)."""
    lines = [f"_ulo = {every}  # {text}: the row blocks some part lets through, none yet", "_uhi = 0"]
    for p in b.parts:
        a, need, why = need_of(p)
        lines.append(f"_need = {need}  # {why}")
        if a == 0:
            lines += ["_ulo = tl.where(_need > 0, _ulo, 0)", f"_uhi = tl.where(_need > 0, _uhi, {every})"]
        elif a > 0:
            lines += [f"_t = {_first_row(p, a)}", f"_ulo = tl.minimum(_ulo, {start})", f"_uhi = {every}"]
        else:
            lines += ["_ulo = tl.where(_need > 0, _ulo, 0)",
                      f"_uhi = tl.where(_need > 0, _uhi, tl.maximum(_uhi, {stop.format(last=_last_row(p, a))}))"]
    return lines + ([f"{lo} = tl.maximum({lo}, _ulo)"] if lo else []) + [f"{hi} = tl.minimum({hi}, _uhi)"]


def _ranges_dkdv(plan: BackwardPlan, names: E._Names) -> list[str]:
    """A data mask's row blocks from the prepass's transposed ranges (a
    program per key block), at dK/dV's blocks: usable when the kernel has an
    index of each batch wire the mask reads (not one its outer loop walks)."""
    if not R.applies(plan.forward):
        return []
    return R.bounds_lines(names, plan.forward, plan.row, _dkdv_ranges_usable(plan))


def _dkdv_ranges_usable(plan: BackwardPlan) -> bool:
    k = next(k for k in plan.kernels if k.role == "dkdv")
    return set(R.batch_wires(plan.forward)) <= set(k.batch)


def _dkdv_lower(plan: BackwardPlan) -> bool:
    """Whether a bound can put partial row blocks before the full ones (a
    bound met from some row on: x <= q is, at the diagonal)."""
    return any((b.row_coeff if b.kind == "upper" else -b.row_coeff) > 0 for b in plan.forward.full or ())


def _full_dkdv(plan: BackwardPlan, names: E._Names) -> list[str]:
    """[_flo, _fhi) of the row blocks whose tile with this key block is full:
    napkin.visits.full_row_blocks term for term.  None at global positions."""
    if plan.forward.full is None:
        return []
    row, col = plan.row, plan.col
    br, bc, nq = names.block(row), names.block(col), names.size(row)
    lower = _dkdv_lower(plan)
    first = "_flo" if lower else "_lo"
    lines = ["# Of those, the full row blocks [_flo, _fhi): every row and key of the tile real and the mask",
             "# true at every pair (visits.full_row_blocks): they skip the mask and bound arithmetic."]
    lines += ["_flo = _lo"] if lower else []
    lines += ["_fhi = _lo  # rows or keys at global positions: none known full",
              f"if not _POS_{row}:", f"    if not _POS_{col}:"]
    inner = ["_flo = 0"] if lower else []
    inner.append(f"_fhi = tl.where(_col0 + {bc} <= {names.size(col)}, {nq} // {br}, 0)"
                 "  # whole row blocks; a ragged key block has none")

    every = f"tl.cdiv({nq}, {br})"

    def need_of(p):
        a, need, why = _full_need(p, names, row, col, bc)
        return a, need, f"{why}, for every row"

    for b in plan.forward.full:
        if b.alts:
            inner += _union_rows(b, B.text(b, col, row), every, "_flo" if lower else None, "_fhi", need_of,
                                 f"tl.cdiv(_t, {br})", "({last} + 1) // " + br)
            continue
        a, need, why = _full_need(b, names, row, col, bc)
        inner.append(f"_need = {need}  # {why}, for every row")
        if a == 0:
            inner.append("_fhi = tl.where(_need > 0, 0, _fhi)")
        elif a > 0:
            inner.append(f"_t = {_first_row(b, a)}  # the first row meeting it")
            inner.append(f"_flo = tl.maximum(_flo, tl.cdiv(_t, {br}))")
        else:
            inner.append(f"_fhi = tl.where(_need > 0, 0, tl.minimum(_fhi, ({_last_row(b, a)} + 1) // {br}))")
    if lower:
        inner.append("_flo = tl.minimum(tl.maximum(_flo, _lo), _hi)")
    inner.append(f"_fhi = tl.maximum(tl.minimum(_fhi, _hi), {first})")
    return lines + ["        " + line for line in inner]


def _full_need(b, names, row: str, col: str, bc: str) -> tuple[int, str, str]:
    """(a, _need, why) of one form: visits.full_row_blocks' ``a * (r // step) >= need``."""
    if b.kind == "upper":
        return (b.row_coeff, f"_col0 + {bc} - 1 - {B.rest(b, names.size)}",
                f"{B.text(b, col, row)} at the block's last {col}")
    return -b.row_coeff, f"{B.rest(b, names.size)} - _col0", f"{B.text(b, col, row)} at the block's first {col}"


def _first_row(b, a: int) -> str:
    """The least row r with a * (r // step) >= _need (a > 0): masks.Bound.first_row
    of ceil(_need / a), the numerator clamped non-negative (Triton's // truncates)."""
    t = f"(tl.maximum(_need, 0) + {a - 1}) // {a}" if a != 1 else "tl.maximum(_need, 0)"
    return t if b.step == 1 else f"{t if a == 1 else f'({t})'} * {b.step}"


def _last_row(b, a: int) -> str:
    """The greatest row r with a * (r // step) >= _need (a < 0, _need <= 0):
    masks.Bound.last_row of floor(-_need / |a|)."""
    u = "tl.maximum(-_need, 0)" + ("" if a == -1 else f" // {-a}")
    return u if b.step == 1 else f"({u} * {b.step} + {b.step - 1})"


def _bounds_dq(plan: BackwardPlan, names: E._Names) -> str:
    """[_lo, _hi) of the key range this row block visits: the forward's own
    bounds (bounds.loop_bounds, napkin.visits.stream_range), rows at positions
    included, so dQ sees exactly the forward's blocks; the full ones among
    them as the forward's, but none in a ragged block of rows (the side
    gradients sum over rows)."""
    text = B.loop_bounds(names, plan.forward, whole_rows=True)
    if R.applies(plan.forward):  # a data mask: the prepass's ranges at dQ's blocks
        text = "\n".join([text] + R.bounds_lines(names, plan.forward, plan.col))
    return text


def _decode_outer(names: E._Names, outer, n: str) -> list[str]:
    """The indices of the ``outer`` wires (of ``n`` combinations) at the flat step ``_it``."""
    if len(outer) == 1:
        return [f"_i_{outer[0]} = _it % {n}"]
    lines = [f"_o = _it % {n}"]
    for w in reversed(outer[1:]):
        lines += [f"_i_{w} = _o % {names.size(w)}", f"_o = _o // {names.size(w)}"]
    lines.append(f"_i_{outer[0]} = _o")
    return lines


def _indent(lines: list[str], n: int) -> list[str]:
    return [" " * n + line if line else line for line in lines]


def _wide(plan: BackwardPlan, k: Kernel) -> bool:
    """Whether the kernel takes a product widened to float32 whose precision
    the launcher gives (the constexpr _WIDE)."""
    return k.role != "rows" and plan.forward.precision == "ieee" and bool(wide_operands(plan, k))


def rows_held(plan: BackwardPlan, k: Kernel, lines: list[str], after: list[str]) -> list[str]:
    """The feature wires of the rows kernel's float32 [rows, feature] tiles
    that outlive its row sums: each loaded tile the later ``lines`` or the
    stores (``after``) read, and each tile stored."""
    later = "\n".join(lines + after)
    out = [ld.cols for ld in k.loads if ld.cols and E.reads(later, ld.var)]
    return out + [st.cols for st in k.stores if st.cols]


def full_step_omits(plan: BackwardPlan, role: str) -> frozenset:
    """(tensor, wires) of the step loads kernel ``role``'s full-block step
    leaves out (what only the mask reads: a data mask's ids), as its inner()
    writes it: the cost pass counts them at partial blocks alone."""
    k = next(k for k in plan.kernels if k.role == role)
    names = _BackwardNames(plan.diagram, plan.dims, (plan.row, plan.col), plan.row)
    text = "\n".join(_tile_lines(plan, names, k, True))
    return frozenset((ld.tensor, ld.wires) for ld in k.loads if ld.phase == "step" and not E.reads(text, ld.var))


def kernel_context(plan: BackwardPlan, k: Kernel) -> dict:
    """The template context of one backward kernel."""
    d = plan.diagram
    row, col = plan.row, plan.col
    # the rows kernel is elementwise in the rows' own state: no positions
    names = _BackwardNames(d, plan.dims, () if k.role == "rows" else (row, col), row)
    if k.role != "rows":   # the lengths the loops' bounds read, from their loads before the loop
        names.read_lengths = B.length_vars(plan.forward.bounds, k.loads)
    dims = [w for w in plan.dims if any(w in (ld.cols, ld.rows) for ld in k.loads)
            or any(w == g.cols for g in k.grads) or any(w == st.cols for st in k.stores)]
    blocks = [names.block(row)] + ([names.block(col)] if k.role != "rows" else []) \
        + [names.block(w) for w in dims] + [f"_NEED_{s.tensor}" for s in k.sides] \
        + [granule(s, w) for s in k.sides for w, _ in tiled_reads(plan, s)]
    if _wide(plan, k):
        blocks.append("_WIDE")
    blocks.append("_INT64")
    params, sizes = _params(plan, k, blocks)
    ranges_call = ""
    if k.role != "rows":
        # positions / lengths, as the forward's (emit.py): runtime arguments and a constexpr flag per wire
        params += [f"_pos_{row}", f"_pos_{col}", f"_len_{row}", f"_len_{col}",
                   f"_POS_{row}: tl.constexpr", f"_POS_{col}: tl.constexpr"]
        sizes = sizes + [f"_len_{row}", f"_len_{col}"]
        if R.applies(plan.forward):  # a data mask's ranges (ranges.py), unless rows sit at positions
            params += ["_ranges", "_RANGES: tl.constexpr"]
            on = R.WITHOUT_POSITIONS
            ranges_call = R.launch(plan.forward, _ranges_var(k), "_kv_br", "_kv_bc", True, True,
                                   on if _dkdv_ranges_usable(plan) else "False") if k.role == "dkdv" else \
                R.launch(plan.forward, _ranges_var(k), "_br", "_bc", True, False, on)
    # dQ and dK/dV move their qualifying tiles through TMA descriptors under _TMA (codegen/tma.py):
    # each tile's first row is the program's (_row0 / _col0) or the step's (_start / _row0)
    tma = None if k.role == "rows" else \
        T.Tma(plan.forward, names, {row: "_row0", col: "_start" if k.role == "dq" else "_col0"}, d, k.outer)
    # Padded query rows (positions >= the length) read as zeros in dQ and dK/dV, whatever they
    # hold: their P and dS are zeros, but 0 * NaN (dS^T Q, P^T dO, dS K and a side input's
    # partial sums) is not.  So the loads take an integer load's mask, and TMA, which cannot
    # mask, falls back when query rows have positions (_tma_context's padded wires).
    pre = [E._load(d, names, ld, tma=tma, drop_padding=True) for ld in k.loads if ld.phase == "pre"]
    start = "_row0" if k.grid_wire == row else "_col0"
    head = [f"{start} = _pid * {names.block(k.grid_wire)}"] + _offsets(names, k.grid_wire, start) \
        + (_globals(k.grid_wire, row) if k.role != "rows" else []) + _dims(names, dims)
    init, body, bounds, after = [], [], "", []
    if k.role == "rows":
        # elementwise in float32: dO * O of two fp16 tiles would round in fp16
        body += [f"{ld['var']} = {ld['var']}.to(tl.float32)" for ld in pre]
        ctx = names.ctx(row, dims[0] if dims else None, dict(k.subst), E._kinds(d))
        for var, e in k.reduces:
            code = triton(e, ctx)
            if dims and not names.exact(dims[0]):
                code = f"tl.where(_ok_{dims[0]}[None, :], {code}, 0.0)"
            body.append(f"{var} = tl.sum({code}, 1)[:, None]")
        for var, e in k.lines:
            code = triton(e, names.ctx(row, dims[0] if dims else None,
                                       {n: v for n, v in k.subst if v != var}, E._kinds(d)))
            body.append(f"{var} = {code}")
        for st in k.stores:
            ptr = E._pointer(d, names, st.tensor, ir.axis_wires(d.tensor(st.tensor).axes), st.rows, st.cols)
            mask = names.mask(st.rows, st.cols)
            value = st.value
            if st.cols is not None:
                value = f"tl.broadcast_to({value}, [{names.block(row)}, {names.block(st.cols)}])"
            after.append(f"tl.store({ptr}, {value}.to({st.tensor}.dtype.element_ty)"
                         f"{', mask=' + ' & '.join(mask) if mask else ''})")
    else:
        init += _row_lines(plan, names, k, "pre")
        for g in k.grads:
            init.append(f"{g.var} = tl.zeros([{names.block(g.rows)}, {names.block(g.cols)}], tl.float32)")
        for s in k.sides:
            if not s.has_col:
                shape = f"[{names.block(row)}, 1]" if s.has_row or s.centre is not None else "[1, 1]"
                init.append(f"{joined('part_acc', s.tensor)} = tl.zeros({shape}, tl.float32)")
            if s.centre is not None:
                init.append(f"{joined('part_pg', s.tensor)} = tl.zeros([{names.block(row)}, 1], tl.float32)")
        if any(s.centre is not None for s in k.sides):
            init.append(f"{DS_ROWS} = tl.zeros([{names.block(row)}, 1], tl.float32)")
        loop_wire = col if k.role == "dq" else row
        step_loads = [ld for ld in k.loads if ld.phase == "step"]

        def inner(full: bool) -> list[str]:
            """Loop-wire offsets, loads and the step; a full block's: no bounds masks, no mask, and
            no load of what only the mask reads (a data mask's ids)."""
            first = "_start" if k.role == "dq" else "_row0"
            tile = _tile_lines(plan, names, k, full)
            text = "\n".join(tile)
            inside = (loop_wire,) if full else ()
            step = [line for ld in step_loads if not full or E.reads(text, ld.var)
                    for line in _step_load(d, names, ld, inside, tma, loop_wire).split("\n")] + tile
            if full:  # every index real, at its own offset (no positions)
                return [f"_offs_{loop_wire} = {first} + tl.arange(0, {names.block(loop_wire)})",
                        f"_idx_{loop_wire} = _offs_{loop_wire}"] + step
            # a dead tile at positions (bounds.live) is neither loaded nor computed
            return _offsets(names, loop_wire, first) \
                + _globals(loop_wire, row, B.live(names, plan.forward, loop_wire)) + ["if _live:"] + _indent(step, 4)

        if k.role == "dq":
            bounds = _bounds_dq(plan, names)
            lower = any(b.kind == "lower" for b in plan.forward.full or ())
            usable = True
        else:
            bounds = _bounds_dkdv(plan, names)
            lower = _dkdv_lower(plan)
            usable = _dkdv_ranges_usable(plan)  # else no list: its loops walk every block
        loop = []
        for seg in E.segments(plan.forward, "_lo", "_hi", lower):
            loop += [seg["why"]] if seg["why"] else []
            if k.role == "dq":
                loop += E.loop_head(seg, "_start", names.block(col)).split("\n")
            elif k.outer:  # dK/dV of keys the outer wires share (GQA's g): one flat loop over both
                # A loop over g around each segment's loop held 30 to 145 more registers a program
                # (bench.aot, sm_90) and spilled causal GQA's at head dim 128; flat, none spill.
                n = " * ".join(names.size(w) for w in k.outer)
                n = f"({n})" if len(k.outer) > 1 else n
                lo, hi = (b if b.isidentifier() else f"({b})" for b in (seg["lo"], seg["hi"]))
                pairs = f"  # (row block, {', '.join(k.outer)}) pairs"
                if seg["listed"] and usable:
                    opening = R.list_loop("_rb", seg, flat=n)
                    opening[2] += pairs  # on its for line, after the list's two
                else:
                    opening = [f"for _it in range({lo} * {n}, {hi} * {n}):{pairs}", f"    _rb = _it // {n}"]
                loop += opening + _indent(_decode_outer(names, k.outer, n), 4) + [f"    _row0 = _rb * {names.block(row)}"]
            else:
                opening = R.list_loop("_rb", seg) if seg["listed"] and usable else \
                    [f"for _rb in range({seg['lo']}, {seg['hi']}):"]
                loop += opening + [f"    _row0 = _rb * {names.block(row)}"]
            loop += _indent(inner(seg["full"]), 4)
        body = loop
        for g in k.grads:
            wires = ir.axis_wires(d.tensor(g.buffer).axes)
            ptr = E._pointer(d, names, g.buffer, wires, g.rows, g.cols)
            mask = [_rows_after_loop(names, g.rows, start) if m == f"_ok_{g.rows}[:, None]" and g.rows == k.grid_wire else m
                    for m in names.mask(g.rows, g.cols)]
            if g.scale is None:
                scaled = g.var
            elif _small(g.scale):  # backward.grad_scales; float16 took it on each tile
                scaled = f"_scaled_grad({g.var}, {g.scale!r}, {grad_dt(plan, g)})"
            else:
                scaled = f"({g.var} * {g.scale!r})"
            value = f"{scaled}.to({g.buffer}.dtype.element_ty)"
            after += T.store_code(ptr, value, f", mask={' & '.join(mask)}" if mask else "",
                                  tma.store(g.buffer, wires, g.rows, g.cols, value)).split("\n")
        for s in k.sides:
            if not s.has_col:
                acc = joined("part_acc", s.tensor)
                if s.centre is not None:   # delta's rounding taken out, row by row
                    acc = f"({acc} - {DS_ROWS} * {joined('part_pg', s.tensor)})"
                value = acc if s.has_row else f"tl.sum(tl.sum({acc}, 1), 0)"
                after += [f"if _NEED_{s.tensor}:",
                          f"    tl.store({_side_ptr(plan, names, s)}, {value}{_side_masks(plan, names, s)})"]
    held = ""

    def block(w):  # a block of the held tiles, as the launcher knows it
        if w in (row, col):
            return {row: "_kv_br", col: "_kv_bc"}[w] if k.role == "dkdv" else {row: "_br", col: "_bc"}[w]
        return E._dim_block_value(names, w)

    if k.role in DEFAULT_TILE:  # what one program holds in float32 (held_terms): see HELD_FP32
        held = " + ".join(f"{block(a)} * {block(b)}" for a, b in held_terms(plan, k))
    elif k.role == "rows" and after:  # what outlives its row sums: see HELD_FP32
        widths = [block(w) for w in rows_held(plan, k, body[len(pre) + len(k.reduces):], after)]
        held = f"_br * ({' + '.join(widths)})" if widths else ""
    params += tma.params() if tma is not None else []
    return {
        **(_tma_context(plan, k, tma, names, dims) if tma is not None else {}),
        "name": k.name, "role": k.role, "params": params, "no_specialize": ", ".join(f'"{s}"' for s in sizes),
        "held": held, "held_budget": HELD_FP32,
        "decode": E._decode(names, k.batch, 1), "head": "\n".join(head),
        "pid": "tl.program_id(0)" if k.role == "rows" else
        masks.program_order(plan.forward.bounds, "row" if k.grid_wire == row else "col"),
        "pre_loads": pre, "init": "\n".join(init), "bounds": bounds, "body": "\n".join(body),
        "after": "\n".join(after), "grid_wire": k.grid_wire, "loop_wire": k.loop_wire,
        "batch": ", ".join(k.batch) or "none", "outer": ", ".join(k.outer), "sides": [s.tensor for s in k.sides],
        "ranges_call": ranges_call, "ranges_var": _ranges_var(k) if ranges_call else "",
        **_launch_parts(plan, k, names, dims),
    }


def _tma_context(plan: BackwardPlan, k: Kernel, tma: T.Tma, names: E._Names, dims) -> dict:
    """A loop kernel's TMA table (_TMA_DESCS_DQ / _DKDV), the dict its last
    launch is recorded in and the launcher's call (codegen/tma.py), at the
    kernel's own blocks and options (dK/dV's _kv_*)."""
    kv = k.role == "dkdv"
    blocks = {plan.row: "_kv_br" if kv else "_br", plan.col: "_kv_bc" if kv else "_bc"}
    blocks.update({w: E._dim_block_value(names, w) for w in dims})
    table, last = f"_TMA_DESCS_{k.role.upper()}", f"_tma_last_{k.role}"
    return {"tma_table": table, "tma_descs": tma.table(), "tma_last": last,
            "tma_call": tma.launch("_kv_tma" if kv else "_tma", f'{"_kv_opts" if kv else "_opts"}["{T.OPTION}"]',
                                   table, _tensors(plan, k), blocks, last, (plan.row,))}


def _small(scale) -> bool:
    """A gradient factor under 1 in size: in float16 it stays on each tile, before the
    cast (_operand_grad / _scaled_grad in templates/module.py.jinja)."""
    return scale is not None and abs(scale) < 1


def _rows_after_loop(names, rows: str, start: str) -> str:
    """A gradient store's row bounds: every real row of the program's block
    (padded ones zero; rows past a positions= length too), recomputed from
    the block's start rather than taken from the prologue's ``_ok_<rows>``
    (which with positions also tests the length).  A 16-bit gradient is
    stored in the layout of the 16-bit prologue loads (Q, dO; K, V), so
    Triton would share their broadcast row mask with the store and keep it
    live across every loop: compiled for sm_90 at head dim 128 that made
    sliding_window's dQ kernel spill (a float32 store, in a layout of its
    own, never shared it)."""
    return f"(tl.arange(0, {names.block(rows)})[:, None] < {names.size(rows)} - {start})"  # & binds tighter than <


def _ranges_var(k: Kernel) -> str:
    """The launcher's name for a loop kernel's ranges (``_kv_rng`` / ``_rng``, and ``..._on``)."""
    return "_kv_rng" if k.role == "dkdv" else "_rng"


def _launch_parts(plan: BackwardPlan, k: Kernel, names: E._Names, dims) -> dict:
    """A kernel's launch in the three parts a backward launch plan keeps apart
    (codegen/launch_plan.py): its tensors, named each call; the positional
    arguments after them (sizes, strides) and the keyword ones (blocks,
    flags, positions, TMA), which follow from the call's signature."""
    d = plan.diagram
    tensors = _tensors(plan, k)
    sizes = [f'_sz["{w.name}"]' for w in d.wires if w.size is None]
    strides = []
    for t in tensors:
        strides.append(f"*{t}.stride()" if t.startswith("_part_") else f'*_wire_strides({t}, "{t}", _sz)')
    br, bc = ("_kv_br", "_kv_bc") if k.role == "dkdv" else ("_br", "_bc")  # dK/dV's own defaults (the template)
    blocks = [f"{names.block(plan.row)}={br}"] + ([f"{names.block(plan.col)}={bc}"] if k.role != "rows" else [])
    blocks += E._wire_block_args(names, dims)
    # _need has a flag per input, integer ones included (_wanted): the input's own position
    inputs = [t.name for t in plan.diagram.inputs]
    blocks += [f"_NEED_{s.tensor}=_need[{inputs.index(s.tensor)}]" for s in k.sides]
    blocks += [f"{granule(s, w)}={value}" for s in k.sides for w, value in granule_of(plan, s).items()]
    if _wide(plan, k):
        blocks.append(f"_WIDE={wide_precision(plan)}")
    blocks.append(f"_INT64=_int64_offsets({', '.join(tensors)})")
    if k.role != "rows":
        blocks += ["**_pos", "**_kv_tma" if k.role == "dkdv" else "**_tma"]
        if R.applies(plan.forward):
            rng = _ranges_var(k)
            blocks.append(f"_ranges={rng}, _RANGES={rng}_on")
    return {"tensors": ", ".join(tensors), "tail": ",\n".join(([", ".join(sizes)] if sizes else []) + strides),
            "keywords": ", ".join(blocks)}
