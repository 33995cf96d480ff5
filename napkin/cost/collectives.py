"""What napkin's distributed schemes send, device by device and link by link.

This is the one model of communication across devices.  The cost pass
(devices.py), ``napkin plan``, ``napkin.distributed.predicted_comm`` and the
tables in docs/ all read it, and the multi-process tests prove it against
the communication counter, byte for byte, on every rank.  Pure arithmetic:
no torch.

The schemes (napkin/distributed/ runs each one):

* ``attention2d``: an R x C grid, tokens dealt cyclically over all P = R*C
  devices.  Forward: all-gather Q along the row, K and V along the column,
  all-to-all of the partial states (O, lse) along the row.  Backward:
  all-gather Q, dO, lse, delta along the row and K, V along the column;
  reduce-scatter dQ along the row, dK and dV along the column.
* ``ring``: a ring of P, zigzag layout.  K and V pass round the ring (P-1
  passes); backward: K, V again and their gradient accumulators dK, dV
  (P passes: one more brings them home).
* ``burst``: the same forward, BurstAttention's backward: the query side
  (Q, dO, lse, delta) passes round the ring while K, V stay put, and the
  accumulator dQ follows it (P passes).  It moves h_q-sized rows where Ring
  moves h_kv-sized ones, so it wins under multi-head attention and loses
  under grouped-query attention.
* ``ring2`` and ``burst2``: the same two backwards on a double ring (a
  topology-aware, two-level ring; LoongTrain's double-ring attention) over
  N nodes of G GPUs, grid (N, G), rank n*G + l.  Blocks go round each node's
  inner ring of G over NVLink (G-1 passes a round); at the start of each of
  the N rounds every GPU also sends the block it started the round with to
  the same GPU of the next node over InfiniBand (N-1 passes), hidden behind
  the whole round's G compute steps.  The accumulators follow their blocks
  round the node (G-1 inner passes a round); where a round's chain ends the
  GPU adds what the previous node summed for the same block and sends the
  total to the same GPU of the next node (N-1 outer passes), and after the
  last round one ``home`` pass (to the next GPU of the next node) brings
  every accumulator home.  The bytes are a flat ring's; only N-1 of the P-1
  block passes and N of the P accumulator passes cross nodes.
* ``tree``: decoding.  Every device holds every query; the keys are dealt
  contiguously; the partial states (O, lse) are merged by a butterfly
  (recursive doubling): log2 P rounds, each an exchange with the partner
  whose part differs in one bit.  With P not a power of two the extra
  devices first fold their state into a partner and get the result back at
  the end.

Byte counts follow the direct-exchange model of the counter
(napkin/distributed/commcount.py): an all-gather among k devices sends each
peer one block; an all-to-all or reduce-scatter sends each peer its block; a
ring pass sends one block to the next device.  Partial states, lse, delta
and gradient accumulators travel in fp32 (fp64 for fp64 inputs): ``state``.

Every collective is a ``Term``: ``steps`` blocks of ``nbytes``.  A
``collective`` term sends one block to each of its ``steps`` peers; a
``pass`` term sends all of its ``steps`` blocks to one peer in a row.
``Placement`` puts the scheme's parts on global ranks and nodes, so each
block is known to cross NVLink (within a node) or InfiniBand (across).
"""
from __future__ import annotations

import collections
import functools
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

SCHEMES = ("attention2d", "ring", "burst", "ring2", "burst2", "tree")
RINGS = ("ring", "burst", "ring2", "burst2")
TWO_D = ("attention2d", "ring2", "burst2")   # schemes whose grid has two numbers
PHASES = ("check", "forward", "backward")

# The shape handshake: one int64 vector per rank (napkin/distributed/groups.py,
# META_LEN = 5 + 8 * (4 + 5) = 77 entries).
META_BYTES = 8 * 77

ELEMENT_BYTES = {"fp64": 8, "fp32": 4, "fp16": 2, "bf16": 2}


def ceil_div(a, b: int):
    """ceil(a / b); ``a`` may be a symbol with a ``ceil_div`` method (the cost
    pass runs these formulas on wire names to print them)."""
    if hasattr(a, "ceil_div"):
        return a.ceil_div(b)
    return -(-a // b)


def state_bytes(dtype: str) -> int:
    """Partial states travel in fp64 when the inputs are fp64, else in fp32."""
    return 8 if dtype == "fp64" else 4


# --------------------------------------------------------------------------
# What moves: widths per token row.
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class Moved:
    """The tensors a scheme moves, as elements per token row.

    query / keys: (elements per row, bytes per element) of each token input
    along the query / key wire (Q; K and V).  out: elements of O per query
    row; out_bytes: O's element size as the caller sees it (dO travels so).
    stats: elements of lse per query row (0 for the sum family, which has no
    lse).  state: bytes per element of partial states and accumulators.
    Ring schemes only: ``layout``, the token layout (None: zigzag, the
    default), ``reach``, the steps a flat ring runs where its mask lets
    it stop early (napkin/distributed/reach.py; None: every step), and
    ``ahead``, the steps it then runs the other way round (reach.ring_arms:
    a mask keeping keys on both sides of its queries; 0: none).
    """

    q_len: int
    x_len: int
    query: tuple[tuple[int, int], ...]
    keys: tuple[tuple[int, int], ...]
    out: int
    out_bytes: int
    stats: int
    state: int
    layout: Optional[str] = None
    reach: Optional[int] = None
    ahead: int = 0

    @classmethod
    def attention(cls, sizes: Mapping[str, int], dtype: str, family: str = "softmax") -> "Moved":
        """Q, K, V of ``b`` batches, ``hq`` query heads, ``hkv`` key/value
        heads of dimension ``d``; ``q`` query tokens, ``x`` keys (default q)."""
        e = ELEMENT_BYTES[dtype]
        b, hq, hkv, d = sizes["b"], sizes["hq"], sizes["hkv"], sizes["d"]
        return cls(sizes["q"], sizes.get("x", sizes["q"]), ((b * hq * d, e),), ((b * hkv * d, e),) * 2,
                   b * hq * d, e, b * hq if family == "softmax" else 0, state_bytes(dtype))

    # bytes per row of the bundles the schemes move
    @property
    def query_row(self) -> int:
        return sum(w * e for w, e in self.query)

    @property
    def key_row(self) -> int:
        return sum(w * e for w, e in self.keys)

    @property
    def backward_query_row(self) -> int:
        """Q, dO and (softmax) lse and delta: what the backward needs per query row."""
        return self.query_row + self.out * self.out_bytes + 2 * self.stats * self.state

    @property
    def state_row(self) -> int:
        """A partial state (O, lse) per query row."""
        return (self.out + self.stats) * self.state


def layout_rows(scheme: str, parts: int, length: int, layout: Optional[str] = None) -> int:
    """Rows every part holds, padding included: zigzag for the ring schemes
    (2P chunks, two each) unless ``layout`` says otherwise, cyclic for
    ATTENTION2D, contiguous for the tree's keys."""
    if scheme in RINGS and layout in (None, "zigzag"):
        return 2 * ceil_div(length, 2 * parts)
    return ceil_div(length, parts)


# --------------------------------------------------------------------------
# Terms.
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class Term:
    """One collective of a call, for one part: ``steps`` blocks of ``nbytes``.

    kind "collective": one block to each of ``steps`` peers (and one from
    each); "pass": all ``steps`` blocks to one peer and from another.
    ``sends`` / ``receives``: whether this part sends / receives (the tree's
    fold and unfold go one way)."""

    what: str
    group: str          # "row", "column", "ring", "ring reversed", "inner", "outer", "home", "home K" (a short
                        # ring's hop home, to part + K), "all", "fold", "unfold", "round K"
    kind: str
    steps: int
    nbytes: int
    sends: bool = True
    receives: bool = True

    @property
    def total(self) -> int:
        return self.steps * self.nbytes


def parts_of(scheme: str, grid: Sequence[int]) -> int:
    return grid[0] * grid[1] if scheme in TWO_D else grid[0]


def _grid(scheme: str, grid) -> tuple[int, ...]:
    grid = (grid,) if isinstance(grid, int) else tuple(grid)
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; expected one of {', '.join(SCHEMES)}")
    if len(grid) != (2 if scheme in TWO_D else 1) or min(grid) < 1:
        raise ValueError(f"bad grid {grid} for {scheme}")
    return grid


def terms(scheme: str, grid, moved: Moved, phase: str = "forward", part: int = 0) -> list[Term]:
    """The collectives part ``part`` of the scheme runs in one call's phase
    ("check": the shape handshake before the forward; "forward";
    "backward").  Terms with no steps are left out."""
    grid = _grid(scheme, grid)
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}; expected one of {', '.join(PHASES)}")
    m = moved
    if scheme == "attention2d":
        r, c = grid
        p = r * c
        nq, nx = ceil_div(m.q_len, p), ceil_div(m.x_len, p)
        if phase == "check":
            out = [Term("shapes", "row", "collective", c - 1, META_BYTES),
                   Term("shapes", "column", "collective", r - 1, c * META_BYTES)]
        elif phase == "forward":
            out = [Term("Q", "row", "collective", c - 1, nq * m.query_row),
                   Term("K, V", "column", "collective", r - 1, nx * m.key_row),
                   Term("partial states", "row", "collective", c - 1, nq * m.state_row)]
        else:
            out = [Term("Q, dO" + (", lse, delta" if m.stats else ""), "row", "collective", c - 1,
                        nq * m.backward_query_row),
                   Term("K, V", "column", "collective", r - 1, nx * m.key_row),
                   Term("dQ (reduce-scatter)", "row", "collective", c - 1,
                        nq * sum(w for w, _ in m.query) * m.state),
                   Term("dK, dV (reduce-scatter)", "column", "collective", r - 1,
                        nx * sum(w for w, _ in m.keys) * m.state)]
    elif scheme in RINGS:
        # a flat ring of P is a double ring of one node: every pass is inner
        n, g = grid if scheme in TWO_D else (1, grid[0])
        inner, outer = ("inner", "outer") if scheme in TWO_D else ("ring", "ring")
        p = n * g
        nq, nx = layout_rows(scheme, p, m.q_len, m.layout), layout_rows(scheme, p, m.x_len, m.layout)
        s = ring_steps(scheme, grid, m) - m.ahead      # the steps the usual way round
        if scheme in ("ring", "ring2"):
            blocks, block = "K, V", nx * m.key_row
            acc, acc_block = "dK, dV", nx * sum(w for w, _ in m.keys) * m.state
        else:
            blocks, block = "Q, dO" + (", lse, delta" if m.stats else ""), nq * m.backward_query_row
            acc, acc_block = "dQ", nq * sum(w for w, _ in m.query) * m.state
        if phase == "check":
            out = [Term("shapes", "all", "collective", p - 1, META_BYTES)]
        elif s < p:
            # a flat ring cut to s steps (napkin/distributed/ring.py): the blocks make s - 1 passes;
            # an accumulator's chain makes s - 1 and then hops straight home, s - 1 devices back
            # ("home K": to part + K); BurstAttention's backward runs the ring the other way round
            # ("ring reversed", home s - 1 devices ahead); one step moves nothing
            # ("ring reversed", home s - 1 devices ahead); one step moves nothing.  A ring run both
            # ways then runs ``ahead`` more steps the other way round, its accumulators home ahead the
            # other way too (its first step, the device's own block, is the first arm's: its chains
            # start at zero and make the same passes)
            out = []
            for steps, turn in ((s, 1), (m.ahead + 1, -1)):
                way = ("ring" if (scheme == "ring") == (turn == 1) else "ring reversed")
                home = f"home {turn * (1 - steps) if scheme == 'ring' else turn * (steps - 1)}"
                key_way = "ring" if turn == 1 else "ring reversed"
                out += [Term("K, V", key_way, "pass", steps - 1, nx * m.key_row)] if phase == "forward" else [
                    Term(blocks, way, "pass", steps - 1, block), Term(acc, way, "pass", steps - 1, acc_block),
                    Term(acc, home, "pass", 1 if steps > 1 else 0, acc_block)]
        elif phase == "forward":
            out = [Term("K, V", inner, "pass", n * (g - 1), nx * m.key_row),
                   Term("K, V", outer, "pass", n - 1, nx * m.key_row)]
        else:
            out = [Term(blocks, inner, "pass", n * (g - 1), block),
                   Term(blocks, outer, "pass", n - 1, block)]
            if scheme in TWO_D:
                out += [Term(acc, "inner", "pass", n * (g - 1), acc_block),
                        Term(acc, "outer", "pass", n - 1, acc_block),
                        Term(acc, "home", "pass", 1, acc_block)]
            else:
                out.append(Term(acc, "ring", "pass", p if p > 1 else 0, acc_block))
    else:
        out = _tree_terms(grid[0], m, phase, part)
    return [t for t in out if t.steps > 0]


@dataclass(frozen=True)
class PartTerms:
    """The terms of every part of a scheme's phase, held once per role.
    Only a tree's parts have more than one role (its extra devices fold in,
    their partners take the fold); the other schemes' parts share one list,
    built once, not once a part: at 2^16 devices that was a third of the
    cost pass's time."""

    lists: tuple[tuple[Term, ...], ...]     # the terms of each role
    roles: Sequence[int]                     # the role of every part, in part order

    def __call__(self, part: int) -> tuple[Term, ...]:
        return self.lists[self.roles[part]]


def terms_by_part(scheme: str, grid, moved: Moved, phase: str) -> PartTerms:
    """part -> terms(scheme, grid, moved, phase, part), for every part."""
    grid = _grid(scheme, grid)
    firsts, roles = _roles(scheme, parts_of(scheme, grid))
    return PartTerms(tuple(tuple(terms(scheme, grid, moved, phase, first)) for first in firsts), roles)


def ring_steps(scheme: str, grid, moved: Moved) -> int:
    """The steps a ring scheme runs: P, or ``moved.reach`` (and
    ``moved.ahead`` the other way) for a flat ring its mask cuts short."""
    grid = _grid(scheme, grid)
    p = parts_of(scheme, grid)
    if (moved.reach is None or moved.reach == p) and not moved.ahead:
        return p
    back = p if moved.reach is None else moved.reach
    if scheme not in ("ring", "burst") or not 1 <= back <= p or not 0 <= moved.ahead <= p - back:
        raise ValueError(f"a reach of {back} steps ({moved.ahead} the other way) applies to a flat ring of at "
                         f"least as many ranks, not {scheme} {grid}")
    return back + moved.ahead


def _roles(scheme: str, p: int) -> tuple[tuple[int, ...], list[int]]:
    """The first part of each role, and the role of every part.  A tree's
    parts (P not a power of two) are the partners of the extra devices (part
    < P - low, low the largest power of two <= P), the rest below low, and the
    extra devices, which fold in; every other part of every scheme is alike."""
    low = 1 << (p.bit_length() - 1)
    if scheme != "tree" or p == low:
        return (0,), [0] * p
    return (0, p - low, low), [0] * (p - low) + [1] * (2 * low - p) + [2] * (p - low)


def _tree_terms(p: int, m: Moved, phase: str, part: int) -> list[Term]:
    if phase == "check":
        return [Term("shapes", "all", "collective", p - 1, META_BYTES)]
    if phase == "backward":
        return []                      # decoding is forward only
    state = m.q_len * m.state_row
    low = 1 << (p.bit_length() - 1)    # the largest power of two <= p
    out = []
    if part >= low:                    # an extra device: fold in, wait for the result
        return [Term("partial state (fold)", "fold", "pass", 1, state, receives=False),
                Term("merged state (unfold)", "unfold", "pass", 1, state, sends=False)]
    if part < p - low:
        out.append(Term("partial state (fold)", "fold", "pass", 1, state, sends=False))
    for k in range(low.bit_length() - 1):
        out.append(Term(f"partial states (round {k})", f"round {k}", "pass", 1, state))
    if part < p - low:
        out.append(Term("merged state (unfold)", "unfold", "pass", 1, state, receives=False))
    return out


def rank_bytes(scheme: str, grid, moved: Moved, phase: str = "forward") -> list[tuple[int, int]]:
    """(bytes sent, bytes received) of every part, in part order."""
    by_part = terms_by_part(scheme, grid, moved, phase)
    sums = [(sum(t.total for t in ts if t.sends), sum(t.total for t in ts if t.receives)) for ts in by_part.lists]
    return [sums[role] for role in by_part.roles]


# --------------------------------------------------------------------------
# Placement: parts on ranks, ranks on nodes, peers.
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class Placement:
    """Where a scheme's parts run.

    Parts are the scheme's own order (grid part i*C + j, ring or tree
    position).  ``gpus_per_node`` G (None: all on one node).  Without
    ``block``, part p runs on global rank p and ranks fill nodes in order.
    ATTENTION2D with ``block = (DR, DC)``: every node holds a DR x DC block
    of the grid (DR * DC = G), nodes in row-major order over the grid of
    blocks, ranks row-major inside a node.  DC = C puts whole grid rows
    inside nodes (rows on NVLink, columns across nodes)."""

    scheme: str
    grid: tuple[int, ...]
    gpus_per_node: Optional[int] = None
    block: Optional[tuple[int, int]] = None

    def __post_init__(self):
        object.__setattr__(self, "grid", _grid(self.scheme, self.grid))
        g = self.gpus_per_node
        if g is not None and g < 1:
            raise ValueError(f"gpus per node must be positive, not {g}")
        if self.scheme in ("ring2", "burst2"):
            # a double ring's grid is (nodes, GPUs per node): it places itself
            if g is not None and g != self.grid[1]:
                raise ValueError(f"a double ring of {self.grid[0]} x {self.grid[1]} needs {self.grid[1]} GPUs "
                                 f"per node, not {g}")
            object.__setattr__(self, "gpus_per_node", self.grid[1])
        if self.block is not None:
            dr, dc = self.block
            r, c = self.grid
            if self.scheme != "attention2d" or r % dr or c % dc:
                raise ValueError(f"a {dr} x {dc} block does not tile the {self.grid} grid of {self.scheme}")
            if g is not None and g != dr * dc:
                raise ValueError(f"a {dr} x {dc} block per node needs {dr * dc} GPUs per node, not {g}")
            object.__setattr__(self, "gpus_per_node", dr * dc)

    @property
    def parts(self) -> int:
        return parts_of(self.scheme, self.grid)

    def rank(self, part: int) -> int:
        """The global rank part ``part`` runs on."""
        if self.block is None:
            return part
        r, c = self.grid
        dr, dc = self.block
        i, j = divmod(part, c)
        node = (i // dr) * (c // dc) + j // dc
        return node * dr * dc + (i % dr) * dc + j % dc

    def ranks(self) -> list[int]:
        return [self.rank(p) for p in range(self.parts)]

    def node(self, part: int) -> int:
        g = self.gpus_per_node
        return 0 if g is None else self.rank(part) // g

    def nodes(self) -> list[int]:
        """node(part) of every part, in part order."""
        g = self.gpus_per_node
        if g is None:
            return [0] * self.parts
        if self.block is None:
            return [part // g for part in range(self.parts)]
        return [self.rank(part) // g for part in range(self.parts)]

    def peers(self, group: str, part: int) -> list[int]:
        """The parts ``part`` sends a block to in a term of ``group``."""
        if group in _MEMBER_GROUPS:
            p = self.parts
            if group == "all":
                return [q for q in range(p) if q != part]
            r, c = self.grid
            i, j = divmod(part, c)
            if group == "row":
                return [i * c + jj for jj in range(c) if jj != j]
            return [ii * c + j for ii in range(r) if ii != i]
        return [self.peer(group, True)(part)]

    def senders(self, group: str, part: int) -> list[int]:
        """The parts ``part`` receives a block from (a ring receives from the
        previous device; every other group is symmetric)."""
        if group in _MEMBER_GROUPS:
            return self.peers(group, part)
        return [self.peer(group, False)(part)]

    def peer(self, group: str, sending: bool) -> Callable[[int], int]:
        """part -> the one part it sends to (receives from) in a pass group.
        A function, so that the cost pass can map it over every part."""
        p = self.parts
        if group in ("ring", "ring reversed") or group.startswith("home "):
            # the flat ring, the other way round, or a short ring's hop home (to part + K)
            k = 1 if group == "ring" else -1 if group == "ring reversed" else int(group.split()[1])
            k = k if sending else -k
            return lambda q: (q + k) % p
        if group in ("inner", "outer", "home"):
            n, g = self.grid
            dn, dl = {"inner": (0, 1), "outer": (1, 0), "home": (1, 1)}[group]
            if not sending:
                dn, dl = -dn, -dl
            return lambda q: (q // g + dn) % n * g + (q % g + dl) % g
        low = 1 << (p.bit_length() - 1)
        if group in ("fold", "unfold"):
            return lambda q: q - low if q >= low else q + low
        if group.startswith("round "):
            bit = 1 << int(group.split()[1])
            return lambda q: q ^ bit
        raise ValueError(f"unknown group {group!r}")


def link_bytes(term: Term, placement: Placement, part: int, sending: bool = True) -> tuple[int, int]:
    """(bytes within the node, bytes across nodes) that ``part`` sends (or
    receives) in ``term``."""
    if not (term.sends if sending else term.receives):
        return 0, 0
    per_peer = term.nbytes if term.kind == "collective" else term.total
    if term.group in _MEMBER_GROUPS:   # symmetric: peers = the part's row, column or all, less itself
        within, peers = _members_near(placement, term.group, part)
        return within * per_peer, (peers - within) * per_peer
    peers = placement.peers(term.group, part) if sending else placement.senders(term.group, part)
    home = placement.node(part)
    inter = sum(1 for q in peers if placement.node(q) != home)
    return (len(peers) - inter) * per_peer, inter * per_peer


# Groups whose peers are every other member of a set (the grid's row, its column, all parts).
# Listed peer by peer, every part's terms cost O(parts): the cost pass and the picture of a
# 2048 x 2 grid took 20 s and more, quadratic in the devices (errors3 hunt).  Counted per set.
_MEMBER_GROUPS = ("all", "row", "column")


def _members_near(placement: Placement, group: str, part: int) -> tuple[int, int]:
    """(peers on ``part``'s node, all peers) in a term of a member group."""
    size = placement.parts if group == "all" else placement.grid[1] if group == "row" else placement.grid[0]
    return _members_on_node(placement, group)[part] - 1, size - 1


@dataclass(frozen=True)
class RankTraffic:
    sent: int
    received: int
    sent_within: int        # of the bytes sent, to peers on the same node
    sent_across: int        # to peers on other nodes


def traffic(placement: Placement, moved: Moved, phase: str = "forward") -> list[RankTraffic]:
    """Per part (in part order): bytes sent and received, and the bytes sent
    split by link."""
    by_part = terms_by_part(placement.scheme, placement.grid, moved, phase)
    classes, firsts = _link_classes(placement, by_part)
    per_class = []
    for part in firsts:
        ts = by_part(part)
        within = across = 0
        for t in ts:
            a, b = link_bytes(t, placement, part)
            within, across = within + a, across + b
        per_class.append(RankTraffic(sum(t.total for t in ts if t.sends), sum(t.total for t in ts if t.receives),
                                     within, across))
    return [per_class[k] for k in classes]


def _link_classes(placement: Placement, by_part: PartTerms) -> tuple[list[int], list[int]]:
    """Parts that send and receive the same bytes over the same links: the
    class of every part (in part order) and the first part of each class.

    link_bytes of a part's term depends on the term and on how many of the
    part's peers in it share its node (a member group: the set's members on
    the node; a pass: whether the peer's node is another).  Parts alike in
    their terms (their role) and in those counts for every group are priced
    once a class: walking every part through link_bytes took napkin cost 36 s
    for a 1024 x 1024 ATTENTION2D grid and 122 s for a tree of 2^20 - 1."""
    return _classes(placement, tuple(frozenset(t.group for t in ts) for ts in by_part.lists))


@functools.lru_cache(maxsize=8)
def _classes(placement: Placement, uses: tuple[frozenset[str], ...]) -> tuple[list[int], list[int]]:
    """_link_classes for the groups each role's terms use (the phases of a
    scheme mostly use the same ones: computed once)."""
    n = placement.parts
    roles = _roles(placement.scheme, n)[1]
    groups = sorted(frozenset().union(*uses))
    nodes = _nodes(placement) if any(g not in _MEMBER_GROUPS for g in groups) else []   # for the passes
    columns: list[list] = [roles] if len(uses) > 1 else []
    for group in groups:
        if group in _MEMBER_GROUPS:
            columns.append(_members_on_node(placement, group))
            continue
        used = [group in u for u in uses]   # a tree's extra devices have no rounds
        for sending in (True, False):
            peer = placement.peer(group, sending)
            columns.append([nodes[peer(q)] != nodes[q] if used[roles[q]] else None for q in range(n)])
    if not columns:                         # no terms: every part alike
        return [0] * n, [0]
    index: dict[tuple, int] = {}
    classes = [index.setdefault(key, len(index)) for key in zip(*columns)]
    firsts = [0] * len(index)
    for part in range(n - 1, -1, -1):
        firsts[classes[part]] = part
    return classes, firsts


@functools.lru_cache(maxsize=8)
def _nodes(placement: Placement) -> list[int]:
    """placement.nodes(), once a placement: a row's and a column's counts and
    the passes all read it (with node blocks, a rank computed per part)."""
    return placement.nodes()


@functools.lru_cache(maxsize=16)
def _members_on_node(placement: Placement, group: str) -> list[int]:
    """For every part, the members of its set in a member group (all parts;
    its grid row or column) that run on its node, itself included: one pass
    over the parts, which the classes and link_bytes share."""
    nodes = _nodes(placement)
    if group == "all":
        keys = nodes
    else:
        c, stride = placement.grid[1], max(nodes) + 1
        keys = [q // c * stride + node for q, node in enumerate(nodes)] if group == "row" \
            else [q % c * stride + node for q, node in enumerate(nodes)]
    counts = collections.Counter(keys)
    return [counts[k] for k in keys]


# --------------------------------------------------------------------------
# Time.
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class Links:
    """Per GPU, per direction, bytes per second: NVLink within a node,
    InfiniBand across nodes (napkin/profiles.toml)."""

    within: float
    across: float

    @classmethod
    def of(cls, profile) -> "Links":
        return cls(profile["nvlink_bandwidth"], profile["infiniband_bandwidth"])


def phase_seconds(placement: Placement, moved: Moved, phase: str, links: Links) -> dict[str, float]:
    """Seconds per collective (keyed by the term's what and group) of a
    phase.  A part's two links work at once, so its time is max(bytes within
    / NVLink, bytes across / InfiniBand) over what it sends and receives;
    each collective waits for its slowest part."""
    out: dict[str, float] = {}
    by_part = terms_by_part(placement.scheme, placement.grid, moved, phase)
    for part in _link_classes(placement, by_part)[1]:    # a class's parts take the same time
        for t in by_part(part):
            key = f"{t.what} [{t.group}]"
            a, b = link_bytes(t, placement, part, True)
            c, d = link_bytes(t, placement, part, False)
            secs = max(a / links.within, b / links.across, c / links.within, d / links.across)
            out[key] = max(out.get(key, 0.0), secs)
    return out


@dataclass(frozen=True)
class Timing:
    forward_s: float
    backward_s: float           # 0 without a backward
    forward_comm_s: float
    backward_comm_s: float
    forward_compute_s: float
    backward_compute_s: float

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s


def scheme_seconds(placement: Placement, moved: Moved, links: Links, forward_steps: Sequence[float],
                   backward_steps: Optional[Sequence[float]] = None) -> Timing:
    """Predicted seconds of one call.

    ``forward_steps`` / ``backward_steps``: compute seconds of the slowest
    part at each step (P steps for the ring schemes, ``moved.reach`` for a
    ring cut short, one step otherwise).
    ATTENTION2D and the tree do not overlap (communication, then compute:
    the paper's faster no-overlap variant).  The ring schemes overlap every
    step's compute with the pass that brings the next step's blocks and with
    the accumulator pass of the previous step; a double ring also overlaps
    each round's outer pass with the whole round.  The last accumulator
    passes (bringing dK, dV or dQ home) are not hidden."""
    scheme = placement.scheme
    fwd_comm = phase_seconds(placement, moved, "forward", links)
    bwd_comm = phase_seconds(placement, moved, "backward", links) if backward_steps is not None else {}
    fc, bc = sum(fwd_comm.values()), sum(bwd_comm.values())
    f_compute = sum(forward_steps)
    b_compute = sum(backward_steps) if backward_steps is not None else 0.0
    if scheme not in RINGS:
        fwd = fc + f_compute
        bwd = bc + b_compute if backward_steps is not None else 0.0
        return Timing(fwd, bwd, fc, bc, f_compute, b_compute)
    n, g = placement.grid if scheme in TWO_D else (1, ring_steps(scheme, placement.grid, moved))
    p = n * g
    if len(forward_steps) != p or (backward_steps is not None and len(backward_steps) != p):
        raise ValueError(f"a ring of {p} steps needs {p} compute steps")
    def seconds(steps, phase, comm) -> float:
        pp = _per_pass(placement, moved, phase, comm)
        if not moved.ahead:
            return _ring_seconds(n, g, steps, pp)
        # a ring run both ways (one node) runs its arms one after the other, the second's first
        # step computing nothing
        back = g - moved.ahead
        return _ring_seconds(1, back, steps[:back], pp) + _ring_seconds(1, moved.ahead + 1, [0.0, *steps[back:]], pp)

    fwd = seconds(forward_steps, "forward", fwd_comm)
    bwd = seconds(backward_steps, "backward", bwd_comm) if backward_steps is not None else 0.0
    return Timing(fwd, bwd, fc, bc, f_compute, b_compute)


def _per_pass(placement: Placement, moved: Moved, phase: str, seconds: dict[str, float]) -> dict:
    """Seconds of one pass of each ring term, keyed (blocks or accumulators,
    link group); a flat ring's passes are "ring" (either way round) but for
    a short ring's hop "home"."""
    out = {}
    for t in terms(placement.scheme, placement.grid, moved, phase):
        group = "ring" if t.group == "ring reversed" else "home" if t.group.startswith("home") else t.group
        out[(t.what.startswith(("dK", "dQ")), group)] = seconds[f"{t.what} [{t.group}]"] / t.steps
    return out


def _ring_seconds(n: int, g: int, steps: Sequence[float], per_pass: dict) -> float:
    """A ring's time, round by round (a flat ring: one round of P steps).
    Step i of a round takes the longer of its compute and its inner link's
    work: the pass bringing the next block (not after the round's last
    step) and the accumulator pass started at the previous step (not at the
    round's first step: each round starts new chains).  A round takes the
    longer of its steps and its outer link's work: the next round's block
    and the previous round's accumulator totals.  Then the home pass, which
    nothing hides."""
    flat = n == 1
    inner_block = per_pass.get((False, "ring" if flat else "inner"), 0.0)
    inner_acc = per_pass.get((True, "ring" if flat else "inner"), 0.0)
    outer_block, outer_acc = per_pass.get((False, "outer"), 0.0), per_pass.get((True, "outer"), 0.0)
    home = per_pass.get((True, "home"), inner_acc if flat else 0.0)
    total = 0.0
    for o in range(n):
        round_s = 0.0
        for i in range(g):
            link = (inner_block if i < g - 1 else 0.0) + (inner_acc if i > 0 else 0.0)
            round_s += max(steps[o * g + i], link)
        total += max(round_s, (outer_block if o < n - 1 else 0.0) + (outer_acc if o > 0 else 0.0))
    return total + home
