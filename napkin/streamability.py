"""Pass 2, part 5: can every box be computed chunk by chunk along a streamed wire?

Run by napkin.check for each wire a level streams; it reports through the
checker (its ``err``) and skips the boxes the checker found broken.
"""
from __future__ import annotations

from . import ir
from .ir import show


class Streamability:
    """Can every box be computed chunk by chunk along the streamed wire w?

    Each value gets three facts: ``along`` (it still varies along w),
    ``done`` (it depends on a reduction over w that is complete only after
    the last chunk: (op, description)) and ``soft`` (it is a softmax over w,
    whose normaliser is likewise complete only at the end: (description,
    box name or None)).  A value both ``along`` and ``done`` cannot be
    computed per chunk.  A ``soft`` value streams only when it flows
    linearly (through * and /) into a sum over w, which rescales its
    accumulator as the running max moves: the online-softmax trick.
    """

    def __init__(self, checker, wire: str):
        self.c, self.w, self.d = checker, wire, checker.d
        self.info: dict[str, tuple] = {}

    def run(self) -> None:
        for t in self.d.inputs:
            self.info.setdefault(t.name, (self.w in ir.axis_wires(t.axes), None, None))
        for let in self.d.lets:
            if let.name in self.info or let.name in self.c.broken_boxes:
                continue
            self.box, self.reported = let.name, False
            along, done, soft = self.eval(let.expr)
            if soft is not None and soft[1] is None:
                soft = (soft[0], let.name)
            self.info[let.name] = (along, done, soft)
        for out in self.d.outputs:
            soft = self.info.get(out.name, (False, None, None))[2]
            if soft is not None:
                self.bad_softmax(soft, f"the output list (out {out.name})", out.loc)

    def eval(self, e: ir.Expr) -> tuple:
        w = self.w
        if isinstance(e, (ir.Num, ir.WireSize)):
            return False, None, None
        if isinstance(e, ir.WireIndex):
            return e.wire == w, None, None
        if isinstance(e, ir.TensorRef):
            along, done, soft = self.info.get(e.name, (False, None, None))
            if e.wires is not None:
                along = w in e.wires
            return self.settle(e, along, done, soft)
        if isinstance(e, ir.Reduce):
            along, done, soft = self.eval(e.body)
            head = f"{e.op}[{', '.join(e.wires)}]"
            if soft is not None and e.op != "sum":
                self.bad_softmax(soft, f"{head} in {self.box}", e.loc)
                soft = None
            if w in e.wires and along:
                return False, (e.op, f"{head} of {show(e.body)}"), None
            return along, done, soft
        if isinstance(e, ir.Normalize):
            along, done, soft = self.eval(e.body)
            if soft is not None:
                self.bad_softmax(soft, f"{e.op}[{e.wire}] in {self.box}", e.loc)
            if e.wire == w:
                return True, None, (f"{e.op}[{w}] of {show(e.body)}", None)
            return along, done, None
        children = [e.operand] if isinstance(e, ir.Unary) else [e.lhs, e.rhs] if isinstance(e, ir.Binary) \
            else list(e.args)
        facts = [self.eval(x) for x in children]
        softs = [i for i, f in enumerate(facts) if f[2] is not None]
        soft = None
        if softs:
            linear = isinstance(e, ir.Binary) and len(softs) == 1 and (e.op == "*" or (e.op == "/" and softs == [0]))
            if linear:
                soft = facts[softs[0]][2]
            else:
                what = e.fn if isinstance(e, ir.Call) else f"'{e.op}'"
                hint = None
                if isinstance(e, ir.Binary) and e.op in "+-":
                    # differential attention's P1 - lam * P2: linear, but one normaliser a sum
                    hint = (f"give each softmax a sum of its own: sum[{w}]((A {e.op} B) * V) is "
                            f"sum[{w}](A * V) {e.op} sum[{w}](B * V), which streams")
                self.bad_softmax(facts[softs[0]][2], f"{what} in {self.box}", e.loc, hint)
        along = any(f[0] for f in facts)
        done = next((f[1] for f in facts if f[1] is not None), None)
        return self.settle(e, along, done, soft)

    def settle(self, e: ir.Expr, along: bool, done, soft) -> tuple:
        """Report a completed reduction over w used beside values along w."""
        if along and done is not None:
            if not self.reported:
                self.reported = True
                op, what = done
                hint = (f"softmax[{self.w}] streams with a running max" if op in ("max", "logsumexp")
                        else f"reduce over {self.w} last, or do not stream {self.w} at this level")
                self.c.err(f"{self.box} uses {what} beside values along {self.w}: that {op} is complete only "
                           f"after the last chunk of {self.w}, so {self.box} cannot be computed chunk by chunk",
                           e.loc, hint)
            done = None  # reported once; do not cascade into later boxes
        return along, done, soft

    def bad_softmax(self, soft: tuple, consumer: str, loc: ir.Loc, hint: str | None = None) -> None:
        what, box = soft
        subject = f"{box} (a {what})" if box else what
        ref = box or "softmax(...)"
        self.c.err(f"{subject} cannot stream over {self.w}: {consumer} uses it, but a softmax over a "
                   f"streamed wire can only feed a sum over it, as in sum[{self.w}]({ref} * V)", loc,
                   hint or f"its normaliser is complete only after the last chunk of {self.w}; "
                   f"stream another wire, or do not stream {self.w}")
