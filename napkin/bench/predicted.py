"""The cost pass's prediction beside napkin bench's measurement.

Each row of a GPU run gets the cost pass's roofline estimate (napkin/cost)
for its forward and backward, at the row's sizes, on the profile of the GPU
it ran on (H100, H200 or A100; a CPU smoke run gets none: the interpreter's
wall clock is no roofline's), so napkin's measured ms over the predicted ms
says how far from its roofline each kernel runs, row by row, with no second
command.  The forward is priced at the blocks the timed launch used (the
row's config, tuned or cached, else the schedule's), the backward at its
untuned launch's tiles (its kernels' configs are the tuner's, per kernel).
A mask that reads ids is priced on --docs' documents when the run was
given them (napkin/documents.py), else dense, every block, as the cost pass
prices it without data: the row says which.
"""
from __future__ import annotations

from typing import Optional

# the profiles (napkin/profiles.toml) whose GPU a device name names
PROFILES = (("H200", "h200"), ("H100", "h100"), ("A100", "a100"))


def profile_for(device_name: str) -> Optional[str]:
    """The cost profile of a torch device name ("NVIDIA H100 80GB HBM3"), or None."""
    return next((key for word, key in PROFILES if word in device_name.upper()), None)


def predict(diagram, sizes: dict, device_name: str, config: Optional[dict], docs=None,
            backward: bool = True, mask_cache: bool = False) -> Optional[dict]:
    """{"profile", "fwd_ms", "bwd_ms", "blocks"} or {"profile", "error"}; None
    off the profiled GPUs.  ``blocks``: "documents" (priced on ``docs``),
    "every" (a mask that reads ids priced dense: an upper bound) or
    "formula" (the mask's own bounds, or no mask).  ``mask_cache``: the timed
    calls reused the ranges prepass's record (a warm mask_cache), so it is
    priced without the prepass's kernels, as they ran."""
    from ..cost import analyse, packing, with_blocks
    from ..cost.masked import kernel_ids
    from ..cost.backward import backward_cost
    from ..errors import NapkinError

    key = profile_for(device_name)
    if key is None:
        return None
    ids = kernel_ids(diagram)
    docs = docs if ids is not None else None
    blocks = {k[len("block_"):]: v for k, v in (config or {}).items() if k.startswith("block_")}
    priced = with_blocks(diagram, packing.schedule_blocks(diagram, blocks)) if blocks else diagram
    try:
        fwd = analyse(priced, sizes, key, docs, mask_cache=mask_cache).roofline.estimate_s
    except NapkinError as err:   # a diagram the cost pass cannot price at these sizes: said, not fatal
        return {"profile": key, "error": str(err).splitlines()[0]}
    bwd = None
    if backward:
        try:
            bwd = backward_cost(diagram, sizes, key, docs=docs, mask_cache=mask_cache).time_s
        except NapkinError:      # no backward napkin builds: the row's backward says why
            pass
    return {"profile": key, "fwd_ms": fwd * 1e3, "bwd_ms": None if bwd is None else bwd * 1e3,
            "blocks": "documents" if docs is not None else "every" if ids is not None else "formula"}
