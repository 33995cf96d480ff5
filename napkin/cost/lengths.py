"""Length inputs priced at given values: ``--lengths`` of napkin cost.

A length input is an integer input compared with an index of a wire it is
not read along (ir.length_inputs): the prefix-LM's ``x < p[b]``, a ragged
batch's cache lengths ``x < n[b]``, a window's width read as a scalar
(``q - x < w``, examples/runtime_window.ncd).  Its mask reads data.  Where
every conjunct is a bound once the length is read (``x < n[b]``, ``q - x <
w``, the prefix-LM's ``x <= q or x < p[b]``, one bound ``x <= max(q, p - 1)``)
the kernels' loops read it and the cost pass, without the value,
leaves those bounds out (masks.at_values: an upper bound); given a value it
counts the blocks the loops' formulas visit then.  Any other such mask
(sinks read at run time beside a window, ``x <= q and (q - x < 1024 or
x < s[b])``: two runs of keys a row) is found by the ranges prepass at each launch and
counted, without the values, as every block (an upper bound); given a value
(the same at every index: every batch row's prefix is 1024 tokens, every
cache holds 3000 keys) the mask compares indices alone, and the cost pass
counts the blocks the prepass finds live on it, row by row
(ranges.index_disjuncts, visits.prepass_visits), forward and backward.

Only a uniform value is taken: a ragged batch of lengths would need visited
blocks per batch row, which the cost model's spans (one per row block,
shared by every batch index) do not hold.
"""
from __future__ import annotations

from typing import Iterable, Mapping, Optional

from .. import ir
from ..errors import NapkinError
from ..sizes import parse_pairs

__all__ = ["add_lengths_option", "parse_lengths", "check_lengths", "describe"]


def add_lengths_option(p) -> None:
    p.add_argument("--lengths", action="append", default=None, metavar="NAME=N",
                   help="a length input read as N at every index (p[b] = N for a prefix-LM's x < p[b]; "
                        "repeatable): counts the blocks the kernels visit when it holds N")


def parse_lengths(items: Optional[Iterable[str]]) -> Optional[dict[str, int]]:
    """``["p=1024"]`` -> ``{"p": 1024}``; None when the option is not given."""
    if items is None:
        return None
    return parse_pairs(items, "--lengths", key="NAME", what="the length")


def check_lengths(diagram: ir.Diagram, lengths: Mapping[str, int]) -> None:
    """Each name is a length input of ``diagram``: anything else is refused
    in words, not dropped (a misspelt name would price every block unseen)."""
    found = dict(ir.length_inputs(diagram))
    for name in lengths:
        if name in found:
            continue
        t = diagram.tensor(name)
        if not found:
            why = (f"diagram {diagram.name} has no length input (an integer input compared with an index of a "
                   "wire it is not read along, as x < n[b])")
        else:
            what = ("an input" if isinstance(t, ir.Input) else "a box") if t is not None else "no tensor"
            why = f"{name} is {what}, not a length input (those of diagram {diagram.name}: {', '.join(found)})"
        raise NapkinError(f"--lengths {name}={lengths[name]}: {why}")


def describe(lengths: Mapping[str, int]) -> str:
    """``p = 1024`` / ``n = 3000 and m = 40``, as a note names them."""
    return " and ".join(f"{n} = {v}" for n, v in lengths.items())
