"""Autotuning: the tuned-config cache's keys and the runtime snippet that
reads it, the tuner and its candidates, budgets, and concurrent writers."""
from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path

import pytest
import torch

import napkin
from napkin import autotune, tunecache
from napkin.bench import budget, harness, reference, results
from napkin.errors import NapkinError

from bench_helpers import EXAMPLES, F16, T16, WIRES, record as _data

# --------------------------------------------------------------------------
# Autotune: cache keys, the runtime snippet, tuning, candidates.
# --------------------------------------------------------------------------



def _sizes(n, b=1, h=16):
    return {"b": b, "h": h, "q": n, "x": n}


def test_shape_bucket_rounds_each_wire_up_to_a_power_of_two():
    assert tunecache.shape_bucket(_sizes(3000, b=1, h=12), WIRES) == (("b", 1), ("h", 16), ("q", 4096), ("x", 4096))
    assert tunecache.shape_bucket(_sizes(4096), WIRES)[2] == ("q", 4096)
    assert tunecache.shape_bucket(_sizes(4097), WIRES)[2] == ("q", 8192)


def test_cache_round_trip_and_bucket_hits(tmp_path, monkeypatch):
    monkeypatch.setenv("NAPKIN_CACHE", str(tmp_path))
    cache = tunecache.Cache()
    assert cache.path == tmp_path / "autotune.json"
    config = tunecache.Config((("q", 128), ("x", 64)), 8, 3)
    key = tunecache.cache_key("abc", "NVIDIA H100", F16, _sizes(3000), WIRES)
    cache.put(key, config, ms=1.5)
    data = json.loads(cache.path.read_text())
    assert data["schema"] == tunecache.SCHEMA
    assert data["entries"][key]["config"] == {"block_q": 128, "block_x": 64, "num_warps": 8, "num_stages": 3}
    same_bucket = tunecache.cache_key("abc", "NVIDIA H100", F16, _sizes(4000), WIRES)
    assert cache.get(same_bucket) == config
    for other in (tunecache.cache_key("abc", "NVIDIA H100", F16, _sizes(5000), WIRES),   # next bucket
                  tunecache.cache_key("abc", "NVIDIA H200", F16, _sizes(3000), WIRES),   # other device
                  tunecache.cache_key("abd", "NVIDIA H100", F16, _sizes(3000), WIRES)):  # other diagram
        assert cache.get(other) is None
    # another entry keeps the first
    cache.put(tunecache.cache_key("abc", "NVIDIA H100", F16, _sizes(9000), WIRES), config, ms=2.0)
    assert len(cache.entries()) == 2 and cache.get(same_bucket) == config


def test_a_corrupt_or_foreign_cache_reads_as_empty(tmp_path, monkeypatch):
    monkeypatch.setenv("NAPKIN_CACHE", str(tmp_path))
    (tmp_path / "autotune.json").write_text("{not json")
    assert tunecache.Cache().entries() == {}
    (tmp_path / "autotune.json").write_text(json.dumps({"schema": "other/9", "entries": {"k": {}}}))
    assert tunecache.Cache().get("k") is None


def _put_many(path, writer, n):   # a process of the concurrent-writers test
    for i in range(n):
        tunecache.Cache(Path(path)).put(f"{writer}-{i}", tunecache.Config((("q", 64),), 4, 2), ms=float(i))


def test_writers_in_several_processes_keep_every_entry(tmp_path):
    """Each put reads, changes and renames under a lock: without it the last
    rename won and 149 of 400 entries survived (a helper's hunt)."""
    import multiprocessing

    path = tmp_path / "autotune.json"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_put_many, args=(str(path), w, 30)) for w in "abcd"]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    assert sorted(tunecache.Cache(path).entries()) == sorted(f"{w}-{i}" for w in "abcd" for i in range(30))
    assert not [f.name for f in tmp_path.iterdir() if f.name.endswith(".tmp")]


def test_bench_autotune_refuses_a_cache_it_cannot_write_before_tuning(tmp_path, capsys, monkeypatch):
    """The bench's launches read the configs the tuner stores: a tuning that
    cannot be stored was spent and then failed as 'the launcher would not read
    the config tuned for it' (a review); now the run stops first, in words.  Where it tunes:
    on a GPU (stood in for here; the refusal comes before any launch)."""
    from napkin.cli import main

    (tmp_path / "file").write_text("")
    monkeypatch.setenv("NAPKIN_CACHE", str(tmp_path / "file"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    status = main(["bench", str(EXAMPLES / "attention.ncd"), "--seqlen", "32", "--autotune", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert status == 1 and f"--autotune stores its configs in {tmp_path / 'file' / 'autotune.json'}, which napkin " \
        f"cannot write ({tmp_path / 'file'} is a file, not a folder): point NAPKIN_CACHE at a folder it can" in err
    assert tunecache.Cache(tmp_path / "ok" / "autotune.json").unwritable() is None
    assert not [p.name for p in (tmp_path / "ok").iterdir() if p.name != "autotune.json.lock"]


def test_bench_autotune_on_the_cpu_runs_beside_a_cache_it_cannot_write(tmp_path, capsys, monkeypatch):
    """On the CPU --autotune tunes nothing and stores nothing, yet the run said it takes the cached
    or the schedule's configs and then stopped: "--autotune stores its configs in .../autotune.json,
    which napkin cannot write (... is a file, not a folder)" (rc 1).  The run goes on now."""
    from napkin.cli import main

    if torch.cuda.is_available():
        pytest.skip("on a GPU --autotune tunes, and a cache it cannot write is refused (the test above)")
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("NAPKIN_CACHE", str(tmp_path / "file"))
    status = main(["bench", str(EXAMPLES / "causal.ncd"), "--seqlen", "32", "--autotune", "--preset", "smoke",
                   "--no-backward", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert "--autotune tunes on a GPU only" in err and "which napkin cannot write" not in err
    assert status == 0, err


def test_a_file_system_that_refuses_locks_still_gets_its_entries(tmp_path, monkeypatch):
    """flock raises ENOLCK or EOPNOTSUPP on some network mounts: write unlocked, as before the lock."""
    import errno
    import fcntl

    def refuse(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(fcntl, "flock", refuse)
    tunecache.Cache(tmp_path / "autotune.json").put("k", tunecache.Config((("q", 64),), 4, 2))
    assert list(tunecache.Cache(tmp_path / "autotune.json").entries()) == ["k"]


def test_a_put_keeps_an_unreadable_file_aside_and_the_files_mode(tmp_path):
    path = tmp_path / "autotune.json"
    old = json.dumps({"schema": tunecache.SCHEMA, "entries": {"a": {"config": {}}}})[:-1] + ",}"   # one stray comma
    path.write_text(old)
    path.chmod(0o644)
    with pytest.warns(UserWarning, match=r"autotune.json was no readable napkin-autotune/2 cache .*moved to .*\.old"):
        tunecache.Cache(path).put("new", tunecache.Config((("q", 64),), 4, 2))
    assert (tmp_path / "autotune.json.old").read_text() == old
    assert list(tunecache.Cache(path).entries()) == ["new"]
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask       # mkstemp's 0600 would hide it from others
    with warnings.catch_warnings():
        warnings.simplefilter("error")                           # an empty file, a readable cache: no warning
        tunecache.Cache(path).put("newer", tunecache.Config((("q", 32),), 4, 2))
        path.write_text("")
        tunecache.Cache(path).put("a", tunecache.Config((("q", 32),), 4, 2))


def test_a_cache_it_cannot_write_keeps_the_tuning(tmp_path):
    (tmp_path / "file").write_text("")
    cache = tunecache.Cache(tmp_path / "file" / "autotune.json")   # its folder is a file
    configs = [tunecache.Config((("q", q),), 4, 2) for q in (32, 64)]
    with pytest.warns(UserWarning, match="the tuned config could not be cached in .*file/autotune.json"):
        tuned = autotune.autotune(lambda **o: None, configs, lambda fn: 1.0, cache=cache, key="k")
    assert tuned.best in configs and not tuned.cached and len(tuned.trials) == 2


@pytest.mark.parametrize("make, words", [
    (lambda root: (root / "c" / "autotune.json.lock").mkdir(parents=True), "{root}/c/autotune.json.lock is a folder"),
    (lambda root: (root / "c").write_text(""), "{root}/c is a file, not a folder")])
def test_a_cache_it_cannot_write_is_told_by_what_is_in_the_way(tmp_path, make, words):
    """Its lock file a folder: unwritable() said "Is a directory" and the warning "could not be
    cached in .../autotune.json: Is a directory" (the cache is no folder, its lock is); $NAPKIN_CACHE
    a file: the warning said "File exists".  Both name the path in the way now."""
    make(tmp_path)
    cache = tunecache.Cache(tmp_path / "c" / "autotune.json")
    words = words.format(root=tmp_path)
    assert cache.unwritable() == words
    configs = [tunecache.Config((("q", 32),), 4, 2)]
    with pytest.warns(UserWarning) as caught:
        autotune.autotune(lambda **o: None, configs, lambda fn: 1.0, cache=cache, key="k")
    assert [str(w.message) for w in caught] == [f"the tuned config could not be cached in {cache.path}: {words}"]


@pytest.mark.parametrize("config", [
    "fast", [64], None, {"block_q": 7, "num_warps": 4, "num_stages": 2},
    {"block_q": -64, "num_warps": 4, "num_stages": 2}, {"block_q": "64", "num_warps": 4, "num_stages": 2},
    {"block_q": 64.7, "num_warps": 4, "num_stages": 2}, {"block_q": 64, "num_warps": 3, "num_stages": 2},
    {"block_q": 64, "num_warps": 4, "num_stages": 2, "tma": "false"},
    {"block_q": 1 << 20, "num_warps": 4, "num_stages": 2},
    {"block_q": 4096, "block_x": 512, "num_warps": 4, "num_stages": 2}])
def test_the_tuner_and_the_launcher_refuse_the_same_cached_configs(tmp_path, monkeypatch, config):
    """A cached config either reader would not launch is no config to both
    (the tuner once coerced "64", 64.7 and tma "false" -> True, and kept them)."""
    monkeypatch.setenv("NAPKIN_CACHE", str(tmp_path))
    key = tunecache.cache_key("f00d", "cpu", F16, _sizes(1000), WIRES)
    (tmp_path / "autotune.json").write_text(json.dumps({"schema": tunecache.SCHEMA,
                                                        "entries": {key: {"config": config, "ms": 1.0}}}))
    ns: dict = {}
    exec(compile(tunecache.runtime_source("f00d", WIRES), "<snippet>", "exec"), ns)
    assert ns["_autotune_lookup"](_sizes(1000), "cpu", T16) is None
    assert tunecache.Cache().get(key) is None
    fresh = tunecache.Config((("q", 64), ("x", 64)), 4, 2)
    tuned = autotune.autotune(lambda **o: None, [fresh], lambda fn: 1.0, cache=tunecache.Cache(), key=key)
    assert not tuned.cached and tuned.best == fresh           # retuned, not taken from the bad entry


def test_cached_facts_of_the_wrong_type_do_not_stop_the_tuner(tmp_path):
    cache = tunecache.Cache(tmp_path / "autotune.json")
    good = {"block_q": 64, "num_warps": 4, "num_stages": 2}
    configs = [tunecache.Config((("q", q),), 4, 2) for q in (64, 32, 16)]
    cache.path.write_text(json.dumps({"schema": tunecache.SCHEMA, "entries": {
        "done": {"config": good, "ms": "fast", "skipped": "x", "budget_s": [1]},
        "cut": {"config": good, "ms": 1.0, "truncated": True, "tried": 1, "candidates": 3,
                "order": autotune.order_digest(configs), "timed": "x", "failed": [1]}}}))
    done = autotune.autotune(lambda **o: None, configs, lambda fn: 1.0, cache=cache, key="done")
    assert done.cached and math.isnan(done.ms) and done.skipped == 0 and done.budget_s is None
    cut = autotune.autotune(lambda **o: None, configs, lambda fn: 1.0, cache=cache, key="cut")
    assert cut.resumed_from == 1 and cut.facts()["timed"] == 2 and cut.facts()["failed"] == 0   # earlier: unknown


def test_a_config_tuned_on_16_bit_inputs_is_not_taken_by_a_float32_call(tmp_path, monkeypatch):
    """The key names the inputs' dtypes: float32 tiles take twice the shared
    memory, so a config tuned at float16 may not even launch at float32."""
    monkeypatch.setenv("NAPKIN_CACHE", str(tmp_path))
    ns: dict = {}
    exec(compile(tunecache.runtime_source("f00d", WIRES), "<snippet>", "exec"), ns)
    tunecache.Cache().put(tunecache.cache_key("f00d", "cpu", F16, _sizes(1000), WIRES),
                         tunecache.Config((("q", 128), ("x", 128)), 8, 4))
    assert ns["_autotune_lookup"](_sizes(1000), "cpu", T16)["block_q"] == 128
    assert ns["_autotune_lookup"](_sizes(1000), "cpu", {"fp16": torch.float32}) is None
    assert ns["_autotune_lookup"](_sizes(1000), "cpu", {"fp16": torch.bfloat16}) is None
    mixed = {"fp32": torch.float32, "fp16": torch.bfloat16}             # ALiBi's slopes beside bf16 Q, K, V
    assert tunecache.cache_key("f00d", "cpu", mixed, _sizes(1000), WIRES).split("|")[2] == "bfloat16,float32"
    assert tunecache.input_classes(napkin.load("examples/alibi.ncd")) == {"fp16": "float16", "fp32": "float32"}


def test_a_cache_nested_too_deep_for_json_reads_as_empty(tmp_path, monkeypatch):
    monkeypatch.setenv("NAPKIN_CACHE", str(tmp_path))
    (tmp_path / "autotune.json").write_text("[" * 100000 + "]" * 100000)
    assert tunecache.Cache().entries() == {}
    ns: dict = {}
    exec(compile(tunecache.runtime_source("f00d", WIRES), "<snippet>", "exec"), ns)
    assert ns["_autotune_lookup"](_sizes(1000), "cpu", T16) is None   # was RecursionError: every launch failed


def test_the_committed_tunings_are_read_by_this_napkin():
    """bench/results/autotune-*.json seeds a GPU session's cache (bench/device.sh),
    where cut-short tunings resume: each entry must be one this napkin's
    reader finds, under the key a bench of its diagram's variant asks for."""
    folder = Path(__file__).resolve().parents[1]
    variants = {}
    for path in sorted((folder / "examples").glob("*.ncd")):
        d = napkin.load(str(path))
        for dtype in ("bfloat16", "float16"):
            try:
                v, text = harness.variant(d, path.read_text(), dtype, 128)
            except NapkinError:
                continue
            variants[tunecache.diagram_hash(text)] = v
    newest = sorted((folder / "bench" / "results").glob("autotune-*.json"))[-1]
    cache = tunecache.Cache(newest)
    assert cache.entries()
    for key, entry in cache.entries().items():
        v = variants[key.split("|")[0]]
        kind = key.split("|")[4] if key.count("|") == 4 else ""
        assert key == tunecache.cache_key(key.split("|")[0], key.split("|")[1], tunecache.input_classes(v),
                                         entry["sizes"], tunecache.symbolic_wires(v), kind)
        assert cache.get(key) is not None, key


def test_runtime_snippet_reads_what_the_writer_stored(tmp_path, monkeypatch):
    monkeypatch.setenv("NAPKIN_CACHE", str(tmp_path))
    source = tunecache.runtime_source("f00d", WIRES)
    imports = {line.split()[1] for line in source.splitlines() if line.startswith(("import ", "from "))}
    assert imports <= {"json", "operator", "os", "threading", "torch"}, imports   # a generated module may import little
    ns: dict = {}
    exec(compile(source, "<snippet>", "exec"), ns)
    assert ns["_autotune_lookup"](_sizes(1000), "cpu", T16) is None
    cache = tunecache.Cache()
    cache.put(tunecache.cache_key("f00d", "cpu", F16, _sizes(1000), WIRES), tunecache.Config((("q", 64), ("x", 32)), 4, 2))
    # the memo notices the file changed; a length in the same bucket hits
    assert ns["_autotune_lookup"](_sizes(1000), "cpu", T16)["block_q"] == 64
    assert ns["_autotune_lookup"](_sizes(600), "cpu", T16)["block_x"] == 32
    assert ns["_autotune_lookup"](_sizes(1100), "cpu", T16) is None
    filled = ns["_autotune_fill"]({"block_q": None, "block_x": 16, "num_warps": None, "num_stages": None},
                                  _sizes(1000), "cpu", T16)
    # explicit wins; a block given sets the cached blocks aside (tuned with each other), not its warps
    assert filled == {"block_q": None, "block_x": 16, "num_warps": 4, "num_stages": 2}
    filled = ns["_autotune_fill"]({"block_q": None, "block_x": None, "num_warps": 8, "num_stages": None},
                                  _sizes(1000), "cpu", T16)
    assert filled == {"block_q": 64, "block_x": 32, "num_warps": 8, "num_stages": 2}


def test_autotune_keeps_the_fastest_skips_failures_and_caches(tmp_path):
    cache = tunecache.Cache(tmp_path / "c.json")
    configs = [tunecache.Config((("q", q), ("x", 64)), w, 2) for q in (64, 128) for w in (4, 8)]
    fake_ms = {(64, 4): 3.0, (64, 8): 2.5, (128, 4): 1.25, (128, 8): None}
    timed = []

    def fn(block_q, block_x, num_warps, num_stages):
        if fake_ms[(block_q, num_warps)] is None:
            raise RuntimeError("out of resources")
        return fake_ms[(block_q, num_warps)]

    def bench(call):
        timed.append(1)
        return call()

    tuned = autotune.autotune(fn, configs, bench, cache=cache, key="k", diagram="attention")
    assert tuned.best == tunecache.Config((("q", 128), ("x", 64)), 4, 2) and tuned.ms == 1.25
    assert not tuned.cached and [t.ms is None for t in tuned.trials] == [False, False, False, True]
    assert "out of resources" in tuned.trials[3].error
    assert cache.entries()["k"]["diagram"] == "attention"
    timed.clear()
    again = autotune.autotune(fn, configs, bench, cache=cache, key="k")
    assert again.cached and again.best == tuned.best and timed == []   # no retuning
    with pytest.raises(NapkinError, match="no configuration that runs"):
        autotune.autotune(fn, configs[3:], bench)


def test_a_tuning_cut_short_goes_on_where_it_stopped(tmp_path):
    """A budget that ran out after two of six candidates: the next --autotune times the cached best
    again and then only the four it never reached, keeps the faster, and counts over all six; the
    finished entry is read back without timing.  A changed candidate list starts afresh, and an
    entry from before the list's fingerprint was kept (the H200 session's) resumes when its counts
    fit and its best is among the candidates it tried."""
    cache = tunecache.Cache(tmp_path / "c.json")
    configs = [tunecache.Config((("q", q), ("x", x)), 8, 3) for q in (64, 128) for x in (32, 64, 128)]
    fake_ms = dict(zip(configs, (3.0, 2.0, 1.0, 4.0, 0.5, None)))
    now, timed = [0.0], []

    def fn(block_q, block_x, num_warps, num_stages):
        return fake_ms[tunecache.Config((("q", block_q), ("x", block_x)), num_warps, num_stages)]

    def bench(call):
        now[0] += 10.0                       # each trial takes 10 s of the budget
        ms = call()
        if ms is None:
            raise RuntimeError("out of resources")
        timed.append(ms)
        return ms

    clock = lambda: now[0]  # noqa: E731
    first = autotune.autotune(fn, configs, bench, cache=cache, key="k", budget_s=25.0, clock=clock)
    assert timed == [3.0, 2.0] and first.best == configs[1] and first.facts()["skipped"] == 4
    assert cache.entries()["k"]["tried"] == 2 and cache.entries()["k"]["order"] == autotune.order_digest(configs)
    timed.clear()
    second = autotune.autotune(fn, configs, bench, cache=cache, key="k", budget_s=100.0, clock=clock)
    assert timed == [2.0, 1.0, 4.0, 0.5]      # the cached best again, then candidates 3 to 6
    assert not second.cached and second.best == configs[4] and second.ms == 0.5
    facts = second.facts()
    assert (facts["candidates"], facts["timed"], facts["failed"], facts["skipped"]) == (6, 5, 1, 0)
    assert facts["resumed_from"] == 2 and not facts["truncated"] and cache.entries()["k"]["tried"] == 6
    timed.clear()
    assert autotune.autotune(fn, configs, bench, cache=cache, key="k", clock=clock).cached and timed == []

    # the row's record: the counts over all six, and this run's trials, the re-timed best first
    record = harness.tuning_record(second)
    assert record["timed"] == 5 and [t["ms"] for t in record["trials"]] == [2.0, 1.0, 4.0, 0.5, None]
    assert record["trials"][0]["config"] == configs[1].kwargs() and "out of resources" in record["trials"][4]["error"]
    # a cached best that fails when timed again is counted failed, not timed
    fails = tunecache.Cache(tmp_path / "f.json")
    autotune.autotune(fn, configs, bench, cache=fails, key="k", budget_s=25.0, clock=clock)
    fake_ms[configs[1]] = None
    again = autotune.autotune(fn, configs, bench, cache=fails, key="k", budget_s=100.0, clock=clock).facts()
    assert (again["timed"], again["failed"], again["candidates"]) == (4, 2, 6) and again["skipped"] == 0
    fake_ms[configs[1]] = 2.0
    # resumed twice: a second cut keeps counting where the first left off
    autotune.autotune(fn, configs, bench, cache=cache, key="t", budget_s=5.0, clock=clock)
    autotune.autotune(fn, configs, bench, cache=cache, key="t", budget_s=35.0, clock=clock)
    assert cache.entries()["t"]["tried"] == 3 and cache.entries()["t"]["config"] == configs[2].kwargs()
    # another list (reordered): no resume, the entry is taken as it stands
    timed.clear()
    other = autotune.autotune(fn, configs[::-1], bench, cache=cache, key="t", budget_s=100.0, clock=clock)
    assert other.cached and timed == []
    assert autotune.autotune(fn, configs, bench, cache=cache, key="t", resume=False, clock=clock).cached
    # an entry without the fingerprint, as the 2026-11-26 cache has them
    entry = {"tried": 2, "candidates": 6, "truncated": True, "skipped": 4}
    assert autotune.resume_point(entry, configs[1], configs) == 2
    assert autotune.resume_point(entry, configs[4], configs) == 0          # its best was never among them
    assert autotune.resume_point(entry | {"candidates": 7}, configs[1], configs) == 0
    assert autotune.resume_point(entry | {"truncated": False}, configs[1], configs) == 0


def test_smem_estimate_counts_pipelined_tiles():
    d = napkin.load(EXAMPLES / "attention.ncd")
    c = tunecache.Config((("q", 128), ("x", 64)), 4, 2)
    # Q tile 128 x 64 fp16 once; K and V tiles 64 x 64 fp16, two stages each.
    assert autotune.smem_bytes(d, c, _sizes(4096)) == 128 * 64 * 2 + 2 * 2 * 64 * 64 * 2
    c3 = tunecache.Config((("q", 128), ("x", 64)), 4, 3)
    assert autotune.smem_bytes(d, c3, _sizes(4096)) == 128 * 64 * 2 + 3 * 2 * 64 * 64 * 2


def test_candidates_are_pruned_by_shared_memory_capacity():
    d = napkin.load(EXAMPLES / "attention.ncd")
    sizes = _sizes(16384)
    roomy, roomy_pruned = autotune.candidates(d, sizes, capacity=1 << 30)
    assert roomy and not any("shared memory" in p.why for p in roomy_pruned)
    assert roomy[0].blocks == (("q", 128), ("x", 64))          # the schedule's own comes first
    tight, pruned = autotune.candidates(d, sizes, capacity=50_000)
    assert tight and len(tight) < len(roomy)
    assert all(autotune.smem_bytes(d, c, sizes) <= 50_000 for c in tight)
    over = [p for p in pruned if "shared memory" in p.why]
    assert over and all(autotune.smem_bytes(d, p.config, sizes) > 50_000 for p in over)
    # a warp gets at least 16 rows
    assert all(dict(c.blocks)["q"] >= 16 * c.num_warps for c in roomy)
    assert autotune.candidates(d, sizes) == autotune.candidates(d, sizes)   # deterministic


def _target(name: str):
    """An example as run_h100.sh benchmarks it: head dim 128, bf16, 16K tokens, 16 heads."""
    path = EXAMPLES / f"{name}.ncd"
    d = harness.variant(napkin.load(path), path.read_text(), "bfloat16", 128)[0]
    sizes = {"b": 1, "hk": 4, "g": 4, "q": 16384, "x": 16384} if name == "gqa" else _sizes(16384)
    return d, sizes


H100_SMEM = 232448        # shared_memory_per_block_optin of an H100


@pytest.mark.parametrize("name", ["attention", "causal"])
def test_forward_candidates_at_the_target_are_hopper_shaped(name):
    """At 16K tokens, d 128: the streamed blocks FlashAttention kernels use,
    not the 16-wide ones the HBM ranking alone picked, and the schedule's
    own (128, 64) first."""
    d, sizes = _target(name)
    keep, pruned = autotune.candidates(d, sizes, capacity=H100_SMEM)
    shapes = [tuple(b for _, b in c.blocks) for c in keep]
    assert shapes[0] == (128, 64)
    assert {(128, 64), (128, 128), (64, 64), (64, 128)} <= set(shapes)
    assert all(x >= 32 for _, x in shapes)                     # 32 and wider fit: no 16-wide step
    tiny = [p for p in pruned if dict(p.config.blocks)["x"] == 16]
    assert tiny and all("wider streamed block fits" in p.why or "rows each" in p.why for p in tiny)
    # breadth first: every block shape once before any shape's second (warps, stages)
    first = len(set(shapes))
    assert len(set(shapes[:first])) == first
    assert len(keep) < 30 and len(set(keep)) == len(keep)


def test_a_compute_bound_band_tries_row_blocks_the_warps_can_fill():
    """A window of 1024 at 8K is compute-bound, where the roofline ranks the finest tiles first (they
    skip more of the band's edge): its two picks were 16 and 32 rows, which every warp count
    prunes, so only the schedule's 128 ran.  The picks now skip rows no warp count fills."""
    text = (EXAMPLES / "sliding_window.ncd").read_text().replace("q - x < 256", "q - x < 1024")
    d = napkin.load_text(text, "window.ncd")
    sizes = {"b": 1, "h": 16, "q": 8192, "x": 8192}
    from napkin.cost import tune
    assert tune(d, sizes, top=1)[0].block["q"] < autotune.MIN_ROWS_PER_WARP * min(autotune.WARPS)
    keep, pruned = autotune.candidates(d, sizes, capacity=H100_SMEM)
    assert {dict(c.blocks)["q"] for c in keep} == {64, 128, 256}
    assert not any("rows each" in p.why for p in pruned if dict(p.config.blocks)["q"] < 64)
    # decoding's 16 packed rows, short of every warp count, are still tried (with the warps they fill)
    decode = napkin.load(EXAMPLES / "ragged_decode.ncd")
    keep, _ = autotune.candidates(decode, {"b": 8, "hk": 8, "g": 4, "q": 1, "x": 8192})
    assert keep and {dict(c.blocks)["q"] for c in keep} == {16}


def test_register_estimate_prunes_what_would_spill_and_says_why():
    """float32 values a thread holds, against backward_hold.HELD_FP32: the
    forward's accumulator [128, 128] and score tile [128, 64] over 4 warps
    are 192 (sm_90 spills: napkin.bench.aot), over 8 warps 96."""
    from napkin.codegen.backward_hold import HELD_FP32

    d, sizes = _target("causal")
    keep, pruned = autotune.candidates(d, sizes, capacity=H100_SMEM)
    shape = autotune.kernel_shape(d, sizes)
    assert (shape.resident, shape.streamed, shape.widths, shape.tiles) == ("q", "x", 128, 1)
    assert shape.held({"q": 128, "x": 64}, 4) == 192 and shape.held({"q": 128, "x": 64}, 8) == 96
    why = {(p.config.blocks, p.config.num_warps, p.config.num_stages): p.why for p in pruned}
    reason = why[((("q", 128), ("x", 64)), 4, 3)]
    assert reason.startswith("registers: a thread would hold 192 float32 values") and f"more than {HELD_FP32}" in reason
    assert tunecache.Config((("q", 128), ("x", 64)), 8, 3) in keep
    for c in keep:
        assert shape.held(dict(c.blocks), c.num_warps) <= HELD_FP32
    assert any(p.why.startswith("registers") for p in pruned)


def test_backward_candidates_are_shaped_for_each_kernel():
    """dQ holds [rows, keys] tiles like the forward (resident q); dK/dV holds
    the transpose (resident x, rows streamed) and is judged by its own
    launcher rule (backward_hold.dkdv_default_tile); its untuned tile leads."""
    from napkin.codegen.backward_hold import dkdv_default_tile

    d, sizes = _target("causal")
    dq, dq_pruned = autotune.candidates(d, sizes, kind="bwd", lead=harness.untuned(d, sizes, "bwd"),
                                        capacity=H100_SMEM)
    lead = harness._backward_default(d, sizes, "bwd_kv")
    kv, kv_pruned = autotune.candidates(d, sizes, kind="bwd_kv", lead=lead, capacity=H100_SMEM)
    assert dq[0] == tunecache.Config((("q", 128), ("x", 64)), 8, 2)          # dQ's untuned launch
    assert kv[:2] == lead == [tunecache.Config((("q", 32), ("x", 128)), 8, s) for s in (2, 3)]
    # dQ: rows resident, many rows a warp; dK/dV: keys resident, at least 16 keys a warp
    assert all(dict(c.blocks)["q"] >= 16 * c.num_warps for c in dq)
    assert all(dict(c.blocks)["x"] >= 16 * c.num_warps for c in kv)
    assert {(128, 64), (128, 128), (64, 64)} <= {tuple(b for _, b in c.blocks) for c in dq}
    # dK/dV's tiles are the ones its own rule keeps: the launcher would not shrink them
    from dataclasses import replace

    plan = autotune.kernel_shape(d, sizes, "bwd_kv").plan
    full = {**sizes, "d": 128}
    for c in kv:
        b = dict(c.blocks)
        probe = replace(plan, forward=replace(plan.forward, blocks=(("q", b["x"]), ("x", b["q"]))))
        assert dkdv_default_tile(probe, full, c.num_warps)[:2] == (b["q"], b["x"])
    cut = [p for p in kv_pruned if p.why.startswith("registers")]
    assert cut and all("dkdv_default_tile" in p.why for p in cut)
    assert any(p.config.blocks == (("q", 64), ("x", 128)) and p.config.num_warps == 8 for p in cut)
    # dQ holds more than the forward ([128, 128] dQ accumulator and dS) and is pruned by its own estimate
    dq_shape = autotune.kernel_shape(d, sizes, "bwd")
    assert (dq_shape.resident, dq_shape.streamed) == ("q", "x")
    assert any(p.why.startswith("registers") and "dQ accumulators" in p.why for p in dq_pruned)
    assert kv != dq and not set(kv[2:]) & set(dq)


def test_backward_shared_memory_counts_what_each_kernel_loads():
    """dQ loads Q and dO once and streams K, V; dK/dV loads K, V once and
    streams Q, dO (dO in the inputs' dtype, as autograd hands it over) and
    the row state.  The counts agree with what Triton allocated for sm_90
    (napkin.bench.aot, causal d 128: dQ at (128, 64), 3 stages, 160 KiB)."""
    d, sizes = _target("causal")
    c = tunecache.Config((("q", 128), ("x", 64)), 8, 3)
    dq = autotune.kernel_shape(d, sizes, "bwd")
    assert autotune.kernel_smem(dq, c, sizes) == 2 * 128 * 128 * 2 + 2 * 128 * 4 + 3 * 2 * 64 * 128 * 2
    fwd = autotune.kernel_shape(d, sizes, "")
    assert autotune.kernel_smem(fwd, c, sizes) == autotune.smem_bytes(d, c, sizes)
    kv = autotune.kernel_shape(d, sizes, "bwd_kv")
    t = tunecache.Config((("q", 32), ("x", 128)), 8, 2)
    assert autotune.kernel_smem(kv, t, sizes) == 2 * 128 * 128 * 2 + 2 * (2 * 32 * 128 * 2 + 2 * 32 * 4)


def test_candidate_counts_at_the_target_stay_small():
    """What a GPU stage must compile: each kernel's list, lead included."""
    for name in ("attention", "causal", "sliding_window", "softcap", "alibi", "document_mask", "gqa"):
        d, sizes = _target(name)
        for kind in ("", "bwd", "bwd_kv"):
            keep, _ = autotune.candidates(d, sizes, kind=kind, lead=harness.untuned(d, sizes, kind),
                                          capacity=H100_SMEM)
            # at head dim 128 the forward's and dQ's lists hold 3 TMA variants (19 + 3, 18 + 3), dK/dV's 2
            assert 2 <= len(keep) <= (24 if kind in ("", "bwd") else 20), (name, kind, len(keep))
            streamed = autotune.kernel_shape(d, sizes, kind).streamed
            steps = [dict(c.blocks)[streamed] for c in keep]
            if kind == "bwd_kv":   # 16 rows stay (its default spills on Triton 3.6 where 16 does not), last
                assert steps == sorted(steps, key=lambda b: b <= 16), (name, kind)
            else:
                assert all(b >= 32 for b in steps), (name, kind)


def test_autotune_budget_stops_timing_and_records_what_it_skipped(tmp_path):
    """With a fake clock: each trial takes 10 s, the budget is 25 s.  After
    two trials (20 s spent, 10 s a trial) a third would end at 30 s, so the
    rest are skipped; the best of those timed is kept, and the cache entry
    and the result say how many were skipped."""
    now = [0.0]
    configs = [tunecache.Config((("q", q), ("x", 64)), 4, 2) for q in (16, 32, 64, 128, 256)]
    ms = {16: 5.0, 32: 3.0, 64: 2.0, 128: 1.0, 256: 0.5}

    def bench(call):
        now[0] += 10.0
        return call()

    cache = tunecache.Cache(tmp_path / "c.json")
    tuned = autotune.autotune(lambda block_q, **_: ms[block_q], configs, bench, cache=cache, key="k",
                              budget_s=25.0, clock=lambda: now[0])
    assert [t.config for t in tuned.trials] == configs[:2] and tuned.skipped == 3
    assert tuned.best == configs[1] and tuned.ms == 3.0
    facts = tuned.facts()
    assert facts == {"candidates": 5, "timed": 2, "failed": 0, "skipped": 3, "budget_s": 25.0, "truncated": True}
    entry = cache.entries()["k"]
    assert entry["skipped"] == 3 and entry["timed"] == 2 and entry["truncated"] is True
    # read back as it stands when not resumed (test_a_tuning_cut_short_goes_on_where_it_stopped)
    again = autotune.autotune(lambda **_: 0.0, configs, bench, cache=cache, key="k", resume=False)
    assert again.cached and again.skipped == 3
    # no budget: everything is timed
    now[0] = 0.0
    full = autotune.autotune(lambda block_q, **_: ms[block_q], configs, bench, clock=lambda: now[0])
    assert full.skipped == 0 and len(full.trials) == 5 and full.best == configs[4]


def test_autotune_budget_never_ends_without_a_timed_config():
    """Failures do not count as a result: the budget is not applied until one config has run."""
    now = [0.0]
    configs = [tunecache.Config((("q", q), ("x", 64)), 4, 2) for q in (16, 32, 64)]

    def fn(block_q, **_):
        if block_q < 64:
            raise RuntimeError("out of resources")
        return 1.0

    def bench(call):
        now[0] += 100.0
        return call()

    tuned = autotune.autotune(fn, configs, bench, budget_s=1.0, clock=lambda: now[0])
    assert tuned.best == configs[2] and tuned.skipped == 0 and tuned.facts()["failed"] == 2


def test_tune_budget_default_shares_a_ten_minute_command():
    # main: two diagrams, one point each, three kernels each
    main = budget.tune_budget(2, 3)
    assert main == (budget.RUN_S - budget.STARTUP_S - 2 * budget.POINT_S) // 6
    assert budget.STARTUP_S + 2 * budget.POINT_S + 6 * main <= budget.RUN_S
    assert budget.tune_budget(5, 3) >= budget.MIN_TUNE_S
    assert budget.tune_budget(1, 1) > main


def test_tune_share_gives_each_point_what_the_time_limit_leaves():
    """A fake clock: 300 s for two points of three kernels.  The first point gets (300 - start-up -
    2 points) / 6; the time it does not use goes to the second, and a point that ran long takes from it
    (never below MIN_TUNE_S).  A fixed --tune-budget is every point's."""
    now = [0.0]
    share = budget.TuneShare(300, 2, 3, clock=lambda: now[0])
    first = share.next()
    assert first == (300 - budget.STARTUP_S - 2 * budget.POINT_S) // 6 == 39
    now[0] = 100.0                                   # the first point took 100 s of its 15 + 25 + 6 * 39
    assert share.next() == (300 - 100 - budget.POINT_S) // 3 == 58
    late = budget.TuneShare(300, 2, 3, clock=lambda: now[0])
    now[0] += 280.0
    late.next()
    assert late.next() == budget.MIN_TUNE_S
    fixed = budget.TuneShare(300, 2, 3, fixed=7.5, clock=lambda: now[0])
    assert fixed.next() == fixed.next() == 7.5


def test_tune_share_skips_the_points_of_a_variant_that_failed():
    now = [0.0]
    share = budget.TuneShare(600, 4, 3, clock=lambda: now[0])
    share.next()
    share.passed(2)            # the first variant (2 points) failed after its first point
    assert share.next() == (600 - budget.POINT_S * 2) // 6
    share.passed(1)            # never goes back
    assert share.done == 3


def test_time_limit_reads_the_flag_then_the_environment(monkeypatch):
    parse = harness.build_parser().parse_args
    monkeypatch.delenv(budget.TIME_LIMIT_ENV, raising=False)
    assert budget.time_limit(parse(["a.ncd"])) == budget.RUN_S
    monkeypatch.setenv(budget.TIME_LIMIT_ENV, "250")
    assert budget.time_limit(parse(["a.ncd"])) == 250.0
    assert budget.time_limit(parse(["a.ncd", "--time-limit", "90"])) == 90.0
    monkeypatch.setenv(budget.TIME_LIMIT_ENV, "soon")
    with pytest.raises(NapkinError) as err:
        budget.time_limit(parse(["a.ncd"]))
    assert str(err.value).endswith("$NAPKIN_BENCH_SECONDS expects a positive number of seconds, not 'soon'")
    with pytest.raises(NapkinError) as err:
        budget.time_limit(parse(["a.ncd", "--time-limit", "0"]))
    assert str(err.value).endswith("--time-limit expects a positive number of seconds, not 0.0")


def test_tuning_is_shown_in_the_markdown_when_truncated():
    data = _data(smoke=False)
    row = data["rows"][0]
    row["config"] = {"block_q": 128, "block_x": 64, "num_warps": 8, "num_stages": 3}
    row["bwd_config"] = {"dq": None, "dkdv": {"block_q": 32, "block_x": 128, "num_warps": 8, "num_stages": 2}}
    row["tuning"] = {"fwd": {"candidates": 19, "timed": 7, "failed": 1, "skipped": 12, "budget_s": 65.0,
                             "truncated": True},
                     "dkdv": {"candidates": 6, "timed": 6, "failed": 0, "skipped": 0, "budget_s": 65.0,
                              "truncated": False}}
    results.validate(data)
    md = results.markdown(data)
    assert "## Tuning" in md
    assert "| causal | bfloat16 | 64 | fwd | block_q=128, block_x=64, num_warps=8, num_stages=3 | 7 of 19 | 1 | " \
           "**12 skipped: budget 65 s ran out** |" in md
    assert "| dkdv | block_q=32, block_x=128, num_warps=8, num_stages=2 | 6 of 6 | 0 | all timed |" in md
    # a config read back from the cache reports how its tuning went then
    entry = {"config": {}, "ms": 1.0, "tried": 7, "candidates": 19, "timed": 7, "failed": 0, "skipped": 12,
             "budget_s": 65.0, "truncated": True}
    row["tuning"] = {"fwd": harness._tuning_facts(entry), "dkdv": harness._tuning_facts({"config": {}})}
    md = results.markdown(data)
    assert "| 7 of 19 | 0 | **12 skipped: budget 65 s ran out** (cached) |" in md
    assert "| dkdv | block_q=32, block_x=128, num_warps=8, num_stages=2 | ? | ? | ? (cached) |" in md


def test_backward_kernels_lead_with_their_own_default_tiles():
    """dK/dV's own untuned tile and dQ's lead their candidates: tuning never
    ends worse than the default (backward_hold.dkdv_default_tile / dq_default_tile)."""
    gqa = napkin.load(EXAMPLES / "gqa.ncd")           # head dim 128: 128 keys by 32 rows, 8 warps
    sizes = {"b": 1, "hk": 2, "g": 4, "q": 16384, "x": 16384}
    lead = harness.untuned(gqa, sizes, "bwd_kv")
    assert lead == [tunecache.Config((("q", 32), ("x", 128)), 8, s) for s in (2, 3)]
    assert autotune.candidates(gqa, sizes, kind="bwd_kv", lead=lead)[0][:2] == lead
    # dQ's: the schedule's blocks (its keys would be halved only past HELD_FP32)
    assert harness.untuned(gqa, sizes, "bwd") == [tunecache.Config((("q", 128), ("x", 64)), 8, s) for s in (2, 3)]


def test_the_backward_tuning_call_times_gradients_of_the_options_given(tmp_path):
    """harness.backward_call: the forward once, then gradients of Q, or of K
    and V (the attention operands), under the options asked for; they match
    autograd's."""
    import inspect

    import torch

    d = napkin.load(EXAMPLES / "alibi.ncd")
    module, _ = harness.compile_module(d, (EXAMPLES / "alibi.ncd").read_text(), str(EXAMPLES / "alibi.ncd"), tmp_path)
    launcher = getattr(module, d.name)
    sizes = {"b": 1, "h": 2, "q": 37, "x": 37}
    inputs = [t.float() if t.is_floating_point() else t for t in reference.example_inputs(d, sizes, seed=3)]
    accepted = set(inspect.signature(launcher).parameters)
    for kind, wrt in (("bwd", ["Q"]), ("bwd_kv", ["K", "V"])):
        call = harness.backward_call(d, module, inputs, sizes, accepted, kind)
        small = call(block_q=16, block_x=32, num_warps=4, num_stages=2, not_an_option=1)
        again = call(block_q=16, block_x=32, num_warps=4, num_stages=2)
        other = call(block_q=32, block_x=16, num_warps=4, num_stages=2)
        assert len(small) == len(wrt)            # dQ alone, or dK and dV: one kernel each
        names = [t.name for t in d.inputs]
        for a, b, c, name in zip(small, again, other, wrt):
            assert a.shape == inputs[names.index(name)].shape
            assert torch.equal(a, b)             # the same graph and upstream gradient
            assert a.shape == c.shape and torch.isfinite(a).all()
        # the same gradients as autograd through the launcher at those options
        leaves = [t.detach().clone().requires_grad_(n in wrt) for n, t in zip(names, inputs)]
        out = launcher(*leaves, block_q=32, block_x=16, num_warps=4, num_stages=2)
        torch.manual_seed(0)
        call = harness.backward_call(d, module, inputs, sizes, accepted, kind)   # draws its upstream gradient
        torch.manual_seed(0)
        upstream = torch.randn_like(out)
        want = torch.autograd.grad(out, [t for t in leaves if t.requires_grad], upstream)
        for a, b in zip(call(block_q=32, block_x=16, num_warps=4, num_stages=2), want):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def test_the_backward_tuning_call_of_mla_takes_every_part(tmp_path):
    """MLA's dQ kernel writes both query parts' gradients and its dK/dV kernel both key parts'
    and V's: the tuning calls ask for all of them (the kinds named Q alone, K and V)."""
    import inspect

    text = (EXAMPLES / "mla.ncd").read_text().replace("wire c = 128", "wire c = 32").replace(
        "wire r = 64", "wire r = 16").replace("wire e = 128", "wire e = 24")
    d = napkin.load_text(text, "mla.ncd")
    module, _ = harness.compile_module(d, text, "mla.ncd", tmp_path)
    sizes = {"b": 1, "h": 2, "q": 37, "x": 37}
    inputs = [t.float() for t in reference.example_inputs(d, sizes, seed=3)]
    accepted = set(inspect.signature(getattr(module, d.name)).parameters)
    for kind, wrt in (("bwd", ["Qc", "Qr"]), ("bwd_kv", ["Kc", "Kr", "V"])):
        got = harness.backward_call(d, module, inputs, sizes, accepted, kind)(block_q=16, block_x=16)
        assert [g.shape for g in got] == [inputs[[t.name for t in d.inputs].index(n)].shape for n in wrt]
