"""The host's time per launch: what a generated launcher does in Python before
its kernels start (check and bind the inputs, read the tuned config, allocate
the outputs, work out strides and grid), with every Triton kernel of the
module replaced by a stub that only counts its launches.  Triton's own launch
is not in it (bench/decode.py's host column has that, on a GPU); with
--triton (no GPU) Triton's part up to its C launcher is, the kernels compiled
for sm_90 once and never run.

A decode step's kernels take microseconds on an H100 (an 8K cache of 8 kv
heads, d 128, bf16, is 33.5 MB: 10 us at 3.35 TB/s), so this part of a
launch can be what a step costs when it is not captured in a CUDA graph.

    python bench/launch_overhead.py [--calls 2000] [--out DIR] [--triton] [--backward | --new-shapes | --lengths] [NAME ...]

NAME: generated modules (default: flash_decoding, attention, causal, gqa,
sliding_window, alibi), called on decode-shaped inputs (one query row per head
against a 4K cache) on the CPU (under TRITON_INTERPRET=1, the stubs run no
kernel) or on the GPU when there is one.  Prints a table and, with --out,
writes launch-overhead-DEVICE-DATE.md there.  The times are this machine's
Python: compare them with each other, and on another machine measure again.

--backward times a training step's backward instead: torch.autograd.grad
through the module's torch op (autograd's engine, the op's dispatch, the
row-values launcher and the dQ and dK/dV launchers), on small training-shaped
inputs (TRAIN_SIZES) whose float inputs require gradients.  A short
backward's kernels wait for all of this before the first of them starts
(docs/bench.md, "The host's time per launch").
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import importlib
import itertools
import os
import platform
import re
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

DEFAULT = ("flash_decoding", "attention", "causal", "gqa", "sliding_window", "alibi")
# decode-shaped sizes: every symbolic wire a diagram may have
SIZES = {"b": 1, "h": 8, "hk": 8, "g": 4, "q": 1, "x": 4096, "d": 128}
# --backward: a short training shape (the host's work does not grow with it; on the CPU
# larger stubbed outputs would time the allocator's page mapping instead)
TRAIN_SIZES = {**SIZES, "q": 256, "x": 256}


class Stub:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` counts a launch."""

    def __init__(self):
        self.launches = 0

    def __getitem__(self, grid):
        return self._launch

    def _launch(self, *args, **kwargs):
        self.launches += 1


@contextlib.contextmanager
def stubbed(module):
    """Every Triton kernel the module launches from the host (the jitted
    functions named ``_..._kernel`` or ``_..._merge``) replaced by a Stub,
    for the ``with`` block: yields {name: Stub}."""
    kernels = {name: value for name, value in vars(module).items()
               # a JITFunction, or under TRITON_INTERPRET=1 an InterpretedFunction: both wrap .fn
               if re.fullmatch(r"_\w+_(kernel|merge)", name) and callable(getattr(value, "fn", None))}
    if not kernels:
        raise SystemExit(f"bench/launch_overhead.py: {module.__name__} has no kernels to stub")
    stubs = {name: Stub() for name in kernels}
    try:
        for name, stub in stubs.items():
            setattr(module, name, stub)
        yield lambda: {k: s.launches for k, s in stubs.items()}
    finally:
        for name, kernel in kernels.items():
            setattr(module, name, kernel)


@contextlib.contextmanager
def hopper(module):
    """Triton's launch path as far as its C launcher: each kernel compiled
    once for sm_90 (napkin.bench.aot's stand-in GPU, no GPU needed), then on
    every launch Triton's argument binder, cache key and lookup; nothing
    runs.  Needs a process whose Triton was imported without
    TRITON_INTERPRET.  Yields launch counts like ``stubbed``."""
    from napkin.bench import aot

    check = module._check_device
    module._check_device = lambda device: None   # CPU tensors without the interpreter: nothing runs
    try:
        with aot._compiling_for(90) as compiled:
            yield lambda: dict(collections.Counter(name for name, _ in compiled))
    finally:
        module._check_device = check


# What a module remembers per signature (the forward's launch plans, the bindings, the tuned
# configs looked up): --new-shapes clears them before each timed run, so every call is a first.
MEMOS = ("_LAUNCH_PLANS", "_BIND_MEMO", "_autotune_memo")


def growing(module, sizes: dict, dtype, device: str, calls: int) -> list[list]:
    """Inputs for ``calls`` calls, the i-th with |x| + i keys: views of one
    cache of |x| + ``calls`` rows narrowed along x, as a decode loop reads
    its preallocated cache (the whole cache's strides, a new shape a step)."""
    big = module.example_inputs(dict(sizes, x=sizes["x"] + calls), dtype=dtype, device=device, seed=0)
    dims = {n: next((i for i, axis in enumerate(module._LAYOUTS[n]) if axis == ("x",)), None) for n in module.INPUTS}
    return [[t if dims[n] is None else t.narrow(dims[n], 0, sizes["x"] + i) for n, t in zip(module.INPUTS, big)]
            for i in range(calls)]


def measure(name: str, calls: int, device: str, triton: bool = False, backward: bool = False,
            new_shapes: bool = False, lengths: bool = False) -> dict:
    """Microseconds per call of the module's launcher (forward, no gradient;
    with ``backward`` its backward through autograd), median of 5 runs of
    ``calls`` calls, and the kernels each call launches: kernels stubbed, or
    with ``triton`` Triton's own launch path (hopper).  ``new_shapes``: each
    call of a run a new cache length (``growing``), nothing remembered from
    the run before.  ``lengths``: each call the whole preallocated cache of
    |x| + ``calls`` rows with ``lengths={"x": |x| + i}`` (a decode loop that
    passes its cache's length instead of narrowing it), the memos kept, as
    a loop keeps them."""
    import torch

    module = importlib.import_module(f"generated.{name}")
    table = TRAIN_SIZES if backward else SIZES
    sizes = {w: table[w] for w, n in module.WIRES.items() if n is None}
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    inputs = module.example_inputs(sizes, dtype=dtype, device=device, seed=0)
    launch = getattr(module, name)
    fresh = growing(module, sizes, dtype, device, calls) if new_shapes else None
    if lengths:   # one cache for every call, its rows past the call's length padding
        cache = module.example_inputs(dict(sizes, x=sizes["x"] + calls), dtype=dtype, device=device, seed=0)
        fresh = [{"x": sizes["x"] + i} for i in range(calls)]
    with contextlib.ExitStack() as stack:
        launches = stack.enter_context((hopper if triton else stubbed)(module))
        if new_shapes:
            stack.enter_context(torch.no_grad())

            def call():
                launch(*next(turn))
        elif lengths:
            stack.enter_context(torch.no_grad())

            def call():
                launch(*cache, lengths=next(turn))
        elif backward:
            leaves = [t.requires_grad_() for t in inputs if t.is_floating_point()]
            out = launch(*inputs)
            out = out[0] if isinstance(out, tuple) else out
            upstream = torch.randn_like(out)
            launches()   # the forward's launches: not counted below

            def call():
                torch.autograd.grad(out, leaves, upstream, retain_graph=True)
        else:
            stack.enter_context(torch.no_grad())

            def call():
                launch(*inputs)
        before = launches()
        if new_shapes or lengths:
            turn = itertools.cycle(fresh)   # the warm-up's 50 calls: round the lengths
        for _ in range(50):
            call()
        counts = {k: v - before.get(k, 0) for k, v in launches().items()}
        runs = []
        for _ in range(5):
            if new_shapes:
                for memo in MEMOS:
                    getattr(module, memo, {}).clear()
            if new_shapes or lengths:
                turn = iter(fresh)
            t0 = time.perf_counter()
            for _ in range(calls):
                call()
            runs.append((time.perf_counter() - t0) / calls * 1e6)
    runs.sort()
    per_call = {k: v // 50 for k, v in counts.items() if v}
    return {"name": name, "us": runs[2], "launches": per_call,
            "sizes": ", ".join(f"{w}={n}" for w, n in sizes.items())}


def markdown(rows: list[dict], device: str, command: str, triton: bool = False, backward: bool = False,
             new_shapes: bool = False, lengths: bool = False) -> str:
    what = ("Triton's launch path included up to its C launcher (kernels compiled for sm_90, not run)"
            if triton else "every Triton kernel stubbed (Triton's own launch not included)")
    if backward:
        what = "the backward through torch.autograd.grad (the forward run once before); " + what
    if new_shapes:
        what = "each call a new cache length (one more key a call), nothing remembered across runs; " + what
    if lengths:
        what = "each call one preallocated cache with lengths={'x': one more key a call}; " + what
    lines = [f"# Host time per launch ({device}, {datetime.date.today().isoformat()})", "",
             f"Command: `{command}`", "",
             f"Python {platform.python_version()} on {platform.processor() or platform.machine()}; "
             f"{what}; median of 5 runs.", "",
             "| module | sizes | kernels a call | us per call |", "|---|---|---|---|"]
    for r in rows:
        kernels = ", ".join(f"{k} x{n}" for k, n in r["launches"].items())
        lines.append(f"| {r['name']} | {r['sizes']} | {kernels} | {r['us']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", default=list(DEFAULT))
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--out", default=None, help="folder for launch-overhead-DEVICE-DATE.md")
    p.add_argument("--backward", action="store_true",
                   help="time the backward through autograd (row values, dQ and dK/dV launchers) instead")
    p.add_argument("--triton", action="store_true",
                   help="CPU only: Triton's launch path too, the kernels compiled for sm_90 and not run "
                        "(binder, cache key, lookup; not the C launcher)")
    p.add_argument("--new-shapes", action="store_true",
                   help="forward only: every call a new length of the key cache (a decode loop's growing "
                        "cache), so no call finds what an earlier one remembered")
    p.add_argument("--lengths", action="store_true",
                   help="forward only: every call the same preallocated cache with lengths={'x': n}, n one "
                        "more each call (a decode loop that passes its cache's length)")
    args = p.parse_args(argv)
    if (args.new_shapes or args.lengths) and args.backward:
        raise SystemExit("bench/launch_overhead.py: --new-shapes and --lengths time the forward; "
                         "leave out --backward")
    if args.new_shapes and args.lengths:
        raise SystemExit("bench/launch_overhead.py: --new-shapes narrows the cache, --lengths passes its "
                         "length: one of them")
    if args.triton and os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("bench/launch_overhead.py --triton: unset TRITON_INTERPRET (Triton must compile)")
    import torch
    cuda = torch.cuda.is_available()
    if args.triton and cuda:
        raise SystemExit("bench/launch_overhead.py --triton is for a machine without a GPU: on one, "
                         "bench/decode.py's host column times the real launch")
    if not cuda and not args.triton:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = "cuda" if cuda else "cpu"
    rows = [measure(n, args.calls, device, args.triton, args.backward, args.new_shapes, args.lengths)
            for n in args.names]
    label = torch.cuda.get_device_name() if cuda else "cpu"
    text = markdown(rows, label, "python bench/launch_overhead.py " + " ".join(argv if argv is not None
                                                                               else sys.argv[1:]), args.triton, args.backward,
                    args.new_shapes, args.lengths)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        kind = ("-backward" if args.backward else "") + ("-new-shapes" if args.new_shapes else "") \
            + ("-lengths" if args.lengths else "") + ("-triton" if args.triton else "")
        stem = f"launch-overhead{kind}-{re.sub(r'[^a-z0-9]+', '-', label.lower()).strip('-')}-{datetime.date.today()}"
        (out / f"{stem}.md").write_text(text)
        print(f"wrote {out / stem}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
