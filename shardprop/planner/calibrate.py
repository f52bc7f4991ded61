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
small tensor. Last, the ranks train a small transformer (:mod:`.probe`, 2 blocks) on every dp x tp
shape of the world with autoplan's plan for it: what the measured steps take beyond the model's
prediction, per collective the plan issues, is the in-step latency of a group size (the wait for
late peers, which lock-step micro-benchmarks miss), fitted by non-negative least squares over
the shapes. The result is saved as JSON (:func:`shardprop.planner.costs.default_path`) and
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
        dist.barrier()
        # The wait for late peers inside training steps: rank 0 fits the model so far, every rank plans and
        # times the probe transformer on each mesh shape with it.
        state = [_model(out, backend).to_json() if rank == 0 else None]
        dist.broadcast_object_list(state, src=0)
        out["probes"] = _probes(CostModel.from_json(state[0]), world, dev, sync)
        if rank == 0:
            q.put(out)
    finally:
        dist.destroy_process_group()


def _probes(cm: CostModel, world: int, dev: str, sync, steps: int = 8) -> list:
    """Train the probe transformer on every dp x tp shape of ``world`` with autoplan's plan for it.

    Returns ``(shape, measured s, predicted s, {"compute": s, group size: collectives per step})`` per shape,
    predicted without step latency; the parts are the prediction's derivatives in the compute scale and in
    each group size's latency.
    """
    import torch
    import torch.distributed as dist

    from shardprop.mesh import init_device_mesh
    from shardprop.planner.probe import probe_batch, probe_loss, probe_model
    from shardprop.planner.search import autoplan
    from shardprop.planner.solve import Shape

    batch = 8
    tokens = probe_batch(batch, 0)[0]
    shapes = list(dict.fromkeys(Shape(dp=world // t, tp=t) for t in (1, 2, world) if world % t == 0
                                and batch % (world // t) == 0))
    sizes = sorted({g for s in shapes for g in (s.dp, s.tp) if g > 1})
    runs = []
    for shape in shapes:
        def plan_with(model: CostModel):
            return autoplan(probe_model(), world, (tokens,), shapes=[shape], cost_model=model,
                            sequence_parallel=True if shape.tp > 1 else None)

        plan = plan_with(cm)
        base = plan.predicted_step_time
        parts = {"compute": (plan_with(dataclasses.replace(cm, compute_scale=cm.compute_scale * 1.01)).predicted_step_time
                             - base) / 0.01}
        for g in sizes:
            bumped = dataclasses.replace(cm, step_latency=tuple((h, 1e-4 if h == g else 0.0) for h in sizes))
            parts[g] = round((plan_with(bumped).predicted_step_time - base) / 1e-4, 1)
        dims = [(n, v) for n, v in (("dp", shape.dp), ("tp", shape.tp)) if v > 1]
        mesh = init_device_mesh(dev, tuple(v for _, v in dims), mesh_dim_names=tuple(n for n, _ in dims))
        model = plan.apply(probe_model().to(dev), mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
        runs.append((shape, plan, parts, model, opt))
    times = {i: [] for i in range(len(runs))}
    for r in range(steps + 1):  # interleaved, the first round warms up
        for i, (shape, plan, parts, model, opt) in enumerate(runs):
            x, y = (plan.local_batch(t).to(dev) for t in probe_batch(batch, r))
            dist.barrier()
            t0 = time.perf_counter()
            probe_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            took = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
            if r:
                times[i].append(took.item())
    return [((s.dp, s.tp), statistics.median(times[i]), plan.predicted_step_time, parts)
            for i, (s, plan, parts, _, _) in enumerate(runs)]


def _fit_probes(probes) -> tuple:
    """(compute scale, step latency) from the probes, by non-negative least squares of

    ``measured = scale x compute + (predicted - compute) + sum over group sizes of collectives x latency``:
    the shapes' common level gives the scale, their differences in collectives the latencies.
    """
    import numpy as np
    from scipy.optimize import nnls

    sizes = sorted({g for _, _, _, counts in probes for g in counts if g != "compute"})
    A = np.array([[counts["compute"]] + [counts.get(g, 0.0) for g in sizes] for _, _, _, counts in probes])
    b = np.array([measured - predicted + counts["compute"] for _, measured, predicted, counts in probes])
    x, _ = nnls(A, b)
    return float(min(max(x[0], 0.25), 20.0)), tuple((g, float(v)) for g, v in zip(sizes, x[1:]))


def _model(res: dict, backend: str) -> CostModel:
    """The cost model of one world's measurements (links fitted; compute scale and step latency from the probes)."""
    links = tuple((kind, g, *_fit(pts)) for (kind, g), pts in res["links"].items())
    return CostModel(links, res["matmul_flops"], res["elementwise_bytes"], res["op_overhead"],
                     f"measured on {socket.gethostname()} ({backend}, {time.strftime('%Y-%m-%d')})", backend,
                     res["dtensor_overhead"])


def _fit(points) -> tuple:
    """Least squares of time = alpha + bytes / bandwidth (alpha >= 0, bandwidth > 0)."""
    xs = [b for b, _ in points]
    ys = [t for _, t in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs) or 1.0
    slope = max(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var, 1e-13)
    alpha = max(my - slope * mx, 0.0)
    return alpha, 1.0 / slope


def _result(q, procs, timeout: float = 900.0) -> dict:
    """Rank 0's result; a RuntimeError as soon as any rank died (the others are then killed, not waited on)."""
    import queue

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return q.get(timeout=1.0)
        except queue.Empty:
            dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"calibrate: rank {dead[0]} failed (exit code {procs[dead[0]].exitcode}); "
                                   "its error is printed above") from None
    raise TimeoutError(f"calibrate: no result after {timeout:g} s")


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
    links, probes, cm = {}, [], None
    for world in sizes:
        q = ctx.Queue()
        port = _free_port()
        procs = [ctx.Process(target=_rank_main, args=(r, world, port, backend, reps, q)) for r in range(world)]
        for p in procs:
            p.start()
        try:
            res = _result(q, procs)
        finally:
            for p in procs:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()
        cm = _model(res, backend)  # compute rates of the last (largest) world: what training here sees
        links.update({(c, k): (c, k, a, b) for c, k, a, b in cm.links})
        probes += res["probes"]
    scale, latency = _fit_probes(probes)
    cm = dataclasses.replace(cm, links=tuple(links.values()), compute_scale=scale, step_latency=latency)
    if save:
        path = path or default_path()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(cm.to_json(), f, indent=1)
    return cm
