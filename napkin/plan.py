"""``napkin plan``: every way napkin can spread one attention diagram over
devices, ranked by predicted time.

    napkin plan examples/gqa.ncd --devices 16 -D b=1 -D hk=8 -D g=4 -D q=32768 -D x=32768
    napkin plan FILE --devices 64 --gpus-per-node 8 --device h100 ... [--forward] [--emit OUT.ncd]
    napkin plan examples/document_ring.ncd --devices 8 -D b=1 -D h=16 -D q=65536 -D x=65536 --docs 4096

The candidates, for P devices (G per node):

* Ring Attention (``ring``) and Ring Attention with BurstAttention's
  backward (``burst``): the same forward, two backwards;
* with several nodes, the same two as a double ring (``ring2``, ``burst2``:
  topology-aware, N nodes x G GPUs; blocks go round each node over NVLink
  and hop to the next node once a round, over InfiniBand);
* ATTENTION2D on every R x C grid with R * C = P (1 x P and P x 1 too);
  with several nodes, every way of placing a DR x DC block of the grid on
  each node (DR * DC = G): DC = C keeps whole grid rows inside a node, so
  the row collectives (Q, the partial states) stay on NVLink;
* with ``--forward`` (inference), decoding's tree (``tree``): queries on
  every device, the keys split, states merged by a butterfly;
* where the mask keeps only nearby keys (a causal window, chunks), the flat
  ring and its BurstAttention variant over contiguous shards, cut to the
  steps the mask reaches (napkin/distributed/reach.py); ``--emit`` writes
  ``contiguous`` on its tiles, which the wrappers, the generated launcher
  and napkin cost read.  The zigzag ring is cut too, a few steps each way
  round (its ranks' late chunks need the ranks ahead);
* with ``--docs LENGTHS``, a mask comparing ids (``doc[b, q] == doc``) is
  priced on packed documents of those lengths (napkin/documents.py): its
  compute is the pairs they keep, each scheme's counted in its own token
  layout at its busiest device (documents.ShardPairs: a long document's
  devices work while the others wait), and each flat ring, zigzag or over
  contiguous shards, runs the steps RingAttention would read from such ids
  (napkin cost counts the same), each step timed at its busiest rank (a
  double ring's too, which runs every step of its rounds); and the flat
  ring over cyclic shards joins the candidates, as it deals every long
  document out evenly (``--emit`` writes ``cyclic`` on its tiles).

Each is costed with napkin/cost/collectives.py, the model the
multi-process tests prove against the byte counter: bytes per device,
split by link, and time = transfers at NVLink / InfiniBand bandwidth
(profiles.toml) plus compute.  Compute: 4 FLOPs per query-key pair per head
dimension forward (QK and PV; the pairs a mask of bounds keeps counted exactly,
in closed form, napkin/pairs.py; any other mask's density from napkin/visits.py at a 128
x 128 block grid, partial blocks counted half), 2.5 times that backward, at
FlashAttention-2's fraction of the dense peak (370 and 322 of 989 TFLOP/s on
an H100, background section 4) for every GPU.  Every scheme's layout is
taken to balance the work (cyclic for ATTENTION2D, zigzag for the rings),
but for a ring its mask of bounds cuts short, whose steps are timed at their
busiest rank (``BoundPairs``, every rank counted in closed form: the own
block holds most of a window's pairs, and a zigzag ring's steps fall on
different ranks), and for documents,
counted per device as above; bench/cp_bench.py counts the work of each
device exactly instead.

``--emit OUT.ncd`` writes the diagram with the winner's mesh levels (a
double ring as a nodes level over a devices level), with a nodes level
wherever napkin cost would otherwise read other nodes than the plan assumed
(mesh_levels); for ``burst`` the
diagram is the ring's, run with
``RingAttention(diagram, backward="burst")`` (the backward is the wrapper's
choice, not the diagram's).
"""
from __future__ import annotations

import dataclasses
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from . import ir, masks, pairs
from .cost import collectives as C
from .cost.analysis import bind_sizes
from .cost.devices import moved, placement_of, unstated_gpus_per_node
from .cost.profiles import get_profile, profile_names
from .distributed.reach import mask_bounds, ring_arms, same_ids
from .distributed.reading import roles
from .documents import (Documents, ShardPairs, add_docs_option, bound_interval, covered, id_wire, ring_meets,
                        ring_steps_at)
from .errors import Diagnostic, NapkinError
from .files import why_not, write_atomic
from .sizes import positive_int

# The most devices plan searches: it prices every placement of every divisor of P, each
# in time linear in P (collectives._link_classes): 3.2 s at 27,720 devices (96 divisors,
# 100 placements), 2.2 s at 32,768, 94 s at 2^20 (one core of this machine, 8 a node)
MAX_DEVICES = 32768

FWD_EFFICIENCY = 370 / 989.4     # FlashAttention-2 forward, d128, H100 (background section 4)
BWD_EFFICIENCY = 322 / 989.4     # and backward
BWD_FLOP_FACTOR = 2.5            # backward FLOPs / forward FLOPs (background section 1)
DENSITY_BLOCKS = 128             # blocks per side when measuring a mask's density
EXACT_RANK_STEPS = 1 << 20      # a ring cut short: every rank counted at every step up to this many
CUT_RANKS = 512                  # ranks counted beyond (BoundPairs)


@dataclass(frozen=True)
class Option:
    """One way to run the diagram, costed."""

    scheme: str                          # attention2d, ring, burst, tree
    grid: tuple[int, ...]
    block: Optional[tuple[int, int]]     # ATTENTION2D: the grid block a node holds (None: row-major)
    gpus_per_node: int
    forward_bytes: int                   # sent by the busiest device
    backward_bytes: int
    across_bytes: int                    # of those (forward + backward), sent across nodes
    forward_s: float
    backward_s: float
    comm_s: float                        # transfer time on the critical path's collectives (not overlap-aware)
    compute_s: float
    # a flat ring cut short: its steps the usual way round and the other way
    arms: Optional[tuple[int, int]] = None
    # the token layout its tiles name (the launcher and napkin cost read it): "contiguous" for a
    # ring cut short by its mask's reach, "cyclic" for a ring that shares documents out evenly
    # (--docs); None for the scheme's own (a ring's zigzag)
    layout: Optional[str] = None

    @property
    def reach(self) -> Optional[int]:
        """The steps a ring cut short runs, both ways together (None: not cut)."""
        return sum(self.arms) if self.arms is not None else None

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def label(self) -> str:
        if self.scheme == "attention2d":
            r, c = self.grid
            where = ""
            if self.block is not None and self.block != (r, c):
                dr, dc = self.block
                where = (", rows in nodes" if dc == c else ", columns in nodes" if dr == r
                         else "") + f", {dr}x{dc} per node"
            return f"ATTENTION2D {r}x{c}{where}"
        if self.scheme in ("ring2", "burst2"):
            n, g = self.grid
            return ("Double ring" if self.scheme == "ring2" else "Double ring + BurstAttention backward") + \
                f" of {n} nodes x {g}"
        short = f", {self.reach} of {self.grid[0]} steps" if self.reach else ""
        if self.layout == "contiguous":
            short = f" over contiguous shards, {self.reach} of {self.grid[0]} steps"
        elif self.layout == "cyclic":
            short = " over cyclic shards" + short
        if self.arms is not None and self.arms[1]:
            short += f" ({self.arms[0]} back, {self.arms[1]} ahead)"
        return {"ring": "Ring", "burst": "Ring + BurstAttention backward", "tree": "tree (decoding)"}[
            self.scheme] + f" of {self.grid[0]}" + short


def placements(p: int, gpus_per_node: int, training: bool = True) -> list[C.Placement]:
    """Every placement napkin can emit for P devices, G per node."""
    out = [C.Placement("ring", (p,), gpus_per_node)]
    if training:
        out.append(C.Placement("burst", (p,), gpus_per_node))
    if 1 < gpus_per_node < p:
        out.append(C.Placement("ring2", (p // gpus_per_node, gpus_per_node)))
        if training:
            out.append(C.Placement("burst2", (p // gpus_per_node, gpus_per_node)))
    for r in range(1, p + 1):
        if p % r:
            continue
        c = p // r
        if gpus_per_node >= p or gpus_per_node == 1:     # one node, or one GPU per node
            out.append(C.Placement("attention2d", (r, c), gpus_per_node))
            continue
        blocks = [(dr, gpus_per_node // dr) for dr in range(1, gpus_per_node + 1)
                  if gpus_per_node % dr == 0 and r % dr == 0 and c % (gpus_per_node // dr) == 0]
        if not blocks:      # no block tiles the grid: ranks row-major
            out.append(C.Placement("attention2d", (r, c), gpus_per_node))
        out += [C.Placement("attention2d", (r, c), block=b) for b in blocks]
    if not training:
        out.append(C.Placement("tree", (p,), gpus_per_node))
    return out


def density(diagram: ir.Diagram, r, sizes: dict[str, int]) -> float:
    """The fraction of query-key pairs the mask keeps: counted exactly where
    the mask is a conjunction of bounds on the key (pairs.kept), else at a
    block grid (partial blocks count half); 1 for an unmasked diagram and for
    a mask that reads data (on --docs' documents Pricing counts the pairs,
    documents.ShardPairs)."""
    pred = _predicate(diagram, r)
    if pred is None:
        return 1.0
    if any(isinstance(n, ir.TensorRef) for n in ir.walk(pred)):
        # a mask of data (document ids): which pairs it keeps is known only at run time;
        # counted dense, as napkin cost counts it (every block read "partial", it was priced at half)
        return 1.0
    nq, nx = sizes[r.query], sizes[r.key]
    bounds = _bounds(pred, r, sizes)
    if bounds is not None:
        # a conjunction of bounds on the key (causal, windows, chunks): the pairs counted exactly,
        # in closed form; a block grid of 128 x 128 would count a window narrower than its blocks at half
        # of each diagonal block (256 tokens of 2^23: 255 times too many)
        return pairs.kept(bounds, sizes, nq, nx) / (nq * nx)
    bq, bx = min(DENSITY_BLOCKS, nq), min(DENSITY_BLOCKS, nx)
    edges_q = [nq * i // bq for i in range(bq + 1)]
    edges_x = [nx * j // bx for j in range(bx + 1)]
    kept = 0.0
    for i in range(bq):
        for j in range(bx):
            ranges = {r.query: (edges_q[i], edges_q[i + 1]), r.key: (edges_x[j], edges_x[j + 1])}
            cls = masks.classify_block(pred, ranges, sizes)
            area = (edges_q[i + 1] - edges_q[i]) * (edges_x[j + 1] - edges_x[j])
            kept += area * {masks.BlockClass.FULL: 1.0, masks.BlockClass.PARTIAL: 0.5}.get(cls, 0.0)
    return kept / (nq * nx)


def _predicate(diagram: ir.Diagram, r) -> Optional[ir.Expr]:
    """The mask's predicate on the scores (True keeps a pair); None unmasked."""
    body = r.score if r.score is not None else diagram.tensor(r.value).expr
    node = masks.mask_node(body)
    return None if node is None else masks.mask_predicate(node)


def _bounds(pred: Optional[ir.Expr], r, sizes: dict[str, int]) -> Optional[tuple]:
    """The bounds on the key whose conjunction is the mask ``pred``, where it
    is one (masks.exact_bounds); None where it reads data or another conjunct."""
    return None if pred is None else masks.exact_bounds(pred, r.query, r.key, sizes)


class BoundPairs:
    """The pairs a mask of bounds keeps at the steps of a ring cut short,
    its busiest rank's, each once: counted in closed form over every rank
    (pairs.ring_steps) where the steps times the ranks are at most
    EXACT_RANK_STEPS, else over at most CUT_RANKS ranks, a pass over their
    rows (documents.ring_steps_at: the first and last quarter and the rest
    spread evenly, a window's or a chunk's interior ranks alike)."""

    def __init__(self, bounds: tuple, q_len: int, x_len: int, sizes: dict[str, int]):
        self.bounds, self.q_len, self.x_len, self.sizes = bounds, q_len, x_len, sizes
        self._memo: dict = {}

    def keeps(self, q):
        import numpy as np

        return [bound_interval(self.bounds, q, np.zeros_like(q), np.full_like(q, self.x_len), self.sizes)]

    def steps(self, kind: str, parts: int, offsets: tuple) -> tuple[int, ...]:
        key = (kind, parts, offsets)
        if key not in self._memo:
            if len(offsets) * parts <= EXACT_RANK_STEPS:
                steps = pairs.ring_steps(self.bounds, self.sizes, kind, parts, self.q_len, self.x_len, offsets)
            else:
                steps = ring_steps_at(self.keeps, kind, parts, self.q_len, self.x_len, offsets, CUT_RANKS)
            self._memo[key] = steps
        return self._memo[key]


def forward_flops(m: C.Moved, keep: float) -> float:
    """QK (2 FLOPs per query row element of every query input) and PV (2 per
    output element), for every kept query-key pair."""
    per_pair = 2 * sum(w for w, _ in m.query) + 2 * m.out
    return per_pair * m.q_len * m.x_len * keep


def plan(diagram: ir.Diagram, devices: int, sizes: Optional[dict] = None, gpus_per_node: Optional[int] = None,
         profile: Optional[str] = None, training: bool = True, docs: Optional[Documents] = None) -> list[Option]:
    """Every option, best (least predicted time, then fewest bytes, then fewest
    across nodes) first.  ``docs``: a mask comparing ids (doc[b, q] == doc)
    read on documents of these lengths: the pairs it keeps set the compute,
    each scheme's busiest device and each flat ring's steps on them."""
    if devices < 1:
        raise NapkinError(f"--devices must be at least 1, not {devices}")
    if devices > MAX_DEVICES:
        raise NapkinError(f"--devices {devices} is more than napkin plan searches ({MAX_DEVICES:,}: it prices "
                          "every placement, a few seconds at that many devices, 94 s at 2^20)")
    g = devices if gpus_per_node is None else gpus_per_node
    if g < 1:
        raise NapkinError(f"--gpus-per-node must be at least 1, not {g}")
    if devices > g and devices % g:
        raise NapkinError(f"{devices} devices do not fill nodes of {g} GPUs")
    coarse = ir.coarse_reads(diagram)
    if coarse:   # the checker refuses a devices level beside such a read: no scheme would run
        tensor, _, read, step, loc = coarse[0]
        raise NapkinError([Diagnostic(
            f"diagram {diagram.name} reads {tensor} at {read} // {step}, which napkin's distributed wrappers do "
            "not split across devices: napkin plan has no scheme to offer", loc)])
    g = min(g, devices)
    pricing = Pricing.of(diagram, devices, sizes, profile, training, docs)
    candidates = placements(devices, g, training)
    out = [pricing.option(pl, g) for pl in candidates]
    rings = [pl for pl in candidates if pl.scheme in ("ring", "burst")]
    if sum(pricing.arms) < devices:
        out += [pricing.option(pl, g, "contiguous") for pl in rings]
    if pricing.kept is not None:
        # on documents the layout decides the busiest rank: cyclic shares every long document out
        # evenly, where zigzag and contiguous shards leave it to a few ranks
        out += [pricing.option(pl, g, "cyclic") for pl in rings]
    # times equal but for the order of their additions (one round of 16 or two
    # of 8) tie: the fewer bytes, then the fewer across nodes, decide
    out.sort(key=lambda o: (rank_time(o.total_s), o.forward_bytes + o.backward_bytes, o.across_bytes, o.label))
    return out


@dataclass(frozen=True)
class Pricing:
    """What pricing a placement of one diagram at given sizes needs: the bytes
    its tokens move, the links, and the compute every device does."""

    moved: C.Moved
    links: C.Links
    flops: float            # the forward's, all devices together
    rate: float             # one device's dense peak for the tokens' dtype
    devices: int
    training: bool
    arms: tuple[int, int]   # the steps a flat ring over contiguous shards runs each way (reach.ring_arms)
    # on --docs' documents: the pairs each scheme's devices keep (documents.ShardPairs), which
    # price every step at its busiest device; else None
    kept: Optional[ShardPairs] = dataclasses.field(default=None, compare=False)
    # the steps a flat ring runs each way in the zigzag layout (its mask's and, on --docs, its ids'),
    # and in the cyclic one (--docs only: no mask cuts it)
    zigzag_arms: Optional[tuple[int, int]] = None
    cyclic_arms: Optional[tuple[int, int]] = None
    # without --docs, where a mask of bounds (exactly) cuts a ring short: the pairs it keeps, which
    # time the cut ring's steps at their busiest rank (a zigzag ring's steps fall on different ranks)
    cut: Optional["BoundPairs"] = dataclasses.field(default=None, compare=False)

    @staticmethod
    def of(diagram: ir.Diagram, devices: int, sizes: Optional[dict], profile: Optional[str],
           training: bool, docs: Optional[Documents] = None) -> "Pricing":
        r = _roles(diagram)
        bound = bind_sizes(diagram, sizes)
        missing = sorted({w for n in r.tokens for w in ir.axis_wires(diagram.tensor(n).axes)} - set(bound))
        if missing:
            raise NapkinError(f"give the size of {', '.join(missing)} (-D WIRE=N) to plan {diagram.name}")
        m = moved(diagram, r, bound)
        prof = get_profile(profile_of(diagram, profile))
        rate, _ = prof.contraction_rate(diagram.tensor(r.tokens[0]).dtype)
        if docs is None:
            arms = {kind: ring_arms(r, kind, devices, m.q_len, m.x_len) for kind in ("contiguous", "zigzag")}
            bounds = _bounds(_predicate(diagram, r), r, bound)
            # a ring its mask of bounds cuts short is timed at each step's busiest rank
            cut = BoundPairs(bounds, m.q_len, m.x_len, bound) \
                if bounds and min(sum(a) for a in arms.values()) < devices else None
            return Pricing(m, C.Links.of(prof), forward_flops(m, density(diagram, r, bound)), rate, devices,
                           training, arms["contiguous"], zigzag_arms=arms["zigzag"], cut=cut)
        same = same_ids(r)
        if not same:
            raise NapkinError(f"--docs: diagram {diagram.name}'s mask compares no ids at the query and the key "
                              "(doc[b, q] == doc): document lengths change nothing napkin plan prices")
        if id_wire(diagram, same[0]) not in bound:
            raise NapkinError(f"give the size of {id_wire(diagram, same[0])} (-D WIRE=N): --docs covers it")
        length = covered(docs, diagram, same[0], bound)
        kept = ShardPairs.on_documents(docs, mask_bounds(r), m.q_len, m.x_len, bound, length)
        arms = {kind: ring_arms(r, kind, devices, m.q_len, m.x_len,
                                ring_meets(docs, kind, devices, m.q_len, m.x_len, length))
                for kind in ("contiguous", "zigzag", "cyclic")}
        return Pricing(m, C.Links.of(prof), forward_flops(m, kept.total / (m.q_len * m.x_len)), rate, devices,
                       training, arms["contiguous"], kept, arms["zigzag"], arms["cyclic"])

    def option(self, pl: C.Placement, g: int, layout: Optional[str] = None) -> Option:
        """``pl`` costed (``g``: the GPUs a node it is labelled with where the
        placement, a grid block, does not say).  ``layout``, a flat ring's
        tokens named on its tiles: "contiguous", the ring cut to the steps
        its mask reaches (``arms``); "cyclic" (--docs only); None, the
        scheme's own (zigzag for a ring, cut where its mask or --docs' ids
        allow)."""
        arms = {"contiguous": self.arms, "cyclic": self.cyclic_arms, None: self.zigzag_arms}[layout] \
            if pl.scheme in ("ring", "burst") else None
        if arms is not None and sum(arms) == self.devices:
            arms = None     # every step: the bytes of the ring in any layout, as without --docs
        m = self.moved if arms is None else \
            dataclasses.replace(self.moved, layout=layout or "zigzag", reach=arms[0], ahead=arms[1])
        work = self._work(pl, arms, layout or "zigzag")
        # BurstAttention's backward over the whole ring sends the query blocks the keys' way round
        # (ring.py): rank r's keys meet origin's queries; cut short, they go the other way, r + s's
        back = self._work(pl, arms, layout or "zigzag", queries=True) \
            if pl.scheme in ("burst", "burst2") and arms is None else work
        fwd = [x / (self.rate * FWD_EFFICIENCY) for x in work]
        bwd = [BWD_FLOP_FACTOR * x / (self.rate * BWD_EFFICIENCY) for x in back] \
            if self.training and pl.scheme != "tree" else None
        t = C.scheme_seconds(pl, m, self.links, fwd, bwd)
        phases = ("forward", "backward") if bwd is not None else ("forward",)
        traffic = {ph: C.traffic(pl, m, ph) for ph in phases}
        sent = {ph: max(x.sent for x in traffic[ph]) for ph in phases}
        across = max(sum(traffic[ph][k].sent_across for ph in phases) for k in range(pl.parts))
        return Option(pl.scheme, pl.grid, pl.block, pl.gpus_per_node or g, sent["forward"],
                      sent.get("backward", 0), across, t.forward_s, t.backward_s,
                      t.forward_comm_s + t.backward_comm_s, t.forward_compute_s + t.backward_compute_s, arms,
                      layout)

    def _work(self, pl: C.Placement, arms: Optional[tuple[int, int]], layout: str,
              queries: bool = False) -> list[float]:
        """The forward FLOPs of each step (its busiest device's): an even split
        of ``flops``, or on documents, and for a ring cut short, the pairs the
        busiest device keeps (``queries``: with the query blocks travelling,
        ShardPairs.ring_steps)."""
        p = self.devices
        steps = sum(arms) if arms is not None else (pl.parts if pl.scheme in C.RINGS else 1)
        if self.kept is None and arms is not None and self.cut is not None:
            # the flops of a kept pair (density counted the pairs exactly: a mask of bounds)
            per_pair = forward_flops(self.moved, 1.0) / (self.moved.q_len * self.moved.x_len)
            back, ahead = arms
            offsets = tuple(range(back)) + tuple(p - t for t in range(1, ahead + 1))
            return [per_pair * w for w in self.cut.steps(layout, p, offsets)]
        pairs = self.kept
        if pairs is None:
            return [self.flops / p / steps] * steps
        per_pair = self.flops / pairs.total if pairs.total else 0.0
        if pl.scheme == "attention2d":
            return [per_pair * pairs.grid_busiest(*pl.grid)]
        if pl.scheme == "tree":
            return [per_pair * pairs.tree_busiest(p)]
        if pl.scheme in ("ring2", "burst2"):    # zigzag over all P, every step of every round
            return [per_pair * w for w in pairs.ring_steps("zigzag", p, pl.grid[0], queries)]
        # step s of the usual way brings rank r - s's keys, step t of the other way rank r + t's
        w = pairs.ring_steps(layout, p, queries=queries)
        back, ahead = arms if arms is not None else (p, 0)
        return [per_pair * w[s] for s in range(back)] + [per_pair * w[p - t] for t in range(1, ahead + 1)]


# --------------------------------------------------------------------------
# Emitting the chosen option as mesh levels.
# --------------------------------------------------------------------------

def profile_of(diagram: ir.Diagram, profile: Optional[str] = None) -> str:
    """The device profile priced: the one asked for, else the diagram's own
    (``schedule on a100``), else h100, as napkin cost takes it (plan priced
    h100 whatever the diagram said)."""
    return profile or (diagram.schedule.profile if diagram.schedule else None) or "h100"


def _roles(diagram: ir.Diagram):
    """The roles of the diagram without its mesh levels, its query and key wires
    the ones its own mesh splits when it has one (without the mesh only wires
    named q and x were found: a ring over t and s was refused)."""
    base = _without_mesh(diagram)
    if base.schedule == diagram.schedule:
        return roles(base)
    try:
        full = roles(diagram)
    except NapkinError:   # a mesh the wrappers refuse still names no wires: the plain reading decides
        return roles(base)
    return roles(base, full.query, full.key)


def _without_mesh(diagram: ir.Diagram) -> ir.Diagram:
    if diagram.schedule is None:
        return diagram
    levels = tuple(lv for lv in diagram.schedule.levels if lv.name not in ir.MESH_LEVELS)
    return dataclasses.replace(diagram, schedule=dataclasses.replace(diagram.schedule, levels=levels))


def rank_time(seconds: float) -> float:
    """A predicted time to nine significant digits: sums of the same terms in
    another order differ in the last bits, which must not rank two options."""
    return float(f"{seconds:.9g}")


def mesh_levels(option: Option, query: str, key: str) -> tuple[ir.Level, ...]:
    """The nodes / devices levels that ask for ``option``, saying where its
    nodes are wherever a diagram can.  Without a nodes level napkin cost reads
    P devices as unstated_gpus_per_node(P) GPUs a node; where this plan
    assumed otherwise, all P on one node is a nodes level of 'across 1' and
    one GPU a node puts the mesh at the nodes level (a ring of P nodes is the
    double ring of P x 1).  Two layouts have no such words: a flat ring over
    nodes of 1 < G < P GPUs and a grid ranked row-major that no node block
    tiles (emitted_placement_note says what cost makes of them)."""
    p = math.prod(option.grid)
    g = min(option.gpus_per_node, p)
    state = p > 1 and g != unstated_gpus_per_node(p)   # the nodes are to be written down

    # a ring over contiguous shards cut short says so on its tiles (napkin cost then prices it so)
    layout = option.layout

    def level(name, tiles, keep=False):
        tiles = tuple(ir.Tile(w, kind, n, True, layout=layout) for w, kind, n in tiles if n > 1 or keep)
        return (ir.Level(name, None, tiles),) if tiles else ()

    def nodes(tiles):
        # 'across 1' tiles only where nothing else would say where the nodes are
        return level("nodes", tiles) or level("nodes", tiles, keep=state)

    if option.scheme in ("ring", "burst"):
        if state and g == 1:
            return level("nodes", [(query, "group", p), (key, "stream", p)])
        # a flat ring is one devices level; the launcher fills nodes in rank order
        return nodes([(query, "group", 1), (key, "stream", 1)] if g >= p else []) + \
            level("devices", [(query, "group", p), (key, "stream", p)])
    if option.scheme in ("ring2", "burst2"):
        n, per = option.grid
        return level("nodes", [(query, "group", n), (key, "stream", n)]) + \
            level("devices", [(query, "group", per), (key, "stream", per)])
    if option.scheme == "tree":
        n = max(p // g, 1)
        return nodes([(key, "group", n)]) + level("devices", [(key, "group", p // n)])
    r, c = option.grid
    block = option.block
    if block is None and state and g in (1, p):
        block = (1, 1) if g == 1 else (r, c)
    dr, dc = block if block is not None else (r, c)
    # both wires stay in the devices level, 'across 1' included: a grid
    # without q is decoding's, not a 1 x C grid
    return (nodes([(query, "group", r // dr), (key, "group", c // dc)]) if block is not None else ()) + \
        level("devices", [(query, "group", dr), (key, "group", dc)], keep=True)


def emitted_placement_note(option: Option, emitted: ir.Diagram, sizes: Optional[dict] = None,
                           profile: Optional[str] = None, training: bool = True,
                           docs: Optional[Documents] = None) -> Optional[str]:
    """What ``napkin cost`` makes of the emitted diagram where it prices other
    links than this plan did (mesh_levels: the two layouts a diagram cannot
    place on nodes), else None.  Priced, not compared by shape: a flat ring
    of 16 over nodes of 8 waits on InfiniBand every step as one over nodes of
    1 does, and its busiest device (at a node's edge) sends all it sends
    across nodes as there, so cost's reading changes no figure plan gives."""
    p = math.prod(option.grid)
    if p == 1:      # one device: no mesh, no links
        return None
    read = placement_of(roles(emitted))
    if option.scheme.startswith("burst"):   # the backward is the wrapper's choice, not the diagram's
        read = dataclasses.replace(read, scheme=read.scheme.replace("ring", "burst"))
    cost = Pricing.of(emitted, p, sizes, profile, training, docs).option(read, read.gpus_per_node or p,
                                                                         option.layout)
    if (rank_time(cost.forward_s), rank_time(cost.backward_s), cost.across_bytes) == \
            (rank_time(option.forward_s), rank_time(option.backward_s), option.across_bytes):
        return None
    g = min(option.gpus_per_node, p)
    layout = "a flat ring" if option.scheme in ("ring", "burst") else "an ATTENTION2D grid no node block tiles"
    return (f"napkin cost prices the emitted diagram as {unstated_gpus_per_node(p)} GPU(s) a node, not the {g} "
            f"this plan assumed: a diagram cannot place {layout} on nodes. Its bytes agree; cost's time is "
            f"{_ms(cost.total_s)} ms against {_ms(option.total_s)} ms, {cost.across_bytes / 1e6:.2f} MB across "
            f"nodes against {option.across_bytes / 1e6:.2f}")


def emit(diagram: ir.Diagram, option: Option) -> ir.Diagram:
    """The diagram with ``option``'s mesh levels (others replaced)."""
    r = _roles(diagram)
    base = _without_mesh(diagram)
    schedule = base.schedule or ir.Schedule()
    levels = mesh_levels(option, r.query, r.key) + schedule.levels
    return dataclasses.replace(base, schedule=dataclasses.replace(schedule, levels=levels))


# --------------------------------------------------------------------------
# The command line.
# --------------------------------------------------------------------------

def _ms(t: float) -> str:
    """Milliseconds, three decimals; three significant digits below 0.1 ms, where decoding's
    plans live (they all read 0.000 or 0.001 with a fixed three decimals)."""
    v = t * 1e3
    return f"{v:.3f}" if v >= 0.1 or v == 0 else f"{v:.3g}"


def format_table(options: list[Option], top: int) -> str:
    head = ["#", "scheme", "fwd ms", "bwd ms", "total ms", "fwd MB/dev", "bwd MB/dev", "across nodes MB"]
    rows = [[str(k + 1), o.label, _ms(o.forward_s), _ms(o.backward_s),
             _ms(o.total_s), f"{o.forward_bytes / 1e6:.2f}", f"{o.backward_bytes / 1e6:.2f}",
             f"{o.across_bytes / 1e6:.2f}"] for k, o in enumerate(options[:top])]
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    lines = ["  ".join(x.ljust(w) if i == 1 else x.rjust(w) for i, (x, w) in enumerate(zip(line, widths)))
             for line in [head] + rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def register_cli(subparsers) -> None:
    p = subparsers.add_parser("plan", help="rank the ways to spread an attention diagram over devices")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--devices", type=int, required=True, metavar="P", help="how many GPUs")
    p.add_argument("--gpus-per-node", type=int, default=None, metavar="G",
                   help="GPUs per node (NVLink inside, InfiniBand across; default: all on one node)")
    p.add_argument("--device", "--profile", dest="device", default=None, metavar="NAME",
                   help="device profile: " + ", ".join(profile_names()) + " (default: the diagram's "
                        "'schedule on', else h100)")
    p.add_argument("--size", "-D", action="append", default=[], metavar="WIRE=N", dest="sizes",
                   help="size of a symbolic wire (repeatable)")
    p.add_argument("--forward", action="store_true", help="rank by forward time only (adds decoding's tree)")
    p.add_argument("--top", type=positive_int, default=10, metavar="N", help="how many options to print (default 10)")
    p.add_argument("--json", action="store_true", help="print every option as JSON")
    p.add_argument("--emit", default=None, metavar="OUT.ncd", help="write the diagram with the best option")
    add_docs_option(p)
    p.set_defaults(func=handler)


def handler(args) -> int:
    import napkin
    from .sizes import parse_pairs
    from .printer import to_text

    if args.emit and Path(args.emit).resolve() == Path(args.file).resolve():
        # the printer's text has no comments: the diagram would lose them, and its own placement
        raise NapkinError(f"--emit {args.emit} is the diagram itself, which the emitted one would replace; "
                          "write it to another file", filename=args.file)
    diagram = napkin.load(args.file)
    docs = Documents.parse(args.docs) if args.docs is not None else None
    try:
        options = plan(diagram, args.devices, parse_pairs(args.sizes, "--size"), args.gpus_per_node, args.device,
                       training=not args.forward, docs=docs)
    except NapkinError as err:
        raise err.with_source(args.file, napkin.read_source(args.file)) from None
    if args.json:
        print(json.dumps([dict(dataclasses.asdict(o), label=o.label, total_s=o.total_s) for o in options],
                         indent=2))
    else:
        g = min(args.gpus_per_node or args.devices, args.devices)
        print(f"{diagram.name} on {args.devices} x {profile_of(diagram, args.device)} ({g} per node), "
              f"{'forward' if args.forward else 'forward + backward'}; per device, busiest device")
        print(format_table(options, args.top))
    if args.emit:
        best = options[0]
        text = to_text(emit(diagram, best))
        emitted = napkin.load_text(text, args.emit)          # what is written must check
        try:
            write_atomic(Path(args.emit), text)
        except OSError as err:  # a folder that is a file, or missing, or not writable; --emit a folder
            raise NapkinError(f"cannot write {args.emit}: {why_not(err, Path(args.emit))}") from None
        note = " (run it with RingAttention(diagram, backward='burst'))" \
            if best.scheme in ("burst", "burst2") else ""
        out = sys.stderr if args.json else sys.stdout   # --json: stdout holds the JSON alone
        print(f"wrote {args.emit}: {best.label}{note}", file=out)
        placement = emitted_placement_note(best, emitted, parse_pairs(args.sizes, "--size"), args.device,
                                           training=not args.forward, docs=docs)
        if placement:
            print(f"note: {placement}", file=out)
    return 0
