"""``napkin cost FILE``: the cost report on the command line.

    napkin cost examples/attention.ncd --size b=1 -D h=16 -D q=4096 -D x=4096
    napkin cost examples/attention.ncd -D ... --device a100 --json
    napkin cost examples/attention.ncd -D ... --tune [--top 5] [--objective transfers]
    napkin cost examples/attention.ncd -D ... --dtypes fp32,fp16,e4m3
    napkin cost examples/causal.ncd -D ... --backward     (the training backward too)
    napkin cost examples/document_mask.ncd -D ... --docs 512   (the mask's blocks on those documents)
    napkin cost examples/prefix_lm.ncd -D ... --lengths p=1024   (the mask's blocks at that prefix)

Bad options (a wire the diagram lacks, a size that is not a positive whole
number, an unknown device or dtype) are NapkinErrors: exit status 1.
"""
from __future__ import annotations

import dataclasses
import json

from .. import ir
from ..documents import Documents, add_docs_option
from .lengths import add_lengths_option, parse_lengths
from ..errors import NapkinError
from ..sizes import parse_pairs, positive_int
from .analysis import analyse
from .backward import backward_cost
from .profiles import profile_names
from .report import format_text, human, seconds
from .tune import tune


def register_cli(subparsers) -> None:
    p = subparsers.add_parser("cost", help="predict traffic, FLOPs and time of a diagram's schedule")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--size", "-D", action="append", default=[], metavar="WIRE=N", dest="sizes",
                   help="size of a symbolic wire (repeatable)")
    p.add_argument("--device", "--profile", dest="device", default=None, metavar="NAME",
                   help="device profile: " + ", ".join(profile_names()) + " (default: the diagram's)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    # one report a run: the schedule's (with --backward), a tile search, or a sweep
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--tune", action="store_true", help="search block sizes and print the best few")
    p.add_argument("--top", type=positive_int, default=None, metavar="N", help="how many tuning results (default 5)")
    p.add_argument("--objective", choices=("time", "transfers"), default=None,
                   help="what the tile search minimises (default: predicted time)")
    mode.add_argument("--dtypes", default=None, metavar="LIST",
                      help="compare the diagram with every tensor in each of these dtypes, e.g. fp32,fp16")
    p.add_argument("--backward", action="store_true",
                   help="also cost the training backward: its kernels' transfers, FLOPs and time "
                        "(not with --tune, --dtypes or --capacities)")
    mode.add_argument("--capacities", default=None, metavar="LIST",
                      help="compare shared-memory capacities in bytes, e.g. 65536,131072,262144")
    add_docs_option(p)
    add_lengths_option(p)
    p.add_argument("--mask-cache", action="store_true",
                   help="price launches given a warm mask_cache=: a data mask's ranges prepass kept from an earlier "
                        "call, its record's reads alone counted")
    p.set_defaults(func=handler)


def handler(args) -> int:
    import napkin

    # the tile search (and the sweeps, which re-price the schedule at other
    # capacities) may start from a schedule that overflows: finding blocks
    # that fit is what it is for
    search = args.tune or args.dtypes is not None or args.capacities is not None
    given = [f for f, v in (("--top", args.top), ("--objective", args.objective)) if v is not None]
    if given and not args.tune:   # an option of the tile search alone would be dropped unseen
        raise NapkinError(f"{' and '.join(given)} {'is an option' if len(given) == 1 else 'are options'} of --tune")
    if search and args.backward:
        mode = "--tune" if args.tune else "--dtypes" if args.dtypes is not None else "--capacities"
        raise NapkinError(f"--backward costs the schedule as written; {mode} prints another report: give one of them")
    diagram = napkin.load(args.file, capacity=not search)
    if search and not args.json:
        from ..check import check
        for problem in check(diagram):   # only capacity can be left: say it, then search
            print(f"note: the schedule as written: {problem.message}")
    try:
        sizes = parse_pairs(args.sizes, "--size")
        docs = Documents.parse(args.docs) if args.docs is not None else None
        lengths = parse_lengths(args.lengths)
        for flag, given in (("--docs", docs), ("--lengths", lengths)):
            if given is not None and (args.dtypes is not None or args.capacities is not None):
                raise NapkinError(f"{flag} prices the schedule or a tile search; "
                                  f"{'--dtypes' if args.dtypes is not None else '--capacities'} prints another report")
        if args.dtypes is not None:
            rows = dtype_table(diagram, sizes, args.device, _dtypes(args.dtypes))
            print(json.dumps(rows, indent=2) if args.json else format_sweep(rows, "dtype"))
            return 0
        if args.capacities is not None:
            rows = capacity_table(diagram, sizes, args.device, _capacities(args.capacities))
            print(json.dumps(rows, indent=2) if args.json else format_sweep(rows, "smem capacity"))
            return 0
        if args.tune:
            results = tune(diagram, sizes, args.device, top=args.top or 5, objective=args.objective or "time",
                           docs=docs, lengths=lengths)
            print(json.dumps(tune_dicts(results), indent=2) if args.json else format_tune(diagram, results))
            return 0
        report = analyse(diagram, sizes, args.device, docs, lengths, args.mask_cache)
        back = backward_cost(diagram, sizes, args.device, docs=docs, lengths=lengths,
                             mask_cache=args.mask_cache) if args.backward else None
    except NapkinError as err:   # a place in the diagram shows its line and caret
        raise napkin.located(err, diagram) from None
    if back is None:
        print(report.to_json() if args.json else format_text(report))
    elif args.json:
        # its own schema: it is no napkin.cost/1 report (from_json takes its "forward")
        print(json.dumps({"schema": BACKWARD_SCHEMA, "forward": report.to_dict(), "backward": backward_dict(back)},
                         indent=2))
    else:
        print(format_text(report) + "\n\n" + "\n".join(back.lines()))
    return 0


BACKWARD_SCHEMA = "napkin.cost.backward/1"


def backward_dict(back) -> dict:
    """The backward's cost as JSON-native values (the training forward is the
    --json report of the same diagram with its row state added)."""
    return {"kernels": list(back.kernels),
            "transfers": [dict(kernel=m.kernel, tensor=m.tensor, direction=m.direction, dtype=m.dtype,
                               elements=m.elements, bytes=m.bytes) for m in back.moves],
            "load_bytes": back.load_bytes, "store_bytes": back.store_bytes,
            "dram_bytes": dict(zip(back.kernels, back.dram)),
            "flops": {"contraction": back.contraction_flops, "other": back.other_flops, "exp": back.exp_flops},
            "training_forward_bytes": back.forward.hbm_bytes, "time_s": back.time_s,
            "roofline": dataclasses.asdict(back.roofline)}


def _dtypes(text: str) -> list[str]:
    out = [t.strip() for t in text.split(",")]
    for d in out:
        if d not in ir.FLOAT_DTYPES:   # an empty item too ("fp32,,fp16"): a typo, not a wish
            raise NapkinError(f"--dtypes: {d!r} is not a float dtype ({', '.join(ir.FLOAT_DTYPES)})")
    return out


def tune_dicts(results) -> list[dict]:
    return [{"blocks": dict(r.blocks), "time_s": r.time_s, "hbm_bytes": r.hbm_bytes, "bound": r.bound,
             "footprint": [{"level": lv, "bytes": b, "capacity": c} for lv, b, c in r.footprint]}
            for r in results]


def format_tune(diagram, results) -> str:
    if not results:
        return f"napkin cost --tune: no block sizes fit every level of {diagram.name}"
    lines = [f"best blocks for {diagram.name}:"]
    for i, r in enumerate(results, 1):
        blocks = " ".join(f"{w}={b}" for w, b in r.blocks)
        fp = ", ".join(f"{lv} {human(b, 'B')}/{human(c, 'B')}" for lv, b, c in r.footprint)
        lines.append(f"{i}. {blocks}: {seconds(r.time_s)} ({r.bound}-bound), hbm {human(r.hbm_bytes, 'B')}; {fp}")
    return "\n".join(lines)


# --------------------------------------------------------------------------
# The same diagram in other dtypes (the q^(1 + beta) effect).
# --------------------------------------------------------------------------

def recast(diagram: ir.Diagram, dtype: str) -> ir.Diagram:
    """A copy with every input, and every box that declares a dtype, in ``dtype``."""
    return dataclasses.replace(
        diagram,
        inputs=tuple(dataclasses.replace(t, dtype=dtype) if t.dtype in ir.FLOAT_DTYPES else t
                     for t in diagram.inputs),
        lets=tuple(dataclasses.replace(t, dtype=dtype) if t.dtype in ir.FLOAT_DTYPES else t
                   for t in diagram.lets))


def with_capacity(diagram: ir.Diagram, level: str, capacity: int) -> ir.Diagram:
    """A copy whose ``level`` has the given capacity in bytes."""
    levels = tuple(dataclasses.replace(lv, capacity=capacity) if lv.name == level else lv
                   for lv in diagram.schedule.levels)
    return dataclasses.replace(diagram, schedule=dataclasses.replace(diagram.schedule, levels=levels))


def _sweep_row(key: str, value, d: ir.Diagram, sizes, device) -> dict:
    r = analyse(d, sizes, device)
    best = tune(d, sizes, device, top=1, objective="transfers") if r.hbm_bytes is not None else []
    fits = [f.fits for f in r.footprints if f.fits is not None]
    return {key: value, "hbm_bytes": r.hbm_bytes, "schedule_fits": all(fits) if fits else None,
            "bound_bytes": r.bound.bytes, "bound_reread_bytes": r.bound.reread_bytes,
            "tuned_blocks": dict(best[0].blocks) if best else None,
            "tuned_hbm_bytes": best[0].hbm_bytes if best else None}


def dtype_table(diagram, sizes, device, dtypes) -> list[dict]:
    return [_sweep_row("dtype", dt, recast(diagram, dt), sizes, device) for dt in dtypes]


def capacity_table(diagram, sizes, device, capacities) -> list[dict]:
    if diagram.level("smem") is None:
        raise NapkinError(f"diagram {diagram.name} has no smem level to resize")
    return [_sweep_row("smem capacity", c, with_capacity(diagram, "smem", c), sizes, device)
            for c in capacities]


def _capacities(text: str) -> list[int]:
    out = []
    for item in text.split(","):
        item = item.strip()
        if not item.isdigit() or int(item) <= 0:
            raise NapkinError(f"--capacities: {item!r} is not a positive whole number of bytes")
        out.append(int(item))
    return out


def format_sweep(rows, key: str) -> str:
    """The same diagram at several dtypes or capacities: the schedule as written,
    the lower bound (and its capacity-dependent term), and the best blocks the
    tile search finds for the fewest transfers."""
    head = [key, "schedule hbm", "bound", "bound re-read term", "tuned hbm", "tuned blocks"]
    body = [[str(r[key]), human(r["hbm_bytes"], "B") + (" *" if r.get("schedule_fits") is False else ""),
             human(r["bound_bytes"], "B"),
             human(r["bound_reread_bytes"], "B"), human(r["tuned_hbm_bytes"], "B"),
             " ".join(f"{w}={b}" for w, b in (r["tuned_blocks"] or {}).items())] for r in rows]
    widths = [max(len(x[i]) for x in [head] + body) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [head] + body]
    if any(r.get("schedule_fits") is False for r in rows):   # then it may sit below its bound
        lines.append("* the schedule's tiles overflow a level there: it runs on no such device, and the bound "
                     "holds only for schedules that fit")
    return "\n".join(lines)
