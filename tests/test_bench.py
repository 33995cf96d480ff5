"""The benchmark's GPU-independent half: the results files, the harness's
pieces and its smoke run end to end on the CPU, and (skipped without one)
the real timing path on a GPU.  Flex emission is tests/test_bench_flex.py,
autotuning tests/test_autotune.py, the bench/ scripts
tests/test_bench_scripts.py."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

import napkin
from napkin import tunecache
from napkin.bench import baselines, budget, checks, flex, harness, reference, results
from napkin.errors import NapkinError

from bench_helpers import (EXAMPLES, F16, SIZES, WIRES, record as _data, fp32 as _fp32,
                           flex_vs_reference as _flex_vs_reference)

pytestmark = pytest.mark.usefixtures("quiet_flex")   # eager flex warns on every call (conftest.py)

# --------------------------------------------------------------------------
# Results files.
# --------------------------------------------------------------------------



def test_results_are_written_as_json_and_markdown_without_overwriting(tmp_path):
    data = _data(smoke=False)
    j1, m1 = results.write(data, tmp_path)
    assert j1.name == "nvidia-h100-80gb-hbm3-2025-01-02.json" and m1.suffix == ".md"
    assert json.loads(j1.read_text()) == data
    j2, _ = results.write(data, tmp_path)
    assert j2.name == "nvidia-h100-80gb-hbm3-2025-01-02-2.json" and j1.exists()
    md = m1.read_text()
    assert "| causal | bfloat16 | 1 | 2 | 64 | 64 | yes | ok | 2.000 |" in md
    assert "(1.5x)" in md                      # flex takes 3 ms, napkin 2 ms
    assert "\u2020 (0.5x)" in md and "speed reference" in md
    # the cell points at a note below the table, so a '|' in the message cannot break the table
    assert "| n/a [1] |" in md and "1. sdpa-cudnn on causal: RuntimeError: no kernel | for this" in md
    assert "SMOKE" not in md


def test_smoke_results_say_so(tmp_path):
    _, md = results.write(_data(smoke=True), tmp_path)
    assert "SMOKE RUN: not performance numbers" in md.read_text()


def test_validate_names_what_is_wrong():
    results.validate(_data())
    broken = _data()
    del broken["rows"][0]["results"][0]["impl"]
    with pytest.raises(NapkinError, match=r"rows\[0\]\.results\[0\] lacks 'impl'"):
        results.validate(broken)
    wrong = _data()
    wrong["schema"] = "napkin-bench/0"
    with pytest.raises(NapkinError, match="schema"):
        results.validate(wrong)


# --------------------------------------------------------------------------
# Harness pieces and the smoke run end to end.
# --------------------------------------------------------------------------

def test_parse_list_and_its_errors():
    assert harness.parse_list("1K, 16K,300", "seqlen") == [1024, 16384, 300]
    assert harness.parse_list(None, "seqlen") is None
    assert harness.parse_list("bfloat16,float16", "dtype", str) == ["bfloat16", "float16"]
    for bad in ("0", "1.5K", "x"):
        with pytest.raises(NapkinError, match="--seqlen"):
            harness.parse_list(bad, "seqlen")
    with pytest.raises(NapkinError, match="--dtype"):
        harness.parse_list("fp8", "dtype", str)


def test_grid_sizes_follow_roles_and_presets():
    gqa = napkin.load(EXAMPLES / "gqa.ncd")
    roles = flex.attention_roles(gqa)
    grid = {"seqlens": [2048], "batch": None, "heads": [8], "group": 4, "extra": {},
            "preset": harness.PRESETS["h100"]}
    assert harness.point_sizes(gqa, roles, grid) == [{"b": 8, "hk": 2, "g": 4, "q": 2048, "x": 2048}]
    grid["heads"] = [6]
    with pytest.raises(NapkinError, match="multiple of --group"):
        harness.point_sizes(gqa, roles, grid)
    att = napkin.load(EXAMPLES / "attention.ncd")
    grid = {"seqlens": [16384], "batch": None, "heads": None, "group": 4, "extra": {},
            "preset": harness.PRESETS["h100"]}
    # 16K tokens per batch and hidden 2048 with d = 64
    assert harness.point_sizes(att, flex.attention_roles(att), grid) == [{"b": 1, "h": 32, "q": 16384, "x": 16384}]


def test_check_sizes_shrink_only_when_the_reference_would_not_fit():
    d = napkin.load(EXAMPLES / "attention.ncd")
    roles = flex.attention_roles(d)
    small = {"b": 2, "h": 4, "q": 1024, "x": 1024}
    assert checks.check_sizes(d, roles, small) == small
    big = checks.check_sizes(d, roles, {"b": 8, "h": 16, "q": 16384, "x": 16384})
    assert big == {"b": 2, "h": 2, "q": 4096, "x": 4096}   # two of each: batch and head offsets checked
    assert reference.reference_elements(d, big) <= checks.CHECK_ELEMENTS
    # a short length is never raised to 128 (q=64 was checked at 128)
    decode = checks.check_sizes(d, roles, {"b": 1, "h": 16, "q": 64, "x": 1 << 20})
    assert decode == {"b": 1, "h": 2, "q": 64, "x": 1 << 19}


def test_variant_rewrites_dtypes_and_head_dim():
    path = EXAMPLES / "causal.ncd"
    d, text = napkin.load(path), path.read_text()
    same, same_text = harness.variant(d, text, "float16", None)
    assert same is d and same_text is text            # the file's own hash is kept
    v, vtext = harness.variant(d, text, "bfloat16", 128)
    assert v.wire("d").size == 128 and {t.dtype for t in v.inputs} == {"bf16"}
    assert v.tensor("O").dtype == "bf16" and v.tensor("lse").dtype is None
    assert napkin.load_text(vtext) == v


def test_reference_agrees_with_the_generated_modules_reference(tmp_path):
    codegen = pytest.importorskip("napkin.codegen")
    module, _ = harness.compile_module(napkin.load(EXAMPLES / "alibi.ncd"),
                                 (EXAMPLES / "alibi.ncd").read_text(), "examples/alibi.ncd", tmp_path)
    d = napkin.load(EXAMPLES / "alibi.ncd")
    inputs = module.example_inputs(SIZES, dtype=torch.float32)
    wide = [t.double() for t in inputs]
    theirs = module.reference(*wide)
    mine = reference.reference(d, inputs, SIZES)[0]
    assert codegen is not None and float((theirs - mine).abs().max()) < 1e-12


def test_a_run_stopped_midway_keeps_what_it_measured(tmp_path, monkeypatch):
    """The harness rewrites its one pair of files after every diagram: a GPU
    session's stage killed at its time limit keeps the diagrams it finished,
    marked partial; a finished run leaves the same pair, unmarked."""
    from napkin.cli import main

    calls = []

    def fake_variant(path, dtype, head_dim, *rest):
        calls.append(Path(path).stem)
        if len(calls) == 3:
            raise KeyboardInterrupt  # what a stage's timeout amounts to here
        row = _data()["rows"][0] | {"diagram": Path(path).stem, "file": str(path)}
        return [row]

    monkeypatch.setattr(harness, "_bench_variant", fake_variant)
    argv = ["bench", str(EXAMPLES / "causal.ncd"), str(EXAMPLES / "alibi.ncd"), str(EXAMPLES / "softcap.ncd"),
            "--seqlen", "48", "--out", str(tmp_path / "stopped")]
    assert main(argv) != 0  # the CLI turns the interrupt into its exit status
    assert calls == ["causal", "alibi", "softcap"]
    (json_path,) = (tmp_path / "stopped").glob("*.json")
    data = json.loads(json_path.read_text())
    results.validate(data)
    assert [r["diagram"] for r in data["rows"]] == ["causal", "alibi"]
    assert data["partial"] == "written after 2 of 3 diagram/dtype/head-dim variants"
    assert "**PARTIAL: written after 2 of 3" in json_path.with_suffix(".md").read_text()

    calls.clear()
    argv[-1] = str(tmp_path / "finished")
    assert main(argv[:3] + argv[4:]) == 0  # causal and alibi: it finishes
    (json_path,) = (tmp_path / "finished").glob("*.json")
    data = json.loads(json_path.read_text())
    assert [r["diagram"] for r in data["rows"]] == ["causal", "alibi"] and "partial" not in data
    assert "PARTIAL" not in json_path.with_suffix(".md").read_text()


def test_a_run_across_midnight_is_named_and_titled_by_the_day_it_began(tmp_path, monkeypatch):
    """The H100 run begun 2026-11-27 at 23:57 wrote its first diagram that day
    and its last after midnight: its files were named -2026-11-27 and titled
    2026-11-28.  Both now say the day the run began."""
    import datetime as real
    from napkin.cli import main

    days = iter(["2026-11-27", "2026-11-28", "2026-11-28", "2026-11-28"])

    class Clock(real.date):
        @classmethod
        def today(cls):
            return real.date.fromisoformat(next(days))

    monkeypatch.setattr(harness.datetime, "date", Clock)
    monkeypatch.setattr(harness, "_bench_variant", lambda path, *rest: [
        _data()["rows"][0] | {"diagram": Path(path).stem, "file": str(path)}])
    argv = ["bench", str(EXAMPLES / "causal.ncd"), str(EXAMPLES / "alibi.ncd"), "--seqlen", "48",
            "--out", str(tmp_path)]
    assert main(argv) == 0
    (json_path,) = tmp_path.glob("*.json")
    assert json_path.name.endswith("-2026-11-27.json")
    assert json.loads(json_path.read_text())["date"] == "2026-11-27"
    assert ", 2026-11-27\n" in json_path.with_suffix(".md").read_text().splitlines(keepends=True)[0]


@pytest.mark.parametrize("argv, message", [
    (["--size", "zz=64"], "attention.ncd: --size zz=64: diagram attention has no wire zz (its wires: b, h, q, x, d)"),
    (["--size", "d=128"], "attention.ncd: --size d=128: wire d of diagram attention is fixed at 64 "
                          "(--head-dim sets the fixed head dims)"),
    (["--out", "{afile}"], "--out {afile} is a file: the results need a folder"),
    # under a file: refused after the whole run was timed (atomic hunt), now before it
    (["--out", "{afile}/sub"], "--out {afile}/sub: {afile} is a file, not a folder")])
def test_bench_refuses_sizes_it_would_ignore_and_an_out_that_is_a_file(tmp_path, capsys, argv, message):
    """--size for a wire the diagram lacks, or a fixed wire, was silently
    ignored (the record said --size d=128 of a run at 64); --out naming a
    file failed with an internal error after the whole run."""
    from napkin.cli import main

    afile = tmp_path / "afile"
    afile.write_text("")
    argv = [a.format(afile=afile) for a in argv]
    out = [] if "--out" in argv else ["--out", str(tmp_path)]
    status = main(["bench", str(EXAMPLES / "attention.ncd"), "--seqlen", "32", "--no-backward", *out, *argv])
    err = capsys.readouterr().err
    assert status == 1 and message.format(afile=afile) in err, err
    assert not list(tmp_path.glob("cpu-*")) and afile.read_text() == ""


def test_a_cpu_smoke_run_says_when_the_launch_took_a_cached_config(tmp_path, capsys, monkeypatch):
    """No tuning on the CPU, but the launcher reads the cache's "cpu" entry:
    the row said "schedule" while the launch ran the cached blocks."""
    from napkin.cli import main

    monkeypatch.setenv("NAPKIN_CACHE", str(tmp_path))
    path = EXAMPLES / "attention.ncd"
    sizes = {"b": 1, "h": 2, "q": 32, "x": 32}
    key = tunecache.cache_key(tunecache.diagram_hash(napkin.read_source(path)), "cpu", F16, sizes, WIRES)
    tunecache.Cache().put(key, tunecache.Config((("q", 16), ("x", 32)), 2, 1), ms=1.0)
    assert main(["bench", str(path), "--seqlen", "32", "--no-backward", "--out", str(tmp_path)]) == 0
    (row,) = json.loads(next(tmp_path.glob("cpu-*.json")).read_text())["rows"]
    assert row["config_source"] == "cache (CPU smoke run: no tuning)"
    assert row["config"] == {"block_q": 16, "block_x": 32, "num_warps": 2, "num_stages": 1}
    assert row["check"]["ok"]


@pytest.mark.parametrize("flag", ["--group", "--reps"])
@pytest.mark.parametrize("value", ["0", "-2"])
def test_bench_counts_below_one_are_usage_errors(capsys, flag, value):
    from napkin.cli import main

    assert main(["bench", str(EXAMPLES / "gqa.ncd"), flag, value]) == 2    # argparse's usage error
    assert f"argument {flag}: expected a whole number of at least 1, got '{value}'" in capsys.readouterr().err


def test_bench_points_at_the_users_line_of_a_diagram_it_cannot_compile(tmp_path, capsys):
    """A rewritten variant (here for float16) is re-printed text: its line 6
    was reported as the file's, whose V (an fp8 value, refused) is declared on line 14."""
    from napkin.cli import main

    status = main(["bench", str(EXAMPLES / "attention_fp8.ncd"), "--no-backward", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert status == 1 and "attention_fp8.ncd:14:4: napkin cannot emit a kernel for input V" in err, err


@pytest.mark.slow
def test_napkin_bench_smoke_run_end_to_end(tmp_path, capsys):
    from napkin.cli import main

    status = main(["bench", str(EXAMPLES / "causal.ncd"), "--seqlen", "48", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    assert status == 0, out
    (json_path,) = tmp_path.glob("cpu-*.json")
    data = json.loads(json_path.read_text())
    results.validate(data)
    assert data["smoke"] and "NOT a performance number" in data["timing"]
    assert data["command"].startswith("napkin bench ") and "--seqlen 48" in data["command"]
    (row,) = data["rows"]
    assert row["check"]["ok"] and row["check"]["sizes"] == {"b": 1, "h": 2, "q": 48, "x": 48}
    assert row["check"]["errors"]["napkin"]["O"] < harness.TOLERANCE["float16"]
    assert row["check"]["full_size_vs_flex"]["ok"]
    assert max(row["check"]["backward"]["errors"]["napkin"].values()) < harness.TOLERANCE["float16"]
    fwd = {r["impl"]: r for r in row["results"] if r["pass"] == "fwd"}
    assert fwd["napkin"]["ms"] > 0 and fwd["flex"]["ms"] > 0 and fwd["sdpa-math"]["equivalent"]
    assert math.isclose(row["ratios"]["fwd"]["flex"], fwd["flex"]["ms"] / fwd["napkin"]["ms"])
    assert "SMOKE RUN" in out and str(json_path) in out
    assert os.environ.get("TRITON_INTERPRET") == "1"
    # where the point's time went, for the next GPU session's estimates; the check and the timing
    # ran the interpreter, so each took some time
    assert set(row["seconds"]) == {"tune", "check", "time"} and row["seconds"]["tune"] >= 0
    assert row["seconds"]["check"] > 0 and row["seconds"]["time"] > 0
    assert f"napkin bench: causal float16 {row['sizes']}: tune " in err


def test_bench_checks_each_backward_before_timing_it(tmp_path, monkeypatch):
    """Only the forward was checked against float64 before timing: a backward
    computing a wrong dK was timed and its speed reported.  Now each backward
    that is timed is checked first (napkin's, SDPA's where it is the same
    function), each gradient's error relative to its scale; a wrong one is not
    timed and the run fails.  The wrong dK here is napkin's own, times 1.1."""
    from napkin.cli import main

    compile_module = harness.compile_module

    def wrong_dk(*args, **kwargs):
        module, digest = compile_module(*args, **kwargs)
        grads = module._attention_grads

        def scaled(*a):
            g = list(grads(*a))
            g[1] = None if g[1] is None else g[1] * 1.1
            return tuple(g)

        monkeypatch.setattr(module, "_attention_grads", scaled)
        return module, digest

    argv = ["bench", str(EXAMPLES / "attention.ncd"), "--seqlen", "40"]
    assert main(argv + ["--out", str(tmp_path / "right")]) == 0
    (row,) = json.loads(next((tmp_path / "right").glob("cpu-*.json")).read_text())["rows"]
    back = row["check"]["backward"]
    assert back["output"] == "O" and set(back["errors"]["napkin"]) == {"dQ", "dK", "dV"}
    assert all(0 < v <= harness.TOLERANCE["float16"] for v in back["errors"]["napkin"].values()), back
    assert all(v <= harness.TOLERANCE["float16"] for v in back["errors"]["sdpa-math"].values()), back
    bwd = {r["impl"]: r for r in row["results"] if r["pass"] == "bwd"}
    assert bwd["napkin"]["ms"] > 0 and bwd["sdpa-math"]["ms"] > 0

    monkeypatch.setattr(harness, "compile_module", wrong_dk)
    assert main(argv + ["--out", str(tmp_path / "wrong")]) == 1
    (row,) = json.loads(next((tmp_path / "wrong").glob("cpu-*.json")).read_text())["rows"]
    errors = row["check"]["backward"]["errors"]["napkin"]
    assert not row["check"]["ok"] and errors["dK"] > 0.05 and errors["dQ"] <= harness.TOLERANCE["float16"]
    assert errors["error"].startswith("wrong: dK max abs error "), errors
    rows = {(r["impl"], r["pass"]): r for r in row["results"]}
    assert rows["napkin", "bwd"]["ms"] is None and rows["napkin", "bwd"]["error"].startswith("not timed: wrong: dK")
    assert rows["napkin", "fwd"]["ms"] > 0 and rows["sdpa-math", "bwd"]["ms"] > 0


VKQ = """diagram vkq
wire b, h, q, x
wire d = 16
in V[b, h, x, d] : fp32
in K[b, h, x, d] : fp32
in Q[b, h, q, d] : fp32
S[b, h, q, x] = sum[d](Q * K) * |d|^-0.5
O[b, h, q, d] : fp32 = sum[x](softmax[x](S) * V)
out O
"""


@pytest.mark.parametrize("backward, words", [
    ("zero", "wrong: dV max abs error 1 of its scale > 0.002"),
    ("crash", "crashed: KeyError: 'y'"),
    ("refuse", "NotImplementedError: napkin has no backward here"),
])
def test_the_backward_check_names_each_gradient_by_its_input_and_counts_a_crash(backward, words):
    """Inputs declared V, K, Q: a wrong dV was reported as dQ (labels in Q, K, V order, gradients in
    the diagram's); and a backward dying of a KeyError left the check ok (only "wrong" counted).
    A refusal in words (NotImplementedError, NapkinError) is reported and not counted."""
    import types

    d = napkin.load_text(VKQ, "vkq.ncd")
    sizes = {"b": 1, "h": 1, "q": 8, "x": 8}
    module = types.SimpleNamespace(reference=lambda *xs: tuple(reference.reference(d, xs, sizes)))

    class Broken(torch.autograd.Function):   # the identity forward, V's gradient broken
        @staticmethod
        def forward(ctx, v):
            return v.view_as(v)

        @staticmethod
        def backward(ctx, g):
            if backward == "crash":
                raise KeyError("y")
            if backward == "refuse":
                raise NotImplementedError("napkin has no backward here")
            return torch.zeros_like(g)

    def prepare(inputs, shape, device, grad=False):
        v, k, q = inputs
        return lambda: (reference.reference(d, (Broken.apply(v), k, q), sizes)[0],)

    record = checks.check(module, d, [baselines.Baseline("napkin", True, "", prepare)], sizes, "float32", "cpu",
                          backward=True)
    errors = record["backward"]["errors"]["napkin"]
    assert errors["error"] == words and record["ok"] == (backward == "refuse"), record
    if backward == "zero":
        assert errors["dQ"] < 1e-6 and errors["dK"] < 1e-6 and errors["dV"] == pytest.approx(1.0)


def test_flex_visible_counts_the_pairs_a_mask_keeps():
    """The FLOP share of a masked diagram, against counts made here from the definitions: a causal
    window of 8 keeps i - 8 < j <= i; documents keep the pairs of one id (per batch, every head
    alike).  Row blocks of 7 leave a ragged last block; no mask keeps everything."""
    window = _fp32((EXAMPLES / "sliding_window.ncd").read_text().replace("q - x < 256", "q - x < 8"))
    inputs = reference.example_inputs(window, SIZES, seed=1)
    n = SIZES["q"]
    want = sum(1 for i in range(n) for j in range(n) if j <= i and i - j < 8) / n ** 2
    assert flex.load(window).visible(*inputs, rows=7) == pytest.approx(want, abs=1e-12)
    docs = _fp32((EXAMPLES / "document_mask.ncd").read_text())
    inputs = reference.example_inputs(docs, SIZES, seed=2)
    doc = inputs[3].tolist()
    same = sum(a == c for row in doc for a in row for c in row)
    assert 0 < same < SIZES["b"] * n * n
    assert flex.load(docs).visible(*inputs, rows=7) == pytest.approx(same / (SIZES["b"] * n * n), abs=1e-12)
    plain = _fp32((EXAMPLES / "attention.ncd").read_text())
    assert flex.load(plain).visible(*reference.example_inputs(plain, SIZES)) == 1.0


def test_the_bench_draws_a_length_input_as_a_length():
    """ragged_decode's n[b] (x < n[b]) is each sequence's cache length, 1..|x|: drawn as document ids
    (small numbers) the bench timed near-empty attention, and its FLOP share was a few pairs."""
    d = napkin.load(EXAMPLES / "ragged_decode.ncd")
    sizes = {"b": 64, "hk": 1, "g": 1, "q": 1, "x": 300}
    n = reference.example_inputs(d, sizes, seed=1)[3]
    assert n.dtype == torch.int32 and n.min() >= 1 and n.max() <= 300
    assert n.max() > 100 and len(set(n.tolist())) > 32
    assert torch.equal(n, reference.example_inputs(d, sizes, seed=1)[3])   # the seed decides it


def _softmax64(S, V):
    return torch.softmax(S, -1) @ V


NAMED_SIDE = """diagram named
wire n, hd, q, x
wire d = 4
in Q[n, hd, q, d] : fp32
in K[n, hd, x, d] : fp32
in V[n, hd, x, d] : fp32
in NAME[x] : fp64
S[n, hd, q, x] = sum[d](Q * K) + NAME
O[n, hd, q, d] : fp32 = sum[x](softmax[x](S) * V)
out O
"""


@pytest.mark.parametrize("name", ["score", "h", "b", "q_idx", "kv_idx", "sizes", "rows", "compiled"])
def test_flex_side_inputs_named_like_the_modules_own_names(name):
    """A side input called score was shadowed by score_mod's argument (a wrong answer, no error); h, b,
    q_idx, kv_idx crashed in prepare; sizes, rows, compiled were duplicate arguments (a SyntaxError
    that stopped a whole bench run).  The module's own names all start with an underscore now."""
    g = torch.Generator().manual_seed(0)
    Q, K, V = (torch.randn(1, 2, 5, 4, generator=g, dtype=torch.float64) for _ in range(3))
    bias = 3 * torch.randn(5, generator=g, dtype=torch.float64)
    got = flex.load(napkin.load_text(NAMED_SIDE.replace("NAME", name))).prepare(Q, K, V, bias)()[0]
    assert torch.allclose(got.double(), _softmax64(Q @ K.transpose(-1, -2) + bias, V), atol=1e-6)


def test_flex_inputs_named_q_k_v_keep_their_sizes():
    """prepare() rebound q, k, v to the arranged tensors before reading the sizes off them: inputs so
    named got a wrong key-length offset (error 1.8) and visible() a wrong share."""
    text = """diagram lower
wire h, n, m, d
in q[h, n, d] : fp32
in k[h, m, d] : fp32
in v[h, m, d] : fp32
S[h, n, m] = where(m <= n + |m| - |n|, sum[d](q * k) / sqrt(|d|), -inf)
O[h, n, d] : fp32 = sum[m](softmax[m](S) * v)
out O
"""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, L, 5, generator=g, dtype=torch.float64) for L in (6, 9, 9))
    mod = flex.load(napkin.load_text(text))
    n, m = torch.arange(6)[:, None], torch.arange(9)[None, :]
    keep = m <= n + 9 - 6
    want = _softmax64(torch.where(keep, q @ k.transpose(-1, -2) / math.sqrt(5), -math.inf), v)
    assert torch.allclose(mod.prepare(q, k, v)()[0].double(), want, atol=1e-6)
    assert mod.visible(q, k, v) == pytest.approx(float(keep.double().mean()))


def test_flex_integer_powers_in_the_score_are_taken_in_floats():
    """2 ^ (0 - h - 1), an ALiBi slope per head, rendered torch.pow of two integer tensors: 0 for
    every negative exponent, not 1/2, 1/4."""
    text = """diagram powers
wire b, h, q, x
wire d = 4
in Q[b, h, q, d] : fp32
in K[b, h, x, d] : fp32
in V[b, h, x, d] : fp32
S[b, h, q, x] = where(x <= q, sum[d](Q * K) + 2 ^ (0 - h - 1) * (x - q), -inf)
O[b, h, q, d] : fp32 = sum[x](softmax[x](S) * V)
out O
"""
    g = torch.Generator().manual_seed(1)
    Q, K, V = (torch.randn(1, 3, 7, 4, generator=g, dtype=torch.float64) for _ in range(3))
    i, j = torch.arange(7)[:, None], torch.arange(7)[None, :]
    slope = (2.0 ** -(torch.arange(3) + 1.0))[:, None, None]
    S = torch.where(j <= i, Q @ K.transpose(-1, -2) + slope * (j - i), -math.inf)
    got = flex.load(napkin.load_text(text)).prepare(Q, K, V)()[0]
    assert torch.allclose(got.double(), _softmax64(S, V), atol=1e-6)


def test_flex_takes_a_mask_of_sizes_alone():
    """A mask reading sizes only made mask_mod return a Python bool, which create_block_mask refuses."""
    sized = _fp32((EXAMPLES / "attention.ncd").read_text().replace(
        "sum[d](Q * K) * |d|^-0.5", "where(|x| > 3, sum[d](Q * K) * |d|^-0.5, -inf)"))
    assert max(_flex_vs_reference(sized)) < 1e-5


MQA = """diagram mqa
wire b, h, q, x
wire d = 16
in Q[b, h, q, d] : fp16
in K[b, x, d] : fp16
in V[b, x, d] : fp16
in slope[h] : fp32
S[b, h, q, x] = where(x <= q, sum[d](Q * K) * |d|^-0.5 + slope * (x - q), -inf)
O[b, h, q, d] : fp16 = sum[x](softmax[x](S) * V)
out O
schedule on h100 {
  accumulate fp32
  level hbm { hold Q, K, V, slope, O }
  level smem {
    group b by 1, h by 1, q by 32
    stream x by 16
    hold S
  }
}
"""


def _gqa_apart(q_layout="Q[b, hk, g, q, d]", o_layout="O[b, hk, g, q, d]"):
    text = (EXAMPLES / "gqa.ncd").read_text().replace("Q[b, (hk g), q, d]", q_layout)
    return text.replace("O[b, (hk g), q, d]", o_layout)


@pytest.mark.parametrize("text, heads, kv_heads", [
    (MQA, 6, 1),
    (_gqa_apart(), 4, 2),                                           # GQA, query heads apart (hk, g)
    (_gqa_apart(o_layout="O[b, (hk g), q, d]"), 4, 2),              # apart in Q, one axis in O
    (_gqa_apart("Q[b, q, hk, g, d]", "O[b, q, g, hk, d]"), 4, 2),   # and permuted
    (_gqa_apart(o_layout="O[b, hk, g, q, d]").replace("lse[b, (hk g), q]", "lse[b, hk, g, q]"), 4, 2)],
    ids=["mqa", "gqa-apart", "gqa-apart-in-q", "gqa-apart-permuted", "gqa-apart-lse"])
def test_flex_takes_multi_query_and_grouped_heads_written_apart(text, heads, kv_heads):
    """Multi-query (K[b, x, d]: one kv head) and grouped-query heads written as two wires of Q and O
    were refused ("write grouped heads as one axis"), so napkin bench could not run them: flex maps
    them onto enable_gqa now, the query heads flattened kv-major as SDPA's.  Checked against the
    float64 reference; the roles give the benchmark its sizes."""
    d = _fp32(text)
    sizes = {"b": 2, "h": 6, "hk": 2, "g": 2, "q": 37, "x": 37}
    assert max(_flex_vs_reference(d, sizes)) < 1e-5
    shape = flex.attention_shape(d, sizes)
    assert (shape["heads"], shape["kv_heads"], shape["q_len"]) == (heads, kv_heads, 37)
    assert flex.emit(d).enable_gqa


def _differential(old="", new=""):
    return (EXAMPLES / "differential_attention.ncd").read_text().replace(old, new)


# a bias per head and map: the score reads h and g, which flex's head h * |g| + g must give back
_DIFF_BIAS = _differential("in V[b, h, x, e] : fp16", "in V[b, h, x, e] : fp16\nin bias[h, g] : fp32").replace(
    "sum[d](Q * K) * |d|^-0.5", "sum[d](Q * K) * |d|^-0.5 + bias[h, g]").replace("hold Q, K, V,", "hold Q, K, V, bias,")


@pytest.mark.parametrize("text", [_differential(), _DIFF_BIAS,
                                  _differential("A[b, h, g, q, e]", "A[b, g, q, h, e]")],
                         ids=["differential", "bias-per-head-and-map", "output-permuted"])
def test_flex_takes_differential_attentions_maps_as_heads(text):
    """Differential attention (Q[b, h, q, (g d)], K alike, V[b, h, x, e]: |g| softmax maps a head,
    V shared by them) was refused ("axis (g d) has no place in flex's layout"), so napkin bench
    could not run the bundled example: to flex and SDPA its maps are heads now, h * |g| + g, each
    with its own keys and V repeated over g.  Checked against the float64 reference, a score that
    reads h and g included; the heads the FLOPs count are h * |g|."""
    d = _fp32(text)
    sizes = {"b": 2, "h": 3, "q": 37, "x": 37}
    assert max(_flex_vs_reference(d, sizes)) < 1e-5
    shape = flex.attention_shape(d, sizes)
    assert (shape["heads"], shape["kv_heads"], shape["dim"], shape["value_dim"]) == (6, 6, 64, 128)
    src = flex.emit(d)
    assert not src.enable_gqa and "V.unsqueeze(2).expand(-1, -1, 2, -1, -1).flatten(1, 2)" in src.text


def test_differential_maps_of_no_fixed_size_or_beside_grouped_heads_are_refused():
    with pytest.raises(flex.NoFlexEquivalent, match=r"Q\[b, h, q, \(g d\)\]: the maps wire g has no fixed size "
                                                    r"\(declare wire g = N\)"):
        flex.emit(napkin.load_text(_differential("wire g = 2", "wire g"), capacity=False))
    grouped = _differential("in Q[b, h, q, (g d)]", "in Q[b, (h n), q, (g d)]").replace(
        "A[b, h, g, q, e]", "A[b, (h n), g, q, e]").replace("wire g = 2", "wire g = 2\nwire n = 2").replace(
        "S[b, h, g, q, x]", "S[b, (h n), g, q, x]").replace("P[b, h, g, q, x]", "P[b, (h n), g, q, x]")
    with pytest.raises(flex.NoFlexEquivalent, match=r"holds maps \(g d\) beside grouped or multi-query heads"):
        flex.emit(napkin.load_text(grouped, capacity=False))


def test_two_query_wires_the_schedule_does_not_tell_apart_are_refused():
    """Q[b, h, q, d] beside K[b, x, d]: h or q could be the queries; the schedule's tiled wire says
    which.  Tiling neither leaves it open, and that is said rather than guessed."""
    text = MQA.replace("group b by 1, h by 1, q by 32", "group b by 1, h by 1, q by 1")
    with pytest.raises(flex.NoFlexEquivalent, match=r"Q\[b, h, q, d\] has two wires K\[b, x, d\] lacks "
                                                    r"\(h, q\), and the schedule tiles neither"):
        flex.emit(napkin.load_text(text))
    both = MQA.replace("group b by 1, h by 1, q by 32", "group b by 1, h by 4, q by 32")
    with pytest.raises(flex.NoFlexEquivalent, match=r"the schedule tiles both: which is the queries\? \(tile the "
                                                    r"heads by 1, or write grouped heads as one axis \(hk g\)\)"):
        flex.emit(napkin.load_text(both))


@pytest.mark.slow
@pytest.mark.parametrize("text, shape, out", [
    (MQA, (3, 1, 16), "O"),                                                     # one kv head (enable_gqa)
    ((EXAMPLES / "differential_attention.ncd").read_text(), (6, 6, 128), "A")],   # h * |g| heads to flex
    ids=["multi-query", "differential"])
def test_napkin_bench_runs_multi_query_and_differential_attention(tmp_path, text, shape, out):
    """napkin bench on a multi-query diagram (--heads sets the query heads, one kv head) and on the
    bundled differential attention (refused before: no flex layout; --heads sets h, flex and SDPA
    take h * |g| heads): napkin's forward and backward, flex's forward and SDPA's speed reference
    are checked against float64 and timed."""
    from napkin.cli import main

    path = tmp_path / "diagram.ncd"
    path.write_text(text)
    assert main(["bench", str(path), "--seqlen", "40", "--heads", "3", "--out", str(tmp_path)]) == 0
    (row,) = json.loads(next(tmp_path.glob("cpu-*.json")).read_text())["rows"]
    assert row["sizes"] == {"b": 1, "h": 3, "q": 40, "x": 40}
    assert (row["shape"]["heads"], row["shape"]["kv_heads"], row["shape"]["value_dim"]) == shape
    assert row["check"]["ok"] and set(row["check"]["errors"]["flex"]) == {out}
    assert set(row["check"]["backward"]["errors"]["napkin"]) == {"dQ", "dK", "dV"}
    timed = {(r["impl"], r["pass"]) for r in row["results"] if r["ms"]}
    assert {("napkin", "fwd"), ("napkin", "bwd"), ("flex", "fwd"), ("sdpa-math", "fwd")} <= timed


@pytest.mark.parametrize("score", [
    "where(x <= q, where(q - x < 4, sum[d](Q * K) * |d|^-0.5, -inf), -inf)",
    "sum[d](Q * K) * |d|^-0.5 + where(x <= q and q - x < 4, 0, -inf)",
    "where(x > q or q - x >= 4, -inf, 0) + sum[d](Q * K) * |d|^-0.5"])
def test_a_window_written_nested_or_added_is_a_window(score):
    """A window nested in a second where was "exactly causal" to the harness (FLOPs counted as half the
    square, 4x too many at 32), and one added to the score was no mask at all to flex (a dense
    score_mod, every pair counted).  Each is a mask of x <= q and q - x < 4 now: its share and its
    FLOPs agree with a count made here."""
    text = (EXAMPLES / "attention.ncd").read_text().replace("sum[d](Q * K) * |d|^-0.5", score)
    d = _fp32(text)
    sizes = {"b": 1, "h": 1, "q": 32, "x": 32}
    shape = flex.attention_shape(d, sizes)
    assert not shape["causal"] and shape["causal_part"]
    src = flex.emit(d)
    assert src.mask is not None and not src.causal and src.causal_part
    kept = sum(1 for i in range(32) for j in range(32) if j <= i and i - j < 4) / 32 ** 2
    assert flex.load(d).visible(*reference.example_inputs(d, sizes)) == pytest.approx(kept)
    assert max(_flex_vs_reference(d)) < 1e-5


def test_bench_counts_a_window_at_the_pairs_it_keeps_and_a_speed_reference_at_its_own(tmp_path):
    """A window of 8 in 48 keeps 29% of the pairs: napkin's and flex's TFLOP/s count that share of the
    dense FLOPs (counted dense, a 256-wide window in 16K read 11,000 TFLOP/s on the H200), while the
    SDPA speed reference, causal attention, counts half."""
    from napkin.cli import main

    path = tmp_path / "window.ncd"
    path.write_text((EXAMPLES / "sliding_window.ncd").read_text().replace("q - x < 256", "q - x < 8"))
    assert main(["bench", str(path), "--seqlen", "48", "--no-backward", "--out", str(tmp_path)]) == 0
    data = json.loads(next(tmp_path.glob("cpu-*.json")).read_text())
    (row,) = data["rows"]
    n = 48
    kept = sum(1 for i in range(n) for j in range(n) if j <= i and i - j < 8) / n ** 2
    assert row["visible"] == pytest.approx(kept) and not row["causal"]
    s = row["shape"]
    dense = 2.0 * s["batch"] * s["heads"] * n * n * (s["dim"] + s["value_dim"])
    assert row["flops"]["fwd"] == pytest.approx(dense * kept)
    fwd = {r["impl"]: r for r in row["results"] if r["pass"] == "fwd"}
    for impl, share in (("napkin", kept), ("flex", kept), ("sdpa-math", 0.5)):
        r = fwd[impl]
        assert r["tflops"] == pytest.approx(dense * share / (r["ms"] * 1e-3) / 1e12), impl
    assert not fwd["sdpa-math"]["equivalent"]
    assert f"no, keeps {100 * kept:.3g}%" in next(tmp_path.glob("cpu-*.md")).read_text()


def test_the_overlap_row_is_timed_only_once_it_gives_the_serial_bits():
    """napkin bench's "napkin-overlap" (napkin/bench/overlap.py): its scope
    sets the module's knob and restores it; its backward is refused (not
    timed) when a gradient differs from the serial backward's."""
    import contextlib
    import types

    from napkin.bench import overlap

    class Scaled(torch.autograd.Function):  # a backward that reads the knob, as a race would show
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * (3 if module.BACKWARD_OVERLAP else 2)

    module = types.SimpleNamespace(BACKWARD_OVERLAP=False)
    row = overlap.baseline(module, lambda inputs, shape, device, grad=False: lambda: (Scaled.apply(inputs[0]),))
    assert row.passes == ("bwd",) and row.name == "napkin-overlap"
    with row.scope():
        assert module.BACKWARD_OVERLAP is True
    assert module.BACKWARD_OVERLAP is False
    x = torch.randn(5, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"the gradients of leaves \[0\] differ from the serial backward's"):
        row.prepare([x], {}, "cpu", grad=True)
    assert module.BACKWARD_OVERLAP is False
    module.BACKWARD_OVERLAP = "either"  # restored whatever it was
    same = overlap.baseline(module, lambda inputs, shape, device, grad=False: lambda: (inputs[0] * 2,))
    assert same.prepare([x], {}, "cpu", grad=True)()[0].shape == (5,) and module.BACKWARD_OVERLAP == "either"
    assert not overlap.applies(module, "cpu") and overlap.applies(module, "cuda")
    module.BACKWARD_OVERLAP = True  # NAPKIN_BACKWARD_OVERLAP=1: the napkin row still times the serial backward
    with overlap.serial(module)():
        assert module.BACKWARD_OVERLAP is False
    assert module.BACKWARD_OVERLAP is True and overlap.serial(types.SimpleNamespace()) is contextlib.nullcontext


def test_bench_times_a_data_masks_prepass_apart(tmp_path):
    """The document mask's ranges prepass runs before the forward, dQ and dK/dV
    kernels (each at its blocks): the row records each launch timed alone and
    the markdown its share of napkin's pass; a diagram with no prepass has none."""
    from napkin.cli import main

    assert main(["bench", str(EXAMPLES / "document_mask.ncd"), "--seqlen", "40", "--out", str(tmp_path)]) == 0
    data = json.loads(next(tmp_path.glob("cpu-*.json")).read_text())
    results.validate(data)
    (row,) = data["rows"]
    assert sorted(t["kernel"] for t in row["prepass"]) == ["dkdv", "dq", "fwd"]
    assert all(t["ms"] > 0 and t["error"] is None and len(t["blocks"]) == 2 for t in row["prepass"])
    fwd = next(t for t in row["prepass"] if t["kernel"] == "fwd")
    assert row["config"] is None and fwd["blocks"] == [128, 64]  # untuned: the schedule's q by 128, x by 64
    assert row["mask_cache"] is True   # napkin's timed calls reuse the prepass results, as Flex its BlockMask
    md = next(tmp_path.glob("cpu-*.md")).read_text()
    assert "## Ranges prepass (timed alone; outside napkin's times" in md
    assert md.count("| document_mask | float16 | 40 | ") >= 3
    assert main(["bench", str(EXAMPLES / "causal.ncd"), "--seqlen", "40", "--no-backward",
                 "--out", str(tmp_path / "c")]) == 0
    (row,) = json.loads(next((tmp_path / "c").glob("cpu-*.json")).read_text())["rows"]
    assert row["prepass"] is None and row["mask_cache"] is None


# --------------------------------------------------------------------------
# On a GPU (skipped without one): the real timing path and the autotune cache.
# --------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.slow
def test_napkin_bench_on_the_gpu_checks_times_and_reuses_tuned_configs(tmp_path, monkeypatch):
    from napkin.cli import main

    monkeypatch.setenv("NAPKIN_CACHE", str(tmp_path / "cache"))
    argv = ["bench", str(EXAMPLES / "causal.ncd"), "--seqlen", "1000", "--batch", "2", "--heads", "4",
            "--dtype", "bfloat16", "--head-dim", "128", "--out", str(tmp_path / "out")]
    # 10 s a kernel (MIN_TUNE_S): the benchtest stage has 120 s for collection, three tunings and two runs
    assert main(argv + ["--autotune", "--tune-budget", str(budget.MIN_TUNE_S)]) == 0
    assert main([a if a != "1000" else "1024" for a in argv]) == 0   # a new length, same bucket
    # the second run of the day gets the "-2" name
    paths = sorted((tmp_path / "out").glob("*.json"), key=lambda p: (len(p.name), p.name))
    first, second = (json.loads(p.read_text()) for p in paths)
    for data in (first, second):
        results.validate(data)
        (row,) = data["rows"]
        assert not data["smoke"] and row["check"]["ok"] and row["check"]["full_size_vs_flex"]["ok"]
        # every backward timed was checked first (FlexAttention's too: it has one on CUDA)
        checked = row["check"]["backward"]["errors"]
        assert all(set(checked[i]) == {"dQ", "dK", "dV"} for i in ("napkin", "flex", "sdpa-flash")), checked
        fwd = {r["impl"]: r for r in row["results"] if r["pass"] == "fwd"}
        assert fwd["napkin"]["tflops"] > 0 and fwd["flex"]["tflops"] > 0
        assert fwd["sdpa-flash"]["equivalent"] and fwd["sdpa-flash"]["ms"] > 0
    assert first["rows"][0]["config_source"] == "autotune"
    # 1000 and 1024 share a bucket: the second run reads the tuned config, no retuning.
    assert second["rows"][0]["sizes"]["q"] == 1024
    assert second["rows"][0]["config_source"] == "cache"
    assert second["rows"][0]["config"] == first["rows"][0]["config"]
    # each backward kernel was tuned on its own, and read back from its own entry
    assert first["rows"][0]["bwd_config_source"] == {"dq": "autotune", "dkdv": "autotune"}
    assert second["rows"][0]["bwd_config_source"] == {"dq": "cache", "dkdv": "cache"}
    assert second["rows"][0]["bwd_config"] == first["rows"][0]["bwd_config"]
    # how each tuning went is recorded, the second run's from the cache entries
    tuning = first["rows"][0]["tuning"]
    assert set(tuning) == {"fwd", "dq", "dkdv"}
    assert all(t["timed"] >= 1 and t["budget_s"] == budget.MIN_TUNE_S for t in tuning.values())
    assert all(len(t["trials"]) == t["timed"] + t["failed"] for t in tuning.values())
    assert all(t["from_cache"] and t["timed"] == tuning[k]["timed"] for k, t in second["rows"][0]["tuning"].items())
    entries = json.loads((tmp_path / "cache" / "autotune.json").read_text())["entries"]
    assert backward_kinds(entries) == ["bwd", "bwd_kv"]
    assert len(entries) == 3


def backward_kinds(entries) -> list[str]:
    """The kinds of a cache's backward entries: each key is diagram hash,
    device, dtypes, sizes, then the kind when it is not the forward's."""
    return sorted(k.split("|")[4] for k in entries if k.count("|") == 4)


def test_the_gpu_bench_tests_key_reading_matches_the_caches_keys():
    """What the GPU test above reads its cache's keys with, checked here
    against keys made as the launcher makes them: counting the fields from
    before keys held dtypes, it took a forward key for a backward one."""
    d = napkin.load(EXAMPLES / "causal.ncd")
    keys = [tunecache.cache_key("h", "NVIDIA H100", tunecache.input_classes(d), {"b": 2, "h": 4, "q": 1024, "x": 1024},
                                tunecache.symbolic_wires(d), kind) for kind in ("", "bwd", "bwd_kv")]
    assert backward_kinds(keys) == ["bwd", "bwd_kv"]
