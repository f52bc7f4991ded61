"""Spawn CPU ranks for a benchmark: gloo on 127.0.0.1, one thread per rank.

Usage::

    from _launch import launch

    def body(rank, world_size, n):     # module level: pickled by reference
        ...
        return result                  # rank 0's return value comes back

    result = launch(body, 4, 1000)

Each rank joins the default process group before ``body`` runs and leaves it
afterwards. Only rank 0's return value is returned (it must pickle).
"""
from __future__ import annotations

import os
import pickle
import socket
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["free_port", "launch"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn, args, out_path: str, timeout_s: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))
    try:
        result = fn(rank, world_size, *args)
        if rank == 0:
            with open(out_path, "wb") as f:
                pickle.dump(result, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def launch(fn, world_size: int, *args, timeout_s: float = 300.0):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; return rank 0's result.

    Raises (``torch.multiprocessing.ProcessRaisedException``) if any rank fails.
    """
    with tempfile.TemporaryDirectory(prefix="shardprop-bench-") as d:
        out_path = os.path.join(d, "rank0.pkl")
        mp.spawn(_entry, args=(world_size, free_port(), fn, args, out_path, timeout_s),
                 nprocs=world_size, join=True)
        with open(out_path, "rb") as f:
            return pickle.load(f)
