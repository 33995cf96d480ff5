"""The cost pass: what a schedule moves, computes and costs, against the lower bound.

Public API:

* ``analyse(diagram, sizes=None, profile=None) -> CostReport`` (report.py has
  the records, ``format_text`` and ``to_json`` / ``from_json``);
* ``summary_lines(diagram, sizes=None) -> list[str]``: a few lines for the
  demo and the generated modules' header;
* ``tune(diagram, sizes, profile=None, top=5, objective="time")``: the block
  sizes that fit every level and minimise predicted time or traffic;
* ``with_blocks(diagram, {wire: block})``: the same diagram with other blocks;
* ``backward_cost(diagram, sizes, profile=None, *, given=False, grad_dtype="input")``:
  the training backward's kernels (backward.py): transfers, what reaches
  DRAM, FLOPs, the roofline, and the training forward;
* ``register_cli(subparsers)``: the ``napkin cost`` subcommand.

The modules: model.py (kernels, loads and stores, FLOPs), chunks.py (chunks
of the streamed wire: the state and the merge kernel), devices.py (the
device level), bounds.py (lower bounds), analysis.py (putting them
together), tune.py (tile search), report.py (records and text), cli.py.
"""
from __future__ import annotations

from typing import Mapping, Optional

from .analysis import analyse, bind_sizes, with_blocks
from .backward import BackwardCost, backward_cost
from .profiles import Profile, get_profile, profile_names
from .report import SCHEMA, CostReport, bound_terms, format_text, from_json, human, seconds
from .tune import TuneResult, tune
from .cli import register_cli


def summary_lines(diagram, sizes: Optional[Mapping[str, int]] = None) -> list[str]:
    """FLOPs, hbm traffic (formula, and number when every size is known), the
    lower bound and the schedule's ratio to it; deterministic."""
    r = analyse(diagram, sizes)
    fl = r.flops
    lines = [f"flops: {human(fl.contraction)} in contractions ({fl.contraction_formula}), "
             f"{human(fl.other)} other, {human(fl.exp)} exp"
             if fl.contraction is not None else
             f"flops: contractions {fl.contraction_formula}; exp {fl.exp_formula}"]
    for t in r.totals:
        moved = f" = {human(t.load_bytes + t.store_bytes, 'B')}" if t.load_bytes is not None else ""
        lines.append(f"{t.boundary} traffic: {t.formula_bytes} bytes{moved}")
    b = r.bound
    # as napkin cost words it: M is the capacity in elements, the value after the formula
    value = "" if b.bytes is None else f" ({human(b.bytes, 'B')})"
    if b.floored:   # the formula's own value, then the compulsory traffic that replaces it (206kB beside 125kB's formula)
        value = f" ({human(b.formula_bytes, 'B')}; the compulsory traffic, {human(b.bytes, 'B')}, is the bound)"
    lines.append(f"lower bound ({bound_terms(b)}): {b.formula} elements{value}")
    if b.ratio is not None:
        lines.append(f"schedule / lower bound = {b.ratio:.3g}")
    if r.roofline is not None:
        rf = r.roofline
        lines.append(f"roofline on {rf.profile}: {seconds(rf.estimate_s)}, {rf.bound}-bound")
    if r.devices is not None and r.devices.bytes_received is not None:
        d = r.devices
        lines.append(f"per device: receives {human(d.bytes_received, 'B')} in {d.steps} steps over {d.link}")
    return lines


__all__ = ["analyse", "backward_cost", "BackwardCost", "summary_lines", "tune", "TuneResult", "with_blocks", "bind_sizes", "register_cli",
           "CostReport", "SCHEMA", "format_text", "from_json", "get_profile", "profile_names", "Profile"]
