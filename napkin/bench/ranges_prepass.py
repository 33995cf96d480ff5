"""The ranges prepass of a mask that reads data, timed apart (napkin bench).

A diagram whose mask reads data (document ids, a bool mask) runs a small
prepass before each of its kernels (napkin/codegen/ranges.py): it finds
each row block's live and full key blocks.  Its time is part of napkin's
timed forward and backward; FlexAttention builds its BlockMask once, in
its prepare, outside the timed region, as a training step reusing one mask
across layers would.  Timing the prepass alone says how much of a
difference between the two it is.  Since 2026-11-28 napkin's timed calls
pass a warm ``mask_cache`` (harness._napkin_prepare), so the prepass is
outside napkin's timed region too, and this record is its cost per new mask.
"""
from __future__ import annotations

import inspect
from typing import Callable, Optional

from .. import ir
from . import baselines, timing


def prepass_name(diagram: str) -> str:
    """The generated module's prepass launcher (codegen/ranges.py) for diagram ``diagram``."""
    return f"_{diagram}_ranges"


def has_prepass(module, name: str) -> bool:
    """Whether diagram ``name``'s generated module runs a ranges prepass."""
    return callable(getattr(module, prepass_name(name), None))


# The prepass launches of a call, by (whole_rows, by_col): which kernel's blocks they serve.
KERNELS = {(False, False): "fwd", (True, False): "dq", (True, True): "dkdv"}


def timed(module, d: ir.Diagram, inputs, shape: dict, ms: Callable, backward: bool) -> Optional[list]:
    """The ranges prepass of a mask that reads data (codegen/ranges.py) timed
    on its own, at each launch's blocks: what a new mask costs, outside
    napkin's timed calls (a warm mask_cache) as FlexAttention's BlockMask is
    built in its prepare, outside its timed region.  ``ms(fn)``: the harness's timer.  A list of
    {kernel, blocks, ms, error}, one per launch of one forward and backward
    call; None when the diagram has no prepass."""
    import torch

    name = prepass_name(d.name)
    prepass = getattr(module, name, None)
    if prepass is None:
        return None
    calls = []

    def spy(*a, **k):
        calls.append(inspect.signature(prepass).bind(*a, **k))
        return prepass(*a, **k)

    setattr(module, name, spy)
    try:
        xs = timing.fresh_inputs(inputs, shape, grad=backward)
        outs = getattr(module, d.name)(*xs)
        outs = [o for o in (outs if isinstance(outs, tuple) else (outs,)) if o.requires_grad]
        if outs:
            torch.autograd.backward(outs[:1], [torch.randn_like(outs[0])])
    except Exception as err:  # noqa: BLE001 - reported in the row, as a baseline's failure is
        return [{"kernel": None, "ms": None, "error": baselines.first_line(err)}]
    finally:
        setattr(module, name, prepass)
    out = []
    for bound in calls:
        a = bound.arguments
        if a["_on"]:  # off: rows at global positions, no prepass ran
            out.append({"kernel": KERNELS[(bool(a["_whole_rows"]), bool(a["_by_col"]))],
                        "blocks": [a["_br"], a["_bc"]], "error": None,
                        "ms": ms(lambda b=bound: prepass(*b.args, **b.kwargs))})
    return out
