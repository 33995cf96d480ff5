"""The ``napkin`` command line: check, compile, demo, and the subcommands
other modules register (cost, render, report, bench).

Errors: a ``NapkinError`` is the user's problem, so only its rendered text
(file:line:col, source line, caret, hint) is printed and the exit status is 1.
Any other exception is napkin's bug: one line saying so, exit status 2, and
the traceback only with ``--traceback``.

Extending: a module ``napkin.X`` that wants a subcommand defines
``register_cli(subparsers)``.  It calls ``subparsers.add_parser(...)``, adds
its arguments, and sets ``func=handler`` with ``handler(args) -> int``.
``_register_plugins`` below calls it for every module in ``PLUGINS``.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import os
import signal
import sys
import tempfile
import threading
import traceback
from pathlib import Path
from typing import Optional

from . import __version__, ir
from .errors import Diagnostic, NapkinError
from .sizes import parse_pairs

# Modules that may add subcommands through register_cli(subparsers).
PLUGINS = ("cost", "render", "bench", "plan")

# Where the bundled examples live when napkin runs from a checkout (or an
# editable install): the folder above the package.
REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO_FILE = "examples/attention.ncd"

# Sizes the demo gives symbolic wires: small and not multiples of the block
# sizes (200 is ragged against 128 and 64), so edge masking is exercised and
# the run takes seconds under Triton's CPU interpreter.
DEMO_SIZES = {"b": 1, "h": 2, "q": 200, "x": 200, "hk": 2, "g": 2,
              "m": 200, "n": 200, "k": 200}
DEMO_OTHER_SIZE = 64  # any other symbolic wire
# ... but one the kernels take index by index: a wire grouped by 1 (a batch wire, one program
# each) and a wire a sum loops over around its stream (sum[k, j](A * B) streaming j: k), which
# multiply the interpreter's programs and steps: a 5-wire product at 64 x 200^3 ran for minutes
DEMO_INDEXED_SIZE = 3

# Max abs error (against a float64 reference) the demo accepts per output dtype,
# times the output's scale, max(1, its largest |value|): rounding to fp16 alone is
# 2^-11 of each value, so a matmul over k = 1000 (values near 30) was "TOO LARGE"
# at an absolute 0.02 with the kernel exact to fp16.
DEMO_TOLERANCE = {"float16": 2e-2, "bfloat16": 6e-2, "float32": 2e-3, "float64": 1e-6}
# A unit in the last place of each dtype the kernels may run in (the gradients' floor above).
DEMO_ULP = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float32": 2.0 ** -23}

# The declared dtypes the demo runs a diagram in (the kernels' float inputs); others run in fp16.
DEMO_DTYPES = ("fp16", "bf16", "fp32", "e4m3", "e5m2")


def main(argv: Optional[list[str]] = None) -> int:
    """Run the command line; returns the exit status (0 ok, 1 user error, 2 bug)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # --traceback is global but users type it anywhere (also after the
    # subcommand, whose parser may come from another module), so it is taken
    # out of argv here rather than declared on every subparser.
    cut = argv.index("--") if "--" in argv else len(argv)
    show_traceback = "--traceback" in argv[:cut]
    argv = [a for i, a in enumerate(argv) if i >= cut or a != "--traceback"]
    with _terminable() as received:
        status = _run(argv, show_traceback)
    # a SIGTERM whose exception something swallowed (raised inside a finalizer, Python prints
    # "Exception ignored" and goes on) still ends as one: the run's cleanup has happened either way
    return 143 if received else status


class _Terminated(BaseException):
    """SIGTERM (timeout, a batch system's time limit), raised where the
    process is, so that ``with`` and ``finally`` clean up: Python's default
    stopped at once and left /tmp/napkin-demo-* and napkin-bench-* behind.
    A BaseException, as KeyboardInterrupt: no ``except Exception`` takes it."""


@contextlib.contextmanager
def _terminable():
    """SIGTERM raises _Terminated inside the block; yields the list of the
    signals received, so a caller sees one even where the exception was lost."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():   # signals reach the main thread only
        yield received
        return

    def stop(signum, frame):
        received.append(signum)
        raise _Terminated()
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(argv: list[str], show_traceback: bool) -> int:
    try:
        parser = build_parser(strict=show_traceback)
        try:
            args = parser.parse_args(argv)
        except SystemExit as stop:  # --help, --version, usage errors
            return _exit_code(stop)
        status = int(args.func(args) or 0)
        sys.stdout.flush()   # a closed pipe shows here, not in the interpreter's last flush
        return status
    except BrokenPipeError:
        # the reader stopped reading (napkin cost FILE | head): nothing of napkin's went wrong.
        _quiet_stdout()
        return 141   # 128 + SIGPIPE, as a shell reports a command a closed pipe stopped
    except OSError as err:
        if err.errno not in _OUTPUT_FULL:
            raise
        # every file napkin writes says so in a NapkinError of its own: what is left is the
        # output (napkin check ... > /dev/full), which is the user's to see, not a bug
        _quiet_stdout()
        print(f"napkin: cannot write the output: {err.strerror or err}", file=sys.stderr)
        return 1
    except NapkinError as err:
        print(str(err), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except _Terminated:
        return 143   # 128 + SIGTERM, as a shell reports it
    except Exception as err:  # anything else is a bug in napkin
        if show_traceback:
            traceback.print_exc()
        else:
            print(f"napkin: internal error: {type(err).__name__}: {err} "
                  "(this is a bug; rerun with --traceback for details)", file=sys.stderr)
        return 2


# no space on the device or in the quota, past the file-size limit, an I/O error
_OUTPUT_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO)


def _quiet_stdout() -> None:
    """stdout to devnull, so that the interpreter's own flush at exit does
    not fail on it again (and print an 'Exception ignored' of its own)."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):   # a stdout with no descriptor (a test's capture)
        pass


def _exit_code(stop: SystemExit) -> int:
    if stop.code is None:
        return 0
    return stop.code if isinstance(stop.code, int) else 2


def build_parser(strict: bool = False) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="napkin",
        description="Attention kernels, cost reports and pictures from neural circuit diagrams (.ncd).",
    )
    parser.add_argument("--version", action="version", version=f"napkin {__version__}")
    parser.add_argument("--traceback", action="store_true",
                        help="show the Python traceback of an internal error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("check", help="parse and check .ncd files")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("compile", help="write the Triton module for each .ncd file")
    p.add_argument("files", nargs="+", metavar="FILE")
    p.add_argument("-o", "--out", default="generated", metavar="DIR",
                   help="folder for the generated modules (default: generated)")
    p.add_argument("--render", action="store_true", help="also draw each diagram beside its module")
    p.set_defaults(func=cmd_compile)

    p = sub.add_parser("demo", help="compile a diagram, run it on small inputs and compare with the reference")
    p.add_argument("file", nargs="?", default=DEMO_FILE, metavar="FILE",
                   help=f"the diagram (default: {DEMO_FILE})")
    p.add_argument("--size", "-D", action="append", default=[], metavar="WIRE=N",
                   help="size of a symbolic wire (repeatable)")
    p.set_defaults(func=cmd_demo)

    _register_plugins(sub, strict)
    return parser


def _register_plugins(sub, strict: bool = False) -> None:
    """Let each plugin module add its subcommands.  A plugin that fails to
    import is a bug, but it must not take ``napkin check`` down with it: it is
    reported in one line and its subcommands are left out (``--traceback``
    makes it fatal, to see where it broke)."""
    for name in PLUGINS:
        try:
            _provided(name, "register_cli")(sub)
        except Exception as err:
            if strict:
                raise
            print(f"napkin: internal error: the subcommands of napkin.{name} are unavailable: "
                  f"{type(err).__name__}: {err} (this is a bug)", file=sys.stderr)


def _provided(module: str, attr: str):
    """``napkin.<module>.<attr>``, looked up when a command runs: the passes
    load only for the commands that use them, and tests stand fakes in for
    them (test_cli's _fake_passes)."""
    return getattr(importlib.import_module(f"napkin.{module}"), attr)


def _plural(n: int, word: str) -> str:
    if n == 1:
        return f"{n} {word}"
    return f"{n} {word}es" if word.endswith("x") else f"{n} {word}s"


# --------------------------------------------------------------------------
# napkin check
# --------------------------------------------------------------------------

def cmd_check(args) -> int:
    """Check every file, even after a failure; exit 1 if any failed."""
    import napkin

    failed = False
    for path in args.files:
        try:
            d = napkin.load(path)
        except NapkinError as err:
            print(str(err), file=sys.stderr)
            failed = True
            continue
        print(f"{path}: ok ({_plural(len(d.wires), 'wire')}, {_plural(len(d.inputs), 'input')}, "
              f"{_plural(len(d.lets), 'box')}, {_plural(len(d.outputs), 'output')})")
    return 1 if failed else 0


# --------------------------------------------------------------------------
# napkin compile
# --------------------------------------------------------------------------

def cmd_compile(args) -> int:
    failed = False
    out_dir = Path(args.out)
    write_module = _provided("codegen", "write_module")
    claimed: dict[str, str] = {}   # two files of one diagram name: the second is refused
    for path in args.files:
        try:
            # write_module makes out_dir once the diagram has checked: a bad
            # diagram leaves nothing behind, not even an empty folder
            written = Path(write_module(path, out_dir, claimed=claimed))
            print(f"wrote {written}")
            if args.render:
                _render_beside(path, written)
        except NapkinError as err:
            print(str(err), file=sys.stderr)
            failed = True
    return 1 if failed else 0


def _render_beside(path, module_path: Path) -> None:
    render_file = _provided("render", "render_file")
    out = render_file(path, module_path.with_suffix(".svg"))
    print(f"wrote {out if out is not None else module_path.with_suffix('.svg')}")


# --------------------------------------------------------------------------
# napkin demo: the README's main job
# --------------------------------------------------------------------------

def cmd_demo(args) -> int:
    path = _find_demo_file(args.file)
    requested = parse_pairs(args.size, "--size")

    # Triton reads TRITON_INTERPRET when it is imported, so decide before any
    # import of triton (torch itself does not import it).
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ["TRITON_INTERPRET"] = "1"
    device = "cuda" if cuda else "cpu"

    import napkin
    from napkin.interpreter import problem

    message = problem()   # Triton 3.6's interpreter on NumPy 2.4: say what to install, before any kernel fails
    if message:
        print(f"napkin demo: {message}", file=sys.stderr)
        return 1

    diagram = napkin.load(path)
    sizes = _demo_sizes(diagram, requested, path)
    write_module = _provided("codegen", "write_module")

    with tempfile.TemporaryDirectory(prefix="napkin-demo-") as tmp:
        module = _import_file(Path(write_module(path, Path(tmp))))
        dtype, why = _demo_dtype(diagram, cuda, torch)
        int8 = ", ".join(t.name for t in diagram.inputs if t.dtype == "int8")   # a product's factors: drawn in int8
        print(f"{path}: diagram {diagram.name}, sizes "
              + ", ".join(f"{k}={v}" for k, v in sizes.items())
              + f", on {'the GPU' if cuda else 'the CPU (Triton interpreter)'}, "
              + f"{str(dtype).replace('torch.', '')} inputs"
              + (f" ({int8}: int8)" if int8 else ""))
        if why:
            print(f"  ({why})")
        try:
            ok = _run_and_compare(module, diagram, sizes, device, torch, dtype)
        finally:
            sys.modules.pop(module.__name__, None)

    print("cost model:")
    for line in _provided("cost", "summary_lines")(diagram, sizes):
        print("  " + line)
    if not ok:
        print("napkin demo: the kernel's outputs differ from the reference", file=sys.stderr)
        return 1
    return 0


def _find_demo_file(name: str) -> Path:
    """FILE as given, else relative to the repository root (so ``napkin demo``
    works from any folder of a checkout)."""
    path = Path(name)
    if path.is_file():
        return path
    if not path.is_absolute() and (REPO_ROOT / path).is_file():
        return REPO_ROOT / path
    raise NapkinError(f"no such file: {name}", filename="napkin")


def _demo_sizes(diagram, requested: dict[str, int], path) -> dict[str, int]:
    """A size for every symbolic wire: the user's, else a small default (a
    coarse read's blocks, qb of keep[.., q // 64, ..], from their wire's)."""
    known = {w.name: w for w in diagram.wires}
    for name, value in requested.items():
        if name not in known:
            raise NapkinError(f"--size {name}={value}: diagram {diagram.name} has no wire {name!r}",
                              filename=str(path))
        if known[name].size is not None and known[name].size != value:
            raise NapkinError(f"--size {name}={value}: wire {name} is fixed at {known[name].size}",
                              filename=str(path))
    from . import tiling

    levels = tiling.chip_levels(diagram)
    looped = tiling.looped_wires(diagram, levels[0]) if levels else set()
    by_one = {t.wire for t in diagram.level(levels[0]).tiles if t.kind == "group" and t.size == 1} \
        if levels else set()

    def default(w: str) -> int:   # the named sizes first, but a looped wire is small whatever its name
        if w in looped or (w in by_one and w not in DEMO_SIZES):
            return DEMO_INDEXED_SIZE
        return DEMO_SIZES.get(w, DEMO_OTHER_SIZE)

    # a relabel ties two wires (doc[b, q] of doc[b, x]): one given, the other takes its size, not a default
    tied = dict(requested)
    clash = ir.tie_relabels(diagram, tied)
    if clash:
        tensor, declared, read, loc = clash
        raise NapkinError([Diagnostic(f"--size: {tensor} is read along {read} as well as {declared}, so wires "
                                      f"{read} ({tied[read]}) and {declared} ({tied[declared]}) must have equal "
                                      "sizes", loc)], filename=str(path), source=path.read_text())
    return ir.coarse_sizes(diagram, {w.name: tied.get(w.name, default(w.name))
                                     for w in diagram.wires if w.size is None}, requested)   # qb follows q


def _import_file(path: Path):
    """Import a generated module by file path.  It is registered in
    sys.modules while it runs (Triton's JIT looks its functions' source up)."""
    name = f"napkin_demo_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _demo_dtype(diagram, cuda: bool, torch):
    """The dtype the demo's float inputs come in: the diagram's own, that of
    its first input declared fp16, bf16 or fp32 (fp16 if none is), except
    bf16 on the CPU, which runs as fp16 (the Triton interpreter's bf16
    tl.dot is wrong).  Returns (dtype, why it is not the declared one, or
    None)."""
    from . import ir

    main = next((t.dtype for t in diagram.inputs if t.dtype in DEMO_DTYPES), "fp16")
    if main == "bf16" and not cuda:
        return torch.float16, "a bf16 diagram runs in fp16 here: Triton's interpreter gets bf16 dots wrong"
    return getattr(torch, ir.TORCH_NAMES[main]), None


def _run_and_compare(module, diagram, sizes, device, torch, dtype) -> bool:
    """Run the launcher and the float64 reference on the same inputs; print
    the max abs error of each output, then, for a module that trains, of
    each float input's gradient through autograd (random output gradients,
    the same for both).  True when all are within tolerance."""
    inputs = module.example_inputs(sizes, dtype=dtype, device=device, seed=0)
    launcher = getattr(module, diagram.name)
    trains = callable(getattr(module, f"{diagram.name}_backward", None))
    by_name = isinstance(inputs, dict)
    if by_name:
        names, inputs = list(inputs), list(inputs.values())
    else:
        names = list(getattr(module, "INPUTS", [f"input {i}" for i in range(len(inputs))]))

    for name, wire in getattr(module, "_LENGTH_INPUTS", {}).items():   # x < n[b]: say what was drawn
        drawn = inputs[names.index(name)].flatten().tolist()
        shown = ", ".join(map(str, drawn[:8])) + (", ..." if len(drawn) > 8 else "")
        what = "a length" if len(drawn) == 1 else "lengths"   # a scalar's (a window's width), or b = 1
        print(f"  ({name}: {what} of {wire} drawn in 1..{sizes.get(wire) or module.WIRES[wire]}: {shown})")

    # a float input the backward has no kernel for (sigmoid(S + beta): beta past the score box) is
    # passed without requires_grad, and the demo says why, where training with it raises
    refused = getattr(module, "_NO_GRADIENT", {}) if trains else {}

    def prepared(t, wide, name):
        if not (torch.is_tensor(t) and t.is_floating_point()):
            return t
        t = t.detach().double() if wide else t.detach().clone()
        return t.requires_grad_(trains and name not in refused)

    runs = []
    for call, wide in ((launcher, False), (module.reference, True)):
        args = [prepared(t, wide, name) for t, name in zip(inputs, names)]
        outs = call(**dict(zip(names, args))) if by_name else call(*args)
        runs.append((args, outs if isinstance(outs, (tuple, list)) else (outs,)))
    (args, got), (wide_args, want) = runs

    from .bench.checks import max_abs_error, scale_of   # the benchmark's own comparison

    results = [(out.name, g, w, 1) for out, g, w in zip(diagram.outputs, got, want)]
    if trains:
        # a gradient entry that adds up whole rows of the attention (a scalar temperature, slope[h]):
        # how many, against the first output's rows (O[b, h, q, d]: b h q of them)
        rows = want[0].numel() // want[0].shape[-1] if want and want[0].dim() else 1
        results += [(name, g, w, max(1, rows // max(1, w.numel())))
                    for name, g, w in _gradients(names, args, got, wide_args, want, torch)]
    # A gradient summing whole rows sums FlashAttention's delta = rowsum(dO * O), one rounding
    # of the stored O a row in the inputs' dtype, which the reference does not make: the
    # floor of tests/backward_helpers.py, 4 of those ulps a row, grown as the root of the rows
    inputs_kind = str(dtype).replace("torch.", "")
    ulp = DEMO_ULP.get(inputs_kind, DEMO_ULP["float16"])
    ok = True
    for name, g, w, summed in results:
        g, w = g.detach(), w.detach()
        err = max_abs_error(g, w)   # (matching infinities exact: the -inf lse of a fully masked row)
        # The tolerance follows the dtype the kernel actually returned.
        kind = str(g.dtype).replace("torch.", "")
        tol = DEMO_TOLERANCE.get(kind, 2e-2)
        scale = scale_of(w)
        floor = 4 * ulp * summed ** 0.5 if summed > 1 else 0.0
        good = err <= (tol + floor) * scale
        ok = ok and good
        shown = f"{tol:g} x {scale:.3g}" if not floor else \
            f"({tol:g} + 4 {inputs_kind} ulps x sqrt({summed} rows summed)) x {scale:.3g}"
        print(f"  {name}{list(g.shape)} {kind}: max abs error {err:.2e} vs float64 reference "
              f"({'ok' if good else 'TOO LARGE'}, tolerance {shown})")
    if not trains and getattr(module, "_NO_BACKWARD", None):
        print(f"  gradients not checked: {module._NO_BACKWARD}")
    for name in (n for n in names if n in refused):
        print(f"  d{name} not checked: {refused[name]}")
    return ok


def _gradients(names, args, got, wide_args, want, torch):
    """(name, kernel's gradient, reference's) of each float input, through
    autograd from random gradients of the float outputs (fresh normal
    values, seeded: the demo is reproducible)."""
    gen = torch.Generator().manual_seed(1)
    pairs = [(g, w) for g, w in zip(got, want) if torch.is_tensor(g) and g.requires_grad]
    grads = [torch.randn(w.shape, generator=gen, dtype=torch.float64) for _, w in pairs]
    # A fully masked row's -inf lse has no gradient: its random one is zeroed.
    grads = [torch.where(torch.isfinite(w.detach()), d.to(w.device), 0) for (_, w), d in zip(pairs, grads)]
    # the same for both: as the kernel's output dtype holds them (autograd hands the launcher's
    # backward a gradient in its output's dtype; a bf16 output's beside float32 inputs differed
    # from the reference's by a bf16 rounding, which the gradients then summed)
    grads = [d.to(g.dtype).to(d.dtype) for (g, _), d in zip(pairs, grads)]
    wanted = [i for i, a in enumerate(args) if torch.is_tensor(a) and a.requires_grad]
    if not pairs or not wanted:
        return []
    mine = torch.autograd.grad([g for g, _ in pairs], [args[i] for i in wanted],
                               [d.to(g.dtype) for (g, _), d in zip(pairs, grads)], allow_unused=True)
    theirs = torch.autograd.grad([w for _, w in pairs], [wide_args[i] for i in wanted], grads,
                                 allow_unused=True)
    return [(f"d{names[i]}", _zero_if_none(a, args[i], torch), _zero_if_none(b, wide_args[i], torch))
            for i, a, b in zip(wanted, mine, theirs)]


def _zero_if_none(grad, t, torch):
    """An input no output depends on has no gradient: zeros, as torch fills .grad."""
    return torch.zeros_like(t) if grad is None else grad
