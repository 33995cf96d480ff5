"""Printing: parse(to_text(d)) == d, canonical and idempotent output.

Equality of diagrams ignores locations; the tests also compare ``repr``s,
which tell an int from an equal float (``Num(2)`` vs ``Num(2.0)``), so a
number that comes back with another type fails too.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import napkin
from napkin import ir
from napkin.check import check
from napkin.parse import parse
from napkin.printer import expr_text, to_text

from strategies import any_diagrams, attention_diagrams, matmul_diagrams

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.ncd"))
PROPERTY = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def assert_round_trip(d: ir.Diagram) -> str:
    text = to_text(d)
    back = parse(text, "<printed>")
    assert back == d, text
    assert repr(back) == repr(d), text
    assert to_text(back) == text  # idempotent
    return text


# --------------------------------------------------------------------------
# The shipped examples.
# --------------------------------------------------------------------------

def test_there_are_examples():
    assert len(EXAMPLES) >= 5


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_round_trips(path):
    d = parse(path.read_text(), str(path))
    text = assert_round_trip(d)
    # The printed text is a valid diagram in its own right, not just parseable.
    assert napkin.load_text(text, "<printed>") == napkin.load(path)


def test_layout_locations_move_with_printing_but_do_not_count():
    d = parse("diagram t\nwire b,hk,g\nin Q[b,(hk   g)] : fp16\nS[(hk g),b] = Q\nout S\n")
    back = parse(to_text(d))
    assert back == d and repr(back) == repr(d)
    assert back.inputs[0].wire_locs != d.inputs[0].wire_locs      # printing re-spaced the layout
    assert [len(t.wire_locs) for t in back.inputs + back.lets] == [3, 3]


def test_canonical_form_of_an_example():
    source = """
    # comments and layout do not survive printing
    diagram  causal
    wire b, h
    wire d=64
    wire q, x
    in Q[b,h,q,d]:fp16
    in K[b,h,x,d]:fp16
    in V[b,h,x,d]:fp16
    S[b,h,q,x] = where((x <= q), (sum[d](Q*K)) * (|d| ^ (-0.5)), (-inf))
    P[b,h,q,x] = softmax[x](S)
    O[b,h,q,d]:fp16 = sum[x](P*V)
    out O
    schedule on h100 { level smem capacity 232448 { group b by 1, h by 1 group q by 128 stream x by 64 hold S hold P }
      allow tf32 level regs capacity 65536 B {} }
    """
    assert to_text(parse(source)) == """\
diagram causal

wire b, h
wire d = 64
wire q, x

in Q[b, h, q, d] : fp16
in K[b, h, x, d] : fp16
in V[b, h, x, d] : fp16

S[b, h, q, x] = where(x <= q, sum[d](Q * K) * |d|^-0.5, -inf)
P[b, h, q, x] = softmax[x](S)
O[b, h, q, d] : fp16 = sum[x](P * V)

out O

schedule on h100 {
  accumulate fp32
  allow tf32
  level smem capacity 227 KiB {
    group b by 1, h by 1, q by 128
    stream x by 64
    hold S, P
  }
  level regs capacity 64 KiB {}
}
"""


def test_minimal_diagram():
    d = ir.Diagram("empty", (), (), (), ())
    assert assert_round_trip(d) == "diagram empty\n"


def test_schedule_without_profile_and_one_line_levels():
    d = ir.Diagram("s", (), (), (), (), ir.Schedule(None, "fp16", False, (
        ir.Level("hbm", None, (), ("A",)),
        ir.Level("devices", None, (ir.Tile("q", "group", 2, True), ir.Tile("x", "stream", 4, True)), ()),
    )))
    text = assert_round_trip(d)
    assert "schedule {\n  accumulate fp16\n  level hbm { hold A }\n  level devices {\n" in text
    assert "    group q across 2\n    stream x across 4\n" in text


# --------------------------------------------------------------------------
# Expressions: the fewest parentheses that keep the meaning.
# --------------------------------------------------------------------------

a, b, c = ir.TensorRef("a"), ir.TensorRef("b"), ir.TensorRef("c")
q, x = ir.WireIndex("q"), ir.WireIndex("x")


def B(op, lhs, rhs):
    return ir.Binary(op, lhs, rhs)


def neg(e):
    return ir.Unary("-", e)


def N(v):
    return ir.Num(v)


EXPRESSIONS = [
    (B("-", B("-", a, b), c), "a - b - c"),
    (B("-", a, B("-", b, c)), "a - (b - c)"),
    (B("/", a, B("*", b, c)), "a / (b * c)"),
    (B("//", a, B("*", b, c)), "a // (b * c)"),
    (B("//", B("*", a, b), c), "a * b // c"),
    (B("*", B("//", a, b), c), "a // b * c"),
    (B("/", B("//", a, b), c), "a // b / c"),
    (B("%", a, B("+", b, c)), "a % (b + c)"),
    (B("-", B("%", a, b), c), "a % b - c"),
    (B("%", B("//", a, b), c), "a // b % c"),
    (B("*", B("+", a, b), c), "(a + b) * c"),
    (B("+", a, B("*", b, c)), "a + b * c"),
    (B("-", a, N(-1)), "a - -1"),
    (B("*", a, N(-0.5)), "a * -0.5"),
    (B("+", N(-2), a), "-2 + a"),
    (neg(B("^", x, N(2))), "-x^2"),
    (B("^", neg(x), N(2)), "(-x)^2"),
    (B("^", N(-2), x), "(-2)^x"),
    (B("^", x, N(-2)), "x^-2"),
    (B("^", x, neg(q)), "x^-q"),
    (B("^", a, B("^", b, c)), "a^b^c"),
    (B("^", B("^", a, b), c), "(a^b)^c"),
    (B("^", B("*", a, b), c), "(a * b)^c"),
    (B("^", ir.WireSize("d"), N(-0.5)), "|d|^-0.5"),
    (neg(B("+", a, b)), "-(a + b)"),
    (neg(B("*", a, b)), "-(a * b)"),
    (B("*", neg(a), b), "-a * b"),
    (neg(neg(a)), "-(-a)"),
    (neg(N(2)), "-2"),  # not canonical: reads back as Num(-2), see the printer's docstring
    (ir.Unary("not", B("and", a, b)), "not (a and b)"),
    (B("and", ir.Unary("not", a), b), "not a and b"),
    (ir.Unary("not", B("<", x, q)), "not x < q"),
    (ir.Unary("not", ir.Unary("not", a)), "not not a"),
    (B("and", B("or", a, b), c), "(a or b) and c"),
    (B("or", a, B("and", b, c)), "a or b and c"),
    (B("or", a, B("or", b, c)), "a or (b or c)"),
    (B("<", B("<", a, b), c), "(a < b) < c"),
    (B("==", B("<", a, b), B(">=", x, q)), "(a < b) == (x >= q)"),
    (B("<", B("-", q, x), N(256)), "q - x < 256"),
    (B("<=", ir.Unary("not", a), b), "(not a) <= b"),
    (B("*", a, ir.Unary("not", b)), "a * (not b)"),
    (B("-", a, B("<", b, c)), "a - (b < c)"),
    (ir.Call("where", (B("<=", x, q), a, N(-math.inf))), "where(x <= q, a, -inf)"),
    (ir.Call("max", (B("or", a, b), neg(c))), "max(a or b, -c)"),
    (ir.Reduce("sum", ("d", "x"), B("*", a, b)), "sum[d, x](a * b)"),
    (ir.Normalize("softmax", "x", B("+", a, b)), "softmax[x](a + b)"),
    (ir.TensorRef("doc", ("b", "q")), "doc[b, q]"),
    (N(math.inf), "inf"),
    (N(2), "2"),
    (N(2.0), "2.0"),
    (N(1e-05), "1e-05"),
    (N(1e16), "1e+16"),
    (N(-0.0), "-0.0"),
]


@pytest.mark.parametrize("expr, text", EXPRESSIONS, ids=[t for _, t in EXPRESSIONS])
def test_expression_text(expr, text):
    assert expr_text(expr) == text
    d = ir.Diagram("e", (ir.Wire("q"), ir.Wire("x")), (), (ir.Let("S", (("q",),), None, expr),), ())
    back = parse(to_text(d)).lets[0].expr
    if expr == neg(N(2)):
        assert back == N(-2)  # the parser folds the sign into the number
    else:
        assert back == expr and repr(back) == repr(expr)


@given(st.one_of(st.integers(-10**30, 10**30), st.floats(allow_nan=False)))
@settings(max_examples=200, deadline=None)
def test_numbers_read_back_as_the_same_value_and_type(value):
    d = ir.Diagram("n", (), (), (ir.Let("S", (("q",),), None, ir.Num(value)),), ())
    back = parse(to_text(d)).lets[0].expr
    assert isinstance(back, ir.Num) and type(back.value) is type(value)
    assert back.value == value and math.copysign(1, back.value) == math.copysign(1, value)


def test_nan_has_no_spelling():
    with pytest.raises(ValueError, match="NaN"):
        expr_text(N(math.nan))


@pytest.mark.parametrize("nbytes, text", [
    (1, "1"), (1000, "1000"), (1024, "1 KiB"), (1536, "1536"), (232448, "227 KiB"),
    (50 * 1000**2, "50000000"), (3 << 20, "3 MiB"), (1 << 30, "1 GiB"), (80 << 30, "80 GiB"),
    ((1 << 30) + 1024, "1048577 KiB"),
])
def test_capacity_in_the_largest_exact_binary_unit(nbytes, text):
    d = ir.Diagram("c", (), (), (), (), ir.Schedule("h100", "fp32", False, (ir.Level("smem", nbytes),)))
    printed = assert_round_trip(d)
    assert f"  level smem capacity {text} {{}}\n" in printed


# --------------------------------------------------------------------------
# Properties over drawn diagrams.
# --------------------------------------------------------------------------

@PROPERTY
@given(attention_diagrams())
def test_attention_diagrams_round_trip(d):
    assert_round_trip(d)


@PROPERTY
@given(matmul_diagrams())
def test_matmul_diagrams_round_trip(d):
    assert_round_trip(d)


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(any_diagrams())
def test_any_expressible_diagram_round_trips(d):
    assert_round_trip(d)


@PROPERTY
@given(st.one_of(attention_diagrams(), matmul_diagrams()))
def test_drawn_diagrams_pass_the_checker(d):
    problems = check(d)
    text = to_text(d)
    assert problems == [], "\n".join(p.format("<drawn>", text) for p in problems) + "\n" + text
    # and the printed text loads, the user's route in
    assert napkin.load_text(text) == d


def test_a_tiles_token_layout_prints_after_its_count():
    d = ir.Diagram("s", (), (), (), (), ir.Schedule(None, "fp32", False, (
        ir.Level("devices", None, (ir.Tile("q", "group", 4, True, layout="contiguous"),
                                   ir.Tile("x", "stream", 4, True, layout="contiguous")), ()),
    )))
    text = assert_round_trip(d)
    assert "    group q across 4 contiguous\n    stream x across 4 contiguous\n" in text
