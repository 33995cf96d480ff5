"""Taking an attention output apart: the forms grad_plan (napkin/gradrules.py) recognises.

``Form`` walks an output with its boxes inlined and the score box read as
the placeholder S, and takes each sum along the key wire apart into a
contraction with the value, N_i = sum[x](a_i(S) * V), or a row sum, Z_j =
sum[x](c_j(S)), with what lies outside the sums; a gate on the value (a
factor along the key and V's wires alone) comes out of every contraction
as the value's own (``Form.gate``).  ``NoGrad`` is the refusal, with the
place to blame.  Split from gradrules, which builds the rules from these
pieces.
"""
from __future__ import annotations

from . import ir
from .autodiff import ONE, _map, simplify
from .printer import expr_text


def _ref(name: str) -> ir.TensorRef:
    return ir.TensorRef(name)


class NoGrad(ValueError):
    """grad_plan's refusal: why a diagram has no backward, and where in it (a
    ValueError still, for callers of the rule builders)."""

    def __init__(self, message: str, loc: ir.Loc = ir.NOLOC):
        super().__init__(message)
        self.loc = loc


class Form:
    """Walks an inlined attention output and takes it apart into form (a) or (b).

    Each ``sum[x](...)`` becomes a placeholder times the factors of its body
    that do not depend on x (they are constant along the sum, so they come
    out of it: ``sum[x](S / sqrt(Z) * V)`` = ``N / sqrt(Z)``).  A body with V
    is a contraction N_i = sum[x](a_i(S) * V), one without is a row sum Z_j.
    """

    def __init__(self, score_wires, layouts):
        self.score_wires, self.layouts = score_wires, layouts
        self.key = self.v = None
        self.softmax = False
        self.lse = None          # where the output reads logsumexp[key](S), if it does
        self.nums, self.sums = [], []
        self.gate, self.ungated = None, False   # a gate folded into V; a contraction without it

    def visit(self, e: ir.Expr) -> ir.Expr:
        if isinstance(e, ir.Normalize):
            raise NoGrad("softmax must be used as sum[x](softmax[x](S) * V)", e.loc)
        if not isinstance(e, ir.Reduce):
            return _map(e, self.visit)
        if e.op == "logsumexp" and e.body == _ref("S") and len(e.wires) == 1 and self.key in (None, e.wires[0]):
            # the row's lse read by the output (a sink's sigmoid(lse - sink)): softmax's own row state
            self.key, self.lse = e.wires[0], e.loc
            return _ref("lse")
        if e.op != "sum" or len(e.wires) != 1 or (self.key not in (None, e.wires[0])):
            raise NoGrad(f"{e.op}[{', '.join(e.wires)}] is not a sum along the key wire", e.loc)
        self.key = e.wires[0]
        keyed, const = [], []
        for factor, power in factors(e.body):
            (keyed if self._keyed(factor) else const).append((factor, power))
        relabelled = [f for f, _ in keyed if isinstance(f, ir.TensorRef) and f.wires is not None
                      and f.name in self.layouts]
        if relabelled:   # else its weight reads as "softmax must normalise the score box itself"
            f = relabelled[0]
            raise NoGrad(f"the sum along {self.key} reads {f.name} relabelled ({f.name}[{', '.join(f.wires)}]); "
                             "the backward takes a value tensor along its own wires", f.loc)
        vs = [f for f, p in keyed if isinstance(f, ir.TensorRef) and self._is_value(f)]
        if len(vs) > 1 or any(isinstance(f, ir.TensorRef) and self._is_value(f) and p < 0 for f, p in keyed):
            raise NoGrad("a contraction must multiply by the value tensor once", e.loc)
        rest = [(f, p) for f, p in keyed if not (vs and f == vs[0])]
        if vs:
            rest = self._fold_gate(rest, vs[0], e.loc)
        weight = product(rest)
        reduced = [n for n in ir.walk(weight) if isinstance(n, (ir.Reduce, ir.Normalize))]
        if reduced and not self._is_softmax(weight):
            others = [f for f, _ in rest if not isinstance(f, ir.Normalize)]
            # along the keys and short of a score wire (the queries'), as V[b, h, x]; a gate has them all
            flat = [f for f in others if isinstance(f, ir.TensorRef) and f.wires is None
                    and self.key in (self.layouts.get(f.name) or ())
                    and set(self.layouts[f.name]) < set(self.score_wires)]
            if flat and not vs and len(others) < len(rest):   # V[b, h, x]: read as a gate by the rule below
                raise NoGrad(f"the value {flat[0].name} has no feature wire (a wire the scores lack, as d of "
                             f"V[b, h, x, d]): the backward takes sum[{self.key}](softmax[{self.key}](S) * V) "
                             f"with one; give {flat[0].name} a wire of size 1", e.loc)
            if others and len(others) < len(rest):   # softmax(S) * G: a gate, not another score
                # one along the keys and not the rows (gate[b, h, x]) scales V's rows: the same output
                # with V * gate as the value, whose gradient autograd takes through that product
                fold = f" ({flat[0].name} lies along {self.key} and not the rows: multiply it into " \
                       f"{vs[0].name} in torch and pass {vs[0].name} * {flat[0].name} as {vs[0].name}, the same " \
                       f"output; autograd takes {flat[0].name}'s gradient through that product)" \
                    if vs and len(flat) == len(others) == 1 else ""
                raise NoGrad(f"the weights of the sum along {self.key} multiply softmax by "
                             f"{' * '.join(expr_text(f) for f in others)}; the backward takes the softmax "
                             f"weights alone, sum[{self.key}](softmax[{self.key}](S) * V){fold}", e.loc)
            if any(isinstance(n, ir.Normalize) for n in reduced):
                raise NoGrad("softmax must normalise the score box itself: sum[x](softmax[x](S) * V)", e.loc)
            raise NoGrad("the weights inside a sum along the key wire must be elementwise in the scores", e.loc)
        if vs:
            if self.v not in (None, vs[0].name):
                raise NoGrad(f"two value tensors, {self.v} and {vs[0].name}", vs[0].loc)
            self.v = vs[0].name
            if self._is_softmax(weight):
                self.softmax = True
            table, prefix = self.nums, "N"
        else:
            if self._is_softmax(weight):
                raise NoGrad("softmax must be used as sum[x](softmax[x](S) * V)", e.loc)
            table, prefix = self.sums, "Z"
        if weight not in table:
            table.append(weight)
        held = _ref(f"{prefix}{table.index(weight)}")
        outside = [(self.visit(f), p) for f, p in const]
        return product([(held, 1)] + outside) if outside else held

    def _fold_gate(self, rest, v: ir.TensorRef, loc) -> list:
        """The weights less a gate on the value: an input read along its own
        wires, the key's among them, all of them V's (gate[b, h, x] of
        V[b, h, x, d]), which scales V's rows, so the contraction is one with
        the value V * gate.  The one gate of every contraction."""
        wires = set(self.layouts[v.name])
        gates = [i for i, (f, _) in enumerate(rest) if isinstance(f, ir.TensorRef) and f.wires is None
                 and f.name in self.layouts and f.name != v.name and self.key in self.layouts[f.name]
                 and set(self.layouts[f.name]) <= wires]
        if not gates:
            self.ungated = True
            return rest
        names = sorted({rest[i][0].name for i in gates})
        if len(gates) > 1 or rest[gates[0]][1] < 0 or self.gate not in (None, names[0]):
            shown = " and ".join(names + ([self.gate] if self.gate not in (None, *names) else []))
            raise NoGrad(f"the value {v.name} is scaled by {shown}: the backward takes one gate on the "
                         f"value, as sum[{self.key}](softmax[{self.key}](S) * {v.name} * gate), in every "
                         "contraction (multiply the gates into one input in torch)", loc)
        self.gate = names[0]
        return rest[:gates[0]] + rest[gates[0] + 1:]

    def _is_softmax(self, e) -> bool:
        return isinstance(e, ir.Normalize) and e.wire == self.key and e.body == _ref("S")

    def _is_value(self, t: ir.TensorRef) -> bool:
        """V: an input along the key wire that also has a wire the scores lack (d)."""
        wires = self.layouts.get(t.name)
        return (t.wires is None and wires is not None and self.key in wires
                and any(w not in self.score_wires for w in wires))

    def _keyed(self, e: ir.Expr) -> bool:
        """Does e vary along the key wire?  A sum over it does not."""
        if isinstance(e, ir.TensorRef):
            wires = e.wires or self.layouts.get(e.name) or self.score_wires  # S is along the scores' wires
            return self.key in wires
        if isinstance(e, ir.WireIndex):
            return e.wire == self.key
        if isinstance(e, ir.Reduce) and self.key in e.wires:
            return False
        return any(self._keyed(c) for c in ir.children(e))


def factors(e: ir.Expr, power: int = 1) -> list:
    """A product/quotient as [(factor, +1 or -1)]."""
    if isinstance(e, ir.Binary) and e.op in ("*", "/"):
        return factors(e.lhs, power) + factors(e.rhs, power if e.op == "*" else -power)
    if isinstance(e, ir.Unary) and e.op == "-":
        return [(ir.Num(-1), 1)] + factors(e.operand, power)
    return [(e, power)]


def product(parts) -> ir.Expr:
    """[(factor, +1 or -1)] back to a product/quotient, simplified."""
    num = [f for f, p in parts if p > 0]
    den = [f for f, p in parts if p < 0]
    out = num[0] if num else ONE
    for f in num[1:]:
        out = ir.Binary("*", out, f)
    for f in den:
        out = ir.Binary("/", out, f)
    return simplify(out)


def check_gate(form: Form, score_let: ir.Let, at: ir.Loc) -> None:
    """A gate folded into the value is read nowhere else: its gradient is then
    the value path's alone (sum_d(dW * V), dW the ungated rule's dV)."""
    gate, v = form.gate, form.v
    if form.ungated:
        raise NoGrad(f"{gate} scales {v} in one contraction along {form.key} and not another: the backward "
                     f"takes one value, {v} * {gate} in every contraction or {v} in every one", at)
    reads = [("the scores", score_let.expr)] + [(f"a row sum along {form.key}", c) for c in form.sums]
    where = [what for what, e in reads if any(isinstance(n, ir.TensorRef) and n.name == gate for n in ir.walk(e))]
    if where:
        raise NoGrad(f"{gate} scales the value {v} and is read by {where[0]} too: its gradient would have two "
                     "paths; declare another input for that read and pass the same tensor to both (autograd "
                     "adds their gradients)", at)
