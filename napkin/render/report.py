"""The one-page HTML report: ``report_html(diagram, costs, svg, ...) -> str``.

One self-contained file (inline CSS and SVG, no scripts, nothing fetched),
ordered the way a kernel engineer reads it: the headline (time, what bounds
it, traffic against the lower bound), where the time goes, the roofline, the
picture, then the tables behind the numbers.  A pure function: the caller
runs the cost pass and Graphviz and passes their results in; missing pieces
(no cost pass, no ``dot``) become a sentence saying why, never a failure.
"""
from __future__ import annotations

import html
from typing import Optional

from .. import ir
from ..cost.report import grid_text, kernel_words
from ..printer import to_text
from .dot import format_bytes
from .roofline import roofline_svg, seconds, si, time_bars_svg

STYLE = """
body { font-family: Helvetica, Arial, sans-serif; margin: 24px auto; max-width: 1400px;
       color: #222; line-height: 1.4; padding: 0 16px; }
h1 { font-size: 24px; margin-bottom: 4px; }
h2 { font-size: 18px; margin-top: 32px; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
.headline { font-size: 16px; background: #f4f7fb; border-left: 4px solid #6b9bd1; padding: 8px 12px; }
.bad { color: #b03030; font-weight: bold; }
.note { color: #555; }
.picture { overflow-x: auto; border: 1px solid #ddd; padding: 8px; }
.picture svg { width: 100%; height: auto; }
table { border-collapse: collapse; margin: 8px 0; font-size: 13px; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; }
th { background: #f2f2f2; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
code, pre { font-family: Menlo, Consolas, monospace; font-size: 12px; }
pre { background: #f7f7f7; padding: 8px; overflow-x: auto; }
.meter { display: inline-block; height: 10px; background: #6b9bd1; vertical-align: middle; }
.meter.over { background: #b03030; }
"""


def _e(text) -> str:
    return html.escape(str(text), quote=True)


def _bytes(n: Optional[float]) -> str:
    return "?" if n is None else format_bytes(n)


def _count(n: Optional[float]) -> str:
    return "?" if n is None else si(n)


def _table(header: list[str], rows: list[list[str]], numeric: tuple[int, ...] = ()) -> str:
    """An HTML table; cells are already escaped; ``numeric`` columns align right."""
    head = "".join(f"<th>{h}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f'<td class="num">{c}</td>' if i in numeric else f"<td>{c}</td>"
                         for i, c in enumerate(row)) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


# --------------------------------------------------------------------------
# Sections.
# --------------------------------------------------------------------------

def _headline(costs, profile) -> str:
    device = profile.name if profile is not None else costs.profile
    parts = [f"On <b>{_e(device)}</b>"]
    rf = costs.roofline
    if rf is not None:
        parts.append(f"the schedule should take <b>{_e(seconds(rf.estimate_s))}</b>, "
                     f"<b>{_e(rf.bound)}-bound</b>")
    if costs.hbm_bytes is not None:
        text = f"it moves <b>{_e(_bytes(costs.hbm_bytes))}</b> across the HBM boundary"
        if costs.bound.ratio is not None:
            ratio = costs.bound.ratio
            cls = ' class="bad"' if ratio > 2 else ""
            text += (f", <span{cls}>{ratio:.3g}&times;</span> the I/O lower bound "
                     f"({_e(_bytes(costs.bound.bytes))})")
        dram = getattr(costs.totals[0], "dram_bytes", None) if costs.totals else None
        if dram is not None and dram != costs.hbm_bytes:
            text += f"; {_e(_bytes(dram))} of it reaches DRAM after L2 reuse"
        parts.append(text)
    return '<p class="headline">' + "; ".join(parts) + ".</p>"


def _kernels(costs) -> str:
    rows = []
    for k in costs.kernels:
        grid = grid_text(k)
        stream = f"{k.stream[0]} by {k.stream[1]}" if k.stream else "-"
        chunk, chunks = (getattr(k, f, None) for f in ("chunk", "chunks"))
        if chunk is not None and k.stream:   # chunks of the streamed wire (napkin/cost/chunks.py)
            stream += f", in chunks of {chunk}" + (f" ({chunks})" if chunks is not None else "")
        boxes = kernel_words(k)
        rows.append([str(k.index), _e(boxes), _e(", ".join(k.stores)), _e(grid), _e(stream),
                     _e(_count(k.programs)), _e(_count(k.steps)), _e(_count(k.visited_steps)),
                     "yes" if k.two_pass else "no"])
    return _table(["kernel", "boxes", "writes", "grid (wire/block)", "stream", "programs", "steps",
                   "(program, step) pairs run", "two passes"], rows, numeric=(0, 5, 6, 7))


def _transfers(costs) -> str:
    rows = [[_e(t.boundary), str(t.kernel), _e(t.tensor), _e(t.direction), _e(t.dtype),
             f"<code>{_e(t.formula)}</code>", _e(_count(t.elements)), _e(_bytes(t.bytes)),
             "?" if t.fetches is None else _e(f"{t.fetches:.4g}")] for t in costs.transfers]
    totals = [[_e(t.boundary), _e(_bytes(t.load_bytes)), _e(_bytes(t.store_bytes)),
               f"<code>{_e(t.formula_bytes)}</code>"] for t in costs.totals]
    return (_table(["boundary", "kernel", "tensor", "direction", "dtype", "elements (symbolic)",
                    "elements", "bytes", "fetches per element"], rows, numeric=(1, 6, 7, 8))
            + _table(["boundary", "loads", "stores", "bytes (symbolic)"], totals, numeric=(1, 2)))


def _footprints(costs) -> str:
    rows = []
    for f in costs.footprints:
        share = ""
        if f.bytes is not None and f.capacity:
            frac = f.bytes / f.capacity
            cls = "meter over" if frac > 1 else "meter"
            share = f'<span class="{cls}" style="width:{min(frac, 1.0) * 120:.0f}px"></span> {frac:.0%}'
        fits = "?" if f.fits is None else ("yes" if f.fits else '<span class="bad">NO</span>')
        tiles = ", ".join(f"{t.tensor} {format_bytes(t.bytes)}" for t in f.tiles)
        rows.append([_e(f.level), _e(_bytes(f.bytes)), _e(_bytes(f.capacity)), share, fits, _e(tiles)])
    return _table(["level", "resident", "capacity", "used", "fits", "tiles"], rows, numeric=(1, 2))


def _devices(costs) -> str:
    d = costs.devices
    if d is None:
        return ""
    rows = [[_e(c.tensor), _e(c.collective), str(c.group), str(c.steps), _e(c.dtype),
             f"<code>{_e(c.formula)}</code>", _e(_bytes(c.bytes_received)), _e(_bytes(c.bytes_sent))]
            for c in d.rows]
    grid = ", ".join(f"{w} {k} across {n}" for w, k, n in d.grid)
    link = getattr(d, "link", None)
    head = (f"<p>{d.devices} devices ({_e(grid)}); per device: received {_e(_bytes(d.bytes_received))}, "
            f"sent {_e(_bytes(d.bytes_sent))} in {d.steps} steps"
            + (f" over {_e(link)}" if link else "") + ".</p>")
    return "<h2>Between devices</h2>" + head + _table(
        ["tensor", "collective", "devices", "steps", "dtype", "received (symbolic bytes)", "received", "sent"],
        rows, numeric=(2, 3, 6, 7))


def _work(costs) -> str:
    fl, b = costs.flops, costs.bound
    rows = [["contractions", f"<code>{_e(fl.contraction_formula)}</code>", _e(_count(fl.contraction)),
             _e(fl.contraction_dtype)],
            ["other elementwise", f"<code>{_e(fl.other_formula)}</code>", _e(_count(fl.other)), "fp32"],
            ["exp unit", f"<code>{_e(fl.exp_formula)}</code>", _e(_count(fl.exp)), "-"]]
    out = _table(["work", "operations (symbolic)", "operations", "at"], rows, numeric=(2,))
    if fl.skipped_fraction:
        out += f'<p class="note">Block skipping drops {fl.skipped_fraction:.1%} of the (row, step) area.</p>'
    out += (f"<p>I/O lower bound ({_e(b.kind)}), with M = {_e(_bytes(b.capacity_bytes))} of "
            f"{_e(b.capacity_level)} / {b.element_bytes} B per element: <code>{_e(b.formula)}</code> "
            + (f"= {_e(_bytes(b.formula_bytes))}, below the compulsory traffic (each input read and each "
               f"output written once), {_e(_bytes(b.bytes))}, which is the bound"
               if b.floored else f"= {_e(_bytes(b.bytes))}")
            + (f"; this schedule moves {b.ratio:.3g}&times; that." if b.ratio is not None else ".")
            + "</p>")
    return out


# --------------------------------------------------------------------------
# The page.
# --------------------------------------------------------------------------

def report_html(diagram: ir.Diagram, costs, svg: Optional[str], *, dot_text: str = "",
                sizes: Optional[dict] = None, why_no_costs: Optional[str] = None,
                profile=None) -> str:
    """The report page.  ``costs``: a cost report or None; ``svg``: the
    rendered diagram or None (then ``dot_text`` is shown instead);
    ``profile``: the device profile (its name and HBM bandwidth; without
    it there is no roofline)."""
    size_text = " ".join(f"{k}={v}" for k, v in (costs.sizes if costs is not None else (sizes or {}).items()))
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           f"<title>napkin report: {_e(diagram.name)}</title>", f"<style>{STYLE}</style></head><body>",
           f"<h1>napkin report: {_e(diagram.name)}</h1>",
           f'<p class="note">Sizes {_e(size_text or "symbolic")}'
           + (" (numbers per device)" if costs is not None and costs.per_device else "") + ".</p>"]
    if costs is not None:
        out.append(_headline(costs, profile))
        bars = time_bars_svg(costs)
        roof = roofline_svg(costs, profile)
        if bars:
            out += ["<h2>Where the time goes</h2>", bars]
        if roof:
            out += ["<h2>Roofline</h2>", roof]
    else:
        out.append(f'<p class="headline">No cost tables: {_e(why_no_costs or "no cost report")}.</p>')
    out.append("<h2>Diagram</h2>")
    if svg is not None:
        out.append(f'<div class="picture">{svg}</div>')
    else:
        out.append("<p>Graphviz's <code>dot</code> is not installed, so here is the DOT text "
                   "(install Graphviz to see the picture).</p>")
        out.append(f"<pre>{_e(dot_text)}</pre>")
    if costs is not None:
        out += ["<h2>Kernels</h2>", _kernels(costs),
                "<h2>Traffic across memory levels</h2>", _transfers(costs),
                _devices(costs),
                "<h2>Resident per level</h2>", _footprints(costs),
                "<h2>Work and the lower bound</h2>", _work(costs)]
        if costs.notes:
            out.append("<ul>" + "".join(f'<li class="note">{_e(n)}</li>' for n in costs.notes) + "</ul>")
    out += ["<h2>Source</h2>", f"<pre>{_e(to_text(diagram))}</pre>",
            '<p class="note">Written by napkin.</p>', "</body></html>"]
    return "\n".join(out) + "\n"
