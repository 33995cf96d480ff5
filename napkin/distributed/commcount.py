"""The communication counter: bytes each rank sends and receives.

``CommCounter`` is a context manager that, while active, wraps the
collective and point-to-point functions of ``torch.distributed`` (it swaps the
module attributes and puts them back on exit).  Every call made through
``torch.distributed.NAME`` is recorded as an ``Event`` with the bytes this rank
sends and receives.  napkin's wrappers call every collective that way, and so
does anyone else's code, so the counter measures what really reaches
torch.distributed, not what napkin believes it sends.

Bytes are counted with the direct-exchange model, the same one the cost pass
uses: a rank sends each peer exactly the data that peer lacks.
  all-gather of a B-byte block among k ranks    sent (k-1) B, received (k-1) B
  all-to-all of a B-byte buffer (equal splits)   sent and received (k-1)/k B
  reduce-scatter of a B-byte input               sent and received (k-1)/k B
  send / isend, recv / irecv                     the tensor's bytes
  broadcast from src                             src sends (k-1) B, others receive B
  all-reduce                                     2 (k-1)/k B each way (ring)
With ``gpus_per_node`` the bytes sent are also split by link: to ranks on
the same node (NVLink) or on others (InfiniBand); a ring all-reduce's bytes
are charged to the link to the next member.
The backend's own algorithm (gloo's ring or tree, NCCL's) may move the data
in more hops; the model counts the bytes that must leave and enter a rank.

Events carry a phase label ("check", "forward", "backward", or "other"),
set by the wrappers with ``phase(name)``, so a test can compare the forward
traffic with its prediction without the small shape handshake.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..cost import collectives as C

_PHASE = contextvars.ContextVar("napkin_comm_phase", default="other")


@contextlib.contextmanager
def phase(name: str):
    """Label the communication inside the block (nested blocks override)."""
    token = _PHASE.set(name)
    try:
        yield
    finally:
        _PHASE.reset(token)


@dataclass(frozen=True)
class Event:
    op: str
    phase: str
    group_size: int
    sent: int
    received: int
    sent_within: int = 0      # of ``sent``, to ranks on this rank's node (needs gpus_per_node)
    sent_across: int = 0      # to ranks on other nodes


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _members(group) -> list[int]:
    """Global ranks of a group's members, in group-rank order."""
    return list(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def _others(group) -> list[int]:
    me = dist.get_rank()
    return [r for r in _members(group) if r != me]


# Each rule maps the call's arguments to (sent, received, [(peer, bytes sent)])
# for this rank; peers are global ranks.

def _gather_single(output, input, group=None, *a, **k):
    peers = _others(group)
    return len(peers) * _nbytes(input), len(peers) * _nbytes(input), [(q, _nbytes(input)) for q in peers]


def _gather_list(tensor_list, tensor, group=None, *a, **k):
    return _gather_single(None, tensor, group)


def _splits(t, splits, members: list[int]) -> list[int]:
    """Bytes of t for each member (equal splits unless given)."""
    n = len(members)
    if splits is None or len(splits) == 0:
        return [_nbytes(t) // n] * n
    per_row = _nbytes(t) // max(t.shape[0], 1) if t.dim() else _nbytes(t)
    return [int(x) * per_row for x in splits]


def _all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, *a, **k):
    members, me = _members(group), dist.get_rank()
    out = _splits(input, input_split_sizes, members)
    got = _splits(output, output_split_sizes, members)
    mine = members.index(me)
    to = [(q, nb) for q, nb in zip(members, out) if q != me]
    return sum(out) - out[mine], sum(got) - got[mine], to


def _reduce_scatter(output, input, op=None, group=None, *a, **k):
    moved = _nbytes(input) - _nbytes(output)
    return moved, moved, [(q, _nbytes(output)) for q in _others(group)]


def _send(tensor, dst=None, group=None, *a, **k):
    return _nbytes(tensor), 0, [(dst, _nbytes(tensor))]


def _recv(tensor, src=None, group=None, *a, **k):
    return 0, _nbytes(tensor), []


def _broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
    members = _members(group)
    root = members[group_src] if group_src is not None else src
    if dist.get_rank() == root:
        peers = [q for q in members if q != root]
        return len(peers) * _nbytes(tensor), 0, [(q, _nbytes(tensor)) for q in peers]
    return 0, _nbytes(tensor), []


def _all_reduce(tensor, op=None, group=None, *a, **k):
    members = _members(group)
    n = len(members)
    moved = 2 * (n - 1) * _nbytes(tensor) // n
    # a ring all-reduce sends everything to the next member
    nxt = members[(members.index(dist.get_rank()) + 1) % n]
    return moved, moved, [(nxt, moved)] if moved else []


_RULES = {
    "all_gather_single": _gather_single,
    "all_gather_into_tensor": _gather_single,
    "all_gather": _gather_list,
    "all_to_all_single": _all_to_all_single,
    "reduce_scatter_single": _reduce_scatter,
    "reduce_scatter_tensor": _reduce_scatter,
    "send": _send,
    "isend": _send,
    "recv": _recv,
    "irecv": _recv,
    "broadcast": _broadcast,
    "all_reduce": _all_reduce,
}


class CommCounter:
    """Count the bytes this rank sends and receives through torch.distributed.

    >>> with CommCounter(gpus_per_node=2) as cc:
    ...     out = attention_2d(q, k, v, grid=mesh, q_len=N)
    >>> cc.total("forward")          # (sent, received)
    >>> cc.links("forward")          # (sent within the node, sent across nodes)

    ``gpus_per_node`` G says which ranks share a node (global rank // G);
    without it every rank is on one node.
    """

    def __init__(self, gpus_per_node: Optional[int] = None):
        self.events: list[Event] = []
        self.gpus_per_node = gpus_per_node
        self._saved: dict[str, object] = {}

    def __enter__(self) -> "CommCounter":
        if getattr(dist, "_napkin_counter_active", False):
            raise RuntimeError("a CommCounter is already active in this process; nest them by sharing one")
        for name, rule in _RULES.items():
            fn = getattr(dist, name, None)
            if fn is not None:
                self._saved[name] = fn
                setattr(dist, name, self._wrap(name, fn, rule))
        dist._napkin_counter_active = True
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved.clear()
        dist._napkin_counter_active = False

    def _node(self, rank: int) -> int:
        return 0 if self.gpus_per_node is None else rank // self.gpus_per_node

    def _wrap(self, name, fn, rule):
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            sent, received, to = rule(*args, **kwargs)
            group = kwargs.get("group")
            home = self._node(dist.get_rank())
            across = sum(nb for q, nb in to if self._node(q) != home)
            size = dist.get_world_size(group)
            self.events.append(Event(name, _PHASE.get(), size, int(sent), int(received),
                                     int(sent) - across, across))
            return fn(*args, **kwargs)
        return counted

    # -- totals -------------------------------------------------------------------
    def total(self, phase: Optional[str] = None) -> tuple[int, int]:
        """(bytes sent, bytes received) over the events of one phase, or all."""
        evs = [e for e in self.events if phase is None or e.phase == phase]
        return sum(e.sent for e in evs), sum(e.received for e in evs)

    def links(self, phase: Optional[str] = None) -> tuple[int, int]:
        """(bytes sent within this rank's node, bytes sent across nodes)."""
        evs = [e for e in self.events if phase is None or e.phase == phase]
        return sum(e.sent_within for e in evs), sum(e.sent_across for e in evs)

    def by_phase(self) -> dict[str, tuple[int, int]]:
        return {p: self.total(p) for p in dict.fromkeys(e.phase for e in self.events)}

    def clear(self) -> None:
        self.events.clear()


# --------------------------------------------------------------------------
# Predictions: what napkin's wrappers send, exactly (per rank).  The model
# lives in napkin/cost/collectives.py, shared with the cost pass.
# --------------------------------------------------------------------------

_TORCH_NAMES = {torch.float64: "fp64", torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _dtype_name(dtype) -> str:
    name = _TORCH_NAMES.get(dtype, dtype)
    if name not in C.ELEMENT_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {', '.join(C.ELEMENT_BYTES)}")
    return name


def accumulator_bytes(dtype) -> int:
    """Partial states, lse, delta and gradient partials travel in fp64 when
    the inputs are fp64, else in fp32."""
    return C.state_bytes(_dtype_name(dtype))


def comm_terms(scheme: str, grid, sizes: dict, dtype, phase: str = "forward",
               family: str = "softmax", part: int = 0) -> list[C.Term]:
    """The collectives napkin's wrappers run for one call, on part ``part``.

    scheme: "attention2d" (grid = (R, C)), "ring" or "burst" (Ring Attention
    with Ring's or BurstAttention's backward) or "tree" (decoding); grid =
    (P,) or P for the last three.  sizes: b, hq, hkv, d, q (query tokens) and
    optionally x (key tokens, default q).  dtype: of Q, K, V (and so of O
    and dO).  phase: "forward", "backward" or "check" (the shape handshake
    before the forward).  family: "softmax" (states carry lse) or "sum".
    """
    return C.terms(scheme, grid, C.Moved.attention(sizes, _dtype_name(dtype), family), phase, part)


def predicted_comm(scheme: str, grid, sizes: dict, dtype, phase: str = "forward",
                   family: str = "softmax") -> list[tuple[int, int]]:
    """Bytes (sent, received) of each rank, in rank order, for one call of
    napkin's wrappers (arguments as ``comm_terms``).  Padding gives every
    rank the same rows, so ATTENTION2D and the rings are uniform over ranks;
    the tree is not when P is not a power of two."""
    return C.rank_bytes(scheme, grid, C.Moved.attention(sizes, _dtype_name(dtype), family), phase)
