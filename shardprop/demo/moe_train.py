"""``python -m shardprop.demo --moe``: a DeepSeek-style MoE layer trained with expert parallelism, checked against one process.

The model (:mod:`shardprop.demo.moe`): a top-2 router over 8 experts and a shared expert. With
``--mesh 4`` (the default on 4 ranks) the experts are sharded over ``ep=4`` with
:class:`shardprop.ExpertParallel`; with ``--mesh 2x2`` over ``ep=2 x tp=2`` with
:class:`shardprop.ExpertTensorParallel` (each expert's hidden dim split over tp). Each ep rank
trains on its rows of the same synthetic batch; the router's and the shared expert's gradients
are summed over ep (data parallel). Every step prints the loss, the collectives this rank
issued, and the tokens per expert with the load imbalance (:func:`shardprop.expert_load`). Rank
0 then trains the same model on the whole batch in one process and compares every loss.

    python -m shardprop.demo --moe --steps 5
    python -m shardprop.demo --moe --mesh 2x2
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from shardprop.demo.moe import MoE, synthetic_batch

__all__ = ["moe_main"]

EXPERTS, TOP_K = 8, 2


def _mesh(spec, world: int, device: str):
    import shardprop
    shape = (world,) if spec is None else tuple(int(s) for s in spec.lower().split("x"))
    if len(shape) == 1:
        mesh = shardprop.init_device_mesh(device, shape, mesh_dim_names=("ep",))
        return mesh, mesh["ep"], shardprop.ExpertParallel(), "ep"
    mesh = shardprop.init_device_mesh(device, shape, mesh_dim_names=("ep", "tp"))
    return mesh, mesh, shardprop.ExpertTensorParallel(), "ep"


def _loss(out, tgt, total: int):
    # Over the global element count: the ep ranks' losses sum to the one-process loss.
    return ((out - tgt) ** 2).sum() / total


def _reference(args, hidden: int, device: str) -> list:
    torch.manual_seed(args.seed)
    model = MoE(args.dim, hidden, EXPERTS, TOP_K).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(args.steps):
        x, tgt = (t.to(device) for t in synthetic_batch(step, args.batch, args.seq, args.dim, args.seed))
        loss = _loss(model(x), tgt, tgt.numel())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def moe_main(args, compare, rtol: float, device: str = "cpu") -> dict:
    """Train on this rank of an ep (or ep x tp) mesh of every rank; returns a summary (``ok`` on rank 0)."""
    import shardprop
    from shardprop.mesh.collectives import all_reduce
    mesh, target, style, ep = _mesh(args.mesh, dist.get_world_size(), device)
    n, me = mesh.size(ep), mesh.get_local_rank(ep)
    if args.batch % n:
        raise SystemExit(f"--batch {args.batch} does not split over ep={n}")
    say = print if dist.get_rank() == 0 else (lambda *a, **k: None)
    hidden = 2 * args.dim
    torch.manual_seed(args.seed)
    model = MoE(args.dim, hidden, EXPERTS, TOP_K).to(device)
    shardprop.parallelize_module(model.experts, target, style)
    say(f"shardprop demo, mixture of experts: {type(style).__name__} on mesh {dict(zip(mesh.mesh_dim_names, mesh.shape))} "
        f"({device}), {EXPERTS} experts top-{TOP_K} + a shared expert, dim {args.dim}, hidden {hidden}, "
        f"batch {args.batch} x seq {args.seq} ({args.batch // n} rows per ep rank), AdamW")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, times, loads = [], [], []
    for step in range(args.steps):
        x, tgt = (t.to(device) for t in synthetic_batch(step, args.batch, args.seq, args.dim, args.seed))
        t0 = time.perf_counter()
        with shardprop.comm_counter() as c:
            loss = _loss(model(x.chunk(n)[me]), tgt.chunk(n)[me], tgt.numel())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            for name, p in model.named_parameters():
                if not name.startswith("experts."):  # router and shared expert: data parallel over ep
                    all_reduce(p.grad, mesh, ep, inplace=True)
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(all_reduce(loss.detach().reshape(1).clone(), mesh, ep).item())
        load = shardprop.expert_load(model.experts)
        loads.append(load)
        comm = ", ".join(f"{k} {v[0]}" for k, v in sorted(c.counts.items()))
        say(f"step {step + 1:3d}/{args.steps}  loss {losses[-1]:.5f}  {times[-1] * 1e3:7.1f} ms  [{comm}]  "
            f"tokens/expert {load.tokens_per_expert} max/mean {load.imbalance:.2f}, per ep rank "
            f"{load.tokens_per_rank} max/mean {load.rank_imbalance:.2f}")
    summary = dict(losses=losses, ok=None, max_rel=None, loads=[(ld.tokens_per_expert, ld.imbalance) for ld in loads])
    if dist.get_rank() == 0:
        ref = _reference(args, hidden, device)
        worst = compare(losses, ref, say)
        ok = worst <= rtol
        say(f"\nmax relative difference {worst:.2e} (tolerance {rtol:g}): {'PASS' if ok else 'FAIL'}")
        summary.update(reference=ref, ok=ok, max_rel=worst)
    dist.barrier()
    return summary
