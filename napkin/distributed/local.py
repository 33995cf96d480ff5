"""The local attention a device runs on its blocks.

What the wrappers read off the diagram (``roles``: query and key wires,
token and side inputs, O, lse, the merge family, the scheme) lives in
reading.py, which needs no torch; it is re-exported here.

The LOCAL ATTENTION protocol (what a Triton kernel must also offer):

    local(*tokens, q_pos, x_pos, q_len, x_len, **side) -> (O, lse)

``tokens`` are the token inputs in declaration order (Q, K, V), each holding
some rows of its token wire; q_pos / x_pos are int64 tensors giving the
GLOBAL position of every local row (masks such as x <= q compare global
positions); rows at positions >= q_len / x_len are padding (padded keys must
not contribute; padded query rows may hold anything).  O is the partial
output over the given keys in the accumulator dtype (fp32, fp64 for fp64
inputs) and lse its log-sum-exp (None for the sum family).

    local_backward(*tokens, q_pos, x_pos, q_len, x_len, dO, lse, delta, **side)
        -> gradients of the tokens (accumulator dtype)

where lse is the MERGED lse of the query rows and delta = rowsum(dO * O) -
dlse with the merged O: the FlashAttention backward, given the global
statistics, produces exactly this device's share of the gradients.

``EagerLocal`` evaluates the diagram's own boxes with torch (float64 capable)
by rewriting the expressions: a wire index q or x becomes the position tensor,
|q| and |x| become the global lengths, and every reduction over the key wire
skips padded keys.  ``autograd_backward`` derives local_backward from any
local by autograd, so a kernel without its own backward still trains.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch

from .. import ir
from .evaluate import Evaluator
from .merging import partial_weight
from .reading import Roles, _factors, _map, roles

__all__ = ["EagerLocal", "Roles", "autograd_backward", "roles", "accumulator_dtype"]

_QPOS, _XPOS, _XVALID, _QLEN, _XLEN = "_qpos", "_xpos", "_xvalid", "_qlen", "_xlen"
_IDENTITY = {"sum": 0.0, "max": float("-inf"), "logsumexp": float("-inf"), "min": float("inf")}


# --------------------------------------------------------------------------
# The eager local attention.
# --------------------------------------------------------------------------

def accumulator_dtype(*tensors) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


class EagerLocal:
    """The diagram evaluated with torch on one device's blocks (see module doc)."""

    def __init__(self, r: Roles):
        self.r = r
        d = r.diagram
        self.layouts = {t.name: ir.axis_wires(t.axes) for t in d.inputs + d.lets}
        self.layouts.update({_QPOS: (r.query,), _XPOS: (r.key,), _XVALID: (r.key,), _QLEN: (), _XLEN: ()})
        self.side_reads: dict[str, tuple[str, tuple[str, ...]]] = {}
        self.lets = [(t.name, self._rewrite(t.expr)) for t in d.lets]
        if r.family == "softmax" and r.lse is None:
            self.lse_expr = self._rewrite(ir.Reduce("logsumexp", (r.key,), r.score))
        else:
            self.lse_expr = None

    def _rewrite(self, e: ir.Expr) -> ir.Expr:
        r = self.r

        def sub(n):
            if isinstance(n, ir.WireIndex) and n.wire in (r.query, r.key):
                return ir.TensorRef(_QPOS if n.wire == r.query else _XPOS)
            if isinstance(n, ir.WireSize) and n.wire in (r.query, r.key):
                return ir.TensorRef(_QLEN if n.wire == r.query else _XLEN)
            if isinstance(n, ir.TensorRef) and n.name in r.side:
                wires = tuple(n.wires) if n.wires is not None else self.layouts[n.name]
                alias = f"_side_{n.name}_" + "_".join(wires)
                self.side_reads[alias] = (n.name, wires)
                self.layouts[alias] = wires
                return ir.TensorRef(alias)
            valid = ir.TensorRef(_XVALID)
            if isinstance(n, ir.Reduce) and r.key in n.wires:
                facs = _factors(n.body)
                if n.op == "sum" and len(facs) > 1:
                    # mask one factor along the key wire, so the sum stays a
                    # product (one einsum, nothing of size q*x*d is built);
                    # padded rows of the other factors are zeros, finite
                    k = next((i for i, f in enumerate(facs) if r.key in self._wires_of(f)), None)
                    if k is not None:
                        facs[k] = ir.Call("where", (valid, facs[k], ir.Num(0.0)))
                        body = facs[0]
                        for f in facs[1:]:
                            body = ir.Binary("*", body, f)
                        return dataclasses.replace(n, body=body)
                return dataclasses.replace(n, body=ir.Call("where", (valid, n.body, ir.Num(_IDENTITY[n.op]))))
            if isinstance(n, ir.Normalize) and n.wire == r.key:
                return dataclasses.replace(n, body=ir.Call("where", (valid, n.body, ir.Num(float("-inf")))))
            return n
        return _map(e, sub)

    def _wires_of(self, e: ir.Expr) -> set[str]:
        """Wires of a (rewritten) expression: position tensors count as their wire."""
        out: set[str] = set()
        for n in ir.walk(e):
            if isinstance(n, ir.TensorRef):
                out |= set(n.wires if n.wires is not None else self.layouts.get(n.name, ()))
            elif isinstance(n, ir.WireIndex):
                out.add(n.wire)
        return out

    def __call__(self, *tokens, q_pos, x_pos, q_len, x_len, **side):
        r, d = self.r, self.r.diagram
        if len(tokens) != len(r.tokens):
            raise ValueError(f"expected {len(r.tokens)} token inputs ({', '.join(r.tokens)}), got {len(tokens)}")
        acc = accumulator_dtype(*tokens)
        sizes = {w.name: w.size for w in d.wires if w.size is not None}
        given = dict(zip(r.tokens, tokens))
        given.update(side)
        missing = [n for n in r.tokens + r.side if n not in given]
        if missing:
            raise ValueError(f"missing input(s) {', '.join(missing)}")
        lens = {r.query: q_len, r.key: x_len}
        pairs = [(given[n], d.tensor(n), lens if n in r.side else {}) for n in r.tokens + r.side]
        _bind(pairs, sizes)
        env = {}
        for t, decl, glob in pairs:
            env[decl.name] = _unflatten(t.to(acc) if t.is_floating_point() else t, decl, sizes, glob)
        for alias, (name, wires) in self.side_reads.items():
            t = env[name]
            for dim, w in enumerate(wires):
                if w in (r.query, r.key):
                    pos = q_pos if w == r.query else x_pos
                    n = q_len if w == r.query else x_len
                    t = t.index_select(dim, pos.clamp(max=n - 1).to(t.device))
            env[alias] = t
        for name in r.side:
            env.pop(name)
        dev = tokens[0].device
        env[_QPOS] = q_pos.to(dev, acc)
        env[_XPOS] = x_pos.to(dev, acc)
        env[_XVALID] = (x_pos < x_len).to(dev)
        env[_QLEN] = torch.tensor(float(q_len), dtype=acc, device=dev)
        env[_XLEN] = torch.tensor(float(x_len), dtype=acc, device=dev)
        for name, expr in self.lets:
            env[name] = Evaluator(env, self.layouts, acc, dev).run(expr, self.layouts[name])
        o = d.tensor(r.value)
        out = env[r.value].reshape(_stored_shape(env[r.value], o)).to(acc)
        if r.family == "sum":
            return out, None
        rows_axes = o.axes[:len(o.axes) - r.value_axes]
        if self.lse_expr is not None:
            lse = Evaluator(env, self.layouts, acc, dev).run(self.lse_expr, ir.axis_wires(rows_axes))
        else:
            lse = env[r.lse]
        return out, lse.reshape(out.shape[:out.dim() - r.value_axes]).to(acc)


def _bind(pairs, sizes: dict) -> None:
    """Bind wire sizes from tensor shapes, solving flattened axes such as
    (hk g) once all but one of their wires are known (repeat until stable).
    Side inputs see their token wires at the global lengths, not bound here."""
    changed = True
    while changed:
        changed = False
        for t, decl, glob in pairs:
            if t.dim() != len(decl.axes):
                raise ValueError(f"{decl.name} has {t.dim()} dimensions; its layout has {len(decl.axes)}")
            for axis, n in zip(decl.axes, t.shape):
                known = {w: glob.get(w, sizes.get(w)) for w in axis}
                unknown = [w for w in axis if known[w] is None]
                if len(unknown) == 1:
                    rest = math.prod(known[w] for w in axis if w != unknown[0])
                    if n % rest:
                        raise ValueError(f"{decl.name}: {n} is not a multiple of {rest} along ({' '.join(axis)})")
                    sizes[unknown[0]] = n // rest
                    changed = True


def _unflatten(t: torch.Tensor, decl: ir.Input, sizes: dict, glob: dict) -> torch.Tensor:
    """t reshaped to one dimension per wire, its sizes checked."""
    shape = []
    for axis, n in zip(decl.axes, t.shape):
        wires = [glob.get(w, sizes.get(w)) for w in axis]
        if None in wires:
            raise ValueError(f"cannot tell the sizes of ({' '.join(axis)}) from {decl.name}'s shape")
        if math.prod(wires) != n:
            raise ValueError(f"{decl.name} has size {n} along ({' '.join(axis)}), expected {math.prod(wires)}")
        shape += wires
    return t.reshape(shape)


def _stored_shape(t: torch.Tensor, decl) -> tuple[int, ...]:
    """The flattened (stored) shape of an unflattened result."""
    shape, i = [], 0
    for axis in decl.axes:
        n = 1
        for _ in axis:
            n *= t.shape[i]
            i += 1
        shape.append(n)
    return tuple(shape)


def autograd_backward(local: Callable, r: Roles) -> Callable:
    """local_backward (see the module doc) from any differentiable local.

    Softmax family: with w = exp(lse_j - lse) the share of this device's
    partial state in the merged one, the loss reaches the partial output as
    w * dO and the partial lse as w * (rowsum(dO * O_j) - delta), where
    delta = rowsum(dO * O) - dlse; autograd of the local does the rest.
    Sum family: the partial output simply receives dO.
    """
    def local_backward(*tokens, q_pos, x_pos, q_len, x_len, dO, lse, delta, **side):
        acc = accumulator_dtype(*tokens)
        with torch.enable_grad():
            leaves = [t.detach().to(acc).requires_grad_(True) for t in tokens]
            out, lse_j = local(*leaves, q_pos=q_pos, x_pos=x_pos, q_len=q_len, x_len=x_len, **side)
            dO = dO.to(out.dtype)
            if r.family == "softmax":
                w = partial_weight(lse_j.detach(), lse.to(lse_j.dtype))
                wv = w.reshape(w.shape + (1,) * r.value_axes)
                value_dims = tuple(range(out.dim() - r.value_axes, out.dim()))
                dot = (dO * out.detach()).sum(value_dims) if value_dims else dO * out.detach()
                grads = torch.autograd.grad([out, lse_j], leaves, [wv * dO, w * (dot - delta.to(w.dtype))],
                                            allow_unused=True)
            else:
                grads = torch.autograd.grad([out], leaves, [dO], allow_unused=True)
        return tuple(torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves))
    return local_backward
