"""Dead tiles skipped at global positions (napkin/masks.py tile_live and
live_blocks; codegen/bounds.py live, backward_emit.py).

With positions= the kernels test each tile against the mask's affine bounds
from the positions they have just loaded, and neither load nor compute a
tile no pair of which can survive the mask.  Each test deals a sequence to
parts as the distributed wrappers do (napkin.distributed.layouts: zigzag
for rings, cyclic for ATTENTION2D, padded past the end) and runs the
kernels on every (query part, key part) pair:

1. brute force: the key blocks each program loads (a spy on the
   interpreter's loads, padding-only tiles included) in the forward, dQ and
   dK/dV kernels are exactly visits.live_blocks, which holds every tile with a
   real pair the mask keeps (the definition, evaluated pair by pair) and,
   for a mask with one bound, nothing else (with two, a window, a tile it
   adds meets each bound at some pair); one layout puts tiles right at a
   bound's edge, so an off-by-one shows; positions on one wire alone, and
   blocks of padding alone, are checked the same way;
2. outputs and gradients merged over the parts match float64 autograd of
   the module's reference, fp32 and fp16, on ragged sizes (a window whose
   width is read at run time among them: its loops' bounds load it);
3. a document mask has no affine bound: only padding skips; combined with
   a causal bound, the bound skips.

Everything runs under TRITON_INTERPRET=1 with blocks of 16 and d = 16.
"""
from __future__ import annotations

import contextlib
import itertools
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

import napkin
from napkin import masks, visits
from napkin.codegen import lower as L
from napkin.distributed.layouts import TokenLayout, take_rows

import backward_helpers as tb  # its compile_text and EPS
from spies import heaviest_first, program_block
from test_positions import edited_example

REPO = Path(__file__).resolve().parent.parent
BLOCK = 16
BLOCKS = {"block_q": BLOCK, "block_x": BLOCK}
LSE = ("out O\n", "lse[b, h, q] = logsumexp[x](S)\nout O, lse\n")
WINDOW = "q - x < 256"
CASES = {  # name: (example, edits); d shrunk to 16, an lse output where missing (partial states merge through it)
    "causal": ("causal", ()),
    "window9": ("sliding_window", ((WINDOW, "q - x < 9"), LSE)),
    "window3": ("sliding_window", ((WINDOW, "q - x < 3"), LSE)),   # narrower than a cyclic stride of 4
    "decode": ("decode", ()),
    # the width a scalar read at run time: the loops' bounds read it (no prepass), at positions the live test too
    "runtime": ("runtime_window", (LSE,)),
    # an or of two upper bounds, one bound x <= max(q, 19) (masks._union); the prefix-LM's reads p[b]
    "prefix20": ("causal", (("x <= q", "x <= q or x < 20"),)),
    "prefix": ("prefix_lm", (LSE,)),
    "document": ("document_mask", (LSE,)),
    "document_causal": ("document_mask", (("where(doc[b, q] == doc,", "where(x <= q and doc[b, q] == doc,"), LSE)),
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("skipping")


def module(name: str, folder: Path):
    text = edited_example(*CASES[name])
    key = f"skip_{name}_{zlib.crc32(text.encode()):08x}"
    return tb.compile_text(text, key, folder), napkin.load_text(text, f"{key}.ncd")


def sizes_of(nq: int, nx: int) -> dict:
    return {"b": 1, "h": 2, "hk": 1, "g": 2, "q": nq, "x": nx}


def _dim(m, name: str, wire: str):
    dims = [i for i, a in enumerate(m._LAYOUTS[name]) if a == (wire,)]
    return dims[0] if dims else None


def shard(m, full, qpos, xpos, nq: int, nx: int) -> list:
    """Each float input's local rows (zeros at padding positions); integer
    inputs (document ids) whole, as they are read at global positions."""
    out = []
    for name, t in zip(m.INPUTS, full):
        if not t.is_floating_point():
            out.append(t)
            continue
        for wire, pos, n in (("q", qpos, nq), ("x", xpos, nx)):
            dim = _dim(m, name, wire)
            if dim is not None:
                t = take_rows(t, pos, n, dim)
        out.append(t)
    return out


# --------------------------------------------------------------------------
# What each program loads: a spy on the interpreter's loads.
# --------------------------------------------------------------------------

def back_to_back(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Copies of the tensors laid out one after another in one buffer, each
    at a 16-byte boundary: what a masked load past one's end points at is fixed."""
    sizes = [-(-t.numel() * t.element_size() // 16) * 16 for t in tensors]
    buf = torch.empty(sum(sizes), dtype=torch.uint8)
    out, at = [], 0
    for t, size in zip(tensors, sizes):
        view = buf[at:at + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        out.append(view.copy_(t))
        at += size
    return out


def same_type(ptrs, t: torch.Tensor) -> bool:
    """Whether an interpreter load's pointee type is t's element type."""
    ty = ptrs.get_element_ty()
    return ty.primitive_bitwidth == 8 * t.element_size() and ty.is_floating() == t.is_floating_point()


@contextlib.contextmanager
def loaded_blocks(**watch):
    """{name: set of (program's block along grid axis 0, block along dim)} of
    the loads of each watched (tensor, dim, block[, reversed]; reversed: the
    loading kernel takes its blocks heaviest first, masks.program_order, so
    its program i owns block n - 1 - i), from the lanes their mask keeps (a masked
    lane's address past a ragged edge may fall in another head's rows); a
    load whose mask keeps no lane (a tile of padding alone) of the tensor's
    element type whose first address lies in the tensor adds (program id,
    None).  Any lane in the tensor is not enough: a masked load of another
    tensor runs past its end (ids read at padding positions >= n), into
    whatever the allocator placed next, which CI once found to be K."""
    from triton.runtime import interpreter

    seen = {name: set() for name in watch}
    original = interpreter.InterpreterBuilder.create_masked_load

    def spy(builder, ptrs, mask, *rest, **kw):
        addr = np.asarray(ptrs.data).astype(np.int64)
        keep = np.broadcast_to(np.asarray(mask.data).astype(bool), addr.shape)
        for name, (t, dim, block, *rev) in watch.items():
            pid = program_block(builder, bool(rev and rev[0]))
            start, stop = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
            if not keep.any() and start <= addr.min() < stop and same_type(ptrs, t):
                seen[name].add((pid, None))
            inside = addr[keep & (addr >= start) & (addr < stop)]
            for off in set(((inside - start) // t.element_size()).tolist()):
                seen[name].add((pid, off // t.stride(dim) % t.shape[dim] // block))
        return original(builder, ptrs, mask, *rest, **kw)

    interpreter.InterpreterBuilder.create_masked_load = spy
    try:
        yield seen
    finally:
        interpreter.InterpreterBuilder.create_masked_load = original


def definition(pred, qpos, xpos, nq: int, nx: int) -> set:
    """(row block, key block) of the tiles with a real pair the mask keeps,
    the predicate evaluated pair by pair (classify_block on one point)."""
    sizes = {"q": nq, "x": nx}
    out = set()
    for r, c in itertools.product(range(len(qpos)), range(len(xpos))):
        gr, gc = int(qpos[r]), int(xpos[c])
        if gr < nq and gc < nx and (r // BLOCK, c // BLOCK) not in out:
            if masks.classify_block(pred, {"q": (gr, gr + 1), "x": (gc, gc + 1)}, sizes) is masks.BlockClass.FULL:
                out.add((r // BLOCK, c // BLOCK))
    return out


def parts(kind: str, n_parts: int, n: int) -> list[torch.Tensor]:
    """Each part's global positions, padding (>= n) included."""
    layout = TokenLayout(kind, n_parts, n)
    return [layout.positions(p) for p in range(n_parts)]


# (mask, query layout, key layout, parts, |q|, |x|): ragged zigzag chunks (13 rows: blocks straddle two
# chunks), aligned ones (16); zigzag queries against cyclic keys put some tile right at each bound's edge
BRUTE = [(name, kind, kind, p, nq, nx) for name in ("causal", "window9", "window3") for kind in ("zigzag", "cyclic")
         for p, nq, nx in ((4, 100, 100), (2, 64, 64))] \
    + [("decode", kind, kind, 2, 40, 70) for kind in ("zigzag", "cyclic")] \
    + [(name, "zigzag", "cyclic", 4, 100, 100) for name in ("causal", "window9", "window3", "decode")] \
    + [("prefix20", kind, kind, 4, 100, 100) for kind in ("zigzag", "cyclic")]


@pytest.mark.parametrize("name, qkind, xkind, n_parts, nq, nx", BRUTE,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}{c[3]}-q{c[4]}-x{c[5]}" for c in BRUTE])
def test_each_kernel_loads_exactly_the_live_tiles(folder, name, qkind, xkind, n_parts, nq, nx):
    m, diagram = module(name, folder)
    plan = L.lower(diagram)
    bounds, pred = plan.bounds, plan.skip
    assert bounds and pred is not None
    rows_rev, keys_rev = heaviest_first(bounds)
    launcher = getattr(m, diagram.name)
    backward = getattr(m, f"{diagram.name}_backward")
    full = m.example_inputs(sizes_of(nq, nx), dtype=torch.float32, seed=1)
    lengths = {"q": nq, "x": nx}
    dead = total = edges = 0
    for qpos, xpos in itertools.product(parts(qkind, n_parts, nq), parts(xkind, n_parts, nx)):
        q, k, v = shard(m, full, qpos, xpos, nq, nx)
        positions = {"q": qpos, "x": xpos}
        want = definition(pred, qpos, xpos, nq, nx)
        live = visits.live_blocks(bounds, qpos, xpos, nq, nx, BLOCK, BLOCK, lengths)
        assert want <= live  # nothing a real pair needs is skipped
        if len(bounds) == 1:
            assert live == want, (qpos.tolist(), xpos.tolist())
        else:  # a window: a kept tile the mask empties meets each bound at some real pair, none at once
            for i, j in live - want:
                rows = [int(p) for p in qpos[i * BLOCK:(i + 1) * BLOCK] if p < nq]
                cols = [int(p) for p in xpos[j * BLOCK:(j + 1) * BLOCK] if p < nx]
                for b in bounds:
                    assert visits.tile_live((b,), rows, cols, lengths)
        edges += len(at_edge(bounds, qpos, xpos, nq, nx, lengths))
        with loaded_blocks(K=(k, _dim(m, "K", "x"), BLOCK, rows_rev)) as seen:
            launcher(q, k, v, positions=positions, lengths=lengths, out_dtype=torch.float32, **BLOCKS)
        assert seen["K"] == live, "forward"
        # the backward: any finite row state gives the same loads; one kernel at a time
        o_shape = m._shape("O", m._bind((q, k, v), kernel=True, free=set())[0])
        rows = [torch.randn(o_shape), torch.zeros(o_shape[:-1]), torch.zeros(o_shape[:-1])]
        with loaded_blocks(K=(k, _dim(m, "K", "x"), BLOCK, rows_rev)) as seen:
            backward(q, k, v, *rows, positions=positions, lengths=lengths, need=(True, False, False), **BLOCKS)
        assert seen["K"] == live, "dQ"
        with loaded_blocks(Q=(q, _dim(m, "Q", "q"), BLOCK, keys_rev)) as seen:
            backward(q, k, v, *rows, positions=positions, lengths=lengths, need=(False, True, True), **BLOCKS)
        assert seen["Q"] == {(j, i) for i, j in live}, "dK/dV"
        total += -(-len(qpos) // BLOCK) * -(-len(xpos) // BLOCK)
        dead += -(-len(qpos) // BLOCK) * -(-len(xpos) // BLOCK) - len(live)
    assert dead > 0 and dead < total  # the case skips something, and not everything
    if qkind != xkind:  # a tile whose loosest pair meets a bound with equality: an off-by-one would show
        assert edges > 0


def at_edge(bounds, qpos, xpos, nq: int, nx: int, sizes) -> list:
    """(row block, key block, bound) where the bound holds with equality at
    the tile's loosest pair (visits.tile_live's test, one step from failing)."""
    out = []
    for i, j in itertools.product(range(-(-len(qpos) // BLOCK)), range(-(-len(xpos) // BLOCK))):
        rows = [int(p) for p in qpos[i * BLOCK:(i + 1) * BLOCK] if p < nq]
        cols = [int(p) for p in xpos[j * BLOCK:(j + 1) * BLOCK] if p < nx]
        if rows and cols:
            for b in bounds:
                r = min(rows) if b.at_row() == "first" else max(rows)
                value = b.row_coeff * r + sum(v if k == "" else v * sizes[k[1:-1]] for k, v in b.rest)
                if (min(cols) if b.kind == "upper" else max(cols)) == value:
                    out.append((i, j, b))
    return out


SINGLE = [(name, wire) for name in ("causal", "window9", "decode") for wire in ("q", "x")]


@pytest.mark.parametrize("name, wire", SINGLE, ids=[f"{n}-{w}" for n, w in SINGLE])
def test_positions_on_one_wire(folder, name, wire):
    """Positions on one wire, the other whole.  Keys at positions: each tile
    is tested from the loaded keys and the rows' offsets (and dK/dV's range
    comes from the keys'), so the loads are exactly live_blocks.  Rows at
    positions: the range comes from each row block's least and greatest, and
    a lower bound's start is rounded down to a block, so a window may load a
    dead tile at the ragged end; an upper bound alone loads exactly the live
    ones.  Either way no tile a real pair needs is skipped."""
    m, diagram = module(name, folder)
    plan = L.lower(diagram)
    nq, nx = (40, 70) if name == "decode" else (45, 45)
    full = m.example_inputs(sizes_of(nq, nx), dtype=torch.float32, seed=2)
    launcher, backward = getattr(m, diagram.name), getattr(m, f"{diagram.name}_backward")
    exact = wire == "x" or all(b.kind == "upper" for b in plan.bounds)
    dead = 0
    for pos in parts("zigzag", 2, nq if wire == "q" else nx):
        qpos = pos if wire == "q" else torch.arange(nq)
        xpos = pos if wire == "x" else torch.arange(nx)
        q, k, v = shard(m, full, qpos, xpos, nq, nx)
        opts = dict(positions={wire: pos}, lengths={wire: nq if wire == "q" else nx}, **BLOCKS)
        live = visits.live_blocks(plan.bounds, qpos, xpos, nq, nx, BLOCK, BLOCK, {"q": nq, "x": nx})
        want = definition(plan.skip, qpos, xpos, nq, nx)
        rows = [torch.randn(q.shape[:-1] + (16,)), torch.zeros(q.shape[:-1]), torch.zeros(q.shape[:-1])]
        loads = []
        rows_rev, keys_rev = heaviest_first(plan.bounds)
        with loaded_blocks(K=(k, 2, BLOCK, rows_rev)) as seen:
            launcher(q, k, v, **opts)
        loads.append(seen["K"])
        with loaded_blocks(K=(k, 2, BLOCK, rows_rev)) as seen:
            backward(q, k, v, *rows, need=(True, False, False), **opts)
        loads.append(seen["K"])
        with loaded_blocks(Q=(q, 2, BLOCK, keys_rev)) as seen:
            backward(q, k, v, *rows, need=(False, True, True), **opts)
        loads.append({(i, j) for j, i in seen["Q"]})
        for got, kernel in zip(loads, ("forward", "dQ", "dK/dV")):
            assert want <= got and None not in {j for _, j in got}, kernel
            assert got == live if exact else got >= live, kernel
        dead += -(-len(qpos) // BLOCK) * -(-len(xpos) // BLOCK) - len(loads[0])
    assert dead > 0


def test_padding_alone_is_never_loaded(folder):
    """A block of padding keys (positions past the length) has no real pair:
    no program loads it; nor does a program of padding rows load anything.
    A block with some real rows or keys is loaded as its real ones need."""
    m, diagram = module("causal", folder)
    n = 20
    qpos = torch.arange(52)                                          # row block 2 (32..51) is padding
    xpos = torch.cat([torch.arange(40, 56), torch.arange(20)])       # key block 0 (40..55) is padding
    full = m.example_inputs(sizes_of(n, n), dtype=torch.float32)
    q, k, v = shard(m, full, qpos, xpos, n, n)
    with loaded_blocks(K=(k, 2, BLOCK, heaviest_first(L.lower(diagram).bounds)[0])) as seen:
        m.causal(q, k, v, positions={"q": qpos, "x": xpos}, lengths={"q": n, "x": n}, **BLOCKS)
    assert seen["K"] == definition(L.lower(diagram).skip, qpos, xpos, n, n)
    assert not any(j == 0 or i == 2 for i, j in seen["K"])
    assert {i for i, _ in seen["K"]} == {0, 1} and {j for _, j in seen["K"]} == {1, 2}


# --------------------------------------------------------------------------
# Numerics: partial states merged over the parts, gradients added up.
# --------------------------------------------------------------------------

def forward_parts(m, diagram, full, qparts, xparts, nq: int, nx: int):
    """O and lse at every real query position, merged over the key parts."""
    launcher = getattr(m, diagram.name)
    ref_shapes = m.reference(*(t.double() if t.is_floating_point() else t for t in full))
    got_o, got_lse = torch.zeros_like(ref_shapes[0]), torch.zeros_like(ref_shapes[1])
    dq = _dim(m, "O", "q")
    for qpos in qparts:
        states = []
        for xpos in xparts:
            ins = shard(m, full, qpos, xpos, nq, nx)
            states.append(launcher(*ins, positions={"q": qpos, "x": xpos}, lengths={"q": nq, "x": nx},
                                   out_dtype=torch.float32, **BLOCKS))
        lses = torch.stack([s[1].double() for s in states])
        lse = torch.logsumexp(lses, 0)
        w = torch.exp(lses - lse).nan_to_num(0.0)        # a part that saw no key weighs 0
        o = (w[..., None] * torch.stack([s[0].double() for s in states])).sum(0)
        real = (qpos < nq).nonzero()[:, 0]
        got_o.index_copy_(dq, qpos[real], o.index_select(dq, real))
        got_lse.index_copy_(dq, qpos[real], lse.index_select(dq, real))
    return got_o, got_lse


def backward_parts(m, diagram, full, qparts, xparts, nq: int, nx: int, d_o, lse, delta):
    """Each float input's gradient: the parts' added up at their positions
    (padding rows must get none)."""
    backward = getattr(m, f"{diagram.name}_backward")
    got = [torch.zeros(t.shape, dtype=torch.float64) for t in full if t.is_floating_point()]
    dq = _dim(m, "O", "q")
    for qpos, xpos in itertools.product(qparts, xparts):
        ins = shard(m, full, qpos, xpos, nq, nx)
        rows = [take_rows(s, qpos, nq, dq) for s in (d_o.to(ins[0].dtype), lse.float(), delta.float())]
        grads = backward(*ins, *rows, positions={"q": qpos, "x": xpos}, lengths={"q": nq, "x": nx}, **BLOCKS)
        floats = [(g, n) for g, n, t in zip(grads, m.INPUTS, full) if t.is_floating_point()]
        for acc, (g, name) in zip(got, floats):
            assert g.dtype == torch.float32 and torch.isfinite(g).all()
            for wire, pos, n in (("q", qpos, nq), ("x", xpos, nx)):
                dim = _dim(m, name, wire)
                if dim is not None:
                    assert not g.index_select(dim, (pos >= n).nonzero()[:, 0]).any(), "padding gets no gradient"
                    real = (pos < n).nonzero()[:, 0]
                    acc.index_add_(dim, pos[real], g.index_select(dim, real).double())
    return got


def reference_grads(m, inputs, d_o, d_lse):
    """(O, lse, gradients) of the module's reference on ``inputs`` in their
    own dtype: float64 inputs give the exact values, 16-bit ones the
    same-dtype reference whose error sets the tolerance."""
    leaves = [t.detach().clone().requires_grad_(True) if t.is_floating_point() else t for t in inputs]
    o, lse = m.reference(*leaves)
    torch.autograd.backward([o, lse], [d_o.to(o.dtype), d_lse.to(lse.dtype)])
    return o.detach(), lse.detach(), [t.grad for t in leaves if t.is_floating_point()]


def assert_close(got, exact, same, dtype, label):
    """Error <= 2 x the same-dtype reference's + 8 ulps of the inputs' dtype x scale."""
    fin = torch.isfinite(exact)
    assert torch.equal(torch.isinf(got), torch.isinf(exact)), f"{label}: -inf pattern differs"
    assert not torch.isnan(got).any(), f"{label}: NaN"
    if not fin.any():
        return
    err = (got - exact)[fin].abs().max().item()
    ref = (same.double() - exact)[fin].abs().max().item()
    scale = max(1.0, exact[fin].abs().max().item())
    assert err <= 2 * ref + 8 * tb.EPS[dtype] * scale, f"{label}: error {err:.3g} (reference {ref:.3g})"


NUMERIC = [(name, kind, dtype, nq, nx) for name, nq, nx in (("causal", 45, 40), ("window9", 45, 45), ("decode", 7, 45),
                                                             ("runtime", 45, 45), ("prefix", 45, 45))
           for kind in ("zigzag", "cyclic") for dtype in (torch.float32, torch.float16)]


@pytest.mark.parametrize("name, kind, dtype, nq, nx", NUMERIC,
                         ids=[f"{c[0]}-{c[1]}-{str(c[2])[6:]}-q{c[3]}-x{c[4]}" for c in NUMERIC])
def test_outputs_and_gradients_at_positions_match_float64(folder, name, kind, dtype, nq, nx):
    m, diagram = module(name, folder)
    full = m.example_inputs(sizes_of(nq, nx), dtype=dtype, seed=zlib.crc32(name.encode()))
    gen = torch.Generator().manual_seed(3)
    exact_in = [t.double() if t.is_floating_point() else t for t in full]
    o_ref = m.reference(*exact_in)[0]
    d_o = torch.randn(o_ref.shape, generator=gen, dtype=torch.float64)
    d_lse = torch.randn(o_ref.shape[:-1], generator=gen, dtype=torch.float64)
    o64, lse64, g64 = reference_grads(m, exact_in, d_o, d_lse)
    o_same, lse_same, g_same = reference_grads(m, full, d_o, d_lse)   # the inputs' own dtype
    qparts, xparts = parts(kind, 2, nq), parts(kind, 3, nx)
    o, lse = forward_parts(m, diagram, full, qparts, xparts, nq, nx)
    assert_close(o, o64, o_same, dtype, "O")
    assert_close(lse, lse64, lse_same, dtype, "lse")
    delta = (d_o * o64).sum(-1) - d_lse                 # rowsum(dO * O) - dlse, global
    got = backward_parts(m, diagram, full, qparts, xparts, nq, nx, d_o, lse64, delta)
    for g, e, s, label in zip(got, g64, g_same, ["dQ", "dK", "dV"]):
        assert_close(g, e, s, dtype, label)


# --------------------------------------------------------------------------
# Document masks: not affine.
# --------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["document", "document_causal"])
def test_document_mask_skips_padding_and_its_affine_conjuncts_only(folder, name):
    """doc[b, q] == doc bounds nothing: every tile with a real row and key
    is loaded.  With x <= q besides, that bound skips as alone."""
    m, diagram = module(name, folder)
    plan = L.lower(diagram)
    assert len(plan.bounds) == (1 if name == "document_causal" else 0)
    n = 50
    full = m.example_inputs(sizes_of(n, n), dtype=torch.float32, seed=4)
    # 20 padding rows after each part's own: a block of padding alone on both wires
    pad = torch.arange(n, n + 20)
    qparts = [torch.cat([p, pad]) for p in parts("zigzag", 2, n)]
    xparts = [torch.cat([p, pad]) for p in parts("cyclic", 2, n)]
    launcher = getattr(m, diagram.name)
    backward = getattr(m, f"{diagram.name}_backward")
    for qpos, xpos in itertools.product(qparts, xparts):
        # ids read at padding positions run past doc's end (masked): K right after it
        # makes sure the spies are not fooled by that, as CI's allocator once did
        doc, k, v, q = back_to_back(*shard(m, full, qpos, xpos, n, n)[::-1])
        opts = dict(positions={"q": qpos, "x": xpos}, lengths={"q": n, "x": n}, **BLOCKS)
        live = visits.live_blocks(plan.bounds, qpos, xpos, n, n, BLOCK, BLOCK, {"q": n, "x": n})
        if not plan.bounds:  # padding alone skips: every tile with a real row and key
            blocks = [{i // BLOCK for i in (pos < n).nonzero()[:, 0].tolist()} for pos in (qpos, xpos)]
            assert live == set(itertools.product(*blocks))
        assert len(live) < -(-len(qpos) // BLOCK) * -(-len(xpos) // BLOCK)
        rows_rev, keys_rev = heaviest_first(plan.bounds)
        with loaded_blocks(K=(k, 2, BLOCK, rows_rev)) as seen:
            launcher(q, k, v, doc, **opts)
        assert seen["K"] == live, "forward"
        rows = [torch.randn(q.shape), torch.zeros(q.shape[:-1]), torch.zeros(q.shape[:-1])]
        with loaded_blocks(K=(k, 2, BLOCK, rows_rev)) as seen:
            backward(q, k, v, doc, *rows, need=(True, False, False, False), **opts)
        assert seen["K"] == live, "dQ"
        with loaded_blocks(Q=(q, 2, BLOCK, keys_rev)) as seen:
            backward(q, k, v, doc, *rows, need=(False, True, True, False), **opts)
        assert seen["Q"] == {(j, i) for i, j in live}, "dK/dV"
    d_o = torch.randn(m.reference(*full)[0].shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    d_lse = torch.zeros(d_o.shape[:-1], dtype=torch.float64)
    exact_in = [t.double() if t.is_floating_point() else t for t in full]
    o64, lse64, g64 = reference_grads(m, exact_in, d_o, d_lse)
    o32, lse32, g32 = reference_grads(m, full, d_o, d_lse)
    o, lse = forward_parts(m, diagram, full, qparts, xparts, n, n)
    assert_close(o, o64, o32, torch.float32, "O")
    assert_close(lse, lse64, lse32, torch.float32, "lse")
    got = backward_parts(m, diagram, full, qparts, xparts, n, n, d_o, lse64, (d_o * o64).sum(-1) - d_lse)
    for g, e, s, label in zip(got, g64, g32, ["dQ", "dK", "dV"]):
        assert_close(g, e, s, torch.float32, label)
