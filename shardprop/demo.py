"""The demo: spawn CPU ranks, distribute a tensor, walk it through every placement.

    python -m shardprop.demo [--nproc 4] [--mesh 4|2x2]

Also runs under ``torchrun --nproc-per-node 4 -m shardprop.demo``. Every step
prints the plan (collectives and bytes) and checks the result against the
original tensor.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tour(mesh_shape) -> None:
    """Distribute a tensor and redistribute it through every placement; print plans and checks."""
    import shardprop
    from shardprop import Partial, Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", mesh_shape)
    rank = dist.get_rank()
    torch.manual_seed(0)
    full = torch.randn(10, 6)  # 10 rows: uneven over 4 ranks, on purpose
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"mesh {mesh}; global tensor {tuple(full.shape)}")
    options = [Shard(0), Shard(1), Replicate(), Partial("sum"), Partial("max")]
    placements = [[p] for p in options] if mesh.ndim == 1 else \
        [[a, b] for a in options[:4] for b in options[:4]]
    x = distribute_tensor(full, mesh, placements[0])
    ok_all = True
    for target in placements[1:] + placements[:1]:
        plan = shardprop.plan_redistribute(x._spec, tuple(target))
        y = x.redistribute(placements=target)
        back = y.full_tensor()
        ok = torch.allclose(back, full)
        ok_all &= ok
        steps = ", ".join(f"{s.kind}@{list(s.mesh_dims)} ({s.bytes} B)" for s in plan.steps) or "no-op"
        say(f"  {list(x.placements)!s:>10} -> {list(y.placements)!s:<10} local {tuple(y.to_local().shape)!s:<8} "
            f"{'ok ' if ok else 'BAD'} via {steps}")
        x = y
    a = distribute_tensor(full, mesh, [Shard(0)] + [Replicate()] * (mesh.ndim - 1))
    b = distribute_tensor(full, mesh, [Replicate()] * mesh.ndim)
    with shardprop.explain() as ex:
        c = (a * 2.0 + b).relu()
    say("\nop calls on DTensors, with the strategy chosen:")
    say(ex)
    ok_all &= torch.allclose(c.full_tensor(), (full * 2.0 + full).relu())
    say("\ncache statistics:")
    if rank == 0:
        shardprop.print_cache_stats()
    say(f"\nall checks {'passed' if ok_all else 'FAILED'}")
    if not ok_all:
        raise SystemExit(1)


def _worker(rank: int, world: int, port: int, mesh_shape) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    try:
        tour(mesh_shape)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--mesh", default=None, help="mesh shape, e.g. 4 or 2x2 (default: 1-d over all ranks)")
    args = p.parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        world = int(os.environ["WORLD_SIZE"])
        shape = tuple(int(s) for s in args.mesh.split("x")) if args.mesh else (world,)
        torch.set_num_threads(1)
        tour(shape)
        dist.destroy_process_group()
        return
    shape = tuple(int(s) for s in args.mesh.split("x")) if args.mesh else (args.nproc,)
    import torch.multiprocessing as mp
    mp.spawn(_worker, args=(args.nproc, _free_port(), shape), nprocs=args.nproc)


if __name__ == "__main__":
    sys.exit(main())
