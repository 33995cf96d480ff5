"""Process-group plumbing: device grids and rings, collectives with deadlines,
and the handshake that turns a shape mismatch into an error on every rank.

Every collective here is called as ``torch.distributed.NAME`` at call time, so
the communication counter (commcount.py) sees it, and every wait is bounded by
a timeout: a peer that failed or never called gives a RuntimeError that says
what was being waited for, never a hang.

A grid is R x C devices; device (i, j) is part ``i * C + j`` of the token
layout.  ``row_group`` holds the C devices of grid row i (group rank j) and
``col_group`` the R devices of grid column j (group rank i).  A
``DeviceMesh`` of shape (R, C) from ``init_device_mesh`` gives exactly that:
mesh dimension 1 is the row group and dimension 0 the column group.
"""
from __future__ import annotations

import datetime
import time
import zlib
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT = 300.0  # seconds; every wait is bounded by the caller's timeout


# --------------------------------------------------------------------------
# Grids and rings.
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class Grid2D:
    rows: int
    cols: int
    i: int
    j: int
    row_group: Any
    col_group: Any

    @property
    def parts(self) -> int:
        return self.rows * self.cols

    @property
    def part(self) -> int:
        """This device's index in the cyclic token layout."""
        return self.i * self.cols + self.j

    def validate(self) -> "Grid2D":
        """Check that group ranks are grid coordinates: all-gathers return
        blocks in group-rank order, and the layout arithmetic relies on it."""
        for name, group, size, idx in (("row", self.row_group, self.cols, self.j),
                                       ("column", self.col_group, self.rows, self.i)):
            if dist.get_world_size(group) != size:
                raise ValueError(f"the {name} group has {dist.get_world_size(group)} ranks; "
                                 f"a {self.rows} x {self.cols} grid needs {size}")
            if dist.get_rank(group) != idx:
                raise ValueError(f"device ({self.i}, {self.j}) has rank {dist.get_rank(group)} in its {name} "
                                 f"group; it must be {idx} (order the group's ranks by grid coordinate)")
        return self


def grid_from_mesh(mesh) -> Grid2D:
    """A Grid2D over a 2-D DeviceMesh (dimension 0: rows, dimension 1: columns)."""
    if mesh.ndim != 2:
        raise ValueError(f"ATTENTION2D needs a 2-D device mesh, got {mesh.ndim} dimensions")
    i, j = mesh.get_coordinate()
    r, c = mesh.shape
    return Grid2D(r, c, i, j, row_group=mesh.get_group(1), col_group=mesh.get_group(0)).validate()


def grid_ranks(rows: int, cols: int, block: Optional[tuple[int, int]] = None) -> list[int]:
    """Global ranks of an R x C grid's devices in grid order (i*C + j).

    Without ``block``, device (i, j) is rank i*C + j.  With ``block`` =
    (DR, DC), each node of DR*DC GPUs (ranks n*DR*DC ...) holds a DR x DC
    block of the grid, nodes in row-major order over the grid of blocks:
    DC = C puts whole grid rows inside nodes, DR = R whole columns.  The
    placement is napkin/cost/collectives.py's, so the cost pass knows which
    collective crosses nodes."""
    from ..cost.collectives import Placement
    return Placement("attention2d", (rows, cols), block=block).ranks()


def new_grid(rows: int, cols: int, ranks: Optional[Sequence[int]] = None) -> Grid2D:
    """Make the row and column groups of an R x C grid from plain process
    groups.  Collective: every rank of the default group must call it (torch
    requires that for ``new_group``).  ``ranks`` (default 0..R*C-1) lists the
    global ranks in grid order (``grid_ranks`` for a grid placed on nodes)."""
    ranks = list(range(rows * cols)) if ranks is None else list(ranks)
    if len(ranks) != rows * cols or len(set(ranks)) != len(ranks):
        raise ValueError(f"a {rows} x {cols} grid needs {rows * cols} distinct ranks, got {ranks}")
    row_lists = [ranks[i * cols:(i + 1) * cols] for i in range(rows)]
    col_lists = [ranks[j::cols] for j in range(cols)]
    if any(sorted(g) != g for g in row_lists + col_lists):
        # torch orders a group's members by global rank; the layout needs
        # group rank = grid coordinate
        raise ValueError("the ranks of every grid row and column must be increasing")
    world = dist.get_world_size()
    if max(ranks) >= world or min(ranks) < 0:
        # torch's own words ("Rank 3 is out of range") name neither the grid nor the fix
        raise ValueError(f"a {rows} x {cols} grid needs ranks {min(ranks)}..{max(ranks)}, but the default "
                         f"group has {world}: launch {max(ranks) + 1} processes (torchrun --nproc-per-node "
                         f"{max(ranks) + 1}) or ask for a grid of at most {world} ranks")
    me = dist.get_rank()
    mine = None
    row_groups = [dist.new_group(g) for g in row_lists]
    col_groups = [dist.new_group(g) for g in col_lists]
    if me in ranks:
        i, j = divmod(ranks.index(me), cols)
        mine = Grid2D(rows, cols, i, j, row_groups[i], col_groups[j]).validate()
    return mine


def as_grid(grid) -> Grid2D:
    if isinstance(grid, Grid2D):
        return grid
    if hasattr(grid, "get_group") and hasattr(grid, "get_coordinate"):
        return grid_from_mesh(grid)
    raise TypeError(f"expected a 2-D DeviceMesh or a Grid2D (napkin.distributed.new_grid), got {type(grid).__name__}")


@dataclass(frozen=True)
class Ring:
    size: int
    rank: int
    group: Any
    next: int   # global rank of the next device (what this one sends to)
    prev: int   # global rank of the previous device (what this one receives from)


def as_ring(group=None) -> Ring:
    """A ring over a process group (None: the default group), a 1-D
    DeviceMesh, or a Ring."""
    if isinstance(group, Ring):
        return group
    if hasattr(group, "get_group") and hasattr(group, "get_coordinate"):
        if group.ndim != 1:
            raise ValueError(f"Ring Attention needs a 1-D device mesh, got {group.ndim} dimensions")
        group = group.get_group(0)
    pg = group if group is not None else dist.group.WORLD
    size, rank = dist.get_world_size(pg), dist.get_rank(pg)
    return Ring(size, rank, pg, dist.get_global_rank(pg, (rank + 1) % size),
                dist.get_global_rank(pg, (rank - 1) % size))


@dataclass(frozen=True)
class DoubleRing:
    """A ring of P = N * G ranks seen as N nodes of G GPUs (group rank
    n*G + l is GPU l of node n): ``inner`` runs round this node's G GPUs
    (NVLink), ``outer`` joins GPU l of every node (InfiniBand), and ``home``
    goes to the next GPU of the next node (the accumulators' last hop).  A
    flat ring is the double ring of one node (N = 1, G = P).

    A flat ring may be cut short (``steps`` < P: the mask keeps no key more
    than steps - 1 devices back, reach.py): its blocks make steps - 1
    passes and ``home`` is then the hop straight back to where a block
    started, steps - 1 devices behind.  ``direction`` -1 runs it the other
    way (rank r receives from r + 1), as BurstAttention's backward needs:
    there the query blocks travel, and a query block needs the keys behind
    it."""

    nodes: int
    per_node: int
    rank: int          # in the group
    group: Any
    inner: Ring
    outer: Ring
    home: Ring
    steps: Optional[int] = None     # a flat ring cut short: the steps it runs (None: all)
    direction: int = 1

    @property
    def size(self) -> int:
        return self.nodes * self.per_node

    @property
    def round(self) -> int:
        """Steps in a round (a flat ring: its only round)."""
        return self.per_node if self.steps is None else self.steps

    def origin(self, step: int) -> int:
        """The group rank whose blocks this rank holds at ``step``."""
        return ring_origin(self.rank, step, self.nodes, self.per_node, self.direction)


def ring_origin(rank: int, step: int, nodes: int, per_node: int, direction: int = 1) -> int:
    """The rank whose blocks ``rank`` holds at ``step`` of a double ring of
    ``nodes`` x ``per_node``: step o*G + i is step i of round o, and in round
    o a GPU works through the blocks of the node o before it (a flat ring,
    one node: rank - step; run the other way, rank + step)."""
    o, i = divmod(step, per_node)
    node, local = divmod(rank, per_node)
    return (node - o) % nodes * per_node + (local - direction * i) % per_node


def as_double_ring(group=None, per_node: Optional[int] = None, steps: Optional[int] = None,
                   direction: int = 1) -> DoubleRing:
    """The double ring over a process group (None: the default group) or a
    1-D DeviceMesh, ``per_node`` GPUs per node (None: one node).  ``steps``
    and ``direction`` make a flat ring cut short or run the other way."""
    ring = as_ring(group)
    short = steps is not None or direction != 1
    if short:
        steps = ring.size if steps is None else steps
        if per_node not in (None, ring.size) or not 1 <= steps <= ring.size or direction not in (1, -1):
            raise ValueError(f"a ring cut to {steps} steps, direction {direction}, must be a flat ring of "
                             f"at least that many ranks (got {ring.size}, {per_node} per node)")
    g = ring.size if per_node is None else per_node
    if g < 1 or ring.size % g:
        raise ValueError(f"a ring of {ring.size} ranks does not split into nodes of {g} GPUs")
    n = ring.size // g
    node, local = divmod(ring.rank, g)

    def glob(r: int) -> int:
        return dist.get_global_rank(ring.group, r)

    def hop(dn: int, dl: int) -> Ring:
        return Ring(ring.size, ring.rank, ring.group, glob((node + dn) % n * g + (local + dl) % g),
                    glob((node - dn) % n * g + (local - dl) % g))

    if short:   # one node: blocks go ``direction`` round it, accumulators hop home steps - 1 back
        way = hop(0, direction)
        return DoubleRing(1, g, ring.rank, ring.group, way, way, hop(0, -direction * (steps - 1)), steps, direction)
    return DoubleRing(n, g, ring.rank, ring.group, hop(0, 1), hop(1, 0), hop(1, 1))


# --------------------------------------------------------------------------
# Collectives with deadlines.  Tensors are exchanged token-dimension first.
# --------------------------------------------------------------------------

def wait(work, timeout: float, what: str) -> None:
    """Wait for an async work handle, at most ``timeout`` seconds."""
    if work is None:
        return
    start = time.monotonic()
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as err:
        # the failure comes from our deadline, the process group's own (which may be shorter) or a
        # peer that died: say how long it waited, not that it waited the whole timeout
        raise RuntimeError(
            f"napkin.distributed: {what} failed after {time.monotonic() - start:.3g} s (timeout {timeout:g} s) "
            f"on rank {dist.get_rank()} ({err}); a peer may have failed or not made the same call") from err


def _all_gather(out, inp, group):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=True)


def all_gather_rows(t: torch.Tensor, dim: int, group, timeout: float, what: str) -> torch.Tensor:
    """Concatenate every group member's ``t`` along ``dim``, in group-rank order."""
    k = dist.get_world_size(group)
    if k == 1:
        return t
    # detached: a gather is not differentiable, and gloo's all-gather of an
    # input that requires grad fails inside wait() (e.g. gathering O)
    x = t.detach().movedim(dim, 0).contiguous()
    out = x.new_empty((k * x.shape[0],) + tuple(x.shape[1:]))
    wait(_all_gather(out, x, group), timeout, f"all-gather of {what}")
    return out.movedim(0, dim)


def all_to_all_rows(buf: torch.Tensor, group, timeout: float, what: str) -> torch.Tensor:
    """buf [k, ...]: row c goes to member c; returns [k, ...] with row c from member c."""
    k = dist.get_world_size(group)
    if k == 1:
        return buf
    buf = buf.contiguous()
    out = torch.empty_like(buf)
    wait(dist.all_to_all_single(out, buf, group=group, async_op=True), timeout, f"all-to-all of {what}")
    return out


def reduce_scatter_rows(t: torch.Tensor, dim: int, group, timeout: float, what: str) -> torch.Tensor:
    """t holds k blocks along ``dim`` (one per member, in group-rank order);
    returns the sum over members of this member's block.

    NCCL has reduce-scatter; on other backends (gloo's has been missing or
    naive) it is an all-to-all followed by a local sum, which moves the same
    bytes: each rank sends every peer that peer's block once.
    """
    k = dist.get_world_size(group)
    if k == 1:
        return t
    x = t.movedim(dim, 0).contiguous()
    n = x.shape[0] // k
    if dist.get_backend(group) == "nccl":
        fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        out = x.new_empty((n,) + tuple(x.shape[1:]))
        wait(fn(out, x, group=group, async_op=True), timeout, f"reduce-scatter of {what}")
    else:
        got = torch.empty_like(x)
        wait(dist.all_to_all_single(got, x, group=group, async_op=True), timeout, f"reduce-scatter of {what}")
        out = got.view((k, n) + tuple(x.shape[1:])).sum(0)
    return out.movedim(0, dim)


class RingPass:
    """Tensors on their way to the next device while the previous one's arrive.

    Started before the step's computation and waited for after it, so the
    transfer overlaps the local attention (double buffering)."""

    def __init__(self, tensors: Sequence[torch.Tensor], ring: Ring, timeout: float, what: str,
                 first_tag: int = 0):
        self.timeout, self.what = timeout, what
        self.sending = [t.contiguous() for t in tensors]
        self.received = [torch.empty_like(t) for t in self.sending]
        self.works = []
        # distinct tags per concurrent pass keep messages from pairing up wrongly
        for tag, (s, r) in enumerate(zip(self.sending, self.received), start=first_tag):
            self.works.append(dist.isend(s, ring.next, group=ring.group, tag=tag))
            self.works.append(dist.irecv(r, ring.prev, group=ring.group, tag=tag))

    def wait(self) -> list[torch.Tensor]:
        for w in self.works:
            wait(w, self.timeout, f"ring pass of {self.what}")
        return self.received


# --------------------------------------------------------------------------
# The handshake: every rank learns every rank's shapes before any big
# collective, so a mismatch raises the same clear error everywhere.
# --------------------------------------------------------------------------

MAX_TENSORS = 8
DIMS = 5
SLOT = 4 + DIMS                       # dtype code, requires_grad, rank, fingerprint, shape
META_HEAD = 5                         # scheme code, q_len, x_len, layout code, diagram hash
META_LEN = META_HEAD + MAX_TENSORS * SLOT
_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16,
           torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]


def fingerprint(t: torch.Tensor) -> int:
    """A crc32 of the tensor's values (as laid out contiguously), for inputs
    every rank passes whole: a rank with another doc-id tensor or slope
    computes another function, and no shape says so.  The copy to the host
    is of a side input (a slope per head, a doc id per token), small beside
    the token inputs, and the handshake waits on the host anyway."""
    host = t.detach().reshape(-1).contiguous().cpu()
    return zlib.crc32(host.view(torch.uint8).numpy().tobytes()) & 0x7FFFFFFF


def describe(head: Sequence[int], tensors: Sequence[Optional[torch.Tensor]],
             fingerprints: Sequence[int] = ()) -> torch.Tensor:
    """This rank's call as a fixed-length int64 vector.  ``fingerprints``
    gives the first tensors' value fingerprints (-1: not compared)."""
    if len(tensors) > MAX_TENSORS:
        raise ValueError(f"at most {MAX_TENSORS} tensor arguments, got {len(tensors)}")
    prints = list(fingerprints) + [-1] * (len(tensors) - len(fingerprints))
    vec = [int(h) for h in head]
    for t, mark in zip(list(tensors) + [None] * (MAX_TENSORS - len(tensors)), prints + [-1] * MAX_TENSORS):
        if t is None:
            vec += [-1] * SLOT
            continue
        if t.dim() > DIMS:
            raise ValueError(f"tensors of at most {DIMS} dimensions, got shape {tuple(t.shape)}")
        code = _DTYPES.index(t.dtype) if t.dtype in _DTYPES else len(_DTYPES)
        vec += [code, int(t.requires_grad), t.dim(), mark] + list(t.shape) + [0] * (DIMS - t.dim())
    return torch.tensor(vec, dtype=torch.int64)


def decode(row: torch.Tensor, index: int) -> str:
    """One tensor's entry of a handshake vector, as 'shape dtype'."""
    base = META_HEAD + index * SLOT
    code, grad, nd = (int(v) for v in row[base:base + 3])
    if code < 0:
        return "absent"
    shape = shape_at(row, index)
    dtype = str(_DTYPES[code]).replace("torch.", "") if code < len(_DTYPES) else "other dtype"
    return f"{shape} {dtype}" + (" requires_grad" if grad else "")


def fingerprint_at(row: torch.Tensor, index: int) -> int:
    return int(row[META_HEAD + index * SLOT + 3])


def shape_at(row: torch.Tensor, index: int) -> tuple[int, ...]:
    base = META_HEAD + index * SLOT
    return tuple(int(v) for v in row[base + 4:base + 4 + int(row[base + 2])])


def exchange_meta(vec: torch.Tensor, groups: Sequence, timeout: float, device=None) -> torch.Tensor:
    """All ranks' vectors, [parts, META_LEN], identical on every rank.

    ``groups`` are gathered over in order: for a grid (row, column), so the
    second all-gather spreads whole rows and every rank sees every device;
    part index = i * C + j."""
    table = vec.to(device) if device is not None else vec
    table = table.view(1, -1)
    for g in groups:
        if dist.get_world_size(g) > 1:
            table = all_gather_rows(table.reshape(1, -1), 0, g, timeout, "the shape handshake")
    return table.reshape(-1, vec.numel()).cpu()
