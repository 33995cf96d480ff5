"""An attention output that is a function of the attention and its row's lse trains.

O = F(sum[x](softmax[x](S) * V), logsumexp[x](S), inputs) with F elementwise
along the row: an attention sink's A * sigmoid(L - sink), a gate's A *
sigmoid(G), a per-head scale.  gradrules' epilogue rule passes dO through F
in the backward's rows pass (dN0 or gN0, and F's lse term in delta); the
inputs F reads get their gradients from the rows (dT_i, summed over the
wires they lack), in the softmax and in the sums form alike.

Every case is checked against float64 torch written independently of
napkin (the sink as one more softmax column), on ragged sizes across 16-row
blocks, and against the same-dtype reference by test_backward's rule.
"""
from __future__ import annotations

import inspect
import re

from pathlib import Path

import pytest
import torch

import napkin
from backward_helpers import FAST, check, compile_text, gradients


REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("epilogue")


HEAD = """diagram {name}
wire b, h, q, x
wire d = 16
in Q[b, h, q, d] : {dt}
in K[b, h, x, d] : {dt}
in V[b, h, x, d] : {dt}
"""


def sink_torch(q, k, v, sink, causal=False):
    """Softmax over the keys and one sink logit a head, the sink's column dropped."""
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    s = torch.cat([s, sink.reshape(1, -1, 1, 1).expand(*s.shape[:-1], 1)], -1)
    return s.softmax(-1)[..., :-1] @ v


def drawn(shapes, seed, dtype, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    out = [(torch.randn(s, generator=g) * (scale if i < 2 else 1.0)) for i, s in enumerate(shapes)]
    return [t.to(dtype) if i < 3 else t for i, t in enumerate(out)]


def assert_close(got, exact, tol):
    for i, (a, b) in enumerate(zip(got, exact)):
        assert a is not None and b is not None, i
        err = ((a.double() - b).norm() / b.norm()).item()
        assert err < tol, f"gradient {i}: relative error {err:.3g}"


SINK_SOFTMAX = HEAD + """in sink[h] : fp32
S[b, h, q, x] = sum[d](Q * K) * |d|^-0.5
A[b, h, q, d] = sum[x](softmax[x](S) * V)
L[b, h, q] = logsumexp[x](S)
O[b, h, q, d] : {dt} = A * sigmoid(L - sink)
out O
"""
SINK_SUMS = HEAD + """in sink[h] : fp32
S[b, h, q, x] = sum[d](Q * K) * |d|^-0.5
O[b, h, q, d] : {dt} = sum[x](exp(S) * V) / (sum[x](exp(S)) + exp(sink))
out O
"""


@pytest.mark.parametrize("form", ["softmax", "sums"])
@pytest.mark.parametrize("dt, tol", [("fp32", 1e-5), ("fp16", 4e-3)])
def test_an_attention_sink_trains_every_input(folder, form, dt, tol):
    """The sink, written as softmax's A * sigmoid(L - sink) or as sums of exp, against the sink as
    a softmax column.  Before, the first had no backward ('logsumexp[x] is not a sum along the key
    wire') and the second none for sink ('its gradient would go through O, dN0, dZ0 past the score
    box')."""
    text = (SINK_SOFTMAX if form == "softmax" else SINK_SUMS).format(name=f"sink_{form}_{dt}", dt=dt)
    m = compile_text(text, f"sink_{form}_{dt}", folder)
    dtype = torch.float32 if dt == "fp32" else torch.float16
    ins = drawn([(2, 3, 37, 16), (2, 3, 45, 16), (2, 3, 45, 16), (3,)], 11, dtype)
    fn = getattr(m, f"sink_{form}_{dt}")
    got = gradients(fn, ins, **{k: FAST[k] for k in ("block_q", "block_x")})
    exact = gradients(sink_torch, [t.double() for t in ins])
    assert [g.dtype for g in got] == [t.dtype for t in ins]
    assert_close(got, exact, tol)
    out = fn(*ins, block_q=16, block_x=16)
    assert (out.double() - sink_torch(*[t.double() for t in ins])).abs().max().item() < 50 * tol


def test_a_sink_with_grouped_heads_and_a_causal_mask_trains(folder):
    """examples/attention_sink.ncd's form: sink[(hk g)] along a grouped axis, its row values
    [b, hk, g, q] summed over b and q."""
    text = (HEAD.replace("wire b, h, q, x", "wire b, hk, g, q, x").replace("Q[b, h,", "Q[b, (hk g),")
            .replace("K[b, h,", "K[b, hk,").replace("V[b, h,", "V[b, hk,")
            + "in sink[(hk g)] : fp32\n"
            "S[b, hk, g, q, x] = where(x <= q, sum[d](Q * K) * |d|^-0.5, -inf)\n"
            "A[b, hk, g, q, d] = sum[x](softmax[x](S) * V)\n"
            "L[b, hk, g, q] = logsumexp[x](S)\n"
            "O[b, (hk g), q, d] : fp32 = A * sigmoid(L - sink)\nout O\n").format(name="sink_gqa", dt="fp32")
    m = compile_text(text, "sink_gqa", folder)
    ins = drawn([(2, 4, 37, 16), (2, 2, 45, 16), (2, 2, 45, 16), (4,)], 12, torch.float32)

    def exact_fn(q, k, v, sink):
        return sink_torch(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), sink, causal=True)
    got = gradients(m.sink_gqa, ins, block_q=16, block_x=16)
    assert_close(got, gradients(exact_fn, [t.double() for t in ins]), 1e-5)


GATE = HEAD + """in G[b, h, q, d] : {dt}
S[b, h, q, x] = sum[d](Q * K) * |d|^-0.5
O[b, h, q, d] : {dt} = sum[x](softmax[x](S) * V) * sigmoid(G)
lse[b, h, q] = logsumexp[x](S)
out O, lse
"""


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_a_gated_output_trains_beside_an_lse_output(folder, dtype):
    """A gate along the feature wire (gated attention's sigmoid(G)): dF/dA varies along d, so the
    rows write dN0 = dO * sigmoid(G) as a float32 [rows, d] state the tiles read for dP; G's
    gradient is a [rows, d] row value; the lse output's dlse joins delta.  Against float64
    autograd of the module's reference, by test_backward's rule."""
    dt = "fp32" if dtype == torch.float32 else "fp16"
    m = compile_text(GATE.format(name=f"gate_{dt}", dt=dt), f"gate_{dt}", folder)
    check(m, {"b": 2, "h": 2, "q": 37, "x": 45}, dtype, label=f"gate {dt}")
    ins = drawn([(2, 2, 37, 16), (2, 2, 45, 16), (2, 2, 45, 16), (2, 2, 37, 16)], 13, torch.float32)

    def exact_fn(q, k, v, g):
        s = q @ k.transpose(-1, -2) * 0.25
        return s.softmax(-1) @ v * g.sigmoid(), s.logsumexp(-1)
    got = gradients(getattr(m, f"gate_{dt}"), [t.to(dtype) for t in ins], block_q=16, block_x=16)
    assert_close(got, gradients(exact_fn, [t.to(dtype).double() for t in ins]), 1e-5 if dt == "fp32" else 4e-3)


def test_an_input_of_the_scores_and_of_the_output_sums_both_paths(folder):
    """tau scales the scores and the output: its gradient is the dQ kernel's side partial plus
    the rows' dT_i."""
    text = HEAD.format(name="tau_both", dt="fp32") + """in tau[h] : fp32
S[b, h, q, x] = sum[d](Q * K) * tau
O[b, h, q, d] = sum[x](softmax[x](S) * V) * tau
out O
"""
    m = compile_text(text, "tau_both", folder)
    ins = drawn([(2, 3, 29, 16), (2, 3, 40, 16), (2, 3, 40, 16)], 14, torch.float32) + [torch.rand(3) + 0.5]

    def exact_fn(q, k, v, tau):
        t = tau.reshape(1, -1, 1, 1)
        return (q @ k.transpose(-1, -2) * t).softmax(-1) @ v * t
    got = gradients(m.tau_both, ins, block_q=16, block_x=16)
    assert_close(got, gradients(exact_fn, [t.double() for t in ins]), 1e-5)
    # the rows' part alone would miss the scores' (and the reverse): both are large here
    assert got[3].abs().min().item() > 0


def test_the_backward_called_directly_returns_the_sinks_gradient(folder):
    """NAME_preprocess gives the sink's row values (dT0) with the rest of the row state;
    NAME_backward takes them after dO and sums them into the sink's gradient, or leaves it None
    where need does."""
    m = compile_text(SINK_SOFTMAX.format(name="sink_direct", dt="fp32"), "sink_direct", folder)
    ins = drawn([(1, 3, 21, 16), (1, 3, 30, 16), (1, 3, 30, 16), (3,)], 15, torch.float32)
    dO = torch.randn(1, 3, 21, 16, generator=torch.Generator().manual_seed(3))
    _, (n0, lse) = m._sink_direct_forward(*ins, 16, 16, None, None, None, True)   # the saved state
    names = re.search(r"per-row values \(([^)]*)\)", m.sink_direct_preprocess.__doc__).group(1).split(", ")
    rows = dict(zip(names, m.sink_direct_preprocess(*ins, dO=dO, lse=lse, N0=n0)))
    state = [n for n, p in inspect.signature(m.sink_direct_backward).parameters.items()
             if p.kind == p.POSITIONAL_OR_KEYWORD][4:]
    assert state[0] == "dO" and state[-1] == "dT0", state   # the row gradients come last
    given = {"dO": dO, **{n: rows[n] for n in state[1:]}}
    grads = m.sink_direct_backward(*ins, **given, block_q=16, block_x=16)
    xs = [t.double().requires_grad_() for t in ins]
    sink_torch(*xs).backward(dO.double())
    for a, b in zip(grads, xs):
        assert ((a.double() - b.grad).norm() / b.grad.norm()).item() < 1e-5
    assert m.sink_direct_backward(*ins, **given, block_q=16, block_x=16, need=[1, 1, 1, 0])[3] is None


def test_a_sinks_training_step_under_torch_compile(folder):
    """One graph, no break, and the eager gradients (aot_eager, as test_backward's): the op's
    fake implementation knows the saved N0 and lse."""
    m = compile_text(SINK_SOFTMAX.format(name="sink_compiled", dt="fp32"), "sink_compiled", folder)
    ins = drawn([(1, 2, 19, 16), (1, 2, 23, 16), (1, 2, 23, 16), (2,)], 16, torch.float32)

    def step(q, k, v, sink):
        return m.sink_compiled(q, k, v, sink, block_q=16, block_x=16).square().sum()
    explain = torch._dynamo.explain(step)(*ins)
    assert explain.graph_break_count == 0 and explain.graph_count == 1
    got = gradients(torch.compile(step, fullgraph=True, backend="aot_eager"), ins)
    for k, e in zip(got, gradients(step, ins)):
        assert torch.allclose(k, e, atol=1e-6)


def test_refusals_of_an_output_function_say_what_and_where(folder):
    """A logsumexp read beside sums of the scores (no softmax) has no rule; the module's forward
    runs and a gradient is refused in words, at the logsumexp."""
    text = HEAD.format(name="lse_sums", dt="fp32") + """S[b, h, q, x] = sum[d](Q * K) * |d|^-0.5
L[b, h, q] = logsumexp[x](S)
O[b, h, q, d] = sum[x](sigmoid(S) * V) * L
out O
"""
    m = compile_text(text, "lse_sums", folder)
    ins = drawn([(1, 1, 9, 16), (1, 1, 9, 16), (1, 1, 9, 16)], 17, torch.float32)
    assert m.lse_sums(*ins).shape == (1, 1, 9, 16)
    with pytest.raises(NotImplementedError, match=r"output O reads logsumexp\[x\] of the scores beside sums of "
                                                  r"them; .* \(line 8, column 14 of the diagram\)$"):
        m.lse_sums(ins[0].requires_grad_(), *ins[1:])


def test_a_residual_trains_through_its_own_input_and_is_refused_through_q(folder):
    """O = attention + Q read Q on two paths, and the kernels keep one accumulator an input (as
    for K = V): refused at the output's box, saying how to write it.  Written with an input of
    its own, the residual's gradient is dO itself (a [rows, d] row value)."""
    text = HEAD.format(name="resid_q", dt="fp32") + """S[b, h, q, x] = sum[d](Q * K) * |d|^-0.5
O[b, h, q, d] = sum[x](softmax[x](S) * V) + Q
out O
"""
    m = compile_text(text, "resid_q", folder)
    ins = drawn([(1, 2, 19, 16), (1, 2, 23, 16), (1, 2, 23, 16)], 18, torch.float32)
    with pytest.raises(NotImplementedError, match=r"the output reads Q outside the attention too: .* pass the same "
                                                  r"tensor to both .* \(line 8, column 17 of the diagram\)$"):
        m.resid_q(ins[0].requires_grad_(), *ins[1:])
    own = compile_text(text.replace("resid_q", "resid_own").replace("+ Q", "+ res")
                       .replace("S[b, h", "in res[b, h, q, d] : fp32\nS[b, h", 1), "resid_own", folder)
    ins = [t.detach() for t in ins] + [ins[0].detach().clone()]

    def exact_fn(q, k, v, res):
        return (q @ k.transpose(-1, -2) * 0.25).softmax(-1) @ v + res
    got = gradients(own.resid_own, ins, block_q=16, block_x=16)
    assert_close(got, gradients(exact_fn, [t.double() for t in ins]), 1e-5)


@pytest.mark.parametrize("output, exact", [
    ("sum[x](softmax[x](S) * V) * c", lambda s, v, c: s.softmax(-1) @ v * c),
    ("sum[x](sigmoid(S) * V) / (1 + sum[x](sigmoid(S))) * c",
     lambda s, v, c: s.sigmoid() @ v / (1 + s.sigmoid().sum(-1, keepdim=True)) * c),
])
def test_an_output_scale_along_the_feature_wire_alone_trains(folder, output, exact):
    """c[d] read by the output's function: the rows load it as a [1, d] tile.  The sums form's
    backward crashed on it (NameError '_i_d' in the rows kernel: the load had neither a row nor
    a column), and c had no gradient in either form."""
    name = f"scale_d_{'softmax' if 'softmax' in output else 'sums'}"
    text = HEAD.format(name=name, dt="fp32") + (f"in c[d] : fp32\nS[b, h, q, x] = sum[d](Q * K) * 0.25\n"
                                                f"O[b, h, q, d] = {output}\nout O\n")
    m = compile_text(text, name, folder)
    ins = drawn([(2, 2, 21, 16), (2, 2, 34, 16), (2, 2, 34, 16), (16,)], 19, torch.float32)
    got = gradients(getattr(m, name), ins, block_q=16, block_x=16)
    want = gradients(lambda q, k, v, c: exact(q @ k.transpose(-1, -2) * 0.25, v, c), [t.double() for t in ins])
    assert_close(got, want, 1e-5)


def test_a_positive_row_factor_folds_into_the_row_state(folder):
    """A sink's dF/dA = sigmoid(L - sink) is positive and a factor of every term of delta: the
    rows fold it into the row state (lseg = lse - log g, delta / g) and the tiles are softmax's
    own, no Aw tile beside P.  A factor of unknown sign (tau[h]) keeps Aw = P * gN0."""
    from napkin import gradrules
    sink = gradrules.grad_plan(napkin.load(REPO / "examples" / "attention_sink.ncd"))
    assert [n for n, _ in sink.tile] == ["S", "P", "dP", "dS", "dR"]
    assert [n for n, _ in sink.rows] == ["lseg", "delta", "dT0"]
    tau = gradrules.grad_plan(napkin.load_text(HEAD.format(name="t", dt="fp32") + (
        "in tau[h] : fp32\nS[b, h, q, x] = sum[d](Q * K)\nO[b, h, q, d] = sum[x](softmax[x](S) * V) * tau\n"
        "out O\n"), "t.ncd"))
    assert "Aw" in dict(tau.tile) and "gN0" in dict(tau.rows)


@pytest.mark.parametrize("case", ["masked_rows", "plus_lse"])
def test_sink_edges_against_float64_torch(folder, case):
    """Rows with every key masked give all their weight to the sink (O = 0, gradients 0, and
    lseg = +inf: no NaN); an output adding L keeps the sink's factor out of the fold (delta has
    a term without it) and trains the Aw way."""
    score = "where(x <= q - 5, sum[d](Q * K) * |d|^-0.5, -inf)" if case == "masked_rows" else \
        "sum[d](Q * K) * |d|^-0.5"
    extra = " + L" if case == "plus_lse" else ""
    text = HEAD.format(name=f"sink_{case}", dt="fp32") + (
        f"in sink[h] : fp32\nS[b, h, q, x] = {score}\nA[b, h, q, d] = sum[x](softmax[x](S) * V)\n"
        f"L[b, h, q] = logsumexp[x](S)\nO[b, h, q, d] = A * sigmoid(L - sink){extra}\nout O\n")
    m = compile_text(text, f"sink_{case}", folder)
    ins = drawn([(2, 3, 37, 16), (2, 3, 45, 16), (2, 3, 45, 16), (3,)], 20, torch.float32)

    def exact_fn(q, k, v, sink):
        s = q @ k.transpose(-1, -2) * 0.25
        if case == "masked_rows":
            s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(-4), float("-inf"))
        col = sink.reshape(1, -1, 1, 1).expand(*s.shape[:-1], 1)
        out = torch.cat([s, col], -1).softmax(-1)[..., :-1] @ v
        return out + s.logsumexp(-1, keepdim=True) if case == "plus_lse" else out
    got = gradients(getattr(m, f"sink_{case}"), ins, block_q=16, block_x=16)
    assert all(torch.isfinite(g).all() for g in got)
    assert_close(got, gradients(exact_fn, [t.double() for t in ins]), 1e-5)
