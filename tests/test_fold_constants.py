"""Constant factors of products folded into one (napkin/codegen/products.py).

* ``fold_factors`` on IR expressions: chains of * and / with constants on
  either side, nested; a lone division by a constant becomes a multiply;
  nothing folds across +, where, max or a call (inside their arguments
  yes); conditions and nodes held in variables are left whole; a symbolic
  size folds with the numbers into one scalar; no 0, inf or subnormal
  constant is ever made;
* the Triton renderer folds, the reference does not: the soft-cap kernels
  multiply the score by one constant (no ``/ 50``), its reference keeps the
  diagram's literal form; the exponent's scale (scale.py) still comes out
  first and composes with the fold.
"""
from __future__ import annotations

import pytest

import napkin
from napkin import ir
from napkin.codegen import emit_module
from napkin.codegen.exprs import Ctx, fold, triton
from napkin.codegen.products import fold_factors
from napkin.printer import expr_text

from test_scale import REPO, score


def folded(text: str, d: str = "64", opaque=lambda n: False) -> str:
    fixed = {"d": int(d)} if d else {}
    return expr_text(fold_factors(score(text, d), lambda n: fold(n, fixed), opaque))


def same(text: str, d: str = "64") -> bool:
    """Nothing folds: the very expression comes back."""
    fixed = {"d": int(d)} if d else {}
    e = score(text, d)
    return fold_factors(e, lambda n: fold(n, fixed)) == e


@pytest.mark.parametrize("text, out", [
    ("R * 3 / 4", "sum[d](Q * K) * 0.75"),
    ("2 * (3 * R)", "6 * sum[d](Q * K)"),
    ("R / 4", "sum[d](Q * K) * 0.25"),                       # a lone x / c: a multiply
    ("R / 3", f"sum[d](Q * K) * {1 / 3!r}"),
    ("R * |d|^-0.5 / 50", "sum[d](Q * K) * 0.0025"),
    ("2 / R / 4", "0.5 / sum[d](Q * K)"),                    # C where the first multiplying constant was
    ("R * 2 / T * 3", "sum[d](Q * K) * 6 / T"),              # the other factors keep their shape
    ("T / (2 * R) / 4", "T / sum[d](Q * K) * 0.125"),        # every constant divides: C on the right
    ("T * (2 * (R * 0.5))", "T * (1.0 * sum[d](Q * K))"),
    ("50 * tanh(R * |d|^-0.5 / 50)", "50 * tanh(sum[d](Q * K) * 0.0025)"),  # inside a call's argument
    ("where(T > 0, R * 2 * 3, T)", "where(T > 0, sum[d](Q * K) * 6, T)"),
    ("max(R * 2 / 4, T)", "max(sum[d](Q * K) * 0.5, T)"),
    ("R * 1e-3 * 1e-3", "sum[d](Q * K) * 1e-06"),
    ("-(R * 2 * 3) + 1", "-(sum[d](Q * K) * 6) + 1"),
])
def test_chains_fold(text, out):
    assert folded(text) == out


@pytest.mark.parametrize("text", [
    "R * 2",                            # one constant: nothing to fold
    "2 * R * T",
    "R * 2 + R * 3",                    # no reassociation of sums
    "(R * 2 + 1) * 3",                  # nor across one
    "2 * tanh(R) * T",
    "tanh(R * 2) * 3",                  # nor into a call
    "where(T > 0, R * 2, T) * 3",       # nor into a where
    "max(R * 2, T) * 3",
    "where(R * 2 * 3 > 0, T, R)",       # a condition is left as written
    "R * 1e-30 * 1e-30",                # 1e-60: 0 in float32
    "R * 1e-20 * 1e-20",                # 1e-40: subnormal in float32
    "R * 1e30 * 1e30",                  # inf in float32
    "R * 0 * 2",
    "R * inf / 2",
    "R / 0",
    "T * 1e-3 * 1e-3",                  # a tensor as loaded may be float16: 1e-6 is subnormal there
    "T * 300 * 300",                    # and 9e4 overflows it
    "R * T",
])
def test_left_alone(text):
    assert same(text), folded(text)


def test_symbolic_size_folds_into_one_scalar():
    assert folded("R * |d|^-0.5 / 50", d="") == "sum[d](Q * K) * (|d|^-0.5 * 0.02)"
    assert folded("R / |d| / 2", d="") == "sum[d](Q * K) * (0.5 / |d|)"
    assert folded("2 * |d| * R", d="") == "2 * |d| * sum[d](Q * K)"  # one constant leaf already
    assert folded("2 * (|d| * R) * 3", d="") == "|d| * 6 * sum[d](Q * K)"
    # rendered: the per-element work is one multiply by a scalar expression
    e = score("R * |d|^-0.5 / 50", d="")
    qk = e.lhs.lhs
    code = triton(e, Ctx(index={}, size={"d": "_size_d"}, fixed={}, subst={qk: "_qk"}))
    assert code == "_qk * (tl.exp2(-0.5 * tl.log2(_size_d * 1.0)) * 0.02)"


def test_nodes_held_in_variables_stay_whole():
    e = score("R * 2 * 3 + T")
    held = e.lhs
    assert fold_factors(e, lambda n: fold(n, {"d": 64}), lambda n: n == held) == e
    # the renderer finds the variable of a node it holds
    assert triton(e, Ctx(index={}, size={}, fixed={"d": 64}, subst={held: "_h", ir.TensorRef("T"): "_T"})) == "_h + _T"


def test_pure_and_deterministic():
    e = score("2 * (3 * R) / T / 4")
    before = expr_text(e)
    once = fold_factors(e, lambda n: fold(n, {"d": 64}))
    assert expr_text(e) == before
    assert once == fold_factors(e, lambda n: fold(n, {"d": 64}))
    assert fold_factors(once, lambda n: fold(n, {"d": 64})) == once  # a fixed point


def test_folded_constant_rounds_once():
    """C is computed in float64 from the literals: one rounding to float32 in the kernel."""
    assert folded("R * |d|^-0.5 / 50", d="128") == f"sum[d](Q * K) * {128 ** -0.5 / 50!r}"


def softcap_source() -> str:
    d = napkin.load(REPO / "examples" / "softcap.ncd")
    return emit_module(d, source_text=(REPO / "examples" / "softcap.ncd").read_text(),
                       source_path="examples/softcap.ncd")


def test_softcap_kernels_multiply_once_reference_literal():
    src = softcap_source()
    kernels, reference = src.split("\ndef reference(", 1)
    # every kernel (forward step, dQ, dK/dV): the score is one multiply, no division by 50
    assert "/ 50" not in kernels
    assert kernels.count("_tanh(_qk * 0.0017677669529663688)") >= 6
    # the derivative 50 * (c / 50 * (1 - t^2)): one constant, applied once to each gradient at its store
    assert "_dS * (1 - _tanh(" in kernels and "_scaled_grad(_acc_K, 0.08838834764831845, " in kernels
    assert "_scaled_grad(_acc_Q, 0.08838834764831845, " in kernels and "0.08838834764831845 * (1 - " not in kernels
    # scale.py's factor first (50 * log2(e) into the exponent), the fold inside t
    assert "_tanh(_qk * 0.0017677669529663688) * 72.13475204444816" in kernels
    # the reference reads as the diagram
    assert "/ 50" in reference and "50 * torch.tanh(" in reference



@pytest.mark.parametrize("text, out", [
    ("T / (2 * R)", None),                         # 0.5 would multiply every element
    ("T / (R * 2 * 3)", None),
    ("3 * T / (2 * R)", "1.5 * T / sum[d](Q * K)"),  # a multiplying constant takes it
])
def test_a_constant_inside_a_divisor_stays_without_a_place_for_it(text, out):
    """x / (2 * y): taking the 2 out would multiply every element by 0.5,
    where 2 * y may be once a row (L2 attention's backward divides by
    2 * sqrt(Z), Z a row value); with a multiplying constant, or a whole
    divisor (above: T / (2 * R) / 4), C has a place that costs nothing."""
    if out is None:
        assert same(text)
    else:
        assert folded(text) == out


def test_integer_powers_past_64_bits_fold_to_floats_and_fast():
    """``10 ^ 10 ^ 10`` made compile hang on a ten-billion-digit integer (the
    derivative's fold and the renderer's); ``10 ^ 40`` and a literal past 64
    bits were emitted as integers Triton refuses ("Nonrepresentable integer")
    and torch cannot convert."""
    import time

    from napkin.codegen.exprs import number

    assert ir.power(10, 18) == 10 ** 18 and isinstance(ir.power(10, 18), int)
    assert ir.power(10, 40) == 1e40 and isinstance(ir.power(10, 40), float)
    assert ir.power(-10, 10 ** 10 + 1) == float("-inf") and ir.power(10, 10 ** 10) == float("inf")
    assert ir.power(2, -1) == 0.5 and ir.power(-2, 63) == -2 ** 63
    assert number(2 ** 63 - 1) == str(2 ** 63 - 1) and number(2 ** 63) == "9.223372036854776e+18"
    assert number(-2 ** 63) == str(-2 ** 63) and number(10 ** 23) == "1e+23"
    text = (REPO / "examples" / "attention.ncd").read_text().replace(
        "= sum[d](Q * K) * |d|^-0.5",
        "= where(x < 10 ^ 10 ^ 10, sum[d](Q * K) * |d|^-0.5 * (1 + x / 99999999999999999999999) * (1 + x / 10 ^ 10 ^ 10), -inf)")
    start = time.monotonic()
    module = emit_module(napkin.load_text(text, "big.ncd"), source_text=text, source_path="big.ncd")
    assert time.monotonic() - start < 30
    assert "99999999999999999999999" not in module and "1e+23" in module
