"""The training recipes side by side: shardprop vs torch's own stack (torch.distributed.tensor + torch's fully_shard).

For each recipe of ``tests/recipes.py`` (activation checkpointing in every form, TP, HSDP, LoRA,
compile, accumulation + clipping), on 4 gloo ranks in one run: whether 3 AdamW steps equal one
process (losses and parameters within 1e-4), per rank. For the memory recipes (dp=4 fully_shard
with no AC, full AC and selective AC, and 2x2 TP + fully_shard with and without AC) on a larger
model: the peak tensor memory of one training step (forward + backward, after a warm-up step) and
the all-gathers and reduce-scatters it issues, both engines on the same ranks, alternating.

Peak memory is measured the same way for both engines: a ``TorchDispatchMode`` that, after each
op, sums the bytes of every live tensor storage (weak references, so a tensor autograd keeps for
backward counts until backward frees it; a DTensor counts its local shard; parameters, shards and
optimizer state that exist before the step count as well). Memory outside torch's dispatcher
(the transports' own buffers) is not counted, for either engine. The buffers shardprop's CPU
buffer pool keeps idle for reuse (``shardprop.mesh.transport.buffer_pool``) are counted: the table also shows
their peak.

    python bench/recipes.py [--dim 256] [--layers 4] [--seq 128] [--batch 8] [--json out.json]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import weakref

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from _launch import launch  # noqa: E402
from shardprop.mesh.transport import buffer_pool  # noqa: E402
from tests import recipes  # noqa: E402

MEMORY_RECIPES = {
    "fsdp": dict(),
    "fsdp+ac": dict(ac="full"),
    "fsdp+selective-ac": dict(ac="selective"),
    "lora+fsdp+ac": dict(lora=True, ac="full"),
    "tp+fsdp": dict(mesh="2x2"),
    "tp+fsdp+ac": dict(mesh="2x2", ac="full"),
}


def _storage(t):
    local = getattr(t, "_local_tensor", None)
    t = local if isinstance(local, torch.Tensor) else t
    try:
        return t.untyped_storage()
    except Exception:  # noqa: BLE001 - meta, sparse, ...: nothing to count
        return None


class PeakBytes(TorchDispatchMode):
    """Peak bytes of live tensor storages, checked after every op (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = {}
        for obj in gc.get_objects():  # what exists before the step: parameters, shards, optimizer state
            if isinstance(obj, torch.Tensor):
                self._add(obj)
        self.peak = self.now()

    def _add(self, t) -> None:
        st = _storage(t)
        if st is not None and st.device.type != "meta":
            key = st._cdata
            if key not in self.live:
                self.live[key] = weakref.ref(st)

    def now(self) -> int:
        # Buffers shardprop's pool keeps idle for reuse count too (they are held memory); `idle`
        # reports their peak beside the figure.
        self.idle = max(getattr(self, "idle", 0), buffer_pool.idle_bytes())
        total, dead = 0, []
        for key, ref in self.live.items():
            st = ref()
            if st is None:
                dead.append(key)
            else:
                total += st.nbytes()
        for key in dead:
            del self.live[key]
        return total

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t)
        self.peak = max(self.peak, self.now())
        return out


def _collectives(engine, step):
    """{kind: count} of the collectives ``step()`` issues (shardprop's counter; torch's CommDebugMode)."""
    if engine == "shardprop":
        from shardprop import comm_counter
        with comm_counter() as c:
            step()
        return {k: n for k, (n, _) in c.counts.items()}
    from torch.distributed.tensor.debug import CommDebugMode
    with CommDebugMode() as c:
        step()
    out = {}
    for op, n in c.get_comm_counts().items():
        name = str(op)
        kind = ("all_gather" if "gather" in name else "reduce_scatter" if "reduce_scatter" in name
                else "all_reduce" if "all_reduce" in name or "allreduce" in name else name)
        out[kind] = out.get(kind, 0) + n
    return out


def _memory_job(recipe, engine, size):
    from shardprop.demo.model import lm_loss, synthetic_batch
    size = dict(size)
    batch = size.pop("batch")
    cfg = recipes.cfg(**size)
    model, dp = recipes.build(recipe, engine, config=cfg)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

    def step(i):
        x, y = (recipes._rows(t, dp) for t in synthetic_batch(cfg, batch, i, 0))
        lm_loss(model(x), y).backward()

    step(0)  # warm-up: the optimizer state exists from here on, as in a long run
    opt.step()
    opt.zero_grad(set_to_none=True)
    counts = _collectives(engine, lambda: step(1))
    opt.step()
    opt.zero_grad(set_to_none=True)
    gc.collect()
    with PeakBytes() as mem:
        base = mem.peak
        step(2)
    opt.zero_grad(set_to_none=True)
    peak = torch.tensor([float(mem.peak), float(mem.peak - base), float(getattr(mem, "idle", 0))])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return dict(peak=int(peak[0]), above_start=int(peak[1]), pool_idle=int(peak[2]), counts=counts)


def _body(rank, world, size):
    results = {"correct": {}, "memory": {}}
    for name, recipe in recipes.RECIPES.items():
        want = recipes.reference(recipe)
        for engine in ("shardprop", "torch"):
            try:
                got = recipes.train(recipe, engine)
                problems = recipes.compare(got, want)
                ok = torch.tensor([0.0 if problems else 1.0])
                note = problems[0] if problems else ""
            except Exception as e:  # noqa: BLE001 - a recipe the engine cannot run is a result
                ok, note = torch.tensor([0.0]), f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            results["correct"][(name, engine)] = (bool(ok.item()), note)
    for name, recipe in MEMORY_RECIPES.items():
        for engine in ("shardprop", "torch"):  # same ranks, one after the other
            gc.collect()
            results["memory"][(name, engine)] = _memory_job(recipe, engine, size)
    return results


def _fmt(n):
    return f"{n / 2**20:.2f} MiB"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--json")
    a = p.parse_args(argv)
    size = dict(dim=a.dim, n_layers=a.layers, seq_len=a.seq, n_heads=8, vocab_size=512, batch=a.batch)
    print(f"torch {torch.__version__}; 4 gloo ranks; memory model: dim {a.dim}, {a.layers} layers, seq {a.seq}, "
          f"batch {a.batch} (fp32)")
    res = launch(_body, 4, size, timeout_s=1200)
    print("\nrecipe (3 AdamW steps vs one process, every rank)      shardprop   torch's stack")
    for name in recipes.RECIPES:
        ours, theirs = res["correct"][(name, "shardprop")], res["correct"][(name, "torch")]
        mark = lambda r: "pass" if r[0] else "FAIL"  # noqa: E731
        print(f"  {name:<50} {mark(ours):<11} {mark(theirs)}")
        for who, r in (("shardprop", ours), ("torch", theirs)):
            if not r[0]:
                print(f"      {who}: {r[1]}")
    print("\npeak tensor memory of one training step above what is resident before it (activations, gathered")
    print("parameters, gradients; max over ranks), and the step's all-gathers and reduce-scatters")
    print(f"  {'recipe':<20} {'shardprop':>12} {'torch':>12} {'ratio':>6} {'pool idle':>10}   collectives shardprop | torch")
    rows = []
    for name in MEMORY_RECIPES:
        o, t = res["memory"][(name, "shardprop")], res["memory"][(name, "torch")]
        ratio = o["above_start"] / t["above_start"]
        fmt_c = lambda c: ", ".join(f"{k} {v}" for k, v in sorted(c.items()) if "gather" in k or "scatter" in k)  # noqa: E731
        print(f"  {name:<20} {_fmt(o['above_start']):>12} {_fmt(t['above_start']):>12} {ratio:6.2f} "
              f"{_fmt(o['pool_idle']):>10}   {fmt_c(o['counts'])} | "
              f"{fmt_c(t['counts'])}")
        rows.append(dict(recipe=name, shardprop=o, torch=t, ratio=ratio))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(correct={f"{n}|{e}": v for (n, e), v in res["correct"].items()}, memory=rows), f, indent=1)


if __name__ == "__main__":
    main()
