"""The checker (napkin.check) and the tiling arithmetic it shares with the cost model.

Each error kind gets a small diagram; tests assert the exact message and that
the location points at the offending text (``pos`` finds that text's line
and column, so the expected spot is stated as the snippet it should be).
Here: the shipped examples, names, dtypes, box wires, layouts, booleans and
numbers; the schedule, streamability, capacity and the rest are in
tests/test_check_schedule.py, the shared diagrams and helpers in
tests/check_helpers.py.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from strategies import any_diagrams, attention_diagrams, matmul_diagrams

import napkin
from napkin import ir
from napkin.check import RESERVED, check, hostile_name
from napkin.parse import parse

from check_helpers import ATTENTION, HEAD, errors, one, pos, where

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.ncd"))

# ---- the shipped examples ---------------------------------------------------------

@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_examples_check_clean(path):
    diagram = napkin.load(path)
    assert check(diagram) == []


def test_examples_exist():
    assert len(EXAMPLES) >= 5


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(attention_diagrams() | matmul_diagrams())
def test_drawn_valid_diagrams_check_clean(diagram):
    assert check(diagram) == []


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(any_diagrams())
def test_arbitrary_diagrams_give_diagnostics_never_crashes(diagram):
    found = check(diagram)
    assert all(isinstance(d, napkin.Diagnostic) and d.message for d in found)
    assert found == sorted(found, key=lambda d: (d.loc.line, d.loc.col))


def test_check_is_deterministic_and_leaves_the_ir_alone():
    text = HEAD + "S[b, h, q] = Q * Kk\nout S, Z\n"
    diagram = parse(text)
    before = repr(diagram)
    assert errors(text) == check(diagram) == check(diagram)
    assert repr(diagram) == before


# ---- names -------------------------------------------------------------------------

def test_unknown_tensor_in_expression_with_hint():
    text = HEAD + "S[b, h, q, x] = sum[d](Q * Kk)\nout S\n"
    d = one(text)
    assert d.message == "unknown name 'Kk'"
    assert d.hint == "did you mean 'K'?"
    assert where(d) == pos(text, "Kk")


def test_unknown_wire_in_layout_reduction_relabel_and_tile():
    text = HEAD + ("S[b, h, qq, x] = sum[dd](Q * K[b, h, y, d])\nout S\n"
                   "schedule { level smem { group qx by 16 } }\n")
    found = errors(text)
    assert [(d.message, where(d)) for d in found] == [
        ("unknown wire 'qq' in the layout of S", pos(text, "qq")),
        ("unknown wire 'dd' in sum[dd]", pos(text, "sum[dd]")),
        ("unknown wire 'y' in K[b, h, y, d]", pos(text, "K[b, h, y")),
        ("unknown wire 'qx' in level smem", pos(text, "qx")),
    ]
    assert found[0].hint == "did you mean 'q'?"


def test_a_layouts_unknown_wire_is_reported_once_not_again_by_its_readers():
    """K[b, h, y, d] also gave S "has y too: reduce it (sum[y](...))" and "has no x: drop x",
    both wrong (y is a typo, x is right)."""
    text = (HEAD.replace("in K[b, h, x, d]", "in K[b, h, y, d]")
            + "S[b, h, q, x] = sum[d](Q * K)\nT[b, h, q, x] = S * 2\nout T\n")
    assert "in K[b, h, y, d]" in text
    assert [(d.message, where(d)) for d in errors(text)] == [("unknown wire 'y' in the layout of K", pos(text, "y, d]"))]


def test_a_box_whose_wires_differ_from_its_layout_is_reported_once_not_again_by_its_readers():
    """S[b, q] of an expression along x also gave the correct P "has no x: drop x" and
    "softmax[x] normalises along x, but its operand has no x"."""
    text = ("diagram t\nwire b, q, x\nwire d = 16\nin Q[b, q, d] : fp16\nin K[b, x, d] : fp16\n"
            "S[b, q] = sum[d](Q * K)\nP[b, q, x] = softmax[x](S)\nout P\n")
    assert [(d.message, where(d)) for d in errors(text)] == [
        ("S declares [b, q] but its expression has x too: reduce it (sum[x](...)) or declare it", (6, 1))]


def test_a_wire_twice_in_an_inputs_layout_is_reported_once_not_again_by_its_readers():
    """Q[(hk hk), ...], a slip for (hk g), also gave "wire g has no size" at the wire's declaration
    and "S declares [hk, g, q, x] but its expression has no g" at the correct box S."""
    text = ("diagram t\nwire hk, g, q, x\nwire d = 16\nin Q[(hk hk), q, d] : fp16\nin K[hk, x, d] : fp16\n"
            "S[hk, g, q, x] = sum[d](Q * K)\nout S\n")
    assert [(d.message, where(d)) for d in errors(text)] == [
        ("wire 'hk' appears twice in the layout of Q", pos(text, "hk)"))]


def test_an_extra_wire_in_a_box_is_not_also_a_wire_of_no_size():
    text = ("diagram t\nwire b, q, x, y\nwire d = 16\nin Q[b, q, d] : fp16\nin K[b, x, d] : fp16\n"
            "S[b, q, x, y] = sum[d](Q * K)\nP[b, q, x] = softmax[x](S)\nout P\n")
    assert [(d.message, where(d)) for d in errors(text)] == [
        ("S declares [b, q, x, y] but its expression has no y", pos(text, "y] ="))]


def test_unknown_tensor_in_hold_and_out():
    text = HEAD + ATTENTION + "out Oo\nschedule { level hbm { hold Q, Vv } }\n"
    found = errors(text)
    assert [(d.message, where(d)) for d in found] == [
        ("unknown tensor 'Oo' in out", pos(text, "Oo")),
        ("unknown tensor 'Vv' in hold", pos(text, "Vv")),   # the name, not its level (a helper's hunt)
    ]
    assert found[0].hint == "did you mean 'O'?"


def test_duplicate_names_share_one_namespace():
    text = HEAD + "in K[b, x] : fp16\nq[b, h, q] = sum[d](Q)\nt[b, h, x, d] = K\nout q\n"
    found = errors(text)
    assert [(d.message, where(d)) for d in found] == [
        ("duplicate name 'K': already declared as an input at line 5", (7, 4)),
        ("duplicate name 'q': already declared as a wire at line 2", (8, 1)),
        ("duplicate name 't': already declared as a diagram at line 1", (9, 1)),
    ]


def test_wire_twice_in_one_layout():
    text = HEAD + "in A[b, q, q] : fp16\nout A\n"
    d = one(text)
    assert d.message == "wire 'q' appears twice in the layout of A"
    assert where(d) == pos(text, "q] : fp16")            # the second q, not the first


def test_one_wire_given_two_sizes_in_declarations():
    text = "diagram t\nwire d = 64\nwire n, d = 128\nin A[n, d] : fp16\nout A\n"
    d = one(text)
    assert d.message == "one wire given two sizes: 'd' is 128 here but 64 at line 2"
    assert where(d) == (3, 9)


def test_one_wire_given_two_sizes_in_a_relabel():
    text = ("diagram t\nwire b\nwire q = 128\nwire x = 64\nin doc[b, x] : int32\n"
            "M[b, q] = doc[b, q] * 1\nout M\n")
    d = one(text)
    assert d.message == "one wire given two sizes: doc[b, q] reads x (= 64) as q (= 128)"
    assert where(d) == pos(text, "doc[b, q]")


def test_relabel_arity_mismatch():
    text = HEAD + "in doc[b, x] : int32\nM[b, q] = doc[b, h, q] * 1\nout M\n"
    d = one(text)
    assert d.message == "doc[b, h, q] gives 3 wires but doc is declared along 2: [b, x]"
    assert where(d) == pos(text, "doc[b, h, q]")


def test_used_before_defined():
    text = HEAD + "P[b, h, q, x] = softmax[x](S)\nS[b, h, q, x] = sum[d](Q * K)\nout P\n"
    d = one(text)
    assert d.message == "S is used before it is defined (line 8)"
    assert where(d) == (7, 28)


@pytest.mark.parametrize("name, why", [
    ("import", "'import' is a Python keyword"),
    ("__class__", "'__class__' starts with an underscore: such names are reserved for napkin's generated code"),
    ("print", "'print' shadows a Python builtin"),
    ("eval", "'eval' shadows a Python builtin"),
    ("match", "'match' is a Python soft keyword"),
    ("torch", "'torch' is reserved: the generated module uses that name itself"),
    ("SOURCE_HASH", "'SOURCE_HASH' is reserved: the generated module uses that name itself"),
])
def test_hostile_tensor_names(name, why):
    text = HEAD + f"in {name}[b] : fp16\nout {name}\n"
    d = one(text)
    assert d.message == why
    assert where(d) == (7, 4)
    assert "generated code" in d.hint


def test_hostile_wire_and_diagram_names():
    text = "diagram tl\nwire len, ok\nin A[ok, len] : fp16\nout A\n"
    assert [(d.message, where(d)) for d in errors(text)] == [
        ("'tl' is reserved: the generated module uses that name itself", (1, 9)),
        ("'len' shadows a Python builtin", (2, 6)),
    ]


@pytest.mark.parametrize("name", ["json", "typing", "random", "numpy", "napkin"])
def test_a_diagram_named_like_a_module_is_refused(name):
    """diagram json compiled to json.py: with its folder on sys.path, import torch
    failed half-initialised (atomic hunt).  A wire or tensor may have such a name."""
    text = f"diagram {name}\nwire m, heapq\nin queue[m, heapq] : fp16\nout queue\n"
    assert [(d.message, where(d), d.hint) for d in errors(text)] == [
        (f"diagram name '{name}' is the name of the Python module {name}: the compiled {name}.py would "
         "shadow it wherever its folder is on sys.path", (1, 9), "rename the diagram (it names the generated module)")]


def test_hostile_name_function():
    assert hostile_name("attention") is None
    assert hostile_name("d_head2") is None
    assert hostile_name("2x") is not None and hostile_name("héad") is not None
    assert {"torch", "triton", "tl", "math", "reference", "example_inputs", "INPUTS"} <= RESERVED


def test_every_name_a_generated_module_defines_is_reserved():
    """A diagram named like a module global would replace it (a diagram named
    functools replaced the import _on_inputs_device uses: the module failed
    to import).  Every public top-level name of every generated module is
    reserved or made from the diagram's own name."""
    import ast

    folder = Path(__file__).resolve().parents[1] / "generated"
    seen = set()
    for path in sorted(folder.glob("*.py")):
        if path.stem == "__init__":
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [(a.asname or a.name).split(".")[0] for a in node.names]
            elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            else:
                names = []
            seen |= {n for n in names if not n.startswith("_") and not n.startswith(path.stem)}
    assert "functools" in seen and seen <= RESERVED, sorted(seen - RESERVED)


# ---- dtypes ---------------------------------------------------------------------------

def test_unknown_dtypes():
    text = HEAD + "in A[b] : fp17\nB[b] : float = A * 2\nout B\nschedule { accumulate fp31 }\n"
    found = errors(text)
    assert [(d.message, where(d)) for d in found] == [
        ("unknown dtype 'fp17'", pos(text, "fp17")),     # at the dtype, not the tensor's name
        ("unknown dtype 'float'", pos(text, "float")),
        ("unknown dtype 'fp31'", pos(text, "fp31")),
    ]
    assert found[0].hint.startswith("did you mean 'fp16'? dtypes are fp64, fp32")


def test_accumulate_must_be_a_float():
    text = HEAD + ATTENTION + "schedule { accumulate int32 }\n"
    d = one(text)
    assert d.message == "cannot accumulate in int32: the accumulator must be fp32, fp16, bf16 or fp64"


# ---- box wires, reductions, contractions --------------------------------------------

def test_box_has_an_unreduced_wire():
    text = HEAD + "S[b, h, q, x] = Q * K\nout S\n"
    d = one(text)
    assert d.message == ("S declares [b, h, q, x] but its expression has d too: "
                         "reduce it (sum[d](...)) or declare it")
    assert where(d) == (7, 1)


def test_box_misses_a_declared_wire():
    text = HEAD + "O[b, h, q, d] = sum[d](Q)\nout O\n"
    d = one(text)
    assert d.message == "O declares [b, h, q, d] but its expression has no d"
    assert where(d) == pos(text, "d] = ")                  # the layout's d, which the hint drops


# ---- layout wires are reported where they are written -----------------------------

def rendered(text: str) -> str:
    """The NapkinError text napkin.load_text gives for ``text`` (t.ncd)."""
    with pytest.raises(napkin.NapkinError) as info:
        napkin.load_text(text, "t.ncd")
    return str(info.value)


def test_load_text_reads_cr_only_line_endings():
    """With lines ended by CR alone, Lark read the first comment to the end of the text: an empty
    diagram passed silently, the typo Zz unseen (napkin check, reading the file with universal
    newlines, was right)."""
    text = "diagram attn  # a comment\rwire n\rin X[n] : fp32\rY[n] = 2 * Zz\rout Y\r"
    assert rendered(text) == """\
t.ncd:4:12: unknown name 'Zz'
    Y[n] = 2 * Zz
               ^^"""


def test_unknown_wire_in_an_input_layout_points_at_the_wire():
    text = "diagram t\nwire b, h, x\nwire d = 64\nin K[b, h, x, dd] : fp16\nout K\n"
    assert rendered(text) == """\
t.ncd:4:15: unknown wire 'dd' in the layout of K
    in K[b, h, x, dd] : fp16
                  ^^
  hint: did you mean 'd'?"""


def test_unknown_wire_in_a_box_layout_points_at_the_wire():
    text = HEAD + "S[b, h, qq, x] : fp16 = sum[d](Q * K)\nout S\n"
    assert rendered(text) == """\
t.ncd:7:9: unknown wire 'qq' in the layout of S
    S[b, h, qq, x] : fp16 = sum[d](Q * K)
            ^^
  hint: did you mean 'q'?"""


def test_unknown_wire_inside_a_grouped_axis_points_at_that_wire():
    # One location per wire, not per group: the caret is under gg alone.
    text = "diagram t\nwire b, hk, g, q\nin Q[b, (hk gg), q] : fp16\nout Q\n"
    assert rendered(text) == """\
t.ncd:3:13: unknown wire 'gg' in the layout of Q
    in Q[b, (hk gg), q] : fp16
                ^^
  hint: did you mean 'g'?"""


def test_wire_twice_across_grouped_axes_points_at_the_repeat():
    text = "diagram t\nwire hk, q\nwire g = 2\nin Q[(hk g), (g q)] : fp16\nout Q\n"
    assert rendered(text) == """\
t.ncd:4:15: wire 'g' appears twice in the layout of Q
    in Q[(hk g), (g q)] : fp16
                  ^"""


def test_layout_locations_fall_back_to_the_tensor_for_built_nodes():
    # A node built in code records no wire locations: messages stay at its name.
    loc = ir.Loc(3, 4, 3, 5)
    d = ir.Diagram("t", (ir.Wire("q"),), (ir.Input("A", (("q",), ("zz",)), "fp16", loc),), (),
                   (ir.Output("A"),))
    assert [(e.message, e.loc) for e in check(d)] == [("unknown wire 'zz' in the layout of A", loc)]
    assert ir.layout_locs(d.inputs[0]) == (loc, loc)


def test_grouped_axis_layout_is_its_wires():
    text = "diagram t\nwire hk, q\nwire g = 2\nin Q[(hk g), q] : fp16\nS[hk, g] = sum[q](Q)\nT[(g hk), q] = Q * 2\nout S, T\n"
    assert errors(text) == []


def test_reduction_over_a_missing_wire():
    text = HEAD + "M[b, h, q, d] = max[x](Q)\nout M\n"
    d = one(text)
    assert d.message == "max[x] reduces x, but its operand has no x"
    assert where(d) == pos(text, "max[x]")


def test_softmax_over_a_missing_wire():
    text = HEAD + "P[b, h, q, d] = softmax[x](Q)\nout P\n"
    d = one(text)
    assert d.message == "softmax[x] normalises along x, but its operand has no x"
    assert where(d) == pos(text, "softmax")


def test_contraction_over_a_wire_of_one_factor():
    text = HEAD.replace("in K[b, h, x, d]", "in K[b, h, x]") + "S[b, h, q, x] = sum[d](Q * K)\nout S\n"
    d = one(text)
    assert d.message == "sum[d] contracts nothing: d is in Q but not in K"
    assert where(d) == pos(text, "sum[d]")


# ---- booleans and numbers --------------------------------------------------------------

def test_where_condition_must_be_boolean():
    text = HEAD + "S[b, h, q, x] = where(sum[d](Q * K), 1, 0)\nout S\n"
    d = one(text)
    assert d.message == "where's condition must be a boolean (a comparison), not a number"
    assert where(d) == pos(text, "sum[d]")


def test_arithmetic_on_booleans():
    text = HEAD + "S[b, h, q, x] = (x <= q) * sum[d](Q * K)\nout S\n"
    d = one(text)
    assert d.message == "'*' needs numbers, not a boolean"
    assert d.hint == "where(cond, a, b) turns a condition into numbers"


def test_ordering_booleans_and_logic_on_numbers():
    text = HEAD + "A[q, x] = where((x <= q) < (q <= x), 1, 0)\nB[q, x] = where(x and q, 1, 0)\nout A, B\n"
    assert [d.message for d in errors(text)] == [
        "'<' compares numbers, not booleans",
        "'and' needs booleans, not a number",
    ]


def test_a_wrong_kind_under_an_operator_is_one_error_not_a_contradicting_second():
    """-(x < q) was also "where's condition must be a boolean ..., not a number" and softmax[x](not S)
    also "softmax[x] needs numbers, not booleans": the second saying the opposite of the first."""
    text = HEAD + ("S[b, h, q, x] = sum[d](Q * K)\nR[b, h, q, x] = where(-(x < q), S, 0)\n"
                   "P[b, h, q, x] = softmax[x](not S)\nT[b, h, q, x] = exp(x < q) + (S and S) * 2\nout P, R, T\n")
    assert [(d.message, where(d)) for d in errors(text)] == [
        ("'-' needs a number, not a boolean", pos(text, "-(x < q)")),
        ("'not' needs a boolean, not a number", pos(text, "not S")),
        ("exp needs numbers, not a boolean", pos(text, "exp(")),
        ("'and' needs booleans, not a number", pos(text, "S and S")),
    ]


def test_an_input_of_an_unknown_dtype_is_neither_number_nor_boolean_to_its_readers():
    """A mask typed 'boool' was read as a number: "where's condition must be a boolean" at the
    correct line that uses it; an unknown name likewise."""
    text = HEAD + ("in keep[x] : boool\nS[b, h, q, x] = where(keep, sum[d](Q * K), -inf)\n"
                   "T[b, h, q, x] = where(kep, S, -inf)\nout S, T\n")
    assert [(d.message, where(d)) for d in errors(text)] == [
        ("unknown dtype 'boool'", pos(text, "boool")),
        ("unknown name 'kep'", pos(text, "kep,")),
    ]


def test_boolean_inputs_and_comparisons_are_fine():
    text = HEAD + ("in keep[b, x] : bool\n"
                   "S[b, h, q, x] = where(keep and x <= q and not (q == x), sum[d](Q * K), -inf)\nout S\n")
    assert errors(text) == []
