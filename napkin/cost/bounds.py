"""Lower bounds on hbm traffic at a given on-chip capacity M (in elements).

The general form is H* = sum_t alpha_t * M^(-beta_t) (background section 1):

* matmul-like, one contraction sum[k](A * B), with a = A's own wires, c = B's
  own wires, batch = wires both share besides k:
      H* = batch * (2*a*k*c / sqrt(M) + a*c)                (beta = 1/2)
  or, where less, an operand held (a k x M/k slab of B a program, A re-read
  c*k/M times: batch * (a*k^2*c/M + k*c + a*c), "matmul, B held"; A likewise),
  none below the matmul's compulsory traffic (_matmul).
* attention-like, S = sum[d](Q * K) feeding O = sum[x](P * V):
      H* = batch * (rows*d + rows*dv + x*(d + dv)^2 * rows / M)   (beta = 1)
  A score adding several contractions of inputs (MLA's sum[c](Qc * Kc) +
  sum[r](Qr * Kr)) is one over the parts side by side: d = c + r.
  which is 2qd + 4xqd^2/M per head when dv = d.  The last term is the K and V
  re-reads: a program holding g query rows (its Q tile and O accumulator,
  g*(d + dv) <= M) reads all x*(d + dv) keys and values once per g rows.
  An attention-shaped diagram may also run as two matmuls with the scores
  written out between them (naive attention, or a chain C = A B, E = C D
  whose inner wires are wide): that moves less than the fused form once
  (d + dv)^2 outgrows about 2M, so the bound is the smaller of the two
  (kind "two matmuls": each matmul's least form, as above, the scores
  counted in their box's dtype).
* anything else: the compulsory traffic, every input read and output written
  once (no reuse bound is known to napkin for it).

The re-read terms are in elements of the operands: M = capacity in bytes /
element size, and their bytes multiply by that size.  That is where the
q^(1 + beta) effect comes from: halving the element size halves the bytes of
each element moved and doubles how many fit.  The fixed terms (a matmul's
output, attention's Q and O) are each counted in its own tensor's dtype: an
fp16 output of fp32 operands is written at 2 bytes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .. import ir, tiling
from .model import contraction_factors, node_wires
from .symbolic import Poly


@dataclass(frozen=True)
class BoundShape:
    kind: str                       # "attention", "matmul" or "compulsory"
    batch: tuple[str, ...] = ()
    rows: tuple[str, ...] = ()      # a (matmul) / query rows (attention)
    inner: tuple[str, ...] = ()     # k (matmul) / d (attention)
    cols: tuple[str, ...] = ()      # c (matmul) / x (attention)
    value: tuple[str, ...] = ()     # dv (attention)
    # attention's other score contractions, added to the first (MLA's sum[r](Qr * Kr) beside
    # sum[c](Qc * Kc)): each one's wires, so d = |c| + |r|, as the parts written as one wire
    more_inner: tuple[tuple[str, ...], ...] = ()
    dtype: str = "fp16"             # the operands' element type
    # the fixed terms' dtypes: a matmul's output; attention's Q and O (then its scores', for the
    # two-matmul form); None for an output that is not written (a box a later box reads)
    fixed: tuple[Optional[str], ...] = ()


@dataclass(frozen=True)
class Bound:
    """A bound's value at known sizes: bytes, its re-read term in bytes, the
    form taken (the shape's kind, "two matmuls", or a matmul with an operand
    held) and that form's formula, in elements (M the capacity in elements),
    whose terms are the ones the value counts."""
    bytes: float
    reread_bytes: float
    form: str
    formula: str


def _contractions(diagram: ir.Diagram):
    """(let, reduce node, (A, B)) for every contraction, in order."""
    out = []
    for let in diagram.lets:
        for node in ir.walk(let.expr):
            f = contraction_factors(node, diagram)
            if f:
                out.append((let, node, f))
    return out


def _depends_on(diagram: ir.Diagram, name: str, target: str) -> bool:
    todo, seen = [name], set()
    while todo:
        n = todo.pop()
        if n == target:
            return True
        t = diagram.tensor(n)
        if n in seen or not isinstance(t, ir.Let):
            continue
        seen.add(n)
        todo += [r.name for r in ir.walk(t.expr) if isinstance(r, ir.TensorRef)]
    return False


def _operand_dtype(diagram: ir.Diagram, exprs) -> str:
    """What feeds the tensor cores: a product's two factors (``exprs`` of two) in
    the dtype tl.dot meets them in (tiling.dot_dtype: int8 by fp16 runs in fp16),
    each its narrowest input's; else the narrowest input dtype among the operands."""
    if len(exprs) == 2:
        return tiling.dot_dtype(_narrowest(diagram, exprs[:1]), _narrowest(diagram, exprs[1:]))
    return _narrowest(diagram, exprs)


def _narrowest(diagram: ir.Diagram, exprs) -> str:
    names = [r.name for e in exprs for r in ir.walk(e) if isinstance(r, ir.TensorRef)
             and isinstance(diagram.tensor(r.name), ir.Input)]
    dtypes = [tiling.tensor_dtype(diagram, n) for n in names] or \
             [t.dtype for t in diagram.inputs if t.dtype in ir.FLOAT_DTYPES] or ["fp32"]
    return min(dtypes, key=lambda d: (ir.DTYPE_BYTES[d], d))


def _ordered(diagram: ir.Diagram, wires) -> tuple[str, ...]:
    return tuple(w.name for w in diagram.wires if w.name in wires)


def bound_shape(diagram: ir.Diagram) -> BoundShape:
    cons = _contractions(diagram)
    if len(cons) == 1:
        _, node, (a, b) = cons[0]
        wa, wb, k = node_wires(diagram, a), node_wires(diagram, b), set(node.wires)
        batch = (wa & wb) - k
        return BoundShape("matmul", _ordered(diagram, batch), _ordered(diagram, wa - batch - k),
                          _ordered(diagram, k), _ordered(diagram, wb - batch - k),
                          dtype=_operand_dtype(diagram, (a, b)),
                          fixed=(_written(diagram, cons[0][0].name),))
    if len(cons) >= 2:
        # the score's contraction, then the value's: a contraction of a score function with
        # a tensor the score does not feed.  Row sums of the scores alone (L2's sum[x](S * S))
        # move no value and are left out; two different value tensors keep the compulsory bound.
        (let1, n1, (a, b)) = cons[0]
        values = []
        score = set(ir.axis_wires(let1.axes))
        for let2, node, _ in cons[1:]:
            # the product's factors the score feeds, and the value: the one other with a wire the
            # scores lack; a gate on it (sum[x](P * V * gate), gate[b, h, x]) moves x a head, as a bias
            factors = ir.factors(node.body)   # ((P * V) * gate) as [P, V, gate]
            p = [f for f in factors if _feeds(diagram, let1, f)]
            v = [f for f in factors if not _feeds(diagram, let1, f) and not node_wires(diagram, f) <= score]
            if p and len(v) == 1:
                values.append((let2, node, p[0], v[0]))
        names = {r.name for _, _, _, v in values for r in ir.walk(v) if isinstance(r, ir.TensorRef)}
        (let2, n2, p, v) = values[0] if values and len(names) == 1 else (None, None, None, None)
        if n2 is not None:
            xs = set(n2.wires)
            wa, wb, wv = node_wires(diagram, a), node_wires(diagram, b), node_wires(diagram, v)
            if xs & wa:            # the key side is the one carrying x
                a, b, wa, wb = b, a, wb, wa
            ds = set(n1.wires)
            # the score box's other contractions of two inputs add into the score (MLA's parts)
            more = [(n, f) for let, n, f in cons[1:] if let is let1 and n is not n2
                    and not any(_feeds(diagram, let1, x) for x in f)]
            parts = [set(n.wires) for n, _ in more]
            wide = set().union(ds, *parts)
            batch = (wa & wb) - wide
            operands = (a, b, v) + tuple(x for _, f in more for x in f)
            return BoundShape("attention", _ordered(diagram, batch), _ordered(diagram, wa - batch - wide),
                              _ordered(diagram, ds), _ordered(diagram, xs),
                              _ordered(diagram, wv - batch - xs), dtype=_operand_dtype(diagram, operands),
                              fixed=(_operand_dtype(diagram, (a,)), _written(diagram, let2.name),
                                     tiling.tensor_dtype(diagram, let1.name)),
                              more_inner=tuple(_ordered(diagram, p) for p in parts))
    return BoundShape("compulsory", dtype=_operand_dtype(diagram, [let.expr for let in diagram.lets]))


def _written(diagram: ir.Diagram, name: str) -> Optional[str]:
    """The dtype a fixed term writes ``name`` in: its own where it is an
    output, else None (nothing written: a box Y = O * 2 is the output, and
    the compulsory floor counts Y; O at its fp32 was once charged)."""
    return tiling.tensor_dtype(diagram, name) if name in {o.name for o in diagram.outputs} else None


def _feeds(diagram: ir.Diagram, let: ir.Let, expr: ir.Expr) -> bool:
    """Does ``expr`` read ``let`` (directly or through other boxes)?"""
    return any(isinstance(r, ir.TensorRef) and _depends_on(diagram, r.name, let.name)
               for r in ir.walk(expr))


def _prod(sizes: dict[str, int], wires) -> int:
    return math.prod(sizes[w] for w in wires)


def _sym(wires, wire_sym) -> Poly:
    p = Poly.const(1)
    for w in wires:
        p = p * wire_sym(w)
    return p


def bound_formula(shape: BoundShape, wire_sym, compulsory: Poly) -> str:
    """The paper's formula of the bound, in elements, M the capacity in
    elements: what the report shows where the sizes are not known (at known
    sizes, bound_bytes gives the form it takes, and its formula)."""
    if shape.kind == "matmul":
        b, a, k, c = (_sym(w, wire_sym) for w in (shape.batch, shape.rows, shape.inner, shape.cols))
        return f"{b * a * k * c * 2}/sqrt(M) + {b * a * c}"
    if shape.kind == "attention":
        b, r, d, x, dv = (_sym(w, wire_sym) for w in
                          (shape.batch, shape.rows, shape.inner, shape.cols, shape.value))
        for part in shape.more_inner:
            d = d + _sym(part, wire_sym)
        dd = d + dv
        return f"{b * r * dd} + ({b * x * r * dd * dd})/M"
    return str(compulsory)


@dataclass(frozen=True)
class _Term:
    """One matmul's traffic in one dataflow, in bytes, with its formula as
    three Poly coefficients (of 1/sqrt(M), of 1/M and of 1), in elements."""
    bytes: float
    reread: float
    sqrt: Poly
    per_m: Poly
    fixed: Poly
    held: str = ""        # the operand a program holds whole along k ("A", "B"), "" for the paper's

    def __add__(self, other: "_Term") -> "_Term":
        return _Term(self.bytes + other.bytes, self.reread + other.reread, self.sqrt + other.sqrt,
                     self.per_m + other.per_m, self.fixed + other.fixed)

    @property
    def text(self) -> str:
        sqrt = f"({self.sqrt})" if len(self.sqrt.terms) > 1 else str(self.sqrt)   # two matmuls' sum
        parts = ([f"{sqrt}/sqrt(M)"] if self.sqrt.terms else []) \
            + ([f"({self.per_m})/M"] if self.per_m.terms else []) + ([str(self.fixed)] if self.fixed.terms else [])
        return " + ".join(parts) or "0"


def _matmul(n: tuple[int, int, int, int], p: tuple, m: float, eb: float, out: float) -> _Term:
    """The least traffic of a matmul C[a, c] = sum[k](A[a, k] * B[k, c]) (``n``
    = (batch, a, k, c) sizes, ``p`` the same as Poly) among the dataflows a
    schedule can write, none below its compulsory traffic: the output held
    (the paper's: A and B re-read, 2akc/sqrt(M)); B held, a k x M/k slab of
    it a program (k grouped whole, a streamed), A read ck/M times; A held
    likewise.  With k under about 2 sqrt(M) a held slab moves less than the
    paper's form (a 64K x 128 by 128 x 4K product ran at 0.87 of that).
    Operands count ``eb`` bytes an element, the output ``out`` (0: not written)."""
    b, a, k, c = n
    B, A, K, C = p
    write, written = b * a * c * out, (B * A * C if out else Poly())
    none = Poly()
    floor = _Term(b * (a * k + k * c) * eb + write, 0.0, none, none, B * A * K + B * K * C + written)
    paper = b * 2 * a * k * c / math.sqrt(m) * eb
    forms = [_Term(paper + write, paper, B * A * K * C * 2, none, written) if paper > b * (a * k + k * c) * eb
             else floor]
    for held, rows, other, once in (("B", a, c, B * K * C), ("A", c, a, B * A * K)):
        if other * k <= m:       # the whole operand fits: each input read once
            forms.append(floor)
            continue
        reread = b * rows * k * (other * k / m) * eb     # the streamed operand, once per slab
        forms.append(_Term(reread + b * other * k * eb + write, reread, none, B * A * K * K * C, once + written,
                           held))
    return min(forms, key=lambda t: t.bytes)     # the paper's first, where two tie


def bound_bytes(shape: BoundShape, sizes: dict[str, int], capacity_bytes: float, wire_sym) -> Bound:
    """The bound in bytes at these sizes and on-chip capacity, and its
    formula (not the compulsory kind's: that is the compulsory traffic
    itself, analysis.py's).  ``wire_sym``: each wire as a Poly, for the formula."""
    eb = ir.DTYPE_BYTES[shape.dtype]
    m = capacity_bytes / eb
    parts = ("batch", "rows", "inner", "cols", "value")
    b, r, d, x, dv = (_prod(sizes, getattr(shape, k)) for k in parts)
    B, R, D, X, DV = (_sym(getattr(shape, k), wire_sym) for k in parts)
    for part in shape.more_inner:   # the score's other contractions: d is their widths' sum
        d, D = d + _prod(sizes, part), D + _sym(part, wire_sym)
    width = [ir.DTYPE_BYTES[t] if t is not None else 0 for t in shape.fixed]
    if shape.kind == "matmul":
        t = _matmul((b, r, d, x), (B, R, D, X), m, eb, width[0])
        return Bound(t.bytes, t.reread, "matmul" + (f", {t.held} held" if t.held else ""), t.text)
    reread = b * x * r * (d + dv) ** 2 / m * eb
    fixed = B * R * D + (B * R * DV if width[1] else Poly())
    fused = Bound(b * r * (d * width[0] + dv * width[1]) + reread, reread, "attention",
                  f"{fixed} + ({B * X * R * (D + DV) * (D + DV)})/M")
    # two matmuls, S = Q K then O = S V, the scores written (at their own size) and read back
    first = _matmul((b, r, d, x), (B, R, D, X), m, eb, width[2])
    # its operands are the scores and V: the narrower of the two sets its M, as the operands' dtype does
    narrow = min(eb, width[2]) if width[2] else eb
    second = _matmul((b, r, x, dv), (B, R, X, DV), capacity_bytes / narrow, narrow, width[1])
    both = first + second
    if both.bytes >= fused.bytes:
        return fused
    return Bound(both.bytes, both.reread, "two matmuls", both.text)
