"""TMA descriptors in the attention kernels: the launchers' option tma=.

The forward, dQ and dK/dV kernels each move their qualifying tiles
(descriptor_tile: a plain per-wire view of one tiled wire and the
padded head dim, every other wire one program index) through host
TensorDescriptors when their constexpr _TMA is set, and through the pointer
code otherwise.  Which a launch takes is decided per call, per kernel, by
the module's ``_tma_args`` (templates/attention.py.jinja): the option
(explicit, else the kernel's own tuned config: kind "", "bwd" or "bwd_kv"),
the device and every tensor's alignment; a tile that cannot take a
descriptor sends its whole kernel back to the pointer code, silently.

Here: ``Tma``, one kernel's descriptors (its parameters, the descriptor
load or store of each tile, the table the launcher builds them from, the
launcher's call), and ``load_code`` / ``store_code``, the one rendering of
a load or store statement with both forms, which the forward template and
backward_emit share.  Coordinates are int32, one per wire: the program's
batch indices, the tile's first row on its tiled wire, 0 for the head dim.
Rows past an edge read as zeros (the descriptor's zero fill, what the
pointer code's other=0.0 gives) and are clipped on a store; the masks on
the scores stay as they are.
"""
from __future__ import annotations

from typing import Mapping, Optional

from .. import ir, tiling
from . import lower as L
from .kernel_names import joined
from .pysrc import quote as _q, tuple_of as _tuple

# The option's name: a tuned option of every attention launcher (and of its
# NAME_backward), None (the default: each kernel's tuned config, else off),
# False or True.
OPTION = "tma"


# A TMA descriptor has at most five dimensions (cuTensorMapEncodeTiled).
MAX_DESCRIPTOR_RANK = 5


def descriptor_tile(plan: L.AttentionPlan, tensor: str, wires: tuple[str, ...], rows: Optional[str],
                    cols: Optional[str], diagram: Optional[ir.Diagram] = None) -> Optional[tuple[Optional[str], ...]]:
    """How a host TMA descriptor over ``tensor``'s own wires (a grouped axis
    (hk g) split into one dimension per wire) moves the (rows, cols) tile an
    attention kernel of ``plan`` (forward, dQ or dK/dV) reads or writes along
    ``wires``, ``tensor`` declared in ``diagram`` (default the plan's; the
    backward's also declares dO, lse, the gradients): one entry per
    declared wire, the wire whose block is the box's extent there (the tiled
    row or streamed wire, then the padded head-dim wire), None for a wire
    indexed by one program index (box extent 1).  None when the tile does not
    qualify: it must be a plain per-wire view of one tiled wire (plan.row or
    plan.col) and one padded head-dim wire (plan.dims) that is the tensor's
    innermost wire (its stride 1 is checked at each call), every other wire a
    batch wire, at most MAX_DESCRIPTOR_RANK wires.  Integer and boolean
    tensors (ids, masks: read at global positions) never qualify."""
    if tiling.tensor_dtype(diagram or plan.diagram, tensor) not in L.KERNEL_DTYPES:
        return None
    if rows not in (plan.row, plan.col) or cols not in plan.dims or rows == cols:
        return None
    if len(wires) > MAX_DESCRIPTOR_RANK or not wires or wires[-1] != cols or wires.count(rows) != 1 \
            or wires.count(cols) != 1:
        return None
    out: list[Optional[str]] = []
    for w in wires:
        if w in (rows, cols):
            out.append(w)
        elif w in plan.batch and wires.count(w) == 1:
            out.append(None)
        else:
            return None
    return tuple(out)


class Tma:
    """One attention kernel's TMA descriptors: a kernel parameter per
    (tensor, box) a qualifying tile needs, first come.  ``coords``: the
    expression of the first row of a tile along each tiled wire (the
    forward's and dQ's _row0 / _start, dK/dV's _row0 / _col0); ``outer``:
    batch wires the kernel loops over (dK/dV's GQA group), whose index is
    already an int32 loop variable (a Python int under the interpreter, which
    has no .to); ``diagram``: where the tensors are declared (the backward's
    declares dO, lse, ... besides the forward's)."""

    def __init__(self, plan: L.AttentionPlan, names, coords: Mapping[str, str], diagram=None, outer=()):
        self.plan, self.names, self.coords = plan, names, dict(coords)
        self.diagram, self.outer = diagram or plan.diagram, tuple(outer)
        self.descs: dict[tuple, str] = {}    # (tensor, box) -> kernel parameter

    def _desc(self, tensor: str, box) -> str:
        if (tensor, box) not in self.descs:
            n = sum(t == tensor for t, _ in self.descs)
            self.descs[(tensor, box)] = joined("tma", tensor) + (f"_{n}" if n else "")
        return self.descs[(tensor, box)]

    def _box(self, tensor, wires, rows, cols):
        box = descriptor_tile(self.plan, tensor, wires, rows, cols, self.diagram)
        if box is None or rows not in self.coords:
            return None
        coords = [self.coords[b] if b == rows else "0" if b is not None else
                  f"_i_{w}" if w in self.outer else f"_i_{w}.to(tl.int32)" for w, b in zip(wires, box)]
        return self._desc(tensor, box), "[" + ", ".join(coords) + "]", box

    def load(self, ld: L.Load) -> Optional[str]:
        """The descriptor load of a qualifying tile, shaped as the pointer load's; else None."""
        got = self._box(ld.tensor, ld.wires, ld.rows, ld.cols)
        if got is None:
            return None
        desc, coords, _ = got
        return f"{desc}.load({coords}).reshape({self.names.block(ld.rows)}, {self.names.block(ld.cols)})"

    def store(self, tensor: str, wires, rows, cols, value: str) -> Optional[str]:
        """The descriptor store of a qualifying [rows, cols] tile; else None."""
        got = self._box(tensor, wires, rows, cols)
        if got is None:
            return None
        desc, coords, box = got
        shape = ", ".join("1" if b is None else self.names.block(b) for b in box)
        return f"{desc}.store({coords}, {value}.reshape({shape}))"

    def params(self) -> list[str]:
        return list(self.descs.values()) + ["_TMA: tl.constexpr"] if self.descs else []

    def table(self) -> str:
        """``_TMA_DESCS``: (kernel parameter, tensor, the block wire or None per wire of its layout)."""
        return _tuple(f"({_q(p)}, {_q(t)}, {_tuple('None' if b is None else _q(b) for b in box)})"
                      for (t, box), p in self.descs.items())

    def launch(self, var: str, option: str, table: str, order, blocks: Mapping[str, str], last: str,
               padded=(), sizes: str = "_sz") -> str:
        """The launcher's line: ``var`` = the kernel's descriptor arguments
        and _TMA for this call (``_tma_args``), over the tensors of its
        descriptors (in ``order``) and the blocks of their wires; ``padded``:
        wires besides the keys whose padding rows must read as zeros;
        ``sizes``: the wire sizes the descriptors span (the forward's keys
        end at a lengths= cut)."""
        tensors = sorted({t for t, _ in self.descs}, key=list(order).index)
        args = "{" + ", ".join(f"{_q(t)}: {t}" for t in tensors) + "}"
        wires = "{" + ", ".join(f"{_q(w)}: {b}" for w, b in blocks.items()) + "}"
        extra = f", padded={_tuple(_q(w) for w in (self.plan.col, *padded))}" if padded else ""
        return f"{var} = _tma_args({option}, {table}, {args}, {sizes}, {wires}, _dev, _pos, {last}{extra})"


def load_code(var: str, ptr: str, mask: str, tma: Optional[str]) -> str:
    """The statement(s) loading one tile: the pointer load, and for a tile a
    descriptor can move both forms under the kernel's constexpr _TMA (one
    of them compiled)."""
    plain = f"{var} = tl.load({ptr}{mask})"
    if not tma:
        return plain
    return "\n".join(["if _TMA:  # its TMA descriptor (tma=): rows past an edge read as zeros",
                      f"    {var} = {tma}", "else:", f"    {plain}"])


def store_code(ptr: str, value: str, mask: str, tma: Optional[str]) -> str:
    """The statement(s) storing one tile, as ``load_code``."""
    plain = f"tl.store({ptr}, {value}{mask})"
    if not tma:
        return plain
    return "\n".join(["if _TMA:  # its TMA descriptor (tma=): rows past an edge are not written",
                      f"    {tma}", "else:", f"    {plain}"])
