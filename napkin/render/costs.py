"""The cost pass's report, read the way the pictures need it.

The picture only needs, per level boundary, how many bytes each tensor moves
across it, in which direction, in which kernel.  ``traffic_from`` turns a
``napkin.cost`` report into that table.  A boundary is named by its inner
level ("smem" is the hbm -> shared-memory boundary, "hbm" the devices -> hbm
one).  No report gives an empty table: the picture never depends on the cost
pass being present or working.

``try_costs`` runs the cost pass and turns any failure into a reason string,
because a picture without byte labels is better than no picture.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

# Sizes the pictures and the report give symbolic wires when the user gives
# none: one sequence of 4096 tokens, 16 heads (8 kv heads of 2 in GQA), a
# 4096-square matmul.  Any other symbolic wire gets OTHER_SIZE.
DEFAULT_SIZES = {"b": 1, "h": 16, "hk": 8, "g": 2, "q": 4096, "x": 4096,
                 "m": 4096, "n": 4096, "k": 4096}
OTHER_SIZE = 1024


# What a merge of partial results sends between devices, all rounds together: the
# cost pass's "partial states (round 0)", "(round 1)" ... (O and lse merge as one state).
MERGED = "partial states"


@dataclass(frozen=True)
class Traffic:
    """Bytes moved: ``moves[(inner level, tensor, "load"|"store", kernel)]``,
    kernel None for traffic between devices; ``kernel_of[box]``.
    ``sent_by_link``: (within the node, across nodes), the bytes the busiest
    device sends in the forward; None when the report has no such split.
    napkin/cost/devices.py gives only these two totals, not a split per
    collective, so the picture shows them once, on the peer devices."""

    moves: dict = field(default_factory=dict)
    kernel_of: dict = field(default_factory=dict)
    sizes: tuple = ()
    per_device: bool = False
    sent_by_link: Optional[tuple] = None
    # tensor -> the row it travels in between devices ("K" -> "K, V": the
    # cost pass counts K and V of one ring pass or gather together)
    together: dict = field(default_factory=dict)
    # The inputs the cost pass brings to a device from the others, as its device
    # rows say: (tensor, "ring" | "gather", the split wires the collective spans),
    # so the picture's peer edges are the communication the bytes are charged for.
    # None without a cost report of a mesh: the picture then reads the schedule.
    arrivals: Optional[tuple] = None
    # the device profile the costs are for (``--device``), which the picture's
    # capacities and title follow; None without a report
    profile: Optional[str] = None

    def row_of(self, tensor: str) -> str:
        return self.together.get(tensor, tensor)

    def get(self, inner: str, tensor: str, direction: str, box: Optional[str]) -> Optional[float]:
        kernel = self.kernel_of.get(box) if box is not None else None
        return self.moves.get((inner, tensor, direction, kernel))


def traffic_from(costs) -> Traffic:
    """Read a cost report (``napkin.cost``'s CostReport, duck-typed)."""
    if costs is None:
        return Traffic()
    moves: dict = {}
    together: dict = {}
    # a merge kernel's traffic (chunks of the streamed wire) is drawn on the kernel it merges,
    # a ranges prepass's on the kernel whose blocks it lists
    merged = {k.index: k.merges if getattr(k, "merges", None) is not None else k.prepass_of
              for k in getattr(costs, "kernels", ()) or ()
              if getattr(k, "merges", None) is not None or getattr(k, "prepass_of", None) is not None}
    for t in getattr(costs, "transfers", ()) or ():
        if t.bytes is None:
            continue
        inner = t.boundary.split("/")[-1]
        key = (inner, t.tensor, t.direction, merged.get(t.kernel, t.kernel))
        moves[key] = moves.get(key, 0) + t.bytes
    devices = getattr(costs, "devices", None)
    arrivals: dict = {}
    for row in getattr(devices, "rows", ()) or ():
        if not row.collective.startswith("merge"):
            how = "ring" if row.collective.startswith("ring") else "gather"
            for name in row.tensor.split(","):
                # a ring over nodes is two rows (in node, to the next node): one arrival
                _, _, among = arrivals.get(name.strip(), (how, how, ()))
                among += tuple(w for w in row.among if w not in among)
                arrivals[name.strip()] = (name.strip(), how, among)
        if row.bytes_received is None:
            continue
        # Gathers and ring passes bring inputs in; a merge exchanges partial results,
        # every round of it one row of the picture (the outputs' merge edges read MERGED)
        merge = row.collective.startswith("merge")
        key = ("hbm", MERGED if merge else row.tensor, "store" if merge else "load", None)
        moves[key] = moves.get(key, 0) + row.bytes_received
        together.update({name.strip(): row.tensor for name in row.tensor.split(",")})
    kernel_of = {box: k.index for k in getattr(costs, "kernels", ()) or () for box in k.boxes}
    within, across = getattr(devices, "sent_within", None), getattr(devices, "sent_across", None)
    links = (within, across) if within is not None and across is not None else None
    return Traffic(moves, kernel_of, tuple(getattr(costs, "sizes", ()) or ()),
                   bool(getattr(costs, "per_device", False)), links, together,
                   tuple(arrivals.values()) if devices is not None else None,
                   getattr(costs, "profile", None))


def default_sizes(diagram, given: Optional[dict] = None) -> dict[str, int]:
    """A size for every symbolic wire: the user's, else the size a relabel
    ties it to (``X[b, x, d]`` of ``X[b, q, d]``: |q| = |x|, one of them fixed
    or given), else DEFAULT_SIZES.  Defaults taken alone made q 4096 beside a
    fixed x of 128, which the cost pass refuses."""
    from .. import ir

    sizes = {w.name: w.size for w in diagram.wires if w.size is not None}
    sizes.update(given or {})
    ir.tie_relabels(diagram, sizes)   # a clash is the cost pass's to refuse, at the relabel
    for w in diagram.wires:
        if w.name not in sizes:
            sizes[w.name] = DEFAULT_SIZES.get(w.name, OTHER_SIZE)
            ir.tie_relabels(diagram, sizes)
    return {w.name: sizes[w.name] for w in diagram.wires if w.size is None}


def check_profile(profile: Optional[str]) -> None:
    """A device the user named: refused when unknown, not drawn around (nothing
    to check it by without the cost pass)."""
    if profile is None:
        return
    try:
        from .. import cost
    except ImportError:
        return
    cost.get_profile(profile)


def try_costs(diagram, sizes: Optional[dict] = None, profile: Optional[str] = None, docs=None, lengths=None):
    """(report, None) from the cost pass at ``default_sizes``, or (None, why not).

    The user's errors propagate (a bad profile name; a refusal that stays
    with every wire the user did not size at 1).  A refusal at sizes napkin chose (a
    wire it has no default for takes OTHER_SIZE: twenty of them make a launch
    grid past what the cost pass walks) and any other failure only cost the
    picture its byte labels: the reason says which sizes to give.  ``docs``:
    a document mask's counts on those documents, ``lengths`` at those
    length inputs' values (cost.analyse's).
    """
    from .. import located
    from ..errors import NapkinError
    try:
        from .. import cost
    except ImportError:
        return None, "the cost pass (napkin.cost) is not available"
    chosen = default_sizes(diagram, sizes)
    check_profile(profile)
    try:
        return cost.analyse(diagram, chosen, profile, docs, lengths), None
    except NapkinError as err:
        guessed = sorted(set(chosen) - set(sizes or {}))
        if not guessed:   # the user's, shown at its place in the file (it said <input>)
            raise located(err, diagram) from None
        try:   # at 1 for every guessed wire: a refusal that stays is the given sizes'
            cost.analyse(diagram, {**chosen, **dict.fromkeys(guessed, 1)}, profile, docs, lengths)
        except NapkinError:
            raise located(err, diagram) from None
        first = str(err).splitlines()[0].removeprefix("napkin: ")
        return None, (f"the cost pass refused the default sizes {', '.join(f'{w}={chosen[w]}' for w in guessed)} "
                      f"({first}); give the wires' sizes with -D WIRE=N")
    except Exception as err:
        return None, f"the cost pass failed: {type(err).__name__}: {err}"
