"""Masks and scores composed through lets (boxes feeding boxes), trained
against autograd by tests/test_backward.py's rule."""
from __future__ import annotations

import math

import pytest
import torch

import napkin
from napkin.errors import NapkinError

from backward_helpers import REPO, assert_accurate, compile_text, example, gradients, launcher


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("backward_lets")


# --------------------------------------------------------------------------
# Masks composed through lets.
# --------------------------------------------------------------------------

COMPOSED = """diagram composed
wire b, h, q, x
wire d = 16
in Q[b, h, q, d] : fp32
in K[b, h, x, d] : fp32
in V[b, h, x, d] : fp32
W[b, h, q, x] = where(q - x < 8, sum[d](Q * K) * |d|^-0.5, -inf)
S[b, h, q, x] = where(x <= q, W, -inf)
P[b, h, q, x] = softmax[x](S)
O[b, h, q, d] : fp32 = sum[x](P * V)
lse[b, h, q] = logsumexp[x](S)
out O, lse
schedule { level smem { group b by 1, h by 1, q by 16
stream x by 16 } }
"""


def test_a_mask_composed_through_lets_trains(folder):
    """W = a window of the contraction, S = causal W: the backward refused it ("softmax must
    normalise the score box itself"), the score box being W.  The box grows by the elementwise boxes
    that alone read it, so S is the score; its gradients (O and lse weighted) match float64 torch
    written here, on a ragged length."""
    m = compile_text(COMPOSED, "composed", folder)
    assert not hasattr(m, "_NO_BACKWARD")
    n = 45

    def torch64(Q, K, V):
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        S = torch.where((j <= i) & (i - j < 8), Q @ K.transpose(-1, -2) / 4, -math.inf)
        return torch.softmax(S, -1) @ V, torch.logsumexp(S, -1)

    _against_torch64(m.composed, torch64, heads=2, n=n, seed=3)


def _against_torch64(fn, torch64, heads: int, n: int, seed: int):
    """fn's O, lse and the gradients of (O, lse) weighted at random, on fresh fp32 inputs (1, heads,
    n, 16), against torch64 in float64."""
    g = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(1, heads, n, 16, generator=g) for _ in range(3)]
    weights = [torch.randn(1, heads, n, 16, generator=g, dtype=torch.float64),
               torch.randn(1, heads, n, generator=g, dtype=torch.float64)]

    def grads(f, xs):
        xs = [x.detach().clone().requires_grad_(True) for x in xs]
        O, lse = f(*xs)
        ((O.double() * weights[0]).sum() + (lse.double() * weights[1]).sum()).backward()
        return [O.detach().double(), lse.detach().double()] + [x.grad.double() for x in xs]

    for a, b in zip(grads(fn, inputs), grads(torch64, [t.double() for t in inputs])):
        assert (a - b).abs().max() < 2e-5


NAN_MASK = """diagram nan_mask
wire b, h, q, x
wire d = 16
in Q[b, h, q, d] : fp32
in K[b, h, x, d] : fp32
in V[b, h, x, d] : fp32
S[b, h, q, x] = where(sqrt(q - x) > 2.5, -inf, sum[d](Q * K) * |d|^-0.5)
O[b, h, q, d] : fp32 = sum[x](softmax[x](S) * V)
lse[b, h, q] = logsumexp[x](S)
out O, lse
schedule { level smem { group b by 1, h by 1, q by 16
stream x by 16 } }
"""


@pytest.mark.filterwarnings("ignore:invalid value encountered in sqrt")   # the point: NaN above the diagonal
def test_a_negated_mask_that_can_be_nan_is_not_flipped(folder):
    """where(sqrt(q - x) > 2.5, -inf, s) keeps every key after q (sqrt is NaN there, and NaN > 2.5 is
    false).  Flipped to sqrt(q - x) <= 2.5 (false too), the ranges prepass judged those blocks dead:
    lse 1.6 off, dQ 0.8.  Only affine index comparisons are flipped now; checked against float64
    torch, outputs and gradients."""
    m = compile_text(NAN_MASK, "nan_mask", folder)
    n = 37

    def torch64(Q, K, V):
        i, j = torch.arange(n, dtype=torch.float64)[:, None], torch.arange(n, dtype=torch.float64)[None, :]
        S = torch.where(torch.sqrt(i - j) > 2.5, -math.inf, Q @ K.transpose(-1, -2) / 4)
        return torch.softmax(S, -1) @ V, torch.logsumexp(S, -1)

    _against_torch64(m.nan_mask, torch64, heads=1, n=n, seed=5)


def test_an_additive_mask_in_a_box_of_its_own_trains(folder):
    """A = the scores, S = A + where(x <= q, 0, -inf): the backward refused it ("logsumexp takes A +
    where(x <= q, 0, -inf), not the score box A itself").  The score now grows through the elementwise
    boxes a softmax or logsumexp takes, so S is the score; O, lse and both weighted gradients match
    float64 torch written here, on a ragged length."""
    text = COMPOSED.replace("W[b, h, q, x] = where(q - x < 8, sum[d](Q * K) * |d|^-0.5, -inf)",
                            "A[b, h, q, x] = sum[d](Q * K) * |d|^-0.5") \
        .replace("S[b, h, q, x] = where(x <= q, W, -inf)", "S[b, h, q, x] = A + where(x <= q, 0, -inf)")
    m = compile_text(text, "additive_box", folder)
    assert not hasattr(m, "_NO_BACKWARD")
    n = 45

    def torch64(Q, K, V):
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        S = Q @ K.transpose(-1, -2) / 4 + torch.where(j <= i, 0.0, -math.inf)
        return torch.softmax(S, -1) @ V, torch.logsumexp(S, -1)

    _against_torch64(m.composed, torch64, heads=2, n=n, seed=11)


BIAS_CHAIN = """diagram bias_chain
wire b, h, q, x
wire d = 16
in Q[b, h, q, d] : fp32
in K[b, h, x, d] : fp32
in V[b, h, x, d] : fp32
in slope[h] : fp32
W[b, h, q, x] = sum[d](Q * K) * |d|^-0.5
B[b, h, q, x] = W + slope * (x - q)
C[b, h, q, x] = 5 * tanh(B / 5)
M[b, h, q, x] = where(x <= q, C, -inf)
O[b, h, q, d] = sum[x](softmax[x](M) * V)
out O
schedule { level smem { group b by 1, h by 1, q by 16
stream x by 16 } }
"""


def test_a_chain_of_boxes_before_the_softmax_trains_and_its_side_input_gets_a_gradient(folder):
    """A bias, a soft-cap and a causal mask each in a box of its own, in that order, train as the
    one score 5 tanh((QK/4 + slope (x - q)) / 5) masked: the slope's gradient included, against
    float64 torch written here (not the module's reference), on ragged lengths (37 rows, 41 keys)."""
    m = compile_text(BIAS_CHAIN, "bias_chain", folder)
    g = torch.Generator().manual_seed(3)
    Q, K, V = (torch.randn(2, 3, n, 16, generator=g) for n in (37, 41, 41))
    slope = torch.rand(3, generator=g)

    def torch64(Q, K, V, slope):
        i, j = torch.arange(37)[:, None], torch.arange(41)[None, :]
        B = Q @ K.transpose(-1, -2) / 4 + slope[:, None, None] * (j - i)
        S = torch.where(j <= i, 5 * torch.tanh(B / 5), -math.inf)
        return torch.softmax(S, -1) @ V

    blocks = dict(block_q=16, block_x=16)
    got = gradients(m.bias_chain, [Q, K, V, slope], **blocks)
    exact = gradients(torch64, [t.double() for t in (Q, K, V, slope)])
    out, ref = m.bias_chain(Q, K, V, slope, **blocks), torch64(*(t.double() for t in (Q, K, V, slope)))
    assert (out.double() - ref).abs().max() < 2e-5
    for name, a, b in zip("QKV", got, exact):
        assert (a.double() - b).abs().max() < 2e-5 * max(1.0, b.abs().max().item()), name
    assert (got[3].double() - exact[3]).abs().max() < 1e-4 * exact[3].abs().max()   # sums every score of a head


def test_a_box_the_normaliser_does_not_take_whole_still_says_why_it_has_no_backward():
    """The growth stops at a box read twice or an output: those keep their refusal."""
    from napkin import gradrules

    twice = BIAS_CHAIN.replace("O[b, h, q, d] = sum[x](softmax[x](M) * V)",
                               "O[b, h, q, d] = sum[x](softmax[x](M) * V) + sum[x](B * V)")
    output = BIAS_CHAIN.replace("out O", "out O, C")
    for text, why in ((twice, "softmax must normalise the score box itself"),
                      (output, r"outputs O and C: the backward takes one attention output \(and a logsumexp")):
        with pytest.raises(ValueError, match=why):
            gradrules.grad_plan(napkin.load_text(text))


def test_a_gate_on_the_softmax_weights_is_named_in_the_refusal():
    """sum[x](softmax[x](S) * G * V) was told softmax must normalise the score box itself."""
    from napkin import gradrules

    text = (REPO / "examples" / "attention.ncd").read_text()
    text = text.replace("in V[b, h, x, d] : fp16", "in V[b, h, x, d] : fp16\nin G[b, h, q, x] : fp16")
    text = text.replace("sum[x](P * V)", "sum[x](P * G * V)")
    with pytest.raises(ValueError, match=r"the weights of the sum along x multiply softmax by G; the backward "
                                         r"takes the softmax weights alone, sum\[x\]\(softmax\[x\]\(S\) \* V\)"):
        gradrules.grad_plan(napkin.load_text(text))


def test_a_logsumexp_output_scaled_is_named_in_the_refusal():
    """lse = logsumexp[x](S) * 2 was refused as a second attention output."""
    from napkin import gradrules

    text = (REPO / "examples" / "attention.ncd").read_text()
    text = text.replace("lse[b, h, q] = logsumexp[x](S)", "lse[b, h, q] = logsumexp[x](S) * 2")
    with pytest.raises(ValueError, match=r"output lse: the backward takes a logsumexp output as logsumexp of the "
                                         r"scores itself, not logsumexp\[x\]\(S\) \* 2"):
        gradrules.grad_plan(napkin.load_text(text))


KEY_IS_VALUE = """diagram key_is_value
wire b, h, q, x
wire d = 16
in Q[b, h, q, d] : fp32
in K[b, h, x, d] : fp32
S[b, h, q, x] = sum[d](Q * K) * |d|^-0.5
O[b, h, q, d] = sum[x](softmax[x](S) * K)
out O
"""


def test_an_input_in_two_roles_is_refused_a_backward_and_the_two_input_spelling_trains(folder):
    """K both the key and the value: the dK/dV kernel kept one accumulator per input, so dK was twice
    the value path's P^T dO and lost the score path (error 2.4 at |dK| 2.6).  Refused in words now;
    the spelling it suggests (two inputs, one tensor passed to both) trains, against float64 torch."""
    m = compile_text(KEY_IS_VALUE, "key_is_value", folder)
    assert "input K: it is both the key and the value: declare two inputs" in m._NO_BACKWARD
    g = torch.Generator().manual_seed(2)
    Q, K = torch.randn(1, 2, 5, 16, generator=g), torch.randn(1, 2, 7, 16, generator=g)
    with pytest.raises(NotImplementedError, match="both the key and the value"):
        m.key_is_value(Q, K.requires_grad_())
    two = compile_text(KEY_IS_VALUE.replace("in K[b, h, x, d] : fp32", "in K[b, h, x, d] : fp32\nin V[b, h, x, d] : fp32")
                       .replace("softmax[x](S) * K)", "softmax[x](S) * V)"), "key_and_value", folder)
    q, k = Q.clone().requires_grad_(), K.detach().clone().requires_grad_()
    w = torch.randn(1, 2, 5, 16, generator=g)
    (two.key_is_value(q, k, k, block_q=16, block_x=16) * w).sum().backward()
    q64, k64 = Q.double().requires_grad_(), K.detach().double().requires_grad_()
    ((torch.softmax(q64 @ k64.transpose(-1, -2) / 4, -1) @ k64) * w.double()).sum().backward()
    assert (q.grad.double() - q64.grad).abs().max() < 1e-5 and (k.grad.double() - k64.grad).abs().max() < 1e-5


def test_matmul_backward_takes_a_gradient_of_another_float_dtype(folder):
    """matmul_backward(A, B, dC) with fp16 A, B and a float32 (or float64) dC failed inside Triton
    ("Both operands must be same dtype"); dC is taken in C's dtype now, as autograd passes it, and
    as attention's backward takes dO."""
    m = example("matmul", folder)
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(33, 40, generator=g).half(), torch.randn(40, 27, generator=g).half()
    dc = torch.randn(33, 27, generator=g)
    opts = dict(block_m=16, block_n=16, block_k=16)
    want = m.matmul_backward(a, b, dc.half(), **opts)
    for other in (dc, dc.double()):
        got = m.matmul_backward(a, b, other, **opts)
        assert all(torch.equal(x, y) for x, y in zip(got, want))
    exact = (dc.half().double() @ b.double().T, a.double().T @ dc.half().double())
    for x, e in zip(want, exact):
        assert (x.double() - e).abs().max() < 1e-3 * e.abs().max()


def test_a_matmul_of_a_relabelled_operand_names_it_in_the_backward_refusal(folder):
    """C = sum[k](A * A[n, k]) runs forward; its backward refusal said "an input is read along
    other wires than its own", naming neither the input nor the line (contract hunt)."""
    text = "diagram gram\nwire m, n, k\nin A[m, k] : fp32\nC[m, n] : fp32 = sum[k](A * A[n, k])\nout C\n"
    m = compile_text(text, "gram", folder)
    a = torch.randn(20, 16)
    assert m.gram(a, block_m=16, block_n=16, block_k=16).shape == (20, 20)   # the forward runs
    with pytest.raises(NotImplementedError) as err:
        m.gram(a.requires_grad_(), block_m=16, block_n=16, block_k=16)
    assert str(err.value) == ("napkin has no backward for diagram gram: input A is read as A[n, k], along other "
                              "wires than its own [m, k]; a matmul's backward takes each factor along its own "
                              "wires (line 4, column 29 of the diagram)")


def test_matmul_backward_names_the_gradient_by_its_parameter(folder):
    """matmul_backward(A, B, dC) called dC by napkin's own buffer name, with a trailing space:
    "_grad_C has shape (20, 17), but the inputs make it (20, 18) " (contract hunt); an input called
    dC makes the parameter dC_1, and the messages say that."""
    m = example("matmul", folder)
    a, b = torch.randn(20, 16).half(), torch.randn(16, 18).half()
    opts = dict(block_m=16, block_n=16, block_k=16)
    with pytest.raises(ValueError) as err:
        m.matmul_backward(a, b, torch.randn(20, 17).half(), **opts)
    assert str(err.value) == "dC has shape (20, 17), but the inputs make it (20, 18) [m, n]"
    with pytest.raises(TypeError) as err:
        m.matmul_backward(a, b, torch.zeros(20, 18, dtype=torch.int32), **opts)
    assert str(err.value) == "dC must be a float tensor"
    text = "diagram mmdc\nwire m, n, k\nin dC[m, k] : fp32\nin B[k, n] : fp32\nC[m, n] = sum[k](dC * B)\nout C\n"
    mdc = compile_text(text, "mmdc", folder)
    with pytest.raises(ValueError) as err:
        mdc.mmdc_backward(a.float(), b.float(), torch.randn(20, 17), **opts)
    assert str(err.value) == "dC_1 has shape (20, 17), but the inputs make it (20, 18) [m, n]"


def test_a_relabelled_value_is_named_in_the_refusal():
    """sum[x](softmax[x](S) * Q[b, h, x, d]) runs forward; its backward refusal said "softmax must
    normalise the score box itself", which it does."""
    from napkin import gradrules

    text = KEY_IS_VALUE.replace("softmax[x](S) * K)", "softmax[x](S) * Q[b, h, x, d])")
    with pytest.raises(ValueError) as err:
        gradrules.grad_plan(napkin.load_text(text))
    assert str(err.value) == ("the sum along x reads Q relabelled (Q[b, h, x, d]); the backward takes a value "
                              "tensor along its own wires")


def test_a_row_value_read_twice_is_one_parameter_of_the_preprocess(folder):
    """exp(N / Z): the rows kernel's value reads Z0 twice, and the preprocess was emitted as
    def _t_preprocess(Q, K, V, dO, N0, Z0, Z0, _o) (a module that did not compile).  Its gradients
    against float64 torch written here, on ragged lengths."""
    text = ("diagram expratio\nwire b, h, q, x\nwire d = 16\nin Q[b, h, q, d] : fp32\nin K[b, h, x, d] : fp32\n"
            "in V[b, h, x, d] : fp32\nS[b, h, q, x] = sum[d](Q * K) * |d|^-0.5\n"
            "O[b, h, q, d] = exp(sum[x](S * V) / sum[x](S))\nout O\n")
    m = compile_text(text, "expratio", folder)
    g = torch.Generator().manual_seed(6)
    Q, K, V = (torch.randn(1, 2, n, 16, generator=g) for n in (19, 23, 23))

    def torch64(Q, K, V):
        S = Q @ K.transpose(-1, -2) / 4
        return torch.exp((S @ V) / S.sum(-1, keepdim=True))

    got = gradients(m.expratio, [Q, K, V], block_q=16, block_x=16)
    exact = gradients(torch64, [t.double() for t in (Q, K, V)])
    for a, b in zip(got, exact):
        assert (a.double() - b).abs().max() < 1e-3 * max(1.0, b.abs().max().item())


@pytest.mark.parametrize("text, where", [
    ("diagram t\nwire q, x\nwire d = 16\nin Q[q, d] : fp16\nin K[x, d] : fp16\nin V[x, d] : int32\n"
     "S[q, x] = sum[d](Q * K)\nO[q, d] = sum[x](S * V)\nout O\n", "6:4: napkin cannot emit a kernel for input V"),
    ("diagram t\nwire m, n, k\nin A[m, k] : fp16\nin B[k, n] : int32\nC[m, n] = sum[k](A * B)\nout C\n",
     "4:4: napkin cannot emit a kernel for input B"),
])
def test_an_integer_operand_of_a_matrix_product_is_refused_at_its_line(text, where):
    """An int32 value crashed the backward's emitter (AttributeError) or, forward only, failed in
    tl.dot at the call ("Unsupported lhs dtype int32")."""
    from napkin.codegen import emit_module
    from napkin.errors import NapkinError

    with pytest.raises(NapkinError) as err:
        emit_module(napkin.load_text(text, "t.ncd"), source_text=text, source_path="t.ncd")
    assert where in str(err.value) and "takes float operands" in str(err.value)


def test_an_output_named_chunk_is_refused():
    """Its buffer replaced the launcher's chunk= option: every call failed printing a tensor."""
    from napkin.codegen import emit_module
    from napkin.errors import NapkinError

    text = (REPO / "examples" / "attention.ncd").read_text().replace("O[b, h, q, d]", "chunk[b, h, q, d]") \
        .replace("out O, lse", "out chunk, lse").replace("hold Q, K, V, O, lse", "hold Q, K, V, chunk, lse")
    with pytest.raises(NapkinError, match="output chunk: the launcher has an option named chunk"):
        emit_module(napkin.load_text(text, "a.ncd"), source_text=text, source_path="a.ncd")


def test_a_score_written_inside_its_normaliser_trains(folder):
    """sum[x](softmax[x](sum[d](Q * K) * |d|^-0.5) * V) ran forward but its
    gradient was refused with 'the score box O holds 2 different
    contractions' (O is the output; helper's hunt): the score inside the
    normalisers is given a box of its own for the backward.  Causal, with
    an lse of the same score written again, fp16, ragged sizes."""
    score = "sum[d](Q * K) * |d|^-0.5 + where(x <= q, 0, -inf)"
    text = f"""diagram inline_score
wire b, h, q, x
wire d = 32
in Q[b, h, q, d] : fp16
in K[b, h, x, d] : fp16
in V[b, h, x, d] : fp16
O[b, h, q, d] : fp16 = sum[x](softmax[x]({score}) * V)
lse[b, h, q] = logsumexp[x]({score})
out O, lse
"""
    m = compile_text(text, "inline_score", folder)
    g = torch.Generator().manual_seed(23)
    q, k, v = (torch.randn(1, 2, n, 32, generator=g).half() for n in (37, 53, 53))

    def torch64(q, k, v):
        s = q @ k.transpose(-1, -2) / math.sqrt(32)
        s = s.masked_fill(torch.arange(53)[None, :] > torch.arange(37)[:, None], float("-inf"))
        return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)

    got = gradients(lambda *t: m.inline_score(*t, block_q=16, block_x=16), [q, k, v])
    exact = gradients(torch64, [t.double() for t in (q, k, v)])
    for a, e in zip(got, exact):
        assert torch.isfinite(a).all()
        assert (a.double() - e).abs().max() <= 2e-3 * e.abs().max() + 1e-3, ((a.double() - e).abs().max(), e.abs().max())


INLINE_FORMS = {
    # name: (the output written inline, the boxed form's S, the boxed form's output)
    "sigmoid": ("sum[x](sigmoid({s} - log(|x|)) * V)", "{s}", "sum[x](sigmoid(S - log(|x|)) * V)"),
    "relu2": ("sum[x](relu({s})^2 * V) / (sum[x](relu({s})^2) + 1e-6)", "{s}",
              "sum[x](relu(S)^2 * V) / (sum[x](relu(S)^2) + 1e-6)"),
    "l2": ("sum[x]({s} * V) / sqrt(sum[x]({s} * {s}) + 1e-6)", "{s}", "sum[x](S * V) / sqrt(sum[x](S * S) + 1e-6)"),
    "bias_box": ("sum[x](softmax[x]({s} + B2) * V)", "{s} + B2", "sum[x](softmax[x](S) * V)"),
}


@pytest.mark.parametrize("form", sorted(INLINE_FORMS))
def test_inline_scores_of_every_normaliser_train_as_their_boxed_forms(form, folder):
    """Sigmoid, ReLU² and L2 attention written inline were refused ('the box O
    holds 2 sums over inputs'); a score reading a box (B2 = bias * 2) was
    'found none'; GQA inline was refused for its two-letter wire hk, whose box
    layout was a string (helper's hunt).  Each trains and gives its boxed
    form's gradients, which match float64."""
    inline, score, boxed = INLINE_FORMS[form]
    s = "sum[d](Q * K) * |d|^-0.5"
    head = ("wire b, h, q, x\nwire d = 16\nin Q[b, h, q, d] : fp32\nin K[b, h, x, d] : fp32\n"
            "in V[b, h, x, d] : fp32\nin bias[b, h, q, x] : fp32\nB2[b, h, q, x] = bias * 2\n")
    texts = [f"diagram inl_{form}\n{head}O[b, h, q, d] = {inline.format(s=s)}\nout O\n",
             f"diagram box_{form}\n{head}S[b, h, q, x] = {score.format(s=s)}\nO[b, h, q, d] = {boxed}\nout O\n"]
    mods = [compile_text(t, t.split()[1], folder) for t in texts]
    g = torch.Generator().manual_seed(41)
    ins = [torch.randn(1, 2, n, 16, generator=g) for n in (37, 53, 53)] + [torch.randn(1, 2, 37, 53, generator=g)]
    got = [gradients(lambda *t, m=m: launcher(m)(*t, block_q=16, block_x=16), ins) for m in mods]
    exact = gradients(mods[1].reference, [t.double() for t in ins])
    for a, b, e in zip(*got, exact):
        if e is None:
            continue
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)
        assert (a.double() - e).abs().max() <= 1e-4 * (1 + e.abs().max()), ((a.double() - e).abs().max(), form)


def test_gqa_written_inline_trains(folder):
    """Its box's layout was a string: hk read as the wires h and k."""
    text = (REPO / "examples" / "gqa.ncd").read_text().replace("wire d = 128", "wire d = 16")
    text = text.replace("P[b, hk, g, q, x] = softmax[x](S)\n", "").replace(
        "sum[x](P * V)", "sum[x](softmax[x](sum[d](Q * K) * |d|^-0.5) * V)").replace(
        "logsumexp[x](S)", "logsumexp[x](sum[d](Q * K) * |d|^-0.5)").replace(
        "S[b, hk, g, q, x] = sum[d](Q * K) * |d|^-0.5\n", "").replace("hold S, P", "")
    m = compile_text(text, "gqa_inline", folder)
    g = torch.Generator().manual_seed(43)
    q, k, v = torch.randn(1, 4, 17, 16, generator=g), torch.randn(1, 2, 19, 16, generator=g), \
        torch.randn(1, 2, 19, 16, generator=g)

    def torch64(q, k, v):
        kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        s = q @ kk.transpose(-1, -2) / 4
        return torch.softmax(s, -1) @ vv, torch.logsumexp(s, -1)

    got = gradients(lambda *t: m.gqa(*t, block_q=16, block_x=16), [q, k, v])
    exact = gradients(torch64, [t.double() for t in (q, k, v)])
    for a, e in zip(got, exact):
        assert (a.double() - e).abs().max() < 1e-5


def test_two_scores_inside_normalisers_are_refused_in_words(folder):
    """Two different inline scores: no one score to box; the refusal names the
    boxes holding them and points at the second, not 'the score box O'."""
    text = """diagram two_inline
wire b, h, q, x
wire d = 16
in Q[b, h, q, d] : fp32
in K[b, h, x, d] : fp32
in V[b, h, x, d] : fp32
O[b, h, q, d] = sum[x](softmax[x](sum[d](Q * K)) * V)
lse[b, h, q] = logsumexp[x](sum[d](Q * K) * 2)
out O, lse
"""
    m = compile_text(text, "two_inline", folder)
    q, k, v = m.example_inputs({"b": 1, "h": 1, "q": 5, "x": 7}, dtype=torch.float32)
    with pytest.raises(NotImplementedError, match=r"expected one score box contracting inputs \(like sum\[d\]\(Q \* "
                                                  r"K\)\); found O, lse \(line 8, column 1 of the diagram\)$"):
        m.two_inline(q.requires_grad_(), k, v)


def test_a_refusal_after_boxing_an_inline_score_does_not_name_napkins_box():
    """Training boxes a score written inline as `inline_score`; a refusal met after that named the box,
    a name the user never wrote ("found inline_score, R")."""
    from napkin import cost

    text = """diagram inl
wire b, h, q, x
wire d = 16
in Q[b, h, q, d] : fp16
in K[b, h, x, d] : fp16
in V[b, h, x, d] : fp16
O[b, h, q, d] : fp16 = sum[x](softmax[x](sum[d](Q * K) * |d|^-0.5) * V)
R[b, h, q] = max[x](sum[d](Q * K))
out O, R
"""
    with pytest.raises(NapkinError) as err:
        cost.backward_cost(napkin.load_text(text, "inl.ncd"), {"b": 1, "h": 1, "q": 64, "x": 64})
    assert "found the score written inline, R" in str(err.value) and "inline_score" not in str(err.value)


def test_grad_plan_finding_no_score_box_points_at_the_normaliser():
    """'found none' carried no place (a score box reading a box, which
    training now writes out, met it first)."""
    from napkin import gradrules
    text = ("diagram none\nwire b, h, q, x\nwire d = 16\nin Q[b, h, q, d] : fp32\nin K[b, h, x, d] : fp32\n"
            "in V[b, h, x, d] : fp32\nin bias[b, h, q, x] : fp32\nB2[b, h, q, x] = bias * 2\n"
            "S[b, h, q, x] = sum[d](Q * K) + B2\nO[b, h, q, d] = sum[x](softmax[x](S) * V)\nout O\n")
    with pytest.raises(gradrules.NoGrad, match="found none") as err:
        gradrules.grad_plan(napkin.load_text(text, "none.ncd"))
    assert (err.value.loc.line, err.value.loc.col) == (10, 24)


COSINE = """diagram cosine
wire b, h, q, x
wire d = 16
in Q[b, h, q, d] : fp16
in K[b, h, x, d] : fp16
in V[b, h, x, d] : fp16
in tau[h] : fp32
in Qn[b, h, q] : fp32
in Kn[b, h, x] : fp32
S[b, h, q, x] = tau * sum[d](Q * K) / sqrt(Qn * Kn + 1e-6)
O[b, h, q, d] : fp16 = sum[x](softmax[x](S) * V)
out O
"""


@pytest.mark.parametrize("dt", [torch.float32, torch.float16])
def test_cosine_attention_with_its_norms_passed_in_trains(dt, folder):
    """Cosine attention: the norms sum[d](Q * Q) and sum[d](K * K) are no score, so the kernel is
    refused them (test_codegen) with the hint to compute them in torch and pass them in.  Done so,
    autograd carries the kernel's gradients of Qn and Kn on to Q and K: every gradient against
    float64 torch of the whole formula, on ragged sizes."""
    m = compile_text(COSINE, "cosine", folder)
    gen = torch.Generator().manual_seed(3)
    Q, K, V = (torch.randn(2, 2, n, 16, generator=gen).to(dt) for n in (37, 45, 45))
    tau = torch.tensor([4.0, 9.0])

    def cosine(Q, K, V, tau, kernel):
        Qn, Kn = (Q.float() * Q.float()).sum(-1), (K.float() * K.float()).sum(-1)
        if kernel:
            return m.cosine(Q, K, V, tau, Qn, Kn, block_q=16, block_x=16)
        S = tau[:, None, None] * (Q @ K.transpose(-1, -2)) / torch.sqrt(Qn[..., :, None] * Kn[..., None, :] + 1e-6)
        return torch.softmax(S, -1) @ V

    got = gradients(lambda *t: cosine(*t, True), [Q, K, V, tau])
    exact = gradients(lambda *t: cosine(*t, False), [Q.double(), K.double(), V.double(), tau.double()])
    same = gradients(lambda *t: cosine(*t, False), [Q.float(), K.float(), V.float(), tau])
    same = [s.to(g.dtype) for s, g in zip(same, got)]
    assert_accurate(got, exact, same, "cosine", dt)
