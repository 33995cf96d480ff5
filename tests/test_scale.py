"""The exponent's positive scale folded into log2(e) (napkin/codegen/scale.py).

* ``factor`` on IR expressions: what comes out as a positive constant c and
  what must not (a negative constant, a tensor of unknown sign, a sum);
* the emitted source: the causal forward's full step is one multiply by
  the folded constant per score (row max taken unscaled), the backward
  recomputes P with exp2 against a per-row lse * log2(e); a score box read
  elsewhere keeps its value;
* numerics at the edges, forward and backward against float64: large
  scores, fully masked rows, +inf and -inf scores, ragged sizes, fp32 and
  fp16, on causal and soft-capped attention (TRITON_INTERPRET=1).
"""
from __future__ import annotations

import importlib.util
import re
import sys
import zlib
from pathlib import Path

import pytest
import torch

import napkin
from napkin import ir
from napkin.codegen import emit_module
from napkin.codegen.exprs import fold
from napkin.codegen.scale import LOG2E, factor, log2_scale, positive
from napkin.parse import parse
from napkin.printer import expr_text

REPO = Path(__file__).resolve().parent.parent
EPS = {torch.float16: 2.0 ** -10, torch.float32: 2.0 ** -23}


# --------------------------------------------------------------------------
# factor(): c * t on IR expressions.
# --------------------------------------------------------------------------

def score(text: str, d: str = "64") -> ir.Expr:
    """The expression of a box S over (q, x), parsed; R is sum[d](Q * K), T a tensor."""
    size = f" = {d}" if d else ""
    src = (f"diagram t\nwire q, x\nwire d{size}\nin Q[q, d] : fp32\nin K[x, d] : fp32\nin T[q, x] : fp32\n"
           f"S[q, x] = {text.replace('R', 'sum[d](Q * K)')}\nout S\n")
    return parse(src).lets[0].expr


def factored(text: str, d: str = "64"):
    """(c folded to a number or None, t as text) of an expression."""
    fixed = {"d": int(d)} if d else {}
    c, t = factor(score(text, d), fixed)
    return (None if c is None else fold(c, fixed)), expr_text(t)


@pytest.mark.parametrize("text, c, t", [
    ("R * 0.125", 0.125, "sum[d](Q * K)"),
    ("0.5 * R", 0.5, "sum[d](Q * K)"),
    ("R * |d|^-0.5", 0.125, "sum[d](Q * K)"),
    ("R / 8", 0.125, "sum[d](Q * K)"),
    ("2 * (R * 3) / 4", 1.5, "sum[d](Q * K)"),
    ("(2 * T) * (R * |d|)", 128, "T * sum[d](Q * K)"),
    ("where(x <= q, R * 0.125, -inf)", 0.125, "where(x <= q, sum[d](Q * K), -inf)"),
    ("where(x > q, -inf, R / 4)", 0.25, "where(x > q, -inf, sum[d](Q * K))"),
    ("50 * tanh(R * 0.125 / 50)", 50, "tanh(sum[d](Q * K) * 0.125 / 50)"),
])
def test_positive_constants_come_out(text, c, t):
    got_c, got_t = factored(text)
    assert got_c == pytest.approx(c, rel=1e-15) and got_t == t


@pytest.mark.parametrize("text", [
    "R * -0.5",                           # negative: max does not commute, c * -inf = +inf
    "R * (1 - 2)",
    "R * 0",                              # zero is not positive
    "R * T",                              # a tensor of unknown sign
    "R * 0.125 + T",                      # a sum (ALiBi's score)
    "where(x <= q, R * 0.125, 0)",        # a fill other than -inf
    "tanh(R * 0.125)",                    # nothing to take out of a function
    "R",
])
def test_nothing_comes_out(text):
    e = score(text)
    assert factor(e, {"d": 64}) == (None, e)


def test_a_gradient_passes_a_zero_fill():
    """The backward's fills: c * where(p, t, 0) = where(p, c * t, 0) for c > 0."""
    c, t = factor(score("where(x <= q, R * 0.125, 0)"), {"d": 64}, fills=(0.0,))
    assert fold(c, {"d": 64}) == 0.125 and expr_text(t) == "where(x <= q, sum[d](Q * K), 0)"


def test_symbolic_size_stays_an_expression():
    e = score("where(x <= q, R * |d|^-0.5, -inf)", d="")
    c, t = factor(e, {})
    assert expr_text(c) == "|d|^-0.5" and expr_text(t) == "where(x <= q, sum[d](Q * K), -inf)"
    k = log2_scale(c, {})
    assert not isinstance(k, float) and fold(k, {"d": 16}) == pytest.approx(0.25 * LOG2E)
    assert log2_scale(None, {}) == LOG2E


def test_positive_is_proved_not_guessed():
    fixed = {}
    assert positive(ir.Binary("^", ir.WireSize("d"), ir.Num(-0.5)), fixed)
    assert positive(ir.Binary("/", ir.Num(3), ir.WireSize("d")), fixed)
    assert not positive(ir.Binary("-", ir.WireSize("d"), ir.Num(1)), fixed)    # |d| - 1 may be 0
    assert not positive(ir.Unary("-", ir.WireSize("d")), fixed)
    assert not positive(ir.Num(float("inf")), fixed)
    assert not positive(ir.TensorRef("T"), fixed)


def test_held_nodes_are_not_opened():
    e = score("R * 0.125")
    assert factor(e, {"d": 64}, opaque=lambda n: n == e) == (None, e)


# --------------------------------------------------------------------------
# The emitted source.
# --------------------------------------------------------------------------

def emitted(name: str, *replace) -> str:
    text = (REPO / "examples" / f"{name}.ncd").read_text()
    for old, new in replace:
        assert old in text
        text = text.replace(old, new)
    return emit_module(napkin.load_text(text, f"{name}.ncd"), source_text=text, source_path=f"{name}.ncd")


def kernel(src: str, name: str) -> str:
    found = re.search(rf"\ndef {name}\(.*?(?=\n@triton\.jit|\ndef [a-z])", src, re.S)
    assert found, name
    return found.group(0)


def full_step(body: str) -> str:
    """The loop over full blocks (the unmasked copy of the step), its code without comments."""
    step = body.split("# Full blocks:")[1].split("# Partial blocks after:")[0]
    return "\n".join(line for line in step.splitlines() if not line.lstrip().startswith("#"))


def test_causal_forward_full_step_is_one_multiply_by_the_folded_constant():
    c = repr(0.125 * LOG2E)
    step = full_step(kernel(emitted("causal"), "_causal_kernel"))
    assert f"_p = tl.exp2(_qk * {c} - _m_use)" in step
    assert f"tl.max(_qk, 1)[:, None] * {c})" in step           # the row max, unscaled, then scaled once
    assert step.count(f"* {c}") == 2 and "_S =" not in step      # no dead score line
    assert repr(LOG2E) not in step and "* 0.125" not in step     # neither constant on its own


def test_causal_backward_recomputes_p_with_exp2_and_a_per_row_lse():
    c = repr(0.125 * LOG2E)
    lse2 = f'_lse2 = tl.where(_lse == float("-inf"), 0, _lse) * {LOG2E!r}'
    src = emitted("causal")
    for name, loops in (("_causal_bwd_dq_kernel", 2), ("_causal_bwd_dkdv_kernel", 3)):
        body = kernel(src, name)
        assert "tl.exp(" not in body and "_S =" not in body, name
        assert f"_P = tl.exp2(_qk * {c} - _lse2)" in full_step(body), name
        assert body.count("- _lse2)") == loops, name           # every loop's step
        assert "_dS * 0.125" not in full_step(body), name        # the chain rule's factor: at the store (below)
    # dQ holds its rows: lse2 once, before the loop; dK/dV loads rows per step: lse2 right after each load
    dq = kernel(src, "_causal_bwd_dq_kernel")
    assert dq.count(lse2) == 1 and dq.index(lse2) < dq.index("for _start")
    dkdv = kernel(src, "_causal_bwd_dkdv_kernel")
    assert dkdv.count(lse2) == 3
    for part in dkdv.split("for _rb")[1:]:   # on the row vector just loaded, before the step's tiles
        assert part.index("_lse = tl.sum(tl.load(") < part.index("_lse2 =") < part.index("tl.dot(")


def test_softcap_folds_its_cap_and_alibi_only_log2e():
    soft = kernel(emitted("softcap"), "_softcap_kernel")
    cap = repr(50 * LOG2E)
    # t keeps the rest of the score, its constants folded into one (products.py)
    assert f"_s = _tanh(_qk * {128 ** -0.5 / 50!r})" in full_step(soft)
    assert f"_p = tl.exp2(_s * {cap} - _m_use)" in full_step(soft) and "_S =" not in soft
    alibi = kernel(emitted("alibi"), "_alibi_kernel")                      # a sum: nothing comes out
    assert "_S = _qk * 0.125 + _slope" in full_step(alibi)
    assert f"_p = tl.exp2(_S * {LOG2E!r} - _m_use)" in full_step(alibi)


MAXED = """diagram maxed
wire b, h, q, x
wire d = 16
in Q[b, h, q, d] : fp32
in K[b, h, x, d] : fp32
in V[b, h, x, d] : fp32
S[b, h, q, x] = where(x <= q, sum[d](Q * K) * |d|^-0.5, -inf)
O[b, h, q, d] = sum[x](softmax[x](S) * V)
M[b, h, q] = max[x](S)
out O, M
schedule { level smem { group b by 1, h by 1, q by 32
stream x by 16 } }
"""


def stores(body: str, acc: str) -> list[str]:
    """The lines of a kernel that store the accumulator ``acc``."""
    return [line for line in body.splitlines() if "store(" in line and acc in line]


@pytest.mark.parametrize("name, c", [("causal", 0.125), ("softcap", 128 ** -0.5), ("alibi", 0.125)])
def test_backward_scales_its_gradient_accumulators_once_at_the_store(name, c):
    """dR = dS * c (softcap: c * (1 - tanh^2)) with c constant: the steps
    accumulate dS (times the rest) and each of dK, dQ is scaled once, at
    its store, by c; ALiBi's slope gradient reads dS, not dR, and keeps it."""
    src = emitted(name)
    for kname, acc in ((f"_{name}_bwd_dkdv_kernel", "_acc_K"), (f"_{name}_bwd_dq_kernel", "_acc_Q")):
        body = kernel(src, kname)
        assert f"_dS * {c!r}" not in body and f"{c!r} * (1 - " not in body, kname   # no multiply a score
        assert stores(body, acc) and all(f"_scaled_grad({acc}, {c!r}, Q.dtype.element_ty).to(" in line
                                         for line in stores(body, acc)), kname
    if name == "alibi":
        assert "_slope" in kernel(src, "_alibi_bwd_dq_kernel") and "_dS" in kernel(src, "_alibi_bwd_dq_kernel")


def test_a_float16_backward_scales_each_tile_before_its_cast(tmp_path):
    """The factor goes to the store only where the product's operands keep
    float32's range: in float16 the unscaled dS can pass 65504 where
    dS * 0.125 does not (loss-scaled training: small scores, a large
    upstream gradient), and cast unscaled it was inf: dQ and dK NaN."""
    text = (REPO / "examples" / "attention.ncd").read_text().replace("wire d = 64", "wire d = 16")
    m = load(emit_module(napkin.load_text(text, "ovf.ncd"), source_text=text, source_path="ovf.ncd"), "ovf", tmp_path)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(*shape, generator=gen) * s for shape, s in
               (((1, 2, 19, 16), 0.02), ((1, 2, 21, 16), 0.02), ((1, 2, 21, 16), 1000.0)))
    up = torch.randn(1, 2, 19, 16, generator=gen) * 150
    exact = [t.double().requires_grad_() for t in (q, k, v)]
    m.reference(*exact)[0].backward(up.double())
    got = [t.half().requires_grad_() for t in (q, k, v)]
    launcher(m)(*got, **BLOCKS)[0].backward(up.half())
    for i, (g, e) in enumerate(zip(got, exact)):
        assert torch.isfinite(g.grad).all(), f"gradient {i}"
        assert (g.grad.double() - e.grad).abs().max() <= 2e-3 * e.grad.abs().max(), f"gradient {i}"


@pytest.mark.parametrize("c", [64, -64])
def test_a_float16_factor_above_one_waits_for_the_store(tmp_path, c):
    """With |c| >= 1 it is c * dS that can pass 65504 where dS and the
    gradient do not: cast before the factor, scaled at the store (a score
    times 64 gave 80 of 592 dQ and dK entries inf or NaN; a helper's hunt)."""
    text = (REPO / "examples" / "attention.ncd").read_text().replace("wire d = 64", "wire d = 16") \
        .replace("|d|^-0.5", str(c))
    assert f"* {c}" in text
    m = load(emit_module(napkin.load_text(text, "big.ncd"), source_text=text, source_path="big.ncd"), "big", tmp_path)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*shape, generator=gen) * s for shape, s in
               (((1, 1, 37, 16), 0.1), ((1, 1, 37, 16), 0.1), ((1, 1, 37, 16), 1.0)))
    up = torch.randn(1, 1, 37, 16, generator=gen) * 500
    exact = [t.half().double().requires_grad_() for t in (q, k, v)]
    m.reference(*exact)[0].backward(up.half().double())
    got = [t.half().requires_grad_() for t in (q, k, v)]
    launcher(m)(*got, **BLOCKS)[0].backward(up.half())
    assert max(e.grad.abs().max() for e in exact[:2]) > 4000       # large, but float16 holds them
    for i, (g, e) in enumerate(zip(got, exact)):
        assert torch.isfinite(g.grad).all(), f"gradient {i}"
        assert (g.grad.double() - e.grad).abs().max() <= 5e-3 * e.grad.abs().max(), f"gradient {i}"


def test_a_gradient_factor_that_is_not_constant_stays_in_the_step():
    """A temperature tensor multiplying the contraction: dR = dS * tau is no constant."""
    src = emit_module(napkin.load_text(TEMPERATURE, "temperature.ncd"), source_text=TEMPERATURE,
                      source_path="temperature.ncd")
    body = kernel(src, "_temperature_bwd_dkdv_kernel")
    assert "_dR = _dS * _tau" in body.replace("_tau_1", "_tau") or "_dS * _tau" in body
    assert all("_scaled_grad(" not in line for line in stores(body, "_acc_K"))


TEMPERATURE = """diagram temperature
wire b, h, q, x
wire d = 32
in Q[b, h, q, d] : fp32
in K[b, h, x, d] : fp32
in V[b, h, x, d] : fp32
in tau[h] : fp32
S[b, h, q, x] = sum[d](Q * K) * tau
O[b, h, q, d] = sum[x](softmax[x](S) * V)
out O
schedule { level smem { group b by 1, h by 1, q by 16
stream x by 16 } }
"""


def test_a_score_read_elsewhere_keeps_its_value(tmp_path):
    src = emit_module(napkin.load_text(MAXED, "maxed.ncd"), source_text=MAXED, source_path="maxed.ncd")
    step = full_step(kernel(src, "_maxed_kernel"))
    assert "_S = _qk * 0.25" in step and f"_p = tl.exp2(_S * {LOG2E!r} - _m_use)" in step
    m = load(src, "maxed", tmp_path)
    inputs = m.example_inputs({"b": 1, "h": 2, "q": 45, "x": 45}, dtype=torch.float32)
    forward_matches(m, inputs, "maxed")


# --------------------------------------------------------------------------
# Numerics at the edges, against float64.
# --------------------------------------------------------------------------

_MODULES: dict = {}


def load(src: str, key: str, folder: Path):
    if key not in _MODULES:
        path = folder / f"{key}.py"
        path.write_text(src)
        spec = importlib.util.spec_from_file_location(f"_napkin_scale_{key}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module   # torch.library wants to find the op's module
        spec.loader.exec_module(module)
        _MODULES[key] = module
    return _MODULES[key]


# Rows 0..2 see no key (fully masked) in both; softcap's cap is folded through the mask.
EDGES = {
    "causal": [("x <= q", "x + 3 <= q")],
    "softcap": [("50 * tanh(sum[d](Q * K) * |d|^-0.5 / 50)",
                 "where(x + 3 <= q, 50 * tanh(sum[d](Q * K) * |d|^-0.5 / 50), -inf)")],
}
BLOCKS = {"block_q": 16, "block_x": 16}
SIZES = {"b": 1, "h": 2, "q": 45, "x": 37}    # ragged: neither a multiple of the blocks


def launcher(m):
    """The module's launcher: the function its forward kernel is named after."""
    return next(getattr(m, n[1:-len("_kernel")]) for n in vars(m)
                if n.startswith("_") and n.endswith("_kernel") and "_bwd_" not in n and not n.endswith("_ranges_kernel"))


def edge_module(name: str, folder: Path):
    src = emitted(name, *EDGES[name])
    return load(src, f"{name}_{zlib.crc32(src.encode())}", folder)


def large(m, dtype, seed):
    """Inputs whose scores reach thousands (fp16 inputs stay finite)."""
    q, k, v = m.example_inputs(SIZES, dtype=dtype, seed=seed)
    return q * 12, k * 12, v


def forward_matches(m, inputs, label):
    """Non-finite entries exactly as float64's; the rest within twice the
    same-dtype reference's error plus 4 ulps of the output's scale."""
    outs = launcher(m)(*inputs, **BLOCKS)
    outs = outs if isinstance(outs, tuple) else (outs,)
    exact = m.reference(*[t.double() for t in inputs])
    same = m.reference(*inputs)
    exact, same = (exact if isinstance(exact, tuple) else (exact,)), (same if isinstance(same, tuple) else (same,))
    for k, e, s in zip(outs, exact, same):
        k = k.double()
        assert torch.equal(torch.isnan(k), torch.isnan(e)), f"{label}: NaN pattern"
        inf = torch.isinf(e)
        assert torch.equal(torch.isinf(k), inf) and torch.equal(k[inf], e[inf]), f"{label}: inf pattern"
        fin = torch.isfinite(e)
        err_k = (k - e)[fin].abs().max().item()
        err_r = (s.double() - e)[fin].abs().max().item()
        scale = max(1.0, e[fin].abs().max().item())
        assert err_k <= 2 * err_r + 4 * EPS[s.dtype] * scale, \
            f"{label}: error {err_k:.3g} vs the same-dtype reference's {err_r:.3g}"
    return outs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("name", ["causal", "softcap"])
def test_forward_at_the_edges(name, dtype, tmp_path):
    m = edge_module(name, tmp_path)
    q, k, v = large(m, dtype, seed=1)
    k[..., 0] = k[..., 0].abs() + 0.5
    q[0, 1, 20, 0] = float("inf")     # that row's every score: +inf (softcap: the cap)
    q[0, 0, 30, 0] = float("-inf")    # and -inf (softcap: minus the cap)
    outs = forward_matches(m, (q, k, v), f"{name} {dtype}")
    o = outs[0]
    assert torch.equal(o[:, :, :3], torch.zeros_like(o[:, :, :3]))      # rows that see no key give 0
    if name == "causal":
        lse = outs[1]
        assert torch.isneginf(lse[:, :, :3]).all() and torch.isneginf(lse[0, 0, 30])
        assert lse[0, 1, 20] == float("inf") and torch.isnan(o[0, 1, 20]).all()
        assert torch.equal(o[0, 0, 30], torch.zeros_like(o[0, 0, 30]))


def gradients(fn, inputs, seed=7, **opts):
    """d(sum(out_i * W_i)) / d(inputs), W_i random; an output's non-finite entries weigh 0."""
    xs = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = fn(*xs, **opts)
    out = out if isinstance(out, tuple) else (out,)
    gen = torch.Generator().manual_seed(seed)
    loss = sum(torch.where(torch.isfinite(o.double()), o.double() * torch.randn(o.shape, generator=gen,
                                                                                dtype=torch.float64), 0.0).sum()
               for o in out)
    loss.backward()
    return [x.grad for x in xs]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("name", ["causal", "softcap"])
def test_backward_at_the_edges(name, dtype, tmp_path):
    """Large scores and fully masked rows (the gradients must stay finite, so
    no infinite input here: 0 * inf would be NaN in any implementation).

    The rule is test_backward.py's with one more floor term: P = exp(S - lse)
    recomputed in float32 from the saved lse carries an error of about an ulp
    of the exponent's magnitude |S| (the forward's rounding, before this
    change as after it), so at scores in the hundreds the floor counts ulps
    of |S|, not of 1.  A wrong constant or lse in log2 units is off by far more."""
    m = edge_module(name, tmp_path)
    inputs = large(m, dtype, seed=2)
    q, k = (t.double() for t in inputs[:2])
    magnitude = (torch.einsum("bhqd,bhxd->bhqx", q, k) * q.shape[-1] ** -0.5).abs().max().item()
    magnitude = min(magnitude, 50.0) if name == "softcap" else magnitude
    got = gradients(launcher(m), inputs, **BLOCKS)
    exact = gradients(m.reference, [t.double() for t in inputs])
    same = gradients(m.reference, inputs)
    for i, (g, e, s) in enumerate(zip(got, exact, same)):
        assert torch.isfinite(g).all(), f"{name}: gradient {i} is not finite"
        err_k = (g.double() - e).abs().max().item()
        err_r = (s.double() - e).abs().max().item()
        scale = max(1.0, e.abs().max().item())
        floor = 4 * EPS[dtype] * scale + 2 * EPS[torch.float32] * (2 + magnitude) * scale
        assert err_k <= 2 * err_r + floor, \
            f"{name} {dtype}: gradient {i}: error {err_k:.3g} vs the same-dtype reference's {err_r:.3g}"
    assert torch.equal(got[0][:, :, :3], torch.zeros_like(got[0][:, :, :3]))   # queries that see no key


SYMBOLIC = """diagram named
wire b, h, q, x, d
in scale[b, h, q, d] : fp32
in lse2[b, h, x, d] : fp32
in V[b, h, x, d] : fp32
S[b, h, q, x] = where(x <= q, sum[d](scale * lse2) * |d|^-0.5, -inf)
O[b, h, q, d] = sum[x](softmax[x](S) * V)
out O
schedule { level smem { group b by 1, h by 1, q by 16
stream x by 16 } }
"""


def test_symbolic_scale_is_one_scalar_and_user_names_do_not_clash(tmp_path):
    """|d| symbolic: C = |d|^-0.5 * log2(e) is computed once per program
    (``_scale``); inputs named scale and lse2 get other variables."""
    src = emit_module(napkin.load_text(SYMBOLIC, "named.ncd"), source_text=SYMBOLIC, source_path="named.ncd")
    fwd = kernel(src, "_named_kernel")
    assert fwd.count("_scale = ") == 1 and fwd.index("_scale = ") < fwd.index("for _start")
    assert "_p = tl.exp2(_qk * _scale - _m_use)" in full_step(fwd)
    m = load(src, "named", tmp_path)
    inputs = m.example_inputs({"b": 1, "h": 2, "q": 37, "x": 29, "d": 24}, dtype=torch.float32)
    forward_matches(m, inputs, "named")
    got = gradients(m.named, inputs, **BLOCKS)
    exact = gradients(m.reference, [t.double() for t in inputs])
    for k, e in zip(got, exact):
        assert (k.double() - e).abs().max().item() < 1e-4
