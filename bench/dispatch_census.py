"""Count every DTensor dispatch of one training step and attribute it: forward, backward, optimizer.

The cost of an eager TP step above hand-written TP is mostly per-op Python: every
``__torch_dispatch__`` entry on a DTensor. This prints, for the demo model on 4 CPU
ranks (tp=4, the torchtitan-style plan), how many dispatches each phase of one
step makes, for SGD and AdamW with ``foreach`` left at torch's default (None), on and off, and the ops that make
most of them, so work on the step's speed starts from where the dispatches are.

Counts come from the dispatcher's own per-op counters (``shardprop.cache_stats()``).

    python bench/dispatch_census.py [--dim 64] [--layers 2] [--top 8] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _launch import launch  # noqa: E402

OPTIMIZERS = [("sgd", None), ("sgd", False), ("sgd", True), ("adamw", None), ("adamw", False), ("adamw", True)]  # None: torch's default


def _counts() -> Counter:
    import shardprop
    return Counter({r["op"]: r["calls"] for r in shardprop.cache_stats()})


def _phase(fn) -> Counter:
    """Dispatches made while ``fn`` runs, per op."""
    before = _counts()
    fn()
    return _counts() - before


def census(rank, world, args):
    import shardprop
    from shardprop.demo.model import Llama, LlamaConfig, lm_loss, synthetic_batch, tp_plan
    cfg = LlamaConfig(dim=args["dim"], n_layers=args["layers"], n_heads=4, vocab_size=64, seq_len=16)
    mesh = shardprop.init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = {}
    for name, foreach in OPTIMIZERS:
        model = shardprop.parallelize_module(Llama(cfg, 0), mesh, tp_plan())
        params = list(model.parameters())
        opt = (torch.optim.SGD(params, lr=0.1, foreach=foreach) if name == "sgd"
               else torch.optim.AdamW(params, lr=1e-2, foreach=foreach))
        tokens, targets = synthetic_batch(cfg, 4, 0)
        for _ in range(2):  # warm the caches (and create optimizer state)
            opt.zero_grad(set_to_none=True)
            lm_loss(model(tokens), targets).backward()
            opt.step()
        box = {}
        fwd = _phase(lambda: box.setdefault("loss", lm_loss(model(tokens), targets)))
        bwd = _phase(lambda: box["loss"].backward())
        step = _phase(opt.step)
        zero = _phase(lambda: opt.zero_grad(set_to_none=True))
        out[f"{name} foreach={foreach}"] = dict(
            params=len(params),
            phases={"forward": dict(fwd), "backward": dict(bwd), "optimizer": dict(step), "zero_grad": dict(zero)})
    return out


def report(results, top: int) -> None:
    from tabulate import tabulate
    rows = []
    for key, r in results.items():
        ph = r["phases"]
        tot = {k: sum(v.values()) for k, v in ph.items()}
        rows.append([key, r["params"], tot["forward"], tot["backward"], tot["optimizer"],
                     f"{tot['optimizer'] / r['params']:.1f}", sum(tot.values())])
    print("DTensor dispatches per training step (demo model, tp=4)")
    print(tabulate(rows, headers=["optimizer", "params", "forward", "backward", "optimizer", "opt/param", "total"]))
    first = next(iter(results.values()))["phases"]
    for phase in ("forward", "backward"):
        print(f"\nmost frequent ops in {phase}")
        print(tabulate(Counter(first[phase]).most_common(top), headers=["op", "calls"]))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--json")
    a = p.parse_args(argv)
    results = launch(census, 4, dict(dim=a.dim, layers=a.layers))
    report(results, a.top)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
