"""Across devices, part two: BurstAttention's backward, decoding with a tree
merge, two-level meshes, and the cost pass against the byte counter.

As in test_distributed.py, a module fixture spawns 4 gloo ranks once; each
runs every case below and writes what it saw (errors against an explicit
float64 reference, bytes counted, bytes predicted by
napkin/cost/collectives.py and by the cost pass) to a JSON file, and the
tests assert on those.  Every wait has a timeout and the fixture kills the
ranks after a deadline, so nothing can hang.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest
import torch

import napkin
from ring_diagrams import D, DOC_LENGTHS, PER_NODE, diagram_text, doc_ids, fewest_arms, keeps
from spawn import max_error, run_ranks
from napkin.cost import analyse
from napkin.cost import collectives as C

WORLD = 4
DEADLINE_S = 240
TIMEOUT = 30.0

# --------------------------------------------------------------------------
# Cases.
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    scheme: str         # "burst", "ring", "ring2", "burst2", "attention2d", "tree"
    mesh: str           # a key of MESHES
    base: str           # examples/BASE.ncd
    mask: str           # a key of MASKS
    n_q: int
    n_x: int
    gqa: bool = False
    dtype: str = "float64"
    layout: str = "zigzag"   # the ring's token layout

    @property
    def name(self) -> str:
        heads = "gqa" if self.gqa else "mha"
        lay = "" if self.layout == "zigzag" else f"-{self.layout}"
        return f"{self.scheme}-{self.mesh}-{self.base}-{self.mask}-{heads}-q{self.n_q}-x{self.n_x}-{self.dtype}{lay}"

    def live_offsets(self) -> set[int]:
        """The s in 1 .. P-1 for which some rank's queries keep a key of rank
        r - s (mod P), by brute force over every pair of positions."""
        from napkin.distributed.layouts import TokenLayout
        ql, xl = TokenLayout(self.layout, self.parts, self.n_q), TokenLayout(self.layout, self.parts, self.n_x)
        live = set()
        for rank in range(self.parts):
            qi = ql.positions(rank)[ql.positions(rank) < self.n_q][:, None]
            for s in range(1, self.parts):
                xi = xl.positions((rank - s) % self.parts)
                xi = xi[xi < self.n_x][None, :]
                if qi.numel() and xi.numel() and bool(keeps(self.mask, qi, xi + 0 * qi).any()):
                    live.add(s)
        return live

    def reach(self) -> Optional[int]:
        """The steps a ring running one way needs: 1 + the farthest live
        offset (None: not a flat ring)."""
        if self.scheme not in ("ring", "burst"):
            return None
        return max(self.live_offsets(), default=0) + 1

    def arms(self) -> Optional[tuple[int, int]]:
        """(back, ahead) of a ring over contiguous or zigzag shards: of every
        split reaching each live offset s back (s < back) or the other way
        (P - s <= ahead), the fewest steps, the other way round only where
        that is fewer than one way; over cyclic shards one way (None: not a
        flat ring)."""
        if self.scheme not in ("ring", "burst"):
            return None
        if self.layout == "cyclic":
            return self.reach(), 0
        return fewest_arms(self.live_offsets(), self.parts, self.reach())

    @property
    def side(self) -> dict:
        """The side inputs the wrappers take whole: a document mask's ids."""
        doc = doc_ids(self.mask)
        return {} if doc is None else {"doc": doc}

    @property
    def heads(self) -> tuple[int, int]:
        return (4, 2) if self.gqa else (2, 2)

    @property
    def family(self) -> str:
        return "sum" if self.base == "sigmoid_attention" else "softmax"

    @property
    def parts(self) -> int:
        return 3 if self.mesh == "tree3" else WORLD

    @property
    def grid(self) -> tuple[int, ...]:
        if self.mesh == "ring-nodes-of-1":
            return (self.parts, 1)
        return (2, 2) if self.scheme in C.TWO_D else (self.parts,)

    @property
    def block(self):
        return {"rows-in-nodes": (1, 2), "cols-in-nodes": (2, 1), "2x2-nodes-of-1": (1, 1)}.get(self.mesh)

    @property
    def gpus_per_node(self):
        return PER_NODE.get(self.mesh, 2 if "nodes" in self.mesh else None)

    @property
    def nodes_level(self) -> bool:
        """Whether the diagram says where the nodes are (the cost pass knows)."""
        return self.mesh.endswith("in-nodes") or self.mesh in ("ring-nodes", *PER_NODE)

    def text(self) -> str:
        base = "gqa" if self.gqa and self.base == "attention" else self.base
        dt = {"float64": "fp64", "float32": "fp32"}[self.dtype]
        return diagram_text(base, self.mask, dt, self.mesh)


def cases() -> list[Case]:
    out = []
    for mask in ("full", "causal"):
        for gqa in (False, True):
            for n in (16, 13):
                out.append(Case("burst", "ring", "attention", mask, n, n, gqa))
    out += [Case("burst", "ring", "attention", "full", 13, 19), Case("burst", "ring", "attention", "strict", 13, 13),
            Case("burst", "ring", "sigmoid_attention", "full", 13, 13),
            Case("burst", "ring", "attention", "causal", 13, 13, True, "float32")]
    # the cost pass against the counter for the schemes of part one too
    out += [Case("ring", "ring", "attention", "causal", 13, 13, g) for g in (False, True)]
    out += [Case("attention2d", "2x2", "attention", "causal", 13, 19, g) for g in (False, True)]
    for mesh in ("tree4", "tree3"):
        for mask in ("full", "decode"):
            for gqa in (False, True):
                out.append(Case("tree", mesh, "decode", mask, 3, 13, gqa))
    out += [Case("tree", "tree4", "decode", "decode", 1, 2), Case("tree", "tree4", "decode", "full", 5, 16, True),
            Case("tree", "tree4", "sigmoid_attention", "full", 3, 13),
            # packed rows (flash_decoding's schedule) inside each device's call, on the generated kernel
            Case("tree", "tree4", "flash_decoding", "decode", 3, 13, True, "float32"),
            Case("tree", "tree4", "flash_decoding", "decode", 5, 150, True, "float32")]
    for mesh in ("rows-in-nodes", "cols-in-nodes"):
        out += [Case("attention2d", mesh, "attention", "causal", 13, 13, g) for g in (False, True)]
    # the double ring: both backwards, full and causal, MHA and GQA, ragged;
    # and the flat ring counted on the same two nodes, to compare
    out += [Case("ring2", "ring-nodes", "attention", "causal", 13, 13), Case("ring2", "ring-nodes", "attention", "full", 13, 19, True),
            Case("burst2", "ring-nodes", "attention", "full", 13, 13, True), Case("burst2", "ring-nodes", "attention", "causal", 16, 16),
            Case("ring2", "ring-nodes", "attention", "causal", 13, 13, True), Case("burst2", "ring-nodes", "attention", "causal", 13, 19, True),
            Case("ring2", "ring-nodes", "sigmoid_attention", "full", 13, 13),
            Case("ring", "flat-ring-2-nodes", "attention", "causal", 13, 13)]
    out += [Case("ring2", "ring-nodes-of-1", "attention", "causal", 13, 19, True),
            Case("burst2", "ring-nodes-of-1", "attention", "causal", 13, 13),
            Case("ring", "ring-one-node", "attention", "causal", 13, 13),
            Case("attention2d", "2x2-nodes-of-1", "attention", "causal", 13, 19, True)]
    # contiguous shards under masks of nearby keys: rings cut short (two steps, one, and all four
    # for a causal mask), both backwards, the sum family, GQA, fp32 on the generated kernel, and
    # a short ring counted on two nodes of two
    out += [Case("ring", "ring", "attention", "window", 13, 13, layout="contiguous"),
            Case("ring", "ring", "attention", "chunks", 16, 16, True, layout="contiguous"),
            Case("ring", "ring", "attention", "causal", 10, 10, layout="contiguous"),
            Case("burst", "ring", "attention", "window", 13, 13, True, layout="contiguous"),
            Case("burst", "ring", "attention", "chunks", 13, 13, layout="contiguous"),
            Case("burst", "ring", "sigmoid_attention", "causal_chunks", 16, 16, layout="contiguous"),
            Case("ring", "ring", "attention", "causal_chunks", 13, 13, True, "float32", layout="contiguous"),
            Case("ring", "flat-ring-2-nodes", "attention", "window", 16, 16, layout="contiguous"),
            Case("burst", "flat-ring-2-nodes", "attention", "causal_chunks", 13, 13, layout="contiguous")]
    # document masks over contiguous shards: the ring reads the ids (one step; two, causal, both
    # backwards, the generated fp32 kernel reading doc at its positions)
    out += [Case("ring", "ring", "document_mask", "document", 16, 16, layout="contiguous"),
            Case("burst", "ring", "document_mask", "causal_document", 13, 13, layout="contiguous"),
            Case("ring", "ring", "document_mask", "causal_document", 13, 13, False, "float32", layout="contiguous")]
    # document masks over cyclic shards (napkin plan's pick for long documents: each dealt out
    # evenly): every step, both backwards
    out += [Case("ring", "ring", "document_mask", "causal_document", 13, 13, layout="cyclic"),
            Case("burst", "ring", "document_mask", "causal_document", 13, 13, layout="cyclic")]
    # keys on both sides: the ring runs both ways (a window: 2 steps back and 1 ahead of 4, both
    # backwards, GQA; straddling documents without causality, on the generated fp32 kernel too)
    out += [Case("ring", "ring", "attention", "two_sided", 16, 16, True, layout="contiguous"),
            Case("burst", "ring", "attention", "two_sided", 13, 13, layout="contiguous"),
            Case("burst", "ring", "document_mask", "documents_across", 13, 13, layout="contiguous"),
            Case("ring", "ring", "document_mask", "documents_across", 13, 13, False, "float32", layout="contiguous")]
    # zigzag shards under masks of nearby keys and documents: a rank's late chunk needs the ranks
    # ahead, so the ring runs both ways (2 steps back, 1 ahead of 4): both backwards, GQA, the sum
    # family, the generated fp32 kernel, two nodes of two
    out += [Case("ring", "ring", "attention", "window", 13, 13),
            Case("burst", "ring", "attention", "window", 13, 13, True),
            Case("ring", "ring", "attention", "chunks", 16, 16, True, "float32"),
            Case("burst", "ring", "attention", "two_sided", 16, 16),
            Case("burst", "ring", "sigmoid_attention", "window", 13, 13),
            Case("ring", "flat-ring-2-nodes", "attention", "window", 16, 16),
            Case("ring", "ring", "document_mask", "zigzag_document", 13, 13),
            Case("burst", "ring", "document_mask", "zigzag_document", 13, 13),
            Case("ring", "ring", "document_mask", "zigzag_documents", 13, 13, False, "float32")]
    return out


CASES = cases()
IDS = [c.name for c in CASES]


def reference(case: Case, q, k, v):
    """Explicit float64 attention, independent of napkin."""
    hq, hkv = q.shape[1], k.shape[1]
    kk, vv = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    s = q @ kk.transpose(-1, -2) / math.sqrt(q.shape[-1])
    qi = torch.arange(q.shape[2])[:, None]
    xi = torch.arange(k.shape[2])[None, :]
    keep = keeps(case.mask, qi, xi) if case.mask != "decode" else xi <= qi + k.shape[2] - q.shape[2]
    if case.family == "sum":
        return (torch.sigmoid(s - math.log(k.shape[2])) * keep) @ vv, None
    s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.where(torch.isneginf(lse)[..., None], torch.zeros_like(s), torch.softmax(s, -1).nan_to_num(0.0))
    return p @ vv, lse


def _inputs(case: Case):
    gen = torch.Generator().manual_seed(4321)
    hq, hkv = case.heads
    q = torch.randn(1, hq, case.n_q, D, generator=gen, dtype=torch.float64)
    k = torch.randn(1, hkv, case.n_x, D, generator=gen, dtype=torch.float64)
    v = torch.randn(1, hkv, case.n_x, D, generator=gen, dtype=torch.float64)
    g_out = torch.randn(1, hq, case.n_q, D, generator=gen, dtype=torch.float64)
    g_lse = torch.randn(1, hq, case.n_q, generator=gen, dtype=torch.float64)
    return q, k, v, g_out, g_lse


def _cost(case: Case, docs=None) -> dict:
    """What the cost pass says one device sends (its busiest device).  With
    ``docs`` (napkin/documents.py), the ring laid out as the case runs it,
    priced on those documents."""
    text = case.text()
    if docs is not None:
        text = text.replace("stream x across 4\n", f"stream x across 4 {case.layout}\n")
    d = napkin.load_text(text, f"{case.name}.ncd")
    hq, hkv = case.heads
    sizes = {"b": 1, "q": case.n_q, "x": case.n_x}
    sizes.update({"hk": hkv, "g": hq // hkv} if d.wire("hk") else {"h": hq})
    c = analyse(d, sizes, docs=docs).devices
    back = c.burst_backward_bytes if case.scheme.startswith("burst") else c.backward_bytes
    return {"check": c.handshake_bytes, "forward": c.bytes_sent, "backward": back or 0,
            "within": c.sent_within, "across": c.sent_across}


def run_case(case: Case, places: dict, rank: int) -> dict:
    from napkin.distributed import Attention2D, CommCounter, KernelLocal, RingAttention, TreeAttention
    dtype = getattr(torch, case.dtype)
    q, k, v, g_out, g_lse = _inputs(case)
    diagram = napkin.load_text(case.text(), f"{case.name}.ncd")
    place = places[case.mesh]
    if place == "absent":                                # rank 3 sits out the tree of 3
        return {"skipped": True}
    if case.scheme == "attention2d":
        fn, where = Attention2D(diagram), dict(grid=place)
    elif case.scheme == "tree":
        fn, where = TreeAttention(diagram), dict(group=place)
        if case.base == "flash_decoding":   # its generated kernel (packed rows, chunks), not the eager local
            fn.local = KernelLocal(fn.roles)
    else:
        fn = RingAttention(diagram, backward="burst" if case.scheme.startswith("burst") else "kv",
                           layout=case.layout)
        assert fn.scheme == case.scheme, (fn.scheme, case.scheme)
        where = dict(group=place)
    train = case.scheme != "tree"
    leaves = [t.clone().requires_grad_(train) for t in (q, k, v)]
    ref_o, ref_lse = reference(case, *leaves)
    if "lse" not in {o.name for o in diagram.outputs}:     # document_mask.ncd's: out O
        ref_lse = None
    if train:
        torch.autograd.backward([ref_o] + ([ref_lse] if ref_lse is not None else []),
                                [g_out] + ([g_lse] if ref_lse is not None else []))

    def shard(t, n):
        return fn.shard(t.to(dtype), place, n, 2)

    if case.scheme == "tree":
        mine = [q.to(dtype), shard(k, case.n_x), shard(v, case.n_x)]
    else:
        mine = [shard(q, case.n_q).requires_grad_(True), shard(k, case.n_x).requires_grad_(True),
                shard(v, case.n_x).requires_grad_(True)]
    with CommCounter(gpus_per_node=case.gpus_per_node) as cc:
        out = fn(*mine, q_len=case.n_q, x_len=case.n_x, timeout=TIMEOUT, **where, **case.side)
        o, lse = out if isinstance(out, tuple) else (out, None)
        if train:
            outs, grads = [o], [shard(g_out, case.n_q)]
            if lse is not None:
                outs.append(lse)
                grads.append(shard(g_lse, case.n_q))
            torch.autograd.backward(outs, grads)
    res = {"counted": {ph: list(cc.total(ph)) for ph in C.PHASES},
           "links": {ph: list(cc.links(ph)) for ph in C.PHASES}}
    full_o = fn.gather(o.detach(), place, case.n_q, 2, timeout=TIMEOUT)
    res["o"] = max_error(full_o, ref_o)
    res["lse"] = max_error(fn.gather(lse.detach(), place, case.n_q, 2, timeout=TIMEOUT), ref_lse) \
        if lse is not None else 0.0
    if train:
        full = [fn.gather(t.grad, place, n, 2, timeout=TIMEOUT) for t, n in zip(mine, (case.n_q, case.n_x, case.n_x))]
        res["grads"] = [max_error(a, b.grad) for a, b in zip(full, leaves)]
    else:
        res["o_bits"] = o.detach().double().flatten().tolist()
    hq, hkv = case.heads
    sizes = dict(b=1, hq=hq, hkv=hkv, d=D, q=case.n_q, x=case.n_x)
    moved = C.Moved.attention(sizes, {"float64": "fp64", "float32": "fp32"}[case.dtype], case.family)
    if case.scheme in C.RINGS:
        back, ahead = case.arms() or (None, 0)
        moved = dataclasses.replace(moved, layout=case.layout, reach=back, ahead=ahead)
        res["reach"] = fn.reach(case.parts, case.n_q, case.n_x, side=case.side)
        res["arms"] = list(fn.arms(case.parts, case.n_q, case.n_x, side=case.side))
    part = place.part if case.scheme == "attention2d" else torch.distributed.get_rank(place)
    placement = C.Placement(case.scheme, case.grid, case.gpus_per_node, case.block)
    res["predicted"] = {ph: list(C.rank_bytes(case.scheme, case.grid, moved, ph)[part]) for ph in C.PHASES}
    res["predicted_links"] = {ph: [C.traffic(placement, moved, ph)[part].sent_within,
                                   C.traffic(placement, moved, ph)[part].sent_across] for ph in C.PHASES}
    res["part"] = part
    res["kernel_launches"] = getattr(fn.local, "launches", None) if case.scheme == "tree" else None
    return res


def error_cases(places: dict, rank: int) -> dict:
    from napkin.distributed import RingAttention, TreeAttention
    out = {}
    d = napkin.load_text(diagram_text("decode", "full", "fp64", "tree4"), "decode.ncd")
    tree = TreeAttention(d)
    q = torch.randn(1, 2, 2, D, dtype=torch.float64, requires_grad=True)
    k = torch.zeros(1, 2, 2, D, dtype=torch.float64)
    try:
        tree(q, k, k, group=places["tree4"], q_len=2, x_len=8, timeout=TIMEOUT)
        out["grad"] = "no error"
    except ValueError as err:
        out["grad"] = f"ValueError: {err}"
    try:
        RingAttention(d, backward="bursty")
        out["option"] = "no error"
    except ValueError as err:
        out["option"] = f"ValueError: {err}"
    # a side input wanting a gradient: the tree took it and rank 0 got a gradient, the others
    # zeros (the tree checked the tokens alone)
    plain = "S[b, hk, g, q, x] = sum[d](Q * K) * |d|^-0.5"
    text = diagram_text("decode", "full", "fp64", "tree4")
    assert plain in text
    text = text.replace(plain, "S[b, hk, g, q, x] = sum[d](Q * K) * |d|^-0.5 + slope[hk] * (x - q)").replace(
        "in V[b, hk, x, d] : fp64", "in V[b, hk, x, d] : fp64\nin slope[hk] : fp64")
    sloped = TreeAttention(napkin.load_text(text, "sloped.ncd"))
    slope = torch.tensor([0.5, 0.25], dtype=torch.float64, requires_grad=True)
    try:
        sloped(q.detach(), k, k, group=places["tree4"], q_len=2, x_len=8, timeout=TIMEOUT, slope=slope)
        out["side_grad"] = "no error"
    except ValueError as err:
        out["side_grad"] = f"ValueError: {err}"
    # one key over four ranks: each share is one row, as long as the whole; gather took rank 0's
    # own padded row for the whole cache on every rank
    row = torch.full((1, 2, 1, D), float(rank + 7), dtype=torch.float64)
    out["gather_one"] = tree.gather(row, places["tree4"], 1, 2, timeout=TIMEOUT)[0, 0, :, 0].tolist()
    return out


def emitted_double_ring() -> dict:
    """The function a generated module holds for a ring over nodes, run for
    real: it must run the double ring (scheme ring2) and match float64."""
    from napkin.distributed import CommCounter
    from napkin.distributed.emit import distributed_source
    text = diagram_text("attention", "causal", "fp64", "ring-nodes")
    ns: dict = {}
    exec(compile(distributed_source(napkin.load_text(text, "double.ncd")), "<emitted>", "exec"), ns)
    q, k, v, _, _ = _inputs(Case("ring2", "ring-nodes", "attention", "causal", 13, 13))
    name = "attention_distributed"
    with CommCounter(gpus_per_node=2) as cc:
        o, lse = ns[name](*(ns[name + "_shard"](t, None, 13, 2) for t in (q, k, v)), q_len=13, timeout=TIMEOUT)
    ref, _ = reference(Case("ring2", "ring-nodes", "attention", "causal", 13, 13), q, k, v)
    return {"o": max_error(ns[name + "_gather"](o, None, 13, 2, TIMEOUT), ref), "scheme": ns["_distributed"]().scheme,
            "across": cc.links("forward")[1]}


def emitted_short_ring() -> dict:
    """The generated module's ring launcher with layout="contiguous" (its
    shard and gather too) on a window of 3 over 13 tokens: the ring runs 2
    of 4 steps, so the forward makes one K, V pass; O matches float64."""
    from napkin.distributed import CommCounter
    from napkin.distributed.emit import distributed_source
    case = Case("ring", "ring", "attention", "window", 13, 13, layout="contiguous")
    ns: dict = {}
    exec(compile(distributed_source(napkin.load_text(case.text(), "short.ncd")), "<emitted>", "exec"), ns)
    q, k, v, _, _ = _inputs(case)
    name, lay = "attention_distributed", dict(layout="contiguous")
    with CommCounter() as cc:
        o, _ = ns[name](*(ns[name + "_shard"](t, None, 13, 2, **lay) for t in (q, k, v)), q_len=13,
                        timeout=TIMEOUT, **lay)
    ref, _ = reference(case, q, k, v)
    rows = -(-13 // WORLD)
    return {"o": max_error(ns[name + "_gather"](o, None, 13, 2, TIMEOUT, **lay), ref),
            "forward": cc.total("forward")[0], "one_pass": rows * 2 * case.heads[1] * D * 8}


def _worker(rank: int, world: int, init: str, out_dir: str) -> None:
    import torch.distributed as dist

    from napkin.distributed import Attention2D, grid_ranks, new_grid
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    three = dist.new_group([0, 1, 2])
    places = {"ring": None, "tree4": None, "ring-nodes": None, "flat-ring-2-nodes": None, "2x2": new_grid(2, 2),
              "ring-nodes-of-1": None, "ring-one-node": None,
              "2x2-nodes-of-1": Attention2D(napkin.load_text(
                  diagram_text("attention", "full", "fp64", "2x2-nodes-of-1"))).make_grid(),
              "tree3": three if rank < 3 else "absent",
              "rows-in-nodes": new_grid(2, 2, grid_ranks(2, 2, (1, 2))),
              # the same placement, read off the diagram's mesh levels
              "cols-in-nodes": Attention2D(napkin.load_text(
                  diagram_text("attention", "full", "fp64", "cols-in-nodes"))).make_grid()}
    assert grid_ranks(2, 2, (2, 1)) == [0, 2, 1, 3]
    results = {}
    for case in CASES:
        try:
            results[case.name] = run_case(case, places, rank)
        except Exception as err:  # recorded, so one broken case does not hide the others
            results[case.name] = {"error": f"{type(err).__name__}: {err}"}
    results["errors"] = error_cases(places, rank)
    for key, run in (("emitted", emitted_double_ring), ("emitted_short", emitted_short_ring)):
        try:
            results[key] = run()
        except Exception as err:
            results[key] = {"error": f"{type(err).__name__}: {err}"}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    try:    # leave together, so no rank is torn down while a peer still talks to it
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=TIMEOUT))
    finally:
        os._exit(0)


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    return run_ranks(_worker, WORLD, tmp_path_factory.mktemp("distributed2"), DEADLINE_S)


def _ran(suite, case: Case):
    for rank, res in enumerate(suite):
        got = res[case.name]
        assert "error" not in got, f"rank {rank}: {got.get('error')}"
        if not got.get("skipped"):
            yield rank, got


def _tol(case: Case) -> float:
    return 1e-10 if case.dtype == "float64" else 2e-5


# --------------------------------------------------------------------------
# Multi-process tests.
# --------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_outputs_match_reference(suite, case):
    for rank, got in _ran(suite, case):
        assert got["o"] <= _tol(case), f"rank {rank}: O error {got['o']}"
        assert got["lse"] <= _tol(case), f"rank {rank}: lse error {got['lse']}"


@pytest.mark.parametrize("case", [c for c in CASES if c.scheme != "tree"], ids=[c.name for c in CASES
                                                                                 if c.scheme != "tree"])
def test_gradients_match_reference(suite, case):
    for rank, got in _ran(suite, case):
        for name, e in zip("QKV", got["grads"]):
            assert e <= 10 * _tol(case), f"rank {rank}: d{name} error {e}"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_counted_bytes_equal_the_model_on_every_rank(suite, case):
    for rank, got in _ran(suite, case):
        assert got["counted"] == got["predicted"], f"rank {rank}"
        if case.gpus_per_node:
            assert got["links"] == got["predicted_links"], f"rank {rank}: within / across nodes"


# the cost pass prices a ring in its default (zigzag) layout: a diagram does not say how the
# caller shards its tokens, so the contiguous cases are priced by the model alone (above); a
# document mask's steps need the documents (DOCUMENT_RINGS, below)
ZIGZAG = [c for c in CASES if c.layout == "zigzag" and c.mask not in DOC_LENGTHS]


@pytest.mark.parametrize("case", ZIGZAG, ids=[c.name for c in ZIGZAG])
def test_cost_pass_equals_the_counter(suite, case):
    """The cost pass's per-device numbers (busiest device) are what the
    counter measures: handshake, forward, backward, and per link."""
    cost = _cost(case)
    ran = list(_ran(suite, case))
    for ph in C.PHASES:
        assert cost[ph] == max(got["counted"][ph][0] for _, got in ran), ph
    if case.nodes_level:
        busiest = max(ran, key=lambda rg: (rg[1]["counted"]["forward"][0], -rg[0]))[1]
        assert [cost["within"], cost["across"]] == busiest["links"]["forward"]


# rings a mask may cut: over contiguous shards, and over zigzag ones under masks that keep nearby
# keys or documents
SHORT = [c for c in CASES if c.layout == "contiguous" or
         (c.layout == "zigzag" and c.scheme in ("ring", "burst") and c.mask not in ("full", "causal", "strict"))]
DOCUMENT_RINGS = [c for c in CASES if c.mask in DOC_LENGTHS]


@pytest.mark.parametrize("case", DOCUMENT_RINGS, ids=[c.name for c in DOCUMENT_RINGS])
def test_cost_pass_on_the_documents_equals_the_counter(suite, case):
    """napkin cost --docs of the lengths the ranks' ids were made from prices
    the steps RingAttention read from those ids (both ways round without
    causality): handshake, forward and backward are the counter's, busiest
    device, where without the lengths it prices every step (over cyclic
    shards the documents meet every rank, and it runs every step anyway)."""
    from napkin.documents import Documents

    docs = Documents(lengths=DOC_LENGTHS[case.mask])
    cost, dense = _cost(case, docs), _cost(case)
    ran = list(_ran(suite, case))
    for ph in C.PHASES:
        assert cost[ph] == max(got["counted"][ph][0] for _, got in ran), ph
    if case.layout == "cyclic":     # a document of P tokens or more meets every cyclic part: every step
        assert cost == dense
    else:
        assert cost["forward"] < dense["forward"]


@pytest.mark.parametrize("case", SHORT, ids=[c.name for c in SHORT])
def test_rings_cut_short_run_the_steps_their_mask_reaches(suite, case):
    """RingAttention.reach is the brute-force count of steps holding a kept
    pair, on every rank; the blocks made reach - 1 passes (the counted
    bytes equal the model's, test_counted_bytes_equal_the_model_on_every_rank),
    and the outputs and gradients match float64 (the tests above)."""
    want, arms = case.reach(), list(case.arms())
    for rank, got in _ran(suite, case):
        assert got["reach"] == want, (rank, got["reach"], want)
        assert got["arms"] == arms, (rank, got["arms"], arms)
        if want == 1:       # chunks no wider than a shard: nothing moves after the handshake
            assert got["counted"]["forward"] == [0, 0] and got["counted"]["backward"] == [0, 0], rank


def test_short_rings_are_exercised():
    """The contiguous cases cover a ring of one step, of two, and a full one,
    and rings run both ways; every zigzag case runs both ways, 3 steps of 4,
    Ring's and Burst's backwards, windows and documents."""
    contiguous = [c for c in SHORT if c.layout == "contiguous"]
    assert {c.reach() for c in contiguous} == {1, 2, 4}
    assert {tuple(c.arms()) for c in contiguous if c.arms()[1]} == {(2, 1)}
    zigzag = [c for c in SHORT if c.layout == "zigzag"]
    assert {tuple(c.arms()) for c in zigzag} == {(2, 1)}
    assert {(c.scheme, c.mask in DOC_LENGTHS) for c in zigzag} == {(s, d) for s in ("ring", "burst")
                                                                   for d in (False, True)}


def _backward_sent(suite, case) -> int:
    return suite[0][case.name]["counted"]["backward"][0]


def test_double_ring_moves_the_flat_rings_bytes_with_fewer_across_nodes(suite):
    """Two nodes of two GPUs, causal MHA, 13 tokens: the double ring sends
    exactly the flat ring's bytes, but on every rank at most one block pass
    of the forward crosses nodes, where the flat ring's node-boundary ranks
    send all three across."""
    flat = Case("ring", "flat-ring-2-nodes", "attention", "causal", 13, 13)
    double = Case("ring2", "ring-nodes", "attention", "causal", 13, 13)
    for rank in range(WORLD):
        f, d = suite[rank][flat.name], suite[rank][double.name]
        for ph in ("forward", "backward"):
            assert f["counted"][ph] == d["counted"][ph], (rank, ph)
        block = f["counted"]["forward"][0] // 3            # P-1 = 3 passes of one K, V block
        assert d["links"]["forward"] == [2 * block, block], rank
        assert f["links"]["forward"] == ([3 * block, 0] if rank % 2 == 0 else [0, 3 * block]), rank


def test_emitted_function_runs_the_double_ring(suite):
    for rank, res in enumerate(suite):
        got = res["emitted"]
        assert "error" not in got, f"rank {rank}: {got.get('error')}"
        assert got["scheme"] == "ring2" and got["o"] <= 1e-10, (rank, got)
        assert got["across"] > 0, rank


def test_emitted_function_runs_a_short_ring_over_contiguous_shards(suite):
    for rank, res in enumerate(suite):
        got = res["emitted_short"]
        assert "error" not in got, f"rank {rank}: {got.get('error')}"
        assert got["o"] <= 1e-10 and got["forward"] == got["one_pass"], (rank, got)


def test_burst_backward_sends_less_for_multihead_and_more_for_grouped_query(suite):
    for gqa, burst_wins in ((False, True), (True, False)):
        ring = _backward_sent(suite, Case("ring", "ring", "attention", "causal", 13, 13, gqa))
        burst = _backward_sent(suite, Case("burst", "ring", "attention", "causal", 13, 13, gqa))
        assert (burst < ring) == burst_wins, (gqa, burst, ring)


def test_packed_decode_runs_the_generated_kernel_on_every_rank(suite):
    """flash_decoding's schedule (query heads packed into a block of rows)
    inside each device's call, its rows and keys at global positions: the
    kernel served it, and test_outputs_match_reference checked the merged
    outputs.  (Each device's share of the cache is one chunk here.)"""
    cases = [c for c in CASES if c.base == "flash_decoding"]
    assert cases
    for case in cases:
        for rank, got in _ran(suite, case):
            assert got["kernel_launches"] == 1, (case.name, rank, got["kernel_launches"])


def test_tree_outputs_are_bitwise_equal_on_every_rank(suite):
    for case in (c for c in CASES if c.scheme == "tree"):
        bits = [got["o_bits"] for _, got in _ran(suite, case)]
        assert all(b == bits[0] for b in bits[1:]), case.name


def test_rows_inside_nodes_keep_the_merge_on_nvlink(suite):
    """Rows in nodes: only K, V cross nodes; columns in nodes: Q and the
    partial states cross."""
    rows = suite[0][Case("attention2d", "rows-in-nodes", "attention", "causal", 13, 13).name]["links"]["forward"]
    cols = suite[0][Case("attention2d", "cols-in-nodes", "attention", "causal", 13, 13).name]["links"]["forward"]
    hq, n = 2, 4            # ceil(13 / 4) rows per device
    assert rows[1] == n * 2 * hq * D * 8                       # K and V, fp64
    assert cols[1] == n * (hq * D * 8 + (hq * D + hq) * 8)     # Q, then O and lse


def test_decoding_refuses_gradients_and_ring_refuses_unknown_backward(suite):
    for rank, res in enumerate(suite):
        assert res["errors"]["grad"].startswith("ValueError") and "forward only" in res["errors"]["grad"], rank
        assert "'kv'" in res["errors"]["option"], rank
        # a side input wanting a gradient is refused by the tree too (helper's hunt)
        assert res["errors"]["side_grad"].startswith("ValueError: side input(s) slope require gradients"), rank


def test_decoding_gathers_a_one_row_cache_from_rank_0(suite):
    """x_len = 1 over four ranks: every share is one row, as long as the whole
    cache, and gather returned each rank's own row (rank 1 its padding) as
    the whole (helper's hunt): the row is rank 0's on every rank."""
    for rank, res in enumerate(suite):
        assert res["errors"]["gather_one"] == [7.0], rank


# --------------------------------------------------------------------------
# Single-process: the model itself.
# --------------------------------------------------------------------------

def test_burst_traffic_formula():
    """Per rank, P = 4, n rows: Ring's backward (P-1) 2 n H_kv e + P 2 n H_kv a,
    BurstAttention's (P-1) n (2 H_q e + 2 h_q a) + P n H_q a."""
    sizes = dict(b=1, hq=32, hkv=8, d=128, q=8192)
    m = C.Moved.attention(sizes, "bf16")
    n, hq, hkv, d = 2 * math.ceil(8192 / 8), 32, 8, 128
    ring = C.rank_bytes("ring", (4,), m, "backward")[0][0]
    burst = C.rank_bytes("burst", (4,), m, "backward")[0][0]
    assert ring == 3 * 2 * n * hkv * d * 2 + 4 * 2 * n * hkv * d * 4
    assert burst == 3 * n * (2 * hq * d * 2 + 2 * hq * 4) + 4 * n * hq * d * 4
    mha = C.Moved.attention(dict(sizes, hkv=32), "bf16")
    assert C.rank_bytes("burst", (4,), mha, "backward")[0][0] < C.rank_bytes("ring", (4,), mha, "backward")[0][0]
    assert burst > ring


def test_tree_rounds_and_folds():
    m = C.Moved.attention(dict(b=1, hq=8, hkv=2, d=64, q=4, x=4096), "bf16")
    state = 4 * (8 * 64 + 8) * 4
    assert C.rank_bytes("tree", (8,), m) == [(3 * state, 3 * state)] * 8
    # 6 = 4 + 2: parts 4, 5 fold into 0, 1
    six = C.rank_bytes("tree", (6,), m)
    assert six[0] == six[1] == (3 * state, 3 * state)
    assert six[2] == six[3] == (2 * state, 2 * state)
    assert six[4] == six[5] == (state, state)


def test_placement_of_grid_blocks_on_nodes():
    p = C.Placement("attention2d", (4, 4), block=(2, 4))      # two whole rows per node of 8
    assert p.gpus_per_node == 8
    assert [p.node(part) for part in range(16)] == [0] * 8 + [1] * 8
    q = C.Placement("attention2d", (4, 4), block=(4, 2))      # two whole columns per node
    assert [q.node(i * 4 + j) for i in range(4) for j in range(4)] == [0, 0, 1, 1] * 4
    with pytest.raises(ValueError):
        C.Placement("attention2d", (4, 4), block=(3, 2))


def test_checker_accepts_a_nodes_level_and_refuses_mixed_kinds():
    text = diagram_text("attention", "full", "bf16", "rows-in-nodes")
    napkin.load_text(text)
    bad = text.replace("level devices { group x across 2 }", "level devices { stream q across 2 }")
    with pytest.raises(napkin.NapkinError, match="q is grouped across nodes but streamed across devices"):
        napkin.load_text(bad)
    late = text.replace("level nodes { group q across 2 }\n  level devices { group x across 2 }",
                        "level devices { group x across 2 }\n  level nodes { group q across 2 }")
    with pytest.raises(napkin.NapkinError, match="outermost first \\(nodes, devices, hbm"):
        napkin.load_text(late)


def test_cp_bench_masks_and_work_counts_are_exact():
    """bench/cp_bench.py: each mask's diagram keeps exactly the keys its
    intervals say (the eager local attention's lse over zero scores is
    log(kept keys)), and the per-device work counts it prices by
    (documents.ShardPairs over those intervals) equal a brute-force count
    over the zigzag, contiguous and cyclic layouts."""
    import numpy as np

    from bench import cp_bench as B
    from napkin.distributed import EagerLocal, TokenLayout, roles
    from napkin.documents import ShardPairs
    n, p = 48, 4
    pos = torch.arange(n)
    for mask in B.MASKS:
        keep = np.zeros((n, n), dtype=bool)
        for lo, hi in B.intervals(mask, n):
            for q in range(n):
                keep[q, lo[q]:hi[q]] = True
        d = napkin.load_text(B.diagram_text(mask, n), f"{mask}.ncd")
        side = B.side_inputs(mask, n)
        zeros = torch.zeros(1, 1, n, 32, dtype=torch.float64)
        _, lse = EagerLocal(roles(d))(zeros, zeros, zeros, q_pos=pos, x_pos=pos, q_len=n, x_len=n, **side)
        assert torch.equal(torch.exp(lse[0, 0]).round().long(), torch.from_numpy(keep.sum(1))), mask
        pairs = ShardPairs(n, n, B.intervals(mask, n))     # the counts cp_bench prices by
        for layout in ("zigzag", "contiguous"):
            lay = TokenLayout(layout, p, n)
            brute = [[keep[np.ix_(lay.positions(a).numpy(), lay.positions(b).numpy())].sum() for b in range(p)]
                     for a in range(p)]
            assert pairs.part_pairs(layout, p).tolist() == brute, (mask, layout)
        cyc = TokenLayout("cyclic", p, n)
        for rows, cols in ((2, 2), (1, 4), (4, 1)):
            qs = [np.concatenate([cyc.positions(i * cols + j).numpy() for j in range(cols)]) for i in range(rows)]
            xs = [np.concatenate([cyc.positions(i * cols + j).numpy() for i in range(rows)]) for j in range(cols)]
            brute = [[keep[np.ix_(qs[i], xs[j])].sum() for j in range(cols)] for i in range(rows)]
            assert pairs.grid_pairs(rows, cols).tolist() == brute, (mask, rows, cols)


def test_double_ring_schedule_visits_every_block_once():
    """groups.ring_origin (DoubleRing.origin, and bench/cp_bench.py's step
    order): every rank holds every rank's blocks exactly once, its own
    first; a flat ring (one node) holds rank r - s at step s; the passes
    follow the links (within a round the next step's block comes from the
    previous GPU of the node, a new round's from the previous node)."""
    from napkin.distributed.groups import DoubleRing, ring_origin
    for n, g in ((1, 4), (2, 2), (2, 4), (3, 2), (4, 1)):
        p = n * g
        for rank in range(p):
            seen = [ring_origin(rank, s, n, g) for s in range(p)]
            assert sorted(seen) == list(range(p)) and seen[0] == rank, (n, g, rank, seen)
            assert seen == [DoubleRing(n, g, rank, None, None, None, None).origin(s) for s in range(p)]
            if n == 1:
                assert seen == [(rank - s) % p for s in range(p)]
            node, local = divmod(rank, g)
            for s in range(1, p):
                prev = (node * g + (local - 1) % g) if s % g else ((node - 1) % n * g + local)
                # what I hold now, my sender held one step before (or, for a
                # new round, at the start of its previous round)
                want = ring_origin(prev, s - 1, n, g) if s % g else ring_origin(prev, s - g, n, g)
                assert seen[s] == want, (n, g, rank, s)

