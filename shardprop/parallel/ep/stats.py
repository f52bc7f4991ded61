"""How the tokens of the last forward spread over the experts: tokens per expert and load imbalance.

Why: with expert parallelism a step is as slow as its busiest rank, and routing decides the
load at run time. Each rank knows what its own experts computed (the counts received in the
dispatch); :func:`expert_load` gathers those over the ep group (one small all-gather, called
on every rank) into the whole picture.

Example:
    >>> load = expert_load(moe.experts)  # every ep rank calls it, after a forward  # doctest: +SKIP
    >>> load.tokens_per_expert, load.imbalance  # doctest: +SKIP
    ([5, 3, 0, 8, 2, 6, 4, 4], 2.0)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch
from torch import nn

from shardprop.mesh import collectives


@dataclass(frozen=True)
class ExpertLoad:
    """Tokens per expert (all experts, in expert order) and per ep rank in the last forward.

    ``imbalance``: the busiest expert's tokens over the mean per expert (1.0: perfectly even);
    ``rank_imbalance``: the same over ep ranks (what bounds the step time).

    Example:
        >>> load = ExpertLoad(tokens_per_expert=[6, 2, 0, 0], tokens_per_rank=[8, 0])
        >>> load.imbalance, load.rank_imbalance
        (3.0, 2.0)
    """

    tokens_per_expert: List[int]
    tokens_per_rank: List[int]

    @property
    def imbalance(self) -> float:
        return _ratio(self.tokens_per_expert)

    @property
    def rank_imbalance(self) -> float:
        return _ratio(self.tokens_per_rank)

    def __str__(self) -> str:
        return (f"tokens per expert {self.tokens_per_expert} (max/mean {self.imbalance:.2f}), per ep rank "
                f"{self.tokens_per_rank} (max/mean {self.rank_imbalance:.2f})")


def _ratio(counts: List[int]) -> float:
    total = sum(counts)
    return max(counts) * len(counts) / total if total else 1.0


def local_load(module: nn.Module) -> List[int]:
    """Tokens each of this rank's experts computed in the module's last forward (no communication).

    Example:
        >>> local_load(moe.experts)  # 2 local experts  # doctest: +SKIP
        [7, 3]
    """
    route = _last_route(module)
    return route.tokens_per_local_expert


def expert_load(module: nn.Module) -> ExpertLoad:
    """Tokens per expert over the whole ep group in the module's last forward (call on every ep rank).

    One all-gather of each rank's per-expert counts over the ep mesh (counted by ``comm_counter``).

    Example:
        >>> from shardprop.demo.moe import MoE
        >>> mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
        >>> _ = torch.manual_seed(0); moe = MoE(dim=16, hidden=24, num_experts=8, top_k=2)
        >>> _ = parallelize_module(moe.experts, mesh, ExpertParallel())
        >>> _ = moe(torch.randn(2, 5, 16))             # 10 tokens per rank, 2 experts each
        >>> load = expert_load(moe.experts)            # every ep rank calls it, after a forward
        >>> sum(load.tokens_per_expert), len(load.tokens_per_rank)
        (80, 4)
        >>> print(load)
        tokens per expert [...] (max/mean ...), per ep rank [...] (max/mean ...)
    """
    route = _last_route(module)
    mine = torch.tensor(route.tokens_per_local_expert, dtype=torch.int64)
    # On the tokens' device: the ep group's backend may carry nothing else (NCCL, for one).
    every = collectives.all_gather(mine.to(route.device), route.mesh, route.dim).cpu()
    L = mine.numel()
    per_expert = [int(v) for v in every.tolist()]
    return ExpertLoad(per_expert, [sum(per_expert[i:i + L]) for i in range(0, len(per_expert), L)])


def _last_route(module: nn.Module):
    routes = getattr(module, "_shardprop_expert_routes", None)
    if routes is None:
        raise ValueError(f"expert_load: {type(module).__name__} is not laid out by ExpertParallel")
    if routes.last is None:
        raise ValueError("expert_load: the module has not run a forward yet")
    return routes.last


__all__ = ["ExpertLoad", "expert_load", "local_load"]
