"""A matrix product's speed on a GPU: its program order, and its fp8 and int8 paths.

The order: generated/matmul.py (examples/matmul.ncd), forward and backward, with its
programs in one group (the plain order, row blocks fastest), in groups of 4 row blocks
(napkin's default, tiling.GROUP_ROWS) and of 8 (Triton's tutorial's), against
torch.matmul; beside each, the bytes the cost pass's L2 model says reach DRAM in that
order (docs/cost.md, "DRAM estimate").  TFLOP/s of 2 N^3 forward, 4 N^3 backward.

--fp8: an e4m3 product with per-row and per-column scales and a bf16 output (FP8
below: language.md's fp8_linear in 128 x 128 tiles by 64 of k), forward only, against
torch._scaled_mm given the same scales (cuBLAS's fp8 GEMM; where this torch has none
for the device, its row says why) and torch.matmul in bf16.

--int8: the same product of int8 factors (language.md's int8_linear: an int32 sum,
then the scales), against torch._int_mm (cuBLAS's int8 GEMM) scaled in torch, and
torch.matmul in bf16.

    python bench/matmul_order.py [--sizes 4096,8192] [--groups 0,4,8] [--out DIR]
    python bench/matmul_order.py --fp8 [--sizes 4096,8192] [--out DIR]
    python bench/matmul_order.py --int8 [--sizes 4096,8192] [--out DIR]

Sizes are m = n = k = N; group 0 is the plain order.  On a GPU: bf16 (fp8 or int8
with --fp8 or --int8), each result checked against float64 before it is timed,
triton.testing.do_bench medians (napkin.bench.timing).  Without one, a smoke under
TRITON_INTERPRET=1, fp32 (e4m3 or int8) at ragged sizes (default 150), checked the
same way; its times are the interpreter's, not performance numbers.  Writes
matmul-order-DEVICE-DATE.json and .md (matmul-fp8-... or matmul-int8-...) under --out
(default bench/results).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PLAIN = 2 ** 30   # one group holds every row block: the plain order (tiling.grouped_program)

FP8 = """diagram fp8_linear
wire m, n, k
in A[m, k] : e4m3
in B[k, n] : e4m3
in sa[m] : fp32
in sb[n] : fp32
C[m, n] : bf16 = sum[k](A * B) * sa * sb
out C
schedule on h100 {
  accumulate fp32
  level hbm { hold A, B, sa, sb, C }
  level smem { group m by 128, n by 128
    stream k by 64 }
}
"""

# the same product of int8 factors: tl.dot's int8 path, an exact int32 sum
INT8 = FP8.replace("diagram fp8_linear", "diagram int8_linear").replace(": e4m3", ": int8")
BASELINE = {"fp8": "torch._scaled_mm", "int8": "torch._int_mm, scaled"}


def predicted_dram(n: int, group: int) -> dict:
    """The L2 model's bytes reaching DRAM, forward and backward, at m = n = k = N."""
    import napkin
    from napkin import tiling
    from napkin.cost import analyse, backward_cost

    d = napkin.load(str(REPO / "examples" / "matmul.ncd"))
    sizes = {"m": n, "n": n, "k": n}
    kept, tiling.GROUP_ROWS = tiling.GROUP_ROWS, group or PLAIN
    try:
        return {"forward": analyse(d, sizes).totals[0].dram_bytes, "backward": backward_cost(d, sizes).dram_bytes}
    finally:
        tiling.GROUP_ROWS = kept


def measure(mm, n: int, group: int, dtype, device: str, reps: int) -> dict:
    """One row: the order's forward and backward checked against float64, then timed."""
    import torch
    from napkin.bench import timing

    g = torch.Generator(device="cpu").manual_seed(n)
    a, b, dc = (torch.randn(shape, generator=g).to(device=device, dtype=dtype)
                for shape in ((n, n), (n, n), (n, n)))
    a.requires_grad_(), b.requires_grad_()
    kept, mm._GROUP_ROWS = mm._GROUP_ROWS, group or PLAIN
    try:
        c = mm.matmul(a, b)
        want = a.detach().double() @ b.detach().double()
        da, db = torch.autograd.grad(c, (a, b), dc, retain_graph=True)
        exact = {"C": want, "dA": dc.double() @ b.detach().double().T, "dB": a.detach().double().T @ dc.double()}
        errors = {k: ((got.double() - exact[k]).abs().max() / exact[k].abs().max()).item()
                  for k, got in (("C", c), ("dA", da), ("dB", db))}
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        bad = {k: v for k, v in errors.items() if not v <= tol}
        if bad:
            raise AssertionError(f"N={n}, group {group}: error relative to the largest entry {bad} over {tol}")
        fwd = timing.ms(lambda: mm.matmul(a, b), device, reps)
        bwd = timing.ms(lambda: torch.autograd.grad(c, (a, b), dc, retain_graph=True), device, reps)
    finally:
        mm._GROUP_ROWS = kept
    return {"n": n, "group": group, "forward_ms": fwd, "backward_ms": bwd, "errors": errors}


def torch_row(n: int, dtype, device: str, reps: int) -> dict:
    import torch
    from napkin.bench import timing

    a, b, dc = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(3))
    a.requires_grad_(), b.requires_grad_()
    c = a @ b
    return {"n": n, "group": None, "forward_ms": timing.ms(lambda: a @ b, device, reps),
            "backward_ms": timing.ms(lambda: torch.autograd.grad(c, (a, b), dc, retain_graph=True), device, reps)}


def quantised_rows(kind: str, n: int, device: str, reps: int, build: Path) -> list[dict]:
    """The ``kind`` ("fp8" or "int8") product at m = n = k = N: napkin's kernel, cuBLAS's
    (BASELINE) and torch.matmul in bf16, each of the first two checked against float64 of the
    same 8-bit values first (napkin's: each entry within one bf16 unit of its own)."""
    import torch
    import napkin
    from napkin.bench import harness, timing

    text, name = (FP8, "fp8_linear") if kind == "fp8" else (INT8, "int8_linear")
    m, _ = harness.compile_module(napkin.load_text(text, f"{name}.ncd"), text, f"{name}.ncd", build,
                                  f"napkin_matmul_{kind}")
    g = torch.Generator(device="cpu").manual_seed(n)
    if kind == "fp8":
        a, b = (torch.randn(n, n, generator=g).to(device=device, dtype=torch.float8_e4m3fn) for _ in range(2))
    else:
        a, b = (torch.randint(-128, 128, (n, n), generator=g, dtype=torch.int8).to(device) for _ in range(2))
    sa, sb = ((torch.rand(n, generator=g) + 0.5).to(device) for _ in range(2))
    want = (a.double() @ b.double()) * sa.double()[:, None] * sb.double()

    def checked(impl, fn) -> dict:
        got = fn().double()
        error = ((got - want).abs().max() / want.abs().max()).item()
        # napkin's: each entry within one bf16 unit of its own (an exact sum, rounded once or twice)
        if impl.startswith("napkin") and not ((got - want).abs() <= 2 ** -7 * want.abs() + 1e-30).all():
            raise AssertionError(f"N={n}, {impl}: an entry is more than one bf16 unit off (max {error:.3g} "
                                 "of the largest)")
        if error > 2 ** -7:   # a baseline's, against the largest entry: it is not timed, and says so
            return {"n": n, "impl": impl, "ms": None, "error": f"check failed: max error {error:.3g} of the largest"}
        return {"n": n, "impl": impl, "ms": timing.ms(fn, device, reps), "relative_error": error}

    rows = [checked(f"napkin {kind}", lambda: getattr(m, name)(a, b, sa, sb))]
    try:
        if kind == "fp8":
            bt = b.t().contiguous().t()   # column-major, as cuBLAS's fp8 GEMM takes its second factor
            rows.append(checked(BASELINE[kind], lambda: torch._scaled_mm(
                a, bt, scale_a=sa[:, None].contiguous(), scale_b=sb[None, :].contiguous(), out_dtype=torch.bfloat16)))
        else:   # the int32 product, then the scales as eager torch would apply them
            rows.append(checked(BASELINE[kind], lambda: (torch._int_mm(a, b) * sa[:, None] * sb).to(torch.bfloat16)))
    except (RuntimeError, TypeError, AttributeError, NotImplementedError) as err:
        rows.append({"n": n, "impl": BASELINE[kind], "ms": None, "error": f"{type(err).__name__}: {err}"[:200]})
    a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
    rows.append({"n": n, "impl": "torch.matmul bf16", "ms": timing.ms(lambda: a16 @ b16, device, reps)})
    for r in rows:
        r["tflops"] = 2 * n ** 3 / r["ms"] / 1e9 if r["ms"] else None
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=None, help="N for m = n = k (default 4096,8192; smoke 150)")
    p.add_argument("--groups", default="0,4,8", help="row blocks a group, 0 = the plain order (default 0,4,8)")
    p.add_argument("--reps", type=int, default=3, help="CPU smoke: calls timed (default 3)")
    kinds = p.add_mutually_exclusive_group()
    kinds.add_argument("--fp8", action="store_true", help="an e4m3 product against torch._scaled_mm instead")
    kinds.add_argument("--int8", action="store_true", help="an int8 product against torch._int_mm instead")
    p.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = p.parse_args(argv)

    import torch
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton

    import generated.matmul as mm
    from napkin.bench import harness, results

    smoke = not cuda
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    sizes = harness.parse_list(args.sizes or ("150" if smoke else "4096,8192"), "sizes")
    groups = [int(g) for g in args.groups.split(",")]
    rows = []
    kind = "fp8" if args.fp8 else "int8" if args.int8 else "order"
    if kind != "order":
        import tempfile

        with tempfile.TemporaryDirectory(prefix=f"napkin-{kind}-") as build:
            for n in sizes:
                rows += quantised_rows(kind, n, device, args.reps, Path(build))
    for n in sizes if kind == "order" else ():
        base = torch_row(n, dtype, device, args.reps)
        rows.append({**base, "impl": "torch.matmul"})
        for group in groups:
            row = measure(mm, n, group, dtype, device, args.reps)
            dram = predicted_dram(n, group)
            rows.append({**row, "impl": "napkin", "dram_forward": dram["forward"], "dram_backward": dram["backward"],
                         "forward_tflops": 2 * n ** 3 / row["forward_ms"] / 1e9,
                         "backward_tflops": 4 * n ** 3 / row["backward_ms"] / 1e9,
                         "forward_vs_torch": base["forward_ms"] / row["forward_ms"],
                         "backward_vs_torch": base["backward_ms"] / row["backward_ms"]})
    data = {"date": datetime.date.today().isoformat(), "smoke": smoke,
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "command": "python bench/matmul_order.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "dtype": {"fp8": "float8_e4m3fn", "int8": "int8"}.get(kind, str(dtype).replace("torch.", "")),
            "versions": {"torch": torch.__version__, "triton": triton.__version__},
            "timing": "CPU smoke under TRITON_INTERPRET=1: NOT a performance number" if smoke
            else "triton.testing.do_bench median", "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data["kind"] = kind
    stem = f"matmul-{kind}-{results.slug(data['device'])}-{data['date']}"
    (out / f"{stem}.json").write_text(json.dumps(data, indent=1) + "\n")
    (out / f"{stem}.md").write_text(markdown(data))
    print(markdown(data))
    return 0


def markdown(data: dict) -> str:
    if data["kind"] != "order":
        what = "An e4m3" if data["kind"] == "fp8" else "An int8"
        lines = [f"# {what} product, scaled per row and column, bf16 out ({data['device']}, {data['date']})", "",
                 f"`{data['command']}`; {data['timing']}; torch {data['versions']['torch']}, triton "
                 f"{data['versions']['triton']}.", "", "| N | impl | ms | TFLOP/s | note |", "|---|---|---|---|---|"]
        for r in data["rows"]:
            ms = "" if r["ms"] is None else f"{r['ms']:.4g}"
            tf = "" if r.get("tflops") is None else f"{r['tflops']:.4g}"
            note = r.get("error") or ("" if "relative_error" not in r else
                                     f"checked: max error {r['relative_error']:.2g} of the largest entry")
            lines.append(f"| {r['n']} | {r['impl']} | {ms} | {tf} | {note} |")
        return "\n".join(lines) + "\n"
    lines = [f"# A contraction's program order: examples/matmul.ncd against torch.matmul ({data['device']}, "
             f"{data['date']})", "", f"`{data['command']}`; {data['dtype']}; {data['timing']}; torch "
             f"{data['versions']['torch']}, triton {data['versions']['triton']}.  Group 0: the plain order.", "",
             "| N | impl | group | fwd ms | fwd TFLOP/s | fwd vs torch | bwd ms | bwd TFLOP/s | bwd vs torch "
             "| model DRAM fwd | model DRAM bwd |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        if r["impl"] == "torch.matmul":
            lines.append(f"| {r['n']} | torch.matmul | | {r['forward_ms']:.4g} | | | {r['backward_ms']:.4g} | | | | |")
        else:
            lines.append(f"| {r['n']} | napkin | {r['group']} | {r['forward_ms']:.4g} | {r['forward_tflops']:.4g} "
                         f"| {r['forward_vs_torch']:.3f} | {r['backward_ms']:.4g} | {r['backward_tflops']:.4g} "
                         f"| {r['backward_vs_torch']:.3f} | {r['dram_forward'] / 1e9:.3g} GB "
                         f"| {r['dram_backward'] / 1e9:.3g} GB |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
