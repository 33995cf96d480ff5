"""Ring Attention (Liu et al. 2023) on torch.distributed: napkin's baseline.

The query wire is grouped across the P devices of a ring and the key wire is
streamed around it.  Tokens are in the zigzag layout by default (device p
holds chunks p and 2P-1-p of 2P), which balances causal work.

Forward, on ring rank r: the key-side inputs (K, V) travel around the ring
in P-1 passes; at step s the device holds the keys of rank r-s, runs the same
local attention as ATTENTION2D on (its queries, those keys) and merges the
partial state into its running one with the same merge.  The next pass is
started before the step's computation and waited for after it, so transfer
and compute overlap.

Backward, ``backward="kv"`` (Ring's): K and V go round again (P-1 passes)
and their gradient accumulators dK, dV (accumulator dtype) follow them, one
pass per step and one more (P in all) to come home; dQ stays local.

Backward, ``backward="burst"`` (BurstAttention's): the query side goes round
instead: Q, dO and, for softmax diagrams, the merged lse and delta
(P-1 passes), followed by the accumulator dQ (P passes); K, V, dK and dV
stay put.  Per pass it moves h_q-sized rows (two of them plus two fp32
scalars) where Ring moves two h_kv-sized rows, so it sends less under
multi-head attention and more under grouped-query attention
(napkin/cost/collectives.py has the exact counts, which the tests check).

Topology-aware: a diagram with a nodes level (``level nodes { group q
across N; stream x across N }`` above ``level devices { ... across G }``)
runs a double ring (LoongTrain's double-ring attention): the P = N * G
steps are N rounds of G.  In a round the blocks go round the node's G GPUs
(NVLink) and, from the round's first step, the block a GPU started the
round with travels to the same GPU of the next node (InfiniBand), so each
InfiniBand pass has a whole round of compute to hide behind and only N-1 of
the P-1 passes cross nodes.  Accumulators follow their blocks round the node
(G-1 passes a round); where a round's chain ends, the previous node's sum for
the same block is added and the total hops to the next node (N-1 passes),
and a last hop (next node, next GPU) brings each home: P passes, N across
nodes.  A flat ring is the double ring of one node: the code is the same.

Cut short (reach.py): when the mask keeps only keys near their queries (a
sliding window, causal chunks) and the tokens are in the contiguous layout,
a flat ring runs only the S steps whose blocks hold a kept pair (``reach``):
the blocks make S - 1 passes, and an accumulator, once its chain of S
devices ends, hops straight home (S - 1 devices back) instead of going on
round.  BurstAttention's backward then runs the ring the other way, since a
query block needs the keys behind it.  At S = P this is the ring above.  A
document mask (``doc[b, q] == doc``) is cut by its ids (``id_meets``):
packed documents shorter than a shard reach a step or two.  A mask keeping
keys on both sides of a query (a window |q - x| < W) runs two such arms
(``arms``, ``_Arm``): ``back`` steps the usual way, then ``ahead`` steps the
other way round, whose first step (the device's own block) computes
nothing.  So does a zigzag ring under a mask of nearby keys or documents: a
rank's early chunk needs the ranks behind it, its late chunk (2P - 1 - r of
2P) the ranks ahead of it.

Either way an accumulator pass is started as soon as the step's share is
added and waited for only after the next step's computation, so it overlaps
that computation; the local backward is the same as ATTENTION2D's, given the
merged lse and delta of the query rows it is called with.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .. import ir
from ..documents import layout_chunks
from . import groups as G
from .commcount import phase
from .common import attention_side, handshake, results, save_and_show, saved_state, split_side, upstream_rows
from .layouts import TokenLayout
from .local import Roles, accumulator_dtype, default_backward, default_local, roles
from .merging import merge
from .reach import Meets, SameIds, ring_schedule, same_ids


_KEPT = 16   # reaches RingAttention keeps (RingAttention.reach)


class RingAttention:
    """Ring Attention for one diagram.

    >>> fn = RingAttention(napkin.load("examples/ring_attention.ncd"))
    >>> O, lse = fn(q, k, v, group=None, q_len=N)      # None: the default group

    Each rank passes its own rows in the ring's layout (``shard``).
    ``layout`` is "zigzag", "cyclic" or "contiguous": by default the one
    the diagram's mesh names (``stream x across 8 contiguous``), else zigzag.
    Under a mask that keeps only nearby keys (a window, causal chunks) or
    packed documents, a contiguous or zigzag ring stops after ``arms(...)``
    steps (both ways round where that is fewer).
    ``backward`` is "kv" (Ring's: K, V, dK, dV circulate) or "burst"
    (BurstAttention's: Q, dO, lse, delta, dQ circulate); the results are
    the same, the traffic is not (``napkin plan`` says which is cheaper).
    The choice is the wrapper's, not the diagram's: the schedule language
    describes where the forward's wires live, and both backwards compute
    the same gradients from the same placement.
    """

    def __init__(self, diagram: ir.Diagram, *, local: Optional[Callable] = None,
                 local_backward: Optional[Callable] = None, query_wire: Optional[str] = None,
                 key_wire: Optional[str] = None, layout: Optional[str] = None, backward: str = "kv"):
        if backward not in ("kv", "burst"):
            raise ValueError(f"backward must be 'kv' (Ring's) or 'burst' (BurstAttention's), not {backward!r}")
        self.roles: Roles = roles(diagram, query_wire, key_wire)
        self.local = local or default_local(self.roles)
        self.local_backward = local_backward or default_backward(self.local, self.roles)
        # the caller's layout, else the one the diagram's mesh names, else zigzag
        self.layout = layout or self.roles.layout or "zigzag"
        self.backward = backward
        self._reach: dict = {}

    @property
    def per_node(self) -> Optional[int]:
        """GPUs per node of the double ring (None: a flat ring): from the
        diagram's devices level under a nodes level that splits the ring."""
        nodes = self.roles.double_ring
        return None if nodes is None else nodes[1]

    @property
    def scheme(self) -> str:
        """The name napkin/cost/collectives.py knows this wrapper by."""
        return ("ring" if self.backward == "kv" else "burst") + ("2" if self.per_node else "")

    @property
    def ring_size(self) -> Optional[int]:
        s = self.roles.scheme
        return s[1][0] if s and s[0] == "ring" else None

    def layouts(self, parts: int, q_len: int, x_len: Optional[int] = None) -> tuple[TokenLayout, TokenLayout]:
        return TokenLayout(self.layout, parts, q_len), TokenLayout(self.layout, parts, q_len if x_len is None else x_len)

    def reach(self, parts: int, q_len: int, x_len: Optional[int] = None, side: Optional[dict] = None,
              prints: Optional[dict] = None) -> int:
        """The steps a ring running one way needs over ``parts`` ranks: all
        of them, or fewer where no rank's queries keep a key further back
        (reach.py).  ``side``: the side inputs, whole; where the mask
        compares ids (``doc[b, q] == doc``) their values are read too.  Kept
        per set of values (a crc32 of each, ``prints`` where the handshake
        has taken them), so a model's layers read one batch's ids once.  A
        double ring always runs every step."""
        return self._steps(parts, q_len, x_len, side, prints)[0]

    def arms(self, parts: int, q_len: int, x_len: Optional[int] = None, side: Optional[dict] = None,
             prints: Optional[dict] = None) -> tuple[int, int]:
        """The steps the ring runs: (back, ahead), ``back`` the usual way
        (its own block included) and ``ahead`` the other way, where a mask
        keeps keys on both sides of its queries (a window |q - x| < W) and
        both ways are fewer steps in all (reach.ring_schedule); (reach, 0)
        otherwise.  ``side``, ``prints``: as ``reach``."""
        return self._steps(parts, q_len, x_len, side, prints)[1]

    def _steps(self, parts, q_len, x_len, side, prints) -> tuple[int, tuple[int, int]]:
        if self.per_node is not None:
            return parts, (parts, 0)
        x_len = q_len if x_len is None else x_len
        same = same_ids(self.roles) if side is not None else ()
        key: tuple = (parts, q_len, x_len)
        if same:
            prints = prints or {}
            key += tuple((n, tuple(side[n].shape), str(side[n].dtype),
                          prints[n] if n in prints else G.fingerprint(side[n]))
                         for n in dict.fromkeys(s.name for s in same))
        if key not in self._reach:
            if len(self._reach) >= _KEPT:       # a batch's ids each: keep the latest few
                self._reach.pop(next(iter(self._reach)))
            ql, xl = self.layouts(parts, q_len, x_len)
            meets = id_meets(same, side, ql, xl) if same else None
            self._reach[key] = ring_schedule(self.roles, self.layout, parts, q_len, x_len, meets)
        return self._reach[key]

    def __call__(self, *tokens, group=None, q_len: int, x_len: Optional[int] = None,
                 timeout: float = G.DEFAULT_TIMEOUT, **side):
        ring = G.as_double_ring(group, self.per_node)
        if self.ring_size is not None and self.ring_size != ring.size:
            raise ValueError(f"the diagram asks for a ring of {self.ring_size}, got {ring.size} ranks")
        side = split_side(self.roles, side, tokens)
        whole, side = side, attention_side(self.roles, side)
        ql, xl = self.layouts(ring.size, q_len, x_len)
        prints = handshake(self.roles, self.scheme, tokens, whole, ql, xl, (ring.group,), timeout,
                           lambda p: f"ring rank {p}")
        back, ahead = self.arms(ring.size, q_len, x_len, side, prints)   # side inputs agree on every rank
        arms = [_Arm(ring, ring)]
        if back + ahead < ring.size:
            # the key blocks come from behind (their queries' blocks go the other way, Burst's),
            # then from ahead
            arms = [_Arm(G.as_double_ring(group, steps=back), G.as_double_ring(group, steps=back, direction=-1))]
            if ahead:
                arms.append(_Arm(G.as_double_ring(group, steps=ahead + 1, direction=-1),
                                 G.as_double_ring(group, steps=ahead + 1), own=False))
        outs = _Function.apply(_Call(self, arms, ql, xl, timeout, side), *tokens)
        return results(self.roles, outs[0], outs[1] if len(outs) > 1 else None, whole,
                       ql.positions(ring.rank) < q_len)

    def shard(self, full: torch.Tensor, group, length: int, dim: int) -> torch.Tensor:
        ring = G.as_ring(group)
        return TokenLayout(self.layout, ring.size, length).shard(full, ring.rank, dim)

    def gather(self, local: torch.Tensor, group, length: int, dim: int,
               timeout: float = G.DEFAULT_TIMEOUT) -> torch.Tensor:
        ring = G.as_ring(group)
        lay = TokenLayout(self.layout, ring.size, length)
        x = G.all_gather_rows(local, dim, ring.group, timeout, "rows for gather (ring)")
        return lay.unshard(list(x.chunk(ring.size, dim)), dim)


def id_meets(same: tuple[SameIds, ...], side: dict, ql: TokenLayout, xl: TokenLayout) -> Meets:
    """reach.Meets from the ids themselves: whether unit u's queries and unit
    v's keys share an id at some batch index, for every conjunct of ``same``
    (the units are reach.py's: a contiguous or zigzag layout's chunks,
    documents.layout_chunks, or cyclic's ranks).  Each unit's ids become a
    set once (O(N log N)), and one join of the sets on the ids answers every
    pair: its size is the (query unit, key unit) pairs each id joins, a few
    an id for packed documents."""
    units = _units(ql), _units(xl)
    met = torch.ones(len(units[0]), len(units[1]), dtype=torch.bool)
    for s in same:
        # on the host: the sets are small (a shard's documents) and a device would wait on
        # them; the handshake has copied these values to the host already
        ids = side[s.name].detach().cpu()
        ids = ids.movedim(s.axis, -1).reshape(-1, ids.shape[s.axis])          # (batch, tokens)
        # one integer per (batch index, id): the ids renumbered 0 .. U-1, offset by U a batch row
        values, dense = torch.unique(ids, return_inverse=True)
        keys = dense + torch.arange(ids.shape[0])[:, None] * max(values.numel(), 1)
        (qu, qk), (xu, xk) = (_unit_ids(keys, pos) for pos in units)
        order = torch.argsort(xk)
        xu, xk = xu[order], xk[order]
        # each query (unit, id) against the key units holding that id: a run of the sorted keys
        lo, hi = torch.searchsorted(xk, qk), torch.searchsorted(xk, qk, right=True)
        n = hi - lo
        at = torch.arange(int(n.sum())) + torch.repeat_interleave(lo - (torch.cumsum(n, 0) - n), n)
        both = torch.zeros_like(met)
        both[torch.repeat_interleave(qu, n), xu[at]] = True
        met &= both
    table = met.tolist()
    return lambda u, v: table[u][v]


def _units(lay: TokenLayout) -> list[torch.Tensor]:
    """The positions of each of reach.py's units: a contiguous or zigzag
    layout's chunks, a cyclic layout's ranks (real tokens only)."""
    if lay.kind == "cyclic":
        return [p[p < lay.length] for p in (lay.positions(r) for r in range(lay.parts))]
    return [torch.arange(a, b) for _, a, b in layout_chunks(lay.kind, lay.parts, lay.length)]


def _unit_ids(keys: torch.Tensor, units: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(unit, id) for every id each unit (its positions) holds, once: two
    flat tensors."""
    sets = [torch.unique(keys[:, p]) for p in units]
    units = torch.cat([torch.full((len(u),), k, dtype=torch.int64) for k, u in enumerate(sets)])
    return units, torch.cat(sets)


class _Arm:
    """One way round: ``ring`` carries the key blocks (the forward, Ring's
    backward), ``query_ring`` the query blocks (BurstAttention's backward);
    they differ only in a ring cut short.  ``own`` False: the arm's first
    step, the device's own blocks, was the other arm's (nothing computed;
    its accumulators start at zero)."""

    def __init__(self, ring: G.DoubleRing, query_ring: G.DoubleRing, own: bool = True):
        self.ring, self.query_ring, self.own = ring, query_ring, own

    def computes(self, step: int) -> bool:
        return self.own or step > 0


class _Call:
    """One call's schedule: its arms (one; two where the ring runs both
    ways), the layouts and the side inputs."""

    def __init__(self, fn: RingAttention, arms: list[_Arm], ql: TokenLayout, xl: TokenLayout, timeout, side):
        self.fn, self.arms = fn, arms
        self.ql, self.xl, self.timeout, self.side = ql, xl, timeout, side
        self.my_q = ql.positions(arms[0].ring.rank)

    def x_pos(self, arm: _Arm, step: int) -> torch.Tensor:
        """Positions of the keys held at ``step`` of ``arm`` (a flat ring:
        those of rank r - step, or r + step the other way)."""
        return self.xl.positions(arm.ring.origin(step))

    def lens(self):
        return dict(q_len=self.ql.length, x_len=self.xl.length)


def _assemble(r: Roles, tokens, keys):
    """Token inputs in declaration order: local queries, travelling keys."""
    it = iter(keys)
    return [t if r.is_query(k) else next(it) for k, t in enumerate(tokens)]


class _Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call: _Call, *tokens):
        r = call.fn.roles
        keys = [t for k, t in enumerate(tokens) if not r.is_query(k)]
        names = ", ".join(n for k, n in enumerate(r.tokens) if not r.is_query(k))
        out = lse = None
        with phase("forward"):
            for arm in call.arms:
                for step, held in _visit(arm.ring, keys, call.timeout, names):
                    if not arm.computes(step):
                        continue
                    o, l = call.fn.local(*_assemble(r, tokens, held), q_pos=call.my_q, x_pos=call.x_pos(arm, step),
                                         **call.lens(), **call.side)
                    if out is None:
                        out, lse = o, l
                    else:
                        out, lse = merge([out, o], None if l is None else [lse, l])
        return save_and_show(ctx, call, tokens, out, lse)

    @staticmethod
    def backward(ctx, *grads):
        call = ctx.call
        r = call.fn.roles
        tokens, out, lse = saved_state(ctx, len(r.tokens))
        dO, delta = upstream_rows(call, grads, tokens, out, lse)
        with phase("backward"):
            if call.fn.backward == "kv":
                grads_out = _backward_kv(call, tokens, dO, lse, delta)
            else:
                grads_out = _backward_burst(call, tokens, dO, lse, delta)
        return (None, *[g.to(t.dtype) for g, t in zip(grads_out, tokens)])


def _visit(ring: G.DoubleRing, blocks: list[torch.Tensor], timeout: float, what: str):
    """Yield (step, the blocks held at that step) for the steps of the
    (double) ring (P, or fewer where it is cut short).  Each pass is started
    before the step's computation (the consumer's work between two yields)
    and waited for after it; a round's outer pass is started before its
    first step and waited for after its last, so it overlaps the whole
    round."""
    n = ring.nodes
    for o in range(n):
        outer = G.RingPass(blocks, ring.outer, timeout, f"{what} (to the next node)",
                           first_tag=2 * G.MAX_TENSORS) if o < n - 1 else None
        held = blocks
        for i in range(ring.round):
            inner = G.RingPass(held, ring.inner, timeout, what) if i < ring.round - 1 else None
            yield o * ring.per_node + i, held
            if inner is not None:
                held = inner.wait()
        if outer is not None:
            blocks = outer.wait()


class _Accumulators:
    """Gradient accumulators that follow their blocks round the (double) ring.

    At step i of a round the device adds its share to the accumulator of the
    block it holds, which arrived from the previous GPU of the node during
    the step's computation, and sends the sum on.  Where a round's chain
    ends (its last step) the GPU adds what the previous node summed for the
    same block, which has had the whole round to arrive, and sends the total
    to the same GPU of the next node; after the last round the ``home`` hop
    (next node, next GPU) brings every accumulator to the GPU its block
    lives on.  On a flat ring (one node) that is the plain ring's chain and
    its last pass home; on a ring cut short, the hop straight home."""

    def __init__(self, ring: G.DoubleRing, timeout: float, what: str):
        self.ring, self.timeout, self.what = ring, timeout, what
        self.inner: Optional[G.RingPass] = None      # this round's chain, on its way round the node
        self.outer: Optional[G.RingPass] = None      # a round's totals, on their way to the next node
        self.single: Optional[list[torch.Tensor]] = None    # a ring of one: nothing moves

    def add(self, step: int, share: list[torch.Tensor]) -> None:
        ring = self.ring
        o, i = divmod(step, ring.per_node)
        acc = share if i == 0 else [a + b for a, b in zip(self.inner.wait(), share)]
        if i < ring.round - 1:
            self.inner = G.RingPass(acc, ring.inner, self.timeout, self.what, first_tag=G.MAX_TENSORS)
            return
        if self.outer is not None:
            acc = [a + b for a, b in zip(self.outer.wait(), acc)]
        if ring.nodes == 1 and ring.round == 1:     # one step: every block stayed home
            self.single = acc
            return
        last = o == ring.nodes - 1
        self.outer = G.RingPass(acc, ring.home if last else ring.outer, self.timeout,
                                f"{self.what} ({'home' if last else 'to the next node'})",
                                first_tag=3 * G.MAX_TENSORS)

    def home(self) -> list[torch.Tensor]:
        return self.single if self.single is not None else self.outer.wait()


def _zeros(blocks, tokens) -> list[torch.Tensor]:
    """An accumulator's start where an arm computes nothing at its first step."""
    return [torch.zeros_like(t, dtype=accumulator_dtype(*tokens)) for t in blocks]


def _added(total, share):
    return share if total is None else [a + b for a, b in zip(total, share)]


def _backward_kv(call: _Call, tokens, dO, lse, delta) -> list[torch.Tensor]:
    """Ring's backward: K, V and their accumulators dK, dV circulate, arm
    after arm, each accumulator home before the next arm starts."""
    r = call.fn.roles
    keys = [t for k, t in enumerate(tokens) if not r.is_query(k)]
    knames = ", ".join(nm for k, nm in enumerate(r.tokens) if not r.is_query(k))
    dq = dk = None
    for arm in call.arms:
        acc = _Accumulators(arm.ring, call.timeout, f"gradients of {knames}")
        for step, held in _visit(arm.ring, keys, call.timeout, knames):
            if not arm.computes(step):
                acc.add(step, _zeros(held, tokens))
                continue
            parts = call.fn.local_backward(*_assemble(r, tokens, held), q_pos=call.my_q,
                                           x_pos=call.x_pos(arm, step), **call.lens(), dO=dO, lse=lse,
                                           delta=delta, **call.side)
            dq = _added(dq, [p for k, p in enumerate(parts) if r.is_query(k)])
            acc.add(step, [p for k, p in enumerate(parts) if not r.is_query(k)])
        dk = _added(dk, acc.home())
    iq, ik = iter(dq), iter(dk)
    return [next(iq) if r.is_query(k) else next(ik) for k in range(len(tokens))]


def _backward_burst(call: _Call, tokens, dO, lse, delta) -> list[torch.Tensor]:
    """BurstAttention's backward: the query side (Q, dO, lse, delta) and its
    accumulator dQ circulate; K, V stay and dK, dV accumulate locally.  At
    each step the device holds the query rows of ``ring.origin(step)``."""
    r = call.fn.roles
    bundle = [t for k, t in enumerate(tokens) if r.is_query(k)] + [dO]
    if lse is not None:
        bundle += [lse, delta]
    nq = len(bundle) - (3 if lse is not None else 1)
    qnames = ", ".join(nm for k, nm in enumerate(r.tokens) if r.is_query(k))
    what = f"{qnames}, dO" + (", lse, delta" if lse is not None else "")
    my_x = call.xl.positions(call.arms[0].ring.rank)
    dkeys = dq = None
    for arm in call.arms:
        ring = arm.query_ring
        acc = _Accumulators(ring, call.timeout, f"gradients of {qnames}")
        for step, held in _visit(ring, bundle, call.timeout, what):
            if not arm.computes(step):
                acc.add(step, _zeros(held[:nq], tokens))
                continue
            it = iter(held[:nq])
            args = [next(it) if r.is_query(k) else t for k, t in enumerate(tokens)]
            parts = call.fn.local_backward(*args, q_pos=call.ql.positions(ring.origin(step)), x_pos=my_x,
                                           **call.lens(), dO=held[nq],
                                           lse=held[nq + 1] if lse is not None else None,
                                           delta=held[nq + 2] if lse is not None else None, **call.side)
            dkeys = _added(dkeys, [p for k, p in enumerate(parts) if not r.is_query(k)])
            acc.add(step, [p for k, p in enumerate(parts) if r.is_query(k)])
        dq = _added(dq, acc.home())
    iq, ik = iter(dq), iter(dkeys)
    return [next(iq) if r.is_query(k) else next(ik) for k in range(len(tokens))]
