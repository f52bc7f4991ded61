"""Per-op dispatch overhead on the cache-hit path, and cache-miss propagation time, vs torch's DTensor.

Overhead = time on DTensors - time on the plain local tensors. Contenders run
interleaved in rounds in one process; medians over rounds; ratios reported.
A one-rank world keeps communication out of the measurement (every op
here runs without redistribution on the hit path): gloo on CPU, NCCL with
``--device cuda`` (tensors on the GPU; each timed loop ends with a synchronize,
so the figures are absolute microseconds per call, launch and kernel included).

    python bench/dispatch.py [--rounds 15] [--iters 200] [--json out.json] [--device cpu|cuda]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F


DEVICE = "cpu"


def _setup(device: str = "cpu"):
    global DEVICE
    if device == "cuda" and not (torch.cuda.is_available() and torch.cuda.device_count() > 0):
        raise SystemExit("bench/dispatch.py --device cuda: torch sees no CUDA device here (a CPU build of torch, or "
                         "no GPU); run it on a GPU machine (make bench-gpu), or use --device cpu")
    DEVICE = device
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 1000))
    if device == "cuda":
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


class _Engine:
    """Adapter: the same benchmark body for shardprop and for the reference."""

    def __init__(self, name):
        self.name = name
        if name == "shardprop":
            import shardprop as m
            self.mesh = m.init_device_mesh(DEVICE, (1,))
        else:
            import torch.distributed.tensor as m
            from torch.distributed.device_mesh import init_device_mesh
            self.mesh = init_device_mesh(DEVICE, (1,))
        self.m = m

    def dist(self, t, shard=None, requires_grad=False):
        pl = [self.m.Shard(shard)] if shard is not None else [self.m.Replicate()]
        out = self.m.distribute_tensor(t, self.mesh, pl)
        return out.requires_grad_(requires_grad) if requires_grad else out


def _cases():
    """name -> (make inputs from a 'wrap' function, op on those inputs)."""
    g = torch.Generator().manual_seed(0)

    def r(*s):
        return torch.randn(*s, generator=g).to(DEVICE)

    a, b, bias = r(64, 64), r(64, 64), r(64)
    x, lnw, lnb = r(32, 64), r(64), r(64)
    idx, emb = torch.randint(0, 100, (32,), generator=g).to(DEVICE), r(100, 64)
    lin = torch.nn.Linear(64, 64).to(DEVICE)
    return {
        "mm": (lambda wr: (wr(a, 0), wr(b)), lambda p, q: torch.mm(p, q)),
        "addmm": (lambda wr: (wr(bias), wr(a, 0), wr(b)), lambda c, p, q: torch.addmm(c, p, q)),
        "add": (lambda wr: (wr(a, 0), wr(b, 0)), lambda p, q: p + q),
        "mul_scalar": (lambda wr: (wr(a, 0),), lambda p: p * 0.5),
        "relu": (lambda wr: (wr(a, 0),), lambda p: torch.relu(p)),
        "sum_dim": (lambda wr: (wr(a, 0),), lambda p: p.sum(1)),
        "softmax": (lambda wr: (wr(a, 0),), lambda p: torch.softmax(p, -1)),
        "layer_norm": (lambda wr: (wr(x, 0), wr(lnw), wr(lnb)), lambda p, q, s: F.layer_norm(p, (64,), q, s)),
        "embedding": (lambda wr: (wr(idx, 0), wr(emb)), lambda i, e: F.embedding(i, e)),
        "view": (lambda wr: (wr(a, 0),), lambda p: p.view(64, 8, 8)),
        "reshape": (lambda wr: (wr(a, 0),), lambda p: p.reshape(64, 4, 16)),
        "transpose": (lambda wr: (wr(a, 0),), lambda p: p.transpose(0, 1)),
        "linear_fwd_bwd": (
            lambda wr: (wr(x, 0), wr(lin.weight.detach(), rg=True), wr(lin.bias.detach(), rg=True)),
            lambda p, q, s: F.linear(p, q, s).sum().backward()),
    }


def _timeit(fn, args, iters):
    fn(*args)
    _sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn(*args)
    _sync()
    return (time.perf_counter() - t0) / iters


def run(rounds: int, iters: int):
    engines = [_Engine("shardprop"), _Engine("reference")]
    results = {}
    for name, (make, fn) in _cases().items():
        inputs = {"local": make(lambda t, shard=None, rg=False: t.clone().requires_grad_(rg))}
        err = {}
        for e in engines:
            try:
                inputs[e.name] = make(lambda t, shard=None, rg=False, e=e: e.dist(t.clone(), shard, rg))
                fn(*inputs[e.name])
            except Exception as ex:  # report, keep benchmarking the rest
                err[e.name] = f"{type(ex).__name__}: {str(ex)[:80]}"
                inputs.pop(e.name, None)
        times = {k: [] for k in inputs}
        for r in range(rounds):
            order = list(inputs)
            order = order[r % len(order):] + order[:r % len(order)]
            for k in order:
                times[k].append(_timeit(fn, inputs[k], iters))
        med = {k: statistics.median(v) for k, v in times.items()}
        row = {"local_us": med["local"] * 1e6}
        for e in ("shardprop", "reference"):
            row[f"{e}_overhead_us"] = (med[e] - med["local"]) * 1e6 if e in med else None
        if row["shardprop_overhead_us"] is not None and row["reference_overhead_us"]:
            row["ratio"] = row["shardprop_overhead_us"] / row["reference_overhead_us"]
        row["errors"] = err
        results[name] = row
    results["_miss"] = _miss_times(engines)
    return results


def _miss_times(engines, n=30):
    """Cache-miss cost: every call has a new shape, so both engines must propagate afresh."""
    out = {}
    for op_name, fn in (("add", lambda p: p + p), ("mm", lambda p: torch.mm(p, p.t())),
                        ("view", lambda p: p.view(-1)), ("sum_dim", lambda p: p.sum(0))):
        row = {}
        for e in engines:
            ts, base = [], []
            try:
                for i in range(n):
                    t = torch.randn(16 + i, 16).to(DEVICE)
                    d = e.dist(t, 0)
                    _sync()
                    t0 = time.perf_counter()
                    fn(d)
                    _sync()
                    ts.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    fn(t)
                    _sync()
                    base.append(time.perf_counter() - t0)
                row[e.name] = (statistics.median(ts) - statistics.median(base)) * 1e6
            except Exception as ex:
                row[e.name] = None
                row.setdefault("errors", {})[e.name] = f"{type(ex).__name__}: {str(ex)[:80]}"
        row["ratio"] = row["shardprop"] / row["reference"] if row["shardprop"] and row["reference"] else None
        out[op_name] = row
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--json")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: a one-rank NCCL mesh, tensors on the GPU (absolute us per call)")
    args = p.parse_args()
    _setup(args.device)
    res = run(args.rounds, args.iters)
    from tabulate import tabulate
    rows = []
    for name, r in res.items():
        if name.startswith("_"):
            continue
        f = lambda v: "error" if v is None else f"{v:.1f}"
        rows.append([name, f(r["local_us"]), f(r["shardprop_overhead_us"]), f(r["reference_overhead_us"]),
                     f"{r['ratio']:.2f}" if "ratio" in r else "-", "; ".join(f"{k}: {v}" for k, v in r["errors"].items())])
    print(f"device {DEVICE}, torch {torch.__version__}")
    print("Cache-hit dispatch overhead (us per call; ratio = shardprop / reference, lower is better)")
    print(tabulate(rows, headers=["op", "local", "shardprop", "reference", "ratio", "errors"]))
    ratios = [r["ratio"] for k, r in res.items() if not k.startswith("_") and "ratio" in r]
    if ratios:
        geo = statistics.geometric_mean(ratios)
        print(f"geomean overhead ratio: {geo:.2f}")
    print("\nCache-miss propagation (us per call, new shape every call)")
    f = lambda v, fmt: "error" if v is None else format(v, fmt)
    print(tabulate([[k, f(v["shardprop"], ".0f"), f(v["reference"], ".0f"), f(v["ratio"], ".2f")]
                    for k, v in res["_miss"].items()], headers=["op", "shardprop", "reference", "ratio"]))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
