"""The runnable examples' body: run a distributed diagram under torchrun and
report its error against a single-process float64 reference and the bytes
each rank sent.

    torchrun --nproc-per-node 4 examples/run_attention_2d.py
    torchrun --nproc-per-node 4 examples/run_ring_attention.py

On a machine without GPUs it runs on gloo with the CPU (Triton, when a
kernel is plugged in, runs under its interpreter); with one GPU per rank it
uses NCCL.  The reference is the same diagram evaluated eagerly in float64 on
the whole sequence in one process (no layout, no merge).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import os

import torch

from napkin.cost import collectives as C


def _args(default_diagram: str, argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--diagram", default=default_diagram, help="an .ncd file with a devices level")
    ap.add_argument("--tokens", type=int, default=1001, help="sequence length (need not divide the devices)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds any wait may take")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backward", default="kv", choices=["kv", "burst"],
                    help="Ring Attention only: Ring's backward (K, V circulate) or BurstAttention's (Q, dO, ...)")
    ap.add_argument("--layout", default=None, choices=["zigzag", "contiguous", "cyclic"],
                    help="Ring Attention only: the token layout (default: the diagram's, else zigzag; "
                         "contiguous lets a mask of nearby keys, a window or chunks, cut the ring short)")
    return ap.parse_args(argv)


def main(scheme: str, default_diagram: str, argv=None) -> None:
    import torch.distributed as dist

    import napkin
    from napkin.distributed import Attention2D, CommCounter, EagerLocal, RingAttention
    from napkin.distributed.common import results

    a = _args(default_diagram, argv)
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=a.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    diagram = napkin.load(a.diagram)
    if scheme == "attention2d":
        fn = Attention2D(diagram)
    else:
        fn = RingAttention(diagram, backward=a.backward, layout=a.layout)
        scheme = fn.scheme              # "ring", "burst", "ring2" or "burst2", as the byte model names them
    r = fn.roles
    per_node = fn.roles.per_node
    if scheme == "attention2d":
        from torch.distributed.device_mesh import init_device_mesh

        from napkin.distributed import grid_ranks, new_grid
        shape = fn.grid_shape or (1, world)
        if shape[0] * shape[1] != world:
            raise SystemExit(f"{a.diagram} asks for a {shape[0]} x {shape[1]} grid: run with "
                             f"--nproc-per-node {shape[0] * shape[1]}, not {world}")
        # a nodes level places a block of the grid on each node
        place = new_grid(*shape, grid_ranks(*shape, per_node)) if per_node else init_device_mesh(device.type, shape)
        where, grid = dict(grid=place), shape
    else:
        if fn.ring_size not in (None, world):
            raise SystemExit(f"{a.diagram} asks for a ring of {fn.ring_size}: run with "
                             f"--nproc-per-node {fn.ring_size}, not {world}")
        place, where, grid = None, {}, (world,)
        if fn.per_node:                 # a double ring: the byte model's grid is (nodes, GPUs per node)
            grid = (world // fn.per_node, fn.per_node)

    # the same full inputs on every rank, from the seed
    gen = torch.Generator().manual_seed(a.seed)
    fixed = {w.name: w.size for w in diagram.wires if w.size is not None}
    sizes = {w.name: (a.tokens if w.name in (r.query, r.key) else a.batch if w.name == "b" else 2 if w.name == "g"
                      else a.heads // 2 if w.name == "hk" else fixed.get(w.name, a.heads)) for w in diagram.wires}
    full = {}
    for t in diagram.inputs:
        shape = []
        for axis in t.axes:
            n = 1
            for w in axis:
                n *= sizes[w]
            shape.append(n)
        full[t.name] = _input(t, shape, (r.query, r.key), a.tokens, gen)
    dtype = getattr(torch, a.dtype)

    def cast(t):    # floats to the run's dtype; ids and flags keep theirs
        return t.to(device, dtype) if t.is_floating_point() else t.to(device)

    mine = [fn.shard(full[n], place, a.tokens, r.token_axis[k]).to(device, dtype).requires_grad_(True)
            for k, n in enumerate(r.tokens)]
    side = {n: cast(full[n]) for n in r.side}
    side.update((n, cast(fn.shard(full[n], place, a.tokens, axis)))   # a gate: its rows, as Q's
                for n, axis in zip(r.rows, r.row_axis))

    gpus_per_node = (per_node[0] * per_node[1] if scheme == "attention2d" else per_node[0]) if per_node else None
    with CommCounter(gpus_per_node=gpus_per_node) as cc:
        out = fn(*mine, q_len=a.tokens, timeout=a.timeout, **where, **side)
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward([o for o in outs], [torch.ones_like(o).nan_to_num(0.0) for o in outs])
    # the diagram's first output along the query wire (a sink's O, not the merged A, where r.epilogue)
    o_full = fn.gather(outs[0].detach(), place, a.tokens, r.query_axis(r.written.outputs[0].name),
                       timeout=a.timeout)
    # every token input's gradient, gathered whole (the first is Q's, the rest K's and V's parts)
    grads_full = [fn.gather(t.grad, place, a.tokens, r.token_axis[k], timeout=a.timeout) for k, t in enumerate(mine)]

    # single-process float64 reference on the whole sequence
    leaves = [full[n].clone().requires_grad_(True) for n in r.tokens]
    pos = torch.arange(a.tokens)
    ref_o, ref_lse = EagerLocal(r)(*leaves, q_pos=pos, x_pos=pos, q_len=a.tokens, x_len=a.tokens,
                                   **{n: full[n] for n in r.side})
    ref = results(r, ref_o, ref_lse, {n: full[n] for n in r.side + r.rows})   # the diagram's outputs, in order
    ref_outs = list(ref) if isinstance(ref, tuple) else [ref]
    torch.autograd.backward(ref_outs, [torch.ones_like(t) for t in ref_outs])
    ref_o = ref_outs[0]

    sent = [cc.total("forward")[0], cc.total("backward")[0]]
    moved = _moved(r, sizes, a.dtype)
    steps = None
    if scheme != "attention2d":
        back, ahead = fn.arms(world, a.tokens, side={n: side[n] for n in r.side})
        moved = dataclasses.replace(moved, layout=fn.layout, reach=back, ahead=ahead)
        steps = back + ahead
    predicted = [C.rank_bytes(scheme, grid, moved, ph)[rank][0] for ph in ("forward", "backward")]
    report = [None] * world
    dist.all_gather_object(report, (rank, sent, predicted, cc.links()))
    if rank == 0:
        err_o = (o_full.cpu().double() - ref_o.detach()).abs().max().item()
        errs = [(g.cpu().double() - leaf.grad).abs().max().item() for g, leaf in zip(grads_full, leaves)]
        title = {"attention2d": "ATTENTION2D", "ring": "Ring Attention",
                 "burst": "Ring Attention with BurstAttention's backward",
                 "ring2": "Ring Attention, double ring", "burst2": "Ring Attention, double ring, "
                 "BurstAttention's backward"}[scheme]
        print(f"{title}: {a.diagram}, {world} ranks, grid {'x'.join(map(str, grid))}, "
              f"{a.tokens} tokens, {a.dtype}, backend {dist.get_backend()}")
        if steps is not None:
            both = f" ({back} the usual way round, {ahead} the other)" if ahead else ""
            print(f"{fn.layout} layout: the ring runs {steps} of {world} steps{both}")
        print(f"max |O - reference|   = {err_o:.3e}")
        print(f"max |dQ - reference|  = {errs[0]:.3e}")
        for name, err in zip(r.tokens[1:], errs[1:]):    # the key side's, each named as the diagram names it
            print(f"max |d{name} - reference| = {err:.3e}")
        print("rank  forward bytes sent (predicted)   backward bytes sent (predicted)"
              + ("   sent within / across nodes (all phases)" if gpus_per_node else ""))
        for rk, (s, p, links) in enumerate((x[1], x[2], x[3]) for x in report):
            print(f"{rk:4d}  {s[0]:14d} ({p[0]:14d})   {s[1]:14d} ({p[1]:14d})"
                  + (f"   {links[0]} / {links[1]}" if gpus_per_node else ""))
    dist.destroy_process_group()


def _input(t, shape: list, token_wires: tuple, tokens: int, gen) -> torch.Tensor:
    """A full input from the seed: floats from a normal distribution; integers as ids of packed
    documents (sorted along a token wire, about 64 tokens each, so a document mask keeps
    something and a ring over contiguous shards reads how far they reach); bools at random."""
    if t.dtype == "bool":
        return torch.rand(shape, generator=gen) < 0.5
    if t.dtype.startswith("int"):
        ids = torch.randint(0, max(2, tokens // 64), shape, generator=gen)
        wires = [axis[0] if len(axis) == 1 else None for axis in t.axes]
        along = next((k for k, w in enumerate(wires) if w in token_wires), None)
        return (ids.sort(dim=along).values if along is not None else ids).to(getattr(torch, t.dtype))
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def _moved(r, sizes: dict, dtype: str):
    """What the wrappers move per row (the cost pass's reading of the diagram: each token input's
    own width, so MLA's two query parts or a value wider than the keys count right), every
    tensor in the run's ``dtype``, to which the demo casts them all."""
    from napkin.cost.devices import moved

    e = C.ELEMENT_BYTES[dtype.replace("float", "fp")]
    m = moved(r.diagram, r, sizes)
    return dataclasses.replace(m, query=tuple((w, e) for w, _ in m.query), keys=tuple((w, e) for w, _ in m.keys),
                               out_bytes=e, state=C.state_bytes(dtype.replace("float", "fp")))


def decode_main(default_diagram: str, argv=None) -> None:
    """Decoding: a few queries against a key/value cache split over the
    ranks (TreeAttention), forward only."""
    import torch.distributed as dist

    import napkin
    from napkin.distributed import CommCounter, EagerLocal, TreeAttention

    ap = argparse.ArgumentParser(description="decoding across devices, against a float64 reference")
    ap.add_argument("--diagram", default=default_diagram)
    ap.add_argument("--queries", type=int, default=4, help="new query tokens")
    ap.add_argument("--cache", type=int, default=4001, help="key/value cache length (need not divide)")
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--group", type=int, default=4, help="query heads per key/value head")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--timeout", type=float, default=120.0)
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=a.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    fn = TreeAttention(napkin.load(a.diagram))
    if fn.tree_size not in (None, world):
        raise SystemExit(f"{a.diagram} asks for {fn.tree_size} devices: run with --nproc-per-node {fn.tree_size}")
    d = next(w.size for w in fn.roles.diagram.wires if w.name == "d")
    gen = torch.Generator().manual_seed(0)
    hq = a.kv_heads * a.group
    q = torch.randn(1, hq, a.queries, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, a.kv_heads, a.cache, d, generator=gen, dtype=torch.float64) for _ in range(2))
    dtype = getattr(torch, a.dtype)
    mine = [q.to(device, dtype)] + [fn.shard(t, None, a.cache, 2).to(device, dtype) for t in (k, v)]
    with CommCounter() as cc:
        out, lse = fn(*mine, q_len=a.queries, x_len=a.cache, timeout=a.timeout)
    pos_q, pos_x = torch.arange(a.queries), torch.arange(a.cache)
    ref, ref_lse = EagerLocal(fn.roles)(q, k, v, q_pos=pos_q, x_pos=pos_x, q_len=a.queries, x_len=a.cache)
    m = C.Moved.attention(dict(b=1, hq=hq, hkv=a.kv_heads, d=d, q=a.queries, x=a.cache), a.dtype.replace("float", "fp"))
    predicted = C.rank_bytes("tree", (world,), m, "forward")[rank][0]
    report = [None] * world
    dist.all_gather_object(report, (cc.total("forward")[0], predicted,
                                    (out.cpu().double() - ref).abs().max().item()))
    if rank == 0:
        print(f"decoding: {a.diagram}, {world} ranks, {a.queries} queries, cache {a.cache}, {a.dtype}, "
              f"backend {dist.get_backend()}")
        print(f"max |O - reference| over ranks = {max(r[2] for r in report):.3e}")
        print("rank  forward bytes sent (predicted)")
        for rk, (s, p, _) in enumerate(report):
            print(f"{rk:4d}  {s:10d} ({p:10d})")
    dist.destroy_process_group()
