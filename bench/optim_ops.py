"""Per-op cost of the ops torch.optim's per-parameter SGD/AdamW make, on plain tensors and on DTensors.

``torch.optim.AdamW`` / ``SGD`` on CPU default to ``foreach=False``: ``_single_tensor_adamw``
makes eight ops per parameter (``mul_`` weight decay, ``lerp_``, ``mul_``, ``addcmul_``,
``sqrt``, ``div``, ``add_``, ``addcdiv_``), SGD one (``add_`` with ``alpha``). This times each,
exactly as torch.optim calls it, on a plain tensor of a demo-model shard's shape (tp=4: 48x64),
on a shardprop DTensor and on a ``torch.distributed.tensor`` DTensor over that shard
(``Shard(0)`` on a one-rank gloo mesh: no communication), and on ``floor``: the least any
Python ``__torch_dispatch__`` wrapper subclass pays (unwrap, one call on the local tensor,
return self or wrap the result; no sharding logic at all), so ``ours - floor`` is our own
Python and ``floor - plain`` is torch's subclass entry and exit. Contenders are interleaved
in rounds; times are this thread's CPU time (robust on a shared machine), medians.
It also times a whole ``opt.step()`` over the demo-sized parameter set for each contender.

    python bench/optim_ops.py [--rounds 15] [--iters 300] [--json out.json]
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

SHAPE = (48, 64)


def _setup():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)


_make = torch.Tensor._make_wrapper_subclass


def _op_callable(op):
    return getattr(op, "_op", op)


try:  # the local call shardprop's dispatcher makes for an op (the floor makes the same)
    from shardprop.dispatch.method_calls import local_callable as _local_callable
except ImportError:  # an older shardprop: the overload's C++ callable
    _local_callable = _op_callable


class _Floor(torch.Tensor):
    """The cheapest possible wrapper subclass: one local call per op, no sharding logic."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def of(t):
        r = _make(_Floor, t.shape, strides=t.stride(), dtype=t.dtype, device=t.device)
        r._t = t
        return r

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        local = [a._t if type(a) is _Floor else a for a in args]
        res = _local_callable(func)(*local, **(kwargs or {}))
        if res is local[0]:
            return args[0]
        return _Floor.of(res) if isinstance(res, torch.Tensor) else res


def _wrappers():
    """name -> function making (a contender's tensor) from a plain tensor."""
    import shardprop
    import torch.distributed.tensor as ref
    from torch.distributed.device_mesh import init_device_mesh
    ours_mesh = shardprop.init_device_mesh("cpu", (1,))
    ref_mesh = init_device_mesh("cpu", (1,))
    return {
        "plain": lambda t: t.clone(),
        "floor": lambda t: _Floor.of(t.clone()),
        "ours": lambda t: shardprop.distribute_tensor(t.clone(), ours_mesh, [shardprop.Shard(0)]),
        "ref": lambda t: ref.distribute_tensor(t.clone(), ref_mesh, [ref.Shard(0)]),
    }


def _cases():
    """name -> (number of tensors the op needs, the call as torch.optim makes it)."""
    return {
        "mul_ (weight decay)": (1, lambda p: p.mul_(0.9999)),
        "lerp_(grad, w)": (2, lambda m, g: m.lerp_(g, 0.1)),
        "addcmul_(g, g, value)": (2, lambda v, g: v.addcmul_(g, g, value=0.001)),
        "sqrt": (1, lambda v: v.sqrt()),
        "div (scalar)": (1, lambda v: v.div(0.999)),
        "add_ (scalar)": (1, lambda d: d.add_(1e-8)),
        "addcdiv_(m, d, value)": (3, lambda p, m, d: p.addcdiv_(m, d, value=-1e-6)),
        "add_(grad, alpha) [SGD]": (2, lambda p, g: p.add_(g, alpha=-1e-6)),
    }


def _timeit(fn, args, iters):
    fn(*args)
    t0 = time.thread_time()
    for _ in range(iters):
        fn(*args)
    return (time.thread_time() - t0) / iters


def _interleaved(fns, rounds):
    """name -> median seconds of fns[name]() over rounds, contenders rotated each round."""
    times = {k: [] for k in fns}
    names = list(fns)
    for r in range(rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            times[k].append(fns[k]())
    return {k: statistics.median(v) for k, v in times.items()}


def op_table(rounds, iters):
    wrappers = _wrappers()
    g = torch.Generator().manual_seed(0)
    base = [torch.rand(SHAPE, generator=g) + 0.5 for _ in range(3)]
    out = {}
    with torch.no_grad():
        for name, (n, fn) in _cases().items():
            inputs = {k: [w(t) for t in base[:n]] for k, w in wrappers.items()}
            fns = {k: (lambda a=a: _timeit(fn, a, iters)) for k, a in inputs.items()}
            out[name] = {k: v * 1e6 for k, v in _interleaved(fns, rounds).items()}
    return out


def step_table(rounds, iters):
    """Median time of one opt.step() over demo-sized parameters, per optimizer and contender."""
    wrappers = _wrappers()
    g = torch.Generator().manual_seed(1)
    shapes = ([(16, 64)] * 3 + [(64, 16)] + [(48, 64)] * 2 + [(64, 48)]) * 2 + [(64, 64)]
    plain = [torch.randn(s, generator=g) * 0.1 for s in shapes]
    grads = [torch.randn(s, generator=g) * 0.01 for s in shapes]
    out = {}
    for opt_name in ("sgd", "adamw"):
        fns = {}
        for k, w in wrappers.items():
            ps = [torch.nn.Parameter(w(t)) for t in plain]
            for p, gr in zip(ps, grads):
                p.grad = w(gr)
            opt = (torch.optim.SGD(ps, lr=1e-4) if opt_name == "sgd"
                   else torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01))
            fns[k] = (lambda opt=opt: _timeit(opt.step, (), iters))
        out[opt_name] = {k: v * 1e6 for k, v in _interleaved(fns, rounds).items()}
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--json")
    args = p.parse_args()
    _setup()
    from tabulate import tabulate
    ops = op_table(args.rounds, args.iters)
    rows = [[k, f"{v['plain']:.1f}", f"{v['floor']:.1f}", f"{v['ours']:.1f}", f"{v['ref']:.1f}",
             f"{v['floor'] - v['plain']:.1f}", f"{v['ours'] - v['floor']:.1f}", f"{v['ref'] - v['plain']:.1f}",
             f"{v['ours'] / v['plain']:.2f}", f"{v['ours'] / v['ref']:.2f}"]
            for k, v in ops.items()]
    print(f"Per-op time (us per call, thread CPU time; local shard {SHAPE} float32; medians of interleaved rounds)")
    print(tabulate(rows, headers=["op", "plain", "floor", "ours", "ref", "floor-plain", "ours-floor", "ref-plain",
                                  "ours/plain", "ours/ref"]))
    steps = step_table(max(5, args.rounds // 2), max(20, args.iters // 10))
    print("\nopt.step() over 15 demo-sized parameters (us; foreach left at torch's default)")
    print(tabulate([[k, f"{v['plain']:.0f}", f"{v['floor']:.0f}", f"{v['ours']:.0f}", f"{v['ref']:.0f}",
                     f"{v['ours'] / v['plain']:.2f}", f"{v['ours'] / v['ref']:.2f}"] for k, v in steps.items()],
                   headers=["optimizer", "plain", "floor", "ours", "ref", "ours/plain", "ours/ref"]))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"ops": ops, "steps": steps}, fh, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
