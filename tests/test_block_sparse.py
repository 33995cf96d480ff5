"""Coarse reads: a tensor read at the blocks of a wire, ``keep[b, h, q // 64, x // 64]``.

One element of ``keep[b, h, qb, xb]`` serves a 64 x 64 block of (q, x)
pairs: a block-sparse mask (MoBA's and NSA's block selection,
FlexAttention's BlockMask) at |q| |x| / 4096 bools, where a dense mask takes
|q| |x|.  Checked here:

* the language: the read parses, prints back, and what it cannot be is
  refused in words where it is written (another operator, a step of 0 or a
  fraction, a step in a reduction, a wire read at its own blocks, a fixed
  size that is not ceil(|q| / step), a devices level), and the launcher
  refuses a keep of the wrong size;
* numerics: examples/block_sparse.ncd and a coarse additive bias against the
  float64 reference and torch's SDPA given the mask expanded to every pair,
  forward and gradients, at ragged sizes and steps that are and are not a
  multiple of the kernels' blocks;
* the ranges prepass finds the dead blocks: K's loads fall to the live ones;
* the cost pass counts a coarse read by the distinct cells each tile meets,
  as the kernels' loads touch them (ByteCounter's distinct addresses), forward
  and backward;
* FlexAttention's mask_mod reads the same blocks.
"""
from __future__ import annotations

import pytest
import torch

import napkin
import backward_helpers as B
import kernel_helpers as K
from cost_helpers import backward_bytes, predicted_bytes, without_tensors
from napkin.bytecount import ByteCounter
from napkin.errors import NapkinError


@pytest.fixture(scope="module", autouse=True)
def _folder(tmp_path_factory):
    K._FOLDER.append(tmp_path_factory.mktemp("block_sparse"))
    yield
    K._FOLDER.pop()


SPARSE = (K.REPO / "examples" / "block_sparse.ncd").read_text()
# a coarse additive bias at blocks of 48 (no multiple of the 32-row or 16-key blocks): a float input, no mask
BIAS = """diagram coarse_bias

wire b, h, q, x, qb, xb
wire d = 32

in Q[b, h, q, d] : fp32
in K[b, h, x, d] : fp32
in V[b, h, x, d] : fp32
in bias[h, qb, xb] : fp32

S[b, h, q, x] = sum[d](Q * K) * |d|^-0.5 + bias[h, q // 48, x // 48]
O[b, h, q, d] : fp32 = sum[x](softmax[x](S) * V)
out O

schedule on h100 {
  accumulate fp32
  level hbm { hold Q, K, V, bias, O }
  level smem {
    group b by 1, h by 1, q by 32
    stream x by 16
    hold S
  }
}
"""


def _error(text: str) -> str:
    with pytest.raises(NapkinError) as err:
        napkin.load_text(text, "t.ncd")
    return str(err.value)


def test_a_coarse_read_parses_and_prints_back():
    from napkin import ir
    from napkin.printer import to_text

    d = napkin.load_text(SPARSE, "block_sparse.ncd")
    ref = next(n for n in ir.walk(d.lets[0].expr) if isinstance(n, ir.TensorRef) and n.name == "keep")
    assert (ref.wires, ref.steps) == (("b", "h", "q", "x"), (1, 1, 64, 64))
    assert ir.coarse_reads(d) == (("keep", "qb", "q", 64, ref.loc), ("keep", "xb", "x", 64, ref.loc))
    assert ir.relabels(d) == ()   # qb and x differ in size: no relabel
    again = napkin.load_text(to_text(d), "again.ncd")
    assert again.lets == d.lets and "keep[b, h, q // 64, x // 64]" in to_text(d)


@pytest.mark.parametrize("read, message", [
    ("keep[b, h, q * 64, x // 64]", "t.ncd:18:34: an index in brackets is a wire or, in a tensor read, its "
                                    "blocks (q // 64), not q * 64"),
    ("keep[b, h, q // 0, x // 64]", "t.ncd:18:39: the step of q // 0 must be a positive whole number"),
    ("keep[b, h, q // 2.5, x // 64]", "t.ncd:18:39: the step of q // 2.5 must be a positive whole number"),
    ("keep[b, h, q - x, x // 64]", "t.ncd:18:36: unexpected '-'"),
])
def test_a_read_at_anything_but_a_wire_s_blocks_is_refused_where_it_is_written(read, message):
    assert _error(SPARSE.replace("keep[b, h, q // 64, x // 64]", read)).startswith(message)


def test_what_a_coarse_read_cannot_be_is_refused_in_words():
    assert "a reduction names whole wires, not d // 2" in _error(SPARSE.replace("sum[d](Q * K)", "sum[d // 2](Q * K)"))
    own = _error(SPARSE.replace("in keep[b, h, qb, xb] : bool", "in keep[b, h, q, xb] : bool"))
    assert "keep[b, h, q // 64, x // 64] reads keep at q // 64, but keep is declared along q itself" in own
    assert "hint: declare keep along a wire of the blocks of q, of size ceil(|q| / 64)" in own
    fixed = _error(SPARSE.replace("wire b, h, q, x, qb, xb", "wire b, h, x, xb\nwire q = 300, qb = 4"))
    assert "keep[b, h, q // 64, x // 64] reads qb at q // 64, so qb must have size ceil(300 / 64) = 5, not 4" in fixed
    mesh = _error(SPARSE.replace("level hbm {", "level devices { group q across 2 }\n  level hbm {"))
    assert ("keep[b, h, q // 64, x // 64] reads keep at blocks of q, which napkin's distributed wrappers do not "
            "split across devices") in mesh
    from napkin.cost import analyse
    with pytest.raises(NapkinError, match=r"keep is read at q // 64, so wire qb must have size ceil\(\|q\| / 64\) "
                                          r"= 5 \(\|q\| = 300\), not 4"):
        analyse(napkin.load_text(SPARSE, "s.ncd"), {"b": 1, "h": 1, "q": 300, "x": 300, "qb": 4})


def test_the_launcher_refuses_a_keep_of_the_wrong_size():
    m = K.example("block_sparse")
    Q, Kt, V, keep = m.example_inputs({"b": 1, "h": 2, "q": 130, "x": 70}, dtype=torch.float32)
    assert keep.shape == (1, 2, 3, 2)   # ceil(130 / 64), ceil(70 / 64)
    with pytest.raises(ValueError, match=r"keep is read at q // 64, so its wire qb must have size ceil\(\|q\| / 64\) "
                                         r"= 3 \(\|q\| = 130\), not 2"):
        m.block_sparse(Q, Kt, V, keep[:, :, :2])


@pytest.mark.parametrize("name", ["block_sparse", "coarse_bias"])
def test_rows_at_global_positions_read_the_blocks_of_their_positions(name):
    """A shard of the queries (rows 50..129 of 130) at their global positions reads keep /
    bias at the blocks of those positions, which hold the global length's blocks: the
    shard's output is the whole call's rows, bit for bit.  keep and bias bound no size
    then (an internal KeyError 'qb' before), and one short of the global blocks is refused."""
    m = K.example("block_sparse") if name == "block_sparse" else K.compile_text(BIAS, "coarse_bias")
    fn = getattr(m, name)
    inputs = m.example_inputs({"b": 1, "h": 2, "q": 130, "x": 70}, dtype=torch.float32, seed=4)
    Q, Kt, V, blocks = inputs
    opts = {"block_q": 32, "block_x": 16}
    whole = fn(*inputs, **opts)
    whole = whole[0] if isinstance(whole, tuple) else whole
    at = {"positions": {"q": torch.arange(50, 130)}, "lengths": {"q": 130}}
    shard = fn(Q[:, :, 50:].contiguous(), Kt, V, blocks, **at, **opts)
    shard = shard[0] if isinstance(shard, tuple) else shard
    assert torch.equal(shard, whole[:, :, 50:])
    tensor, dim, step = ("keep", 2, 64) if name == "block_sparse" else ("bias", 1, 48)
    short = blocks.narrow(dim, 0, 2)   # ceil(130 / 64) = ceil(130 / 48) = 3 blocks hold the global length
    with pytest.raises(ValueError, match=rf"^{tensor} is read at global positions along dimension {dim}: it must "
                                         rf"hold 3 blocks of {step} \(the global length's\), not 2$"):
        fn(Q[:, :, 50:].contiguous(), Kt, V, short, **at, **opts)
    if name == "coarse_bias":   # its gradient would sum the shard's rows by local blocks: refused
        with pytest.raises(NotImplementedError, match="napkin has no gradient for bias with positions for q"):
            m.coarse_bias_backward(Q[:, :, 50:].contiguous(), Kt, V, blocks, torch.randn(1, 2, 80, 32),
                                   torch.zeros(1, 2, 80), torch.zeros(1, 2, 80), **at)


def _expanded(keep, steps, n_q, n_x):
    """keep[..., q // s, x // s] at every (q, x): what SDPA and the reference see."""
    iq, ix = torch.arange(n_q) // steps[0], torch.arange(n_x) // steps[1]
    return keep[..., iq, :][..., ix]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n_q, n_x", [(300, 300), (190, 257)])
def test_block_sparse_attention_matches_sdpa_and_float64(dtype, n_q, n_x):
    """Random blocks kept (a row of blocks with none kept too), causal
    within them, at ragged sizes: forward and gradients against float64's
    reference and autograd, and the forward against SDPA's with the mask
    expanded (rows that keep no key are 0 here, NaN there: left out)."""
    m = K.example("block_sparse")
    Q, Kt, V, keep = m.example_inputs({"b": 2, "h": 2, "q": n_q, "x": n_x}, dtype=dtype, seed=n_q + n_x)
    keep[0, 1, 1] = False
    inputs = (Q, Kt, V, keep)
    out = K.run(m, inputs)
    K.assert_accurate(out, K.reference(m, inputs, torch.float64), K.reference(m, inputs), "block sparse")
    mask = _expanded(keep, (64, 64), n_q, n_x) & (torch.arange(n_x)[None, :] <= torch.arange(n_q)[:, None])
    sdpa = torch.nn.functional.scaled_dot_product_attention(Q.double(), Kt.double(), V.double(), attn_mask=mask)
    seen = mask.any(-1)
    assert (~seen).any() and seen.any()
    assert (out[0].double() - sdpa)[seen].abs().max().item() < (1e-5 if dtype == torch.float32 else 2e-3)
    assert torch.equal(out[0][~seen], torch.zeros_like(out[0][~seen]))

    def ours(Q, Kt, V, keep):
        return m.block_sparse(Q, Kt, V, keep, block_q=32, block_x=16)
    got = B.gradients(ours, inputs)
    wide = [t.double() if t.is_floating_point() else t for t in inputs]
    B.assert_accurate(got[:3], B.gradients(m.reference, wide)[:3], B.gradients(m.reference, inputs)[:3],
                      "block sparse", dtype=dtype)


def test_the_kernels_skip_the_blocks_keep_drops():
    """A keep with whole dead key blocks at each row block's ends: the
    prepass finds them and K is loaded from the live blocks alone."""
    m = K.example("block_sparse")
    n = 256
    Q, Kt, V, keep = m.example_inputs({"b": 1, "h": 1, "q": n, "x": n}, dtype=torch.float32, seed=4)
    keep[:] = False
    keep[0, 0, torch.arange(4), torch.arange(4)] = True   # the diagonal blocks alone: 64 keys a row
    with ByteCounter(tensors={"K": Kt}) as bc:
        m.block_sparse(Q, Kt, V, keep, block_q=64, block_x=64)
    assert bc.loads["K"] == n * 64 * 4   # each row block of 64 loads its one diagonal block of K
    with ByteCounter(tensors={"K": Kt}) as bc:
        m.block_sparse(Q, Kt, V, torch.ones_like(keep), block_q=64, block_x=64)
    assert bc.loads["K"] == (1 + 2 + 3 + 4) * 64 * 64 * 4   # causal: the blocks up to the diagonal


def test_the_kernels_visit_the_live_blocks_of_a_random_keep_alone():
    """A random keep (about half the blocks of 64, causal within) at blocks
    of 32 over a ragged 300 tokens leaves row blocks with several dead runs:
    the forward and dQ load K, and dK/dV loads Q, from the live tiles alone,
    each once (the prepass's lists), and the gradients match float64."""
    m = K.example("block_sparse")
    n, blk, sizes = 300, 32, {"b": 1, "h": 2, "q": 300, "x": 300}
    Q, Kt, V, keep = m.example_inputs(sizes, dtype=torch.float32, seed=21)
    keep.copy_(torch.rand(keep.shape, generator=torch.Generator().manual_seed(34)) < 0.5)
    at = torch.arange(n)
    pairs = keep[0][:, at // 64][:, :, at // 64] & (at[None, :] <= at[:, None])   # [h, q, x]
    nb = -(-n // blk)
    live = torch.zeros(2, nb, nb, dtype=torch.bool)
    for i in range(nb):
        for j in range(nb):
            live[:, i, j] = pairs[:, i * blk:(i + 1) * blk, j * blk:(j + 1) * blk].flatten(1).any(1)
    runs = [(r.nonzero().flatten().diff() > 1).sum().item() for r in live.flatten(0, 1)]
    assert max(runs) >= 2   # a row block with two dead runs or more: one skipped run would not do

    def tiles(axis):   # the bytes of the live tiles' operand along ``axis`` (1: keys, 0: rows), d of fp32
        return sum(min(blk, n - int(t[1 + axis]) * blk) for t in live.nonzero()) * Q.shape[-1] * 4

    opts = {"block_q": blk, "block_x": blk}
    with ByteCounter(tensors={"K": Kt}) as bc:
        m.block_sparse(Q, Kt, V, keep, **opts)
    assert bc.loads["K"] == tiles(1), "forward"
    rows_in = [torch.randn(Q.shape), torch.zeros(Q.shape[:-1]), torch.zeros(Q.shape[:-1])]
    with ByteCounter(tensors={"K": Kt}) as bc:
        m.block_sparse_backward(Q, Kt, V, keep, *rows_in, need=(True, False, False, False), **opts)
    assert bc.loads["K"] == tiles(1), "dQ"
    with ByteCounter(tensors={"Q": Q}) as bc:
        m.block_sparse_backward(Q, Kt, V, keep, *rows_in, need=(False, True, True, False), **opts)
    assert bc.loads["Q"] == tiles(0), "dK/dV"
    inputs = (Q, Kt, V, keep)
    got = B.gradients(lambda *xs: m.block_sparse(*xs, **opts), inputs)
    wide = [t.double() if t.is_floating_point() else t for t in inputs]
    B.assert_accurate(got[:3], B.gradients(m.reference, wide)[:3], B.gradients(m.reference, inputs)[:3],
                      "block sparse, a random keep")


@pytest.mark.parametrize("n_q, n_x", [(100, 100), (150, 70)])
def test_the_cost_pass_counts_the_cells_a_coarse_read_meets(n_q, n_x):
    """bias[h, q // 48, x // 48] at blocks 32 x 16 (a block meets one or two
    cells of 48): counted bytes = the distinct bytes each load of the kernels
    touches, tensor by tensor, for the forward, the training forward and the
    backward's kernels; and the kernel matches float64, gradients too (the bias's
    summed by cells)."""
    from napkin.cost import analyse
    from napkin.cost.backward import backward_cost

    m = K.compile_text(BIAS, "coarse_bias")
    d = napkin.load_text(BIAS, "coarse_bias.ncd")
    sizes = {"b": 2, "h": 2, "q": n_q, "x": n_x}
    inputs = m.example_inputs(sizes, dtype=torch.float32, seed=n_q)
    assert inputs[3].shape == (2, -(-n_q // 48), -(-n_x // 48))
    out = K.run(m, inputs)
    K.assert_accurate(out, K.reference(m, inputs, torch.float64), K.reference(m, inputs), "coarse bias")
    # the bias trains too: each cell's gradient the sum over its 48 x 48 scores (cut short at the
    # edges) of both batches' dS, whose delta roundings add up as the root of its rows (2 x 48)
    wide = [t.double() for t in inputs]
    B.assert_accurate(B.gradients(m.coarse_bias, inputs), B.gradients(m.reference, wide),
                      B.gradients(m.reference, inputs), "coarse bias", rows=[1, 1, 1, 2 * 48])

    report = analyse(d, sizes)
    with ByteCounter(tensors=dict(zip(m.INPUTS, inputs)), distinct=True) as bc:
        m.coarse_bias(*inputs)
    assert (without_tensors(bc.loads), without_tensors(bc.stores)) == predicted_bytes(report)
    back = backward_cost(d, sizes, given=True)
    options = tuple({"block_q": 32, "block_x": 16}.get(o) for o in m._OPTIONS)
    with ByteCounter(tensors=dict(zip(m.INPUTS, inputs)), distinct=True) as bc:
        outs, saved = m._coarse_bias_forward(*inputs, *options, True)
    assert (without_tensors(bc.loads), without_tensors(bc.stores)) == predicted_bytes(back.forward)
    grads = [torch.randn(o.shape, generator=torch.Generator().manual_seed(0)) for o in outs]
    with ByteCounter(tensors=dict(zip(m.INPUTS, inputs)), distinct=True) as bc:
        m._coarse_bias_grads(inputs, (*outs, *saved), grads, options, None)
    moved = {k: v for k, v in bc.loads.items() if v}
    assert moved == {k: v for k, v in backward_bytes(back, "load").items() if v}
    bias_bytes = {t.tensor: t.bytes for t in report.transfers}["bias"]
    # one cell a tile where its 32 rows and 16 keys sit within one 48-block, two where they cross
    cells = sum(len({i // 48 for i in range(r, min(r + 32, n_q))}) * len({j // 48 for j in range(c, min(c + 16, n_x))})
                for r in range(0, n_q, 32) for c in range(0, n_x, 16))
    assert bias_bytes == 2 * 2 * cells * 4


def test_flex_reads_the_same_blocks():
    from napkin.bench import flex

    text = flex.emit(napkin.load_text(SPARSE, "block_sparse.ncd")).text
    assert "keep[_b, _h, (_q_idx // 64), (_kv_idx // 64)]" in text


def test_the_bench_reference_reads_the_same_blocks():
    """napkin bench's own float64 reference (napkin/bench/reference.py), which
    checks each run before timing, against the module's at 150 tokens (3 blocks)."""
    from napkin.bench import reference as bench_ref

    m = K.example("block_sparse")
    d = napkin.load_text(SPARSE, "block_sparse.ncd")
    sizes = {"b": 1, "h": 2, "q": 150, "x": 150, "qb": 3, "xb": 3}
    inputs = bench_ref.example_inputs(d, sizes, dtype=torch.float32, seed=2)
    assert inputs[3].shape == (1, 2, 3, 3) and 0 < inputs[3].sum() < 18
    got, = bench_ref.reference(d, inputs, sizes)
    want, = K.reference(m, inputs, torch.float64)
    assert torch.allclose(got, want, atol=1e-12, rtol=0)


def test_napkin_plan_offers_no_distributed_scheme_for_a_coarse_read():
    from napkin.plan import plan

    d = napkin.load_text(SPARSE, "block_sparse.ncd")
    with pytest.raises(NapkinError, match=r"diagram block_sparse reads keep at q // 64, which napkin's distributed "
                                          r"wrappers do not split across devices: napkin plan has no scheme to offer"):
        plan(d, 4, {"b": 1, "h": 2, "q": 4096, "x": 4096})


def test_a_matrix_product_takes_no_factor_read_at_blocks():
    """A[m // 2, k] in a matmul (its loads took no step: NaN, unrefused) and
    Q[b, h, q // 2, d] in a score: refused at the input, with the recipe."""
    from napkin.codegen import emit_module

    matmul = """diagram mm
wire n, k
wire m = 10, mb = 5
in A[mb, k] : fp32
in B[k, n] : fp32
C[m, n] : fp32 = sum[k](A[m // 2, k] * B)
out C
"""
    score = SPARSE.replace("in Q[b, h, q, d]", "in Q[b, h, qb, d]").replace(
        "sum[d](Q * K)", "sum[d](Q[b, h, q // 64, d] * K)").replace(
        "wire b, h, q, x, qb, xb", "wire b, h, x, xb\nwire q = 200, qb = 4")   # no input lies along q
    for text, name in ((matmul, "A"), (score, "Q")):
        with pytest.raises(NapkinError, match=rf"napkin cannot emit a kernel for input {name}: it is read at a wire's "
                                              r"blocks and multiplied in a matrix product \(tl.dot\)"):
            emit_module(napkin.load_text(text, "t.ncd"), source_text=text, source_path="t.ncd")
