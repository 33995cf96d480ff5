"""The cost pass's predicted HBM bytes against Nsight Compute's DRAM bytes.

One forward attention kernel at one size, on a GPU:

    ncu --clock-control none --csv --print-units base --log-file OUT/ncu-causal.csv \\
        --metrics dram__bytes_read.sum,dram__bytes_write.sum -k _causal_kernel \\
        --launch-skip 1 --launch-count 1 \\
        python bench/dram_bytes.py run examples/causal.ncd -D b=1 -D h=16 -D q=16384 -D x=16384 \\
        --dtype bfloat16 --head-dim 128
    python bench/dram_bytes.py compare examples/causal.ncd OUT/ncu-causal.csv -D ... --out OUT

``run`` compiles the diagram (dtype and head dim rewritten as ``napkin
bench`` does), takes the launcher options from the autotune cache when the
bucket was tuned (else the schedule's), launches the forward twice and
prints the options as one JSON line (``--options-file`` keeps them for
``compare``).  ncu skips the first launch (compilation) and measures the
second.  ``compare`` runs the cost pass at the same sizes and block sizes
and writes predicted vs measured: the HBM traffic the kernel issues (loads +
stores at the hbm/smem boundary, which tests/test_bytecount.py proves equal
to the bytes the kernel asks for) and the cost pass's DRAM estimate (re-reads
served by the 50 MB L2 when they fit), next to ncu's dram__bytes_read +
dram__bytes_write.  Issued bytes over DRAM bytes is the share L2 saves.

bench/run_h100.sh's ``ncu`` stage runs both for plain and causal attention
at the issue's target (16K tokens, head dim 128, bf16), and for the chunked
decode (examples/flash_decoding.ncd), whose forward is two kernels, the
chunked one and the merge: ncu profiles both (``-k regex:...``,
``--launch-skip 2 --launch-count 2``) and ``compare`` sums them against the
cost pass's two.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import io
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum")
_UNITS = {"byte": 1, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9, "tbyte": 1e12}


def load_variant(path: str, dtype: str, head_dim):
    import napkin
    from napkin.bench import harness
    text = Path(path).read_text()
    return harness.variant(napkin.load(path), text, dtype, head_dim)


def launcher_options(diagram, text: str, sizes: dict, device: str) -> dict:
    """The autotune cache's options for this bucket, else none (the schedule's)."""
    from napkin import tunecache
    if device != "cuda":
        return {}
    # the inputs are made in their declared dtypes, as napkin bench's are
    key = tunecache.cache_key(tunecache.diagram_hash(text), tunecache.device_name(device),
                             tunecache.input_classes(diagram), sizes, tunecache.symbolic_wires(diagram))
    hit = tunecache.Cache().get(key)
    return dict(hit.kwargs()) if hit is not None else {}


def run(args) -> dict:
    import inspect

    import torch

    from napkin.bench import harness, reference
    diagram, text = load_variant(args.file, args.dtype, args.head_dim)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory() as build:
        module, _ = harness.compile_module(diagram, text, args.file, Path(build))
        launcher = getattr(module, diagram.name)
        accepted = set(inspect.signature(launcher).parameters)
        options = {k: v for k, v in launcher_options(diagram, text, args.sizes, device).items() if k in accepted}
        inputs = reference.example_inputs(diagram, args.sizes, device=device, seed=0)
        for _ in range(2):                   # ncu: skip the first (compiles), measure the second
            launcher(*inputs, **options)
        if device == "cuda":
            torch.cuda.synchronize()
    record = {"file": args.file, "sizes": args.sizes, "dtype": args.dtype, "options": options, "device": device}
    if args.options_file:
        Path(args.options_file).write_text(json.dumps(record))
    print(json.dumps(record))
    return record


def measured_bytes(csv_text: str, kernels: int = 1) -> int:
    """dram__bytes_read.sum + dram__bytes_write.sum of the profiled kernels,
    summed, in an ncu --csv log (any unit ncu chose; lines before the header
    skipped).  ``kernels``: how many launches the log must hold (2 for a
    chunked forward: its kernel and the merge)."""
    lines = csv_text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise ValueError("no ncu CSV header (\"ID\",...) in the log: did ncu profile a kernel?")
    rows = list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))
    found = {}
    for row in rows:
        name = row.get("Metric Name")
        if name in METRICS:
            unit = (row.get("Metric Unit") or "byte").strip().lower()
            if unit not in _UNITS:
                raise ValueError(f"unknown unit {unit!r} for {name}")
            profiled = {r.get("ID") for r in rows if r.get("Metric Name") == name}
            if len(profiled) != kernels:
                raise ValueError(f"{len(profiled)} kernels profiled; profile exactly {kernels} "
                                 f"(--launch-count {kernels})")
            found[name] = found.get(name, 0.0) + float(row["Metric Value"].replace(",", "")) * _UNITS[unit]
    missing = [m for m in METRICS if m not in found]
    if missing:
        raise ValueError(f"the ncu log lacks {', '.join(missing)}")
    return int(round(sum(found.values())))


def predicted(diagram, sizes: dict, options: dict) -> dict:
    """Issued HBM bytes (loads + stores at the hbm boundary, every kernel of
    the launch) and the DRAM estimate, at the launcher's block sizes and
    chunk; ``kernels``: how many kernels the launch runs (ncu must profile
    that many)."""
    from napkin.cost import analyse, packing, with_blocks
    blocks = {k[len("block_"):]: int(v) for k, v in options.items() if k.startswith("block_")}
    # with packed rows block_q is the packed block: with_blocks takes q's group (packing.schedule_blocks)
    d = with_blocks(diagram, packing.schedule_blocks(diagram, blocks)) if blocks else diagram
    if options.get("chunk") is not None:
        d = with_chunk(d, int(options["chunk"]))
    report = analyse(d, sizes)
    hbm = next(t for t in report.totals if t.boundary.startswith("hbm/"))
    return {"issued_bytes": hbm.load_bytes + hbm.store_bytes, "dram_estimate_bytes": hbm.dram_bytes,
            "kernels": len(report.kernels)}


def with_chunk(diagram, chunk: int):
    """The diagram with its streamed wire's chunk set as the launcher's
    chunk= sets it (0: none); a new diagram, the given one unchanged."""
    import dataclasses
    levels = tuple(dataclasses.replace(lv, tiles=tuple(
        dataclasses.replace(t, chunk=chunk or None) if t.kind == "stream" and not t.across else t
        for t in lv.tiles)) if lv.name == "smem" else lv for lv in diagram.schedule.levels)
    return dataclasses.replace(diagram, schedule=dataclasses.replace(diagram.schedule, levels=levels))


def compare(args) -> dict:
    diagram, _ = load_variant(args.file, args.dtype, args.head_dim)
    options = json.loads(Path(args.options_file).read_text())["options"] if args.options_file else {}
    pred = predicted(diagram, args.sizes, options)
    measured = measured_bytes(Path(args.csv).read_text(), pred["kernels"])
    record = dict(file=args.file, sizes=args.sizes, dtype=args.dtype, options=options, measured_dram_bytes=measured,
                  **pred, issued_over_measured=pred["issued_bytes"] / measured,
                  estimate_over_measured=(pred["dram_estimate_bytes"] / measured
                                          if pred["dram_estimate_bytes"] else None),
                  date=datetime.date.today().isoformat())
    print(f"{args.file}: measured DRAM {measured / 1e6:.3f} MB; issued (predicted exactly) "
          f"{pred['issued_bytes'] / 1e6:.3f} MB = {record['issued_over_measured']:.2f}x; "
          f"DRAM estimate {(pred['dram_estimate_bytes'] or 0) / 1e6:.3f} MB"
          + (f" = {record['estimate_over_measured']:.2f}x" if record["estimate_over_measured"] else ""))
    if args.out:
        out = Path(args.out) / f"dram-bytes-{Path(args.file).stem}-{record['date']}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=2) + "\n")
    return record


def main(argv=None) -> int:
    from napkin.sizes import parse_pairs
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("run", "compare"):
        p = sub.add_parser(name)
        p.add_argument("file")
        if name == "compare":
            p.add_argument("csv", help="the ncu --csv log of the run")
            p.add_argument("--out", default=None, help="folder for the JSON record")
        p.add_argument("--size", "-D", action="append", default=[], dest="size_args", metavar="WIRE=N")
        p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
        p.add_argument("--head-dim", type=int, default=None)
        p.add_argument("--options-file", default=None, help="run writes the launcher options here; compare reads them")
    args = ap.parse_args(argv)
    args.sizes = parse_pairs(args.size_args, "--size")
    (run if args.cmd == "run" else compare)(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
