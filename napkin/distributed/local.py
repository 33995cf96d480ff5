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

``KernelLocal`` runs napkin's generated Triton forward kernel instead (the
launcher's positions=, lengths= and out_dtype= options), and its
``backward`` the generated backward kernels (``default_backward`` picks it
for the wrappers); ``default_local``
picks it whenever the diagram compiles to an attention kernel, and it hands
a call to its ``EagerLocal`` when the kernel cannot serve it: float64
inputs (the reference path), inputs that require gradients (autograd of the
local, i.e. ``autograd_backward``), or a CPU without TRITON_INTERPRET=1.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import math
import os
import tempfile
from pathlib import Path
from typing import Callable

import torch

from .. import ir
from ..files import write_atomic
from .evaluate import Evaluator
from .merging import partial_weight
from .reading import Roles, _map, roles

__all__ = ["EagerLocal", "KernelLocal", "Roles", "autograd_backward", "default_backward", "default_local", "roles",
           "accumulator_dtype"]

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
                facs = ir.factors(n.body)
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


# --------------------------------------------------------------------------
# The generated Triton kernel as the local attention.
# --------------------------------------------------------------------------

_MODULES: dict[str, object] = {}     # emitted source digest -> imported module: one compile per process


def kernel_diagram(r: Roles) -> ir.Diagram:
    """The diagram the local kernel is compiled from: the roles' diagram,
    plus an lse output (logsumexp over the key wire of the softmax's scores)
    when a softmax diagram outputs none, since merging partial states needs
    it; the kernel computes it from the softmax's own running state."""
    d = r.diagram
    if r.family != "softmax" or r.lse is not None:
        return d
    taken = {t.name for t in d.inputs + d.lets} | {w.name for w in d.wires} | {d.name}
    name = next(n for n in ["lse"] + [f"lse{i}" for i in range(2, 100)] if n not in taken)
    o = d.tensor(r.value)
    let = ir.Let(name, o.axes[:len(o.axes) - r.value_axes], None, ir.Reduce("logsumexp", (r.key,), r.score))
    return dataclasses.replace(d, lets=d.lets + (let,), outputs=d.outputs + (ir.Output(name),))


class KernelLocal:
    """The local attention on napkin's generated forward kernel.

    Calls the launcher with positions={query: q_pos, key: x_pos},
    lengths={query: q_len, key: x_len} and out_dtype=float32, so masks and
    biases see global positions, |q| and |x| the global lengths, padded keys
    are masked, and the partial states come back in fp32.  Integer side
    inputs (document ids) are passed whole: the kernel reads them at the
    global positions.  ``options`` go to the launcher (block_q=16, ...).

    Calls the kernel cannot serve go to ``self.eager`` (see the module doc);
    ``reason`` is None when the diagram has a kernel, else why not, and
    ``launches`` counts the calls the kernel served.

    ``backward`` is local_backward on the generated backward kernels (the
    NAME_backward launcher with the same positions= / lengths=), given the
    merged lse and delta; ``backward_launches`` counts the calls they
    served.  Other calls (float64, no kernel backward, the sum family) are
    autograd of the eager local (``autograd_backward``).
    """

    def __init__(self, r: Roles, **options):
        # both the forward launcher and NAME_backward take these; positions=, lengths= and
        # out_dtype= are this class's own, and chunk= the backward lacks: found at the first
        # backward (chunk=16), the error left a Ring pass in flight and the group broken
        allowed = (f"block_{r.query}", f"block_{r.key}", "num_warps", "num_stages", "tma")
        bad = [k for k in options if k not in allowed]
        if bad:
            raise TypeError(f"KernelLocal takes the launch options {', '.join(allowed)}, not {', '.join(bad)} "
                            "(positions=, lengths= and out_dtype= it passes itself; the wrappers split the keys "
                            "themselves, so chunk= has no place)")
        self.r = r
        self.eager = EagerLocal(r)
        self.options = options
        self.launches = 0
        self.backward_launches = 0
        self._module = None
        self._eager_backward = autograd_backward(self.eager, r)
        self.diagram, self.text, self.reason = _kernel_source(r)

    def serves(self, tensors) -> bool:
        """Whether the kernel can run this call (else the eager local does)."""
        if self.reason is not None or not tensors:
            return False
        floats = [t for t in tensors if t.is_floating_point()]
        if any(t.dtype not in (torch.float16, torch.bfloat16, torch.float32) for t in floats):
            return False
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            return False
        device = tensors[0].device
        if device.type == "cpu":
            # Triton's interpreter; its bf16 tl.dot is wrong (tests/test_kernels.py)
            return os.environ.get("TRITON_INTERPRET") == "1" and all(t.dtype != torch.bfloat16 for t in floats)
        return device.type == "cuda"

    def __call__(self, *tokens, q_pos, x_pos, q_len, x_len, **side):
        r = self.r
        if not self.serves(list(tokens) + list(side.values())):
            return self.eager(*tokens, q_pos=q_pos, x_pos=x_pos, q_len=q_len, x_len=x_len, **side)
        if len(tokens) != len(r.tokens):
            raise ValueError(f"expected {len(r.tokens)} token inputs ({', '.join(r.tokens)}), got {len(tokens)}")
        given = dict(zip(r.tokens, tokens), **side)
        missing = [t.name for t in r.diagram.inputs if t.name not in given]
        if missing:
            raise ValueError(f"missing input(s) {', '.join(missing)}")
        module = self.module()
        launcher = getattr(module, self.diagram.name)
        dev = tokens[0].device
        outs = launcher(*(given[t.name] for t in r.diagram.inputs),
                        positions={r.query: q_pos.to(dev), r.key: x_pos.to(dev)},
                        lengths={r.query: int(q_len), r.key: int(x_len)}, out_dtype=torch.float32,
                        **self.options)
        named = dict(zip(module.OUTPUTS, outs if isinstance(outs, tuple) else (outs,)))
        self.launches += 1
        if r.family == "sum":
            return named[r.value], None
        return named[r.value], named[r.lse or self.diagram.outputs[-1].name]

    def backward(self, *tokens, q_pos, x_pos, q_len, x_len, dO, lse, delta, **side):
        """local_backward (see the module doc): the gradients of the tokens, fp32 (fp64 from the eager path)."""
        r = self.r
        launcher = self._backward_launcher() if self.serves(list(tokens) + list(side.values())) else None
        if launcher is None or lse is None or delta is None:
            return self._eager_backward(*tokens, q_pos=q_pos, x_pos=x_pos, q_len=q_len, x_len=x_len, dO=dO,
                                        lse=lse, delta=delta, **side)
        given = dict(zip(r.tokens, tokens), **side)
        names = [t.name for t in r.diagram.inputs]
        missing = [n for n in names if n not in given]
        if missing:
            raise ValueError(f"missing input(s) {', '.join(missing)}")
        dev = tokens[0].device
        # the row state is float32 whatever the tokens' dtype: lse and delta are the merged, global ones
        state = [t.to(dev, torch.float32).contiguous() for t in (dO, lse, delta)]
        grads = launcher(*(given[n] for n in names), *state, need=[n in r.tokens for n in names],
                         positions={r.query: q_pos.to(dev), r.key: x_pos.to(dev)},
                         lengths={r.query: int(q_len), r.key: int(x_len)}, **self.options)
        self.backward_launches += 1
        out = dict(zip(names, grads))
        return tuple(out[n] for n in r.tokens)

    def _backward_launcher(self):
        """NAME_backward where the module has one taking (inputs, dO, lse,
        delta): the softmax family's FlashAttention backward; else None."""
        import inspect

        if self.r.family != "softmax":
            return None
        fn = getattr(self.module(), f"{self.diagram.name}_backward", None)
        if fn is None:
            return None
        params = [p.name for p in inspect.signature(fn).parameters.values() if p.kind == p.POSITIONAL_OR_KEYWORD]
        state = params[len(self.diagram.inputs):]
        return fn if len(state) == 3 and state[-1] == "delta" else None

    def module(self):
        """The generated module (emitted and imported once per process; the
        file goes to a napkin-local folder of the temporary directory, since
        Triton reads a kernel's source from its file)."""
        from ..codegen import emit_module

        if self._module is not None:
            return self._module
        source = emit_module(self.diagram, source_text=self.text, source_path=f"{self.diagram.name}.ncd")
        digest = hashlib.sha256(source.encode()).hexdigest()[:24]
        if digest not in _MODULES:
            folder = Path(tempfile.gettempdir()) / "napkin-local"
            folder.mkdir(exist_ok=True)
            path = folder / f"{self.diagram.name}_{digest}.py"
            if not path.exists() or path.read_text(encoding="utf-8") != source:
                write_atomic(path, source)  # ranks of one job may write at once: each its own file, renamed
            spec = importlib.util.spec_from_file_location(f"_napkin_local_{digest}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            _MODULES[digest] = module
        self._module = _MODULES[digest]
        return self._module


def _kernel_source(r: Roles):
    """(checked kernel diagram, its text, None) or (None, None, why there is
    no kernel local for it)."""
    from .. import load_text
    from ..codegen.lower import lower
    from ..errors import NapkinError
    from ..printer import to_text

    try:
        text = to_text(kernel_diagram(r))
        d = load_text(text, f"{r.diagram.name}.ncd")
        plan = lower(d)
    except NapkinError as err:
        return None, None, str(err)
    if plan.family != "attention" or (plan.row, plan.col) != (r.query, r.key):
        return None, None, (f"the kernel blocks {plan.row} and streams {plan.col}; the local attention needs "
                            f"rows of {r.query} and a stream of {r.key}")
    fixed = [w for w in (r.query, r.key) if d.wire(w).size is not None]
    if fixed:
        return None, None, f"wire {fixed[0]} has a fixed size, so the kernel cannot take its global length"
    return d, text, None


def default_backward(local: Callable, r: Roles) -> Callable:
    """The local_backward the wrappers use unless given one: the generated
    backward kernels of a ``KernelLocal`` (which hands what they cannot
    serve to autograd of its eager local), else autograd of ``local``."""
    return local.backward if isinstance(local, KernelLocal) else autograd_backward(local, r)


def default_local(r: Roles):
    """The local attention the wrappers use unless given one: the generated
    kernel where the diagram has one (it hands float64 and autograd calls to
    the eager local), else the eager local."""
    k = KernelLocal(r)
    return k if k.reason is None else k.eager
