"""Predicted time of ATTENTION2D and Ring Attention on a cluster, next to the
ATTENTION2D paper's reported speedups (docs/distributed.md).

    python -m napkin.distributed.predict

The model is napkin/cost/collectives.py's, the one the cost pass and
``napkin plan`` use (and the tests prove against the byte counter):

* traffic: exactly what napkin's wrappers send;
* links: ranks placed row-major, ``gpus_per_node`` per node; NVLink within a
  node, InfiniBand across (per GPU, per direction, profiles.toml); a
  collective takes max(bytes within / NVLink, bytes across / InfiniBand) on
  its slowest rank, a ring step its slowest hop;
* compute: 4 b N^2 h d / P FLOPs forward per device (x0.5 causal), 2.5x
  that backward, at FlashAttention-2's fraction of the dense bf16 peak
  (napkin/plan.py), the same for every GPU and balanced over devices;
* overlap: Ring overlaps each step's transfers with its compute;
  ATTENTION2D is the paper's no-overlap variant.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..cost import collectives as C
from ..plan import BWD_EFFICIENCY, BWD_FLOP_FACTOR, FWD_EFFICIENCY

# GPT-3 family (Brown et al. 2020, Table 2.1): heads x head dim
GPT3 = {"760M": (16, 96), "2.7B": (32, 80), "6.7B": (32, 128), "13B": (40, 128)}


@dataclass(frozen=True)
class Cluster:
    profile: str          # "a100" or "h100" (napkin/profiles.toml)
    gpus: int
    gpus_per_node: int

    def figures(self):
        from ..cost.profiles import get_profile
        p = get_profile(self.profile)
        return p["peak_flops_bf16"], C.Links.of(p)


def predicted_time(scheme: str, grid, sizes: dict, cluster: Cluster, *, dtype: str = "bf16",
                   causal: bool = True, backward: bool = False) -> float:
    """Seconds for one attention call (forward, or forward + backward); the
    shape handshake (a few hundred bytes) is left out."""
    peak, links = cluster.figures()
    placement = C.Placement(scheme, grid, cluster.gpus_per_node)
    devices = placement.parts
    flops = 4 * sizes["b"] * sizes["q"] * sizes.get("x", sizes["q"]) * sizes["hq"] * sizes["d"] / devices
    flops *= 0.5 if causal else 1.0
    steps = devices if scheme in C.RINGS else 1
    fwd = [flops / steps / (peak * FWD_EFFICIENCY)] * steps
    bwd = [BWD_FLOP_FACTOR * flops / steps / (peak * BWD_EFFICIENCY)] * steps if backward else None
    t = C.scheme_seconds(placement, C.Moved.attention(sizes, dtype), links, fwd, bwd)
    return t.total_s


def table(rows=None) -> list[dict]:
    """The docs table: Ring vs ATTENTION2D, multi-head GPT-3 shapes, bf16,
    causal, batch 1 (long-context training)."""
    rows = rows or [
        (Cluster("a100", 16, 8), (4, 4)),
        (Cluster("a100", 64, 8), (8, 8)),
        (Cluster("h100", 16, 8), (4, 4)),
        (Cluster("h100", 64, 1), (8, 8)),
    ]
    out = []
    for cluster, grid in rows:
        for model in ("760M", "13B"):
            heads, d = GPT3[model]
            for tokens in (8192, 32768, 131072):
                sizes = dict(b=1, hq=heads, hkv=heads, d=d, q=tokens)
                rec = dict(gpu=cluster.profile, gpus=cluster.gpus, per_node=cluster.gpus_per_node,
                           grid=f"{grid[0]}x{grid[1]}", model=model, tokens=tokens)
                for bwd in (False, True):
                    ring = predicted_time("ring", (cluster.gpus,), sizes, cluster, backward=bwd)
                    a2d = predicted_time("attention2d", grid, sizes, cluster, backward=bwd)
                    key = "fwdbwd" if bwd else "fwd"
                    rec[f"ring_{key}_ms"], rec[f"a2d_{key}_ms"] = ring * 1e3, a2d * 1e3
                    rec[f"speedup_{key}"] = ring / a2d
                out.append(rec)
    return out


def markdown(records: list[dict]) -> str:
    head = ("| GPUs | per node | grid | model | tokens | Ring fwd ms | A2D fwd ms | fwd speedup "
            "| Ring fwd+bwd ms | A2D fwd+bwd ms | fwd+bwd speedup |")
    lines = [head, "|" + "---|" * 11]
    for r in records:
        lines.append(f"| {r['gpus']} {r['gpu'].upper()} | {r['per_node']} | {r['grid']} | {r['model']} "
                     f"| {r['tokens'] // 1024}K | {r['ring_fwd_ms']:.2f} | {r['a2d_fwd_ms']:.2f} "
                     f"| {r['speedup_fwd']:.2f}x | {r['ring_fwdbwd_ms']:.2f} | {r['a2d_fwdbwd_ms']:.2f} "
                     f"| {r['speedup_fwdbwd']:.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m napkin.distributed.predict
    print(markdown(table()))
