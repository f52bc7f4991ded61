"""``Function.apply`` without its Python wrapper, for the fused styles' small autograd functions.

``torch.autograd.Function.apply`` is a Python classmethod that, outside functorch transforms
(vmap, grad), only unwraps dead functorch wrappers and calls the C++ ``apply``. The fused
tensor-parallel paths call a few tiny functions dozens of times per training step, so they
call the C++ ``apply`` directly (a few microseconds less each) and take the full path
whenever a functorch transform is active. The functions used this way define no
``setup_context`` and take no keyword or default arguments.

Example:
    >>> to_local = direct_apply(LocalOf)  # doctest: +SKIP
    >>> local = to_local(dt, spec)  # doctest: +SKIP
"""
from __future__ import annotations

import torch

_transforms_active = torch._C._are_functorch_transforms_active


def direct_apply(cls):
    """A callable equal to ``cls.apply`` for positional arguments, skipping its Python wrapper when it may.

    Example:
        >>> apply = direct_apply(MyFunction)  # doctest: +SKIP
    """
    raw = super(torch.autograd.Function, cls).apply  # the C++ apply, bound to cls
    full = cls.apply

    def apply(*args):
        if _transforms_active():
            return full(*args)
        return raw(*args)

    apply.__doc__ = f"{cls.__name__}.apply (direct when no functorch transform is active)"
    return apply


__all__ = ["direct_apply"]
