"""Ring Attention against ATTENTION2D, per device, in napkin's own numbers.

    python -m napkin.cost.compare [--tokens N] [--dim D] [--dtype bf16]

For each device count P and head layout (multi-head, grouped-query), the
same attention diagram is costed under two device schedules that differ
only in their devices level:

  Ring:        group q across P, stream x across P
  ATTENTION2D: group q across R, group x across C   (R * C = P)

with the square grid (R = C = sqrt P) and the best rectangular grid napkin
finds.  Printed next to the background notes' figures (section 2), which
are derived there, not measured.  Numbers are bytes each device receives in
the forward pass (it sends as much), the cost pass's, which are what
napkin.distributed sends (napkin/cost/collectives.py; partial states travel
in fp32, as the merge needs).  The column "partials in input dtype" is a
what-if napkin does not run: the same grid with bf16 partial states.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Optional

from ..sizes import positive_int
from . import collectives as C
from .analysis import analyse

# Ring / ATTENTION2D per-device traffic for multi-head attention, as the
# background notes state it (section 2, "derived").
BACKGROUND_MHA_RATIO = {16: 2.1, 64: 4.2, 256: 8.2}

_TEMPLATE = """
diagram {name}
wire b, hk, g, q, x
wire d = {d}
in Q[b, (hk g), q, d] : {dtype}
in K[b, hk, x, d] : {dtype}
in V[b, hk, x, d] : {dtype}
S[b, hk, g, q, x] = sum[d](Q * K) * |d|^-0.5
P[b, hk, g, q, x] = softmax[x](S)
O[b, (hk g), q, d] : {dtype} = sum[x](P * V)
lse[b, (hk g), q] = logsumexp[x](S)
out O, lse
schedule on h100 {{
  accumulate {acc}
  level devices {{ {devices} }}
  level hbm {{ hold Q, K, V, O, lse }}
  level smem {{ group b by 1, hk by 1, g by 1, q by 128
               stream x by 64
               hold S, P }}
}}
"""


def _diagram(name: str, devices: str, d: int, dtype: str, acc: str = "fp32"):
    """The comparison's diagram with the given devices level."""
    import napkin
    text = _TEMPLATE.format(name=name, devices=devices, d=d, dtype=dtype, acc=acc)
    return napkin.load_text(text, f"<{name}>")


def received(devices: str, n: int, h_kv: int, g: int, d: int, dtype: str) -> int:
    """Bytes one device receives in the forward under the given devices level."""
    r = analyse(_diagram("cmp", devices, d, dtype), {"b": 1, "hk": h_kv, "g": g, "q": n, "x": n})
    return r.devices.bytes_received


def ring(p: int, n: int, h_kv: int, g: int, d: int, dtype: str) -> int:
    return received(f"group q across {p}\n stream x across {p}", n, h_kv, g, d, dtype)


def a2d(rows: int, cols: int, n: int, h_kv: int, g: int, d: int, dtype: str) -> int:
    return received(f"group q across {rows}\n group x across {cols}", n, h_kv, g, d, dtype)


def a2d_narrow(rows: int, cols: int, n: int, h_kv: int, g: int, d: int, dtype: str) -> int:
    """The what-if: partial states in the input dtype instead of fp32."""
    m = C.Moved.attention(dict(b=1, hq=h_kv * g, hkv=h_kv, d=d, q=n), dtype)
    m = dataclasses.replace(m, state=C.ELEMENT_BYTES[dtype])
    return C.rank_bytes("attention2d", (rows, cols), m, "forward")[0][1]


def best_grid(p: int, n: int, h_kv: int, g: int, d: int, dtype: str) -> Optional[tuple[int, int, int]]:
    """(R, C, bytes) of the two-dimensional R x C grid (R, C > 1) with the
    least per-device traffic.  R x 1 (x whole on every device) gathers K and
    V as Ring does, the same bytes, so the Ring column stands for it; the
    background's claims compare Ring with grids that split both wires.  None
    where P has no such grid (a prime, or 1)."""
    options = [(r, p // r) for r in range(1, p + 1) if p % r == 0 and r > 1 and p // r > 1]
    if not options:
        return None
    scored = [(a2d(r, c, n, h_kv, g, d, dtype), r, c) for r, c in options]
    cost, r, c = min(scored)
    return r, c, cost


def table(ps=(4, 16, 64, 256), n: int = 65536, d: int = 128, dtype: str = "bf16",
          layouts=(("MHA", 32, 1), ("GQA g=8", 4, 8))) -> list[dict]:
    rows = []
    for label, h_kv, g in layouts:
        for p in ps:
            side = math.isqrt(p)
            r_bytes = ring(p, n, h_kv, g, d, dtype)
            square: Optional[int] = a2d(side, side, n, h_kv, g, d, dtype) if side * side == p else None
            narrow = a2d_narrow(side, side, n, h_kv, g, d, dtype) if side * side == p else None
            best = best_grid(p, n, h_kv, g, d, dtype)
            rect = None if best is None else best[2]
            rows.append({"heads": label, "P": p, "ring": r_bytes, "a2d_square": square,
                         "best_grid": "-" if best is None else f"{best[0]}x{best[1]}", "a2d_best": rect,
                         "ring_over_square": None if square is None else r_bytes / square,
                         "ring_over_square_narrow": None if narrow is None else r_bytes / narrow,
                         "ring_over_best": None if rect is None else r_bytes / rect,
                         "background": BACKGROUND_MHA_RATIO.get(p) if g == 1 else None})
    return rows


def markdown(rows: list[dict]) -> str:
    def mb(v):
        return "-" if v is None else f"{v / 1e6:,.1f}"

    def x(v):
        return "-" if v is None else f"{v:.2f}x"
    out = ["| heads | P | Ring MB | A2D square MB | Ring/square | same, partials in input dtype "
           "| best grid | A2D best MB | Ring/best | background Ring/A2D |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['heads']} | {r['P']} | {mb(r['ring'])} | {mb(r['a2d_square'])} | "
                   f"{x(r['ring_over_square'])} | {x(r['ring_over_square_narrow'])} | {r['best_grid']} | {mb(r['a2d_best'])} | "
                   f"{x(r['ring_over_best'])} | {x(r['background'])} |")
    return "\n".join(out)


def _device_counts(text: str) -> tuple[int, ...]:
    """P,...: each at least 2 (one device sends nothing, and the ratios divide by it)."""
    counts = tuple(positive_int(item) for item in text.split(","))
    if min(counts) < 2:
        raise argparse.ArgumentTypeError(f"each device count must be at least 2, got {text!r}")
    return counts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m napkin.cost.compare", description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=positive_int, default=65536)
    parser.add_argument("--dim", type=positive_int, default=128)
    parser.add_argument("--dtype", default="bf16", choices=tuple(C.ELEMENT_BYTES))
    parser.add_argument("--devices", type=_device_counts, default=(4, 16, 64, 256), metavar="P,...",
                        help="device counts (default 4,16,64,256)")
    args = parser.parse_args(argv)
    print(f"per-device forward communication, N = {args.tokens} tokens, d = {args.dim}, {args.dtype}; "
          "MHA = 32 heads, GQA = 32 query heads over 4 kv heads")
    print(markdown(table(ps=args.devices, n=args.tokens, d=args.dim, dtype=args.dtype)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
