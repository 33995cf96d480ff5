"""Kernel plan -> module text: fill the Jinja skeletons with generated code.

The templates (templates/*.py.jinja, loaded as package data) hold the
skeleton: program ids, the loop over the streamed wire, loads and stores,
and the run-time argument checks.  Everything the diagram says is generated
here from the plan: the tl.dot contractions, the score expression, the mask
and the loop bounds derived from it, the streaming state (init / update /
finalise), block sizes, dtypes, the reference and the tables.  The loop
over the streamed wire comes in segments (``segments``): the full blocks'
step is the same step generated with the mask taken as true (exprs.Ctx's
``known``) and no bounds masks on the streamed wire.  The loop bounds and
the per-tile test at global positions are bounds.py's.

Naming in generated code: the user's tensor names are the kernel's pointer
arguments and the launcher's parameters; every other name starts with an
underscore (the checker forbids such names in diagrams): ``_offs_q`` /
``_ok_q`` (indices and bounds mask along q), ``_i_b`` (a batch index),
``_size_x``, ``_st_Q_d`` (Q's stride along d), ``_BLOCK_q`` (a constexpr
block size).  A loaded tile or a box's step tile is ``_`` + the user's
name, which may still be one of those (a box called ``m`` or ``offs_q``):
kernel_names.fresh_name gives it ``_m_1`` then (kernel_names.internal_names lists the
kernels' own).  Launcher parameters the user's names cannot avoid are
refused with a location: inputs named like an option (``options``),
outputs named like Triton's launch options.
"""
from __future__ import annotations

import functools
from typing import Optional

from .. import ir, masks, tiling
from . import launch as H
from . import lower as L
from . import packed as P
from . import ranges as R
from . import tma as T
from . import weights as W
from .bounds import length_vars, live, loop_bounds
from .exprs import Ctx, number, triton
from .kernel_names import stride
from .launch_plan import forward_launch
from .chunks import chunk_bounds, chunk_merge, chunk_state, chunk_store, merge_launch
from .pysrc import NEG_INF, POS_INF, names_read, quote as _q, tuple_of as _tuple
from .reference import reference_lines
from .scale import log2_scale, plan_exponents



@functools.lru_cache(maxsize=1)
def environment():
    """The Jinja environment, built once per process (compile stays fast)."""
    import jinja2

    from ..resources import data_dir

    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(data_dir("templates"))),
        undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
        trim_blocks=True, lstrip_blocks=True, autoescape=False)


# --------------------------------------------------------------------------
# Names and small renderings.
# --------------------------------------------------------------------------

class _Names:
    def __init__(self, d: ir.Diagram, dims: tuple[str, ...], positional: tuple[str, ...] = (),
                 runtime: tuple[str, ...] = ()):
        self.d = d
        self.fixed = {w.name: w.size for w in d.wires if w.size is not None}
        self.dims = dims
        # wires whose rows may sit at given global positions (the attention
        # kernel's row and streamed wires): expressions read their index as
        # _idx_w and their size as _len_w, which the kernel sets from its
        # offsets and sizes unless the launcher got positions / lengths
        self.positional = positional
        # wires the kernel takes its size of at run time even when the diagram
        # fixes it: packed rows (L.packed_wire) launch with |g| = 1 and |g||q| rows
        self.runtime = frozenset(runtime)
        # the length inputs the mask's bounds read (masks.length_key): the variable of each one's
        # load before the loop (bounds.length_vars), which the bounds render in place of a size
        self.read_lengths: dict[str, str] = {}

    def size(self, w: str) -> str:
        if w in self.read_lengths:
            return self.read_lengths[w]
        return str(self.fixed[w]) if w in self.fixed and w not in self.runtime else f"_size_{w}"

    def block(self, w: str) -> str:
        return f"_BLOCK_{w}"

    def exact(self, w: str) -> bool:
        """A padded dim whose block is exactly its size needs no mask."""
        return w in self.dims and w in self.fixed and L._dim_block(self.d, w) == self.fixed[w]

    def length(self, w: str) -> str:
        """|w| as expressions see it: the global length for a positional wire
        (a fixed one's own size, whatever the launch's rows)."""
        if w in self.fixed:
            return str(self.fixed[w])
        return f"_len_{w}" if w in self.positional else self.size(w)   # size: a length's load too

    def index(self, w: str, rows: Optional[str], cols: Optional[str], glob: bool = False,
              unit: bool = False) -> str:
        """The index of w in a tile; ``glob``: the global index (expressions,
        and integer inputs, which are read at global positions); ``unit``: the
        tile with a trailing unit axis, [rows, cols, 1] (backward_emit._step_load)."""
        base = "_idx" if glob and w in self.positional else "_offs"
        if w in (rows, cols):
            return f"{base}_{w}{self.axis(w == rows, unit)}"
        return f"_i_{w}"

    @staticmethod
    def axis(row: bool, unit: bool = False) -> str:
        """The subscript that lays a vector along a tile's rows or its cols."""
        return ("[:, None" if row else "[None, :") + (", None]" if unit else "]")

    def mask(self, rows: Optional[str], cols: Optional[str], glob: bool = False, inside=(),
             unit: bool = False) -> list[str]:
        """The bounds mask of a (rows, cols) tile; ``inside``: wires known to
        be in bounds there (a full block's loop wire), which need none;
        ``unit``: as index's."""
        parts = []
        if rows in inside:
            pass
        elif rows is not None and glob and rows in self.positional:
            parts.append(f"_gok_{rows}{self.axis(True, unit)}")  # also inside the global length
        elif rows is not None and not self.exact(rows):
            parts.append(f"_ok_{rows}{self.axis(True, unit)}")
        if cols is not None and cols not in inside and not self.exact(cols):
            parts.append(f"_ok_{cols}{self.axis(False, unit)}")
        return parts

    def ctx(self, rows, cols, subst, kinds, known=frozenset()) -> Ctx:
        index = {w.name: self.index(w.name, rows, cols, glob=True) for w in self.d.wires}
        sizes = {w.name: self.length(w.name) for w in self.d.wires}
        return Ctx(index=index, size=sizes, fixed=self.fixed, subst=dict(subst), kinds=kinds, known=known)


def row_state_outputs(plan) -> tuple[str, ...]:
    """An attention's undeclared row statistics (lse = logsumexp[x](S), a row max or
    min): row state, kept in the accumulator's type whatever dtype the inputs come in
    (language.md: an undeclared lse comes back in fp32).  Beside fp32 inputs called
    with fp16 ones it followed them to fp16, and training rebuilt every P = exp(S - lse)
    from that (gradients ~10x fp16's; layouts hunt).  A weighted sum along no feature
    wire (O[b, h, q] = sum[x](P * v)) is an output like O, and follows the inputs."""
    if plan.family != "attention":
        return ()
    d = plan.diagram
    return tuple(o.name for o in d.outputs if d.tensor(o.name).dtype is None
                 and isinstance(d.tensor(o.name).expr, ir.Reduce)
                 and d.tensor(o.name).expr.op in ("logsumexp", "max", "min"))


def _kinds(d: ir.Diagram) -> dict[str, str]:
    return {t.name: "int" if t.dtype in ir.NUMBER_INT_DTYPES else "bool" if t.dtype == "bool" else "float"
            for t in d.inputs}


def _read_elsewhere(d: ir.Diagram, tensor: str, wires, steps) -> bool:
    """Whether a read of side tensor ``tensor`` along ``wires`` (at ``steps``) is not along
    its own wires: at a wire's blocks, or relabelled, not as a product's operand.  Such a
    read along a positional wire is at the rows' positions (_load), and that dimension
    holds the global length (_global_dims)."""
    return any(st != 1 for st in steps or ()) or (
        tuple(wires) != ir.axis_wires(d.tensor(tensor).axes) and tensor not in ir.product_factors(d))


def _pointer(d: ir.Diagram, names: _Names, tensor: str, wires, rows, cols, glob: bool = False,
             unit: bool = False, steps=()) -> str:
    declared = ir.axis_wires(d.tensor(tensor).axes)
    # each index widened under the kernel's _INT64 (the launcher's _int64_offsets) before its stride;
    # a coarse read's (keep[.., q // 64, ..]) floor-divided first, from the row's global position
    terms = [f"_ix({_stepped(names.index(rw, rows, cols, glob, unit), step)}, _INT64) * {stride(tensor, dw)}"
             for dw, rw, step in zip(declared, wires, steps or (1,) * len(wires))]
    return f"{tensor} + " + " + ".join(terms) if terms else tensor   # a scalar input: its one element


def _stepped(index: str, step: int) -> str:
    return index if step == 1 else f"({index}) // {step}"


def _load(d: ir.Diagram, names: _Names, ld: L.Load, inside=(), tma: Optional[T.Tma] = None,
          drop_padding: bool = False, unit: bool = False, pad: str = "0.0") -> dict:
    """A load's pointer and mask; ``inside``: wires in bounds (no mask);
    ``drop_padding``: rows at global positions past the length read as zeros
    (the mask an integer load takes), float loads too; ``unit``: the tile
    with a trailing unit axis (_Names.index; pointers only); ``pad``: what a
    float load's lanes past the edges read.
    ``tma``: the kernel's descriptors; "tma" is then the descriptor load of a
    qualifying tile (else None), taken when the kernel's constexpr _TMA is
    set.  "code": the statement(s), either way (tma.load_code)."""
    # integer and boolean inputs (ids, masks: the distributed wrappers' side
    # inputs) are read at the global positions; float inputs hold local rows
    glob = _kinds(d).get(ld.tensor) != "float"
    # a side tile read at a wire's blocks (tb[q // 3, x // 16]) or along another wire than its own
    # (bx[q] of bx[x]) indexes by the row's position, whatever its dtype: packed rows (g, q) hold q in
    # their positions, and the tensor is not laid out along the rows (read at the packed row index it
    # ran past its end); rows at padding positions (negative) read nothing of it.  A product's operand
    # read along another wire (Q[b, h, x, d], keys from the queries) holds local rows: as before.
    at = glob or bool(ld.steps) or (_read_elsewhere(d, ld.tensor, ld.wires, ld.steps)
                                    and bool(set(ld.wires) & set(names.positional)))
    mask = names.mask(ld.rows, ld.cols, at or drop_padding, inside, unit)
    other = "0" if glob else pad
    out = {"var": ld.var, "ptr": _pointer(d, names, ld.tensor, ld.wires, ld.rows, ld.cols, at, unit, ld.steps),
           "mask": f", mask={' & '.join(mask)}, other={other}" if mask else "",
           "tma": None if tma is None or glob or unit or ld.steps else tma.load(ld)}
    out["code"] = T.load_code(out["var"], out["ptr"], out["mask"], out["tma"])
    return out


def _store(d: ir.Diagram, names: _Names, out: L.Output, tma: Optional[T.Tma] = None) -> dict:
    mask = names.mask(out.rows, out.cols)
    value = f"_out_{out.name}.to({out.name}.dtype.element_ty)"
    st = {"ptr": _pointer(d, names, out.name, out.wires, out.rows, out.cols), "value": value,
          "mask": f", mask={' & '.join(mask)}" if mask else "",
          "tma": None if tma is None else tma.store(out.name, out.wires, out.rows, out.cols, value)}
    st["code"] = T.store_code(st["ptr"], st["value"], st["mask"], st["tma"])
    return st


def reads(code: str, var: str) -> bool:
    """Whether generated ``code`` (whole statements) reads the variable
    ``var``: a name it loads, not a word in a comment or a string."""
    return var in names_read(code)


def reference_inputs(d: ir.Diagram, dtype: str = "_c") -> list[str]:
    """The reference's first lines: each input by its wires (a grouped axis
    (hk g) as two dimensions), floats as ``dtype`` (a variable's name)."""
    lines = []
    for t in d.inputs:
        wires = ir.axis_wires(t.axes)
        conv = f".to({dtype})" if t.dtype not in ir.INT_DTYPES else ""
        if len(wires) != len(t.axes):
            shape = ", ".join(f'_sz["{w}"]' for w in wires)
            lines.append(f"{t.name} = {t.name}.reshape({shape}){conv}")
        elif conv:
            lines.append(f"{t.name} = {t.name}{conv}")
    return lines


def _decode(names: _Names, batch: tuple[str, ...], axis: Optional[int] = None, flat: str = "_batch") -> str:
    """Per-wire batch indices from the flat program id (innermost wire last),
    read from grid ``axis`` into ``flat`` first where given (None: the
    caller's template has read it).  ``flat``: the variable holding the flat
    index (a contraction's loop over the sum's other wires decodes its own)."""
    if not batch:
        return "# (no batch wires: one program per block)"
    lines = [] if axis is None else [f"{flat} = tl.program_id({axis}).to(tl.int64)"]
    for w in reversed(batch[1:]):
        lines.append(f"_i_{w} = {flat} % {names.size(w)}")
        lines.append(f"{flat} = {flat} // {names.size(w)}")
    lines.append(f"_i_{batch[0]} = {flat}")
    return "\n".join(lines)


def _params(d: ir.Diagram, names: _Names, blocks: list[str]) -> tuple[list[str], list[str]]:
    tensors = [t.name for t in d.inputs] + [o.name for o in d.outputs]
    sizes = [f"_size_{w}" for w in H.size_wires(d, names.runtime)]
    strides = [stride(t, w) for t in tensors for w in ir.axis_wires(d.tensor(t).axes)]
    return tensors + sizes + strides + [f"{b}: tl.constexpr" for b in blocks], sizes


def _dim_block_value(names: _Names, w: str) -> str:
    if w in names.fixed:
        return str(L._dim_block(names.d, w))
    least = tiling.least_block(names.d, w)
    return f'_dim_block(_sz["{w}"])' if least == L.MIN_DOT else f'_dim_block(_sz["{w}"], {least})'


def _wire_block_args(names: _Names, dims) -> list[str]:
    return [f"{names.block(w)}={_dim_block_value(names, w)}" for w in dims]


# --------------------------------------------------------------------------
# Attention.
# --------------------------------------------------------------------------

def _full(d, e, row, col, code, names, known=frozenset()) -> str:
    """A tile expression broadcast to the full (row, col) block when it lacks
    a wire (``known``: as rendered, with those conditions taken as true)."""
    ws = L.wires_of(d, e, known)
    if row in ws and col in ws:
        return code
    shape = f"[{names.block(row)}, {names.block(col)}]"
    if _number(code):  # a constant (a full block's where(mask, 2.0, 1.0)): not a tensor to broadcast
        return f"tl.full({shape}, {code}, tl.float32)"
    return f"tl.broadcast_to({code}, {shape})"


def _number(code: str) -> bool:
    """Whether ``code`` is a numeric literal as exprs.number writes them."""
    try:
        float(code)
        return True
    except ValueError:
        return code.lstrip("-") in ('float("inf")', 'float("-inf")', 'float("nan")')


def known(plan: L.AttentionPlan) -> frozenset:
    """What holds on every pair of a full block's tile: the mask predicate
    and its conjuncts (nothing to know without a mask)."""
    return frozenset() if plan.skip is None else frozenset({plan.skip, *masks.conjuncts(plan.skip)})


def dot_operands(lhs: str, lhs_dtype: str, rhs: str, rhs_dtype: str) -> tuple[str, str]:
    """tl.dot takes one dtype: two tiles of different dtypes meet in
    tiling.dot_dtype's (fp16 by fp32 in fp32; fp16 by bf16 in fp32; an 8-bit
    factor in the other's).  Rounding the right one to the left one's dtype
    made the answer depend on operand order, and an fp32 dC past 65504 inf in
    an fp16 matmul's dB.  A side converts to the other tile's runtime dtype
    (a tensor declared fp16 may come as bf16)."""
    if lhs_dtype == rhs_dtype:
        return lhs, rhs
    meet = tiling.dot_dtype(lhs_dtype, rhs_dtype)
    if meet == lhs_dtype:
        return lhs, f"{rhs}.to({lhs}.dtype)"
    if meet == rhs_dtype:
        return f"{lhs}.to({rhs}.dtype)", rhs
    to = {"fp16": "tl.float16", "fp32": "tl.float32"}[meet]
    return f"{lhs}.to({to})", f"{rhs}.to({to})"


def as_float(a: str, b: str) -> str:
    """What follows a score product of factors declared ``a`` and ``b``: an
    int8 pair's exact int32 sum (tl.dot's integer path) made float32, as the
    softmax and the scales take it; else nothing."""
    return ".to(tl.float32)" if tiling.dot_dtype(a, b) == "int8" else ""


def _step(plan: L.AttentionPlan, names: _Names, full: bool) -> tuple[list[str], list[str], list[str]]:
    """(init, step lines, the constexpr flags they read) of the streamed loop.  The step of
    a full block (``full``) is the same text generated with the mask taken
    as true and without the streamed wire's bounds masks: no where() on
    either is left in it."""
    d = plan.diagram
    kinds = _kinds(d)
    row, col = plan.row, plan.col
    br = names.block(row)
    ok = None if full else f"_ok_{col}[None, :]"
    sure = known(plan) if full else frozenset()

    def where(value: str, fill: str) -> str:
        return value if ok is None else f"tl.where({ok}, {value}, {fill})"

    step_subst = dict(plan.step_subst)
    lines = []
    dtypes = {t.name: t.dtype for t in d.inputs}
    for dot in plan.dots:
        lhs, rhs = dot_operands(dot.lhs.var, dtypes[dot.lhs.tensor], dot.rhs.var, dtypes[dot.rhs.tensor])
        lines.append(f'{dot.var} = tl.dot({lhs}, tl.trans({rhs}), input_precision="{plan.precision}")'
                     + as_float(dtypes[dot.lhs.tensor], dtypes[dot.rhs.tensor]))
    # each exponent as c * t (scale.py): t is what the step computes, c * log2(e) one constant
    tiles = {e: var for var, e in plan.tiles}
    factored, opened = plan_exponents(
        [e for _, e in plan.groups], [e for _, e in plan.tiles], [a.tile for a in plan.accums if a.tile is not None],
        names.fixed, lambda n: n in step_subst and n not in tiles)
    for var, e in plan.tiles:
        if e not in opened:  # an opened tile: its exponent computes t instead, and nothing else reads it
            # the tile's own root is what this line computes: render it, not its name
            # (dropping by node, not by variable: the score product never goes with it)
            own = {k: v for k, v in step_subst.items() if k != e}
            lines.append(f"{var} = {triton(e, names.ctx(row, col, own, kinds, sure))}")
    ctx = names.ctx(row, col, step_subst, kinds, sure)
    init = []
    for i, ((m, e), (c, t)) in enumerate(zip(plan.groups, factored)):
        sfx = "" if i == 0 else str(i)
        init.append(f"{m} = tl.full([{br}, 1], {NEG_INF}, tl.float32)  # running max of the exponent, log2 units")
        scaled = log2_scale(c, names.fixed)
        if not isinstance(scaled, float):  # c holds a symbolic size: one scalar per program
            init.append(f"_scale{sfx} = {triton(scaled, ctx)}  # the exponent's scale times log2(e)")
        scaled = number(scaled) if isinstance(scaled, float) else f"_scale{sfx}"
        code = _full(d, t, row, col, triton(t, ctx), names, sure)
        if ok is not None or not code.isidentifier():  # else a variable already: no copy
            code, copy = f"_s{sfx}", f"_s{sfx} = {where(code, NEG_INF)}"
        else:
            copy = None
        why = "log2(e) folded in" if c is None else "the scale > 0 times log2(e), one constant"
        lines += [f"# online softmax state {m}, log2 units: the exponent is {code} * {scaled} ({why}); one",
                  "# FMA a score, the row max scaled once (max commutes with it); rescale by 2^(m_old - m_new)"]
        lines += [copy] if copy else []
        lines += [
            f"_m_new{sfx} = tl.maximum({m}, tl.max({code}, 1)[:, None] * {scaled})",
            f"_m_use{sfx} = tl.where(_m_new{sfx} == {NEG_INF}, 0.0, _m_new{sfx})  # all -inf so far: no NaN",
            f"_alpha{sfx} = tl.exp2({m} - _m_use{sfx})",
            f"_p{sfx} = tl.exp2({code} * {scaled} - _m_use{sfx})",
            f"{m} = _m_new{sfx}",
        ]
    group_sfx = {m: ("" if i == 0 else str(i)) for i, (m, _) in enumerate(plan.groups)}
    flags: set[str] = set()
    for j, a in enumerate(plan.accums):
        shape = f"[{br}, {names.block(a.value.cols)}]" if a.value is not None else f"[{br}, 1]"
        fill = {"max": NEG_INF, "min": POS_INF}.get(a.op, "0.0")
        init.append(f"{a.var} = tl.full({shape}, {fill}, tl.float32)" if fill != "0.0"
                    else f"{a.var} = tl.zeros({shape}, tl.float32)")
        tile = None if a.tile is None else _full(d, a.tile, row, col, triton(a.tile, ctx), names, sure)
        if a.op == "expsum":
            sfx = group_sfx[a.group]
            w = f"_p{sfx}" if tile is None else where(f"_p{sfx} * ({tile})", "0.0")
            scale = f"{a.var} * _alpha{sfx}"
        else:
            fill_in = {"sum": "0.0", "max": NEG_INF, "min": POS_INF}[a.op]
            lines.append(f"_t{j} = {where(tile, fill_in)}")
            w, scale = f"_t{j}", a.var
        if a.op in ("max", "min"):
            fn = "tl.maximum" if a.op == "max" else "tl.minimum"
            red = "tl.max" if a.op == "max" else "tl.min"
            lines.append(f"{a.var} = {fn}({a.var}, {red}({w}, 1)[:, None])")
        elif a.value is not None:
            # an expsum's weights are _p <= 1 times its tile
            bounded = a.tile is None or W.fits(a.tile, names.fixed)
            lines += W.dot_lines(a.var, scale, w, a.value.var, j, plan.precision, bounded)
            flags |= {"_SPLIT_WEIGHTS"} | (set() if bounded else {"_FIT_WEIGHTS"})
        else:
            lines.append(f"{a.var} = {scale} + tl.sum({w}, 1)[:, None]")
    return init, lines, sorted(flags, reverse=True)


def segments(plan: L.AttentionPlan, lo: str, hi: str, lower: bool) -> list[dict]:
    """The loops over the visited range [lo, hi): one masked loop when no
    block is known full, else partial blocks before (only when a lower bound
    can put some there), the full blocks [_flo, _fhi), partial blocks after
    (the mask's far edge and the ragged end).  Without a lower bound the
    full blocks start the range (``_flo`` is ``lo``).  A mask that reads
    data (ranges.py) takes two loops, each walking a list the prepass made
    (``listed``: ranges.list_loop) over the whole [lo, hi) (``over``): its
    full blocks, then its partial ones; without the ranges (rows at global
    positions) the first is empty and the second visits every block."""
    if plan.full is None and not R.applies(plan):
        return [{"lo": lo, "hi": hi, "full": False, "why": "", "listed": None}]
    if plan.full is None:  # a data mask: its full and partial blocks may lie anywhere in [lo, hi)
        return [{"lo": "_flo", "hi": "_fhi", "full": True, "listed": ("_fp", "_fl", "_fq"), "over": (lo, hi),
                 "why": "# Full blocks, the prepass's list: the mask holds on the whole tile, inside the edges."},
                {"lo": "_fhi", "hi": hi, "full": False, "listed": ("_rp", "_rl", "_rq"), "over": (lo, hi),
                 "why": "# Partial blocks, the prepass's list; with positions every block, dead tiles skipped."}]
    start = "_flo" if lower else lo
    out = [{"lo": lo, "hi": "_flo", "full": False, "listed": None,
            "why": "# Partial blocks before the full ones: the mask cuts through them."}] if lower else []
    return out + [
        {"lo": start, "hi": "_fhi", "full": True, "listed": None,
         "why": "# Full blocks: the mask holds on the whole tile, inside the edges: no mask, no bounds masks."},
        {"lo": "_fhi", "hi": hi, "full": False, "listed": None,
         "why": "# Partial blocks after: the mask's edge, the ragged end; with positions every block, dead tiles skipped."}]


def loop_head(seg: dict, var: str, step: str, cut: str = "") -> str:
    """A segment's loop header, ``var`` (``_start``) each block's first offset; ``cut`` as R.list_loop's."""
    if seg["listed"]:
        return "\n".join(R.list_loop(var, seg, step, cut=cut))
    return f"for {var} in range({seg['lo']}, {seg['hi']}, {step}):"


# A partial step at positions runs under ``if _live:`` (bounds.live); without
# them _live is a constexpr True, so that branch is static and the step
# compiles as it would unwrapped.
LIVE_CONSTANT = "_live: tl.constexpr = True  # no positions on this wire: the loop's range does the skipping"


def attention_context(plan: L.AttentionPlan, saved: tuple[str, ...] = ()) -> dict:
    """The template context of an attention kernel and its launch.  ``saved``
    names outputs of the plan that only training needs (the row state the
    backward reads, see training.py): the kernel stores them only when its
    constexpr _SAVE is set, so the plain forward moves exactly what it did."""
    d = plan.diagram
    names = _Names(d, plan.dims, (plan.row, plan.col), P.runtime(plan))
    names.read_lengths = length_vars(plan.bounds, plan.loads)
    kinds = _kinds(d)
    row, col = plan.row, plan.col
    br, bc = names.block(row), names.block(col)
    init, lines, flags = _step(plan, names, full=False)
    tma = T.Tma(plan, names, {row: "_row0", col: "_start"})
    pre_loads = [_load(d, names, ld, tma=tma) for ld in plan.loads if ld.phase == "pre"]
    step_loads = [ld for ld in plan.loads if ld.phase == "step"]
    segs = segments(plan, "_lo", "_hi", any(b.kind == "lower" for b in plan.full or ()))
    for seg in segs:
        seg["step"] = "\n".join(_step(plan, names, full=True)[1] if seg["full"] else lines)
        # a full step may not read what only the mask reads (a data mask's ids): no load for it
        seg["loads"] = [_load(d, names, ld, (col,) if seg["full"] else (), tma) for ld in step_loads
                        if not seg["full"] or reads(seg["step"], ld.var)]
        seg["pad"] = "" if seg["full"] else "    "  # a partial step sits under `if _live:`
        seg["head"] = loop_head(seg, "_start", bc, "_CHUNK")
    accums = {a.var: a for a in plan.accums}
    finalise, stores = _finalise(d, names, [o for o in plan.outputs if o.name not in saved], kinds, accums, tma)
    save_finalise, save_stores = _finalise(d, names, [o for o in plan.outputs if o.name in saved], kinds, accums)
    blocks_list = [br, bc] + [names.block(w) for w in plan.dims] + flags + ["_INT64"] + (["_SAVE"] if saved else [])
    params, sizes = _params(d, names, blocks_list)
    positional = len(params) - len(blocks_list)  # tensors, sizes, strides: the launcher's _args
    # positions / lengths (see the template): runtime arguments and a constexpr flag per wire
    params += [f"_pos_{row}", f"_pos_{col}", f"_len_{row}", f"_len_{col}",
               f"_POS_{row}: tl.constexpr", f"_POS_{col}: tl.constexpr"]
    sizes = sizes + [f"_len_{row}", f"_len_{col}"]
    params += tma.params()
    params += ["_part", "_n_chunks", "_CHUNK: tl.constexpr"]  # chunks of the streamed wire (chunk_state)
    sizes = sizes + ["_n_chunks"]
    opts = H.options(d, [row, col], (T.OPTION,))
    H.refuse_clash(d, H.LAUNCH_OPTIONS)
    _, launch_width = chunk_state(plan, names, lambda w: _dim_block_value(names, w))
    # chunk= is no tuned option of the backward's kernels (nor in the torch op's schema), but the
    # forward's tuned config may set it (autotune.chunk_lengths)
    # the launch grid's limits as the launch checks them (_fits): axis 1 the batch wires (the
    # fakes' sizes are unpacked: packed rows' wire is no batch wire there), axis 2 the chunks where
    # the caller gives chunk= (else a tuned chunk may differ)
    batch = " * ".join(f'_sz["{w}"]' for w in plan.batch if plan.pack is None or w != plan.pack[0]) or "1"
    checks = H.given_blocks([row, col]) + [
        H.tile_fits(row, col), f"_tma_check({T.OPTION})",
        f'_n_chunks = _chunks(chunk, None, _b_{col}, _sz["{col}"], block_{col} is not None)[1]',
        f"_fits((1, {batch}, _n_chunks if chunk is not None else 1))"]
    launch = H.fill_options(opts + ["chunk"]) + [
        # the caller's lengths= of the streamed wire, where the kernel may stop (before _pack's positions)
        "_cut = _streamed_cut(positions, lengths, _sz)"] + P.launch_lines(plan, R.applies(plan)) + [
        f'_br = _block_size(_opts["block_{row}"], "{row}", "block_{row}")',
        f'_bc = _block_size(_opts["block_{col}"], "{col}", "block_{col}")',
        H.tile_fits(row, col, "_br", "_bc"),
        # packed rows: _pack checked the caller's positions and made the launch's from them
        "_pos = _position_args(positions, lengths, _sz)" if plan.pack is not None else
        f"_pos = _positions(positions, lengths, _sz, _dev, ({', '.join(t.name for t in d.inputs)},))",
        # before the outputs are allocated: those take their names as locals, and an output may be
        # named like an option (an output block_x made a caller's block_x look given)
        f'_chunk, _n_chunks = _chunks(chunk, _opts["chunk"], _bc, _sz["{col}"], block_{col} is not None)',
        f"[{', '.join(o.name for o in d.outputs if o.name not in saved)}] = _allocate(_sz, _cls, _dev, out_dtype)",
        *_allocate_saved(d, saved),
        f'_grid = _fits((_cdiv(_sz["{row}"], _br), '
        + (" * ".join(f'_sz["{w}"]' for w in plan.batch) or "1") + ", _n_chunks))  # axis 2: the chunks of "
        + f"{col} (1: whole)",
        f'_part = torch.empty(math.prod(_grid[1:]) * _sz["{row}"] * ({launch_width}), dtype=torch.float32, '
        "device=_dev) if _chunk else None  # the chunks' states"]
    block_args = [f"{br}=_br", f"{bc}=_bc"] + _wire_block_args(names, plan.dims)
    # descriptors when tma= asks and every tile can take one (_tma_args), else the pointer code
    blocks = {row: "_br", col: "_bc", **{w: _dim_block_value(names, w) for w in plan.dims}}
    # the streamed wire cut at its length: no positions, the kernel's size its length; a descriptor
    # then ends at the length too, so the rows past it read as zeros, as the masked loads give them
    # (it read the stale rows of the whole cache, so lengths= had turned TMA off)
    launch.append(f'if _cut is not None:\n    _pos.update(_pos_{col}=None, _POS_{col}=False)')
    launch.append(tma.launch("_tma", f'_opts["{T.OPTION}"]', "_TMA_DESCS",
                             [x.name for x in d.inputs] + [o.name for o in d.outputs], blocks, "_tma_last",
                             sizes=f'(_sz if _cut is None else {{**_sz, "{col}": _cut}})'))
    if "_FIT_WEIGHTS" in flags:  # weights of no known bound, rounded to a float16 V
        values = sorted({a.value.tensor for a in plan.accums if a.value is not None})
        block_args.append(f"_FIT_WEIGHTS=any(t.dtype == torch.float16 for t in ({', '.join(values)},))")
    if "_SPLIT_WEIGHTS" in flags:  # only outputs that use a weighted sum of V decide it (not lse, say)
        # not 8-bit score factors: an fp16 O beside e4m3 Q and K keeps fp16 weights, as beside fp16 ones
        inputs = ", ".join(t.name for t in d.inputs if t.dtype not in ir.FACTOR_DTYPES)
        valued = {a.var for a in plan.accums if a.value is not None}
        outputs = ", ".join(o.name for o in plan.outputs if o.name not in saved
                            and any(isinstance(n, L.Var) and n.name in valued for n in L.nodes(o.expr)))
        block_args.append(f"_SPLIT_WEIGHTS=_wider([{outputs}], [{inputs}])")
    block_args.append(f"_INT64=_int64_offsets({', '.join([t.name for t in d.inputs] + [o.name for o in d.outputs])})")
    if saved:
        block_args.append("_SAVE=_save")
    block_args += ["_part=_part", "_n_chunks=_n_chunks", "_CHUNK=_chunk", "**_pos", "**_tma"]
    bounds = loop_bounds(names, plan)
    if R.applies(plan):  # a data mask: the prepass's ranges, unless rows sit at global positions
        bounds = "\n".join([bounds] + R.bounds_lines(names, plan, col, cut="_CHUNK"))
        params += ["_ranges", "_RANGES: tl.constexpr"]
        launch.append(R.launch(plan, "_rng", "_br", "_bc", False, False, *P.ranges_on(plan, R.WITHOUT_POSITIONS),
                               prefix="_chunk != 0"))
        block_args += ["_ranges=_rng", "_RANGES=_rng_on"]
    extra = ['num_warps=_opts["num_warps"] or (8 if _br >= 128 else 4)', 'num_stages=_opts["num_stages"] or 2',
             H.FP_FUSION]
    # the kernel's positional arguments, worked out once: a chunked launch's merge takes a slice
    # of them (a decode step's launch is short enough for the host's time to show)
    cut = f'_sz["{col}"]'
    args = [line.replace(cut, f"({cut} if _cut is None else _cut)") for line in H.positional_args(d, names.runtime)]
    assert sum(cut in line for line in args) <= 1, args   # the sizes' line alone holds it
    launch += ["_args = (\n    " + ",\n    ".join(args) + ",\n)",
               f"_meta = dict({', '.join(block_args + extra)})"]
    merged = {spec.var for spec in merge_loads(plan)}
    ctx = {
        "kernel": f"_{d.name}_kernel", "merge_kernel": f"_{d.name}_merge", "params": params,
        "no_specialize": ", ".join(f'"{s}"' for s in sizes),
        "decode": _decode(names, plan.batch, 1), "pid": masks.program_order(plan.bounds, "row"),
        "row": _wire_ctx(names, row), "col": _wire_ctx(names, col),
        "dims": [_wire_ctx(names, w) for w in plan.dims],
        "pre_loads": pre_loads,
        "segments": segs,
        "tma_descs": tma.table(), "tma_col": _q(col),
        "init": "\n".join(init), "bounds": bounds, "ranges": R.render(plan),
        "live": "\n".join(live(names, plan, col)), "live_constant": LIVE_CONSTANT,
        "finalise": finalise, "stores": stores, "launch": "\n".join(launch), "check_options": H.option_checks(checks),
        "chunk": L.chunk_of(d), "chunk_bounds": "\n".join(chunk_bounds(segs)),
        **P.context(plan, saved),
        "chunk_store": "\n".join(chunk_store(plan, names)), "chunk_merge": "\n".join(chunk_merge(plan, names)),
        "merge_loads": [ld for ld, spec in zip(pre_loads, [x for x in plan.loads if x.phase == "pre"])
                        if spec.var in merged],
        "save_finalise": save_finalise, "save_stores": save_stores,
        "launcher_params": ", ".join([t.name for t in d.inputs] + ["*"] + [f"{o}=None" for o in opts]
                                     + [f"{o}=None" for o in H.LAUNCH_OPTIONS]),
        "options": opts,
        "positional": _tuple(_q(w) for w in (row, col)), "global_dims": _global_dims(d, (row, col)),
        "length_dims": _length_dims(d, (row, col)),
        "bind_free": ", free=_global_dims(positions)",
        "local_args": "".join(f", {o}" for o in H.LAUNCH_OPTIONS),
        "local_params": "".join(f", {o}=None" for o in H.LAUNCH_OPTIONS),
    }
    # the merge kernel takes what its body reads (chunks.merge_launch), rendered from the template
    # each read back from the kernel's _meta, so no expression (_int64_offsets's
    # walk over the tensors, say) is worked out a second time for the merge
    named = [arg.split("=", 1)[0] for arg in block_args if not arg.startswith("**")]
    named += [p for w in (row, col) for p in (f"_pos_{w}", f"_len_{w}", f"_POS_{w}")]
    named += [q.split(":")[0] for q in tma.params()]
    keywords = {p: f'_meta["{p}"]' for p in named}
    options = [f'{k}=_meta["{k}"]' for k in (arg.split("=", 1)[0] for arg in extra)]
    parts = environment().get_template("attention_parts.py.jinja").make_module(vars=ctx)
    # its header's rows' global indices and real-rows mask only where the merge
    # reads them (its stores mask with _ok): else no positions parameters either
    # and the offsets of the feature wires it reads (a score's wire alone, MLA's c and r: none)
    bare = str(parts.merge_body(True, True, ()))
    only = tuple(w["wire"] for w in ctx["dims"] if reads(bare, w["offs"]) or reads(bare, w["ok"]))
    body = str(parts.merge_body(True, True, only))
    gok = reads(body, ctx["row"]["gok"])
    if not gok:
        body = str(parts.merge_body(True, False, only))
    idx = gok or reads(body, ctx["row"]["idx"])
    if not idx:
        body = str(parts.merge_body(False, False, only))
    ctx["merge_rows"] = (idx, gok, only)
    ctx["merge_params"], merge = merge_launch(f"_{d.name}_merge", body, params, positional, keywords, options)
    ctx["merge_no_specialize"] = ", ".join(f'"{s}"' for s in sizes if s in ctx["merge_params"])
    tail = (f"if math.prod(_grid) > 0:\n    _{d.name}_kernel[_grid](*_args, **_meta)\n"
            "    if _chunk:  # the chunks' states, merged into the outputs\n" + H.indent(merge, 8))
    inputs = [t.name for t in d.inputs]
    # no _BIND_MEMO entry: a signature seen before takes its launch plan, which holds the binding
    bind = (f"_sz, _cls, _dev = _bind_for_launch(({', '.join(inputs)},), free=_global_dims(positions), "
            "remember=False)")
    # the kernel's tensors after the inputs, in its order (H.positional_args): outputs, saved state
    # a mask that reads data: a plan's call (never one with positions or lengths) runs its prepass
    # again; packed rows' prepass reads the launch's positions (each packed row's q), which the
    # plan's keywords hold (_fixed: _pos_q, _len_q, _POS_q)
    ranges = R.launch(plan, "_rng", "_br", "_bc", False, False, R.WITHOUT_POSITIONS,
                      "_fixed" if plan.pack is not None else "", "_chunk != 0") if R.applies(plan) else ""
    # where _args holds the streamed wire's size, which a plan's call of a short length replaces
    sized = H.size_wires(d, names.runtime)
    cut_at = (len(inputs) + len(d.outputs) + sized.index(col), col) if col in sized else None
    ctx["launch"] = forward_launch(inputs, [o.name for o in d.outputs], opts + ["_save", "out_dtype", "chunk"],
                                   bind + "\n" + ctx["launch"], tail, P.packed_inputs(plan), ranges, cut_at)
    ctx["binds"] = True   # the launch block binds (after its plan lookup): the template does not
    return ctx


def merge_loads(plan: L.AttentionPlan) -> list[L.Load]:
    """The tiles without the streamed wire that the merge kernel loads again:
    those the finalise of an output (a saved one too) reads.  The cost model
    counts them (napkin/cost/chunks.py)."""
    names = _Names(plan.diagram, plan.dims, (plan.row, plan.col), P.runtime(plan))
    code, _ = _finalise(plan.diagram, names, list(plan.outputs), _kinds(plan.diagram),
                        {a.var: a for a in plan.accums})
    return [ld for ld in plan.loads if ld.phase == "pre" and reads(code, ld.var)]


def _allocate_saved(d: ir.Diagram, saved) -> list[str]:
    """float32 buffers for the saved row state; empty ones (the kernel writes
    nothing) when the call does not save it."""
    lines = []
    for name in saved:
        n = len(d.tensor(name).axes)
        lines.append(f'{name} = torch.empty(_shape("{name}", _sz) if _save else [0] * {n}, '
                     "dtype=torch.float32, device=_dev)")
    return lines


def _wire_ctx(names: _Names, w: str) -> dict:
    return {"wire": w, "offs": f"_offs_{w}", "ok": f"_ok_{w}", "block": names.block(w), "size": names.size(w),
            "exact": names.exact(w), "idx": f"_idx_{w}", "gok": f"_gok_{w}", "pos": f"_pos_{w}",
            "len": f"_len_{w}", "flag": f"_POS_{w}"}


def _length_dims(d: ir.Diagram, positional) -> str:
    """``_LENGTH_DIMS``: for each positional wire some input holds as a
    dimension of its own, (that input's index, the dimension): where a plan's
    key reads the wire's local size before any binding (_lengths_key)."""
    found = {}
    for w in positional:
        at = next(((i, k) for i, t in enumerate(d.inputs) for k, axis in enumerate(t.axes) if tuple(axis) == (w,)),
                  None)
        if at is not None:
            found[w] = at
    return "{" + ", ".join(f"{_q(w)}: {found[w]}" for w in positional if w in found) + "}"


def _global_dims(d: ir.Diagram, positional) -> str:
    """``_GLOBAL_DIMS``: (input, dimension, positional wires it is read along
    there, number of wires the dimension flattens, step) for the integer and
    boolean inputs, which are read at global positions, and any side input
    read along a positional wire it is not declared along, or at its blocks
    (step: the block, 1 elsewhere; such a dimension holds the global
    length's blocks; _load reads them at positions); the launcher refuses
    positions for a dimension that flattens such a wire with others (its
    global extent would mix two lengths)."""
    reads: dict = {}   # (input, declared wire) -> {(wire read, step, read elsewhere)}
    for let in d.lets:
        for n in ir.walk(let.expr):
            if isinstance(n, ir.TensorRef) and isinstance(d.tensor(n.name), ir.Input):
                declared = ir.axis_wires(d.tensor(n.name).axes)
                wires, steps = n.wires or declared, ir.read_steps(n) if n.wires else (1,) * len(declared)
                elsewhere = _read_elsewhere(d, n.name, wires, steps)
                for dw, rw, step in zip(declared, wires, steps):
                    reads.setdefault((n.name, dw), set()).add((rw, step, elsewhere))
    rows = []
    for t in d.inputs:
        for i, axis in enumerate(t.axes):
            read = {r for dw in axis for r in reads.get((t.name, dw), ())}
            ws = [w for w in positional if any(rw == w for rw, _, _ in read)]
            step = max((st for rw, st, _ in read if rw in ws), default=1)
            at = t.dtype not in ir.FLOAT_DTYPES or any(rw in ws and e for rw, _, e in read)   # _load's rule
            if ws and at:
                rows.append(f'("{t.name}", {i}, {_tuple(_q(w) for w in ws)}, {len(axis)}, {step})')
    return _tuple(rows)


def _finalise(d, names: _Names, outputs, kinds, accums: dict, tma: Optional[T.Tma] = None) -> tuple[str, list]:
    lines, stores = [], []
    for out in outputs:
        ctx = names.ctx(out.rows, out.cols, dict(out.subst), kinds)
        code = triton(out.expr, ctx)
        has_cols = out.cols is None or _has_wire(d, out.expr, out.cols, accums)
        if not has_cols:
            code = f"tl.broadcast_to({code}, [{names.block(out.rows)}, {names.block(out.cols)}])"
        lines.append(f"_out_{out.name} = {code}")
        stores.append(_store(d, names, out, tma))
    return "\n".join(lines), stores


def _has_wire(d, e, wire, accums) -> bool:
    for n in L.nodes(e):
        if isinstance(n, L.Var) and n.name in accums and accums[n.name].value is not None:
            if accums[n.name].value.cols == wire:
                return True
        elif wire in L.wires_of(d, n) and not isinstance(n, L.Var):
            return True
    return False


# --------------------------------------------------------------------------
# Contraction.
# --------------------------------------------------------------------------

# --------------------------------------------------------------------------
# The module.
# --------------------------------------------------------------------------

def _layout_repr(axes) -> str:
    return _tuple(_tuple(_q(w) for w in axis) for axis in axes)


def module_context(plan: L.Plan, *, docstring: str, version: str, source_hash: str) -> dict:
    """Everything the templates need.  The kernel comes from training.py's
    forward plan (the diagram plus the row state training saves); the
    tables, the reference and the docs from the diagram itself."""
    from . import training

    d = plan.diagram
    train = training.prepare(plan)
    if plan.family == "attention":
        ctx = attention_context(train.forward, train.saved)
    else:
        from .contraction import contraction_context
        ctx = contraction_context(train.forward)
    tensors = list(d.inputs) + [d.tensor(o.name) for o in d.outputs]
    out_dtypes = {o.name: o.dtype for o in plan.outputs}
    layouts = "{\n" + "".join(f'    "{t.name}": {_layout_repr(t.axes)},\n' for t in tensors) + "}"
    dtypes = "{" + ", ".join(f'"{t.name}": "{t.dtype if isinstance(t, ir.Input) else out_dtypes[t.name]}"'
                             for t in tensors) + "}"
    relabels = [r[:3] for r in ir.relabels(d)]
    blocks = "{" + ", ".join(f'"{w}": {n}' for w, n in plan.blocks) + "}"
    accumulated = row_state_outputs(plan)
    ref_inputs = reference_inputs(d)
    # what the reference computes in: float32 holds integers to 2**24 exactly, and an int8 sum passes it
    ref_dtype = "torch.float64  # int8 factors: their sums are exact in float64" \
        if any(t.dtype == "int8" for t in d.inputs) else "torch.float64 if torch.float64 in _cls.values() else torch.float32"
    returns = [f'{o.name}.reshape(_shape("{o.name}", _sz)).to(_out_dtype("{o.name}", _cls))' for o in d.outputs]
    ctx.update({
        "docstring": docstring, "version": version, "source_hash": source_hash, "name": d.name,
        "inputs": _tuple(_q(t.name) for t in d.inputs), "outputs": _tuple(_q(o.name) for o in d.outputs),
        "wires": "{" + ", ".join(f'"{w.name}": {w.size}' for w in d.wires) + "}",
        "layouts": layouts, "dtypes": dtypes, "accumulated": _tuple(_q(n) for n in accumulated),
        "relabels": _tuple(_tuple(_q(x) for x in r) for r in relabels), "blocks": blocks,
        "coarse": _tuple(f"({_q(t)}, {_q(dw)}, {_q(rw)}, {step})" for t, dw, rw, step, _ in ir.coarse_reads(d)),
        "length_inputs": "{" + ", ".join(f"{_q(n)}: {_q(w)}" for n, w in ir.length_inputs(d)) + "}",
        "int8_scales": _tuple(_q(n) for n in tiling.int8_scales(d)),
        "input_params": ", ".join(t.name for t in d.inputs),
        "input_tuple": ", ".join(t.name for t in d.inputs) + ("," if len(d.inputs) == 1 else ""),
        "returns": ", ".join(o.name for o in d.outputs),
        "reference_dtype": ref_dtype, "reference_inputs": ref_inputs, "reference_body": reference_lines(d),
        "autotune_wires": repr(tuple(w.name for w in d.wires if w.size is None)),
        # the feature wires the forward's and the backward's kernels hold whole beside a block
        "tile_dims": H.tile_dims(d, (*train.forward.dims,
                                     *(train.backward.dims if train.backward is not None else ()))),
        "reference_returns": ", ".join(returns) if len(returns) > 1 else returns[0],
        "launcher_doc": H.launcher_doc(plan, ctx["options"], train.reason,
                                      training.no_gradient(train)),
        "option_params": ", ".join(ctx["options"]), "single": len(d.outputs) == 1,
        # the whole-number options, as the torch op's schema takes them (tma has _tma_check)
        "int_options": ", ".join(o for o in ctx["options"] if o != "tma"),
        "int_option_names": _tuple(_q(o) for o in ctx["options"] if o != "tma"),
        "saved_returns": "".join(f"{n}, " for n in train.saved).rstrip(" "),
        "backward_layouts": training.backward_layouts(train),
    })
    ctx.update(training.context(train, name=d.name, options=ctx["options"], source_hash=source_hash))
    return ctx


def render(plan: L.Plan, **kw) -> str:
    template = environment().get_template(f"{plan.family}.py.jinja")
    text = template.render(**module_context(plan, **kw))
    return text.rstrip("\n") + "\n"
