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

Backward: K and V go round again (P-1 passes) together with their gradient
accumulators dK, dV (accumulator dtype), which take one more pass (P in all)
to come home; dQ stays local.  The local backward is the same as
ATTENTION2D's, given the merged lse and delta of the device's own rows.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .. import ir
from . import groups as G
from .commcount import phase
from .common import handshake, pad_rows, results, row_delta, split_side, zero_rows
from .layouts import TokenLayout
from .local import EagerLocal, Roles, autograd_backward, roles
from .merging import merge


class RingAttention:
    """Ring Attention for one diagram.

    >>> fn = RingAttention(napkin.load("examples/ring_attention.ncd"))
    >>> O, lse = fn(q, k, v, group=None, q_len=N)      # None: the default group

    Each rank passes its own rows in the ring's layout (``shard``).
    ``layout`` is "zigzag" (default), "cyclic" or "contiguous".
    """

    def __init__(self, diagram: ir.Diagram, *, local: Optional[Callable] = None,
                 local_backward: Optional[Callable] = None, query_wire: Optional[str] = None,
                 key_wire: Optional[str] = None, layout: str = "zigzag"):
        self.roles: Roles = roles(diagram, query_wire, key_wire)
        self.local = local or EagerLocal(self.roles)
        self.local_backward = local_backward or autograd_backward(self.local, self.roles)
        self.layout = layout

    @property
    def ring_size(self) -> Optional[int]:
        s = self.roles.scheme
        return s[1][0] if s and s[0] == "ring" else None

    def layouts(self, parts: int, q_len: int, x_len: Optional[int] = None) -> tuple[TokenLayout, TokenLayout]:
        return TokenLayout(self.layout, parts, q_len), TokenLayout(self.layout, parts, x_len or q_len)

    def __call__(self, *tokens, group=None, q_len: int, x_len: Optional[int] = None,
                 timeout: float = G.DEFAULT_TIMEOUT, **side):
        ring = G.as_ring(group)
        if self.ring_size is not None and self.ring_size != ring.size:
            raise ValueError(f"the diagram asks for a ring of {self.ring_size}, got {ring.size} ranks")
        side = split_side(self.roles, side)
        ql, xl = self.layouts(ring.size, q_len, x_len)
        handshake(self.roles, "ring", tokens, side, ql, xl, (ring.group,), timeout, lambda p: f"ring rank {p}")
        outs = _Function.apply(_Call(self, ring, ql, xl, timeout, side), *tokens)
        return results(self.roles, outs[0], outs[1] if len(outs) > 1 else None)

    def shard(self, full: torch.Tensor, group, length: int, dim: int) -> torch.Tensor:
        ring = G.as_ring(group)
        return TokenLayout(self.layout, ring.size, length).shard(full, ring.rank, dim)

    def gather(self, local: torch.Tensor, group, length: int, dim: int,
               timeout: float = G.DEFAULT_TIMEOUT) -> torch.Tensor:
        ring = G.as_ring(group)
        lay = TokenLayout(self.layout, ring.size, length)
        x = G.all_gather_rows(local, dim, ring.group, timeout, "rows for gather (ring)")
        return lay.unshard(list(x.chunk(ring.size, dim)), dim)


class _Call:
    def __init__(self, fn: RingAttention, ring: G.Ring, ql: TokenLayout, xl: TokenLayout, timeout, side):
        self.fn, self.ring, self.ql, self.xl, self.timeout, self.side = fn, ring, ql, xl, timeout, side
        self.my_q = ql.positions(ring.rank)

    def x_pos(self, step: int) -> torch.Tensor:
        """Positions of the keys held at ``step``: those of rank r - step."""
        return self.xl.positions((self.ring.rank - step) % self.ring.size)

    def lens(self):
        return dict(q_len=self.ql.length, x_len=self.xl.length)


def _assemble(r: Roles, tokens, keys):
    """Token inputs in declaration order: local queries, travelling keys."""
    it = iter(keys)
    return [t if r.is_query(k) else next(it) for k, t in enumerate(tokens)]


class _Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call: _Call, *tokens):
        r, ring = call.fn.roles, call.ring
        keys = [t for k, t in enumerate(tokens) if not r.is_query(k)]
        names = ", ".join(n for k, n in enumerate(r.tokens) if not r.is_query(k))
        out = lse = None
        with phase("forward"):
            for step in range(ring.size):
                moving = G.RingPass(keys, ring, call.timeout, names) if step < ring.size - 1 else None
                o, l = call.fn.local(*_assemble(r, tokens, keys), q_pos=call.my_q, x_pos=call.x_pos(step),
                                     **call.lens(), **call.side)
                if out is None:
                    out, lse = o, l
                else:
                    out, lse = merge([out, o], None if l is None else [lse, l])
                if moving is not None:
                    keys = moving.wait()
        out, lse = pad_rows(out, lse, call.my_q, call.ql.length, r.out_axis)
        ctx.call = call
        ctx.save_for_backward(*tokens, out, *([lse] if lse is not None else []))
        first_q = next(t for k, t in enumerate(tokens) if r.is_query(k))
        visible = out.to(first_q.dtype)
        return (visible, lse) if lse is not None else (visible,)

    @staticmethod
    def backward(ctx, *grads):
        call = ctx.call
        r, ring = call.fn.roles, call.ring
        saved = ctx.saved_tensors
        n = len(r.tokens)
        tokens, out = saved[:n], saved[n]
        lse = saved[n + 1] if len(saved) > n + 1 else None
        dO = grads[0] if grads[0] is not None else torch.zeros_like(out)
        dlse = grads[1] if len(grads) > 1 else None
        dO = zero_rows(dO, call.my_q, call.ql.length, r.out_axis)
        first_q = next(t for k, t in enumerate(tokens) if r.is_query(k))
        dO = dO.to(first_q.dtype)
        delta = row_delta(r, dO, out, dlse) if lse is not None else None
        keys = [t for k, t in enumerate(tokens) if not r.is_query(k)]
        knames = ", ".join(nm for k, nm in enumerate(r.tokens) if not r.is_query(k))
        dq = dkeys = None
        with phase("backward"):
            for step in range(ring.size):
                moving = G.RingPass(keys, ring, call.timeout, knames) if step < ring.size - 1 else None
                parts = call.fn.local_backward(*_assemble(r, tokens, keys), q_pos=call.my_q,
                                               x_pos=call.x_pos(step), **call.lens(), dO=dO, lse=lse,
                                               delta=delta, **call.side)
                pq = [p for k, p in enumerate(parts) if r.is_query(k)]
                pk = [p for k, p in enumerate(parts) if not r.is_query(k)]
                dq = pq if dq is None else [a + b for a, b in zip(dq, pq)]
                dkeys = pk if dkeys is None else [a + b for a, b in zip(dkeys, pk)]
                # the accumulators follow their keys; after the last step one
                # more pass brings each home
                dkeys = G.RingPass(dkeys, ring, call.timeout, f"gradients of {knames}",
                                        first_tag=G.MAX_TENSORS).wait() \
                    if ring.size > 1 else dkeys
                if moving is not None:
                    keys = moving.wait()
        iq, ik = iter(dq), iter(dkeys)
        result = [(next(iq) if r.is_query(k) else next(ik)).to(t.dtype) for k, t in enumerate(tokens)]
        return (None, *result)
