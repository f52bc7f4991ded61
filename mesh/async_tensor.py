"""AsyncTensor: the result of a collective still in flight.

It stands in for the tensor the collective will produce. The first time any op
touches it (or ``wait()`` is called) it waits on the work, runs the optional
finishing step (a layout fix-up or a division for averages) and from then on
behaves as that plain tensor. Communication thus overlaps whatever the caller
does before using the result.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.utils._pytree import tree_map_only

from shardprop.mesh import groups as _groups


class AsyncTensor(torch.Tensor):
    """A tensor whose data arrives when the pending collective finishes.

    Example:
        >>> mesh = init_device_mesh("cpu", (4,))
        >>> out = all_reduce(torch.ones(3), mesh, 0, async_op=True)
        >>> out + 1   # waits here, automatically
        tensor([5., 5., 5.])
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, work, pending: torch.Tensor, finish: Optional[Callable] = None, shape=None):
        shape = pending.shape if shape is None else torch.Size(shape)
        r = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=pending.dtype, device=pending.device, requires_grad=False)
        r._work = work
        r._pending = pending
        r._finish = finish
        r._result = None
        return r

    def __init__(self, *args, **kwargs):
        pass

    def wait(self) -> torch.Tensor:
        """Wait for the collective (with the configured timeout) and return the plain result."""
        if self._result is None:
            if self._work is not None:
                self._work.wait(_groups.collective_timeout())
                self._work = None
            out = self._pending
            if self._finish is not None:
                out = self._finish(out)
            self._result = out
            self._pending = None
        return self._result

    def __repr__(self) -> str:
        return f"AsyncTensor({'done' if self._result is not None else 'pending'}, shape={tuple(self.shape)})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        args, kwargs = tree_map_only(AsyncTensor, AsyncTensor.wait, (args, kwargs or {}))
        return func(*args, **kwargs)


def wait_all(t):
    """Return ``t`` itself, or its result if it is an AsyncTensor (waiting first)."""
    return t.wait() if type(t) is AsyncTensor else t
