"""autoplan against the hand plans on 4 CPU ranks: step time measured and predicted.

    python bench/autoplan.py [--calibrate] [--rounds 9] [--steps 2] [--models demo,titan-debug,hf-llama,hf-mixtral]

For each model the hand plans as torchtitan writes them (TP 4 with sequence parallelism, FSDP 4,
TP 2 x FSDP 2) and autoplan's own plan (same memory limit: ``--memory-gib``) are built once on
the same 4 gloo ranks and then timed in interleaved rounds (each round runs every plan
``--steps`` AdamW steps, the order rotating), so load from other processes on the machine
falls on all of them alike. A plan's step time is the median over its timed steps of the
slowest rank's time. autoplan's prediction is its cost model's (``CostModel.default()``: this
machine's calibration if ``shardprop.calibrate()`` saved one; ``--calibrate`` takes one first), for
its own plan and (``p``) for each hand plan's mesh shape.

Models: the demo Llama; torchtitan's debug model config (dim 256, 6 layers, 16 heads, vocab
2048: built with the demo Llama, whose module tree is torchtitan's); tiny HF Llama and Mixtral
(``transformers``, from configs; skipped when it is not installed).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _launch import launch  # noqa: E402

SEQ, BATCH = 128, 8


def build(name: str, seed: int = 0):
    """(model, loss(model, x, y), make_batch(step)) for a model name."""
    import torch.nn.functional as F

    from shardprop.demo.model import Llama, LlamaConfig, lm_loss, synthetic_batch

    if name in ("demo", "titan-debug"):
        cfg = (LlamaConfig(dim=256, n_layers=4, n_heads=8, vocab_size=1024, seq_len=SEQ) if name == "demo" else
               LlamaConfig(dim=256, n_layers=6, n_heads=16, vocab_size=2048, seq_len=SEQ, multiple_of=256))
        return Llama(cfg, seed), lambda m, x, y: lm_loss(m(x), y), lambda step: synthetic_batch(cfg, BATCH, step)
    from transformers import LlamaConfig as HFL, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    common = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=1024, max_position_embeddings=SEQ)
    if name == "hf-llama":
        model = LlamaForCausalLM(HFL(**common))
    else:
        model = MixtralForCausalLM(MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2))
    cfg = LlamaConfig(vocab_size=1024, seq_len=SEQ)

    def loss(m, x, y):
        logits = m(input_ids=x).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
    return model, loss, lambda step: synthetic_batch(cfg, BATCH, step)


def hand_plans(name: str):
    """torchtitan-style hand plans for the model, as (label, apply(model, meshes) -> (model, local_batch))."""
    import shardprop as sp
    from shardprop.demo.model import tp_plan

    def tp(model, mesh):
        if name.startswith("hf"):
            return sp.parallelize_hf(model, mesh)
        return sp.parallelize_module(model, mesh, tp_plan())

    def fsdp(model, mesh):
        layers = model.model.layers if name.startswith("hf") else model.layers
        for block in layers:
            sp.fully_shard(block, mesh=mesh)
        sp.fully_shard(model, mesh=mesh)
        return model

    def rows(dp, rank):
        return lambda t: t.chunk(dp)[rank] if dp > 1 else t

    return [
        ("TP 4", lambda m, M: (tp(m, M["tp4"]), rows(1, 0))),
        ("FSDP 4", lambda m, M: (fsdp(m, M["dp4"]), rows(4, dist.get_rank()))),
        ("TP 2 x FSDP 2", lambda m, M: (fsdp(tp(m, M["2x2"]["tp"]), M["2x2"]["dp"]), rows(2, dist.get_rank() // 2))),
    ]


def _ranks(rank, world, names, rounds, steps, memory_gib):
    import shardprop as sp
    from shardprop import autoplan
    from shardprop.planner import Shape

    torch.set_num_threads(1)
    meshes = {"tp4": sp.init_device_mesh("cpu", (4,), mesh_dim_names=("tp",)),
              "dp4": sp.init_device_mesh("cpu", (4,), mesh_dim_names=("dp",)),
              "2x2": sp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))}
    rows = []
    for name in names:
        try:
            build(name)
        except ImportError as e:
            rows.append((name, {}, None, str(e)))
            continue
        runs = {}
        for label, apply in hand_plans(name):
            model, loss, batch = build(name)
            model, local = apply(model, meshes)
            runs[label] = (model, loss, batch, local)
        model, loss, batch = build(name)
        tokens, _ = batch(0)
        plan = autoplan(model, 4, (tokens,), memory_per_rank=memory_gib * 2**30)
        # autoplan's cost model on each hand plan's shape (what it predicts for the hand plan).
        sp_ok = not name.startswith("hf")
        hand_pred = {label: autoplan(model, 4, (tokens,), shapes=[Shape(*shape)], sequence_parallel=sp_ok if shape[1] > 1
                                     else None).predicted_step_time
                     for label, shape in (("TP 4", (1, 4)), ("FSDP 4", (4, 1)), ("TP 2 x FSDP 2", (2, 2)))}
        mesh = {(4, 1): meshes["dp4"], (1, 4): meshes["tp4"], (2, 2): meshes["2x2"]}[(plan.shape.dp, plan.shape.tp)]
        runs["autoplan"] = (plan.apply(model, mesh), loss, batch, plan.local_batch)
        opts = {k: torch.optim.AdamW(v[0].parameters(), lr=1e-3, foreach=False) for k, v in runs.items()}
        times = {k: [] for k in runs}
        labels = list(runs)
        for r in range(rounds):
            for label in labels[r % len(labels):] + labels[:r % len(labels)]:
                model, loss_fn, batch, local = runs[label]
                for s in range(steps):
                    x, y = batch(r * steps + s)
                    t0 = time.perf_counter()
                    loss = loss_fn(model, local(x), local(y))
                    opts[label].zero_grad(set_to_none=True)
                    loss.backward()
                    opts[label].step()
                    took = torch.tensor([time.perf_counter() - t0])
                    dist.all_reduce(took, op=dist.ReduceOp.MAX)
                    if r > 0:  # round 0 warms up
                        times[label].append(took.item())
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append((name, med, (str(plan.shape) + (" +SP" if plan.sequence_parallel else "")
                                 + (" +AC" if plan.activation_checkpointing else ""), plan.predicted_step_time,
                                 hand_pred), ""))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--models", default="demo,titan-debug,hf-llama,hf-mixtral")
    p.add_argument("--memory-gib", type=float, default=2.0)
    p.add_argument("--calibrate", action="store_true", help="run shardprop.calibrate() first (saves this machine's costs)")
    args = p.parse_args(argv)
    from tabulate import tabulate

    from shardprop import CostModel, calibrate
    if args.calibrate:
        calibrate()

    rows = launch(_ranks, 4, args.models.split(","), args.rounds, args.steps, args.memory_gib, timeout_s=3000)
    table = []
    for name, med, auto, err in rows:
        if err:
            table.append([name] + ["-"] * 6 + [f"skipped: {err}"])
            continue
        hand = {k: v for k, v in med.items() if k != "autoplan"}
        best = min(hand, key=hand.get)
        choice, pred, hand_pred = auto
        table.append([name] + [f"{hand[k] * 1e3:.0f} (p {hand_pred[k] * 1e3:.0f})" for k in ("TP 4", "FSDP 4", "TP 2 x FSDP 2")]
                     + [choice, f"{med['autoplan'] * 1e3:.0f}", f"{pred * 1e3:.0f}",
                        f"{med['autoplan'] / hand[best]:.2f} (vs {best})"])
    print(tabulate(table, headers=["model", "TP 4 ms (pred)", "FSDP 4 ms (pred)", "TP2xFSDP2 ms (pred)",
                                   "autoplan's choice", "autoplan ms", "predicted ms", "ratio to best hand"]))
    print(f"(4 gloo ranks on this machine, medians of {args.rounds - 1} rounds x {args.steps} steps, interleaved; "
          f"costs: {CostModel.default().source})")


if __name__ == "__main__":
    main()
