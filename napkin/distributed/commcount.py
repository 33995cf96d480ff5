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


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _group_size(group) -> int:
    return dist.get_world_size(group)


def _group_rank(group) -> int:
    return dist.get_rank(group)


# Each rule maps the call's arguments to (sent, received, group) for this rank.

def _gather_single(output, input, group=None, *a, **k):
    n = _group_size(group)
    return (n - 1) * _nbytes(input), (n - 1) * _nbytes(input), group


def _gather_list(tensor_list, tensor, group=None, *a, **k):
    n = _group_size(group)
    return (n - 1) * _nbytes(tensor), (n - 1) * _nbytes(tensor), group


def _split_bytes(t, splits, n, me) -> int:
    """Bytes of t outside this rank's own split (the part it keeps)."""
    per_row = _nbytes(t) // max(t.shape[0], 1) if t.dim() else _nbytes(t)
    if splits is None or len(splits) == 0:
        return _nbytes(t) - _nbytes(t) // n
    return _nbytes(t) - splits[me] * per_row


def _all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, *a, **k):
    n, me = _group_size(group), _group_rank(group)
    return _split_bytes(input, input_split_sizes, n, me), _split_bytes(output, output_split_sizes, n, me), group


def _reduce_scatter(output, input, op=None, group=None, *a, **k):
    moved = _nbytes(input) - _nbytes(output)
    return moved, moved, group


def _send(tensor, dst=None, group=None, *a, **k):
    return _nbytes(tensor), 0, group


def _recv(tensor, src=None, group=None, *a, **k):
    return 0, _nbytes(tensor), group


def _broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
    n = _group_size(group)
    is_src = (_group_rank(group) == group_src) if group_src is not None else dist.get_rank() == src
    return ((n - 1) * _nbytes(tensor), 0, group) if is_src else (0, _nbytes(tensor), group)


def _all_reduce(tensor, op=None, group=None, *a, **k):
    n = _group_size(group)
    moved = 2 * (n - 1) * _nbytes(tensor) // n
    return moved, moved, group


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

    >>> with CommCounter() as cc:
    ...     out = attention_2d(q, k, v, grid=mesh, q_len=N)
    >>> cc.total("forward")          # (sent, received)
    """

    def __init__(self):
        self.events: list[Event] = []
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

    def _wrap(self, name, fn, rule):
        @functools.wraps(fn)
        def counted(*args, **kwargs):
            sent, received, group = rule(*args, **kwargs)
            self.events.append(Event(name, _PHASE.get(), _group_size(group), int(sent), int(received)))
            return fn(*args, **kwargs)
        return counted

    # -- totals -------------------------------------------------------------------
    def total(self, phase: Optional[str] = None) -> tuple[int, int]:
        """(bytes sent, bytes received) over the events of one phase, or all."""
        evs = [e for e in self.events if phase is None or e.phase == phase]
        return sum(e.sent for e in evs), sum(e.received for e in evs)

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
