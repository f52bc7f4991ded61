"""Benchmark fully sharded data parallelism: shardprop.fully_shard vs torch.distributed.fsdp.fully_shard.

Spawns 4 CPU ranks (gloo on 127.0.0.1, one thread each). On a 1-d dp=4 mesh and a
2x2 ("dp", "tp") mesh (tp with the demo's plan first, then fully_shard over dp) the
demo's Llama model is trained with AdamW (``foreach=False``): each block, then the
model, is ``fully_shard``-ed (reshard_after_forward=True, float32). One step =
forward + backward + optimizer step. dp=4 also runs replicated data parallelism
(``replicate_gradients``) for the memory comparison.

Step time: the contenders alternate step by step after a warm-up; a barrier precedes
each timed step; a sample is the max over ranks; the table shows medians.
Peak memory per rank (rank 0): the bytes the parameters, gradients and optimizer
state hold at the start of a step (their storages, counted once) plus the highest
net growth of CPU allocations during one step (torch.profiler's allocation events,
which see autograd's saved tensors and storage resizes), counted from the allocation
counter at the step's start. Frees made on gloo's worker threads are not seen, for
either contender; a block is counted freed once its address is handed out again
(``_step_peak``; the JSON keeps the raw counter's figure too). Collectives per step: ours
with ``shardprop.comm_counter()``, the reference with ``CommDebugMode``.

The closing estimate: the largest demo model (layers x dim, vocab 256) whose
parameter + gradient + AdamW state + one gathered unit fits a per-rank cap, with
FSDP (dp=4) and with replicated data parallelism, from the per-parameter bytes
measured here (an estimate: activations excluded, they do not depend on the scheme).

Targets: ours/ref step time <= 1.0; peak memory <= the reference's; collectives <= the reference's.

Usage::

    python bench/fsdp.py [--reps 8] [--warmup 2] [--dim 64] [--layers 2] [--batch 8] [--cap-mb 1024] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _launch import launch  # noqa: E402
from tp import _Contender as TPContender  # noqa: E402
from tp import add_model_args, print_targets, time_interleaved  # noqa: E402

WORLD = 4
MESHES = {"dp4": (4,), "dp2xtp2": (2, 2)}


def _cfg(args):
    from shardprop.demo.model import LlamaConfig
    return LlamaConfig(dim=args["dim"], n_layers=args["layers"], n_heads=args["heads"],
                       vocab_size=args["vocab"], seq_len=args["seq"])


class _Contender:
    """A sharded model and its optimizer; ``step(i)`` trains on this dp rank's rows of batch ``i``."""

    def __init__(self, name, cfg, mesh_shape, args):
        from shardprop.demo.model import Llama, make_optimizer, tp_plan
        self.name, self.cfg, self.batch, self.seed = name, cfg, args["batch"], args["seed"]
        names = ("dp",) if len(mesh_shape) == 1 else ("dp", "tp")
        model = Llama(cfg, self.seed)
        self.sync = None
        if name in ("ours", "replicated"):
            import shardprop
            mesh = shardprop.init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
            if len(mesh_shape) == 2:
                model = shardprop.parallelize_module(model, mesh["tp"], tp_plan())
            dp = mesh["dp"] if len(mesh_shape) == 2 else mesh
            if name == "ours":
                for block in model.layers:
                    shardprop.fully_shard(block, mesh=dp)
                shardprop.fully_shard(model, mesh=dp)
            else:
                self.sync = shardprop.replicate_gradients(model, mesh, "dp")
            self.dp = (dp.size(), dp.get_local_rank())
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            from tp import torch_styles
            mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
            if len(mesh_shape) == 2:
                from torch.distributed.tensor.parallel import parallelize_module
                model = parallelize_module(model, mesh["tp"], tp_plan(torch_styles()))
            dp = mesh["dp"]
            for block in model.layers:
                fully_shard(block, mesh=dp)
            fully_shard(model, mesh=dp)
            self.dp = (dp.size(), dp.get_local_rank())
        self.model = model
        self.opt = make_optimizer("adamw", self.model.parameters())

    step = TPContender.step  # one step on this dp rank's rows, exactly as bench/tp.py's contenders train

    def state_bytes(self):
        """(parameter, optimizer-state) bytes this rank holds, each storage counted once."""
        def local(t):
            t = t.to_local() if hasattr(t, "to_local") else t
            return getattr(t, "_local_tensor", t)
        seen = set()

        def nbytes(ts):
            total = 0
            for t in ts:
                st = local(t).untyped_storage()
                if st.data_ptr() not in seen and st.nbytes():
                    seen.add(st.data_ptr())
                    total += st.nbytes()
            return total
        params = list(self.model.parameters())
        state = [v for s in self.opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return nbytes(params), nbytes(state), sum(local(p).numel() for p in params)


def _step_peak(c, i):
    """(highest net growth of CPU allocations during one step, the same from the raw counter).

    From torch.profiler's allocation events. The profiler misses a free made on a gloo worker
    thread (when the worker drops the last reference to a collective's buffer after the caller
    has let go of its handle, which is a matter of timing), so the raw counter can keep a freed
    block for the rest of the step. A block is known freed when the allocator hands its address
    out again while it still looks live; from then on it is not counted. Blocks freed unseen and
    never reused within the step are still counted (the figure can only be too high).
    """
    from torch._C._profiler import _EventType
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as p:
        c.step(i)
    allocs = []

    def walk(evs):
        for e in evs:
            if e.tag == _EventType.Allocation:
                f = e.extra_fields
                allocs.append((e.start_time_ns, f.alloc_size, f.total_allocated, f.ptr))
            walk(e.children)
    walk(p.profiler.kineto_results.experimental_event_tree())
    allocs.sort()
    if not allocs:
        return 0, 0
    # total_allocated is a process-wide counter that keeps what earlier profiled steps allocated and
    # freed unprofiled (e.g. the previous contender's gradients): measure from its value at the start.
    _, size0, total0, _ = allocs[0]
    base = total0 - size0
    live, unseen, peak, raw = {}, 0, 0, 0
    for _, size, total, ptr in allocs:
        if size > 0:
            unseen += live.get(ptr, 0)  # this address was freed where the profiler did not look
            live[ptr] = size
        else:
            live.pop(ptr, None)
        raw = max(raw, total - base)
        peak = max(peak, total - base - unseen)
    return peak, raw


def _count_ours(c, i):
    from shardprop import comm_counter
    with comm_counter() as k:
        c.step(i)
    return {kind: [n, b] for kind, (n, b) in sorted(k.counts.items())}


def bench_ranks(rank, world, args):
    import warnings
    from tp import _count_ref
    # the reference's fully_shard warns on every forward about its pre-backward hook registration
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    torch.manual_seed(0)
    cfg = _cfg(args)
    out = {}
    for key, shape in MESHES.items():
        names = ("ours", "ref") + (("replicated",) if len(shape) == 1 else ())
        cs = {name: _Contender(name, cfg, shape, args) for name in names}
        losses = {}
        for name, c in cs.items():
            losses[name] = c.step(0).item()
        samples, step = time_interleaved(cs, args["warmup"], args["reps"])
        mem = {}
        for name, c in cs.items():
            pbytes, sbytes, nparams = c.state_bytes()
            peak, raw = _step_peak(c, step)
            mem[name] = dict(param_bytes=pbytes, opt_state_bytes=sbytes, local_params=nparams, step_peak=peak,
                             step_peak_raw_counter=raw,
                             peak=pbytes + sbytes + peak)
        step += 1
        counts = {"ours": _count_ours(cs["ours"], step), "ref": _count_ref(cs["ref"], step)}
        med = {name: statistics.median(s) for name, s in samples.items()}
        units = [m._fsdp_unit.buffers.full_nbytes for m in cs["ours"].model.modules() if hasattr(m, "_fsdp_unit")]
        out[key] = dict(mesh=list(shape), ms=med, ratio=med["ours"] / med["ref"], samples_ms=samples,
                        first_loss=losses, collectives=counts, memory=mem, unit_full_bytes=units,
                        ours_collectives_total=sum(n for n, _ in counts["ours"].values()),
                        ref_collectives_total=sum(counts["ref"].values()))
    return out


def _params_of(layers, dim, vocab=256, multiple_of=32):
    """Parameter count of the demo Llama (untied embedding and output, no biases)."""
    h = int(2 * 4 * dim / 3)
    hidden = multiple_of * ((h + multiple_of - 1) // multiple_of)
    block = 4 * dim * dim + 3 * dim * hidden + 2 * dim
    return layers * block + 2 * vocab * dim + dim, block


def largest_models(results, cap_bytes, dp=4):
    """Largest (layers, dim) under the cap, FSDP vs replicated, from measured bytes per parameter."""
    mem = results["dp4"]["memory"]
    total = _params_of(results["_cfg"]["layers"], results["_cfg"]["dim"])[0]
    # bytes per (global) parameter this rank holds at a step's start: params + AdamW state
    per_ours = (mem["ours"]["param_bytes"] + mem["ours"]["opt_state_bytes"]) / total
    per_rep = (mem["replicated"]["param_bytes"] + mem["replicated"]["opt_state_bytes"]) / total
    grad_ours, grad_rep = 4 / dp, 4.0  # float32 gradients: sharded / whole
    out = {}
    for name, per, grad, unit in (("fsdp", per_ours, grad_ours, 2), ("replicated", per_rep, grad_rep, 0)):
        best = {}
        for dim in (256, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192):
            layers = 0
            while True:
                n, block = _params_of(layers + 1, dim)
                # FSDP also holds two gathered blocks at once (the current one and the prefetched one)
                need = n * (per + grad) + unit * block * 4
                if need > cap_bytes:
                    break
                layers += 1
                if layers > 4096:
                    break
            best[dim] = layers
        out[name] = dict(per_param_bytes=per + grad, layers_by_dim=best)
    return out


def report(results, args) -> list:
    from tabulate import tabulate
    rows, misses = [], []
    for key, r in results.items():
        if key.startswith("_"):
            continue
        m = r["memory"]
        rows.append([key, r["ms"]["ours"], r["ms"]["ref"], r["ratio"], m["ours"]["peak"] / 2**20,
                     m["ref"]["peak"] / 2**20, m.get("replicated", {}).get("peak", float("nan")) / 2**20,
                     r["ours_collectives_total"], r["ref_collectives_total"]])
        if r["ratio"] > 1.0:
            misses.append(f"  {key}: step time ours/ref {r['ratio']:.2f} > 1.0")
        if m["ours"]["peak"] > m["ref"]["peak"]:
            misses.append(f"  {key}: peak memory {m['ours']['peak'] / 2**20:.2f} MB > reference "
                          f"{m['ref']['peak'] / 2**20:.2f} MB")
        if r["ours_collectives_total"] > r["ref_collectives_total"]:
            misses.append(f"  {key}: {r['ours_collectives_total']} collectives per step vs the reference's "
                          f"{r['ref_collectives_total']}")
        a, b = r["first_loss"]["ours"], r["first_loss"]["ref"]
        if abs(a - b) > 1e-4 * abs(b):
            misses.append(f"  {key}: first-step loss ours {a:.6f} vs reference {b:.6f}")
    print(f"\nfsdp: Llama dim {args['dim']}, {args['layers']} layers, {args['heads']} heads, vocab {args['vocab']}, "
          f"seq {args['seq']}, batch {args['batch']}; AdamW; {WORLD} ranks (gloo, 1 thread each); "
          f"median of {args['reps']} steps, ms = max over ranks; memory on rank 0\n")
    print(tabulate(rows, headers=["mesh", "ours ms", "ref ms", "ours/ref", "ours peak MB", "ref peak MB",
                                  "replicated peak MB", "ours colls", "ref colls"], floatfmt=".2f"))
    print("\ncollectives per step (rank 0):")
    for key, r in results.items():
        if key.startswith("_"):
            continue
        print(f"  {key} ours:      " + ", ".join(f"{k} {n} ({b / 1024:.1f} KB)"
                                                 for k, (n, b) in r["collectives"]["ours"].items()))
        print(f"  {key} reference: " + ", ".join(f"{k} {n}" for k, n in r["collectives"]["ref"].items()))
        print(f"  {key} memory (bytes): " + "; ".join(f"{n}: params {m['param_bytes']}, adam {m['opt_state_bytes']}, "
                                                      f"step growth {m['step_peak']} (raw counter {m['step_peak_raw_counter']})"
                                                      for n, m in r["memory"].items()))
    est = results["_largest"]
    print(f"\nlargest demo model per {args['cap_mb']} MB/rank (estimate: params+grads+AdamW state+gathered "
          f"blocks, activations excluded) on 4 ranks, layers at each dim:")
    dims = list(est["fsdp"]["layers_by_dim"])
    print(tabulate([[name, f"{e['per_param_bytes']:.1f}"] + [e["layers_by_dim"][d] for d in dims]
                    for name, e in est.items()], headers=["scheme", "B/param"] + [f"dim {d}" for d in dims]))
    return print_targets("ours/ref <= 1.0, peak <= reference's, collectives <= reference's", misses)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    add_model_args(ap)
    ap.add_argument("--cap-mb", type=int, default=1024, help="per-rank memory cap for the largest-model estimate")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    opts = {k: v for k, v in vars(args).items() if k != "json"}
    t0 = time.perf_counter()
    results = launch(bench_ranks, WORLD, opts, timeout_s=600)
    results["_cfg"] = opts
    results["_largest"] = largest_models(results, args.cap_mb * 2**20)
    misses = report(results, opts)
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")
    results["_summary"] = dict(config=opts, world_size=WORLD, misses=misses)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
