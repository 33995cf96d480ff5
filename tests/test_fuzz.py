"""Fuzzing: whatever the text, napkin answers with a NapkinError or a diagram.

Any other exception escaping ``napkin.load_text`` is a bug (a crash where the
user deserved a message).  Inputs: the shipped examples with tokens or lines
deleted, duplicated, swapped or replaced; random printable text; random
bytes decoded with replacement characters; printed diagrams that the
grammar accepts but the checker should refuse.  Every error must also point
inside the text it complains about.

The CLI part runs ``napkin check`` on mutated files and asserts exit status
0 or 1, never a traceback.
"""
from __future__ import annotations

import dataclasses
import random
import re
import string
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import napkin
from napkin import ir
from napkin.cli import main
from napkin.errors import NapkinError
from napkin.printer import to_text

from strategies import any_diagrams, attention_diagrams, expressions, matmul_diagrams

EXAMPLES = {p.stem: p.read_text() for p in
            sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.ncd"))}

# Tokens roughly as the lexer sees them, whitespace and comments included, so
# that joining them gives the text back and a mutation moves whole tokens.
TOKEN = re.compile(r"\s+|#[^\n]*|[A-Za-z_]\w*|(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?|<=|>=|==|!=|.", re.S)
TOKENS = {stem: TOKEN.findall(text) for stem, text in EXAMPLES.items()}
# Replacements: every token of the examples, plus edge cases the examples lack.
VOCAB = sorted({t for ts in TOKENS.values() for t in ts if not t.isspace()} | {
    "inf", "-", "--", "(", ")", "[", "]", "{", "}", "|", "^", ",", ":", "=", "!", ".", "#",
    "0", "-1", "1e400", "1e-400", "99999999999999999999", "0.5", "not", "and", "or", "across",
    "softmax", "logsumexp", "where", "exp", "max", "sum", "devices", "regs", "bool", "int64",
    "\n", "\t", "\r", "\x0c", "\x00", "\u2028", "é", "$", "_x", "sum[x](", "where(",
})
LINES = [line for text in EXAMPLES.values() for line in text.splitlines()]

FUZZ = settings(deadline=None, suppress_health_check=list(HealthCheck), database=None)


def load_or_user_error(text: str) -> None:
    """Load ``text``; a NapkinError is fine as long as it points into the text."""
    try:
        napkin.load_text(text, "fuzz.ncd")
    except NapkinError as err:
        # The same line split as load_text's: universal newlines (a lone CR ends a line too).
        lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
        for d in err.diagnostics:
            assert 1 <= d.loc.line <= len(lines), (d, text)
            assert 1 <= d.loc.col <= len(lines[d.loc.line - 1]) + 1, (d, text)
        assert str(err).startswith("fuzz.ncd:")


def mutate(items: list[str], edits) -> str:
    """Apply (kind, i, j, new) edits to a list of tokens or lines; join them."""
    items = list(items)
    for kind, i, j, new in edits:
        if not items:
            break
        i, j = i % len(items), j % len(items)
        if kind == "delete":
            del items[i]
        elif kind == "duplicate":
            items.insert(i, items[i])
        elif kind == "swap":
            items[i], items[j] = items[j], items[i]
        elif kind == "replace":
            items[i] = new
        else:
            items.insert(i, new)
    return "".join(items)


def edits(replacements) -> st.SearchStrategy:
    edit = st.tuples(st.sampled_from(("delete", "duplicate", "swap", "replace", "insert")),
                     st.integers(0, 10**4), st.integers(0, 10**4), replacements)
    return st.lists(edit, min_size=1, max_size=4)


# --------------------------------------------------------------------------
# Text.
# --------------------------------------------------------------------------

@settings(FUZZ, max_examples=800)
@given(st.sampled_from(sorted(TOKENS)), edits(st.sampled_from(VOCAB)))
def test_examples_with_mutated_tokens(stem, changes):
    load_or_user_error(mutate(TOKENS[stem], changes))


@settings(FUZZ, max_examples=300)
@given(st.sampled_from(sorted(EXAMPLES)), edits(st.sampled_from(LINES).map(lambda line: line + "\n")))
def test_examples_with_mutated_lines(stem, changes):
    # Lines keep their newlines so that a swap moves whole statements.
    lines = [line + "\n" for line in EXAMPLES[stem].splitlines()]
    load_or_user_error(mutate(lines, changes))


@settings(FUZZ, max_examples=300)
@given(st.booleans(), st.text(st.sampled_from(string.printable), max_size=200))
def test_random_printable_text(with_header, text):
    # With a valid header the parser gets past its first token.
    load_or_user_error(("diagram a\n" if with_header else "") + text)


@settings(FUZZ, max_examples=200)
@given(st.booleans(), st.binary(max_size=300))
def test_random_bytes_decoded(with_header, data):
    load_or_user_error(("diagram a\n" if with_header else "") + data.decode("utf-8", errors="replace"))


@settings(FUZZ, max_examples=100)
@given(st.text(max_size=100))
def test_random_unicode(text):
    load_or_user_error("diagram a\nwire q\nS[q] = " + text)


@pytest.mark.parametrize("opening, closing", [
    ("-", ""), ("not ", ""), ("exp(", ")"), ("(", ")"), ("sum[q](", ")"), ("2^", ""), ("|", "|"), ("[", "]"),
])
@pytest.mark.parametrize("depth", [50, 99, 100, 101, 500, 5000])
def test_deep_nesting_is_an_error_not_a_crash(opening, closing, depth):
    load_or_user_error("diagram a\nwire q\nS[q] = " + opening * depth + "q" + closing * depth + "\nout S\n")


def test_long_chains_are_an_error_not_a_crash():
    for op in ("+", "*", "and", "or", "-"):
        load_or_user_error("diagram a\nwire q\nS[q] = q" + f" {op} q" * 3000 + "\n")


# --------------------------------------------------------------------------
# Diagrams the grammar accepts and the checker must judge.
# --------------------------------------------------------------------------

@settings(FUZZ, max_examples=300)
@given(any_diagrams())
def test_printed_arbitrary_diagrams(d):
    load_or_user_error(to_text(d))


@st.composite
def damaged_diagrams(draw) -> ir.Diagram:
    """A valid diagram with one thing changed: a box's expression, a tile,
    a wire's size or the order of the levels."""
    d = draw(st.one_of(attention_diagrams(), matmul_diagrams()))
    what = draw(st.sampled_from(("expression", "tile", "size", "levels")))
    if what == "expression":
        i = draw(st.integers(0, len(d.lets) - 1))
        lets = list(d.lets)
        lets[i] = dataclasses.replace(lets[i], expr=draw(expressions))
        return dataclasses.replace(d, lets=tuple(lets))
    levels = list(d.schedule.levels)
    if what == "tile":
        i = draw(st.integers(0, len(levels) - 1))
        tile = ir.Tile(draw(st.sampled_from("bhqxdmnk")), draw(st.sampled_from(("group", "stream"))),
                       draw(st.integers(0, 300)), draw(st.booleans()))
        tiles = draw(st.permutations(levels[i].tiles + (tile,)))
        levels[i] = dataclasses.replace(levels[i], tiles=tuple(tiles),
                                        capacity=draw(st.one_of(st.none(), st.integers(1, 10**6))))
    elif what == "levels":
        extra = ir.Level(draw(st.sampled_from(ir.LEVELS)), None, (), ("Q", "A"))
        levels = draw(st.permutations(levels + [extra]))
    else:
        wires = list(d.wires)
        i = draw(st.integers(0, len(wires) - 1))
        wires[i] = dataclasses.replace(wires[i], size=draw(st.one_of(st.none(), st.integers(0, 5000))))
        return dataclasses.replace(d, wires=tuple(wires))
    return dataclasses.replace(d, schedule=dataclasses.replace(d.schedule, levels=tuple(levels)))


@settings(FUZZ, max_examples=300)
@given(damaged_diagrams())
def test_damaged_valid_diagrams(d):
    load_or_user_error(to_text(d))


def test_checker_regression_undeclared_wire_in_a_box():
    # check.py sorted the wires of a box by declaration order and crashed with
    # ValueError on a wire that was never declared (it came in through A).
    with pytest.raises(NapkinError, match="unknown wire 'kk'"):
        napkin.load_text("diagram t\nwire m, k\nin A[m, kk] : fp16\nC[m] = sum[k](A)\n")


# --------------------------------------------------------------------------
# The command line.
# --------------------------------------------------------------------------

def _mutated_files(folder: Path) -> list[Path]:
    rng = random.Random(20240611)  # fixed: the same files every run
    paths = []
    for n in range(36):
        stem = sorted(TOKENS)[n % len(TOKENS)]
        changes = [(rng.choice(("delete", "duplicate", "swap", "replace", "insert")),
                    rng.randrange(10**4), rng.randrange(10**4), rng.choice(VOCAB))
                   for _ in range(rng.randint(0, 3))]  # 0 edits: some files stay valid
        path = folder / f"{n:02d}_{stem}.ncd"
        path.write_text(mutate(TOKENS[stem], changes), encoding="utf-8")
        paths.append(path)
    odd = {
        "empty.ncd": b"",
        "latin1.ncd": "diagram caf\xe9\n".encode("latin-1"),  # not UTF-8
        "nul.ncd": b"diagram a\x00\n",
        "deep.ncd": b"diagram a\nwire q\nS[q] = " + b"-" * 5000 + b"q\n",
        "crlf.ncd": EXAMPLES["attention"].replace("\n", "\r\n").encode(),
    }
    for name, data in odd.items():
        (folder / name).write_bytes(data)
        paths.append(folder / name)
    paths.append(folder / "missing.ncd")  # never written
    paths.append(folder)  # a directory
    return paths


def test_cli_check_on_mutated_files(tmp_path, capsys):
    statuses = {}
    for path in _mutated_files(tmp_path):
        status = main(["check", str(path)])
        out, err = capsys.readouterr()
        statuses[path.name] = status
        assert status in (0, 1), (path.name, err)
        assert "Traceback" not in out + err and "internal error" not in err, (path.name, err)
        if status == 0:
            assert out.startswith(f"{path}: ok") and err == ""
        else:
            assert err.startswith(f"{path}:"), err
    # Both outcomes happened: the fuzz neither broke everything nor nothing.
    assert set(statuses.values()) == {0, 1}
    assert statuses["crlf.ncd"] == 0 and statuses["latin1.ncd"] == 1


def test_cli_check_reports_every_file(tmp_path, capsys):
    paths = _mutated_files(tmp_path)
    status = main(["check", *map(str, paths)])
    out, err = capsys.readouterr()
    assert status == 1
    assert "Traceback" not in out + err
    for path in paths:  # each file is either ok on stdout or has an error on stderr
        assert f"{path}: ok" in out or f"{path}:" in err
