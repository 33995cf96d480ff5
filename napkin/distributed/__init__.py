"""Attention across devices: ATTENTION2D and Ring Attention on torch.distributed.

* ``Attention2D(diagram)`` / ``RingAttention(diagram)``: the wrappers; call
  them with each rank's rows of Q, K, V (forward and autograd backward).
* ``attention_2d(diagram, q, k, v, grid=..., q_len=...)`` and
  ``ring_attention(...)``: the same as one-shot functions.
* ``TokenLayout``: cyclic, zigzag and contiguous token layouts; shard and
  unshard full tensors.
* ``new_grid`` / ``grid_from_mesh`` / ``Grid2D``, ``as_ring``: process groups.
* ``CommCounter``: counts the bytes each rank sends and receives;
  ``predicted_comm`` says what the wrappers should send.
* ``EagerLocal``, ``autograd_backward``, ``roles``: the local attention a
  device runs and what the wrappers read off the diagram (local.py documents
  the protocol a kernel must follow to be plugged in).
"""
from __future__ import annotations

from .attention2d import Attention2D, gather_2d
from .commcount import CommCounter, phase, predicted_comm
from .groups import DEFAULT_TIMEOUT, Grid2D, Ring, as_grid, as_ring, grid_from_mesh, new_grid
from .layouts import TokenLayout, scheme_layout
from .local import EagerLocal, Roles, autograd_backward, roles
from .merge import merge, merge_softmax, merge_sum
from .ring import RingAttention


def attention_2d(diagram, *tokens, grid, q_len, x_len=None, timeout=DEFAULT_TIMEOUT, **side):
    """One-shot ATTENTION2D (builds the wrapper each call; keep an
    ``Attention2D`` for repeated calls)."""
    return Attention2D(diagram)(*tokens, grid=grid, q_len=q_len, x_len=x_len, timeout=timeout, **side)


def ring_attention(diagram, *tokens, group=None, q_len, x_len=None, timeout=DEFAULT_TIMEOUT, **side):
    """One-shot Ring Attention over ``group`` (None: the default group)."""
    return RingAttention(diagram)(*tokens, group=group, q_len=q_len, x_len=x_len, timeout=timeout, **side)


__all__ = [
    "Attention2D", "RingAttention", "attention_2d", "ring_attention", "gather_2d",
    "TokenLayout", "scheme_layout", "Grid2D", "Ring", "new_grid", "grid_from_mesh", "as_grid", "as_ring",
    "CommCounter", "phase", "predicted_comm", "EagerLocal", "Roles", "autograd_backward", "roles",
    "merge", "merge_softmax", "merge_sum", "DEFAULT_TIMEOUT",
]
