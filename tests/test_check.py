"""The checker (napkin.check) and the tiling arithmetic it shares with the cost model.

Each error kind gets a small diagram; tests assert the exact message and that
the location points at the offending text (``pos`` finds that text's line
and column, so the expected spot is stated as the snippet it should be).
"""
from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from strategies import any_diagrams, attention_diagrams, matmul_diagrams

import napkin
from napkin import ir, tiling
from napkin.check import RESERVED, check, hostile_name
from napkin.parse import parse

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.ncd"))

HEAD = """diagram t
wire b, h, q, x
wire d = 64
in Q[b, h, q, d] : fp16
in K[b, h, x, d] : fp16
in V[b, h, x, d] : fp16
"""
FLASH = """
schedule on h100 {
  level hbm { hold Q, K, V, O }
  level smem {
    group b by 1, h by 1, q by 128
    stream x by 64
  }
}
"""
ATTENTION = """S[b, h, q, x] = sum[d](Q * K) * |d|^-0.5
P[b, h, q, x] = softmax[x](S)
O[b, h, q, d] : fp16 = sum[x](P * V)
out O
"""


def errors(text: str):
    return check(parse(text, "t.ncd"))


def one(text: str):
    found = errors(text)
    assert len(found) == 1, [d.message for d in found]
    return found[0]


def pos(text: str, snippet: str, nth: int = 0) -> tuple[int, int]:
    """1-based (line, col) of the nth occurrence of snippet in text."""
    at = -1
    for _ in range(nth + 1):
        at = text.index(snippet, at + 1)
    line = text.count("\n", 0, at) + 1
    return line, at - (text.rfind("\n", 0, at) + 1) + 1


def where(diag) -> tuple[int, int]:
    return diag.loc.line, diag.loc.col


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


# ---- the schedule ---------------------------------------------------------------------

def test_unknown_profile_and_level():
    text = HEAD + ATTENTION + "schedule on H100 {\n  level shmem { }\n}\n"
    found = errors(text)
    assert [(d.message, where(d)) for d in found] == [
        ("unknown profile 'H100'", pos(text, "H100")),
        ("unknown level 'shmem'", pos(text, "shmem")),
    ]
    assert found[0].hint.startswith("did you mean 'h100'?")
    assert found[1].hint.startswith("did you mean 'smem'?")


def test_levels_out_of_order_and_repeated():
    text = HEAD + ATTENTION + "schedule {\n  level smem { }\n  level hbm { }\n  level smem { }\n}\n"
    assert [(d.message, where(d)) for d in errors(text)] == [
        ("level hbm comes after level smem: levels go outermost first (devices, hbm, smem, regs)",
         pos(text, "hbm")),
        ("level smem appears twice (first at line 12)", pos(text, "smem", 1)),
    ]


def test_a_repeated_levels_tiles_are_not_checked_as_that_levels():
    """level smem mistyped as a second level hbm gave, besides "appears twice", one "blocks belong
    in level smem" per tile of it: four errors for one word."""
    text = HEAD + ATTENTION + ("schedule {\n  level hbm { hold Q, K, V, O }\n"
                               "  level hbm { group b by 1, q by 64, x by 64 }\n}\n")
    assert [(d.message, where(d)) for d in errors(text)] == [
        ("level hbm appears twice (first at line 12)", pos(text, "hbm", 1))]


def test_across_only_at_devices_and_by_only_elsewhere():
    text = HEAD + ATTENTION + ("schedule {\n  level devices { group q by 128 }\n"
                               "  level smem { stream x across 4 }\n}\n")
    assert [(d.message, where(d)) for d in errors(text)] == [
        ("level devices splits wires over devices: write 'group q across N', not 'by'",
         pos(text, "q by 128")),
        ("'stream x across 4' splits x over devices: 'across' belongs in level devices",
         pos(text, "x across")),
    ]


def test_no_blocks_in_level_hbm():
    # hbm's one processor is the whole GPU: a block there named no program, and the cost pass
    # (which narrowed smem's residency by it but not its grid) and the kernels read it apart
    text = HEAD + ATTENTION + ("schedule {\n  level hbm { hold Q\n    group q by 128\n    stream x by 512 }\n"
                               "  level smem { group b by 1, h by 1\n    stream x by 64 }\n}\n")
    found = errors(text)
    assert [(d.message, where(d)) for d in found] == [
        ("'group q by 128' in level hbm: one processor of hbm is the whole GPU, which sees every wire "
         "whole; blocks belong in level smem (one program's)", pos(text, "q by 128")),
        ("'stream x by 512' in level hbm: one processor of hbm is the whole GPU, which sees every wire "
         "whole; blocks belong in level smem (one program's)", pos(text, "x by 512")),
    ]
    assert found[0].hint == ("write 'group q by 128' in level smem, or 'group q across N' in level devices "
                             "to split q over GPUs")


def test_device_count_must_be_positive():
    text = HEAD + ATTENTION + "schedule { level devices { group q across 0 } }\n"
    d = one(text)
    assert d.message == "cannot split q across 0 devices"
    assert where(d) == pos(text, "q across")


def test_device_counts_past_two_to_the_twenty_are_refused_at_the_tile_that_passes_it():
    """across 99999999999999999999 checked clean, then the cost pass listed every device's
    peers until memory ran out; a grid's counts multiply (2048 x 1024 passes 2^20 at x)."""
    text = HEAD + ATTENTION + "schedule { level devices { group q across 99999999999999999999 } }\n"
    d = one(text)
    assert d.message == ("'group q across 99999999999999999999' makes 99,999,999,999,999,999,999 devices in all: "
                         "napkin models at most 1,048,576 (2^20)")
    assert where(d) == pos(text, "q across")
    text = HEAD + ATTENTION + "schedule { level devices { group q across 2048, x across 1024 } }\n"
    d = one(text)
    assert d.message.startswith("'group x across 1024' makes 2,097,152 devices in all") and where(d) == pos(text, "x across")
    assert not errors(HEAD + ATTENTION + "schedule { level devices { group q across 1024, x across 1024 } }\n")


def test_a_ring_counts_its_devices_once():
    """group q across P beside stream x across P is a ring of P devices (the cost pass's and
    napkin plan's count), not P^2: a ring of 1025 was refused as 1,050,625 devices, and napkin
    plan --devices 1025 --emit could not write the ring it ranked first."""
    ring = "schedule { level devices { group q across %d\n stream x across %d } }\n"
    assert not errors(HEAD + ATTENTION + ring % (2 ** 20, 2 ** 20))
    text = HEAD + ATTENTION + ring % (2 ** 20 + 1, 2 ** 20 + 1)
    d = one(text)
    assert d.message.startswith("'group q across 1048577' makes 1,048,577 devices in all") and \
        where(d) == pos(text, "q across")
    # a stream of another count beside the group is a dimension of its own (the generic model's)
    text = HEAD + ATTENTION + ring % (2048, 1024)
    d = one(text)
    assert d.message.startswith("'stream x across 1024' makes 2,097,152 devices in all") and \
        where(d) == pos(text, "x across")
    # ... and so is one beside a group of a wire its chunks carry (h of K and V: cost/devices.py)
    text = HEAD + ATTENTION + "schedule { level devices { group h across 2048\n stream x across 2048 } }\n"
    d = one(text)
    assert d.message.startswith("'stream x across 2048' makes 4,194,304 devices in all") and \
        where(d) == pos(text, "x across")


def test_tiles_twice_two_streams_and_block_sizes():
    text = HEAD + ATTENTION + ("schedule {\n  level smem {\n    group q by 96, q by 128, b by 2\n"
                               "    stream x by 64, h by 1\n  }\n}\n")
    found = errors(text)
    assert [(d.message, where(d)) for d in found] == [
        ("block size 96 for q is not a power of two", pos(text, "q by 96")),
        ("wire q is tiled twice in level smem", pos(text, "q by 128")),
        ("block size 2 for b is too small: b takes part in a contraction, and matrix products "
         "(tl.dot) need blocks of at least 16", pos(text, "b by 2")),
        ("level smem streams x and h: at most one wire is streamed per level", pos(text, "h by 1")),
    ]
    assert found[0].hint == "try 64 or 128"


def test_small_blocks_on_wires_outside_contractions_are_fine():
    # x is not in any contraction here, and a block bigger than a fixed wire is masked.
    text = "diagram t\nwire q, x\nwire d = 8\nin A[q, x, d] : fp32\nB[q, x, d] = A * 2\nout B\n" \
           "schedule on h100 { level smem { group q by 4, x by 2, d by 64 } }\n"
    assert errors(text) == []


def test_hold_unknown_and_held_twice():
    text = HEAD + ATTENTION + "schedule {\n  level hbm { hold Q, O }\n  level smem { hold S, O }\n}\n"
    d = one(text)
    assert d.message == "O is held at both level hbm and level smem"
    assert where(d) == pos(text, "O }", 1)   # the second hold of O, in level smem
    text = HEAD + ATTENTION + "schedule {\n  level smem { hold S, S }\n}\n"
    d = one(text)
    assert (d.message, where(d)) == ("S is held twice in level smem", pos(text, "S }"))



@pytest.mark.parametrize("level, name, role", [("smem", "O", "output"), ("regs", "K", "input")])
def test_an_input_or_output_held_on_chip_is_refused_at_the_hold(level, name, role):
    """An output held in smem passed check and compiled (codegen wrote it to hbm anyway),
    while the cost pass priced its kernel at 0 bytes and 0 FLOPs (novel3 hunt)."""
    inner = f"  level regs {{ hold S, {name} }}\n" if level == "regs" else ""
    text = HEAD + ATTENTION + ("schedule {\n  level hbm { hold Q }\n  level smem { group q by 16\n"
                               f"    stream x by 16{'' if inner else f'  hold S, {name}'} }}\n{inner}}}\n")
    d = one(text)
    assert d.message == (f"{role} {name} is held in level {level}, but inputs and outputs live in hbm (the "
                         "kernels read the caller's tensors and write the results there)")
    assert where(d) == pos(text, f"{name} }}")
    assert d.hint == f"hold {name} in level hbm, or leave it out of 'hold'"


# ---- streamability ------------------------------------------------------------------------

MANUAL_SOFTMAX = HEAD + """S[b, h, q, x] = sum[d](Q * K)
M[b, h, q] = max[x](S)
P[b, h, q, x] = exp(S - M)
O[b, h, q, d] : fp16 = sum[x](P * V)
out O
"""


def test_completed_max_beside_streamed_values():
    d = one(MANUAL_SOFTMAX + FLASH)
    assert d.message == ("P uses max[x] of S beside values along x: that max is complete only after "
                         "the last chunk of x, so P cannot be computed chunk by chunk")
    assert d.hint == "softmax[x] streams with a running max"
    assert where(d) == pos(MANUAL_SOFTMAX, "S - M")


def test_the_same_diagram_is_fine_without_streaming_x():
    assert errors(MANUAL_SOFTMAX + FLASH.replace("stream x by 64", "group x by 64")) == []
    assert errors(MANUAL_SOFTMAX) == []


def test_completion_flows_through_boxes():
    text = HEAD + ("S[b, h, q, x] = sum[d](Q * K)\nl[b, h, q] = sum[x](exp(S))\nr[b, h, q] = 1 / l\n"
                   "P[b, h, q, x] = exp(S) * r\nout P\n") + FLASH.replace("O }", "P }")
    d = one(text)
    assert d.message.startswith("P uses sum[x] of exp(S) beside values along x: that sum is complete")
    assert where(d) == pos(text, "exp(S) * r")


SOFTMAX_HEAD = HEAD + "S[b, h, q, x] = sum[d](Q * K)\nP[b, h, q, x] = softmax[x](S)\n"


@pytest.mark.parametrize("body, consumer, snippet", [
    ("E[b, h, q, x] = exp(P)\nO[b, h, q, d] = sum[x](E * V)\nout O\n", "exp in E", "exp(P)"),
    ("m[b, h, q] = max[x](P)\nout m\n", "max[x] in m", "max[x](P)"),
    ("O[b, h, q, d] = sum[x]((P + 1) * V)\nout O\n", "'+' in O", "P + 1"),
    ("O[b, h, q, d] = sum[x](P * V)\nout O, P\n", "the output list (out P)", "P\n"),
])
def test_streamed_softmax_feeds_only_a_sum(body, consumer, snippet):
    text = SOFTMAX_HEAD + body + FLASH.replace("hold Q, K, V, O }", "}")
    d = one(text)
    assert d.message == (f"P (a softmax[x] of S) cannot stream over x: {consumer} uses it, but a softmax "
                         "over a streamed wire can only feed a sum over it, as in sum[x](P * V)")
    assert where(d) == pos(text, snippet, text.count(snippet) - 1 if snippet == "P\n" else 0)
    # a sum or difference (differential attention's P1 - lam * P2) is linear: each term a sum of its own
    assert d.hint == ("give each softmax a sum of its own: sum[x]((A + B) * V) is sum[x](A * V) + sum[x](B * V), "
                      "which streams" if consumer == "'+' in O" else
                      "its normaliser is complete only after the last chunk of x; stream another wire, or do not "
                      "stream x")


@pytest.mark.parametrize("body", [
    "O[b, h, q, d] = sum[x](P * V)\nout O\n",
    "O[b, h, q, d] = sum[x](V * (P / 2))\nout O\n",
    "n[b, h, q] = sum[x](P)\nout n\n",
    "lse[b, h, q] = logsumexp[x](S)\nz[b, h, q] = sum[x](exp(S) * 2)\nout lse, z\n",
])
def test_streaming_reductions_that_are_fine(body):
    assert errors(SOFTMAX_HEAD + body + FLASH.replace("hold Q, K, V, O }", "}")) == []


# ---- capacity and tiling --------------------------------------------------------------------

MATMUL = """diagram mm
wire m = 4096
wire n = 4096
wire k = 4096
in A[m, k] : fp16
in B[k, n] : fp16
C[m, n] : fp16 = sum[k](A * B)
out C
schedule on h100 {
  level hbm { hold A, B, C }
  level smem CAPACITY {
    group m by 256, n by 256
    stream k by 64
  }
}
"""


def test_capacity_overflow_with_a_declared_capacity():
    text = MATMUL.replace("CAPACITY", "capacity 200 KiB")
    d = one(text)
    # A 256x64 fp16 + B 64x256 fp16 + C's 256x256 fp32 accumulator = 32768 + 32768 + 262144
    assert d.message == ("tiles at level smem need 327680 bytes but its capacity is 204800 bytes "
                         "(its own capacity): over by 122880 bytes")
    assert d.hint == "biggest tiles: C 262144 bytes, A 32768 bytes, B 32768 bytes; smaller blocks shrink them " \
                     "(napkin cost --tune finds blocks that fit)"
    assert where(d) == pos(text, "smem")


def test_capacity_overflow_against_the_profile():
    text = MATMUL.replace("CAPACITY", "")
    capacity = tiling.level_capacity(parse(text), "smem")
    assert capacity == tiling.profile_table()["h100"]["smem"]
    d = one(text)
    assert d.message == (f"tiles at level smem need 327680 bytes but its capacity is {capacity} bytes "
                         f"(h100): over by {327680 - capacity} bytes")


def test_capacity_fits_with_smaller_blocks_and_is_skipped_for_symbolic_wires():
    assert errors(MATMUL.replace("CAPACITY", "").replace("by 256", "by 128")) == []
    symbolic = MATMUL.replace("wire m = 4096\nwire n = 4096\nwire k = 4096", "wire m, n, k")
    big = symbolic.replace("CAPACITY", "capacity 1 KiB").replace("group m by 256, n by 256", "")
    assert errors(big) == []  # A's tile spans all of m: unknown until call time


def test_tile_extent_by_across_and_inherited():
    d = napkin.load(Path(__file__).resolve().parent.parent / "examples" / "attention_2d.ncd")
    sizes = {"b": 2, "h": 8, "q": 1000, "x": 4096}
    assert tiling.tile_extent(d, "devices", "q", sizes) == 500
    assert tiling.tile_extent(d, "hbm", "x", sizes) == 2048
    assert tiling.tile_extent(d, "smem", "x", sizes) == 64
    assert tiling.tile_extent(d, "smem", "d", {}) == 64
    assert tiling.tile_extent(d, "hbm", "b", {}) is None


def test_level_footprint_of_flash_attention():
    d = napkin.load(Path(__file__).resolve().parent.parent / "examples" / "attention.ncd")
    q, x, dh = 128, 64, 64
    assert tiling.level_footprint(d, "smem", {}) == [
        ("Q", q * dh, q * dh * 2), ("K", x * dh, x * dh * 2), ("V", x * dh, x * dh * 2),
        ("S", q * x, q * x * 4), ("P", q * x, q * x * 4),
        ("O", q * dh, q * dh * 4),  # fp32 accumulator for the fp16 output
        ("lse", q, q * 4),
    ]
    with pytest.raises(tiling.UnboundWire):
        tiling.level_footprint(d, "hbm", {})
    hbm = dict((n, e) for n, e, _ in tiling.level_footprint(d, "hbm", {"b": 1, "h": 2, "q": 10, "x": 20}))
    assert hbm == {"Q": 2 * 10 * 64, "K": 2 * 20 * 64, "V": 2 * 20 * 64, "O": 2 * 10 * 64, "lse": 20}


def test_an_inner_levels_block_is_no_larger_than_the_enclosing_one():
    """regs' group q by 256 inside smem's q by 128 checked clean, and the cost pass then costed a
    256-row register tile no program has (more bytes into smem than out of it: costpaper hunt)."""
    text = HEAD + ATTENTION + ("schedule { level smem { group q by 128\n stream x by 64 }\n"
                               "level regs { group q by 256\n stream x by 64 } }\n")
    d = one(text)
    assert d.message == ("'group q by 256' in level regs is larger than level smem's block of q (128): "
                         "each regs block is part of a smem block")
    assert where(d) == pos(text, "q by 256")
    assert d.hint == "use a block of at most 128, or a larger one in level smem"
    assert errors(text.replace("q by 256", "q by 64").replace("x by 64 } }", "x by 16 } }")) == []
    # levels written inner first: the order's error alone, not nesting errors the wrong way round
    swapped = HEAD + ATTENTION + ("schedule { level regs { group q by 64\n stream x by 16 }\n"
                                  "level smem { group q by 128\n stream x by 64 } }\n")
    assert [e.message for e in errors(swapped)] == [
        "level smem comes after level regs: levels go outermost first (devices, hbm, smem, regs)"]


def test_home_levels():
    d = napkin.load(Path(__file__).resolve().parent.parent / "examples" / "matmul.ncd")
    assert tiling.home_level(d, "A") == "hbm"
    text = HEAD + ATTENTION + "schedule { level smem { group q by 64 } level regs { group x by 16 } }\n"
    d2 = parse(text)
    assert tiling.home_level(d2, "S") == "regs"
    assert tiling.home_level(d2, "O") == "hbm"
    assert tiling.tensor_dtype(d2, "S") == "fp32" and tiling.tensor_dtype(d2, "O") == "fp16"


# ---- everything at once ------------------------------------------------------------------------

def test_every_error_is_reported_in_order():
    text = """diagram t
wire b, q, x
wire d = 64
in Q[b, q, d] : fp16
in K[b, x, d] : fp17
in print[b] : fp16
S[b, q, x] = sum[d](Q * Kx)
T[b, q] = Q * 2
out S, Z
schedule on h100 {
  level smem { group q by 100 }
}
"""
    with pytest.raises(napkin.NapkinError) as info:
        napkin.load_text(text, "t.ncd")
    found = info.value.diagnostics
    assert [(d.message, where(d)) for d in found] == [
        ("unknown dtype 'fp17'", (5, 17)),
        ("'print' shadows a Python builtin", (6, 4)),
        ("unknown name 'Kx'", (7, 25)),
        ("T declares [b, q] but its expression has d too: reduce it (sum[d](...)) or declare it", (8, 1)),
        ("unknown tensor 'Z' in out", (9, 8)),
        ("block size 100 for q is not a power of two", (11, 22)),
    ]
    rendered = str(info.value)
    assert "t.ncd:7:25: unknown name 'Kx'" in rendered and "hint: did you mean 'K'?" in rendered


def test_wires_flattened_together_need_all_but_one_sized_elsewhere():
    """Q[(b h), q, d] with b and h on no other axis passed check and compile, and every call
    raised "cannot tell the sizes of wires b, h from the input shapes" (layouts hunt).  One
    of them fixed, or on an axis of its own elsewhere (GQA's K[b, x, hk, d] beside
    Q[b, q, (hk g), d]), tells the other from the product."""
    text = ("diagram t\nwire b, h, q, x\nwire d = 16\nin Q[(b h), q, d] : fp32\nin K[(b h), x, d] : fp32\n"
            "O[(b h), q, x] = sum[d](Q * K)\nout O\n")
    with pytest.raises(napkin.NapkinError) as err:
        napkin.load_text(text, "t.ncd")
    assert str(err.value).split("\n")[:5] == [
        "t.ncd:2:6: wire b has no size: it lies only in flattened axes such as (b h) of Q, beside another wire "
        "of no size, so a call cannot tell the one from the other in their product",
        "    wire b, h, q, x", "         ^", "  hint: give it one (wire b = 8), or an input along it alone",
        "t.ncd:2:9: wire h has no size: it lies only in flattened axes such as (b h) of Q, beside another wire "
        "of no size, so a call cannot tell the one from the other in their product"]
    napkin.load_text(text.replace("wire b, h, q, x", "wire b = 2\nwire h, q, x"), "t.ncd")
    # h sized only through a relabel (T[h] of T[g]) does not tell b: a call binds (b h) before it
    # spreads sizes along relabels, and failed with "cannot tell the sizes of wires b, h" (today5 hunt)
    relabelled = text.replace("wire b, h, q, x", "wire b, h, g, q, x").replace(
        "in K[(b h), x, d] : fp32\n", "in K[(b h), x, d] : fp32\nin T[g] : fp32\n").replace(
        "sum[d](Q * K)", "sum[d](Q * K) + T[h]")
    with pytest.raises(napkin.NapkinError, match="wire b has no size: it lies only in flattened axes"):
        napkin.load_text(relabelled, "t.ncd")
    napkin.load_text(text.replace("in K[(b h), x, d]", "in K[b, h, x, d]"), "t.ncd")
    napkin.load_text(text.replace("in K[(b h), x, d] : fp32\n", "in K[(b h), x, d] : fp32\nin s[h] : fp32\n"),
                     "t.ncd")


def test_a_wire_no_input_sizes_is_refused_and_a_relabel_sizes_one():
    """C[m, n, j] = ... * j compiled, and every call died on a KeyError: no
    input lies along j.  A wire a relabel ties to an input's (A[n, k] of
    A[m, k]) has its size."""
    text = "diagram t\nwire m, n, k, j\nin A[m, k] : fp32\nin B[k, n] : fp32\nC[m, n, j] = sum[k](A * B) * j\nout C\n"
    with pytest.raises(napkin.NapkinError) as err:
        napkin.load_text(text, "t.ncd")
    assert str(err.value) == (
        "t.ncd:2:15: wire j has no size: no input lies along it (nor along a wire a relabel ties it to), so a "
        "call cannot tell it from the shapes\n    wire m, n, k, j\n                  ^\n"
        "  hint: give it one (wire j = 8), or an input along it")
    napkin.load_text(text.replace("wire m, n, k, j", "wire m, n, k\nwire j = 8"), "t.ncd")
    # one no tensor uses at all: every call of its module was a KeyError
    with pytest.raises(napkin.NapkinError, match="wire y has no size: no input lies along it"):
        napkin.load_text(text.replace("wire m, n, k, j", "wire m, n, k, y\nwire j = 8"), "t.ncd")
    napkin.load_text("diagram g\nwire m, n, k\nin A[m, k] : fp32\nC[m, n] = sum[k](A * A[n, k])\nout C\n", "g.ncd")


# ---- found by a hunt over the front end --------------------------------------------------

def test_the_parser_reports_every_problem_it_finds_in_order():
    """An unknown reduction, function, argument count, option and unit: the
    first raised stopped the parse, so one problem was reported, and not the
    first (a capacity is built before its schedule)."""
    text = ("diagram t\nwire a, c\nin X[a, c] : fp32\nY[a] = sum[c](X)\nP[a, c] = softmx[c](X)\n"
            "Q[a, c] = exq(X)\nR[a, c] = exp(X, X)\nout Y, P, Q, R\n"
            "schedule on h100 {\n  allow fp16\n  level smem capacity 2 kb { group a by 16 }\n}\n")
    with pytest.raises(napkin.NapkinError) as info:
        parse(text, "t.ncd")
    found = info.value.diagnostics
    assert [(d.message, where(d)) for d in found] == [
        ("unknown reduction 'softmx'", pos(text, "softmx")),
        ("unknown function 'exq'", pos(text, "exq")),
        ("exp takes 1 argument, not 2", pos(text, "exp(X, X)")),
        ("unknown option 'allow fp16'", pos(text, "fp16")),
        ("unknown unit 'kb'", pos(text, "kb")),
    ]


def test_an_unknown_dtype_does_not_hide_a_size_problem():
    text = ("diagram t\nwire m, n, k, j\nin A[m, k] : fp16\nin B[k, n] : fp61\n"
            "C[m, n, j] = sum[k](A * B) * j\nout C\n")
    assert [d.message.split(":")[0] for d in errors(text)] == ["wire j has no size", "unknown dtype 'fp61'"]


def test_a_wire_of_size_zero_is_refused():
    text = "diagram z\nwire n = 0\nin X[n] : fp32\nY[n] = X / |n|\nout Y\n"
    d = one(text)
    assert (d.message, where(d)) == ("wire n has size 0: a wire's size is a whole number of at least 1",
                                     pos(text, "n = 0"))


def test_a_wire_of_size_zero_is_not_also_folded_into_constants():
    """|d|^-0.5 with wire d = 0 also gave "0 to a negative power: |d| ^ (-0.5) has no value"."""
    text = HEAD.replace("wire d = 64", "wire d = 0") + "S[b, h, q, x] = sum[d](Q * K) * |d|^-0.5 + 1 / |d|\nout S\n"
    assert [(d.message, where(d)) for d in errors(text)] == [
        ("wire d has size 0: a wire's size is a whole number of at least 1", pos(text, "d = 0"))]


@pytest.mark.parametrize("constant, message", [
    ("1 / 0", "division by zero: 1 / 0 has no value"),
    ("0 / 0", "division by zero: 0 / 0 has no value"),
    ("0 ^ -1", "0 to a negative power: 0 ^ (-1) has no value"),
    ("(-8) ^ (1 / 3)", "a negative number to a fractional power: (-8) ^ (1 / 3) is not a real number"),
    ("|d| / (|d| - 16)", "division by zero: |d| / (|d| - 16) has no value"),
    ("(-0.0) ^ -1", "0 to a negative power: (-0.0) ^ (-1) has no value"),
])
def test_a_constant_with_no_value_is_refused_where_written(constant, message):
    """1 / 0 or 0 ^ -1 passed check and compile, then both the kernel and reference() raised
    ZeroDivisionError at run time; (-8) ^ (1/3) made reference() complex (expr hunt)."""
    text = ("diagram c\nwire b, h, q, x\nwire d = 16\nin Q[b, h, q, d] : fp32\nin K[b, h, x, d] : fp32\n"
            f"S[b, h, q, x] = sum[d](Q * K) + {constant}\nout S\n")
    d = one(text)
    assert (d.message, d.loc.line, d.loc.col) == (message, 6, 33)
    assert not errors(text.replace(constant, "2 ^ 0.5 / |d|"))


@pytest.mark.parametrize("constant", ["(-2) ^ inf", "(-0.5) ^ -inf", "(15 - |d|) ^ inf", "(-inf) ^ 0.5", "2 ^ 0.5"])
def test_constants_with_a_value_pass(constant):
    """(-2) ^ inf crashed the new constant check (int(inf): OverflowError); (-inf) ^ 0.5 is inf
    to torch, no complex number (today3 hunt)."""
    text = ("diagram c\nwire b, h, q, x\nwire d = 16\nin Q[b, h, q, d] : fp32\nin K[b, h, x, d] : fp32\n"
            f"S[b, h, q, x] = sum[d](Q * K) + {constant}\nout S\n")
    assert not errors(text)


def test_relabels_tying_two_fixed_sizes_together_are_refused():
    """A[n, k] * A[p, k] of A[m, k] with n = 8 and p = 16 asks |m| to be both: check passed it and
    compile refused it at <input> (today4 hunt).  Each relabel alone is fine; the second is blamed."""
    d = one("diagram r6\nwire m, k\nwire n = 8\nwire p = 16\nin A[m, k] : fp32\n"
            "C[n, p] : fp32 = sum[k](A[n, k] * A[p, k])\nout C\n")
    assert (d.message, d.loc.line, d.loc.col) == (
        "one wire given two sizes: A[p, k] reads m as p, which ties n (= 8) to p (= 16)", 6, 35)


def test_an_unknown_name_of_the_other_kind_says_so():
    """hold q (a wire) said only "unknown tensor 'q'", group Q (a tensor) "unknown wire 'Q'"
    (errors3 hunt)."""
    text = ("diagram t\nwire q, x\nin Q[q, x] : fp16\nout Q\n"
            "schedule { level hbm { hold q }\n level smem { group Q by 16 } }\n")
    assert [(d.message, where(d), d.hint) for d in errors(text)] == [
        ("unknown tensor 'q' in hold", (5, 29), "q is a wire, not a tensor"),
        ("unknown wire 'Q' in level smem", (6, 21), "Q is a tensor, not a wire")]


# ---- floor division: index arithmetic ----------------------------------------------

CHUNK = HEAD + "in doc[b, x] : int32\nin tau[h] : fp32\nS[b, h, q, x] = where({mask}, sum[d](Q * K), -inf)\nout S\n"


@pytest.mark.parametrize("mask", ["x // 128 == q // 128", "(q - x) // 7 < 3", "x // |d| == q // |x|",
                                  "doc // 2 == doc[b, q] // 2", "max(q, 3) // 4 == -x // 4 * 2",
                                  "(q - x) % 4 == 0", "doc % |x| == q % 3 % 2"])
def test_floor_division_of_index_arithmetic_passes(mask):
    assert errors(CHUNK.format(mask=mask)) == []


@pytest.mark.parametrize("mask, snippet, message", [
    ("x // 128 == tau // 128", "tau // 128",
     "'//' divides whole numbers, and tau may not be one"),
    ("x // 2.5 == q // 2", "2.5",
     "'//' needs a positive whole divisor, not 2.5"),
    ("x // 0 == q", "0 ==",
     "'//' needs a positive whole divisor, not 0"),
    ("x // (|d| - 64) == q", "|d| - 64)",
     "'//' needs a positive whole divisor, not |d| - 64"),
    ("x // q == 1", "q ==",
     "'//' needs a positive whole divisor, not q"),
    ("(x / 2) // 3 == q", "x / 2)",
     "'//' divides whole numbers, and x / 2 may not be one"),
    ("tau % 2 == 1", "tau %", "'%' divides whole numbers, and tau may not be one"),
    ("x % -4 == q", "-4", "'%' needs a positive whole divisor, not -4"),
])
def test_floor_division_of_anything_else_is_refused_where_written(mask, snippet, message):
    """a // b is floor(a / b) (a % b its remainder) of whole numbers by a positive whole divisor:
    Python, torch and the kernels (whose // and % truncate, corrected for a negative numerator)
    then agree, and nothing divides by zero."""
    text = CHUNK.format(mask=mask)
    d = one(text)
    assert (d.message, where(d)) == (message, pos(text, snippet))


def test_a_token_layout_word_is_one_of_three_and_points_at_itself():
    text = HEAD + ATTENTION + ("schedule { level devices { group q across 4 contigous\n"
                               "  stream x across 4 zigzag } }\n")
    d = one(text)
    assert (d.message, where(d), d.hint) == ("unknown token layout 'contigous' for q", pos(text, "contigous"),
                                             "did you mean 'contiguous'?")
    text = HEAD + ATTENTION + "schedule { level devices { group q across 4 rows } }\n"
    assert one(text).hint == "the layouts are cyclic, zigzag, contiguous"
    assert not errors(HEAD + ATTENTION + "schedule { level devices { group q across 4 cyclic\n"
                                         "  stream x across 4 contiguous } }\n")   # the scheme's check: roles
