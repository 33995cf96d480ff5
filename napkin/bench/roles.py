"""Recognising an attention in a diagram: which input is Q, K and V, which wire
plays which part of FlexAttention's and SDPA's (B, H, L, E) layout.

``Analysis(d).run()`` takes a softmax attention apart for the FlexAttention
emitter (napkin/bench/flex.py); ``Analysis(d).loose()`` finds the roles of any
streamed attention (sigmoid, L2 ...) for the benchmark's sizes and its SDPA
speed reference.  Heads come in three forms:

* one head wire both Q and K/V carry, ``Q[b, h, q, d]``, ``K[b, h, x, d]``;
* grouped-query heads, K/V carrying the kv heads hk and Q the query heads
  (hk g), as one axis ``Q[b, (hk g), q, d]`` or apart ``Q[b, hk, g, q, d]``;
* multi-query, a head wire Q carries and K/V lack, ``K[b, x, d]``: one kv
  head (FlexAttention's and SDPA's enable_gqa with H_kv = 1);
* maps: differential attention's |g| softmax maps per head, Q and K holding
  their features as one axis (g d), V without g, ``Q[b, h, q, (g d)]``: to
  flex, h * |g| heads, every one with its own keys and V repeated over g.

When Q carries two wires K lacks (apart GQA, multi-query), the query row is
the one the schedule tiles (``q by 128``), the other the heads.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .. import autotune, ir
from ..codegen.exprs import fold
from ..errors import NapkinError
from ..printer import expr_text


class NoFlexEquivalent(NapkinError):
    """The diagram computes something FlexAttention cannot express."""

    def __init__(self, diagram: str, why: str):
        self.why = why
        super().__init__(f"diagram {diagram}: no FlexAttention equivalent: {why}")


def inline(d: ir.Diagram, e: ir.Expr, refuse) -> ir.Expr:
    """e with every box it reads substituted in (boxes are names, not storage)."""
    if isinstance(e, ir.TensorRef):
        let = next((t for t in d.lets if t.name == e.name), None)
        if let is None:
            return e
        if e.wires is not None and tuple(e.wires) != ir.axis_wires(let.axes):
            refuse(f"the box {e.name} is read relabelled ({e.name}[{', '.join(e.wires)}])")
        return inline(d, let.expr, refuse)
    return rebuild(e, lambda c: inline(d, c, refuse))


def rebuild(e: ir.Expr, f) -> ir.Expr:
    """e with f applied to each direct child."""
    if isinstance(e, ir.Unary):
        return ir.Unary(e.op, f(e.operand))
    if isinstance(e, ir.Binary):
        return ir.Binary(e.op, f(e.lhs), f(e.rhs))
    if isinstance(e, ir.Call):
        return ir.Call(e.fn, tuple(f(a) for a in e.args))
    if isinstance(e, ir.Reduce):
        return ir.Reduce(e.op, e.wires, f(e.body))
    if isinstance(e, ir.Normalize):
        return ir.Normalize(e.op, e.wire, f(e.body))
    return e


def replace(e: ir.Expr, old: ir.Expr, new: ir.Expr) -> ir.Expr:
    return new if e == old else rebuild(e, lambda c: replace(c, old, new))


def gates(t: ir.Input, v: ir.Input, key: str) -> bool:
    """Whether input t, multiplied into v in a sum along ``key``, is a gate on that
    value (sum[x](P * V * gate)): along the key and v's wires alone."""
    wires = set(ir.axis_wires(t.axes))
    return key in wires and wires <= set(ir.axis_wires(v.axes))


def is_neg_inf(e: ir.Expr) -> bool:
    return isinstance(e, ir.Num) and e.value == float("-inf")


def const(e: ir.Expr, d: ir.Diagram) -> Optional[float]:
    """The value of e when it is made of numbers and fixed wire sizes only
    (the code generator's own constant folding), as a float; None otherwise."""
    v = fold(e, {w.name: w.size for w in d.wires if w.size is not None})
    return None if v is None or isinstance(v, complex) or math.isnan(v) else float(v)


@dataclass
class Roles:
    """Which wire plays which part in flex's (B, H, L, E) layout."""

    row: str                      # q
    key: str                      # x
    dim: str                      # d, contracted in the score
    vdim: str                     # V's feature wire (d again, usually)
    batch: Optional[str]          # b, or None (then B = 1)
    head: Optional[ir.Axis]       # the query heads, kv-major: ("h",), ("hk", "g") for GQA, or None (H = 1)
    kv_head: Optional[str]        # the head wire K and V carry: head[0], or None (multi-query, or no heads)
    apart: bool = False           # Q holds hk and g as two axes, Q[b, hk, g, q, d], not one (hk g)
    # the score's other contractions' wires, added to dim's (MLA's r beside c): flex and SDPA take
    # the parts side by side, one (c + r)-wide Q and K
    more_dims: tuple[str, ...] = ()
    # differential attention's maps: g of Q's and K's (g dim) axis, V lacking it; flex's head is
    # h * |g| + g (the head's maps adjacent), V repeated over g.  maps_size: |g|, fixed
    maps: Optional[str] = None
    maps_size: int = 1

    @property
    def gqa(self) -> bool:
        """Query heads share kv heads (grouped or multi-query): enable_gqa."""
        return self.head is not None and self.head != (self.kv_head,)

    @property
    def group(self) -> Optional[str]:
        """g of grouped heads (hk g), flex's head h being hk * |g| + g; None for one head wire."""
        return self.head[1] if self.head is not None and len(self.head) == 2 else None


class Analysis:
    """Takes a diagram apart into flex's pieces, or refuses with a reason."""

    def __init__(self, d: ir.Diagram):
        # K[b, h, x, d] of K[b, h, x, d] is K: the score's contraction was refused as "not sum[d](Q * K)
        # of two inputs" for it
        self.d = ir.plain_reads(d)
        self.gate = None   # a gate on the value, sum[x](softmax[x](S) * V * gate): an input, or None

    def refuse(self, why: str):
        raise NoFlexEquivalent(self.d.name, why)

    def run(self):
        d = self.d
        lets = {t.name: t for t in d.lets}
        attention, lse, score = None, None, None
        for out in d.outputs:
            if out.name not in lets:
                self.refuse(f"output {out.name} is an input, not an attention output")
            e = inline(d, lets[out.name].expr, self.refuse)
            if isinstance(e, ir.Reduce) and e.op == "logsumexp" and len(e.wires) == 1:
                lse, s = out.name, e.body
                key = e.wires[0]
            elif isinstance(e, ir.Reduce) and e.op == "sum" and len(e.wires) == 1 and attention is None:
                attention, key = out.name, e.wires[0]
                s, value = self._softmax_times_value(out.name, e)
            else:
                self.refuse(f"output {out.name} is neither softmax attention sum[x](softmax[x](S) * V) "
                            "nor its logsumexp[x](S), and flex_attention only normalises with softmax")
            if score is not None and (s != score or key != self.key):
                self.refuse("the outputs do not share one score and key wire")
            score, self.key = s, key
        if attention is None:
            self.refuse("no output contracts softmax weights with a value tensor")
        self.attention, self.lse, self.value = attention, lse, value
        self.raw, self.q, self.k = self._contraction(score)
        self.roles = self._roles()
        return score

    def loose(self) -> "Roles":
        """The roles of any streamed attention, softmax or not (sigmoid, L2):
        the one contraction sum[d](Q * K) of two inputs, and the value input V
        some sum along the key wire multiplies by.  For the SDPA speed
        reference, which needs only the sizes."""
        d = self.d
        self.exprs = exprs = [inline(d, d.tensor(o.name).expr, self.refuse) for o in d.outputs
                              if isinstance(d.tensor(o.name), ir.Let)]
        nodes = [n for e in exprs for n in ir.walk(e)]
        raws = {n for n in nodes if isinstance(n, ir.Reduce) and n.op == "sum" and len(n.wires) == 1
                and isinstance(n.body, ir.Binary) and n.body.op == "*"
                and all(isinstance(t, ir.TensorRef) and isinstance(d.tensor(t.name), ir.Input)
                        for t in (n.body.lhs, n.body.rhs))}
        if len(raws) > 1:   # contractions added up into one score (MLA's parts): their sum
            raw = next((s for e in exprs if (s := ir.sum_of(e, raws)) is not None), None)
        else:
            raw = raws.pop() if raws else None
        if raw is None:
            self.refuse("not an attention: no single contraction sum[d](Q * K) of two inputs, nor "
                        "contractions added up into one score")
        operands = {t.name for part in ir.terms(raw) for t in (part.body.lhs, part.body.rhs)}
        found = {(f.name, n.wires[0]) for n in nodes if isinstance(n, ir.Reduce) and n.op == "sum"
                 and len(n.wires) == 1 and n != raw for f in ir.factors(n.body)
                 if isinstance(f, ir.TensorRef) and f.name not in operands
                 and isinstance(d.tensor(f.name), ir.Input) and n.wires[0] in ir.axis_wires(d.tensor(f.name).axes)}
        if len(found) > 1:   # a gate on the value (sum[x](P * V * gate)): its wires are all V's
            found = {(n, w) for n, w in found
                     if not any(m != n and gates(d.tensor(n), d.tensor(m), w) for m, _ in found)}
        if len(found) != 1:
            self.refuse("not an attention: no single value input contracted along the key wire")
        value, self.key = found.pop()
        self.value = d.tensor(value)
        self.raw, self.q, self.k = self._contraction(raw)
        return self._roles()

    def _softmax_times_value(self, name: str, e: ir.Reduce):
        factors = ir.factors(e.body)
        soft = [f for f in factors if isinstance(f, ir.Normalize)]
        rest = [f for f in factors if not isinstance(f, ir.Normalize)]
        if len(soft) != 1 or soft[0].op != "softmax" or soft[0].wire != e.wires[0]:
            shown = expr_text(e)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            self.refuse(f"output {name} = {shown} is not softmax attention sum[{e.wires[0]}]"
                        f"(softmax[{e.wires[0]}](S) * V), and flex_attention only normalises with softmax")
        if not rest or len(rest) > 2 or not all(isinstance(f, ir.TensorRef) and f.wires is None
                                                and isinstance(self.d.tensor(f.name), ir.Input) for f in rest):
            self.refuse(f"output {name} must be sum[x](softmax[x](S) * V) with V an input read along its own wires")
        ts = sorted((self.d.tensor(f.name) for f in rest), key=lambda t: -len(t.axes))
        if len(ts) == 2:   # sum[x](P * V * gate): the gate along the keys and V's wires alone, one an axis
            if not gates(ts[1], ts[0], e.wires[0]) or any(len(a) > 1 for t in ts for a in t.axes):
                self.refuse(f"output {name} must be sum[x](softmax[x](S) * V), or V times a gate along {e.wires[0]} "
                            "and V's wires, each an input read along its own wires, one wire an axis")
            self.gate = ts[1]
        return soft[0].body, ts[0]

    def _contraction(self, score: ir.Expr):
        """(the score's contraction, Q, K); several contractions added up (MLA's
        sum[c](Qc * Kc) + sum[r](Qr * Kr)) are their sum, Q and K the first's, and
        ``self.parts`` holds every (Q, K, wire)."""
        raws = list(dict.fromkeys(n for n in ir.walk(score) if isinstance(n, (ir.Reduce, ir.Normalize))))
        raw = raws[0] if len(raws) == 1 else ir.sum_of(score, raws)
        if raw is None or not all(isinstance(r, ir.Reduce) for r in raws):
            self.refuse("the score must hold exactly one contraction sum[d](Q * K), or contractions added up, "
                        "and no other reduction")
        self.parts = []
        for part in ir.terms(raw):
            body = part.body
            ok = (part.op == "sum" and len(part.wires) == 1 and isinstance(body, ir.Binary) and body.op == "*"
                  and all(isinstance(t, ir.TensorRef) and t.wires is None
                          and isinstance(self.d.tensor(t.name), ir.Input) for t in (body.lhs, body.rhs)))
            if not ok:
                self.refuse("the score's contraction is not sum[d](Q * K) of two inputs")
            a, b = (self.d.tensor(t.name) for t in (body.lhs, body.rhs))
            with_key = [t for t in (a, b) if self.key in ir.axis_wires(t.axes)]
            if len(with_key) != 1:
                self.refuse(f"exactly one side of the contraction must carry the key wire {self.key}")
            k = with_key[0]
            self.parts.append((b if k is a else a, k, part.wires[0]))
        return raw, self.parts[0][0], self.parts[0][1]

    def _roles(self) -> Roles:
        dim, key = self.parts[0][2], self.key
        for q, k, w in self.parts[1:]:   # the other parts: laid out as the first, their own wire last
            for t, first in ((q, self.q), (k, self.k)):
                if [a for a in t.axes if a != (w,)] != [a for a in first.axes if a != (dim,)]:
                    self.refuse(f"{t.name}{layout(t.axes)} is not laid out as {first.name}{layout(first.axes)} "
                                f"with {w} for {dim}: flex and SDPA take the score's parts side by side")
        kw = set(ir.axis_wires(self.k.axes))
        maps = self._maps(dim)
        row, gqa, shared = [], [], []
        for axis in self.q.axes:
            if axis == (dim,) or (maps is not None and axis == (maps, dim)):
                continue
            if len(axis) == 1 and axis[0] not in kw:
                row.append(axis[0])
            elif len(axis) == 1:
                shared.append(axis)
            elif len(axis) == 2 and axis[0] in kw and axis[1] not in kw:
                gqa.append(axis)      # (hk g): query head i uses kv head i // |g|, as enable_gqa does
            else:
                self.refuse(f"{self.q.name}'s axis ({' '.join(axis)}) has no place in flex's (B, H, L, E) layout")
        apart = len(row) == 2 and not gqa
        if apart:   # multi-query K[b, x, d], or GQA apart Q[b, hk, g, q, d]: which is the query row?
            row = self._query_row(row)
        if len(row) != 1 + apart or len(gqa) > 1 or len(shared) + len(gqa) > 2 or (gqa and len(shared) > 1):
            self.refuse(f"{self.q.name}{layout(self.q.axes)} is not a (batch, heads, queries, dim) layout")
        if apart and len(shared) == 2:          # GQA apart: K carries b and hk
            batch, kv_head, head = shared[0][0], shared[1][0], (shared[1][0], row[1])
        elif apart:                             # multi-query: K carries b (or nothing) and no head
            batch, kv_head, head = (shared[0][0] if shared else None), None, (row[1],)
        elif gqa:
            batch, head = (shared[0][0] if shared else None), gqa[0]
            kv_head = head[0]
        else:
            batch = shared[0][0] if len(shared) == 2 else None
            head = shared[-1] if shared else None
            kv_head = head[0] if head else None
        apart = apart and kv_head is not None
        if maps is not None and (apart or gqa or (head is not None and head != (kv_head,))):
            self.refuse(f"{self.q.name}{layout(self.q.axes)} holds maps ({maps} {dim}) beside grouped or "
                        "multi-query heads: no flex layout takes both")
        vw = [w for w in ir.axis_wires(self.value.axes) if w not in (batch, key, kv_head)]
        if len(vw) != 1:
            self.refuse(f"{self.value.name}{layout(self.value.axes)} is not a (batch, heads, keys, dim) layout")
        roles = Roles(row[0], key, dim, vw[0], batch, head, kv_head, apart, tuple(w for _, _, w in self.parts[1:]),
                      maps, self.d.wire(maps).size if maps is not None else 1)
        kv = [w for w in (batch, kv_head) if w is not None]
        for t, last in ((self.k, (maps, dim) if maps is not None else (dim,)), (self.value, (vw[0],))):
            want = {(w,) for w in kv + [key]} | {last}
            if set(t.axes) != want or len(t.axes) != len(want):
                self.refuse(f"{t.name}{layout(t.axes)} is not a (batch, heads, keys, dim) layout")
        return roles

    def _maps(self, dim: str) -> Optional[str]:
        """g when Q and K both hold their features as one axis (g dim), dim the
        contracted wire, V lacking g and the score one contraction:
        differential attention's maps (its outputs carry g).  A g of no fixed
        size is refused: flex's heads are h * |g|, split again by it."""
        held = [a for a in self.q.axes if len(a) == 2 and a[1] == dim]
        if len(held) != 1 or held[0] not in self.k.axes or len(self.parts) > 1 \
                or held[0][0] in ir.axis_wires(self.value.axes):
            return None
        g = held[0][0]
        if self.d.wire(g).size is None:
            self.refuse(f"{self.q.name}{layout(self.q.axes)}: the maps wire {g} has no fixed size "
                        f"(declare wire {g} = N): flex's heads are split by it")
        return g

    def _query_row(self, row: list) -> list:
        """[the query row, the query heads] of the two wires Q carries and K
        lacks: the row is the one the schedule tiles (``group q by 128``, not
        ``h by 1``); the attention is the same function either way, but the
        FLOPs and the benchmark's sizes follow the roles."""
        tiled = [w for w in row if w in autotune.tiled_wires(self.d)]
        if len(tiled) != 1:
            self.refuse(f"{self.q.name}{layout(self.q.axes)} has two wires {self.k.name}{layout(self.k.axes)} "
                        f"lacks ({', '.join(row)}), and the schedule tiles "
                        + ("neither: which is the queries? (tile the query wire in the smem or regs level)"
                           if not tiled else "both: which is the queries? (tile the heads by 1, or write "
                           "grouped heads as one axis (hk g))"))
        return tiled + [w for w in row if w not in tiled]


def layout(axes) -> str:
    return "[" + ", ".join(a[0] if len(a) == 1 else "(" + " ".join(a) + ")" for a in axes) + "]"
