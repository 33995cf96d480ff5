"""Lowering of the STREAMED ATTENTION family (see lower.py for the plan).

Steps, for a diagram whose outputs reduce the streamed wire x over a score
tile that holds a contraction ``sum[d](Q * K)``:

1. roles: the score contraction(s) give the row wire (q: the row side's own
   wire the schedule groups) and the batch wires (the score's other wires);
2. each reduction along x becomes an accumulator (``Accum``): softmax is
   rewritten exp(E) / sum[x](exp(E)) with a guarded division; x-invariant
   factors move out of sums; a factor exp(E) makes an "expsum" sharing a
   running max per E; a factor along the value wire makes the step a tl.dot;
3. exp(m) cancels in ratios of expsums (acc / l), logsumexp is m + log(l);
4. tiles: inputs read inside the score are loaded (before the loop when they
   lack x), boxes the accumulators use get per-step variables;
5. skipping: the first ``where(pred, s, -inf)`` is the mask; blocks where it
   is false may be skipped when every accumulator's body is its identity at
   a -inf score (``masks.value_when_masked``); the loop bounds come from the
   predicate's affine conjuncts (``masks.stream_bounds``).
"""
from __future__ import annotations

from typing import Optional

from .. import ir, masks, tiling
from .lower import (
    DEFAULT_BLOCK_ROW, DEFAULT_BLOCK_STREAM, Accum, AttentionPlan, Dot, LogSumExp, Output, SafeDiv, Var, _ExpSum,
    _LogExpSum, _Loads, _block, _factors, _finalise_leaves, _group_block, _precision, _product,
    _red_wires, _show, _streamed, nodes, packed_wire, read_wires, unsupported, walk_until, wires_of,
)
from .kernel_names import fresh_name, internal_names

# Names the attention kernel's skeleton and loop bounds define.
KERNEL_NAMES = frozenset({"_pid", "_batch", "_row0", "_start", "_lo", "_hi", "_flo", "_fhi", "_row_first",
                          "_row_last", "_col_first", "_col_last", "_live"})


def lower_attention(d: ir.Diagram, exprs: dict, col: str) -> AttentionPlan:
    return _Attention(d, exprs, col).plan()


def _not_col_alone(node: ir.Reduce, col: str):
    """A reduction over the streamed wire and others at once: the refusal, said
    by plan's pre-check (before the score contraction is picked) and lower_reduce."""
    return unsupported(_show(node), f"it reduces {', '.join(node.wires)} at once; a streamed kernel "
                       f"reduces {col} alone", node.loc)


class _Attention:
    def __init__(self, d: ir.Diagram, exprs: dict, col: str):
        self.d, self.exprs, self.col = d, exprs, col
        self.accums: list[Accum] = []
        self.groups: dict[object, str] = {}   # exponent E -> running-max var
        # names the kernel defines itself (loop bounds): no load may take them
        self.taken: set[str] = set(KERNEL_NAMES)
        self.dots: list[Dot] = []
        self.step_subst: dict = {}
        self.tiles: list[tuple[str, object]] = []

    def plan(self) -> AttentionPlan:
        d, col = self.d, self.col
        outs = [self.exprs[o.name] for o in d.outputs]
        contractions = []
        for e in outs:
            for n in nodes(e):
                if isinstance(n, ir.Reduce) and col not in n.wires and n not in contractions:
                    contractions.append(n)
        if not contractions:
            raise unsupported(f"diagram {d.name}", "the reductions along the streamed wire need a score "
                              "contraction such as sum[d](Q * K)", d.loc)
        for e in outs:   # sum[h, x](...): said here, not as a score contraction of h (the pick of col)
            for n in nodes(e):
                if isinstance(n, ir.Reduce) and col in n.wires and len(n.wires) > 1:
                    raise _not_col_alone(n, col)
        sides = [self.sides(c) for c in contractions]
        self.key = sides[0][1]   # the first contraction's key: the dK/dV kernel's programs index its wires
        self.row = row = self.row_wire(contractions[0], sides[0])
        self.score_wires = frozenset().union(*(wires_of(d, c) for c in contractions))
        order = [w.name for w in d.wires]
        self.batch = batch = tuple(w for w in order if w in self.score_wires and w not in (row, col))
        pack = packed_wire(d, batch, row)

        finals = [self.lower_final(e, f"output {o.name}") for e, o in zip(outs, d.outputs)]
        step_loads = _Loads(d, "step", self.taken)
        for i, (c, side) in enumerate(zip(contractions, sides)):
            self.step_subst[c] = self.dot(c, side, i, step_loads)
        tile_exprs = [x for a in self.accums for x in (a.exponent, a.tile) if x is not None]
        self.name_tiles(tile_exprs)
        self.tile_loads([(e, False) for e in tile_exprs] + [(t, True) for _, t in self.tiles], step_loads)
        accums = [self.bind_value(a, step_loads) for a in self.accums]
        dims = {c.wires[0] for c in contractions} | {a.value.cols for a in accums if a.value is not None}

        outputs = []
        for o, fin in zip(d.outputs, finals):
            let = d.tensor(o.name)
            wires = ir.axis_wires(let.axes)
            extra = [w for w in wires if w not in set(batch) | {row}]
            if len(extra) > 1:
                raise unsupported(f"output {o.name}", f"it keeps {', '.join(extra)} besides the row wire "
                                  f"{row}; a program holds at most one more wire", let.loc)
            cols = extra[0] if extra else None
            fin = _finish(fin)
            subst = {n: n.name for n in nodes(fin) if isinstance(n, Var)}
            _finalise_leaves(d, fin, subst, step_loads, row, cols, set(batch) | {row} | set(extra),
                             f"output {o.name}")
            outputs.append(Output(o.name, let.axes, wires, tiling.tensor_dtype(d, o.name), fin, row, cols,
                                  tuple(subst.items())))
            if cols is not None:
                dims.add(cols)
        skip, bounds, full = self.skipping(accums)
        tile = _group_block(d, row)
        rows = _block(tile, DEFAULT_BLOCK_ROW)
        if pack is not None:  # packed rows (packed_wire): the packed wire's group times the row wire's
            rows = _block(None, pack[1] * (tile.size if tile is not None else DEFAULT_BLOCK_ROW))
        blocks = ((row, rows),
                  (col, _block(_streamed(d), DEFAULT_BLOCK_STREAM)))
        # one table for every load, so each tile is loaded once (pre-loop first)
        loads = tuple(ld for ld in step_loads.loads if ld.phase == "pre") \
            + tuple(ld for ld in step_loads.loads if ld.phase == "step")
        return AttentionPlan(
            d, row, col, batch, blocks, tuple(w for w in order if w in dims), loads, tuple(self.dots),
            tuple(self.tiles), tuple(self.step_subst.items()),
            tuple((m, e) for e, m in self.groups.items()), tuple(accums), tuple(outputs), bounds, skip,
            _precision(d), full, pack)

    # ---- roles of the wires ----
    def row_wire(self, c: ir.Reduce, sides) -> str:
        """The blocked wire: the row side's own wire that the schedule groups
        by more than 1.  With none, the query wire by its look: an own wire
        that is an axis by itself (a wire flattened with another, g of
        (hk g), is a head), one the diagram compares with the key wire's
        index or subtracts from it (q of x <= q, of abs(q - x)) before one it
        reads as an index at all (h of 2^-(h + 1)), the last such (q in
        Q[b, h, q, d]).  By layout order alone, Q[b, q, (hk g), d] blocked
        g: a program per query, K and V read once per query.  Two such wires
        with neither told apart (Q[b, q, h, d] beside K[b, x, d], no mask)
        block the last: a schedule says which."""
        d = self.d
        a, b = sides
        own = [w for w in read_wires(d, a) if w not in c.wires and w not in read_wires(d, b)]
        grouped = [w for w in own if (t := _group_block(d, w)) is not None and t.size > 1]
        if grouped:
            return grouped[-1]
        if not own:
            raise unsupported(_show(c), f"its factor {a.name} has no wire of its own to block", c.loc)
        flat = iter(read_wires(d, a))
        axes = [tuple(next(flat) for _ in axis) for axis in d.tensor(a.name).axes]
        alone = [w for w in own if (w,) in axes] or own
        indexed = {n.wire for let in d.lets for n in ir.walk(let.expr) if isinstance(n, ir.WireIndex)}
        related = self._beside_key()
        return ([w for w in alone if w in related] or [w for w in alone if w in indexed] or alone)[-1]

    def _beside_key(self) -> set[str]:
        """The wires whose index the diagram compares with the key wire's or
        subtracts from it (or it from them): positions, not heads."""
        out: set[str] = set()
        for let in self.d.lets:
            for n in ir.walk(let.expr):
                if isinstance(n, ir.Binary) and (n.op in ir.COMPARE_OPS or n.op == "-"):
                    lhs, rhs = ({m.wire for m in ir.walk(e) if isinstance(m, ir.WireIndex)} for e in (n.lhs, n.rhs))
                    out |= (rhs if self.col in lhs else set()) | (lhs if self.col in rhs else set())
        return out - {self.col}

    def sides(self, c: ir.Reduce) -> tuple[ir.TensorRef, ir.TensorRef]:
        """(row side, streamed side) of a score contraction sum[w](A * B)."""
        d, col = self.d, self.col
        body = c.body
        ok = (c.op == "sum" and isinstance(body, ir.Binary) and body.op == "*"
              and isinstance(body.lhs, ir.TensorRef) and isinstance(body.rhs, ir.TensorRef)
              and all(isinstance(d.tensor(r.name), ir.Input) for r in (body.lhs, body.rhs)))
        if not ok and any(isinstance(n, ir.Reduce) and col in n.wires for n in nodes(c.body)):
            # Y = sum[d](O) of an attention O: the streamed wire is the outermost reduction's (d)
            raise unsupported(_show(c), f"an output reduces it again along {col}: a kernel streams the wire "
                              f"of its outputs' outermost reduction ({col} here) and ends there", c.loc,
                              "output this result and reduce it in torch")
        if not ok:
            raise unsupported(_show(c), "a score contraction must be sum[w](A * B) of two inputs", c.loc,
                              self.fold_hint(c))
        if len(c.wires) != 1:
            raise unsupported(_show(c), "a score contraction joins one wire", c.loc)
        a, b = body.lhs, body.rhs
        if col in read_wires(d, a):
            a, b = b, a
        if col in read_wires(d, a) or col not in read_wires(d, b):
            raise self.one_sided(c, both=col in read_wires(d, a))
        return a, b

    def fold_hint(self, c: ir.Reduce) -> Optional[str]:
        """What to do with a third factor of the contraction read along neither the
        rows nor the keys (a per-dimension scale, sum[d](Q * K * s)): it is one
        side's, multiplied into it before the call; the tiles take two factors."""
        parts = ir.factors(c.body)
        if len(parts) < 3 or not all(isinstance(f, ir.TensorRef) for f in parts):
            return None
        # the rows' factor is the widest without the key wire; a narrower one rides on it
        rows = [f for f in parts if self.col not in read_wires(self.d, f)]
        widest = max((len(read_wires(self.d, f)) for f in rows), default=0)
        extra = [f for f in rows if len(read_wires(self.d, f)) < widest]
        if not extra:
            return None
        into = _show(next(f for f in rows if len(read_wires(self.d, f)) == widest))
        shown = " * ".join(_show(f) for f in extra)
        return (f"multiply {shown} into {into} in torch before the call and pass {into} * {shown} as {into} "
                "(the same scores; the tiles multiply two factors)")

    def one_sided(self, c: ir.Reduce, both: bool):
        """The refusal of a contraction of one side alone: sum[d](Q * Q) (a
        query's norm, cosine attention's) reads no key, sum[d](K * K) only
        keys; the kernel's contractions are scores, a side of rows against a
        side of keys.  Its box can be computed before the kernel and passed
        in, which the hint says with the box's own layout."""
        from ..printer import layout_text

        col, (w,) = self.col, c.wires or ("",)
        which = f"both factors are along the streamed wire {col}" if both else \
            f"neither factor is along the streamed wire {col}"
        box = next((let for let in self.d.lets if any(n == c for n in ir.walk(let.expr))), None)
        hint = None if box is None else (f"compute {box.name} in torch before the kernel and pass it in as "
                                         f"an input: in {box.name}{layout_text(box.axes)} : fp32")
        return unsupported(_show(c), f"{which}; a kernel contracts {w} only in a score, one factor along {col} "
                           f"(the keys) and one without it (the rows)", c.loc, hint)

    def dot(self, c: ir.Reduce, sides, i: int, loads: _Loads) -> str:
        d = self.d
        a, b = sides
        (w,) = c.wires
        for ref, own in ((a, self.row), (b, self.col)):
            ws = read_wires(d, ref)
            extra = set(ws) - {own, w} - set(self.batch)
            if own not in ws or extra:
                raise unsupported(_show(c), f"{ref.name} must be along {own}, {w} and batch wires only",
                                  ref.loc)
        lhs = loads.get(a, self.row, w, "pre")
        rhs = loads.get(b, self.col, w, "step")
        var = f"_qk{i}" if i else "_qk"
        self.taken.add(var)
        self.dots.append(Dot(var, lhs, rhs, w))
        return var

    def name_tiles(self, tile_exprs) -> None:
        """Per-step variables for the boxes the accumulators use (readable code).
        A box is the user's name: ``_`` + it unless the kernel has that
        variable already (a box called ``m`` would overwrite the running max
        ``_m``, one called ``qk`` the score product ``_qk``), else the next
        free ``_m_1``, as loads are named."""
        d = self.d
        used = {n for e in tile_exprs for n in nodes(e)}
        reserved = internal_names(d)
        for let in d.lets:
            e = self.exprs[let.name]
            if e in used and e not in self.step_subst and not isinstance(e, (ir.TensorRef, ir.Num)) \
                    and self.col in wires_of(d, e):
                var = fresh_name(let.name, self.taken, reserved)
                self.taken.add(var)
                self.tiles.append((var, e))
                self.step_subst[e] = var

    def tile_loads(self, exprs, loads: _Loads) -> None:
        d, row, col = self.d, self.row, self.col
        allowed = set(self.batch) | {row, col}
        for e, named in exprs:  # a named box's own root is its variable: look inside it
            for n in walk_until(e, self.step_subst, skip_root=named):
                if isinstance(n, ir.TensorRef):
                    ws = read_wires(d, n)
                    extra = set(ws) - allowed
                    if extra:
                        # the weights too: sum[x](P * (V + G)) put V in the weight tile, not "the score"
                        wires = ", ".join(sorted(extra))
                        raise unsupported(f"{n.name}", f"it is read along {wires} in a tile over ({row}, {col}) "
                                          f"(the scores, or the weights of a sum over {col}); a tensor along "
                                          f"{wires} may only be the value of sum[{col}](weights * V), one input "
                                          "multiplied in alone", n.loc)
                    phase = "step" if col in ws else "pre"
                    ld = loads.get(n, row if row in ws else None, col if col in ws else None, phase)
                    self.step_subst[n] = ld.var
                elif isinstance(n, ir.WireIndex) and n.wire not in allowed:
                    raise unsupported(f"index {n.wire}", f"the score is a tile over ({row}, {col})", n.loc)
                elif isinstance(n, (ir.Reduce, ir.Normalize)):
                    raise unsupported(_show(n), "this reduction cannot be computed inside the loop", n.loc)

    def bind_value(self, a: Accum, loads: _Loads) -> Accum:
        if a.value is None:
            return a
        ref = a.value  # a TensorRef until now
        ws = read_wires(self.d, ref)
        dv = [w for w in ws if w not in set(self.batch) | {self.col}]
        if len(dv) != 1 or self.col not in ws:
            raise unsupported(f"{ref.name} in sum[{self.col}](... * {ref.name})",
                              f"the value factor must be along {self.col}, batch wires and one more wire",
                              ref.loc)
        ld = loads.get(ref, self.col, dv[0], "step")
        return Accum(a.var, a.op, a.tile, a.exponent, a.group, ld)

    # ---- reductions along the streamed wire ----
    def lower_final(self, e, what: str):
        """Replace reductions along x by accumulator placeholders."""
        col = self.col
        if isinstance(e, ir.Reduce) and col in e.wires:
            return self.lower_reduce(e)
        if isinstance(e, ir.Normalize) and e.wire == col:
            raise unsupported(f"{e.op}[{col}]", f"its result keeps {col}; a streamed kernel can only sum it "
                              f"over {col}, as in sum[{col}](P * V)", e.loc)
        if isinstance(e, ir.Unary):
            return ir.Unary(e.op, self.lower_final(e.operand, what), e.loc)
        if isinstance(e, ir.Binary):
            return self.cancel(ir.Binary(e.op, self.lower_final(e.lhs, what), self.lower_final(e.rhs, what),
                                         e.loc))
        if isinstance(e, SafeDiv):
            return self.cancel(SafeDiv(self.lower_final(e.lhs, what), self.lower_final(e.rhs, what)))
        if isinstance(e, ir.Call):
            args = tuple(self.lower_final(a, what) for a in e.args)
            if e.fn == "log" and isinstance(args[0], _ExpSum):
                return _LogExpSum(args[0].acc, args[0].group)
            return ir.Call(e.fn, args, e.loc)
        if col in wires_of(self.d, e):
            raise unsupported(what, f"it keeps the streamed wire {col}", getattr(e, "loc", ir.NOLOC))
        return e

    def lower_reduce(self, node: ir.Reduce):
        d, col = self.d, self.col
        if node.wires != (col,):
            raise _not_col_alone(node, col)
        body = self.softmax_to_exp(node.body)
        if node.op == "logsumexp":
            self.no_inner_reduction(node, body)
            acc, group = self.accum("expsum", None, body, None)
            return _LogExpSum(acc, group)
        if node.op != "sum":
            self.no_inner_reduction(node, body)
            return Var(self.accum(node.op, body, None, None)[0])
        num, den = _factors(body)
        outside = [f for f in num if col not in wires_of(d, f)]
        outside_den = [(f, s) for f, s in den if col not in wires_of(d, f)]
        inside = [f for f in num if col in wires_of(d, f)]
        inside_den = [f for f, s in den if col in wires_of(d, f)]
        values = [f for f in inside if isinstance(f, ir.TensorRef) and isinstance(d.tensor(f.name), ir.Input)
                  and not set(read_wires(d, f)) <= self.score_wires]
        if len(values) > 1:
            raise unsupported(_show(node), "it multiplies two value tensors", node.loc)
        value = values[0] if values else None
        rest = [f for f in inside if f is not value]
        exps = [f.args[0] for f in rest if isinstance(f, ir.Call) and f.fn == "exp"]
        rest = [f for f in rest if not (isinstance(f, ir.Call) and f.fn == "exp")]
        tile = _product(rest)
        for f in inside_den:
            tile = ir.Binary("/", tile if tile is not None else ir.Num(1.0), f)
        for part in exps + ([tile] if tile is not None else []):
            self.no_inner_reduction(node, part)
        if exps:
            exponent = exps[0]
            for e in exps[1:]:
                exponent = ir.Binary("+", exponent, e)
            acc, group = self.accum("expsum", tile, exponent, value)
            result = _ExpSum(acc, group)
        else:
            # a weight of 1 when nothing multiplies (sum[x](V), a count): the emitter needs a tile
            acc, _ = self.accum("sum", tile if tile is not None else ir.Num(1.0), None, value)
            result = Var(acc)
        for f in outside:
            result = ir.Binary("*", result, self.lower_final(f, _show(node)))
        for f, safe in outside_den:
            lowered = self.lower_final(f, _show(node))
            result = self.cancel(SafeDiv(result, lowered) if safe else ir.Binary("/", result, lowered))
        return result

    def no_inner_reduction(self, node, part) -> None:
        for n in nodes(part):
            if isinstance(n, (ir.Reduce, ir.Normalize)) and self.col in _red_wires(n):
                # a softmax of a softmax is no spelled-out softmax: the hint would name what is written
                nested = any(isinstance(m, ir.Normalize) and any(isinstance(k, ir.Normalize) for k in nodes(m.body))
                             for m in nodes(node))
                hint = None if nested else f"write softmax[{self.col}](S) for a normalised score"
                raise unsupported(_show(node), f"it uses a reduction over {self.col} inside a reduction "
                                  f"over {self.col}", n.loc, hint)

    def softmax_to_exp(self, e):
        """softmax[x](E) -> exp(E) / sum[x](exp(E)), the division guarded."""
        if isinstance(e, ir.Normalize) and e.wire == self.col:
            body = self.softmax_to_exp(e.body)
            ex = ir.Call("exp", (body,), e.loc)
            return SafeDiv(ex, ir.Reduce("sum", (self.col,), ex, e.loc))
        if isinstance(e, ir.Unary):
            return ir.Unary(e.op, self.softmax_to_exp(e.operand), e.loc)
        if isinstance(e, ir.Binary):
            return ir.Binary(e.op, self.softmax_to_exp(e.lhs), self.softmax_to_exp(e.rhs), e.loc)
        if isinstance(e, ir.Call):
            return ir.Call(e.fn, tuple(self.softmax_to_exp(a) for a in e.args), e.loc)
        return e

    def accum(self, op, tile, exponent, value) -> tuple[str, Optional[str]]:
        group = None
        if op == "expsum":
            group = self.groups.get(exponent)
            if group is None:
                group = f"_m{len(self.groups)}" if self.groups else "_m"
                self.taken.add(group)
                self.groups[exponent] = group
        for a in self.accums:
            if (a.op, a.tile, a.exponent, a.value) == (op, tile, exponent, value):
                return a.var, a.group
        var = _acc_name(op, value, self.taken)
        self.taken.add(var)
        self.accums.append(Accum(var, op, tile, exponent, group, value))
        return var, group

    def cancel(self, e):
        """exp(m) * acc / (exp(m) * l) -> acc / l: the scales cancel exactly."""
        if isinstance(e, SafeDiv) or (isinstance(e, ir.Binary) and e.op == "/"):
            top, bottom = _expsum_factors(e.lhs), _expsum_factors(e.rhs)
            common = {g for g in top if top.count(g) == 1} & {g for g in bottom if bottom.count(g) == 1}
            if common:
                lhs, rhs = _drop_scale(e.lhs, common), _drop_scale(e.rhs, common)
                return SafeDiv(lhs, rhs) if isinstance(e, SafeDiv) else ir.Binary("/", lhs, rhs, e.loc)
        return e

    # ---- skipping masked blocks ----
    def skipping(self, accums):
        """(mask predicate, loop bounds, full-block bounds) when blocks where
        the mask is false everywhere contribute nothing to any accumulator;
        else (None, (), ()) without a mask (every block inside the edges is
        full) and (None, (), None) with one (no block is known full)."""
        d = self.d
        fixed = {w.name: w.size for w in d.wires if w.size is not None}
        node = None
        for a in accums:
            for x in (a.exponent, a.tile):
                if x is not None and node is None:
                    node = masks.mask_node(x)
        if node is None:
            return None, (), ()
        for a in accums:
            if a.op == "expsum":
                body = ir.Call("exp", (a.exponent,))
                if a.tile is not None:
                    body = ir.Binary("*", body, a.tile)
                want = 0.0
            else:
                body = a.tile if a.tile is not None else ir.Num(1.0)
                want = {"sum": 0.0, "max": float("-inf"), "min": float("inf")}[a.op]
            if masks.value_when_masked(body, node, fixed) != want:
                return None, (), None
        pred = masks.mask_predicate(node)
        # a mask whose every conjunct is a bound once its lengths are read (x < n[b], q - x < w):
        # the loops' bounds load them, no prepass (see lengths()).  Reading no length, these are
        # the exact bounds without them (None stays None: a length only adds bounds)
        exact = masks.exact_bounds(pred, self.row, self.col, fixed, self.lengths(pred))
        if exact is not None and masks.lengths_read(exact):
            return pred, exact, exact
        return pred, masks.stream_bounds(pred, self.row, self.col, fixed), exact

    def lengths(self, pred) -> frozenset:
        """The integer inputs the mask's bounds may read at run time (masks.affine's data):
        those it reads whole (no coarse step) along their own wires, every one a batch wire the
        key has, so every kernel's program has one index of each and loads the value once
        (the forward and dQ index every batch wire, dK/dV the key's; a value per g of GQA's
        would vary in dK/dV's loop over g).  Any other keeps the ranges prepass."""
        d = self.d
        on = set(self.batch) & set(read_wires(d, self.key))
        out = set()
        bad = set()
        for n in ir.walk(pred):
            if not isinstance(n, ir.TensorRef):
                continue
            t = d.tensor(n.name)
            own = ir.axis_wires(t.axes) if isinstance(t, ir.Input) else ()
            if (isinstance(t, ir.Input) and t.dtype in ir.NUMBER_INT_DTYPES and n.steps is None
                    and (n.wires is None or tuple(n.wires) == own) and set(own) <= on):
                out.add(n.name)
            else:
                bad.add(n.name)
        return frozenset(out - bad)


def _finish(e):
    """Render the lowering placeholders: an expsum keeps exp2(m) * acc (m in
    log2 units), a logsumexp is m * ln 2 + log(acc) (LogSumExp)."""
    if isinstance(e, _ExpSum):
        return ir.Binary("*", ir.Call("exp2", (Var(e.group),)), Var(e.acc))
    if isinstance(e, _LogExpSum):
        return LogSumExp(e.group, e.acc)
    if isinstance(e, ir.Unary):
        return ir.Unary(e.op, _finish(e.operand), e.loc)
    if isinstance(e, ir.Binary):
        return ir.Binary(e.op, _finish(e.lhs), _finish(e.rhs), e.loc)
    if isinstance(e, SafeDiv):
        return SafeDiv(_finish(e.lhs), _finish(e.rhs))
    if isinstance(e, ir.Call):
        return ir.Call(e.fn, tuple(_finish(a) for a in e.args), e.loc)
    return e


def _acc_name(op, value, taken) -> str:
    base = {"max": "_max", "min": "_min"}.get(op, "_acc" if value is not None else "_l")
    var, n = base, 1
    while var in taken:
        var, n = f"{base}{n}", n + 1
    return var


def _expsum_factors(e) -> list[str]:
    if isinstance(e, _ExpSum):
        return [e.group]
    if isinstance(e, ir.Binary) and e.op == "*":
        return _expsum_factors(e.lhs) + _expsum_factors(e.rhs)
    return []


def _drop_scale(e, groups: set):
    if isinstance(e, _ExpSum) and e.group in groups:
        return Var(e.acc)
    if isinstance(e, ir.Binary) and e.op == "*":
        return ir.Binary("*", _drop_scale(e.lhs, groups), _drop_scale(e.rhs, groups), e.loc)
    return e
