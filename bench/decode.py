"""Decoding on one GPU: a few query rows against a long key/value cache,
napkin's chunked forward (flash-decoding, examples/flash_decoding.ncd) at
several chunk lengths against the unchunked kernel, FlexAttention (the
diagram's own mask_mod, napkin.bench.flex; compiled on a GPU) and torch's SDPA.
Each napkin configuration runs twice: as the example schedules it, its 4
query heads packed into the rows of one program (impl "napkin"), and with
`group g by 1, q by 16`, one program per query head ("napkin-unpacked"):
what packing buys.

    python bench/decode.py [--cache 8K,32K,128K] [--queries 1,4] [--batch 1,8] [--chunks 0,512,1024,4096]
    python bench/decode.py --ragged [...]

--ragged: examples/ragged_decode.ncd instead, a batch whose caches are filled
to their own lengths n[b] (the module's example_inputs draws them in 1..|x|,
seed 0; each point's lengths are in the record).  napkin's loops read each
sequence's length at every call (no prepass), so a call's lengths may be any;
FlexAttention's block mask is built from the lengths, so it is timed twice:
"flex", the mask built once outside the timed call (a step whose lengths did
not change), and "flex-step", the mask rebuilt inside it (create_block_mask
compiled too on a GPU), what a decode loop pays when every step adds a key.
SDPA gets the lengths' bool mask, built outside the timed call.

Every napkin and Flex configuration is checked against the float64
reference (the diagram's own, at the call's sizes) before it is timed; SDPA
is a speed reference: with one query row the decode mask is all true, so SDPA runs
unmasked (GQA through enable_gqa); with more rows it gets the mask as a bool
tensor.  On a GPU: triton.testing.do_bench medians, bf16, 8 kv heads x 4
query heads each, head dim 128.  Without one: a smoke run at tiny sizes
under TRITON_INTERPRET=1 (fp32), whose times mean nothing.  Writes
decode-DEVICE-DATE.json and .md under --out (default bench/results).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

DIAGRAM = REPO / "examples" / "flash_decoding.ncd"
RAGGED = REPO / "examples" / "ragged_decode.ncd"
UNPACKED = ("g by 4, q by 4", "g by 1, q by 16")   # the schedule's packed rows -> one program per head
HKV, GROUP, HEAD_DIM = 8, 4, 128


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", default=None, help="cache lengths |x| (default 8K,32K,128K; smoke 300)")
    p.add_argument("--queries", default=None, help="query rows |q| (default 1,4; smoke 3)")
    p.add_argument("--batch", default=None, help="batch sizes (default 1,8, --ragged 8; smoke 1, --ragged 3)")
    p.add_argument("--chunks", default=None, help="chunk= values, 0 = unchunked (default 0,512,1024,2048,4096; "
                                                 "smoke 0,64)")
    p.add_argument("--ragged", action="store_true",
                   help="examples/ragged_decode.ncd: each sequence's cache filled to its own length")
    p.add_argument("--out", default=str(REPO / "bench" / "results"))
    args = p.parse_args(argv)

    import torch
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton

    import napkin
    from napkin.bench import flex, harness
    from napkin.bench.checks import max_abs_error
    from napkin.errors import NapkinError

    smoke = not cuda
    def sizes_list(text: str, what: str, least: int = 1) -> list[int]:
        try:
            return harness.parse_list(text, what, least=least)
        except NapkinError as err:
            raise SystemExit(f"bench/decode.py: {err.messages[0]}") from None

    caches = sizes_list(args.cache or ("300" if smoke else "8K,32K,128K"), "cache")
    queries = sizes_list(args.queries or ("3" if smoke else "1,4"), "queries")
    batches = sizes_list(args.batch or {(True, False): "1", (False, False): "1,8", (True, True): "3",
                                        (False, True): "8"}[smoke, args.ragged], "batch")
    chunks = sizes_list(args.chunks or ("0,64" if smoke else "0,512,1024,2048,4096"), "chunks", least=0)
    dtype, device = (torch.float32, "cpu") if smoke else (torch.bfloat16, "cuda")
    hkv, group = (2, 2) if smoke else (HKV, GROUP)
    opts = {"block_q": 16, "block_x": 16} if smoke else {}

    path = RAGGED if args.ragged else DIAGRAM
    text = path.read_text()
    diagram, text = harness.variant(napkin.load(str(path)), text, "bfloat16" if cuda else "float16",
                                    None if smoke else HEAD_DIM)
    rows = []
    data = {"date": datetime.date.today().isoformat(), "smoke": smoke,
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "command": "python bench/decode.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "diagram": f"examples/{path.name}", "lengths": {} if args.ragged else None,
            "heads": {"kv": hkv, "per_kv": group}, "head_dim": HEAD_DIM if not smoke else 128,
            "dtype": str(dtype).replace("torch.", ""),
            "versions": {"torch": torch.__version__, "triton": triton.__version__},
            "timing": "CPU smoke under TRITON_INTERPRET=1: NOT a performance number" if smoke
            else "triton.testing.do_bench median", "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"decode-{'ragged-' if args.ragged else ''}{re.sub(r'[^a-z0-9]+', '-', data['device'].lower()).strip('-')}-{data['date']}"
    points = [(b, q, x) for b in batches for q in queries for x in caches]
    flex_module = flex.load(diagram)   # the diagram's FlexAttention equivalent (mask_mod, enable_gqa)
    with tempfile.TemporaryDirectory(prefix="napkin-decode-") as build:
        m, _ = harness.compile_module(diagram, text, str(path), Path(build), "napkin_decode")
        assert UNPACKED[0] in text, f"{data['diagram']} no longer packs its heads as bench/decode.py expects"
        unpacked_text = text.replace(*UNPACKED)
        unpacked, _ = harness.compile_module(napkin.load_text(unpacked_text, str(path)), unpacked_text,
                                             str(path), Path(build), "napkin_decode_unpacked")
        for done, (b, q, x) in enumerate(points, 1):
            sizes = {"b": b, "hk": hkv, "g": group, "q": q, "x": x}
            inputs = m.example_inputs(sizes, dtype=dtype, device=device, seed=0)   # Q, K, V (, n)
            Q, K, V = inputs[:3]
            if args.ragged:
                data["lengths"][f"{b},{q},{x}"] = inputs[3].tolist()
            want = m.reference(*(t.double() if t.is_floating_point() else t for t in inputs))[0]
            for impl, module in (("napkin", m), ("napkin-unpacked", unpacked)):
                attend = getattr(module, diagram.name)
                for chunk in chunks:
                    fn = lambda: attend(*inputs, chunk=chunk, **opts)  # noqa: E731
                    err = max_abs_error(fn()[0], want)
                    ok = err <= tolerance(dtype)
                    ms = harness._ms(fn, device, 2) if ok else None
                    rows.append({"impl": impl, "chunk": chunk, "b": b, "q": q, "x": x,
                                 "max_abs_error": err, "ok": ok, "ms": ms, "host_us": host_us(fn, cuda),
                                 **(graph_ms(fn, harness) if cuda and ok else {})})
            rows.append(_flex(flex_module, harness, inputs, q, x, b, device, want, cuda))
            if args.ragged:
                rows.append(_flex(flex_module, harness, inputs, q, x, b, device, want, cuda, step=True))
            rows.append(_sdpa(torch, harness, inputs, q, x, b, device, want))
            # rewritten after each point: a run stopped at a GPU session's limit keeps what it measured
            data["partial"] = None if done == len(points) else f"written after {done} of {len(points)} points"
            (out / f"{stem}.json").write_text(json.dumps(data, indent=1) + "\n")
            (out / f"{stem}.md").write_text(markdown(data))
    print(markdown(data))
    print(f"wrote {out / stem}.json and .md")
    return 0 if all(r["ok"] for r in rows if r["impl"].startswith("napkin")) else 1


def host_us(fn, cuda: bool, calls: int = 50):
    """Microseconds a call holds the host (napkin's Python, Triton's launch;
    torch's for the baselines): the wall time of ``calls`` calls that do not
    wait for the GPU, whose few kernels queue behind each other.  Where it
    is near the ms column a step is bound by the host, not the kernel, unless
    it is captured in a CUDA graph.  None on the CPU, where the interpreter
    runs each kernel inside its call."""
    if not cuda:
        return None
    import torch
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def graph_ms(fn, harness) -> dict:
    """The call captured in a CUDA graph and replayed: the step without the
    host (napkin's Python, Triton's launches), as a serving loop that
    captures its decode step runs it.  Warmed up on a side stream first (so
    nothing the launcher caches, the packed rows' positions say, is first
    made inside the capture); the replay's output must be the call's own.
    {"graph_ms": ms} or {"graph_error": why}: a step that cannot be captured
    is reported, not fatal."""
    import torch

    from napkin.bench.checks import max_abs_error
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        graph.replay()
        first = (lambda o: o[0] if isinstance(o, tuple) else o)
        err = max_abs_error(first(out), first(fn()).double())
        if err > 0:   # the same kernels on the same inputs: bitwise the same
            return {"graph_error": f"replayed output off the call's by {err:.3g}"}
        return {"graph_ms": harness._ms(graph.replay, "cuda", 2)}
    except Exception as e:  # noqa: BLE001 - reported in the row
        return {"graph_error": f"{type(e).__name__}: {e}"}


def tolerance(dtype) -> float:
    """The max abs error against float64 a checked result may have: bf16's
    8-bit mantissa on outputs of order 1, else fp16/fp32 (the CPU smoke)."""
    import torch
    return 2e-2 if dtype == torch.bfloat16 else 1e-3


def _flex(module, harness, inputs, q, x, b, device, want, compiled, step=False) -> dict:
    """FlexAttention with the diagram's own mask (napkin.bench.flex), compiled
    on a GPU; checked like napkin's, the same tolerance.  step: the block mask
    is built inside the timed call ("flex-step"; its create_block_mask compiled
    where flex_attention is), not once before it."""
    from napkin.bench.checks import max_abs_error

    impl = "flex-step" if step else "flex"
    try:
        if step:
            fn = lambda: module.prepare(*inputs, compiled=compiled, compile_mask=compiled)()  # noqa: E731
        else:
            fn = module.prepare(*inputs, compiled=compiled)
        err = max_abs_error(fn()[0], want)
    except Exception as e:  # noqa: BLE001 - a baseline that cannot run is reported, not fatal
        return {"impl": impl, "chunk": None, "b": b, "q": q, "x": x, "ok": None, "ms": None,
                "error": f"{type(e).__name__}: {e}"}
    ok = err <= tolerance(inputs[0].dtype)
    return {"impl": impl, "chunk": None, "b": b, "q": q, "x": x, "max_abs_error": err, "ok": ok,
            "ms": harness._ms(fn, device, 2) if ok else None, "host_us": host_us(fn, compiled),
            **(graph_ms(fn, harness) if compiled and ok else {})}


def _sdpa(torch, harness, inputs, q, x, b, device, want) -> dict:
    """SDPA on the same inputs: unmasked with one row, else a bool mask; with
    lengths n (--ragged), the mask of each sequence's n[b] keys, (b, 1, q, x)."""
    import torch.nn.functional as F

    from napkin.bench.checks import max_abs_error
    Q, K, V = inputs[:3]
    keys, rows = torch.arange(x, device=device), torch.arange(q, device=device)[:, None]
    if len(inputs) > 3:
        n = inputs[3].long()[:, None, None, None]
        mask = (keys < n) & (keys <= rows + n - q)
    else:
        mask = None if q == 1 else keys[None, :] <= rows + x - q
    fn = lambda: F.scaled_dot_product_attention(Q, K, V, attn_mask=mask, enable_gqa=True)  # noqa: E731
    try:
        err = max_abs_error(fn(), want)
        ms = harness._ms(fn, device, 2)
    except RuntimeError as e:  # an old torch without enable_gqa, say
        return {"impl": "sdpa", "chunk": None, "b": b, "q": q, "x": x, "ok": None, "ms": None, "error": str(e)}
    return {"impl": "sdpa", "chunk": None, "b": b, "q": q, "x": x, "max_abs_error": err, "ok": None, "ms": ms,
            "host_us": host_us(fn, device == "cuda"), **(graph_ms(fn, harness) if device == "cuda" else {})}


def markdown(data: dict) -> str:
    lengths = data.get("lengths")
    lines = [f"# {'Ragged decode' if lengths is not None else 'Decode'}: napkin chunked forward vs FlexAttention "
             f"and SDPA ({data['device']}, {data['date']})", "",
             *([f"PARTIAL: {data['partial']}", ""] if data.get("partial") else []),
             f"Command: `{data['command']}`", "", f"Timing: {data['timing']}. dtype {data['dtype']}, "
             f"{data['heads']['kv']} kv heads x {data['heads']['per_kv']} query heads each.", "",
             *(["Each sequence's cache length n[b] (the keys it attends), by b, q, x: "
                + "; ".join(f"{k}: {v} ({sum(v) / (len(v) * int(k.split(',')[2])):.0%} full)"
                            for k, v in lengths.items()),
                "", "flex: the block mask built before the timed call; flex-step: rebuilt inside it, "
                "as a decode step whose lengths grew.", ""] if lengths is not None else []),
             "host us: the wall time of 50 calls that do not wait for the GPU, per call "
             "(the host's share of a step; near ms, the step is host-bound).  graph ms: the call "
             "captured in a CUDA graph and replayed (checked first): the step without the host.", "",
             "| b | q | x | impl | chunk | max abs error | ok | ms | host us | graph ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        ms = f"{r['ms']:.4f}" if r.get("ms") is not None else "-"
        host = f"{r['host_us']:.1f}" if r.get("host_us") is not None else "-"
        graph = f"{r['graph_ms']:.4f}" if r.get("graph_ms") is not None else r.get("graph_error", "-")
        err = f"{r['max_abs_error']:.2e}" if "max_abs_error" in r else r.get("error", "-")
        ok = {True: "ok", False: "FAIL", None: "(speed ref)"}[r["ok"]]
        lines.append(f"| {r['b']} | {r['q']} | {r['x']} | {r['impl']} | {r['chunk'] if r['chunk'] is not None else '-'}"
                     f" | {err} | {ok} | {ms} | {host} | {graph} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    t0 = time.perf_counter()
    rc = main()
    print(f"{time.perf_counter() - t0:.1f} s")
    sys.exit(rc)
