"""IR -> the body of ``reference(...)``: the diagram as plain eager PyTorch.

The reference materialises every box as a tensor whose dimensions are its
declared wires, flattened (``(hk g)`` becomes two dimensions), in order.
Each subexpression is rendered together with the wires of its dimensions;
a binary operation aligns its operands to the union of their wires with
``permute`` and ``None`` indexing (weaving = broadcasting by wire name).
Sums of products are einsums; softmax uses the module's ``_softmax``, which
gives a row of all -inf the value 0 (napkin's convention).  It is emitted
from the IR, not from the kernel plan, so it checks the lowering too.
"""
from __future__ import annotations

import string

from .. import ir
from .exprs import Ctx, ScalarRender, TorchRender, fold, number, whole_number


def _letters(d: ir.Diagram) -> dict[str, str]:
    letters = string.ascii_letters
    return {w.name: letters[i] for i, w in enumerate(d.wires)}


def atom(code: str) -> str:
    """``code`` parenthesised unless it is already one operand (a name, a
    number, a call or an indexing chain, with nothing at the top level that
    could bind to a neighbouring operator)."""
    depth = 0
    for ch in code:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif depth == 0 and ch in " +-*/<>=&|~%@":
            return f"({code})"
    return code


def align(code: str, src: tuple[str, ...], dst: tuple[str, ...]) -> str:
    """``code`` (dims = src wires) as a view with dims in dst order (size 1
    where src lacks a wire)."""
    if src == dst or not src:
        return code
    code = atom(code)
    kept = [w for w in dst if w in src]
    if kept != list(src):
        code = f"{code}.permute({', '.join(str(src.index(w)) for w in kept)})"
    if len(kept) != len(dst):
        code = f"{code}[{', '.join(':' if w in src else 'None' for w in dst)}]"
    return code

def _whole_and_not_negative(v) -> bool:
    v = whole_number(v)
    return v is not None and v >= 0


class _Ref:
    def __init__(self, d: ir.Diagram):
        self.d = d
        self.fixed = {w.name: w.size for w in d.wires if w.size is not None}
        self.letters = _letters(d)
        self.kinds = {t.name: ("int" if t.dtype in ir.NUMBER_INT_DTYPES else "bool" if t.dtype == "bool" else "float")
                      for t in d.inputs}
        self.ctx = Ctx(index={}, size={w.name: f'_sz["{w.name}"]' for w in d.wires}, fixed=self.fixed)

    def wires_of_ref(self, ref: ir.TensorRef) -> tuple[str, ...]:
        return ref.wires if ref.wires is not None else ir.axis_wires(self.d.tensor(ref.name).axes)

    def kind(self, e) -> str:
        if isinstance(e, ir.TensorRef):
            t = self.d.tensor(e.name)
            return self.kinds.get(e.name, "float") if isinstance(t, ir.Input) else "float"
        if isinstance(e, (ir.WireIndex, ir.WireSize)):
            return "int"
        return "float"

    def expr(self, e) -> tuple[str, tuple[str, ...]]:
        """(torch source, wires of its dimensions); () wires: a Python scalar."""
        v = fold(e, self.fixed)
        if v is not None:
            return number(v), ()
        if isinstance(e, ir.WireSize):
            return f'_sz["{e.wire}"]', ()
        if isinstance(e, ir.WireIndex):
            return f'torch.arange(_sz["{e.wire}"], device=_dev)', (e.wire,)
        if isinstance(e, ir.TensorRef):
            code, wires = e.name, self.wires_of_ref(e)
            for i, (w, step) in enumerate(zip(wires, ir.read_steps(e))):
                if step != 1:   # keep[.., q // 64, ..]: its blocks' rows, one per q
                    code = f'{code}.index_select({i}, torch.arange(_sz["{w}"], device=_dev) // {step})'
            return code, wires
        if isinstance(e, ir.Reduce):
            return self.reduce(e)
        if isinstance(e, ir.Normalize):
            code, wires = self.expr(e.body)
            return f"_softmax({code}, {wires.index(e.wire)})", wires
        parts = [self.expr(c) for c in self.children(e)]
        parts = self.in_compute_dtype(e, parts)
        if isinstance(e, ir.Binary) and e.op == "^" and parts[0][1] and self.integral(e.lhs) \
                and not _whole_and_not_negative(fold(e.rhs, self.fixed)):
            # torch refuses an integer tensor to a negative integer power; a float one takes any
            parts[0] = (f"({parts[0][0]}).to(_c)", parts[0][1])
        if isinstance(e, ir.Binary) and e.op == "^" and parts[1][1] and self.integral(e.rhs):
            # an integer tensor exponent makes torch's power integral: 2 ** (m - n) is 0 where m < n
            parts[1] = (f"({parts[1][0]}).to(_c)", parts[1][1])
        wires = self.union([w for _, w in parts])
        subst = {_Leaf(i): atom(align(code, w, wires) if w else code) for i, (code, w) in enumerate(parts)}
        rebuilt = self.rebuild(e, list(subst))
        if not wires:  # all scalars (symbolic sizes): Python arithmetic
            return ScalarRender(Ctx({}, {}, self.fixed, subst))(rebuilt), ()
        return TorchRender(Ctx({}, {}, self.fixed, subst))(rebuilt), wires

    def in_compute_dtype(self, e, parts):
        """parts with each integer tensor made _c where ``e`` makes a float of
        it with nothing but scalars: torch takes (x - q) ** 3 / 1000,
        (x - q) * 0.5 or sqrt(x) to its default dtype, float32, in a float64
        reference.  With a float tensor beside it torch promotes to that one's
        dtype, so those are left as written."""
        kids = self.children(e)
        mixes = (isinstance(e, ir.Binary) and e.op in ir.ARITH_OPS or isinstance(e, ir.Call)) \
            and not self.integral(e)
        skip = 0 if isinstance(e, ir.Call) and e.fn == "where" else None   # the predicate stays bool
        values = [(i, c, p) for i, (c, p) in enumerate(zip(kids, parts)) if i != skip]
        if not mixes or any(w and not self.integral(c) for _, c, (_, w) in values):
            return parts
        out = list(parts)
        for i, c, (code, w) in values:
            if w and self.integral(c):
                out[i] = (f"({code}).to(_c)", w)
        return out

    def integral(self, e) -> bool:
        """Whether ``e`` is an integer tensor in torch (indices and integer inputs, added,
        subtracted, multiplied or raised to whole powers)."""
        if isinstance(e, (ir.WireIndex, ir.WireSize)):
            return True
        if isinstance(e, ir.Num):
            return isinstance(e.value, int) and not isinstance(e.value, bool)
        if isinstance(e, ir.TensorRef):
            return self.kind(e) == "int"
        if isinstance(e, ir.Unary) and e.op == "-":
            return self.integral(e.operand)
        if isinstance(e, ir.Binary) and e.op in ("+", "-", "*"):
            return self.integral(e.lhs) and self.integral(e.rhs)
        if isinstance(e, ir.Binary) and e.op == "^":
            return self.integral(e.lhs) and _whole_and_not_negative(fold(e.rhs, self.fixed))
        return False

    @staticmethod
    def children(e) -> list:
        if isinstance(e, ir.Unary):
            return [e.operand]
        if isinstance(e, ir.Binary):
            return [e.lhs, e.rhs]
        if isinstance(e, ir.Call):
            return list(e.args)
        return []

    def rebuild(self, e, leaves):
        """e with its children replaced by leaves (rendered elsewhere)."""
        if isinstance(e, ir.Unary):
            return ir.Unary(e.op, leaves[0])
        if isinstance(e, ir.Binary):
            return ir.Binary(e.op, leaves[0], leaves[1])
        return ir.Call(e.fn, tuple(leaves))

    def union(self, lists) -> tuple[str, ...]:
        """All wires of the operands, in the diagram's declaration order (a
        canonical order keeps permutes rare)."""
        seen = {w for ws in lists for w in ws}
        return tuple(w.name for w in self.d.wires if w.name in seen)

    def reduce(self, e: ir.Reduce) -> tuple[str, tuple[str, ...]]:
        factors = ir.factors(e.body) if e.op == "sum" else []
        tensors = [f for f in factors if fold(f, self.fixed) is None]
        if len(tensors) >= 2 and all(self.kind(f) == "float" and not isinstance(f, ir.WireIndex) for f in tensors):
            return self.einsum(e, factors)
        code, wires = self.expr(e.body)
        dims = ", ".join(str(wires.index(w)) for w in e.wires)
        dims = f"({dims},)" if len(e.wires) == 1 else f"({dims})"
        out = tuple(w for w in wires if w not in e.wires)
        if e.op == "logsumexp":
            return f"torch.logsumexp({code}, dim={dims})", out
        if e.op == "sum":
            return f"{atom(code)}.sum(dim={dims})", out
        # max and min through _extreme: along an empty wire (x = 0 keys) they are -inf and inf, not torch's error
        return f'_extreme({code}, {dims}, "{e.op}")', out

    def einsum(self, e: ir.Reduce, factors) -> tuple[str, tuple[str, ...]]:
        parts, scalars, specs = [], [], []
        for f in factors:
            code, wires = self.expr(f)
            if not wires:
                scalars.append(code)
                continue
            parts.append(code)
            specs.append("".join(self.letters[w] for w in wires))
        out = self.union([tuple(self.letters_inv(s)) for s in specs])
        out = tuple(w for w in out if w not in e.wires)
        parts = [atom(p) for p in parts]
        spec = ",".join(specs) + "->" + "".join(self.letters[w] for w in out)
        code = f'torch.einsum("{spec}", {", ".join(parts)})'
        for s in scalars:
            code = f"{code} * {s}"
        return code, out

    def letters_inv(self, spec: str):
        back = {v: k for k, v in self.letters.items()}
        return [back[c] for c in spec]


class _Leaf:
    """A placeholder child (already rendered); compared by identity."""

    __slots__ = ("i",)

    def __init__(self, i):
        self.i = i


def reference_lines(d: ir.Diagram) -> list[str]:
    """Statements computing every box, in order (inputs are already viewed
    along their flattened wires and converted to the compute dtype)."""
    r = _Ref(d)
    lines = []
    for let in d.lets:
        code, wires = r.expr(let.expr)
        target = ir.axis_wires(let.axes)
        if not wires:  # a constant or a scalar input's box: broadcast to its layout (autograd through a scalar)
            shape = "".join(f'_sz["{w}"], ' for w in target)
            code = f"torch.zeros(({shape.rstrip(' ')}), dtype=_c, device=_dev) + ({code})"
        else:
            code = align(code, wires, target)
        lines.append(f"{let.name} = {code}")
    return lines
