"""Optimizer state dicts keyed by parameter names, for DCP (torch's names and layout).

``optimizer.state_dict()`` keys its state by parameter index and is empty until the first
step, so a fresh optimizer has nothing for ``dcp.load`` to fill. These helpers, named as
``torch.distributed.checkpoint.state_dict``'s, key the state by the parameter's fully
qualified name (as torch's do, so either side can read the other's checkpoint) and create
the state of a fresh optimizer first (a step with zero gradients and a zero learning rate).
The state tensors are the optimizer's own DTensors: ``dcp.load`` fills them in place, with
resharding, and ``set_optimizer_state_dict`` then restores the hyper-parameters and steps.
"""
from __future__ import annotations

from typing import Any, Dict, List

import torch
from torch import nn


def _names(model: nn.Module) -> Dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def _init_state(optim: torch.optim.Optimizer) -> None:
    if optim.state:
        return
    params = [p for g in optim.param_groups for p in g["params"] if p.requires_grad]
    if any(p.grad is not None for p in params):
        return
    for p in params:
        p.grad = torch.zeros_like(p)
    lrs = [g["lr"] for g in optim.param_groups]
    for g in optim.param_groups:
        g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
    optim.step()
    for g, lr in zip(optim.param_groups, lrs):
        g["lr"] = lr
    optim.zero_grad(set_to_none=True)


def get_optimizer_state_dict(model: nn.Module, optimizers) -> Dict[str, Any]:
    """The optimizer's state dict keyed by parameter names (the state is created if empty).

    Example:
        >>> model = parallelize_module(nn.Linear(8, 8), init_device_mesh("cpu", (4,)), ColwiseParallel())
        >>> opt = torch.optim.AdamW(model.parameters())
        >>> model(torch.ones(2, 8)).sum().backward(); opt.step()
        >>> osd = get_optimizer_state_dict(model, opt)
        >>> sorted(osd["state"]), osd["state"]["weight"]["exp_avg"].placements   # keyed by name, sharded
        (['bias', 'weight'], (S(0),))

        With DCP (every rank writes its shards; loading reshards):

        >>> sd = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}  # doctest: +SKIP
        >>> dcp.load(sd, checkpoint_id="ckpt")                                                  # doctest: +SKIP
        >>> set_optimizer_state_dict(model, opt, sd["optim"])                                   # doctest: +SKIP
    """
    optims = optimizers if isinstance(optimizers, (list, tuple)) else [optimizers]
    names = _names(model)
    state: Dict[str, Any] = {}
    groups: List[Dict[str, Any]] = []
    for optim in optims:
        _init_state(optim)
        raw = optim.state_dict()
        index_to_name = {}
        for group, raw_group in zip(optim.param_groups, raw["param_groups"]):
            for p, i in zip(group["params"], raw_group["params"]):
                index_to_name[i] = names[id(p)]
            groups.append({**raw_group, "params": [index_to_name[i] for i in raw_group["params"]]})
        for i, s in raw["state"].items():
            state[index_to_name[i]] = s
    return {"state": state, "param_groups": groups}


def set_optimizer_state_dict(model: nn.Module, optimizers, optim_state_dict: Dict[str, Any]) -> None:
    """Load a state dict made by :func:`get_optimizer_state_dict` (or torch's) into the optimizer(s).

    Example:
        >>> model = parallelize_module(nn.Linear(8, 8), init_device_mesh("cpu", (4,)), ColwiseParallel())
        >>> opt = torch.optim.AdamW(model.parameters())
        >>> model(torch.ones(2, 8)).sum().backward(); opt.step()
        >>> saved = get_optimizer_state_dict(model, opt)
        >>> fresh = torch.optim.AdamW(model.parameters())
        >>> set_optimizer_state_dict(model, fresh, saved)
        >>> torch.equal(fresh.state[model.weight]["exp_avg"].to_local(), opt.state[model.weight]["exp_avg"].to_local())
        True
    """
    optims = optimizers if isinstance(optimizers, (list, tuple)) else [optimizers]
    names = _names(model)
    groups = list(optim_state_dict["param_groups"])
    for optim in optims:
        state, raw_groups, index = {}, [], 0
        for group in optim.param_groups:
            want = [names[id(p)] for p in group["params"]]
            match = next((g for g in groups if list(g["params"]) == want), None)
            if match is None:
                raise ValueError(f"set_optimizer_state_dict: no saved parameter group holds {want}")
            ids = list(range(index, index + len(want)))
            index += len(want)
            raw_groups.append({**match, "params": ids})
            for i, name in zip(ids, want):
                if name in optim_state_dict["state"]:
                    state[i] = optim_state_dict["state"][name]
        optim.load_state_dict({"state": state, "param_groups": raw_groups})
