"""The parser: each construct of the language, and the exact text of its errors.

Errors are compared in full, as a user sees them: ``file:line:col: message``,
the source line, the caret line and ``hint: ...``.
"""
from __future__ import annotations

import math
import textwrap

import pytest

from napkin import ir
from napkin.errors import NapkinError
from napkin.parse import MAX_DEPTH, _keywords, parse

from strategies import KEYWORDS

HEAD = "diagram t\nwire q, x\nwire d = 4\n"


def box(expr: str) -> ir.Expr:
    """The expression of a one-box diagram over wires q, x, d."""
    return parse(HEAD + f"S[q] = {expr}\n").lets[0].expr


def error(text: str) -> str:
    with pytest.raises(NapkinError) as info:
        parse(textwrap.dedent(text), "t.ncd")
    return str(info.value)


def T(name, wires=None):
    return ir.TensorRef(name, wires)


def B(op, lhs, rhs):
    return ir.Binary(op, lhs, rhs)


N = ir.Num
q, x = ir.WireIndex("q"), ir.WireIndex("x")


# --------------------------------------------------------------------------
# Constructs.
# --------------------------------------------------------------------------

def test_wires_symbolic_and_fixed():
    d = parse("diagram w\nwire b, h\nwire d = 64, e\nwire q")
    assert d.name == "w"
    assert d.wires == (ir.Wire("b"), ir.Wire("h"), ir.Wire("d", 64), ir.Wire("e"), ir.Wire("q"))


def test_inputs_with_grouped_axes():
    d = parse("diagram g\nwire b, hk, g, q, d\nin Q[b, (hk g), q, d] : fp16\nin R[(b hk g)] : fp32")
    assert d.inputs == (ir.Input("Q", (("b",), ("hk", "g"), ("q",), ("d",)), "fp16"),
                        ir.Input("R", (("b", "hk", "g"),), "fp32"))


def test_box_with_and_without_dtype():
    d = parse(HEAD + "S[d, (q x)] : fp16 = 1\nT[q] = 2\n")
    assert d.lets == (ir.Let("S", (("d",), ("q", "x")), "fp16", N(1)), ir.Let("T", (("q",),), None, N(2)))


def test_outputs_in_order():
    assert parse("diagram o\nout O, lse\nout Z").outputs == (ir.Output("O"), ir.Output("lse"), ir.Output("Z"))


def test_bare_wire_names_are_indices_and_other_names_tensors():
    # d is declared after the box that uses it: resolution happens at the end.
    d = parse("diagram r\nS[q] = q + Q + d\nwire q\nwire d = 2")
    assert d.lets[0].expr == B("+", B("+", q, T("Q")), ir.WireIndex("d"))


def test_relabel():
    assert box("doc[b, q] == doc") == B("==", T("doc", ("b", "q")), T("doc"))


def test_reductions_and_contraction():
    assert box("sum[d](Q * K)") == ir.Reduce("sum", ("d",), B("*", T("Q"), T("K")))
    assert box("sum[d, x](A)") == ir.Reduce("sum", ("d", "x"), T("A"))
    for op in ("max", "min", "logsumexp"):
        assert box(f"{op}[x](S)") == ir.Reduce(op, ("x",), T("S"))


def test_softmax_is_a_normaliser():
    assert box("softmax[x](S)") == ir.Normalize("softmax", "x", T("S"))


def test_calls():
    assert box("where(x <= q, exp(S), max(S, 0))") == ir.Call("where", (
        B("<=", x, q), ir.Call("exp", (T("S"),)), ir.Call("max", (T("S"), N(0)))))


def test_size():
    assert box("|d|") == ir.WireSize("d")
    assert box("log(|x|)") == ir.Call("log", (ir.WireSize("x"),))


def test_power_is_right_associative_with_signed_exponents():
    assert box("|d|^-0.5") == B("^", ir.WireSize("d"), N(-0.5))
    assert box("2^-x") == B("^", N(2), ir.Unary("-", x))
    assert box("a^b^c") == B("^", T("a"), B("^", T("b"), T("c")))
    assert box("-x^2") == ir.Unary("-", B("^", x, N(2)))
    assert box("(-x)^2") == B("^", ir.Unary("-", x), N(2))


def test_negative_literals_fold():
    assert box("-inf") == N(-math.inf)
    assert box("inf") == N(math.inf)
    assert box("-2") == N(-2) and isinstance(box("-2").value, int)
    assert box("- -2") == N(2)
    assert box("-(0.5)") == N(-0.5)
    assert box("-x") == ir.Unary("-", x)
    assert box("a - -1") == B("-", T("a"), N(-1))


def test_numbers_keep_int_or_float():
    assert [type(box(t).value) for t in ("7", "7.", ".5", "1e3", "2.5E-2")] == [int, float, float, float, float]
    assert box("1e3").value == 1000.0 and box("2.5E-2").value == 0.025


def test_precedence():
    # d is a wire here, so it reads as its index
    sum_ = B("+", ir.WireIndex("d"), B("*", T("e"), T("f")))
    assert box("a or b and not c < d + e * f") == B(
        "or", T("a"), B("and", T("b"), ir.Unary("not", B("<", T("c"), sum_))))
    assert box("a - b - c") == B("-", B("-", T("a"), T("b")), T("c"))
    assert box("a / b * c") == B("*", B("/", T("a"), T("b")), T("c"))
    assert box("-a * b") == B("*", ir.Unary("-", T("a")), T("b"))


def test_comparisons_and_logic():
    for op in ir.COMPARE_OPS:
        assert box(f"x {op} q") == B(op, x, q)
    assert box("not (x < q) or x == 3 and q != 1") == B(
        "or", ir.Unary("not", B("<", x, q)), B("and", B("==", x, N(3)), B("!=", q, N(1))))


def test_comments_and_whitespace_anywhere():
    d = parse("# head\ndiagram c # after the name\n\twire b  # a wire\n\n\nout b # the end, no newline")
    assert d.wires == (ir.Wire("b"),) and d.outputs == (ir.Output("b"),)


def test_names_may_start_with_a_keyword():
    d = parse("diagram a\nwire inx, bylaw, notice, orx, andy\nin info[inx] : fp16\n"
              "S[inx] = notice and orx or andy\n")
    assert d.lets[0].expr == B("or", B("and", ir.WireIndex("notice"), ir.WireIndex("orx")),
                               ir.WireIndex("andy"))


def test_the_reserved_words():
    assert set(_keywords()) == KEYWORDS


SCHEDULE = """\
diagram s
schedule on h100 {
  accumulate fp16
  allow tf32
  level devices { group q across 2  stream x across 4 }
  level hbm { hold Q, K  hold V }
  level smem capacity 228 KiB {
    group b by 1, q by 128
    stream x by 64
    hold S, P
  }
  level regs {}
}
"""


def test_schedule():
    s = parse(SCHEDULE).schedule
    assert (s.profile, s.accumulate, s.tf32) == ("h100", "fp16", True)
    assert s.levels == (
        ir.Level("devices", None, (ir.Tile("q", "group", 2, True), ir.Tile("x", "stream", 4, True))),
        ir.Level("hbm", None, (), ("Q", "K", "V")),
        ir.Level("smem", 228 * 1024, (ir.Tile("b", "group", 1), ir.Tile("q", "group", 128),
                                      ir.Tile("x", "stream", 64)), ("S", "P")),
        ir.Level("regs"),
    )


def test_schedule_defaults():
    s = parse("diagram s\nschedule { }").schedule
    assert s == ir.Schedule(None, "fp32", False, ())


@pytest.mark.parametrize("text, nbytes", [
    ("4096", 4096), ("4096 B", 4096), ("2 KB", 2000), ("3 MB", 3 * 10**6), ("1 GB", 10**9),
    ("228 KiB", 228 * 1024), ("1.5 KiB", 1536), ("2 MiB", 2 << 20), ("80 GiB", 80 << 30), ("1e3", 1000),
])
def test_capacity_units(text, nbytes):
    assert parse(f"diagram c\nschedule {{ level smem capacity {text} {{}} }}").level("smem").capacity == nbytes


def test_locations():
    d = parse("diagram loc\nwire q\n\nS[q] = q + 1\n  out S")
    assert d.loc == ir.Loc(1, 9, 1, 12)
    assert (d.lets[0].loc.line, d.lets[0].loc.col) == (4, 1)
    plus = d.lets[0].expr
    assert (plus.loc.line, plus.loc.col, plus.rhs.loc.col) == (4, 8, 12)
    assert (d.outputs[0].loc.line, d.outputs[0].loc.col) == (5, 7)


def test_layout_wire_locations():
    # One location per wire, grouped axes flattened, each spanning its name.
    d = parse("diagram loc\nwire b, hk, g, q\nin Q[b, (hk g), q] : fp16\n  S[q, b] = 1")
    assert d.inputs[0].wire_locs == (ir.Loc(3, 6, 3, 7), ir.Loc(3, 10, 3, 12), ir.Loc(3, 13, 3, 14),
                                     ir.Loc(3, 17, 3, 18))
    assert d.lets[0].wire_locs == (ir.Loc(4, 5, 4, 6), ir.Loc(4, 8, 4, 9))
    assert ir.layout_locs(d.lets[0]) == d.lets[0].wire_locs
    # Locations are not part of the node's value.
    assert d.inputs[0] == ir.Input("Q", (("b",), ("hk", "g"), ("q",)), "fp16")
    assert "wire_locs" not in repr(d.inputs[0])


def test_nesting_up_to_the_limit_parses():
    depth = MAX_DEPTH - 1
    assert parse("diagram n\nS[q] = " + "-" * depth + "a").lets[0].expr is not None
    e = parse("diagram n\nS[q] = " + "exp(" * depth + "a" + ")" * depth).lets[0].expr
    assert sum(1 for _ in ir.walk(e)) == depth + 1
    # Parentheses alone add no depth.
    assert parse("diagram n\nS[q] = " + "(" * 1000 + "a" + ")" * 1000).lets[0].expr == T("a")


# --------------------------------------------------------------------------
# Syntax errors, in full.
# --------------------------------------------------------------------------

ERRORS = {
    "missing diagram name": ("diagram", """\
t.ncd:1:8: unexpected end of file
    diagram
           ^
  hint: expected a name"""),
    "not a diagram": ("wire a\n", """\
t.ncd:1:1: unexpected 'wire'
    wire a
    ^^^^
  hint: expected 'diagram'"""),
    "missing colon before dtype": ("diagram a\nin Q[b] fp16\n", """\
t.ncd:2:9: unexpected 'fp16'
    in Q[b] fp16
            ^^^^
  hint: expected ':'"""),
    "empty expression": ("diagram a\nS[b] = \nout S\n", """\
t.ncd:3:1: unexpected 'out'
    out S
    ^^^
  hint: expected an expression ('out' is a reserved word, so it cannot be a name)"""),
    "dangling operator at end of file": ("diagram a\nS[b] = a and\n", """\
t.ncd:2:13: unexpected end of file
    S[b] = a and
                ^
  hint: expected an expression"""),
    "two operators": ("diagram a\nS[b] = a + * b\n", """\
t.ncd:2:12: unexpected '*'
    S[b] = a + * b
               ^
  hint: expected an expression"""),
    "unclosed parenthesis": ("diagram a\nS[b] = (a + b\n", """\
t.ncd:2:14: unexpected end of file
    S[b] = (a + b
                 ^
  hint: expected '(', ')', '[' or an operator"""),
    # the hints were taken after the bad token had reduced Q to a whole expression, so they left
    # out the operator: "expected ')' or 'or'" and "expected 'or' or a new statement"
    "missing operator": ("diagram a\nS[q, x] = sum[d](Q  K)\n", """\
t.ncd:2:21: unexpected 'K'
    S[q, x] = sum[d](Q  K)
                        ^
  hint: expected '(', ')', '[' or an operator"""),
    "stray closing parenthesis": ("diagram a\nS[q, x] = sum[d](Q * K))\nout S\n", """\
t.ncd:2:24: unexpected ')'
    S[q, x] = sum[d](Q * K))
                           ^
  hint: expected a new statement or an operator"""),
    "chained comparison": ("diagram a\nS[b] = a < b < c\n", """\
t.ncd:2:14: comparisons do not chain
    S[b] = a < b < c
                 ^
  hint: write 'a < b and b < c'"""),
    "single equals": ("diagram a\nS[b] = where(x = q, 1, 0)\n", """\
t.ncd:2:16: unexpected '='
    S[b] = where(x = q, 1, 0)
                   ^
  hint: to compare, write '=='"""),
    # P[q, x] below was read as the operand of the dangling '*': "unexpected '='", hint "to compare,
    # write '=='", at the correct line's '='
    "dangling operator before a box": ("diagram a\nS[q, x] = sum[d](Q * K) *   # scaled\n\n"
                                       "P[q, x] = softmax[x](S)\n", """\
t.ncd:2:25: line 2 ends with '*', so the box on line 4 was read as its operand
    S[q, x] = sum[d](Q * K) *   # scaled
                            ^
  hint: finish the expression after '*', or drop the '*'"""),
    "dangling operator before a box with a dtype": ("diagram a\nS[b] = b and\nT[b] : fp16 = 1\n", """\
t.ncd:2:10: line 2 ends with 'and', so the box on line 3 was read as its operand
    S[b] = b and
             ^^^
  hint: finish the expression after 'and', or drop the 'and'"""),
    "python power": ("diagram a\nS[b] = x ** 2\n", """\
t.ncd:2:11: unexpected '*'
    S[b] = x ** 2
              ^
  hint: a power is written with '^', as in x^2"""),
    # C's logical operators: the words are named, not the set (which an '&' does not reach)
    "C's and": ("diagram a\nS[b] = where(x < n && x < 3, 1, 0)\n", """\
t.ncd:2:20: unexpected character '&'
    S[b] = where(x < n && x < 3, 1, 0)
                       ^
  hint: napkin's logical operators are words: write 'and'"""),
    "C's or": ("diagram a\nS[b] = where(x < n || x < 3, 1, 0)\n", """\
t.ncd:2:20: unexpected '|'
    S[b] = where(x < n || x < 3, 1, 0)
                       ^
  hint: napkin's logical operators are words: write 'or'"""),
    "C's not": ("diagram a\nS[b] = where(!(x < 3), 1, 0)\n", """\
t.ncd:2:14: unexpected character '!'
    S[b] = where(!(x < 3), 1, 0)
                 ^
  hint: napkin's logical operators are words: write 'not'"""),
    # a '|' that opens a size is a missing operator, and a '!' where no expression goes is no 'not'
    "size after an operand": ("diagram a\nS[b] = 2 |d|\n", """\
t.ncd:2:10: unexpected '|'
    S[b] = 2 |d|
             ^
  hint: expected a new statement or an operator"""),
    "bang after a statement": ("diagram a\nS[b] = x !\n", """\
t.ncd:2:10: unexpected character '!'
    S[b] = x !
             ^
  hint: expected '(', '[', a new statement or an operator"""),
    # an index computed from wires is a gather (a relative-position table): said so inside a
    # tensor read of a box, not in a reduction's brackets nor on the box's own left side
    "gather": ("diagram a\nS[q, x] = s + rel[q - x]\n", """\
t.ncd:2:21: unexpected '-'
    S[q, x] = s + rel[q - x]
                        ^
  hint: expected ',', '//' or ']': a tensor is read along wires, one name each, or at a wire's blocks \
(q // 64); T[h, q - x] would be a gather, which napkin does not make: expand the table in torch and pass T[h, q, x]"""),
    "gather by a number": ("diagram a\nS[q] = where(x < n[2 * b], 1, 0)\n", """\
t.ncd:2:20: unexpected '2'
    S[q] = where(x < n[2 * b], 1, 0)
                       ^
  hint: expected a name: a tensor is read along wires, one name each, or at a wire's blocks (q // 64); \
T[h, q - x] would be a gather, which napkin does not make: expand the table in torch and pass T[h, q, x]"""),
    "reduction's wires": ("diagram a\nS[q] = sum[x - 1](s)\n", """\
t.ncd:2:14: unexpected '-'
    S[q] = sum[x - 1](s)
                 ^
  hint: expected ',' or ']'"""),
    "box's own wires": ("diagram a\nS[q + 1] = s\n", """\
t.ncd:2:5: unexpected '+'
    S[q + 1] = s
        ^
  hint: expected ',' or ']'"""),
    "bad character": ("diagram a\nS[b] = a $ b\n", """\
t.ncd:2:10: unexpected character '$'
    S[b] = a $ b
             ^
  hint: expected '(', '[', a new statement or an operator"""),
    # the lexer's set: ']' cannot go on a hold list, and a new statement was missing after out X
    "bad character in a hold list": ("diagram a\nschedule { level hbm { hold Q, K ; S } }\n", """\
t.ncd:2:34: unexpected character ';'
    schedule { level hbm { hold Q, K ; S } }
                                     ^
  hint: expected ',', 'group', 'hold', 'stream' or '}'"""),
    "bad character after a statement": ("diagram a\nwire n\nin X[n] : fp32\nout X;\n", """\
t.ncd:4:6: unexpected character ';'
    out X;
         ^
  hint: expected ',' or a new statement"""),
    "keyword as a name": ("diagram a\nwire b, in\n", """\
t.ncd:2:9: unexpected 'in'
    wire b, in
            ^^
  hint: expected a name ('in' is a reserved word, so it cannot be a name)"""),
    "tile without by": ("diagram a\nschedule { level smem { group q 64 } }\n", """\
t.ncd:2:33: unexpected '64'
    schedule { level smem { group q 64 } }
                                    ^^
  hint: expected 'across' or 'by'"""),
    "unclosed schedule": ("diagram a\nschedule {\n  level smem { group q by 64 }\n", """\
t.ncd:3:31: unexpected end of file
      level smem { group q by 64 }
                                  ^
  hint: expected 'accumulate', 'allow', 'level' or '}'"""),
    "statement expected": ("diagram a\n123\n", """\
t.ncd:2:1: unexpected '123'
    123
    ^^^
  hint: expected a new statement"""),
    "empty group axis": ("diagram a\nin Q[()] : fp16\n", """\
t.ncd:2:7: unexpected ')'
    in Q[()] : fp16
          ^
  hint: expected a name"""),
    "missing capacity number": ("diagram a\nschedule { level smem capacity KiB {} }\n", """\
t.ncd:2:32: unexpected 'KiB'
    schedule { level smem capacity KiB {} }
                                   ^^^
  hint: expected a number"""),
    # the raw vertical tab was echoed, which a terminal draws as a line break: the caret hung below nothing
    "control character": ("diagram a\n\x0bwire d = 64\n", """\
t.ncd:2:1: unexpected character '\\x0b'
    \ufffdwire d = 64
    ^
  hint: expected a new statement"""),
    # a bidi override was echoed raw: the terminal drew the rest of the line reversed ("Trojan source")
    "bidi override": ("diagram a\nwire d\u202e = 64\n", """\
t.ncd:2:7: unexpected character '\\u202e' (U+202E RIGHT-TO-LEFT OVERRIDE): napkin reads only ASCII outside comments
    wire d\ufffd = 64
          ^
  hint: expected ',', '=' or a new statement"""),
    # a comment may hold any character, but its echo under an error on that line shows none that
    # reorders or hides text (an isolate, a zero-width joiner): each is one visible column
    "bidi isolate in a comment": ("diagram a\nwire d = 6x4   # \u2067x\u200dy\u2069\n", """\
t.ncd:2:10: 6x4 is not a number
    wire d = 6x4   # \ufffdx\ufffdy\ufffd
             ^^^
  hint: napkin reads decimal numbers, such as 16, 1000, 2.5 or 1e-6"""),
    # the end of file was placed after the comment on the line below the dangling '*'
    "end after a comment": ("diagram a\nwire n\nin X[n] : fp32\nY[n] = 2 *     # scale it\n# more\n", """\
t.ncd:4:11: unexpected end of file
    Y[n] = 2 *     # scale it
              ^
  hint: expected an expression"""),
    # read as the number 0 and a name x10, the error fell on the next line: "unexpected 'in'"
    "hex number": ("diagram a\nwire n = 0x10\nin X[n] : fp32\n", """\
t.ncd:2:10: 0x10 is not a number
    wire n = 0x10
             ^^^^
  hint: napkin reads decimal numbers, such as 16, 1000, 2.5 or 1e-6"""),
    "a number run into letters": ("diagram a\nwire n\nin X[n] : fp32  # 0x10 in a comment is no number\n"
                                  "Y[n] = where(1<2and n>=0, X, 12.5abc)\n", """\
t.ncd:4:30: 12.5abc is not a number
    Y[n] = where(1<2and n>=0, X, 12.5abc)
                                 ^^^^^^^
  hint: napkin reads decimal numbers, such as 16, 1000, 2.5 or 1e-6"""),
    # \d took every Unicode digit: wire d = ٦٤ and q by １２８ passed as 64 and 128 (names2 hunt)
    "arabic-indic digits": ("diagram a\nwire d = \u0666\u0664\n", """\
t.ncd:2:10: unexpected character '\u0666' (U+0666 ARABIC-INDIC DIGIT SIX): numbers are written in the ASCII digits 0-9
    wire d = \u0666\u0664
             ^
  hint: expected a number"""),
    "full-width digits": ("diagram a\nschedule { level smem { group q by \uff11\uff12\uff18 } }\n", """\
t.ncd:2:36: unexpected character '\uff11' (U+FF11 FULLWIDTH DIGIT ONE): numbers are written in the ASCII digits 0-9
    schedule { level smem { group q by \uff11\uff12\uff18 } }
                                       ^
  hint: expected a number"""),
    "a non-ascii digit after ascii ones": ("diagram a\nwire n\nin X[n] : fp32\nY[n] = X * 1\u0660\n", """\
t.ncd:4:13: unexpected character '\u0660' (U+0660 ARABIC-INDIC DIGIT ZERO): numbers are written in the ASCII digits 0-9
    Y[n] = X * 1\u0660
                ^
  hint: expected a new statement or an operator"""),
    # a digit going on a name was told numbers are ASCII digits, as if q6 were a number
    "a non-ascii digit in a name": ("diagram a\nwire b, q1\u0666\n", """\
t.ncd:2:11: unexpected character '\u0666' (U+0666 ARABIC-INDIC DIGIT SIX): names are ASCII letters, digits and _
    wire b, q1\u0666
              ^
  hint: expected ',', '=' or a new statement"""),
    # a lookalike letter was shown as the letter it looks like: "unexpected character 'K'"
    "kelvin sign": ("diagram \u212aelvin\n", """\
t.ncd:1:9: unexpected character '\u212a' (U+212A KELVIN SIGN): names are ASCII letters, digits and _
    diagram \u212aelvin
            ^
  hint: expected a name"""),
    "cyrillic a": ("diagram \u0430\n", """\
t.ncd:1:9: unexpected character '\u0430' (U+0430 CYRILLIC SMALL LETTER A): names are ASCII letters, digits and _
    diagram \u0430
            ^
  hint: expected a name"""),
    "a zero-width space": ("diagram a\u200b\n", """\
t.ncd:1:10: unexpected character '\\u200b' (U+200B ZERO WIDTH SPACE): napkin reads only ASCII outside comments
    diagram a\ufffd
             ^
  hint: expected a new statement"""),
    # a well-parsed capacity above (228 and the unit kib, which the checker refuses) took the error
    # as "228kib is not a number", and the dangling ',' was never shown
    "syntax error after a capacity with a glued unit": (
        "diagram a\nschedule {\n  level smem capacity 228kib {\n    group q by 16,\n  }\n}\n", """\
t.ncd:5:3: unexpected '}'
      }
      ^
  hint: expected a name"""),
    "bad character after a capacity with a glued unit": (
        "diagram a\nschedule {\n  level smem capacity 228kib { group q by 16 ; }\n}\n", """\
t.ncd:3:46: unexpected character ';'
      level smem capacity 228kib { group q by 16 ; }
                                                 ^
  hint: expected ',', 'group', 'hold', 'stream' or '}'"""),
    "underscored number": ("diagram a\nwire n\nin X[n] : fp32\nY[n] = 1_000 * X\n", """\
t.ncd:4:8: 1_000 is not a number
    Y[n] = 1_000 * X
           ^^^^^
  hint: napkin reads decimal numbers, such as 16, 1000, 2.5 or 1e-6"""),
}


def test_decimal_capacities_are_exact():
    """1.001 MB was refused as "not 1000999.9999999999" and 1.005 KB as "not 1004.9999999999999"."""
    d = parse("diagram a\nschedule {\n level hbm capacity 1.001 MB { }\n level smem capacity 1.005 KB { }\n"
              " level regs capacity 0.5 KiB { }\n}\n")
    assert [lv.capacity for lv in d.schedule.levels] == [1_001_000, 1005, 512]


def test_numbers_run_into_a_unit_or_a_word_operator_still_parse():
    """Refusing every number run into letters refused capacity 256KiB and 1<2and q>=0, which parse."""
    d = parse("diagram a\nwire n\nin X[n] : fp32\nY[n] = where(1<2and n>=0, X, .5 * X + 2.)\nout Y\n"
              "schedule { level smem capacity 256KiB { } }\n")
    assert d.schedule.levels[0].capacity == 256 * 1024


@pytest.mark.parametrize("text, expected", ERRORS.values(), ids=ERRORS.keys())
def test_syntax_error_text(text, expected):
    assert error(text) == expected


# --------------------------------------------------------------------------
# Errors found while building the IR, in full.
# --------------------------------------------------------------------------

BUILD_ERRORS = {
    "fractional wire size": ("diagram a\nwire d = 1.5\n", """\
t.ncd:2:10: a wire size must be a whole number, not 1.5
    wire d = 1.5
             ^^^"""),
    "fractional block": ("diagram a\nschedule { level smem { stream x by 6.4 } }\n", """\
t.ncd:2:37: a block size must be a whole number, not 6.4
    schedule { level smem { stream x by 6.4 } }
                                        ^^^"""),
    "unknown function": ("diagram a\nS[b] = foo(a)\n", """\
t.ncd:2:8: unknown function 'foo'
    S[b] = foo(a)
           ^^^
  hint: functions are exp, exp2, log, log2, sqrt, rsqrt, tanh, sigmoid, abs, relu, max, min, where"""),
    "floor as a function": ("diagram a\nS[b] = where(floor(x / 64) == q // 64, 1, 0)\n", """\
t.ncd:2:14: unknown function 'floor'
    S[b] = where(floor(x / 64) == q // 64, 1, 0)
                 ^^^^^
  hint: floor division is an operator: floor(q / 128) is q // 128, and the remainder q % 128"""),
    "mod as a function": ("diagram a\nS[b] = mod(x, 3)\n", """\
t.ncd:2:8: unknown function 'mod'
    S[b] = mod(x, 3)
           ^^^
  hint: the remainder is an operator: mod(q, 128) is q % 128"""),
    "wrong arity": ("diagram a\nS[b] = where(x < q, 1)\n", """\
t.ncd:2:8: where takes 3 arguments, not 2
    S[b] = where(x < q, 1)
           ^^^^^"""),
    "unknown reduction": ("diagram a\nS[b] = softmx[x](S)\n", """\
t.ncd:2:8: unknown reduction 'softmx'
    S[b] = softmx[x](S)
           ^^^^^^
  hint: reductions are sum, max, min, logsumexp, softmax"""),
    "softmax over two wires": ("diagram a\nS[b] = softmax[x, q](S)\n", """\
t.ncd:2:8: softmax normalises along one wire, not 2
    S[b] = softmax[x, q](S)
           ^^^^^^^^^^^^^^^^
  hint: store (x q) as one axis of each tensor that has them, declare it as one wire and write softmax[xq](...)"""),
    "unknown unit": ("diagram a\nschedule { level smem capacity 2 KiBs {} }\n", """\
t.ncd:2:34: unknown unit 'KiBs'
    schedule { level smem capacity 2 KiBs {} }
                                     ^^^^
  hint: units are B, KB, MB, GB, KiB, MiB, GiB"""),
    "fractional capacity": ("diagram a\nschedule { level smem capacity 0.5 B {} }\n", """\
t.ncd:2:32: a capacity must be a positive whole number of bytes, not 0.5
    schedule { level smem capacity 0.5 B {} }
                                   ^^^"""),
    # a float refused 1.001 MB as "not 1000999.9999999999"; a refused capacity shows what was written
    "non-whole capacity in a unit": ("diagram a\nschedule { level smem capacity 1.0001 KB {} }\n", """\
t.ncd:2:32: a capacity must be a positive whole number of bytes, not 1000.1 (1.0001 KB)
    schedule { level smem capacity 1.0001 KB {} }
                                   ^^^^^^"""),
    "capacity too large": ("diagram a\nschedule { level smem capacity 1e300 GB {} }\n", """\
t.ncd:2:32: 1e300 GB is too large for a capacity (the largest is about 1.8e308 bytes)
    schedule { level smem capacity 1e300 GB {} }
                                   ^^^^^"""),
    "whole wire size not in digits": ("diagram a\nwire d = 64.0, e = 1e3\n", """\
t.ncd:2:10: a wire size is written in digits (64), not 64.0
    wire d = 64.0, e = 1e3
             ^^^^
t.ncd:2:20: a wire size is written in digits (1000), not 1e3
    wire d = 64.0, e = 1e3
                       ^^^"""),
    "infinite block size": ("diagram a\nschedule { level smem { group q by 1e400 } }\n", """\
t.ncd:2:36: 1e400 is too large for a number (the largest is about 1.8e308)
    schedule { level smem { group q by 1e400 } }
                                       ^^^^^"""),
    "infinite capacity": ("diagram a\nschedule { level smem capacity 1e400 {} }\n", """\
t.ncd:2:32: 1e400 is too large for a number (the largest is about 1.8e308)
    schedule { level smem capacity 1e400 {} }
                                   ^^^^^"""),
    # float() took 1e400 as inf silently: every score inf, every output NaN
    "number too large": ("diagram a\nwire b\nin X[b] : fp32\nS[b] = X * 1e400\nout S\n", """\
t.ncd:4:12: 1e400 is too large for a number (the largest is about 1.8e308)
    S[b] = X * 1e400
               ^^^^^
  hint: write inf if infinity is meant"""),
    "number too small": ("diagram a\nwire b\nin X[b] : fp32\nS[b] = X * 2.5e-400 + 0e-400\nout S\n", """\
t.ncd:4:12: 2.5e-400 is too small for a number: it would be 0 (the smallest is about 4.9e-324)
    S[b] = X * 2.5e-400 + 0e-400
               ^^^^^^^^"""),
    "unknown option": ("diagram a\nschedule { allow fp8 }\n", """\
t.ncd:2:18: unknown option 'allow fp8'
    schedule { allow fp8 }
                     ^^^
  hint: the only option is 'allow tf32'"""),
    "two schedules": ("diagram a\nschedule { }\nschedule on h100 { }\n", """\
t.ncd:3:1: a diagram has one schedule; this is the second
    schedule on h100 { }
    ^^^^^^^^^^^^^^^^^^^^"""),
    "too deep": ("diagram a\nwire b\nS[b] = " + "-" * MAX_DEPTH + "b\n", f"""\
t.ncd:3:1: the expression of box 'S' is nested too deeply (more than {MAX_DEPTH} levels; each operator of a \
chain such as a + b + c is a level)
    S[b] = {"-" * MAX_DEPTH}b
    ^
  hint: split it into several boxes"""),
    "too many digits": ("diagram a\nwire d = " + "9" * 5000 + "\n", "t.ncd:2:10: a number with 5000 digits is too long"),
}


def test_numbers_that_cannot_be_taken_are_collected_with_the_other_problems():
    """A non-whole block size raised at once from inside the transformer: the unknown function
    above it and the second block size below were never reported."""
    text = ("diagram a\nwire b, d = 2.5\nin X[b] : fp32\nS[b] = expp(X) * 1e999\nout S\n"
            "schedule { level smem { group b by 128.0\n stream b by 64.0 } }\n")
    with pytest.raises(NapkinError) as err:
        parse(text, "t.ncd")
    assert [(d.loc.line, d.loc.col, d.message) for d in err.value.diagnostics] == [
        (2, 13, "a wire size must be a whole number, not 2.5"),
        (4, 8, "unknown function 'expp'"),
        (4, 18, "1e999 is too large for a number (the largest is about 1.8e308)"),
        (6, 36, "a block size is written in digits (128), not 128.0"),
        (7, 14, "a block size is written in digits (64), not 64.0")]


@pytest.mark.parametrize("text, expected", BUILD_ERRORS.values(), ids=BUILD_ERRORS.keys())
def test_build_error_text(text, expected):
    got = error(text)
    if "5000 digits" in expected:  # the source line is 5000 characters long: compare the head
        got = got.splitlines()[0]
    assert got == expected


def test_deep_left_associative_chain_is_refused_not_a_crash():
    # 'a + a + ... + a' nests to the left: a RecursionError in Lark's
    # transformer before the depth limit existed.
    with pytest.raises(NapkinError, match="nested too deeply"):
        parse("diagram a\nS[b] = a" + " + a" * 5000)


def test_a_second_accumulate_is_refused():
    # the second silently won (a repeated level, output or hold is refused)
    text = "diagram t\nwire m, k\nin A[m, k] : fp16\nC[m] = sum[k](A)\nout C\n" \
           "schedule {\n  accumulate fp32\n  accumulate fp16\n}\n"
    assert error(text) == ("t.ncd:8:14: a second 'accumulate' in one schedule\n"
                           "      accumulate fp16\n"
                           "                 ^^^^\n"
                           "  hint: the first, at line 7, says fp32; keep one")
