"""``python bench/tp.py --floor``: eager TP training steps against the hand-written Megatron floor.

Contenders (4 CPU ranks, gloo, one thread each; a 1-d tp=4 mesh), one step = forward +
backward + optimizer step:

* ``floor``: Megatron TP written by hand on plain local tensors (``bench/tp_floor.py``);
* ``floor SP``: the same with sequence parallelism, communicating exactly as ``tp_plan`` does
  (``megatron_sp_floor``): how much of the titan contenders' time is the plan's communication;
* ``floor shm`` / ``floor SP shm``: the same two floors with every collective made by
  shardprop's own CPU collectives (``comm="shm"``: shared memory between ranks of one host, the
  transport ``ours`` uses) instead of gloo's: the floor on equal communication;
* ``ours titan`` / ``ref titan``: the demo's ``tp_plan`` (torchtitan style, sequence parallel)
  under shardprop / torch.distributed.tensor;
* ``ours per-linear``: Colwise on wq/wk/wv/w1/w3/output (``output_layouts=Replicate()``: full
  logits, like the floor), Rowwise on wo/w2, nothing else.

Optimizers SGD and AdamW with ``foreach`` left at torch's default (off for CPU tensors);
sizes ``demo`` (the model options given) and ``issue`` (dim 256, 8 heads, 2 layers, seq 128,
batch 8, vocab 1024). Contenders alternate step by step after a warm-up (``time_interleaved``);
the table shows medians and each one over the floor's median of the same run (and the titan
contenders' over ``floor SP``'s); ``x floor shm`` shows ours over ``floor shm`` and ``x floor SP
shm`` ours titan over ``floor SP shm``: the ratios on equal transport. Step 0 is the correctness
check: every contender's loss must equal the floor's (the first contender's when the floor is
not run).

Targets (issue 13): ours titan <= 1.10x floor, ours per-linear <= 1.25x floor, same losses
(against the gloo ``floor``; the shm ratios are shown, not checked).

    python bench/tp.py --floor [--reps 10] [--warmup 3] [--sizes demo,issue] [--optims sgd,adamw] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _launch import launch  # noqa: E402
from tp_common import add_model_args, print_targets, time_interleaved, torch_styles  # noqa: E402
from tp_floor import megatron_floor, megatron_sp_floor  # noqa: E402

WORLD = 4
LOSS_RTOL = 1e-4
CONTENDERS = ("floor", "floor SP", "floor shm", "floor SP shm", "ours titan", "ours per-linear", "ref titan")
SP_RATIO = ("ours titan", "ref titan")  # also shown over floor SP (same communication)
SHM_RATIO = ("ours titan", "ours per-linear")  # also shown over floor shm (same transport)
SP_SHM_RATIO = ("ours titan",)  # and over floor SP shm (same communication, same transport)
TARGETS = {"ours titan": 1.10, "ours per-linear": 1.25}
ISSUE_SIZE = dict(dim=256, layers=2, heads=8, vocab=1024, seq=128, batch=8)


def per_linear_plan(P) -> dict:
    """Colwise/Rowwise on each linear only: no sequence parallelism, no PrepareModuleInput."""
    col, row = P.ColwiseParallel(), P.RowwiseParallel()
    plan = {f"layers.*.attention.{n}": col for n in ("wq", "wk", "wv")}
    plan.update({f"layers.*.feed_forward.{n}": col for n in ("w1", "w3")})
    plan.update({"layers.*.attention.wo": row, "layers.*.feed_forward.w2": row,
                 "output": P.ColwiseParallel(output_layouts=P.Replicate())})
    return plan


def make_optimizer(name, params):
    """SGD or AdamW as the demo sets them up, ``foreach`` left at torch's default."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


class _Contender:
    def __init__(self, name, cfg, optim, batch, seed):
        from shardprop.demo.model import Llama, tp_plan
        self.cfg, self.batch, self.seed = cfg, batch, seed
        if name.startswith("floor"):
            build = megatron_sp_floor if name.startswith("floor SP") else megatron_floor
            model = build(cfg, seed, comm="shm" if name.endswith(" shm") else "gloo")
        elif name.startswith("ours"):
            import shardprop
            mesh = shardprop.init_device_mesh("cpu", (WORLD,))
            plan = tp_plan() if name == "ours titan" else per_linear_plan(shardprop)
            model = shardprop.parallelize_module(Llama(cfg, seed), mesh, plan)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor.parallel import parallelize_module
            mesh = init_device_mesh("cpu", (WORLD,))
            model = parallelize_module(Llama(cfg, seed), mesh, tp_plan(torch_styles()))
        self.model = model
        self.sync_grads = getattr(model, "sync_grads", None)
        self.opt = make_optimizer(optim, model.parameters())

    def step(self, i):
        from shardprop.demo.model import lm_loss, synthetic_batch
        tokens, targets = synthetic_batch(self.cfg, self.batch, i, self.seed)
        loss = lm_loss(self.model(tokens), targets)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if self.sync_grads is not None:
            self.sync_grads()
        self.opt.step()
        loss = loss.detach()
        return loss.full_tensor() if hasattr(loss, "full_tensor") else loss


def _sizes(args) -> dict:
    demo = {k: args[k] for k in ("dim", "layers", "heads", "vocab", "seq", "batch")}
    return {"demo": demo, "issue": dict(ISSUE_SIZE)}


def _over(med: dict, base: str, names) -> dict:
    """``names``' medians over ``base``'s (empty when ``base`` did not run)."""
    return {name: med[name] / med[base] for name in names if name in med} if base in med else {}


def bench_ranks(rank, world, args):
    from shardprop.demo.model import LlamaConfig
    warnings.filterwarnings("ignore")
    out = {}
    for size in args["sizes"]:
        m = _sizes(args)[size]
        cfg = LlamaConfig(dim=m["dim"], n_layers=m["layers"], n_heads=m["heads"], vocab_size=m["vocab"],
                          seq_len=m["seq"])
        for optim in args["optims"]:
            cs = {name: _Contender(name, cfg, optim, m["batch"], args["seed"]) for name in args["contenders"]}
            losses = {name: c.step(0).item() for name, c in cs.items()}
            samples, _ = time_interleaved(cs, args["warmup"], args["reps"])
            med = {name: statistics.median(s) for name, s in samples.items()}
            out[f"{size} {optim}"] = dict(model=m, median_ms=med, samples_ms=samples, first_loss=losses,
                                          ratio={name: ms / med["floor"] for name, ms in med.items()}
                                          if "floor" in med else {},
                                          ratio_sp=_over(med, "floor SP", SP_RATIO),
                                          ratio_shm=_over(med, "floor shm", SHM_RATIO),
                                          ratio_sp_shm=_over(med, "floor SP shm", SP_SHM_RATIO))
    return out


def report(results, args) -> list:
    from tabulate import tabulate
    rows, misses = [], []
    for key, r in results.items():
        base = "floor" if "floor" in r["first_loss"] else next(iter(r["first_loss"]))
        floor_loss = r["first_loss"][base]
        for name, ms in r["median_ms"].items():
            loss = r["first_loss"][name]
            rows.append([key, name, ms] + [r.get(k, {}).get(name) for k in ("ratio", "ratio_sp", "ratio_shm",
                                                                           "ratio_sp_shm")] + [loss])
            if abs(loss - floor_loss) > LOSS_RTOL * abs(floor_loss):
                misses.append(f"  {key} {name}: first-step loss {loss:.6f} vs {base}'s {floor_loss:.6f}")
            target = TARGETS.get(name)
            if target is not None and name in r["ratio"] and r["ratio"][name] > target:
                misses.append(f"  {key} {name}: {r['ratio'][name]:.2f}x the floor (> {target:.2f}x)")
    sizes = _sizes(args)
    print(f"\ntp={WORLD} (gloo; floors *shm: shardprop's collectives; 1 thread per rank), one step = fwd + bwd + "
          f"optimizer step; median of {args['reps']} interleaved steps, ms = max over ranks")
    for size in args["sizes"]:
        print(f"  {size}: " + ", ".join(f"{k} {v}" for k, v in sizes[size].items()))
    print()
    print(tabulate(rows, headers=["size optimizer", "contender", "ms/step", "x floor", "x floor SP", "x floor shm",
                                  "x floor SP shm", "first loss"],
                   floatfmt=".3f"))
    return print_targets("ours titan <= 1.10x floor, ours per-linear <= 1.25x floor, same losses", misses)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--sizes", default="demo,issue", help="comma-separated subset of demo,issue")
    ap.add_argument("--optims", default="sgd,adamw", help="comma-separated subset of sgd,adamw")
    ap.add_argument("--contenders", default=",".join(CONTENDERS),
                    help="comma-separated subset of " + ", ".join(CONTENDERS) + " (floor first for ratios)")
    add_model_args(ap)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    if args.reps < 1 or args.warmup < 1:
        ap.error("--reps and --warmup must be at least 1")
    opts = {k: v for k, v in vars(args).items() if k != "json"}
    for k in ("sizes", "optims", "contenders"):
        opts[k] = tuple(s.strip() for s in opts[k].split(",") if s.strip())
    t0 = time.perf_counter()
    results = launch(bench_ranks, WORLD, opts, timeout_s=1800)
    misses = report(results, opts)
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")
    if args.json:
        results["_summary"] = dict(config=opts, world_size=WORLD, misses=misses)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
