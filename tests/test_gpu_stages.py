"""The scripts of bench/run_h100.sh's stages that had never run on a GPU
(tma, decode, benchtest), driven on the CPU as far as they go without one:
a lent GPU's minutes are too few to spend on a crash a CPU can find."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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


REPO = Path(__file__).resolve().parent.parent
TMA_FWD = REPO / "bench" / "tma" / "tma_fwd.py"


def _tma_fwd(*args, interpret=None, timeout=300):
    """One run of bench/tma/tma_fwd.py in a process of its own, the worktree's
    napkin first on its path: `check` sets TRITON_INTERPRET=1 itself before
    importing triton, and `compile` needs it unset (this process may have
    imported triton under it, conftest.py), so neither can share this one."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return subprocess.run([sys.executable, str(TMA_FWD), *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_tma_check_runs_the_launchers_tma_option_against_pointers_and_the_reference():
    """`tma_fwd.py check` raised in its text patch (the launcher's tma= had
    replaced it); now each form is the launcher's own tma=, checked against
    the float64 reference, tma bitwise against ptr, and TMA really used
    (under the interpreter it always can be): a small example, with the
    strided-view, positions and ragged-edge (an inf in the next head's V)
    cases."""
    done = _tma_fwd("check", "--examples", "causal", "--dtypes", "float16", "--shapes", "1,2,37,77:16x32",
                    "--head-dim", "16")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[-1] == "all ok" and len(lines) == 9
    tma = [line for line in lines if " tma " in line]
    assert len(tma) == 4 and all("bitwise = ptr ok" in line for line in tma)
    # TMA ran wherever the launcher can take it; at global positions it keeps the pointer code
    assert sum("TMA used" in line for line in tma) == 3
    assert any("positions/lengths" in line and "TMA not used (rows of x at global positions" in line
               for line in tma)
    assert any("inf in head 1's V" in line and "finite True" in line for line in tma)


def test_tma_check_fails_when_tma_falls_back_to_pointers():
    """A tma row whose launch fell back to the pointer code compares ptr with
    ptr and proves nothing: check counts it a failure (head dim 4 in fp16:
    8-byte strides, which a descriptor cannot take)."""
    done = _tma_fwd("check", "--examples", "causal", "--dtypes", "float16", "--shapes", "1,2,37,77:16x32",
                    "--head-dim", "4", "--shapes-only")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "TMA not used (Q: a stride is not a positive multiple of 16 bytes)" in done.stdout
    assert done.stdout.splitlines()[-1] == "1 FAILED"


@pytest.mark.slow
def test_tma_compile_gives_a_row_for_ptr_and_tma_compiled_for_sm90(tmp_path):
    """`tma_fwd.py compile` on this CPU machine: the launcher called with
    tma=False and tma=True under napkin.bench.aot's paper sm_90, whose target
    the launcher's _tma_ready accepts, so the tma row's kernel moves its
    tiles by TMA (bulk tensor copies, no cp.async) and says it did."""
    pytest.importorskip("triton.backends.nvidia", reason="Triton without its NVIDIA backend cannot target sm_90")
    out = tmp_path / "sm90.jsonl"
    done = _tma_fwd("compile", "--examples", "causal", "--head-dims", "64", "--blocks", "64x64", "--stages", "2",
                    "--out", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["form"] for r in rows] == ["ptr", "tma"] and not any("error" in r for r in rows)
    ptr, tma = rows
    assert (ptr["tma_used"], ptr["tma_why_not"]) == (False, "tma not requested")
    assert (tma["tma_used"], tma["tma_why_not"]) == (True, None)
    assert ptr["tma"] == 0 and ptr["cp_async"] > 0 and ptr["sass"]["UTMALDG"] == 0
    assert tma["tma"] > 0 and tma["cp_async"] == 0 and tma["sass"]["UTMALDG"] > 0 and tma["sass"]["UTMASTG"] > 0
    assert ptr["wgmma"] > 0 and tma["wgmma"] > 0 and ptr["spill_stores"] == tma["spill_stores"] == 0


def test_tma_table_still_renders_the_old_studys_rows(capsys, tmp_path):
    """The committed JSON lines of the patched forms (tma4d, tma2d, ...;
    their code is at commit a397b7e) render as the appendix of
    bench/results/tma-sm90-2026-11-21.md shows them, row for row."""
    from bench.tma import tma_fwd

    files = [str(REPO / "bench" / "tma" / f) for f in
             ("sm90-t36.jsonl", "sm90-t39.jsonl", "sm90-t36-ws.jsonl", "sm90-t39-ws.jsonl")]
    assert tma_fwd.main(["table", *files]) == 0
    got = capsys.readouterr().out.splitlines()
    doc = (REPO / "bench" / "results" / "tma-sm90-2026-11-21.md").read_text().splitlines()
    start = doc.index(got[0])
    assert doc[start:start + len(got)] == got and len(got) == 2 + 64 + 64 + 2 + 2
    # a new row (the launcher's forms) adds whether TMA ran
    row = dict(json.loads((REPO / "bench" / "tma" / "sm90-t39.jsonl").read_text().splitlines()[0]),
               form="tma", tma_used=False, tma_why_not="TMA needs compute capability 9.0")
    new = tmp_path / "new.jsonl"
    new.write_text(json.dumps(row) + "\n")
    assert tma_fwd.main(["table", files[1], str(new)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("| TMA used |") and lines[2].endswith(" |  |")
    assert lines[-1].endswith("| no: TMA needs compute capability 9.0 |")


def test_decode_stage_keeps_the_host_time_when_the_decode_bench_fails(tmp_path):
    """run_h100.sh decode under set -e: decode.py exits 1 on a failed check and
    runs until the stage's limit stops it, so launch_overhead.py, the stage's
    other (seconds-long) script, comes first, forward, backward, new shapes and
    lengths; it was never reached after it."""
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
    assert log.read_text().split() == ["bench/launch_overhead.py"] * 4 + ["bench/decode.py"]


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
