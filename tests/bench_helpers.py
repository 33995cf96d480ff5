"""What the benchmark's test files share: paths, the tiny sizes flex runs at,
a results record, the float64 comparison of an emitted flex module, bench/
scripts loaded as fresh modules and run_h100.sh's stages recorded."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import torch

import napkin
from napkin.bench import flex, harness, reference, results

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
SIZES = {"b": 2, "h": 2, "q": 40, "x": 40, "hk": 2, "g": 2}
WIRES = ("b", "h", "q", "x")
F16, T16 = {"fp16": "float16"}, {"fp16": torch.float16}   # a key's dtype classes: names or torch dtypes


def fp32(text: str):
    """The diagram with fp16 declarations made fp32, so flex's output is not
    rounded to fp16 and the comparison can be tight."""
    d = napkin.load_text(text)
    return harness.variant(d, text, "float32", None)[0]


def flex_vs_reference(d, sizes=SIZES, seed=0):
    """Max abs difference per output between the emitted flex module (float64
    inputs) and the float64 reference."""
    inputs = reference.example_inputs(d, sizes, seed=seed)
    wide = [t.double() if t.is_floating_point() else t for t in inputs]
    want = reference.reference(d, inputs, sizes)
    got = flex.load(d).prepare(*wide)()
    assert len(got) == len(want) == len(d.outputs)
    # equal entries (-inf lse of a fully masked row included) differ by 0; a NaN by inf: max() of a
    # list with a NaN in it returned the other entries' maximum, so an NaN lse passed
    return [float(torch.where(g.double() == w, 0.0, (g.double() - w).abs()).nan_to_num(nan=math.inf).max())
            for g, w in zip(got, want)]


def bench_script(stem: str):
    """bench/STEM.py loaded as a fresh module (a script, not a package module:
    each test gets its own copy to patch)."""
    spec = importlib.util.spec_from_file_location(f"napkin_bench_{stem}", REPO / "bench" / f"{stem}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module



def run_stage_recorded(tmp_path, stage: str) -> list[list[str]]:
    """run_h100.sh STAGE with PYTHON a stand-in that records its arguments
    (and runs nothing): the argument lists of the stage's calls, in order."""
    import shlex
    import subprocess

    log = tmp_path / "calls.jsonl"
    (tmp_path / "record.py").write_text("import json, os, sys\n"
                                        "with open(os.environ['CALLS'], 'a') as f:\n"
                                        "    f.write(json.dumps(sys.argv[1:]) + '\\n')\n")
    shim = tmp_path / "python"
    shim.write_text(f"#!/usr/bin/env bash\nexec {shlex.quote(sys.executable)} {tmp_path / 'record.py'} \"$@\"\n")
    shim.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "NAPKIN_TUNE_BUDGET"}
    env |= {"PYTHON": str(shim), "NAPKIN_BENCH_OUT": str(tmp_path / "out"), "CALLS": str(log)}
    done = subprocess.run(["bash", str(REPO / "bench" / "run_h100.sh"), stage], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in log.read_text().splitlines()]


def record(smoke=True) -> dict:
    """A results record as napkin bench writes it: one causal row, four implementations."""
    shape = {"batch": 1, "heads": 2, "kv_heads": 2, "q_len": 64, "kv_len": 64, "dim": 64, "value_dim": 64}
    flops = results.attention_flops(shape, causal=True)
    rows = [{"impl": "napkin", "pass": "fwd", "ms": 2.0, "tflops": results.tflops(flops["fwd"], 2.0),
             "equivalent": True, "note": "", "error": None},
            {"impl": "flex", "pass": "fwd", "ms": 3.0, "tflops": results.tflops(flops["fwd"], 3.0),
             "equivalent": True, "note": "", "error": None},
            {"impl": "sdpa-flash", "pass": "fwd", "ms": 1.0, "tflops": results.tflops(flops["fwd"], 1.0),
             "equivalent": False, "note": "speed reference", "error": None},
            {"impl": "sdpa-cudnn", "pass": "fwd", "ms": None, "tflops": None, "equivalent": True,
             "note": "", "error": "RuntimeError: no kernel | for this"}]
    return {"schema": results.SCHEMA, "smoke": smoke, "timing": "test timing", "date": "2025-01-02",
            "command": "napkin bench x.ncd", "flop_convention": "test", "versions": {"torch": "t"},
            "device": {"name": "NVIDIA H100 80GB HBM3", "kind": "cuda", "capability": "9.0"},
            "rows": [{"diagram": "causal", "file": "x.ncd", "source_hash": "h", "dtype": "bfloat16",
                      "sizes": {"q": 64}, "shape": shape, "causal": True, "flops": flops, "config": None,
                      "config_source": "schedule", "check": {"ok": True, "errors": {}},
                      "results": rows, "ratios": results.ratios(rows)}]}
