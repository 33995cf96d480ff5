"""A gate on the value, sum[x](P * V * gate) with gate along the keys and V's
wires alone: the forward kernel multiplies it into the weights; the backward
takes V * gate as the value (formed by the launcher in torch) and gives dV,
dgate from the kernels' gradient of it (gradform.Form.gate,
training._gate_context).  Checked on ragged sizes against float64 torch
written here and against the module's own reference in float64 and in the
inputs' dtype, in fp32 and fp16, in softmax form and in sums form (sigmoid)."""
from __future__ import annotations

import math
import zlib

import pytest
import torch

import napkin
from napkin import gradrules
from napkin.printer import expr_text

from backward_helpers import check, compile_text, gradients
from cost_helpers import backward_bytes, triton_launches, without_tensors
from napkin.bytecount import ByteCounter
from napkin.cost import bounds
from napkin.cost.backward import backward_cost

GATED = """diagram gated
wire b, h, q, x
wire d = 16
in Q[b, h, q, d] : {dtype}
in K[b, h, x, d] : {dtype}
in V[b, h, x, d] : {dtype}
in {gate} : fp32
S[b, h, q, x] = where(x <= q + 5, sum[d](Q * K) * |d|^-0.5, -inf)
P[b, h, q, x] = {weights}
O[b, h, q, d] : {dtype} = sum[x](P * V * {read})
out O
schedule {{ level smem {{ group b by 1, h by 1, q by 16
stream x by 16 }} }}
"""

SOFTMAX, SIGMOID = "softmax[x](S)", "sigmoid(S)"
SIZES = {"b": 2, "h": 3, "q": 37, "x": 53}
FAST = {"block_q": 16, "block_x": 16}


def gated(folder, *, dtype="fp32", gate="gate[b, h, x]", weights=SOFTMAX, read="gate", extra=()):
    text = GATED.format(dtype=dtype, gate=gate, weights=weights, read=read)
    for old, new in extra:
        assert old in text
        text = text.replace(old, new)
    return compile_text(text, f"gated_{zlib.crc32(text.encode())}", folder), text


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("value_gate")


# each gate layout put along (b, h, x)
ALONG_BHX = {"bhx": lambda g: g, "hx": lambda g: g[None], "xh": lambda g: g.T[None], "x": lambda g: g[None, None]}


def _hand_written(Q, K, V, gate, weights, layout):
    """The gated attention in float64 torch, written without napkin."""
    n, m = Q.shape[2], K.shape[2]
    S = Q @ K.transpose(-1, -2) / 4
    S = torch.where(torch.arange(m)[None, :] <= torch.arange(n)[:, None] + 5, S, -math.inf)
    P = torch.softmax(S, -1) if weights == SOFTMAX else torch.sigmoid(S)
    return P @ (V * ALONG_BHX[layout](gate)[..., None])


@pytest.mark.parametrize("weights", [SOFTMAX, SIGMOID])
@pytest.mark.parametrize("gate,layout", [("gate[b, h, x]", "bhx"), ("gate[h, x]", "hx"),
                                          ("gate[x, h]", "xh"), ("gate[x]", "x")])
def test_a_gated_value_trains_against_float64_torch(folder, weights, gate, layout):
    """Every input's gradient, the gate's included (it had none: softmax refused the backward,
    sigmoid's left the gate out), against float64 torch written here, fp32, ragged sizes."""
    m, _ = gated(folder, gate=gate, weights=weights)
    inputs = list(m.example_inputs(SIZES, dtype=torch.float32, seed=5))
    # a gate of either sign, not the example's ALiBi-like slopes
    inputs[3] = torch.rand(inputs[3].shape, generator=torch.Generator().manual_seed(9)) * 2 - 0.5
    got = gradients(m.gated, inputs, **FAST)
    exact = gradients(lambda *t: _hand_written(*t, weights, layout), [t.double() for t in inputs])
    assert all(g is not None for g in got)
    for name, k, e in zip("QKV", got[:3], exact[:3]):
        assert (k.double() - e).abs().max() <= 2e-5 * max(1.0, e.abs().max()), name
    assert (got[3].double() - exact[3]).abs().max() <= 2e-5 * max(1.0, exact[3].abs().max())
    assert exact[3].abs().max() > 0.1   # the gate's gradient is no zero that a missing term passes


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("weights", [SOFTMAX, SIGMOID])
def test_a_gated_value_against_the_reference_in_both_dtypes(folder, dtype, weights):
    """The tests' usual rule: within twice the same-dtype reference's error (plus a floor) of
    float64, fp16 included, where the launcher's V * gate rounds to fp16 as the kernels take V."""
    m, _ = gated(folder, dtype="fp16" if dtype == torch.float16 else "fp32", weights=weights)
    check(m, SIZES, dtype, seed=2, label=f"gated {weights} {dtype}")


def test_need_and_the_backward_called_directly(folder):
    """need= asks for the gate alone, or V alone: each the same bits as the full call's (the
    kernels' dW serves both); NAME_backward's float32 gradients are float64 autograd's of the
    reference; a second call (the launch plan's) with another V takes that V, not the first's
    product."""
    m, _ = gated(folder)
    Q, K, V, gate = m.example_inputs(SIZES, dtype=torch.float32, seed=11)
    dO = torch.randn(2, 3, 37, 16, generator=torch.Generator().manual_seed(1))

    def direct(V, **need):
        (O,), (lse,) = m._gated_forward(Q, K, V, gate, 16, 16, None, None, None, True)   # with the saved state
        delta, = m.gated_preprocess(Q, K, V, gate, dO, O, block_q=16)
        return m.gated_backward(Q, K, V, gate, dO, lse, delta, **FAST, **need)

    full = direct(V)
    only_gate, only_v = direct(V, need=0b1000), direct(V, need=[0, 0, 1, 0])
    assert only_gate[:3] == (None, None, None) and torch.equal(only_gate[3], full[3])
    assert only_v[3] is None and torch.equal(only_v[2], full[2])
    for V in (V, V.flip(2).contiguous()):   # the second call's plan forms the product of its own V
        xs = [t.clone().double().requires_grad_() for t in (Q, K, V, gate)]
        (m.reference(*xs) * dO.double()).sum().backward()
        for got, via in zip(direct(V), xs):
            assert got.dtype == torch.float32 and (got.double() - via.grad).abs().max() < 1e-5 * via.grad.abs().max()


def test_the_rule_takes_v_times_the_gate_as_the_value():
    d = napkin.load_text(GATED.format(dtype="fp32", gate="gate[b, h, x]", weights=SOFTMAX, read="gate"))
    rule = gradrules.grad_plan(d)
    assert rule.value == "V" and rule.value_gate == "gate"
    # the kernels' dW is softmax's own dV; the forward's sum (what a saved N0 stores) keeps the gate
    assert expr_text(dict(rule.input_grads)["V"]) == "sum[q](P * dO)"
    assert expr_text(rule.binding("O")) == "sum[x](P * (V * gate))"


REFUSED = [
    # two gates: one value a contraction
    ({"gate": "gate[b, h, x] : fp32\nin g2[h, x]", "read": "gate * g2"},
     "the value V is scaled by g2 and gate: the backward takes one gate on the value, as "
     "sum[x](softmax[x](S) * V * gate), in every contraction (multiply the gates into one input in torch)"),
    # the gate read by the scores too
    ({"extra": (("sum[d](Q * K) * |d|^-0.5", "sum[d](Q * K) * |d|^-0.5 + gate"),)},
     "gate scales the value V and is read by the scores too: its gradient would have two paths; declare "
     "another input for that read and pass the same tensor to both (autograd adds their gradients)"),
    # the gate in a row sum beside the contraction (a normaliser of the gated weights)
    ({"weights": SIGMOID, "extra": (("sum[x](P * V * gate)", "sum[x](P * V * gate) / sum[x](P * gate)"),)},
     "gate scales the value V and is read by a row sum along x too: its gradient would have two paths"),
    # gated in one contraction, not in the other
    ({"weights": SIGMOID, "extra": (("sum[x](P * V * gate)", "sum[x](P * V * gate) + sum[x](P * P * V)"),)},
     "gate scales V in one contraction along x and not another: the backward takes one value, V * gate in "
     "every contraction or V in every one"),
]


@pytest.mark.parametrize("case,why", REFUSED)
def test_what_the_gate_refuses_says_why(case, why):
    case = dict(case)
    text = GATED.format(dtype="fp32", gate=case.pop("gate", "gate[b, h, x]"), weights=case.pop("weights", SOFTMAX),
                        read=case.pop("read", "gate"))
    for old, new in case.pop("extra", ()):
        text = text.replace(old, new)
    with pytest.raises(ValueError) as e:
        gradrules.grad_plan(napkin.load_text(text))
    assert str(e.value).startswith(why)


def test_a_gate_the_value_lacks_a_wire_of_keeps_the_hint():
    """gate[b, h, g, x] beside a grouped-query V[b, h, x, d]: V * gate would be per query head,
    no value of the kernels' (they read V once per key head): refused with the way that trains."""
    text = GATED.format(dtype="fp32", gate="gate[b, h, g, x]", weights=SOFTMAX, read="gate")
    text = text.replace("wire d = 16", "wire d = 16\nwire g = 2").replace("in Q[b, h, q, d]", "in Q[b, h, g, q, d]")
    text = text.replace("S[b, h, q, x]", "S[b, h, g, q, x]").replace("P[b, h, q, x]", "P[b, h, g, q, x]")
    text = text.replace("O[b, h, q, d]", "O[b, h, g, q, d]").replace("group b by 1, h by 1,", "group b by 1, h by 1, g by 1,")
    with pytest.raises(ValueError) as e:
        gradrules.grad_plan(napkin.load_text(text))
    assert "(gate lies along x and not the rows: multiply it into V in torch and pass V * gate as V" in str(e.value)


def test_the_kernels_move_what_the_cost_pass_says_and_torch_is_priced_apart(folder):
    """The backward's Triton kernels, counted under the interpreter, move the bytes napkin cost
    predicts for them (V: the launcher's product, loaded under V's parameter); the launcher's
    torch is the kernel "value gate (torch)": V and the gate read twice, the product written, dW
    read twice (for dgate, for dV) and dV, dgate written."""
    m, text = gated(folder, dtype="fp16")
    d = napkin.load_text(text)
    inputs = m.example_inputs(SIZES, dtype=torch.float16, seed=4)
    none = (None,) * len(m._OPTIONS)
    outs, saved = m._gated_forward(*inputs, *none, True)
    grads = [torch.randn(o.shape, generator=torch.Generator().manual_seed(0)).to(o.dtype) for o in outs]
    with ByteCounter(tensors=dict(zip(m.INPUTS, inputs))) as bc:
        m._gated_grads(inputs, (*outs, *saved), grads, none, None)
    cost = backward_cost(d, SIZES)
    assert bc.launches == triton_launches(cost) == 3
    assert without_tensors(bc.loads) == backward_bytes(cost, "load")
    assert without_tensors(bc.stores) == backward_bytes(cost, "store")
    nv, ng = 2 * 3 * 53 * 16, 2 * 3 * 53
    assert {(mv.tensor, mv.direction): mv.bytes for mv in cost.moves if mv.kernel == "value gate (torch)"} == {
        ("V", "load"): 2 * nv * 2, ("gate", "load"): 2 * ng * 4, ("V * gate", "store"): nv * 2,
        ("_grad_V", "load"): 2 * nv * 2, ("_grad_V", "store"): nv * 2, ("_grad_gate", "store"): ng * 4}


def test_the_lower_bound_takes_v_as_the_value():
    """The forward's bound read the gate as the value (sum[x](P * V * gate) is (P * V) * gate):
    no value wire, so no value terms, and a bound below the compulsory traffic.  The gate moves
    |x| a head, as a bias does: the bound is the dense attention's."""
    text = GATED.format(dtype="fp16", gate="gate[b, h, x]", weights=SOFTMAX, read="gate")
    plain = text.replace("sum[x](P * V * gate)", "sum[x](P * V)")
    assert bounds.bound_shape(napkin.load_text(text)) == bounds.bound_shape(napkin.load_text(plain))
    assert bounds.bound_shape(napkin.load_text(text)).value == ("d",)


def test_a_gated_training_step_under_torch_compile(folder):
    """One graph, no break, and the eager gradients (aot_eager): the backward op runs the
    launcher's torch around the kernels inside its opaque body."""
    m, _ = gated(folder)
    ins = m.example_inputs({"b": 1, "h": 2, "q": 19, "x": 23}, dtype=torch.float32, seed=8)

    def step(q, k, v, gate):
        return m.gated(q, k, v, gate, **FAST).square().sum()
    explain = torch._dynamo.explain(step)(*ins)
    assert explain.graph_break_count == 0 and explain.graph_count == 1
    got = gradients(torch.compile(step, fullgraph=True, backend="aot_eager"), ins)
    for k, e in zip(got, gradients(step, ins)):
        assert torch.allclose(k, e, atol=1e-6)


@pytest.mark.parametrize("gate", ["gate[b, h, x]", "gate[x, h]", "gate[x]"])
def test_napkin_bench_takes_a_gated_value_and_flex_its_product(gate):
    """napkin bench refused the diagram ("not an attention: no single value input contracted
    along the key wire": V and the gate both were): the value is V, whose wires the gate's lie
    within, so the bench has SDPA's sizes; Flex, which has no gate on the value, takes V * gate
    as its V (formed once when the call is prepared, outside a timed call), checked against the
    float64 reference here.  A gate along a wire V lacks is refused in words."""
    from bench_helpers import flex_vs_reference
    from napkin.bench import flex

    d = napkin.load_text(GATED.format(dtype="fp32", gate=gate, weights=SOFTMAX, read="gate"))
    shape = flex.attention_shape(d, SIZES)
    assert (shape["value_dim"], shape["kv_len"], shape["operands"]) == (16, 53, ["Q", "K", "V"])
    assert max(flex_vs_reference(d, SIZES)) < 1e-5
    assert "def arrange(Q, K, V, gate):" in flex.emit(d).text
    wider = GATED.format(dtype="fp32", gate="gate[b, h, q, x]", weights=SOFTMAX, read="gate")
    with pytest.raises(flex.NoFlexEquivalent, match=r"or V times a gate along x and V's wires"):
        flex.emit(napkin.load_text(wider))
