"""The scripts of bench/run_h100.sh's stages that had never run on a GPU
(tma, decode, benchtest), driven on the CPU as far as they go without one:
a lent GPU's minutes are too few to spend on a crash a CPU can find."""
from __future__ import annotations

import json
import os

import pytest


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the CPU smoke runs under TRITON_INTERPRET=1")
def test_tma_stage_times_the_launchers_tma_option_against_pointers(tmp_path):
    """The tma stage (`bench/tma/tma_fwd.py time`): its forms were a text
    patch of the forward kernel that napkin's own tma= option has since
    replaced, so every form but ptr raised before anything was timed.  It
    times the launcher with tma False and True, each row saying whether TMA
    really ran (the launcher falls back silently) and what it differs by."""
    from bench.tma import tma_fwd

    out = tmp_path / "tma-times.jsonl"
    assert tma_fwd.main(["time", "--examples", "causal", "--head-dims", "16", "--seqlens", "40", "--tokens", "40",
                         "--hidden", "32", "--blocks", "16x16", "--stages", "2", "--dtype", "float16",
                         "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["form"] for r in rows] == ["ptr", "tma"] and not any("error" in r for r in rows)
    ptr, tma = rows
    assert not ptr["tma_used"] and tma["tma_used"] and tma["tma_why_not"] is None
    assert (tma["b"], tma["h"], tma["n"]) == (1, 2, 40) and tma["max_diff_vs_first"] < 1e-2 and tma["ms"] > 0


def test_decode_stage_keeps_the_host_time_when_the_decode_bench_fails(tmp_path):
    """run_h100.sh decode under set -e: decode.py exits 1 on a failed check and
    runs until the stage's limit stops it, so launch_overhead.py, the stage's
    other (seconds-long) script, comes first; it was never reached after it."""
    import shlex
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    log = tmp_path / "calls"
    shim = tmp_path / "python"   # records each call; decode.py "fails"
    shim.write_text(f"#!/usr/bin/env bash\necho \"$1\" >> {shlex.quote(str(log))}\n"
                    "[[ $1 != bench/decode.py ]]\n")
    shim.chmod(0o755)
    env = dict(os.environ, PYTHON=str(shim), NAPKIN_BENCH_OUT=str(tmp_path / "out"))
    done = subprocess.run(["bash", str(repo / "bench" / "run_h100.sh"), "decode"], env=env, cwd=repo,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1   # the stage still says decode failed
    assert log.read_text().split() == ["bench/launch_overhead.py", "bench/decode.py"]


def test_tma_stage_keeps_the_python_path_that_holds_the_carried_wheels(tmp_path):
    """bench/device.sh installs the wheels the GPU image lacks (lark) under
    /tmp/site and puts it on PYTHONPATH; the tma stage set PYTHONPATH=. for
    its script, dropping them: napkin could not parse the example there."""
    import shlex
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    log = tmp_path / "pythonpath"
    shim = tmp_path / "python"   # records the PYTHONPATH each call sees
    shim.write_text(f"#!/usr/bin/env bash\necho \"$PYTHONPATH\" >> {shlex.quote(str(log))}\n")
    shim.chmod(0o755)
    env = dict(os.environ, PYTHON=str(shim), NAPKIN_BENCH_OUT=str(tmp_path / "out"), PYTHONPATH="/tmp/site:/repo")
    done = subprocess.run(["bash", str(repo / "bench" / "run_h100.sh"), "tma"], env=env, cwd=repo,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert log.read_text().split() == [".:/tmp/site:/repo"]
