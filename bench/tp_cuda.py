"""The TP training step on one GPU: plain torch vs shardprop vs torch.distributed.tensor, eager and compiled.

One process, a one-rank NCCL world, a tp=1 mesh: what a user pays for running the TP code
path when there is nothing to shard (the engine's overhead at real sizes). The demo's Llama
(``shardprop.demo.model``; default dim 1024, 4 layers, 16 heads, seq 512, batch 8, vocab
32000) is parallelized with the same ``tp_plan`` by shardprop and by the reference, and
trained with AdamW (``foreach=False`` for all three, as the demo). One step = forward +
backward + optimizer step, a ``torch.cuda.synchronize()`` after each; contenders alternate
step by step after a warm-up; medians. Collectives per step are counted over one step:
shardprop's ``comm_counter()``, the reference's ``CommDebugMode`` (on tp=1 both should be none:
a collective over one rank is a copy). First-step losses must agree (relative 1e-4).

Targets (issue 22): shardprop tp=1 step <= 1.02x plain at dim 1024.

    python bench/tp_cuda.py [--dim 1024] [--layers 4] [--heads 16] [--seq 512] [--batch 8] [--vocab 32000]
                            [--reps 20] [--warmup 3] [--no-compile] [--json out.json]

Without a GPU it exits at once with a clear message.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist


def _reference_styles() -> SimpleNamespace:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)
    return SimpleNamespace(Shard=Shard, Replicate=Replicate, ColwiseParallel=ColwiseParallel,
                           RowwiseParallel=RowwiseParallel, SequenceParallel=SequenceParallel,
                           PrepareModuleInput=PrepareModuleInput)


def _setup() -> None:
    if not (torch.cuda.is_available() and torch.cuda.device_count() > 0):
        raise SystemExit("bench/tp_cuda.py: torch sees no CUDA device here (a CPU build of torch, or no GPU); "
                         "run it on a GPU machine (make bench-gpu)")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))


def _contenders(cfg, compiled: bool) -> dict:
    """name -> (model, optimizer): plain, shardprop tp=1, reference tp=1 (each from the same seeded init)."""
    import shardprop
    from shardprop.demo.model import Llama, make_optimizer, tp_plan
    from torch.distributed.device_mesh import init_device_mesh as ref_mesh
    from torch.distributed.tensor.parallel import parallelize_module as ref_parallelize
    out = {}
    plain = Llama(cfg, 0).cuda()
    ours = shardprop.parallelize_module(Llama(cfg, 0).cuda(), shardprop.init_device_mesh("cuda", (1,)), tp_plan())
    ref = ref_parallelize(Llama(cfg, 0).cuda(), ref_mesh("cuda", (1,)), tp_plan(_reference_styles()))
    for name, model in (("plain", plain), ("shardprop", ours), ("reference", ref)):
        run = torch.compile(model) if compiled else model
        out[name] = (run, make_optimizer("adamw", model.parameters()))
    return out


def _step(run, opt, tokens, targets) -> float:
    from shardprop.demo.model import lm_loss
    loss = lm_loss(run(tokens), targets)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    value = loss.detach()
    value = value.full_tensor() if hasattr(value, "full_tensor") else value
    return float(value)


def _counts(name, run, opt, tokens, targets) -> dict:
    """Collectives of one step: shardprop's counter for ours, CommDebugMode for the reference."""
    if name == "plain":
        return {}
    if name == "shardprop":
        from shardprop import comm_counter
        with comm_counter() as c:
            _step(run, opt, tokens, targets)
        return {k: n for k, (n, _) in c.counts.items()}
    from torch.distributed.tensor.debug import CommDebugMode
    mode = CommDebugMode()
    with mode:
        _step(run, opt, tokens, targets)
    return {str(k).split(".")[-1]: v for k, v in mode.get_comm_counts().items()}


def bench(cfg, batch: int, reps: int, warmup: int, compiled: bool) -> dict:
    from shardprop.demo.model import synthetic_batch
    tokens, targets = (t.cuda() for t in synthetic_batch(cfg, batch, 0, 0))
    contenders = _contenders(cfg, compiled)
    first = {name: _step(run, opt, tokens, targets) for name, (run, opt) in contenders.items()}
    for _ in range(warmup):
        for run, opt in contenders.values():
            _step(run, opt, tokens, targets)
    times = {name: [] for name in contenders}
    for r in range(reps):
        order = list(contenders)
        order = order[r % 3:] + order[:r % 3]
        for name in order:
            run, opt = contenders[name]
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            _step(run, opt, tokens, targets)
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    counts = {name: _counts(name, run, opt, tokens, targets) for name, (run, opt) in contenders.items()}
    agree = {k: abs(v - first["plain"]) / max(abs(first["plain"]), 1e-12) for k, v in first.items()}
    return dict(ms=med, over_plain={k: v / med["plain"] for k, v in med.items()}, first_loss=first,
                rel_diff_first_loss=agree, collectives=counts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-compile", action="store_true", help="eager only")
    p.add_argument("--json")
    args = p.parse_args(argv)
    _setup()
    from shardprop.demo.model import LlamaConfig
    cfg = LlamaConfig(dim=args.dim, n_layers=args.layers, n_heads=args.heads, vocab_size=args.vocab,
                      seq_len=args.seq)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}; Llama dim {cfg.dim}, {cfg.n_layers} layers, "
          f"{cfg.n_heads} heads, seq {cfg.seq_len}, batch {args.batch}, vocab {cfg.vocab_size}, AdamW; tp=1 mesh")
    results = {}
    for mode in ("eager",) + (() if args.no_compile else ("compiled",)):
        res = results[mode] = bench(cfg, args.batch, args.reps, args.warmup, mode == "compiled")
        print(f"\n{mode}: ms/step (x plain)   first-step loss rel diff vs plain   collectives per step")
        for name in res["ms"]:
            print(f"  {name:10s} {res['ms'][name]:8.2f} ({res['over_plain'][name]:.3f}x)   "
                  f"{res['rel_diff_first_loss'][name]:.1e}   {res['collectives'][name] or 'none'}")
        bad = [k for k, v in res["rel_diff_first_loss"].items() if v > 1e-4]
        if bad:
            print(f"  WARNING: first-step losses of {bad} differ from plain by more than 1e-4")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
