"""Generated attention kernels with rows at global positions.

The launcher's positions= / lengths= / out_dtype= options (what the
distributed wrappers' local attention uses): each test cuts the query and
key rows of a sequence into parts, as devices would hold them (queries dealt
cyclically, keys in a shuffled order, both padded with rows past the end),
runs the kernel on every (query part, key part) pair with the parts' global
positions, merges the partial states over the key parts with plain torch
(the lse-weighted sum; a plain sum for sigmoid attention) and compares with
the module's own reference() on the whole sequence in float64.  Masks,
biases, |x| and document ids must all be read at global positions for that
to hold, and padded keys must not count.

Everything runs under TRITON_INTERPRET=1 with blocks of 16 on small shapes.
"""
from __future__ import annotations

import importlib.util
import zlib
from pathlib import Path

import pytest
import torch

import napkin
from napkin.codegen import emit_module

REPO = Path(__file__).resolve().parent.parent
BLOCKS = {"block_q": 16, "block_x": 16}
_MODULES: dict[str, object] = {}

# (example, edits): d shrunk to 16; diagrams without an lse output get one,
# since partial softmax states merge through it.
LSE = ("out O\n", "lse[b, h, q] = logsumexp[x](S)\nout O, lse\n")
CASES = {
    "causal": ("causal", ()),
    "sliding_window": ("sliding_window", (("q - x < 256", "q - x < 9"), LSE)),
    "chunked": ("chunked_attention", (("x // 8192 == q // 8192", "x // 8 == q // 8"), LSE)),
    "alibi": ("alibi", (LSE,)),
    "document_mask": ("document_mask", (LSE,)),
    "sigmoid": ("sigmoid_attention", ()),
    "gqa_causal": ("gqa", (("S[b, hk, g, q, x] = sum[d](Q * K) * |d|^-0.5",
                            "S[b, hk, g, q, x] = where(x <= q, sum[d](Q * K) * |d|^-0.5, -inf)"),)),
    "decode": ("flash_decoding", ()),   # packed rows and chunks
}


def edited_example(example: str, edits) -> str:
    """examples/EXAMPLE.ncd with each (old, new) edit made (each must apply)
    and the head dim shrunk to 16."""
    text = (REPO / "examples" / f"{example}.ncd").read_text()
    for old, new in tuple(edits) + (("wire d = 64", "wire d = 16"), ("wire d = 128", "wire d = 16")):
        assert old in text or old.startswith("wire d"), old
        text = text.replace(old, new)
    return text


def module(name: str, tmp: Path):
    text = edited_example(*CASES[name])
    key = f"{name}_{zlib.crc32(text.encode()):08x}"
    if key not in _MODULES:
        diagram = napkin.load_text(text, f"{name}.ncd")
        source = emit_module(diagram, source_text=text, source_path=f"{name}.ncd")
        path = tmp / f"{key}.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location(f"_positions_{key}", path)
        m = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(m)
        _MODULES[key] = (m, diagram)
    return _MODULES[key]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("positions")


def cyclic(n: int, parts: int) -> list[torch.Tensor]:
    """Part p holds positions p, p + parts, ...; positions >= n are padding."""
    rows = -(-n // parts)
    return [torch.arange(rows) * parts + p for p in range(parts)]


def shuffled(n: int, parts: int, seed: int) -> list[torch.Tensor]:
    """A random order of n positions and some padding, cut into parts."""
    rows = -(-n // parts) + 3
    order = torch.randperm(rows * parts, generator=torch.Generator().manual_seed(seed))
    return list(order.reshape(parts, rows))


def take(t: torch.Tensor, dim: int, pos: torch.Tensor, n: int) -> torch.Tensor:
    """Rows ``pos`` of t along dim; zeros at padding positions (>= n)."""
    out = t.index_select(dim, pos.clamp(max=n - 1))
    shape = [1] * t.dim()
    shape[dim] = len(pos)
    return torch.where((pos < n).view(shape), out, torch.zeros((), dtype=t.dtype))


def run_parts(name: str, tmp: Path, nq: int, nx: int, qparts, xparts=None):
    """(kernel O and lse at every real query position, reference O and lse).
    ``xparts`` None: the keys whole, without positions (static bounds)."""
    m, diagram = module(name, tmp)
    launcher = getattr(m, diagram.name)
    sizes = {"b": 1, "h": 2, "hk": 2, "g": 2, "q": nq, "x": nx}
    full = m.example_inputs(sizes, dtype=torch.float32, seed=zlib.crc32(name.encode()))
    ref = m.reference(*(t.double() if t.is_floating_point() else t for t in full))
    ref = ref if isinstance(ref, tuple) else (ref,)
    axes = {n: m._LAYOUTS[n] for n in m.INPUTS}
    out_q = [i for i, a in enumerate(m._LAYOUTS[m.OUTPUTS[0]]) if a == ("q",)][0]
    got_o = torch.zeros_like(ref[0])
    got_lse = torch.zeros_like(ref[1]) if name != "sigmoid" else None
    for qp in qparts:
        states = []
        for xp in xparts or [None]:
            inputs = []
            for name_, t in zip(m.INPUTS, full):
                dims = [i for i, a in enumerate(axes[name_]) if a in (("q",), ("x",))]
                if not t.is_floating_point() or not dims:   # ids and slopes: passed whole
                    inputs.append(t)
                    continue
                (dim,) = dims
                if axes[name_][dim] == ("q",):
                    inputs.append(take(t, dim, qp, nq))
                else:
                    inputs.append(t if xp is None else take(t, dim, xp, nx))
            positions = {"q": qp} if xp is None else {"q": qp, "x": xp}
            outs = launcher(*inputs, positions=positions, lengths={"q": nq, "x": nx}, out_dtype=torch.float32,
                            **BLOCKS)
            outs = outs if isinstance(outs, tuple) else (outs,)
            assert all(o.dtype == torch.float32 for o in outs)
            states.append(outs)
        o = torch.stack([s[0].double() for s in states])
        real = qp < nq
        if got_lse is None:    # sigmoid attention: partial sums add up
            merged = o.sum(0)
        else:
            lses = torch.stack([s[1].double() for s in states])
            lse = torch.logsumexp(lses, 0)
            w = torch.exp(lses - lse).nan_to_num(0.0)      # a part that saw no key weighs 0
            merged = (w[..., None] * o).sum(0)
            got_lse.index_copy_(out_q, qp[real], lse.index_select(out_q, real.nonzero()[:, 0]))
        got_o.index_copy_(out_q, qp[real], merged.index_select(out_q, real.nonzero()[:, 0]))
    return (got_o, got_lse), ref


def assert_close(got, want, label):
    assert torch.equal(torch.isinf(got), torch.isinf(want)), f"{label}: -inf pattern differs"
    fin = torch.isfinite(want)
    assert not torch.isnan(got).any(), f"{label}: NaN"
    err = (got[fin] - want[fin]).abs().max().item() if fin.any() else 0.0
    scale = max(1.0, want[fin].abs().max().item()) if fin.any() else 1.0
    assert err <= 2e-5 * scale, f"{label}: max error {err:.3g}"


# ragged: more queries than keys, neither a multiple of the blocks (document
# ids are read along both wires, so there |q| = |x|)
SHAPES = [(n, 45, 40) for n in sorted(CASES) if n != "document_mask"] + [(n, 37, 37) for n in sorted(CASES)]


@pytest.mark.parametrize("name, nq, nx", SHAPES, ids=[f"{n}-q{a}-x{b}" for n, a, b in SHAPES])
def test_partial_states_at_global_positions_merge_to_the_reference(tmp, name, nq, nx):
    (o, lse), ref = run_parts(name, tmp, nq, nx, cyclic(nq, 2), shuffled(nx, 2, seed=nq))
    assert_close(o, ref[0], f"{name} O")
    if lse is not None:
        assert_close(lse, ref[1], f"{name} lse")


@pytest.mark.parametrize("name", ["causal", "sliding_window", "document_mask", "chunked"])
def test_query_positions_alone_keep_exact_block_bounds(tmp, name):
    """Only the queries at positions (keys whole): the loop bounds come from
    each block's least and greatest query position, and skip nothing needed."""
    (o, lse), ref = run_parts(name, tmp, 45, 45, [torch.arange(45).flip(0)[::2], torch.arange(45)[1::2]])
    assert_close(o, ref[0], f"{name} O")
    assert_close(lse, ref[1], f"{name} lse")


def test_sigmoid_reads_the_global_length(tmp):
    """sigmoid(S - log |x|) over one part of the keys: |x| is the global
    length, so the part's output is the reference's with the other keys'
    values zeroed (a sum over keys is linear in V)."""
    m, _ = module("sigmoid", tmp)
    q, k, v = m.example_inputs({"b": 1, "h": 2, "q": 20, "x": 40}, dtype=torch.float32)
    xp = torch.arange(0, 40, 3)
    o = m.sigmoid_attention(q, k.index_select(2, xp), v.index_select(2, xp), positions={"x": xp},
                            lengths={"x": 40}, **BLOCKS)
    keep = torch.zeros(40, dtype=torch.bool)
    keep[xp] = True
    ref = m.reference(q.double(), k.double(), torch.where(keep[:, None], v, 0.0).double())
    assert_close(o.double(), ref, "sigmoid part")
    local = m.sigmoid_attention(q, k.index_select(2, xp), v.index_select(2, xp), **BLOCKS)
    assert not torch.allclose(local, o)    # |x| = 14 without lengths: a different result


def test_default_path_is_unchanged(tmp):
    """No options: the same outputs as identity positions, and K, V loaded
    for exactly the blocks visits.visited_blocks lists.  Row positions keep
    those blocks (the causal bound from the block's largest position) and add
    8 bytes a row; key positions visit every block, loading each block's
    positions (8 more bytes a key), but K and V only for the live tiles: the
    same blocks again."""
    from napkin.bytecount import ByteCounter
    from napkin.codegen import visited_blocks

    m, diagram = module("causal", tmp)
    n, heads, row = 50, 2, 16 * 4                  # bytes of one key row: d = 16, fp32
    q, k, v = m.example_inputs({"b": 1, "h": heads, "q": n, "x": n}, dtype=torch.float32)
    ar = torch.arange(n)
    plain_out = m.causal(q, k, v, **BLOCKS)
    counted = []
    for opts in ({}, {"positions": {"q": ar}, "lengths": {"q": n}},
                 {"positions": {"q": ar, "x": ar}, "lengths": {"q": n, "x": n}}):
        with ByteCounter(tensors={"Q": q, "K": k, "V": v}) as bc:
            out = m.causal(q, k, v, **opts, **BLOCKS)
        counted.append(bc.loads)
        assert all(torch.equal(a, b) for a, b in zip(out, plain_out))
    plain, rows, both = counted
    visits = visited_blocks(diagram, {"q": n, "x": n}, 16, 16)
    assert plain["K"] == plain["V"] == heads * sum(min(16, n - 16 * j) for _, j in visits) * row
    assert set(plain) == {"Q", "K", "V"}
    extra = {t: b for t, b in rows.items() if t not in ("Q", "K", "V")}
    assert rows["K"] == plain["K"] and rows["Q"] == plain["Q"] and sum(extra.values()) == heads * n * 8
    extra = {t: b for t, b in both.items() if t not in ("Q", "K", "V")}
    blocks = -(-n // 16)
    assert both["K"] == both["V"] == plain["K"] < heads * blocks * n * row
    assert sum(extra.values()) == heads * n * 8 + heads * blocks * n * 8


def test_out_dtype_keeps_float32_partial_states_from_16_bit_inputs(tmp):
    m, _ = module("causal", tmp)
    q, k, v = m.example_inputs({"b": 1, "h": 2, "q": 40, "x": 40}, dtype=torch.float16)
    ref, _ = m.reference(q.double(), k.double(), v.double())
    o16, _ = m.causal(q, k, v, **BLOCKS)
    o32, lse = m.causal(q, k, v, out_dtype=torch.float32, **BLOCKS)
    assert (o16.dtype, o32.dtype, lse.dtype) == (torch.float16, torch.float32, torch.float32)
    assert (o32.double() - ref).abs().max() < (o16.double() - ref).abs().max() / 10


def test_option_errors(tmp):
    m, _ = module("causal", tmp)
    q, k, v = m.example_inputs({"b": 1, "h": 1, "q": 8, "x": 8}, dtype=torch.float32)
    with pytest.raises(ValueError, match="needs lengths"):
        m.causal(q, k, v, positions={"q": torch.arange(8)})
    with pytest.raises(ValueError, match="1-D integer tensor of 8"):
        m.causal(q, k, v, positions={"x": torch.arange(7)}, lengths={"x": 8})
    with pytest.raises(ValueError, match="may name the wires q and x, not h"):
        m.causal(q, k, v, lengths={"h": 3})
    with pytest.raises(ValueError, match="out_dtype"):
        m.causal(q, k, v, out_dtype=torch.float64)
    with pytest.raises(ValueError, match="forward-only"):
        m.causal(q.requires_grad_(True), k, v, positions={"q": torch.arange(8)}, lengths={"q": 8})
    doc, _ = module("document_mask", tmp)
    q, k, v, ids = doc.example_inputs({"b": 1, "h": 1, "q": 8, "x": 8}, dtype=torch.float32)
    with pytest.raises(ValueError, match="must hold 20 rows"):
        doc.document_mask(q, k, v, ids, positions={"q": torch.arange(8)}, lengths={"q": 20})


# --------------------------------------------------------------------------
# The backward kernels at global positions (NAME_backward's positions= /
# lengths=): each (query part, key part) pair gets the GLOBAL lse and delta
# of its query rows, as the distributed wrappers pass them, so the parts'
# gradients scattered back to their positions and added up must equal
# float64 autograd of reference() on the whole sequence.
# --------------------------------------------------------------------------

def backward_parts(name: str, tmp: Path, nq: int, nx: int, qparts, xparts=None):
    """(kernel gradients, reference gradients), one per float input."""
    m, diagram = module(name, tmp)
    backward = getattr(m, f"{diagram.name}_backward")
    full = m.example_inputs({"b": 1, "h": 2, "hk": 2, "g": 2, "q": nq, "x": nx}, dtype=torch.float32,
                            seed=zlib.crc32(name.encode()))
    leaves = [t.double().requires_grad_(True) if t.is_floating_point() else t for t in full]
    o, lse = m.reference(*leaves)
    gen = torch.Generator().manual_seed(7)
    d_o = torch.randn(o.shape, generator=gen, dtype=torch.float64)
    d_lse = torch.randn(lse.shape, generator=gen, dtype=torch.float64)
    torch.autograd.backward([o, lse], [d_o, d_lse])
    want = [t.grad for t in leaves if t.is_floating_point()]
    delta = (d_o * o.detach()).sum(-1) - d_lse          # rowsum(dO * O) - dlse, global
    axes = {n: m._LAYOUTS[n] for n in m.INPUTS}
    out_q = [i for i, a in enumerate(m._LAYOUTS[m.OUTPUTS[0]]) if a == ("q",)][0]
    got = [torch.zeros_like(t) for t in want]
    for qp in qparts:
        for xp in xparts or [None]:
            inputs, where = [], []      # where: (dim, positions, length) of each input's local rows
            for name_, t in zip(m.INPUTS, full):
                dims = [i for i, a in enumerate(axes[name_]) if a in (("q",), ("x",))]
                if not t.is_floating_point() or not dims:
                    inputs.append(t)
                    where.append(None)
                    continue
                (dim,) = dims
                pos, n = (qp, nq) if axes[name_][dim] == ("q",) else (xp, nx)
                inputs.append(t if pos is None else take(t, dim, pos, n))
                where.append(None if pos is None else (dim, pos, n))
            rows = [take(s, out_q, qp, nq).float() for s in (d_o, lse.detach(), delta)]
            positions = {"q": qp} if xp is None else {"q": qp, "x": xp}
            grads = backward(*inputs, *rows, positions=positions, lengths={"q": nq, "x": nx}, **BLOCKS)
            grads = [g for g, t in zip(grads, full) if t.is_floating_point()]
            for i, (g, w) in enumerate(zip(grads, [w for w, t in zip(where, full) if t.is_floating_point()])):
                assert g.dtype == torch.float32 and not torch.isnan(g).any()
                if w is None:
                    got[i] += g.double()
                    continue
                dim, pos, n = w
                real = (pos < n).nonzero()[:, 0]
                pad = (pos >= n).nonzero()[:, 0]
                assert not g.index_select(dim, pad).any(), "padded rows get no gradient"
                got[i].index_add_(dim, pos[real], g.index_select(dim, real).double())
    return got, want


BACKWARD = [("causal", 45, 40), ("alibi", 37, 37), ("gqa_causal", 45, 40), ("document_mask", 37, 37),
            ("chunked", 45, 40)]


@pytest.mark.parametrize("name, nq, nx", BACKWARD, ids=[f"{n}-q{a}-x{b}" for n, a, b in BACKWARD])
def test_backward_at_global_positions_matches_float64_autograd(tmp, name, nq, nx):
    got, want = backward_parts(name, tmp, nq, nx, cyclic(nq, 2), shuffled(nx, 2, seed=nq))
    assert len(got) == (4 if name == "alibi" else 3)     # alibi: the slope's gradient too
    for g, w, label in zip(got, want, ["dQ", "dK", "dV", "dslope"]):
        err = (g - w).abs().max().item()
        assert err <= 1e-4 * max(1.0, w.abs().max().item()), f"{name} {label}: max error {err:.3g}"


def test_backward_with_query_positions_alone(tmp):
    """Keys whole (the dQ loop keeps the forward's exact causal bounds from
    each block's least and greatest query position; dK/dV visit every row block)."""
    qparts = [torch.arange(45).flip(0)[::2], torch.arange(45)[1::2]]
    got, want = backward_parts("causal", tmp, 45, 45, qparts)
    for g, w, label in zip(got, want, ["dQ", "dK", "dV"]):
        err = (g - w).abs().max().item()
        assert err <= 1e-4 * max(1.0, w.abs().max().item()), f"{label}: max error {err:.3g}"


@pytest.mark.parametrize("name", ["causal", "alibi"])
@pytest.mark.parametrize("tma", [False, True])
def test_padded_query_rows_add_nothing_whatever_they_hold(tmp, name, tma):
    """Query rows at positions >= the length are padding: whatever they hold
    (NaN here: memory nobody wrote), no gradient may see it.  A padded row's
    P and dS are zeros, but the products multiply them into its Q and dO
    (dK = dS^T Q, dV = P^T dO, dP = dO V^T, the slope's partial sums): 0 *
    NaN is NaN, so dQ and dK/dV read those rows as zeros (and TMA, which
    cannot mask a load, falls back).  The gradients equal those of zero
    padding, bitwise, and padded rows get a zero dQ."""
    m, diagram = module(name, tmp)
    backward = getattr(m, f"{diagram.name}_backward")
    nq, nx, real = 40, 40, 36
    inputs = m.example_inputs({"b": 1, "h": 2, "q": nq, "x": nx}, dtype=torch.float32, seed=11)
    Q = inputs[0]
    gen = torch.Generator().manual_seed(12)
    d_o, lse, delta = (torch.randn(s, generator=gen) for s in (Q.shape, Q.shape[:-1], Q.shape[:-1]))
    kw = dict(positions={"q": torch.arange(nq)}, lengths={"q": real}, tma=tma, **BLOCKS)
    clean = [t.clone() for t in (Q, d_o, lse, delta)]
    for t in clean:
        t[:, :, real:] = 0.0
    dirty = [t.clone() for t in clean]
    for t in dirty:
        t[:, :, real:] = float("nan")
    want = backward(clean[0], *inputs[1:], *clean[1:], **kw)
    got = backward(dirty[0], *inputs[1:], *dirty[1:], **kw)
    assert m._tma_last_dkdv["used"] is False
    for g, w in zip(got, want):
        assert not torch.isnan(g).any(), "NaN from padded query rows"
        assert torch.equal(g, w)
    assert not got[0][:, :, real:].any(), "padded rows get no dQ"


@pytest.mark.parametrize("name", ["causal", "sigmoid", "gqa_causal"])
def test_a_length_alone_makes_the_rows_past_it_padding(name, tmp, monkeypatch):
    """lengths={'x': 10} on 37 key rows, no positions: a row's position is its offset, so the rows
    from 10 on are padding, as the docstring says; the kernels tested a row against the length only
    where positions were given, and counted all 37 (off by 1.4 from the first 10 keys)."""
    m, _ = module(name, tmp)
    fn = getattr(m, {"sigmoid": "sigmoid_attention", "gqa_causal": "gqa"}.get(name, name))
    sizes = {"b": 1, "h": 2, "hk": 2, "g": 2, "q": 21, "x": 37}
    q, k, v = m.example_inputs({w: n for w, n in sizes.items() if w in m.WIRES}, dtype=torch.float32)
    monkeypatch.setattr(m, "_LAUNCH_PLANS", {})
    real, hits = m._launch_plan, []
    monkeypatch.setattr(m, "_launch_plan", lambda key: hits.append(real(key)[0] is not None) or real(key))
    # a decode loop over one cache: the calls after the first short one are launched from its plan
    # (keyed by whether the length is short, not by the length), the whole cache from a plan of its own
    for n, planned in ((10, False), (3, True), (36, True), (37, False), (11, True)):
        cut = [t.narrow(t.dim() - 2, 0, n) for t in (k, v)]
        got = fn(q, k, v, lengths={"x": n}, **BLOCKS)
        assert hits[-1] is planned, n
        want = fn(q, *cut, **BLOCKS)
        got, want = (r if isinstance(r, tuple) else (r,) for r in (got, want))
        ref = m.reference(q.double(), *(t.double() for t in cut))
        for a, b, r in zip(got, want, ref if isinstance(ref, tuple) else (ref,)):
            assert torch.equal(a, b), n
            assert_close(a.double(), r, f"{name} length {n} alone")


@pytest.mark.parametrize("name, q, chunk", [("causal", 21, None), ("decode", 5, 16)])
def test_a_length_alone_stops_the_kernel_at_it(name, q, chunk, tmp, monkeypatch):
    """lengths={'x': n} and no positions: the kernel takes n as the streamed wire's size, as for the
    cache narrowed to n, so it loads no positions and no K or V past n (padding positions made it
    walk every block of the cache, loading each one's positions), and gives the narrowed call's
    outputs bit for bit, through a launch plan too; the chunked decode's chunks past n are empty."""
    from napkin.bytecount import ByteCounter

    m, _ = module(name, tmp)
    fn = getattr(m, "flash_decoding" if name == "decode" else name)
    sizes = {"b": 1, "h": 2, "hk": 2, "g": 4, "q": q, "x": 70}
    inputs = m.example_inputs({w: n for w, n in sizes.items() if w in m.WIRES}, dtype=torch.float32)
    opts = dict(BLOCKS, **({"chunk": chunk} if chunk else {}))
    monkeypatch.setattr(m, "_LAUNCH_PLANS", {})
    for i, n in enumerate((10, 33, 5)):   # the second and third from the plan the first made
        cut = [t.narrow(t.dim() - 2, 0, n) if t.shape[-2] == 70 else t for t in inputs]
        counts = []
        for args, kw in ((inputs, {"lengths": {"x": n}}), (cut, {})):
            with ByteCounter(tensors={"Q": inputs[0], "K": inputs[1], "V": inputs[2]}) as bc:
                out = fn(*args, **kw, **opts)
            counts.append(bc)
        assert len(m._LAUNCH_PLANS) == 2 + i   # one for the lengths, one each narrowed shape
        (lengths_bc, narrow_bc), got = counts, fn(*inputs, lengths={"x": n}, **opts)
        for a, b in zip(got, out):
            assert torch.equal(a, b), n
        assert "_pos_x" not in lengths_bc.loads, n
        assert (lengths_bc.loads["K"], lengths_bc.loads["V"]) == (narrow_bc.loads["K"], narrow_bc.loads["V"]), n
        if chunk is None:   # the same loop, load for load (chunked: the empty chunks load their Q rows)
            assert lengths_bc.load_calls == narrow_bc.load_calls, n


def test_negative_positions_are_padding_and_never_read_below_an_input(tmp):
    """A negative position was a real row to some tests and none to others:
    causal dropped whole key blocks (positions - 16: error 2.95, lse -inf),
    and document_mask read its doc ids below the tensor's start.  Rows
    outside [0, length) are padding now: keys never count, and query rows'
    outputs are unspecified (checked here: the others are exact)."""
    m, _ = module("document_mask", tmp)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=g) for _ in range(3))
    store = torch.zeros(1, 48, dtype=torch.int32)
    store[:, :8] = 7                  # what sits below doc in memory: another sequence's ids
    doc = store[:, 8:]                # every real row is document 0
    shift = torch.arange(40) - 4      # query rows 0-3 at negative positions: padding
    out, lse = m.document_mask(q, k, v, doc, positions={"q": shift}, lengths={"q": 40}, **BLOCKS)
    at = torch.cat([q[:, :, 4:], torch.zeros(1, 2, 4, 16)], 2)   # at[p]: the query row at position p
    want, want_lse = m.reference(at.double(), k.double(), v.double(), doc)
    assert (out[:, :, 4:].double() - want[:, :, :36]).abs().max() < 1e-5   # row i at position i - 4
    # keys at negative positions never count: shifting x by -16 leaves 24 real keys
    m, _ = module("causal", tmp)
    keys = torch.arange(40) - 16
    out, _ = m.causal(q, k, v, positions={"x": keys}, lengths={"x": 40}, **BLOCKS)
    s = (q.double() @ k.double().transpose(-1, -2)) / 4
    s = s.masked_fill((keys[None, :] < 0) | (keys[None, :] > torch.arange(40)[:, None]), -torch.inf)
    want = torch.nan_to_num(torch.softmax(s, -1)) @ v.double()
    assert (out.double() - want).abs().max() < 1e-5


@pytest.mark.parametrize("kwargs, words", [
    ({"positions": torch.arange(40)}, "positions must be a dict from wire names (q and x) to 1-D integer tensors, "
                                      "not a Tensor"),
    ({"lengths": 40}, "lengths must be a dict from wire names (q and x) to ints, not a int"),
])
def test_positions_and_lengths_of_another_type_are_named(tmp, kwargs, words):
    m, _ = module("causal", tmp)
    q = torch.randn(1, 2, 40, 16)
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        m.causal(q, q, q, **kwargs)


def test_lengths_take_numpy_integers_and_the_positions_message_allows_padding(tmp):
    """lengths={'x': np.int64(10)} was refused ("must be a non-negative int") where block_q= and
    chunk= take numpy integers; the positions message said "non-negative" of indices whose
    negative ones are documented padding."""
    np = pytest.importorskip("numpy")
    m, _ = module("causal", tmp)
    q, k, v = m.example_inputs({"b": 1, "h": 2, "q": 21, "x": 37}, dtype=torch.float32)
    assert torch.equal(m.causal(q, k, v, lengths={"x": np.int64(10)}, **BLOCKS)[0],
                       m.causal(q, k, v, lengths={"x": 10}, **BLOCKS)[0])
    with pytest.raises(ValueError, match=r"positions\['x'\] must be a 1-D integer tensor of 37 global indices, "
                                         r"one per row of x \(a negative one marks a padding row\)"):
        m.causal(q, k, v, positions={"x": torch.arange(36)}, lengths={"x": 37})


def test_preprocess_takes_the_forwards_positions(tmp):
    """With positions, doc holds the global length, which NAME_preprocess bound as a local size
    ("doc dimension 1 (x) has size 64, but wire x has size 24"): the preprocess -> backward recipe
    of docs/training.md failed for a diagram reading data at positions."""
    m, _ = module("document_mask", tmp)
    g = torch.Generator().manual_seed(5)
    q, dout = (torch.randn(1, 2, 16, 16, generator=g) for _ in range(2))
    k, v = (torch.randn(1, 2, 24, 16, generator=g) for _ in range(2))
    doc = torch.div(torch.arange(64, dtype=torch.int32), 20, rounding_mode="floor")[None]
    pos = dict(positions={"q": torch.arange(16) + 40, "x": torch.arange(24) + 20}, lengths={"q": 64, "x": 64})
    out, lse = m.document_mask(q, k, v, doc, **pos, **BLOCKS)
    (delta,) = m.document_mask_preprocess(q, k, v, doc, dout, out, positions=pos["positions"])
    assert torch.allclose(delta, (dout * out).sum(-1), atol=1e-5)
