"""``torch.optim`` on DTensor parameters: the foreach kernels where the user left torch's default.

torch turns its foreach kernels on by default only for CUDA/XPU parameters (and some
private backends); on CPU a step loops over the parameters, about eight ops per AdamW parameter. For a
plain CPU tensor each op costs a couple of microseconds; for a DTensor each is a trip through
``__torch_dispatch__``, so an AdamW step over N DTensor parameters makes 8N dispatches where
the foreach kernels make 8 (one per list op, whatever N is). Measured on the demo model (tp=4,
15 parameters): 168 dispatches per step become 8.

So for a parameter group that holds DTensors and whose ``foreach`` the user left at ``None``
(no ``fused``, not ``differentiable``, not ``capturable``), the step runs with ``foreach=True``,
as torch itself would on CUDA. The group's setting is put back right after the step, so
``optimizer.state_dict()`` and the user still see ``None``. The update is the same: torch's
foreach and per-parameter implementations apply the same elementwise operations in the same
order. An explicit ``foreach=False`` (or ``True``, or ``fused=True``) is always respected;
``set_optimizer_foreach_default(False)`` turns this off everywhere, and so does
``shardprop.set_fast_paths(False)`` (all fast paths), read at each step.

Example:
    >>> opt = torch.optim.AdamW(model.parameters())  # doctest: +SKIP
    >>> opt.step()   # DTensor parameters: 8 dispatches, not 8 per parameter  # doctest: +SKIP
"""
from __future__ import annotations

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from shardprop.dispatch import fast_paths as _fast
from shardprop.mesh import config as _config
from shardprop.mesh.config import values as _settings
from shardprop.tensor.dtensor import DTensor

_MARK = "_shardprop_foreach"  # set on a group while its step runs with foreach chosen here


def set_optimizer_foreach_default(on: bool) -> bool:
    """Turn the foreach default for DTensor parameter groups on or off; returns the previous setting.

    Example:
        >>> old = set_optimizer_foreach_default(False); set_optimizer_foreach_default(old)
        False
    """
    return _config.set("optimizer_foreach", on)


def _wants_foreach(group: dict) -> bool:
    if "foreach" not in group or group["foreach"] is not None:
        return False  # the optimizer has no foreach kernels, or the user chose
    if group.get("fused") or group.get("differentiable") or group.get("capturable"):
        return False
    return any(type(p) is DTensor for p in group["params"])


def _before_step(optimizer, args, kwargs):
    if not (_settings.optimizer_foreach and _settings.fast_paths) or torch.compiler.is_compiling():
        return None
    for group in optimizer.param_groups:
        if _wants_foreach(group):
            group["foreach"] = True
            group[_MARK] = True
    return None


def _after_step(optimizer, args, kwargs):
    for group in optimizer.param_groups:
        if group.pop(_MARK, False):
            group["foreach"] = None


# Global hooks (every optimizer): cheap when no group holds a DTensor with foreach left at None.
_handles = (register_optimizer_step_pre_hook(_before_step), register_optimizer_step_post_hook(_after_step))

__all__ = ["set_optimizer_foreach_default"]


_fast.register("optimizer_foreach", "shardprop.parallel.fast.optim_foreach",
               "torch's per-parameter optimizer loop on DTensors (foreach left at None)", ("torch.optim",))
