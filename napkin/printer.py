"""IR -> canonical .ncd text.  ``to_text(diagram) -> str``.

The inverse of ``napkin.parse``: ``parse(to_text(d)) == d`` for every diagram
the parser can produce (locations aside, which take no part in equality).
The output is canonical, so printing is idempotent and two equal diagrams
print to the same text, whatever their source looked like:

* sections in a fixed order (wires, inputs, boxes, outputs, schedule), one
  blank line between them, comments dropped;
* consecutive wires of the same kind share one line (``wire b, h, q, x`` /
  ``wire d = 64``), as do consecutive tiles of the same kind in a level;
* expressions carry only the parentheses the grammar needs;
* numbers are spelled so they read back as the same value and type (ints as
  ints, floats through ``repr``), capacities in the largest exact binary unit.

Only one kind of IR node has no spelling: a minus applied to a number
(``Unary('-', Num(2))``).  The parser folds ``-2`` into ``Num(-2)``, so such a
node prints as ``-2`` and reads back folded; the parser never builds one.
NaN has no spelling at all and raises ValueError, as does an IR shape the
grammar cannot express (an empty layout, an unknown tile kind): those are
bugs in whatever built the IR, not user errors.
"""
from __future__ import annotations

import math

from . import ir

INDENT = "  "

# Binding strength, loosest first, mirroring the expression rules of
# grammars/ncd.lark: or < and < not < comparison < + - < * / < unary - < ^ < atom.
_OR, _AND, _NOT, _CMP, _ADD, _MUL, _NEG, _POW, _ATOM = range(1, 10)

# For a binary operator: its own strength and the strength each operand
# needs to go without parentheses.  Left-associative operators accept their
# own strength on the left only; comparisons do not chain, so neither side
# may be a comparison; ``^`` is right-associative and its base is an atom
# (``(-x)^2``), while its exponent may carry a sign (``|d|^-0.5``).
_BINARY = {
    "or": (_OR, _OR, _AND),
    "and": (_AND, _AND, _NOT),
    **{op: (_CMP, _ADD, _ADD) for op in ir.COMPARE_OPS},
    "+": (_ADD, _ADD, _MUL),
    "-": (_ADD, _ADD, _MUL),
    "*": (_MUL, _MUL, _NEG),
    "/": (_MUL, _MUL, _NEG),
    "//": (_MUL, _MUL, _NEG),
    "%": (_MUL, _MUL, _NEG),
    "^": (_POW, _ATOM, _NEG),
}

# Capacity units, largest first.  Binary units only: a capacity that is an
# exact number of KiB/MiB/GiB prints with one, anything else in plain bytes.
_UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def to_text(diagram: ir.Diagram) -> str:
    """The canonical .ncd text of ``diagram`` (ends with a newline)."""
    sections = [
        _wires(diagram.wires),
        [f"in {t.name}{layout_text(t.axes)} : {t.dtype}" for t in diagram.inputs],
        [_let(let) for let in diagram.lets],
        ["out " + ", ".join(o.name for o in diagram.outputs)] if diagram.outputs else [],
        _schedule(diagram.schedule) if diagram.schedule is not None else [],
    ]
    lines = [f"diagram {diagram.name}"]
    for section in sections:
        if section:
            lines.append("")
            lines.extend(section)
    return "\n".join(lines) + "\n"


def expr_text(expr: ir.Expr) -> str:
    """One expression as it would appear on the right of a box's ``=``."""
    return _expr(expr, 0)


# --------------------------------------------------------------------------
# Declarations.
# --------------------------------------------------------------------------

def _runs(items, key):
    """Split a sequence into maximal runs of consecutive items with equal key."""
    runs: list[list] = []
    for item in items:
        if runs and key(runs[-1][0]) == key(item):
            runs[-1].append(item)
        else:
            runs.append([item])
    return runs


def _wires(wires: tuple[ir.Wire, ...]) -> list[str]:
    # Declaration order matters to nobody's semantics but is part of the IR,
    # so runs keep it: ``wire b`` / ``wire d = 64`` / ``wire c`` stays three lines.
    lines = []
    for run in _runs(wires, lambda w: w.size is None):
        items = [w.name if w.size is None else f"{w.name} = {_int(w.size)}" for w in run]
        lines.append("wire " + ", ".join(items))
    return lines


def layout_text(axes: tuple[ir.Axis, ...]) -> str:
    """A layout as written: ``[b, (hk g), q]``; a scalar's none (``in t : fp32``)."""
    if not axes:
        return ""
    return "[" + ", ".join(_axis(a) for a in axes) + "]"


def _axis(axis: ir.Axis) -> str:
    if not axis:
        raise ValueError("an axis needs at least one wire")
    return axis[0] if len(axis) == 1 else "(" + " ".join(axis) + ")"


def _let(let: ir.Let) -> str:
    dtype = f" : {let.dtype}" if let.dtype is not None else ""
    return f"{let.name}{layout_text(let.axes)}{dtype} = {_expr(let.expr, 0)}"


# --------------------------------------------------------------------------
# The schedule.
# --------------------------------------------------------------------------

def _schedule(schedule: ir.Schedule) -> list[str]:
    head = "schedule" + (f" on {schedule.profile}" if schedule.profile is not None else "")
    # accumulate is always printed, even at its default: the reader of a
    # schedule should not need to know the default.
    body = [f"accumulate {schedule.accumulate}"]
    if schedule.tf32:
        body.append("allow tf32")
    for level in schedule.levels:
        body.extend(_level(level))
    return [head + " {"] + [INDENT + line for line in body] + ["}"]


def _level(level: ir.Level) -> list[str]:
    head = f"level {level.name}"
    if level.capacity is not None:
        head += f" capacity {_capacity(level.capacity)}"
    items = []
    for run in _runs(level.tiles, lambda t: t.kind):
        if run[0].kind not in ("group", "stream"):
            raise ValueError(f"unknown tile kind {run[0].kind!r}")
        # a chunked stream prints as the pair it was written as (ir.Tile.chunk)
        items += [f"group {t.wire} by {_int(t.chunk)}" for t in run if t.chunk is not None]
        items.append(run[0].kind + " " + ", ".join(_tile(t) for t in run))
    if level.holds:
        items.append("hold " + ", ".join(level.holds))
    # A level with one line of content reads best on one line, as in
    # ``level hbm { hold Q, K, V, O }``.
    if not items:
        return [head + " {}"]
    if len(items) == 1:
        return [f"{head} {{ {items[0]} }}"]
    return [head + " {"] + [INDENT + item for item in items] + ["}"]


def _tile(tile: ir.Tile) -> str:
    layout = f" {tile.layout}" if tile.layout else ""
    return f"{tile.wire} {'across' if tile.across else 'by'} {_int(tile.size)}{layout}"


def _capacity(nbytes: int) -> str:
    for unit, size in _UNITS:
        if nbytes % size == 0 and nbytes >= size:
            return f"{nbytes // size} {unit}"
    return _int(nbytes)


def _int(value: int) -> str:
    if not isinstance(value, int) or value < 0:
        raise ValueError(f"expected a non-negative whole number, got {value!r}")
    return str(value)


# --------------------------------------------------------------------------
# Expressions.
# --------------------------------------------------------------------------

def _strength(expr: ir.Expr) -> int:
    if isinstance(expr, ir.Binary):
        return _BINARY[expr.op][0]
    if isinstance(expr, ir.Unary):
        return _NOT if expr.op == "not" else _NEG
    if isinstance(expr, ir.Num) and math.copysign(1.0, expr.value) < 0:
        return _NEG  # -2 reads as a minus applied to 2
    return _ATOM


def _expr(expr: ir.Expr, need: int) -> str:
    """``expr`` as text, parenthesised when it binds looser than ``need``."""
    text = _bare(expr)
    return f"({text})" if _strength(expr) < need else text


def _bare(expr: ir.Expr) -> str:
    if isinstance(expr, ir.Num):
        return _number(expr.value)
    if isinstance(expr, ir.WireIndex):
        return expr.wire
    if isinstance(expr, ir.WireSize):
        return f"|{expr.wire}|"
    if isinstance(expr, ir.TensorRef):
        return ir.show(expr)   # Q, doc[b, q], keep[b, h, q // 64, x // 64]
    if isinstance(expr, ir.Unary):
        if expr.op == "not":
            return "not " + _expr(expr.operand, _NOT)
        # "--x" would read the same, but "-(-x)" says what it means.
        operand = _expr(expr.operand, _NEG)
        if operand.startswith("-"):
            operand = f"({operand})"
        return "-" + operand
    if isinstance(expr, ir.Binary):
        _, left, right = _BINARY[expr.op]
        lhs, rhs = _expr(expr.lhs, left), _expr(expr.rhs, right)
        # ^ is written tight, as in |d|^-0.5; everything else spaced.
        return f"{lhs}^{rhs}" if expr.op == "^" else f"{lhs} {expr.op} {rhs}"
    if isinstance(expr, ir.Call):
        return f"{expr.fn}({', '.join(_expr(a, 0) for a in expr.args)})"
    if isinstance(expr, ir.Reduce):
        return f"{expr.op}[{', '.join(expr.wires)}]({_expr(expr.body, 0)})"
    if isinstance(expr, ir.Normalize):
        return f"{expr.op}[{expr.wire}]({_expr(expr.body, 0)})"
    raise TypeError(f"not an expression node: {expr!r}")


def _number(value) -> str:
    """A literal that reads back as the same value and type."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"not a number: {value!r}")
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        raise ValueError("NaN has no .ncd spelling")
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    # repr is the shortest text that reads back as the same float, and is
    # always in NUMBER's shape after its sign: 0.5, 1e-05, 1e+16, 2.0.
    return repr(value)
