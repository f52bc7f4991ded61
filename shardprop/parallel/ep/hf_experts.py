"""HFExperts: expert (and expert-tensor) parallelism for Hugging Face transformers' experts modules.

transformers (5.x) stacks each MoE layer's experts in one module (``MixtralExperts``, ``Qwen2MoeExperts``, ...)
with its own contract, unlike torchtitan's ``GroupedExperts``:

- ``gate_up_proj`` ``[experts, 2 * hidden, dim]`` (gate rows, then up rows) and ``down_proj``
  ``[experts, dim, hidden]``, read straight off the module (no ``.to_local()``);
- ``forward(hidden_states, top_k_index, top_k_weights)``: every token of this rank (``[tokens, dim]``),
  with the ids and weights of its top-k experts; the module weights and sums the experts' outputs;
- ``num_experts``: how many experts the module's own forward loops or groups over.

The style lays the weights out over an ``ep`` and/or ``tp`` mesh dim and wraps forward in two hooks.
Before it: the (token, expert) pairs are sorted by expert and sent to the ranks holding their experts
with the existing token routing (:func:`routing.dispatch`: one counts all-to-all, one uneven token
all-to-all); the module then runs top-1 with unit weights on its local experts (``num_experts`` is
set to the local count, as transformers' own expert parallelism does), on local weight tensors
swapped in for the forward. After it: the partial outputs are all-reduced over tp, sent back
(:func:`routing.combine`), put back in (token, slot) order, weighted by ``top_k_weights`` and summed.
``explain()`` shows the dispatch and combine as ``moe_dispatch`` / ``moe_combine`` moves and
``expert_load(module)`` the tokens per expert, as for ``ExpertParallel``.

Layouts: both weights ``Shard(0)`` over ep. Over tp, ``down_proj`` is ``Shard(2)`` (each rank a slice
of the hidden dim); ``gate_up_proj`` packs the gate and up halves along one dim, which a plain
``Shard(1)`` would cut between (not across) the halves, and shardprop has no strided placement yet:
it stays replicated over tp, each tp rank computes with its hidden slice of both halves, and its
gradient (partial over tp) is all-reduced into that layout.

Example:
    >>> mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "tp"))  # doctest: +SKIP
    >>> parallelize_module(model.model.layers[0].mlp.experts, mesh, HFExperts())  # doctest: +SKIP
"""
from __future__ import annotations

import functools
from typing import List, Optional

import torch
from torch import nn

from shardprop.dispatch import fast_paths
from shardprop.parallel.ep import routing, tensor_parallel
from shardprop.parallel.tp.styles import ParallelStyle, distribute_params
from shardprop.tensor.placement import Partial, Replicate, Shard


class _Call:
    """What the output hook needs from one forward: the route, the sort order, the weights, the swapped weights."""

    def __init__(self, route, order, weights, tokens: int, top_k: int, originals: dict) -> None:
        self.route, self.order, self.weights, self.tokens, self.top_k = route, order, weights, tokens, top_k
        self.originals = originals


class _Layout:
    """One styled experts module: mesh, ep / tp mesh dim indices (None: absent), experts, hidden slice."""

    def __init__(self, mesh, ep: Optional[int], tp: Optional[int], num_experts: int, hidden: int, name: str) -> None:
        self.mesh, self.ep, self.tp, self.num_experts, self.name = mesh, ep, tp, num_experts, name
        self.hidden = hidden
        self.calls: List[_Call] = []  # a stack: nested or re-entrant forwards (activation checkpointing)
        self.last = None  # the route of the last dispatch over ep, read by stats.expert_load


def _check_module(module: nn.Module, name: str) -> None:
    what = f"HFExperts on {name!r} ({type(module).__name__})"
    for attr, bad in (("is_transposed", True), ("has_bias", True), ("is_concatenated", False), ("has_gate", False)):
        if getattr(module, attr, not bad) == bad:
            raise ValueError(f"{what}: experts with {attr}={bad} are not supported (only stacked, concatenated "
                             "gate_up_proj [experts, 2*hidden, dim] and down_proj [experts, dim, hidden], no biases)")
    gu, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gu, torch.Tensor) and isinstance(down, torch.Tensor) and gu.ndim == 3 and down.ndim == 3):
        raise ValueError(f"{what}: needs 3-d parameters gate_up_proj [experts, 2*hidden, dim] and down_proj "
                         f"[experts, dim, hidden]; it has {[(n, tuple(p.shape)) for n, p in module.named_parameters()]}")
    e, two_h, d = gu.shape
    if down.shape != (e, d, two_h // 2) or two_h % 2:
        raise ValueError(f"{what}: gate_up_proj {tuple(gu.shape)} and down_proj {tuple(down.shape)} do not fit "
                         "[experts, 2*hidden, dim] and [experts, dim, hidden]")
    extra = [n for n, _ in module.named_parameters(recurse=False) if n not in ("gate_up_proj", "down_proj")]
    if extra:
        raise ValueError(f"{what}: parameters {extra} beside gate_up_proj and down_proj are not supported")
    if getattr(module, "num_experts", e) != e:
        raise ValueError(f"{what}: num_experts={module.num_experts} but the weights stack {e} experts (styled twice?)")


class HFExperts(ParallelStyle):
    """Shard a transformers experts module over ``ep`` (experts) and/or ``tp`` (each expert's hidden dim).

    The mesh's dims are found by name (``ep_dim``, ``tp_dim``); a mesh may have either or both. Over ep
    each rank brings its own tokens (the batch is split over ep); over tp the tokens are the same on
    every tp rank (replicated, as after a tensor-parallel attention). Per forward: a counts all-to-all
    and a token all-to-all each way over ep, one all-reduce over tp (and one of the tokens' gradient in
    backward). Parameters are laid out ``Shard(0)`` over ep; over tp ``down_proj`` ``Shard(2)``,
    ``gate_up_proj`` replicated (see the module docstring).

    Example:
        >>> mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))  # doctest: +SKIP
        >>> parallelize_module(moe_block.experts, mesh, HFExperts())  # doctest: +SKIP
    """

    takes_nd_mesh = True

    def __init__(self, ep_dim: str = "ep", tp_dim: str = "tp") -> None:
        self.ep_dim, self.tp_dim = ep_dim, tp_dim

    def _apply(self, module: nn.Module, mesh, name: str = "") -> nn.Module:
        name = name or type(module).__name__
        _check_module(module, name)
        names = tuple(mesh.mesh_dim_names or ())
        ep = names.index(self.ep_dim) if self.ep_dim in names else None
        tp = names.index(self.tp_dim) if self.tp_dim in names else None
        if ep is None and tp is None or mesh.ndim != (ep is not None) + (tp is not None):
            raise ValueError(f"HFExperts on {name!r}: wants a mesh whose dims are named {self.ep_dim!r} and/or "
                             f"{self.tp_dim!r}, got {mesh} with names {names}")
        e, two_h, _ = module.gate_up_proj.shape
        hidden = two_h // 2
        for dim, size, what in ((ep, e, "experts"), (tp, hidden, "hidden size")):
            if dim is not None and size % mesh.shape[dim]:
                raise ValueError(f"HFExperts on {name!r}: {what} {size} do not split evenly over "
                                 f"{names[dim]}={mesh.shape[dim]}")

        def placements(pname):
            pl = [Replicate()] * mesh.ndim
            if ep is not None:
                pl[ep] = Shard(0)
            if tp is not None and pname == "down_proj":
                pl[tp] = Shard(2)
            return tuple(pl)

        distribute_params(module, mesh, placements, self.src_data_rank)
        lay = _Layout(mesh, ep, tp, e, hidden, name)
        # The module's own forward runs on its local experts: as transformers' EP, it counts only those.
        module.num_experts = e // (mesh.shape[ep] if ep is not None else 1)
        if ep is not None:
            module._shardprop_expert_routes = lay  # expert_load(module): tokens per expert of the last forward
        module.register_forward_pre_hook(functools.partial(_dispatch_hook, lay), with_kwargs=True)
        # always_call: the swapped-in local weights are put back even when the forward raises.
        module.register_forward_hook(functools.partial(_combine_hook, lay), with_kwargs=True, always_call=True)
        return module


def _inputs(args, kwargs, name: str):
    names = ("hidden_states", "top_k_index", "top_k_weights")
    vals = list(args[:3]) + [kwargs.get(n) for n in names[len(args[:3]):]]
    if len(vals) != 3 or any(v is None for v in vals) or len(args) > 3:
        raise TypeError(f"HFExperts on {name!r}: the experts module takes forward(hidden_states, top_k_index, "
                        "top_k_weights)")
    x, idx, w = vals
    if x.ndim != 2 or idx.ndim != 2 or w.shape != idx.shape or idx.shape[0] != x.shape[0]:
        raise ValueError(f"HFExperts on {name!r}: hidden_states {tuple(x.shape)}, top_k_index {tuple(idx.shape)}, "
                         f"top_k_weights {tuple(w.shape)}; want [tokens, dim], [tokens, k], [tokens, k]")
    return x, idx, w


def _local_weights(lay: _Layout, module: nn.Module) -> dict:
    """This rank's weight tensors for the module's own forward, differentiable back to the DTensor parameters."""
    gu, down = module._parameters["gate_up_proj"], module._parameters["down_proj"]
    local = {"down_proj": down.to_local()}
    if lay.tp is None:
        local["gate_up_proj"] = gu.to_local()
        return local
    # Replicated over tp: this rank uses its hidden slice of the gate and of the up half, so its gradient
    # is a partial sum over tp (the parameter's gradient hook all-reduces it).
    grad_pl = list(gu.placements)
    grad_pl[lay.tp] = Partial()
    full = gu.to_local(grad_placements=grad_pl)
    n, r = lay.mesh.shape[lay.tp], lay.mesh.get_local_rank(lay.tp)
    step = lay.hidden // n
    lo, hi = r * step, (r + 1) * step
    local["gate_up_proj"] = torch.cat([full[:, lo:hi], full[:, lay.hidden + lo:lay.hidden + hi]], dim=1)
    return local


def _dispatch_hook(lay: _Layout, module, args, kwargs):
    x, idx, w = _inputs(args, kwargs, lay.name)
    tokens, k = idx.shape
    ids = idx.reshape(-1)
    # (token, slot) pairs sorted by expert: the order routing.dispatch takes (stable: reproducible rows).
    order = torch.argsort(ids, stable=True)
    pairs = x.index_select(0, order // k)
    bad = ids.numel() > 0 and bool((ids.min() < 0) | (ids.max() >= lay.num_experts))
    if bad and lay.ep is None:  # every tp rank holds the same ids: each raises the same error
        raise ValueError(f"HFExperts on {lay.name!r}: top_k_index holds expert ids outside 0..{lay.num_experts - 1}")
    # An id out of range on one ep rank: counts of the wrong length make routing.dispatch raise on every
    # ep rank (it exchanges each rank's verdict first), where raising here alone would leave the others waiting.
    counts = (torch.zeros(lay.num_experts + 1, dtype=torch.int64) if bad
              else torch.bincount(ids, minlength=lay.num_experts))
    route = None
    if lay.ep is not None:
        dispatch = functools.partial(routing.dispatch, width=x.shape[1])
        try:
            if fast_paths.recording():  # inside explain(): the token moves, as ExpertParallel's
                pairs, counts, route = fast_paths.run_recorded(
                    "moe_dispatch", f"HFExperts dispatch on {lay.name!r}", ((Shard(0),),), (lay.ep,),
                    dispatch, pairs, counts, lay.mesh, lay.ep, lay.num_experts)
            else:
                pairs, counts, route = dispatch(pairs, counts, lay.mesh, lay.ep, lay.num_experts)
        except ValueError as e:
            raise ValueError(f"HFExperts on {lay.name!r} (top_k_index with an expert id outside "
                             f"0..{lay.num_experts - 1} shows as the wrong number of experts): {e}") from e
        lay.last = route
    if lay.tp is not None:  # the tokens are the same on every tp rank: their gradient is summed over tp
        pairs = tensor_parallel.copy_in(pairs, lay.mesh, lay.tp)
    local_ids = torch.repeat_interleave(torch.arange(counts.numel(), device=x.device), counts.to(x.device))
    originals = {n: module._parameters[n] for n in ("gate_up_proj", "down_proj")}
    module._parameters.update(_local_weights(lay, module))
    lay.calls.append(_Call(route, order, w, tokens, k, originals))
    ones = torch.ones(pairs.shape[0], 1, dtype=pairs.dtype, device=pairs.device)
    return (pairs, local_ids.unsqueeze(-1), ones), {}


def _combine_hook(lay: _Layout, module, args, kwargs, output):
    if output is None:  # the forward (or a hook before it) raised: always_call brings us here
        # Put the weights back if this call's dispatch swapped them in (it did if they are not the parameters).
        if lay.calls and module._parameters["down_proj"] is not lay.calls[-1].originals["down_proj"]:
            module._parameters.update(lay.calls.pop().originals)
        return None
    call = lay.calls.pop()
    module._parameters.update(call.originals)
    if lay.tp is not None:  # each tp rank computed its hidden slice: partial sums
        output = tensor_parallel.reduce_out(output, lay.mesh, lay.tp)
    if call.route is not None and fast_paths.recording():
        output = fast_paths.run_recorded("moe_combine", f"HFExperts combine on {lay.name!r}", (), (lay.ep,),
                                         routing.combine, output, call.route)
    elif call.route is not None:
        output = routing.combine(output, call.route)
    inverse = torch.empty_like(call.order)
    inverse[call.order] = torch.arange(call.order.numel(), device=call.order.device)
    per_slot = output.index_select(0, inverse).view(call.tokens, call.top_k, -1)
    return (per_slot * call.weights.unsqueeze(-1).to(per_slot.dtype)).sum(1).to(output.dtype)


__all__ = ["HFExperts"]
