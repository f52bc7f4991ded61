"""Dry run: one rank of a large job in this process, on torch's fake backend, the model on the meta device.

    python -m shardprop.demo --dry-run --model llama3-70b --mesh 16x4x8 [--rank 0] [--seq 8192] [--batch 16]

The mesh is dp x cp x tp (``DPxCPxTP``; ``DPxTP`` and ``DP`` too). The default group is torch's
``fake`` backend (every collective returns at once, one process plays rank ``--rank`` of the
world), the model is built on the meta device (no memory, no data), parallelized as the demo
does it (tensor parallelism over tp with :func:`shardprop.demo.model.tp_plan`, ``fully_shard``
of every block and the root over dp x cp, as torchtitan shards parameters over ``dp_shard_cp``),
and one training step (forward, backward, AdamW step) really runs through shardprop on meta
tensors. Reported per rank:

- parameter, gradient and optimizer-state bytes: the local shards the step left (measured);
- peak activations with and without activation checkpointing: an estimate (the formula is in
  :func:`activation_bytes`), since meta tensors have no memory to measure;
- the collectives of the step by kind, group size and bytes (``comm_counter()``, measured). Context
  parallelism is simulated by giving each rank its ``seq / cp`` tokens; the ring attention's
  key/value passes are not run, and are reported as an estimate.
"""
from __future__ import annotations

import time
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist

from shardprop.demo.model import Llama, LlamaConfig, lm_loss, tp_plan

MODELS: Dict[str, LlamaConfig] = {
    "llama3-70b": LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256, seq_len=8192,
                              ffn_dim=28672, sdpa=True),
    "llama3-8b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, seq_len=8192,
                             ffn_dim=14336, sdpa=True),
    "tiny": LlamaConfig(dim=256, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=1024, seq_len=128, ffn_dim=512,
                        sdpa=True),
}
NAMES = {1: ("dp",), 2: ("dp", "tp"), 3: ("dp", "cp", "tp")}


def parse_mesh(spec: str) -> Tuple[Tuple[int, ...], Tuple[str, ...]]:
    """``"16x4x8"`` -> ((16, 4, 8), ("dp", "cp", "tp")); ``"64x8"`` -> dp x tp; ``"512"`` -> dp.

    Example:
        >>> parse_mesh("16x4x8")
        ((16, 4, 8), ('dp', 'cp', 'tp'))
    """
    shape = tuple(int(s) for s in spec.lower().split("x"))
    if len(shape) not in NAMES or any(s < 1 for s in shape):
        raise SystemExit(f"--mesh {spec}: want DP, DPxTP or DPxCPxTP, e.g. 16x4x8")
    return shape, NAMES[len(shape)]


def param_count(cfg: LlamaConfig) -> Dict[str, int]:
    """Parameters of the model by kind: ``matrix`` (linears and embeddings) and ``norm`` (RMSNorm weights).

    Example:
        >>> param_count(MODELS["tiny"])["norm"]
        1280
    """
    h, kv, f = cfg.dim, cfg.kv_heads * cfg.head_dim, cfg.hidden_dim
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * f
    return {"matrix": cfg.n_layers * per_layer + 2 * cfg.vocab_size * h, "norm": (2 * cfg.n_layers + 1) * h}


def analytic_bytes(cfg: LlamaConfig, dp: int, tp: int, itemsize: int = 4) -> Dict[str, float]:
    """Per-rank parameter, gradient and AdamW-state bytes when every dim divides evenly.

    Matrices are split over tp and over the fully_shard mesh (``dp`` here means dp x cp); norm
    weights are replicated over tp and split over dp. Gradients are as large as the parameters,
    AdamW keeps two states of each.

    Example:
        >>> analytic_bytes(MODELS["tiny"], 2, 2)["params"]
        1706496.0
    """
    n = param_count(cfg)
    params = (n["matrix"] / (dp * tp) + n["norm"] / dp) * itemsize
    return {"params": params, "grads": params, "optim": 2 * params}


def activation_bytes(cfg: LlamaConfig, batch: int, seq: int, tp: int, itemsize: int = 4,
                     ac: bool = False) -> float:
    """Estimated peak of saved activations on one rank (``batch`` and ``seq`` are this rank's).

    Per block, what autograd keeps for backward under the demo's plan (sequence parallel norms,
    SDPA attention): the two norm inputs (``h/tp`` per token), the two gathered norm outputs
    feeding the projections (``h``), q/k/v (``(h + 2 kv)/tp``), RoPE's inputs and rotated halves
    of q and k (``2 (h + kv)/tp``), SDPA's q, repeated k and v and output (``4 h/tp``), and the
    MLP's w1, w3, silu and product (``4 ffn/tp``); plus the logits and their softmax, full
    vocabulary (the plan's output is replicated), once. With activation checkpointing of every
    block only each block's input (``h/tp`` per token) stays, plus one block recomputed at a time.

    Example:
        >>> activation_bytes(MODELS["tiny"], 1, 128, 2) > activation_bytes(MODELS["tiny"], 1, 128, 2, ac=True)
        True
    """
    h, kv, f, t = cfg.dim, cfg.kv_heads * cfg.head_dim, cfg.hidden_dim, tp
    per_token = 2 * h / t + 2 * h + (h + 2 * kv) / t + 2 * (h + kv) / t + 4 * h / t + 4 * f / t
    block = batch * seq * per_token * itemsize
    logits = 2 * batch * seq * cfg.vocab_size * itemsize
    if not ac:
        return cfg.n_layers * block + logits
    return cfg.n_layers * batch * seq * h / t * itemsize + block + logits


def _local_bytes(t) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def plan_on_paper(cfg: LlamaConfig, world: int, batch: Optional[int] = None, seq: Optional[int] = None, say=print):
    """``shardprop.autoplan`` of the model for ``world`` ranks on the H100 preset, 80 GiB per rank (meta weights).

    Returns the plan and its mesh spec for :func:`dry_run`.

    ``batch`` defaults to one sequence per 8 ranks. Example:
        >>> plan, spec = plan_on_paper(MODELS["tiny"], 8, say=lambda *a: None)  # doctest: +SKIP
    """
    from shardprop import autoplan
    from shardprop import CostModel

    seq = seq or cfg.seq_len
    batch = batch or max(1, world // 8)
    with torch.device("meta"):
        model = Llama(LlamaConfig(**{**cfg.__dict__, "seq_len": seq}))
    tokens = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    # An H100's 80 GB: the activation estimate is conservative, so activation checkpointing comes on at scale.
    plan = autoplan(model, world, (tokens,), cost_model=CostModel.preset("h100"), memory_per_rank=80 * 2**30,
                    context_parallel=cfg.sdpa)
    say(plan)
    return plan, f"{plan.shape.dp}x{plan.shape.cp}x{plan.shape.tp}"


def dry_run(model_name: str, mesh_spec: str, rank: int = 0, seq: Optional[int] = None, batch: Optional[int] = None,
            cfg: Optional[LlamaConfig] = None, say=print, autoplan_world: Optional[int] = None) -> dict:
    """Run one training step of ``model_name`` as ``rank`` of the mesh ``mesh_spec``; return the report.

    Starts (and at the end destroys) a fake default group: call it in a process with none.
    ``autoplan_world``: instead of ``mesh_spec`` and the demo's plan, ``shardprop.autoplan`` chooses the
    mesh shape and the plan for that many ranks (:func:`plan_on_paper`), and the step runs that plan.

    Example:
        >>> report = dry_run("tiny", "2x2x2", say=lambda *a: None)  # doctest: +SKIP
        >>> report["params_bytes"] > 0  # doctest: +SKIP
        True
    """
    import shardprop as sp
    from torch.testing._internal.distributed.fake_pg import FakeStore

    cfg = cfg or MODELS[model_name]
    plan = None
    if autoplan_world:
        plan, mesh_spec = plan_on_paper(cfg, autoplan_world, batch, seq, say)
        batch = batch or max(1, autoplan_world // 8)
    shape, names = parse_mesh(mesh_spec)
    dims = dict(zip(names, shape))
    dp, cp, tp = dims.get("dp", 1), dims.get("cp", 1), dims.get("tp", 1)
    world = dp * cp * tp
    seq = seq or cfg.seq_len
    batch = batch or dp
    if not 0 <= rank < world or batch % dp or seq % cp:
        raise SystemExit(f"--rank {rank} of {world}, batch {batch} over dp {dp}, seq {seq} over cp {cp}: "
                         "the rank must be in the world, and dp must divide the batch and cp the sequence")
    if dist.is_initialized():
        raise RuntimeError("dry_run: a default process group exists already; the dry run starts its own (fake)")
    t0 = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        mesh = sp.init_device_mesh("cpu", shape, mesh_dim_names=names)
        # fully_shard over dp x cp (torchtitan's dp_shard_cp), tp inside: the same ranks, row-major.
        fsdp_tp = sp.init_device_mesh("cpu", (dp * cp, tp), mesh_dim_names=("dp_cp", "tp"))
        local_seq, local_batch = seq // cp, batch // dp
        run_cfg = LlamaConfig(**{**cfg.__dict__, "seq_len": local_seq})
        with torch.device("meta"):
            model = Llama(run_cfg)
        if plan is not None:
            plan.apply(model, fsdp_tp)
        else:
            if tp > 1:
                sp.parallelize_module(model, fsdp_tp["tp"], tp_plan())
            for block in model.layers:
                sp.fully_shard(block, mesh=fsdp_tp["dp_cp"])
            sp.fully_shard(model, mesh=fsdp_tp["dp_cp"])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        t_setup = time.perf_counter() - t0
        tokens = torch.zeros(local_batch, local_seq, dtype=torch.long, device="meta")
        with sp.comm_counter() as comms:
            loss = lm_loss(model(tokens), tokens)
            loss.backward()
            opt.step()
        t_step = time.perf_counter() - t0 - t_setup
        itemsize = next(model.parameters()).element_size()
        report = {
            "model": model_name, "mesh": dict(dims), "rank": rank, "coordinate": mesh.get_coordinate(),
            "world": world, "batch_per_rank": local_batch, "seq_per_rank": local_seq,
            "params_bytes": sum(_local_bytes(p) for p in model.parameters()),
            "grads_bytes": sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None),
            "optim_bytes": sum(_local_bytes(v) for s in opt.state.values() for v in s.values()
                               if isinstance(v, torch.Tensor) and v.dim() > 0),
            "analytic": analytic_bytes(cfg, dp * cp, tp, itemsize),
            "activations_bytes": activation_bytes(cfg, local_batch, local_seq, tp, itemsize),
            "activations_ac_bytes": activation_bytes(cfg, local_batch, local_seq, tp, itemsize, ac=True),
            "collectives": {f"{k}/{n}": v for (k, n), v in sorted(comms.by_group.items())},
            "cp_ring_estimate": _cp_ring(cfg, local_batch, local_seq, cp, tp, itemsize),
            "setup_s": t_setup, "step_s": t_step, "plan": str(plan) if plan is not None else "",
        }
    finally:
        dist.destroy_process_group()
    _print(report, say)
    return report


def _cp_ring(cfg: LlamaConfig, batch: int, seq: int, cp: int, tp: int, itemsize: int) -> dict:
    """Ring attention's key/value passes (not run in the dry run): sends per step and bytes, estimated.

    Forward: each layer passes this rank's k and v (``seq x kv/tp``) ``cp - 1`` times; backward
    passes k, v and their gradients the same number of times.
    """
    if cp == 1:
        return {}
    kv = batch * seq * (cfg.kv_heads * cfg.head_dim // tp) * 2 * itemsize
    hops = cfg.n_layers * (cp - 1)
    return {"send/recv": (3 * hops, hops * kv + hops * 2 * kv)}


def _gb(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _cost_model(r: dict):
    """The H100 preset (a dry run plays a large GPU job); this machine's calibration for the tiny model."""
    from shardprop import CostModel
    return CostModel.default() if r["model"] == "tiny" else CostModel.preset("h100")


def _predicted(cm, key: str, calls: int, nbytes: float) -> str:
    """``calls`` collectives of ``key`` ("all_gather/8") moving ``nbytes`` of payload in all, by the cost model."""
    kind, k = key.split("/")[0], int(key.split("/")[1])
    if kind not in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all") or k < 2 or not calls:
        return ""
    per_call = nbytes / calls / (k if kind == "all_gather" else 1)  # an all-gather's payload is its output
    return f"{calls * cm.collective(kind, k, per_call) * 1e3:.1f} ms"


def _print(r: dict, say) -> None:
    from tabulate import tabulate
    mesh = " x ".join(f"{k} {v}" for k, v in r["mesh"].items())
    say(f"dry run: {r['model']} on {mesh} = {r['world']} ranks (fake backend, meta device), as rank {r['rank']} "
        f"at {r['coordinate']}; per rank: batch {r['batch_per_rank']}, seq {r['seq_per_rank']}")
    a = r["analytic"]
    rows = [["parameters", _gb(r["params_bytes"]), _gb(a["params"]), "measured (local shards)"],
            ["gradients", _gb(r["grads_bytes"]), _gb(a["grads"]), "measured"],
            ["AdamW state", _gb(r["optim_bytes"]), _gb(a["optim"]), "measured"],
            ["activations, no AC", _gb(r["activations_bytes"]), "", "estimate (activation_bytes)"],
            ["activations, AC per block", _gb(r["activations_ac_bytes"]), "", "estimate"]]
    say(tabulate(rows, headers=["per rank", "bytes", "analytic", "how"]))
    cm = _cost_model(r)
    rows = [[k.split("/")[0], int(k.split("/")[1]) or "p2p", n, _gb(b), _predicted(cm, k, n, b), "measured"]
            for k, (n, b) in r["collectives"].items()]
    rows += [[k, r["mesh"].get("cp"), n, _gb(b), "", "estimate (ring attention not run)"]
             for k, (n, b) in r["cp_ring_estimate"].items()]
    say(tabulate(rows, headers=["collective", "group size", "calls", "bytes (payload)", "time (cost model)", "how"]))
    say(f"(times: shardprop's autoplan cost model, {cm.source})")
    say(f"setup {r['setup_s']:.1f} s, one step {r['step_s']:.1f} s")
