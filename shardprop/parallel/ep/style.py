"""ExpertParallel: shard a grouped-experts module over an ep mesh dim and route tokens to it.

The module follows torchtitan's ``GroupedExperts`` contract: stacked expert weights (``w1``,
``w3`` ``[experts, dim, hidden]``, ``w2`` ``[experts, hidden, dim]``; any parameter whose
dim 0 counts the experts), ``forward(x, num_tokens_per_expert)`` with ``x`` the tokens sorted by
expert, and weights read through ``.to_local()`` when they are DTensors. The style makes every
parameter ``Shard(0)`` over the ep mesh, and wraps forward in two hooks: before it,
:func:`routing.dispatch` (each rank's tokens to the ranks holding their experts, regrouped by
local expert); after it, :func:`routing.combine` (results back, in the caller's order). The
module itself runs unchanged on its local experts.
"""
from __future__ import annotations

import functools
from typing import List

from torch import nn

from shardprop.dispatch import dispatcher as _dispatch
from shardprop.dispatch import fast_paths
from shardprop.parallel.ep import routing
from shardprop.parallel.styles import ParallelStyle, check_divisible, distribute_params
from shardprop.tensor.placement import Shard


class _Routes:
    """The routes of the forwards now running on one module (a stack: dispatch pushes, combine pops).

    ``last``: the route of the most recent dispatch, kept for statistics.
    """

    def __init__(self) -> None:
        self.stack: List[routing.Route] = []
        self.last = None


def _experts(module: nn.Module, name: str) -> int:
    params = [(n, p) for n, p in module.named_parameters(recurse=False) if p is not None]
    if not params or any(p.ndim < 1 for _, p in params):
        raise ValueError(f"parallelize_module: ExpertParallel on {name!r} ({type(module).__name__}) needs stacked "
                         "expert weights (w1, w2, w3 with the experts along dim 0); it has "
                         f"{[(n, tuple(p.shape)) for n, p in params]}")
    counts = {p.shape[0] for _, p in params}
    if len(counts) != 1:
        raise ValueError(f"parallelize_module: ExpertParallel on {name!r}: the parameters disagree on the number "
                         f"of experts (dim 0): {[(n, tuple(p.shape)) for n, p in params]}")
    return counts.pop()


def _width(module: nn.Module):
    """The token width the experts take (``w1``'s dim 1), if the module has a ``w1``."""
    w1 = getattr(module, "w1", None)
    return w1.shape[1] if w1 is not None and w1.ndim == 3 else None


def _dispatch_hook(mesh, num_experts, routes, name, module, args, kwargs):
    x, counts = _inputs(args, kwargs)
    if fast_paths.recording():  # inside explain(): the moves and the load this rank's experts got
        routed, local_counts, route = fast_paths.run_recorded(
            "moe_dispatch", f"ExpertParallel dispatch on {name!r}", ((Shard(0),),), (0,),
            functools.partial(routing.dispatch, width=_width(module)), x, counts, mesh, 0, num_experts)
        _note_load(name, route)
    else:
        routed, local_counts, route = routing.dispatch(x, counts, mesh, 0, num_experts, width=_width(module))
    routes.stack.append(route)
    routes.last = route
    return (routed, local_counts) + tuple(args[2:]), {k: v for k, v in kwargs.items()
                                                      if k not in ("x", "num_tokens_per_expert")}


def _inputs(args, kwargs):
    x = args[0] if args else kwargs.get("x")
    counts = args[1] if len(args) > 1 else kwargs.get("num_tokens_per_expert")
    if x is None or counts is None:
        raise TypeError("ExpertParallel: the experts module takes forward(x, num_tokens_per_expert)")
    return x, counts


def _combine_hook(routes, name, module, args, kwargs, output):
    if fast_paths.recording():
        return fast_paths.run_recorded("moe_combine", f"ExpertParallel combine on {name!r}", (), (0,),
                                       routing.combine, output, routes.stack.pop())
    return routing.combine(output, routes.stack.pop())


def _note_load(name: str, route: routing.Route) -> None:
    """A line for explain(): tokens per local expert, from each ep rank, and this rank's share of the load."""
    rec = _dispatch.recorder
    if rec is None or not hasattr(rec, "note"):
        return
    mine = sum(route.output_splits)
    rec.note(f"ExpertParallel on {name!r}: local experts got tokens {route.tokens_per_local_expert} "
             f"(from ep ranks: {route.received.tolist()}); this rank computes {mine} token copies, "
             f"sends {sum(route.input_splits)}")


class ExpertParallel(ParallelStyle):
    """Experts ``Shard(0)`` over the (1-d) ep mesh; tokens dispatched to their experts and combined back.

    Each ep rank brings its own tokens (the batch is split over ep), sorted by expert, with
    ``num_tokens_per_expert`` for all experts. Per forward: one small all-to-all (token counts,
    with a status word so that bad counts on any rank raise on every rank), one all-to-all of
    tokens there and one back; backward: the two token all-to-alls inverted. The experts'
    gradients land on the ranks holding them, laid out ``Shard(0)`` like the weights. Parameters
    outside the experts (router, shared experts) are the caller's: replicate or data-parallel them.

    Example:
        >>> mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))  # doctest: +SKIP
        >>> parallelize_module(moe.experts, mesh["ep"], ExpertParallel())  # doctest: +SKIP
        >>> out = moe(x_of_this_rank)  # the experts run on this rank's 8 / 4 experts  # doctest: +SKIP
    """

    def _apply(self, module: nn.Module, mesh, name: str = "") -> nn.Module:
        num_experts = _experts(module, name)
        for pname, _ in module.named_parameters(recurse=False):
            check_divisible(name, module, "ExpertParallel", pname, 0, mesh)
        distribute_params(module, mesh, lambda _: Shard(0), self.src_data_rank)
        routes = _Routes()
        module._shardprop_expert_routes = routes  # read by stats (expert_load)
        # Partials of module-level functions: torch.save(model) pickles the hooks.
        module.register_forward_pre_hook(functools.partial(_dispatch_hook, mesh, num_experts, routes, name),
                                         with_kwargs=True)
        module.register_forward_hook(functools.partial(_combine_hook, routes, name), with_kwargs=True)
        return module


__all__ = ["ExpertParallel"]
