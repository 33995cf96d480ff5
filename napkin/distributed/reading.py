"""What the distributed wrappers read off a diagram: its roles.

``roles(diagram)`` reads a checked diagram and names the parts the
distributed schemes move around: the query wire and the key wire (from the
mesh levels, else given), the token inputs (cut along one of the two wires
and moved between devices), the side inputs (passed whole to every device),
the value output O and the lse, the merge family, and the scheme the mesh
levels ask for.  Anything the merge rule cannot handle exactly is refused
with a NapkinError.

Pure IR reading, no torch: the cost pass (napkin/cost/devices.py) and
``napkin plan`` import it to cost exactly what the wrappers will send.

The mesh levels.  ``level devices`` splits wires over the devices of one
group; an optional ``level nodes`` before it splits them over nodes first
(NVLink inside a node, InfiniBand across).  A wire's parts multiply over the
two levels and its kind (group or stream) must agree.  The schemes:

* ``group q`` + ``group x`` (x reduced by the output): ATTENTION2D on an
  R x C grid, R = q's parts, C = x's parts; with a nodes level each node
  holds a DR x DC block of the grid (the devices level's counts);
* ``group q`` + ``stream x`` with equal counts: Ring Attention;
* only ``group x`` (q not split: every device holds all the queries):
  decoding, partial states merged by a butterfly all-reduce (tree.py);
* only ``group q``: ATTENTION2D on an R x 1 grid.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from .. import ir
from ..errors import Diagnostic, NapkinError

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
    for child in ir.children(e):
        out |= _wires(d, child)
    return out


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
    scheme: Optional[tuple[str, tuple[int, ...]]]  # from the mesh levels, if any
    per_node: Optional[tuple[int, ...]] = None      # the grid block one node holds (nodes level)
    # the user's output that is a function of the attention and its lse (a sink), computed by the
    # wrappers after the merge; ``diagram`` then outputs that attention and lse in its place
    epilogue: Optional["Epilogue"] = None
    # inputs that function alone reads along the query wire (a gate G[b, h, q, d]): each device
    # passes its own rows, laid out as its queries; ``diagram`` has none of them
    rows: tuple[str, ...] = ()
    row_axis: tuple[int, ...] = ()      # the stored dimension of the query wire, per row input
    # the token layout the mesh levels name (stream x across 8 contiguous), None where they name none
    layout: Optional[str] = None

    def is_query(self, index: int) -> bool:
        return self.token_wire[index] == self.query

    @property
    def written(self) -> ir.Diagram:
        """The diagram as written: its outputs are what the wrappers return
        (``diagram`` has A and L where the epilogue's output is)."""
        return self.epilogue.diagram if self.epilogue is not None else self.diagram

    def query_axis(self, output: str) -> int:
        """The stored dimension of the query wire in one of ``written``'s outputs."""
        return next(i for i, axis in enumerate(self.written.tensor(output).axes) if self.query in axis)

    @property
    def double_ring(self) -> Optional[tuple[int, int]]:
        """(nodes, GPUs per node) when the diagram's ring spans several nodes
        (its nodes level splits it): ring.py runs it as a double ring."""
        if self.scheme is None or self.scheme[0] != "ring" or self.per_node is None:
            return None
        p, g = self.scheme[1][0], self.per_node[0]
        return (p // g, g) if g < p else None


@dataclass(frozen=True)
class Split:
    """One wire split over the mesh: its kind and its parts at each level."""

    wire: str
    kind: str            # "group" or "stream"
    nodes: int           # parts across nodes (1 without a nodes level)
    devices: int         # parts across the devices of a node
    loc: ir.Loc = ir.NOLOC

    @property
    def parts(self) -> int:
        return self.nodes * self.devices


def mesh_splits(d: ir.Diagram) -> tuple[Split, ...]:
    """The wires the mesh levels split, in order of first appearance; a
    wire's parts multiply over the levels.  Empty without a mesh level."""
    found: dict[str, Split] = {}
    for name in ir.MESH_LEVELS:
        level = d.level(name)
        for t in level.tiles if level else ():
            if not t.across:
                continue
            old = found.get(t.wire)
            if old is not None and old.kind != t.kind:
                raise _refuse(f"{t.wire} is {old.kind}ed across nodes but {t.kind}ed across devices", t.loc,
                              "a wire is grouped at both mesh levels or streamed at both")
            nodes = t.size if name == "nodes" else (old.nodes if old else 1)
            devices = t.size if name == "devices" else (old.devices if old else 1)
            found[t.wire] = Split(t.wire, t.kind, nodes, devices, old.loc if old else t.loc)
    return tuple(found.values())


# The layouts each scheme can run: a ring any (zigzag by default); ATTENTION2D's grid rows and
# columns are cyclic shares (layouts.py) and decoding's tree holds contiguous shares of the keys.
_SCHEME_LAYOUTS = {"ring": ir.LAYOUTS, "attention2d": ("cyclic",), "tree": ("contiguous",)}
_SCHEME_NAMES = {"ring": "Ring Attention", "attention2d": "ATTENTION2D", "tree": "decoding's tree"}


def mesh_layout(d: ir.Diagram, scheme: Optional[str]) -> Optional[str]:
    """The token layout the mesh levels' across tiles name, checked against
    the scheme they make (None: they name none)."""
    found: Optional[ir.Tile] = None
    for name in ir.MESH_LEVELS:
        level = d.level(name)
        for t in level.tiles if level else ():
            if not t.across or t.layout is None:
                continue
            allowed = _SCHEME_LAYOUTS.get(scheme, ir.LAYOUTS)
            if t.layout not in allowed:
                raise _refuse(f"{_SCHEME_NAMES[scheme]} cannot lay {t.wire} out {t.layout}: it deals tokens "
                              f"{'cyclically' if allowed == ('cyclic',) else 'in contiguous shares'}",
                              t.layout_loc, f"write '{allowed[0]}' or no layout")
            if found is not None and found.layout != t.layout:
                raise _refuse(f"{t.wire} is laid out {t.layout} but {found.wire} {found.layout}: the mesh deals "
                              "every split wire's tokens one way", t.layout_loc,
                              f"write '{found.layout}' here too, or the layout once")
            found = found or t
    return None if found is None else found.layout


def has_nodes_level(d: ir.Diagram) -> bool:
    level = d.level("nodes")
    return level is not None and any(t.across for t in level.tiles)


def _device_wires(d: ir.Diagram, value_expr) -> tuple:
    """(query, key, scheme, per_node) from the mesh levels, or Nones without
    them.  per_node is the block of the scheme's grid one node holds: (DR, DC)
    for ATTENTION2D, (G,) for a ring or a tree; None without a nodes level."""
    splits = mesh_splits(d)
    if not splits:
        return None, None, None, None
    nodes = has_nodes_level(d)
    loc = splits[0].loc
    groups = [s for s in splits if s.kind == "group"]
    streams = [s for s in splits if s.kind == "stream"]
    reduced = set(value_expr.wires) if isinstance(value_expr, ir.Reduce) else set()
    if streams:
        s = streams[0]
        if len(streams) != 1 or len(groups) != 1 or (groups[0].nodes, groups[0].devices) != (s.nodes, s.devices):
            raise _refuse("Ring Attention needs 'group Q across P' and 'stream X across P' with the same P "
                          "(at each mesh level)", s.loc)
        return groups[0].wire, s.wire, ("ring", (s.parts,)), ((s.devices,) if nodes else None)
    if len(groups) == 2:
        keys = [g for g in groups if g.wire in reduced]
        if len(keys) != 1:
            raise _refuse("ATTENTION2D needs exactly one device-split wire reduced by the output", loc)
        qt = next(g for g in groups if g is not keys[0])
        block = (qt.devices, keys[0].devices) if nodes else None
        return qt.wire, keys[0].wire, ("attention2d", (qt.parts, keys[0].parts)), block
    if len(groups) == 1:
        g = groups[0]
        if g.wire in reduced:
            # the query wire is not split: every device holds every query
            # (decoding), and the partial states are all-reduced
            return None, g.wire, ("tree", (g.parts,)), ((g.devices,) if nodes else None)
        return g.wire, None, ("attention2d", (g.parts, 1)), ((g.devices, 1) if nodes else None)
    raise _refuse("the mesh levels split more wires than ATTENTION2D, Ring Attention or decoding handles", loc)


def roles(d: ir.Diagram, query: Optional[str] = None, key: Optional[str] = None) -> Roles:
    """What the distributed wrappers need to know about a checked diagram;
    a refusal names the file the diagram was loaded from."""
    import napkin

    try:
        return _roles(d, query, key)
    except NapkinError as err:
        raise napkin.located(err, d) from None


def _tiled_query(d: ir.Diagram, key: Optional[str]) -> Optional[str]:
    """The query wire of a mesh that splits the key wire alone (decoding's),
    named other than q: the one other wire the schedule tiles (``t by 16``
    beside ``stream s by 64``), else None."""
    from ..autotune import tiled_wires

    others = [w for w in tiled_wires(d) if w != key]
    return others[0] if key is not None and len(others) == 1 else None


@dataclass(frozen=True)
class Epilogue:
    """O = F(A, L, side inputs): an output that is a function of the softmax
    attention A = sum[x](softmax[x](S) * V) and its row's L = logsumexp[x](S),
    elementwise along the rows (an attention sink's A * sigmoid(L - sink)).
    Partial states merge exactly as A and L only, so the wrappers run the
    diagram with A and L as its outputs (``Roles.diagram``) and compute F on
    each device's merged rows in torch, where autograd takes F's gradient to
    A, L (the merge's dO and dlse) and to the side inputs F reads."""

    output: str                   # O
    expr: ir.Expr                 # F over the value box, the lse box and side inputs
    diagram: ir.Diagram           # the user's diagram (O's layout and dtype, the outputs' order)
    reads: tuple[str, ...]        # the inputs F reads
    only: tuple[str, ...] = ()    # of those, the ones no box of the attention reads: they may train


def split_epilogue(d: ir.Diagram) -> tuple[ir.Diagram, Optional[Epilogue]]:
    """(the diagram to distribute, the epilogue or None): an output that is
    neither a sum nor a logsumexp, written over boxes holding softmax
    attention and its logsumexp (or such sums inline) and inputs, becomes
    those two outputs; the boxes F reads stay the diagram's (named as the
    user wrote them, or ``attention`` / ``row_lse``)."""
    lets = {t.name: t for t in d.lets}
    inlined = {o.name: _inline(d, lets[o.name].expr) for o in d.outputs if o.name in lets}
    funcs = [n for n, e in inlined.items() if not (isinstance(e, ir.Reduce) and e.op in ("sum", "logsumexp"))]
    if len(funcs) != 1:
        return d, None   # none, or several: _roles refuses them as before
    name = funcs[0]
    if not any(isinstance(n, ir.Reduce) and n.op == "sum" and len(n.wires) == 1 and any(
            isinstance(m, ir.Normalize) and m.op == "softmax" for m in ir.walk(n.body))
            for n in ir.walk(inlined[name])):
        return d, None   # no softmax attention in it (max[x](S), a ratio of sums): refused as before
    taken = {t.name for t in d.inputs + d.lets} | {w.name for w in d.wires} | {d.name}
    # (kind, inlined expression) -> box name; an lse output F also reads is the one lse (two would
    # be refused)
    boxes: dict = {("row_lse", e): n for n, e in inlined.items() if isinstance(e, ir.Reduce) and e.op == "logsumexp"}

    def box(kind: str, e: ir.Expr, written: Optional[str]) -> ir.TensorRef:
        key = (kind, _inline(d, e))
        if key not in boxes:
            boxes[key] = written or next(n for n in [kind] + [f"{kind}{i}" for i in range(2, 100)]
                                         if n not in taken and n not in boxes.values())
        return ir.TensorRef(boxes[key])

    def piece(e: ir.Expr) -> Optional[str]:
        """"attention" for sum[w](softmax[w](S) * ...), "row_lse" for logsumexp[w](S), else None."""
        e = _inline(d, e)
        if isinstance(e, ir.Reduce) and len(e.wires) == 1 and e.op == "logsumexp":
            return "row_lse"
        if isinstance(e, ir.Reduce) and len(e.wires) == 1 and e.op == "sum" and any(
                isinstance(n, ir.Normalize) and n.op == "softmax" and n.wire == e.wires[0] for n in ir.walk(e.body)):
            return "attention"
        return None

    def walk(e: ir.Expr) -> ir.Expr:
        if isinstance(e, ir.TensorRef) and e.name in lets:
            kind = piece(lets[e.name].expr)
            if kind is None or (e.wires is not None and tuple(e.wires) != ir.axis_wires(lets[e.name].axes)):
                raise _refuse(f"output {name} is a function of box {e.name}, which is neither softmax attention "
                              "nor its logsumexp", e.loc, "the wrappers compute such a function after the "
                              "merge, of the attention, its logsumexp and side inputs alone")
            return box(kind, lets[e.name].expr, e.name)
        if isinstance(e, (ir.Reduce, ir.Normalize)):
            kind = piece(e) if isinstance(e, ir.Reduce) else None
            if kind is None:
                raise _refuse(f"output {name} reduces other than by softmax attention or its logsumexp", e.loc)
            return box(kind, e, None)
        fixed = isinstance(e, ir.WireSize) and d.wire(e.wire) is not None and d.wire(e.wire).size is not None
        if isinstance(e, (ir.WireIndex, ir.WireSize)) and not fixed:
            what = f"the index of wire {e.wire}" if isinstance(e, ir.WireIndex) else f"|{e.wire}|"
            raise _refuse(f"output {name} reads {what} outside its sums", e.loc,
                          "a device holds its own rows, not their global positions or count: the function "
                          "after the merge may read the attention, its logsumexp, side inputs and fixed sizes")
        return ir.map_children(e, walk)
    f = walk(lets[name].expr)
    kinds = {k for k, _ in boxes}
    if "attention" not in kinds or len(boxes) > 2 or len(kinds) != len(boxes):
        raise _refuse(f"output {name} must be a function of one softmax attention and its logsumexp",
                      lets[name].loc)
    new = []
    for (kind, e), bname in boxes.items():
        if bname not in lets:
            o = lets[name]
            axes = o.axes if kind == "attention" else tuple(a for a in o.axes if set(a) <= _wires(d, e))
            new.append(ir.Let(bname, axes, "fp32" if kind == "row_lse" else None, e, o.loc))
    outputs = [bname for _, bname in sorted(boxes.items(), key=lambda kv: kv[0][0])]   # attention, row_lse
    outputs += [o.name for o in d.outputs if o.name != name and o.name not in outputs]
    core = _unheld(dataclasses.replace(d, lets=tuple(t for t in d.lets if t.name != name) + tuple(new),
                                       outputs=tuple(ir.Output(n) for n in outputs)), (name,))
    reads = tuple(dict.fromkeys(n.name for n in ir.walk(f) if isinstance(n, ir.TensorRef)
                                and isinstance(d.tensor(n.name), ir.Input)))
    used = {n.name for t in core.lets for n in ir.walk(t.expr) if isinstance(n, ir.TensorRef)}
    return core, Epilogue(name, f, d, reads, tuple(n for n in reads if n not in used))


def _roles(d: ir.Diagram, query: Optional[str], key: Optional[str]) -> Roles:
    d, epilogue = split_epilogue(d)
    r = _core_roles(d, query, key)
    if epilogue is None:
        return r
    # F alone reads it along the query wire (a gate): each device's own rows, as its queries,
    # and never sent; the attention does not read it, so its diagram drops it
    at = {n: k for k, n in enumerate(r.tokens) if r.is_query(k) and n in epilogue.only}
    if at:
        d = _without_inputs(d, tuple(at))
        r = dataclasses.replace(_core_roles(d, r.query, r.key), rows=tuple(at),
                                row_axis=tuple(r.token_axis[k] for k in at.values()))
    bad = [n for n in epilogue.reads if n not in r.side and n not in r.rows]
    if bad:
        t = epilogue.diagram.tensor(bad[0])
        raise _refuse(f"output {epilogue.output} reads {bad[0]}, which is split across devices, outside its "
                      "sums", t.loc, "the function the wrappers apply after the merge may read side inputs "
                      "and inputs along the query wire that the attention itself does not read")
    return dataclasses.replace(r, epilogue=epilogue)


def _without_inputs(d: ir.Diagram, names: tuple[str, ...]) -> ir.Diagram:
    """``d`` without the inputs ``names`` (which no box reads) and their holds."""
    return _unheld(dataclasses.replace(d, inputs=tuple(t for t in d.inputs if t.name not in names)), names)


def _unheld(d: ir.Diagram, names: tuple[str, ...]) -> ir.Diagram:
    """``d`` with ``names`` held at no level of its schedule."""
    if d.schedule is None:
        return d
    levels = tuple(dataclasses.replace(lv, holds=tuple(h for h in lv.holds if h not in names),
                                       hold_locs=tuple(loc for h, loc in zip(lv.holds, lv.hold_locs)
                                                       if h not in names))
                   for lv in d.schedule.levels)
    return dataclasses.replace(d, schedule=dataclasses.replace(d.schedule, levels=levels))


def _core_roles(d: ir.Diagram, query: Optional[str], key: Optional[str]) -> Roles:
    inlined = {o.name: _inline(d, d.tensor(o.name).expr) if isinstance(d.tensor(o.name), ir.Let) else None
               for o in d.outputs}
    sums = [n for n, e in inlined.items() if isinstance(e, ir.Reduce) and e.op == "sum"]
    if not sums:
        # said before the mesh is read, which finds the key wire as the one the
        # sum reduces and, without a sum, would blame the levels instead
        other = next((n for n, e in inlined.items()
                      if not (isinstance(e, ir.Reduce) and e.op == "logsumexp")), None)
        if other is not None:
            sums_in = [n for n in ir.walk(inlined[other]) if isinstance(n, ir.Reduce) and n.op == "sum"] \
                if inlined[other] is not None else []
            softmax = any(isinstance(n, ir.Normalize) for e in inlined.values() if e is not None
                          for n in ir.walk(e))
            hint = ("a merge of partial states is exact for O = sum[x](...) and for logsumexp[x] alone (not for a "
                    "ratio of sums); a function of softmax attention and its logsumexp is applied after the merge")
            if len(sums_in) == 1 and not softmax:   # a matrix product's epilogue, f(sum[k](A * B)): no attention
                hint = (f"the wrappers apply a function after the merge to softmax attention alone: make "
                        f"sum[{', '.join(sums_in[0].wires)}](...) the output and apply the rest in torch")
            raise _refuse(f"output {other} is not a sum over the key wire", d.tensor(other).loc, hint)
    dq, dk, scheme, per_node = _device_wires(d, inlined[sums[0]] if len(sums) == 1 else None)
    key = key or dk or ("x" if d.wire("x") else None)
    query = query or dq or ("q" if d.wire("q") else None) or _tiled_query(d, key)
    if query is None or key is None or query == key:
        raise _refuse("it has no query and key wires: wires q and x, the ones its devices level splits, "
                      "or in Python query_wire= and key_wire=", d.loc)

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
        facs = ir.factors(body)
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
        if split and t.dtype in ir.FACTOR_DTYPES:
            # an 8-bit score factor (SageAttention's Q and K) is a token input with no gradient: the
            # wrappers' shards, ring and backward carry float tokens that all train; taken as a side
            # input it was passed whole beside its split scales
            kind = "int8" if t.dtype == "int8" else "fp8"
            raise _refuse(f"input {t.name} is {t.dtype} along the {'query' if split[0] == query else 'key'} "
                          f"wire {split[0]}: the distributed wrappers carry float token inputs only, each "
                          f"with a gradient, and an {kind} score factor has none", t.loc,
                          f"run the {kind} kernel on each device's tokens (napkin compile without the "
                          "devices level), or declare the token inputs fp16 or bf16")
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
                 tuple(o.name for o in d.outputs), value, lse, family, score, out_axis, nvalue, scheme,
                 per_node, layout=mesh_layout(d, scheme[0] if scheme else None))
