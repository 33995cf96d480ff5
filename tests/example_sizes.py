"""What the example-driven tests need to know of a shipped example, read from
its diagram rather than from a list of names, so a new example gets it too:
whether it reads an input along the query wire that is declared along the
key wire (``doc[b, q]`` of ``doc[b, x]``: then the two lengths are equal),
and the sizes the tests run it at."""
from __future__ import annotations

import functools
from pathlib import Path

import napkin
from napkin import ir

REPO = Path(__file__).resolve().parent.parent


@functools.lru_cache(maxsize=None)
def ties_lengths(name: str) -> bool:
    """Whether examples/NAME.ncd reads an input declared along one of q and x
    along the other (a document mask's ids): its q and x must be equal."""
    d = napkin.load(str(REPO / "examples" / f"{name}.ncd"))
    for let in d.lets:
        for n in ir.walk(let.expr):
            if isinstance(n, ir.TensorRef) and n.wires is not None:
                declared = ir.axis_wires(d.tensor(n.name).axes)
                if any({a, b} == {"q", "x"} for a, b in zip(declared, n.wires)):
                    return True
    return False


def sizes_for(name: str, q: int, x: int) -> dict:
    """Every wire an example may have, q and x as given (x = q where they are tied)."""
    x = q if ties_lengths(name) else x
    return {"b": 2, "h": 2, "hk": 2, "g": 2, "q": q, "x": x, "m": q, "n": x, "k": q + x}


@functools.lru_cache(maxsize=None)
def has_prepass(name: str) -> bool:
    """Whether examples/NAME.ncd's kernels run a ranges prepass (codegen/ranges.py):
    a mask that reads ids or flags, or one of indices alone that no loop
    formula covers (streaming_llm's or of cuts)."""
    from napkin.codegen import lower, ranges

    plan = lower.lower(napkin.load(str(REPO / "examples" / f"{name}.ncd")))
    return plan.family == "attention" and ranges.applies(plan)
