"""``calibrate()``: time this machine's collectives and compute, fit the cost model, save it.

Each world (4 ranks by default) is a fresh set of processes on this host joined over
gloo (NCCL with ``backend="nccl"`` and GPUs); each rank builds a shardprop mesh (so gloo runs with
our shared-memory transport where it applies, as training does) and times all-gather,
reduce-scatter, all-reduce and all-to-all over the whole world and over each smaller group size
dividing it (groups of 2 timed while all 4 ranks run, as a tp group of a 2 x 2 mesh does), over
a ladder of message sizes (median of several
runs). A least-squares fit of ``time = alpha + moved_bytes / bandwidth`` per (kind, group size)
gives the model's links. Matmul flops and elementwise bandwidth are timed with every rank busy at
once (the ranks share the cores in training too); the per-op overhead is an eager ``add`` on a
small tensor. The result is saved as JSON (:func:`shardprop.planner.costs.default_path`) and
read by ``autoplan`` and the dry run's collective table.

    >>> cm = calibrate(sizes=(2, 4))  # doctest: +SKIP
    >>> cm.source  # doctest: +SKIP
    'measured on host ... (gloo, 2026-11-29)'
"""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import statistics
import time
from typing import Optional, Sequence

from shardprop.planner.costs import KINDS, CostModel, default_path, moved_bytes

__all__ = ["calibrate"]

MESSAGE_BYTES = (4 << 10, 256 << 10, 2 << 20, 8 << 20)


def _time(fn, reps: int) -> float:
    fn()  # warm-up (buffers, first-call paths)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _rank_main(rank: int, world: int, port: int, backend: str, reps: int, q) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    try:
        from shardprop.mesh import collectives as C
        from shardprop.mesh import init_device_mesh

        dev = "cuda" if backend == "nccl" else "cpu"
        if dev == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        mesh = init_device_mesh(dev, (world,))
        sync = (lambda: torch.cuda.synchronize()) if dev == "cuda" else (lambda: None)
        out = {"links": {}}
        # Every group size that divides the world, timed with all ranks of the world busy at once (a
        # tp group of 2 inside 4 ranks on few cores waits on all of them, as in training).
        for g in [d for d in range(2, world + 1) if world % d == 0]:
            sub = mesh if g == world else init_device_mesh(dev, (world // g, g), mesh_dim_names=("o", "g"))["g"]
            for kind in KINDS:
                pts = []
                for nbytes in MESSAGE_BYTES:
                    n = max(g, nbytes // 4 // g * g)
                    t = torch.ones(n, device=dev)
                    call = {"all_gather": lambda: C.all_gather(t[: n // g], sub, 0),
                            "reduce_scatter": lambda: C.reduce_scatter(t, sub, 0),
                            "all_reduce": lambda: C.all_reduce(t, sub, 0),
                            "all_to_all": lambda: C.all_to_all(t, sub, 0)}[kind]
                    dist.barrier()
                    inp = n * 4 / g if kind == "all_gather" else n * 4
                    pts.append((moved_bytes(kind, g, inp), _time(lambda: (call(), sync()), reps)))
                out["links"][(kind, g)] = pts
        # Compute with every rank busy at once.
        dist.barrier()
        # Loops long enough (tens of ms) that the ranks' runs overlap, as in a training step.
        a = torch.randn(512, 512, device=dev)
        mm = _time(lambda: ([a @ a for _ in range(10)], sync()), reps) / 10
        out["matmul_flops"] = 2 * 512 ** 3 / mm
        # Activation-sized operands (1 MiB): what a training step's elementwise ops mostly see.
        x = torch.randn(1 << 18, device=dev)
        ew = _time(lambda: ([x + x for _ in range(50)], sync()), reps) / 50
        out["elementwise_bytes"] = 3 * x.numel() * 4 / ew
        # An eager op with autograd recording and its backward, as in a training step (per op, one direction).
        s = torch.ones(8, device=dev, requires_grad=True)

        def chain():
            y = s
            for _ in range(100):
                y = y * 1.0
            y.sum().backward()
        out["op_overhead"] = _time(chain, reps) / 200
        # The same on a DTensor (the optimizer's ops on sharded parameters): the dispatcher's cached path.
        from shardprop.tensor.distribute import distribute_tensor
        from shardprop.tensor.placement import Shard
        d = distribute_tensor(torch.ones(8 * world, device=dev), mesh, [Shard(0)])
        out["dtensor_overhead"] = _time(lambda: [d.mul_(1.0) for _ in range(200)], reps) / 200
        # A reference training step (one process per rank, all busy, no communication): its time against
        # what the rates above predict gives the compute scale.
        dist.barrier()
        model, x = _reference(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)

        def step():
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
        out["reference_step"] = _time(step, reps)
        dist.barrier()
        if rank == 0:
            q.put(out)
    finally:
        dist.destroy_process_group()


def _reference(dev: str):
    """A small transformer-like MLP stack and its input: what the compute scale is measured on."""
    import torch
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self, d: int):
            super().__init__()
            self.norm = nn.RMSNorm(d)
            self.up = nn.Linear(d, 3 * d, bias=False)
            self.down = nn.Linear(3 * d, d, bias=False)

        def forward(self, x):
            return x + self.down(torch.nn.functional.silu(self.up(self.norm(x))))

    torch.manual_seed(0)
    model = nn.Sequential(*[Block(256) for _ in range(4)]).to(dev)
    return model, torch.randn(4, 128, 256, device=dev)


def _compute_scale(cm: CostModel, measured: float) -> float:
    """Measured reference step over its prediction by ``cm`` (compute only; the per-op overheads are kept)."""
    from shardprop.planner.costs import node_cost
    from shardprop.planner.trace import trace_model

    model, x = _reference("cpu")
    g = trace_model(model, (x,))
    g_ops = sum((g.repeats if n.in_block else 1) for n in g.nodes if n.kind == "op")
    compute = sum((g.repeats if n.in_block else 1) * node_cost(n, g, cm) for n in g.nodes)
    n_params = sum(1 for _ in model.parameters())
    overhead = 3 * g_ops * cm.op_overhead + 12 * n_params * cm.op_overhead
    return min(max((measured - overhead) / max(compute, 1e-9), 0.5), 20.0)


def _fit(points) -> tuple:
    """Least squares of time = alpha + bytes / bandwidth (alpha >= 0, bandwidth > 0)."""
    xs = [b for b, _ in points]
    ys = [t for _, t in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs) or 1.0
    slope = max(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var, 1e-13)
    alpha = max(my - slope * mx, 0.0)
    return alpha, 1.0 / slope


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def calibrate(sizes: Sequence[int] = (4,), *, backend: str = "gloo", reps: int = 5,
              path: Optional[str] = None, save: bool = True) -> CostModel:
    """Measure collectives over each world size in ``sizes`` (and every group size dividing it, timed inside that
    world with all its ranks busy) and compute throughput; save and return the model.

    Runs in fresh processes (this process needs no process group). ``path`` defaults to
    ``~/.cache/shardprop/calibration.json`` (``$XDG_CACHE_HOME``); ``save=False`` only returns it.

    Example:
        >>> calibrate((2,), reps=3, save=False).links[0][:2]  # doctest: +SKIP
        ('all_gather', 2)
    """
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    links, rates = [], []
    for world in sizes:
        q = ctx.Queue()
        port = _free_port()
        procs = [ctx.Process(target=_rank_main, args=(r, world, port, backend, reps, q)) for r in range(world)]
        for p in procs:
            p.start()
        try:
            res = q.get(timeout=600)
        finally:
            for p in procs:
                p.join(timeout=60)
        for (kind, g), pts in res["links"].items():
            alpha, bw = _fit(pts)
            links = [l for l in links if (l[0], l[1]) != (kind, g)] + [(kind, g, alpha, bw)]
        rates.append(res)
    best = rates[-1]  # compute rates with the most ranks busy: what training on this machine sees
    cm = CostModel(tuple(links), best["matmul_flops"], best["elementwise_bytes"], best["op_overhead"],
                   f"measured on {socket.gethostname()} ({backend}, {time.strftime('%Y-%m-%d')})", backend,
                   best["dtensor_overhead"])
    cm = dataclasses.replace(cm, compute_scale=_compute_scale(cm, best["reference_step"]))
    if save:
        path = path or default_path()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(cm.to_json(), f, indent=1)
    return cm
