"""What the TP benchmarks share: the demo model's options, the reference's styles, interleaved timing.

Its own module so that ``tp.py`` (which hands ``--floor`` and ``--compile`` to ``tp_vs_floor.py`` and
``tp_compile.py``) and those scripts import it instead of each other.
"""
from __future__ import annotations

import time
from types import SimpleNamespace

import torch
import torch.distributed as dist


def torch_styles() -> SimpleNamespace:
    """The reference's styles and placements under the names :func:`tp_plan` uses."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)
    return SimpleNamespace(Shard=Shard, Replicate=Replicate, ColwiseParallel=ColwiseParallel,
                           RowwiseParallel=RowwiseParallel, SequenceParallel=SequenceParallel,
                           PrepareModuleInput=PrepareModuleInput)


def add_model_args(ap) -> None:
    """The demo model's size and data options, shared by the TP, compiled and fully_shard benchmarks."""
    for name, default in (("dim", 64), ("layers", 2), ("heads", 4), ("vocab", 256), ("seq", 32), ("batch", 8),
                          ("seed", 0)):
        ap.add_argument(f"--{name}", type=int, default=default)


def print_targets(targets: str, misses: list) -> list:
    """Print whether a benchmark met its targets (and each miss); return the misses."""
    print(f"\ntargets ({targets}): " + ("all met" if not misses else "missed:"))
    for m in misses:
        print(m)
    return misses


def time_interleaved(cs, warmup: int, reps: int):
    """Warm up, then time each contender's ``step`` in turn, ``reps`` rounds (ms, max over ranks).

    Returns (samples per contender, the next step index). Every timed step starts after a barrier.
    """
    for w in range(1, warmup):
        for c in cs.values():
            c.step(w)
    step = warmup
    samples = {name: [] for name in cs}
    for _ in range(reps):
        for name, c in cs.items():
            samples[name].append(timed_step(c, step))
        step += 1
    return samples, step


def timed_step(c, i: int) -> float:
    """``c.step(i)`` after a barrier: its time in ms, the max over ranks."""
    dist.barrier()
    t0 = time.perf_counter()
    c.step(i)
    el = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(el, op=dist.ReduceOp.MAX)
    return el.item() * 1e3
