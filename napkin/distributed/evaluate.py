"""A small eager evaluator of napkin expressions over named-dimension tensors.

A value is a torch tensor together with the wires its dimensions stand for.
Elementwise operations broadcast by wire name (weaving): both operands are
laid out along the union of their wires, size 1 where a wire is missing.
Reductions remove wires; softmax keeps its wire.  Following the language's
convention, a row whose scores are all -inf has softmax 0 and logsumexp -inf,
and both are computed so that autograd through such a row gives 0, not NaN.

Used by the distributed wrappers' eager local attention (local.py), where the
wire indices of q and x are replaced by position tensors before evaluation.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from .. import ir

NEG_INF = float("-inf")


def _lay_out(t: torch.Tensor, have: tuple, want: tuple) -> torch.Tensor:
    """t (dims ``have``) permuted to ``want``'s order, size 1 for absent wires."""
    order = [have.index(w) for w in want if w in have]
    t = t.permute(order) if have else t
    shape, it = [], iter(t.shape)
    for w in want:
        shape.append(next(it) if w in have else 1)
    return t.reshape(shape)


def _binary(op: str, a, b):
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if op == "/":
        return a / b
    if op == "//":
        return a // b   # floor division (torch's and Python's); the checker keeps the divisor positive
    if op == "%":
        return a % b    # its remainder, of the divisor's sign (torch's and Python's)
    if op == "^":
        return torch.pow(a, b)
    if op == "and":
        return torch.logical_and(a, b)
    if op == "or":
        return torch.logical_or(a, b)
    return {"<": torch.lt, "<=": torch.le, ">": torch.gt, ">=": torch.ge, "==": torch.eq, "!=": torch.ne}[op](a, b)


_UNARY_FNS = {
    "exp": torch.exp, "exp2": torch.exp2, "log": torch.log, "log2": torch.log2, "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt, "tanh": torch.tanh, "sigmoid": torch.sigmoid, "abs": torch.abs, "relu": torch.relu,
}


class Evaluator:
    """Evaluate expressions against ``env`` (name -> tensor laid out along
    ``layouts[name]``, one dimension per wire); ``dtype`` is the float type
    constants and wire sizes take."""

    def __init__(self, env: Mapping[str, torch.Tensor], layouts: Mapping[str, Sequence[str]], dtype, device):
        self.env, self.layouts, self.dtype, self.device = env, layouts, dtype, device
        self.sizes: dict[str, int] = {}
        for name, t in env.items():
            for w, n in zip(layouts[name], t.shape):
                if self.sizes.setdefault(w, n) != n:
                    raise ValueError(f"wire {w} has size {self.sizes[w]} here and {n} in {name}")

    def const(self, value) -> torch.Tensor:
        return torch.tensor(float(value), dtype=self.dtype, device=self.device)

    def run(self, e: ir.Expr, want: Sequence[str]) -> torch.Tensor:
        """e laid out along ``want`` (every wire of e must be in it), expanded."""
        t, have = self.eval(e)
        extra = set(have) - set(want)
        if extra:
            raise ValueError(f"the result has wires {sorted(extra)} beyond {tuple(want)}")
        return _lay_out(t, have, tuple(want)).expand(*(self.sizes[w] for w in want))

    def eval(self, e: ir.Expr):
        """(tensor, wires) for e."""
        if isinstance(e, ir.Num):
            return self.const(e.value), ()
        if isinstance(e, ir.WireIndex):
            return torch.arange(self.sizes[e.wire], dtype=self.dtype, device=self.device), (e.wire,)
        if isinstance(e, ir.WireSize):
            return self.const(self.sizes[e.wire]), ()
        if isinstance(e, ir.TensorRef):
            wires = tuple(e.wires) if e.wires is not None else tuple(self.layouts[e.name])
            return self.env[e.name], wires
        if isinstance(e, ir.Unary):
            t, w = self.eval(e.operand)
            return (torch.logical_not(t) if e.op == "not" else -t), w
        if isinstance(e, (ir.Binary, ir.Call)):
            args = (e.lhs, e.rhs) if isinstance(e, ir.Binary) else e.args
            vals = [self.eval(a) for a in args]
            wires = tuple(dict.fromkeys(w for _, ws in vals for w in ws))
            ts = [_lay_out(t, ws, wires) for t, ws in vals]
            if isinstance(e, ir.Binary):
                return _binary(e.op, *ts), wires
            return self._call(e.fn, ts), wires
        if isinstance(e, ir.Reduce):
            return self._reduce(e)
        if isinstance(e, ir.Normalize):
            t, w = self.eval(e.body)
            if e.wire not in w:
                t, w = t.unsqueeze(-1).expand(*t.shape, self.sizes[e.wire]), w + (e.wire,)
            dim = w.index(e.wire)
            dead = t.amax(dim, keepdim=True) == NEG_INF
            safe = torch.where(dead, torch.zeros_like(t), t)   # softmax of zeros: finite gradients
            return torch.where(dead, torch.zeros_like(t), torch.softmax(safe, dim)), w
        raise ValueError(f"cannot evaluate {type(e).__name__}")

    def _call(self, fn: str, ts):
        if fn in _UNARY_FNS:
            return _UNARY_FNS[fn](ts[0])
        if fn == "max":
            return torch.maximum(*ts)
        if fn == "min":
            return torch.minimum(*ts)
        if fn == "where":
            return torch.where(ts[0].bool(), ts[1], ts[2])
        raise ValueError(f"unknown function {fn}")

    def _reduce(self, e: ir.Reduce):
        if e.op == "sum" and isinstance(e.body, ir.Binary) and e.body.op == "*":
            return self._contract(e)
        t, w = self.eval(e.body)
        for extra in e.wires:              # a body constant along a reduced wire
            if extra not in w:
                t, w = t.unsqueeze(-1).expand(*t.shape, self.sizes[extra]), w + (extra,)
        dims = tuple(w.index(x) for x in e.wires)
        rest = tuple(x for x in w if x not in e.wires)
        if e.op == "sum":
            return t.sum(dims), rest
        if e.op == "max":
            return t.amax(dims), rest
        if e.op == "min":
            return t.amin(dims), rest
        if e.op == "logsumexp":
            dead = t.amax(dims, keepdim=True) == NEG_INF
            safe = torch.where(dead, torch.zeros_like(t), t)
            lse = torch.logsumexp(safe, dims)
            dead = dead.reshape(lse.shape) if lse.dim() else dead.reshape(())
            return torch.where(dead, self.const(NEG_INF).to(lse.dtype), lse), rest
        raise ValueError(f"unknown reduction {e.op}")



    def _contract(self, e: ir.Reduce):
        """sum over wires of a product, as one einsum: the product of all the
        factors' wires (b, h, q, x, d for Q * K) is never materialised."""
        factors, stack = [], [e.body]
        while stack:
            f = stack.pop()
            if isinstance(f, ir.Binary) and f.op == "*":
                stack += [f.rhs, f.lhs]
            else:
                factors.append(f)
        vals = [self.eval(f) for f in factors]
        wires = tuple(dict.fromkeys(w for _, ws in vals for w in ws))
        letters = {w: chr(ord("a") + i) for i, w in enumerate(wires)}
        if len(letters) > 26:
            raise ValueError("too many wires for one contraction")
        dtype = vals[0][0].dtype
        for t, _ in vals[1:]:
            dtype = torch.promote_types(dtype, t.dtype)
        if dtype == torch.bool:
            dtype = self.dtype
        keep = tuple(w for w in wires if w not in e.wires)
        spec = ",".join("".join(letters[w] for w in ws) for _, ws in vals) + "->" + "".join(letters[w] for w in keep)
        out = torch.einsum(spec, *[t.to(dtype) for t, _ in vals])
        for w in e.wires:                  # a reduced wire no factor has: each term counted |w| times
            if w not in wires:
                out = out * self.sizes[w]
        return out, keep
