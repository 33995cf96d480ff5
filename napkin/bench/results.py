"""The benchmark's record: a JSON file and a markdown table under bench/results/.

Both are named ``<device>-<date>`` (``nvidia-h100-80gb-hbm3-2025-06-01.json``),
with ``-2``, ``-3`` ... added when a run that day already wrote one, so no
result is ever overwritten.  The JSON is the record (schema below, checked by
``validate``); the markdown is written from it alone.

Schema ``napkin-bench/1``::

    schema, smoke (bool: a CPU smoke run, never a performance number),
    timing (how times were taken), date, command, flop_convention,
    device {name, kind, capability}, versions {napkin, torch, triton, python},
    rows: [{diagram, file, source_hash, dtype, sizes {wire: n},
            shape {batch, heads, kv_heads, q_len, kv_len, dim, value_dim},
            causal, flops {fwd, bwd}, visible (optional: the fraction of (query, key)
            pairs the mask keeps, by which flops were scaled; null: dense or causal),
            config {launcher option: value} | null,
            config_source, bwd_config {dq, dkdv: the backward kernels' own, as
            config}, bwd_config_source {dq, dkdv} (optional: older rows lack both),
            tuning {fwd, dq, dkdv: {candidates, timed, failed, skipped, budget_s,
            truncated, from_cache?, resumed_from?}} (optional: the kernels tuned by
            --autotune; skipped > 0: the time budget ran out before every candidate
            was timed; resumed_from: a cut-short tuning went on after that many;
            trials [{config, ms | null, error | null}]: each candidate timed here,
            in order, a resumed tuning's first being the cached best again),
            tma {used, why} | null (optional: whether the timed napkin forward moved
            its tiles through TMA descriptors, and why not),
            bwd_tma {dq, dkdv: {used, why}} | null (optional: the same of the timed
            backward's kernels),
            prepass [{kernel (fwd, dq, dkdv), blocks [rows, cols], ms, error}] | null
            (optional: a mask that reads data, its ranges prepass timed alone at each
            launch's blocks; null: no prepass),
            mask_cache true | null (optional: napkin's timed calls reused the prepass
            results, a warm mask_cache, so its fwd and bwd ms exclude the prepass, as
            Flex's exclude create_block_mask; absent in records before 2026-11-28,
            whose napkin ms include it),
            check {sizes, tolerance, ok, errors {impl: {output: err}}},
            results: [{impl, pass, ms, tflops, equivalent, note, error}],
            ratios {pass: {baseline: napkin speed / baseline speed}}}]
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Optional

from ..errors import NapkinError
from ..files import write_atomic

SCHEMA = "napkin-bench/1"
PASSES = ("fwd", "bwd")

_TOP = {"schema": str, "smoke": bool, "timing": str, "date": str, "command": str,
        "flop_convention": str, "device": dict, "versions": dict, "rows": list}
_ROW = {"diagram": str, "file": str, "source_hash": str, "dtype": str, "sizes": dict, "shape": dict,
        "causal": bool, "flops": dict, "config_source": str, "check": dict, "results": list,
        "ratios": dict}
_RESULT = {"impl": str, "pass": str, "equivalent": bool, "note": str}


def attention_flops(shape: dict, causal: bool, visible: Optional[float] = None) -> dict:
    """Forward and backward FLOPs by the usual attention convention:
    2 * B * H * Lq * Lk * (d + dv) forward (4 B H N^2 d when d = dv and
    Lq = Lk), halved when causal, else times ``visible`` (the fraction of
    (query, key) pairs a mask keeps) when given, and 2.5x that for the
    backward."""
    fwd = 2.0 * shape["batch"] * shape["heads"] * shape["q_len"] * shape["kv_len"] \
        * (shape["dim"] + shape["value_dim"])
    if causal:
        fwd *= 0.5
    elif visible is not None:
        fwd *= visible
    return {"fwd": fwd, "bwd": 2.5 * fwd}


def top_left_causal(q_len: int, kv_len: int) -> float:
    """The fraction of (query, key) pairs SDPA's is_causal keeps: query i
    sees keys 0..i (top-left aligned), so 16 queries of 64 keys keep 13.3%."""
    if not q_len or not kv_len:
        return 0.0
    n = min(q_len, kv_len)
    kept = n * (n + 1) // 2 + max(q_len - kv_len, 0) * kv_len
    return kept / (q_len * kv_len)


def tflops(flops: float, ms: Optional[float]) -> Optional[float]:
    if ms is None or ms <= 0:
        return None
    return flops / (ms * 1e-3) / 1e12


def ratios(results: list[dict]) -> dict:
    """pass -> {baseline: napkin's speed over the baseline's} (> 1: napkin is faster)."""
    out = {}
    for p in PASSES:
        mine = next((r["ms"] for r in results if r["impl"] == "napkin" and r["pass"] == p and r["ms"]), None)
        if mine is None:
            continue
        out[p] = {r["impl"]: r["ms"] / mine for r in results
                  if r["impl"] != "napkin" and r["pass"] == p and r["ms"]}
    return out


# --------------------------------------------------------------------------
# Validation.
# --------------------------------------------------------------------------

def validate(data: dict) -> None:
    """Raise NapkinError naming the first thing that does not fit the schema."""
    def need(obj, spec, where):
        if not isinstance(obj, dict):
            raise NapkinError(f"bench results: {where} is not an object")
        for key, kind in spec.items():
            if key not in obj:
                raise NapkinError(f"bench results: {where} lacks {key!r}")
            if not isinstance(obj[key], kind):
                raise NapkinError(f"bench results: {where}.{key} is not a {kind.__name__}")

    need(data, _TOP, "the file")
    if data["schema"] != SCHEMA:
        raise NapkinError(f"bench results: schema {data['schema']!r}, expected {SCHEMA!r}")
    for i, row in enumerate(data["rows"]):
        need(row, _ROW, f"rows[{i}]")
        for j, r in enumerate(row["results"]):
            need(r, _RESULT, f"rows[{i}].results[{j}]")
            if r["pass"] not in PASSES:
                raise NapkinError(f"bench results: rows[{i}].results[{j}].pass is {r['pass']!r}")
            for key in ("ms", "tflops"):
                if r.get(key) is not None and not isinstance(r[key], (int, float)):
                    raise NapkinError(f"bench results: rows[{i}].results[{j}].{key} is not a number")


# --------------------------------------------------------------------------
# Writing.
# --------------------------------------------------------------------------

def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "device"


def result_paths(out_dir: Path, device: str, date: str) -> tuple[Path, Path]:
    """The first unused ``<device>-<date>[-N].{json,md}`` pair in out_dir."""
    stem = f"{slug(device)}-{date}"
    n = 1
    while True:
        name = stem if n == 1 else f"{stem}-{n}"
        json_path, md_path = out_dir / f"{name}.json", out_dir / f"{name}.md"
        if not json_path.exists() and not md_path.exists():
            return json_path, md_path
        n += 1


def write(data: dict, out_dir, paths: Optional[tuple[Path, Path]] = None) -> tuple[Path, Path]:
    """Write the record's JSON and markdown; ``paths``: rewrite the pair an
    earlier write of the same run returned (the harness writes after every
    diagram, so a run stopped at its time limit keeps what it measured)."""
    validate(data)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = paths or result_paths(out_dir, data["device"]["name"], data["date"])
    # through a temporary file and a rename: the harness rewrites the pair after every diagram, and a
    # write cut short (a full disk, a kill) truncated the record a run stopped at its limit had kept
    write_atomic(json_path, json.dumps(finite(data), indent=1, sort_keys=False, allow_nan=False) + "\n")
    write_atomic(md_path, markdown(data))
    return json_path, md_path


def finite(value):
    """``value`` with every non-finite float as None (JSON null): an error of
    inf (a NaN output, a wrong shape) wrote ``Infinity``, which strict JSON
    readers (jq, JavaScript) refuse, just when someone reads up on a broken kernel."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def _num(v: Optional[float], digits: int = 1) -> str:
    """Fixed decimals, but three significant digits for small values (a CPU
    smoke run's TFLOP/s would otherwise all read 0.0)."""
    if v is None:
        return "-"
    return f"{v:.{digits}f}" if abs(v) >= 1 or v == 0 else f"{v:.3g}"


def markdown(data: dict) -> str:
    """One table per pass: napkin's TFLOP/s, then each baseline's TFLOP/s with
    napkin's speed ratio to it.  A dagger marks a speed reference that does
    not compute the diagram's function."""
    lines = [f"# napkin bench: {data['device']['name']}, {data['date']}", ""]
    if data.get("partial"):
        lines += [f"**PARTIAL: {data['partial']}.**", ""]
    if data["smoke"]:
        lines += ["**SMOKE RUN: not performance numbers.** " + data["timing"], ""]
    else:
        lines += [f"Timing: {data['timing']}.  FLOPs: {data['flop_convention']}.", ""]
    lines += [f"Command: `{data['command']}`", "",
              "Versions: " + ", ".join(f"{k} {v}" for k, v in data["versions"].items()), ""]
    impls = []
    for row in data["rows"]:
        for r in row["results"]:
            if r["impl"] != "napkin" and r["impl"] not in impls:
                impls.append(r["impl"])
    notes: list[str] = []
    for p in PASSES:
        body = [_row_cells(row, p, impls, notes) for row in data["rows"]]
        body = [b for b in body if b is not None]
        if not body:
            continue
        head = ["diagram", "dtype", "B", "H", "N", "d", "causal", "check", "napkin ms", "napkin TFLOP/s"] \
            + [f"{i} TFLOP/s (napkin x)" for i in impls]
        lines += _table(f"## {'Forward' if p == 'fwd' else 'Backward'}", head, body)
    if any(not r["equivalent"] for row in data["rows"] for r in row["results"]):
        lines += ["\u2020 a speed reference: plain softmax attention at the same sizes, not the "
                  "diagram's function, so never checked against the reference.", ""]
    lines += _tuning_lines(data["rows"])
    lines += _prepass_lines(data["rows"])
    lines += _predicted_lines(data["rows"])
    if notes:
        lines += ["Notes:", ""] + [f"{i + 1}. {n}" for i, n in enumerate(notes)] + [""]
    return "\n".join(lines)


def _tuning_lines(rows: list[dict]) -> list[str]:
    """A table of each tuned kernel: the config it chose and how many of its
    candidates were timed; a budget that ran out first says so."""
    body = []
    for row in rows:
        configs = {"fwd": row.get("config"), **(row.get("bwd_config") or {})}
        for kernel, t in (row.get("tuning") or {}).items():
            if not t:
                continue
            timed = "?" if t.get("timed") is None else f"{t['timed']} of {t.get('candidates', '?')}"
            cut = f"**{t['skipped']} skipped: budget {_num(t.get('budget_s'), 0)} s ran out**" \
                if t.get("skipped") else "all timed" if t.get("skipped") == 0 else "?"
            cfg = ", ".join(f"{k}={v}" for k, v in (configs.get(kernel) or {}).items())
            body.append([row["diagram"], row["dtype"], str(row["shape"]["q_len"]), kernel, cfg, timed,
                         "?" if t.get("failed") is None else str(t["failed"]),
                         cut + (" (cached)" if t.get("from_cache") else "")
                         + (f" (resumed after {t['resumed_from']})" if t.get("resumed_from") else "")])
    if not body:
        return []
    head = ["diagram", "dtype", "N", "kernel", "config", "timed", "failed", "budget"]
    return _table("## Tuning", head, body)


def _prepass_lines(rows: list[dict]) -> list[str]:
    """A table of each ranges prepass launch (a mask that reads data) and
    its share of the napkin pass it belongs to."""
    body = []
    for row in rows:
        napkin = {r["pass"]: r["ms"] for r in row["results"] if r["impl"] == "napkin"}
        for t in row.get("prepass") or []:
            p = "fwd" if t["kernel"] == "fwd" else "bwd"
            share = f"{100 * t['ms'] / napkin[p]:.1f}%" if t.get("ms") and napkin.get(p) else "?"
            body.append([row["diagram"], row["dtype"], str(row["shape"]["q_len"]), str(t["kernel"]),
                         " x ".join(map(str, t.get("blocks") or [])), _num(t.get("ms"), 4), share,
                         t.get("error") or ""])
    if not body:
        return []
    head = ["diagram", "dtype", "N", "for kernel", "blocks", "ms", "of napkin's pass", "error"]
    # since 2026-11-28 the napkin rows reuse the prepass results (mask_cache): its times exclude it
    where = "outside napkin's times above, which reuse its results" if all(row.get("mask_cache") for row in rows
                                                                           if row.get("prepass")) \
        else "part of napkin's times above"
    return _table(f"## Ranges prepass (timed alone; {where})", head, body)


def _predicted_lines(rows: list[dict]) -> list[str]:
    """A table of the cost pass's roofline estimate (predicted.py) beside
    napkin's measured time, per pass: measured over predicted is how far
    from its roofline napkin's kernel runs."""
    body = []
    for row in rows:
        pred = row.get("predicted")
        if not pred:
            continue
        napkin = {r["pass"]: r.get("ms") for r in row["results"] if r["impl"] == "napkin"}
        for p in PASSES:
            if pred.get("error"):
                body.append([row["diagram"], row["dtype"], str(row["shape"]["q_len"]), p, pred["profile"], "", "",
                             "", pred["error"]])
                break
            if pred.get(f"{p}_ms") is None or p not in napkin:
                continue
            ms = napkin[p]
            body.append([row["diagram"], row["dtype"], str(row["shape"]["q_len"]), p, pred["profile"],
                         _num(pred[f"{p}_ms"], 4), _num(ms, 4),
                         f"{ms / pred[f'{p}_ms']:.2f}x" if ms and pred[f"{p}_ms"] else "?", pred["blocks"]])
    if not body:
        return []
    head = ["diagram", "dtype", "N", "pass", "profile", "predicted ms", "napkin ms", "measured / predicted",
            "blocks counted"]
    return _table("## The cost pass's roofline estimate against napkin's time", head, body)


def _table(title: str, head: list[str], body: list[list[str]]) -> list[str]:
    """A markdown section: its title, a table of ``head`` over ``body``, a blank line."""
    return [title, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)] \
        + ["| " + " | ".join(b) + " |" for b in body] + [""]


def _row_cells(row: dict, p: str, impls: list[str], notes: list[str]) -> Optional[list[str]]:
    got = {r["impl"]: r for r in row["results"] if r["pass"] == p}
    if not got:
        return None
    s = row["shape"]
    mine = got.get("napkin")
    # queries x keys and d/dv where they differ (a decode row read "N 4", its cache length nowhere)
    n = str(s["q_len"]) if s["q_len"] == s["kv_len"] else f"{s['q_len']} x {s['kv_len']}"
    dim = str(s["dim"]) if s["dim"] == s["value_dim"] else f"{s['dim']}/{s['value_dim']}"
    cells = [row["diagram"], row["dtype"], str(s["batch"]), str(s["heads"]), n,
             dim, _mask_cell(row), "ok" if row["check"].get("ok") else "FAILED",
             _num(mine and mine.get("ms"), 3), _num(mine and mine.get("tflops"))]
    if mine and mine.get("error"):
        cells[-1] = _note(notes, f"napkin {row['diagram']} {p}: {mine['error']}")
    for impl in impls:
        r = got.get(impl)
        if r is None:
            # not run in this pass because it failed in the other (a backend that cannot run the
            # shape is not differentiated): the same note, where the cell stood empty
            failed = next((x for x in row["results"] if x["impl"] == impl and x.get("error")), None)
            cells.append(_note(notes, f"{impl} on {row['diagram']}: {failed['error']}") if failed else "")
        elif r.get("error"):
            cells.append(_note(notes, f"{impl} on {row['diagram']}: {r['error']}"))
        else:
            ratio = row["ratios"].get(p, {}).get(impl)
            mark = "" if r["equivalent"] else " \u2020"
            cells.append(f"{_num(r.get('tflops'))}{mark}" + (f" ({ratio:.3g}x)" if ratio else ""))
    return cells


def _mask_cell(row: dict) -> str:
    """The causal column; a mask that keeps part of the pairs, how much (the
    share its FLOPs are counted at)."""
    if row["causal"]:
        return "yes"
    kept = row.get("visible")
    return f"no, keeps {100 * kept:.3g}%" if kept is not None and kept < 1 else "no"


def _note(notes: list[str], text: str) -> str:
    if text not in notes:
        notes.append(text)
    return f"n/a [{notes.index(text) + 1}]"
