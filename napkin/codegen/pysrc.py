"""Python literals as the emitters write them into generated source: the
one spelling of a quoted name and of a tuple (a 1-tuple keeps its comma).
Its own module because emit.py and tma.py both need it and emit imports tma.
Names are plain identifiers by then (the checker refuses any other), so
quoting needs no escaping."""

from __future__ import annotations

# -inf and inf as generated Triton source writes them
NEG_INF = 'float("-inf")'
POS_INF = 'float("inf")'


def quote(s: str) -> str:
    return f'"{s}"'


def tuple_of(items) -> str:
    items = list(items)
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
