"""Differential fuzz of TMA descriptors against the pointer code (tma=True vs
tma=False) on random attention diagrams, layouts and calls.

A case is an ``attention_diagrams()`` variant (tests/strategies.py) rewritten
to unusual layouts: axes of Q, K, V, O, lse, bias and the masks in other
orders (the head dim sometimes not innermost), grouped query heads
(hk g) / (g hk) as examples/gqa.ncd, a value head dim e apart from d, head
dims that are not powers of two (padded), a bool mask beside the drawn one;
then a call: fp16 or fp32, ragged sizes, explicit blocks (16 to 128) or the
schedule's, inputs passed as strided views (other storage orders, slices of a
wider head dim or batch, storage offsets that do or do not keep 16-byte
alignment), output gradients of any strides (zero ones too), rows or keys at
global positions, out_dtype.

The property: every output and every gradient with tma=True is bitwise the
tma=False call's (the interpreter runs descriptors on the CPU), and each
kernel either took its descriptors or fell back for a reason
``_tma_last*`` states and the case explains.  ``tma_fuzz_stats`` counts how
often each kernel really used TMA, so the fuzz is not vacuous; a long run:
``python tests/test_tma_fuzz.py N [LOG]`` (offline, under TRITON_INTERPRET=1;
TMA_FUZZ_REFERENCE=1 also holds each call loosely to the float64 reference).

Padding rows (at positions past the length) hold NaN in the cases.  They
must read as zeros (keys everywhere, query rows in the backward), which a
descriptor cannot do: those launches fall back to the pointer code.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import zlib
from collections import Counter
from pathlib import Path

if __name__ == "__main__":   # the offline run (under pytest, conftest decides)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from napkin import ir  # noqa: E402
from napkin.errors import NapkinError  # noqa: E402
from napkin.printer import to_text  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from strategies import attention_diagrams  # noqa: E402
import test_backward as tb  # noqa: E402  (its compile_text)

# Bitwise equality is the interpreter's (on a GPU the two codes compile to other instruction orders).
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs under TRITON_INTERPRET=1")

TF_KERNELS = ("_tma_last", "_tma_last_dq", "_tma_last_dkdv")
TF_TORCH = {"fp16": torch.float16, "fp32": torch.float32}
TF_HEADS = (8, 16, 24, 32, 40, 48, 64, 80, 96, 128)
TF_SEQ = (1, 16, 17, 33, 50, 64, 100)
_TF_REFUSED: set[str] = set()   # texts napkin refuses (tma_fuzz_module)
_TF_FOLDER = Path(tempfile.mkdtemp(prefix="napkin_tma_fuzz_"))
# How often each kernel took its descriptors, over every case run in this process.
tma_fuzz_stats: Counter = Counter()


# --------------------------------------------------------------------------
# Diagrams: a drawn attention variant, rewritten.
# --------------------------------------------------------------------------

def _tf_map_axes(axes, fn):
    out = []
    for axis in axes:
        out.extend(fn(axis))
    return tuple(out)


def _tf_grouped(d: ir.Diagram, order: tuple[str, str], kv_grouped: bool, g) -> ir.Diagram:
    """h -> hk, g (|g| = ``g``, None: symbolic): K and V over hk (or the whole
    (hk g) when kv_grouped: then no shape tells |g|, fixed), the other tensors
    over the grouped axis ``order``, the boxes S, P over hk, g."""
    def rewrite(name, axes):
        if name in ("S", "P"):
            return _tf_map_axes(axes, lambda a: (("hk",), ("g",)) if a == ("h",) else (a,))
        if name in ("K", "V") and not kv_grouped:
            return _tf_map_axes(axes, lambda a: (("hk",),) if a == ("h",) else (a,))
        return _tf_map_axes(axes, lambda a: (order,) if a == ("h",) else (a,))

    wires = []
    for w in d.wires:
        wires += [ir.Wire("hk", w.size), ir.Wire("g", g)] if w.name == "h" else [w]
    inputs = tuple(dataclasses.replace(t, axes=rewrite(t.name, t.axes)) for t in d.inputs)
    lets = tuple(dataclasses.replace(t, axes=rewrite(t.name, t.axes)) for t in d.lets)
    levels = []
    for lv in d.schedule.levels:
        tiles = []
        for t in lv.tiles:
            tiles += [dataclasses.replace(t, wire="hk"), dataclasses.replace(t, wire="g")] if t.wire == "h" else [t]
        levels.append(dataclasses.replace(lv, tiles=tuple(tiles)))
    return dataclasses.replace(d, wires=tuple(wires), inputs=inputs, lets=lets,
                               schedule=dataclasses.replace(d.schedule, levels=tuple(levels)))


def _tf_value_dim(d: ir.Diagram, size) -> ir.Diagram:
    """V and O over a value head dim e apart from d."""
    def swap(axes):
        return _tf_map_axes(axes, lambda a: (("e",),) if a == ("d",) else (a,))
    inputs = tuple(dataclasses.replace(t, axes=swap(t.axes)) if t.name == "V" else t for t in d.inputs)
    lets = tuple(dataclasses.replace(t, axes=swap(t.axes)) if t.name == "O" else t for t in d.lets)
    return dataclasses.replace(d, wires=d.wires + (ir.Wire("e", size),), inputs=inputs, lets=lets)


def _tf_bool_mask(d: ir.Diagram, layout) -> ir.Diagram:
    """A bool mask keep[...] and-ed into the drawn mask (only where there is
    one: the normaliser then already copes with -inf and empty rows)."""
    s = d.lets[0]
    e = s.expr
    assert isinstance(e, ir.Call) and e.fn == "where"
    cond = ir.Binary("and", e.args[0], ir.TensorRef("keep"))
    lets = (dataclasses.replace(s, expr=ir.Call("where", (cond,) + e.args[1:])),) + d.lets[1:]
    inputs = d.inputs + (ir.Input("keep", tuple((w,) for w in layout), "bool"),)
    levels = list(d.schedule.levels)
    levels[0] = dataclasses.replace(levels[0], holds=levels[0].holds + ("keep",))
    return dataclasses.replace(d, inputs=inputs, lets=lets,
                               schedule=dataclasses.replace(d.schedule, levels=tuple(levels)))


def _tf_self_keys(d: ir.Diagram) -> ir.Diagram:
    """Keys read from Q relabelled along x (K dropped): one tensor behind two
    descriptors (rows of q, rows of x); |x| = |q|.  Forward only."""
    q_axes = next(t.axes for t in d.inputs if t.name == "Q")
    relabel = ir.TensorRef("Q", tuple("x" if a == ("q",) else a[0] for a in q_axes))

    def swap(e):
        if isinstance(e, ir.TensorRef) and e.name == "K":
            return relabel
        if isinstance(e, ir.Binary):
            return ir.Binary(e.op, swap(e.lhs), swap(e.rhs))
        if isinstance(e, ir.Unary):
            return ir.Unary(e.op, swap(e.operand))
        if isinstance(e, ir.Call):
            return ir.Call(e.fn, tuple(swap(a) for a in e.args))
        if isinstance(e, ir.Reduce):
            return dataclasses.replace(e, body=swap(e.body))
        if isinstance(e, ir.Normalize):
            return dataclasses.replace(e, body=swap(e.body))
        return e

    q = next(w for w in d.wires if w.name == "q")
    wires = tuple(ir.Wire("x", q.size) if w.name == "x" else w for w in d.wires)
    levels = list(d.schedule.levels)
    levels[0] = dataclasses.replace(levels[0], holds=tuple(h for h in levels[0].holds if h != "K"))
    return dataclasses.replace(d, wires=wires, inputs=tuple(t for t in d.inputs if t.name != "K"),
                               lets=tuple(dataclasses.replace(t, expr=swap(t.expr)) for t in d.lets),
                               schedule=dataclasses.replace(d.schedule, levels=tuple(levels)))


def _tf_permute(draw, axes, head):
    """A random order of ``axes``: usually with the head dim (a wire in
    ``head``) kept innermost, sometimes any order."""
    axes = list(axes)
    kind = draw(st.sampled_from(("keep", "keep", "inner", "inner", "any")))
    if kind == "keep":
        return tuple(axes)
    if kind == "any" or not axes or axes[-1][0] not in head:
        return tuple(draw(st.permutations(axes)))
    return tuple(draw(st.permutations(axes[:-1]))) + (axes[-1],)


@st.composite
def tma_fuzz_diagrams(draw) -> ir.Diagram:
    """An attention_diagrams() variant, rewritten as the module docstring says."""
    # (masks without chunks or remainders: a descriptor does not read the mask, and with them the
    # draws shifted to a dozen cases of keys at positions, where no descriptor applies)
    d = draw(attention_diagrams(floors=False))
    # head dims, padded or not; symbolic ones get a size at the call
    d = dataclasses.replace(d, wires=tuple(
        ir.Wire("d", draw(st.one_of(st.none(), st.sampled_from(TF_HEADS)))) if w.name == "d" else
        ir.Wire(w.name, draw(st.one_of(st.none(), st.sampled_from(TF_SEQ)))) if w.name == "q" and w.size
        is not None and not any(t.name == "doc" for t in d.inputs) else w for w in d.wires))
    if draw(st.integers(0, 4)) == 0:
        d = _tf_value_dim(d, draw(st.one_of(st.none(), st.sampled_from(TF_HEADS))))
    if draw(st.integers(0, 2)) == 0:
        kv_grouped = draw(st.integers(0, 4)) == 0
        g = draw(st.sampled_from((1, 2, 3)) if kv_grouped else st.sampled_from((None, None, 1, 2)))
        d = _tf_grouped(d, draw(st.sampled_from((("hk", "g"), ("hk", "g"), ("g", "hk")))), kv_grouped, g)
    s = d.lets[0].expr
    if isinstance(s, ir.Call) and s.fn == "where" and draw(st.booleans()):
        bq = ("b", "q", "x")
        d = _tf_bool_mask(d, draw(st.sampled_from((bq, ("q", "x"), ("x", "q"), ("b", "x"), bq))))
    head = ("d", "e")
    # (doc[b, q] relabels doc's axes in order: doc keeps its layout)
    # (a read at blocks, tb[q // 3, x // 16] or kb[x // 4], names its wires in the declared order: kept too)
    inputs = tuple(dataclasses.replace(t, axes=_tf_permute(draw, t.axes, head))
                   if t.name not in ("slope", "doc", "tb", "kb") else t for t in d.inputs)
    lets = tuple(dataclasses.replace(t, axes=_tf_permute(draw, t.axes, head)) if t.name in ("O", "lse") else t
                 for t in d.lets)
    d = dataclasses.replace(d, inputs=inputs, lets=lets)
    if not any(w.name == "hk" for w in d.wires) and draw(st.integers(0, 7)) == 0:
        d = _tf_self_keys(d)
    return d


# --------------------------------------------------------------------------
# Calls: sizes, views, options.
# --------------------------------------------------------------------------

@dataclasses.dataclass
class TmaCase:
    text: str
    sizes: dict
    dtype: str
    views: dict            # input name -> view kind
    grads: tuple           # per output: the output gradient's layout kind
    mode: str              # "train" (autograd), "forward" (no grad), "backward" (NAME_backward)
    opts: dict             # block_q, block_x; out_dtype (forward); grad_dtype (backward)
    positions: str         # "", "q" or "x": that wire's rows at global positions (forward, backward)
    seed: int
    need: tuple = ()       # the inputs that want a gradient (train, backward); () all


# Views a descriptor takes (other strides, 16-byte aligned), and those it cannot
# (an odd offset or row stride, a head dim not innermost in storage, zero
# strides): one tensor of a "hostile" case gets one of the latter.
_TF_FIT = ("contiguous", "contiguous", "storage", "pad_head", "slice_outer", "offset16")
_TF_UNFIT = ("storage_any", "pad_head_odd", "offset_odd", "zero_stride")
_TF_GRADS = ("contiguous", "contiguous", "storage", "pad_head", "storage_any", "zero")


@st.composite
def tma_fuzz_cases(draw) -> TmaCase:
    d = draw(tma_fuzz_diagrams())
    text = to_text(d)
    sizes = {}
    blocks = {declared for _, declared, _, _, _ in ir.coarse_reads(d)}   # a tile bias's qb, xb: below
    for w in d.wires:
        if w.name in blocks and w.size is None:
            continue
        pick = {"b": (1, 2), "h": (1, 2, 3), "hk": (1, 2), "g": (1, 2, 3), "q": TF_SEQ, "x": TF_SEQ,
                "d": TF_HEADS, "e": TF_HEADS}[w.name]
        sizes[w.name] = w.size if w.size is not None else draw(st.sampled_from(pick))
    names = {t.name for t in d.inputs}
    if "doc" in names or "K" not in names:
        sizes["x"] = sizes["q"]   # doc[b, q] reads the keys' ids along q; Q[.., x, ..] the queries along x
    sizes = ir.coarse_sizes(d, sizes)
    views = {t.name: draw(st.sampled_from(_TF_FIT)) for t in d.inputs if t.dtype not in ("int32", "bool")}
    if draw(st.integers(0, 3)) == 0:
        views[draw(st.sampled_from(sorted(views)))] = draw(st.sampled_from(_TF_UNFIT))
    outs = [o.name for o in d.outputs]
    grads = tuple(draw(st.sampled_from(_TF_GRADS)) for _ in outs)
    mode = draw(st.sampled_from(("train", "train", "forward", "backward")))
    blocks = (None, 16, 32, 64, 128)
    opts = {"block_q": draw(st.sampled_from(blocks)), "block_x": draw(st.sampled_from(blocks))}
    positions = ""
    if mode != "train":
        positions = draw(st.sampled_from(("", "", "q", "x")))
    if mode == "forward" and draw(st.integers(0, 3)) == 0:
        opts["out_dtype"] = draw(st.sampled_from(("float32", "float16")))
    if mode == "backward":
        opts["grad_dtype"] = draw(st.sampled_from(("float32", "input")))
    need = ()
    if mode != "forward" and draw(st.integers(0, 3)) == 0:
        floats = sorted(views)
        need = tuple(sorted(draw(st.lists(st.sampled_from(floats), min_size=1, max_size=len(floats), unique=True))))
    if positions and {"tb", "kb"} & set(views):   # a gradient summed by blocks of the wire: refused with positions
        need = tuple(n for n in (need or sorted(views)) if n not in ("tb", "kb"))
    return TmaCase(text, sizes, d.inputs[0].dtype, views, grads, mode, opts, positions,
                   draw(st.integers(0, 2 ** 16)), need)


def tma_fuzz_module(text: str):
    """The case's generated module (test_backward.compile_text: emitted and
    imported once per text); None when napkin refuses the diagram."""
    key = f"tf_{zlib.crc32(text.encode()):08x}"
    if key in _TF_REFUSED:
        return None
    try:
        return tb.compile_text(text, key, _TF_FOLDER)
    except NapkinError:
        _TF_REFUSED.add(key)
        return None


def _tf_view(t: torch.Tensor, kind: str, gen: torch.Generator) -> torch.Tensor:
    """``t``'s values as a view of the given kind (same shape, other strides or offset)."""
    if t.dim() == 0 or kind == "contiguous":
        return t
    n = t.dim()
    if kind in ("storage", "storage_any"):   # another storage order of the dimensions
        order = torch.randperm(n, generator=gen).tolist()
        if kind == "storage" and n > 1:
            order = [i for i in torch.randperm(n - 1, generator=gen).tolist()] + [n - 1]
        base = torch.empty([t.shape[i] for i in order], dtype=t.dtype)
        out = base.permute([order.index(i) for i in range(n)])
    elif kind in ("pad_head", "pad_head_odd"):   # a slice of a wider last dimension
        esz = t.element_size()
        pad = (16 // esz) * 2 if kind == "pad_head" else 1
        off = 16 // esz if kind == "pad_head" else 0
        base = torch.empty(list(t.shape[:-1]) + [t.shape[-1] + pad], dtype=t.dtype)
        out = base[..., off:off + t.shape[-1]]
    elif kind == "slice_outer":                 # every other entry of the outermost dimension
        base = torch.empty([2 * t.shape[0]] + list(t.shape[1:]), dtype=t.dtype)
        out = base[1::2]
    elif kind in ("offset16", "offset_odd"):    # a storage offset, 16-byte aligned or not
        k = 16 // t.element_size() if kind == "offset16" else 1
        flat = torch.empty(t.numel() + k, dtype=t.dtype)
        out = flat[k:].view(t.shape)
    elif kind == "zero_stride":                  # dims of size 1 at stride 0
        if not any(s == 1 for s in t.shape):
            return t
        c = t.contiguous()
        strides = [0 if s == 1 else st_ for s, st_ in zip(c.shape, c.stride())]
        return c.as_strided(c.shape, strides)
    else:
        raise ValueError(kind)
    out.copy_(t)
    return out


def _tf_inputs(m, case: TmaCase, gen):
    """The call's inputs (document ids sorted along the sequence whatever the layout)."""
    dtype = TF_TORCH[case.dtype]
    sizes = dict(case.sizes)
    inputs = list(m.example_inputs(sizes, dtype=dtype, seed=case.seed))
    for i, name in enumerate(m.INPUTS):
        wires = [w for axis in m._layout(name) for w in axis]
        if m._DTYPES[name] in ir.NUMBER_INT_DTYPES and "x" in wires and inputs[i].dim():
            dim = next(k for k, axis in enumerate(m._layout(name)) if "x" in axis)
            inputs[i] = inputs[i].sort(dim=dim).values.contiguous()
    return inputs


def _tf_positions(m, case: TmaCase, inputs, gen):
    """positions=/lengths= for the case's wire (rows at sorted distinct
    positions below size + 7, the global length size + 4: some rows are
    padding), the data inputs read there extended to the positions' range."""
    w = case.positions
    n = case.sizes[w]
    pos = torch.randperm(n + 7, generator=gen)[:n].sort().values
    # rows at or past the length are padding (some usually are); a fixed wire's length is its size
    total = n if m.WIRES[w] is not None else n + 4
    for name, dim, wires, flat, step in m._GLOBAL_DIMS:
        if w not in wires:
            continue
        i = m.INPUTS.index(name)
        t = inputs[i]
        shape = list(t.shape)
        shape[dim] = -(-(n + 7) // step)   # a read at blocks of the wire: the positions' blocks
        if t.dtype == torch.bool:
            g = torch.randint(0, 2, shape, generator=gen).bool()
        elif not t.is_floating_point():
            g = torch.randint(0, 4, shape, generator=gen).sort(dim=dim).values.to(t.dtype)
        else:
            g = torch.randn(shape, generator=gen).to(t.dtype)
        inputs[i] = g
    # Padding rows hold garbage: NaN in every float input along the wire, so a
    # kernel that reads them where the pointer code reads zeros (keys at
    # positions: the fallback) cannot pass by luck.
    pad = (pos >= total).nonzero().flatten()
    for i, name in enumerate(m.INPUTS):
        dims = [k for k, axis in enumerate(m._layout(name)) if axis == (w,)]
        if dims and inputs[i].is_floating_point() and len(pad):
            inputs[i] = inputs[i].index_fill(dims[0], pad, float("nan"))
    return {w: pos}, {w: total}


def _tf_grad_out(o: torch.Tensor, kind: str, gen) -> torch.Tensor:
    """An output gradient of the given layout (0 where the output is not finite)."""
    finite = torch.isfinite(o)
    if kind == "zero" and bool(finite.all()):
        return torch.ones((), dtype=o.dtype).expand(o.shape)
    g = torch.where(finite, torch.randn(o.shape, generator=gen, dtype=torch.float32), 0.0).to(o.dtype)
    return _tf_view(g, "contiguous" if kind == "zero" else kind, gen)


def _tf_bits(t):
    if t is None:
        return None
    t = t.detach().contiguous()
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]) if t.is_floating_point() else t


def _tf_same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_tf_bits(a), _tf_bits(b))


def _tf_call(m, case: TmaCase, inputs, tma: bool, pos, gen_seed: int, state=None):
    """(outputs, gradients or None, each kernel's _tma_last*) of one call;
    ``state``: NAME_backward's arguments (mode "backward")."""
    fn = _tf_launcher(m)
    opts = {k: v for k, v in case.opts.items() if k in ("block_q", "block_x")}
    for k in TF_KERNELS:
        if hasattr(m, k):   # (a forward-only module has no _tma_last_dq, _tma_last_dkdv)
            getattr(m, k).update(used=None, why="not run")
    if case.mode == "backward":
        extra = {"positions": pos[0], "lengths": pos[1]} if pos else {}
        need = tuple(not case.need or n in case.need for n in m.INPUTS) if case.need else None
        got = getattr(m, fn.__name__ + "_backward")(*state, tma=tma, need=need, grad_dtype=case.opts["grad_dtype"],
                                                     **opts, **extra)
        return (), list(got), _tf_how(m)
    if case.mode == "forward":
        if "out_dtype" in case.opts:
            opts["out_dtype"] = getattr(torch, case.opts["out_dtype"])
        if pos:
            opts["positions"], opts["lengths"] = pos
        with torch.no_grad():
            out = fn(*inputs, tma=tma, **opts)
        out = out if isinstance(out, tuple) else (out,)
        return out, None, _tf_how(m)
    xs = [t.detach().requires_grad_(t.is_floating_point() and (not case.need or n in case.need))
          for n, t in zip(m.INPUTS, inputs)]
    out = fn(*xs, tma=tma, **opts)
    out = out if isinstance(out, tuple) else (out,)
    gen = torch.Generator().manual_seed(gen_seed)
    dos = [_tf_grad_out(o.detach(), kind, gen) for o, kind in zip(out, case.grads)]
    torch.autograd.backward(out, dos)
    return out, [x.grad for x in xs], _tf_how(m)


def _tf_how(m) -> dict:
    return {k: dict(getattr(m, k)) for k in TF_KERNELS if hasattr(m, k)}


def _tf_state(m, case: TmaCase, inputs, local):
    """NAME_backward's arguments for ``case``: those autograd's backward hands
    the module's _NAME_backward on a pointer run over the ``local`` inputs
    (no positions), the inputs then replaced by the call's own."""
    name = "_" + _tf_launcher(m).__name__ + "_backward"
    real, seen = getattr(m, name), []

    def spy(*args, **kwargs):
        seen.append(args)
        return real(*args, **kwargs)

    setattr(m, name, spy)
    try:
        train = dataclasses.replace(case, mode="train", need=())
        _tf_call(m, train, local, False, None, case.seed + 1)
    finally:
        setattr(m, name, real)
    state = list(seen[0][:-2])   # (inputs..., state...), then the options tuple and need
    state[:len(inputs)] = inputs
    return state


def _tf_launcher(m):
    kernel = next(n for n in vars(m) if n.startswith("_") and n.endswith("_kernel") and "_bwd_" not in n
                  and not n.endswith("_ranges_kernel"))
    return getattr(m, kernel[1:-len("_kernel")])


# Reasons a kernel may give for not taking its descriptors, each with what in
# the case must explain it (checked in run_tma_case).
_TF_REASONS = ("its data is not 16-byte aligned", "its last dimension is not contiguous",
               "a stride is not a positive multiple of 16 bytes", "rows of x at global positions",
               "rows of q at global positions",  # the backward: its padding query rows read as zeros
               "no tile of this kernel can move through a descriptor", "a dimension is empty")


def run_tma_case(case: TmaCase) -> dict:
    """Run ``case`` with tma=False and tma=True and check the property; the
    TMA call's per-kernel report ({} when napkin refuses the diagram)."""
    m = tma_fuzz_module(case.text)
    if m is None:
        return {}
    if not hasattr(m, "_tma_last_dq"):   # no backward: the forward alone
        case = dataclasses.replace(case, mode="forward", need=(), opts={
            k: v for k, v in case.opts.items() if k != "grad_dtype"})
    gen = torch.Generator().manual_seed(case.seed)
    inputs = _tf_inputs(m, case, gen)
    local = list(inputs)
    pos = _tf_positions(m, case, inputs, gen) if case.positions else None
    inputs = [_tf_view(t, case.views.get(name, "contiguous"), gen) if t.is_floating_point() else t
              for name, t in zip(m.INPUTS, inputs)]
    state = None
    if case.mode == "backward":
        local = [t if t.dtype == u.dtype and t.shape == u.shape else u for t, u in zip(inputs, local)]
        state = _tf_state(m, case, inputs, local)
    # a kernel the call did not launch: still "not run" (set above), or the module's own record of
    # that (need= left its gradients out, an empty grid)
    idle = {"not run"} | ({m._NOT_LAUNCHED} if hasattr(m, "_NOT_LAUNCHED") else set())
    ptr_out, ptr_grads, ptr_how = _tf_call(m, case, inputs, False, pos, case.seed + 1, state)
    assert all(h == {"used": False, "why": "tma not requested"} for k, h in ptr_how.items()
               if h["why"] not in idle), ptr_how
    out, grads, how = _tf_call(m, case, inputs, True, pos, case.seed + 1, state)
    for i, (a, b) in enumerate(zip(ptr_out, out)):
        assert _tf_same(a, b), f"output {i} differs with tma=True: {how}"
    for i, (a, b) in enumerate(zip(ptr_grads or (), grads or ())):
        assert _tf_same(a, b), f"gradient of {m.INPUTS[i]} differs with tma=True: {how}"
    if os.environ.get("TMA_FUZZ_REFERENCE") == "1" and case.mode != "backward" and not case.positions \
            and "out_dtype" not in case.opts and not case.need:
        _tf_accurate(m, case, inputs, out, grads)
    ran = {k: h for k, h in how.items() if h["why"] not in idle}
    assert ("_tma_last" in ran) == (case.mode != "backward"), how
    assert case.mode == "forward" or "_tma_last_dq" in ran or "_tma_last_dkdv" in ran, how
    for k, h in ran.items():
        tma_fuzz_stats[(k, h["used"])] += 1
        if h["used"]:
            continue
        why = h["why"]
        assert any(r in why for r in _TF_REASONS), (k, why)
        if "rows of x" in why:
            assert case.positions == "x"
        elif "rows of q" in why:   # only dQ and dK/dV mask padding query rows (TMA cannot)
            assert case.positions == "q" and k in ("_tma_last_dq", "_tma_last_dkdv"), (k, why)
        elif ":" in why:   # a tensor's view: the case must have made it so
            name = why.split(":")[0]
            if "16-byte aligned" in why:
                assert case.views.get(name) == "offset_odd", (k, why, case.views)
            elif "last dimension" in why:
                assert case.views.get(name, "").startswith("storage") or name in ("dO", "dN0") \
                    or _tf_head_not_last(m, name), (k, why, case.views)
    return ran


def _tf_accurate(m, case, inputs, out, grads):
    """(Offline only) the TMA call against the float64 reference, so a bug
    shared by both paths (a strided view the pointer code misreads) shows
    too: outputs and gradients within loose tolerances."""
    dtype = TF_TORCH[case.dtype]
    ref = m.reference(*[t.double() if t.is_floating_point() else t for t in inputs])
    ref = ref if isinstance(ref, tuple) else (ref,)
    tol = {torch.float16: 1e-2, torch.float32: 1e-4}[dtype]
    for i, (o, r) in enumerate(zip(out, ref)):
        ok = torch.isfinite(r)
        assert torch.equal(torch.isfinite(o.detach()), ok), f"output {i}: non-finite entries differ"
        if ok.any():
            err = (o.detach().double() - r)[ok].abs().max().item()
            assert err <= tol * max(1.0, r[ok].abs().max().item()), f"output {i}: error {err:.3g} vs reference"
    if grads is None:
        return
    gen = torch.Generator().manual_seed(case.seed + 1)
    dos = [_tf_grad_out(o.detach(), kind, gen).double() for o, kind in zip(out, case.grads)]

    def through(fn, xs):
        xs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in xs]
        o = fn(*xs)
        o = o if isinstance(o, tuple) else (o,)
        torch.autograd.backward([t.double() for t in o], [torch.where(torch.isfinite(t), g, 0.0)
                                                          for t, g in zip(o, dos)])
        return [x.grad for x in xs]

    exact = through(m.reference, [t.double() if t.is_floating_point() else t for t in inputs])
    same = through(m.reference, inputs)
    # Loose on purpose (64 ulps of the inputs' dtype times the scale, not
    # test_backward's 4): this looks for gross errors of a layout, not for
    # rounding (dS = P * (dP - delta) cancels; a side input's gradient sums
    # dS over every (q, x), ALiBi's weighted by x - q, from the fp16 O).
    eps = {torch.float16: 2.0 ** -10, torch.float32: 2.0 ** -23}[dtype]
    for i, (k, e, r) in enumerate(zip(grads, exact, same)):
        if e is None or not e.numel():
            continue
        assert k is not None and torch.isfinite(k).all(), f"gradient {i} is missing or not finite"
        err_k, err_r = ((t.double() - e).abs().max().item() for t in (k, r))
        scale = max(1.0, e.abs().max().item())
        assert err_k <= 2 * err_r + 64 * eps * scale, \
            f"gradient {i}: error {err_k:.3g} vs the same-dtype reference's {err_r:.3g} (scale {scale:.3g})"


def _tf_head_not_last(m, name) -> bool:
    layout = m._layout(name) if name in m._LAYOUTS else ()
    return bool(layout) and layout[-1][-1] not in ("d", "e")


# --------------------------------------------------------------------------
# The CI-fast test.
# --------------------------------------------------------------------------

@settings(max_examples=20, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
@given(case=tma_fuzz_cases())
def _tf_property(case):
    run_tma_case(case)


def test_tma_is_bitwise_the_pointer_code_on_random_diagrams_and_layouts():
    """The property on a dozen drawn cases, and not vacuously: most kernel
    launches took their descriptors, each kernel at least once."""
    before = Counter(tma_fuzz_stats)
    _tf_property()
    got = tma_fuzz_stats - before
    used = sum(n for (k, u), n in got.items() if u)
    assert used >= 0.4 * sum(got.values()), dict(got)
    assert all(got[(k, True)] for k in TF_KERNELS), dict(got)


# --------------------------------------------------------------------------
# Regressions the fuzz found.
# --------------------------------------------------------------------------

def test_tma_keeps_descriptors_when_key_positions_are_none():
    """positions={"x": None} gives the keys no positions (_positions reads a
    None entry as absent), so the keys cannot hold padding rows: the forward
    keeps its descriptors with rows of q at positions, and the backward
    (whose padded query rows must read as zeros too) with {"q": None, "x":
    None} (they fell back: the check was "x in positions"), with the pointer
    code's results."""
    text = (Path(__file__).resolve().parent.parent / "examples" / "causal.ncd").read_text()
    m = tma_fuzz_module(text)
    Q, K, V = m.example_inputs({"b": 1, "h": 2, "q": 20, "x": 20}, dtype=torch.float32, seed=0)
    opts = dict(block_q=16, block_x=16, positions={"q": torch.arange(20) + 3, "x": None}, lengths={"q": 23})
    want = m.causal(Q, K, V, tma=False, **opts)
    got = m.causal(Q, K, V, tma=True, **opts)
    assert m._tma_last == {"used": True, "why": None}
    assert all(_tf_same(a, b) for a, b in zip(want, got))
    O, lse = got
    dO = torch.randn(O.shape, generator=torch.Generator().manual_seed(1))
    (delta,) = m.causal_preprocess(Q, K, V, dO, O)
    opts = dict(block_q=16, block_x=16, positions={"q": None, "x": None})
    want = m.causal_backward(Q, K, V, dO, lse, delta, tma=False, **opts)
    got = m.causal_backward(Q, K, V, dO, lse, delta, tma=True, **opts)
    assert m._tma_last_dq == m._tma_last_dkdv == {"used": True, "why": None}
    assert all(_tf_same(a, b) for a, b in zip(want, got))


if __name__ == "__main__":   # the long offline run: python tests/test_tma_fuzz.py N
    import time
    import traceback

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    log = Path(sys.argv[2]) if len(sys.argv) > 2 else Path("/tmp/tma_fuzz.log")
    failures = []
    t0 = time.time()

    @settings(max_examples=n, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(case=tma_fuzz_cases())
    def _tf_offline(case):
        t = time.time()
        try:
            ran = run_tma_case(case)
            status = "refused" if not ran else "ok " + ",".join(
                f"{k[9:] or 'fwd'}={'T' if h['used'] else h['why'][:40]}" for k, h in ran.items())
        except Exception as exc:  # noqa: BLE001 - keep fuzzing, log the repro
            failures.append((case, traceback.format_exc()))
            status = f"FAIL {type(exc).__name__}: {str(exc)[:200]}"
        with log.open("a") as f:
            f.write(f"{status} {time.time() - t:.1f}s {case!r}\n")

    _tf_offline()
    print(f"{n} cases in {time.time() - t0:.0f}s; failures: {len(failures)}")
    print(dict(tma_fuzz_stats))
    for case, trace in failures[:20]:
        print("=" * 70)
        print(repr(case))
        print(trace[-3000:])
