"""``autoplan``: trace once, then solve every mesh shape of the world and keep the fastest that fits.

Mesh shapes are the factorizations ``dp x tp`` of the world size (``tp`` up to ``max_tp``, ``dp``
dividing the batch). The trace and each tp size's candidates are computed once; each shape's
integer program solves in milliseconds, so the search is dominated by the trace (about a
second for Llama3-70B's 80 blocks on meta).

    >>> plan = autoplan(model, 4, (tokens,))  # doctest: +SKIP
    >>> print(plan)  # doctest: +SKIP
"""
from __future__ import annotations

import time
from typing import Iterable, List, Optional, Union

import torch.nn as nn

from shardprop.planner.candidates import strategies
from shardprop.planner.costs import CostModel
from shardprop.planner.plan import NoPlanFits, Plan
from shardprop.planner.solve import Shape, Solution, solve_shape
from shardprop.planner.trace import trace_model
from shardprop.planner.units import find_units

__all__ = ["autoplan", "mesh_shapes"]


def mesh_shapes(world: int, batch: Optional[int] = None, max_tp: int = 64, seq: Optional[int] = None) -> List[Shape]:
    """Every ``dp x tp`` (x ``cp`` when ``seq`` is given) of ``world``: ``tp <= max_tp``, ``dp`` divides ``batch``,
    ``2 cp`` divides ``seq`` (ring attention's load-balanced halves).

        >>> [str(s) for s in mesh_shapes(4)]
        ['dp 4', 'dp 2 x tp 2', 'tp 4']
    """
    out = []
    for tp in range(1, min(world, max_tp) + 1):
        for cp in range(1, world // tp + 1):
            if world % (tp * cp) or (cp > 1 and (seq is None or seq % (2 * cp))):
                continue
            dp = world // (tp * cp)
            if batch is not None and batch % dp:
                continue
            out.append(Shape(dp=dp, tp=tp, cp=cp))
    return out


def _world_of(mesh) -> tuple:
    """(world size, a fixed shape or None) from an int, a DeviceMesh, or the default process group."""
    if mesh is None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ValueError("autoplan: give a world size or a mesh (no default process group exists)")
        return dist.get_world_size(), None
    if isinstance(mesh, int):
        return mesh, None
    names = tuple(mesh.mesh_dim_names or ())
    sizes = dict(zip(names, mesh.shape))
    if set(names) - {"dp", "tp"}:
        raise ValueError(f"autoplan: a mesh's dims must be named 'dp' and/or 'tp' (got {names}); "
                         "or pass the world size and let autoplan choose the shape")
    return mesh.size(), Shape(dp=sizes.get("dp", 1), tp=sizes.get("tp", 1))


def autoplan(model: nn.Module, mesh: Union[int, object, None], example_inputs: tuple, *,
             memory_per_rank: Optional[float] = None, objective: str = "step_time",
             cost_model: Optional[CostModel] = None, shapes: Optional[Iterable[Shape]] = None,
             sequence_parallel: Optional[bool] = None, context_parallel: bool = False, loss_parallel: bool = False,
             max_tp: int = 64) -> Plan:
    """Choose how to parallelize ``model`` over ``mesh`` (a world size, or a mesh with dims "dp"/"tp").

    ``example_inputs``: one global batch (shapes matter, values do not; meta tensors are fine).
    ``memory_per_rank``: bytes each rank may hold (parameters, gradients, AdamW state, saved
    activations); :class:`NoPlanFits` when no plan fits. ``objective``: "step_time" (default) or
    "memory" (the smallest plan). ``cost_model``: default :meth:`CostModel.default` (this
    machine's calibration if saved, else a built-in profile). ``shapes``: the mesh shapes to try
    (default: every dp x tp of the world). ``sequence_parallel``: force it on or off (default: chosen).
    ``loss_parallel``: also consider keeping the logits vocab-sharded (the loss must then run inside
    :meth:`Plan.loss_context`, ``shardprop.loss_parallel``). ``context_parallel``: also try splitting the sequence over a cp mesh dim (ring attention; needs SDPA in
    the model, and the training loop's ``shardprop.context_parallel``: see :meth:`Plan.apply`).

    Example:
        >>> from shardprop.demo.model import Llama, LlamaConfig, synthetic_batch
        >>> cfg = LlamaConfig(dim=64, n_layers=2, n_heads=4, vocab_size=128, seq_len=16)
        >>> plan = autoplan(Llama(cfg), 4, (synthetic_batch(cfg, 8, 0)[0],))
        >>> plan.shape.world
        4
        >>> print(plan)  # each unit's choice, its predicted compute, communication, memory and runner-up  # doctest: +SKIP
        >>> model = plan.apply(Llama(cfg, seed=0))
    """
    if objective not in ("step_time", "memory"):
        raise ValueError(f"autoplan: objective must be 'step_time' or 'memory', not {objective!r}")
    t0 = time.perf_counter()
    cm = cost_model or CostModel.default()
    world, fixed = _world_of(mesh)
    graph = trace_model(model, example_inputs)
    batch = next((x.shape[0] for x in example_inputs if hasattr(x, "shape") and len(x.shape)), None)
    has_sdpa = any("scaled_dot_product" in str(n.op) for n in graph.nodes)
    seq = next((x.shape[1] for x in example_inputs if hasattr(x, "shape") and len(x.shape) > 1), None)
    candidates = list(shapes) if shapes is not None else [fixed] if fixed else mesh_shapes(
        world, batch, max_tp, seq if context_parallel and has_sdpa else None)
    if not candidates:
        raise ValueError(f"autoplan: no dp x tp shape of {world} ranks divides the batch of {batch}")
    solved: List[Solution] = []
    units_by_tp = {}
    smallest = None
    for shape in candidates:
        if shape.tp not in units_by_tp:
            units_by_tp[shape.tp] = find_units(model, graph, strategies(graph, shape.tp), shape.tp, cm)
        u = units_by_tp[shape.tp]
        free = solve_shape(u, shape, cm, sequence_parallel=sequence_parallel, loss_parallel=loss_parallel) if memory_per_rank is not None else None
        if free is not None and (smallest is None or free.memory < smallest.memory):
            smallest = free
        sol = solve_shape(u, shape, cm, memory_per_rank=memory_per_rank, sequence_parallel=sequence_parallel,
                          loss_parallel=loss_parallel)
        if sol is not None:
            solved.append(sol)
    if not solved and memory_per_rank is None:  # nothing fits the options asked for, whatever the memory
        why = "; ".join(sorted({u.sp_why_not for u in units_by_tp.values() if not u.sp_ok and u.sp_why_not}))
        raise NoPlanFits(f"autoplan: no plan for {world} ranks with the options asked for "
                         f"(shapes {', '.join(map(str, candidates))}, sequence_parallel={sequence_parallel})"
                         + (f": sequence parallelism is not possible: {why}" if sequence_parallel and why else ""))
    if not solved:
        hint = f"; the smallest plan found needs {smallest.memory / 2**30:.2f} GiB ({smallest.shape})" if smallest else ""
        raise NoPlanFits(f"autoplan: no plan for {world} ranks fits {memory_per_rank / 2**30:.2f} GiB per rank{hint}. "
                         "Use more ranks, a smaller batch per rank, or activation checkpointing.")
    key = (lambda s: (s.memory, s.step_time)) if objective == "memory" else (lambda s: (s.step_time, s.memory))
    best = min(solved, key=key)
    u = units_by_tp[best.shape.tp]
    block = u.block_prefix.rpartition(".")[0] + ".*" if u.block_prefix else ""
    kws = graph.module_kw
    regions = tuple((r.path, tuple(e.path for e in r.entries), r.exit.path if r.exit else "",
                     kws.get(f"{u.block_prefix}.{r.path}", "")) for r in u.regions)
    notes = []
    for r in u.regions:
        if not r.shardable and best.shape.tp > 1:
            notes.append(f"note: {block}.{r.path} not sharded over tp {best.shape.tp}: {r.why_not}")
    if best.shape.dp * best.shape.cp == 1 and all(c.choice in ("replicate", "off") for c in best.choices):
        notes.append("note: nothing sharded: every rank runs the whole model (at this size, parallelism costs more "
                     "than it saves)")
    if best.shape.tp > 1 and not u.sp_ok:
        notes.append(f"note: no sequence parallelism: {u.sp_why_not}")
    return Plan(best, tuple(s for s in solved if s is not best), block, regions, u.block_norms, u.embedding_path,
                u.output_path, u.final_norm, cm.source, time.perf_counter() - t0, tuple(notes))
