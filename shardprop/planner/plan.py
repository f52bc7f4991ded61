"""The plan autoplan returns: readable, editable, and applied with the public styles and ``fully_shard``.

A :class:`Plan` holds the mesh shape, the boundary layout (sequence parallelism or not), one
choice per unit and the predictions. ``print(plan)`` shows each unit's choice with its predicted
compute, communication and memory and the runner-up it beat; :meth:`Plan.tp_plan` is the
``parallelize_module`` dict it applies (edit it, or build a plan with :meth:`Plan.replace`);
:meth:`Plan.apply` parallelizes a model in place.

    >>> plan = autoplan(model, 4, (tokens,))  # doctest: +SKIP
    >>> print(plan)  # doctest: +SKIP
    >>> model = plan.apply(model)  # doctest: +SKIP
    >>> loss = lm_loss(model(plan.local_batch(tokens)), plan.local_batch(targets))  # doctest: +SKIP
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.nn as nn

from shardprop.planner.solve import Shape, Solution
from shardprop.parallel.tp.styles import ParallelStyle
from shardprop.tensor.placement import Replicate, Shard

__all__ = ["Plan", "NoPlanFits"]


class NoPlanFits(RuntimeError):
    """No mesh shape and no placement keeps a rank within the memory limit.

    Example:
        >>> from shardprop.demo.model import Llama, LlamaConfig, synthetic_batch
        >>> cfg = LlamaConfig(dim=64, n_layers=2, n_heads=4, vocab_size=128, seq_len=16)
        >>> try:
        ...     autoplan(Llama(cfg), 4, (synthetic_batch(cfg, 8, 0)[0],), memory_per_rank=1024)
        ... except NoPlanFits as e:
        ...     print(str(e).split(" fits")[0])
        autoplan: no plan for 4 ranks
    """


def _fmt_s(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 10 else f"{s:.1f} s"


def _fmt_b(n: float) -> str:
    if n < 0:
        return "-" + _fmt_b(-n)
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class Plan:
    """A parallelism plan for one model on ``shape.world`` ranks (see the module docstring).

    ``solution`` is the winner; ``others`` the best plan of each other mesh shape tried (for the
    report); ``block`` the repeated block's path pattern (``"layers.*"``), ``regions`` its
    regions' relative paths with their Linears, ``norms`` its norm modules.

    Example:
        >>> from shardprop.demo.model import Llama, LlamaConfig, synthetic_batch
        >>> from shardprop.planner import Shape
        >>> cfg = LlamaConfig(dim=64, n_layers=2, n_heads=4, vocab_size=128, seq_len=16)
        >>> plan = autoplan(Llama(cfg), 4, (synthetic_batch(cfg, 8, 0)[0],), shapes=[Shape(2, 2)])
        >>> plan.mesh_shape()
        ((2, 2), ('dp', 'tp'))
        >>> plan.tp_plan()  # the TP styles it chose, an editable dict  # doctest: +SKIP
        >>> model = plan.apply(Llama(cfg, seed=0))  # the styles and fully_shard, on a (dp, tp) mesh
    """

    solution: Solution
    others: Tuple[Solution, ...]
    block: str
    regions: Tuple[Tuple[str, Tuple[str, ...], str, str], ...]   # (region, entry Linears, exit Linear, input kwarg)
    norms: Tuple[str, ...]
    embedding: str
    output: str
    final_norm: str
    cost_source: str
    plan_seconds: float
    notes: Tuple[str, ...] = ()

    # ---------------------------------------------------------------- reading
    @property
    def shape(self) -> Shape:
        return self.solution.shape

    @property
    def sequence_parallel(self) -> bool:
        return self.solution.boundary == "sequence-parallel"

    @property
    def loss_parallel(self) -> bool:
        return any(c.unit == "output" and c.choice == "colwise, loss parallel" for c in self.solution.choices)

    def loss_context(self):
        """Where the loss (and its backward) must run: ``shardprop.loss_parallel()`` if the plan keeps the
        logits vocab-sharded, else a context that does nothing.

            >>> with plan.loss_context():  # doctest: +SKIP
            ...     loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()); loss.backward()
        """
        import contextlib

        from shardprop.parallel.tp.loss_parallel import loss_parallel

        return loss_parallel() if self.loss_parallel else contextlib.nullcontext()

    @property
    def activation_checkpointing(self) -> bool:
        return any(c.unit == "activation checkpointing" and c.choice == "every block" for c in self.solution.choices)

    @property
    def fsdp(self) -> bool:
        return self.shape.dp * self.shape.cp > 1

    @property
    def predicted_step_time(self) -> float:
        return self.solution.step_time

    def replace(self, **changes) -> "Plan":
        """A copy with fields changed (``plan.replace(solution=...)``): plans are immutable values."""
        return dataclasses.replace(self, **changes)

    def mesh_shape(self) -> Tuple[Tuple[int, ...], Tuple[str, ...]]:
        """The device mesh this plan runs on: ``((dp, tp), ("dp", "tp"))`` without the size-1 dims."""
        dims = [(n, v) for n, v in (("dp", self.shape.dp), ("tp", self.shape.tp)) if v > 1] or [("dp", 1)]
        return tuple(v for _, v in dims), tuple(n for n, _ in dims)

    def tp_plan(self) -> Dict[str, object]:
        """The ``parallelize_module`` plan for the tp mesh dim (empty when tp is 1).

            >>> plan.tp_plan()["layers.*.attention.wq"]  # doctest: +SKIP
            ColwiseParallel(...)
        """
        from shardprop.parallel.tp.styles import (
            ColwiseParallel, PrepareModuleInput, PrepareModuleOutput, RowwiseParallel, SequenceParallel)

        if self.shape.tp == 1:
            return {}
        sp = self.sequence_parallel
        S1, R = Shard(1), Replicate()
        L = S1 if sp else R
        out: Dict[str, object] = {}
        choice = {c.unit: c.choice for c in self.solution.choices}
        if self.embedding:
            if choice.get("embedding") == "vocab-sharded":
                out[self.embedding] = RowwiseParallel(input_layouts=R, output_layouts=L)
            elif sp:
                out[self.embedding] = PrepareModuleOutput(output_layouts=R, desired_output_layouts=S1)
        for name in self.norms if sp else ():
            out[f"{self.block}.{name}"] = SequenceParallel()
        for region, entries, exit_, kw in self.regions:
            if choice.get(f"block.{region}") == "colwise+rowwise":
                if sp and kw:  # the region takes its input by keyword (HF: self_attn(hidden_states=...))
                    out[f"{self.block}.{region}"] = PrepareModuleInput(
                        input_kwarg_layouts={kw: S1}, desired_input_kwarg_layouts={kw: R})
                elif sp:
                    out[f"{self.block}.{region}"] = PrepareModuleInput(input_layouts=(S1,), desired_input_layouts=(R,))
                for e in entries:
                    out[f"{self.block}.{e}"] = ColwiseParallel()
                out[f"{self.block}.{exit_}"] = RowwiseParallel(output_layouts=L)
            elif sp:
                out[f"{self.block}.{region}"] = _GatherAround()
        if sp and self.final_norm:
            out[self.final_norm] = SequenceParallel()
        if self.output:
            if choice.get("output") == "colwise":
                out[self.output] = ColwiseParallel(input_layouts=L, output_layouts=R)
            elif choice.get("output") == "colwise, loss parallel":
                out[self.output] = ColwiseParallel(input_layouts=L, output_layouts=Shard(-1), use_local_output=False)
            elif sp:
                out[self.output] = PrepareModuleInput(input_layouts=(S1,), desired_input_layouts=(R,))
        return out

    # ---------------------------------------------------------------- applying
    def make_mesh(self, device_type: Optional[str] = None):
        """``init_device_mesh`` of :meth:`mesh_shape` (the default process group must span ``shape.world`` ranks)."""
        from shardprop.mesh import init_device_mesh

        shape, names = self.mesh_shape()
        return init_device_mesh(device_type or "cpu", shape, mesh_dim_names=names)

    def apply(self, model: nn.Module, mesh=None) -> nn.Module:
        """Parallelize ``model`` in place: tensor parallelism over tp, then ``fully_shard`` of each block and the root over dp.

        ``mesh``: a mesh with dims named "dp" and/or "tp" of this plan's sizes (default: :meth:`make_mesh`).
        Feed each rank its rows of the batch: :meth:`local_batch`.
            >>> model = plan.apply(model)  # doctest: +SKIP
        """
        from shardprop.parallel.fsdp.fully_shard import fully_shard
        from shardprop.parallel.tp.parallelize import parallelize_module

        if mesh is None and self.shape.cp > 1:
            raise NotImplementedError(
                "Plan.apply: a plan with context parallelism needs the mesh given, (dp x cp, tp) as torchtitan's "
                "dp_shard_cp (fully_shard spans it), and the training step under shardprop.context_parallel over cp")
        if mesh is None:
            dev = next((p.device.type for p in model.parameters()), "cpu")
            mesh = self.make_mesh("cpu" if dev == "meta" else dev)
        names = mesh.mesh_dim_names or tuple(str(i) for i in range(mesh.ndim))
        # A 2-d mesh is (dp, tp) in that order (any names: the dry run's is ("dp_cp", "tp")); a 1-d one is
        # whichever of dp and tp this plan uses.
        if mesh.ndim == 2:
            dp_mesh, tp_mesh = mesh[names[0]], mesh[names[1]]
        else:
            dp_mesh, tp_mesh = mesh, mesh
        if self.shape.tp > 1:
            parallelize_module(model, tp_mesh, self.tp_plan())
        prefix = self.block.rpartition(".")[0]
        blocks = model.get_submodule(prefix) if prefix else []
        if self.activation_checkpointing:  # torch's non-reentrant checkpoint of each block, as torchtitan's "full" AC
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

            for i, block in enumerate(list(blocks)):
                blocks[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        if self.fsdp:
            for block in blocks:
                fully_shard(block, mesh=dp_mesh)
            fully_shard(model, mesh=dp_mesh)
        return model

    def dp_rank(self) -> int:
        import torch.distributed as dist

        return (dist.get_rank() // self.shape.tp) % self.shape.dp if dist.is_initialized() else 0

    def local_batch(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a global batch (split over dp; tp ranks of one dp group see the same rows)."""
        return t.chunk(self.shape.dp, dim=0)[self.dp_rank()] if self.shape.dp > 1 else t

    # ---------------------------------------------------------------- printing
    def __str__(self) -> str:
        from tabulate import tabulate

        s = self.solution
        head = (f"autoplan: {s.shape} on {s.shape.world} ranks"
                f"{', sequence parallel' if self.sequence_parallel else ''}"
                f"{', fully_shard over dp' if self.fsdp else ''}"
                f"{', activation checkpointing' if self.activation_checkpointing else ''}"
                f"{', loss parallel' if self.loss_parallel else ''}; predicted step {_fmt_s(s.step_time)} "
                f"(compute {_fmt_s(s.compute)}, tp comm {_fmt_s(s.tp_comm)}, dp comm {_fmt_s(s.dp_comm)}, "
                f"overhead {_fmt_s(s.overhead)}), memory {_fmt_b(s.memory)} per rank "
                f"[costs: {self.cost_source}; planned in {self.plan_seconds:.1f} s]")
        rows = []
        names = {"block boundary": f"{self.block} boundary", "embedding": self.embedding, "output": self.output,
                 "activation checkpointing": f"{self.block} checkpointing"}
        for c in s.choices:
            unit = names.get(c.unit) or f"{self.block}.{c.unit[6:]}"
            if not c.runner_up:
                beat = "-"
            elif c.runner_up_delta >= 0:
                beat = f"{c.runner_up} (+{_fmt_s(c.runner_up_delta)})"
            else:  # faster, but over the memory limit (or kept out by another unit's choice)
                beat = f"{c.runner_up} ({_fmt_s(-c.runner_up_delta)} faster, over the memory limit)"
            rows.append([unit, c.choice, _fmt_s(c.compute), _fmt_s(c.comm), _fmt_b(c.memory), beat])
        table = tabulate(rows, headers=["unit", "choice", "compute", "comm", "memory", "runner-up (slower by)"])
        shapes = sorted(self.others, key=lambda o: o.step_time)[:4]
        alt = "; ".join(f"{o.shape}: {_fmt_s(o.step_time)}, {_fmt_b(o.memory)}" for o in shapes)
        lines = [head, table]
        if alt:
            lines.append(f"other mesh shapes: {alt}")
        lines += list(self.notes)
        return "\n".join(lines)

    __repr__ = __str__


class _GatherAround(ParallelStyle):
    """A replicated region inside a sequence-parallel block: gather its input, chunk its output.

    The public styles PrepareModuleInput then PrepareModuleOutput, as one entry of the plan.
    """

    def _apply(self, module, mesh, name: str = ""):
        from shardprop.parallel.tp.styles import PrepareModuleInput, PrepareModuleOutput

        S1, R = Shard(1), Replicate()
        PrepareModuleInput(input_layouts=(S1,), desired_input_layouts=(R,))._apply(module, mesh, name)
        return PrepareModuleOutput(output_layouts=R, desired_output_layouts=S1)._apply(module, mesh, name)
