"""Benchmark tensor parallelism: the demo model under shardprop vs torch.distributed.tensor.parallel.

Spawns 4 CPU ranks (gloo on 127.0.0.1, one thread each). On a 1-d tp=4 mesh and a
2x2 ("dp", "tp") mesh, the demo's Llama model (shardprop.demo.model, no dropout) is
parallelized with the same plan (``shardprop.demo.model.tp_plan``, built once from
shardprop's styles and once from torch's) and trained with AdamW
(``foreach=False`` for both). One step = forward + backward + dp gradient
averaging + optimizer step.

dp gradient averaging:
* ours:      ``shardprop.data_parallel.replicate_gradients`` (async bucketed
             all-reduce launched from autograd hooks, waited before the step);
* reference: the same bucket assignment, each bucket's local gradients packed
             and all-reduced synchronously after backward (plain per-bucket
             all-reduce; the reference's DTensor has no bucketing of its own).

The two contenders alternate step by step after a warm-up; a ``dist.barrier()``
precedes every timed step, each sample is the max over ranks, the table shows
medians and ours/ref. Collectives per step are counted on rank 0 over one step:
ours with ``shardprop.comm_counter()``, the reference with
``torch.distributed.tensor.debug.CommDebugMode`` (counts only; it also sees the
plain c10d all-reduces of the dp buckets, listed as "allreduce"). The first step's loss of each contender is checked against the other.

Targets: ours/ref <= 1.0 and no more collectives per step than the reference.

Usage::

    python bench/tp.py [--reps 10] [--warmup 3] [--dim 64] [--layers 2] [--batch 8] [--json out.json]
    python bench/tp.py --compile [...]   # torch.compile contenders vs an eager Megatron floor (tp_compile.py)
    python bench/tp.py --floor [...]     # eager contenders vs the hand-written Megatron floor (below)

``--floor`` (issue 13) times, on a 1-d tp=4 mesh, interleaved, one step = forward + backward +
optimizer step:

* ``floor``: the hand-written Megatron TP on plain local tensors (``bench/tp_floor.py``);
* ``floor SP``: the same with sequence parallelism, communicating exactly as ``tp_plan`` does
  (the titan contenders are also shown over it: what is left once the plan's communication is paid);
* ``ours titan`` / ``ref titan``: ``tp_plan`` (torchtitan style, sequence parallel) under
  shardprop / torch.distributed.tensor;
* ``ours per-linear``: ColwiseParallel on wq/wk/wv/w1/w3/output (``output_layouts=Replicate()``
  for the logits), RowwiseParallel on wo/w2, nothing else (no sequence parallelism, no
  PrepareModuleInput; embedding and norms stay plain replicated tensors);

for SGD and AdamW (``foreach`` left at torch's default: off for CPU tensors) and two sizes:
``demo`` (the options below) and ``issue`` (Llama blocks where compute weighs more: dim 256,
8 heads, 2 layers, seq 128, batch 8, vocab 1024). Each contender's median is shown over the
floor's median of the same run; first-step losses must match the floor's.
Targets: ours titan <= 1.10x floor, ours per-linear <= 1.25x floor.
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
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _launch import launch  # noqa: E402
# Shared with tp_compile.py, tp_vs_floor.py and fsdp.py (kept importable from here too).
from tp_common import add_model_args, print_targets, time_interleaved, timed_step, torch_styles  # noqa: E402,F401

WORLD = 4
MESHES = {"tp4": (4,), "dp2xtp2": (2, 2)}
LOSS_RTOL = 1e-4


def _cfg(args):
    from shardprop.demo.model import LlamaConfig
    return LlamaConfig(dim=args["dim"], n_layers=args["layers"], n_heads=args["heads"],
                       vocab_size=args["vocab"], seq_len=args["seq"])


class _RefBuckets:
    """The reference's dp averaging: our bucket assignment, one synchronous all-reduce per bucket."""

    def __init__(self, model, group, dp_size):
        from shardprop.parallel.dp.data_parallel import DEFAULT_SIZE_LIMITS, compute_bucket_assignment_by_size
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buckets = compute_bucket_assignment_by_size([p.to_local() for p in self.params],
                                                         DEFAULT_SIZE_LIMITS)
        self.group, self.n = group, dp_size

    @torch.no_grad()
    def finish(self):
        for idx in self.buckets:
            grads = [self.params[i].grad.to_local() for i in idx]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.group)
            flat /= self.n
            off = 0
            for g in grads:
                g.copy_(flat[off:off + g.numel()].view(g.shape))
                off += g.numel()


class _Contender:
    """A parallelized model, its optimizer and its dp averaging; ``step(i)`` trains on batch ``i``."""

    def __init__(self, name, cfg, mesh_shape, args):
        from shardprop.demo.model import Llama, make_optimizer, tp_plan
        self.name, self.cfg, self.batch, self.seed = name, cfg, args["batch"], args["seed"]
        names = ("tp",) if len(mesh_shape) == 1 else ("dp", "tp")
        model = Llama(cfg, self.seed)
        if name == "ours":  # public names only: bench/ab.py runs this against older commits too
            import shardprop
            mesh = shardprop.init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
            tp = mesh["tp"] if len(mesh_shape) == 2 else mesh
            self.model = shardprop.parallelize_module(model, tp, tp_plan())
            self.sync = shardprop.replicate_gradients(self.model, mesh, "dp") if len(mesh_shape) == 2 else None
            self.dp = (mesh.size(0), mesh.get_local_rank(0)) if len(mesh_shape) == 2 else (1, 0)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor.parallel import parallelize_module
            mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
            tp = mesh["tp"] if len(mesh_shape) == 2 else mesh
            self.model = parallelize_module(model, tp, tp_plan(torch_styles()))
            if len(mesh_shape) == 2:
                self.sync = _RefBuckets(self.model, mesh.get_group("dp"), mesh.size(0))
                self.dp = (mesh.size(0), mesh.get_local_rank("dp"))
            else:
                self.sync, self.dp = None, (1, 0)
        self.opt = make_optimizer("adamw", self.model.parameters())

    def step(self, i):
        from shardprop.demo.model import lm_loss, synthetic_batch
        n, r = self.dp
        tokens, targets = synthetic_batch(self.cfg, self.batch, i, self.seed)
        k = self.batch // n
        tokens, targets = tokens[r * k:(r + 1) * k], targets[r * k:(r + 1) * k]
        loss = lm_loss(self.model(tokens), targets)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if self.sync is not None:
            self.sync.finish()
        self.opt.step()
        return loss.detach()


def _count_ours(c, i):
    from shardprop import comm_counter
    with comm_counter() as k:
        c.step(i)
    return {kind: [n, b] for kind, (n, b) in sorted(k.counts.items())}


def _count_ref(c, i):
    from torch.distributed.tensor.debug import CommDebugMode
    # CommDebugMode sees DTensor's functional collectives and plain c10d calls (the dp buckets:
    # "allreduce") alike. Its module tracker's full backward hooks warn on every backward.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        with CommDebugMode() as mode:
            c.step(i)
    counts = {}
    for op, n in mode.get_comm_counts().items():
        kind = str(op).split(".")[-1] if "." in str(op) else str(op)
        kind = kind.replace("_c10d_functional", "").strip("_") or str(op)
        counts[kind] = counts.get(kind, 0) + n
    return dict(sorted(counts.items()))


def bench_ranks(rank, world, args):
    torch.manual_seed(0)
    cfg = _cfg(args)
    out = {}
    for key, shape in MESHES.items():
        cs = {name: _Contender(name, cfg, shape, args) for name in ("ours", "ref")}
        losses = {}  # step 0 is the first warm-up step and the correctness check
        for name, c in cs.items():
            loss = c.step(0)
            loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
            losses[name] = loss.item()
        samples, step = time_interleaved(cs, args["warmup"], args["reps"])
        counts = {"ours": _count_ours(cs["ours"], step), "ref": _count_ref(cs["ref"], step)}
        med = {name: statistics.median(s) for name, s in samples.items()}
        out[key] = dict(mesh=list(shape), ours_ms=med["ours"], ref_ms=med["ref"], ratio=med["ours"] / med["ref"],
                        samples_ms=samples, first_loss=losses, collectives=counts,
                        ours_collectives_total=sum(n for n, _ in counts["ours"].values()),
                        ref_collectives_total=sum(counts["ref"].values()))
    return out


def _fmt_counts(counts, with_bytes):
    if with_bytes:
        return ", ".join(f"{k} {n} ({b / 1024:.1f} KB)" for k, (n, b) in counts.items())
    return ", ".join(f"{k} {n}" for k, n in counts.items())


def report(results, args) -> list:
    from tabulate import tabulate
    rows, misses = [], []
    for key, r in results.items():
        rows.append([key, r["ours_ms"], r["ref_ms"], r["ratio"], r["ours_collectives_total"],
                     r["ref_collectives_total"]])
        a, b = r["first_loss"]["ours"], r["first_loss"]["ref"]
        if abs(a - b) > LOSS_RTOL * abs(b):
            misses.append(f"  {key}: first-step loss differs: ours {a:.6f} vs reference {b:.6f}")
        if r["ratio"] > 1.0:
            misses.append(f"  {key}: step time ours/ref {r['ratio']:.2f} > 1.0")
        if r["ours_collectives_total"] > r["ref_collectives_total"]:
            misses.append(f"  {key}: {r['ours_collectives_total']} collectives per step vs the reference's "
                          f"{r['ref_collectives_total']}")
    print(f"\ntp: Llama dim {args['dim']}, {args['layers']} layers, {args['heads']} heads, vocab {args['vocab']}, "
          f"seq {args['seq']}, batch {args['batch']}; AdamW; {WORLD} ranks (gloo, 1 thread each); "
          f"median of {args['reps']} steps, ms = max over ranks\n")
    print(tabulate(rows, headers=["mesh", "ours ms/step", "reference ms/step", "ours/ref", "ours colls/step",
                                  "ref colls/step"], floatfmt=".2f"))
    print("\ncollectives per step (rank 0):")
    for key, r in results.items():
        print(f"  {key} ours:      {_fmt_counts(r['collectives']['ours'], True)}")
        print(f"  {key} reference: {_fmt_counts(r['collectives']['ref'], False)}")
    print("\nfirst-step losses: " + "; ".join(
        f"{k} ours {r['first_loss']['ours']:.6f} ref {r['first_loss']['ref']:.6f}" for k, r in results.items()))
    return print_targets("ours/ref <= 1.0, collectives <= reference's, same loss", misses)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--floor" in argv:  # eager contenders vs the hand-written Megatron floor
        from tp_vs_floor import main as floor_main
        floor_main([a for a in argv if a != "--floor"])
        return
    if "--compile" in argv:  # compiled contenders vs the eager Megatron floor: bench/tp_compile.py
        from tp_compile import main as compiled_main
        compiled_main([a for a in argv if a != "--compile"])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=10, help="timed steps per contender and mesh (default 10)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per contender first (default 3)")
    add_model_args(ap)
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON, keyed by mesh")
    args = ap.parse_args(argv)
    if args.reps < 1 or args.warmup < 1:
        ap.error("--reps and --warmup must be at least 1")
    opts = vars(args)
    t0 = time.perf_counter()
    results = launch(bench_ranks, WORLD, {k: v for k, v in opts.items() if k != "json"}, timeout_s=300)
    misses = report(results, opts)
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")
    results["_summary"] = dict(config={k: v for k, v in opts.items() if k != "json"}, world_size=WORLD,
                               misses=misses)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
