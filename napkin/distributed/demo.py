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
import datetime
import os

import torch


def _args(default_diagram: str, argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--diagram", default=default_diagram, help="an .ncd file with a devices level")
    ap.add_argument("--tokens", type=int, default=1001, help="sequence length (need not divide the devices)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds any wait may take")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def main(scheme: str, default_diagram: str, argv=None) -> None:
    import torch.distributed as dist

    import napkin
    from napkin.distributed import Attention2D, CommCounter, EagerLocal, RingAttention, predicted_comm

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
    fn = (Attention2D if scheme == "attention2d" else RingAttention)(diagram)
    r = fn.roles
    if scheme == "attention2d":
        from torch.distributed.device_mesh import init_device_mesh
        shape = fn.grid_shape or (1, world)
        if shape[0] * shape[1] != world:
            raise SystemExit(f"{a.diagram} asks for a {shape[0]} x {shape[1]} grid: run with "
                             f"--nproc-per-node {shape[0] * shape[1]}, not {world}")
        place = init_device_mesh(device.type, shape)
        where, grid = dict(grid=place), shape
    else:
        if fn.ring_size not in (None, world):
            raise SystemExit(f"{a.diagram} asks for a ring of {fn.ring_size}: run with "
                             f"--nproc-per-node {fn.ring_size}, not {world}")
        place, where, grid = None, {}, (world,)

    # the same full inputs on every rank, from the seed
    gen = torch.Generator().manual_seed(a.seed)
    sizes = {w.name: w.size for w in diagram.wires if w.size is not None}
    full = {}
    for t in diagram.inputs:
        shape = []
        for axis in t.axes:
            n = 1
            for w in axis:
                n *= (a.tokens if w in (r.query, r.key) else a.batch if w == "b"
                      else 2 if w == "g" else a.heads // 2 if w == "hk" else sizes.get(w, a.heads))
            shape.append(n)
        full[t.name] = torch.randn(shape, generator=gen, dtype=torch.float64)
    dtype = getattr(torch, a.dtype)
    mine = [fn.shard(full[n], place, a.tokens, r.token_axis[k]).to(device, dtype).requires_grad_(True)
            for k, n in enumerate(r.tokens)]
    side = {n: full[n].to(device, dtype) for n in r.side}

    with CommCounter() as cc:
        out = fn(*mine, q_len=a.tokens, timeout=a.timeout, **where, **side)
        outs = out if isinstance(out, tuple) else (out,)
        torch.autograd.backward([o for o in outs], [torch.ones_like(o).nan_to_num(0.0) for o in outs])
    o_full = fn.gather(outs[0].detach(), place, a.tokens, r.out_axis, timeout=a.timeout)
    dq_full = fn.gather(mine[0].grad, place, a.tokens, r.token_axis[0], timeout=a.timeout)

    # single-process float64 reference on the whole sequence
    leaves = [full[n].clone().requires_grad_(True) for n in r.tokens]
    pos = torch.arange(a.tokens)
    ref_o, ref_lse = EagerLocal(r)(*leaves, q_pos=pos, x_pos=pos, q_len=a.tokens, x_len=a.tokens,
                                   **{n: full[n] for n in r.side})
    ref_outs = [ref_o] + ([ref_lse] if len(outs) > 1 else [])
    torch.autograd.backward(ref_outs, [torch.ones_like(t) for t in ref_outs])

    hq = full[r.tokens[0]].numel() // (a.batch * a.tokens * full[r.tokens[0]].shape[-1])
    hkv = full[r.tokens[1]].numel() // (a.batch * a.tokens * full[r.tokens[1]].shape[-1])
    pred_sizes = dict(b=a.batch, hq=hq, hkv=hkv, d=full[r.tokens[0]].shape[-1], q=a.tokens)
    dname = a.dtype.replace("float", "fp")
    sent = [cc.total("forward")[0], cc.total("backward")[0]]
    predicted = [predicted_comm(scheme, grid, pred_sizes, dname, ph, r.family)[rank][0]
                 for ph in ("forward", "backward")]
    report = [None] * world
    dist.all_gather_object(report, (rank, sent, predicted))
    if rank == 0:
        err_o = (o_full.cpu().double() - ref_o.detach()).abs().max().item()
        err_dq = (dq_full.cpu().double() - leaves[0].grad).abs().max().item()
        title = "ATTENTION2D" if scheme == "attention2d" else "Ring Attention"
        print(f"{title}: {a.diagram}, {world} ranks, grid {'x'.join(map(str, grid))}, "
              f"{a.tokens} tokens, {a.dtype}, backend {dist.get_backend()}")
        print(f"max |O - reference|   = {err_o:.3e}")
        print(f"max |dQ - reference|  = {err_dq:.3e}")
        print("rank  forward bytes sent (predicted)   backward bytes sent (predicted)")
        for rk, (s, p) in enumerate((x[1], x[2]) for x in report):
            print(f"{rk:4d}  {s[0]:14d} ({p[0]:14d})   {s[1]:14d} ({p[1]:14d})")
    dist.destroy_process_group()
