"""TMA descriptor loads in napkin's forward attention kernel: the launcher's tma= option, checked and compiled for sm_90.

The generated module of a diagram (examples/causal.ncd, examples/attention.ncd)
is emitted and imported as napkin emits it, unpatched, and its launcher is
called with its own option ``tma=`` (napkin/codegen/tma.py): False runs the
pointer kernel, True moves Q, K, V and O through host TensorDescriptors over
each tensor's own wires [b, h, x, d] (block 1 on b and h: rows past |x| are
zero-filled per head, the O store is clipped at |q|).  The launcher falls
back to the pointer code silently where TMA cannot run (no sm_90, a stride
TMA cannot take, rows at global positions); ``module._tma_last`` says which
ran and why, and every subcommand reports it.  tma is always passed
explicitly: None would take a tuned config's choice from the autotune cache.

Forms (``FORMS``, one table for every subcommand: the launcher's tma=):

  ptr   tma=False, the pointer kernel (the baseline)
  tma   tma=True

The study this script began as (commit a397b7e, 2026-11-21) text-patched the
generated forward kernel into forms of its own (tma4d, tma4d_qo, tma2d,
tma2d_raw, tma4d_qo_ws); napkin's tma= is its tma4d_qo, and the patch no
longer applies to what napkin emits.  Those forms' results are kept in
bench/tma/sm90-*.jsonl, bench/tma/check-*.log and
bench/results/tma-sm90-2026-11-21.md; their code is
``git show a397b7e:bench/tma/tma_fwd.py``.  ``table`` still renders those
files (their rows carry the old form names).

Commands (from the repository root; keep TRITON_INTERPRET unset for ``compile``):

  # numerics under the interpreter (the script sets TRITON_INTERPRET=1 itself),
  # each form against the float64 reference, tma bitwise against ptr
  PYTHONPATH=. python bench/tma/tma_fwd.py check

  # compile for sm_90 with no GPU (napkin.bench.aot's paper target) and count; JSON lines out
  PYTHONPATH=. python bench/tma/tma_fwd.py compile --out bench/tma/build/sm90.jsonl

  # one configuration, keeping its SASS, TTGIR and PTX
  PYTHONPATH=. python bench/tma/tma_fwd.py compile --examples causal --head-dims 128 \\
      --blocks 128x64 --stages 2 --forms tma --dump bench/tma/build/dump

  # on an H100 (run_h100.sh's tma stage): tma=True against the pointer kernel
  PYTHONPATH=. python bench/tma/tma_fwd.py time --out bench/tma/h100-times.jsonl

  # the markdown table of one or more JSON-lines files (old study's or new)
  python bench/tma/tma_fwd.py table bench/tma/sm90-t39.jsonl bench/tma/sm90-t36.jsonl

Compile-time counts are not timings: they say what the GPU would run (TMA or
cp.async, how many address instructions, registers, shared memory), not how
fast.  Only an H100 run can say that.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

if len(sys.argv) > 1 and sys.argv[1] == "check":
    os.environ["TRITON_INTERPRET"] = "1"      # before triton is imported

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
BUILD = HERE / "build"          # ignored by git (build/)

# The forms of every subcommand: the launcher's tma= for each.
FORMS = {"ptr": False, "tma": True}


def generated(example: str, head_dim: int | None, dtype: str) -> tuple[str, str]:
    """(diagram name, the module text napkin emits) for examples/<example>.ncd,
    its fp16 declarations set to ``dtype`` and its head dim to ``head_dim``."""
    import napkin
    from napkin.bench.harness import variant
    from napkin.codegen import emit_module

    path = ROOT / "examples" / f"{example}.ncd"
    diagram, text = variant(napkin.load(str(path)), path.read_text(), dtype, head_dim)
    return diagram.name, emit_module(diagram, source_text=text, source_path=str(path))


def load(example: str, head_dim: int | None, dtype: str):
    """(diagram name, the generated module), unpatched, imported from BUILD
    under a name of its own (interpreted and compiled copies apart)."""
    import importlib.util

    name, src = generated(example, head_dim, dtype)
    tag = "interp" if os.environ.get("TRITON_INTERPRET") == "1" else "jit"
    mod_name = f"tma_{example}_{head_dim or 'd'}_{dtype}_{tag}"
    if mod_name in sys.modules:
        return name, sys.modules[mod_name]
    BUILD.mkdir(parents=True, exist_ok=True)
    target = BUILD / f"{mod_name}.py"
    target.write_text(src)
    spec = importlib.util.spec_from_file_location(mod_name, target)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module      # Triton's JIT looks the kernel's source up through it
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(mod_name, None)
        raise
    return name, module


# --------------------------------------------------------------------------
# Numerics under the interpreter.
# --------------------------------------------------------------------------

TOLERANCE = {"float16": 2e-3, "float32": 1e-5}
# (b, h, q, x) and (block_q, block_x): ragged lengths, blocks that do and do not divide them
SHAPES = ("2,3,100,100:32x16", "1,2,37,77:16x32", "1,2,64,64:32x32")


def _shape(text: str) -> tuple[tuple[int, ...], tuple[int, int]]:
    sizes, blocks = text.split(":")
    bhqx = tuple(map(int, sizes.split(",")))
    bq, bx = map(int, blocks.split("x"))
    if len(bhqx) != 4:
        raise argparse.ArgumentTypeError(f"a shape is B,H,Q,X:BQxBX, not {text!r}")
    return bhqx, (bq, bx)


def _bitwise(outs, base) -> bool:
    """Every output equal to base's, bit for bit (NaN where base has NaN)."""
    import torch

    return all(o.dtype == p.dtype and o.shape == p.shape and torch.equal(torch.isnan(o), torch.isnan(p))
               and torch.equal(torch.nan_to_num(o, nan=0.0), torch.nan_to_num(p, nan=0.0))
               for o, p in zip(outs, base))


def _err(outs, ref) -> float:
    """The largest |output - reference| over every output (NaN if any is NaN)."""
    errs = [(o.double() - r).abs().max().item() for o, r in zip(outs, ref)]
    return float("nan") if any(e != e for e in errs) else max(errs)


def _vs_ptr(base, same: bool) -> str:
    return "" if base is None else "  bitwise = ptr" if same else "  differs from ptr"


def _used(mod) -> str:
    last = dict(mod._tma_last)
    return "TMA used" if last["used"] else f"TMA not used ({last['why']})"


def check(args) -> int:
    """Each form of each example's launcher under the interpreter: against the
    float64 reference within TOLERANCE, tma bitwise against ptr, and whether
    TMA really ran (a tma row that fell back to pointers proves nothing: a
    failure, except where falling back is the launcher's documented choice)."""
    import torch

    if os.environ.get("TRITON_INTERPRET") != "1":
        print("check runs under TRITON_INTERPRET=1 (`tma_fwd.py check` sets it before importing triton)",
              file=sys.stderr)
        return 2
    failed = 0

    def line(example, dtype, what, form, text, ok):
        nonlocal failed
        failed += not ok
        print(f"{example:9s} {dtype:8s} {what:38s} {form:4s} {text} {'ok' if ok else 'FAIL'}", flush=True)

    def run(mod, name, form, inputs, **kw):
        out = getattr(mod, name)(*inputs, tma=FORMS[form], **kw)
        return out, dict(mod._tma_last)

    for example in args.examples:
        for dtype in args.dtypes:
            tol = TOLERANCE[dtype]
            name, mod = load(example, args.head_dim, dtype)
            tdt = getattr(torch, dtype)
            for (b, h, q, x), (bq, bx) in args.shapes:
                Q, K, V = mod.example_inputs({"b": b, "h": h, "q": q, "x": x}, dtype=tdt)
                ref = mod.reference(Q.double(), K.double(), V.double())
                base = None
                for form in FORMS:
                    out, last = run(mod, name, form, (Q, K, V), block_q=bq, block_x=bx)
                    err = _err(out, ref)
                    same = base is None or _bitwise(out, base)
                    ok = err <= tol and same and last["used"] == FORMS[form]
                    line(example, dtype, f"b,h,q,x={b},{h},{q},{x} blocks {bq}x{bx}", form,
                         f"max|err| {err:.2e}  {_used(mod)}{_vs_ptr(base, same)}", ok)
                    base = out if base is None else base
            if args.shapes_only:
                continue
            # Strided [b, x, h, d] views (a fused qkv projection's layout): the descriptors take any
            # 16-byte strides over the tensors' own wires.
            Q, K, V = (t.transpose(1, 2).contiguous().transpose(1, 2)
                       for t in mod.example_inputs({"b": 2, "h": 3, "q": 100, "x": 100}, dtype=tdt))
            ref = mod.reference(Q.double(), K.double(), V.double())
            base = None
            for form in FORMS:
                out, last = run(mod, name, form, (Q, K, V), block_q=32, block_x=16)
                err = _err(out, ref)
                same = base is None or _bitwise(out, base)
                ok = err <= tol and same and last["used"] == FORMS[form]
                line(example, dtype, "strided [b,x,h,d] view, 32x16", form,
                     f"max|err| {err:.2e}  {_used(mod)}{_vs_ptr(base, same)}", ok)
                base = out if base is None else base
            # Rows at global positions (a ring-attention shard): the launcher keeps the pointer code
            # there (key padding rows must read as zeros, which a descriptor cannot mask); whichever
            # ran, tma must equal ptr bitwise (the reference has no positions).
            Q, K, V = mod.example_inputs({"b": 1, "h": 2, "q": 100, "x": 90}, dtype=tdt)
            pos = {"positions": {"q": torch.arange(100) + 40, "x": torch.arange(90) * 2},
                   "lengths": {"q": 140, "x": 180}}
            base = None
            for form in FORMS:
                out, last = run(mod, name, form, (Q, K, V), block_q=32, block_x=16, **pos)
                same = base is None or _bitwise(out, base)
                line(example, dtype, "positions/lengths (q+40, 2x), 32x16", form,
                     _used(mod) + _vs_ptr(base, same), same and (FORMS[form] or not last["used"]))
                base = out if base is None else base
            # The ragged edge: |x| = 100, block 32, so head 0's last block covers rows 96..127,
            # past |x|; in memory rows 100..127 are head 1's rows 0..27.  With an inf in head 1's V
            # row 0, a tile that read them unmasked gives head 0 NaN (P = 0 there, 0 * inf = NaN):
            # rows past |x| must read as zero (the per-head descriptor's zero fill).
            Q, K, V = mod.example_inputs({"b": 1, "h": 2, "q": 100, "x": 100}, dtype=tdt)
            V[0, 1, 0, 0] = float("inf")
            ref = mod.reference(Q.double(), K.double(), V.double())
            base = None
            for form in FORMS:
                out, last = run(mod, name, form, (Q, K, V), block_q=32, block_x=32)
                head0 = _err([o[0, 0] for o in out], [r[0, 0] for r in ref])
                finite = all(bool(torch.isfinite(o[0, 0]).all()) for o in out)
                same = base is None or _bitwise(out, base)
                ok = finite and head0 <= tol and same and last["used"] == FORMS[form]
                line(example, dtype, "inf in head 1's V row 0: head 0, 32x32", form,
                     f"max|err| {head0:.2e} finite {finite}  {_used(mod)}{_vs_ptr(base, same)}", ok)
                base = out if base is None else base
    print("all ok" if not failed else f"{failed} FAILED")
    return 1 if failed else 0


# --------------------------------------------------------------------------
# Compiling for sm_90.
# --------------------------------------------------------------------------

# Extra SASS families (exact opcode or opcode with modifiers).
SASS_EXTRA = ("LDGSTS", "UTMALDG", "UTMASTG", "UBLKCP", "SYNCS", "LDG", "STG", "LDS", "LDSM", "STS", "STSM",
              "HGMMA", "IMAD", "IADD3", "LEA", "SHF", "LOP3", "ISETP", "BAR", "WARPGROUP", "ARRIVES")
# TTGIR operations: shared-memory traffic and layout changes the reshape might add.
TTGIR_OPS = {
    "tma_load": r"async_tma_copy_global_to_local", "tma_store": r"async_tma_copy_local_to_global",
    "tma_reduce_or_desc_store": r"tt\.descriptor_store", "cp_async": r"ttg\.async_copy_global_to_local",
    "convert_layout": r"ttg\.convert_layout", "local_alloc": r"ttg\.local_alloc", "local_load": r"ttg\.local_load",
    "local_store": r"ttg\.local_store", "reshape": r"tt\.reshape|ttg\.memdesc_reshape", "wgmma": r"ttng\.warp_group_dot ",
}
_SASS = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);", re.MULTILINE)


def _family(op: str, name: str) -> bool:
    return op == name or op.startswith(name + ".")


def sass_counts(sass: str) -> dict:
    """Static counts over the whole kernel, and over each loop that holds an
    HGMMA: the range of a predicated backward BRA (an unpredicated one is the
    return from an out-of-line mbarrier wait after EXIT), its total and families."""
    # `@!PT LDS RZ, [RZ]` and the like never execute (ptxas's padding): left out
    insts = [(int(a, 16), op, rest, pred) for a, pred, op, rest in _SASS.findall(sass) if pred.strip() != "@!PT"]
    out = {"total": len(insts)}
    out.update({f: sum(_family(op, f) for _, op, _, _ in insts) for f in SASS_EXTRA})
    loops = []
    for addr, op, rest, pred in insts:
        m = re.search(r"0x([0-9a-f]+)", rest) if _family(op, "BRA") and pred else None
        if m and int(m.group(1), 16) < addr:
            body = [(a, o) for a, o, _, _ in insts if int(m.group(1), 16) <= a <= addr]
            if any(_family(o, "HGMMA") for _, o in body):
                loops.append((int(m.group(1), 16), addr, body))
    # outermost loops only
    outer = [l for l in loops if not any(o is not l and o[0] <= l[0] and l[1] <= o[1] for o in loops)]
    out["loops"] = [{"span": f"{lo:#x}-{hi:#x}", "total": len(body),
                     **{f: sum(_family(o, f) for _, o in body) for f in SASS_EXTRA if
                        sum(_family(o, f) for _, o in body)}} for lo, hi, body in outer]
    return out


def compile_one(example, head_dim, dtype, form, bq, bx, warps, stages, dump=None) -> dict:
    """One row: the forward kernel of ``example``'s launcher called with
    tma=FORMS[form] on CPU tensors while Triton compiles for sm_90 with no GPU
    (napkin.bench.aot's paper target), its counts, and whether TMA was used
    (``_tma_last``): the launcher's _tma_ready asks the active Triton target,
    which aot sets to sm_90, so tma=True builds its descriptors as on an
    H100, for CPU tensors standing for the GPU's (same shapes, strides and
    16-byte alignment)."""
    import torch
    import triton
    from napkin.bench import aot

    name, mod = load(example, head_dim, dtype)
    mod._check_device = lambda device: None      # as aot.compile_diagram: CPU tensors stand for the GPU's
    sizes = {"b": aot.OTHER_SIZE, "h": aot.OTHER_SIZE, "q": aot.DEFAULT_SIZE, "x": aot.DEFAULT_SIZE}
    inputs = mod.example_inputs(sizes, dtype=getattr(torch, dtype), device="cpu", seed=0)
    with aot._compiling_for(90) as compiled:
        getattr(mod, name)(*inputs, block_q=bq, block_x=bx, num_warps=warps, num_stages=stages, tma=FORMS[form])
    used = dict(mod._tma_last)
    (kname, kernel), = [(k, c) for k, c in compiled if k == f"_{name}_kernel"]
    rep = aot.report(kname, kernel, 90)
    sass = aot._sass(kernel.asm["cubin"])
    ttgir = kernel.asm.get("ttgir", "")
    if dump:
        d = Path(dump)
        d.mkdir(parents=True, exist_ok=True)
        stem = f"{example}_d{head_dim}_{bq}x{bx}_s{stages}_{form}"
        (d / f"{stem}.sass").write_text(sass)
        (d / f"{stem}.ttgir").write_text(ttgir)
        (d / f"{stem}.ptx").write_text(kernel.asm["ptx"])
    return {"triton": triton.__version__, "example": example, "head_dim": head_dim, "dtype": dtype, "form": form,
            "block_q": bq, "block_x": bx, "num_warps": warps, "num_stages": stages,
            "tma_used": used["used"], "tma_why_not": used["why"],
            "shared": rep.shared, "registers": rep.registers, "spill_stores": rep.spill_stores,
            "spill_loads": rep.spill_loads, "wgmma": rep.wgmma, "cp_async": rep.cp_async, "tma": rep.tma,
            "ptx_tma_store": kernel.asm["ptx"].count("cp.async.bulk.tensor") - len(
                re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::cluster\.global", kernel.asm["ptx"])),
            "sass": sass_counts(sass),
            "ttgir": {k: len(re.findall(p, ttgir)) for k, p in TTGIR_OPS.items()}}


def compile_all(args) -> int:
    """Every configuration and form: one row each, printed (``_short``) and
    appended to --out as JSON.  A compile error is recorded in its row and
    the run goes on; the exit status is 1 when any row is an error or a
    form's tma= did not take effect (tma not used, or used for ptr)."""
    if os.environ.get("TRITON_INTERPRET"):
        print("unset TRITON_INTERPRET for compile", file=sys.stderr)
        return 2
    import triton

    out = open(args.out, "a") if args.out else None
    failed = 0
    for example in args.examples:
        for hd in args.head_dims:
            for blk in args.blocks:
                bq, bx = map(int, blk.split("x"))
                for stages in args.stages:
                    for form in args.forms:
                        try:
                            row = compile_one(example, hd, args.dtype, form, bq, bx, args.warps, stages, args.dump)
                        except Exception as err:      # record the error text and go on
                            row = {"triton": triton.__version__, "example": example, "head_dim": hd, "form": form,
                                   "block_q": bq, "block_x": bx, "num_warps": args.warps, "num_stages": stages,
                                   "dtype": args.dtype, "error": f"{type(err).__name__}: {str(err)[-2000:]}"}
                        failed += "error" in row or row["tma_used"] != FORMS[form]
                        print(_short(row), flush=True)
                        if out:
                            out.write(json.dumps(row) + "\n")
                            out.flush()
    if failed:
        print(f"{failed} row(s) failed or did not take their form's tma=", file=sys.stderr)
    return 1 if failed else 0


def _short(r: dict) -> str:
    head = (f"triton {r['triton']} {r['example']} d={r['head_dim']} {r['block_q']}x{r['block_x']} "
            f"s{r['num_stages']} {r['form']}")
    if "error" in r:
        return head + "  ERROR " + r["error"].splitlines()[0][:200]
    if "tma_used" in r:     # the launcher's forms' rows (the old study's rows have no such key)
        head += " (TMA used)" if r["tma_used"] else f" (TMA not used: {r['tma_why_not']})"
    s = r["sass"]
    loops = "/".join(str(l["total"]) for l in s["loops"])
    return (f"{head}: regs {r['registers']} spill {r['spill_stores']}/{r['spill_loads']} smem {r['shared']} "
            f"wgmma {r['wgmma']} cp.async {r['cp_async']} tma {r['tma']} | SASS {s['total']} loops {loops} "
            f"LDGSTS {s['LDGSTS']} UTMALDG {s['UTMALDG']} UTMASTG {s['UTMASTG']} LDS {s['LDS']} LDSM {s['LDSM']} "
            f"IMAD {s['IMAD']} IADD3 {s['IADD3']} | ttgir {r['ttgir']}")


def table(args) -> int:
    """The markdown table of JSON-lines files, old study's rows and new alike;
    a last column "TMA used" only when some row says (the old files print
    as they did)."""
    rows = [json.loads(l) for f in args.files for l in Path(f).read_text().splitlines() if l.strip()]
    used = any("tma_used" in r for r in rows)
    cols = ["Triton", "ex", "d", "blocks", "st", "form", "regs", "spill", "smem KiB", "wgmma", "cp.async",
            "TMA ptx", "SASS", "loop(s)", "LDGSTS", "UTMALDG", "UTMASTG", "LDS/LDSM", "IMAD+IADD3+LEA", "loop IMAD+IADD3+LEA",
            "cvt_layout"] + (["TMA used"] if used else [])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        head = [r["triton"], r["example"], str(r["head_dim"]), f"{r['block_q']}x{r['block_x']}",
                str(r["num_stages"]), r["form"]]
        if "error" in r:
            print("| " + " | ".join(head + ["error: " + r["error"].splitlines()[0][:120].replace("|", "/")]
                                    + [""] * (len(cols) - 7)) + " |")
            continue
        s = r["sass"]
        loops = s["loops"]
        la = "/".join(str(l["total"]) for l in loops)
        laddr = "/".join(str(l.get("IMAD", 0) + l.get("IADD3", 0) + l.get("LEA", 0)) for l in loops)
        tail = []
        if used:
            tail = ["" if "tma_used" not in r else "yes" if r["tma_used"]
                    else "no: " + str(r["tma_why_not"]).replace("|", "/")]
        print("| " + " | ".join(head + [
            str(r["registers"]), f"{r['spill_stores']}/{r['spill_loads']}", f"{r['shared'] / 1024:.0f}",
            str(r["wgmma"]), str(r["cp_async"]), str(r["tma"]), str(s["total"]), la, str(s["LDGSTS"]),
            str(s["UTMALDG"]), str(s["UTMASTG"]), f"{s['LDS']}/{s['LDSM']}",
            str(s["IMAD"] + s["IADD3"] + s["LEA"]), laddr, str(r["ttgir"]["convert_layout"])] + tail) + " |")
    return 0


def time_rows(args, device: str, bench):
    """The rows of ``time``: each form (FORMS) of the generated
    forward at each size, block and stage count, timed by ``bench`` (a
    callable with no arguments -> ms) on ``device``, with the largest
    difference from the first form's O and whether TMA really ran (the
    launcher falls back to pointers silently: its _tma_last says why).
    tma is always passed: None would take a tuned config's choice from the
    autotune cache, which main tuned with tma True at these sizes."""
    import torch
    import triton

    label = torch.cuda.get_device_name() if device == "cuda" else device
    for example in args.examples:
        for hd in args.head_dims:
            name, mod = load(example, hd, args.dtype)
            for n in args.seqlens:
                b, h = max(1, args.tokens // n), args.hidden // hd
                Q, K, V = (t.to(device) for t in mod.example_inputs(
                    {"b": b, "h": h, "q": n, "x": n}, dtype=getattr(torch, args.dtype)))
                for blk in args.blocks:
                    bq, bx = map(int, blk.split("x"))
                    for stages in args.stages:
                        base = None
                        for form in args.forms:
                            def run():
                                return getattr(mod, name)(Q, K, V, block_q=bq, block_x=bx, num_warps=args.warps,
                                                          num_stages=stages, tma=FORMS[form])
                            try:
                                o = run()[0]
                                used = dict(mod._tma_last)
                                base = o if base is None else base
                                diff = (o.float() - base.float()).abs().max().item()
                                ms = bench(run)
                                yield {"triton": triton.__version__, "device": label, "example": example,
                                       "head_dim": hd, "dtype": args.dtype, "b": b, "h": h, "n": n, "block_q": bq,
                                       "block_x": bx, "num_warps": args.warps, "num_stages": stages, "form": form,
                                       "tma_used": used["used"], "tma_why_not": used["why"], "ms": ms,
                                       "max_diff_vs_first": diff}
                            except Exception as err:
                                yield {"example": example, "head_dim": hd, "n": n, "block_q": bq, "block_x": bx,
                                       "num_stages": stages, "form": form, "error": f"{type(err).__name__}: {err}"[:500]}


def time_gpu(args) -> int:
    """On a GPU: tma=True against the pointer kernel (time_rows), ms from
    triton.testing.do_bench (median); each row printed and appended to --out
    as it is measured, so a stage stopped at its limit keeps what it timed.
    Without one, under TRITON_INTERPRET=1, a smoke run of the same path on
    the CPU (wall-clock ms, meaningless; small --seqlens and --head-dims)."""
    import torch
    import triton

    from napkin.bench.timing import cpu_ms

    if torch.cuda.is_available():
        device, bench = "cuda", lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100)
    elif os.environ.get("TRITON_INTERPRET") == "1":
        device, bench = "cpu", lambda fn: cpu_ms(fn, 1)
    else:
        print("time needs a CUDA GPU (or TRITON_INTERPRET=1 for a smoke run)", file=sys.stderr)
        return 2
    out = open(args.out, "a") if args.out else None
    for row in time_rows(args, device, bench):
        print(json.dumps(row), flush=True)
        if out:
            out.write(json.dumps(row) + "\n")
            out.flush()
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="numerics under TRITON_INTERPRET=1: each form against the float64 "
                       "reference, tma bitwise against ptr, and whether TMA ran")
    c.add_argument("--examples", nargs="+", default=["causal", "attention"])
    c.add_argument("--dtypes", nargs="+", default=list(TOLERANCE), choices=list(TOLERANCE))
    c.add_argument("--shapes", nargs="+", type=_shape, default=[_shape(s) for s in SHAPES], metavar="B,H,Q,X:BQxBX",
                   help=f"sizes and blocks (default {' '.join(SHAPES)})")
    c.add_argument("--head-dim", type=int, help="the examples' head dim (default theirs: 64)")
    c.add_argument("--shapes-only", action="store_true",
                   help="skip the strided-view, positions and ragged-edge (inf in the next head) cases")
    k = sub.add_parser("compile", help="compile for sm_90 (no GPU needed) and count")
    k.add_argument("--examples", nargs="+", default=["causal", "attention"])
    k.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    k.add_argument("--blocks", nargs="+", default=["128x64", "128x128"])
    k.add_argument("--stages", nargs="+", type=int, default=[2, 3])
    k.add_argument("--forms", nargs="+", default=list(FORMS), choices=list(FORMS))
    k.add_argument("--warps", type=int, default=8)
    k.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    k.add_argument("--out", help="append JSON lines here")
    k.add_argument("--dump", help="write each kernel's SASS, TTGIR and PTX into this folder")
    g = sub.add_parser("time", help="on a GPU: time each form against the pointer kernel")
    g.add_argument("--examples", nargs="+", default=["causal", "attention"])
    g.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    g.add_argument("--blocks", nargs="+", default=["128x64", "128x128"])
    g.add_argument("--stages", nargs="+", type=int, default=[2, 3])
    g.add_argument("--forms", nargs="+", default=list(FORMS), choices=list(FORMS))
    g.add_argument("--seqlens", nargs="+", type=int, default=[1024, 4096, 16384])
    g.add_argument("--tokens", type=int, default=16384, help="batch = tokens // seqlen (napkin bench's h100 preset)")
    g.add_argument("--hidden", type=int, default=2048, help="heads = hidden // head dim")
    g.add_argument("--warps", type=int, default=8)
    g.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    g.add_argument("--out", help="append JSON lines here")
    t = sub.add_parser("table", help="markdown table of JSON-lines files")
    t.add_argument("files", nargs="+")
    args = p.parse_args(argv)
    return {"check": check, "compile": compile_all, "time": time_gpu, "table": table}[args.cmd](args)


if __name__ == "__main__":
    try:
        status = main()
        sys.stdout.flush()    # a closed pipe shows here, not in the interpreter's last flush
    except BrokenPipeError:   # `table ... | head`: the reader stopped reading, as napkin's CLI says it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        status = 141
    sys.exit(status)
