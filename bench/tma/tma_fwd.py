"""TMA descriptor loads in napkin's forward attention kernel: a compile-only study for sm_90.

The generated module of a diagram (examples/causal.ncd, examples/attention.ncd)
is emitted as napkin emits it; then its *forward kernel* is patched as text so
that the streamed K and V tiles (and, with ``qo``, the Q tile and the O store)
go through host-side ``triton.tools.tensor_descriptor.TensorDescriptor``s
instead of pointer arithmetic.  Nothing else changes (same blocks, same
softmax code, same masks), so a difference in the compiled code is the
loads'.  The compiler is not touched: the patch lives here.

Forms (``FORMS``):

  ptr        the generated kernel, unpatched (the baseline)
  tma4d      K, V through descriptors over the tensors' own dims [b, h, x, d],
             block [1, 1, BLOCK_x, BLOCK_d], loaded at [i_b, i_h, start, 0] and
             reshaped to [BLOCK_x, BLOCK_d]: rows past |x| are zero-filled per
             head (exactly the pointer code's other=0.0); any strides whose
             non-last entries are 16-byte multiples, d contiguous
  tma4d_qo   tma4d, plus Q loaded and O stored through 4-D descriptors (the
             TMA store clips rows past |q| of each head, like the mask)
  tma2d      K, V through 2-D descriptors over [(b h x), d] (Triton's
             fused-attention tutorial): a ragged last block reads the next
             head's first rows, so V's rows past |x| are zeroed with a select
             in the partial-block loop (K's need nothing: their scores are
             masked to -inf); needs b, h, x flattenable (contiguous [b, h, x, d])
  tma2d_raw  tma2d without that select: correct only while the neighbouring
             head's V rows are finite (0 * inf = NaN); numerics check only
  tma4d_qo_ws  tma4d_qo with the streamed loops as tl.range(..., warp_specialize=True):
             a probe of Triton's automatic warp specialisation on sm_90 (compile only)

Commands (from /work/wt-tma; keep TRITON_INTERPRET unset for ``compile``):

  # numerics under the interpreter (Triton 3.9), against the float64 reference
  PYTHONPATH=. python bench/tma/tma_fwd.py check

  # compile for sm_90 and count (Triton 3.9, then the 3.6 venv); JSON lines out
  PYTHONPATH=. python bench/tma/tma_fwd.py compile --out bench/tma/sm90-t39.jsonl
  PYTHONPATH=. /tmp/t36/venv/bin/python bench/tma/tma_fwd.py compile --out bench/tma/sm90-t36.jsonl

  # one configuration, keeping its SASS, TTGIR and PTX
  PYTHONPATH=. python bench/tma/tma_fwd.py compile --examples causal --head-dims 128 \\
      --blocks 128x64 --stages 2 --forms tma4d --dump bench/tma/build/dump

  # on an H100 (not run in this study): the launcher's own tma=True against the
  # pointer kernel (the patch above predates that option and no longer applies)
  PYTHONPATH=. python bench/tma/tma_fwd.py time --out bench/tma/h100-times.jsonl

  # the markdown table of one or more JSON-lines files
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
FORMS = ("ptr", "tma4d", "tma4d_qo", "tma2d", "tma2d_raw", "tma4d_qo_ws")


# --------------------------------------------------------------------------
# The patch.
# --------------------------------------------------------------------------

def _kernel_span(src: str, name: str) -> tuple[int, int]:
    start = src.index(f"def _{name}_kernel(")
    end = src.index("\ndef ", start + 1)
    return start, end


def _sub1(pattern: str, repl, text: str, count: int, what: str) -> str:
    new, n = re.subn(pattern, repl, text, flags=re.MULTILINE)
    if n != count and not (count == -1 and n > 0):
        raise RuntimeError(f"patch {what}: expected {count} match(es), found {n}")
    return new


def patch(src: str, name: str, form: str) -> str:
    """The module text ``src`` with its forward kernel ``_{name}_kernel``
    loading through descriptors of ``form``."""
    if form == "ptr":
        return src
    four = form.startswith("tma4d")
    ws = form.endswith("_ws")
    form = form.removesuffix("_ws")
    a, b = _kernel_span(src, name)
    k = src[a:b]
    # Descriptor parameters after the tensors.
    k = _sub1(r"^    lse,\n", "    lse,\n    _tQ,\n    _tK,\n    _tV,\n    _tO,\n", k, 1, "signature")
    ib, ih = "_i_b.to(tl.int32)", "_i_h.to(tl.int32)"
    if not four:   # the first row of this head in the flattened [(b h x), d] / [(b h q), d]
        k = _sub1(r"^(    _offs_d = tl\.arange\(0, _BLOCK_d\)\n)",
                  r"\1    _krow = ((_i_b * _size_h + _i_h) * _size_x).to(tl.int32)\n", k, 1, "rows")
    for t in "KV":
        if four:
            load = f"_t{t}.load([{ib}, {ih}, _start, 0]).reshape(_BLOCK_x, _BLOCK_d)"
        else:
            load = f"_t{t}.load([_krow + _start, 0])"
        k = _sub1(rf"^(\s*)_{t} = tl\.load\({t} \+ .*\)$", rf"\1_{t} = {load}", k, 2, f"{t} loads")
    if form == "tma2d":   # rows past |x| in the ragged block belong to the next head: zero V's
        # the partial-block loop's load is the one under `if _live:` (12 spaces in)
        k = _sub1(r"^(            )(_V = _tV\.load\(\[_krow \+ _start, 0\]\))$",
                  r"\1\2\n\1_V = tl.where(_ok_x[:, None], _V, 0.0)", k, 1, "V select")
    if form == "tma4d_qo":
        k = _sub1(r"^(\s*)_Q = tl\.load\(Q \+ .*\)$",
                  rf"\1_Q = _tQ.load([{ib}, {ih}, _row0, 0]).reshape(_BLOCK_q, _BLOCK_d)", k, 1, "Q load")
        k = _sub1(r"^(\s*)tl\.store\(O \+ .*\)$",
                  rf"\1_tO.store([{ib}, {ih}, _row0, 0], _out_O.to(O.dtype.element_ty).reshape(1, 1, _BLOCK_q, _BLOCK_d))",
                  k, 1, "O store")
    if ws:   # Triton's automatic warp specialisation of the streamed loops (a producer warp for TMA)
        k = _sub1(r"^(    for _start in )range\((.*)\):$", r"\1tl.range(\2, warp_specialize=True):", k, -1, "ws")
    src = src[:a] + k + src[b:]
    src = _sub1(rf"(_{name}_kernel\[_grid\]\(\n\s*Q, K, V, O, lse,)", r"\1 *_tma_args(Q, K, V, O, _br, _bc),",
                src, 1, "launch")
    return src + _LAUNCH.replace("@FORM@", form)   # form without _ws: the same descriptors


_LAUNCH = '''

# ---------------------------------------------------------------------------
# bench/tma/tma_fwd.py: host-side TMA descriptors for the forward kernel.
# ---------------------------------------------------------------------------
_TMA_FORM = "@FORM@"


def _tma_args(Q, K, V, O, br, bc):
    """(Q, K, V, O descriptors or None) for the form.  TensorDescriptor asserts
    what TMA needs: base 16-byte aligned, every stride but the last a multiple
    of 16 bytes, the last stride 1; a launcher would fall back to pointers."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    bd = _dim_block(Q.shape[-1])
    if _TMA_FORM.startswith("tma4d"):
        def desc(t, rows):
            return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, bd])
        qo = _TMA_FORM == "tma4d_qo"
        return (desc(Q, br) if qo else None, desc(K, bc), desc(V, bc), desc(O, br) if qo else None)

    def flat(t, rows):
        if not t.is_contiguous():
            raise ValueError("the 2-D form needs contiguous [b, h, x, d]")
        f = t.reshape(-1, t.shape[-1])
        return TensorDescriptor(f, list(f.shape), list(f.stride()), [rows, bd])
    return (None, flat(K, bc), flat(V, bc), None)
'''


def generated(example: str, head_dim: int | None, dtype: str) -> tuple[str, str]:
    """(diagram name, the module text napkin emits) for examples/<example>.ncd."""
    import napkin
    from napkin.bench.harness import variant
    from napkin.codegen import emit_module

    path = ROOT / "examples" / f"{example}.ncd"
    diagram, text = variant(napkin.load(str(path)), path.read_text(), dtype, head_dim)
    return diagram.name, emit_module(diagram, source_text=text, source_path=str(path))


def load(example: str, head_dim: int | None, dtype: str, form: str):
    """The (patched) module, imported from BUILD under a name of its own."""
    import importlib.util

    name, src = generated(example, head_dim, dtype)
    src = patch(src, name, form)
    tag = "interp" if os.environ.get("TRITON_INTERPRET") == "1" else "jit"
    mod_name = f"tma_{example}_{head_dim or 'd'}_{dtype}_{form}_{tag}"
    BUILD.mkdir(parents=True, exist_ok=True)
    target = BUILD / f"{mod_name}.py"
    target.write_text(src)
    spec = importlib.util.spec_from_file_location(mod_name, target)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    spec.loader.exec_module(module)
    return name, module


# --------------------------------------------------------------------------
# Numerics under the interpreter.
# --------------------------------------------------------------------------

def check(args) -> int:
    import torch

    failed = 0
    for example in args.examples:
        for dtype, tol in ((torch.float16, 2e-3), (torch.float32, 1e-5)):
            mods = {f: load(example, None, "float16", f) for f in FORMS if not f.endswith("_ws")}
            name = mods["ptr"][0]
            for (b, h, q, x), (bq, bx) in (((2, 3, 100, 100), (32, 16)), ((1, 2, 37, 77), (16, 32)),
                                           ((1, 2, 64, 64), (32, 32))):
                Q, K, V = mods["ptr"][1].example_inputs({"b": b, "h": h, "q": q, "x": x}, dtype=dtype)
                ref = mods["ptr"][1].reference(Q.double(), K.double(), V.double())
                base = None
                for form, (_, mod) in mods.items():
                    out = getattr(mod, name)(Q, K, V, block_q=bq, block_x=bx)
                    err = max((o.double() - r).abs().max().item() for o, r in zip(out, ref))
                    same = "" if base is None else \
                        ("  bitwise = ptr" if all(torch.equal(o, p) for o, p in zip(out, base)) else "  differs from ptr")
                    base = base or out
                    ok = err <= tol
                    failed += not ok
                    print(f"{example:9s} {str(dtype):13s} b,h,q,x={b},{h},{q},{x} blocks {bq}x{bx} {form:9s} "
                          f"max|err| {err:.2e} {'ok' if ok else 'FAIL'}{same}")
            # Strided [b, x, h, d] views (a fused qkv projection's layout): the 4-D form takes them.
            Q, K, V = (t.transpose(1, 2).contiguous().transpose(1, 2)
                       for t in mods["ptr"][1].example_inputs({"b": 2, "h": 3, "q": 100, "x": 100}, dtype=dtype))
            ref = mods["ptr"][1].reference(Q.double(), K.double(), V.double())
            for form in ("tma4d", "tma4d_qo"):
                out = getattr(mods[form][1], name)(Q, K, V, block_q=32, block_x=16)
                err = max((o.double() - r).abs().max().item() for o, r in zip(out, ref))
                failed += err > tol
                print(f"{example:9s} {str(dtype):13s} strided [b,x,h,d] view       {form:9s} max|err| {err:.2e} "
                      f"{'ok' if err <= tol else 'FAIL'}")
            # Rows at global positions (a ring-attention shard): loads stay at local rows, so the
            # descriptors change nothing; compared with the pointer kernel (the reference has no positions).
            Q, K, V = mods["ptr"][1].example_inputs({"b": 1, "h": 2, "q": 100, "x": 90}, dtype=dtype)
            pos = {"positions": {"q": torch.arange(100) + 40, "x": torch.arange(90) * 2},
                   "lengths": {"q": 140, "x": 180}}
            base = getattr(mods["ptr"][1], name)(Q, K, V, block_q=32, block_x=16, **pos)
            for form in ("tma4d", "tma4d_qo", "tma2d"):
                out = getattr(mods[form][1], name)(Q, K, V, block_q=32, block_x=16, **pos)
                same = all(torch.equal(o, p) for o, p in zip(out, base))
                failed += not same
                print(f"{example:9s} {str(dtype):13s} positions/lengths (q+40, 2x)      {form:9s} "
                      f"{'bitwise = ptr ok' if same else 'differs from ptr FAIL'}")
            # The 2-D form's ragged end: head 1's V holds an inf in row 0; head 0's last block reads it.
            Q, K, V = mods["ptr"][1].example_inputs({"b": 1, "h": 2, "q": 100, "x": 100}, dtype=dtype)
            V[0, 1, 0, 0] = float("inf")
            ref = mods["ptr"][1].reference(Q.double(), K.double(), V.double())
            for form in ("ptr", "tma4d", "tma2d", "tma2d_raw"):
                out = getattr(mods[form][1], name)(Q, K, V, block_q=32, block_x=32)
                head0 = (out[0][0, 0].double() - ref[0][0, 0]).abs().max().item()
                nan0 = bool(torch.isnan(out[0][0, 0]).any())
                bad = nan0 or head0 > tol
                expected_bad = form == "tma2d_raw"
                failed += bad != expected_bad
                print(f"{example:9s} {str(dtype):13s} inf in head 1's V row 0, head 0's O {form:9s} "
                      f"max|err| {head0:.2e} NaN {nan0}  {'(expected: no select)' if expected_bad else ''}"
                      f"{'ok' if bad == expected_bad else 'FAIL'}")
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
    import torch
    from napkin.bench import aot

    name, mod = load(example, head_dim, dtype, form)
    mod._check_device = lambda device: None
    sizes = {"b": aot.OTHER_SIZE, "h": aot.OTHER_SIZE, "q": aot.DEFAULT_SIZE, "x": aot.DEFAULT_SIZE}
    inputs = mod.example_inputs(sizes, dtype=getattr(torch, dtype), device="cpu", seed=0)
    with aot._compiling_for(90) as compiled:
        getattr(mod, name)(*inputs, block_q=bq, block_x=bx, num_warps=warps, num_stages=stages)
    (kname, kernel), = compiled
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
    import triton
    return {"triton": triton.__version__, "example": example, "head_dim": head_dim, "dtype": dtype, "form": form,
            "block_q": bq, "block_x": bx, "num_warps": warps, "num_stages": stages,
            "shared": rep.shared, "registers": rep.registers, "spill_stores": rep.spill_stores,
            "spill_loads": rep.spill_loads, "wgmma": rep.wgmma, "cp_async": rep.cp_async, "tma": rep.tma,
            "ptx_tma_store": kernel.asm["ptx"].count("cp.async.bulk.tensor") - len(
                re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::cluster\.global", kernel.asm["ptx"])),
            "sass": sass_counts(sass),
            "ttgir": {k: len(re.findall(p, ttgir)) for k, p in TTGIR_OPS.items()}}


def compile_all(args) -> int:
    if os.environ.get("TRITON_INTERPRET"):
        print("unset TRITON_INTERPRET for compile", file=sys.stderr)
        return 2
    out = open(args.out, "a") if args.out else None
    for example in args.examples:
        for hd in args.head_dims:
            for blk in args.blocks:
                bq, bx = map(int, blk.split("x"))
                for stages in args.stages:
                    for form in args.forms:
                        try:
                            row = compile_one(example, hd, args.dtype, form, bq, bx, args.warps, stages, args.dump)
                        except Exception as err:      # record the error text and go on
                            import triton
                            row = {"triton": triton.__version__, "example": example, "head_dim": hd, "form": form,
                                   "block_q": bq, "block_x": bx, "num_warps": args.warps, "num_stages": stages,
                                   "dtype": args.dtype, "error": f"{type(err).__name__}: {str(err)[-2000:]}"}
                        line = json.dumps(row)
                        print(_short(row), flush=True)
                        if out:
                            out.write(line + "\n")
                            out.flush()
    return 0


def _short(r: dict) -> str:
    head = (f"triton {r['triton']} {r['example']} d={r['head_dim']} {r['block_q']}x{r['block_x']} "
            f"s{r['num_stages']} {r['form']}")
    if "error" in r:
        return head + "  ERROR " + r["error"].splitlines()[0][:200]
    s = r["sass"]
    loops = "/".join(str(l["total"]) for l in s["loops"])
    return (f"{head}: regs {r['registers']} spill {r['spill_stores']}/{r['spill_loads']} smem {r['shared']} "
            f"wgmma {r['wgmma']} cp.async {r['cp_async']} tma {r['tma']} | SASS {s['total']} loops {loops} "
            f"LDGSTS {s['LDGSTS']} UTMALDG {s['UTMALDG']} UTMASTG {s['UTMASTG']} LDS {s['LDS']} LDSM {s['LDSM']} "
            f"IMAD {s['IMAD']} IADD3 {s['IADD3']} | ttgir {r['ttgir']}")


def table(args) -> int:
    rows = [json.loads(l) for f in args.files for l in Path(f).read_text().splitlines() if l.strip()]
    cols = ["Triton", "ex", "d", "blocks", "st", "form", "regs", "spill", "smem KiB", "wgmma", "cp.async",
            "TMA ptx", "SASS", "loop(s)", "LDGSTS", "UTMALDG", "UTMASTG", "LDS/LDSM", "IMAD+IADD3+LEA", "loop IMAD+IADD3+LEA",
            "cvt_layout"]
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
        print("| " + " | ".join(head + [
            str(r["registers"]), f"{r['spill_stores']}/{r['spill_loads']}", f"{r['shared'] / 1024:.0f}",
            str(r["wgmma"]), str(r["cp_async"]), str(r["tma"]), str(s["total"]), la, str(s["LDGSTS"]),
            str(s["UTMALDG"]), str(s["UTMASTG"]), f"{s['LDS']}/{s['LDSM']}",
            str(s["IMAD"] + s["IADD3"] + s["LEA"]), laddr, str(r["ttgir"]["convert_layout"])]) + " |")
    return 0


# napkin's launcher has had a tma= option since this study (napkin/codegen/tma.py:
# descriptors for Q, K, V and O, this study's tma4d_qo), so the patch above no
# longer applies to what it emits; `time` runs the launcher unpatched, with
# tma=False (the pointer kernel) and tma=True.
TIME_FORMS = {"ptr": False, "tma": True}


def time_rows(args, device: str, bench):
    """The rows of ``time``: each form (TIME_FORMS) of the generated
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
            name, mod = load(example, hd, args.dtype, "ptr")
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
                                                          num_stages=stages, tma=TIME_FORMS[form])
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
    c = sub.add_parser("check", help="numerics under TRITON_INTERPRET=1")
    c.add_argument("--examples", nargs="+", default=["causal", "attention"])
    k = sub.add_parser("compile", help="compile for sm_90 and count")
    k.add_argument("--examples", nargs="+", default=["causal", "attention"])
    k.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    k.add_argument("--blocks", nargs="+", default=["128x64", "128x128"])
    k.add_argument("--stages", nargs="+", type=int, default=[2, 3])
    k.add_argument("--forms", nargs="+", default=["ptr", "tma4d", "tma4d_qo", "tma2d"], choices=FORMS)
    k.add_argument("--warps", type=int, default=8)
    k.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    k.add_argument("--out", help="append JSON lines here")
    k.add_argument("--dump", help="write each kernel's SASS, TTGIR and PTX into this folder")
    g = sub.add_parser("time", help="on a GPU: time each form against the pointer kernel")
    g.add_argument("--examples", nargs="+", default=["causal", "attention"])
    g.add_argument("--head-dims", nargs="+", type=int, default=[64, 128])
    g.add_argument("--blocks", nargs="+", default=["128x64", "128x128"])
    g.add_argument("--stages", nargs="+", type=int, default=[2, 3])
    g.add_argument("--forms", nargs="+", default=list(TIME_FORMS), choices=list(TIME_FORMS))
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
    sys.exit(main())
