"""Charts for the report, drawn as inline SVG text (no plotting library).

* ``roofline_svg(costs, profile)``: log-log roofline of the schedule on its
  device.  x is arithmetic intensity (contraction FLOPs per DRAM byte), y
  the contraction FLOP/s.  The roofs are the tensor-core peak and HBM bandwidth
  times intensity; this diagram's other ceilings (the exp unit, fp32
  elementwise work, the link between devices) are drawn as the contraction
  rate at which each would be the limit, given this diagram's mix of work.
  Points: the schedule, the same without L2 reuse, and the I/O lower bound
  (the least traffic any schedule at this capacity could have).
* ``time_bars_svg(costs)``: where the time goes, one bar per ceiling.

Pure functions of the cost report: same report, same bytes.
"""
from __future__ import annotations

import html
import math
from typing import Optional

from ..units import three_figures

WIDTH, HEIGHT = 720, 420
MARGIN = {"left": 78, "right": 190, "top": 20, "bottom": 52}
FONT = "font-family=\"Helvetica, Arial, sans-serif\""
SCHEDULE_COLOUR = "#d62728"
BOUND_COLOUR = "#2ca02c"
ROOF_COLOUR = "#1f3b73"
CEILING_COLOUR = "#9467bd"


def _e(text: str) -> str:
    return html.escape(text, quote=True)


def si(value: float, unit: str = "") -> str:
    """3 significant figures with an SI prefix: 989T, 3.35G, 127; with a
    unit, a space before it: 989 TFLOP/s."""
    sep = " " if unit else ""
    return three_figures(value, tuple((scale, f"{sep}{prefix}{unit}") for scale, prefix in (
        (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1, ""))))


def seconds(t: float) -> str:
    return three_figures(t, ((1.0, " s"), (1e-3, " ms"), (1e-6, " \u00b5s"), (1e-9, " ns")))


def _f(x: float) -> str:
    """Coordinates with two decimals: stable text, no float noise."""
    return f"{x:.2f}"


# --------------------------------------------------------------------------
# Roofline.
# --------------------------------------------------------------------------

class _LogAxes:
    """Maps (intensity, FLOP/s) to pixels on decade-aligned log axes."""

    def __init__(self, xs: list[float], ys: list[float]):
        self.x0 = 10 ** math.floor(math.log10(min(xs)))
        self.x1 = 10 ** math.ceil(math.log10(max(xs)))
        self.y0 = 10 ** math.floor(math.log10(min(ys)))
        self.y1 = 10 ** math.ceil(math.log10(max(ys)))
        if self.x1 <= self.x0:
            self.x1 = self.x0 * 10
        if self.y1 <= self.y0:
            self.y1 = self.y0 * 10
        self.w = WIDTH - MARGIN["left"] - MARGIN["right"]
        self.h = HEIGHT - MARGIN["top"] - MARGIN["bottom"]

    def px(self, x: float) -> float:
        return MARGIN["left"] + self.w * math.log10(x / self.x0) / math.log10(self.x1 / self.x0)

    def py(self, y: float) -> float:
        return MARGIN["top"] + self.h * (1 - math.log10(y / self.y0) / math.log10(self.y1 / self.y0))

    def decades(self, lo: float, hi: float) -> list[float]:
        return [10.0 ** k for k in range(round(math.log10(lo)), round(math.log10(hi)) + 1)]


def roofline_svg(costs, profile) -> Optional[str]:
    """The roofline chart, or None when the report (or the profile) lacks
    the numbers.  Up to three points, named in a key inside the plot:

    * the schedule, at the DRAM bytes its time estimate charges
      (``hbm_s`` x bandwidth: after whatever L2 reuse the cost pass models)
      and its estimated contraction FLOP/s;
    * the same schedule if nothing were reused in L2 (every byte it issues
      across the HBM boundary), when that differs;
    * the I/O lower bound for that boundary, on the roof, so the gap between
      the schedule's issued traffic and the least possible is visible.
    """
    rf = getattr(costs, "roofline", None)
    if rf is None or not rf.hbm_s or profile is None:
        return None
    flops, issued = costs.flops.contraction, costs.hbm_bytes
    if not flops:
        return None
    bandwidth = float(profile["hbm_bandwidth"])
    peak = rf.contraction_rate
    ceilings = [(f"tensor cores {si(peak, 'FLOP/s')}", peak, ROOF_COLOUR)]
    for name, t in (("exp unit", rf.exp_s), ("fp32 elementwise", rf.other_s),
                    ("between devices", rf.communication_s)):
        if t and t > 0:
            ceilings.append((f"{name} (this mix)", flops / t, CEILING_COLOUR))
    local = [c for name, c, _ in ceilings if "devices" not in name]

    def on_roof(intensity: float) -> float:
        return min([bandwidth * intensity] + local)

    dram = rf.hbm_s * bandwidth
    achieved = flops / rf.estimate_s if rf.estimate_s else peak
    points = [("this schedule", flops / dram, achieved, SCHEDULE_COLOUR, True)]
    if issued and abs(issued - dram) > 0.01 * dram:
        points.append(("same, without L2 reuse", flops / issued, on_roof(flops / issued), SCHEDULE_COLOUR, False))
    bound_bytes = getattr(costs.bound, "bytes", None)
    if bound_bytes:
        points.append(("I/O lower bound", flops / bound_bytes, on_roof(flops / bound_bytes), BOUND_COLOUR, False))
    ridge = peak / bandwidth
    xs = [p[1] for p in points] + [ridge]
    xs = [min(xs) / 4, max(xs) * 4]
    ys = [p[2] for p in points] + [c for _, c, _ in ceilings] + [bandwidth * xs[0]]
    ys = [min(ys) / 2, max(ys) * 1.5]
    ax = _LogAxes(xs, ys)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
           f'viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="roofline" {FONT} font-size="12">',
           f'<rect x="0" y="0" width="{WIDTH}" height="{HEIGHT}" fill="#ffffff"/>']
    left, right = MARGIN["left"], WIDTH - MARGIN["right"]
    top, bottom = MARGIN["top"], HEIGHT - MARGIN["bottom"]
    # Grid and decade labels.
    for x in ax.decades(ax.x0, ax.x1):
        out.append(f'<line x1="{_f(ax.px(x))}" y1="{top}" x2="{_f(ax.px(x))}" y2="{bottom}" stroke="#e5e5e5"/>')
        out.append(f'<text x="{_f(ax.px(x))}" y="{bottom + 16}" text-anchor="middle">{_e(si(x))}</text>')
    for y in ax.decades(ax.y0, ax.y1):
        out.append(f'<line x1="{left}" y1="{_f(ax.py(y))}" x2="{right}" y2="{_f(ax.py(y))}" stroke="#e5e5e5"/>')
        out.append(f'<text x="{left - 6}" y="{_f(ax.py(y) + 4)}" text-anchor="end">{_e(si(y))}</text>')
    out.append(f'<rect x="{left}" y="{top}" width="{right - left}" height="{bottom - top}" '
               f'fill="none" stroke="#888888"/>')
    out.append(f'<text x="{(left + right) / 2:.2f}" y="{HEIGHT - 12}" text-anchor="middle">'
               f'arithmetic intensity (contraction FLOPs per DRAM byte)</text>')
    out.append(f'<text x="16" y="{(top + bottom) / 2:.2f}" text-anchor="middle" '
               f'transform="rotate(-90 16 {(top + bottom) / 2:.2f})">contraction FLOP/s</text>')
    # The memory roof, from where it enters the frame to where it meets the peak.
    x_start, x_end = max(ax.x0, ax.y0 / bandwidth), min(ax.x1, ridge)
    out.append(f'<line x1="{_f(ax.px(x_start))}" y1="{_f(ax.py(bandwidth * x_start))}" '
               f'x2="{_f(ax.px(x_end))}" y2="{_f(ax.py(bandwidth * x_end))}" stroke="{ROOF_COLOUR}" '
               f'stroke-width="2.5"/>')
    angle = -math.degrees(math.atan2(ax.py(bandwidth * x_start) - ax.py(bandwidth * x_end),
                                     ax.px(x_end) - ax.px(x_start)))
    lx = math.sqrt(x_start * x_end)
    anchor = (_f(ax.px(lx)), _f(ax.py(bandwidth * lx) - 8))
    out.append(f'<text x="{anchor[0]}" y="{anchor[1]}" fill="{ROOF_COLOUR}" text-anchor="middle" '
               f'transform="rotate({angle:.2f} {anchor[0]} {anchor[1]})">HBM {_e(si(bandwidth, "B/s"))}</text>')
    # Horizontal ceilings, labelled in the right margin; labels of ceilings
    # that nearly coincide are spread apart so each stays readable.
    for name, level, colour in ceilings:
        start = ax.px(max(ax.x0, min(ax.x1, level / bandwidth)))
        dash = "" if colour == ROOF_COLOUR else ' stroke-dasharray="6 4"'
        out.append(f'<line x1="{_f(start)}" y1="{_f(ax.py(level))}" x2="{right}" y2="{_f(ax.py(level))}" '
                   f'stroke="{colour}" stroke-width="{2.5 if colour == ROOF_COLOUR else 1.5}"{dash}/>')
    placed = _spread(sorted((ax.py(level) + 4, name, colour) for name, level, colour in ceilings), 15)
    for y, name, colour in placed:
        out.append(f'<text x="{right + 6}" y="{_f(y)}" fill="{colour}">{_e(name)}</text>')
    # The points, and a key in the plot's lower right (below the roofs).
    if len(points) > 1 and points[1][0].startswith("same"):
        (_, x0, y0, _, _), (_, x1, y1, _, _) = points[0], points[1]
        out.append(f'<line x1="{_f(ax.px(x1))}" y1="{_f(ax.py(y1))}" x2="{_f(ax.px(x0))}" '
                   f'y2="{_f(ax.py(y0))}" stroke="{SCHEDULE_COLOUR}" stroke-dasharray="2 3"/>')
    keys = [f"{name}: {si(y, 'FLOP/s')} at {x:.3g} FLOP/B" for name, x, y, _, _ in points]
    # Right-aligned by an estimate of the text's width (about 6.5 px a
    # character at 12 px Helvetica): SVG text cannot be measured here.
    key_x = right - 10 - 6.5 * max(len(k) for k in keys)
    key_y = bottom - 14 - 18 * (len(points) - 1)
    for i, ((name, x, y, colour, filled), key) in enumerate(zip(points, keys)):
        fill = colour if filled else "#ffffff"
        out.append(f'<circle cx="{_f(ax.px(x))}" cy="{_f(ax.py(y))}" r="6" fill="{fill}" '
                   f'stroke="{colour}" stroke-width="2.5"/>')
        ky = key_y + 18 * i
        out.append(f'<circle cx="{_f(key_x - 10)}" cy="{ky - 4}" r="5" fill="{fill}" stroke="{colour}" '
                   f'stroke-width="2"/>')
        out.append(f'<text x="{_f(key_x)}" y="{ky}" fill="{colour}">{_e(key)}</text>')
    out.append("</svg>")
    return "\n".join(out)


def _spread(labels: list[tuple], gap: float) -> list[tuple]:
    """Labels sorted by y, each pushed down until it is ``gap`` below the last."""
    out, last = [], None
    for y, *rest in labels:
        if last is not None and y < last + gap:
            y = last + gap
        out.append((y, *rest))
        last = y
    return out


# --------------------------------------------------------------------------
# Where the time goes.
# --------------------------------------------------------------------------

BAR_WIDTH, BAR_ROW = 680, 26


def time_bars_svg(costs) -> Optional[str]:
    """One bar per ceiling: the time each alone would take; the longest is
    the bound (red).  Communication, not overlapped, adds to it.  A pale bar
    shows HBM time if L2 reused nothing, when the cost pass models L2."""
    rf = getattr(costs, "roofline", None)
    if rf is None:
        return None
    rows = [("tensor cores", rf.contraction_s, "compute"), ("exp unit", rf.exp_s, "exp"),
            ("fp32 elementwise", rf.other_s, "other"), ("HBM traffic", rf.hbm_s, "bandwidth")]
    issued = getattr(rf, "hbm_issued_s", None)
    if issued and abs(issued - rf.hbm_s) > 0.01 * rf.hbm_s:
        rows.append(("HBM, without L2 reuse", issued, "issued"))
    if rf.communication_s:
        rows.append(("between devices (added)", rf.communication_s, "communication"))
    longest = max(t for _, t, _ in rows) or 1.0
    label_w, value_w = 170, 90
    span = BAR_WIDTH - label_w - value_w
    height = BAR_ROW * len(rows) + 30
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{BAR_WIDTH}" height="{height}" '
           f'viewBox="0 0 {BAR_WIDTH} {height}" role="img" aria-label="time per ceiling" {FONT} font-size="12">',
           f'<rect x="0" y="0" width="{BAR_WIDTH}" height="{height}" fill="#ffffff"/>']
    for i, (name, t, key) in enumerate(rows):
        y = 6 + i * BAR_ROW
        colour = SCHEDULE_COLOUR if key == rf.bound else ("#bbbbbb" if key == "issued" else
                                                           "#999999" if key == "communication" else "#6b9bd1")
        out.append(f'<text x="{label_w - 8}" y="{y + 15}" text-anchor="end">{_e(name)}</text>')
        out.append(f'<rect x="{label_w}" y="{y + 3}" width="{_f(max(1.0, span * t / longest))}" height="16" '
                   f'fill="{colour}"/>')
        out.append(f'<text x="{_f(label_w + max(1.0, span * t / longest) + 6)}" y="{y + 15}">'
                   f'{_e(seconds(t))}</text>')
    out.append(f'<text x="{label_w}" y="{height - 8}" fill="#555555">estimate {_e(seconds(rf.estimate_s))}: '
               f'{_e(rf.bound)}-bound (the red bar)</text>')
    out.append("</svg>")
    return "\n".join(out)
