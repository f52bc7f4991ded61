"""Token dispatch and combine for expert parallelism, on plain local tensors.

With ``E`` experts over ``n`` ep ranks, rank ``j`` holds experts ``j*L .. (j+1)*L - 1``
(``L = E / n``, the ``Shard(0)`` pieces of the stacked expert weights). Each rank brings its
own tokens, already sorted by expert, and ``num_tokens_per_expert`` (length ``E``).

dispatch:
 1. one small all-to-all sends each peer how many of this rank's tokens go to each of its
    experts (plus a status word: a rank whose arguments are wrong makes every rank raise);
 2. one uneven all-to-all sends the tokens (rank ``j`` gets the contiguous run of rows for
    its experts from every rank), in (source rank, local expert) order;
 3. a gather regroups them by local expert, (local expert, source rank) order, so the
    experts module sees its usual input: rows sorted by (local) expert and their counts.
combine: the inverse gather, then the inverse all-to-all. Both moves are differentiable.

Example:
    >>> routed, counts, route = dispatch(x, num_tokens_per_expert, mesh, 0, 8)  # doctest: +SKIP
    >>> y = combine(experts_forward(routed, counts), route)  # doctest: +SKIP
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from shardprop.mesh import collectives, compat
from shardprop.mesh.uneven_all_to_all import all_to_all_uneven, exchange_splits

# Reasons a rank's own arguments are refused (every rank prints the reason of the rank at fault).
REASONS = (
    "num_tokens_per_expert has the wrong number of experts",
    "num_tokens_per_expert is not a 1-d integer tensor",
    "a negative token count",
    "the token count differs from the sum of num_tokens_per_expert",
    "tokens of the wrong width",
    "x is not a 2-d tensor of tokens",
)


@dataclass
class Route:
    """What combine needs to undo one dispatch (and what stats report).

    ``received[i, e]``: tokens rank ``i`` (index in the ep group) sent for local expert ``e``;
    ``order``: the regrouping gather (None when it is the identity, one local expert).
    """

    mesh: object
    dim: object
    input_splits: List[int]
    output_splits: List[int]
    received: torch.Tensor
    order: Optional[torch.Tensor]
    device: torch.device

    @property
    def tokens_per_local_expert(self) -> List[int]:
        """Tokens each local expert computes in this step (from every rank)."""
        return [int(v) for v in self.received.sum(0).tolist()]


def _check(x: torch.Tensor, counts, num_experts: int, width: Optional[int]) -> Optional[Tuple[int, str]]:
    """This rank's own problem with its arguments as (index into REASONS, detail), or None."""
    if x.ndim != 2:
        return 5, f"gave x of shape {tuple(x.shape)}; want (tokens, dim)"
    if not isinstance(counts, torch.Tensor) or counts.ndim != 1 or counts.is_floating_point():
        return 1, f"gave num_tokens_per_expert {counts!r}"
    if counts.shape[0] != num_experts:
        return 0, f"gave num_tokens_per_expert of {counts.shape[0]} experts; the module has {num_experts}"
    if width is not None and x.shape[1] != width:
        return 4, f"gave tokens of width {x.shape[1]}; the experts take {width}"
    c = counts.detach().cpu()
    if bool((c < 0).any()):
        return 2, f"gave negative counts in num_tokens_per_expert {c.tolist()}"
    if int(c.sum()) != x.shape[0]:
        return 3, f"gave {x.shape[0]} tokens but num_tokens_per_expert sums to {int(c.sum())}"
    return None


def _regroup_order(received: torch.Tensor, device) -> Optional[torch.Tensor]:
    """Rows in (source, expert) order -> the gather index that puts them in (expert, source) order."""
    n, L = received.shape
    if L == 1:
        return None
    flat = received.reshape(-1)
    starts = torch.cumsum(flat, 0) - flat  # where each (source, expert) run starts in the buffer
    lengths = received.t().reshape(-1)     # runs in the order wanted: expert-major
    run_starts = starts.view(n, L).t().reshape(-1)
    total = int(flat.sum())
    # Row k of the result is row (its run's start + its offset in the run) of the buffer.
    offsets = torch.arange(total) - torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
    return (torch.repeat_interleave(run_starts, lengths) + offsets).to(device)


# Routing is a redistribution: like every collective and redistribution program it runs beneath the user's
# dispatch modes (compat.beneath_dispatch_modes), so a selective-checkpoint policy neither caches its
# buffers (which it then writes into) nor replays its exchanges.
@compat.beneath_dispatch_modes
def dispatch(x: torch.Tensor, num_tokens_per_expert: torch.Tensor, mesh, dim, num_experts: int, *,
             width: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor, Route]:
    """Send this rank's tokens (sorted by expert) to the ranks holding their experts.

    Returns the tokens this rank's experts compute, sorted by local expert, their counts per
    local expert (a tensor like ``num_tokens_per_expert``) and the :class:`Route` that
    :func:`combine` undoes. ``width`` is the token width the experts take (checked). Bad
    arguments on any rank raise the same ``ValueError`` on every rank of the ep group.

    Example:
        >>> routed, counts, route = dispatch(x, torch.tensor([3, 0, 2, 1, 0, 0, 4, 2]), mesh, "ep", 8)  # doctest: +SKIP
    """
    _, _, n = collectives.resolve(mesh, dim)
    if num_experts % n:
        raise ValueError(f"shardprop ExpertParallel: {num_experts} experts do not split over {n} ep ranks")
    L = num_experts // n
    problem = _check(x, num_tokens_per_expert, num_experts, width)
    if problem is None:
        per_peer = num_tokens_per_expert.detach().to("cpu", torch.int64).view(n, L)
    else:
        per_peer = torch.zeros(n, L, dtype=torch.int64)
    input_splits = [int(v) for v in per_peer.sum(1).tolist()]
    output_splits, received = exchange_splits(x if x.ndim else x.reshape(1), mesh, dim, input_splits,
                                              what="ExpertParallel", extra=per_peer, reasons=REASONS,
                                              problem=problem)
    routed = all_to_all_uneven(x, mesh, dim, input_splits, output_splits)
    order = _regroup_order(received, x.device)
    if order is not None:
        routed = routed.index_select(0, order)
    local_counts = received.sum(0).to(device=num_tokens_per_expert.device, dtype=num_tokens_per_expert.dtype)
    return routed, local_counts, Route(mesh, dim, input_splits, output_splits, received, order, x.device)


@compat.beneath_dispatch_modes
def combine(y: torch.Tensor, route: Route) -> torch.Tensor:
    """The experts' outputs back to the ranks (and the order) their tokens came from.

    Example:
        >>> out = combine(experts(routed, counts), route)  # same rows as dispatch's x  # doctest: +SKIP
    """
    if route.order is not None:
        inverse = torch.empty_like(route.order)
        inverse[route.order] = torch.arange(route.order.numel(), device=route.order.device)
        y = y.index_select(0, inverse)
    return all_to_all_uneven(y, route.mesh, route.dim, route.output_splits, route.input_splits)


__all__ = ["REASONS", "Route", "combine", "dispatch"]
