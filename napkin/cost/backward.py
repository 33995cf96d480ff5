"""The backward pass's cost: what the generated backward kernels move and compute.

``backward_cost(diagram, sizes, profile=None, *, given=False, grad_dtype="input") -> BackwardCost``

The backward kernels are derived by the code generator (napkin/codegen/
backward.py from the diagram's GradRule; a matrix product's are two more
contractions), so this model reads the code generator's backward plan
rather than re-deriving it, and counts, as model.py does for the forward,
every tile each program loads and stores:

* ROWS: one program per (row block, batch index); each row tile once.
* DK/DV: one program per (key block, K's batch index).  Tiles without the
  row wire (and the GQA group wire) once per program; the others once per
  visited (row block, key block) pair and group index.
* DQ: one program per (row block, batch index).  Tiles without the key wire
  once per program, the others once per visited pair; a side input's
  partial gradient per visited pair (when it has the key wire) or once per
  program.
* Gradients are stored once per program, in the dtype of the launch
  costed (``grad_dtype``): "input", each in its input's dtype, is the
  autograd op's launch (what training and ``napkin bench`` run); "float32"
  is NAME_backward's default (what the distributed wrappers call, adding
  the gradients up).  A side input's partial sums and the row state are
  float32 either way, and so are the shares of a key-side input that lacks
  batch wires K has (differential attention's V: one share a dK/dV program,
  summed by the launcher in torch, a pass this model does not count).

Packed rows (napkin/cost/packing.py: ``group g by 4`` beside ``q by 4``)
are a forward launch only: the backward kernels run g as a batch wire, one
program per index, at the plan's row block (the packed block B), and the
code generator's backward plan says so (g in its batch, B its row block),
so this model counts them unpacked as they are; ``forward``, the training
forward, is packed (analyse counts it so).

The visited pairs are the forward's (napkin/visits.py): both backward loops
skip exactly the blocks the forward skips.  Tiles are clipped at ragged
edges and padded feature wires, so the counts are exact;
tests/test_bytecount.py checks them against the bytes the interpreter
really moves.  A matrix product's dA and dB kernels are ordinary
contraction diagrams and are costed by analysis.py itself.

FLOPs: 2 * |f| per tile element of every tl.dot over a feature wire f (the
score recompute, dP, and the dQ / dK / dV products), one per arithmetic
node of the rule's tile expressions, transcendental calls counted apart
(the "exp" ceiling), over the visited area only; a subtree written twice in
one kernel's step counts once, one of numbers and sizes alone not at all
(``_ops``).  ``forward`` is the cost of the training forward, which also
writes the row state (lse, or the sums of a general normaliser) when the
diagram does not output it.

Time: the forward's roofline (analysis._roofline), the bytes priced being
the forward's DRAM estimate (model.dram_fractions: a tile the programs of
one wave share reaches DRAM once a wave) run on each backward kernel's own
grid, and the issued bytes' time kept beside it.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter
from dataclasses import dataclass
from typing import Mapping, Optional

from .. import ir, masks, visits, tiling
from ..documents import column_spans
from ..errors import Diagnostic, NapkinError
from . import model
from . import prepass as prepass_mod
from .model import TRANSCENDENTAL, clip
from .report import Roofline
from .symbolic import Poly


@dataclass(frozen=True)
class Move:
    """One tensor moved by one backward kernel."""

    kernel: str          # "rows", "dkdv", "dq" or a contraction kernel's name
    tensor: str
    direction: str       # "load" or "store"
    dtype: str
    elements: int

    @property
    def bytes(self) -> int:
        return self.elements * prepass_mod.element_bytes(self.dtype)


@dataclass(frozen=True)
class BackwardCost:
    diagram: str
    kernels: tuple[str, ...]
    moves: tuple[Move, ...]
    contraction_flops: int
    other_flops: int
    exp_flops: int
    forward: object               # the training forward's CostReport
    dram: tuple[int, ...]         # per kernel, of its moves' bytes those that reach DRAM (the estimate)
    roofline: Roofline            # of the backward kernels together, on the profile
    # the contraction FLOPs by the dtype each product runs in, each priced at its own peak
    contraction_parts: tuple[tuple[str, int], ...] = ()

    @property
    def time_s(self) -> float:
        return self.roofline.estimate_s

    @property
    def dram_bytes(self) -> int:
        return sum(self.dram)

    @property
    def load_bytes(self) -> int:
        return sum(m.bytes for m in self.moves if m.direction == "load")

    @property
    def store_bytes(self) -> int:
        return sum(m.bytes for m in self.moves if m.direction == "store")

    def by_tensor(self, direction: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for m in self.moves:
            if m.direction == direction:
                out[m.tensor] = out.get(m.tensor, 0) + m.bytes
        return out

    def lines(self) -> list[str]:
        """A few lines for people: traffic per kernel, FLOPs, the estimate."""
        from .report import human, seconds

        out = [f"backward of {self.diagram}: kernels {', '.join(self.kernels)}"]
        for k, dram in zip(self.kernels, self.dram):
            mine = [m for m in self.moves if m.kernel == k]
            loads = sum(m.bytes for m in mine if m.direction == "load")
            stores = sum(m.bytes for m in mine if m.direction == "store")
            reach = dram - stores   # every store reaches DRAM
            out.append(f"  {k}: loads {human(loads, 'B')}"
                       + (f" ({human(reach, 'B')} reach DRAM: re-reads hit L2)" if reach != loads else "")
                       + f", stores {human(stores, 'B')}")
        issued = self.load_bytes + self.store_bytes
        parts = "" if len(self.contraction_parts) < 2 else \
            " (" + "; ".join(f"{human(n)} {dtype}" for dtype, n in self.contraction_parts) + ")"
        out.append(f"  flops: {human(self.contraction_flops)} in contractions{parts}, {human(self.other_flops)} other, "
                   f"{human(self.exp_flops)} exp; hbm traffic {human(issued, 'B')}"
                   + (f", of which reach DRAM {human(self.dram_bytes, 'B')}" if self.dram_bytes != issued else ""))
        rf = self.roofline
        out.append(f"  roofline on {rf.profile}: {seconds(rf.estimate_s)}, {rf.bound}-bound "
                   f"(compute {seconds(rf.contraction_s)}, exp {seconds(rf.exp_s)}, other {seconds(rf.other_s)}, "
                   f"hbm {seconds(rf.hbm_s)}"
                   + (f" [{seconds(rf.hbm_issued_s)} if no re-read hit L2]" if rf.hbm_issued_s != rf.hbm_s else "")
                   + ")")
        return out


GRAD_DTYPES = ("input", "float32")


def backward_cost(diagram: ir.Diagram, sizes: Mapping[str, int], profile: Optional[str] = None, *,
                  given: bool = False, grad_dtype: str = "input", docs=None, lengths=None,
                  mask_cache: bool = False) -> BackwardCost:
    """The backward kernels' transfers and FLOPs at the given sizes (every
    symbolic wire bound), for the launch with no options: the dK/dV kernel
    at its own default tile (backward_hold.dkdv_default_tile), dQ at the
    schedule's blocks with its keys halved as the launcher does
    (dq_default_tile), the rows kernel at the schedule's.  ``given``: the
    schedule's blocks are given (or tuned), and every kernel takes them as
    they are.  ``grad_dtype``: what the gradient buffers hold, as the
    module's grad_dtype= takes it: "input" (the autograd op's launch, the
    default) or "float32" (NAME_backward's default).  NapkinError when the
    code generator has no backward for the diagram, with its reason.
    ``docs``: a mask comparing ids visits the blocks the ranges prepass
    finds on those documents (napkin/documents.py), in every kernel;
    ``lengths`` (napkin/cost/lengths.py): length inputs read as these values,
    which make a mask reading only them one of indices alone; ``mask_cache``:
    every launch given a warm mask_cache (analyse's), no prepass kernel run."""
    if grad_dtype not in GRAD_DTYPES:
        raise ValueError(f"grad_dtype must be one of {GRAD_DTYPES}, not {grad_dtype!r}")
    from ..codegen import lower, training
    from .analysis import analyse, bind_sizes, resolve_profile

    devices = diagram.level("devices") if diagram.schedule is not None else None
    if devices is not None:
        # the forward's report is one device's share; the distributed wrappers' backward (local
        # kernels at each step, the merged row state, the gradients sent round) is not priced, and
        # the whole problem's single-device backward under a per-device label misled
        raise NapkinError([Diagnostic(
            f"napkin cost --backward prices one device's training kernels, and diagram {diagram.name} has a "
            "devices level: its forward is priced per device, its distributed backward is not", devices.loc,
            "for one device's local kernels, drop the devices level and give that device's share of the sizes "
            "(-D q=...); napkin plan prices the distributed forward and backward")])
    d = _single_device(diagram)
    bound = bind_sizes(d, sizes)
    missing = [w.name for w in d.wires if w.name not in bound]
    if missing:
        raise NapkinError(f"the backward's cost needs sizes for {', '.join(missing)}")
    t = training.prepare(lower.lower(d))
    if t.reason is not None:
        raise NapkinError([Diagnostic(t.reason, t.reason_loc)])
    forward = analyse(dataclasses.replace(t.forward.diagram, name=d.name), bound, profile, docs, lengths,
                      mask_cache) if t.saved else analyse(d, bound, profile, docs, lengths, mask_cache)
    prof = resolve_profile(d, profile)
    if t.backward is not None:
        on = _on_documents(d, docs, bound)
        moves, (products, *rest), kernels, dram, working_set = _attention(t.backward, bound, given, grad_dtype, prof,
                                                                          on, lengths or {}, mask_cache)
    else:
        moves, (products, *rest), kernels, dram, working_set = _contraction(d, t, bound, profile, grad_dtype)
    flops = (sum(products.values()), *rest)
    # the forward's roofline (analysis._roofline): the largest of the four times, each product at its
    # dtype's peak, the bytes at DRAM's estimate, the issued bytes' time beside it
    compute, rate = prof.contraction_time(products.items(), forward.flops.contraction_dtype,
                                          d.schedule.tf32 if d.schedule else False)
    issued, reach = sum(m.bytes for m in moves), sum(dram)
    parts = {"compute": compute, "exp": flops[2] / prof["exp_rate"],
             "other": flops[1] / prof["peak_flops_fp32"], "bandwidth": reach / prof["hbm_bandwidth"]}
    which = max(parts, key=lambda key: (parts[key], key))
    roofline = Roofline(prof.key, rate, parts["compute"], parts["exp"], parts["other"], parts["bandwidth"],
                        issued / prof["hbm_bandwidth"], working_set, 0.0, parts[which], which,
                        sum(flops) / reach if reach else 0.0)
    return BackwardCost(d.name, tuple(kernels), tuple(moves), *flops, forward, tuple(dram), roofline,
                        tuple(sorted(products.items())))


def _single_device(d: ir.Diagram) -> ir.Diagram:
    """A distributed schedule's kernels run one device's share: drop the devices level."""
    if d.schedule is None or d.level("devices") is None:
        return d
    levels = tuple(lv for lv in d.schedule.levels if lv.name != "devices")
    return dataclasses.replace(d, schedule=dataclasses.replace(d.schedule, levels=levels))


# --------------------------------------------------------------------------
# Attention: the three kernels of backward.py.
# --------------------------------------------------------------------------

def _on_documents(d: ir.Diagram, docs, sizes: dict) -> Optional[tuple]:
    """(docs, the tokens the ids cover) where the kernels' blocks are the
    ranges prepass's on ``docs`` (masked.kernel_ids), else None."""
    from ..documents import covered
    from .masked import kernel_ids

    ids = kernel_ids(d) if docs is not None else None
    return None if ids is None else (docs, covered(docs, d, ids, sizes))


def _attention(b, sizes: dict, given: bool, grad_dtype: str, prof, on_documents=None, lengths={},
               mask_cache: bool = False) -> tuple:
    """(moves, (contraction, other, exp FLOPs), kernels, DRAM bytes per kernel,
    the largest one-step L2 working set).  ``on_documents``: (docs, tokens)
    where the blocks are the ranges prepass's on them (_on_documents); ``lengths``
    the length inputs' values (--lengths)."""
    from ..codegen.backward_hold import DEFAULT_TILE, do_names, rows_round_do
    from ..codegen.ranges import index_disjuncts
    from ..codegen.backward_emit import full_step_omits, granule_size, tiled_reads
    from ..documents import row_full, row_visits

    d, f = b.diagram, b.forward
    blocks = dict(f.blocks)
    row, col = b.row, b.col
    nr, nc = sizes[row], sizes[col]
    moves, kernels, drams = [], [], []
    working_set = 0
    of = ef = 0
    parts: Counter = Counter()   # the products' FLOPs by the dtype each runs in
    # the recomputed scores in the forward's dtype (int8 Q . K at the int8 rate); the others in the
    # kernels' dtype (BackwardPlan.typed: V's beside 8-bit Q and K)
    fd = b.forward.diagram
    kernel_dtype = fd.tensor(b.typed).dtype
    # the rows kernel reads dO rounded to the products' dtype where the launcher rounds a wider one
    rounded_do = do_names(b) if rows_round_do(b) else set()
    batch_all = math.prod(sizes[w] for w in b.batch)

    # a mask of indices alone (the length inputs at their values): an or of cuts
    union = index_disjuncts(f, lengths) if on_documents is None else None
    # the loops' bounds, a length they read at run time at its given value, else left out (masks.at_values)
    bounds = masks.at_values(f.bounds, lengths)

    @functools.lru_cache(maxsize=None)
    def prepass(br: int, bc: int, by_col: bool = False) -> model.Visited:
        """The blocks the ranges prepass finds live, per row block (per key block
        ``by_col``): on the documents, or the union's, row by row (key by key)."""
        if union is not None:
            found = (visits.prepass_column_visits if by_col else visits.prepass_visits)(union, nr, nc, br, bc, sizes)
            return model.Visited(col if by_col else row, *found)
        spans, holes = row_visits(on_documents[0], bounds, nr, nc, br, bc, sizes, on_documents[1])
        # consecutive rows of contiguous documents meet one run of keys: no holes, by column neither
        return model.Visited(col, column_spans(spans, -(-nc // bc))) if by_col else model.Visited(row, spans, holes)

    @functools.lru_cache(maxsize=None)
    def full(br: int, bc: int) -> frozenset:
        """The (row block, key block) pairs the backward's prepass finds full
        (whole rows: a ragged row block has none), on the documents or the
        union's; none known without them."""
        if union is not None:
            runs = visits.prepass_full(union, nr, nc, br, bc, sizes, whole_rows=True)
        elif on_documents is not None:
            runs = row_full(on_documents[0], bounds, nr, nc, br, bc, sizes, on_documents[1], whole_rows=True)
        else:
            return frozenset()
        return frozenset((i, j) for i, rs in enumerate(runs) for a, z in rs for j in range(a, z))

    @functools.lru_cache(maxsize=None)
    def visited(br: int, bc: int) -> list:
        """The (row block, key block) pairs a kernel at these blocks visits: the forward's."""
        if on_documents is not None or union is not None:
            return sorted(prepass(br, bc).pairs)
        return visits.visited_blocks(bounds, nr, nc, br, bc, sizes) if nr and nc else []

    for k in b.kernels:
        kernels.append(k.role)
        br, bc = blocks[row], blocks[col]
        if k.role in DEFAULT_TILE and not given:   # the rows kernel takes the schedule's
            br, bc, _ = DEFAULT_TILE[k.role](b, sizes)
        pairs = visited(br, bc)
        rows_of = functools.partial(clip, nr, br)
        cols_of = functools.partial(clip, nc, bc)
        nblocks = {row: math.ceil(nr / br), col: math.ceil(nc / bc)}
        area = sum(rows_of(i) * cols_of(j) for i, j in pairs) * batch_all
        batch = math.prod(sizes[w] for w in k.batch)
        outer = math.prod(sizes[w] for w in k.outer)
        if k.role != "rows" and not (nblocks[k.grid_wire] and batch):
            drams.append(0)   # not launched
            continue

        def feat(wires, step={}) -> int:
            return math.prod(-(-sizes[w] // step.get(w, 1)) for w in wires if w not in {row, col} | set(b.batch))

        # what only the mask reads, a full block's step does not load (backward_emit.full_step_omits)
        omits = full_step_omits(b, k.role) if k.role != "rows" else frozenset()
        partial = [p for p in pairs if p not in full(br, bc)] if omits else pairs
        reach, ws_bytes = _dram_fractions(b, k, br, bc, sizes, prof,
                                         _spans(b, k, br, bc, sizes, len(pairs) == nblocks[row] * nblocks[col], bounds,
                                                prepass if on_documents is not None or union is not None else None))
        working_set = max(working_set, ws_bytes)
        first = len(moves)
        dram = 0
        for ld in k.loads:
            ws = ld.wires
            step = dict(zip(ws, ld.steps or (1,) * len(ws)))   # a coarse read's: the distinct cells a tile meets
            if ld.phase == "pre":
                grid = nblocks[k.grid_wire]
                if k.grid_wire in ws:
                    gb = bc if k.grid_wire == col else br
                    grid = model.coarse_sum(sizes[k.grid_wire], gb, step[k.grid_wire], 0, grid)
                n = grid * batch * feat(ws, step)
            else:
                n = sum((model.coarse_cells(nr, br, i, step[row]) if row in ws else 1)
                        * (model.coarse_cells(nc, bc, j, step[col]) if col in ws else 1)
                        for i, j in (partial if (ld.tensor, ld.wires) in omits else pairs))
                n *= batch * outer * feat(ws, step)
            dtype = _dtype(b, ld.tensor)
            if k.role == "rows" and ld.tensor in rounded_do and ir.DTYPE_BYTES[dtype] > ir.DTYPE_BYTES[kernel_dtype]:
                dtype = kernel_dtype
            moves.append(Move(k.role, ld.tensor, "load", dtype, n))
            dram += round(n * reach.get(ld, 1.0)) * ir.DTYPE_BYTES[moves[-1].dtype]
        for g in k.grads:   # one store per element, in the buffer's dtype (the template's _grad_X)
            wires = ir.axis_wires(d.tensor(g.buffer).axes)
            # a shared input's (differential attention's V) shares are float32 whatever grad_dtype says:
            # the launcher sums them, then rounds once
            dtype = _dtype(b, g.tensor) if grad_dtype == "input" and g.tensor not in dict(b.shared) else "fp32"
            moves.append(Move(k.role, g.buffer, "store", dtype, sizes[g.rows] * batch * feat(wires)))
        for s in k.sides:
            if s.has_col:   # a float an entry, or a granule of a read at blocks (summed inside the tile)
                tiles = dict(tiled_reads(b, s))
                gr, gc = (granule_size(tiles[w], blk) if w in tiles else 1 for w, blk in ((row, br), (col, bc)))
                n = sum((model.coarse_cells(nr, br, i, gr) if s.has_row else 1) * model.coarse_cells(nc, bc, j, gc)
                        for i, j in pairs) * batch
            else:
                n = (nr if s.has_row else nblocks[row]) * batch
            moves.append(Move(k.role, s.buffer, "store", "fp32", n))
        for st in k.stores:
            n = nr * batch * (sizes[st.cols] if st.cols is not None else 1)
            moves.append(Move(k.role, st.tensor, "store", "fp32", n))
        launch = _prepass_launch(b, k, br, bc, mask_cache)
        if launch is not None:   # its record's head a program, an entry a visited pair (and group)
            programs = nblocks[k.grid_wire] * batch
            moves.append(Move(k.role, prepass_mod.RANGES, "load", "int32",
                              prepass_mod.RECORD_HEAD * programs + len(pairs) * batch * outer))
            dram += moves[-1].bytes
        drams.append(dram + sum(m.bytes for m in moves[first:] if m.direction == "store"))
        if launch is not None and not launch.kept:   # the prepass's own steps, each a kernel of the report
            made = prepass_mod.rows(launch, [sizes], Poly.sym)   # the formulas unused: numbers alone
            fractions = prepass_mod.reach(launch, sizes, int(prof["sm_count"]), prof["l2_bytes"])
            for step in prepass_mod.STEPS:
                kernels.append(f"{k.role} prepass {step}")
                mine = [r for r in made if r.step == step]
                moves += [Move(kernels[-1], r.access.tensor, r.access.kind, r.access.dtype, r.elements[0])
                          for r in mine]
                drams.append(sum(round(r.elements[0] * fractions.get(r.access, 1.0)) *
                                 prepass_mod.element_bytes(r.access.dtype) for r in mine))
        # FLOPs
        if k.role == "rows":
            per_row = nr * batch
            fv = [w for w in b.dims if any(w == ld.cols for ld in k.loads)]
            width = sizes[fv[0]] if fv else 1
            for _, body in k.reduces:
                o, e = _ops(body, dict(k.subst), set())
                of, ef = of + (o + 1) * per_row * width, ef + e * per_row * width
            seen: set = set()
            for var, e in k.lines:
                o, x = _ops(e, {n: v for n, v in k.subst if v != var}, seen)
                of, ef = of + o * per_row, ef + x * per_row
            continue
        for dot in k.dots:
            dtype = tiling.dot_dtype(fd.tensor(dot.lhs.tensor).dtype, fd.tensor(dot.rhs.tensor).dtype) \
                if dot.var == "_qk" else kernel_dtype
            parts[dtype] += 2 * _dot_width(b, dot, sizes) * area
        for g in k.grads:
            parts[kernel_dtype] += 2 * sizes[g.cols] * area
            of += area                                       # the ragged-edge where
        # the step's lines and the sides' partials are one loop body: a subtree written
        # twice (softcap's tanh, once in P and twice in dR) is computed once (the
        # compiler merges the copies), so it is counted once per score
        seen = set()
        for var, e in k.lines:
            o, x = _ops(e, {n: v for n, v in k.subst if v != var}, seen)
            of, ef = of + o * area, ef + x * area
        for s in k.sides:
            o, x = _ops(s.expr, dict(k.subst), seen)
            of, ef = of + (o + 2) * area, ef + x * area
    if b.gate is not None:
        gate = _gate_moves(b, sizes, grad_dtype)
        kernels.append(gate[0].kernel)
        moves += gate
        drams.append(sum(m.bytes for m in gate))
    return moves, (parts, of, ef), kernels, drams, working_set


def _gate_moves(b, sizes: dict, grad_dtype: str) -> list[Move]:
    """A gated value's torch around the kernels (training._gate_context), one
    pass over what each op reads and writes: V * gate formed in V's dtype, then
    dgate = sum(dW * V) and dV = dW * gate, each reading the kernels' dW.  Eager
    torch makes float32 temporaries besides, which are not counted."""
    d = b.forward.diagram
    kernel, v, g = "value gate (torch)", b.v, b.gate
    nv, ng = (math.prod(sizes[w] for w in ir.axis_wires(d.tensor(n).axes)) for n in (v, g))
    grad = (lambda n: d.tensor(n).dtype) if grad_dtype == "input" else (lambda n: "fp32")
    return [Move(kernel, v, "load", d.tensor(v).dtype, 2 * nv), Move(kernel, g, "load", d.tensor(g).dtype, 2 * ng),
            Move(kernel, f"{v} * {g}", "store", d.tensor(v).dtype, nv),
            Move(kernel, f"_grad_{v}", "load", grad(v), 2 * nv),
            Move(kernel, f"_grad_{v}", "store", grad(v), nv), Move(kernel, f"_grad_{g}", "store", grad(g), ng)]


def _prepass_launch(b, k, br: int, bc: int, cached: bool = False) -> Optional[prepass_mod.Launch]:
    """The ranges prepass a backward kernel's launch runs (prepass.py): dQ's by
    row, dK/dV's by column where it indexes every mask batch wire, else None."""
    from ..codegen.ranges import applies, batch_wires

    if k.role not in ("dq", "dkdv") or not applies(b.forward):
        return None
    if k.role == "dkdv" and not set(batch_wires(b.forward)) <= set(k.batch):   # no ranges: every block
        return None
    return prepass_mod.backward_launch(b.forward, br, bc, k.role == "dkdv", cached)


def _spans(b, k, br: int, bc: int, sizes: dict, dense: bool, bounds, prepass=None) -> Optional[model.Visited]:
    """The steps each program of a masked backward kernel reads (the forward's
    masked-loop rule, model.Visited), by the formulas its loops run: dQ's row
    block over the key blocks the forward's loop visits (model.visited_spans),
    dK/dV's key block over the row blocks that visit it (visits.row_block_range).
    A kernel that visits every pair (``dense``), or has no step loop (rows),
    gets None: every program reads the whole stream.  ``bounds``: the forward's, at the
    lengths' values (masks.at_values).  ``prepass(br, bc, by_col)``:
    the ranges prepass's blocks (on --docs' documents, or a mask of indices') instead."""
    if k.role == "rows" or dense:
        return None
    nr, nc = sizes[b.row], sizes[b.col]
    if prepass is not None:   # the prepass's (by column: the same live pairs seen from the keys)
        return prepass(br, bc, k.grid_wire == b.col)
    if k.grid_wire == b.col:
        spans = tuple(visits.row_block_range(bounds, j, nr, nc, br, bc, sizes) for j in range(-(-nc // bc)))
    else:
        spans = model.visited_spans(bounds, nr, nc, br, bc, sizes)
    return model.Visited(k.grid_wire, spans)


def _dram_fractions(b, k, br: int, bc: int, sizes: dict, prof,
                    visited: Optional[model.Visited] = None) -> tuple[dict, int]:
    """The forward's DRAM estimate (model.dram_fractions) on one backward
    kernel's launch: per load of k.loads that several programs read (dK/dV's
    Q, dO, lse and delta, read by every key block of a head; dQ's K and V),
    the fraction of its issued bytes that reaches DRAM; and one step's shared
    working set of the first wave.  The grid is the launcher's: k.grid_wire's
    blocks on axis 0, the batch wires flattened on axis 1, the last fastest
    (model.launch_order); the step walks the other of the row and key wires.
    A wire the program loops over outside the step (GQA's g in dK/dV) is one
    index a step, and carried by no grid axis, so it is left out.
    ``visited``: a masked kernel's spans (_spans), each wave counted by the
    steps its programs read, as the forward's masked loop is."""
    row, col = b.row, b.col
    block = bc if k.grid_wire == col else br
    if not (sizes[k.grid_wire] and math.prod(sizes[w] for w in k.batch)):
        return {}, 0   # no program: nothing read
    stream = None if k.role == "rows" else (row, br) if k.grid_wire == col else (col, bc)
    accesses = {ld: model.Access(ld.tensor, tuple(w for w in ld.wires if w not in k.outer), "load",
                                 _dtype(b, ld.tensor),
                                 tuple(st for w, st in zip(ld.wires, ld.steps) if w not in k.outer))
                for ld in k.loads}
    kernel = model.Kernel(0, (), (), tuple(accesses.values()),
                          (k.grid_wire, *k.batch) + ((stream[0],) if stream else ()), False, False)
    tiles = model.Tiling("smem", ((k.grid_wire, block),) + tuple((w, 1) for w in k.batch), stream)
    fractions, working_set = model.dram_fractions(kernel, tiles, sizes, int(prof["sm_count"]), prof["l2_bytes"],
                                                  visited=visited)
    return {ld: fractions[acc] for ld, acc in accesses.items() if acc in fractions}, working_set


def _dot_width(b, dot, sizes) -> int:
    """|f| of a tl.dot over the feature wire f the two tiles share."""
    shared = [w for w in dot.lhs.wires if w in dot.rhs.wires and w not in set(b.batch) | {b.row, b.col}]
    return math.prod(sizes[w] for w in shared)


def _dtype(b, tensor: str) -> str:
    """What a backward tensor is stored in: the diagram's dtype for its
    inputs and O (dO and dlse as their outputs, as autograd hands them over),
    float32 for the row state, lse included: a narrower lse output has a
    float32 twin the backward reads (codegen/training.py)."""
    d = b.forward.diagram
    bound = dict(b.rule.bound)
    tensor = dict(b.aliases).get(tensor, tensor)   # dN0 = dO: the same tensor
    if tensor in ("dO", "dlse"):
        return tiling.tensor_dtype(d, bound[tensor[1:]])
    if tensor == "O":
        return tiling.tensor_dtype(d, bound["O"])
    t = d.tensor(tensor)
    if isinstance(t, ir.Input):
        return t.dtype
    return "fp32"


def _ops(e, subst: dict, seen: set) -> tuple[int, int]:
    """(arithmetic nodes, transcendental calls) of e, per element.  Nodes the
    kernel holds in a variable cost nothing, nor do subtrees of numbers and
    sizes alone: the kernel computes tl.log(_len_x * 1.0) once a program, not
    once a score (model.kernel_work skips them in the forward likewise).  A
    node already in ``seen`` (the same subtree earlier in the same loop body)
    costs nothing again; ``seen`` takes the nodes counted here."""
    if e in subst or _scalar(e) or isinstance(e, (ir.WireIndex, ir.TensorRef)):
        return 0, 0
    if e in seen:
        return 0, 0
    seen.add(e)
    other = exp = 0
    if isinstance(e, ir.Call) and e.fn in TRANSCENDENTAL:
        exp += 1
        other += 2 if e.fn == "sigmoid" else 0
    elif isinstance(e, (ir.Unary, ir.Binary, ir.Call)):
        other += 1
    children = [e.operand] if isinstance(e, ir.Unary) else [e.lhs, e.rhs] if isinstance(e, ir.Binary) \
        else list(e.args) if isinstance(e, ir.Call) else []
    for c in children:
        o, x = _ops(c, subst, seen)
        other, exp = other + o, exp + x
    return other, exp


def _scalar(e) -> bool:
    """Whether e reads only numbers and wire sizes: one value a program."""
    if isinstance(e, (ir.Num, ir.WireSize)):
        return True
    if isinstance(e, ir.Unary):
        return _scalar(e.operand)
    if isinstance(e, ir.Binary):
        return _scalar(e.lhs) and _scalar(e.rhs)
    if isinstance(e, ir.Call):
        return all(_scalar(a) for a in e.args)
    return False


# --------------------------------------------------------------------------
# A matrix product: dA and dB are contraction diagrams, costed as such.
# --------------------------------------------------------------------------

def _contraction(d: ir.Diagram, train, sizes: dict, profile, grad_dtype: str) -> tuple:
    """Each gradient diagram declares its output fp32 (its accumulator); the
    launch stores it in the buffer's dtype, the input's under "input".  The
    DRAM estimate is the gradient diagram's own (analysis.py), its store
    recounted in that dtype (a store always reaches DRAM).  An epilogue's
    torch part (training.epilogue_lines) is counted as one pass over what it
    reads and writes: eager torch may make temporaries besides, and its
    elementwise FLOPs are not counted."""
    from ..codegen import training
    from .analysis import analyse

    moves, kernels, drams = [], [], []
    working_set = 0
    of = ef = 0
    parts: Counter = Counter()   # the products' FLOPs by the dtype each runs in
    for g in train.grads:
        gd = g.diagram
        r = analyse(gd, {w: s for w, s in sizes.items() if gd.wire(w) is not None}, profile)
        name = gd.outputs[0].name
        kernels.append(name)
        if name == training.EPI_SUM:    # the recomputed sum, float32 whatever grad_dtype says
            stored = "fp32"
        else:
            stored = d.tensor(name[len("_grad_"):]).dtype if grad_dtype == "input" else "fp32"
        mine = []
        for t in r.transfers:
            if t.boundary.startswith("hbm/"):
                dtype = stored if (t.direction, t.tensor) == ("store", name) else t.dtype
                mine.append(Move(name, t.tensor, t.direction, dtype, t.elements))
        total = r.totals[0]
        drams.append(total.dram_bytes - (total.load_bytes + total.store_bytes) + sum(m.bytes for m in mine))
        moves += mine
        working_set = max(working_set, r.roofline.l2_working_set)
        of, ef = of + r.flops.other, ef + r.flops.exp
        parts.update(dict(r.flops.contraction_parts))
    if train.epilogue is not None:
        mine = _epilogue_moves(d, train, sizes, grad_dtype)
        kernels.append(mine[0].kernel)
        drams.append(sum(m.bytes for m in mine))
        moves += mine
    return moves, (parts, of, ef), kernels, drams, working_set


def _epilogue_moves(d: ir.Diagram, train, sizes: dict, grad_dtype: str) -> list[Move]:
    """The epilogue's torch part: dC (and the recomputed sum, and the inputs
    f reads) in, dR (in dC's dtype, where a product reads it) and each side
    input's gradient out."""
    from ..codegen import training

    epi = train.epilogue
    def elements(name: str) -> int:
        return math.prod(sizes[w] for w in ir.axis_wires(d.tensor(name).axes))

    out = d.outputs[0].name
    dc = training._dc_dtype(d, out)
    kernel = "epilogue (torch)"
    mine = [Move(kernel, f"d{out}", "load", dc, elements(out))]
    if epi.recompute:
        mine.append(Move(kernel, training.EPI_SUM, "load", "fp32", elements(out)))
    mine += [Move(kernel, n, "load", d.tensor(n).dtype, elements(n)) for n in epi.reads]
    if training.writes_dr(train):
        mine.append(Move(kernel, f"dR ({out}'s)", "store", dc, elements(out)))
    mine += [Move(kernel, f"_grad_{n}", "store", d.tensor(n).dtype if grad_dtype == "input" else "fp32",
                  elements(n)) for n, _ in epi.sides]
    return mine
