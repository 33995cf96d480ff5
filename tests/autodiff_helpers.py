"""``evaluate``: the reference meaning of an IR expression in float64, wires
matched by name (a tiny interpreter of the IR), which tests/test_autodiff.py
and tests/test_grad_plan.py take as ground truth; the expression builders
N, B, C, and a diagram's test sizes and random float64 inputs."""
from __future__ import annotations

import torch

from napkin import ir

F64 = torch.float64
INF = float("inf")

# --------------------------------------------------------------------------
# evaluate: the reference meaning of an expression, wires matched by name.
# (A tiny interpreter of the IR in float64, used as the ground truth below.)
# --------------------------------------------------------------------------

def evaluate(expr, env, layouts, wires, sizes=None):
    """Evaluate ``expr`` with torch; the result has one dimension per wire in ``wires``.

    env maps tensor names to torch tensors with one dimension per wire of
    ``layouts[name]`` (flattened axes such as (hk g) unflattened).  Wire sizes
    come from those shapes, or ``sizes`` for a wire no tensor has.  A wire
    index is 0..size-1 (float64).  Elementwise operations broadcast by wire
    name; softmax of a fully masked (all -inf) row is 0 and its logsumexp is
    -inf, computed so that autograd through them gives 0, not NaN.
    """
    size = dict(sizes or {})
    for name, t in env.items():
        if name in layouts:
            for w, n in zip(layouts[name], t.shape):
                if size.setdefault(w, n) != n:
                    raise ValueError(f"wire {w} has size {size[w]} and {n} ({name})")
    t, have = _Eval(env, layouts, size).run(expr)
    wires = tuple(wires)
    if not set(have) <= set(wires):
        raise ValueError(f"the result has wires {have}, more than the {wires} asked for")
    return _align(t, have, wires).expand(*(size[w] for w in wires))


def _align(t, have: tuple, want: tuple):
    """t (dimensions ``have``) permuted into ``want``'s order, size 1 where it lacks a wire."""
    present = [w for w in want if w in have]
    if have:
        t = t.permute([have.index(w) for w in present])
    return t.reshape([t.shape[present.index(w)] if w in have else 1 for w in want])


class _Eval:
    def __init__(self, env, layouts, size):
        self.env, self.layouts, self.size = env, layouts, size

    def run(self, e):
        """(tensor, its wires) for e."""
        f64 = torch.float64
        if isinstance(e, ir.Num):
            return torch.tensor(float(e.value), dtype=f64), ()
        if isinstance(e, ir.WireIndex):
            return torch.arange(self.size[e.wire], dtype=f64), (e.wire,)
        if isinstance(e, ir.WireSize):
            return torch.tensor(float(self.size[e.wire]), dtype=f64), ()
        if isinstance(e, ir.TensorRef):
            declared = self.layouts[e.name]
            wires = e.wires if e.wires is not None else declared
            if len(wires) != len(declared) or len(set(wires)) != len(wires):
                raise ValueError(f"cannot read {e.name} {declared} along {wires}")
            t = self.env[e.name]
            for i, (w, step) in enumerate(zip(wires, e.steps or ())):   # keep[.., q // 64, ..]: a row per q
                if step != 1:
                    t = t.index_select(i, torch.arange(self.size[w]) // step)
            return t, tuple(wires)
        if isinstance(e, ir.Unary):
            t, w = self.run(e.operand)
            return (-t if e.op == "-" else torch.logical_not(t)), w
        if isinstance(e, (ir.Binary, ir.Call)):
            parts = [self.run(a) for a in ((e.lhs, e.rhs) if isinstance(e, ir.Binary) else e.args)]
            wires = tuple(dict.fromkeys(w for _, ws in parts for w in ws))
            args = [_align(t, ws, wires) for t, ws in parts]
            return self._apply(e.op if isinstance(e, ir.Binary) else e.fn, args), wires
        if isinstance(e, ir.Reduce):
            t, w = self.run(e.body)
            for extra in (x for x in e.wires if x not in w):  # summing a constant along a wire
                t, w = t.unsqueeze(-1).expand(*t.shape, self.size[extra]), w + (extra,)
            dims = [w.index(x) for x in e.wires]
            rest = tuple(x for x in w if x not in e.wires)
            if e.op in ("sum", "max", "min"):
                return getattr(t, {"sum": "sum", "max": "amax", "min": "amin"}[e.op])(dims), rest
            dead, safe = self._dead_rows(t, dims)
            lse = torch.logsumexp(safe, dims)
            return torch.where(dead.reshape(lse.shape), float("-inf"), lse), rest
        if isinstance(e, ir.Normalize):
            t, w = self.run(e.body)
            dead, safe = self._dead_rows(t, [w.index(e.wire)])
            return torch.where(dead, 0.0, torch.softmax(safe, w.index(e.wire))), w
        raise ValueError(f"cannot evaluate {type(e).__name__}")  # pragma: no cover

    def _dead_rows(self, t, dims):
        """Rows that are all -inf, and t with those rows zeroed: computing on the
        zeroed copy and selecting afterwards keeps autograd free of NaN."""
        dead = t.amax(dims, keepdim=True) == float("-inf")
        return dead, torch.where(dead, 0.0, t)

    def _apply(self, op, a):
        if op == "where":
            return torch.where(a[0].bool(), a[1], a[2])
        return getattr(torch, _TORCH_OPS.get(op, op))(*a)


# IR operator -> torch function name, where they differ.
_TORCH_OPS = {"+": "add", "-": "sub", "*": "mul", "/": "div", "//": "floor_divide", "%": "remainder",
              "^": "pow", "<": "lt", "<=": "le",
              ">": "gt", ">=": "ge", "==": "eq", "!=": "ne", "and": "logical_and",
              "or": "logical_or", "max": "maximum", "min": "minimum"}


def N(v):
    return ir.Num(v)


def B(op, a, b):
    return ir.Binary(op, a, b)


def C(fn, *args):
    return ir.Call(fn, tuple(args))


def diagram_sizes(diagram):
    sizes = {"b": 2, "h": 2, "hk": 2, "g": 2, "q": 5, "x": 7, "m": 3, "n": 4, "k": 5}
    if any(isinstance(n, ir.TensorRef) and n.wires for let in diagram.lets for n in ir.walk(let.expr)):
        sizes["x"] = sizes["q"]  # a relabelled read (doc[b, q]) needs |q| = |x|
    sizes.update({w.name: w.size for w in diagram.wires if w.size is not None})
    for _, declared, read, step, _ in ir.coarse_reads(diagram):   # qb of keep[.., q // 64, ..]
        sizes[declared] = -(-sizes[read] // step)
    return sizes


def random_inputs(diagram, sizes, g):
    env, layouts = {}, {}
    lengths = dict(ir.length_inputs(diagram))
    for inp in diagram.inputs:
        wires = ir.axis_wires(inp.axes)
        shape = [sizes[w] for w in wires]
        if inp.name in lengths:   # a length of a wire (x < n[b]): 1..|wire|, as example_inputs draws it
            env[inp.name] = torch.randint(1, sizes[lengths[inp.name]] + 1, shape, generator=g).to(F64)
        elif inp.dtype in ir.INT_DTYPES:  # document ids: non-decreasing small integers
            env[inp.name] = torch.randint(0, 2, shape, generator=g).sort(-1).values.to(F64)
        elif inp.name == "slope":
            env[inp.name] = torch.rand(shape, generator=g, dtype=F64)
        else:
            env[inp.name] = torch.randn(shape, generator=g, dtype=F64)
        layouts[inp.name] = wires
    return env, layouts
