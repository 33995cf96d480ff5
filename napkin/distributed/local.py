"""The local attention a device runs on its blocks, and what the wrappers
need to know about the diagram.

``roles(diagram)`` reads a checked diagram and names the parts the
distributed wrappers move around: the query wire and the key wire (from the
devices level, else given), the token inputs (cut along one of the two
wires and moved between devices), the side inputs (passed whole to every
device), the value output O and the lse, and the merge family.  Anything the
merge rule cannot handle exactly is refused with a NapkinError.

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
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .. import ir
from ..errors import Diagnostic, NapkinError
from .evaluate import Evaluator
from .merge import partial_weight

_QPOS, _XPOS, _XVALID, _QLEN, _XLEN = "_qpos", "_xpos", "_xvalid", "_qlen", "_xlen"
_IDENTITY = {"sum": 0.0, "max": float("-inf"), "logsumexp": float("-inf"), "min": float("inf")}


def _refuse(message: str, loc: ir.Loc = ir.NOLOC, hint: Optional[str] = None) -> NapkinError:
    return NapkinError([Diagnostic(f"cannot distribute this diagram: {message}", loc, hint)])


# --------------------------------------------------------------------------
# Small IR helpers.
# --------------------------------------------------------------------------

def _map(e: ir.Expr, f) -> ir.Expr:
    """Rebuild e bottom-up, applying f to every rebuilt node."""
    if isinstance(e, ir.Unary):
        e = dataclasses.replace(e, operand=_map(e.operand, f))
    elif isinstance(e, ir.Binary):
        e = dataclasses.replace(e, lhs=_map(e.lhs, f), rhs=_map(e.rhs, f))
    elif isinstance(e, ir.Call):
        e = dataclasses.replace(e, args=tuple(_map(a, f) for a in e.args))
    elif isinstance(e, (ir.Reduce, ir.Normalize)):
        e = dataclasses.replace(e, body=_map(e.body, f))
    return f(e)


def _inline(d: ir.Diagram, e: ir.Expr) -> ir.Expr:
    """e with every box reference replaced by the box's expression."""
    def sub(n):
        if isinstance(n, ir.TensorRef) and isinstance(d.tensor(n.name), ir.Let):
            let = d.tensor(n.name)
            if n.wires is not None and tuple(n.wires) != ir.axis_wires(let.axes):
                raise _refuse(f"box {n.name} is read along other wires", n.loc)
            return _inline(d, let.expr)
        return n
    return _map(e, sub)


def _wires(d: ir.Diagram, e: ir.Expr) -> set[str]:
    """The wires an expression produces (inline first)."""
    if isinstance(e, ir.WireIndex):
        return {e.wire}
    if isinstance(e, ir.TensorRef):
        return set(e.wires if e.wires is not None else ir.axis_wires(d.tensor(e.name).axes))
    if isinstance(e, ir.Reduce):
        return _wires(d, e.body) - set(e.wires)
    out: set[str] = set()
    for child in _children(e):
        out |= _wires(d, child)
    return out


def _children(e: ir.Expr) -> list:
    if isinstance(e, ir.Unary):
        return [e.operand]
    if isinstance(e, ir.Binary):
        return [e.lhs, e.rhs]
    if isinstance(e, ir.Call):
        return list(e.args)
    if isinstance(e, (ir.Reduce, ir.Normalize)):
        return [e.body]
    return []


def _factors(e: ir.Expr) -> list:
    if isinstance(e, ir.Binary) and e.op == "*":
        return _factors(e.lhs) + _factors(e.rhs)
    return [e]


def _touches(e: ir.Expr, wire: str) -> bool:
    """Does e reduce or normalise along ``wire`` anywhere?"""
    return any((isinstance(n, ir.Reduce) and wire in n.wires) or (isinstance(n, ir.Normalize) and n.wire == wire)
               for n in ir.walk(e))


# --------------------------------------------------------------------------
# Roles.
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class Roles:
    diagram: ir.Diagram
    query: str                          # the query wire (grouped across devices)
    key: str                            # the key wire (grouped or streamed: merged)
    tokens: tuple[str, ...]             # token inputs, declaration order
    token_wire: tuple[str, ...]         # query or key, per token input
    token_axis: tuple[int, ...]         # the stored dimension of that wire, per token input
    side: tuple[str, ...]               # inputs passed whole to every device
    outputs: tuple[str, ...]            # the diagram's outputs, in order
    value: str                          # the output O (a sum over the key wire)
    lse: Optional[str]                  # the lse output, if the diagram has one
    family: str                         # "softmax" or "sum"
    score: Optional[ir.Expr]            # the softmax's argument (inlined)
    out_axis: int                       # O's stored dimension of the query wire
    value_axes: int                     # O's trailing dimensions that lse lacks (d)
    scheme: Optional[tuple[str, tuple[int, ...]]]  # from the devices level, if any

    def is_query(self, index: int) -> bool:
        return self.token_wire[index] == self.query


def _device_wires(d: ir.Diagram, value_expr) -> tuple:
    """(query, key, scheme) from the devices level, or Nones without one."""
    level = d.level("devices")
    if level is None or not level.tiles:
        return None, None, None
    groups = [t for t in level.tiles if t.kind == "group"]
    streams = [t for t in level.tiles if t.kind == "stream"]
    reduced = set(value_expr.wires) if isinstance(value_expr, ir.Reduce) else set()
    if streams:
        s = streams[0]
        if len(groups) != 1 or groups[0].size != s.size:
            raise _refuse("Ring Attention needs 'group Q across P' and 'stream X across P' with the same P",
                          s.loc)
        return groups[0].wire, s.wire, ("ring", (s.size,))
    if len(groups) == 2:
        keys = [g for g in groups if g.wire in reduced]
        if len(keys) != 1:
            raise _refuse("ATTENTION2D needs exactly one device-split wire reduced by the output", level.loc)
        qt = next(g for g in groups if g is not keys[0])
        return qt.wire, keys[0].wire, ("attention2d", (qt.size, keys[0].size))
    if len(groups) == 1:
        g = groups[0]
        if g.wire in reduced:
            return None, g.wire, ("attention2d", (1, g.size))
        return g.wire, None, ("attention2d", (g.size, 1))
    raise _refuse("the devices level splits more wires than ATTENTION2D or Ring Attention handles", level.loc)


def roles(d: ir.Diagram, query: Optional[str] = None, key: Optional[str] = None) -> Roles:
    """What the distributed wrappers need to know about a checked diagram."""
    inlined = {o.name: _inline(d, d.tensor(o.name).expr) if isinstance(d.tensor(o.name), ir.Let) else None
               for o in d.outputs}
    sums = [n for n, e in inlined.items() if isinstance(e, ir.Reduce) and e.op == "sum"]
    dq, dk, scheme = _device_wires(d, inlined[sums[0]] if len(sums) == 1 else None)
    query = query or dq or ("q" if d.wire("q") else None)
    key = key or dk or ("x" if d.wire("x") else None)
    if query is None or key is None or query == key:
        raise _refuse("name the query and key wires (query_wire=, key_wire=)", d.loc)

    # outputs: one value output O = sum over the key wire, optionally lse
    value = lse = score = None
    family = "sum"
    for name, e in inlined.items():
        if isinstance(e, ir.Reduce) and e.wires == (key,) and e.op == "logsumexp":
            if lse is not None:
                raise _refuse(f"two log-sum-exp outputs ({lse}, {name})")
            lse = name
        elif isinstance(e, ir.Reduce) and e.wires == (key,) and e.op == "sum":
            if value is not None:
                raise _refuse(f"two outputs reduce the key wire {key} ({value}, {name})")
            value = name
        else:
            raise _refuse(f"output {name} is neither a sum nor a logsumexp over the key wire {key}",
                          d.tensor(name).loc, "the partial states of other outputs have no exact merge")
    if value is None:
        raise _refuse(f"no output sums over the key wire {key}")
    body = inlined[value].body
    norms = [n for n in ir.walk(body) if isinstance(n, ir.Normalize)]
    if norms:
        soft = norms[0]
        facs = _factors(body)
        if (soft.op != "softmax" or soft.wire != key or sum(f == soft for f in facs) != 1
                or any(_touches(f, key) for f in facs if f != soft) or _touches(soft.body, key)):
            raise _refuse(f"{value} must be sum[{key}](softmax[{key}](S) * ...) with S free of reductions "
                          f"over {key}", d.tensor(value).loc)
        family, score = "softmax", soft.body
    elif _touches(body, key):
        raise _refuse(f"{value} reduces over {key} inside its sum", d.tensor(value).loc)
    if lse is not None:
        if family != "softmax" or inlined[lse].body != score:
            raise _refuse(f"{lse} must be the log-sum-exp of the same scores the softmax normalises",
                          d.tensor(lse).loc)
    for t in d.lets:
        if _touches(t.expr, query):
            raise _refuse(f"box {t.name} reduces over the query wire {query}, which is split across devices",
                          t.loc)

    # inputs: token inputs are floating and carry exactly one of the two wires
    tokens, twire, taxis, side = [], [], [], []
    reads = [n for t in d.lets for n in ir.walk(t.expr) if isinstance(n, ir.TensorRef)]
    for t in d.inputs:
        wires = ir.axis_wires(t.axes)
        split = [w for w in (query, key) if w in wires]
        if not split or t.dtype not in ir.FLOAT_DTYPES:
            side.append(t.name)
            continue
        if len(split) == 2:
            raise _refuse(f"input {t.name} carries both {query} and {key}", t.loc)
        if any(r.name == t.name and r.wires is not None and tuple(r.wires) != wires for r in reads):
            raise _refuse(f"input {t.name} is split along {split[0]} but read along other wires", t.loc)
        axis = next(i for i, a in enumerate(t.axes) if split[0] in a)
        if len(t.axes[axis]) != 1:
            raise _refuse(f"input {t.name} flattens {split[0]} with other wires", t.loc)
        tokens.append(t.name)
        twire.append(split[0])
        taxis.append(axis)
    if query not in twire or key not in twire:
        raise _refuse(f"need inputs along the query wire {query} and the key wire {key}")

    o = d.tensor(value)
    oaxes = o.axes
    rows = (_wires(d, score) - {key}) if score is not None else set()
    nvalue = 0
    while nvalue < len(oaxes) and rows and not set(oaxes[len(oaxes) - 1 - nvalue]) & rows:
        nvalue += 1
    if family == "softmax":
        if any(not set(a) & rows for a in oaxes[:len(oaxes) - nvalue]):
            raise _refuse(f"the value wires of {value} must be its last dimensions", o.loc)
        if lse is not None and tuple(d.tensor(lse).axes) != tuple(oaxes[:len(oaxes) - nvalue]):
            raise _refuse(f"{lse} must be laid out as {value} without its value wires", d.tensor(lse).loc)
    out_axis = next((i for i, a in enumerate(oaxes) if query in a), None)
    if out_axis is None or len(oaxes[out_axis]) != 1:
        raise _refuse(f"{value} must keep the query wire {query} as a dimension of its own", o.loc)
    return Roles(d, query, key, tuple(tokens), tuple(twire), tuple(taxis), tuple(side),
                 tuple(o.name for o in d.outputs), value, lse, family, score, out_axis, nvalue, scheme)


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
