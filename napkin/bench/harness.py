"""``napkin bench``: a compiled diagram against SDPA and FlexAttention.

For every diagram file, dtype and head dim the harness compiles a variant of
the diagram (the file itself when nothing changes; otherwise the same IR
with its fixed wires and fp16/bf16 declarations rewritten, printed back to
text so the module's SOURCE_HASH and the autotune key follow the variant),
then for every (batch, heads, length) point:

1. picks the launch config: tuned now (``--autotune``), else from the
   autotune cache, else the schedule's own blocks;
2. checks napkin and every baseline that computes the same function against
   the float64 reference *before* timing anything, forward and backward
   (checks.py); an implementation that fails is reported, not timed.  The reference materialises the q x x
   scores, so when they would exceed CHECK_ELEMENTS the check runs at
   two batches and two (kv) heads at most and shorter lengths; at the full size napkin's outputs
   are then compared with FlexAttention's, which costs nothing extra (the
   warm-up calls produce both);
3. times forward and backward: on CUDA with triton.testing.do_bench (median
   after warm-up, CUDA events); on the CPU with a wall clock under Triton's
   interpreter, a smoke test of the plumbing that is labelled, in the JSON
   and the table, as not a performance number;
4. reports TFLOP/s (results.attention_flops) and napkin's speed ratio to
   each baseline, and writes bench/results/<device>-<date>.{json,md}.

Symbolic wires get their sizes from their role, found in the IR (not from
their names): batch -> --batch, heads -> --heads (for GQA's (hk g): hk =
heads / --group, g = --group), queries and keys -> --seqlen; any other
wire needs --size WIRE=N.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import inspect
import os
import platform
import sys
import tempfile
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Optional

from .. import autotune, ir, tunecache
from ..documents import Documents
from ..errors import NapkinError
from ..files import why_not
from ..sizes import parse_pairs, positive_int
from . import baselines, checks, flex, overlap, predicted, ranges_prepass, reference, results
from .budget import POINT_S, RUN_S, TIME_LIMIT_ENV, TuneShare, time_limit
from .checks import TOLERANCE, full_size_check
from .timing import DO_BENCH, cuda_ms as _cuda_ms, ms as _ms, result as _result
from .timing import time_backward as _time_backward, time_forward as _time_forward

NAPKIN_DTYPE = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}

FLOP_CONVENTION = ("2*B*H*Lq*Lk*(d+dv) forward (4*B*H*N^2*d), x0.5 when the mask is exactly causal, x the "
                   "fraction of (query, key) pairs any other mask keeps on the inputs (`visible`; dense where "
                   "FlexAttention cannot express the diagram), backward 2.5x forward; a speed reference (†) "
                   "counts its own plain attention, x0.5 when it ran causal")

# Presets: lists of values, crossed.  h100 follows the FlashAttention papers'
# grid: 16K tokens per batch (batch = 16384 / seqlen) and a hidden size of
# 2048 (heads = 2048 / head dim), lengths 1K to 32K.
PRESETS = {
    "smoke": {"seqlen": [64], "batch": [1], "heads": [2], "head_dim": [], "dtype": ["float16"],
              "group": 2, "reps": 2},
    "h100": {"seqlen": [1024, 2048, 4096, 8192, 16384, 32768], "tokens": 16384, "hidden": 2048,
             "head_dim": [64, 128, 256], "dtype": ["bfloat16", "float16"], "group": 4, "reps": 0},
}


# --------------------------------------------------------------------------
# Command line.
# --------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="+", metavar="FILE", help="attention diagrams (.ncd)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="smoke",
                   help="the grid to run (default smoke: tiny, any machine); flags below override it")
    p.add_argument("--seqlen", metavar="N,...", help="sequence lengths, e.g. 1K,4K,16K")
    p.add_argument("--batch", metavar="N,...", help="batch sizes (default: preset)")
    p.add_argument("--heads", metavar="N,...", help="query heads (default: preset)")
    p.add_argument("--head-dim", metavar="N,...", help="set the diagram's head dims, fixed or symbolic (the "
                   "score's contracted wire and V's feature wire)")
    p.add_argument("--dtype", metavar="T,...", help="float16, bfloat16, float32 for the fp16/bf16 tensors")
    p.add_argument("--group", type=positive_int, help="query heads per kv head for GQA diagrams")
    p.add_argument("--size", "-D", action="append", default=[], metavar="WIRE=N", help="any other symbolic wire")
    p.add_argument("--no-backward", action="store_true", help="time the forward pass only")
    p.add_argument("--autotune", action="store_true",
                   help="tune block sizes / num_warps / num_stages first (GPU only; cached on disk)")
    p.add_argument("--tune-budget", type=float, metavar="SECONDS",
                   help="with --autotune: seconds per tuned kernel (forward, dQ, dK/dV each), after which "
                        "its remaining candidates are skipped and the best so far kept (default: "
                        f"the seconds --time-limit leaves after start-up and {POINT_S} s per grid point, shared "
                        "by the kernels still to tune, before each point)")
    p.add_argument("--time-limit", type=float, metavar="SECONDS",
                   help="with --autotune: the seconds the whole run may take, which the default tuning budget "
                        f"shares out (default: ${TIME_LIMIT_ENV}, else {RUN_S})")
    p.add_argument("--docs", metavar="LENGTHS", help="integer inputs hold the ids of packed documents of these "
                   "lengths, the same in every row: N, or N1,N2,... cut at each length (default: about 4 random)")
    p.add_argument("--reps", type=positive_int, help="CPU smoke: timed repetitions (default 2)")
    p.add_argument("--out", default="bench/results", metavar="DIR",
                   help="where the JSON and markdown go (default bench/results)")


def register_cli(subparsers) -> None:
    p = subparsers.add_parser("bench", help="time a compiled diagram against SDPA and FlexAttention")
    add_arguments(p)
    p.set_defaults(func=lambda args: run(args, "napkin bench"))


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m napkin.bench``: the same command without the napkin CLI."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        return run(args, "python -m napkin.bench")
    except NapkinError as err:
        print(str(err), file=sys.stderr)
        return 1


def command_line(args, prog: str) -> str:
    """The command that reproduces this run: the files and every flag that
    differs from its default, in a fixed order (recorded with the results)."""
    parts = [prog] + list(args.files)
    defaults = vars(build_parser().parse_args(list(args.files)))
    for key, value in vars(args).items():
        if key in ("files", "func", "command") or value == defaults.get(key, value) or key not in defaults:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            parts.append(flag)
        elif isinstance(value, list):
            parts += [f"{flag} {v}" for v in value]
        else:
            parts.append(f"{flag} {value}")
    return " ".join(parts)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m napkin.bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return parser


def parse_list(text: Optional[str], what: str, kind=int, least: int = 1) -> Optional[list]:
    """"1K,4K,16384" -> [1024, 4096, 16384]; None stays None.  ``least``: the
    smallest number taken (bench/decode.py's chunk 0 is no chunking)."""
    if text is None:
        return None
    out = []
    for item in text.split(","):
        item = item.strip()
        if kind is int:
            scale = 1024 if item[-1:] in "kK" and item[:-1].isdigit() else 1
            digits = item[:-1] if scale > 1 else item
            if not digits.isdigit() or int(digits) < least:
                raise NapkinError(f"--{what} expects {'positive ' if least > 0 else ''}whole numbers (1K = 1024), "
                                  f"not {item!r}")
            out.append(int(digits) * scale)
        else:
            if item not in TOLERANCE:
                raise NapkinError(f"--{what}: {item!r} is not one of {', '.join(TOLERANCE)}")
            out.append(item)
    return out


# --------------------------------------------------------------------------
# The run.
# --------------------------------------------------------------------------

def run(args, prog: str) -> int:
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        # Triton reads this when first imported: the generated modules import it.
        os.environ.setdefault("TRITON_INTERPRET", "1")
        # Eager FlexAttention is what a CPU smoke run means to use: no need to say so per call.
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    preset = PRESETS[args.preset]
    seqlens = parse_list(args.seqlen, "seqlen") or preset["seqlen"]
    dtypes = parse_list(args.dtype, "dtype", str) or preset["dtype"]
    head_dims = parse_list(args.head_dim, "head-dim") or preset["head_dim"] or [None]
    grid = {"seqlens": seqlens, "batch": parse_list(args.batch, "batch"), "heads": parse_list(args.heads, "heads"),
            "group": args.group or preset["group"], "extra": parse_pairs(args.size, "--size"), "preset": preset,
            "docs": Documents.parse(args.docs) if args.docs is not None else None}
    reps = args.reps or preset["reps"] or 2
    device = "cuda" if cuda else "cpu"
    if args.autotune and not cuda:   # a run's record says "no tuning" per row; say so once, up front
        print("napkin bench: --autotune tunes on a GPU only: this CPU run takes the cached or the schedule's "
              "configs", file=sys.stderr)
    if args.tune_budget is not None and not args.tune_budget > 0:
        raise NapkinError(f"--tune-budget expects a positive number of seconds, not {args.tune_budget}")
    if Path(args.out).exists() and not Path(args.out).is_dir():   # found now, not after an hour's run
        raise NapkinError(f"--out {args.out} is a file: the results need a folder")
    blocked = next((p for p in Path(args.out).parents if p.exists() and not p.is_dir()), None)
    if blocked is not None:   # --out afile/sub was refused only after the run
        raise NapkinError(f"--out {args.out}: {blocked} is a file, not a folder")
    cache = tunecache.Cache()
    # only where it tunes: a CPU run stores nothing, and refusing its unwritable cache stopped the
    # run just said to go on with the cached configs
    why = cache.unwritable() if args.autotune and cuda else None
    if why:   # the launcher reads what the tuner writes: a tuning it cannot store is lost
        raise NapkinError(f"--autotune stores its configs in {cache.path}, which napkin cannot write ({why}): "
                          "point NAPKIN_CACHE at a folder it can")
    points = len(args.files) * len(dtypes) * len(head_dims) * len(seqlens) \
        * len(grid["batch"] or [1]) * len(grid["heads"] or [1])
    grid["tune_share"] = TuneShare(time_limit(args), points, 1 if args.no_backward else 3, fixed=args.tune_budget)
    rows, failed, paths = [], False, None
    command = command_line(args, prog)
    # the day the run began, once: a run across midnight named its files by the first
    # write's date and titled them with the last's (an H100 run of 2026-11-27/28)
    today = datetime.date.today().isoformat()
    variants = [(path, dtype, head_dim) for path in args.files for dtype in dtypes for head_dim in head_dims]
    with tempfile.TemporaryDirectory(prefix="napkin-bench-") as build:
        for done, (path, dtype, head_dim) in enumerate(variants, 1):
            # One diagram napkin cannot compile (or that is no attention)
            # must not cost the rest of a long GPU run: say so, go on.
            try:
                rows += _bench_variant(path, dtype, head_dim, grid, device, args, reps, Path(build))
            except NapkinError as err:
                print(str(err), file=sys.stderr)
                failed = True
            # a variant that stopped early leaves its points' time to the rest
            grid["tune_share"].passed(done * points // len(variants))
            if rows and done < len(variants):
                # what is measured so far, rewritten after each: a run stopped at a
                # GPU session's time limit keeps it (the last write drops the mark)
                partial = _record(rows, command, device, reps, today) \
                    | {"partial": f"written after {done} of {len(variants)} diagram/dtype/head-dim variants"}
                paths = _write(partial, args.out, paths)
    if not rows:
        return 1
    data = _record(rows, command, device, reps, today)
    json_path, md_path = _write(data, args.out, paths)
    print(results.markdown(data))
    print(f"wrote {json_path} and {md_path}")
    return 0 if not failed and all(r["check"]["ok"] for r in rows) else 1


def _write(data: dict, out: str, paths):
    try:
        return results.write(data, out, paths)
    except OSError as err:   # a folder made unwritable, a full disk
        raise NapkinError(f"cannot write the results under {out}: {why_not(err, Path(out) / 'x')}") from None


def _record(rows: list[dict], command: str, device: str, reps: int, date: str) -> dict:
    import torch
    import triton

    from .. import __version__

    if device == "cuda":
        name = torch.cuda.get_device_name()
        cap = ".".join(map(str, torch.cuda.get_device_capability()))
        timing = (f"triton.testing.do_bench median (CUDA events) after {DO_BENCH['warmup']} ms warm-up, "
                  f"over {DO_BENCH['rep']} ms")
    else:
        name, cap = "cpu", ""
        timing = (f"CPU smoke run: wall-clock median of {reps} calls after one warm-up, napkin under "
                  "TRITON_INTERPRET=1 and eager FlexAttention; NOT a performance number")
    return {
        "schema": results.SCHEMA, "smoke": device != "cuda", "timing": timing,
        "date": date, "command": command,
        "flop_convention": FLOP_CONVENTION,
        "device": {"name": name, "kind": device, "capability": cap},
        "versions": {"napkin": __version__, "torch": torch.__version__, "triton": triton.__version__,
                     "python": platform.python_version()},
        "rows": rows,
    }


# --------------------------------------------------------------------------
# One diagram variant: compile it once, then every size point.
# --------------------------------------------------------------------------

def variant(diagram: ir.Diagram, text: str, dtype: str, head_dim: Optional[int]) -> tuple[ir.Diagram, str]:
    """The diagram with fp16/bf16 declarations set to ``dtype`` and its head
    dims (the score's contracted wire and V's feature wire, fixed or
    symbolic: a symbolic one is fixed there, so that |d|^-0.5 is a constant
    FlexAttention takes as its scale) set to ``head_dim``; the file's own
    text when nothing changes.  Other fixed wires keep their sizes: a
    window's |w| or a fixed group is no head dim.  (A symbolic head dim was
    left alone: --head-dim 16,64 -D d=32 gave two rows, both at 32.)"""
    import napkin
    from ..printer import to_text

    want = NAPKIN_DTYPE[dtype]

    def retype(t):
        return replace(t, dtype=want) if t.dtype in ("fp16", "bf16") else t

    try:
        roles = flex.attention_roles(diagram)
        dims = {roles.dim, roles.vdim}
    except flex.NoFlexEquivalent:   # no attention (the AOT report's matmul): every fixed wire, as before
        dims = {w.name for w in diagram.wires if w.size is not None}
    wires = tuple(replace(w, size=head_dim) if head_dim and w.name in dims else w for w in diagram.wires)
    changed = replace(diagram, wires=wires, inputs=tuple(map(retype, diagram.inputs)),
                      lets=tuple(map(retype, diagram.lets)))
    if changed == diagram:
        return diagram, text
    changed = _fit_blocks(changed)
    new_text = to_text(changed)
    return napkin.load_text(new_text, f"{diagram.name} ({dtype}, head dim = {head_dim})"), new_text


def _fit_blocks(d: ir.Diagram) -> ir.Diagram:
    """A larger head dim or dtype can overflow shared memory with the
    schedule's blocks (d = 256 with q by 128): halve the largest on-chip block
    until the tiles fit, as a user would edit the schedule."""
    from .. import tiling
    from ..cost import with_blocks

    capacity = tiling.level_capacity(d, "smem")
    blocks = {w: b for w, b in autotune.tiled_blocks(d).items()}
    while capacity is not None and blocks:
        try:
            used = sum(b for _, _, b in tiling.level_footprint(d, "smem", {}))
        except tiling.UnboundWire:
            return d                      # a footprint that depends on call-time sizes: leave it
        wire = max(blocks, key=lambda w: (blocks[w], -list(blocks).index(w)))
        if used <= capacity or blocks[wire] <= 16:
            return d
        blocks[wire] //= 2
        d = with_blocks(d, blocks)
    return d


def compile_module(diagram: ir.Diagram, text: str, path: str, build: Path, prefix: str = "napkin_bench"):
    """(the generated module of ``diagram``, imported from ``build``; its
    source hash).  One module per prefix and source text in a process."""
    from ..codegen import emit_module

    source = emit_module(diagram, source_text=text, source_path=path)
    digest = tunecache.diagram_hash(text)
    name = f"{prefix}_{diagram.name}_{digest[:12]}"
    if name in sys.modules:
        return sys.modules[name], digest
    target = build / f"{name}.py"
    try:
        target.write_text(source, encoding="utf-8")
    except OSError as err:   # a full /tmp read as "cannot write the output", naming nothing
        raise NapkinError(f"cannot write the benchmark's module {target}: {why_not(err, target)}") from None
    spec = importlib.util.spec_from_file_location(name, target)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module      # Triton's JIT looks the kernel's source up through it
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)  # a module that failed to import is not reused
        raise
    return module, digest


def run_dtype(diagram: ir.Diagram, dtype: str) -> str:
    """The dtype a run of ``diagram`` computes in: --dtype's, which its 16-bit
    float declarations take, or float32 for a diagram declaring none (--dtype
    changes nothing there: its rows were labelled float16 and checked at
    float16's tolerance)."""
    floats = [t.dtype for t in diagram.inputs if t.dtype in ir.FLOAT_DTYPES]
    return dtype if not floats or any(f in ("fp16", "bf16") for f in floats) else "float32"


def _bench_variant(path, dtype, head_dim, grid, device, args, reps, build) -> list[dict]:
    import napkin

    source = napkin.read_source(path)
    diagram = napkin.load_text(source, str(path))
    try:   # the variant's roles too: it changes sizes and dtypes, not which wire plays which part
        roles = flex.attention_roles(diagram)
    except flex.NoFlexEquivalent as err:
        raise NapkinError(f"napkin bench compares attention diagrams ({err.why})", filename=str(path)) from None
    dtype = run_dtype(diagram, dtype)
    seen = grid.setdefault("seen", set())
    if (str(path), dtype, head_dim) in seen:   # another --dtype of a float32 diagram: the same run
        return []
    seen.add((str(path), dtype, head_dim))
    base = variant(diagram, source, dtype, head_dim)
    try:
        module, digest = compile_module(*base, path, build)
    except NapkinError:
        if base[1] != source:   # the variant is re-printed text: where it can, say where in the user's file
            from ..codegen import emit_module

            emit_module(diagram, source_text=source, source_path=str(path))
        raise
    try:
        flex_module, flex_why = flex.load(base[0]), None
    except flex.NoFlexEquivalent as err:
        flex_module, flex_why = None, err.why
    if grid["docs"] is not None and not any(t.dtype in ir.NUMBER_INT_DTYPES for t in diagram.inputs):
        raise NapkinError(f"--docs: diagram {diagram.name} has no integer input to hold document ids",
                          filename=str(path))
    ctx = {"path": path, "diagram": base[0], "module": module, "digest": digest, "dtype": dtype,
           "flex": flex_module, "flex_why": flex_why, "device": device, "reps": reps, "args": args,
           "docs": grid["docs"]}
    rows = []
    check_extra_sizes(base[0], grid["extra"], str(path))
    for sizes in point_sizes(base[0], roles, grid):
        rows.append(_bench_point(ctx | {"tune_budget": grid["tune_share"].next()}, sizes))
    return rows


def point_sizes(diagram: ir.Diagram, roles, grid: dict) -> list[dict[str, int]]:
    """One {wire: size} per grid point, in a fixed order."""
    preset = grid["preset"]
    out = []
    head_dim = diagram.wire(roles.dim).size or 64
    for n in grid["seqlens"]:
        batches = grid["batch"] or preset.get("batch") or [max(1, preset["tokens"] // n)]
        heads_list = grid["heads"] or preset.get("heads") or [max(1, preset["hidden"] // head_dim)]
        for batch in batches:
            for heads in heads_list:
                sizes = {roles.row: n, roles.key: n}
                if roles.batch:
                    sizes[roles.batch] = batch
                if roles.group is not None:   # GQA: hk = heads / g
                    fixed_g = diagram.wire(roles.group).size   # the diagram's own group, else --group
                    g = fixed_g or grid["group"]
                    if heads % g:
                        raise NapkinError(f"--heads {heads} is not a multiple of "
                                          + (f"the diagram's group, wire {roles.group} = {g}" if fixed_g
                                             else f"--group {g}") + " (GQA)")
                    sizes[roles.kv_head], sizes[roles.group] = heads // g, g
                elif roles.head:   # one head wire (multi-query: Q's alone, one kv head)
                    sizes[roles.head[0]] = heads
                for w in (roles.batch, *(roles.head or ())):   # a fixed wire is not the grid's to set
                    fixed = diagram.wire(w).size if w else None
                    if fixed is not None and sizes.get(w, fixed) != fixed:
                        flag = "--batch" if w == roles.batch else "--heads"
                        raise NapkinError(f"{flag} asks {sizes[w]} of wire {w}, which diagram {diagram.name} "
                                          f"fixes at {fixed}")
                sizes = ir.coarse_sizes(diagram, {**sizes, **grid["extra"]})   # qb of keep[.., q // 64, ..]
                missing = [w.name for w in diagram.wires if w.size is None and w.name not in sizes]
                if missing:
                    hint = " (or --head-dim N)" if missing[0] in (roles.dim, roles.vdim) else ""
                    raise NapkinError(f"diagram {diagram.name}: no size for wire {missing[0]}; "
                                      f"pass --size {missing[0]}=N{hint}")
                out.append({w.name: sizes[w.name] for w in diagram.wires if w.size is None})
    return out


def check_extra_sizes(diagram: ir.Diagram, extra: dict[str, int], path: str) -> None:
    """--size's wires must be wires of the diagram, a fixed one at its own size
    (as cost, render and demo hold -D)."""
    for w, n in extra.items():
        if diagram.wire(w) is None:
            raise NapkinError(f"--size {w}={n}: diagram {diagram.name} has no wire {w} "
                              f"(its wires: {', '.join(x.name for x in diagram.wires)})", filename=path)
        fixed = diagram.wire(w).size
        if fixed is not None and fixed != n:
            raise NapkinError(f"--size {w}={n}: wire {w} of diagram {diagram.name} is fixed at {fixed} "
                              "(--head-dim sets the fixed head dims)", filename=path)


# --------------------------------------------------------------------------
# One grid point.
# --------------------------------------------------------------------------

def _bench_point(ctx: dict, sizes: dict[str, int]) -> dict:
    d, module, device, dtype = ctx["diagram"], ctx["module"], ctx["device"], ctx["dtype"]
    shape = flex.attention_shape(d, sizes)
    shape.update(dtype=dtype, inputs=[t.name for t in d.inputs])
    launcher = getattr(module, d.name)
    tuning: dict = {}
    clock = [time.monotonic()]
    config, source = _choose_config(ctx, sizes, launcher, tuning=tuning)
    bwd_config, bwd_source = {}, {}
    for kernel, kind in BACKWARD_KINDS.items():
        bwd_config[kernel], bwd_source[kernel] = (None, "not run") if ctx["args"].no_backward else \
            _choose_config(ctx, sizes, launcher, kind=kind, tuning=tuning)
    cached = uses_mask_cache(launcher, module)
    impls = [baselines.Baseline("napkin", True, "the generated Triton kernel", _napkin_prepare(launcher, cached),
                                scope=overlap.serial(module))]
    if ctx["flex"] is not None:
        impls.append(baselines.flex_baseline(ctx["flex"], compiled=device == "cuda"))
    impls += baselines.sdpa_baselines(ctx["flex"], shape, device)

    clock.append(time.monotonic())
    check = checks.check(module, d, impls, sizes, dtype, device, backward=not ctx["args"].no_backward,
                         docs=ctx["docs"])
    if overlap.applies(module, device) and not ctx["args"].no_backward and check["ok"]:
        impls.insert(1, overlap.baseline(module, _napkin_prepare(launcher, cached)))  # its forward is napkin's
    clock.append(time.monotonic())
    out: list[dict] = []
    if ctx["flex"] is None:
        out.append(_result("flex", "fwd", False, "FlexAttention", error=f"no FlexAttention equivalent: "
                                                                       f"{ctx['flex_why']}"))
    full = reference.example_inputs(d, sizes, device=device, seed=0, docs=ctx["docs"])
    # The diagram's FLOPs: x0.5 for an exact causal mask (the usual
    # convention), x the pairs any other mask keeps on these inputs (counted
    # with FlexAttention's mask_mod: a window of 256 in 16K keeps 1.6%, and
    # counting it dense gave 11,000 "TFLOP/s"); a speed reference (†) counts
    # its own plain attention, causal where it ran causal.
    masked = ctx["flex"] is not None and ctx["flex"].FLEX_SOURCE.mask is not None
    # half the square is causal's share only where queries and keys are as many: else the pairs
    # it keeps (x = 256 keys for 64 queries keep 12.7%, not 50%)
    square = shape["q_len"] == shape["kv_len"]
    halved = shape["causal"] and square
    visible = ctx["flex"].visible(*full) if masked and not halved else None
    flops = results.attention_flops(shape, halved, visible)
    # the speed reference runs top-left is_causal where the mask has a causal part: half the square
    # only where queries and keys are as many, as above, else the pairs it keeps
    kept = results.top_left_causal(shape["q_len"], shape["kv_len"]) if shape["causal_part"] and not square else None
    own_flops = results.attention_flops(shape, shape["causal_part"] and square, kept)
    first = {}
    tma = bwd_tma = None
    for impl in impls:
        failed = check["errors"].get(impl.name, {}).get("error") if impl.equivalent else None
        if failed:
            out.append(_result(impl.name, "fwd", impl.equivalent, impl.note, error=f"not timed: {failed}"))
            continue
        counted = flops if impl.equivalent else own_flops
        with impl.scope():
            if "fwd" in impl.passes:
                out.append(_time_forward(impl, full, shape, device, ctx["reps"], counted["fwd"], first))
            if impl.name == "napkin" and isinstance(getattr(module, "_tma_last", None), dict):
                tma = dict(module._tma_last)   # how the timed forward moved its tiles (tma= may fall back)
            wrong = check.get("backward", {}).get("errors", {}).get(impl.name, {}).get("error")
            if wrong and "bwd" in impl.passes:
                out.append(_result(impl.name, "bwd", impl.equivalent, impl.note, error=f"not timed: {wrong}"))
            elif not ctx["args"].no_backward and "bwd" in impl.passes:
                out.append(_time_backward(impl, full, shape, device, ctx["reps"], counted["bwd"]))
                if impl.name == "napkin":   # the same of the timed backward's dQ and dK/dV kernels
                    bwd_tma = {k: dict(getattr(module, f"_tma_last_{k}")) for k in BACKWARD_KINDS
                               if isinstance(getattr(module, f"_tma_last_{k}", None), dict)} or None
    full_size_check(check, first, d, dtype)
    prepass = ranges_prepass.timed(module, d, full, shape, lambda fn: _ms(fn, device, ctx["reps"]),
                                   not ctx["args"].no_backward)
    clock.append(time.monotonic())
    # where a point's time went (FlexAttention's compiles fall in check and time):
    # what the next GPU session corrects STARTUP_S and POINT_S by
    seconds = {k: round(b - a, 1) for k, a, b in zip(("tune", "check", "time"), clock, clock[1:])}
    budget = f" (tuning budget {ctx['tune_budget']} s a kernel)" if ctx["args"].autotune and device == "cuda" else ""
    print(f"napkin bench: {d.name} {dtype} {sizes}: " + ", ".join(f"{k} {v} s" for k, v in seconds.items())
          + budget, file=sys.stderr)
    return {
        "diagram": d.name, "file": str(ctx["path"]), "source_hash": ctx["digest"], "dtype": dtype,
        "sizes": sizes, "shape": {k: shape[k] for k in ("batch", "heads", "kv_heads", "q_len", "kv_len",
                                                         "dim", "value_dim")},
        "causal": shape["causal"], "flops": flops, "visible": visible, "config": config, "config_source": source,
        "bwd_config": bwd_config, "bwd_config_source": bwd_source, "tuning": tuning, "tma": tma, "bwd_tma": bwd_tma,
        "check": check, "results": out, "ratios": results.ratios(out), "seconds": seconds,
        "prepass": prepass, "predicted": predicted.predict(d, sizes, tunecache.device_name(device), config,
                                                           ctx["docs"], not ctx["args"].no_backward, bool(cached)),
        # napkin's timed calls reused the prepass results (a warm mask_cache): the prepass is outside
        # its timed region, as Flex's create_block_mask is outside Flex's; None: no prepass
        "mask_cache": True if cached else None,
    }


def _napkin_prepare(launcher, cached: bool = False):
    """The napkin row's call.  A tuned config is not passed: the launcher
    reads the cache itself (_choose_config checked it finds the same
    entries), the forward its own config and each backward kernel, through
    autograd, its own; options passed here would bind every kernel to them.

    A diagram whose mask reads data (a ranges prepass, ranges_prepass.py)
    gets a fresh mask_cache dict per prepare, that is per set of inputs (the
    check's may hold other document ids than the timed ones): the first call
    (the check's, or the timing's warm-up: do_bench's, the CPU smoke run's
    one call) fills it, forward and, through autograd, backward, so the timed
    calls run no prepass, as FlexAttention's BlockMask is built in its
    prepare, outside its timed region.  The prepass is timed alone in the
    row's "prepass" record.  ``cached``: uses_mask_cache's answer, asked
    once a point."""
    def prepare(inputs, shape, device, grad=False):
        kw = {"mask_cache": {}} if cached else {}

        def go():
            got = launcher(*inputs, **kw)
            return got if isinstance(got, tuple) else (got,)
        return go

    return prepare


def uses_mask_cache(launcher, module) -> bool:
    """Whether the napkin row passes mask_cache= (_napkin_prepare): its
    diagram runs a ranges prepass and its launcher takes the option."""
    import inspect

    name = getattr(launcher, "__name__", "")
    return (module is not None and ranges_prepass.has_prepass(module, name)
            and "mask_cache" in inspect.signature(launcher).parameters)


# The backward's kernels, each tuned and cached on its own (its cache kind):
# they hold other tiles than the forward's, dK/dV the transpose of dQ's.
BACKWARD_KINDS = {role: kind for kind, role in autotune.KIND_ROLES.items()}


TUNED_KERNELS = {"": "fwd", **autotune.KIND_ROLES}   # cache kind -> its key in a row's "tuning"


def _choose_config(ctx: dict, sizes: dict, launcher, kind: str = "",
                   tuning: Optional[dict] = None) -> tuple[Optional[dict], str]:
    """(launcher options, where they came from) for the forward (kind "") or
    one backward kernel (BACKWARD_KINDS).  Only options the launcher takes
    are kept (a config tuned for another module version may carry more).
    ``tuning`` gets, under the kernel's name, how its tuning went: the
    candidates, how many were timed, failed and skipped for the budget
    (from the cache entry when it was tuned before)."""
    import torch

    d, device = ctx["diagram"], ctx["device"]
    accepted = set(inspect.signature(launcher).parameters)
    classes = tunecache.input_classes(d)   # the bench passes every input in its declared dtype
    launch_classes = {k: getattr(torch, v) for k, v in classes.items()}   # as the launcher's _bind finds them
    if device != "cuda":
        # no tuning here, but a launch takes what the cache holds for "cpu": say so
        seen = ctx["module"]._autotune_lookup(sizes, device, launch_classes, kind)
        if seen:
            return {k: v for k, v in seen.items() if k in accepted}, "cache (CPU smoke run: no tuning)"
        return None, "schedule (CPU smoke run: no tuning)"
    key = tunecache.cache_key(ctx["digest"], tunecache.device_name(device), classes, sizes,
                             tunecache.symbolic_wires(d), kind)
    cache = tunecache.Cache()
    if ctx["args"].autotune:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        capacity = getattr(props, "shared_memory_per_block_optin", None)
        configs, _ = autotune.candidates(d, sizes, kind=kind, lead=untuned(d, sizes, kind), capacity=capacity)
        inputs = reference.example_inputs(d, sizes, device=device, seed=0, docs=ctx["docs"])
        call = backward_call(d, ctx["module"], inputs, sizes, accepted, kind) if kind else \
            (lambda **options: launcher(*inputs, **{k: v for k, v in options.items() if k in accepted}))
        tuned = autotune.autotune(call, configs, _cuda_ms, cache=cache, key=key, budget_s=ctx.get("tune_budget"),
                                  diagram=d.name, sizes=sizes, **({"pass": kind} if kind else {}))
        config, source = tuned.best.kwargs(), ("cache" if tuned.cached else "autotune")
        if tuning is not None:
            # every trial's time too: what the next session orders its candidates by
            tuning[TUNED_KERNELS[kind]] = _tuning_facts(cache.entries().get(key, {})) if tuned.cached \
                else tuning_record(tuned)
    else:
        hit = cache.get(key)
        if hit is None:
            return None, "schedule"
        config, source = hit.kwargs(), "cache"
        if tuning is not None:
            tuning[TUNED_KERNELS[kind]] = _tuning_facts(cache.entries().get(key, {}))
    config = {k: v for k, v in config.items() if k in accepted}
    seen = ctx["module"]._autotune_lookup(sizes, device, launch_classes, kind)
    if seen is None or {k: v for k, v in seen.items() if k in accepted} != config:
        raise NapkinError(f"the launcher of {d.name} would not read the config tuned for it ({key}): it finds "
                          f"{seen}; is NAPKIN_CACHE the same for both?")
    return config, source


def tuning_record(tuned: autotune.Tuned) -> dict:
    """A row's record of a tuning run here: its counts, and each trial's
    config and time (or error) in order, from which a later session can
    order its candidates without a GPU (the cache keeps only the best)."""
    trials = [{"config": t.config.kwargs(), "ms": t.ms, "error": t.error} for t in tuned.trials]
    return tuned.facts() | {"trials": trials}


def _tuning_facts(entry: dict) -> dict:
    """A cache entry's record of its tuning (older entries lack some: None)."""
    keys = ("candidates", "timed", "failed", "skipped", "budget_s", "truncated")
    return {"from_cache": True, **{k: entry.get(k) for k in keys}}


def untuned(d: ir.Diagram, sizes: dict, kind: str) -> list:
    """The launch a kernel gets untuned, the lead of its candidates so that
    tuning never ends worse than not tuning: dQ and dK/dV their own default
    tiles (``_backward_default``); the forward, and a backward without such
    a rule (a matrix product's), the schedule's blocks with the launchers'
    defaults (8 warps from 128 rows, else 4; 2 stages: emit.py and
    training.py.jinja)."""
    lead = _backward_default(d, sizes, kind) if kind else []
    if lead:
        return lead
    from ..codegen import lower

    blocks = autotune.tiled_blocks(d)
    plan = lower.streamed_attention(d)
    if plan is not None and plan.pack is not None:   # packed rows: the launcher's block_q is the (g, q) pairs'
        blocks = dict(plan.blocks)
    if len(blocks) != 2:
        return []
    rows = next(iter(blocks.values()))
    return [tunecache.Config(tuple(blocks.items()), 8 if rows >= 128 else 4, 2)]


def _backward_default(d: ir.Diagram, sizes: dict, kind: str) -> list:
    """The launch a backward kernel gets untuned, as candidates (2 and 3
    stages): dQ the schedule's blocks, its keys halved while they would not
    fit the registers (backward_hold.dq_default_tile), dK/dV its own default
    tile (backward_hold.dkdv_default_tile)."""
    from ..codegen import lower, training
    from ..codegen.backward_hold import DEFAULT_TILE

    plan = training.prepare(lower.lower(d)).backward
    if plan is None:
        return []
    br, bc, warps = DEFAULT_TILE[autotune.KIND_ROLES[kind]](plan, reference.full_sizes(d, sizes))
    blocks = ((plan.row, br), (plan.col, bc))
    return [tunecache.Config(blocks, warps, stages) for stages in (2, 3)]


def backward_call(d: ir.Diagram, module, inputs, sizes, accepted, kind: str):
    """A function of launcher options that runs one backward kernel: the
    per-row values, then the gradient of the first output with respect to Q
    alone (kind "bwd": the dQ kernel) or to K and V (kind "bwd_kv": dK/dV).

    The forward runs once, at its own launch (no options: its tuned entry or
    the schedule's), through the module's forward op, which also returns the
    row state it saves for training.  Each call then runs the module's own
    backward entry (``_NAME_grads``, what the autograd op calls) with the
    options given.  Through autograd the options would reach the forward
    too, compiling a useless forward at every dK/dV tile (and a forward
    that failed there would fail the candidate)."""
    import torch

    shape = flex.attention_shape(d, sizes)
    names = [t.name for t in d.inputs]
    v_name = shape["operands"][-1]
    need = sum(1 << names.index(n) for n in {"bwd": shape["queries"], "bwd_kv": shape["keys"] + [v_name]}[kind])
    grads_of = getattr(module, f"_{d.name}_grads")
    with torch.no_grad():
        outs = getattr(torch.ops.napkin, module._FWD_OP)(*inputs, *(None for _ in module._OPTIONS))
    outs = tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
    # the attention output (the one with a feature wire), wherever the diagram lists it (out lse, O)
    first = max(range(len(module.OUTPUTS)), key=lambda i: outs[i].dim())
    upstream = [torch.randn_like(o) if i == first else torch.zeros_like(o)
                for i, o in enumerate(outs[:len(module.OUTPUTS)])]

    def call(**options):
        o = tuple(options.get(k) if k in accepted else None for k in module._OPTIONS)
        return tuple(g for g in grads_of(tuple(inputs), outs, upstream, o, need) if g is not None)

    return call
