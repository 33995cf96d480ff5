"""Generated kernels of diagrams no example holds, against the float64
reference (test_kernels.py's accuracy rule) or torch in float64: random
diagrams drawn by tests/strategies.py, and forms a bug hunt found wrong
(rare powers, relabels, index arithmetic past int32, int64 offsets).
"""
from __future__ import annotations

import functools
import zlib

import pytest
import torch
from hypothesis import given

import kernel_helpers as kh
import napkin
from kernel_helpers import FAST, REPO, SETTINGS, assert_accurate, compile_text, example, reference, run
from napkin.printer import to_text
from strategies import attention_diagrams, drawn_sizes, matmul_diagrams


@pytest.fixture(scope="module", autouse=True)
def _folder(tmp_path_factory):
    kh._FOLDER.append(tmp_path_factory.mktemp("kernel_forms"))
    yield
    kh._FOLDER.pop()


# --------------------------------------------------------------------------
# Random diagrams (tests/strategies.py): kernel against reference.
# --------------------------------------------------------------------------

def _drawn_check(diagram, key: str):
    m = compile_text(to_text(diagram), key, diagram)
    sizes = drawn_sizes(diagram, zlib.crc32(key.encode()))
    dtype = {"fp16": torch.float16, "fp32": torch.float32}[diagram.inputs[0].dtype]
    inputs = m.example_inputs(sizes, dtype=dtype, seed=1)
    out = run(m, inputs, **{k: None for k in FAST})  # the drawn schedule's own blocks (16..64)
    assert_accurate(out, reference(m, inputs, torch.float64), reference(m, inputs), to_text(diagram))


@SETTINGS
@given(diagram=attention_diagrams())
def test_random_attention_diagrams(diagram):
    _drawn_check(diagram, f"drawn_{zlib.crc32(to_text(diagram).encode())}")


@SETTINGS
@given(diagram=matmul_diagrams())
def test_random_matmul_diagrams(diagram):
    _drawn_check(diagram, f"drawn_{zlib.crc32(to_text(diagram).encode())}")


# --------------------------------------------------------------------------
# Forms a bug hunt found wrong (2026-11-26), each against
# torch in float64, written here from the diagram's math.
# --------------------------------------------------------------------------

MATMUL_FORM = """diagram {name}
wire m, n, k
in A[m, k] : fp32
{more}
C[m, n] : fp32 = {expr}
out C
"""

RARE_ATTENTION = """diagram rare
wire b, h, q, x
wire d = 16
in Q[b, h, q, d] : fp32
in K[b, h, x, d] : fp32
in V[b, h, x, d] : fp32
S[b, h, q, x] = sum[d](Q * K) * |d|^-0.5 + where(x > q, (x - q) ^ -1, (x - q) ^ 9 / 10 ^ 14)
O[b, h, q, d] = sum[x](softmax[x](S) * V) - sum[x](V) / |x|
out O
schedule { level smem { group b by 1, h by 1, q by 16
stream x by 16 } }
"""


def test_rarely_used_forms_match_torch():
    """A whole power past 8 of a negative base was NaN (exp2(n log2 b));
    a wire only a relabel reaches (A[n, k] of A[m, k]) was a KeyError at
    the call; an unweighted sum[x](V) beside an attention rendered a tile
    of None; the reference raised an index to a negative power in integers."""
    g = torch.Generator().manual_seed(11)
    a, b = torch.randn(20, 37, generator=g) * 0.3, torch.randn(37, 21, generator=g) * 0.3
    power = compile_text(MATMUL_FORM.format(name="pow9", more="in B[k, n] : fp32", expr="sum[k](A * B) ^ 9"),
                         "pow9")
    want = (a.double() @ b.double()) ** 9
    assert (want < 0).sum() > 100
    (c,) = run(power, [a, b])
    assert torch.allclose(c.double(), want, rtol=1e-4, atol=1e-9)
    gram = compile_text(MATMUL_FORM.format(name="gram", more="", expr="sum[k](A * A[n, k])"), "gram")
    (c,) = run(gram, [a])
    assert c.shape == (20, 20) and torch.allclose(c.double(), a.double() @ a.double().T, atol=1e-5)

    m = compile_text(RARE_ATTENTION, "rare")
    q_, k_, v_ = (torch.randn(1, 2, n, 16, generator=g) for n in (37, 29, 29))
    qi, xi = torch.arange(37.0, dtype=torch.float64)[:, None], torch.arange(29.0, dtype=torch.float64)[None, :]
    bias = torch.where(xi > qi, 1 / (xi - qi), (xi - qi) ** 9 / 1e14)
    s = q_.double() @ k_.double().transpose(-1, -2) / 4 + bias
    want = torch.softmax(s, -1) @ v_.double() - v_.double().sum(-2, keepdim=True) / 29
    (o,) = run(m, [q_, k_, v_])
    assert torch.allclose(o.double(), want, atol=1e-5)
    (r,) = reference(m, [q_, k_, v_], torch.float64)
    assert torch.allclose(r, want, atol=1e-10)


@pytest.mark.parametrize("box, torch64", [
    # an index exponent: whole per element, odd or even; a negative base was NaN (exp2(e log2 b))
    ("sum[k](A * B) ^ (n + 1)", lambda p, m, n, k: p ** (n + 1)),
    ("sum[k](A * B) ^ |k|", lambda p, m, n, k: p ** k),
    ("sum[k](A * B) ^ (n - 2)", lambda p, m, n, k: p ** (n - 2)),
    # an integer tensor to an integer power in the reference: 2 ** (m - n) was 0 where m < n
    ("sum[k](A * B) + 2 ^ (m - n)", lambda p, m, n, k: p + 2.0 ** (m - n)),
])
def test_powers_with_exponents_known_at_run_time(box, torch64):
    text = f"diagram rpow\nwire m, n, k\nin A[m, k] : fp32\nin B[k, n] : fp32\nC[m, n] = {box}\nout C\n"
    m = compile_text(text, f"rpow_{zlib.crc32(box.encode())}")
    g = torch.Generator().manual_seed(8)
    a, b = torch.randn(5, 3, generator=g), torch.randn(3, 7, generator=g)
    p = a.double() @ b.double()
    mi, ni = torch.arange(5, dtype=torch.float64)[:, None], torch.arange(7, dtype=torch.float64)[None, :]
    want = torch64(p, mi, ni, 3)
    assert (p < 0).any() and want.isfinite().all()
    for got in (m.rpow(a, b, block_m=16, block_n=16, block_k=16), m.reference(a.double(), b.double())):
        assert not got.isnan().any()
        assert ((got.double() - want).abs() / want.abs().clamp(min=1)).max() < 1e-4, box


@pytest.mark.parametrize("mask", ["not x > q", "not (q < x or q - x >= 20)"])
def test_a_written_not_skips_the_blocks_of_its_flipped_comparison(mask):
    """where(not x > q, s, -inf) keeps what x <= q keeps; it visited every block (the cost pass) and
    found its blocks with a ranges prepass at each launch (the kernel).  The kernel now has the affine
    bounds of the flipped mask, no prepass, and the cost pass counts the causal pairs."""
    from napkin.cost import analyse

    flipped = {"not x > q": "x <= q", "not (q < x or q - x >= 20)": "x <= q and q - x < 20"}[mask]
    text = (REPO / "examples" / "causal.ncd").read_text().replace("wire d = 64", "wire d = 16")
    mine, plain = (text.replace("where(x <= q, ", f"where({m}, ") for m in (mask, flipped))
    m = compile_text(mine, f"not_{zlib.crc32(mask.encode())}")
    assert not hasattr(m, "_causal_ranges")
    q, k, v = m.example_inputs({"b": 1, "h": 2, "q": 45, "x": 45}, dtype=torch.float32)
    got = m.causal(q, k, v, block_q=16, block_x=16)
    want = m.reference(q.double(), k.double(), v.double())
    assert all((a.double() - b).abs().max() < 2e-5 for a, b in zip(got, want))
    sizes = {"b": 1, "h": 1, "q": 4096, "x": 4096}
    visited = [analyse(napkin.load_text(t), sizes).flops.skipped_fraction for t in (mine, plain)]
    assert visited[0] == visited[1] and visited[0] > 0.4


@pytest.mark.parametrize("score, torch64", [
    # a distance penalty: (x - q)^3 passes 2^31 at a distance of 1291 (int32 wrapped: the forward off by
    # 0.04 of 0.03 at (x - q)^2 and 50,000 keys)
    ("sum[d](Q * K) * |d|^-0.5 - (x - q) ^ 3 / 1000000000",
     lambda s, q, x, n: s * 0.25 - (x - q) ** 3 / 1e9),
    # a size product in the exponent's scale: |x|^3 wrapped negative (every output NaN)
    ("sum[d](Q * K) * (|x| * |x| * |x|) / 3000000000", lambda s, q, x, n: s * n ** 3 / 3e9),
    # a mask of index products, found by the ranges prepass: both sides wrapped and kept keys it drops
    ("where(x * x * x <= (q + 1) * 200000000, sum[d](Q * K) * |d|^-0.5, -inf)",
     lambda s, q, x, n: torch.where(x ** 3 <= (q + 1) * 200000000, s * 0.25, -torch.inf)),
    # literals past int32: Triton refused 4294967296 beside an int32 index, and a bound's
    # 99999999999999999998 in the block range ("Nonrepresentable integer")
    ("where(x * 3000000 <= 4294967296, sum[d](Q * K) * |d|^-0.5, -inf)",
     lambda s, q, x, n: torch.where(x * 3000000 <= 4294967296, s * 0.25, -torch.inf)),
    ("where(q - x < 99999999999999999999 and x - q < 4294967296, sum[d](Q * K) * |d|^-0.5, -inf)",
     lambda s, q, x, n: s * 0.25 + 0 * x),
    # near 2^31: the bound's 2147483647 overflowed the block range's int32 sums (_row_last + c + 1),
    # and q + 2147483646, or constants each under 2^31 adding past it, the mask's own
    ("where(q - x < 2147483648 and x <= q + 2147483646, sum[d](Q * K) * |d|^-0.5, -inf)",
     lambda s, q, x, n: s * 0.25 + 0 * x),
    ("where(x <= q + 1500000000 + 1500000000 - 2999999000, sum[d](Q * K) * |d|^-0.5, -inf)",
     lambda s, q, x, n: torch.where(x <= q + 1000, s * 0.25, -torch.inf)),
])
def test_index_and_size_products_past_int32_are_exact(score, torch64):
    """The kernels' indices and sizes are int32; a product of two of them is
    taken in int64 (tl.cast), as the reference's torch indices are.  1,500
    keys, 16 rows: forward and every gradient against float64 autograd."""
    text = ("diagram wide\nwire b, h, q, x\nwire d = 16\nin Q[b, h, q, d] : fp32\nin K[b, h, x, d] : fp32\n"
            f"in V[b, h, x, d] : fp32\nS[b, h, q, x] = {score}\nO[b, h, q, d] : fp32 = sum[x](softmax[x](S) * V)\n"
            "out O\nschedule on h100 {\n  accumulate fp32\n  level smem {\n    group b by 1, h by 1, q by 16\n"
            "    stream x by 64\n  }\n}\n")
    m = compile_text(text, f"wide_{zlib.crc32(score.encode())}")
    g = torch.Generator().manual_seed(11)
    n = 1500
    q, k, v = (torch.randn(1, 1, rows, 16, generator=g) for rows in (16, n, n))
    qi, xi = torch.arange(16)[:, None], torch.arange(n)[None, :]

    def formula(q, k, v):
        s = torch64(torch.einsum("bhqd,bhxd->bhqx", q, k), qi, xi, n)
        return torch.softmax(s, -1) @ v

    ours = [t.clone().requires_grad_() for t in (q, k, v)]
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    got, want = m.wide(*ours), formula(*exact)
    dout = torch.randn(got.shape, generator=g)
    got.backward(dout)
    want.backward(dout.double())
    assert (got.double() - want).abs().max() < 1e-5 * want.abs().max()
    for a, b in zip(ours, exact):
        assert (a.grad.double() - b.grad).abs().max() < 1e-4 * b.grad.abs().max().clamp(min=1e-3)


@pytest.mark.parametrize("term, torch64", [
    ("(n - m) ^ 3 / 1000", lambda m, n: (n - m) ** 3 / 1000),
    ("(n - m) * 0.1", lambda m, n: (n - m) * 0.1),
    ("sqrt(abs(n - m))", lambda m, n: (n - m).abs().sqrt()),
    ("where(n <= m, (n - m) * 0.3, 0.5)", lambda m, n: torch.where(n <= m, (n - m) * 0.3, 0.5)),
])
def test_a_float64_reference_takes_index_arithmetic_in_float64(term, torch64):
    """torch takes an integer tensor met only by Python floats (or a function)
    to its default dtype, float32: the float64 reference computed these terms
    in float32 (a relative error of 1e-8, where the reference is the truth
    the kernels are held to)."""
    text = f"diagram idxref\nwire m, n, k\nin A[m, k] : fp32\nin B[k, n] : fp32\nC[m, n] = sum[k](A * B) + {term}\nout C\n"
    m = compile_text(text, f"idxref_{zlib.crc32(term.encode())}")
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(37, 3, generator=g, dtype=torch.float64), torch.randn(3, 41, generator=g, dtype=torch.float64)
    mi, ni = torch.arange(37, dtype=torch.float64)[:, None], torch.arange(41, dtype=torch.float64)[None, :]
    got = m.reference(a, b)
    assert got.dtype == torch.float64
    assert (got - (a @ b + torch64(mi, ni))).abs().max() < 1e-12


def test_the_reference_takes_torchs_values_for_a_sizes_terms_at_the_edges():
    """sigmoid attention's - log(|x|) at x = 0 raised 'math domain error' in the reference (math.log),
    where the kernel gives zeros: size terms go through torch's functions now (log(0) = -inf)."""
    m = example("sigmoid_attention")
    q, k, v = m.example_inputs({"b": 1, "h": 2, "q": 5, "x": 0}, dtype=torch.float32)
    assert torch.equal(m.reference(q, k, v), torch.zeros(1, 2, 5, 64))
    assert torch.equal(run(m, [q, k, v])[0], torch.zeros(1, 2, 5, 64))


ROW_EXTREMES = """diagram rowext
wire b, h, q, x
wire d = 16
in Q[b, h, q, d] : fp32
in K[b, h, x, d] : fp32
in V[b, h, x, d] : fp32
S[b, h, q, x] = sum[d](Q * K) * |d|^-0.5
O[b, h, q, d] = sum[x](softmax[x](S) * V)
mx[b, h, q] = max[x](S)
mn[b, h, q] = min[x](S)
out O, mx, mn
"""


@pytest.mark.parametrize("keys", [0, 37])
def test_the_reference_takes_max_and_min_along_no_keys_as_the_kernel_does(keys):
    """max[x] and min[x] outputs at x = 0: the kernel gives -inf and inf, the
    reference raised torch's 'amax(): Expected reduction dim 3 to have
    non-zero size' (helper's hunt).  At 37 keys both are the float64 truth."""
    m = compile_text(ROW_EXTREMES, "rowext")
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g, dtype=torch.float64) for n in (5, keys, keys))
    s = q @ k.transpose(-1, -2) / 4
    o, mx, mn = m.reference(q, k, v)
    if keys == 0:
        assert torch.equal(mx, torch.full((1, 2, 5), float("-inf"), dtype=torch.float64))
        assert torch.equal(mn, torch.full((1, 2, 5), float("inf"), dtype=torch.float64))
        assert torch.equal(o, torch.zeros(1, 2, 5, 16, dtype=torch.float64))
    else:
        assert torch.allclose(mx, s.amax(-1), rtol=0, atol=1e-12) and torch.allclose(mn, s.amin(-1), rtol=0, atol=1e-12)
        assert torch.allclose(o, torch.softmax(s, -1) @ v, rtol=0, atol=1e-12)
    got = run(m, [t.float() for t in (q, k, v)])
    for a, b in zip(got, (o, mx, mn)):
        assert torch.allclose(a.double(), b, rtol=1e-5, atol=1e-5, equal_nan=False), (a, b)


def _spread(rows: int, stride: int, cols: int, dtype, gen):
    """rows x cols of random values, rows ``stride`` elements apart in one
    allocation that is mostly never touched (Linux commits only the pages
    written); None when the system refuses the address space."""
    try:
        big = torch.empty(rows * stride + cols, dtype=dtype)
    except (RuntimeError, MemoryError):
        return None
    t = big.as_strided((rows, cols), (stride, 1))
    t.copy_(torch.randn(rows, cols, generator=gen).to(dtype))
    return t


def test_a_contiguous_tensors_span_is_its_element_count_less_one():
    """_int64_offsets takes a contiguous tensor's span from numel alone (a
    fast path: it runs for every launch): 2^31 elements span 2^31 - 1 and stay
    int32, one more needs int64; a strided view still sums its dimensions.
    Meta tensors: the sizes without the memory."""
    m = example("matmul")
    meta = functools.partial(torch.empty, device="meta")
    assert not m._int64_offsets(meta(1 << 31), meta(0), None)
    assert m._int64_offsets(meta((1 << 31) + 1))
    assert m._int64_offsets(meta(1 << 30, 4)[:, 0])                 # 2^30 rows of stride 4: span 2^32 - 4
    assert not m._int64_offsets(meta(1 << 29, 4)[:, 0])             # span 2^31 - 4
    assert m._int64_offsets(meta(1 << 16, 1 << 16).t())               # transposed: the same 2^32 - 1


@pytest.mark.parametrize("rows", [64, 65])
def test_element_offsets_past_2_31_index_in_int64(rows):
    """A row stride of 2^25 puts row 64 at element 2^31: the kernels' int32
    row offset times the int32 stride wrapped negative and read outside the
    tensor (the interpreter died of SIGSEGV; helper's hunt).  The launcher
    sees the span and sets _INT64; at 64 rows it stays off.  Matmul's A and
    attention's Q, against float64."""
    gen = torch.Generator().manual_seed(29)
    a = _spread(rows, 1 << 25, 16, torch.float16, gen)
    if a is None:
        pytest.skip("this machine refuses 4 GiB of address space")
    m = example("matmul")
    assert m._int64_offsets(a) == (rows > 64)
    b = torch.randn(16, 24, generator=gen).half()
    got = m.matmul(a, b, block_m=16, block_n=16, block_k=16)
    assert (got.double() - a.double() @ b.double()).abs().max() < 2e-2
    att = example("attention", ("wire d = 64", "wire d = 16"))
    q = _spread(rows, 1 << 25, 16, torch.float16, gen).view(1, 1, rows, 16)
    k, v = (torch.randn(1, 1, 40, 16, generator=gen).half() for _ in range(2))
    o, lse = att.attention(q, k, v, block_q=16, block_x=16)
    s = q.double() @ k.double().transpose(-1, -2) / 4
    assert (o.double() - torch.softmax(s, -1) @ v.double()).abs().max() < 2e-3
    assert (lse.double() - torch.logsumexp(s, -1)).abs().max() < 1e-4


def test_the_int64_path_gives_the_int32_paths_numbers(monkeypatch):
    """Every kernel with _INT64 forced on (forward, the three backward
    kernels, the matmul's gradients) on small inputs: the wide path compiles
    and agrees bit for bit with the narrow one."""
    gen = torch.Generator().manual_seed(31)
    att = example("causal", ("wire d = 64", "wire d = 16"))
    mm = example("matmul")
    q, k, v = (torch.randn(1, 2, n, 16, generator=gen) for n in (37, 53, 53))
    a, b = torch.randn(21, 19, generator=gen), torch.randn(19, 23, generator=gen)

    def results():
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        outs = att.causal(*xs, block_q=16, block_x=16)
        sum((o * torch.linspace(-1, 1, o.numel()).view(o.shape)).sum() for o in outs).backward()
        ys = [t.clone().requires_grad_() for t in (a, b)]
        c = mm.matmul(*ys, block_m=16, block_n=16, block_k=16)
        (c * torch.linspace(-1, 1, c.numel()).view(c.shape)).sum().backward()
        return [o.detach() for o in outs] + [x.grad for x in xs] + [c.detach()] + [y.grad for y in ys]

    narrow = results()
    asked = []
    for m in (att, mm):
        monkeypatch.setattr(m, "_int64_offsets", lambda *tensors: asked.append(len(tensors)) or True)
    monkeypatch.setattr(att, "_LAUNCH_PLANS", {})   # the forward's plan holds the narrow call's _INT64
    wide = results()
    assert len(asked) >= 7   # causal: forward, rows, dK/dV, dQ; matmul: forward, dA, dB
    for n, w in zip(narrow, wide):
        assert torch.equal(n, w)


@pytest.mark.parametrize("keys", [3, 9])
def test_a_condition_of_sizes_alone_in_the_reference(keys):
    """where(|x| > 3, s, -inf): the reference gave torch.where a Python bool
    (TypeError, which stopped napkin bench's check; helper's hunt)."""
    m = example("attention", ("wire d = 64", "wire d = 16"),
                ("sum[d](Q * K) * |d|^-0.5", "where(|x| > 3, sum[d](Q * K) * |d|^-0.5, -inf)"))
    g = torch.Generator().manual_seed(37)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g, dtype=torch.float64) for n in (5, keys, keys))
    o, lse = m.reference(q, k, v)
    s = q @ k.transpose(-1, -2) / 4
    if keys > 3:
        assert (o - torch.softmax(s, -1) @ v).abs().max() < 1e-12 and (lse - torch.logsumexp(s, -1)).abs().max() < 1e-12
    else:
        assert torch.equal(o, torch.zeros_like(o)) and torch.equal(lse, torch.full_like(lse, float("-inf")))
    got = run(m, [t.float() for t in (q, k, v)])
    assert (got[0].double() - o).abs().max() < 1e-5


def test_and_or_of_a_per_head_scalars_comparison_with_a_tile():
    """``t > 0`` of a per-head side input ``t[h]`` is a scalar in the kernel; ``&`` of it and a
    tile failed in Triton's interpreter (its comparison keeps t's fp32 type, broadcast to
    float: TypeError in numpy's bitwise_and), so every such diagram failed on the CPU.  Heads
    with t > 0 are causal, the others keep a window of 4 keys; `not` and `or` too."""
    text = """diagram headwise
wire b, h, q, x
wire d = 16
in Q[b, h, q, d] : fp32
in K[b, h, x, d] : fp32
in V[b, h, x, d] : fp32
in t[h] : fp32
S[b, h, q, x] = where(x <= q and t > 0 or x <= q and q - x < 4 and not t > 0, sum[d](Q * K) * |d|^-0.5, -inf)
O[b, h, q, d] : fp32 = sum[x](softmax[x](S) * V)
out O
"""
    m = compile_text(text, "headwise")
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 3, 37, 16, generator=g) for _ in range(3))
    t = torch.tensor([0.5, -1.0, 2.0])
    ours = [a.clone().requires_grad_() for a in (q, k, v)]
    exact = [a.double().requires_grad_() for a in (q, k, v)]
    out, = run(m, (*ours, t))
    i, j = torch.arange(37)[:, None], torch.arange(37)[None, :]
    keep = torch.where((t > 0)[:, None, None], j <= i, (j <= i) & (i - j < 4))
    s = (exact[0] @ exact[1].transpose(-1, -2) * 0.25).masked_fill(~keep, float("-inf"))
    want = torch.softmax(s, -1) @ exact[2]
    assert (out.double() - want).abs().max() < 1e-5
    grad = torch.randn(out.shape, generator=g)
    out.backward(grad)
    want.backward(grad.double())
    for a, b in zip(ours, exact):
        assert (a.grad.double() - b.grad).abs().max() < 1e-4 * (1 + b.grad.abs().max())


def test_functions_of_a_16_bit_input_are_taken_in_float32():
    """exp(T) of an fp16 per-head T[h] failed to compile: Triton's exp, log, sqrt, tanh's and
    sigmoid's exp take fp32 and fp64 alone ("Expected dtype ['fp32', 'fp64'] but got fp16";
    novel2 hunt), in the score and in an epilogue alike, and so did a fractional power of one.
    The kernels widen such a read first; forward and gradients against float64."""
    head = """wire b, h, q, x
wire d = 16
in Q[b, h, q, d] : fp16
in K[b, h, x, d] : fp16
in V[b, h, x, d] : fp16
in T[h] : fp16
"""
    score = "S[b, h, q, x] = where(x <= q, sum[d](Q * K) * exp(T) + log(abs(T) + 1) * sqrt(abs(T)), -inf)\n"
    scored = compile_text("diagram wide16\n" + head + score
                          + "O[b, h, q, d] : fp16 = sum[x](softmax[x](S) * V)\nout O\n", "wide16")
    gated = compile_text("diagram gated16\n" + head + "in G[b, h, q, d] : fp16\n" + score
                         + "O[b, h, q, d] : fp16 = sum[x](softmax[x](S) * V) * sigmoid(G) + tanh(G) * abs(G)^0.5\n"
                         + "out O\n", "gated16")
    g = torch.Generator().manual_seed(5)
    q, k, v, gate = (torch.randn(1, 2, 37, 16, generator=g).half() for _ in range(4))
    t = torch.tensor([0.3, -0.7]).half()
    ours = [a.clone().requires_grad_() for a in (q, k, v, t)]
    exact = [a.double().requires_grad_() for a in (q, k, v, t, gate)]
    Q, K, V, T, G = exact
    T4 = T[None, :, None, None]
    s = Q @ K.transpose(-1, -2) * T4.exp() + (T4.abs() + 1).log() * T4.abs().sqrt()
    keep = torch.arange(37)[None, :] <= torch.arange(37)[:, None]
    want = torch.softmax(s.masked_fill(~keep, float("-inf")), -1) @ V
    out, = run(scored, ours)
    assert (out.double() - want).abs().max() < 4e-3
    # the reference takes them as written, in float64
    assert (reference(scored, (q, k, v, t), torch.float64)[0] - want).abs().max() < 1e-12
    more, = run(gated, (q, k, v, t, gate))
    assert (more.double() - (want * G.sigmoid() + G.tanh() * G.abs() ** 0.5)).abs().max() < 4e-3
    grad = torch.randn(out.shape, generator=g).half()
    out.backward(grad)
    want.backward(grad.double())
    for a, b in zip(ours, exact):
        assert (a.grad.double() - b.grad).abs().max() < 2e-2 * (1 + b.grad.abs().max())
