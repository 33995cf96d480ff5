"""The device level: what each device sends and receives, in how many steps.

Layout.  P devices = the product of the ``group w across N`` counts.  Every
input starts dealt evenly over the P devices (cyclically along its token
wire, as ATTENTION2D does, so a device's own share lies inside every block it
needs), and every output must end that way.

Inputs.  A device needs the block of each input cut by the wires grouped
across devices that the input carries (Q is cut by q's rows, K by x's
columns), and every chunk of a wire streamed across devices (Ring: all of K
and V pass through each device).  What it lacks it receives:
  * an all-gather among the k devices that need the same block (k - 1 steps),
    receiving (k - 1)/k of the block and sending as much;
  * for the wire streamed across N devices, a ring pass: N - 1 steps, one
    chunk in and one out per step.
Outputs.  When a kernel reduces a wire grouped across devices (x in
ATTENTION2D), each device holds a partial result for its block; the k
devices sharing the block exchange their partials for each other's shares
(an all_to_all plus a local merge, k - 1 steps).  Partials travel in the
accumulator dtype, and a softmax-style merge also needs each row's
log-sum-exp (fp32) unless lse is itself an output (it then travels anyway).

Link.  Up to 8 devices talk over NVLink, more over InfiniBand (one GPU per
node, the slowest link of a larger collective).  Time = the larger of bytes
sent and received over the link's per-direction bandwidth; the no-overlap
variant adds it to the compute estimate.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .. import ir, tiling
from .model import Kernel, contraction_factors, device_tiles, node_wires
from .symbolic import Poly

NVLINK_DOMAIN = 8  # GPUs per NVLink domain (one DGX/HGX node)


@dataclass(frozen=True)
class CommRow:
    tensor: str
    collective: str       # "all-gather", "ring pass" or "merge (all-to-all)"
    among: tuple[str, ...]  # the device-split wires whose parts the collective spans
    group: int            # devices in the collective
    steps: int
    dtype: str
    formula: str          # bytes received per device, symbolic
    bytes_received: Optional[int]
    bytes_sent: Optional[int]


@dataclass(frozen=True)
class DeviceComm:
    devices: int
    grid: tuple[tuple[str, str, int], ...]   # (wire, "group"/"stream", parts)
    rows: tuple[CommRow, ...]
    steps: int
    bytes_received: Optional[int]
    bytes_sent: Optional[int]
    link: str
    link_bandwidth: float
    time_s: Optional[float]


def _parts(diagram: ir.Diagram) -> tuple[dict[str, int], Optional[tuple[str, int]]]:
    groups, stream = {}, None
    for t in device_tiles(diagram):
        if t.kind == "group":
            groups[t.wire] = t.size
        else:
            stream = (t.wire, t.size)
    return groups, stream


def device_count(diagram: ir.Diagram) -> int:
    return math.prod(_parts(diagram)[0].values()) if device_tiles(diagram) else 1


def _merge_wires(diagram: ir.Diagram, kernel: Kernel) -> set[str]:
    """Wires the kernel reduces or normalises over."""
    out = set()
    for b in kernel.boxes:
        for n in ir.walk(diagram.tensor(b).expr):
            if isinstance(n, ir.Reduce):
                out |= set(n.wires)
            elif isinstance(n, ir.Normalize):
                out.add(n.wire)
    return out


def _softmax_like(diagram: ir.Diagram, kernel: Kernel, wire: str) -> bool:
    return any((isinstance(n, ir.Normalize) and n.wire == wire) or
               (isinstance(n, ir.Reduce) and n.op in ("max", "logsumexp") and wire in n.wires)
               for b in kernel.boxes for n in ir.walk(diagram.tensor(b).expr))


def communication(diagram: ir.Diagram, kernels: list[Kernel], sizes: Optional[dict[str, int]],
                  profile, wire_sym) -> Optional[DeviceComm]:
    """Per-device communication, or None without a devices level."""
    if not device_tiles(diagram):
        return None
    groups, stream = _parts(diagram)
    p = math.prod(groups.values())
    acc = tiling.accumulator_dtype(diagram)
    rows: list[CommRow] = []

    def block(wires) -> tuple[Poly, Optional[int], int]:
        """A device's block of a tensor along ``wires``: formula, elements, and
        how many devices share it."""
        poly, n, share = Poly.const(1), 1, p
        for w in wires:
            # all chunks of a wire streamed across devices pass through each device
            poly = poly * (Poly.sym(w) if stream and w == stream[0] else wire_sym(w))
            if w in groups:
                share //= groups[w]
            if n is not None:
                n = None if sizes is None else n * (math.ceil(sizes[w] / groups[w]) if w in groups else sizes[w])
        return poly, n, share

    def add(name, wires, dtype, collective, share, steps, poly, n):
        frac = Poly.const(1) - Poly.const(1) / share_sym(wires, collective)
        nbytes = None if n is None else (n - n // share) * ir.DTYPE_BYTES[dtype]
        among = (stream[0],) if collective == "ring pass" else tuple(w for w in groups if w not in wires)
        rows.append(CommRow(name, collective, among, share, steps, dtype, str(poly * frac * ir.DTYPE_BYTES[dtype]),
                            nbytes, nbytes))

    def share_sym(wires, collective) -> Poly:
        if collective == "ring pass":
            return Poly.sym(f"P_{stream[0]}")
        k = Poly.const(1)
        for w in groups:
            if w not in wires:
                k = k * Poly.sym(f"P_{w}")
        return k

    for t in diagram.inputs:
        wires = ir.axis_wires(t.axes)
        if stream and stream[0] in wires:
            poly, n, _ = block(wires)
            # per step a chunk of 1/N along the streamed wire; N - 1 chunks arrive
            add(t.name, wires, t.dtype, "ring pass", stream[1], stream[1] - 1, poly, n)
            continue
        poly, n, share = block(wires)
        if share > 1:
            add(t.name, wires, t.dtype, "all-gather", share, share - 1, poly, n)

    outputs = {o.name for o in diagram.outputs}
    for k in kernels:
        merged = [w for w in _merge_wires(diagram, k) if w in groups]
        if not merged:
            continue
        for name in k.stores:
            if name not in outputs:
                continue
            wires = ir.axis_wires(diagram.tensor(name).axes)
            poly, n, share = block(wires)
            if share > 1:
                add(name, wires, acc, "merge (all-to-all)", share, share - 1, poly, n)
        soft = [w for w in merged if _softmax_like(diagram, k, w)]
        lse_out = any(isinstance(n, ir.Reduce) and n.op == "logsumexp"
                      for b in k.stores if b in outputs for n in [diagram.tensor(b).expr])
        if soft and not lse_out and k.stores:
            # the merge needs each row's log-sum-exp: rows = the first store's wires minus its last
            first = diagram.tensor(k.stores[0])
            wires = tuple(w for w in ir.axis_wires(first.axes) if w not in _value_wires(diagram, k))
            poly, n, share = block(wires)
            if share > 1:
                add(f"lse({first.name})", wires, "fp32", "merge (all-to-all)", share, 0, poly, n)

    steps = _steps(rows)
    received = None if sizes is None else sum(r.bytes_received for r in rows)
    sent = None if sizes is None else sum(r.bytes_sent for r in rows)
    link = "nvlink_bandwidth" if p <= NVLINK_DOMAIN else "infiniband_bandwidth"
    bw = profile[link]
    time = None if received is None else max(received, sent) / bw
    grid = tuple((t.wire, t.kind, t.size) for t in device_tiles(diagram))
    return DeviceComm(p, grid, tuple(rows), steps, received, sent,
                      "NVLink" if p <= NVLINK_DOMAIN else "InfiniBand", bw, time)


def _value_wires(diagram: ir.Diagram, kernel: Kernel) -> set[str]:
    """Wires an output has that its row statistics lack (d of O): the wires
    of the value operand of the last contraction that are not reduced."""
    out: set[str] = set()
    for b in kernel.boxes:
        for n in ir.walk(diagram.tensor(b).expr):
            f = contraction_factors(n, diagram)
            if f:
                out = set(node_wires(diagram, f[1])) - set(n.wires)
                out -= node_wires(diagram, f[0])
    return out


def _steps(rows: list[CommRow]) -> int:
    """Tensors in the same collective among the same devices move together."""
    seen: dict[tuple, int] = {}
    for r in rows:
        key = (r.collective, r.among)
        seen[key] = max(seen.get(key, 0), r.steps)
    return sum(seen.values())
