"""Which blocks a masked kernel visits, as the cost pass counts them.

The code generator decides whether a kernel may skip blocks and how (its
plan: bounds its loops render, or a ranges prepass at each launch), so this
module asks it first (``kernel_plan``) and counts what it decided:

* ``visited(...)``: the (row block, step) pairs a masked kernel visits: by
  the loops' formula (model.visited_spans; packed rows, packing.py), by the
  prepass's blocks on ``--docs``' documents (documents.row_visits) or, for a
  mask of indices alone, row by row (visits.prepass_visits); None where it
  visits every pair.
* ``kernel_ids`` / ``plan_ids`` / ``mask_ids``: the conjunct comparing ids
  at the query and the key, which ``--docs`` prices.
* ``prepass_note(...)``: the report's words on what the counts are where a
  prepass finds the blocks.

Split out of analysis.py, which puts the report together; it reads the IR
and returns values, never changing the diagram.
"""
from __future__ import annotations

import functools
from typing import Mapping, Optional

from .. import documents, ir, masks, visits
from ..documents import Documents
from ..errors import NapkinError
from ..printer import expr_text
from . import packing
from .devices import mesh_tiles as device_tiles
from .lengths import describe
from .model import Kernel, Tiling, Visited, kernel_tiling, visited_spans


def visited(diagram: ir.Diagram, kernel: Kernel, tiles: Tiling, sizes: dict[str, int],
             pack: Optional[packing.Packing] = None, docs: Optional[Documents] = None,
             lengths: Mapping[str, int] = {}) -> Optional[Visited]:
    """The (row block, step) pairs a masked kernel visits (napkin/visits.py),
    or None when it visits every pair.  ``sizes`` are the real ones: with
    packed rows the row blocks are the launch's blocks of (g, q) pairs, each
    row masked at its own q (packing.py).

    Whether a kernel may skip at all is the code generator's decision (a
    masked score must contribute nothing downstream: exp(-inf) = 0 does,
    S * S does not), so its plan is asked first; for a schedule it cannot
    emit, a kernel whose mask bounds the streamed wire skips.  With
    ``docs`` a kernel whose launch runs the ranges prepass visits the blocks
    it finds live on those documents (documents.row_spans); with
    ``lengths`` (cost's --lengths) a mask that reads only those inputs is
    one of indices alone, counted as such."""
    groups, stream = kernel_tiling(kernel, tiles)
    if not kernel.skips or stream is None or device_tiles(diagram):
        return None
    col, step = stream
    decided = codegen_bounds(diagram)
    if decided is not None:   # a length the loops read (x < n[b]) at its given value, else left out
        decided = decided[0], masks.at_values(decided[1], lengths)
    from ..codegen.ranges import index_disjuncts

    ids = kernel_ids(diagram) if docs is not None else None
    # a mask of indices alone the prepass runs on (an or of cuts): its blocks row by row
    union = index_disjuncts(attention_plan(diagram), lengths) if decided is not None and ids is None else None
    if (ids is not None or union is not None) and decided[0] in groups and col == decided_col(diagram):
        row, found = decided
        rows, block, cycle = (sizes[pack.wire] * sizes[pack.row], pack.block, sizes[pack.row]) if pack is not None \
            else (sizes[row], groups[row], None)
        # the full blocks, where the full step leaves out loads only the mask reads
        omits = bool(full_step_omits(diagram))
        if union is not None:
            full = visits.prepass_full(union, rows, sizes[col], block, step, sizes, cycle) if omits else ()
            return Visited(row, *visits.prepass_visits(union, rows, sizes[col], block, step, sizes, cycle), full)
        length = documents.covered(docs, diagram, ids, sizes)
        full = documents.row_full(docs, found, rows, sizes[col], block, step, sizes, length, cycle) if omits else ()
        return Visited(row, *documents.row_visits(docs, found, rows, sizes[col], block, step, sizes, length, cycle),
                       full)
    if decided is not None:
        row, found = decided
        if not found or row not in groups or col != decided_col(diagram):
            return None
        if pack is not None:
            return Visited(row, pack.spans(found, sizes, col, step))
        return Visited(row, visited_spans(found, sizes[row], sizes[col], groups[row], step, sizes))
    box = next((b for b in kernel.boxes if masks.mask_node(diagram.tensor(b).expr) is not None), None)
    if box is None:
        return None
    # masks composed on it through lets (W a window, S = where(x <= q, W,
    # -inf)) join its own, as the kernels' and the backward's do
    pred = masks.mask_predicate(masks.mask_node(masks.grown_score(diagram, diagram.tensor(box)).expr))
    for row, block in groups.items():
        found = masks.stream_bounds(pred, row, col, sizes)
        if found:
            return Visited(row, visited_spans(found, sizes[row], sizes[col], block, step, sizes))
    return None


@functools.lru_cache(maxsize=64)
def kernel_plan(diagram: ir.Diagram):
    """The code generator's plan (attention or contraction), or None where it
    refuses the schedule (the refusal is napkin compile's to report), cached
    because the tile search analyses one diagram at many blocks."""
    from ..codegen import lower

    try:
        return lower.lower(diagram)
    except NapkinError:
        return None


def attention_plan(diagram: ir.Diagram):
    """The code generator's attention plan, or None (not attention, or a
    schedule it refuses): what lower.streamed_attention returns."""
    plan = kernel_plan(diagram)
    return plan if plan is not None and plan.family == "attention" else None


@functools.lru_cache(maxsize=64)
def full_step_omits(diagram: ir.Diagram) -> frozenset:
    """(tensor, wires) of the loads the forward's full-block step leaves out
    (ranges.full_step_omits: what only a data mask reads), asked of the code
    generator once per diagram, as kernel_plan is: each analyse and each
    visited() of it would render the step again."""
    from ..codegen import ranges

    plan = attention_plan(diagram)
    return ranges.full_step_omits(plan) if plan is not None else frozenset()


def codegen_bounds(diagram: ir.Diagram):
    """(row wire, loop bounds) from the generated kernel's plan: empty bounds
    when it visits every block; None when there is no plan to ask."""
    plan = attention_plan(diagram)
    if plan is None:
        return None
    return plan.row, (tuple(plan.bounds) if plan.skip is not None else ())


def decided_col(diagram: ir.Diagram) -> Optional[str]:
    plan = attention_plan(diagram)
    return plan.col if plan is not None else None


def kernel_ids(diagram: ir.Diagram) -> Optional[documents.SameIds]:
    """The conjunct comparing ids at the query and the key (doc[b, q] == doc)
    of a single-device kernel that finds its blocks with the ranges prepass:
    the one ``docs`` prices (the first, where there are several; any other
    conjunct that reads data is counted as keeping every pair)."""
    from ..codegen import ranges

    plan = attention_plan(diagram)
    if plan is None or device_tiles(diagram) or not ranges.applies(plan):
        return None
    same = plan_ids(plan)
    return same[0] if same else None


def plan_ids(plan) -> tuple[documents.SameIds, ...]:
    """The id conjuncts of a kernel plan's mask, the ids any integer input."""
    names = [t.name for t in plan.diagram.inputs if t.dtype not in ir.FLOAT_DTYPES]
    return documents.id_conjuncts(plan.diagram, plan.skip, plan.row, plan.col, names)


def mask_ids(diagram: ir.Diagram) -> bool:
    """Whether the mask has a conjunct comparing ids at the query and the key,
    priced or not: the ring's roles across devices, the kernel's plan on one."""
    if device_tiles(diagram):
        from ..distributed.reach import same_ids
        from ..distributed.reading import roles
        try:
            return bool(same_ids(roles(diagram)))
        except NapkinError:   # no scheme the wrappers run
            return False
    plan = attention_plan(diagram)
    return plan is not None and bool(plan_ids(plan))


def prepass_note(diagram: ir.Diagram, docs: Optional[Documents] = None, sizes: Mapping[str, int] = {},
                 lengths: Mapping[str, int] = {}) -> Optional[str]:
    """Where the kernels find their blocks with a ranges prepass (a mask that
    reads data, or whose comparisons bound no wire by an affine function of
    the other with coefficient 1): the counts are every block's (the part
    the formula bounds), the prepass's own kernels beside them;
    with ``docs`` (and sizes) the blocks it finds on those documents, and
    for a mask of indices alone (an or of cuts) the blocks it finds, row by row."""
    from ..codegen import ranges

    plan = attention_plan(diagram)
    if plan is None or device_tiles(diagram) or not ranges.applies(plan):
        return None
    cost = (f"the prepass's scan, merge and lists counted as kernels of their own, and each program's reads of its "
            f"record, p_{plan.col} the blocks of {plan.col} a scan program takes, about their square root; the lists, "
            "torch's cumsum and sort, a floor: a read of the states a list and the record's write")
    ids = kernel_ids(diagram) if docs is not None else None
    if ids is not None:
        wire = documents.id_wire(diagram, ids)
        return (f"the counts are the blocks the ranges prepass finds live when {ids.name} holds "
                f"--docs' {docs.describe(sizes[wire])} in every batch row, each document's tokens contiguous "
                f"({cost}; a full block's step reads no {ids.name}, and none is counted there)")
    if ranges.index_disjuncts(plan, lengths) is not None:   # indices alone, the given lengths' values read
        read = sorted({n.name for n in ir.walk(plan.skip) if isinstance(n, ir.TensorRef)} & set(lengths))
        if not read:
            return (f"the mask {expr_text(plan.skip)} compares indices alone: the counts are the blocks the kernels' "
                    f"ranges prepass finds live, every dead block skipped ({cost})")
        given = describe({n: lengths[n] for n in read})
        # a scalar has one index: "at every index" is said of the others alone
        every = " at every index" if any(plan.diagram.tensor(n).axes for n in read) else ""
        return (f"the counts are the blocks the kernels' ranges prepass finds live when {given}{every} "
                f"(--lengths), every dead block skipped ({cost})")
    # a part the formula bounds (x <= q beside doc[b, q] == doc) still skips in the counts
    counted = (": the counts are the blocks its formula part bounds" if plan.bounds else
               " bounds no block by formula: the counts are every block's")
    hint = "; --docs LENGTHS counts them on packed documents" if plan_ids(plan) else \
        "; --lengths NAME=N counts them where the length input holds N" if _length_reads(plan) else ""
    return (f"the mask {expr_text(plan.skip)}{counted} (an upper bound of the main kernel's tiles), while the "
            f"kernels skip blocks with a ranges prepass at each launch ({cost}){hint}")


def lengths_note(diagram: ir.Diagram, lengths: Mapping[str, int] = {}) -> Optional[str]:
    """Where the kernels' loop bounds read a length input (x < n[b], q - x < w: no prepass, each
    program loads it): what the counts take it to be, the --lengths value or no bound at all."""
    plan = attention_plan(diagram)
    if plan is None or device_tiles(diagram) or plan.skip is None:
        return None
    read = masks.lengths_read(plan.bounds)
    if not read:
        return None
    names = ", ".join(read)
    loop = f"the kernels' loops are bounded by {names} at run time, each program loading it (no ranges prepass)"
    given = {n: lengths[n] for n in read if n in lengths}
    if len(given) == len(read):
        every = " at every index" if any(plan.diagram.tensor(n).axes for n in read) else ""
        return f"{loop}: the counts are the blocks they visit when {describe(given)}{every} (--lengths)"
    unknown = ", ".join(n for n in read if n not in given)
    return (f"{loop}: the counts leave out the bounds that read {unknown} (an upper bound of the blocks "
            f"visited); --lengths NAME=N counts them where the length input holds N")


def _length_reads(plan) -> bool:
    """Whether every input the prepass mask reads is a length input (ir.length_inputs), so
    that --lengths makes it a mask of indices alone."""
    found = dict(ir.length_inputs(plan.diagram))
    read = {n.name for n in ir.walk(plan.skip) if isinstance(n, ir.TensorRef)}
    return bool(read) and read <= set(found)
