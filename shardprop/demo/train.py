"""The demo: train a small Llama-style model with tensor + data parallelism, check it against one process.

    python -m shardprop.demo [--nproc 4] [--mesh 2x2|4|1x4] [--steps 20] [--dim 64] [--layers 2] [--seed 0]
    torchrun --nproc-per-node 4 -m shardprop.demo
    python -m shardprop.demo --compile     # the same training under torch.compile (inductor)
    python -m shardprop.demo --tour        # the older tour: one tensor through every placement
    python -m shardprop.demo --cp 4 --seq 4096 --batch 1 --steps 3     # context parallelism (ring attention)
    python -m shardprop.demo --moe [--mesh 4|2x2]                      # mixture of experts: ep=4, or ep2 x tp2
    python -m shardprop.demo --steps 10 --checkpoint ckpt              # save at the end (DCP)
    python -m shardprop.demo --steps 20 --resume ckpt --mesh 4         # continue on another mesh
    python -m shardprop.demo --fsdp --ac selective                     # tp + fully_shard + selective AC
    python -m shardprop.demo --fsdp --mesh 4 --lora --ac full          # torchtune's distributed LoRA recipe
    python -m shardprop.demo --dry-run --model llama3-70b --mesh 16x4x8  # one rank of 512, fake backend, meta
    python -m shardprop.demo --autoplan                                # shardprop.autoplan chooses mesh and plan
    python -m shardprop.demo --dry-run --autoplan --model llama3-70b --nproc 512  # planned on paper, then dry-run

Spawns ranks (on 127.0.0.1) unless started by torchrun: on the CPU over gloo, or with
``--device cuda`` (the default when torch sees a GPU) on the GPUs: NCCL with one GPU per rank,
or, with fewer GPUs than ranks (one GPU), the ranks sharing them over gloo with CUDA tensors;
see :mod:`shardprop.demo.devices`. The first line says which backend carries what. On a ``("dp", "tp")`` mesh the model is parallelized over
``tp`` with :func:`shardprop.demo.model.tp_plan`, each dp rank trains on its rows of
the same synthetic batch, and gradients are averaged over ``dp`` with bucketed
all-reduces. Every step prints the loss and the collectives this rank issued;
the end prints the cache statistics and compares every loss with a one-process run
of the same model (PASS within 1e-4 relative). ``--checkpoint DIR`` saves model and
optimizer state with ``torch.distributed.checkpoint`` at the end; ``--resume DIR`` loads
them (written with any mesh: loading reshards) and trains on from the saved step to
``--steps``, and its losses are compared with the same steps of an uninterrupted run.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from contextlib import nullcontext
from typing import List, Optional

import torch
import torch.distributed as dist

from shardprop.demo.model import (
    Llama,
    LlamaConfig,
    lm_loss,
    make_optimizer,
    reference_losses,
    synthetic_batch,
    tp_plan,
)
from shardprop.demo.recipes import AC_MODES, add_lora, apply_ac

RTOL = 1e-4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_mesh(spec: Optional[str], world: int):
    """``"2x2"`` -> ((2, 2), ("dp", "tp")); ``"4"`` -> ((4,), ("tp",)); None -> 2x2 on 4 ranks, else 1-d tp."""
    if spec is None:
        spec = "2x2" if world == 4 else str(world)
    shape = tuple(int(s) for s in spec.lower().split("x"))
    if len(shape) not in (1, 2):
        raise SystemExit(f"--mesh {spec}: want TP or DPxTP, e.g. 4 or 2x2")
    n = 1
    for s in shape:
        n *= s
    if n != world:
        raise SystemExit(f"--mesh {spec} has {n} ranks but there are {world}")
    return shape, (("tp",) if len(shape) == 1 else ("dp", "tp"))


def _device_type(args) -> str:
    """The device this rank trains on: ``args.device`` as :func:`shardprop.demo.devices.plan` resolved it.

    Left at ``auto`` (rank_main called inside an existing group, as tests do): cuda only when the
    default group has NCCL, so a gloo pool of ranks stays on the CPU.
    """
    device = getattr(args, "device", "auto")
    if device != "auto":
        return device
    if dist.is_initialized() and "nccl" in str(dist.get_backend()).lower() and torch.cuda.is_available():
        return "cuda"
    return "cpu"


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _fmt_counts(counts) -> str:
    if not counts:
        return "no collectives"
    return ", ".join(f"{k} {n}x ({_fmt_bytes(b)})" for k, (n, b) in sorted(counts.items()))


def build(cfg: LlamaConfig, mesh, seed: int, loss_parallel: bool = False, fsdp: bool = False,
          ac: Optional[str] = None, lora: int = 0, plan=None):
    """The model parallelized over ``mesh["tp"]`` (or a 1-d tp mesh), from the seeded single-process init.

    With ``fsdp`` each block, then the whole model, is ``fully_shard``-ed over ``mesh["dp"]``
    (a 1-d mesh is then all dp: no tp). As torchtitan orders them: LoRA adapters (``lora``: their
    rank; the rest frozen), then tensor parallelism, activation checkpointing (``ac``), fully_shard.
    With ``plan`` (``--autoplan``: a ``shardprop.autoplan`` plan) the plan parallelizes the model instead.
    """
    from shardprop import fully_shard, parallelize_module
    model = Llama(cfg, seed).to(mesh.device_type)
    if plan is not None:
        return plan.apply(model, mesh)
    tp_on = not (fsdp and mesh.ndim == 1)
    if lora:
        if tp_on:
            raise SystemExit("--lora runs with --fsdp on a 1-d --mesh (fully sharded data parallel): the demo's "
                             "tensor-parallel plan does not cover the adapters")
        add_lora(model, rank=lora)
    if tp_on:
        tp = mesh["tp"] if mesh.ndim == 2 else mesh
        model = parallelize_module(model, tp, tp_plan(loss_parallel=loss_parallel))
    apply_ac(model, ac)
    if fsdp:
        dp = mesh["dp"] if mesh.ndim == 2 else mesh
        for block in model.layers:
            fully_shard(block, mesh=dp)
        fully_shard(model, mesh=dp)
    return model


def train(args, mesh, say=print):
    """Train on this rank; returns (losses averaged over dp, per-step collective counts, seconds per step)."""
    from shardprop import comm_counter, loss_parallel, replicate_gradients
    from shardprop.mesh.collectives import all_reduce
    cfg = config_from(args)
    device = mesh.device_type
    fsdp = getattr(args, "fsdp", False)
    dp = mesh["dp"] if mesh.ndim == 2 else (mesh if fsdp else None)
    if dp is not None and args.batch % dp.size():
        # Equal slices make the mean of the dp ranks' losses the global batch's loss.
        raise SystemExit(f"--batch {args.batch} does not split evenly over dp={dp.size()}")
    model = build(cfg, mesh, args.seed, args.loss_parallel, fsdp, getattr(args, "ac", None), getattr(args, "lora", 0),
                  getattr(args, "plan", None))
    opt = make_optimizer(args.optimizer, model.parameters())
    start = resume(args.resume, model, opt, say) if args.resume else 0
    # --compile: the forward and backward run as compiled graphs (collectives inside them).
    run = torch.compile(model, backend=args.compile) if getattr(args, "compile", None) else model
    if run is not model:
        say(f"torch.compile (backend {args.compile}): step 1 compiles; collectives inside the compiled graphs "
            "are counted once, while tracing, and not on later steps")
    # Averages gradients over dp in bucketed async all-reduces launched from autograd hooks
    # (fully_shard reduce-scatters them itself).
    sync = replicate_gradients(model, mesh, "dp") if dp is not None and not fsdp else None
    rows = sync.split_batch if sync is not None else (lambda t: t)
    if fsdp:
        rows = lambda t: t.chunk(dp.size())[dp.get_local_rank()]  # noqa: E731
    losses, counts, times = [], [], []
    for step in range(start, args.steps):
        tokens, targets = (rows(t).to(device) for t in synthetic_batch(cfg, args.batch, step, args.seed))
        t0 = time.perf_counter()
        with comm_counter() as c:
            # loss_parallel: cross-entropy on the vocab-sharded logits, never gathered.
            with (loss_parallel() if args.loss_parallel else nullcontext()):
                loss = lm_loss(run(tokens), targets)
                opt.zero_grad(set_to_none=True)
                loss.backward()
            if sync is not None:
                sync.finish()  # waits for the buckets' all-reduces; gradients are now dp averages
            opt.step()
        times.append(time.perf_counter() - t0)
        counts.append(dict(c.counts))
        value = loss.detach()
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        if dp is not None:  # the global batch's loss: the mean of the dp ranks' equal-size slices
            value = all_reduce(value.reshape(1).clone(), dp, 0, "avg")
        losses.append(value.item())
        say(f"step {step + 1:3d}/{args.steps}  loss {losses[-1]:.5f}  {times[-1] * 1e3:7.1f} ms  "
            f"collectives: {_fmt_counts(counts[-1])}")
    if args.checkpoint:
        save_checkpoint(args.checkpoint, model, opt, args.steps, say)
    return losses, counts, times


def _checkpoint_state(model, opt, step: int) -> dict:
    from shardprop import get_optimizer_state_dict
    return {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt), "step": step}


def save_checkpoint(path: str, model, opt, step: int, say=print) -> None:
    """Save model and optimizer with torch.distributed.checkpoint (each rank writes its own shards)."""
    import torch.distributed.checkpoint as dcp
    t0 = time.perf_counter()
    dcp.save(_checkpoint_state(model, opt, step), checkpoint_id=path)
    say(f"saved a checkpoint of step {step} to {path} ({time.perf_counter() - t0:.2f} s)")


def resume(path: str, model, opt, say=print) -> int:
    """Load model and optimizer from ``path`` (any mesh may have written it); return the step to continue from."""
    import torch.distributed.checkpoint as dcp
    from shardprop import set_optimizer_state_dict
    state = _checkpoint_state(model, opt, 0)
    dcp.load(state, checkpoint_id=path)
    set_optimizer_state_dict(model, opt, state["optim"])
    say(f"resumed from {path} at step {state['step']}")
    return int(state["step"])


def config_from(args) -> LlamaConfig:
    return LlamaConfig(dim=args.dim, n_layers=args.layers, n_heads=args.heads, vocab_size=args.vocab,
                       seq_len=args.seq)


def compare(ours: List[float], ref: List[float], say=print, first: int = 1) -> float:
    """Print the losses side by side (steps numbered from ``first``); return the largest relative difference."""
    say(f"\n{'step':>4}  {'one process':>12}  {'ours':>12}  {'rel diff':>9}")
    worst = 0.0
    for i, (a, b) in enumerate(zip(ours, ref)):
        rel = abs(a - b) / max(abs(b), 1e-12)
        worst = max(worst, rel)
        say(f"{i + first:4d}  {b:12.6f}  {a:12.6f}  {rel:9.2e}")
    return worst


def rank_main(args) -> dict:
    """Everything one rank does (the default process group may already exist). Returns a summary."""
    import shardprop
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"])
    if getattr(args, "autoplan", False):  # the engine chooses the mesh shape and the plan
        from shardprop import autoplan
        with torch.device("meta"):
            meta_model = Llama(config_from(args))
        tokens, _ = synthetic_batch(config_from(args), args.batch, 0, args.seed)
        args.plan = autoplan(meta_model, world, (tokens,))
        if dist.get_rank() == 0:
            print(args.plan)
        shape, names = args.plan.mesh_shape()
        args.mesh, args.fsdp = "x".join(map(str, shape)), args.plan.fsdp
    else:
        shape, names = parse_mesh(args.mesh, world)
    if getattr(args, "fsdp", False) and len(shape) == 1:
        names = ("dp",)  # --fsdp on a 1-d mesh: fully sharded data parallel only
    device = _device_type(args)
    mesh = shardprop.init_device_mesh(device, shape, mesh_dim_names=names)
    rank = dist.get_rank()
    say = print if rank == 0 else (lambda *a, **k: None)
    cfg = config_from(args)
    if getattr(args, "placement", None):
        say(args.placement)
    say(f"shardprop demo: {world} ranks on {device}, mesh {dict(zip(names, shape))}; model dim {cfg.dim}, "
        f"{cfg.n_layers} layers, {cfg.n_heads} heads, vocab {cfg.vocab_size}, seq {cfg.seq_len}, "
        f"batch {args.batch}, {args.optimizer}{', loss_parallel' if args.loss_parallel else ''}"
        f"{', fully_shard over dp' if getattr(args, 'fsdp', False) else ''}"
        f"{', activation checkpointing: ' + args.ac if getattr(args, 'ac', None) else ''}"
        f"{', LoRA rank %d (base weights frozen)' % args.lora if getattr(args, 'lora', 0) else ''}")
    shardprop.clear_cache()
    t0 = time.perf_counter()
    losses, counts, times = train(args, mesh, say)
    elapsed = time.perf_counter() - t0
    if times:
        say(f"\n{len(times)} steps in {elapsed:.1f} s (median {1e3 * sorted(times)[len(times) // 2]:.1f} ms/step)")
    say("\ncache statistics (rank 0):")
    if rank == 0:
        shardprop.print_cache_stats()
    summary = dict(losses=losses, counts=counts, ok=None, max_rel=None)
    if rank == 0:
        # A resumed run did the last len(losses) steps of an uninterrupted one: compare with those.
        ref = reference_losses(cfg, args.steps, args.batch, args.seed, args.optimizer, device=device,
                               lora=getattr(args, "lora", 0))
        ref = ref[len(ref) - len(losses):]
        worst = compare(losses, ref, say, first=args.steps - len(losses) + 1)
        ok = worst <= RTOL
        say(f"\nmax relative difference {worst:.2e} (tolerance {RTOL:g}): {'PASS' if ok else 'FAIL'}")
        summary.update(reference=ref, ok=ok, max_rel=worst)
    dist.barrier()
    return summary


def tour(mesh_shape) -> None:
    """Distribute a tensor and redistribute it through every placement; print plans and checks."""
    import shardprop
    from shardprop import Partial, Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", mesh_shape)
    say = print if dist.get_rank() == 0 else (lambda *a, **k: None)
    torch.manual_seed(0)
    full = torch.randn(10, 6)  # 10 rows: uneven over 4 ranks, on purpose
    say(f"mesh {mesh}; global tensor {tuple(full.shape)}")
    options = [Shard(0), Shard(1), Replicate(), Partial("sum"), Partial("max")]
    placements = [[p] for p in options] if mesh.ndim == 1 else [[a, b] for a in options[:4] for b in options[:4]]
    x = distribute_tensor(full, mesh, placements[0])
    ok_all = True
    for target in placements[1:] + placements[:1]:
        plan = shardprop.plan_redistribute(x._spec, tuple(target))
        y = x.redistribute(placements=target)
        ok = torch.allclose(y.full_tensor(), full)
        ok_all &= ok
        steps = ", ".join(f"{s.kind}@{list(s.mesh_dims)} ({s.bytes} B)" for s in plan.steps) or "no-op"
        say(f"  {list(x.placements)!s:>10} -> {list(y.placements)!s:<10} local {tuple(y.to_local().shape)!s:<8} "
            f"{'ok ' if ok else 'BAD'} via {steps}")
        x = y
    say(f"\nall checks {'passed' if ok_all else 'FAILED'}")
    if not ok_all:
        raise SystemExit(1)


def _run(args) -> None:
    from shardprop.mesh.groups import ensure_default_group
    ensure_default_group("cpu" if args.tour else _device_type(args),
                         backend=None if args.tour else getattr(args, "backend", None))
    if args.tour:
        shape = tuple(int(s) for s in args.mesh.split("x")) if args.mesh else (dist.get_world_size(),)
        tour(shape)
        return
    if getattr(args, "cp", None):
        from shardprop.demo.cp_train import cp_main
        summary = cp_main(args, config_from, compare, RTOL)
    elif getattr(args, "moe", False):
        from shardprop.demo.moe_train import moe_main
        summary = moe_main(args, compare, RTOL, _device_type(args))
    else:
        summary = rank_main(args)
    if summary["ok"] is False:
        raise SystemExit(1)


def _worker(rank: int, world: int, port: int, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    try:
        _run(args)
    finally:
        dist.destroy_process_group()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=None, help="ranks to spawn (default 4)")
    p.add_argument("--mesh", default=None, help="DPxTP or TP, e.g. 2x2, 1x4, 4 (default 2x2 on 4 ranks)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=8, help="global batch (split over dp)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--loss-parallel", action="store_true", help="vocab-sharded logits with shardprop.loss_parallel")
    p.add_argument("--fsdp", action="store_true", help="fully_shard over dp (a 1-d --mesh is then all dp)")
    p.add_argument("--ac", choices=AC_MODES, default=None,
                   help="activation checkpointing of each block: full (checkpoint_wrapper), reentrant, selective "
                        "(saves matmul outputs), inner (checkpoint() inside each block's forward)")
    p.add_argument("--lora", type=int, nargs="?", const=8, default=0, metavar="RANK",
                   help="torchtune's LoRA: adapters of this rank (default 8) on wq/wv, every other weight frozen "
                        "(with --fsdp on a 1-d --mesh)")
    p.add_argument("--checkpoint", metavar="DIR", default=None,
                   help="at the end, save model and AdamW state to DIR with torch.distributed.checkpoint")
    p.add_argument("--resume", metavar="DIR", default=None,
                   help="load model and optimizer from DIR (saved with any --mesh) and continue up to --steps")
    p.add_argument("--compile", nargs="?", const="inductor", default=None, metavar="BACKEND",
                   help="train under torch.compile (backend: inductor, or e.g. aot_eager)")
    p.add_argument("--cp", type=int, default=None, metavar="N",
                   help="context parallelism over N ranks (ring attention; see shardprop.demo.cp_train)")
    p.add_argument("--moe", action="store_true",
                   help="a mixture-of-experts layer, experts over ep (--mesh 4) or ep x tp (--mesh 2x2); see "
                        "shardprop.demo.moe_train")
    p.add_argument("--tour", action="store_true", help="instead: walk one tensor through every placement")
    p.add_argument("--dry-run", action="store_true",
                   help="one rank of a large job in this process (fake backend, meta device): memory and collectives "
                        "per rank; --mesh is then DPxCPxTP (see shardprop.demo.dry_run)")
    p.add_argument("--model", default="llama3-70b", help="with --dry-run: llama3-70b, llama3-8b or tiny")
    p.add_argument("--rank", type=int, default=0, help="with --dry-run: the rank to play (default 0)")
    p.add_argument("--autoplan", action="store_true",
                   help="let shardprop.autoplan choose the mesh shape and the plan (prints it); with --dry-run: "
                        "plan --nproc ranks on paper (H100 preset) and dry-run the chosen plan")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="cuda: NCCL with one GPU per rank, or ranks sharing fewer GPUs over gloo (default: cuda if any)")
    return p


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    if args.dry_run:  # one process, no ranks to spawn: see shardprop.demo.dry_run
        from shardprop.demo.dry_run import dry_run
        given = argv if argv is not None else sys.argv
        dry_run(args.model, args.mesh or "16x4x8", rank=args.rank,
                seq=args.seq if "--seq" in given else None,
                batch=args.batch if "--batch" in given else None,
                autoplan_world=(args.nproc or 64) if args.autoplan else None)
        return
    from shardprop.demo.devices import plan, visible_gpus
    under_launcher = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if args.tour:
        args.device = "cpu"
    ranks = (int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])) if under_launcher
             else args.nproc if args.nproc is not None or not args.cp else args.cp)
    chosen = plan(args.device, ranks, visible_gpus())
    args.device, args.backend, args.placement = chosen.device, chosen.backend, chosen.describe()
    if under_launcher:  # under torchrun, or inside a pool of ranks
        torch.set_num_threads(1)
        own_group = not dist.is_initialized()
        try:
            _run(args)
        finally:
            if own_group and dist.is_initialized():
                dist.destroy_process_group()
        return
    nproc = chosen.nproc
    if not args.tour and not args.cp and not args.autoplan:
        parse_mesh(args.mesh, nproc)  # a bad --mesh fails here, not in every spawned rank
    import torch.multiprocessing as mp
    mp.spawn(_worker, args=(nproc, _free_port(), args), nprocs=nproc)


if __name__ == "__main__":
    sys.exit(main())
