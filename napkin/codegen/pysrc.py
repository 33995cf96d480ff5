"""Python source as the emitters write and read it: the one spelling of a
quoted name and of a tuple (a 1-tuple keeps its comma), of a tensor put
along another's wires and summed back to its own (``along``, ``summed_to``),
and the names a piece of generated code
reads.  Its own module because emit.py, tma.py and
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


def along(wires, target) -> str:
    """Indexing that puts a tensor laid out along ``wires`` along ``target``'s
    (a superset): its own axes permuted to their order there, None where it
    lacks one (gate[x, h] along V[b, h, x, d]: ``.permute(1, 0)[None, :, :, None]``)."""
    order = [w for w in target if w in wires]
    perm = tuple(list(wires).index(w) for w in order)
    return (f".permute{perm}" if perm != tuple(range(len(perm))) else "") + \
        "[" + ", ".join(":" if w in wires else "None" for w in target) + "]"


def summed_to(wires, target) -> str:
    """What takes a tensor laid out along ``wires`` to ``target``'s (a subset):
    summed over the wires target lacks, the rest permuted to target's order
    (dgate[b, x, h] of dW * V along V[b, h, x, d]: ``.sum(dim=(3,)).permute(0, 2, 1)``)."""
    summed = tuple(i for i, w in enumerate(wires) if w not in target)
    kept = [w for w in wires if w in target]
    perm = tuple(kept.index(w) for w in target)
    return (f".sum(dim={summed})" if summed else "") + (f".permute{perm}" if perm != tuple(range(len(perm))) else "")
