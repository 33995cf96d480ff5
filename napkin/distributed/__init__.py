"""Attention across devices: ATTENTION2D, Ring Attention (with Ring's or
BurstAttention's backward) and decoding over a sharded key/value cache, on
torch.distributed.

* ``Attention2D(diagram)`` / ``RingAttention(diagram, backward="kv" | "burst")``
  / ``TreeAttention(diagram)``: the wrappers; call them with each rank's rows
  of Q, K, V (forward and autograd backward; decoding is forward only).
* ``attention_2d(diagram, q, k, v, grid=..., q_len=...)``,
  ``ring_attention(...)``: the same as one-shot functions.
* ``TokenLayout``: cyclic, zigzag and contiguous token layouts; shard and
  unshard full tensors.
* ``new_grid`` / ``grid_from_mesh`` / ``Grid2D``, ``as_ring``: process groups;
  ``grid_ranks`` places a grid on nodes of several GPUs.
* ``CommCounter``: counts the bytes each rank sends and receives (split into
  within-node and across-node bytes when given the GPUs per node);
  ``predicted_comm`` says what the wrappers should send (napkin/cost/
  collectives.py, the model the cost pass uses).
* ``EagerLocal``, ``KernelLocal`` (the generated Triton kernel, the
  default through ``default_local``), ``autograd_backward``, ``roles``: the
  local attention a device runs and what the wrappers read off the diagram
  (local.py documents the protocol a kernel must follow to be plugged in).

The names are imported on first use, so ``napkin.distributed.reading`` (pure
IR reading) can be used by the cost pass without importing torch.
"""
from __future__ import annotations

import importlib

_WHERE = {
    "Attention2D": "attention2d", "gather_2d": "attention2d",
    "RingAttention": "ring", "TreeAttention": "tree",
    "CommCounter": "commcount", "phase": "commcount", "predicted_comm": "commcount",
    "DEFAULT_TIMEOUT": "groups", "Grid2D": "groups", "Ring": "groups", "as_grid": "groups",
    "as_ring": "groups", "grid_from_mesh": "groups", "new_grid": "groups", "grid_ranks": "groups",
    "TokenLayout": "layouts", "scheme_layout": "layouts",
    "EagerLocal": "local", "autograd_backward": "local", "KernelLocal": "local", "default_local": "local",
    "default_backward": "local",
    "Roles": "reading", "roles": "reading", "mesh_splits": "reading",
    "merge": "merging", "merge_softmax": "merging", "merge_sum": "merging", "partial_weight": "merging",
}


def __getattr__(name: str):
    if name in _WHERE:
        module = importlib.import_module(f".{_WHERE[name]}", __name__)
        value = getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def attention_2d(diagram, *tokens, grid, q_len, x_len=None, timeout=300.0, **side):
    """One-shot ATTENTION2D (builds the wrapper each call; keep an
    ``Attention2D`` for repeated calls)."""
    from .attention2d import Attention2D
    return Attention2D(diagram)(*tokens, grid=grid, q_len=q_len, x_len=x_len, timeout=timeout, **side)


def ring_attention(diagram, *tokens, group=None, q_len, x_len=None, timeout=300.0, **side):
    """One-shot Ring Attention over ``group`` (None: the default group)."""
    from .ring import RingAttention
    return RingAttention(diagram)(*tokens, group=group, q_len=q_len, x_len=x_len, timeout=timeout, **side)


__all__ = sorted(set(_WHERE) | {"attention_2d", "ring_attention"})
