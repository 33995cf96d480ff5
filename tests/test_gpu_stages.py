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
