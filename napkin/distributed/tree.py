"""Decoding across devices: a few queries against a sharded key/value cache.

The diagram's mesh level groups the key wire across every device and leaves
the query wire whole (``level devices { group x across P }``): every device
holds all the query tokens (a handful when decoding) and 1/P of the cache,
dealt contiguously (device p holds keys p*n .. p*n + n - 1, n = ceil(N/P)).
Each device computes the partial state (O_p, lse_p) of all queries over its
keys, then the states are merged across devices by a butterfly, as in tree
attention (Shyam et al. 2024): in round k device p exchanges its state with
device p XOR 2^k and both merge the two (merging.py).  After log2 P rounds
every device holds the merged state of all P.  When P is not a power of
two, the devices beyond the largest power of two first send their state to
a partner, which folds it in, and get the result back at the end.

Both partners of a round merge in the same order (the lower part's state
first), so every device ends with bitwise the same O and lse.  One message
per round carries O and lse together in fp32 (fp64 for fp64 inputs):
log2 P messages of q_len * (H_q + h_q) * 4 bytes, where an all-gather of
keys would move the cache.  Forward only: decoding needs no gradients, and a
call with inputs that require them is refused on every rank.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from .. import ir
from . import groups as G
from .commcount import phase
from .common import attention_side, handshake, results, split_side
from .layouts import TokenLayout
from .local import EagerLocal, Roles, accumulator_dtype, roles
from .merging import merge_softmax, merge_sum

_TAG = 64     # point-to-point tags of the butterfly (the ring's use 0..15)


class TreeAttention:
    """Decoding for one diagram.

    >>> fn = TreeAttention(napkin.load("examples/decode.ncd"))
    >>> k_rows = fn.shard(K, None, N, dim=2)           # this rank's keys
    >>> O, lse = fn(Q, k_rows, v_rows, group=None, q_len=4, x_len=N)

    Query inputs are passed whole on every rank; key inputs hold this rank's
    contiguous rows (``shard``), padded to ceil(x_len / P).  The outputs are
    the whole O (and lse) on every rank.
    """

    def __init__(self, diagram: ir.Diagram, *, local: Optional[Callable] = None,
                 query_wire: Optional[str] = None, key_wire: Optional[str] = None):
        self.roles: Roles = roles(diagram, query_wire, key_wire)
        self.local = local or EagerLocal(self.roles)

    @property
    def tree_size(self) -> Optional[int]:
        s = self.roles.scheme
        return s[1][0] if s and s[0] == "tree" else None

    def layouts(self, parts: int, q_len: int, x_len: int) -> tuple[TokenLayout, TokenLayout]:
        return TokenLayout("contiguous", 1, q_len), TokenLayout("contiguous", parts, x_len)

    def __call__(self, *tokens, group=None, q_len: int, x_len: Optional[int] = None,
                 timeout: float = G.DEFAULT_TIMEOUT, **side):
        if x_len is None:
            raise ValueError("decoding needs x_len, the length of the key/value cache")
        tree = G.as_ring(group)
        if self.tree_size is not None and self.tree_size != tree.size:
            raise ValueError(f"the diagram asks for {self.tree_size} devices, got {tree.size} ranks")
        side = split_side(self.roles, side, tokens)
        ql, xl = self.layouts(tree.size, q_len, x_len)
        handshake(self.roles, "tree", tokens, side, ql, xl, (tree.group,), timeout, lambda p: f"rank {p}")
        if torch.is_grad_enabled() and any(t.requires_grad for t in tokens):
            raise ValueError("decoding across devices is forward only: pass inputs that do not require "
                             "gradients, or call it under torch.no_grad()")
        r = self.roles
        with phase("forward"):
            out, lse = self.local(*tokens, q_pos=ql.positions(0), x_pos=xl.positions(tree.rank),
                                  q_len=q_len, x_len=x_len, **attention_side(r, side))
            out, lse = butterfly(out, lse, tree, timeout)
        first_q = next(t for k, t in enumerate(tokens) if r.is_query(k))
        return results(r, out.to(first_q.dtype), lse, side)

    def shard(self, full: torch.Tensor, group, length: int, dim: int) -> torch.Tensor:
        """This rank's contiguous rows of a full key-side tensor (queries are
        passed whole)."""
        tree = G.as_ring(group)
        return TokenLayout("contiguous", tree.size, length).shard(full, tree.rank, dim)

    def gather(self, local: torch.Tensor, group, length: int, dim: int,
               timeout: float = G.DEFAULT_TIMEOUT) -> torch.Tensor:
        """The full tensor: an output (already whole on every rank) as is,
        key-side rows all-gathered."""
        tree = G.as_ring(group)
        lay = TokenLayout("contiguous", tree.size, length)
        if local.shape[dim] == length and lay.rows != length:
            return local
        # a share as long as the whole (one row over several ranks) is either: gathered, a
        # key-side tensor is whole, and an output is rank 0's copy (every rank holds one)
        x = G.all_gather_rows(local, dim, tree.group, timeout, "rows for gather (tree)")
        return lay.unshard(list(x.chunk(tree.size, dim)), dim)


def _exchange(state: torch.Tensor, peer: int, tree: G.Ring, timeout: float, what: str, send: bool = True,
              receive: bool = True) -> Optional[torch.Tensor]:
    """Send ``state`` to part ``peer`` and/or receive a state of the same
    shape from it, within ``timeout``."""
    other = dist.get_global_rank(tree.group, peer)
    got = torch.empty_like(state) if receive else None
    works = []
    if send:
        works.append(dist.isend(state, other, group=tree.group, tag=_TAG))
    if receive:
        works.append(dist.irecv(got, other, group=tree.group, tag=_TAG))
    for w in works:
        G.wait(w, timeout, what)
    return got


def butterfly(out: torch.Tensor, lse: Optional[torch.Tensor], tree: G.Ring, timeout: float):
    """All-reduce the partial states of the tree's parts with the merge rule;
    every part returns the same merged (O, lse)."""
    p, me = tree.size, tree.rank
    if p == 1:
        return out, lse
    acc = accumulator_dtype(out)
    shapes = [out.shape] + ([lse.shape] if lse is not None else [])
    state = torch.cat([out.to(acc).reshape(-1)] + ([lse.to(acc).reshape(-1)] if lse is not None else []))

    def merged(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
        lo, hi = _unpack(low, shapes), _unpack(high, shapes)
        if lse is None:
            return merge_sum(torch.stack([lo[0], hi[0]])).reshape(-1)
        o, l = merge_softmax(torch.stack([lo[0], hi[0]]), torch.stack([lo[1], hi[1]]))
        return torch.cat([o.reshape(-1), l.reshape(-1)])

    low = 1 << (p.bit_length() - 1)
    if me >= low:       # an extra part: fold into me - low, get the result back
        _exchange(state, me - low, tree, timeout, "the tree's fold", receive=False)
        state = _exchange(state, me - low, tree, timeout, "the tree's unfold", send=False)
    else:
        if me < p - low:
            state = merged(state, _exchange(state, me + low, tree, timeout, "the tree's fold", send=False))
        for k in range(low.bit_length() - 1):
            peer = me ^ (1 << k)
            theirs = _exchange(state, peer, tree, timeout, f"round {k} of the tree")
            state = merged(state, theirs) if me < peer else merged(theirs, state)
        if me < p - low:
            _exchange(state, me + low, tree, timeout, "the tree's unfold", receive=False)
    parts = _unpack(state, shapes)
    return parts[0], (parts[1] if lse is not None else None)


def _unpack(flat: torch.Tensor, shapes) -> list[torch.Tensor]:
    out, at = [], 0
    for shape in shapes:
        n = 1
        for s in shape:
            n *= s
        out.append(flat[at:at + n].reshape(shape))
        at += n
    return out
