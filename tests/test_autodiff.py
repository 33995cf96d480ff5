"""napkin.autodiff and napkin.gradrules checked numerically against
torch.autograd in float64.

* diff: the score expression of every shipped example, a hand-picked list of
  mask cases, and random elementwise expressions (hypothesis);
* simplify: each rule, value preservation (inf/NaN included), idempotence;
* grad_plan: the whole backward (dQ, dK, dV and dS) of softmax, sigmoid,
  L2-normalised and logsumexp attention, masked, with a fully masked row,
  against hand-written eager attention, and of every example and of random
  attention diagrams (tests/strategies.py) against autograd through
  ``evaluate``: tests/test_grad_plan.py.  ``evaluate`` itself is in
  tests/autodiff_helpers.py, checked here.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from napkin import ir
from napkin.autodiff import diff, simplify, substitute
from napkin.parse import parse

from autodiff_helpers import B, C, N, diagram_sizes, evaluate, random_inputs

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.ncd"))
F64 = torch.float64
INF = float("inf")

def test_evaluate_is_a_faithful_reference():
    g = torch.Generator().manual_seed(0)
    Q, K = torch.randn(2, 3, 4, generator=g, dtype=F64), torch.randn(2, 5, 4, generator=g, dtype=F64)
    lay = {"Q": ("h", "q", "d"), "K": ("h", "x", "d"), "doc": ("x",)}
    env = {"Q": Q, "K": K, "doc": torch.tensor([0.0, 0, 1, 1, 2])}
    raw = ir.Reduce("sum", ("d",), ir.Binary("*", ir.TensorRef("Q"), ir.TensorRef("K")))
    ref = torch.einsum("hqd,hxd->hqx", Q, K)
    torch.testing.assert_close(evaluate(raw, env, lay, ("h", "q", "x")), ref)
    torch.testing.assert_close(evaluate(raw, env, lay, ("x", "h", "q")), ref.permute(2, 0, 1))
    dist = ir.Binary("-", ir.WireIndex("x"), ir.WireIndex("q"))
    assert evaluate(dist, env, lay, ("q", "x"))[2, 4] == 2
    same_doc = ir.Binary("==", ir.TensorRef("doc", ("q",)), ir.TensorRef("doc"))
    row3 = evaluate(same_doc, {"doc": env["doc"]}, lay, ("q", "x"), {"q": 5})[3]
    assert row3.tolist() == [False, False, True, True, False]
    S = torch.randn(3, 4, generator=g, dtype=F64)
    S[1] = -INF
    lay_s, env_s = {"S": ("q", "x")}, {"S": S}
    P = evaluate(ir.Normalize("softmax", "x", ir.TensorRef("S")), env_s, lay_s, ("q", "x"))
    lse = evaluate(ir.Reduce("logsumexp", ("x",), ir.TensorRef("S")), env_s, lay_s, ("q",))
    assert (P[1] == 0).all() and lse[1] == -INF
    torch.testing.assert_close(P[[0, 2]], torch.softmax(S[[0, 2]], -1))
    torch.testing.assert_close(lse[[0, 2]], torch.logsumexp(S[[0, 2]], -1))


s, t = ir.TensorRef("s"), ir.TensorRef("t")
ONE_WIRE = {"s": ("i",), "t": ("i",)}


def ev1(e, env):
    """Evaluate over the one wire i of s and t."""
    return evaluate(e, env, ONE_WIRE, ("i",))


def autograd_1(e, s_val, t_val):
    """(value, d value / d s) by autograd, with s and t on wire i."""
    leaf = s_val.clone().requires_grad_()
    value = ev1(e, {"s": leaf, "t": t_val})
    if not value.requires_grad:
        return value.detach(), torch.zeros_like(s_val)
    (grad,) = torch.autograd.grad(value, leaf, torch.ones_like(value), allow_unused=True)
    return value.detach(), torch.zeros_like(s_val) if grad is None else grad


def assert_grad_matches(e, s_val, t_val):
    """diff(e, s) evaluated equals autograd wherever autograd is finite; never NaN there."""
    _, ref = autograd_1(e, s_val, t_val)
    sym = ev1(diff(e, s), {"s": s_val, "t": t_val})
    finite = torch.isfinite(ref)
    torch.testing.assert_close(sym[finite], ref[finite], rtol=1e-7, atol=1e-9)
    return sym, ref


# --------------------------------------------------------------------------
# diff: rules and masks
# --------------------------------------------------------------------------

MASK = B(">", t, N(0))


def test_mask_derivative_is_a_where_of_one_and_zero():
    assert diff(C("where", MASK, s, N(-INF)), s) == C("where", MASK, N(1), N(0))


def test_derivative_rules_have_the_documented_shape():
    assert diff(B("^", s, N(3)), s) == B("*", N(3), B("^", s, N(2)))
    # torch's conventions (the module's reference() under autograd): a tie of two varying
    # arguments splits evenly (torch.maximum), one against a constant follows the varying
    # one (torch.clamp), abs'(0) = 0 (expr hunt: napkin gave ties to the first, abs'(0) = 1)
    assert diff(C("max", s, t), s) == C("where", B(">", s, t), N(1), C("where", B("<", s, t), N(0), N(0.5)))
    assert diff(C("min", t, s), s) == C("where", B("<", t, s), N(0), C("where", B(">", t, s), N(1), N(0.5)))
    assert diff(C("max", s, N(0)), s) == C("where", B(">=", s, N(0)), N(1), N(0))
    assert diff(C("min", N(2), s), s) == C("where", B(">=", N(2), s), N(1), N(0))
    assert diff(C("relu", s), s) == C("where", B(">", s, N(0)), N(1), N(0))
    assert diff(C("abs", s), s) == C("where", B("<", s, N(0)), N(-1), C("where", B(">", s, N(0)), N(1), N(0)))
    # d/dp s^p: 0 where s = 0 and p >= 0 (torch's), not 0 * log(0) = NaN
    assert diff(B("^", s, t), t) == C("where", B("==", s, N(0)), C("where", B(">=", t, N(0)), N(0), N(-math.inf)),
                                      B("*", B("^", s, t), C("log", s)))
    assert diff(B("<", s, t), s) == N(0)
    assert diff(C("exp", t), s) == N(0)
    assert diff(ir.WireSize("d"), s) == N(0)


def test_wrt_may_be_any_subexpression():
    raw = ir.Reduce("sum", ("d",), B("*", ir.TensorRef("Q"), ir.TensorRef("K")))
    score = B("*", N(50), C("tanh", B("/", raw, N(50))))
    d = diff(score, raw)
    assert raw in list(ir.walk(d))  # the derivative reads the raw score back
    with pytest.raises(ValueError, match="sum"):
        diff(score, ir.TensorRef("Q"))  # Q is inside a reduction
    with pytest.raises(ValueError, match="softmax"):
        diff(ir.Normalize("softmax", "x", s), s)


U = B("+", B("*", s, t), B("*", N(0.5), s))       # an inner function of s for the chain rule
POS = B("+", N(1.5), C("tanh", U))                 # positive, for logs and roots
# One expression per rule (each with s on every side it can be on), checked
# deterministically; the random expressions below mix them.
RULE_CASES = [
    B("+", U, C("exp", s)), B("-", U, C("exp", s)), B("*", U, C("tanh", s)),
    B("/", U, POS), B("/", C("exp", U), B("+", N(2), s)), ir.Unary("-", U),
    B("^", U, N(3)), B("^", POS, N(-1.5)), B("^", N(1.5), U), B("^", POS, U),
    C("exp", U), C("exp2", U), C("log", POS), C("log2", POS), C("sqrt", POS), C("rsqrt", POS),
    C("tanh", U), C("sigmoid", U), C("abs", U), C("relu", U),
    C("max", U, B("*", s, s)), C("min", U, B("*", s, s)), C("max", t, U), C("min", U, t),
    C("where", B(">", U, t), B("*", s, s), C("exp", U)),
    C("where", B("and", B(">", t, N(0)), ir.Unary("not", B("<", s, N(0)))), U, N(2)),
]


@pytest.mark.parametrize("expr", RULE_CASES, ids=range(len(RULE_CASES)))
def test_each_rule_against_autograd(expr):
    g = torch.Generator().manual_seed(4)
    s_val, t_val = torch.randn(64, generator=g, dtype=F64), torch.randn(64, generator=g, dtype=F64)
    sym, ref = assert_grad_matches(expr, s_val, t_val)
    assert torch.isfinite(ref).all() and torch.isfinite(sym).all()


# Masked expressions whose derivative must be finite everywhere and exactly 0
# where the mask removes s.
MASKED = [
    C("where", MASK, s, N(-INF)),
    C("exp", C("where", MASK, B("*", s, N(2)), N(-INF))),
    B("*", C("where", MASK, s, N(-INF)), t),
    C("sigmoid", C("where", MASK, B("*", s, s), N(-INF))),
    C("tanh", B("-", C("where", MASK, s, N(-INF)), N(1))),
    C("exp", B("-", C("where", MASK, C("exp", s), N(-INF)), C("max", t, N(0)))),
    C("log", C("where", MASK, C("exp", s), N(0))),
    C("where", B("and", MASK, B("<", t, N(1))), C("exp", s), N(-INF)),
]


@pytest.mark.parametrize("expr", MASKED, ids=range(len(MASKED)))
def test_masked_derivatives_are_zero_not_nan(expr):
    g = torch.Generator().manual_seed(1)
    s_val, t_val = torch.randn(32, generator=g, dtype=F64), torch.randn(32, generator=g, dtype=F64)
    sym, ref = assert_grad_matches(expr, s_val, t_val)
    assert torch.isfinite(sym).all()
    assert (sym[t_val <= 0] == 0).all()


def _score_box(diagram):
    """The first box holding a contraction of inputs, and that contraction."""
    inputs = {i.name for i in diagram.inputs}
    for let in diagram.lets:
        raws = [n for n in ir.walk(let.expr) if isinstance(n, ir.Reduce) and n.op == "sum"]
        if raws and {n.name for n in ir.walk(let.expr) if isinstance(n, ir.TensorRef)} <= inputs:
            return let, raws[0]
    raise AssertionError("no score box")


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_score_derivative_of_every_example(path):
    diagram = parse(path.read_text(), str(path))
    let, raw = _score_box(diagram)
    wires = ir.axis_wires(let.axes)
    sizes = diagram_sizes(diagram)
    g = torch.Generator().manual_seed(2)
    env, layouts = random_inputs(diagram, sizes, g)
    R = ir.TensorRef("R")
    env["R"] = 3 * torch.randn([sizes[w] for w in wires], generator=g, dtype=F64)
    layouts["R"] = wires
    score = substitute(let.expr, raw, R)
    leaf = env["R"].clone().requires_grad_()
    value = evaluate(score, {**env, "R": leaf}, layouts, wires, sizes)
    (ref,) = torch.autograd.grad(value, leaf, torch.ones_like(value))
    sym = evaluate(substitute(diff(let.expr, raw), raw, R), env, layouts, wires, sizes)
    assert torch.isfinite(sym).all()
    torch.testing.assert_close(sym, ref, rtol=1e-9, atol=1e-12)
    # differentiating with respect to the placeholder gives the same expression
    assert substitute(diff(let.expr, raw), raw, R) == diff(score, R)


def test_alibi_slope_derivative():
    path = next(p for p in EXAMPLES if p.stem == "alibi")
    diagram = parse(path.read_text())
    let, _ = _score_box(diagram)
    sizes = diagram_sizes(diagram)
    env, layouts = random_inputs(diagram, sizes, torch.Generator().manual_seed(3))
    wires = ir.axis_wires(let.axes)
    leaf = env["slope"].clone().requires_grad_()
    value = evaluate(let.expr, {**env, "slope": leaf}, layouts, wires)
    (ref,) = torch.autograd.grad(value, leaf, torch.ones_like(value))
    d = diff(let.expr, ir.TensorRef("slope"))
    assert d == C("where", B("<=", ir.WireIndex("x"), ir.WireIndex("q")),
                  B("-", ir.WireIndex("x"), ir.WireIndex("q")), N(0))
    sym = evaluate(d, env, layouts, wires).sum(dim=(0, 2, 3))  # onto slope's wire h
    torch.testing.assert_close(sym, ref)


# --------------------------------------------------------------------------
# diff on random elementwise expressions
# --------------------------------------------------------------------------

def _sq1(a):  # 1 + a * a: positive, for log, sqrt and real powers
    return B("+", N(1), B("*", a, a))


def _grow(sub):
    pair = st.tuples(sub, sub)
    return st.one_of(
        st.tuples(st.sampled_from(["+", "-", "*"]), sub, sub).map(lambda p: B(*p)),
        pair.map(lambda p: B("/", p[0], _sq1(p[1]))),
        st.tuples(st.sampled_from(["exp", "tanh", "sigmoid"]), sub).map(lambda p: C(*p)),
        st.tuples(st.sampled_from(["log", "log2", "sqrt", "rsqrt"]), sub).map(lambda p: C(p[0], _sq1(p[1]))),
        sub.map(lambda a: C("exp2", C("tanh", a))),
        sub.map(lambda a: ir.Unary("-", a)),
        st.tuples(sub, st.sampled_from([2, 3])).map(lambda p: B("^", p[0], N(p[1]))),
        st.tuples(sub, st.sampled_from([-1.5, 0.5, 2.5])).map(lambda p: B("^", _sq1(p[0]), N(p[1]))),
        pair.map(lambda p: B("^", _sq1(p[0]), p[1])),               # general a^b
        pair.map(lambda p: B("^", N(1.5), B("*", p[0], p[1]))),     # constant base
        st.tuples(sub, sub, sub).map(lambda p: C("where", B(">", p[0], N(0)), p[1], p[2])),
        st.tuples(st.sampled_from(["max", "min"]), sub, sub).map(lambda p: C(*p)),
        st.tuples(st.sampled_from(["abs", "relu"]), sub).map(lambda p: C(*p)),
        sub.map(lambda a: C("exp", C("where", MASK, a, N(-INF)))),   # a -inf mask, then exp
        sub.map(lambda a: C("where", B("<", t, N(0.5)), a, N(-INF))),
    )


LEAVES = st.sampled_from([s, s, t, N(0), N(1), N(0.5), N(2), N(-1.5)])
EXPRS = st.recursive(LEAVES, _grow, max_leaves=8)


def _points(seed):
    """s uniform in (-1, 1) and t standard normal, 12 points each."""
    g = torch.Generator().manual_seed(seed)
    return 2 * torch.rand(12, generator=g, dtype=F64) - 1, torch.randn(12, generator=g, dtype=F64)


POINTS = st.integers(0, 2**31 - 1).map(_points)


def _tame(e, env) -> bool:
    """Every finite intermediate value is moderate (no overflow to hide an inf * 0)."""
    for node in ir.walk(e):
        v = ev1(node, env)
        if v.dtype == F64:
            fin = v[torch.isfinite(v)]
            if fin.numel() and fin.abs().max() > 1e6:
                return False
            if torch.isnan(v).any():
                return False
    return True


SETTINGS = settings(max_examples=150, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@SETTINGS
@given(EXPRS, POINTS)
def test_random_expression_derivatives(expr, points):
    s_val, t_val = points
    env = {"s": s_val, "t": t_val}
    assume(_tame(expr, env))
    assert_grad_matches(expr, s_val, t_val)


@SETTINGS
@given(EXPRS, POINTS)
def test_simplify_keeps_values_and_is_idempotent(expr, points):
    env = {"s": points[0], "t": points[1]}
    once = simplify(expr)
    assert simplify(once) == once
    torch.testing.assert_close(ev1(once, env), ev1(expr, env), equal_nan=True)
    d = diff(expr, s)
    assert simplify(d) == d  # diff's output is already simplified


# --------------------------------------------------------------------------
# simplify rules
# --------------------------------------------------------------------------

X_IDX, D_SIZE = ir.WireIndex("x"), ir.WireSize("d")


@pytest.mark.parametrize("before, after", [
    (B("*", s, N(1)), s),
    (B("*", N(1), s), s),
    (B("+", s, N(0)), s),
    (B("+", N(0), s), s),
    (B("-", s, N(0)), s),
    (B("-", N(0), s), ir.Unary("-", s)),
    (B("/", s, N(1)), s),
    (B("^", s, N(1)), s),
    (B("^", s, N(0)), N(1)),
    (B("^", N(1), s), N(1)),                               # IEEE pow(1, y) = 1, even for NaN
    (ir.Unary("-", ir.Unary("-", s)), s),
    (C("where", MASK, N(0), N(0)), N(0)),
    (C("where", MASK, N(1), N(1)), N(1)),
    (B("*", N(2), B("+", N(3), N(4))), N(14)),
    (B("*", X_IDX, N(0)), N(0)),                           # a wire index is finite
    (B("*", N(0), B("-", X_IDX, D_SIZE)), N(0)),
    (B("+", s, ir.Unary("-", t)), B("-", s, t)),
    (B("*", s, B("/", N(1), t)), B("/", s, t)),
    (B("+", s, s), B("*", N(2), s)),
    (C("exp", N(0)), N(1.0)),
    (C("max", N(2), N(3)), N(3)),
], ids=range(21))
def test_simplify_rules(before, after):
    assert simplify(before) == after


@pytest.mark.parametrize("kept", [
    B("*", s, N(0)),                      # s may be inf: inf * 0 is NaN
    B("*", N(0), B("^", D_SIZE, N(-0.5))),  # a power may be inf
    B("*", N(INF), N(0)),                 # NaN has no constant
    B("/", N(1), N(0)),
    B("^", D_SIZE, N(-0.5)),              # symbolic size: not a constant
    C("log", N(0)),
    C("where", MASK, N(1), N(0)),
    B("^", N(0), s),                      # 0^s is 0, 1 or inf
    B("-", s, s),                         # inf - inf is NaN
], ids=range(9))
def test_simplify_leaves_unsafe_forms_alone(kept):
    assert simplify(kept) == kept


def test_simplify_is_deterministic_and_keeps_untouched_nodes():
    e = B("*", C("exp", s), B("+", t, N(0)))
    assert simplify(e) == simplify(e) == B("*", C("exp", s), t)
    untouched = C("exp", B("-", s, t))
    assert simplify(untouched) is untouched
