"""Predicted time of ATTENTION2D and Ring Attention on a cluster.

A deliberately small model, to put next to the ATTENTION2D paper's reported
speedups (docs/distributed.md):

* traffic: exactly what napkin's wrappers send (commcount.comm_terms);
* links: ranks are placed row-major, ``gpus_per_node`` per node; a transfer
  between two GPUs of one node runs at the profile's NVLink bandwidth, across
  nodes at its InfiniBand bandwidth (per GPU, per direction, profiles.toml).
  A collective's time on a rank is max(bytes from same-node peers / NVLink,
  bytes from other nodes / InfiniBand); the slowest rank sets it.  A ring
  step takes one chunk over the slowest hop of the ring;
* compute: 4 b N^2 h d / P FLOPs forward per device (x0.5 causal), backward
  2.5x that, at a fixed fraction of the dense bf16 peak: 0.37 forward and
  0.33 backward, FlashAttention-2's H100 figures (370 and 322 TFLOP/s at
  d=128, background section 4), used for every GPU;
* overlap: Ring overlaps each step's transfer with its compute
  (max(compute, comm) per step, the way ring implementations run);
  ATTENTION2D is the no-overlap variant (compute + comm), which the paper
  found usually faster.
"""
from __future__ import annotations

from dataclasses import dataclass

from .commcount import comm_terms

FWD_EFFICIENCY = 370 / 989.4     # FA2 forward, d128, H100 (background section 4)
BWD_EFFICIENCY = 322 / 989.4     # FA2 backward
BWD_FLOP_FACTOR = 2.5            # backward FLOPs / forward FLOPs (background section 1)

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
        return p["peak_flops_bf16"], p["nvlink_bandwidth"], p["infiniband_bandwidth"]


def _peers(scheme: str, grid, group: str, rank: int) -> list[int]:
    if scheme == "ring":
        p = grid[0]
        return [(rank - 1) % p]
    r, c = grid
    i, j = divmod(rank, c)
    if group == "row":
        return [i * c + jj for jj in range(c) if jj != j]
    return [ii * c + j for ii in range(r) if ii != i]


def comm_time(scheme: str, grid, sizes: dict, dtype: str, phase: str, cluster: Cluster) -> float:
    _, nvlink, ib = cluster.figures()
    ranks = grid[0] if scheme == "ring" else grid[0] * grid[1]
    total = 0.0
    for term in comm_terms(scheme, grid, sizes, dtype, phase):
        worst = 0.0
        for rank in range(ranks):
            peers = _peers(scheme, grid, term.group, rank)
            node = rank // cluster.gpus_per_node
            inter = sum(1 for p in peers if p // cluster.gpus_per_node != node)
            intra = len(peers) - inter
            if scheme == "ring":      # one neighbour, term.steps times in a row
                per_step = term.nbytes / (ib if inter else nvlink)
                worst = max(worst, term.steps * per_step)
            else:                     # every peer's block, over both kinds of link at once
                worst = max(worst, max(intra * term.nbytes / nvlink, inter * term.nbytes / ib))
        total += worst
    return total


def compute_time(sizes: dict, devices: int, causal: bool, cluster: Cluster, backward: bool) -> float:
    peak = cluster.figures()[0]
    flops = 4 * sizes["b"] * sizes["q"] * sizes.get("x", sizes["q"]) * sizes["hq"] * sizes["d"] / devices
    flops *= 0.5 if causal else 1.0
    fwd = flops / (peak * FWD_EFFICIENCY)
    return fwd + (BWD_FLOP_FACTOR * flops / (peak * BWD_EFFICIENCY) if backward else 0.0)


def predicted_time(scheme: str, grid, sizes: dict, cluster: Cluster, *, dtype: str = "bf16",
                   causal: bool = True, backward: bool = False) -> float:
    """Seconds for one attention call (forward, or forward + backward); the
    shape handshake (a few hundred bytes) is left out."""
    devices = grid[0] if scheme == "ring" else grid[0] * grid[1]
    fwd = compute_time(sizes, devices, causal, cluster, False)
    bwd = compute_time(sizes, devices, causal, cluster, True) - fwd
    fwd_comm = comm_time(scheme, grid, sizes, dtype, "forward", cluster)
    bwd_comm = comm_time(scheme, grid, sizes, dtype, "backward", cluster) if backward else 0.0
    if scheme != "ring":
        return fwd + fwd_comm + (bwd + bwd_comm if backward else 0.0)
    p = grid[0]
    # forward: P compute steps, P-1 transfers each hidden behind a step
    total = (p - 1) * max(fwd / p, fwd_comm / max(p - 1, 1)) + fwd / p
    if backward:   # P steps, each moving K, V and/or dK, dV while computing
        total += p * max(bwd / p, bwd_comm / p)
    return total


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
