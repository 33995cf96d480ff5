"""Scalar inputs: ``in t : fp32``, one number broadcast along every wire it
meets (docs/language.md, "Inputs and dtypes").

Checked here:

* the language: a scalar parses, prints back, reads by its name, and what it
  cannot be (``t[]``, ``t[q]``, a box of no wire) is refused where written;
* numerics: a learned temperature and a window's width read at run time,
  forward against float64 torch and torch's SDPA (given the mask and the
  temperature as its scale), on ragged sizes, fp32 and fp16; the gradients,
  the temperature's included, by tests/test_backward.py's rule; one compiled
  module at several widths (the whole width is causal attention);
* a bool scalar switches a mask (causal or not, against SDPA), a scalar
  soft-cap and a matmul's scalar epilogue train;
* the launcher takes a Python number for a scalar (kept one tensor per
  value, so mask_cache= keeps a width's ranges where a prepass finds them:
  the window and sinks of SINKS; the window alone has its loops bounded by
  w, no prepass, and leaves the dict empty) and names a scalar's shape and
  type in its refusals;
* the cost pass counts a scalar's loads as the kernels make them
  (ByteCounter), and prices a width given with ``--lengths`` as the same
  width written in the diagram;
* the picture draws a scalar with its line into the box; FlexAttention's
  score_mod and mask_mod read it.
The distributed wrappers pass a scalar whole (tests/test_distributed.py's
"temperature" cases).
"""
from __future__ import annotations

import math

import pytest
import torch

import napkin
import backward_helpers as B
import kernel_helpers as K
from cost_helpers import predicted_bytes, without_tensors
from napkin.bytecount import ByteCounter
from napkin.errors import NapkinError


@pytest.fixture(scope="module", autouse=True)
def _folder(tmp_path_factory):
    K._FOLDER.append(tmp_path_factory.mktemp("scalars"))
    yield
    K._FOLDER.pop()


SCALARS = """diagram scalars

wire b, h, q, x
wire d = 16

in Q[b, h, q, d] : fp32
in K[b, h, x, d] : fp32
in V[b, h, x, d] : fp32
in t : fp32
in w : int32

S[b, h, q, x] = where(x <= q and q - x < w, sum[d](Q * K) * t, -inf)
O[b, h, q, d] : fp32 = sum[x](softmax[x](S) * V)
out O

schedule on h100 {
  accumulate fp32
  level hbm { hold Q, K, V, t, w, O }
  level smem {
    group b by 1, h by 1, q by 32
    stream x by 16
    hold S
  }
}
"""
# StreamingLLM's window beside its sink tokens: w in an ``or``, so a ranges prepass finds the blocks
SINKS = SCALARS.replace("x <= q and q - x < w", "x <= q and (q - x < w or x < 4)").replace("diagram scalars",
                                                                                       "diagram sinks")


def _error(text: str) -> str:
    with pytest.raises(NapkinError) as err:
        napkin.load_text(text, "t.ncd")
    return str(err.value)


def _inputs(n: int, dtype, seed: int, t: float = 0.3, w: int = 7):
    gen = torch.Generator().manual_seed(seed)
    Q, Kt, V = (torch.randn(2, 2, n, 16, generator=gen).to(dtype) for _ in range(3))
    # t shares the fp32 class with Q, K and V: it follows their dtype
    return [Q, Kt, V, torch.tensor(t, dtype=dtype), torch.tensor(w, dtype=torch.int32)]


def _sdpa(Q, Kt, V, t, w):
    """torch's SDPA in float64 given the window as a boolean mask and the temperature as its scale."""
    n_q, n_x = Q.shape[2], Kt.shape[2]
    q, x = torch.arange(n_q)[:, None], torch.arange(n_x)[None, :]
    mask = (x <= q) & (q - x < int(w))
    return torch.nn.functional.scaled_dot_product_attention(Q.double(), Kt.double(), V.double(), attn_mask=mask,
                                                            scale=float(t))


# --------------------------------------------------------------------------
# The language.
# --------------------------------------------------------------------------

def test_a_scalar_input_parses_prints_back_and_reads_by_name():
    from napkin import ir
    from napkin.printer import to_text

    d = napkin.load_text(SCALARS, "scalars.ncd")
    assert [(t.name, t.axes, t.dtype) for t in d.inputs][3:] == [("t", (), "fp32"), ("w", (), "int32")]
    refs = {n.name: n for n in ir.walk(d.lets[0].expr) if isinstance(n, ir.TensorRef)}
    assert refs["t"].wires is None and refs["w"].wires is None
    text = to_text(d)
    assert "in t : fp32\nin w : int32\n" in text
    again = napkin.load_text(text, "again.ncd")
    assert again.inputs == d.inputs and again.lets == d.lets
    assert ir.length_inputs(d) == (("w", "q"),)   # compared with an index it is not read along


@pytest.mark.parametrize("old, new, message", [
    ("in t : fp32", "in t[] : fp32",
     "t.ncd:9:6: unexpected ']'\n    in t[] : fp32\n         ^\n"
     "  hint: a scalar input is written without brackets: in t : fp32"),
    ("sum[d](Q * K) * t,", "sum[d](Q * K) * t[q],",
     "t.ncd:12:61: t[q] reads t along wires, but t is a scalar (declared along none)"),
    ("sum[d](Q * K) * t,", "sum[d](Q * K) * t[],",
     "t.ncd:12:63: unexpected ']'"),
    ("out O", "Y[] = t * 2\nout O",
     "t.ncd:14:3: unexpected ']'\n    Y[] = t * 2\n      ^\n"
     "  hint: expected '(' or a name: a box holds one wire at least; only an input may be a scalar (in t : fp32)"),
])
def test_what_a_scalar_cannot_be_is_refused_where_it_is_written(old, new, message):
    assert old in SCALARS
    got = _error(SCALARS.replace(old, new))
    assert got.startswith(message), got
    if "t[]," in new:
        assert got.endswith("hint: a scalar is read by its name alone, without brackets"), got
    if "t[q]" in new:
        assert got.endswith("hint: write t alone"), got


# --------------------------------------------------------------------------
# Numerics.
# --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n", [45, 64])
def test_a_temperature_and_a_width_read_at_run_time_match_float64_and_sdpa(dtype, n):
    m = K.compile_text(SCALARS, "scalars")
    inputs = _inputs(n, dtype, seed=n)
    out = K.run(m, inputs)
    K.assert_accurate(out, K.reference(m, inputs, torch.float64), K.reference(m, inputs), f"scalars {n}")
    sdpa = _sdpa(*inputs)
    assert (out[0].double() - sdpa).abs().max() <= (2e-2 if dtype == torch.float16 else 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_gradients_reach_the_temperature(dtype):
    """dt adds up every (b, h, q) row of dS: the rule's floor widened by the root of those rows
    (tests/backward_helpers.py); the width, an integer, has none."""
    m = K.compile_text(SCALARS, "scalars")
    inputs = _inputs(45, dtype, seed=5)
    got = B.gradients(m.scalars, inputs, **{k: v for k, v in K.FAST.items() if k in ("block_q", "block_x")})
    exact = B.gradients(m.reference, [t.double() if t.is_floating_point() else t for t in inputs])
    same = B.gradients(m.reference, inputs)
    assert got[3].shape == () and got[4] is None and exact[3] != 0
    B.assert_accurate(got[:4], exact[:4], same[:4], "scalars", dtype, rows=[1, 1, 1, 2 * 2 * 45])


def test_one_compiled_module_serves_every_width():
    """The width is data: the same module at 1 (each query its own key: O = V), a few keys, and the
    whole sequence (causal attention, as SDPA's is_causal computes it)."""
    m = K.compile_text(SCALARS, "scalars")
    n = 37
    for w in (1, 5, n):
        inputs = _inputs(n, torch.float32, seed=w, w=w)
        out, = K.run(m, inputs)
        assert (out.double() - _sdpa(*inputs)).abs().max() < 1e-5, w
        if w == 1:
            assert torch.allclose(out, inputs[2], atol=1e-6)
        if w == n:
            causal = torch.nn.functional.scaled_dot_product_attention(*(t.double() for t in inputs[:3]),
                                                                      is_causal=True, scale=0.3)
            assert (out.double() - causal).abs().max() < 1e-5


def test_the_launcher_names_a_scalars_shape_and_type():
    m = K.compile_text(SCALARS, "scalars")
    Q, Kt, V, t, w = _inputs(20, torch.float32, seed=1)
    with pytest.raises(ValueError, match=r"^t must have 0 dimensions \(a scalar\), but has 1 \(shape \(1,\)\)$"):
        m.scalars(Q, Kt, V, t.reshape(1), w)
    with pytest.raises(TypeError, match=r"^w holds integers \(declared int32\): 8.0 is not one$"):
        m.scalars(Q, Kt, V, t, 8.0)
    with pytest.raises(TypeError, match=r"^w is declared int32: True is not one$"):
        m.scalars(Q, Kt, V, t, True)
    with pytest.raises(TypeError, match=r"^t must be a torch.Tensor, not str$"):
        m.scalars(Q, Kt, V, "0.3", w)


def test_a_python_number_passes_for_a_scalar_and_keeps_its_ranges():
    """scalars(Q, K, V, 0.3, 7) is scalars(Q, K, V, tensor(0.3), tensor(7)), in the inputs' dtype (the fp32
    class t shares with Q) on their device, the reference's too; the same width passed again is the same
    0-d tensor, so mask_cache= keeps the prepass's ranges (SINKS'), where fresh tensors of one value run it
    again.  The window alone runs no prepass (its loops read w) and leaves the dict empty."""
    m = K.compile_text(SCALARS, "scalars")
    empty: dict = {}
    m.scalars(*_inputs(45, torch.float32, seed=4)[:3], 0.3, 7, mask_cache=empty)
    assert empty == {}
    m = K.compile_text(SINKS, "sinks")
    for dtype in (torch.float32, torch.float16):
        Q, Kt, V, t, w = _inputs(45, dtype, seed=4)
        got, = K.run(m, [Q, Kt, V, 0.3, 7])
        assert torch.equal(got, K.run(m, [Q, Kt, V, t, w])[0])
        assert torch.equal(m.reference(Q, Kt, V, 0.3, 7), m.reference(Q, Kt, V, t, w))
    cache: dict = {}
    Q, Kt, V, t, w = _inputs(45, torch.float32, seed=4)

    def record():
        (entry,) = cache.values()
        return entry[0][0]

    m.sinks(Q, Kt, V, 0.3, 7, mask_cache=cache)
    first = record()
    m.sinks(Q, Kt, V, 0.3, 7, mask_cache=cache)
    assert record() is first                               # kept: the same tensor for 7
    m.sinks(Q, Kt, V, 0.3, torch.tensor(7, dtype=torch.int32), mask_cache=cache)
    assert record() is not first                           # another tensor of the same value: run again
    # gradients reach the tensors beside a number, which has none to take
    got = B.gradients(lambda q, k, v: m.sinks(q, k, v, 0.3, 7, block_q=32, block_x=16), [Q, Kt, V])
    want = B.gradients(lambda q, k, v: m.sinks(q, k, v, t, w, block_q=32, block_x=16), [Q, Kt, V])
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_the_public_backward_and_preprocess_take_python_numbers_too():
    """scalars_preprocess and scalars_backward, the entries distributed attention calls, turn a number into
    the launcher's 0-d tensor as well: the same delta and gradients, dt a 0-d tensor, dw none."""
    text = SCALARS.replace("out O", "lse[b, h, q] = logsumexp[x](S)\nout O, lse").replace("hold Q, K, V, t, w, O",
                                                                                        "hold Q, K, V, t, w, O, lse")
    m = K.compile_text(text, "scalars_lse")
    Q, Kt, V, t, w = _inputs(45, torch.float32, seed=6)
    O, lse = m.scalars(Q, Kt, V, 0.3, 7, block_q=32, block_x=16)
    dO = torch.randn(O.shape, generator=torch.Generator().manual_seed(7))
    (delta,) = m.scalars_preprocess(Q, Kt, V, 0.3, 7, dO, O, block_q=32)
    assert torch.equal(delta, m.scalars_preprocess(Q, Kt, V, t, w, dO, O, block_q=32)[0])
    got = m.scalars_backward(Q, Kt, V, 0.3, 7, dO, lse, delta, block_q=32, block_x=16)
    want = m.scalars_backward(Q, Kt, V, t, w, dO, lse, delta, block_q=32, block_x=16)
    assert got[3].shape == () and got[4] is None and want[4] is None
    assert all(torch.equal(a, b) for a, b in zip(got[:4], want[:4]))
    with pytest.raises(TypeError, match=r"^w holds integers \(declared int32\): 7.5 is not one$"):
        m.scalars_backward(Q, Kt, V, 0.3, 7.5, dO, lse, delta)


# --------------------------------------------------------------------------
# The cost pass, the picture, FlexAttention.
# --------------------------------------------------------------------------

def test_the_cost_pass_counts_a_scalar_as_the_kernels_load_it():
    """Every tensor's bytes, the scalars' included, against the ByteCounter's at a width given as
    --lengths would give it: each program loads t and w once; the loops read w (no prepass, one
    launch), and SINKS' prepass (w in an or) is counted with its own kernels."""
    from napkin.cost import analyse

    m = K.compile_text(SCALARS, "scalars")
    d = napkin.load_text(SCALARS, "scalars.ncd")
    n, w = 75, 20
    inputs = _inputs(n, torch.float32, seed=3, w=w)
    report = analyse(d, {"b": 2, "h": 2, "q": n, "x": n}, lengths={"w": w})
    with ByteCounter(tensors=dict(zip(m.INPUTS, inputs)), distinct=False) as bc:
        m.scalars(*inputs)
    loads, stores = predicted_bytes(report)
    assert without_tensors(bc.loads) == loads and without_tensors(bc.stores) == stores
    assert loads["t"] == 2 * 2 * math.ceil(n / 32) * 4   # one fp32 a program of the main kernel
    assert bc.launches == 1
    # a scalar has one index: the note gives its value alone
    assert "the counts are the blocks they visit when w = 20 (--lengths)" in " ".join(report.notes)
    m = K.compile_text(SINKS, "sinks")
    report = analyse(napkin.load_text(SINKS, "sinks.ncd"), {"b": 2, "h": 2, "q": n, "x": n}, lengths={"w": w})
    with ByteCounter(tensors=dict(zip(m.INPUTS, inputs)), distinct=False) as bc:
        m.sinks(*inputs)
    loads, stores = predicted_bytes(report)
    assert without_tensors(bc.loads) == loads and without_tensors(bc.stores) == stores
    assert bc.launches == 3   # the prepass's scan and merge, then the kernel
    assert "finds live when w = 20 (--lengths), every dead block skipped" in " ".join(report.notes)


def test_a_width_given_at_run_time_is_priced_as_the_same_width_written_down():
    """--lengths w=256 against the diagram with 256 written in: the same blocks visited, so the same
    FLOPs and the same bytes of Q, K and V (the loops read w: no prepass, no record)."""
    from napkin.cost import analyse

    sizes = {"b": 1, "h": 4, "q": 4096, "x": 4096}
    data = analyse(napkin.load_text(SCALARS, "scalars.ncd"), sizes, lengths={"w": 256})
    fixed = analyse(napkin.load_text(SCALARS.replace("q - x < w", "q - x < 256"), "fixed.ncd"), sizes)
    assert data.flops.contraction == fixed.flops.contraction
    assert data.flops.skipped_fraction == fixed.flops.skipped_fraction
    bytes_of = [{(t.kernel, t.tensor, t.direction): t.bytes for t in r.transfers if t.tensor != "w"}
                for r in (data, fixed)]
    assert bytes_of[0] == bytes_of[1]   # every transfer but w's own loads
    unpriced = analyse(napkin.load_text(SCALARS, "scalars.ncd"), sizes)   # every block under the diagonal
    assert unpriced.flops.contraction > data.flops.contraction


def test_the_picture_draws_a_scalar_with_its_line_into_the_box():
    from napkin.render.dot import to_dot

    dot = to_dot(napkin.load_text(SCALARS, "scalars.ncd"))
    assert "scalar : fp32" in dot and "scalar : int32" in dot
    # a scalar keeps no wire: one black line, through its label, into the score's box
    line = next(x for x in dot.splitlines() if x.strip().startswith('"t.t" ->'))
    label = line.split("->")[1].split("[")[0].strip().strip('"')
    assert 'color="#000000"' in line
    assert any(x.strip().startswith(f'"{label}" -> "op.S"') for x in dot.splitlines())


@pytest.mark.usefixtures("quiet_flex")
def test_flex_reads_a_scalar_in_its_score_mod_and_mask_mod():
    from bench_helpers import fp32, flex_vs_reference
    from napkin.bench import flex

    d = fp32(SCALARS)
    src = flex.emit(d)
    assert src.mask == "x <= q and q - x < w"
    assert max(flex_vs_reference(d)) < 1e-5


MATMUL = """diagram scaled_matmul
wire m, n, k
in A[m, k] : fp32
in B[k, n] : fp32
in alpha : fp32
C[m, n] : fp32 = sum[k](A * B) * alpha
out C
schedule { level smem { group m by 32, n by 32
stream k by 16 } }
"""


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_matrix_product_scaled_by_a_scalar_trains(dtype):
    """A scalar in a matmul's epilogue: C = alpha A B against float64 torch, and dalpha, whose reference box
    (a gradient along no wire) was emitted as torch.full((,), ...), no Python at all."""
    m = K.compile_text(MATMUL, "scaled_matmul")
    gen = torch.Generator().manual_seed(11)
    A, Bm = torch.randn(37, 53, generator=gen).to(dtype), torch.randn(53, 45, generator=gen).to(dtype)
    alpha = torch.tensor(-0.7, dtype=dtype)
    C, = K.run(m, [A, Bm, alpha])
    exact = alpha.double() * (A.double() @ Bm.double())
    assert (C.double() - exact).abs().max() <= (2e-2 if dtype == torch.float16 else 1e-4) * exact.abs().max()
    got = B.gradients(m.scaled_matmul, [A, Bm, alpha])
    want = B.gradients(lambda a, b, s: s * (a @ b), [A.double(), Bm.double(), alpha.double()])
    same = B.gradients(m.reference, [A, Bm, alpha])
    assert got[2].shape == () and want[2] != 0
    B.assert_accurate(got, want, same, "scaled matmul", dtype, rows=[1, 1, 37])
    # its public backward takes the number as the launcher does
    dC = torch.randn(C.shape, generator=gen).to(dtype)
    by_number, by_tensor = (m.scaled_matmul_backward(A, Bm, s, dC) for s in (-0.7, alpha))
    assert all(torch.equal(a, b) for a, b in zip(by_number, by_tensor))


FLAG = """diagram flag
wire b, h, q, x
wire d = 16
in Q[b, h, q, d] : fp32
in K[b, h, x, d] : fp32
in V[b, h, x, d] : fp32
in causal : bool
in c : fp32
S[b, h, q, x] = where(not causal or x <= q, c * tanh(sum[d](Q * K) * |d|^-0.5 / c), -inf)
O[b, h, q, d] : fp32 = sum[x](softmax[x](S) * V)
out O
schedule { level smem { group b by 1, h by 1, q by 32
stream x by 16 } }
"""


def test_a_bool_scalar_switches_the_mask_of_one_kernel_and_a_softcap_trains():
    """causal, a bool read at run time: the same module is SDPA's causal attention and its full one; the
    soft-cap c, a scalar too, gets its gradient (float64 autograd of the formula)."""
    m = K.compile_text(FLAG, "flag")
    gen = torch.Generator().manual_seed(2)
    Q, Kt, V = (torch.randn(2, 2, 45, 16, generator=gen) for _ in range(3))
    c = torch.tensor(1e4)   # far past every score: the cap leaves SDPA's attention
    for causal in (True, False):
        out, = K.run(m, [Q, Kt, V, torch.tensor(causal), c])
        sdpa = torch.nn.functional.scaled_dot_product_attention(Q.double(), Kt.double(), V.double(), is_causal=causal)
        assert (out.double() - sdpa).abs().max() < 1e-4, causal

    def formula(q, k, v, cap):
        s = cap * torch.tanh(q @ k.transpose(-1, -2) / 4 / cap)
        return torch.softmax(s.masked_fill(torch.ones(45, 45, dtype=torch.bool).triu(1), -math.inf), -1) @ v

    flag, cap = torch.tensor(True), torch.tensor(1.5)
    got = B.gradients(lambda q, k, v, s: m.flag(q, k, v, flag, s, block_q=32, block_x=16), [Q, Kt, V, cap])
    exact = B.gradients(formula, [Q.double(), Kt.double(), V.double(), cap.double()])
    same = B.gradients(lambda q, k, v, s: m.reference(q, k, v, flag, s), [Q, Kt, V, cap])
    assert exact[3] != 0
    B.assert_accurate(got, exact, same, "flag", torch.float32, rows=[1, 1, 1, 2 * 2 * 45])
