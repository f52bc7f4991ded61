"""The fused optimizer kernels (``torch.optim.*(..., fused=True)``): one call updates every parameter.

``_fused_adam_`` / ``_fused_adamw_`` / ``_fused_sgd_`` / ``_fused_adagrad_`` take lists
(params, grads, optimizer states, steps) and update position i of every list from
position i of the others only: elementwise within each parameter. So each parameter's
shard is updated from the same shards of its gradient and states, on every placement
except Partial (a partial sum has no elementwise update), and the call on the local
shards is the whole update, with no communication unless a gradient must be reduced.

Placements per list position i:

* the parameter (``self``) keeps its own; a Partial parameter is an error;
* a gradient is moved to the parameter's placements if it differs (a Partial gradient is
  reduced first), unless ``grad_scale`` is given: then the kernel unscales the gradients
  in place, so they must already match (a moved copy would take the write instead);
* the other lists the kernel writes (moments, momentum buffers) must match the parameter:
  a moved copy would take the update, so a mismatch is an error, never a silent loss;
* 0-d tensors (steps; ``lr``, ``grad_scale``, ``found_inf`` as DTensors) are replicated.

Left at torch's CPU default (``foreach=None``), a step over DTensor parameters takes the foreach
kernels (``shardprop/parallel/fast/optim_foreach.py``): one dispatch per list op, eight per AdamW
step; ``fused=True`` makes one per step. Ask for it as torch documents:

    >>> torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)  # doctest: +SKIP
"""
from __future__ import annotations

import torch

from shardprop.dispatch import dispatcher
from shardprop.dispatch.propagate import ShardingError
from shardprop.dispatch.registry import rule
from shardprop.mesh.compat import aten_ops
from shardprop.tensor.placement import Replicate
from shardprop.tensor.spec import DTensorSpec

aten = torch.ops.aten

FUSED_OPTIMIZER_OPS = [op for op in aten_ops(("_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_"))
                       if "out" not in op._overloadname]


def _written(arg) -> bool:
    return arg.alias_info is not None and arg.alias_info.is_write


def fused_optimizer_options(ctx):
    """One option: every list position placed as its parameter (see the module docstring)."""
    op, mesh_ndim = ctx.op, len(ctx.mesh.shape)
    replicate = (Replicate(),) * mesh_ndim
    params = ctx.args[0]
    for i, s in enumerate(params):
        if type(s) is DTensorSpec and any(p.is_partial() for p in s.placements):
            raise ShardingError(f"{op}: parameter {i} is {list(s.placements)}: a Partial parameter holds partial "
                                "sums, and an optimizer update needs its value: redistribute it (e.g. to "
                                "Replicate) first")
    grad_scaled = ctx.kwargs.get("grad_scale") is not None
    ins = []
    for arg, value in zip(op._schema.arguments, ctx.args):
        if type(value) is DTensorSpec:  # a single tensor argument (lr)
            ins.append(replicate)
            continue
        if type(value) is not tuple:
            continue
        if len(value) not in (0, len(params)):
            raise ShardingError(f"{op}: list '{arg.name}' has {len(value)} tensors for {len(params)} parameters")
        for i, s in enumerate(value):
            if type(s) is not DTensorSpec:
                continue
            if len(s.tensor_meta.shape) == 0 and len(params[i].tensor_meta.shape) != 0:  # a step count
                ins.append(replicate)
                continue
            want = params[i].placements
            fixed = _written(arg) and (arg.name != "grads" or grad_scaled)
            if fixed and s.placements != want:
                why = ("the kernel unscales gradients in place (grad_scale given)" if arg.name == "grads"
                       else "the kernel updates it in place")
                raise ShardingError(
                    f"{op}: '{arg.name}'[{i}] is {list(s.placements)} but its parameter is {list(want)}; {why}, "
                    "so it must be placed as the parameter: redistribute it to the parameter's placements")
            ins.append(want)
    for name, value in ctx.kwargs.items():  # grad_scale, found_inf, lr given as tensors
        if type(value) is DTensorSpec:
            ins.append(replicate)
    outs = [ctx.specs[0].placements] * len(ctx.out_metas)
    return [(tuple(ins), tuple(outs))]


rule(*FUSED_OPTIMIZER_OPS, per_dim=False, strided=True)(fused_optimizer_options)
dispatcher.register_positionwise(FUSED_OPTIMIZER_OPS)  # plain parameters beside DTensor ones: split by position
