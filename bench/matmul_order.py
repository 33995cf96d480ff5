"""A contraction kernel's program order, timed: generated/matmul.py (examples/matmul.ncd)
forward and backward with its programs in one group (the plain order, row blocks
fastest), in groups of 4 row blocks (napkin's default, tiling.GROUP_ROWS) and of 8
(Triton's tutorial's), against torch.matmul; beside each, the bytes the cost pass's
L2 model says reach DRAM in that order (docs/cost.md, "DRAM estimate").

    python bench/matmul_order.py [--sizes 4096,8192] [--groups 0,4,8] [--out DIR]

Sizes are m = n = k = N; group 0 is the plain order.  On a GPU: bf16, each result
checked against torch.matmul before it is timed, triton.testing.do_bench medians
(napkin.bench.timing), TFLOP/s of 2 N^3 forward and 4 N^3 backward (dA and dB).
Without one, a smoke under TRITON_INTERPRET=1: fp32 at ragged sizes (default 150),
checked the same way; its times are the interpreter's, not performance numbers.
Writes matmul-order-DEVICE-DATE.json and .md under --out (default bench/results).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PLAIN = 2 ** 30   # one group holds every row block: the plain order (tiling.grouped_program)


def sizes_list(text: str) -> list[int]:
    return [int(s[:-1]) * 1024 if s.endswith("K") else int(s) for s in text.split(",") if s]


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
    """One row: the order's forward and backward checked against torch.matmul, then timed."""
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
        errors = {"C": (c.double() - want).abs().max().item() / want.abs().max().item(),
                  "dA": (da.double() - dc.double() @ b.detach().double().T).abs().max().item(),
                  "dB": (db.double() - a.detach().double().T @ dc.double()).abs().max().item()}
        errors["dA"] /= (dc.double() @ b.detach().double().T).abs().max().item()
        errors["dB"] /= (a.detach().double().T @ dc.double()).abs().max().item()
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=None, help="N for m = n = k (default 4096,8192; smoke 150)")
    p.add_argument("--groups", default="0,4,8", help="row blocks a group, 0 = the plain order (default 0,4,8)")
    p.add_argument("--reps", type=int, default=3, help="CPU smoke: calls timed (default 3)")
    p.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = p.parse_args(argv)

    import torch
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton

    import generated.matmul as mm

    smoke = not cuda
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    sizes = sizes_list(args.sizes or ("150" if smoke else "4096,8192"))
    groups = [int(g) for g in args.groups.split(",")]
    rows = []
    for n in sizes:
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
            "dtype": str(dtype).replace("torch.", ""),
            "versions": {"torch": torch.__version__, "triton": triton.__version__},
            "timing": "CPU smoke under TRITON_INTERPRET=1: NOT a performance number" if smoke
            else "triton.testing.do_bench median", "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"matmul-order-{re.sub(r'[^a-z0-9]+', '-', data['device'].lower()).strip('-')}-{data['date']}"
    (out / f"{stem}.json").write_text(json.dumps(data, indent=1) + "\n")
    (out / f"{stem}.md").write_text(markdown(data))
    print(markdown(data))
    return 0


def markdown(data: dict) -> str:
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
