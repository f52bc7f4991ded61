"""Benchmark torch.compile over tensor parallelism: ours and the reference, compiled, against an eager floor.

Spawns ``--world`` CPU ranks (gloo, one thread each) on a 1-d tp mesh and trains the
demo's Llama (shardprop.demo.model, AdamW ``foreach=False``) with five contenders:

* ``floor``: Megatron-style tensor parallelism written by hand on plain local tensors,
  eager: pre-sliced weights (heads and hidden units split, output vocab split), one
  all-reduce per row-parallel output in forward (``wo``, ``w2``) and one per block input
  in backward (attention and MLP inputs), an all-gather of the logits. No DTensor, no
  sequence parallelism, no per-op Python beyond the model's own.
* ``ours eager`` / ``ref eager``: ``tp_plan`` (sequence parallel) under shardprop / torch.distributed.tensor.
* ``ours compiled`` / ``ref compiled``: the same models under ``torch.compile`` (inductor by default).
* ``ours compiled (no SP)`` / ``ref compiled (no SP)``: the floor's own layout as a plan
  (``megatron_plan``: no sequence parallelism, embedding and norms replicated), compiled: the
  apples-to-apples comparison with the floor (the same collectives; sequence parallelism trades
  each all-reduce for an all-gather plus a reduce-scatter, and all-reduces the norms' gradients).

One step = forward + backward + optimizer step (the optimizer runs eagerly for everyone, unless
``--compile-opt``: then every compiled contender compiles its ``opt.step`` with the same backend);
forward + backward is also timed on its own. After a warm-up (whose first step of a compiled
contender is its compile time, from empty inductor caches of its own, after torch.compile has
compiled one small unrelated function so that no contender pays for its lazy imports), contenders alternate; a barrier
precedes each timed step, each sample is the max over ranks; the table shows medians and
each median over the floor's median (same run). The first step's loss of every contender
is checked against the floor's.

Targets (issue 12): ours compiled <= ref compiled, ours compiled <= 1.0x the eager floor,
our compile time <= the reference's.

Usage::

    python bench/tp_compile.py [--world 2] [--reps 10] [--warmup 3] [--backend inductor] [--compile-opt]
                               [--contenders "floor,ours compiled (no SP)"] [--json out.json]
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
from tp_common import add_model_args, print_targets  # noqa: E402
from tp_floor import megatron_floor  # noqa: E402

LOSS_RTOL = 1e-4
CONTENDERS = ("floor", "ours eager", "ref eager", "ours compiled", "ref compiled", "ours compiled (no SP)",
              "ref compiled (no SP)")
NO_SP = " (no SP)"


# ---------------------------------------------------------------- contenders
def megatron_plan(P) -> dict:
    """The floor's layout as a plan: tp_plan without sequence parallelism (``P``: whose styles).

    Activations between blocks stay replicated plain tensors; each block's input becomes one
    Replicate DTensor (PrepareModuleInput) that q, k, v (or w1, w3) share, so their Partial input
    gradients add up locally and reduce once, like the floor's ``_CopyToTP``. Embedding and norms
    stay plain, as in the floor. Collectives per step: the floor's exactly.
    """
    R = P.Replicate()
    plan = {"output": P.ColwiseParallel(output_layouts=R)}
    for block, cols, rows in (("attention", ("wq", "wk", "wv"), "wo"), ("feed_forward", ("w1", "w3"), "w2")):
        plan[f"layers.*.{block}"] = P.PrepareModuleInput(input_layouts=(R,), desired_input_layouts=(R,))
        for c in cols:
            plan[f"layers.*.{block}.{c}"] = P.ColwiseParallel()
        plan[f"layers.*.{block}.{rows}"] = P.RowwiseParallel()
    return plan


def _reference_styles():
    from types import SimpleNamespace

    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)
    return SimpleNamespace(Shard=Shard, Replicate=Replicate, ColwiseParallel=ColwiseParallel,
                           RowwiseParallel=RowwiseParallel, SequenceParallel=SequenceParallel,
                           PrepareModuleInput=PrepareModuleInput)


class _Contender:
    def __init__(self, name, cfg, args):
        from shardprop.demo.model import Llama, make_optimizer, tp_plan
        self.name, self.cfg, self.batch, self.seed = name, cfg, args["batch"], args["seed"]
        from shardprop.demo.model import shardprop_styles
        world = dist.get_world_size()
        plan = megatron_plan if name.endswith(NO_SP) else tp_plan
        if name == "floor":
            model = megatron_floor(cfg, self.seed)
        elif name.startswith("ours"):
            import shardprop
            mesh = shardprop.init_device_mesh("cpu", (world,))
            model = shardprop.parallelize_module(Llama(cfg, self.seed), mesh, plan(shardprop_styles()))
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor.parallel import parallelize_module
            mesh = init_device_mesh("cpu", (world,))
            model = parallelize_module(Llama(cfg, self.seed), mesh, plan(_reference_styles()))
        self.model = model
        self.opt = make_optimizer("adamw", model.parameters())
        self.compiled = "compiled" in name
        self.run = torch.compile(model, backend=args["backend"]) if self.compiled else model
        # --compile-opt: every compiled contender compiles its optimizer step too (the floor's stays eager).
        self.opt_step = (torch.compile(self.opt.step, backend=args["backend"])
                         if self.compiled and args.get("compile_opt") else self.opt.step)

    def step(self, i):
        """One training step on batch ``i``: (loss, seconds spent in forward + backward)."""
        from shardprop.demo.model import lm_loss, synthetic_batch
        tokens, targets = synthetic_batch(self.cfg, self.batch, i, self.seed)
        t0 = time.perf_counter()
        loss = lm_loss(self.run(tokens), targets)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        fwd_bwd = time.perf_counter() - t0
        self.opt_step()
        loss = loss.detach()
        return (loss.full_tensor() if hasattr(loss, "full_tensor") else loss), fwd_bwd


def _timed(fn):
    """(loss, step seconds, forward+backward seconds), each the max over ranks, after a barrier."""
    dist.barrier()
    t0 = time.perf_counter()
    loss, fwd_bwd = fn()
    el = torch.tensor([time.perf_counter() - t0, fwd_bwd])
    dist.all_reduce(el, op=dist.ReduceOp.MAX)
    return loss, el[0].item(), el[1].item()


def _warm_compiler(backend):
    """Compile a small unrelated function (matmul, relu, a functional all-reduce; forward and backward)
    once, before any contender: torch.compile imports much of itself lazily on its first use, and
    the first compiled contender would pay for it in its compile time."""
    group = dist.group.WORLD.group_name

    def fn(x, w):
        y = torch.relu(x @ w)
        return y + torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(y.detach(), "sum",
                                                                                               group))
    from torch._inductor.utils import fresh_cache
    with fresh_cache(delete=False):
        w = torch.randn(8, 8, requires_grad=True)
        torch.compile(fn, backend=backend)(torch.randn(4, 8), w).sum().backward()
    torch._dynamo.reset()


def _first_step_cpu(c):
    """Step 0 as (loss, wall s, CPU s of this process), each the max over ranks. The CPU seconds are
    the compile work itself, not stretched by other processes on a shared machine; they include
    inductor's kernel builds only when those run in-process (``--serial-compile``)."""
    cpu0 = time.process_time()
    loss, el, _ = _first_step(c)
    cpu = torch.tensor([time.process_time() - cpu0])
    dist.all_reduce(cpu, op=dist.ReduceOp.MAX)
    return loss, el, cpu.item()


def _first_step(c):
    """Step 0; a compiled contender compiles here, from empty inductor caches of its own (a fresh
    directory and cleared in-memory caches), so no contender reuses kernels another compiled."""
    if not c.compiled:
        return _timed(lambda: c.step(0))
    from torch._inductor.utils import fresh_cache
    with fresh_cache(delete=False):
        return _timed(lambda: c.step(0))


def bench_ranks(rank, world, args):
    from shardprop.demo.model import LlamaConfig
    warnings.filterwarnings("ignore")
    cfg = LlamaConfig(dim=args["dim"], n_layers=args["layers"], n_heads=args["heads"], vocab_size=args["vocab"],
                      seq_len=args["seq"])
    names = [n for n in CONTENDERS if n in args["contenders"]]
    cs = {name: _Contender(name, cfg, args) for name in names}
    first_loss, first_s, first_cpu = {}, {}, {}
    if args.get("serial_compile"):
        import torch._inductor.config as inductor_config
        inductor_config.compile_threads = 1
    if any(c.compiled for c in cs.values()):
        _warm_compiler(args["backend"])
    for name, c in cs.items():  # step 0: correctness check, and a compiled contender's compile
        loss, el, cpu = _first_step_cpu(c)
        first_loss[name], first_s[name], first_cpu[name] = loss.item(), el, cpu
    for w in range(1, args["warmup"]):
        for c in cs.values():
            c.step(w)
    samples = {name: [] for name in cs}
    fb_samples = {name: [] for name in cs}
    step = args["warmup"]
    for _ in range(args["reps"]):
        for name, c in cs.items():
            _, el, fb = _timed(lambda: c.step(step))
            samples[name].append(el * 1e3)
            fb_samples[name].append(fb * 1e3)
        step += 1
    med = {name: statistics.median(s) for name, s in samples.items()}
    fb_med = {name: statistics.median(s) for name, s in fb_samples.items()}
    return dict(median_ms=med, fwd_bwd_median_ms=fb_med, samples_ms=samples, fwd_bwd_samples_ms=fb_samples,
                first_loss=first_loss, first_step_s=first_s, first_step_cpu_s=first_cpu)


def report(r, args) -> list:
    from tabulate import tabulate
    med, floor = r["median_ms"], r["median_ms"].get("floor")
    fb, fb_floor = r["fwd_bwd_median_ms"], r["fwd_bwd_median_ms"].get("floor")
    rows = []
    for name, ms in med.items():
        compile_s = r["first_step_s"][name] - ms / 1e3 if "compiled" in name else None
        compile_cpu = r["first_step_cpu_s"][name] if "compiled" in name else None
        rows.append([name, ms, ms / floor if floor else None, fb[name], fb[name] / fb_floor if fb_floor else None,
                     compile_s, compile_cpu, r["first_loss"][name]])
    print(f"\ntp={args['world']}: Llama dim {args['dim']}, {args['layers']} layers, seq {args['seq']}, batch "
          f"{args['batch']}; AdamW; gloo, 1 thread per rank; torch.compile backend {args['backend']}; "
          f"median of {args['reps']} interleaved steps, ms = max over ranks\n")
    print(tabulate(rows, headers=["contender", "ms/step", "x floor", "fwd+bwd ms", "x floor",
                                  "compile s (first step - median)", "first step CPU s", "first loss"], floatfmt=".3f"))
    if args.get("compile_opt"):
        print("\n(ms/step includes the optimizer step: compiled (same backend) for the compiled contenders, "
              "eager for the others)")
    else:
        print("\n(ms/step includes the optimizer step, which runs eagerly for every contender: on DTensor "
              "parameters through the dispatcher, on plain tensors for the floor)")
    print("(no SP: the floor's layout as a plan, megatron_plan: replicated activations, one all-reduce per "
          "block output forward and per block input backward; the others: tp_plan, sequence parallel)")
    misses = []
    ref_loss = r["first_loss"].get("floor")
    for name, loss in r["first_loss"].items():
        if ref_loss is not None and abs(loss - ref_loss) > LOSS_RTOL * abs(ref_loss):
            misses.append(f"  {name}: first-step loss {loss:.6f} vs the floor's {ref_loss:.6f}")
    for suffix in ("", NO_SP):
        ours, ref = "ours compiled" + suffix, "ref compiled" + suffix
        if ours in med and ref in med:
            if med[ours] > med[ref]:
                misses.append(f"  {ours} {med[ours]:.2f} ms > {ref} {med[ref]:.2f} ms")
            # With --serial-compile the compile work is all in-process: compare CPU seconds, which other
            # processes on a shared machine do not stretch; otherwise wall seconds.
            key, unit = ("first_step_cpu_s", "CPU s") if args.get("serial_compile") else ("first_step_s", "s")
            ours_c, ref_c = r[key][ours], r[key][ref]
            if ours_c > ref_c:
                misses.append(f"  {ours}: first (compiling) step {ours_c:.1f} {unit} > the reference's {ref_c:.1f}")
        if floor and ours in med and med[ours] > floor:
            misses.append(f"  {ours} {med[ours] / floor:.2f}x the eager floor (> 1.0)")
    return print_targets("ours compiled <= ref compiled and <= 1.0x floor, compile time <= ref's, same loss", misses)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2, help="tp ranks (default 2)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--serial-compile", action="store_true",
                    help="inductor builds kernels in-process (compile_threads=1): the first step's CPU seconds "
                         "then count all of a contender's compile work")
    ap.add_argument("--compile-opt", action="store_true",
                    help="compiled contenders compile their optimizer step too (the floor's stays eager)")
    ap.add_argument("--contenders", default=",".join(CONTENDERS), help="comma-separated subset of " + ", ".join(CONTENDERS))
    add_model_args(ap)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    opts = {k: v for k, v in vars(args).items() if k != "json"}
    opts["contenders"] = tuple(s.strip() for s in args.contenders.split(","))
    t0 = time.perf_counter()
    r = launch(bench_ranks, args.world, opts, timeout_s=900)
    misses = report(r, opts)
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")
    if args.json:
        r["_summary"] = dict(config=opts, misses=misses)
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
