"""ATTENTION2D (Elango 2025) on torch.distributed: a grid of R x C devices.

The query wire is grouped across the R grid rows and the key wire across the
C grid columns.  Tokens are dealt cyclically over all P = R*C devices
(token t on device t mod P, device (i, j) = part i*C + j), so the queries of
grid row i are exactly the tokens held by that row's devices and the keys of
grid column j those held by that column's devices.

Forward, on device (i, j):
  1. all-gather the query-side inputs (Q) along the grid row and the key-side
     inputs (K, V) along the grid column;
  2. run the local attention on (query block i, key block j) with the global
     positions of the gathered rows: a partial state (O_ij, lse_ij);
  3. all-to-all the partial states along the row (each device receives the
     C partials of its own rows) and merge them (merging.py, fp32);
  4. padding rows read O = 0, lse = -inf.
Backward, from dO (and dlse when lse is an output):
  1. delta = rowsum(dO * O) - dlse on the device's own rows;
  2. all-gather Q, dO, lse and delta along the row, K and V along the column;
  3. the local backward gives this device's share of dQ, dK, dV;
  4. reduce-scatter dQ along the row and dK, dV along the column (sums).
A reduce-scatter is an all-to-all plus a local sum where the backend has no
good one (gloo).  Partial states and gradient partials travel in the
accumulator dtype; Q, K, V and dO in their own.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .. import ir
from . import groups as G
from .commcount import phase
from .common import attention_side, handshake, results, save_and_show, saved_state, split_side, upstream_rows
from .layouts import TokenLayout
from .local import Roles, default_backward, default_local, roles
from .merging import merge_softmax, merge_sum


class Attention2D:
    """ATTENTION2D for one diagram.

    >>> fn = Attention2D(napkin.load("examples/attention_2d.ncd"))
    >>> O, lse = fn(q, k, v, grid=init_device_mesh("cpu", (2, 2)), q_len=N)

    Each rank passes its own rows in the cyclic layout (``shard``), padded
    to ceil(N / P) rows; ``q_len`` / ``x_len`` are the true lengths.
    ``local`` / ``local_backward`` follow the protocol of local.py; the default
    local runs the generated Triton kernel (float64 and unsupported diagrams:
    the eager evaluation), the default backward its generated backward kernels
    (float64 and the rest: autograd of the eager local).
    """

    def __init__(self, diagram: ir.Diagram, *, local: Optional[Callable] = None,
                 local_backward: Optional[Callable] = None, query_wire: Optional[str] = None,
                 key_wire: Optional[str] = None):
        self.roles: Roles = roles(diagram, query_wire, key_wire)
        self.local = local or default_local(self.roles)
        self.local_backward = local_backward or default_backward(self.local, self.roles)

    @property
    def grid_shape(self) -> Optional[tuple[int, int]]:
        """(R, C) from the diagram's devices level, if it has one."""
        s = self.roles.scheme
        return s[1] if s and s[0] == "attention2d" else None

    def layouts(self, parts: int, q_len: int, x_len: Optional[int] = None) -> tuple[TokenLayout, TokenLayout]:
        return TokenLayout("cyclic", parts, q_len), TokenLayout("cyclic", parts, q_len if x_len is None else x_len)

    def make_grid(self) -> G.Grid2D:
        """The diagram's grid, placed as its mesh levels say (with a nodes
        level, each node of consecutive ranks holds its block of the grid).
        Collective: every rank of the default group calls it."""
        if self.grid_shape is None:
            raise ValueError("the diagram has no devices level: build the grid with new_grid(R, C)")
        r, c = self.grid_shape
        return G.new_grid(r, c, G.grid_ranks(r, c, self.roles.per_node))

    def __call__(self, *tokens, grid, q_len: int, x_len: Optional[int] = None,
                 timeout: float = G.DEFAULT_TIMEOUT, **side):
        g = G.as_grid(grid)
        if self.grid_shape is not None and self.grid_shape != (g.rows, g.cols):
            raise ValueError(f"the diagram asks for a {self.grid_shape[0]} x {self.grid_shape[1]} grid, "
                             f"got {g.rows} x {g.cols}")
        side = split_side(self.roles, side, tokens)
        whole, side = side, attention_side(self.roles, side)
        ql, xl = self.layouts(g.parts, q_len, x_len)
        handshake(self.roles, "attention2d", tokens, whole, ql, xl, (g.row_group, g.col_group), timeout,
                  lambda p: f"device {divmod(p, g.cols)}")
        outs = _Function.apply(_Call(self, g, ql, xl, timeout, side), *tokens)
        return results(self.roles, outs[0], outs[1] if len(outs) > 1 else None, whole,
                       ql.positions(g.part) < q_len)

    # -- shard / gather helpers ------------------------------------------------
    def shard(self, full: torch.Tensor, grid, length: int, dim: int) -> torch.Tensor:
        """This device's rows of a full tensor (``length`` tokens along ``dim``)."""
        g = G.as_grid(grid)
        return TokenLayout("cyclic", g.parts, length).shard(full, g.part, dim)

    def gather(self, local: torch.Tensor, grid, length: int, dim: int,
               timeout: float = G.DEFAULT_TIMEOUT) -> torch.Tensor:
        """The full tensor on every device, from every device's rows."""
        return gather_2d(local, grid, length, dim, timeout)


def gather_2d(local: torch.Tensor, grid, length: int, dim: int, timeout: float = G.DEFAULT_TIMEOUT):
    """All-gather cyclic-layout rows over a grid (row, then column: parts end
    in i*C + j order) and put them back in token order."""
    g = G.as_grid(grid)
    lay = TokenLayout("cyclic", g.parts, length)
    x = G.all_gather_rows(local, dim, g.row_group, timeout, "rows for gather (grid row)")
    x = G.all_gather_rows(x, dim, g.col_group, timeout, "rows for gather (grid column)")
    return lay.unshard(list(x.chunk(g.parts, dim)), dim)


class _Call:
    """Everything one call needs besides the tensors (autograd passes it through)."""

    def __init__(self, fn: Attention2D, g: G.Grid2D, ql: TokenLayout, xl: TokenLayout, timeout: float, side):
        self.fn, self.g, self.ql, self.xl, self.timeout, self.side = fn, g, ql, xl, timeout, side
        self.my_q = ql.positions(g.part)
        # positions of the gathered blocks, in all-gather (group rank) order
        self.q_pos = torch.cat([ql.positions(g.i * g.cols + j) for j in range(g.cols)])
        self.x_pos = torch.cat([xl.positions(i * g.cols + g.j) for i in range(g.rows)])

    def gather_tokens(self, tokens, query_side: bool):
        r, g = self.fn.roles, self.g
        out = []
        for k, t in enumerate(tokens):
            if r.is_query(k) != query_side:
                out.append(None)
                continue
            grp, where = (g.row_group, f"grid row {g.i}") if query_side else (g.col_group, f"grid column {g.j}")
            out.append(G.all_gather_rows(t, r.token_axis[k], grp, self.timeout, f"{r.tokens[k]} along {where}"))
        return out

    def lens(self):
        return dict(q_len=self.ql.length, x_len=self.xl.length)


def _to_front(t: torch.Tensor, axis: int, k: int) -> torch.Tensor:
    """[k * n rows along axis] -> [k, n, rest...] (rows first)."""
    x = t.movedim(axis, 0)
    return x.reshape((k, x.shape[0] // k) + tuple(x.shape[1:]))


class _Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call: _Call, *tokens):
        with phase("forward"):
            qs, ks = call.gather_tokens(tokens, True), call.gather_tokens(tokens, False)
            gathered = [a if a is not None else b for a, b in zip(qs, ks)]
            out, lse = call.fn.local(*gathered, q_pos=call.q_pos, x_pos=call.x_pos, **call.lens(), **call.side)
            out, lse = _merge_row(call, out, lse)
        return save_and_show(ctx, call, tokens, out, lse)

    @staticmethod
    def backward(ctx, *grads):
        call = ctx.call
        r, g = call.fn.roles, call.g
        tokens, out, lse = saved_state(ctx, len(r.tokens))
        dO, delta = upstream_rows(call, grads, tokens, out, lse)   # dO travels in O's visible dtype
        with phase("backward"):
            ax, grp, where = r.out_axis, g.row_group, f"grid row {g.i}"
            dO_g = G.all_gather_rows(dO, ax, grp, call.timeout, f"dO along {where}")
            lse_g = delta_g = None
            if lse is not None:
                lse_g = G.all_gather_rows(lse, ax, grp, call.timeout, f"lse along {where}")
                delta_g = G.all_gather_rows(delta, ax, grp, call.timeout, f"delta along {where}")
            qs, ks = call.gather_tokens(tokens, True), call.gather_tokens(tokens, False)
            gathered = [a if a is not None else b for a, b in zip(qs, ks)]
            parts = call.fn.local_backward(*gathered, q_pos=call.q_pos, x_pos=call.x_pos, **call.lens(),
                                           dO=dO_g, lse=lse_g, delta=delta_g, **call.side)
            result = []
            for k, part in enumerate(parts):
                grp2, where2 = (g.row_group, f"grid row {g.i}") if r.is_query(k) else \
                    (g.col_group, f"grid column {g.j}")
                mine = G.reduce_scatter_rows(part, r.token_axis[k], grp2, call.timeout,
                                             f"d{r.tokens[k]} along {where2}")
                result.append(mine.to(tokens[k].dtype))
        return (None, *result)


def _merge_row(call: _Call, out: torch.Tensor, lse: Optional[torch.Tensor]):
    """Send each row-mate the partial state of its rows, merge what arrives."""
    r, g = call.fn.roles, call.g
    c = g.cols
    if c == 1:
        return out, lse
    o = _to_front(out, r.out_axis, c)                        # [C, n, rest]
    flat = [o.reshape(c, -1)]
    if lse is not None:
        l = _to_front(lse, r.out_axis, c)
        flat.append(l.reshape(c, -1))
    buf = torch.cat(flat, 1)
    got = G.all_to_all_rows(buf, g.row_group, call.timeout, f"partial states along grid row {g.i}")
    o_in = got[:, :flat[0].shape[1]].reshape(o.shape)
    if lse is None:
        merged = merge_sum(o_in)
        return merged.movedim(0, r.out_axis), None
    l_in = got[:, flat[0].shape[1]:].reshape(l.shape)
    merged, mlse = merge_softmax(o_in, l_in)
    return merged.movedim(0, r.out_axis), mlse.movedim(0, r.out_axis)
