"""Generated kernels against the float64 reference and PyTorch's SDPA.

Every kernel runs under TRITON_INTERPRET=1 on the CPU (conftest sets it when
there is no GPU), with small block overrides (block_q=32, block_x=16) so the
interpreter stays fast.  The accuracy rule: on every finite entry, the
kernel's max error against the float64 reference is at most twice the
same-dtype reference's own error plus a small floor (4 ulps of the output
dtype times the output's scale); non-finite entries must match exactly.
bf16 runs only on a GPU (the interpreter's bf16 tl.dot is wrong).
Random diagrams and rarely used forms: test_kernel_forms.py; the shared
helpers (compile, run, the rule itself): kernel_helpers.py.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernel_helpers as kh
import napkin
from napkin import masks
from napkin.codegen import lower, visited_blocks
from example_sizes import sizes_for
from kernel_helpers import EXAMPLES, FAST, REPO, assert_accurate, check, compile_text, example, reference, run
from spies import heaviest_first, program_block


@pytest.fixture(scope="module", autouse=True)
def _folder(tmp_path_factory):
    kh._FOLDER.append(tmp_path_factory.mktemp("kernels"))
    yield
    kh._FOLDER.pop()


# --------------------------------------------------------------------------
# Every example, ragged sizes, fp32 and fp16.
# --------------------------------------------------------------------------

SEQ = [(37, 100), (100, 37), (1, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("name", EXAMPLES)
def test_example_matches_reference(name, dtype):
    m = example(name)
    for i, (q, x) in enumerate(SEQ):
        check(m, sizes_for(name, q, x), dtype, seed=i, label=f"{name} q={q} x={x}")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["attention", "causal", "gqa", "matmul", "l2_attention"])
def test_bf16_on_gpu(name):
    m = example(name)
    inputs = m.example_inputs(sizes_for(name, 200, 333), dtype=torch.bfloat16, device="cuda")
    out = run(m, inputs, block_q=None, block_x=None) if name != "matmul" else run(m, inputs)
    assert_accurate(out, reference(m, inputs, torch.float64), reference(m, inputs), name)


# --------------------------------------------------------------------------
# Against torch.nn.functional.scaled_dot_product_attention.
# --------------------------------------------------------------------------

def _sdpa_case(name, inputs):
    """(query, key, value, kwargs) for SDPA reproducing the diagram."""
    if name == "document_mask":
        q, k, v, doc = inputs
        return q, k, v, {"attn_mask": (doc[:, None, :, None] == doc[:, None, None, :])}
    if name == "alibi":
        q, k, v, slope = inputs
        nq, nx = q.shape[2], k.shape[2]
        dist = (torch.arange(nx)[None, :] - torch.arange(nq)[:, None]).to(q.dtype)
        bias = slope.to(q.dtype)[:, None, None] * dist
        bias = bias.masked_fill(torch.arange(nx)[None, :] > torch.arange(nq)[:, None], float("-inf"))
        return q, k, v, {"attn_mask": bias}
    q, k, v = inputs
    if name.startswith("sliding_window"):
        i, j = torch.arange(q.shape[2])[:, None], torch.arange(k.shape[2])[None, :]
        return q, k, v, {"attn_mask": (j <= i) & (i - j < 40)}
    return q, k, v, {"is_causal": name == "causal", "enable_gqa": name == "gqa"}


@pytest.mark.parametrize("name", ["attention", "causal", "gqa", "sliding_window", "document_mask", "alibi"])
def test_sdpa_agrees(name):
    m = example(name, ("q - x < 256", "q - x < 40")) if name == "sliding_window" else example(name)
    sizes = sizes_for(name, 100, 100 if name in ("document_mask", "sliding_window") else 77)
    for dtype in (torch.float32, torch.float16):
        inputs = m.example_inputs(sizes, dtype=dtype, seed=3)
        ref64 = reference(m, inputs, torch.float64)[0]
        as64 = [t.double() if t.is_floating_point() else t for t in inputs]
        q, k, v, kw = _sdpa_case(name, as64)
        # the reference has SDPA's semantics ...
        assert torch.allclose(ref64, F.scaled_dot_product_attention(q, k, v, **kw), rtol=1e-10, atol=1e-12)
        # ... and the kernel is as close to it as SDPA in the same dtype is
        q, k, v, kw = _sdpa_case(name, list(inputs))
        sdpa = F.scaled_dot_product_attention(q, k, v, **kw)
        assert_accurate(run(m, inputs)[:1], [ref64], [sdpa], f"{name} vs sdpa {dtype}")


# --------------------------------------------------------------------------
# Head dims, MQA, layouts, symbolic head dim.
# --------------------------------------------------------------------------

@pytest.mark.parametrize("d, dtype", [(16, torch.float32), (80, torch.float16), (96, torch.float32),
                                      (256, torch.float16)])
def test_head_dims_are_padded_to_a_power_of_two(d, dtype):
    # d = 256 with 128-query blocks overflows the h100's shared memory: the
    # checker refuses it, so that variant also blocks q by 64
    m = example("attention", ("wire d = 64", f"wire d = {d}"), ("q by 128", "q by 64"))
    check(m, {"b": 1, "h": 2, "q": 50, "x": 45}, dtype, label=f"d={d}")


def test_symbolic_head_dim_is_bound_at_call_time():
    m = example("causal", ("wire d = 64", "wire d"))
    for d in (24, 64):
        check(m, {"b": 1, "h": 1, "q": 40, "x": 40, "d": d}, torch.float32, label=f"d={d}")


def test_mqa_is_gqa_with_one_kv_head():
    m = example("gqa")
    check(m, {"b": 1, "hk": 1, "g": 4, "q": 33, "x": 50}, torch.float16, label="mqa")
    q, k, v = m.example_inputs({"b": 1, "hk": 1, "g": 4, "q": 33, "x": 50}, dtype=torch.float32)
    o = run(m, (q, k, v))[0]
    expect = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), enable_gqa=True)
    assert torch.allclose(o.double(), expect, atol=1e-5)


def test_without_a_schedule_the_row_wire_is_the_query_not_a_flattened_head():
    """Q[b, q, (hk g), d] with no schedule blocked g, its last own wire: one program per query,
    K and V read once per query (trainmix hunt).  The query wire is an axis by itself, and the one
    the mask reads as an index."""
    text = """diagram rw
wire b, hk, g, q, x
wire d = 32
in Q[b, q, (hk g), d] : fp16
in K[b, x, hk, d] : fp16
in V[b, x, hk, d] : fp16
S[b, hk, g, q, x] = where(x <= q, sum[d](Q * K) * |d|^-0.5, -inf)
O[b, q, (hk g), d] : fp16 = sum[x](softmax[x](S) * V)
out O
"""
    m = compile_text(text, "rowwire")
    assert set(m._BLOCKS) == {"q", "x"}
    sizes = {"b": 1, "hk": 2, "g": 2, "q": 37, "x": 37}
    q, k, v = m.example_inputs(sizes, dtype=torch.float32)
    o = run(m, (q, k, v), block_q=16, block_x=16)[0]
    qh = q.double().permute(0, 2, 1, 3)                                   # (b, hk*g, q, d)
    kh, vh = (t.double().permute(0, 2, 1, 3) for t in (k, v))
    expect = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True).permute(0, 2, 1, 3)
    assert (o.double() - expect).abs().max() < 1e-5
    # multi-query BSHD with ALiBi reads both h and q as indices; q is the one set against the keys
    alibi = text.replace("diagram rw", "diagram rw_alibi").replace("wire b, hk, g, q, x", "wire b, h, q, x") \
        .replace("in Q[b, q, (hk g), d]", "in Q[b, q, h, d]").replace("K[b, x, hk, d]", "K[b, x, d]") \
        .replace("V[b, x, hk, d]", "V[b, x, d]").replace("S[b, hk, g, q, x]", "S[b, h, q, x]") \
        .replace("where(x <= q, sum[d](Q * K) * |d|^-0.5, -inf)", "sum[d](Q * K) * |d|^-0.5 - 2^(-(h + 1)) * abs(q - x)") \
        .replace("O[b, q, (hk g), d]", "O[b, q, h, d]")
    assert set(compile_text(alibi, "rowwire_alibi")._BLOCKS) == {"q", "x"}


def test_non_contiguous_inputs_use_their_strides():
    m = example("causal")
    q = torch.randn(1, 45, 2, 64).transpose(1, 2)             # (b, h, q, d) view of (b, q, h, d)
    k = torch.randn(1, 2, 100, 64)[:, :, ::2]                  # every other key
    v = torch.randn(1, 2, 64, 50).transpose(2, 3)              # d-major storage
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    out = run(m, (q, k, v))
    assert_accurate(out, reference(m, (q, k, v), torch.float64), reference(m, (q, k, v)), "strided")
    contiguous = run(m, (q.contiguous(), k.contiguous(), v.contiguous()))
    assert all(torch.equal(a, b) for a, b in zip(out, contiguous))


def test_matmul_with_transposed_layout_and_batch():
    text = """diagram bmm
wire b, m, n, k
in A[b, k, m] : fp32
in B[n, k] : fp32
C[b, m, n] = relu(sum[k](A * B)) * 2 + 1
out C
schedule { level smem { group b by 1, m by 32, n by 32
stream k by 16 } }
"""
    m = compile_text(text, "bmm")
    check(m, {"b": 3, "m": 45, "n": 33, "k": 70}, torch.float32, label="bmm")
    check(m, {"b": 1, "m": 1, "n": 1, "k": 1}, torch.float16, label="bmm tiny")


# --------------------------------------------------------------------------
# Edges: large inputs, fully masked rows, NaN and inf.
# --------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["attention", "causal", "sigmoid_attention", "relu2_attention", "l2_attention"])
def test_inputs_scaled_by_100_do_not_overflow(name):
    """relu2 and l2: weights of no known bound (a ReLU² of scores near 10^4,
    10^8) rounded to float16 for the product with V were inf, the rows NaN;
    a power of two per row fits them now (codegen/weights.py)."""
    m = example(name)
    for dtype in (torch.float16, torch.float32):
        inputs = [t * 100 for t in m.example_inputs(sizes_for(name, 50, 60), dtype=dtype)]
        out = run(m, inputs)
        assert all(torch.isfinite(o).all() for o in out)
        assert_accurate(out, reference(m, inputs, torch.float64), reference(m, inputs), f"{name} x100")


def test_wide_output_from_16_bit_inputs_keeps_fp32_accuracy():
    """O declared fp32 with fp16 inputs: the weights multiplied with V are
    kept to ~22 bits (_SPLIT_WEIGHTS), so O is as accurate as an fp32
    reference of the same inputs, not limited by fp16 weights."""
    m = example("attention", ("O[b, h, q, d] : fp16", "O[b, h, q, d] : fp32"))
    inputs, (o, lse) = check(m, {"b": 1, "h": 2, "q": 40, "x": 70}, torch.float16, label="fp32 O")
    assert o.dtype == torch.float32
    m16 = example("attention")
    (o16, _) = run(m16, inputs)
    assert o16.dtype == torch.float16


def test_empty_wires():
    m = example("attention")
    q, k, v = m.example_inputs({"b": 1, "h": 2, "q": 5, "x": 1}, dtype=torch.float32)
    o, lse = run(m, (q, k[:, :, :0], v[:, :, :0]))  # no keys: O = 0, lse = -inf, as the reference says
    ro, rlse = reference(m, (q, k[:, :, :0], v[:, :, :0]))
    assert torch.equal(o, ro) and torch.equal(lse, rlse) and torch.isneginf(lse).all()
    assert run(m, (q[:, :, :0], k, v))[0].shape == (1, 2, 0, 64)


MASKED = """diagram masked
wire b, h, q, x
wire d = 16
in Q[b, h, q, d] : fp16
in K[b, h, x, d] : fp16
in V[b, h, x, d] : fp16
S[b, h, q, x] = where(x + 3 <= q and x + 20 > q, sum[d](Q * K) * |d|^-0.5, -inf)
O[b, h, q, d] : fp16 = sum[x](softmax[x](S) * V)
lse[b, h, q] = logsumexp[x](S)
out O, lse
schedule { level smem { group b by 1, h by 1, q by 32
stream x by 16 } }
"""


def test_fully_masked_rows_give_zero_and_lse_minus_inf():
    m = compile_text(MASKED, "masked")
    for dtype in (torch.float32, torch.float16):
        inputs, (o, lse) = check(m, {"b": 1, "h": 2, "q": 70, "x": 70}, dtype, label="masked")
        assert torch.equal(o[:, :, :3], torch.zeros_like(o[:, :, :3]))
        assert torch.isneginf(lse[:, :, :3]).all() and torch.isfinite(lse[:, :, 3:]).all()
        assert torch.isfinite(o).all()


@pytest.mark.filterwarnings("ignore:All-NaN slice encountered")
def test_nan_and_inf_propagate_as_in_the_reference():
    m = example("attention")
    q, k, v = m.example_inputs({"b": 1, "h": 2, "q": 40, "x": 40}, dtype=torch.float32)
    q[0, 0, 5, 3] = float("nan")   # one query row: its O row and lse are NaN
    v[0, 1, 7, 2] = float("nan")   # one value entry: a whole column of head 1 is NaN
    v[0, 0, 9, 1] = float("inf")   # one value entry: a column of +-inf
    out = run(m, (q, k, v))
    exact = reference(m, (q, k, v), torch.float64)
    assert torch.isnan(out[0][0, 0, 5]).all() and torch.isnan(out[1][0, 0, 5])
    assert torch.isnan(out[0][0, 1, :, 2]).all()
    assert_accurate(out, exact, reference(m, (q, k, v)), "nan/inf")


@pytest.mark.filterwarnings("ignore:invalid value encountered")
def test_a_plus_inf_score_gives_lse_plus_inf_as_the_reference():
    """Scores of +inf (a huge query against positive keys): softmax is NaN
    (inf - inf) in both, but the logsumexp is +inf, not NaN."""
    m = example("attention")
    q, k, v = m.example_inputs({"b": 1, "h": 2, "q": 40, "x": 40}, dtype=torch.float32)
    k[..., 0] = k[..., 0].abs() + 0.5
    q[0, 1, 6, 0] = float("inf")   # every score of that row: +inf
    out = run(m, (q, k, v))
    exact = reference(m, (q, k, v), torch.float64)
    assert torch.isinf(exact[1][0, 1, 6]) and exact[1][0, 1, 6] > 0
    assert torch.isinf(out[1][0, 1, 6]) and out[1][0, 1, 6] > 0
    assert_accurate(out, exact, reference(m, (q, k, v)), "+inf score")


# --------------------------------------------------------------------------
# Masks skip whole blocks: the kernel visits exactly visits.visited_blocks.
# --------------------------------------------------------------------------

def _blocks_loaded(m, inputs, tensor_index, block_x, reversed_rows=False, **opts):
    """(program row block, x block) pairs whose rows of one input were loaded;
    ``reversed_rows``: the kernel takes its row blocks heaviest first
    (masks.program_order), its program i owning block n - 1 - i."""
    import numpy as np
    from triton.runtime import interpreter

    t = inputs[tensor_index]
    start, row_bytes = t.data_ptr(), t.stride(2) * t.element_size()
    seen = set()
    original = interpreter.InterpreterBuilder.create_masked_load

    def spy(builder, ptrs, mask, other, *rest, **kw):
        addr = np.asarray(ptrs.data)[np.broadcast_to(np.asarray(mask.data, dtype=bool), ptrs.data.shape)]
        inside = addr[(addr >= start) & (addr < start + t.numel() * t.element_size())]
        for row in {int(a - start) // row_bytes for a in inside}:
            pid = program_block(builder, reversed_rows)
            seen.add((pid, row // block_x))
        return original(builder, ptrs, mask, other, *rest, **kw)

    interpreter.InterpreterBuilder.create_masked_load = spy
    try:
        run(m, inputs, block_x=block_x, **opts)
    finally:
        interpreter.InterpreterBuilder.create_masked_load = original
    return seen


@pytest.mark.parametrize("name, replace", [("causal", None), ("sliding_window", ("q - x < 256", "q - x < 40")),
                                           ("sliding_window", ("q - x < 256", "x // 24 == q // 24")),
                                           ("sliding_window", ("x <= q and q - x < 256", "x // 24 <= q // 24")),
                                           ("relu2_attention", None), ("masked", None)])
def test_kernel_visits_exactly_the_blocks_masks_lists(name, replace):
    m = compile_text(MASKED, "masked") if name == "masked" else example(name, *([replace] if replace else []))
    text = MASKED if name == "masked" else (REPO / "examples" / f"{name}.ncd").read_text()
    if replace:
        text = text.replace(*replace)
    diagram = napkin.load_text(text)
    sizes = {"b": 1, "h": 1, "q": 100, "x": 90}
    inputs = m.example_inputs(sizes, dtype=torch.float32)
    loaded = _blocks_loaded(m, inputs, 1, 16, heaviest_first(lower.lower(diagram).bounds)[0], block_q=32)
    expected = set(visited_blocks(diagram, sizes, 32, 16))
    assert loaded == expected
    every = {(i, j) for i in range(4) for j in range(6)}
    assert expected < every  # something was skipped
    # and nothing needed was skipped: each unmasked (q, x) pair's block is visited
    pred = lower.lower(diagram).skip
    needed = {(i, j) for i in range(4) for j in range(6)
              if masks.classify_block(pred, {"q": (32 * i, min(32 * i + 32, 100)),
                                             "x": (16 * j, min(16 * j + 16, 90))}, sizes) != masks.BlockClass.EMPTY}
    assert needed <= expected


def test_loads_discipline_in_bytes():
    """Each program loads its Q tile once, K and V once per visited step, and
    stores each output tile once: for unmasked attention every (b, h) reads
    all of K and V once per block of queries, and Q, O, lse move once."""
    from napkin.bytecount import ByteCounter

    m = example("attention")
    q, k, v = m.example_inputs({"b": 2, "h": 2, "q": 70, "x": 50}, dtype=torch.float16)
    with ByteCounter(tensors={"Q": q, "K": k, "V": v}) as counted:
        o, lse = run(m, (q, k, v))
    blocks = -(-70 // FAST["block_q"])
    assert counted.loads["Q"] == q.numel() * 2
    assert counted.loads["K"] == counted.loads["V"] == blocks * k.numel() * 2
    assert counted.store_bytes == o.numel() * 2 + lse.numel() * 4
    assert set(counted.loads) == {"Q", "K", "V"}
