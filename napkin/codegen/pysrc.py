"""Python source as the emitters write and read it: the one spelling of a
quoted name and of a tuple (a 1-tuple keeps its comma), and the names a
piece of generated code reads.  Its own module because emit.py, tma.py and
chunks.py need it and emit imports them.  Names are plain identifiers by
then (the checker refuses any other), so quoting needs no escaping."""

from __future__ import annotations

import ast
import functools
import textwrap

# -inf and inf as generated Triton source writes them
NEG_INF = 'float("-inf")'
POS_INF = 'float("inf")'


def quote(s: str) -> str:
    return f'"{s}"'


def tuple_of(items) -> str:
    items = list(items)
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


@functools.lru_cache(maxsize=256)
def names_read(code: str) -> frozenset[str]:
    """The names generated ``code`` (whole statements, indented as one block)
    loads.  It decides which tiles a loop loads and which parameters the
    merge kernel takes, so a name in a comment or a string must not count."""
    tree = ast.parse(textwrap.dedent(code))
    return frozenset(n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load))
