"""Block ranges of a mask that reads data, found by a prepass kernel.

Affine masks (causal, a sliding window) give each program its visited blocks
and its full ones by formula (bounds.py, napkin/visits.py), and so does a
mask whose every conjunct is such a bound once its length inputs are read
(``x < n[b]``, ``q - x < w``: the loops load the lengths; lower's plan has
them in its bounds, attention.py's ``lengths``).  A mask that reads data,
``doc[b, q] == doc`` of packed documents or a bool mask input, has no such
formula, and without this module every block would be visited, masked:
about twice FlexAttention's work on a few contiguous documents.  For such a
diagram (``applies``) the launcher first runs a small generated Triton
kernel, the ranges prepass (templates/ranges.py.jinja).  It evaluates the
whole mask predicate, every conjunct (the affine ones too) rendered from the
IR as the masked step renders it, on each (row block, key block) tile,
scanning the key blocks in chunks (scalars carried in each chunk's loop, its
[lo, hi) stored; a merge kernel joins a row's chunks) and storing
each tile's state (dead, live, full: one byte a tile).  Per (mask batch
index, row block) it then writes a record of 2 S + 4 int32 (S the blocks
of the other wire): [lo, hi) the blocks from the first to the last live one
(some real pair true), the counts of its partial blocks (live, not full)
and of its full ones (true at every pair, the tile inside the edges), then
the two lists, ascending, which torch compacts from the states
(``_ranges_listed``, as FlexAttention's BlockMask lists kv_num_blocks and
kv_indices, full_kv_num_blocks and full_kv_indices).  The main kernels then
loop over the full list, the step generated with the mask taken as true,
and over the partial list (emit.segments), entry by entry (``list_loop``),
so every dead block is skipped (a random block-sparse mask's too).  A cut
of the range (a flash-decoding chunk) finds its part of each list in two
loads: a chunked launch's record holds the lists' prefix counts besides,
4 S + 6 int32, which the others go without.

* The prepass's grid spans only the batch wires the predicate reads
  (``doc[b, .]`` reads b, not h): its cost does not multiply by heads, and
  the main kernels index the ranges with their own indices of those wires.
* Ranges are in blocks of the launching kernel, so each launch (forward,
  dQ, dK/dV, tuned blocks included) runs the prepass at its own blocks.
  The dK/dV kernel loops over row blocks per key block: the same kernel with
  ``_BY_COL`` scans row blocks per key block; ``_WHOLE_ROWS`` is the
  backward's rule that a ragged block of rows has no full block (it sums
  over rows).
* Rows at global positions (``positions=`` / ``lengths=``: the distributed
  wrappers) keep today's path, every block with its per-tile test: the
  launcher passes ``_RANGES=False`` and the bounds are the affine ones.
* Packed rows (lower.packed_wire, packed.py) sit at positions too, each
  (g, q) row at its q, but they are the launch's own: the forward launcher
  decides from the caller's call, before _pack, and passes the prepass the
  packed rows' positions, which it reads as the main kernel does (``_idx_q``
  for the mask's q and the integer inputs' rows, ``|q|`` the caller's).  So
  its row blocks are the packed launch's, each live where some (g, q) row's
  document meets the key block and full where every real one does.
* ``mask_cache=`` (every attention launcher, the backward's and autograd's
  too): a dict of the caller's in which ``_<name>_ranges_cached`` keeps each
  prepass's result, keyed by all it depends on but the mask inputs' values
  (the launch's blocks, whole-rows and by-column flags, sizes, device, packed
  rows, the mask inputs' shapes and dtypes), so a training step's layers run
  the prepass once per key, as FlexAttention's BlockMask is built once.  An
  entry holds the mask input tensors weakly with their version counters: other
  tensor objects, or the same ones written in place, run the prepass again
  (writes past the counter, .data or inference tensors', go unseen).
  A mask of indices alone (no tensor read) needs no dict: given none, the
  launchers keep its ranges in the module's own (``_NAME_RANGES_KEPT``, per
  CUDA stream, not while a graph is captured, cleared past 64 entries).
  Autograd carries the dict to the backward through a context variable
  (templates/attention.py.jinja): the torch ops' schemas take no Python
  object.
* The cost pass cannot know the data: it counts these diagrams dense, or,
  given document lengths (``--docs``), the blocks this prepass finds on
  them (napkin/documents.py; tests/test_documents.py holds the two equal).
"""
from __future__ import annotations

from typing import Mapping

from .. import ir, masks
from .exprs import triton
from . import packed as P
from .kernel_names import RANGES_NAMES, stride
from .lower import AttentionPlan, wires_of

NAMES = RANGES_NAMES  # what the prepass defines: in kernel_names.internal_names


def applies(plan: AttentionPlan) -> bool:
    """Whether blocks may be skipped (plan.skip) but not by formula (plan.full
    is None: a conjunct is no affine bound) and the predicate reads only wire
    indices of the tile and the batch, sizes and integer or bool inputs: what
    a prepass can evaluate without the scores."""
    if plan.skip is None or plan.full is not None:
        return False
    d = plan.diagram
    for n in ir.walk(plan.skip):
        if isinstance(n, ir.TensorRef):
            t = d.tensor(n.name)
            if not isinstance(t, ir.Input) or t.dtype in ir.FLOAT_DTYPES:
                return False
        elif isinstance(n, (ir.Reduce, ir.Normalize)):
            return False
    return wires_of(d, plan.skip) <= {plan.row, plan.col, *plan.batch}


def index_disjuncts(plan: AttentionPlan, values: Mapping[str, int] = {}):
    """For a prepass mask of indices and sizes alone (no tensor read), its
    conjunctions of cuts (masks.disjunct_cuts), from which the cost pass
    finds the prepass's blocks row by row (visits.prepass_visits); else None.
    ``values``: integer inputs read as these numbers at every index (cost's
    --lengths: s[b] = 4 sinks in every batch row beside a window), which makes
    a mask that reads only them one of indices alone."""
    if not applies(plan):
        return None
    pred = _with_values(plan.skip, values)
    if any(isinstance(n, ir.TensorRef) for n in ir.walk(pred)):
        return None
    fixed = {w.name: w.size for w in plan.diagram.wires if w.size is not None}
    return masks.disjunct_cuts(pred, plan.row, plan.col, fixed)


def _with_values(e: ir.Expr, values: Mapping[str, int]) -> ir.Expr:
    """``e`` with each read of an input named in ``values`` replaced by its number."""
    if isinstance(e, ir.TensorRef) and e.name in values:
        return ir.Num(values[e.name], e.loc)
    return ir.map_children(e, lambda child: _with_values(child, values))


def batch_wires(plan: AttentionPlan) -> tuple[str, ...]:
    """The batch wires the predicate reads, in the kernel's order: the prepass's grid axis 1."""
    ws = wires_of(plan.diagram, plan.skip)
    return tuple(w for w in plan.batch if w in ws)


def _flat(names, wires) -> str:
    """The flat index of the mask batch (innermost wire last), from the kernel's _i_<w>."""
    code = ""
    for w in wires:
        code = f"_i_{w}" if not code else f"({code}) * {names.size(w)} + _i_{w}"
    return code or "0"


def bounds_lines(names, plan: AttentionPlan, loop: str, usable: bool = True, cut: str = "") -> list[str]:
    """Lines after a kernel's affine bounds: with _RANGES, [_lo, _hi) from
    the prepass's record of this program (``loop``: the wire the kernel
    loops over; the forward and dQ loop in offsets of the streamed wire,
    dK/dV in blocks of rows), _rp, _rl the count and list of its partial
    blocks and _fp, _fl of its full ones (list_loop); ``cut``, the constexpr
    set where a chunk cuts the range (the forward's _CHUNK): then the record
    holds the lists' prefix counts too, _rq and _fq.  Else none is known
    full and the lists go unread.  ``usable`` False (a mask batch wire
    the kernel does not index per program): no ranges, and its loops must
    not be list_loop's."""
    row, col = plan.row, plan.col
    none = ["_flo = _lo  # no block known full: the partial loop takes [_lo, _hi)", "_fhi = _lo"]
    if not usable:
        return ["# the mask reads a wire this kernel's outer loop walks: no ranges", *none]
    grid = col if loop == row else row
    n = f"tl.cdiv({names.size(grid)}, {names.block(grid)})"
    steps = f"tl.cdiv({names.size(loop)}, {names.block(loop)})"
    unit = "" if loop == row else f" * {names.block(col)}"
    width = f"((4 if {cut} else 2) * {steps} + (6 if {cut} else 4))" if cut else f"(2 * {steps} + 4)"
    prefix = [f"    _rq = _fl + {steps}  # with {cut}: per block b, the partial blocks before b",
              f"    _fq = _rq + {steps} + 1  # and the full ones"] if cut else []
    # int64: the records of a per-head mask at long sequences pass 2**31 int32
    return ["if _RANGES:  # the mask reads data: the blocks the ranges prepass found live and full (ranges.py)",
            f"    _rg = _ranges + (({_flat(names, batch_wires(plan))}) * {n} + _pid).to(tl.int64) * {width}",
            f"    _lo = tl.load(_rg){unit}",
            f"    _hi = tl.load(_rg + 1){unit}",
            "    _rp = _rg + 2  # the count of its partial blocks",
            "    _fp = _rg + 3  # of its full blocks",
            "    _rl = _rg + 4  # the partial blocks, ascending",
            f"    _fl = _rl + {steps}  # the full blocks",
            *prefix,
            "else:  # rows or keys at global positions: every block, tested per tile",
            *(f"    {v} = _ranges" for v in ("_rp", "_rl", "_fp", "_fl") + (("_rq", "_fq") if cut else ())),
            *none]


def list_loop(var: str, seg: dict, step: str = "", flat: str = "", cut: str = "") -> list[str]:
    """A segment's loop: with _RANGES, over the entries of its list
    (``seg["listed"]``: the count's, the list's and the prefix counts'
    names, bounds_lines), all of them, so dead blocks are never visited;
    else over [seg["lo"], seg["hi"]), every block.  Every entry of a list
    lies in [seg["over"]), the range the loop takes: the prepass evaluates
    the whole mask, the affine bounds that make the range too.  Only a
    chunk's cut of the range (``cut``, a constexpr: the forward's _CHUNK)
    takes part of the list, from pos[first] to pos[stop].  Sets ``var``
    (``_start`` in offsets with ``step``, ``_rb`` in blocks) at each one.
    _RANGES is a constexpr, so each launch compiles one of the two and the
    step, the kernel's largest code, is written once.  ``flat``: dK/dV's
    loop over (row block, outer wires) pairs, ``flat`` of them a block; the
    line decoding the pair's block comes back as ``var`` ("_rb = _it // n"),
    the caller decodes the rest."""
    count, lst, pos = seg["listed"]
    if cut:
        lo, hi = seg["over"]
        first, last = (f"{lo} // {step}", f"tl.cdiv({hi}, {step})") if step else (lo, hi)
        listed = [f"if {cut}:  # a chunk of the range: its part of the list",
                  f"    _pa = tl.load({pos} + {first})",
                  f"    _pb = tl.load({pos} + {last})",
                  "else:  # the whole list",
                  "    _pa = 0",
                  f"    _pb = tl.load({count})"]
    else:
        listed = ["_pa = 0  # the whole list", f"_pb = tl.load({count})"]
    head = ["if _RANGES:", *("    " + line for line in listed),
            "else:", f"    _pa = {seg['lo']}", f"    _pb = {seg['hi']}"]
    if flat:
        return head + [f"for _it in range(_pa * {flat}, _pb * {flat}):",
                       f"    {var} = _it // {flat}", f"    {var} = tl.load({lst} + {var}) if _RANGES else {var}"]
    return head + [f"for _iv in range(_pa, _pb{f', 1 if _RANGES else {step}' if step else ''}):",
                   f"    {var} = tl.load({lst} + _iv){f' * {step}' if step else ''} if _RANGES else _iv"]


def full_step_omits(plan: AttentionPlan) -> frozenset:
    """(tensor, wires) of the step loads the forward's full-block step leaves
    out (what only the mask reads: a data mask's ids, emit.attention_context's
    rule), which the cost pass counts at partial blocks alone; none where no
    block is known full."""
    from . import emit as E

    if not applies(plan):
        return frozenset()
    names = E._Names(plan.diagram, plan.dims, (plan.row, plan.col), P.runtime(plan))
    text = "\n".join(E._step(plan, names, full=True)[1])
    return frozenset((ld.tensor, ld.wires) for ld in plan.loads if ld.phase == "step" and not E.reads(text, ld.var))


# When a launcher runs the prepass: its call has no rows at global positions
# (with them, integer inputs are read at those positions, which the prepass does not).
WITHOUT_POSITIONS = "positions is None and lengths is None"


def launch(plan: AttentionPlan, var: str, br: str, bc: str, whole_rows: bool, by_col: bool, on: str,
           rows: str = "", prefix: str = "False") -> str:
    """The launcher's line running the prepass at the kernel's blocks: ``var``, ``var``_on.
    ``rows``: the launch's position arguments (packed rows: each row's q), else none;
    ``prefix``: whether the launch is chunked (the record then holds the lists' prefix counts)."""
    d = plan.diagram
    args = ", ".join(["mask_cache"] + mask_tensors(plan) + ["_sz", "_dev", br, bc, str(whole_rows), str(by_col), on,
                                                            prefix] + [rows] * bool(rows))
    return (f"{var}, {var}_on = _{d.name}_ranges_cached({args})"
            "  # the mask reads data: its live and full blocks (mask_cache: kept across calls)")


def mask_tensors(plan: AttentionPlan) -> list[str]:
    """The inputs the mask reads, in declaration order: none for a mask of indices alone, whose
    record the launchers keep across calls (the module's own dict)."""
    read = {n.name for n in ir.walk(plan.skip) if isinstance(n, ir.TensorRef)}
    return [t.name for t in plan.diagram.inputs if t.name in read]


def render(plan: AttentionPlan) -> str:
    """The prepass kernel and its launcher, or "" when the plan needs none."""
    if not applies(plan):
        return ""
    from . import emit as E

    d = plan.diagram
    row, col = plan.row, plan.col
    # no positions: the prepass never runs with the caller's; but packed rows (packed.py) give each
    # row its q as a position, which the prepass reads as the main kernel does
    placed = (row,) if plan.pack is not None else ()
    names = E._Names(d, plan.dims, placed, P.runtime(plan))
    kinds = E._kinds(d)
    refs = [n for n in ir.walk(plan.skip) if isinstance(n, ir.TensorRef)]
    subst = dict(plan.step_subst)
    used = {subst[n] for n in refs}
    loads = [ld for ld in plan.loads if ld.var in used]
    tensors = mask_tensors(plan)
    sized = [w.name for w in d.wires if w.size is None or w.name in names.runtime]
    sizes = [f"_size_{w}" for w in sized]
    strides = [stride(t, w) for t in tensors for w in ir.axis_wires(d.tensor(t).axes)]
    pred = triton(plan.skip, names.ctx(row, col, {n: subst[n] for n in refs}, kinds))
    wires = batch_wires(plan)
    ctx = {
        "kernel": f"_{d.name}_ranges_kernel", "merge": f"_{d.name}_merge_ranges_kernel",
        "launcher": f"_{d.name}_ranges", "cached": f"_{d.name}_ranges_cached",
        "kept": f"_{d.name.upper()}_RANGES_KEPT",
        "params": tensors + sizes + strides + ["_parts", "_tiles", "_per"]
        + [f"{b}: tl.constexpr" for b in (names.block(row), names.block(col), "_WHOLE_ROWS", "_BY_COL", "_INT64")]
        + ([f"_pos_{row}", f"_len_{row}", f"_POS_{row}: tl.constexpr"] if placed else []),
        "placed": bool(placed),
        "no_specialize": ", ".join(f'"{s}"' for s in sizes + [f"_len_{row}"] * bool(placed) + ["_per"]),
        "tensors": tensors,
        "args": ([", ".join(tensors)] if tensors else [])  # a mask of indices alone reads no tensor
        + ([", ".join(f'_sz["{w}"]' for w in sized)] if sizes else [])
        + [f'*_wire_strides({t}, "{t}", _sz)' for t in tensors],
        "decode": E._decode(names, wires), "batch_text": ", ".join(wires) or "no batch wire",
        "grid_batch": " * ".join(f'_sz["{w}"]' for w in wires) or "1",
        "row": E._wire_ctx(names, row), "col": E._wire_ctx(names, col),
        "row_loads": [E._load(d, names, ld) for ld in loads if ld.cols is None],
        "col_loads": [E._load(d, names, ld) for ld in loads if ld.cols is not None and ld.rows is None],
        "tile_loads": [E._load(d, names, ld) for ld in loads if ld.cols is not None and ld.rows is not None],
        "pred": pred,
    }
    return E.environment().get_template("ranges.py.jinja").render(**ctx)
