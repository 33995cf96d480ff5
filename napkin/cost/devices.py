"""The device level: what each device sends and receives, in how many steps.

For a diagram napkin.distributed can run (attention whose outputs merge
exactly, see napkin/distributed/reading.py), the numbers are those of
napkin/cost/collectives.py: exactly what the wrappers send, which the
multi-process tests check against the communication counter on every rank.
The mesh levels pick the scheme:

  group q + group x          ATTENTION2D on an R x C grid (cyclic layout)
  group q + stream x         Ring Attention (zigzag layout, or the one the
                             tiles name: a flat ring over contiguous shards
                             runs the steps its mask reaches); the backward
                             is costed both ways, Ring's (K, V circulate) and
                             BurstAttention's (Q, dO, lse, delta circulate)
  group x only               decoding: queries on every device, keys dealt
                             contiguously, states merged by a butterfly

Numbers are per device, for the busiest one: rows of a wire dealt over P
devices round up (padding), partial states and accumulators travel in fp32
(fp64 for fp64 inputs) whatever the diagram's ``accumulate``, and the shape
handshake before the forward is counted separately (``handshake_bytes``).

Link.  With a ``level nodes`` the devices level's counts say how many GPUs
a node holds (an ATTENTION2D node holds a DR x DC block of the grid);
without one, up to 8 devices share a node (NVLink) and more are one GPU per
node (InfiniBand).  Each collective takes max(bytes within the node /
NVLink, bytes across nodes / InfiniBand) on its slowest device.

Other diagrams split across devices (a matmul, say) keep the older generic
model: every input dealt evenly over the devices and gathered by those that
need the same block, outputs merged by all-to-all.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from .. import ir, tiling
from ..distributed.reach import ring_arms, same_ids
from ..documents import Documents, covered, ring_meets
from ..errors import NapkinError
from . import collectives as C
from .model import Kernel, contraction_factors, node_wires
from .symbolic import Poly

NVLINK_DOMAIN = 8  # GPUs per NVLink domain (one DGX/HGX node) without a nodes level


def unstated_gpus_per_node(p: int) -> int:
    """GPUs a node read into P devices of a diagram with no nodes level: one
    NVLink domain up to NVLINK_DOMAIN GPUs, else one GPU a node.  A nodes
    level states it instead ('across 1' there: all P on one node)."""
    return p if p <= NVLINK_DOMAIN else 1


@dataclass(frozen=True)
class CommRow:
    tensor: str
    collective: str       # "all-gather", "ring pass", "merge (all-to-all)", "merge (butterfly)"
    among: tuple[str, ...]  # the device-split wires whose parts the collective spans
    group: int            # devices in the collective
    steps: int
    dtype: str
    formula: str          # bytes received per device, symbolic
    bytes_received: Optional[int]
    bytes_sent: Optional[int]


@dataclass(frozen=True)
class DeviceComm:
    """The forward's communication on the busiest device (``rows``, the
    totals and ``time_s``), plus the handshake and the backward."""

    devices: int
    grid: tuple[tuple[str, str, int], ...]   # (wire, "group"/"stream", parts)
    rows: tuple[CommRow, ...]
    steps: int
    bytes_received: Optional[int]
    bytes_sent: Optional[int]
    link: str
    link_bandwidth: float
    time_s: Optional[float]
    scheme: str = ""                          # attention2d, ring, tree or generic
    gpus_per_node: Optional[int] = None
    handshake_bytes: Optional[int] = None     # sent before the forward (the shape check)
    sent_within: Optional[int] = None         # forward bytes sent within the node
    sent_across: Optional[int] = None         # forward bytes sent across nodes
    backward_bytes: Optional[int] = None      # sent by the backward (Ring's, for a ring)
    backward_time_s: Optional[float] = None
    burst_backward_bytes: Optional[int] = None    # a ring's backward the BurstAttention way
    burst_backward_time_s: Optional[float] = None
    layout: Optional[str] = None              # the token layout the mesh names (a ring's choice)
    ring_steps: Optional[int] = None          # the steps a flat ring runs where its mask cuts it short
    ring_ahead: int = 0                       # of those, the steps the other way round (reach.ring_arms)
    # inputs whose ids the mask compares at query and key (doc[b, q] == doc): on a flat ring their
    # values may cut it shorter still, at each call; priced at the steps above (--docs: on documents)
    ring_ids: tuple[str, ...] = ()
    # the documents (--docs, in words) the steps above were counted on, where they were
    ring_documents: str = ""


def mesh_tiles(diagram: ir.Diagram) -> tuple[ir.Tile, ...]:
    """The wires split across devices, one tile per wire with its parts over
    both mesh levels (nodes x devices) multiplied, and the layout either names."""
    found: dict[str, ir.Tile] = {}
    for name in ir.MESH_LEVELS:
        level = diagram.level(name)
        for t in level.tiles if level else ():
            if t.across:
                old = found.get(t.wire)
                found[t.wire] = ir.Tile(t.wire, t.kind, t.size * (old.size if old else 1), True,
                                        old.loc if old else t.loc, layout=t.layout or (old and old.layout))
    return tuple(found.values())


def communication(diagram: ir.Diagram, kernels: list[Kernel], sizes: Optional[dict[str, int]],
                  profile, wire_sym, docs: Optional[Documents] = None) -> Optional[DeviceComm]:
    """Per-device communication, or None without a mesh level.  ``docs``: a
    ring whose mask compares ids runs the steps they leave on those
    documents (napkin/documents.py)."""
    if not mesh_tiles(diagram):
        return None
    from ..distributed.reading import roles
    try:
        r = roles(diagram)
    except NapkinError:
        if any(t.layout for t in mesh_tiles(diagram)):
            # a token layout is a choice among the wrappers' schemes: a diagram naming one
            # means to run one, so their refusal (which says why) stands
            raise
        return _generic(diagram, kernels, sizes, profile, wire_sym)
    return _scheme(diagram, r, sizes, profile, docs)


# --------------------------------------------------------------------------
# Schemes napkin.distributed runs: the proven numbers.
# --------------------------------------------------------------------------

class Sym:
    """A symbolic byte count, printed for the report: just enough algebra
    (+, *, ceil division) to run collectives.terms on wire names."""

    def __init__(self, text: str):
        self.text = text

    @staticmethod
    def of(v) -> "Sym":
        return v if isinstance(v, Sym) else Sym(str(v))

    def _atom(self) -> str:
        return f"({self.text})" if " + " in self.text else self.text

    def __add__(self, other):
        o = Sym.of(other)
        if o.text == "0":
            return self
        return o if self.text == "0" else Sym(f"{self.text} + {o.text}")

    __radd__ = __add__

    def __mul__(self, other):
        o = Sym.of(other)
        if "0" in (self.text, o.text):
            return Sym("0")
        if o.text == "1":
            return self
        return o if self.text == "1" else Sym(f"{self._atom()}*{o._atom()}")

    __rmul__ = __mul__

    def __bool__(self) -> bool:
        return self.text != "0"

    def ceil_div(self, n: int) -> "Sym":
        return self if n == 1 else Sym(f"ceil({self.text}/{n})")

    def __str__(self) -> str:
        return self.text


def moved(diagram: ir.Diagram, r, sizes: Optional[dict[str, int]]) -> C.Moved:
    """What the wrappers move per token row, from the diagram's roles: numbers
    with ``sizes``, symbols (Sym) without."""
    def size(w: str):
        if sizes is not None:
            return sizes[w]
        fixed = diagram.wire(w).size
        return fixed if fixed is not None else Sym(w)

    def width(axes, skip: str):
        n = 1
        for w in ir.axis_wires(axes):
            if w != skip:
                n = n * size(w)
        return n

    def nbytes(dtype: str) -> int:
        return ir.DTYPE_BYTES[dtype]

    inputs = [diagram.tensor(n) for n in r.tokens]
    query = tuple((width(t.axes, r.query), nbytes(t.dtype)) for t in inputs if r.query in ir.axis_wires(t.axes))
    keys = tuple((width(t.axes, r.key), nbytes(t.dtype)) for t in inputs if r.key in ir.axis_wires(t.axes))
    o = diagram.tensor(r.value)
    rows = o.axes[:len(o.axes) - r.value_axes]
    stats = width(rows, r.query) if r.family == "softmax" else 0
    state = C.state_bytes("fp64" if any(t.dtype == "fp64" for t in inputs) else "fp32")
    return C.Moved(size(r.query), size(r.key), query, keys, width(o.axes, r.query), query[0][1], stats, state)


_COLLECTIVE = {"row": "all-gather", "column": "all-gather", "ring": "ring pass",
               "inner": "ring pass (in node)", "outer": "ring pass (to next node)"}


def _row(term: C.Term, sym: C.Term, r, placement: C.Placement, dtype: str) -> CommRow:
    scheme = placement.scheme
    if term.what == "partial states":
        name = "merge (all-to-all)"
    elif scheme == "tree":
        name = "merge (butterfly)"
    else:
        name = _COLLECTIVE.get(term.group, term.group)
    among = (r.query,) if term.group == "column" else (r.key,)
    group = len(placement.peers(term.group, 0)) + 1 if term.kind == "collective" else 2
    received = term.total if term.receives else 0
    formula = f"{sym.steps}*{Sym.of(sym.nbytes)._atom()}" if sym.steps != 1 else str(sym.nbytes)
    return CommRow(term.what, name, among, group, term.steps, dtype, formula, received,
                   term.total if term.sends else 0)


def placement_of(r) -> C.Placement:
    """The placement the cost pass prices for a diagram's roles (reading.roles):
    its scheme and grid, and where its nodes are."""
    scheme, grid = r.scheme
    p = C.parts_of(scheme, grid)
    if r.per_node is None:
        return C.Placement(scheme, grid, unstated_gpus_per_node(p))
    if scheme == "attention2d":
        return C.Placement(scheme, grid, block=r.per_node)
    if r.double_ring is not None:           # a ring over nodes: the double ring (ring.py)
        return C.Placement("ring2", r.double_ring)
    return C.Placement(scheme, grid, r.per_node[0])


def _link_name(placement: C.Placement) -> tuple[str, str]:
    g = placement.gpus_per_node or placement.parts
    if g >= placement.parts:
        return "NVLink", "nvlink_bandwidth"
    if g == 1:
        return "InfiniBand", "infiniband_bandwidth"
    return f"NVLink within nodes of {g}, InfiniBand across", "infiniband_bandwidth"


def _scheme(diagram: ir.Diagram, r, sizes: Optional[dict[str, int]], profile,
            docs: Optional[Documents] = None) -> DeviceComm:
    placement = placement_of(r)
    scheme = placement.scheme
    sym = moved(diagram, r, None)
    num = moved(diagram, r, sizes) if sizes is not None else None
    reach, meets, counted_on = None, None, ""
    same = same_ids(r) if docs is not None and scheme == "ring" else ()
    if same and num is not None:   # the first conjunct's ids on the documents (any other: meeting)
        length = covered(docs, diagram, same[0], sizes)
        meets = ring_meets(docs, r.layout or "zigzag", placement.parts, num.q_len, num.x_len, length)
        counted_on = docs.describe(length)
    # RingAttention's layout: the mesh's, else zigzag (a flat ring's cut by its mask or its documents
    # either way round; a double ring's never)
    layout = r.layout or ("zigzag" if scheme == "ring" else None)
    if scheme in C.RINGS and layout is not None:
        # the ring's own layout; a flat ring runs the steps its mask reaches, which only
        # numbers tell (symbolic sizes: every step)
        sym = dataclasses.replace(sym, layout=layout)
        if num is not None:
            num = dataclasses.replace(num, layout=layout)
            if scheme == "ring":
                back, ahead = ring_arms(r, layout, placement.parts, num.q_len, num.x_len, meets)
                num, sym = (dataclasses.replace(m, reach=back, ahead=ahead) for m in (num, sym))
                reach = back + ahead
    links = C.Links.of(profile)
    # the busiest part (the tree's parts differ when P is not a power of two)
    busiest = 0
    if num is not None:
        sent = [s for s, _ in C.rank_bytes(scheme, placement.grid, num, "forward")]
        busiest = max(range(len(sent)), key=lambda k: (sent[k], -k))
    sym_terms = C.terms(scheme, placement.grid, sym, "forward", busiest)
    num_terms = C.terms(scheme, placement.grid, num, "forward", busiest) if num is not None else None
    dtypes = {n: diagram.tensor(n).dtype for n in r.tokens}
    qdt = next(dtypes[n] for k, n in enumerate(r.tokens) if r.is_query(k))
    kdt = next(dtypes[n] for k, n in enumerate(r.tokens) if not r.is_query(k))
    state = "fp64" if sym.state == 8 else "fp32"
    rows = []
    for k, st in enumerate(sym_terms):
        dtype = qdt if st.what == "Q" else kdt if st.what == "K, V" else state
        if num_terms is None:
            rows.append(_symbolic(_row(st, st, r, placement, dtype)))
        else:
            rows.append(_row(num_terms[k], st, r, placement, dtype))
    tiles = tuple((t.wire, t.kind, t.size) for t in mesh_tiles(diagram))
    link, key = _link_name(placement)
    steps = sum(t.steps for t in sym_terms)
    # RingAttention reads them at each call in any layout (zigzag's documents may fit its chunks)
    ids = tuple(dict.fromkeys(s.name for s in same_ids(r))) \
        if scheme == "ring" and placement.parts > 1 and meets is None else ()
    cut = reach is not None and reach < placement.parts
    common = dict(scheme=scheme, gpus_per_node=placement.gpus_per_node,
                  layout=layout if meets or cut else r.layout,
                  ring_steps=reach if cut else None,
                  ring_ahead=num.ahead if num is not None else 0, ring_ids=ids,
                  ring_documents=counted_on if meets is not None and scheme == "ring" else "")
    if num is None:
        return DeviceComm(placement.parts, tiles, tuple(rows), steps, None, None, link, profile[key], None,
                          **common)

    def most(values):
        return max(values) if values else 0

    fwd = C.traffic(placement, num, "forward")
    mine = fwd[busiest]
    out = dict(common, handshake_bytes=most([t.sent for t in C.traffic(placement, num, "check")]),
               sent_within=mine.sent_within, sent_across=mine.sent_across)
    if scheme != "tree":
        out["backward_bytes"] = most([t.sent for t in C.traffic(placement, num, "backward")])
        out["backward_time_s"] = sum(C.phase_seconds(placement, num, "backward", links).values())
    if scheme in ("ring", "ring2"):
        burst = C.Placement(scheme.replace("ring", "burst"), placement.grid, placement.gpus_per_node)
        out["burst_backward_bytes"] = most([t.sent for t in C.traffic(burst, num, "backward")])
        out["burst_backward_time_s"] = sum(C.phase_seconds(burst, num, "backward", links).values())
    time = sum(C.phase_seconds(placement, num, "forward", links).values())
    return DeviceComm(placement.parts, tiles, tuple(rows), steps, mine.received, mine.sent, link,
                      profile[key], time, **out)


def _symbolic(row: CommRow) -> CommRow:
    """A symbolic row: no numbers."""
    return CommRow(row.tensor, row.collective, row.among, row.group, row.steps, row.dtype, row.formula,
                   None, None)


# --------------------------------------------------------------------------
# The generic model (diagrams the wrappers cannot run).
# --------------------------------------------------------------------------

def _parts(diagram: ir.Diagram) -> tuple[dict[str, int], Optional[tuple[str, int]]]:
    groups, stream = {}, None
    for t in mesh_tiles(diagram):
        if t.kind == "group":
            groups[t.wire] = t.size
        else:
            stream = (t.wire, t.size)
    return groups, stream


def _merge_wires(diagram: ir.Diagram, kernel: Kernel) -> set[str]:
    """Wires the kernel reduces or normalises over."""
    out = set()
    for b in kernel.boxes:
        for n in ir.walk(diagram.tensor(b).expr):
            if isinstance(n, ir.Reduce):
                out |= set(n.wires)
            elif isinstance(n, ir.Normalize):
                out.add(n.wire)
    return out


def _softmax_like(diagram: ir.Diagram, kernel: Kernel, wire: str) -> bool:
    return any((isinstance(n, ir.Normalize) and n.wire == wire) or
               (isinstance(n, ir.Reduce) and n.op in ("max", "logsumexp") and wire in n.wires)
               for b in kernel.boxes for n in ir.walk(diagram.tensor(b).expr))


def _generic(diagram: ir.Diagram, kernels: list[Kernel], sizes: Optional[dict[str, int]],
             profile, wire_sym) -> DeviceComm:
    """Diagrams napkin.distributed cannot run (not attention): every input
    dealt evenly over the P devices, gathered by the devices that need the
    same block, outputs merged by all-to-all."""
    groups, stream = _parts(diagram)
    # the ring is a mesh dimension of its own here: each device holds a chunk of the streamed
    # wire beside its groups' block (stream x across 8 alone counted 1 device; group h across 2
    # beside it 4, where its rows put K/8 on each), unless it runs over a group's devices
    p = tiling.mesh_devices(diagram)
    acc = tiling.accumulator_dtype(diagram)
    rows: list[CommRow] = []

    def block(wires) -> tuple[Poly, Optional[int], int]:
        """A device's block of a tensor along ``wires``: formula, elements, and
        how many devices share it."""
        # dealt over the grouped wires' devices (a ring alone deals nothing but its chunks)
        poly, n, share = Poly.const(1), 1, math.prod(groups.values())
        for w in wires:
            # all chunks of a wire streamed across devices pass through each device
            poly = poly * (Poly.sym(w) if stream and w == stream[0] else wire_sym(w))
            if w in groups:
                share //= groups[w]
            if n is not None:
                n = None if sizes is None else n * (math.ceil(sizes[w] / groups[w]) if w in groups else sizes[w])
        return poly, n, share

    def add(name, wires, dtype, collective, share, steps, poly, n):
        frac = Poly.const(1) - Poly.const(1) / share_sym(wires, collective)
        nbytes = None if n is None else (n - n // share) * ir.DTYPE_BYTES[dtype]
        among = (stream[0],) if collective == "ring pass" else tuple(w for w in groups if w not in wires)
        rows.append(CommRow(name, collective, among, share, steps, dtype, str(poly * frac * ir.DTYPE_BYTES[dtype]),
                            nbytes, nbytes))

    def share_sym(wires, collective) -> Poly:
        if collective == "ring pass":
            return Poly.sym(f"P_{stream[0]}")
        k = Poly.const(1)
        for w in groups:
            if w not in wires:
                k = k * Poly.sym(f"P_{w}")
        return k

    for t in diagram.inputs:
        wires = ir.axis_wires(t.axes)
        if stream and stream[0] in wires:
            poly, n, _ = block(wires)
            # per step a chunk of 1/N along the streamed wire; N - 1 chunks arrive
            add(t.name, wires, t.dtype, "ring pass", stream[1], stream[1] - 1, poly, n)
            continue
        poly, n, share = block(wires)
        if share > 1:
            add(t.name, wires, t.dtype, "all-gather", share, share - 1, poly, n)

    outputs = {o.name for o in diagram.outputs}
    for k in kernels:
        merged = [w for w in _merge_wires(diagram, k) if w in groups]
        if not merged:
            continue
        for name in k.stores:
            if name not in outputs:
                continue
            wires = ir.axis_wires(diagram.tensor(name).axes)
            poly, n, share = block(wires)
            if share > 1:
                add(name, wires, acc, "merge (all-to-all)", share, share - 1, poly, n)
        soft = [w for w in merged if _softmax_like(diagram, k, w)]
        lse_out = any(isinstance(n, ir.Reduce) and n.op == "logsumexp"
                      for b in k.stores if b in outputs for n in [diagram.tensor(b).expr])
        if soft and not lse_out and k.stores:
            # the merge needs each row's log-sum-exp: rows = the first store's wires minus its last
            first = diagram.tensor(k.stores[0])
            wires = tuple(w for w in ir.axis_wires(first.axes) if w not in _value_wires(diagram, k))
            poly, n, share = block(wires)
            if share > 1:
                add(f"lse({first.name})", wires, "fp32", "merge (all-to-all)", share, 0, poly, n)

    steps = _steps(rows)
    received = None if sizes is None else sum(r.bytes_received for r in rows)
    sent = None if sizes is None else sum(r.bytes_sent for r in rows)
    # a nodes level says where the nodes are: splitting something, it puts the
    # collectives across nodes (InfiniBand); 'across 1' alone, all P on one node
    from ..distributed.reading import has_nodes_level
    if has_nodes_level(diagram):
        across_nodes = any(t.across and t.size > 1 for t in diagram.level("nodes").tiles)
    else:
        across_nodes = unstated_gpus_per_node(p) < p
    link = "infiniband_bandwidth" if across_nodes else "nvlink_bandwidth"
    bw = profile[link]
    time = None if received is None else max(received, sent) / bw
    grid = tuple((t.wire, t.kind, t.size) for t in mesh_tiles(diagram))
    return DeviceComm(p, grid, tuple(rows), steps, received, sent,
                      "InfiniBand" if across_nodes else "NVLink", bw, time, scheme="generic")


def _value_wires(diagram: ir.Diagram, kernel: Kernel) -> set[str]:
    """Wires an output has that its row statistics lack (d of O): the wires
    of the value operand of the last contraction that are not reduced."""
    out: set[str] = set()
    for b in kernel.boxes:
        for n in ir.walk(diagram.tensor(b).expr):
            f = contraction_factors(n, diagram)
            if f:
                out = set(node_wires(diagram, f[1])) - set(n.wires)
                out -= node_wires(diagram, f[0])
    return out


def _steps(rows: list[CommRow]) -> int:
    """Tensors in the same collective among the same devices move together."""
    seen: dict[tuple, int] = {}
    for r in rows:
        key = (r.collective, r.among)
        seen[key] = max(seen.get(key, 0), r.steps)
    return sum(seen.values())
