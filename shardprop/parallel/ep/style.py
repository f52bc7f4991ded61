"""ExpertParallel: shard a grouped-experts module over an ep mesh dim and route tokens to it.

The module follows torchtitan's ``GroupedExperts`` contract: stacked expert weights (``w1``,
``w3`` ``[experts, dim, hidden]``, ``w2`` ``[experts, hidden, dim]``; any parameter whose
dim 0 counts the experts), ``forward(x, num_tokens_per_expert)`` with ``x`` the tokens sorted by
expert, and weights read through ``.to_local()`` when they are DTensors. The style makes every
parameter ``Shard(0)`` over the ep mesh, and wraps forward in two hooks: before it,
:func:`routing.dispatch` (each rank's tokens to the ranks holding their experts, regrouped by
local expert); after it, :func:`routing.combine` (results back, in the caller's order). The
module itself runs unchanged on its local experts. ``ExpertTensorParallel`` does the same on a
2-d (ep, tp) mesh with each expert's hidden dim sharded over tp (``tensor_parallel``: the
all-reduces of that region).
"""
from __future__ import annotations

import functools
from typing import List

from torch import nn

from shardprop.dispatch.hooks import hooks as _hooks
from shardprop.dispatch import fast_paths
from shardprop.parallel.ep import routing, tensor_parallel
from shardprop.parallel.tp.styles import ParallelStyle, check_divisible, distribute_params
from shardprop.tensor.compile_support import outside_graphs
from shardprop.tensor.placement import Replicate, Shard


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


class _Layout:
    """What the hooks of one styled module need: its mesh, the ep (and tp) mesh dim, experts, name, routes."""

    def __init__(self, mesh, ep: int, tp, num_experts: int, name: str) -> None:
        self.mesh, self.ep, self.tp, self.num_experts, self.name = mesh, ep, tp, num_experts, name
        self.routes = _Routes()


# Routing reads split sizes on the host and runs collectives: under torch.compile the graph
# breaks around both hooks and they run eagerly.
@outside_graphs
def _dispatch_hook(lay, module, args, kwargs):
    x, counts = _inputs(args, kwargs)
    dispatch = functools.partial(routing.dispatch, width=_width(module))
    if fast_paths.recording():  # inside explain(): the moves and the load this rank's experts got
        routed, local_counts, route = fast_paths.run_recorded(
            "moe_dispatch", f"{_style(lay)} dispatch on {lay.name!r}", ((Shard(0),),), (lay.ep,),
            dispatch, x, counts, lay.mesh, lay.ep, lay.num_experts)
        _note_load(lay, route)
    else:
        routed, local_counts, route = dispatch(x, counts, lay.mesh, lay.ep, lay.num_experts)
    if lay.tp is not None:  # the tokens are replicated over tp: their gradient is summed there
        routed = tensor_parallel.copy_in(routed, lay.mesh, lay.tp)
    lay.routes.stack.append(route)
    lay.routes.last = route
    return (routed, local_counts) + tuple(args[2:]), {k: v for k, v in kwargs.items()
                                                      if k not in ("x", "num_tokens_per_expert")}


def _style(lay) -> str:
    return "ExpertParallel" if lay.tp is None else "ExpertTensorParallel"


def _inputs(args, kwargs):
    x = args[0] if args else kwargs.get("x")
    counts = args[1] if len(args) > 1 else kwargs.get("num_tokens_per_expert")
    if x is None or counts is None:
        raise TypeError("ExpertParallel: the experts module takes forward(x, num_tokens_per_expert)")
    return x, counts


@outside_graphs
def _combine_hook(lay, module, args, kwargs, output):
    route = lay.routes.stack.pop()
    if lay.tp is not None:  # each tp rank computed its slice of the hidden dim: partial sums
        output = tensor_parallel.reduce_out(output, lay.mesh, lay.tp)
    if fast_paths.recording():
        return fast_paths.run_recorded("moe_combine", f"{_style(lay)} combine on {lay.name!r}", (), (lay.ep,),
                                       routing.combine, output, route)
    return routing.combine(output, route)


def _note_load(lay, route: routing.Route) -> None:
    """A line for explain(): tokens per local expert, from each ep rank, and what this rank computes and sends."""
    rec = _hooks.recorder
    if rec is None or not hasattr(rec, "note"):
        return
    rec.note(f"{_style(lay)} on {lay.name!r}: local experts got tokens {route.tokens_per_local_expert} "
             f"(from ep ranks: {route.received.tolist()}); this rank computes {sum(route.output_splits)} "
             f"token copies, sends {sum(route.input_splits)}")


def _install(module: nn.Module, lay: _Layout) -> nn.Module:
    module._shardprop_expert_routes = lay.routes  # read by stats (expert_load)
    # Partials of module-level functions: torch.save(model) pickles the hooks.
    module.register_forward_pre_hook(functools.partial(_dispatch_hook, lay), with_kwargs=True)
    module.register_forward_hook(functools.partial(_combine_hook, lay), with_kwargs=True)
    return module


class ExpertParallel(ParallelStyle):
    """Experts ``Shard(0)`` over the (1-d) ep mesh; tokens dispatched to their experts and combined back.

    Each ep rank brings its own tokens (the batch is split over ep), sorted by expert, with
    ``num_tokens_per_expert`` for all experts. Per forward: one small all-to-all (token counts,
    with a status word so that bad counts on any rank raise on every rank), one all-to-all of
    tokens there and one back; backward: the two token all-to-alls inverted. The experts'
    gradients land on the ranks holding them, laid out ``Shard(0)`` like the weights. Parameters
    outside the experts (router, shared experts) are the caller's: replicate or data-parallel them.

    Example:
        >>> from shardprop.demo.moe import MoE
        >>> mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
        >>> _ = torch.manual_seed(0); moe = MoE(dim=16, hidden=24, num_experts=8, top_k=2)
        >>> _ = parallelize_module(moe.experts, mesh["ep"], ExpertParallel())
        >>> moe.experts.w1.placements, moe.experts.w1.to_local().shape   # this rank's 8 / 4 experts
        ((S(0),), torch.Size([2, 16, 24]))
        >>> out = moe(torch.randn(2, 5, 16))  # this rank's tokens, routed to every rank's experts and back
        >>> out.shape
        torch.Size([2, 5, 16])
    """

    def sharded_dims(self, module: nn.Module):
        """Every parameter of the experts module is split on its expert dim (0)."""
        return tuple((pname, 0) for pname, _ in module.named_parameters(recurse=False))

    def _apply(self, module: nn.Module, mesh, name: str = "") -> nn.Module:
        num_experts = _experts(module, name)
        # Always, not only in strict mode: routing needs the same number of experts on every rank.
        check_divisible(self, module, mesh, name)
        distribute_params(module, mesh, lambda _: Shard(0), self.src_data_rank)
        return _install(module, _Layout(mesh, 0, None, num_experts, name or type(module).__name__))


class ExpertTensorParallel(ExpertParallel):
    """Experts over ep and each expert's hidden dim over tp, on a 2-d mesh (ep x tp).

    ``w1``, ``w3`` ``[experts, dim, hidden]`` become ``Shard(0)`` on ep and ``Shard(2)`` on tp,
    ``w2`` ``[experts, hidden, dim]`` ``Shard(0)`` on ep and ``Shard(1)`` on tp (other parameters:
    ``Shard(0)`` on ep, replicated on tp). Each ep rank brings its own tokens, the same on every tp
    rank of its ep group (replicated over tp, e.g. after a tensor-parallel attention). Tokens are
    dispatched over ep as in :class:`ExpertParallel`; each tp rank computes its hidden slice, the
    partial outputs are all-reduced over tp, then combined over ep. Backward: the inverse token
    moves, and one all-reduce over tp of the tokens' gradient.

    Example:
        >>> from shardprop.demo.moe import MoE
        >>> mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "tp"))
        >>> _ = torch.manual_seed(0); moe = MoE(dim=16, hidden=24, num_experts=8)
        >>> _ = parallelize_module(moe.experts, mesh, ExpertTensorParallel())
        >>> moe.experts.w1.placements, moe.experts.w1.to_local().shape   # experts over ep, hidden over tp
        ((S(0), S(2)), torch.Size([4, 16, 12]))
        >>> moe(torch.randn(2, 5, 16)).shape
        torch.Size([2, 5, 16])
    """

    takes_nd_mesh = True

    def __init__(self, ep_dim="ep", tp_dim="tp") -> None:
        self.ep_dim, self.tp_dim = ep_dim, tp_dim

    def _apply(self, module: nn.Module, mesh, name: str = "") -> nn.Module:
        if mesh.ndim != 2:
            raise ValueError(f"parallelize_module: ExpertTensorParallel needs a 2-d (ep, tp) mesh, got {mesh}")
        ep, tp = mesh.dim_index(self.ep_dim), mesh.dim_index(self.tp_dim)
        if ep == tp:
            raise ValueError(f"ExpertTensorParallel: ep_dim {self.ep_dim!r} and tp_dim {self.tp_dim!r} are one mesh dim")
        num_experts = _experts(module, name)
        hidden_dims = {"w1": 2, "w3": 2, "w2": 1}
        for pname, p in module.named_parameters(recurse=False):
            _divides(name, pname, p.shape[0], mesh.shape[ep], "experts (dim 0)", "ep")
            if pname in hidden_dims and p.ndim == 3:
                _divides(name, pname, p.shape[hidden_dims[pname]], mesh.shape[tp], f"hidden (dim {hidden_dims[pname]})",
                         "tp")

        def placements(pname):
            pl = [Replicate(), Replicate()]
            pl[ep] = Shard(0)
            if pname in hidden_dims and getattr(module, pname).ndim == 3:
                pl[tp] = Shard(hidden_dims[pname])
            return tuple(pl)

        distribute_params(module, mesh, placements, self.src_data_rank)
        return _install(module, _Layout(mesh, ep, tp, num_experts, name or type(module).__name__))


def _divides(name: str, pname: str, size: int, n: int, what: str, dim: str) -> None:
    if size % n:
        raise ValueError(f"parallelize_module: ExpertTensorParallel on {name!r} shards {pname} {what} of size {size} "
                         f"over {dim}={n}, which does not divide it")


__all__ = ["ExpertParallel", "ExpertTensorParallel"]
