"""Context parallelism over the masks of the Long-Context Attention Benchmark.

    python bench/cp_bench.py predict [--gpus 8,16,32,64,96] [--per-node 8]
    python bench/cp_bench.py measure --devices 4 [--tokens 1024] [--repeats 3] [--masks full,causal]

The masks: full, causal, document (causal inside each document), sliding
window (causal), prefix-LM (the prefix sees itself both ways, the rest is
causal) and shared-question (a question every answer sees, then answers
that see the question and their own earlier tokens).  Their parameters are
this script's choices, scaled with the sequence length N: documents of
MASK_DOCS fractions of N, a window of N/8, a prefix of N/4, a question of
N/8 followed by four answers of equal length.

The schemes: Ring Attention (zigzag layout; Ring's backward; run for the
steps the mask and the ids reach, both ways round, as RingAttention cuts
it), the same with BurstAttention's backward, both as a double ring with
several nodes
(``predict`` only: the steps follow napkin/distributed/groups.py's
ring_origin), Ring over cyclic shards (``predict`` only: the same passes,
every document dealt out evenly), ATTENTION2D on every grid (cyclic layout; with
several nodes, every block of the grid a node can hold), and the short ring:
Ring over contiguous shards, cut to the steps the mask reaches
(napkin/distributed/reach.py).

``predict``: the benchmark's settings (8K tokens per GPU, 64 query heads, 8
key/value heads, head dim 128, bf16, forward + backward) at 8 to 96 H100s,
8 per node.  Communication and its time come from napkin/cost/collectives.py
(the model the tests prove against the byte counter).  Compute is counted
exactly per device and per step: the pairs (query, key) the mask keeps among
the rows each device holds, at 4 * 128 * 64 FLOPs per pair forward and 2.5x
backward, at FlashAttention-2's fraction of the bf16 peak (napkin/plan.py),
a kernel skipping exactly the masked pairs.  Ring steps wait for their
slowest device; ATTENTION2D's single step too.

``measure``: the same schemes on gloo, P processes on this CPU (eager local
attention, float32, 8 query heads over 1 key/value head, head dim 32):
bytes each rank sent, counted and predicted, and the wall time of forward +
backward per rank (the slowest rank's median over the repeats).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from napkin import plan as PLAN  # noqa: E402
from napkin.cost import collectives as C  # noqa: E402
from napkin.cost.profiles import get_profile  # noqa: E402
from napkin.documents import ShardPairs  # noqa: E402

MASKS = ("full", "causal", "document", "sliding_window", "prefix_lm", "shared_question")
MASK_DOCS = (0.30, 0.05, 0.15, 0.02, 0.22, 0.08, 0.18)     # document lengths, fractions of N
ANSWERS = 4


# --------------------------------------------------------------------------
# The masks: as diagram text, and as kept key intervals per query row.
# --------------------------------------------------------------------------

def doc_ids(mask: str, n: int) -> np.ndarray:
    """The document id of every token (document and shared-question masks)."""
    if mask == "document":
        cuts = np.round(np.cumsum(MASK_DOCS) * n).astype(np.int64)
    else:                               # question (id 0), then ANSWERS answers
        q = n // 8
        cuts = np.array([q] + [q + (n - q) * (k + 1) // ANSWERS for k in range(ANSWERS)], dtype=np.int64)
    cuts[-1] = n
    return np.searchsorted(cuts, np.arange(n), side="right")


def side_inputs(mask: str, n: int) -> dict:
    """The wrappers' side inputs: doc[b, x] for the masks on document ids."""
    import torch
    return {"doc": torch.from_numpy(doc_ids(mask, n)).to(torch.int32)[None]} \
        if mask in ("document", "shared_question") else {}


def score(mask: str, n: int) -> str:
    base = "sum[d](Q * K) * |d|^-0.5"
    cond = {"full": None, "causal": "x <= q", "document": "x <= q and doc[b, q] == doc",
            "sliding_window": f"x <= q and q - x < {n // 8}", "prefix_lm": f"x <= q or x < {n // 4}",
            "shared_question": "x <= q and (doc[b, q] == doc or doc == 0)"}[mask]
    return base if cond is None else f"where({cond}, {base}, -inf)"


def diagram_text(mask: str, n: int, dtype: str = "fp32", d: int = 32) -> str:
    doc = "in doc[b, x] : int32\n" if mask in ("document", "shared_question") else ""
    return f"""diagram cp_{mask}
wire b, hk, g, q, x
wire d = {d}
in Q[b, (hk g), q, d] : {dtype}
in K[b, hk, x, d] : {dtype}
in V[b, hk, x, d] : {dtype}
{doc}S[b, hk, g, q, x] = {score(mask, n)}
O[b, (hk g), q, d] : {dtype} = sum[x](softmax[x](S) * V)
lse[b, (hk g), q] = logsumexp[x](S)
out O, lse
"""


def intervals(mask: str, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Kept keys of query row q: a union of disjoint [lo, hi) intervals."""
    q = np.arange(n, dtype=np.int64)
    zero = np.zeros(n, dtype=np.int64)
    if mask == "full":
        return [(zero, np.full(n, n, dtype=np.int64))]
    if mask == "causal":
        return [(zero, q + 1)]
    if mask == "sliding_window":
        return [(np.maximum(q - n // 8 + 1, 0), q + 1)]
    if mask == "prefix_lm":
        return [(zero, np.maximum(q + 1, n // 4))]
    ids = doc_ids(mask, n)
    start = np.searchsorted(ids, ids, side="left").astype(np.int64)    # first token of q's document
    if mask == "document":
        return [(start, q + 1)]
    question = int(np.sum(ids == 0))
    in_answer = ids > 0
    return [(zero, np.where(in_answer, question, q + 1)), (np.where(in_answer, start, q + 1), q + 1)]


# --------------------------------------------------------------------------
# Predicted times at the benchmark's settings.
# --------------------------------------------------------------------------

HQ, HKV, D = 64, 8, 128
TOKENS_PER_GPU = 8192


def predict(gpus: int, per_node: int, masks=MASKS, profile: str = "h100") -> list[dict]:
    n = TOKENS_PER_GPU * gpus
    m = C.Moved.attention(dict(b=1, hq=HQ, hkv=HKV, d=D, q=n), "bf16")
    prof = get_profile(profile)
    rate = prof["peak_flops_bf16"]
    links = C.Links.of(prof)
    flop = 4 * HQ * D

    def secs(pairs, backward=False):
        if backward:
            return PLAN.BWD_FLOP_FACTOR * pairs * flop / (rate * PLAN.BWD_EFFICIENCY)
        return pairs * flop / (rate * PLAN.FWD_EFFICIENCY)

    g = min(per_node, gpus)
    out = []
    for mask in masks:
        pairs = ShardPairs(n, n, intervals(mask, n))   # each device's work, any layout and step
        w = pairs.part_pairs("zigzag", gpus)
        total = int(w.sum())
        rec = {"gpus": gpus, "mask": mask, "density": total / n / n, "ring_imbalance": w.sum(1).max() / (total / gpus)}
        zigzag = ring_arms(mask, n, gpus, "zigzag")
        for scheme in ("ring", "burst", "ring2", "burst2"):
            if scheme.endswith("2"):
                if g >= gpus:                    # one node: the double ring is the ring
                    continue
                pl = C.Placement(scheme, (gpus // g, g))
            else:
                pl = C.Placement(scheme, (gpus,), g)
            if not scheme.endswith("2") and sum(zigzag) < gpus:     # the wrapper cuts its flat ring
                rec[scheme] = cut_ring(pairs, zigzag, "zigzag", scheme, gpus, g, m, links, secs)
                continue
            # each step at its busiest rank, in groups.ring_origin's order: Ring's backward sends the
            # key blocks round again, Burst's the query blocks
            nodes = pl.grid[0] if scheme.endswith("2") else 1
            fwd = [secs(x) for x in pairs.ring_steps("zigzag", gpus, nodes)]
            bwd = [secs(x, True) for x in pairs.ring_steps("zigzag", gpus, nodes, queries=scheme.startswith("burst"))]
            t = C.scheme_seconds(pl, m, links, fwd, bwd)
            rec[scheme] = {"ms": t.total_s * 1e3, "fwd_ms": t.forward_s * 1e3, "steps": gpus,
                           "MB": (C.traffic(pl, m, "forward")[0].sent + C.traffic(pl, m, "backward")[0].sent) / 1e6}
        # Ring over cyclic shards: each long document dealt out evenly (a document of P tokens or
        # more meets every rank: every step, as the wrapper says)
        rec["cyclic"] = cut_ring(pairs, ring_arms(mask, n, gpus, "cyclic"), "cyclic", "ring", gpus, g, m, links, secs)
        # the short ring: over contiguous shards, cut to the steps the mask reaches
        rec["short"] = cut_ring(pairs, ring_arms(mask, n, gpus, "contiguous"), "contiguous", "ring", gpus, g, m,
                                links, secs)
        best = None
        for pl in PLAN.placements(gpus, g):
            if pl.scheme != "attention2d":
                continue
            r, c = pl.grid
            w2 = pairs.grid_pairs(r, c)
            t = C.scheme_seconds(pl, m, links, [secs(w2.max())], [secs(w2.max(), True)])
            traffic = max(a.sent + b.sent for a, b in zip(C.traffic(pl, m, "forward"), C.traffic(pl, m, "backward")))
            cand = {"ms": t.total_s * 1e3, "fwd_ms": t.forward_s * 1e3, "MB": traffic / 1e6,
                    "grid": f"{r}x{c}" + (f" ({pl.block[0]}x{pl.block[1]}/node)" if pl.block else ""),
                    "imbalance": w2.max() / (total / gpus)}
            if best is None or cand["ms"] < best["ms"]:
                best = cand
        rec["a2d"] = best
        out.append(rec)
    return out


def ring_arms(mask: str, n: int, gpus: int, layout: str) -> tuple[int, int]:
    """The steps RingAttention runs each way over ``layout`` shards
    (napkin/distributed/reach.py, asked of the wrapper itself, given the
    document ids: a document mask reaches as far as a document straddles
    shards; the shared question's, read by every answer, every step)."""
    import napkin
    from napkin.distributed import RingAttention
    fn = RingAttention(napkin.load_text(diagram_text(mask, n), f"cp_{mask}.ncd"), layout=layout)
    return fn.arms(gpus, n, side=side_inputs(mask, n))


def cut_ring(pairs: ShardPairs, arms: tuple[int, int], layout: str, scheme: str, gpus: int, per_node: int,
             m: C.Moved, links: C.Links, secs) -> dict:
    """Ring Attention (``scheme``: Ring's or Burst's backward) over ``layout``
    shards run for ``arms`` steps (back, ahead), each step at its busiest
    rank; cut short, Burst's query blocks go the keys' steps the other way
    round, meeting the same pairs."""
    back, ahead = arms
    cut = dataclasses.replace(m, layout=layout, reach=back, ahead=ahead)
    pl = C.Placement(scheme, (gpus,), per_node)
    # step s of the usual way holds rank r - s's keys; step t of the other way rank r + t's
    most = pairs.ring_steps(layout, gpus)
    work = list(most[:back]) + [most[gpus - t] for t in range(1, ahead + 1)]
    t = C.scheme_seconds(pl, cut, links, [secs(x) for x in work], [secs(x, True) for x in work])
    w = pairs.part_pairs(layout, gpus)
    return {"ms": t.total_s * 1e3, "fwd_ms": t.forward_s * 1e3, "steps": back + ahead,
            "MB": (C.traffic(pl, cut, "forward")[0].sent + C.traffic(pl, cut, "backward")[0].sent) / 1e6,
            "imbalance": w.sum(1).max() / (w.sum() / gpus)}


def predict_markdown(records: list[dict]) -> str:
    lines = ["| GPUs | mask | kept | Ring steps | Ring ms | Ring MB | Burst ms | Burst MB | Double ring ms "
             "| Double burst ms | Cyclic ring ms | best ATTENTION2D | A2D ms | A2D MB | Short ring steps | Short ring ms "
             "| Short ring MB | zigzag max/mean work | cyclic max/mean work | contiguous max/mean work | best |",
             "|" + "---|" * 21]

    def ms(r, key):
        return f"{r[key]['ms']:.1f}" if key in r else "-"

    for r in records:
        a, sh = r["a2d"], r["short"]
        # the two-level rings first: on a tie (the same terms summed in another
        # order) the one sending less across nodes wins, as in napkin plan
        cands = [(name, r[key]["ms"]) for name, key in (("Double ring", "ring2"), ("Double burst", "burst2"))
                 if key in r]
        cands += [("Ring", r["ring"]["ms"]), ("Burst", r["burst"]["ms"]), ("Cyclic ring", r["cyclic"]["ms"]),
                  ("A2D " + a["grid"], a["ms"]), ("Short ring", r["short"]["ms"])]
        best = min(cands, key=lambda kv: PLAN.rank_time(kv[1]))[0]
        lines.append(f"| {r['gpus']} | {r['mask']} | {r['density']:.3f} | {r['ring']['steps']} | {r['ring']['ms']:.1f} | "
                     f"{r['ring']['MB']:.0f} | {r['burst']['ms']:.1f} | {r['burst']['MB']:.0f} | {ms(r, 'ring2')} | "
                     f"{ms(r, 'burst2')} | {ms(r, 'cyclic')} | {a['grid']} | "
                     f"{a['ms']:.1f} | {a['MB']:.0f} | {sh['steps']} | {sh['ms']:.1f} | {sh['MB']:.0f} | "
                     f"{r['ring_imbalance']:.2f} | {a['imbalance']:.3f} | {sh['imbalance']:.2f} | {best} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------
# Measured on gloo.
# --------------------------------------------------------------------------

def schemes_for(p: int) -> list[tuple[str, tuple[int, ...]]]:
    """Ring, Burst, the short ring (Ring over contiguous shards, cut to the
    steps the mask reaches: "short") and ATTENTION2D on every grid."""
    out = [("ring", (p,)), ("burst", (p,)), ("short", (p,))]
    out += [("attention2d", (r, p // r)) for r in range(1, p + 1) if p % r == 0]
    return out


def _measure_worker(rank: int, world: int, init: str, out_dir: str, n: int, repeats: int,
                    masks: tuple[str, ...] = MASKS) -> None:
    import torch
    import torch.distributed as dist

    import napkin
    from napkin.distributed import Attention2D, CommCounter, RingAttention, new_grid
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    grids = {shape: new_grid(*shape) for s, shape in schemes_for(world) if s == "attention2d"}
    gen = torch.Generator().manual_seed(0)
    hq, hkv, d = 8, 1, 32
    q, k, v = (torch.randn(1, h, n, d, generator=gen) for h in (hq, hkv, hkv))
    g_out = torch.randn(1, hq, n, d, generator=gen)
    results = []
    for mask in masks:
        diagram = napkin.load_text(diagram_text(mask, n), f"cp_{mask}.ncd")
        side = side_inputs(mask, n)
        for scheme, shape in schemes_for(world):
            if scheme == "attention2d":
                fn, where, place = Attention2D(diagram), {"grid": grids[shape]}, grids[shape]
            else:
                fn = RingAttention(diagram, backward="burst" if scheme == "burst" else "kv",
                                   layout="contiguous" if scheme == "short" else "zigzag")
                where, place = {}, None
            mine = [fn.shard(t, place, n, 2) for t in (q, k, v)]
            dO = fn.shard(g_out, place, n, 2)
            times = []
            for it in range(repeats + 1):                # the first run warms up
                leaves = [t.clone().requires_grad_(True) for t in mine]
                dist.barrier()
                with CommCounter() as cc:
                    t0 = time.perf_counter()
                    o, _ = fn(*leaves, q_len=n, timeout=120.0, **where, **side)
                    o.backward(dO)
                    elapsed = time.perf_counter() - t0
                if it:
                    times.append(elapsed)
            sizes = dict(b=1, hq=hq, hkv=hkv, d=d, q=n)
            m = C.Moved.attention(sizes, "fp32")
            part = place.part if scheme == "attention2d" else rank
            # the flat rings run the steps the wrapper reads from the mask and the ids
            arms = fn.arms(world, n, side=side) if scheme in ("ring", "burst", "short") else None
            steps = sum(arms) if arms is not None else None
            if arms is not None:
                m = dataclasses.replace(m, layout=fn.layout, reach=arms[0], ahead=arms[1])
            model = "ring" if scheme == "short" else scheme
            predicted = [C.rank_bytes(model, shape, m, ph)[part][0] for ph in ("forward", "backward")]
            results.append({"mask": mask, "scheme": scheme, "grid": list(shape), "rank": rank, "steps": steps,
                            "sent": [cc.total("forward")[0], cc.total("backward")[0]], "predicted": predicted,
                            "seconds": statistics.median(times)})
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    os._exit(0)


def measure(p: int, n: int, repeats: int, deadline_s: float = 1800, masks: tuple[str, ...] = MASKS) -> list[dict]:
    import torch.multiprocessing as mp
    out = tempfile.mkdtemp(prefix="cp_bench_")
    ctx = mp.start_processes(_measure_worker, args=(p, f"{out}/init", out, n, repeats, tuple(masks)), nprocs=p,
                             join=False, start_method="spawn")
    end = time.monotonic() + deadline_s
    try:
        while not ctx.join(timeout=2):
            if time.monotonic() > end:
                raise SystemExit(f"the {p} ranks did not finish within {deadline_s:g} s")
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
    per_rank = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(p)]
    rows = []
    for k, first in enumerate(per_rank[0]):
        runs = [pr[k] for pr in per_rank]
        rows.append({"mask": first["mask"], "scheme": first["scheme"], "grid": first["grid"], "P": p,
                     "steps": first["steps"],
                     "sent_max": [max(r["sent"][i] for r in runs) for i in (0, 1)],
                     "all_equal_prediction": all(r["sent"] == r["predicted"] for r in runs),
                     "seconds_max": max(r["seconds"] for r in runs),
                     "seconds_min": min(r["seconds"] for r in runs)})
    return rows


def measure_markdown(rows: list[dict]) -> str:
    lines = ["| P | mask | scheme | fwd KB/rank | bwd KB/rank | counted = predicted | fwd+bwd ms (slowest rank) "
             "| fastest rank ms |", "|" + "---|" * 8]
    for r in rows:
        cut = f" ({r['steps']} of {r['P']} steps)" if r["scheme"] == "short" or (r["steps"] or r["P"]) < r["P"] else ""
        name = {"ring": "Ring", "burst": "Burst", "short": "Short ring"}.get(
            r["scheme"], "A2D " + "x".join(map(str, r["grid"]))) + cut
        lines.append(f"| {r['P']} | {r['mask']} | {name} | {r['sent_max'][0] / 1e3:.1f} | "
                     f"{r['sent_max'][1] / 1e3:.1f} | {'yes' if r['all_equal_prediction'] else 'NO'} | "
                     f"{r['seconds_max'] * 1e3:.1f} | {r['seconds_min'] * 1e3:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    p = sub.add_parser("predict")
    p.add_argument("--gpus", default="8,16,32,64,96")
    p.add_argument("--per-node", type=int, default=8)
    p.add_argument("--json", action="store_true")
    m = sub.add_parser("measure")
    m.add_argument("--devices", type=int, default=4)
    m.add_argument("--tokens", type=int, default=1024)
    m.add_argument("--repeats", type=int, default=3)
    m.add_argument("--masks", default=",".join(MASKS), help="comma-separated, of: " + ", ".join(MASKS))
    m.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.what == "predict":
        records = [r for g in (int(x) for x in args.gpus.split(",")) for r in predict(g, args.per_node)]
        print(json.dumps(records, indent=1) if args.json else predict_markdown(records))
    else:
        masks = tuple(args.masks.split(","))
        unknown = sorted(set(masks) - set(MASKS))
        if unknown:
            ap.error(f"unknown mask(s) {', '.join(unknown)}; expected some of {', '.join(MASKS)}")
        rows = measure(args.devices, args.tokens, args.repeats, masks=masks)
        print(json.dumps(rows, indent=1) if args.json else measure_markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
