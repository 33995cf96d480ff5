"""Compile a diagram's kernels for a GPU that is not here: what would Hopper run?

A session without a GPU cannot time a kernel, but Triton compiles for any
NVIDIA target on any machine: its compiler and ptxas ship in the wheel.
This module runs a generated launcher on CPU tensors while Triton believes
the current device is, say, an sm_90 (``_PaperGPU``); every kernel the
launcher launches (forward, and backward through autograd) is compiled
for that target and never run.  The launch is the real one: the same
block sizes, num_warps and num_stages, and the same specialisation of
arguments (pointer alignment, unit strides), so what comes out is the
binary a GPU session would get on the same Triton.

For each kernel the report says what decides its speed before anything is
timed: registers per thread and spills (ptxas -v), shared memory, and
which instructions carry the work: Hopper's warpgroup MMA (``wgmma``) or
Ampere's ``mma.sync``, asynchronous copies (``cp.async``: the loads the
software pipeline overlaps with the math) and TMA bulk copies.  A kernel
that spills, or an sm_90 attention loop without wgmma, is slow on the GPU
whatever the autotuner picks; the tests hold the bundled examples to that.

    python -m napkin.bench.aot examples/causal.ncd --head-dim 128 --dtype bfloat16

Needs torch and triton (with its NVIDIA backend, which the Linux wheels
carry); no GPU, no CUDA driver.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

from .. import ir
from ..errors import NapkinError
from ..sizes import parse_pairs

# Sizes of symbolic wires when none is given: a tiled wire (rows, keys) a
# multiple of 16 like the real runs, so pointers and strides specialise the
# same way; any other (batch, heads) 2.  Small enough that the CPU tensors of
# the launch cost nothing.
DEFAULT_SIZE = 256
OTHER_SIZE = 2

# What the PTX says the work runs on (counted occurrences of each opcode prefix).
FEATURES = {
    "wgmma": "wgmma.mma_async",                # Hopper warpgroup MMA
    "mma": "mma.sync",                         # Ampere-style warp MMA
    "cp_async": r"cp\.async\.c[ag]",          # pipelined global -> shared copies
    "tma": "cp.async.bulk.tensor",             # TMA bulk copies
}

# The FP32 ALU work in the SASS (cuobjdump -sass of the cubin): how many
# instructions of each opcode family the code holds (FFMA counts FFMA.FTZ
# too).  Static counts: an instruction in a loop counts once however often
# it runs, and code the kernel never reaches counts too.
SASS_OPS = {"ffma": "FFMA", "fmul": "FMUL", "fadd": "FADD", "ex2": "MUFU.EX2", "fsel": "FSEL",
            "fmnmx": "FMNMX"}


@dataclass(frozen=True)
class KernelReport:
    """One compiled kernel, as ptxas and the PTX describe it."""
    kernel: str
    arch: int
    num_warps: int
    num_stages: int
    shared: int              # bytes of shared memory Triton allocated
    registers: int           # per thread
    stack: int               # bytes of stack frame per thread
    spill_stores: int        # bytes
    spill_loads: int         # bytes
    wgmma: int
    mma: int
    cp_async: int
    tma: int
    ffma: int = 0
    fmul: int = 0
    fadd: int = 0
    ex2: int = 0
    fsel: int = 0
    fmnmx: int = 0

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0

    @property
    def per_sm(self) -> Optional[int]:
        """How many of its programs one SM holds at once (occupancy), or None for a target
        not in SM_LIMITS."""
        return programs_per_sm(self.arch, self.num_warps, self.registers, self.shared)

    def row(self) -> list[str]:
        return [self.kernel, f"sm_{self.arch}", str(self.num_warps), str(self.num_stages),
                f"{self.shared / 1024:.1f}", str(self.registers),
                f"{self.spill_stores}/{self.spill_loads}" if self.spills else "0",
                "?" if self.per_sm is None else str(self.per_sm),
                str(self.wgmma), str(self.mma), str(self.cp_async), str(self.tma)] \
            + [str(getattr(self, k)) for k in SASS_OPS]


HEADER = ["kernel", "target", "warps", "stages", "smem KiB", "regs", "spill st/ld B", "per SM",
          "wgmma", "mma.sync", "cp.async", "TMA"] + list(SASS_OPS.values())

# What one SM offers its programs, by compute capability x 10 (CUDA's occupancy tables):
# registers, shared memory (bytes, the most a program may have plus what the driver keeps per
# program), warps, programs.  Registers go to warps in blocks of 256.
SM_LIMITS = {80: (65536, 167936, 1024, 64, 32), 86: (65536, 102400, 1024, 48, 16),
             89: (65536, 102400, 1024, 48, 24), 90: (65536, 233472, 1024, 64, 32)}


def programs_per_sm(arch: int, warps: int, registers: int, shared: int) -> Optional[int]:
    """Resident programs per SM: the least that registers, shared memory and warps allow.
    At 8 warps a program of 129 to 255 registers a thread has an SM to itself; at 4 warps,
    one of 128 shares it with three others (where shared memory allows)."""
    if arch not in SM_LIMITS or warps <= 0:
        return None
    regs, smem, reserved, max_warps, max_programs = SM_LIMITS[arch]
    per_warp = -(-max(registers, 1) * 32 // 256) * 256
    by_regs = (regs // per_warp) // warps
    by_smem = smem // (shared + reserved) if shared else max_programs
    return max(0, min(by_regs, by_smem, max_warps // warps, max_programs))


# --------------------------------------------------------------------------
# Pretending to be a GPU.
# --------------------------------------------------------------------------

class _PaperGPU:
    """The part of a Triton driver that compiling consults: the target.
    Nothing is launched, so nothing else is asked of it."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def is_active(self):
        return True


@contextlib.contextmanager
def _compiling_for(arch: int):
    """Inside, a Triton kernel launch compiles for ``arch`` and returns
    without running; yields the list the compiled kernels are added to, as
    (kernel name, CompiledKernel).  Everything is put back on the way out."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    compiled: list = []
    real_run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = real_run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self.fn.__name__, kernel))
        return kernel

    # Triton's code generator consults TRITON_INTERPRET while it compiles
    # (constexpr functions return plain values under the interpreter), so it
    # must be unset here even in a process (the test suite) that set it.
    before = os.environ.pop("TRITON_INTERPRET", None)
    active = driver._active          # None where no driver was ever made: a machine with no GPU
    JITFunction.run = compile_only
    driver.set_active(_PaperGPU(arch))
    try:
        yield compiled
    finally:
        JITFunction.run = real_run
        driver._active = active
        if before is not None:
            os.environ["TRITON_INTERPRET"] = before


def load_module(diagram: ir.Diagram, text: str, path: str, build: Path):
    """The generated module of ``diagram``, imported with real Triton kernels
    (TRITON_INTERPRET unset while it is decorated), under a name of its own so
    an interpreted copy elsewhere in the process is never reused."""
    from .harness import compile_module

    before = os.environ.pop("TRITON_INTERPRET", None)
    try:
        return compile_module(diagram, text, path, build, prefix="napkin_aot")[0]
    finally:
        if before is not None:
            os.environ["TRITON_INTERPRET"] = before


# --------------------------------------------------------------------------
# Launching on paper.
# --------------------------------------------------------------------------

def compile_diagram(diagram: ir.Diagram, text: str, path: str, sizes: Mapping[str, int], *,
                    arch: int = 90, dtype: Optional[str] = None, backward: bool = True,
                    options: Optional[Mapping[str, int]] = None,
                    build: Optional[Path] = None) -> list[KernelReport]:
    """Compile every kernel the launcher of ``diagram`` launches at ``sizes``
    (the forward; with ``backward``, the backward too when the module has
    one) for sm_``arch``, and report each."""
    import torch
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    from . import reference

    if not isinstance(tl.standard.cdiv, JITFunction):
        raise NapkinError("triton was imported under TRITON_INTERPRET=1, so its own library is interpreted "
                          "and cannot be compiled: run this in a process without it "
                          "(python -m napkin.bench.aot FILE)")
    with tempfile.TemporaryDirectory() as tmp:
        module = load_module(diagram, text, path, Path(build or tmp))
        launcher = getattr(module, diagram.name)
        inputs = reference.example_inputs(diagram, sizes, dtype=dtype, device="cpu", seed=0)
        trains = backward and hasattr(module, f"{diagram.name}_backward")
        if trains:
            # not the inputs napkin has no gradient for (8-bit factors): the launcher refuses them
            skip = getattr(module, "_NO_GRADIENT", {})
            inputs = [t.requires_grad_(True) if t.is_floating_point() and x.name not in skip else t
                      for x, t in zip(diagram.inputs, inputs)]
        # The launcher refuses CPU tensors outside the interpreter; here they
        # only stand for the GPU's (their shapes, strides and alignment).
        module._check_device = lambda device: None
        with _compiling_for(arch) as compiled:
            with torch.set_grad_enabled(trains):
                outs = launcher(*inputs, **dict(options or {}))
            outs = outs if isinstance(outs, tuple) else (outs,)
            if trains:
                tied = [o for o in outs if o.requires_grad]
                torch.autograd.backward(tied, [torch.ones_like(o) for o in tied])
        return [report(name, kernel, arch) for name, kernel in compiled]


def report(name: str, kernel, arch: int) -> KernelReport:
    """Registers and spills from ptxas -v on the kernel's PTX; features from
    the PTX; FP32 instruction counts from the SASS."""
    ptx = kernel.asm["ptx"]
    usage = _ptxas_usage(ptx, arch)
    meta = kernel.metadata
    counts = {k: len(re.findall(pattern, ptx)) for k, pattern in FEATURES.items()}
    return KernelReport(kernel=name, arch=arch, num_warps=meta.num_warps, num_stages=meta.num_stages,
                        shared=meta.shared, **usage, **counts, **count_sass(_sass(kernel.asm["cubin"])))


def _sass(cubin: bytes) -> str:
    """The SASS of a cubin, by the cuobjdump that ships with Triton."""
    from triton import knobs

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        done = subprocess.run([knobs.nvidia.cuobjdump.path, "-sass", str(path)], capture_output=True, text=True)
    if done.returncode:
        raise NapkinError(f"cuobjdump failed on the compiled kernel:\n{done.stderr}")
    return done.stdout


# One SASS instruction: /*0a40*/, an optional predicate (@P0, @!UPT), the opcode.
_SASS_LINE = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", re.MULTILINE)


def count_sass(sass: str) -> dict:
    """{ffma, fmul, ...}: the instructions of each SASS_OPS family in ``sass``
    (an opcode counts for a family when it is the family or extends it with
    a modifier: FFMA.FTZ is an FFMA, MUFU.RCP is not a MUFU.EX2)."""
    ops = _SASS_LINE.findall(sass)
    return {k: sum(op == name or op.startswith(name + ".") for op in ops) for k, name in SASS_OPS.items()}


def _ptxas_usage(ptx: str, arch: int) -> dict:
    """ptxas -v's resource line for the PTX Triton made, run with the ptxas
    Triton used."""
    from triton.backends.nvidia import compiler as nv

    ptxas = nv.get_ptxas(arch).path
    suffix = "a" if arch >= 90 else ""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        done = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{arch}{suffix}", str(src), "-o", str(src) + ".o"],
                              capture_output=True, text=True)
    log = done.stdout + done.stderr
    if done.returncode:
        raise NapkinError(f"ptxas failed on the compiled kernel:\n{log}")
    return parse_ptxas(log)


def parse_ptxas(log: str) -> dict:
    """{registers, stack, spill_stores, spill_loads} from ptxas -v's output."""
    def grab(pattern):
        m = re.search(pattern, log)
        return int(m.group(1)) if m else 0
    if not re.search(r"Used \d+ registers", log):
        raise NapkinError(f"ptxas -v printed no resource line:\n{log}")
    return {"registers": grab(r"Used (\d+) registers"), "stack": grab(r"(\d+) bytes stack frame"),
            "spill_stores": grab(r"(\d+) bytes spill stores"), "spill_loads": grab(r"(\d+) bytes spill loads")}


# --------------------------------------------------------------------------
# Command line.
# --------------------------------------------------------------------------

def default_sizes(diagram: ir.Diagram, given: Mapping[str, int]) -> dict[str, int]:
    """Every symbolic wire's size: ``given``, else DEFAULT_SIZE for a tiled
    wire and OTHER_SIZE for the rest."""
    from ..autotune import tiled_wires

    tiled = set(tiled_wires(diagram))
    return ir.coarse_sizes(diagram, {w.name: int(given.get(w.name, DEFAULT_SIZE if w.name in tiled else OTHER_SIZE))
                                     for w in diagram.wires if w.size is None}, given)   # qb follows q


def table(reports: Sequence[KernelReport]) -> str:
    rows = [HEADER] + [r.row() for r in reports]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADER))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths)] + lines[1:])


def main(argv: Optional[Sequence[str]] = None) -> int:
    import napkin

    from .harness import variant

    p = argparse.ArgumentParser(prog="python -m napkin.bench.aot", description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", metavar="FILE", help="a .ncd diagram")
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200, 80: A100)")
    p.add_argument("--head-dim", type=int, help="set the diagram's fixed head dims to this size (as napkin bench; "
                   "every fixed wire of a diagram that is no attention)")
    p.add_argument("--dtype", choices=["float16", "bfloat16"], default="bfloat16",
                   help="the fp16/bf16 inputs' dtype (default bfloat16)")
    p.add_argument("-D", "--size", action="append", default=[], metavar="WIRE=N",
                   help=f"a symbolic wire's size (default {DEFAULT_SIZE} if tiled, else {OTHER_SIZE})")
    p.add_argument("-O", "--option", action="append", default=[], metavar="NAME=N",
                   help="a launcher option (block_q=64, num_warps=4, ...)")
    p.add_argument("--forward-only", action="store_true", help="skip the backward kernels")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    args = p.parse_args(argv)
    done = []
    try:
        given = parse_pairs(args.size, "-D", filename=p.prog)
        options = parse_pairs(args.option, "-O", key="NAME", what="launcher option", filename=p.prog)
        for file in args.files:
            source = napkin.read_source(file)
            diagram, text = variant(napkin.load_text(source, str(file)), source, args.dtype, args.head_dim)
            sizes = default_sizes(diagram, given)
            reports = compile_diagram(diagram, text, file, sizes, arch=args.arch, dtype=args.dtype,
                                      backward=not args.forward_only, options=options)
            done.append((file, diagram.name, sizes, reports))
    except NapkinError as err:
        print(err, file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"arch": args.arch, "dtype": args.dtype, "head_dim": args.head_dim, "diagrams": [
            {"file": f, "diagram": n, "sizes": s, "kernels": [asdict(r) for r in rs]} for f, n, s, rs in done]},
            indent=1))
        return 0
    for file, name, sizes, reports in done:
        print(f"{file}: {name} at {sizes}, compiled for sm_{args.arch}\n")
        print(table(reports) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
