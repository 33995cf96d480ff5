"""Packed rows in the forward launcher (lower.packed_wire): ``group g by 4``
beside ``group q by 4`` runs the (g, q) pairs as the rows of q, g-major, the
tensors along q viewed with |g| = 1 and |g||q| rows, each row at its own q
(the module's _pack, templates/attention.py.jinja).  What emit.py writes
into the launcher for it, and what the ranges prepass of a mask that reads
data (ranges.py) needs to find the live and full blocks of packed rows."""
from __future__ import annotations

from .. import ir
from .lower import AttentionPlan
from .pysrc import quote as _q, tuple_of as _tuple

# The launcher's flag, set before _pack gives the packed rows their positions:
# whether the caller's own call has rows at global positions (ranges.WITHOUT_POSITIONS).
UNPLACED = "_unplaced"


def runtime(plan: AttentionPlan) -> tuple[str, ...]:
    """The wires a packed launch re-sizes (|g| = 1, |g||q| rows): its kernels
    (the ranges prepass too) take their sizes at run time, fixed in the
    diagram or not."""
    return (plan.pack[0], plan.row) if plan.pack is not None else ()


def launch_lines(plan: AttentionPlan, ranges: bool) -> list[str]:
    """With packed rows, the launch's inputs, positions and sizes become the
    packed ones, after the options are filled: the tuned config stays keyed
    by the caller's sizes.  With a ranges prepass (``ranges``), whether the
    caller placed its rows is kept first (ranges_on): the packed rows always
    have positions, their q's."""
    if plan.pack is None:
        return []
    inputs = ", ".join(t.name for t in plan.diagram.inputs) + ","
    return [f"_real = _sz  # packed rows of {plan.pack[0]} and {plan.row} (_pack): the kernels see the packed sizes",
            *[f"{UNPLACED} = positions is None and lengths is None  # the caller's call: with none, the ranges "
              "prepass runs on the packed rows"] * ranges,
            f"({inputs}), positions, lengths, _sz = _pack(({inputs}), _sz, positions, lengths, _dev)"]


def ranges_on(plan: AttentionPlan, without_positions: str) -> tuple[str, str]:
    """(on, rows): the forward launcher's condition for running the ranges
    prepass and the position arguments it passes it.  Packed rows: the
    caller's call without positions (before _pack), and the launch's own
    (_pos: each packed row's q), so that the prepass's row blocks are the
    packed launch's and each row's ids are read at its q; else
    ``without_positions`` and none."""
    if plan.pack is None:
        return without_positions, ""
    return UNPLACED, "_pos"


def _packed(plan: AttentionPlan, names) -> tuple[str, ...]:
    """Those of ``names`` (float tensors) along the row wire: _pack reshapes them, g into the rows."""
    d = plan.diagram
    return tuple(n for n in dict.fromkeys(names) if plan.row in ir.axis_wires(d.tensor(n).axes))


def packed_inputs(plan: AttentionPlan) -> list[str]:
    """The float inputs _pack reshapes (none without packed rows)."""
    if plan.pack is None:
        return []
    return list(_packed(plan, [t.name for t in plan.diagram.inputs if t.dtype not in ir.INT_DTYPES]))


def context(plan: AttentionPlan, saved) -> dict:
    """The template's packing helpers and the launcher's return through
    _unpack; nothing without packed rows."""
    if plan.pack is None:
        return {"pack": None}
    d = plan.diagram
    floats = [t.name for t in d.inputs if t.dtype not in ir.INT_DTYPES] \
        + [o.name for o in d.outputs] + list(saved)
    packed = _packed(plan, floats)
    outs = [o.name for o in d.outputs if o.name not in saved]
    return {"pack": plan.pack, "packed": _tuple(_q(n) for n in packed),
            "pack_return": f"_unpack(({', '.join(outs)},), {_tuple(_q(n) for n in outs)}, _real), "
                           f"_unpack(({''.join(n + ', ' for n in saved)}), {_tuple(_q(n) for n in saved)}, _real)"}
