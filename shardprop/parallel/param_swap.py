"""Parameter hooks that survive ``Module._apply`` (``model.to(dtype)``, ``to_empty``, ``.float()``).

For a tensor subclass parameter (our DTensor), ``nn.Module._apply`` cannot assign
``param.data``; it swaps the converted tensor into the parameter object with
``torch.utils.swap_tensors``. The parameter keeps its Python identity (optimizers, plans and
state dicts still name it), but autograd hooks live with the old data, so the swap silently
drops them: the gradient-layout hooks of the styles (``grad_sync.GradLike``) and the
post-accumulate hooks of ``replicate_gradients``. :func:`keep_hooks_on_swap` makes a module's
``_apply`` re-install, on each swapped parameter's new data, the hooks its Python object
still lists.

Example:
    >>> keep_hooks_on_swap(model)      # done by distribute_params / replicate_gradients  # doctest: +SKIP
    >>> model.to(torch.bfloat16)       # DTensor parameters swapped, their hooks kept  # doctest: +SKIP
"""
from __future__ import annotations

import functools

from torch import nn

__all__ = ["keep_hooks_on_swap"]


def keep_hooks_on_swap(module: nn.Module) -> None:
    """Make ``module``'s ``_apply`` (and its submodules') keep its parameters' autograd hooks across swaps.

    Idempotent; survives ``copy.deepcopy`` and pickling (a ``functools.partial`` of a
    module-level function, bound to the module).

    Example:
        >>> keep_hooks_on_swap(linear); linear.to(torch.bfloat16)  # doctest: +SKIP
    """
    for sub in module.modules():
        if "_apply" not in sub.__dict__:
            sub._apply = functools.partial(_apply_keeping_hooks, sub)


def _apply_keeping_hooks(module: nn.Module, fn, recurse: bool = True):
    data_before = {name: p._cdata for name, p in module._parameters.items() if p is not None}
    out = type(module)._apply(module, fn, recurse)
    for name, p in module._parameters.items():
        if p is None or data_before.get(name, p._cdata) == p._cdata:
            continue  # untouched, or assigned through .data: its hooks are where they were
        # Swapped: the hook dicts stayed on the Python object, their registration on the old data.
        # Their setters install a dict on the tensor's current data.
        if p._backward_hooks:
            p._backward_hooks = p._backward_hooks
        if p._post_accumulate_grad_hooks:
            p._post_accumulate_grad_hooks = p._post_accumulate_grad_hooks
    return out
