"""Inputs and an eager float64 reference computed straight from the IR.

The generated module brings its own ``reference`` and ``example_inputs``;
the benchmark prefers them.  These are the fallback (and what the tests of
the FlexAttention emitter compare with), so a diagram can be checked without
the code generator, by an interpreter written independently of it: each box
is evaluated in order, in float64, wires matched by name (weaving is
broadcasting), a sum of a product is an einsum, and softmax of a row that is
all -inf gives 0 (its logsumexp -inf), as docs/SEMANTICS-DRAFT.md says.

Every box is materialised, so the largest temporary is the biggest box (the
q x x scores): ``reference_elements`` says how big, and the harness checks
at a reduced size when the real one is too big.
"""
from __future__ import annotations

import math
import string
from typing import Mapping

from .. import ir, tiling
from ..errors import NapkinError


def full_sizes(diagram: ir.Diagram, sizes: Mapping[str, int]) -> dict[str, int]:
    """Every wire's size: fixed ones from the diagram, symbolic ones from ``sizes``."""
    out = {}
    for w in diagram.wires:
        if w.size is not None:
            out[w.name] = w.size
        elif w.name in sizes:
            out[w.name] = int(sizes[w.name])
        else:
            raise NapkinError(f"diagram {diagram.name}: no size given for wire {w.name}")
    return out


def _shape(axes, sizes) -> list[int]:
    return [math.prod(sizes[w] for w in axis) for axis in axes]


def example_inputs(diagram: ir.Diagram, sizes: Mapping[str, int], dtype=None, device="cpu", seed=0, docs=None):
    """Inputs in the diagram's order.  Float tensors: standard normal, in the
    declared dtype (or ``dtype`` for the fp16/bf16 ones, the attention
    operands); an integer input that is a length of a wire (ir.length_inputs:
    x < n[b]) is a random length 1..|wire|, as the generated module's
    example_inputs draws it; any other integer input is read as document ids,
    non-decreasing along its last axis so each document is one contiguous run
    (about 4 of random lengths, or with ``docs``, napkin/documents.py's, the
    ids of those documents cut at the axis's length, the same in every row);
    bool is random; int8 across -128..127, and the float scales of int8 sums
    (tiling.int8_scales) about 1/127.  Deterministic in ``seed``."""
    import torch

    full = full_sizes(diagram, sizes)
    lengths = dict(ir.length_inputs(diagram))
    scales = tiling.int8_scales(diagram)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for t in diagram.inputs:
        shape = _shape(t.axes, full)
        if t.name in lengths:
            value = torch.randint(1, full[lengths[t.name]] + 1, shape, generator=gen)
            value = value.to(getattr(torch, ir.TORCH_NAMES[t.dtype]))
        elif t.dtype in ir.NUMBER_INT_DTYPES and docs is not None:
            bounds = docs.cut(shape[-1])
            ids = torch.repeat_interleave(torch.arange(len(bounds) - 1), torch.tensor(bounds).diff())
            value = ids.expand(shape).to(getattr(torch, ir.TORCH_NAMES[t.dtype])).contiguous()
        elif t.dtype in ir.NUMBER_INT_DTYPES:
            starts = torch.rand(shape, generator=gen) < 4.0 / max(shape[-1], 1)
            value = torch.cumsum(starts.to(torch.int64), dim=-1).to(getattr(torch, ir.TORCH_NAMES[t.dtype]))
        elif t.dtype == "bool":
            value = torch.rand(shape, generator=gen) < 0.5
        elif t.dtype == "int8":   # a product's quantised factor: the whole range
            value = torch.randint(-128, 128, shape, generator=gen, dtype=torch.int8)
        elif t.name in scales:    # its scale: about 1/127, the factors standing for -1..1
            value = ((torch.rand(shape, generator=gen) + 0.5) / 127).to(getattr(torch, ir.TORCH_NAMES[t.dtype]))
        else:
            want = ir.TORCH_NAMES.get(t.dtype, "float32")
            if dtype is not None and t.dtype in ("fp16", "bf16"):
                want = str(dtype).replace("torch.", "")
            value = torch.randn(shape, generator=gen, dtype=torch.float32).to(getattr(torch, want))
        out.append(value.to(device))
    return out


def reference_elements(diagram: ir.Diagram, sizes: Mapping[str, int]) -> int:
    """Elements of the biggest box ``reference`` materialises."""
    full = full_sizes(diagram, sizes)
    return max((math.prod(full[w] for w in ir.axis_wires(t.axes)) for t in diagram.lets), default=1)


def reference(diagram: ir.Diagram, inputs, sizes: Mapping[str, int]):
    """The diagram's outputs in float64, each laid out as declared (flattened
    axes flattened again), on the inputs' device."""
    full = full_sizes(diagram, sizes)
    env = {}
    for t, value in zip(diagram.inputs, inputs):
        value = value.reshape([full[w] for w in ir.axis_wires(t.axes)])
        env[t.name] = (value.double() if value.is_floating_point() else value, ir.axis_wires(t.axes))
    run = _Eval(env, full)
    for let in diagram.lets:
        wires = ir.axis_wires(let.axes)
        value, have = run(let.expr)
        env[let.name] = (_align(value, have, wires).expand([full[w] for w in wires]), wires)
    return [env[o.name][0].reshape(_shape(diagram.tensor(o.name).axes, full)) for o in diagram.outputs]


def _align(t, have: tuple, want: tuple):
    """t (one dimension per wire of ``have``) permuted to ``want``'s order,
    with a size-1 dimension for each wire of ``want`` it lacks."""
    present = [w for w in want if w in have]
    t = t.permute([have.index(w) for w in present]) if have else t
    return t.reshape([t.shape[present.index(w)] if w in have else 1 for w in want])


class _Eval:
    """expr -> (tensor, its wires); tensors carry one dimension per wire."""

    def __init__(self, env, sizes):
        import torch

        self.torch, self.env, self.sizes = torch, env, sizes

    def __call__(self, e):
        torch = self.torch
        if isinstance(e, ir.Num):
            return torch.tensor(float(e.value), dtype=torch.float64), ()
        if isinstance(e, ir.WireIndex):
            return torch.arange(self.sizes[e.wire], dtype=torch.float64), (e.wire,)
        if isinstance(e, ir.WireSize):
            return torch.tensor(float(self.sizes[e.wire]), dtype=torch.float64), ()
        if isinstance(e, ir.TensorRef):
            value, wires = self.env[e.name]
            for i, (w, step) in enumerate(zip(e.wires or (), e.steps or ())):   # keep[.., q // 64, ..]
                if step != 1:
                    value = value.index_select(i, torch.arange(self.sizes[w], device=value.device) // step)
            return value, tuple(e.wires) if e.wires is not None else wires
        if isinstance(e, ir.Reduce) and e.op == "sum" and isinstance(e.body, ir.Binary) and e.body.op == "*":
            return self._einsum(e)
        if isinstance(e, ir.Reduce):
            t, w = self(e.body)
            t, w = self._spread(t, w, e.wires)
            dims = [w.index(x) for x in e.wires]
            rest = tuple(x for x in w if x not in e.wires)
            if e.op == "sum":
                return t.sum(dims), rest
            if e.op in ("max", "min"):
                return (t.amax(dims) if e.op == "max" else t.amin(dims)), rest
            return torch.logsumexp(t, dims), rest     # an all -inf row gives -inf
        if isinstance(e, ir.Normalize):
            t, w = self(e.body)
            t, w = self._spread(t, w, (e.wire,))
            dim = w.index(e.wire)
            dead = t.amax(dim, keepdim=True) == float("-inf")
            return torch.where(dead, 0.0, torch.softmax(torch.where(dead, 0.0, t), dim)), w
        args = [self(a) for a in ((e.operand,) if isinstance(e, ir.Unary) else
                                  (e.lhs, e.rhs) if isinstance(e, ir.Binary) else e.args)]
        wires = tuple(dict.fromkeys(w for _, ws in args for w in ws))
        values = [_align(t, ws, wires) for t, ws in args]
        return _apply(torch, e, values), wires

    def _spread(self, t, w, wires):
        """Broadcast t along reduced wires it does not vary on (a sum of a constant)."""
        for x in wires:
            if x not in w:
                t, w = t.unsqueeze(-1).expand(*t.shape, self.sizes[x]), w + (x,)
        return t, w

    def _einsum(self, e):
        (a, wa), (b, wb) = self(e.body.lhs), self(e.body.rhs)
        wires = tuple(dict.fromkeys(wa + wb))
        letter = dict(zip(wires, string.ascii_letters))
        if any(x not in wires for x in e.wires):   # a wire neither side has: multiply by its size
            t, w = self(ir.Reduce("sum", tuple(x for x in e.wires if x in wires), e.body))
            return t * math.prod(self.sizes[x] for x in e.wires if x not in wires), w
        rest = tuple(w for w in wires if w not in e.wires)
        spec = ",".join("".join(letter[w] for w in ws) for ws in (wa, wb)) + "->" + "".join(letter[w] for w in rest)
        a = a.double() if a.dtype != self.torch.float64 else a
        b = b.double() if b.dtype != self.torch.float64 else b
        return self.torch.einsum(spec, a, b), rest


def _apply(torch, e, a):
    if isinstance(e, ir.Unary):
        return -a[0] if e.op == "-" else torch.logical_not(a[0])
    op = e.op if isinstance(e, ir.Binary) else e.fn
    table = {
        "+": lambda: a[0] + a[1], "-": lambda: a[0] - a[1], "*": lambda: a[0] * a[1],
        "/": lambda: a[0] / a[1], "//": lambda: a[0] // a[1], "%": lambda: a[0] % a[1], "^": lambda: torch.pow(a[0], a[1]),
        "<": lambda: a[0] < a[1], "<=": lambda: a[0] <= a[1], ">": lambda: a[0] > a[1],
        ">=": lambda: a[0] >= a[1], "==": lambda: a[0] == a[1], "!=": lambda: a[0] != a[1],
        "and": lambda: torch.logical_and(a[0], a[1]), "or": lambda: torch.logical_or(a[0], a[1]),
        "exp": lambda: torch.exp(a[0]), "exp2": lambda: torch.exp2(a[0]),
        "log": lambda: torch.log(a[0]), "log2": lambda: torch.log2(a[0]),
        "sqrt": lambda: torch.sqrt(a[0]), "rsqrt": lambda: torch.rsqrt(a[0]),
        "tanh": lambda: torch.tanh(a[0]), "sigmoid": lambda: torch.sigmoid(a[0]),
        "abs": lambda: torch.abs(a[0]), "relu": lambda: torch.relu(a[0]),
        "max": lambda: torch.maximum(a[0], a[1]), "min": lambda: torch.minimum(a[0], a[1]),
        "where": lambda: torch.where(a[0].bool(), a[1], a[2]),
    }
    return table[op]()


def output_dtypes(diagram: ir.Diagram) -> list[str]:
    """The torch dtype name of each output, as the kernel returns it."""
    return [ir.TORCH_NAMES.get(tiling.tensor_dtype(diagram, o.name), "float32") for o in diagram.outputs]
