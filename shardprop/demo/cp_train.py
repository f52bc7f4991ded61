"""``python -m shardprop.demo --cp N``: a long-sequence run with context parallelism, checked against one process.

The model is the demo's Llama with attention through ``F.scaled_dot_product_attention``; every
step shards the batch's tokens and targets and the RoPE tables on the sequence dim with
:func:`shardprop.context_parallel` over an ``N``-rank ``cp`` mesh (attention runs as ring
attention), averages the gradients over ``cp`` and steps the optimizer. Rank 0 then trains the
same model on the whole sequence in one process and compares every loss (PASS within 1e-4).

    python -m shardprop.demo --cp 4 --seq 4096 --steps 3 --batch 1
"""
from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist

from shardprop.demo.model import Llama, cp_buffers, lm_loss, make_optimizer, reference_losses, synthetic_batch

__all__ = ["cp_main"]


def cp_main(args, config_from, compare, rtol: float) -> dict:
    """Train on this rank of a ``cp`` mesh of every rank; returns a summary (``ok`` on rank 0)."""
    import shardprop
    from shardprop.mesh.collectives import all_reduce
    world, n = dist.get_world_size(), args.cp
    if world != n:
        raise SystemExit(f"--cp {n} wants {n} ranks, there are {world} (pass --nproc {n})")
    device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= n else "cpu"
    mesh = shardprop.init_device_mesh(device, (n,), mesh_dim_names=("cp",))
    say = print if dist.get_rank() == 0 else (lambda *a, **k: None)
    cfg = dataclasses.replace(config_from(args), sdpa=True)
    say(f"shardprop demo, context parallel: {n} ranks on {device}, seq {cfg.seq_len} ({cfg.seq_len // n} per rank), "
        f"dim {cfg.dim}, {cfg.n_layers} layers, {cfg.n_heads} heads, batch {args.batch}, {args.optimizer}")
    model = Llama(cfg, args.seed).to(device)
    opt = make_optimizer(args.optimizer, model.parameters())
    losses, times = [], []
    for step in range(args.steps):
        tokens, targets = (t.to(device) for t in synthetic_batch(cfg, args.batch, step, args.seed))
        buffers, dims = cp_buffers(model, tokens, targets)
        t0 = time.perf_counter()
        with shardprop.context_parallel(mesh, buffers=buffers, buffer_seq_dims=dims,
                                        no_restore_buffers={tokens, targets}):
            loss = lm_loss(model(tokens), targets)
            opt.zero_grad(set_to_none=True)
            loss.backward()
        for p in model.parameters():  # every rank saw its part of the sequence: average over cp
            all_reduce(p.grad, mesh, 0, "avg", inplace=True)
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(all_reduce(loss.detach().reshape(1).clone(), mesh, 0, "avg").item())
        say(f"step {step + 1:3d}/{args.steps}  loss {losses[-1]:.5f}  {times[-1] * 1e3:8.1f} ms")
    summary = dict(losses=losses, ok=None, max_rel=None)
    if dist.get_rank() == 0:
        t0 = time.perf_counter()
        ref = reference_losses(cfg, args.steps, args.batch, args.seed, args.optimizer, device=device)
        say(f"one process: {(time.perf_counter() - t0) / max(args.steps, 1) * 1e3:.1f} ms/step")
        worst = compare(losses, ref, say)
        ok = worst <= rtol
        say(f"\nmax relative difference {worst:.2e} (tolerance {rtol:g}): {'PASS' if ok else 'FAIL'}")
        summary.update(reference=ref, ok=ok, max_rel=worst)
    dist.barrier()
    return summary
