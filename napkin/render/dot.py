"""Diagram -> Graphviz DOT text: ``to_dot(diagram, costs=None) -> str``.

A pure function: the same IR (and cost report) always gives the same bytes,
so the text can be golden-tested and the picture diffed in review.

What the picture shows, left to right (rankdir=LR):

* A tensor that lives in memory is a cylinder in the colour of its level; an
  operation (a ``Let``) is a rounded box.  When a box's result stays where the
  box runs (a fused intermediate such as S or P in FlashAttention) the box
  *is* the tensor; otherwise an edge carries the result to its own cylinder
  (O written back to HBM), and that edge crosses the level boundary.
* A tensor flowing into a box is one edge drawn as parallel lines, one line
  per wire, each wire in its own colour everywhere in the picture (Graphviz's
  ``color="a:b:c"``).  Its label names the wires in those colours, with the
  schedule's tiling: ``q[128]`` grouped in blocks of 128 (one per program;
  the legend says when ``g[4] q[4]`` pack into 16 rows, codegen.lower.packed_wire),
  ``q[2 dev]`` split over 2 devices, ``x~64`` streamed in chunks of 64.  An
  edge carrying a streamed wire is dashed: the tensor arrives chunk by chunk.
  A wire split at both mesh levels shows its two splits in one bracket,
  ``q[2 nodes x 2 dev]`` (2 nodes, 2 GPUs each: 4 parts), because the parts
  multiply; split across nodes only it is ``q[2 nodes]``.
* A wire a box sums away (contraction or reduction) leaves the bundle and
  runs into a small dot in the wire's colour beside the box; every input
  carrying that wire joins at the same dot, so ``sum[d](Q * K)`` shows Q's d
  and K's d meeting, and nothing called d comes out.
* An input that is not woven over a wire of the box (K has no q) is
  broadcast over it; the edge says so, and says it is re-read once per block
  when that wire is grouped or streamed in chunks - the term the cost model
  charges for.
* Memory levels are nested clusters, outermost first (nodes, devices, HBM,
  SMEM, registers), each titled with its capacity and tiles.  The optional
  nodes level (a two-level mesh) is lavender, outside the grey devices
  cluster; its title says it is the InfiniBand level and the devices title
  then says NVLink within a node.  With mesh levels that split wires,
  "peer devices" nodes stand for the rest of the grid: gathered (or
  ring-passed) inputs come from one on the left, partial results are merged
  through one on the right.  With a nodes level they say which wires are
  split across nodes and which within a node, and each peer edge says
  which link its collective uses.
* The cost pass reports the busiest device's bytes per link (within its
  node, across nodes) as totals, not per collective, so with a nodes level
  those two totals go on the peer devices node, not on its edges.
* With a cost report, an edge that crosses a level boundary carries the
  bytes that tensor moves across it (loads on the way in, stores out).
* Edge labels are small text nodes the edge runs through (see ``edge``), so
  they never sit on a cluster's title.
"""
from __future__ import annotations

import html
import textwrap
from dataclasses import dataclass
from typing import Optional

from .. import ir, tiling
from ..distributed.reading import Split, has_nodes_level, mesh_splits
from ..printer import expr_text
from ..units import three_figures
from .costs import MERGED, Traffic, traffic_from

# One colour per wire, in declaration order (Tableau 10, dark enough to read
# as text on the pale level fills).  Wraps after ten wires.
AXIS_COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e",
                "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22")

# Memory levels as the napkin paper colours them: (title, cluster fill,
# cluster border, tensor fill).  The nodes level is not in the paper: a pale
# lavender, so the grey devices cluster stands out inside it and no level
# shares a hue with another.
LEVEL_STYLE = {
    "nodes": ("nodes", "#f4f0fa", "#9a82c0", "#e0d6f0"),
    "devices": ("devices", "#f2f2f2", "#8a8a8a", "#d9d9d9"),
    "hbm": ("HBM", "#e3eefa", "#6b9bd1", "#b9d3f0"),
    "smem": ("shared memory", "#e6f5e0", "#6fb05a", "#c4e6b6"),
    "regs": ("registers", "#fdeedd", "#e0a060", "#f8d3a8"),
}
SHORT = {"nodes": "nodes", "devices": "devices", "hbm": "HBM", "smem": "SMEM", "regs": "regs"}  # for byte labels
FONT = "Helvetica"
NOTE_COLOUR = "#555555"      # broadcast notes, byte counts
REREAD_COLOUR = "#b03030"    # broadcast over a grouped wire: re-read per block
# The links of a two-level mesh, as titles and peer notes name them.
ACROSS_NODES = "InfiniBand across nodes"
WITHIN_NODE = "NVLink within a node"
BOX_WRAP = 34                # characters per line of a box's expression


# --------------------------------------------------------------------------
# Small text helpers.
# --------------------------------------------------------------------------

def _q(text: str) -> str:
    """A DOT double-quoted string."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _h(text: str) -> str:
    """Text escaped for a DOT HTML-like label.  "]" too: Graphviz 2.43's XML
    reader holds a bare "]" back (it might open "]]>") and prints it in
    front of the next run of text, one line down."""
    return html.escape(text, quote=True).replace("]", "&#93;")


def _attrs(**attrs) -> str:
    """``[k=v, ...]`` in the given order; HTML labels (``<...>``) go unquoted."""
    parts = []
    for key, value in attrs.items():
        if value is None:
            continue
        text = str(value)
        parts.append(f"{key}={text if text.startswith('<') else _q(text)}")
    return "[" + ", ".join(parts) + "]"


def _table(rows, align: str = "center") -> str:
    """Rows of HTML-label text stacked in a borderless table (see ``_h`` for
    the bracket)."""
    cells = "".join(f'<tr><td align="{align}">{row.replace("]", "&#93;")}</td></tr>'
                    for row in rows if row)
    return f'<table border="0" cellborder="0" cellspacing="0" cellpadding="1">{cells}</table>'


def format_bytes(n: float) -> str:
    """Decimal units, three significant figures: 1.07 GB, 512 B."""
    return three_figures(n, ((1e12, " TB"), (1e9, " GB"), (1e6, " MB"), (1e3, " kB"), (1, " B")))


# --------------------------------------------------------------------------
# What each box reads: wires per input, summed-away wires, broadcasts.
# --------------------------------------------------------------------------

def _ordered(items) -> tuple[str, ...]:
    """Distinct items in first-seen order (deterministic, unlike a set)."""
    return tuple(dict.fromkeys(items))


def read_wires(diagram: ir.Diagram, ref: ir.TensorRef) -> tuple[str, ...]:
    """The wires a reference reads along: its relabelling, else the tensor's own."""
    if ref.wires is not None:
        return ref.wires
    tensor = diagram.tensor(ref.name)
    return ir.axis_wires(tensor.axes) if tensor is not None else ()


def expr_wires(diagram: ir.Diagram, e: ir.Expr) -> tuple[str, ...]:
    """The wires an expression produces: elementwise ops weave (union),
    reductions remove theirs, normalisers keep theirs."""
    if isinstance(e, ir.TensorRef):
        return read_wires(diagram, e)
    if isinstance(e, ir.WireIndex):
        return (e.wire,)
    if isinstance(e, ir.Unary):
        return expr_wires(diagram, e.operand)
    if isinstance(e, ir.Binary):
        return _ordered(expr_wires(diagram, e.lhs) + expr_wires(diagram, e.rhs))
    if isinstance(e, ir.Call):
        return _ordered(w for a in e.args for w in expr_wires(diagram, a))
    if isinstance(e, ir.Reduce):
        return tuple(w for w in expr_wires(diagram, e.body) if w not in e.wires)
    if isinstance(e, ir.Normalize):
        return expr_wires(diagram, e.body)
    return ()


def _packed(d: ir.Diagram) -> Optional[tuple[str, int, str, int]]:
    """(g, its group, the row wire, its group) when the kernel packs g into
    the rows (napkin/cost/packing.py find, from codegen's plan), else None
    (also for a diagram napkin cannot emit: the picture needs no kernel)."""
    from ..cost import packing

    p = packing.find(d)
    return None if p is None else (p.wire, p.groups[0], p.row, p.groups[1])


@dataclass(frozen=True)
class Use:
    """How one box reads one tensor (all its references together).

    kept: wires that survive into the box's result; summed: wires the box
    sums away (they run into the join dot); broadcast: wires of the
    surrounding expression the tensor lacks (it is copied along them).
    """

    tensor: str
    kept: tuple[str, ...]
    summed: tuple[str, ...]
    broadcast: tuple[str, ...]


def box_uses(diagram: ir.Diagram, let: ir.Let) -> list[Use]:
    """The tensors a box reads, in order of first reference."""
    reads: dict[str, list] = {}
    summed: dict[str, list] = {}
    scope: dict[str, list] = {}

    def visit(e: ir.Expr, removing: tuple[str, ...], around: tuple[str, ...]):
        # ``around`` is the wires of the innermost enclosing reduction's body
        # (or of the whole expression): what a reference is woven against.
        if isinstance(e, ir.TensorRef):
            wires = read_wires(diagram, e)
            reads.setdefault(e.name, []).extend(wires)
            summed.setdefault(e.name, []).extend(w for w in wires if w in removing)
            scope.setdefault(e.name, []).extend(around)
            return
        if isinstance(e, ir.Reduce):
            visit(e.body, removing + e.wires, expr_wires(diagram, e.body))
            return
        children = ()
        if isinstance(e, ir.Unary):
            children = (e.operand,)
        elif isinstance(e, ir.Binary):
            children = (e.lhs, e.rhs)
        elif isinstance(e, ir.Call):
            children = e.args
        elif isinstance(e, ir.Normalize):
            children = (e.body,)
        for child in children:
            visit(child, removing, around)

    visit(let.expr, (), expr_wires(diagram, let.expr))
    # Broadcast wires are listed in the order of the box's own layout (then
    # any it sums away), not in the order the expression happens to meet them.
    rank = {w: i for i, w in enumerate(_ordered(ir.axis_wires(let.axes) + tuple(
        w for node in ir.walk(let.expr) if isinstance(node, ir.Reduce) for w in node.wires)))}
    uses = []
    for name, wires in reads.items():
        wires = _ordered(wires)
        gone = _ordered(summed[name])
        copied = [w for w in _ordered(scope[name]) if w not in wires]
        copied.sort(key=lambda w: rank.get(w, len(rank)))
        uses.append(Use(name, tuple(w for w in wires if w not in gone), gone, tuple(copied)))
    return uses


# --------------------------------------------------------------------------
# The schedule, as the picture needs it.
# --------------------------------------------------------------------------

def tiles_of(diagram: ir.Diagram) -> dict[str, list[tuple[str, ir.Tile]]]:
    """wire -> [(level, tile)], outermost level first."""
    out: dict[str, list] = {}
    levels = diagram.schedule.levels if diagram.schedule else ()
    for name in ir.ALL_LEVELS:
        for level in levels:
            if level.name == name:
                for tile in level.tiles:
                    out.setdefault(tile.wire, []).append((name, tile))
    return out


def _parts(tile: ir.Tile, level: Optional[str]) -> str:
    """``128`` (a block), ``2 dev`` (parts across devices), ``2 nodes``."""
    if not tile.across:
        return str(tile.size)
    if level == "nodes":
        return f"{tile.size} node" + ("s" if tile.size != 1 else "")
    return f"{tile.size} dev"


def tile_text(tile: ir.Tile, level: Optional[str] = None) -> str:
    """``[128]`` grouped by 128, ``[2 dev]`` grouped across 2, ``~64``, ``~4 dev``;
    at the nodes level ``[2 nodes]``; ``[1024]~64`` chunks of 1024 streamed by 64."""
    size = _parts(tile, level)
    if tile.chunk is not None:  # grouped in chunks, each streamed: x[1024]~64 (ir.Tile.chunk)
        return f"[{tile.chunk}]~{size}"
    return f"[{size}]" if tile.kind == "group" else f"~{size}"


def tiles_text(tiles: list[tuple[str, ir.Tile]]) -> str:
    """A wire's tiles, outermost first: ``q[2 dev][128]``.  A split across
    nodes followed by one across the devices of a node is one bracket,
    ``q[2 nodes x 2 dev]``: the two multiply into one set of parts (the
    checker makes both the same kind)."""
    texts: list[str] = []
    for i, (level, tile) in enumerate(tiles):
        prev = tiles[i - 1] if i else None
        if prev is not None and prev[0] == "nodes" and level == "devices" and tile.across:
            both = f"{_parts(prev[1], 'nodes')} x {_parts(tile, level)}"
            texts[-1] = f"[{both}]" if tile.kind == "group" else f"~{both}"
        else:
            texts.append(tile_text(tile, level))
    return "".join(texts)


def level_path(diagram: ir.Diagram) -> tuple[str, ...]:
    """The levels drawn, outermost first: the declared ones plus HBM, where
    inputs and outputs live even when the schedule does not name it."""
    if diagram.schedule is None:
        return ()
    named = {lv.name for lv in diagram.schedule.levels} | {"hbm"}
    return tuple(name for name in ir.ALL_LEVELS if name in named)


def compute_level(diagram: ir.Diagram) -> Optional[str]:
    """Where the boxes run: the innermost tiled level (None: no schedule)."""
    if diagram.schedule is None:
        return None
    return tiling.innermost_tiled_level(diagram)


def mesh_links(split: Split) -> tuple[str, ...]:
    """The links a collective among the parts of a split wire uses: InfiniBand
    when the wire is split across nodes, NVLink when across a node's GPUs."""
    return tuple(link for link, parts in ((ACROSS_NODES, split.nodes), (WITHIN_NODE, split.devices))
                 if parts > 1)


# --------------------------------------------------------------------------
# The drawing.
# --------------------------------------------------------------------------

class _Picture:
    """Collects the DOT statements; ``text()`` assembles them in a fixed order.

    Node ids: ``t.NAME`` a tensor in memory, ``op.NAME`` a box, ``j.BOX.WIRE``
    the dot where BOX sums WIRE away, ``e.N`` an edge's label, ``peers.in`` /
    ``peers.out`` the rest of the device grid.  A napkin name cannot contain
    a dot, so ids never collide.
    """

    def __init__(self, diagram: ir.Diagram, traffic: Traffic):
        self.d = diagram
        self.traffic = traffic
        self.colour = {w.name: AXIS_COLOURS[i % len(AXIS_COLOURS)]
                       for i, w in enumerate(diagram.wires)}
        self.tiles = tiles_of(diagram)
        self.levels = level_path(diagram)
        self.run_at = compute_level(diagram)
        self.two_level = has_nodes_level(diagram)
        # The peers are drawn in the innermost mesh level: devices, or nodes
        # when a schedule splits wires across nodes only.
        self.mesh_level = "nodes" if "nodes" in self.levels and "devices" not in self.levels else "devices"
        self.nodes: dict[Optional[str], list[str]] = {}   # level (None: outside) -> node lines
        self.edges: list[str] = []
        self.labelled: set[tuple] = set()                 # traffic keys already shown
        self.label_count = 0                              # edge label nodes so far
        self.outputs = [o.name for o in diagram.outputs]

    # ---- where things live ----
    def home(self, name: str) -> Optional[str]:
        if self.d.schedule is None:
            return None
        return tiling.home_level(self.d, name)

    def fused(self, let: ir.Let) -> bool:
        """The box is its own tensor: the result stays where the box runs."""
        return self.home(let.name) == self.run_at

    def source(self, name: str) -> str:
        """The node a tensor's consumers read from."""
        let = self.d.tensor(name)
        if isinstance(let, ir.Let) and self.fused(let):
            return f"op.{name}"
        return f"t.{name}"

    def add_node(self, level: Optional[str], line: str) -> None:
        self.nodes.setdefault(level, []).append(line)

    # ---- labels ----
    def wire_name(self, wire: str) -> str:
        """A wire name in its colour (node labels: the tiling is on the edges)."""
        return f'<font color="{self.colour.get(wire, "#000000")}">{_h(wire)}</font>'

    def wire_label(self, wire: str) -> str:
        """A wire name in its colour with its tiling: grouped bold, streamed italic."""
        tiles = self.tiles.get(wire, [])
        text = self.wire_name(wire)
        text += _h(tiles_text(tiles))
        if any(t.kind == "group" or t.chunk is not None for _, t in tiles):
            text = f"<b>{text}</b>"
        if any(t.kind == "stream" for _, t in tiles):
            text = f"<i>{text}</i>"
        return text

    def streamed(self, wires) -> bool:
        return any(t.kind == "stream" for w in wires for _, t in self.tiles.get(w, []))

    def broadcast_note(self, wires: tuple[str, ...]) -> list[str]:
        """Label rows for an input the box broadcasts over ``wires``."""
        if not wires:
            return []
        rows = [f'<font color="{NOTE_COLOUR}">broadcast over {_h(" ".join(wires))}</font>']
        # a wire streamed in chunks is grouped too (one chunk per program): the cost
        # pass charges a broadcast input once per chunk (ir.Tile.chunk)
        grouped = [w for w in wires if any(t.kind == "group" or t.chunk is not None
                                           for _, t in self.tiles.get(w, []))]
        if grouped:
            rows.append(f'<font color="{REREAD_COLOUR}">re-read per {_h(" ".join(grouped))} block</font>')
        return rows

    def bytes_note(self, tensor: str, src_level: Optional[str], dst_level: Optional[str],
                   box: Optional[str] = None) -> list[str]:
        """Label rows: the bytes ``tensor`` moves across each boundary between
        two levels (loads going in, stores coming out), in the kernel that
        computes ``box``; each figure goes on the first edge that crosses."""
        if src_level is None or dst_level is None or src_level == dst_level:
            return []
        a, b = ir.LEVELS.index(src_level), ir.LEVELS.index(dst_level)
        direction = "load" if a < b else "store"
        rows = []
        for inner in ir.LEVELS[min(a, b) + 1: max(a, b) + 1]:
            outer = ir.LEVELS[ir.LEVELS.index(inner) - 1]
            # between devices K and V travel as one row: label it once, named
            row = self.traffic.row_of(tensor) if outer == "devices" else tensor
            moved = self.traffic.get(inner, row, direction, box)
            key = (inner, row, direction, self.traffic.kernel_of.get(box))
            if moved is None or key in self.labelled:
                continue
            self.labelled.add(key)
            if outer == "devices":
                what = "between devices" + (f" ({row})" if row != tensor else "")
            else:
                ends = (outer, inner) if direction == "load" else (inner, outer)
                what = f"{SHORT[ends[0]]}&#8594;{SHORT[ends[1]]}"
            rows.append(f'<font color="{NOTE_COLOUR}">{what}: {_h(format_bytes(moved))}</font>')
        return rows

    def edge(self, src: str, dst: str, wires: tuple[str, ...], notes: list[str] = (), **extra) -> None:
        """An edge carrying ``wires``.  A labelled edge runs through its label,
        a text node of its own placed in the inner of the two levels it joins:
        Graphviz keeps nodes out of clusters they do not belong to, whereas
        plain edge labels may land on a cluster's title, and the edge then
        enters the inner cluster from the side rather than through its title."""
        colours = ":".join(self.colour.get(w, "#000000") for w in wires) or "#000000"
        rows = [" ".join(self.wire_label(w) for w in wires)] + list(notes)
        style = extra.pop("style", None) or ("dashed" if self.streamed(wires) else None)
        if not any(rows):
            self.edges.append(f"  {_q(src)} -> {_q(dst)} " + _attrs(color=colours, style=style, **extra) + ";")
            return
        mid = f"e.{self.label_count}"
        self.label_count += 1
        ends = [lv for lv in (self.node_level(src), self.node_level(dst)) if lv is not None]
        where = max(ends, key=ir.ALL_LEVELS.index) if ends else None
        self.add_node(where, f"    {_q(mid)} " + _attrs(
            shape="plain", fontsize="11", label=f"<{_table(rows)}>") + ";")
        self.edges.append(f"  {_q(src)} -> {_q(mid)} " + _attrs(
            color=colours, style=style, arrowhead="none", **extra) + ";")
        if dst.startswith("j."):
            extra.setdefault("arrowhead", "none")   # wires meet at the dot
        self.edges.append(f"  {_q(mid)} -> {_q(dst)} " + _attrs(color=colours, style=style, **extra) + ";")

    # ---- nodes ----
    def tensor_node(self, name: str, wires_of_layout: tuple[ir.Axis, ...], dtype: str) -> None:
        level = self.home(name)
        fill = LEVEL_STYLE[level][3] if level else "#ffffff"
        layout = ", ".join(
            self.wire_name(a[0]) if len(a) == 1 else "(" + " ".join(self.wire_name(w) for w in a) + ")"
            for a in wires_of_layout)
        out = " (out)" if name in self.outputs else ""
        shape = f"[{layout}]" if wires_of_layout else "scalar"
        label = "<" + _table([f"<b>{_h(name)}</b>{_h(out)}", f"{shape} : {_h(dtype)}"]) + ">"
        self.add_node(level, f"    {_q('t.' + name)} " + _attrs(
            shape="cylinder", style="filled", fillcolor=fill, label=label,
            penwidth="2.5" if out else None) + ";")

    def box_node(self, let: ir.Let) -> None:
        text = textwrap.wrap(f"{let.name} = {expr_text(let.expr)}", BOX_WRAP) or [let.name]
        body = "<br/>".join(_h(line) for line in text)
        layout = " ".join(self.wire_name(w) for w in ir.axis_wires(let.axes))
        fused = self.d.schedule is None or self.fused(let)
        tag = ""
        if fused and let.name in self.outputs:
            tag = " (out)"
        head = f"<b>{_h(let.name)}</b>{_h(tag)} [{layout}]"
        label = "<" + _table([head, f'<font point-size="10">{body}</font>']) + ">"
        self.add_node(self.run_at, f"    {_q('op.' + let.name)} " + _attrs(
            shape="box", style="rounded,filled", fillcolor="#ffffff", label=label,
            penwidth="2.5" if tag else None) + ";")

    # ---- the whole diagram ----
    def build(self) -> None:
        d = self.d
        for t in d.inputs:
            self.tensor_node(t.name, t.axes, t.dtype)
        for let in d.lets:
            self.box_node(let)
            if d.schedule is not None and not self.fused(let):
                self.tensor_node(let.name, let.axes, tiling.tensor_dtype(d, let.name))
        for let in d.lets:
            self.wire_box(let)
        self.devices()

    def node_level(self, node: str) -> Optional[str]:
        """The level cluster a node id is drawn in."""
        if node.startswith("peers."):
            return self.mesh_level
        if node.startswith(("op.", "j.")):
            return self.run_at
        return self.home(node.split(".", 1)[1])

    def wire_box(self, let: ir.Let) -> None:
        box = f"op.{let.name}"
        joins: dict[str, str] = {}
        for use in box_uses(self.d, let):
            src = self.source(use.tensor)
            crossing = self.bytes_note(use.tensor, self.node_level(src), self.run_at, let.name)
            notes = self.broadcast_note(use.broadcast) + crossing
            if use.kept or not use.summed:   # a scalar keeps no wire: one black line
                self.edge(src, box, use.kept, notes)
                notes = []
            for wire in use.summed:
                if wire not in joins:
                    joins[wire] = f"j.{let.name}.{wire}"
                self.edge(src, joins[wire], (wire,), notes)
                notes = []
        for wire, join in joins.items():
            # The dot where the summed wires meet; a short, unlabelled stub
            # carries it into the box, with no arrow: nothing comes out.
            colour = self.colour.get(wire, "#000000")
            self.add_node(self.run_at, f"    {_q(join)} " + _attrs(
                shape="point", width="0.12", color=colour, fillcolor=colour) + ";")
            self.edges.append(f"  {_q(join)} -> {_q(box)} " + _attrs(
                color=colour, arrowhead="none", penwidth="2", weight="4") + ";")
        if self.d.schedule is not None and not self.fused(let):
            wires = ir.axis_wires(let.axes)
            self.edge(box, f"t.{let.name}", wires,
                      self.bytes_note(let.name, self.run_at, self.home(let.name), let.name))

    def devices(self) -> None:
        """The rest of the device grid, drawn twice so no edge runs backwards:
        on the left, where inputs come from (gathered or passed round the
        ring, as ``arrivals`` says); on the right, where the partial results
        of a box that sums away a split wire are merged."""
        splits = mesh_splits(self.d)
        if not splits:
            return
        split = {s.wire: s for s in splits}
        grid = " x ".join(str(s.parts) for s in splits if s.kind == "group") or "1"
        def ring(s) -> str:
            # streamed at both mesh levels: a ring round each node, hopping nodes once a round
            if self.two_level and s.nodes > 1 and s.devices > 1:
                return f", double ring of {s.nodes} nodes x {s.devices} over {s.wire}"
            return f", ring of {s.parts} over {s.wire}"

        desc = [f"grid {grid}" + "".join(ring(s) for s in splits if s.kind == "stream")]
        if self.two_level:
            # Which peers are on the same node and which on others, by wire.
            desc.append("; ".join(
                f"{link}: {' '.join(s.wire for s in splits if link in mesh_links(s))}"
                for link in (ACROSS_NODES, WITHIN_NODE) if any(link in mesh_links(s) for s in splits)))
        arrivals = self.arrivals(split)
        merges = []
        for name in self.outputs:
            let = self.d.tensor(name)
            if isinstance(let, ir.Let):
                merged = sorted(w for w in tiling.reduced_wires(let.expr)
                                if w in split and split[w].kind == "group")
                if merged:
                    merges.append((name, "partial state, merged over", tuple(merged)))
        sent = self.link_bytes()
        for node, title, used in (("peers.in", "peer devices", arrivals),
                                  ("peers.out", "peer devices: merge", merges)):
            if used:
                rows = [f"<b>{_h(title)}</b>"] + [_h(line) for line in desc] + sent
                sent = []   # device totals: on the first peers node only
                self.add_node(self.mesh_level, f"    {_q(node)} " + _attrs(
                    shape="box3d", style="filled", fillcolor=LEVEL_STYLE[self.mesh_level][3],
                    label="<" + _table(rows) + ">") + ";")
        for name, what, wires in arrivals:
            self.edge("peers.in", self.source(name), (),
                      self.peer_notes(what, wires) + self.bytes_note(name, "devices", "hbm"), style="dashed")
        for name, what, wires in merges:
            self.edge(self.source(name), "peers.out", (),
                      self.peer_notes(what, wires) + self.bytes_note(MERGED, "hbm", "devices"), style="dashed")

    def arrivals(self, split: dict[str, Split]) -> list[tuple[str, str, tuple[str, ...]]]:
        """(input, how it arrives, over which split wires) for each input a
        device receives from the others.  With a cost report, its device
        rows: the picture shows what the bytes are charged for.  Without one,
        the same rule read off the schedule (napkin/cost/devices.py): the
        schemes of napkin.distributed move only the token inputs (ATTENTION2D
        gathers Q along a row, K and V along a column; a ring passes K and V;
        decoding's devices hold every query already), and any other diagram
        deals every input over the devices, so one that lacks a split wire
        is gathered over it and one carrying a streamed wire goes round."""
        ring, gather = "round the ring over", "gathered over"
        order = {t.name: i for i, t in enumerate(self.d.inputs)}
        if self.traffic.arrivals is not None:
            how = {"ring": ring, "gather": gather}
            return sorted(((name, how[kind], among) for name, kind, among in self.traffic.arrivals
                           if name in order), key=lambda a: order[a[0]])
        from ..distributed.reading import roles
        from ..errors import NapkinError
        try:
            r = roles(self.d)
        except NapkinError:
            r = None
        out = []
        if r is not None:
            scheme = r.scheme[0] if r.scheme else None
            for k, name in enumerate(r.tokens):
                if scheme == "ring" and not r.is_query(k):
                    out.append((name, ring, (r.key,)))
                elif scheme == "attention2d":
                    among = r.key if r.is_query(k) else r.query
                    if among in split:
                        out.append((name, gather, (among,)))
            return out
        for t in self.d.inputs:
            wires = ir.axis_wires(t.axes)
            # a split of one part moves nothing (the cost pass has no row for it)
            streamed = tuple(w for w in wires if w in split and split[w].kind == "stream" and split[w].parts > 1)
            lacking = tuple(w for w, s in split.items() if s.kind == "group" and s.parts > 1 and w not in wires)
            if streamed:
                out.append((t.name, ring, streamed))
            elif lacking:
                out.append((t.name, gather, lacking))
        return out

    def peer_notes(self, what: str, wires: tuple[str, ...]) -> list[str]:
        """Label rows of a peer edge: how the tensor travels, over which
        wires and, on a two-level mesh, on which links."""
        text = f"{what} {' '.join(wires)}"
        if self.two_level:
            splits = {s.wire: s for s in mesh_splits(self.d)}
            links = _ordered(link for w in wires for link in mesh_links(splits[w]))
            text += ", " + " and ".join(links)
        return [f'<font color="{NOTE_COLOUR}">{_h(text)}</font>']

    def link_bytes(self) -> list[str]:
        """Label rows: the bytes the busiest device sends within its node and
        across nodes, when there is a nodes level and a cost report."""
        if not self.two_level or self.traffic.sent_by_link is None:
            return []
        within, across = self.traffic.sent_by_link
        return [f'<font color="{NOTE_COLOUR}">sends {_h(format_bytes(within))} within its node, '
                f'{_h(format_bytes(across))} across nodes</font>']

    # ---- assembly ----
    def cluster(self, depth: int, out: list[str]) -> None:
        name = self.levels[depth]
        title, fill, border, _ = LEVEL_STYLE[name]
        pad = "  " * (depth + 1)
        out.append(f"{pad}subgraph cluster_{name} {{")
        out.append(f"{pad}  " + " ".join(f"{k}={_q(v)};" for k, v in (
            ("style", "filled,rounded"), ("fillcolor", fill), ("color", border),
            ("labelloc", "t"), ("labeljust", "r"), ("margin", "12"))))
        out.append(f"{pad}  label=<{self.cluster_title(name, title)}>;")
        out.extend(pad + line[2:] for line in self.nodes.get(name, []))
        if depth + 1 < len(self.levels):
            self.cluster(depth + 1, out)
        out.append(f"{pad}}}")

    def cluster_title(self, name: str, title: str) -> str:
        head = f"<b>{_h(title)}</b>"
        # the device the costs are for: the footprints of napkin cost --device measure against it
        capacity = (tiling.level_capacity(self.d, name, self.traffic.profile)
                    if name not in ir.MESH_LEVELS else None)
        if capacity is not None:
            head += " " + _h(format_bytes(capacity))
        level = self.d.level(name)
        if "nodes" in self.levels and name in ir.MESH_LEVELS:
            # A two-level mesh: say which link each mesh level is; one that
            # splits nothing ('across 1') uses none: one node, or one GPU a node
            splits = level is not None and any(t.across and t.size > 1 for t in level.tiles)
            head += " &#183; " + _h((ACROSS_NODES if splits else "one node") if name == "nodes"
                                     else WITHIN_NODE if splits else "one GPU a node")
        groups = [t for t in level.tiles if t.kind == "group"] if level else []
        streams = [t for t in level.tiles if t.kind == "stream"] if level else []
        parts = []
        if groups:
            what = name if name in ir.MESH_LEVELS and all(t.across for t in groups) else "grid"
            parts.append(f"{what}: " + " ".join(self.tile_label(t, name) for t in groups))
        if streams:
            parts.append("stream " + " ".join(self.tile_label(t, name) for t in streams))
        return head + ("<br/>" + "; ".join(parts) if parts else "")

    def tile_label(self, tile: ir.Tile, level: Optional[str] = None) -> str:
        return (f'<font color="{self.colour.get(tile.wire, "#000000")}">{_h(tile.wire)}</font>'
                f'{_h(tile_text(tile, level))}')

    def legend(self, title: str) -> str:
        """The graph's caption, under the picture: the title, the wire
        colours, the levels, and what each mark means."""
        wires = "  ".join(
            f'<font color="{self.colour[w.name]}"><b>{_h(w.name)}</b></font>'
            + (f"={w.size}" if w.size is not None else "") for w in self.d.wires)
        levels = "".join(
            f'<td bgcolor="{LEVEL_STYLE[name][3]}" border="1" color="{LEVEL_STYLE[name][2]}">'
            f"{_h(LEVEL_STYLE[name][0])}</td>" for name in self.levels)
        keys = ["wires: " + wires, "one coloured line per wire"]
        # (level, tile), the level None below the mesh: tiles "by" a block size.
        every = [(lv if t.across else None, t) for tiles in self.tiles.values() for lv, t in tiles]
        of_node = " of a node" if self.two_level else ""
        for kind, scope, what in (("group", None, "grouped in blocks of {n}, one per program"),
                                  ("group", "devices", "split over {n} devices" + of_node),
                                  ("group", "nodes", "split over {n} nodes"),
                                  ("stream", None, "dashed: streamed in chunks of {n}"),
                                  ("stream", "devices", "dashed: streamed round a ring of {n} devices" + of_node),
                                  ("stream", "nodes", "dashed: streamed round a ring over {n} nodes")):
            # The largest tile of each kind makes the clearest example.
            tile = max((t for lv, t in every if t.kind == kind and lv == scope),
                       key=lambda t: t.size, default=None)
            if tile is not None and tile.chunk is not None:  # ir.Tile.chunk
                keys.append(f"<b><i>{_h(tile.wire + tile_text(tile, scope))}</i></b> "
                            + _h(f"dashed: in chunks of {tile.chunk}, one per program (states merged), "
                                 f"each streamed {tile.size} at a time"))
            elif tile is not None:
                mark = "b" if kind == "group" else "i"
                if tile.size == 1 and scope is not None:   # 'across 1': where the nodes are, no split
                    what = "not split: every device on one node" if scope == "nodes" else "not split: one GPU a node"
                keys.append(f"<{mark}>{_h(tile.wire + tile_text(tile, scope))}</{mark}> "
                            + _h(what.format(n=tile.size)))
        pack = _packed(self.d)
        if pack is not None:
            keys.append(f"<b>{_h(pack[0])}[{pack[1]}] {_h(pack[2])}[{pack[3]}]</b> "
                        + _h(f"packed: {pack[1] * pack[3]} ({pack[0]}, {pack[2]}) rows per program"))
        more = ["&#9679; wires meeting at a dot are summed away",
                "broadcast: the input lacks that wire and is copied along it",
                "cylinder: a tensor in memory; box: an operation"]
        row = lambda cells: "<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>"
        inner = lambda cells, extra="": (
            '<table border="0" cellborder="0" cellspacing="6" cellpadding="2">'
            + "<tr>" + "".join(f"<td>{c}</td>" for c in cells) + extra + "</tr></table>")
        bytes_row = ""
        if self.labelled:   # built after the edges: only when some edge carries a byte count
            bytes_row = row([_h("bytes moved" + (" per device" if self.traffic.per_device else "") + " at "
                                + " ".join(f"{w}={n}" for w, n in self.traffic.sizes))])
        elif self.traffic.moves and self.d.schedule is None:
            # the cost pass prices what an unscheduled diagram runs as; the picture has no levels to put it on
            bytes_row = row([_h("no byte counts on the edges: the diagram has no schedule "
                                "(napkin cost prices its untuned launch)")])
        return ('<<table border="0" cellborder="0" cellspacing="0" cellpadding="0">'
                + row([f'<font point-size="14"><b>{_h(title)}</b></font>'])
                + bytes_row
                + row([inner(keys)])
                + row([inner(more, levels)])
                + "</table>>")

    def text(self) -> str:
        d = self.d
        title = f"{d.name}"
        costed = self.traffic.profile
        if d.schedule is not None:
            title += f": schedule on {d.schedule.profile or 'the default device'}"
            if costed is not None and costed != d.schedule.profile:
                # --device: the byte counts and capacities are that device's, not the schedule's
                title += f", costed on {costed}"
            title += f", accumulate {d.schedule.accumulate}"
        out = [f"digraph {_q(d.name)} {{",
               "  " + " ".join(f"{k}={_q(v)};" for k, v in (
                   ("rankdir", "LR"), ("newrank", "true"), ("nodesep", "0.35"),
                   ("ranksep", "0.4"), ("fontname", FONT), ("fontsize", "11"), ("labelloc", "b"))),
               f"  label={self.legend(title)};",
               f"  node [fontname={_q(FONT)}, fontsize=\"12\"];",
               f"  edge [fontname={_q(FONT)}, fontsize=\"11\", penwidth=\"1.5\"];"]
        out.extend(self.nodes.get(None, []))
        if self.levels:
            self.cluster(0, out)
        out.extend(self.edges)
        out.append("}")
        return "\n".join(out) + "\n"


def to_dot(diagram: ir.Diagram, costs=None) -> str:
    """The DOT text for a checked diagram; ``costs`` (a cost report, optional)
    adds the bytes each tensor moves across each level boundary."""
    picture = _Picture(diagram, traffic_from(costs))
    picture.build()
    return picture.text()
