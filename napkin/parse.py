"""Pass 1: text -> IR.  ``parse(text, filename) -> Diagram``.

A Lark LALR parser (strict, positions propagated) and one Transformer that
builds the frozen nodes of ``napkin.ir``.  A grammar rule without a handler
fails loudly (``__default__``).  Lark's own errors are rewritten into a
``NapkinError`` saying, in words, what was expected at the caret.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
import sys
import unicodedata
from fractions import Fraction
from typing import NamedTuple, Optional

import lark
from lark import Token, Transformer, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken, VisitError

from . import ir
from .errors import Diagnostic, NapkinError
from .resources import grammar_text

# Units a capacity may be given in.
UNITS = {"B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3,
         "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}


# Deeper expressions are refused: the tree walks here and in later passes
# recurse (several frames a level), and Python stops at 1000 frames.
MAX_DEPTH = 100


def _no_keywords(token: Token) -> Token:
    # Lark's contextual lexer reads a keyword as a NAME wherever the keyword
    # itself cannot appear (``wire out``, or ``out`` after a dangling ``+``).
    # Either way the keyword is misplaced: handing the parser the keyword
    # itself makes it stop right there, expecting what belongs there.
    keyword = _keywords().get(str(token))
    return token if keyword is None else Token.new_borrow_pos(keyword, str(token), token)


@functools.lru_cache(maxsize=1)
def _parser() -> lark.Lark:
    return lark.Lark(grammar_text(), parser="lalr", strict=True,
                     propagate_positions=True, maybe_placeholders=False,
                     lexer_callbacks={"NAME": _no_keywords})


@functools.lru_cache(maxsize=1)
def _keywords() -> dict[str, str]:
    """The grammar's words (wire, in, by, inf, ...), which cannot be names,
    and their terminals (WIRE, IN, ...)."""
    return {t.pattern.value: t.name for t in _parser().terminals
            if t.pattern.type == "str" and re.fullmatch(r"[A-Za-z_]\w*", t.pattern.value)}


def parse(text: str, filename: str = "<input>") -> ir.Diagram:
    """Parse ``.ncd`` text into a Diagram.  Raises NapkinError on bad input."""
    try:
        tree = _parser().parse(text)
    except UnexpectedInput as err:
        raise NapkinError([_syntax_diagnostic(err, text)], filename=filename, source=text) from None
    try:
        _check_depth(tree)
    except NapkinError as err:
        raise err.with_source(filename, text) from None
    build = _Build()
    try:
        diagram = build.transform(tree)
    except VisitError as err:
        if isinstance(err.orig_exc, NapkinError):
            raise err.orig_exc.with_source(filename, text) from None
        raise err.orig_exc
    if build.problems:   # every one the text has, in order; the checker runs once they are gone
        raise NapkinError(sorted(build.problems, key=lambda d: (d.loc.line, d.loc.col)),
                          filename=filename, source=text)
    return diagram


def _check_depth(tree: lark.Tree) -> None:
    """Refuse an expression deeper than MAX_DEPTH, without recursing to find out."""
    stack = [(tree, -1, tree)]  # the root of a box's expression is at depth 1
    while stack:
        node, depth, item = stack.pop()
        if depth > MAX_DEPTH:  # only a box's expression nests: item is a let
            name = item.children[0]
            raise NapkinError([Diagnostic(f"the expression of box {str(name)!r} is nested too deeply "
                                          f"(more than {MAX_DEPTH} levels; each operator of a chain such as "
                                          "a + b + c is a level)", _loc_of(name),
                                          hint="split it into several boxes")])
        for child in node.children:
            if isinstance(child, lark.Tree):
                stack.append((child, depth + 1, child if depth == -1 else item))


def _loc_of(meta_or_token) -> ir.Loc:
    m = meta_or_token
    if getattr(m, "empty", False):
        return ir.NOLOC
    return ir.Loc(m.line, m.column, m.end_line, m.end_column)


# --------------------------------------------------------------------------
# Lark errors in words.
# --------------------------------------------------------------------------

_WORDS = {"NAME": "a name", "NUMBER": "a number", "COMPARE": "a comparison",
          "ADD_OP": "'+' or '-'", "MUL_OP": "'*', '/', '//' or '%'", "$END": "the end of the file"}

# Sets of terminals that a hint names with one phrase, so that it reads
# "expected an expression" rather than listing seven tokens.  Each applies
# when its defining members are all expected; it then swallows its other
# members too.
_PHRASES = (
    ("an expression", {"NAME", "NUMBER", "LPAR"},
     {"NAME", "NUMBER", "LPAR", "MINUS", "INF", "NOT", "VBAR"}),
    ("an operator", {"ADD_OP", "MUL_OP"},
     {"ADD_OP", "MUL_OP", "CIRCUMFLEX", "COMPARE", "AND", "OR"}),
    # After a complete statement: another one (a box starts with its NAME).
    ("a new statement", {"WIRE", "IN", "OUT", "SCHEDULE"},
     {"WIRE", "IN", "OUT", "SCHEDULE", "NAME", "$END"}),
)


def _describe(terminal: str) -> str:
    if terminal in _WORDS:
        return _WORDS[terminal]
    for t in _parser().terminals:
        if t.name == terminal and t.pattern.type == "str":
            return repr(t.pattern.value)
    return terminal.lower()


def _expected(names) -> str:
    names = set(names)
    words = set()
    for phrase, defining, members in _PHRASES:
        if defining <= names:
            names -= members
            words.add(phrase)
    words = sorted(words | {_describe(n) for n in names})
    if len(words) == 1:
        return words[0]
    return ", ".join(words[:-1]) + " or " + words[-1]


# what may follow a number with no space: a capacity's unit (256KiB), a word operator (1<2and q>=0)
_NUMBER_ENDS = re.compile(r"(" + "|".join(UNITS) + r"|and|or|not)")


def _bad_number(text: str, since: int, until: int) -> Optional[Diagnostic]:
    """The first number between ``since`` and ``until`` run into letters,
    digits or a dot it cannot take (0x10, 1_000, 64d, 2e, 12.5abc), as a
    diagnostic at the whole word; None if there is none.  The lexer reads 0x10
    as the number 0 and a name x10, so the syntax error falls on a later token
    (the next line's 'in'): it is the number that is wrong.  ``since``: where
    the last token the parser took before the error starts; a word ending
    before it parsed well (capacity 228kib is 228 and a unit) and is not
    what the error is about."""
    code = re.sub(r"#[^\n]*", lambda c: " " * len(c.group()), text)   # comments blanked, places kept
    for word in re.finditer(r"(?<![\w.])([0-9][\w.]*|\.[0-9][\w.]*)", code, re.ASCII):   # (as NUMBER: ASCII)
        if word.start() > until:   # (a word the error falls inside counts: 5.e's error is at its e)
            break
        if word.end() <= since:
            continue
        number = re.match(_parser().get_terminal("NUMBER").pattern.to_regexp(), word.group())   # the grammar's
        rest = word.group()[number.end():]
        if rest and not _NUMBER_ENDS.fullmatch(rest):
            line = text.count("\n", 0, word.start()) + 1
            col = word.start() - (text.rfind("\n", 0, word.start()) + 1) + 1
            return Diagnostic(f"{word.group()} is not a number", ir.Loc(line, col, line, col + len(word.group())),
                              hint="napkin reads decimal numbers, such as 16, 1000, 2.5 or 1e-6")
    return None


def _character(c: str, before: str = "") -> str:
    """A character the lexer refused, as a message shows it: a non-ASCII one
    with its code point and Unicode name, and what napkin reads instead.  A
    Kelvin sign or a Cyrillic a was shown as 'K' or 'а', which look like the
    letters a name may have.  ``before``: the line ahead of it; a digit
    that would continue a name (q٦) is told about names, not numbers."""
    if c.isascii():
        return repr(c)
    name = unicodedata.name(c, None)
    code = f"U+{ord(c):04X}" + (f" {name}" if name else "")
    if unicodedata.decimal(c, None) is not None and not _in_name(before):
        why = "numbers are written in the ASCII digits 0-9"
    elif unicodedata.category(c)[0] in "LM" or unicodedata.decimal(c, None) is not None:
        # a letter, a mark that joins one, or a digit that would go on a name
        why = "names are ASCII letters, digits and _"
    else:
        why = "napkin reads only ASCII outside comments"
    return f"{c!r} ({code}): {why}"


def _in_name(before: str) -> bool:
    """Whether text ending in ``before`` ends inside a name (q, q1, _x2; not 12)."""
    run = re.search(r"[A-Za-z0-9_]*$", before).group()
    return bool(run) and not run[0].isdigit()


def _replay(text: str, bad: Token) -> tuple[Optional[set[str]], Optional[Token]]:
    """The terminals that lead somewhere (not only LALR's look-aheads) in the
    parser's state just before the token ``bad`` was fed, and the token taken
    before it, found by parsing ``text`` again a token at a time; (None, None)
    if that parse does not fail at ``bad``."""
    ip, last = _parser().parse_interactive(text), None
    tokens = ip.lexer_thread.lex(ip.parser_state)   # (the lexer too refuses a token the state cannot take)
    try:
        while True:
            before = ip.copy(deepcopy_values=False)
            tok = next(tokens, None)
            if tok is None:
                ip.feed_eof(last)   # ($END borrows the last token's place, as in parse())
                return None, None
            ip.feed_token(tok)
            last = tok
    except UnexpectedToken as err:
        if err.token.type == bad.type and err.token.start_pos == bad.start_pos:
            return before.accepts(), last
    except UnexpectedInput:
        pass
    return None, None


def _dangling_operator(text: str, equal: Token) -> Optional[Diagnostic]:
    """A box's '=' (or the ':' before its dtype) met inside the expression
    above it, because that line ends with an operator (S[q] = a *, then
    P[q] = ...: P[q] became the operand of '*'), as an error at that
    operator; None if it is not so.  "to compare, write '=='" sent the
    reader to the '=' of a correct line."""
    lines = re.sub(r"#[^\n]*", "", text[:equal.start_pos]).split("\n")
    if not re.fullmatch(r"\s*[A-Za-z_]\w*\s*\[[\w\s,()]*\]\s*(:\s*\w+\s*)?", lines[-1]):
        return None                           # not a box's head (where(x = q, ...): a slip for '==')
    for n in range(len(lines) - 2, -1, -1):   # the nearest line above with code
        if lines[n].strip():
            op = re.search(r"(\+|-|\*|/|\^|<=?|>=?|==|!=|\band|\bor|\bnot)\s*$", lines[n])
            if op is None:
                return None
            col = op.start() + 1
            return Diagnostic(f"line {n + 1} ends with '{op.group(1)}', so the box on line {equal.line} was read "
                              "as its operand", ir.Loc(n + 1, col, n + 1, col + len(op.group(1))),
                              hint=f"finish the expression after '{op.group(1)}', or drop the '{op.group(1)}'")
    return None


# C's logical operators, which a mask is often first written with
_C_LOGIC = {"&": "and", "!": "not"}


def _reads_tensor_at(text: str, at: int) -> bool:
    """Whether ``at`` is inside the brackets of a tensor read in a box's
    expression (``rel[h, q - x]``), not a declaration's axes or a
    reduction's wires (``sum[d]``): the innermost '[' open before it follows
    a name that is no reduction, after the statement's '='."""
    depth = 0
    for i in range(at - 1, -1, -1):
        c = text[i]
        if c == "]":
            depth += 1
        elif c == "[" and depth:
            depth -= 1
        elif c == "[":
            name = re.search(r"([A-Za-z_]\w*)\s*$", text[:i])
            line = text[text.rfind("\n", 0, i) + 1:i]
            return (name is not None and name.group(1) not in ir.REDUCTIONS + ir.NORMALIZERS
                    and re.search(r"(?<![=!<>])=(?!=)", line) is not None)
        elif c == "\n" and not depth:
            return False
    return False


def _syntax_diagnostic(err: UnexpectedInput, text: str) -> Diagnostic:
    at = getattr(err, "pos_in_stream", None)
    if isinstance(err, UnexpectedToken):
        at = len(text) if err.token.type == "$END" else err.token.start_pos
    accepts, last = _replay(text, err.token) if isinstance(err, UnexpectedToken) else (None, None)
    if isinstance(err, UnexpectedCharacters):
        last = (err.token_history or [None])[-1]
    bad = _bad_number(text, last.start_pos if last else 0, len(text) if at is None else at)
    if bad is not None:
        return bad
    if isinstance(err, UnexpectedToken):
        tok = err.token
        # Lark's own sets are taken after the reductions the bad token set
        # off (in Q  K, K reduced Q to a whole expression first), so they
        # missed the operator the writer most likely left out: ask the
        # parser as it stood before that token instead.
        expected = accepts or set(err.accepts or err.expected)
        if tok.type == "$END":
            what = "unexpected end of file"
            if tok.end_line:   # $END takes the last token's place: just after it, not after a comment
                loc = ir.Loc(tok.end_line, tok.end_column)
            else:              # no token at all
                lines = text.rstrip(" \t\f\r\n").split("\n")  # Lark's whitespace, Lark's lines
                loc = ir.Loc(len(lines), len(lines[-1]) + 1)
        else:
            shown = str(tok) if len(str(tok)) <= 24 else str(tok)[:20] + "..."
            what = f"unexpected {shown!r}"
            loc = ir.Loc(tok.line, tok.column, tok.end_line or tok.line,
                         tok.end_column or tok.column + len(str(tok)))
        # inside the brackets of a read or a reduction the one operator is // (q // 64: a coarse
        # read), and a reduction refuses it: say '//' in a read, nothing in a reduction
        brackets = "MUL_OP" in expected and expected <= {"COMMA", "RSQB", "MUL_OP"}
        in_read = tok.type != "$END" and expected <= {"NAME", "COMMA", "RSQB", "MUL_OP"} and \
            _reads_tensor_at(text, tok.start_pos)
        if brackets:
            expected = expected - {"MUL_OP"} | ({"'//'"} if in_read else set())
        hint = f"expected {_expected(expected)}"
        # The usual slips, spelled out.
        if tok.type == "COMPARE" and "COMPARE" not in expected and "AND" in expected:
            what, hint = "comparisons do not chain", "write 'a < b and b < c'"
        elif tok.type in ("EQUAL", "COLON") and (dangling := _dangling_operator(text, tok)) is not None:
            return dangling
        elif tok.type == "EQUAL" and "COMPARE" in expected:
            hint = "to compare, write '=='"
        elif str(tok) == "*" and text[:tok.start_pos].rstrip().endswith("*"):
            hint = "a power is written with '^', as in x^2"
        elif str(tok) in _keywords() and "NAME" in expected:
            hint += f" ('{tok}' is a reserved word, so it cannot be a name)"
        elif str(tok) == "|" and "OR" in expected and not re.match(r"\|\s*[A-Za-z_]\w*\s*\|", text[tok.start_pos:]):
            # C's || or |, where an operator goes (2 |d| is a size missing its '*': left to the set)
            hint = "napkin's logical operators are words: write 'or'"
        elif tok.type == "RSQB" and text[:tok.start_pos].rstrip().endswith("["):   # in t[] : fp32
            line = text[text.rfind("\n", 0, tok.start_pos) + 1:tok.start_pos].lstrip()
            hint = ("a scalar input is written without brackets: in t : fp32" if line.startswith("in ") else
                    "a scalar is read by its name alone, without brackets" if "=" in line else
                    f"{hint}: a box holds one wire at least; only an input may be a scalar (in t : fp32)")
        elif in_read:
            # an index computed from wires (a relative-position table, T[h, q - x]) is a gather
            hint = (f"{hint}: a tensor is read along wires, one name each, or at a wire's blocks (q // 64); "
                    "T[h, q - x] would be a gather, which napkin does not make: expand the table in torch and "
                    "pass T[h, q, x]")
        return Diagnostic(what, loc, hint=hint)
    if isinstance(err, UnexpectedCharacters):
        before = text[text.rfind("\n", 0, err.pos_in_stream) + 1:err.pos_in_stream]
        # the lexer's allowed set holds look-aheads that lead nowhere (']' in a hold list) and
        # misses a new statement: ask the parser's state what really goes on
        expected = err.allowed
        if err.state is not None:
            ip = _parser().parse_interactive("")
            ip.parser_state = err.state.copy(deepcopy_values=False)
            expected = ip.accepts() or expected
        hint = f"expected {_expected(expected)}" if expected else None
        if err.char in _C_LOGIC and _C_LOGIC[err.char].upper() in expected:   # C's &&, & and ! ('!=' lexes)
            hint = f"napkin's logical operators are words: write '{_C_LOGIC[err.char]}'"
        return Diagnostic(f"unexpected character {_character(err.char, before)}", ir.Loc(err.line, err.column),
                          hint=hint)
    if isinstance(err, UnexpectedEOF):  # pragma: no cover - LALR reports $END tokens
        return Diagnostic("unexpected end of file", ir.Loc(1, 1),
                          hint=f"expected {_expected(err.expected)}")
    return Diagnostic(str(err).splitlines()[0], ir.Loc(getattr(err, "line", 0), getattr(err, "column", 0)))


# --------------------------------------------------------------------------
# Tree -> IR.
# --------------------------------------------------------------------------

class _Layout(NamedTuple):
    """A parsed layout: its axes and where each of their wires is written
    (one Loc per wire, grouped axes flattened, as ``ir.Input.wire_locs``)."""

    axes: tuple[ir.Axis, ...]
    locs: tuple[ir.Loc, ...]


@v_args(meta=True, inline=True)
class _Build(Transformer):
    """One handler per surviving grammar rule; anything else is a bug.

    A problem a rule finds in words (an unknown function, unit, option) is
    collected and the rule goes on with a stand-in, so one parse reports
    every such problem; parse() raises them all at the end (the stand-ins
    never reach the checker)."""

    def __init__(self):
        super().__init__()
        self.problems: list[Diagnostic] = []

    def _refuse(self, problem: Diagnostic) -> None:
        self.problems.append(problem)

    # A number that cannot be taken is refused and a stand-in returned, so the
    # parse goes on and every problem of the text is reported (one raised here
    # hid the others: an unknown function above a `q by 128.0`).
    def _number(self, tok: Token, expression: bool = False):
        text = str(tok)
        if re.fullmatch(r"[0-9]+", text):
            try:
                return int(text)
            except ValueError:  # past Python's limit on digits converted (4300 by default)
                self._refuse(Diagnostic(f"a number with {len(text)} digits is too long", _loc_of(tok)))
                return 1
        value = float(text)
        if math.isinf(value):   # float() takes 1e400 as inf: every score inf, every output NaN, silently
            self._refuse(Diagnostic(f"{text} is too large for a number (the largest is about 1.8e308)",
                                    _loc_of(tok), hint="write inf if infinity is meant" if expression else None))
            return 1.0
        if value == 0 and re.search(r"[1-9]", text.lower().split("e")[0]):
            self._refuse(Diagnostic(f"{text} is too small for a number: it would be 0 (the smallest is about "
                                    "4.9e-324)", _loc_of(tok)))
            return 1.0
        return value

    def _whole(self, tok: Token, what: str) -> int:
        problems = len(self.problems)
        value = self._number(tok)
        if isinstance(value, int) or len(self.problems) > problems:   # (1e400: refused as too large)
            return value if isinstance(value, int) else 1
        if value == int(value):   # 64.0 and 1e3 are whole: "must be a whole number, not 64.0" was wrong
            self._refuse(Diagnostic(f"{what} is written in digits ({int(value)}), not {tok}", _loc_of(tok)))
        else:
            self._refuse(Diagnostic(f"{what} must be a whole number, not {tok}", _loc_of(tok)))
        return 1

    def __default__(self, data, children, meta):
        raise NotImplementedError(f"napkin's grammar rule {data!r} has no IR handler")

    # ---- top level ----
    def start(self, meta, name, *items):
        wires, inputs, lets, outputs, schedules = [], [], [], [], []
        for item in items:
            if isinstance(item, list) and item and isinstance(item[0], ir.Wire):
                wires.extend(item)
            elif isinstance(item, list):
                outputs.extend(item)
            elif isinstance(item, ir.Input):
                inputs.append(item)
            elif isinstance(item, ir.Let):
                lets.append(item)
            elif isinstance(item, ir.Schedule):
                schedules.append(item)
            else:  # pragma: no cover
                raise NotImplementedError(f"unhandled item {item!r}")
        for extra in schedules[1:]:
            self._refuse(Diagnostic("a diagram has one schedule; this is the second", extra.loc))
        wire_names = {w.name for w in wires}
        lets = [dataclasses.replace(l, expr=_resolve(l.expr, wire_names)) for l in lets]
        return ir.Diagram(str(name), tuple(wires), tuple(inputs), tuple(lets), tuple(outputs),
                          schedules[0] if schedules else None, _loc_of(name))

    def wire_decl(self, meta, *items):
        return list(items)

    def wire_item(self, meta, name, size=None):
        return ir.Wire(str(name), None if size is None else self._whole(size, "a wire size"), _loc_of(name))

    def input_decl(self, meta, name, layout, dtype):
        return ir.Input(str(name), layout.axes, str(dtype), _loc_of(name), layout.locs, _loc_of(dtype))

    def scalar_input(self, meta, name, dtype):
        return ir.Input(str(name), (), str(dtype), _loc_of(name), (), _loc_of(dtype))

    def layout(self, meta, *axes):
        # each axis comes as (its wires, where each of them is written)
        return _Layout(tuple(axis for axis, _ in axes), tuple(loc for _, locs in axes for loc in locs))

    def single_axis(self, meta, name):
        return (str(name),), (_loc_of(name),)

    def group_axis(self, meta, *names):
        return tuple(str(n) for n in names), tuple(_loc_of(n) for n in names)

    def let(self, meta, name, layout, *rest):
        dtype, expr = (str(rest[0]), rest[1]) if len(rest) == 2 else (None, rest[0])
        where = _loc_of(rest[0]) if len(rest) == 2 else ir.NOLOC
        return ir.Let(str(name), layout.axes, dtype, expr, _loc_of(name), layout.locs, where)

    def output_decl(self, meta, *names):
        return [ir.Output(str(n), _loc_of(n)) for n in names]

    # ---- schedule ----
    def schedule(self, meta, *items):
        profile, profile_loc = None, ir.NOLOC
        if items and isinstance(items[0], Token):
            profile, profile_loc, items = str(items[0]), _loc_of(items[0]), items[1:]
        accumulate, accumulate_loc, tf32, levels = "fp32", ir.NOLOC, False, []
        for item in items:
            if isinstance(item, ir.Level):
                levels.append(item)
            elif item[0] == "accumulate":
                if accumulate_loc != ir.NOLOC:   # the second silently won, as no other repeat does
                    self._refuse(Diagnostic("a second 'accumulate' in one schedule", item[2],
                                            hint=f"the first, at line {accumulate_loc.line}, says {accumulate}; "
                                                 "keep one"))
                    continue
                accumulate, accumulate_loc = item[1], item[2]
            else:
                flag, loc = item[1], item[2]
                if flag != "tf32":
                    self._refuse(Diagnostic(f"unknown option 'allow {flag}'", loc,
                                            hint="the only option is 'allow tf32'"))
                    continue
                tf32 = True
        return ir.Schedule(profile, accumulate, tf32, tuple(levels), _loc_of(meta), profile_loc, accumulate_loc)

    def accumulate(self, meta, dtype):
        return ("accumulate", str(dtype), _loc_of(dtype))

    def allow(self, meta, flag):
        return ("allow", str(flag), _loc_of(flag))

    def level(self, meta, name, *items):
        capacity, tiles, holds = None, [], []
        for item in items:
            if isinstance(item, int):
                capacity = item
            elif item and isinstance(item[0], ir.Tile):
                tiles.extend(item)
            else:
                holds.extend(item)
        return ir.Level(str(name), capacity, fold_chunks(tiles), tuple(n for n, _ in holds), _loc_of(name),
                        tuple(loc for _, loc in holds))

    def capacity(self, meta, number, unit=None):
        scale = 1
        if unit is not None:
            if str(unit) not in UNITS:
                self._refuse(Diagnostic(f"unknown unit {str(unit)!r}", _loc_of(unit),
                                        hint="units are " + ", ".join(UNITS)))
                return 1   # a stand-in: parse() raises before anything reads it
            scale = UNITS[str(unit)]
        problems = len(self.problems)
        self._number(number)          # (too large, too small)
        if len(self.problems) > problems:
            return 1
        # exact: a float refused 1.001 MB (1,001,000 bytes) as "not 1000999.9999999999"
        value = Fraction(str(number)) * scale
        if value.denominator != 1 or value <= 0:
            written = f" ({number} {unit})" if scale != 1 else ""
            shown = str(value.numerator) if value.denominator == 1 else repr(float(value))
            self._refuse(Diagnostic(f"a capacity must be a positive whole number of bytes, not {shown}{written}",
                                    _loc_of(number)))
            return 1
        if value > sys.float_info.max:   # (the cost pass divides by it as a float)
            self._refuse(Diagnostic(f"{number} {unit} is too large for a capacity (the largest is about 1.8e308 "
                                    "bytes)", _loc_of(number)))
            return 1
        return int(value)

    def group(self, meta, *tiles):
        return [dataclasses.replace(t, kind="group") for t in tiles]

    def stream(self, meta, *tiles):
        return [dataclasses.replace(t, kind="stream") for t in tiles]

    def hold(self, meta, *names):
        return [(str(n), _loc_of(n)) for n in names]

    def tile_by(self, meta, wire, size):
        return ir.Tile(str(wire), "", self._whole(size, "a block size"), False, _loc_of(wire))

    def tile_across(self, meta, wire, size, layout=None):
        # the layout word is checked where its level's meaning is known (check.py)
        return ir.Tile(str(wire), "", self._whole(size, "a device count"), True, _loc_of(wire),
                       layout=None if layout is None else str(layout),
                       layout_loc=_loc_of(layout) if layout is not None else _loc_of(wire))

    # ---- expressions ----
    def or_(self, meta, lhs, rhs):
        return ir.Binary("or", lhs, rhs, _loc_of(meta))

    def and_(self, meta, lhs, rhs):
        return ir.Binary("and", lhs, rhs, _loc_of(meta))

    def not_(self, meta, operand):
        return ir.Unary("not", operand, _loc_of(meta))

    def compare(self, meta, lhs, op, rhs):
        return ir.Binary(str(op), lhs, rhs, _loc_of(meta))

    def binop(self, meta, lhs, op, rhs):
        return ir.Binary(str(op), lhs, rhs, _loc_of(meta))

    def pow(self, meta, base, exponent):
        return ir.Binary("^", base, exponent, _loc_of(meta))

    def neg(self, meta, operand):
        # Fold a negated literal into the literal, so -0.5 and -inf are numbers
        # (and print back the same way).
        if isinstance(operand, ir.Num):
            return ir.Num(-operand.value, _loc_of(meta))
        return ir.Unary("-", operand, _loc_of(meta))

    def number(self, meta, tok):
        return ir.Num(self._number(tok, expression=True), _loc_of(tok))

    def inf(self, meta):
        return ir.Num(float("inf"), _loc_of(meta))

    def name(self, meta, tok):
        # Wire index or tensor: resolved in start(), once all wires are known.
        return ir.TensorRef(str(tok), None, _loc_of(tok))

    def wire_at(self, meta, tok):
        return str(tok), 1, _loc_of(tok)

    def wire_step(self, meta, tok, op, num):
        """``q // 64``: the read's index is the wire's, floor-divided (a coarse read)."""
        shown = f"{tok} {op} {num}"
        if str(op) != "//":
            self._refuse(Diagnostic(
                f"an index in brackets is a wire or, in a tensor read, its blocks (q // 64), not {shown}",
                _loc_of(meta),
                hint="any other index computed from wires would be a gather, which napkin does not make: "
                     "expand the table in torch and pass it along the wires"))
            return str(tok), 1, _loc_of(tok)
        step = self._number(num)
        if not isinstance(step, int) or step < 1:
            self._refuse(Diagnostic(f"the step of {shown} must be a positive whole number", _loc_of(num)))
            return str(tok), 1, _loc_of(tok)
        return str(tok), step, _loc_of(meta)

    def relabel(self, meta, name, *indices):
        steps = tuple(step for _, step, _ in indices)
        return ir.TensorRef(str(name), tuple(w for w, _, _ in indices), _loc_of(meta),
                            steps if any(s != 1 for s in steps) else None)

    def reduce(self, meta, op, *rest):
        *indices, body = rest
        for w, step, where in indices:
            if step != 1:   # the rule is shared with reads (the grammar's index)
                self._refuse(Diagnostic(f"a reduction names whole wires, not {w} // {step}", where))
        wires = [w for w, _, _ in indices]
        op_name, loc = str(op), _loc_of(meta)
        if op_name in ir.NORMALIZERS:
            if len(wires) != 1:
                joined = "".join(str(w) for w in wires)   # as a contraction over several wires is told (lower.py)
                self._refuse(Diagnostic(f"{op_name} normalises along one wire, not {len(wires)}", loc,
                                        hint=f"store ({' '.join(str(w) for w in wires)}) as one axis of each "
                                             f"tensor that has them, declare it as one wire and write "
                                             f"{op_name}[{joined}](...)" if len(wires) > 1 else None))
            return ir.Normalize(op_name, str(wires[0]) if wires else "", body, loc)
        if op_name not in ir.REDUCTIONS:
            self._refuse(Diagnostic(f"unknown reduction {op_name!r}", _loc_of(op),
                                    hint="reductions are " + ", ".join(ir.REDUCTIONS + ir.NORMALIZERS)))
        return ir.Reduce(op_name, tuple(str(w) for w in wires), body, loc)

    def call(self, meta, fn, *args):
        name = str(fn)
        if name not in ir.FUNCTIONS:
            self._refuse(Diagnostic(f"unknown function {name!r}", _loc_of(fn),
                                    hint=_INTEGER_HINTS.get(name, "functions are " + ", ".join(ir.FUNCTIONS))))
        elif len(args) != ir.FUNCTIONS[name]:
            self._refuse(Diagnostic(
                f"{name} takes {ir.FUNCTIONS[name]} argument{'s' if ir.FUNCTIONS[name] > 1 else ''}, "
                f"not {len(args)}", _loc_of(fn)))
        return ir.Call(name, tuple(args), _loc_of(meta))

    def size(self, meta, wire):
        return ir.WireSize(str(wire), _loc_of(meta))


# Functions other languages have for what napkin writes with // and %: the hint
# says how (floor(q / 128) in a mask is a chunk's number, q // 128).
_FLOOR_HINT = "floor division is an operator: floor(q / 128) is q // 128, and the remainder q % 128"
_INTEGER_HINTS = {"floor": _FLOOR_HINT, "floor_divide": _FLOOR_HINT, "div": _FLOOR_HINT, "trunc": _FLOOR_HINT,
                  "ceil": "ceil(q / 128) is -(-q // 128): floor division is the operator //",
                  "mod": "the remainder is an operator: mod(q, 128) is q % 128",
                  "fmod": "the remainder is an operator: fmod(q, 128) is q % 128",
                  "remainder": "the remainder is an operator: remainder(q, 128) is q % 128"}


def _resolve(expr: ir.Expr, wires: set[str]) -> ir.Expr:
    """Bare names that are wires become WireIndex; the rest stay tensors."""
    if isinstance(expr, ir.TensorRef):
        if expr.wires is None and expr.name in wires:
            return ir.WireIndex(expr.name, expr.loc)
        return expr
    if isinstance(expr, ir.Unary):
        return ir.Unary(expr.op, _resolve(expr.operand, wires), expr.loc)
    if isinstance(expr, ir.Binary):
        return ir.Binary(expr.op, _resolve(expr.lhs, wires), _resolve(expr.rhs, wires), expr.loc)
    if isinstance(expr, ir.Call):
        return ir.Call(expr.fn, tuple(_resolve(a, wires) for a in expr.args), expr.loc)
    if isinstance(expr, ir.Reduce):
        return ir.Reduce(expr.op, expr.wires, _resolve(expr.body, wires), expr.loc)
    if isinstance(expr, ir.Normalize):
        return ir.Normalize(expr.op, expr.wire, _resolve(expr.body, wires), expr.loc)
    return expr


def fold_chunks(tiles) -> tuple:
    """``group x by C`` beside ``stream x by B`` in one level is a chunked
    stream (ir.Tile.chunk): one tile, where the stream was written.  Any
    other repetition of a wire is left for the checker to report."""
    def only(wire, kind):
        found = [t for t in tiles if t.wire == wire and t.kind == kind]
        return found[0] if len(found) == 1 and not found[0].across else None

    out = []
    for t in tiles:
        group, stream = only(t.wire, "group"), only(t.wire, "stream")
        if group is None or stream is None:
            out.append(t)
        elif t is stream:
            out.append(dataclasses.replace(t, chunk=group.size, chunk_loc=group.loc))
    return tuple(out)
