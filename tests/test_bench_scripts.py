"""The bench/ scripts a GPU session runs: dram_bytes.py (predicted HBM bytes
against Nsight Compute's), device.sh and run_h100.sh's stages, decode.py and
launch_overhead.py, on the CPU where they can run."""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

import napkin
from napkin import tunecache
from napkin.bench import harness, results

from bench_helpers import EXAMPLES, REPO, bench_script as _bench_script, run_stage_recorded

# --------------------------------------------------------------------------
# bench/dram_bytes.py: predicted HBM bytes against Nsight Compute's DRAM bytes.
# --------------------------------------------------------------------------

_NCU_HEAD = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
             '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def _ncu_row(kid, metric, unit, value):
    return f'"{kid}","1","python","h","_causal_kernel","1","7","(128, 1, 1)","(1, 2, 1)","0","9.0","m",' \
           f'"{metric}","{unit}","{value}"'


def test_ncu_log_is_read_in_any_unit_and_refuses_what_it_cannot_pair():
    from bench import dram_bytes as DB
    log = "\n".join(["==PROF== Connected", _NCU_HEAD, _ncu_row(0, "dram__bytes_read.sum", "byte", "40,960"),
                     _ncu_row(0, "dram__bytes_write.sum", "Kbyte", "26.5")])
    assert DB.measured_bytes(log) == 40960 + 26500
    with pytest.raises(ValueError, match="lacks dram__bytes_write.sum"):
        DB.measured_bytes("\n".join([_NCU_HEAD, _ncu_row(0, "dram__bytes_read.sum", "byte", "1")]))
    two = "\n".join([_NCU_HEAD] + [_ncu_row(k, m, "byte", str(10 ** (k + 1))) for k in (0, 1) for m in DB.METRICS])
    assert DB.measured_bytes(two, kernels=2) == 2 * (10 + 100)      # a chunked forward: kernel + merge
    with pytest.raises(ValueError, match="2 kernels profiled; profile exactly 1"):
        DB.measured_bytes("\n".join([_NCU_HEAD] + [_ncu_row(k, m, "byte", "1") for k in (0, 1)
                                                   for m in DB.METRICS]))
    with pytest.raises(ValueError, match="no ncu CSV header"):
        DB.measured_bytes("==PROF== No kernels were profiled.")


def test_dram_bytes_reads_the_config_the_bench_tuned(tmp_path, monkeypatch):
    """On a GPU the profiled launch takes the tuned config from the cache, under
    the key napkin bench stored it with (its call still passed no dtypes when
    the key gained them: a TypeError only a GPU run would have met)."""
    from bench import dram_bytes as DB
    monkeypatch.setenv("NAPKIN_CACHE", str(tmp_path))
    monkeypatch.setattr(tunecache, "device_name", lambda device: "NVIDIA H100")
    path = EXAMPLES / "alibi.ncd"
    text = path.read_text()
    d = napkin.load(str(path))
    sizes = {"b": 1, "h": 16, "q": 4096, "x": 4096}
    key = tunecache.cache_key(tunecache.diagram_hash(text), "NVIDIA H100", {"fp16": "float16", "fp32": "float32"},
                             sizes, tunecache.symbolic_wires(d))
    tunecache.Cache().put(key, tunecache.Config((("q", 64), ("x", 32)), 4, 3))
    assert DB.launcher_options(d, text, sizes, "cuda") == {"block_q": 64, "block_x": 32, "num_warps": 4,
                                                            "num_stages": 3}
    assert DB.launcher_options(d, text, sizes, "cpu") == {}


def test_dram_bytes_prediction_is_the_cost_pass_at_the_launchers_blocks():
    """The issued bytes compare uses are the cost pass's hbm loads + stores
    at the block sizes the launcher ran with (a different block size gives a
    different count, so the options must be applied)."""
    from bench import dram_bytes as DB
    from napkin.cost import analyse, with_blocks
    d = napkin.load(EXAMPLES / "causal.ncd")
    sizes = {"b": 1, "h": 2, "q": 300, "x": 300}
    base = DB.predicted(d, sizes, {})
    hbm = next(t for t in analyse(d, sizes).totals if t.boundary.startswith("hbm/"))
    assert base["issued_bytes"] == hbm.load_bytes + hbm.store_bytes
    small = DB.predicted(d, sizes, {"block_q": 16, "block_x": 16, "num_warps": 4})
    hbm16 = next(t for t in analyse(with_blocks(d, {"q": 16, "x": 16}), sizes).totals
                 if t.boundary.startswith("hbm/"))
    assert small["issued_bytes"] == hbm16.load_bytes + hbm16.store_bytes != base["issued_bytes"]
    assert base["kernels"] == small["kernels"] == 1


def test_dram_bytes_prediction_takes_the_launchers_chunk():
    """A chunked forward is two kernels, the prediction both; the options'
    chunk (a tuned one) replaces the schedule's, 0 runs whole."""
    from bench import dram_bytes as DB
    from napkin.cost import analyse
    d = napkin.load(EXAMPLES / "flash_decoding.ncd")
    sizes = {"b": 1, "hk": 2, "g": 2, "q": 4, "x": 5000}
    schedule = DB.predicted(d, sizes, {})
    assert schedule["kernels"] == 2
    hbm = next(t for t in analyse(d, sizes).totals if t.boundary.startswith("hbm/"))
    assert schedule["issued_bytes"] == hbm.load_bytes + hbm.store_bytes
    whole, finer = DB.predicted(d, sizes, {"chunk": 0}), DB.predicted(d, sizes, {"chunk": 256})
    assert whole["kernels"] == 1 and whole["issued_bytes"] < schedule["issued_bytes"] < finer["issued_bytes"]
    assert DB.with_chunk(d, 256) != d and d.level("smem").tiles[-1].chunk == 1024    # d itself unchanged


# --------------------------------------------------------------------------
# bench/device.sh: run_h100.sh's stages as device-tool calls
# --------------------------------------------------------------------------

def test_device_run_packs_every_stage_into_one_archive_and_keeps_the_worst_status(tmp_path):
    """A failing stage does not stop the next, its status is the call's, and
    whatever the stages wrote (logs, the carried cache) comes back as one
    results.tgz (the tool returns at most 8 files)."""
    import subprocess
    import tarfile

    out = tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("NAPKIN_BENCH_OUT", "NAPKIN_CACHE")}
    done = subprocess.run(["bash", str(REPO / "bench" / "device.sh"), "run", "nosuchstage", "alsonot"],
                          env=env | {"OUT": str(out), "DEVICE_BUDGET": "120", "DEVICE_WHEELS": str(tmp_path / "none")}, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr  # run_h100.sh's usage error
    assert [p.name for p in out.iterdir()] == ["results.tgz"]
    with tarfile.open(out / "results.tgz") as tar:
        names = set(tar.getnames())
        log = tar.extractfile("results/stages.log").read().decode()
    assert {"results/nosuchstage.log", "results/alsonot.log", "results/stages.log"} <= names
    assert "== nosuchstage rc 2" in log and "== alsonot rc 2" in log


def test_device_run_gives_each_stage_its_share_and_tells_the_bench(tmp_path):
    """`run main:100 variants bad:soon`: main gets its 100 s (the bench inside it 85, its
    $NAPKIN_BENCH_SECONDS), variants what is left of the call's budget, and a share that is not a
    whole number is refused in the log (status 2) without stopping the others."""
    import subprocess
    import tarfile

    out = tmp_path / "out"
    out.mkdir()
    stages = tmp_path / "stages.sh"
    stages.write_text('#!/usr/bin/env bash\necho "stage $1 bench $NAPKIN_BENCH_SECONDS"\n')
    stages.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("NAPKIN_BENCH_OUT", "NAPKIN_CACHE")}
    done = subprocess.run(["bash", str(REPO / "bench" / "device.sh"), "run", "main:100", "variants", "bad:soon"],
                          env=env | {"OUT": str(out), "DEVICE_BUDGET": "300", "DEVICE_STAGES": str(stages),
                                     "DEVICE_WHEELS": str(tmp_path / "none")},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    with tarfile.open(out / "results.tgz") as tar:
        main = tar.extractfile("results/main.log").read().decode()
        variants = tar.extractfile("results/variants.log").read().decode()
        log = tar.extractfile("results/stages.log").read().decode()
    assert main == "stage main bench 85\n"
    # 300 less 20 for the packing, less the second or so spent so far; the bench 15 s less again
    seconds = int(variants.split()[-1])
    assert variants.startswith("stage variants bench ") and 262 <= seconds <= 265, variants
    assert "== main (up to 100s)" in log and "== variants (up to" in log
    assert "'bad:soon': a stage's seconds are a whole number (main:270)" in log


def test_device_run_restores_the_newest_committed_autotune_record(tmp_path):
    """A new session's first call carries no .device/: `run` starts the cache from the newest
    bench/results/autotune-DATE.json, so tunings cut short go on (autotune's resume); a carried
    .device/autotune.json wins over it."""
    import shutil
    import subprocess
    import tarfile

    repo = tmp_path / "repo"
    (repo / "bench" / "results").mkdir(parents=True)
    shutil.copy(REPO / "bench" / "device.sh", repo / "bench" / "device.sh")
    for day in ("2026-11-20", "2026-11-26", "2026-11-03"):
        (repo / "bench" / "results" / f"autotune-{day}.json").write_text(day)
    stages = tmp_path / "stages.sh"
    stages.write_text('#!/usr/bin/env bash\ncat "$NAPKIN_CACHE/autotune.json"\n')
    stages.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("NAPKIN_BENCH_OUT", "NAPKIN_CACHE")}

    def cache_seen() -> str:
        out = tmp_path / "out"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        done = subprocess.run(["bash", str(repo / "bench" / "device.sh"), "run", "env"],
                              env=env | {"OUT": str(out), "DEVICE_BUDGET": "120", "DEVICE_STAGES": str(stages),
                                         "DEVICE_WHEELS": str(tmp_path / "none")},
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        with tarfile.open(out / "results.tgz") as tar:
            return tar.extractfile("results/env.log").read().decode()

    assert cache_seen() == "2026-11-26"
    (repo / ".device").mkdir()
    (repo / ".device" / "autotune.json").write_text("carried")
    assert cache_seen() == "carried"
    # a carried cache of another schema than this napkin's would be set aside at its first
    # write (every kernel retuned): the committed record is taken instead
    (repo / "napkin").mkdir()
    (repo / "napkin" / "tunecache.py").write_text('SCHEMA = "napkin-autotune/2"   # the keys\n')
    (repo / ".device" / "autotune.json").write_text('{\n "schema": "napkin-autotune/1",\n "entries": {}}')
    assert cache_seen() == "2026-11-26"
    (repo / ".device" / "autotune.json").write_text('{\n "schema": "napkin-autotune/2",\n "entries": {}}')
    assert cache_seen().startswith('{\n "schema": "napkin-autotune/2"')
    # ... and the line it reads the schema from is this napkin's
    assert re.search(r'^SCHEMA = "([^"]*)"', (REPO / "napkin" / "tunecache.py").read_text(), re.M)[1] == tunecache.SCHEMA


def test_device_keep_numbers_two_calls_pairs_in_order_and_logs_by_call(tmp_path):
    """`keep` after two calls on one day: the second call's pairs continue the day's numbering
    (the first session gave them a time of day in front, out of order), JSON and markdown of one
    run keep one number, logs are named by call, and the committed autotune copy is readable."""
    import datetime
    import shutil
    import subprocess
    import tarfile

    repo = tmp_path / "repo"
    (repo / "bench").mkdir(parents=True)
    shutil.copy(REPO / "bench" / "device.sh", repo / "bench" / "device.sh")
    day = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")

    def call(n: int, files: dict[str, str]) -> list[str]:
        src = tmp_path / f"call{n}"
        (src / "results" / "autotune-cache").mkdir(parents=True)
        for name, text in files.items():
            (src / "results" / name).write_text(text)
        cache = src / "results" / "autotune-cache" / "autotune.json"
        # each call's tuning of its own key, and of one both tuned
        cache.write_text(json.dumps({"schema": "napkin-autotune/2",
                                     "entries": {f"mine{n}": {"call": n}, "both": {"call": n}}}))
        cache.chmod(0o600)
        got = tmp_path / f"got{n}"
        got.mkdir()
        with tarfile.open(got / "results.tgz", "w:gz") as tar:
            tar.add(src / "results", arcname="results")
        done = subprocess.run(["bash", str(repo / "bench" / "device.sh"), "keep", str(got)],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout.split()

    dev = f"nvidia-h200-{day}"
    call(1, {f"{dev}.json": "main", f"{dev}.md": "main", f"{dev}-2.json": "variants", f"{dev}-2.md": "variants",
             "main.log": "m1", "stages.log": "s1"})
    second = call(2, {f"{dev}-2.json": "others", f"{dev}-2.md": "others", f"{dev}.json": "variants again",
                      f"{dev}.md": "variants again", "stages.log": "s2", "ncu-causal.csv": "c",
                      "ncu-causal.json": "{}", f"dram-bytes-causal-{day}.json": "{}"})
    res = repo / "bench" / "results"
    assert [(res / f"{dev}{n}.json").read_text() for n in ("", "-2", "-3", "-4")] == \
        ["main", "variants", "variants again", "others"]
    assert (res / f"{dev}-3.md").read_text() == "variants again" and (res / f"{dev}-4.md").read_text() == "others"
    assert (res / "logs" / f"{day}-call1-main.log").read_text() == "m1"
    assert (res / "logs" / f"{day}-call2-stages.log").read_text() == "s2"
    # the ncu stage's files under ncu/, its JSON (no bench records) out of the pairs
    assert (res / "ncu" / "ncu-causal.csv").read_text() == "c" and f"bench/results/{dev}-4.json" in second
    assert sorted(p.name for p in (res / "ncu").iterdir()) == \
        sorted(["ncu-causal.csv", "ncu-causal.json", f"dram-bytes-causal-{day}.json"])
    assert not list(res.glob("ncu-*")) and not list(res.glob("dram-bytes-*"))
    # merged, not copied over: call 2 started without call 1's cache (2026-11-28) and dropped its tunings
    want = {"both": {"call": 2}, "mine1": {"call": 1}, "mine2": {"call": 2}}
    assert json.loads((repo / ".device" / "autotune.json").read_text())["entries"] == want
    assert json.loads((res / f"autotune-{day}.json").read_text()) == {"schema": "napkin-autotune/2", "entries": want}
    assert (res / f"autotune-{day}.json").stat().st_mode & 0o044 == 0o044


def test_device_fetch_carries_every_dependency_the_gpu_image_lacks():
    """bench/device.sh's WHEELS against pyproject.toml: each dependency napkin needs at run time is
    either on the GPU image (the device tool's package list: torch, triton, numpy, jinja2) or fetched
    as a wheel, so that a GPU session's first stage does not fail on an import (interegular, which
    lark's strict mode needs, was missing: every diagram failed to parse there)."""
    import re
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.match(r"[A-Za-z0-9_.-]+", dep).group(0).lower() for dep in deps}
    text = (REPO / "bench" / "device.sh").read_text()
    wheels = re.search(r"^WHEELS=\((.*)\)$", text, re.M).group(1)
    fetched = {w.split("==")[0] for w in re.findall(r'"([^"]+)"', wheels)}
    assert all("==" in w for w in re.findall(r'"([^"]+)"', wheels))   # pinned: one version each
    on_image, unused = {"torch", "triton", "numpy", "jinja2"}, {"graphviz"}   # graphviz: pictures only
    assert names - on_image - unused == fetched


def test_device_sh_refuses_an_unknown_verb_and_run_without_out():
    import subprocess

    script = str(REPO / "bench" / "device.sh")
    bad = subprocess.run(["bash", script, "frobnicate"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "usage" in bad.stderr
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    no_out = subprocess.run(["bash", script, "run", "env"], env=env, capture_output=True, text=True, timeout=30)
    assert no_out.returncode != 0 and "device tool" in no_out.stderr


@pytest.mark.parametrize("stage, files, seqlens", [
    ("main", ["attention", "causal"], [16384]),
    ("variants", ["sliding_window", "softcap", "alibi", "document_mask", "gqa"], [16384]),
    ("misses", ["attention", "document_mask", "sliding_window"], [16384]),
    ("others", ["sigmoid_attention", "l2_attention", "relu2_attention"], [16384]),
    ("extras", ["attention_sink", "mla", "chunked_attention"], [16384]),
    ("masks", ["differential_attention", "prefix_lm", "streaming_llm", "document_mask", "block_sparse"], [16384]),
    ("sweep", ["attention", "causal"], [1024, 2048, 4096, 8192, 16384])])
def test_run_h100_stages_hand_the_bench_what_it_accepts(tmp_path, stage, files, seqlens):
    """Each run_h100.sh stage's bench command, as the stage builds it (PYTHON
    is a stand-in that records its arguments), parses with napkin bench's own
    parser and names bundled examples: a GPU session's minutes are not lost
    to a typo in a flag."""
    (call,) = run_stage_recorded(tmp_path, stage)
    assert call[:2] == ["-m", "napkin.bench"]
    args = harness.build_parser().parse_args(call[2:])
    assert [Path(f).stem for f in args.files] == files and all((REPO / f).is_file() for f in args.files)
    assert args.preset == "h100" and args.out == str(tmp_path / "out")
    assert harness.parse_list(args.seqlen, "seqlen") == seqlens
    assert harness.parse_list(args.head_dim, "head-dim") == ([64, 128] if stage == "sweep" else [128])
    assert args.autotune == (stage != "sweep")
    if stage in ("variants", "extras"):
        assert args.group == 4


# --------------------------------------------------------------------------
# bench/decode.py: the chunked (flash-decoding) forward's benchmark
# --------------------------------------------------------------------------

def test_decode_bench_checks_every_chunk_before_timing_and_writes_its_record(tmp_path):
    """The CPU smoke of bench/decode.py (run_h100.sh's decode stage on a GPU):
    each chunk length is checked against the float64 reference, the record
    names the device and date; a chunk the cache does not fill runs whole."""
    decode = _bench_script("decode")
    assert decode.main(["--cache", "100", "--chunks", "0,32,256", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("decode-cpu-*.json")
    data = json.loads(path.read_text())
    assert data["smoke"] and data["device"] == "cpu" and path.name == f"decode-cpu-{data['date']}.json"
    assert data["partial"] is None                  # rewritten after each point; the last drops the mark
    napkin_rows = [r for r in data["rows"] if r["impl"].startswith("napkin")]
    assert [(r["impl"], r["chunk"]) for r in napkin_rows] == [     # packed heads, then one program per head
        (impl, c) for impl in ("napkin", "napkin-unpacked") for c in (0, 32, 256)]
    assert [r["impl"] for r in data["rows"]][6:] == ["flex", "sdpa"]   # the baselines, Flex checked too
    assert data["rows"][6]["ok"] and data["rows"][6]["max_abs_error"] < 1e-3
    assert all(r["ok"] and r["max_abs_error"] < 1e-5 and r["ms"] > 0 for r in napkin_rows)
    assert "| 1 | 3 | 100 | napkin | 32 |" in (tmp_path / path.name.replace(".json", ".md")).read_text()


def test_decode_bench_reads_sizes_as_napkin_bench_does():
    """harness.parse_list, the chunks taking 0 (no chunking): a size it cannot read is refused in
    words before anything runs."""
    decode = _bench_script("decode")
    with pytest.raises(SystemExit) as e:
        decode.main(["--cache", "32M"])
    assert str(e.value) == "bench/decode.py: --cache expects positive whole numbers (1K = 1024), not '32M'"
    with pytest.raises(SystemExit) as e:
        decode.main(["--cache", "100", "--chunks", "0,-64"])
    assert str(e.value) == "bench/decode.py: --chunks expects whole numbers (1K = 1024), not '-64'"


def test_ragged_decode_bench_checks_each_length_and_times_flex_with_its_mask_rebuilt(tmp_path, monkeypatch):
    """bench/decode.py --ragged (run_h100.sh's ragged stage): examples/ragged_decode.ncd, each
    sequence's cache length drawn in 1..|x| and recorded; napkin checked against float64 with
    those lengths, Flex twice (its block mask built once, and inside each timed call), SDPA given
    the lengths' mask, which must be right (it is a speed reference, but a wrong mask would time
    a different attention)."""
    from torch.nn.attention import flex_attention as F

    decode = _bench_script("decode")
    made, real = [], F.create_block_mask
    monkeypatch.setattr(F, "create_block_mask", lambda *a, **k: made.append(k) or real(*a, **k))
    assert decode.main(["--ragged", "--cache", "100", "--chunks", "0,32", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("decode-ragged-cpu-*.json")
    data = json.loads(path.read_text())
    assert data["diagram"] == "examples/ragged_decode.ncd"
    (lengths,) = data["lengths"].values()
    assert len(lengths) == 3 and all(1 <= n <= 100 for n in lengths) and len(set(lengths)) > 1
    assert [(r["impl"], r["chunk"]) for r in data["rows"]] == [
        ("napkin", 0), ("napkin", 32), ("napkin-unpacked", 0), ("napkin-unpacked", 32),
        ("flex", None), ("flex-step", None), ("sdpa", None)]
    assert all(r["ok"] and r["max_abs_error"] < 1e-5 for r in data["rows"][:4])
    assert all(r["ok"] and r["max_abs_error"] < 1e-3 for r in data["rows"][4:6])
    assert data["rows"][6]["max_abs_error"] < 1e-5
    # flex's mask once, then flex-step's at its check and at every timed call; eager on the CPU
    assert len(made) > 3 and all(k["_compile"] is False for k in made)
    md = (tmp_path / path.name.replace(".json", ".md")).read_text()
    assert md.startswith("# Ragged decode:") and f"3,3,100: {lengths}" in md


def test_run_h100_ragged_stage_runs_the_ragged_decode_bench(tmp_path):
    calls = run_stage_recorded(tmp_path, "ragged")
    assert calls == [["bench/decode.py", "--ragged", "--out", str(tmp_path / "out")]]


def test_run_h100_matmul_stage_runs_the_program_order_bench_then_the_fp8_and_int8_ones(tmp_path):
    calls = run_stage_recorded(tmp_path, "matmul")
    assert calls == [["bench/matmul_order.py", "--out", str(tmp_path / "out")],
                     ["bench/matmul_order.py", "--fp8", "--out", str(tmp_path / "out")],
                     ["bench/matmul_order.py", "--int8", "--out", str(tmp_path / "out")]]


# --------------------------------------------------------------------------
# bench/launch_overhead.py: the host's time per launch, kernels stubbed
# --------------------------------------------------------------------------

def test_launch_overhead_times_the_launcher_with_every_kernel_stubbed_and_puts_them_back(tmp_path):
    """Each timed call launches exactly the module's kernels (the chunked
    decode: its kernel and the merge), none of them runs, and the modules get
    their kernels back afterwards (other tests share them)."""
    bench = _bench_script("launch_overhead")
    import generated.flash_decoding as fd
    kernel, merge = fd._flash_decoding_kernel, fd._flash_decoding_merge
    rows = [bench.measure(name, 20, "cpu") for name in ("flash_decoding", "attention")]
    assert rows[0]["launches"] == {"_flash_decoding_kernel": 1, "_flash_decoding_merge": 1}
    assert rows[1]["launches"] == {"_attention_kernel": 1}
    assert all(r["us"] > 0 for r in rows)
    assert (fd._flash_decoding_kernel, fd._flash_decoding_merge) == (kernel, merge)
    # --backward: autograd's backward, the three backward launchers once each, the forward's not counted
    back = bench.measure("attention", 5, "cpu", backward=True)
    assert back["launches"] == {"_attention_bwd_rows_kernel": 1, "_attention_bwd_dkdv_kernel": 1,
                                "_attention_bwd_dq_kernel": 1}
    assert back["sizes"] == "b=1, h=8, q=256, x=256" and back["us"] > 0
    assert bench.main(["--calls", "5", "--out", str(tmp_path), "gqa"]) == 0
    (path,) = tmp_path.glob("launch-overhead-cpu-*.md")
    assert "| gqa | b=1, hk=8, g=4, q=1, x=4096 | _gqa_kernel x1 |" in path.read_text()


def test_launch_overhead_new_shapes_gives_every_call_a_cache_length_of_its_own(tmp_path, monkeypatch):
    """--new-shapes (a decode loop's growing cache): the i-th call's keys are
    |x| + i rows of one cache, the whole cache's strides kept, so no two calls
    share a signature; each timed run starts with the module's memos empty,
    so every call of it takes the launcher's whole path (it makes a launch
    plan; none is found)."""
    bench = _bench_script("launch_overhead")
    import generated.attention as m
    calls = bench.growing(m, {"b": 1, "h": 2, "q": 1, "x": 40}, torch.float16, "cpu", 3)
    assert [tuple(c[1].shape) for c in calls] == [(1, 2, 40, 64), (1, 2, 41, 64), (1, 2, 42, 64)]
    assert calls[2][1].stride() == calls[0][1].stride() == (2 * 43 * 64, 43 * 64, 64, 1)
    assert calls[0][0].shape == (1, 2, 1, 64)   # Q has no x
    found = []
    plan = m._launch_plan
    monkeypatch.setattr(m, "_launch_plan", lambda key: found.append(plan(key)[0] is not None) or plan(key))
    row = bench.measure("attention", 4, "cpu", new_shapes=True)
    assert row["launches"] == {"_attention_kernel": 1} and row["us"] > 0
    assert len(found) == 50 + 5 * 4 and not any(found[50:])   # the warm-up goes round the 4 lengths
    assert bench.main(["--calls", "3", "--new-shapes", "--out", str(tmp_path), "gqa"]) == 0
    (path,) = tmp_path.glob("launch-overhead-new-shapes-cpu-*.md")
    assert "each call a new cache length" in path.read_text()
    with pytest.raises(SystemExit, match="leave out --backward"):
        bench.main(["--new-shapes", "--backward", "gqa"])


def test_launch_overhead_lengths_passes_one_cache_a_length_a_call(tmp_path, monkeypatch):
    """--lengths (a decode loop over a preallocated cache): every call the same
    cache of |x| + calls rows with lengths={'x': |x| + i}; the memos are kept,
    so after the first call every call of a run is launched from one plan."""
    bench = _bench_script("launch_overhead")
    import generated.attention as m
    found, seen = [], []
    plan, launcher = m._launch_plan, m.attention
    monkeypatch.setattr(m, "_LAUNCH_PLANS", {})
    monkeypatch.setattr(m, "_launch_plan", lambda key: found.append(plan(key)[0] is not None) or plan(key))
    monkeypatch.setattr(m, "attention", lambda *a, **kw: seen.append((a[1].shape[2], kw)) or launcher(*a, **kw))
    row = bench.measure("attention", 4, "cpu", lengths=True)
    assert row["launches"] == {"_attention_kernel": 1} and row["us"] > 0
    assert len(found) == 50 + 5 * 4 and not found[0] and all(found[1:])
    assert {n for n, _ in seen} == {4096 + 4}
    assert [kw for _, kw in seen[-4:]] == [{"lengths": {"x": 4096 + i}} for i in range(4)]
    assert bench.main(["--calls", "3", "--lengths", "--out", str(tmp_path), "gqa"]) == 0
    (path,) = tmp_path.glob("launch-overhead-lengths-cpu-*.md")
    assert "lengths={'x': one more key a call}" in path.read_text()
    with pytest.raises(SystemExit, match="one of them"):
        bench.main(["--new-shapes", "--lengths", "gqa"])


def test_run_h100_decode_stage_runs_the_host_time_then_the_decode_bench(tmp_path):
    """run_h100.sh decode, PYTHON a stand-in that records its arguments: both
    scripts exist and write into the stage's output folder, the seconds of
    launch_overhead.py first (decode.py may run to the stage's limit)."""
    calls = run_stage_recorded(tmp_path, "decode")
    assert calls == [["bench/launch_overhead.py", "--out", str(tmp_path / "out")],
                     ["bench/launch_overhead.py", "--backward", "--out", str(tmp_path / "out")],
                     ["bench/launch_overhead.py", "--new-shapes", "--out", str(tmp_path / "out")],
                     ["bench/launch_overhead.py", "--lengths", "--out", str(tmp_path / "out")],
                     ["bench/decode.py", "--out", str(tmp_path / "out")]]
    assert all((REPO / c[0]).is_file() for c in calls)


def test_launch_overhead_with_tritons_launch_path_compiles_for_hopper_and_runs_nothing():
    """--triton (a fresh process: Triton must compile, not interpret): each
    call goes through Triton's binder and kernel cache, the kernels compiled
    for sm_90 once, one launch a call; nothing runs on this machine."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(REPO / "bench" / "launch_overhead.py"), "--triton", "--calls", "5",
                           "attention"], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Triton's launch path included up to its C launcher" in done.stdout
    assert "| attention | b=1, h=8, q=1, x=4096 | _attention_kernel x1 |" in done.stdout
    refused = subprocess.run([sys.executable, str(REPO / "bench" / "launch_overhead.py"), "--triton"],
                             env=dict(env, TRITON_INTERPRET="1"), cwd=REPO, capture_output=True, text=True,
                             timeout=120)
    assert refused.returncode != 0 and "unset TRITON_INTERPRET" in refused.stderr


def test_decode_graph_timing_warms_up_captures_checks_the_replay_and_reports_failures(monkeypatch):
    """bench/decode.py's graph_ms with torch.cuda's graph API faked (no GPU
    here): three warm-up calls on a side stream, one captured, the replay
    held to the eager call's output bit for bit, and a step that cannot be
    captured reported in its row rather than stopping the stage."""
    import contextlib

    decode = _bench_script("decode")

    class Stream:
        def wait_stream(self, other):
            pass

    class Graph:
        replays = 0

        def replay(self):
            Graph.replays += 1

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda g: contextlib.nullcontext())
    timed = []
    monkeypatch.setattr(harness, "_ms", lambda fn, device, reps: (timed.append((fn, device)), 0.25)[1])

    calls = []
    out = torch.randn(3, 4)

    def step():
        calls.append(1)
        return out.clone(), None
    assert decode.graph_ms(step, harness) == {"graph_ms": 0.25}
    assert len(calls) == 5                      # 3 warm-ups, the capture, the eager call it is checked against
    assert Graph.replays == 1 and timed[0][1] == "cuda" and timed[0][0].__name__ == "replay"

    drift = iter(range(100))
    assert decode.graph_ms(lambda: torch.full((2,), float(next(drift))), harness) == \
        {"graph_error": "replayed output off the call's by 1"}

    def broken():
        raise RuntimeError("operation not permitted when stream is capturing")
    assert decode.graph_ms(broken, harness) == \
        {"graph_error": "RuntimeError: operation not permitted when stream is capturing"}


def test_the_committed_gpu_records_fit_the_schema_and_render_as_committed():
    """bench/results/ holds what GPU sessions measured: each record fits the schema, is no smoke run,
    and its markdown is what results.markdown renders from its JSON (the tables in the docs quote
    them)."""
    records = sorted(p for p in (REPO / "bench" / "results").glob("*.json")
                     if not p.name.startswith(("autotune-", "decode-", "matmul-order-")))
    assert records
    for path in records:
        data = json.loads(path.read_text())
        results.validate(data)
        assert not data["smoke"] and data["device"]["kind"] == "cuda", path.name
        assert path.with_suffix(".md").read_text() == results.markdown(data), path.name


def test_the_committed_decode_records_are_gpu_runs_that_passed_their_checks_and_render_as_committed():
    """bench/decode.py's records (their own layout, not napkin bench's): no
    smoke run, every napkin and flex row checked ok against float64 before it
    was timed, and the markdown is decode.py's rendering of the JSON."""
    decode = _bench_script("decode")
    records = sorted((REPO / "bench" / "results").glob("decode-*.json"))
    assert records
    for path in records:
        data = json.loads(path.read_text())
        assert not data["smoke"] and data["rows"], path.name
        assert all(r["ok"] for r in data["rows"] if r["impl"] != "sdpa"), path.name
        assert path.with_suffix(".md").read_text() == decode.markdown(data), path.name


# --------------------------------------------------------------------------
# bench/matmul_order.py: a contraction's program order against torch.matmul
# --------------------------------------------------------------------------

def test_matmul_order_checks_each_order_before_timing_it_and_writes_its_record(tmp_path, monkeypatch):
    """The CPU smoke: each group size's product and gradients checked against float64 and
    timed, the model's DRAM bytes beside them, the record and its table written; a wrong
    product stops it before any time is taken.  Committed records (a GPU's) are no smoke
    and render as committed."""
    bench = _bench_script("matmul_order")
    assert bench.main(["--sizes", "40", "--groups", "0,4", "--reps", "1", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("matmul-order-cpu-*.json")
    data = json.loads(path.read_text())
    assert [(r["impl"], r["group"]) for r in data["rows"]] == [("torch.matmul", None), ("napkin", 0), ("napkin", 4)]
    assert all(max(r["errors"].values()) < 1e-5 and r["dram_forward"] > 0 for r in data["rows"][1:])
    assert path.with_suffix(".md").read_text() == bench.markdown(data)
    import generated.matmul as mm
    monkeypatch.setattr(mm, "matmul", lambda a, b: (a @ b) * 1.01)
    with pytest.raises(AssertionError, match="N=40, group 4: error"):
        bench.measure(mm, 40, 4, torch.float32, "cpu", 1)
    for record in (REPO / "bench" / "results").glob("matmul-*.json"):
        committed = json.loads(record.read_text())
        assert not committed["smoke"] and record.with_suffix(".md").read_text() == bench.markdown(committed)


def test_matmul_fp8_checks_napkins_product_against_float64_and_records_each_baseline(tmp_path, monkeypatch):
    """--fp8's CPU smoke: the e4m3 product (its bf16 entries each within a unit of float64's)
    timed beside torch's two baselines, each row checked or saying why not; a wrong napkin
    product stops the run."""
    bench = _bench_script("matmul_order")
    assert bench.main(["--fp8", "--sizes", "40", "--reps", "1", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("matmul-fp8-cpu-*.json")
    data = json.loads(path.read_text())
    assert [r["impl"] for r in data["rows"]] == ["napkin fp8", "torch._scaled_mm", "torch.matmul bf16"]
    assert data["rows"][0]["relative_error"] < 2 ** -7 and data["rows"][0]["ms"] > 0
    assert data["rows"][1]["ms"] is not None or data["rows"][1]["error"]
    assert path.with_suffix(".md").read_text() == bench.markdown(data)
    monkeypatch.setattr(bench, "FP8", bench.FP8.replace("* sa * sb", "* sa * sb * 1.01"))
    with pytest.raises(AssertionError, match="N=40, napkin fp8: an entry is more than one bf16 unit off"):
        bench.quantised_rows("fp8", 40, "cpu", 1, tmp_path)


def test_matmul_int8_checks_napkins_product_against_float64_and_records_each_baseline(tmp_path, monkeypatch):
    """--int8's CPU smoke: the int8 product (an int32 sum, then the scales; its bf16 entries
    each within a unit of float64's) beside torch._int_mm scaled in torch and bf16 torch.matmul;
    a wrong napkin product stops the run."""
    bench = _bench_script("matmul_order")
    assert bench.main(["--int8", "--sizes", "40", "--reps", "1", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("matmul-int8-cpu-*.json")
    data = json.loads(path.read_text())
    assert [r["impl"] for r in data["rows"]] == ["napkin int8", "torch._int_mm, scaled", "torch.matmul bf16"]
    assert data["rows"][0]["relative_error"] < 2 ** -7 and data["rows"][0]["ms"] > 0
    assert data["rows"][1]["ms"] is not None or data["rows"][1]["error"]
    assert data["dtype"] == "int8" and path.with_suffix(".md").read_text() == bench.markdown(data)
    assert "An int8 product" in bench.markdown(data)
    monkeypatch.setattr(bench, "INT8", bench.INT8.replace("* sa * sb", "* sa * sb * 1.01"))
    with pytest.raises(AssertionError, match="N=40, napkin int8: an entry is more than one bf16 unit off"):
        bench.quantised_rows("int8", 40, "cpu", 1, tmp_path)
