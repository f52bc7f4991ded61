"""FSDPModule (mixed into every ``fully_shard``-ed module's class) and ``register_fsdp_forward_method``.

Each setter changes what a unit does at run time (see :mod:`shardprop.parallel.fsdp.unit`):
which collectives it issues, when, over which group, and how gradients are scaled.

Example:
    >>> model.layers[0].set_modules_to_forward_prefetch([model.layers[1], model.layers[2]])  # doctest: +SKIP
    >>> model.set_gradient_divide_factor(1.0)  # summed, not averaged, gradients  # doctest: +SKIP
"""
from __future__ import annotations

import functools
from typing import List, Optional

import torch.nn as nn

from shardprop.parallel.fsdp.api import GradientReductionHandle, UnshardHandle
from shardprop.parallel.fsdp.hooks import post_forward, pre_forward, reset_iteration, root_state_of, state_for, units_under


def _targets(module, recurse: bool):
    return units_under(module) if recurse else [module._fsdp_unit]


def _units_of(modules, what: str):
    bad = [type(m).__name__ for m in modules if not isinstance(m, FSDPModule)]
    if bad:
        raise ValueError(f"{what}: expects FSDPModules (fully_shard-ed modules), got {bad}")
    return [m._fsdp_unit for m in modules]


class FSDPModule:
    """Mixed into the class of every ``fully_shard``-ed module (FSDP2's names and semantics).

    Example:
        >>> model = fully_shard(nn.Linear(8, 8), mesh=init_device_mesh("cpu", (4,)))
        >>> isinstance(model, FSDPModule), type(model).__name__
        (True, 'FSDPLinear')
        >>> model.set_requires_gradient_sync(False)  # accumulate without reducing
    """

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """With False, backward keeps the full gradients locally (no reduce-scatter, no HSDP all-reduce).

        Example:
            >>> model.set_requires_gradient_sync(False); loss1.backward()  # doctest: +SKIP
            >>> model.set_requires_gradient_sync(True); loss2.backward()   # reduces the sum  # doctest: +SKIP
        """
        for unit in _targets(self, recurse):
            unit.configure(requires_gradient_sync=requires_gradient_sync)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: with False, gradients are reduce-scattered but not all-reduced across replicas.

        The reduce-scattered pieces accumulate until a backward with True all-reduces
        their sum (and only then writes ``.grad``). No effect without a replicate dim.

        Example:
            >>> model.set_requires_all_reduce(False); loss1.backward()  # doctest: +SKIP
            >>> model.set_requires_all_reduce(True); loss2.backward()   # one all-reduce of both  # doctest: +SKIP
        """
        for unit in _targets(self, recurse):
            unit.configure(requires_all_reduce=requires_all_reduce)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Change ``reshard_after_forward`` at run time (a bool; the root follows it too).

        Example:
            >>> model.set_reshard_after_forward(False)  # eval: keep everything gathered  # doctest: +SKIP
        """
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"set_reshard_after_forward: reshard_after_forward should be a bool, "
                             f"got {type(reshard_after_forward).__name__}")
        for unit in _targets(self, recurse):
            unit.configure(reshard_after_forward=reshard_after_forward, auto_reshard=False)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """With False, a unit keeps its gathered parameters after backward (no all-gather before the next forward).

        Call :meth:`reshard` on every unit before the optimizer updates the sharded parameters.

        Example:
            >>> model.set_reshard_after_backward(False); model.set_requires_gradient_sync(False)  # doctest: +SKIP
        """
        for unit in _targets(self, recurse):
            unit.configure(reshard_after_backward=reshard_after_backward)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """With False, the end of backward does not wait for the last reduce-scatter (micro-batching).

        The next backward's first reduce-scatter (or the next last backward) completes it.
        Set True before the final backward of a step: only then are all gradients in ``.grad``.

        Example:
            >>> model.set_is_last_backward(False); loss1.backward()  # doctest: +SKIP
            >>> model.set_is_last_backward(True); loss2.backward(); opt.step()  # doctest: +SKIP
        """
        state_for(self._fsdp_unit).is_last_backward = is_last_backward

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """With True (on the root), backward leaves its end to :meth:`finalize_backward`.

        Example:
            >>> model.set_manual_backward_finalization(True); loss.backward()  # doctest: +SKIP
            >>> model.finalize_backward(); opt.step()  # doctest: +SKIP
        """
        unit = self._fsdp_unit
        if unit.ran_forward and not unit.is_root:
            raise RuntimeError("set_manual_backward_finalization must be called on the root FSDP module")
        root_state_of(unit).manual_finalization = enabled

    def finalize_backward(self, *, async_op: bool = False) -> Optional[GradientReductionHandle]:
        """Finish backward now (manual finalization): reduce what is left, reshard, write the gradients.

        With ``async_op=True`` the last reduce-scatter stays in flight until the returned
        :class:`GradientReductionHandle`'s ``wait()``.

        Example:
            >>> model.finalize_backward(async_op=True).wait()  # doctest: +SKIP
        """
        state = state_for(self._fsdp_unit)
        state.finalize(wait=not async_op)
        return GradientReductionHandle(state) if async_op else None

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Gradients become the sum over data-parallel ranks divided by ``factor`` (default: their mean).

        Example:
            >>> model.set_gradient_divide_factor(1.0)  # summed gradients  # doctest: +SKIP
        """
        self._fsdp_unit.configure(gradient_divide_factor=float(factor))

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated in torch: use :meth:`set_gradient_divide_factor`.

        Example:
            >>> model.set_reduce_scatter_divide_factor(1.0)  # doctest: +SKIP
        """
        self.set_gradient_divide_factor(factor)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """With False, backward does not gather this unit (its parameters are not needed there, e.g. an embedding).

        Example:
            >>> model.tok_embeddings.set_unshard_in_backward(False)  # doctest: +SKIP
        """
        self._fsdp_unit.configure(unshard_in_backward=unshard_in_backward)

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """With True, resharding keeps the full buffer's memory (same addresses every gather; more memory).

        Example:
            >>> model.set_keep_unsharded_storage(True)  # doctest: +SKIP
        """
        for unit in _targets(self, recurse):
            unit.configure(keep_unsharded_storage=keep)

    def set_all_reduce_hook(self, hook, *, stream=None) -> None:
        """Call ``hook(reduced)`` on this unit's reduced gradient shards (flat) before they reach ``.grad``.

        ``reduced`` is the reduce-scatter's output, or the all-reduce's with HSDP; the hook
        may change it in place. shardprop runs no side streams: ``stream`` is accepted and
        unused (refused with HSDP, as torch does).

        Example:
            >>> model.set_all_reduce_hook(lambda t: t.mul_(0.5))  # doctest: +SKIP
        """
        if stream is not None and self._fsdp_unit.replicate_mesh is not None:
            raise ValueError("set_all_reduce_hook: stream cannot be set when using native HSDP")
        self._fsdp_unit.configure(all_reduce_hook=hook)

    def reset_iter_state(self) -> None:
        """After an exception in forward or backward: reshard everything and forget the iteration (call on the root).

        The failed iteration's gradients are dropped (also those accumulated without sync).

        Example:
            >>> try: model(x).sum().backward()  # doctest: +SKIP
            ... except RuntimeError: model.reset_iter_state()
        """
        reset_iteration(self._fsdp_unit)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """With True, gradients are reduced with a plain sum and divided afterwards (never an averaging op).

        Example:
            >>> model.set_force_sum_reduction_for_comms(True)  # doctest: +SKIP
        """
        self._fsdp_unit.configure(force_sum_reduction=enable)

    def set_modules_to_forward_prefetch(self, modules: List["FSDPModule"]) -> None:
        """All-gather ``modules``' parameters right after this unit's own gather in forward.

        Replaces the default (the next unit of the last forward). Two or more
        prefetch further ahead, holding more gathered parameters at once.

        Example:
            >>> layers[0].set_modules_to_forward_prefetch([layers[1], layers[2]])  # doctest: +SKIP
        """
        self._fsdp_unit.forward_prefetch = _units_of(modules, "set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules: List["FSDPModule"]) -> None:
        """All-gather ``modules``' parameters when this unit's backward starts (default: the previous unit).

        Example:
            >>> layers[2].set_modules_to_backward_prefetch([layers[1], layers[0]])  # doctest: +SKIP
        """
        self._fsdp_unit.backward_prefetch = _units_of(modules, "set_modules_to_backward_prefetch")

    def unshard(self, async_op: bool = False) -> Optional[UnshardHandle]:
        """Gather this unit's parameters and register the full ones on the module (not recursive).

        With ``async_op=True`` it returns an :class:`UnshardHandle`; the unit's next forward
        waits for it anyway, so call ``wait()`` only to use the parameters earlier.

        Example:
            >>> handle = model.layers[0].unshard(async_op=True); handle.wait()  # doctest: +SKIP
        """
        unit = self._fsdp_unit
        unit.unshard()
        handle = UnshardHandle(unit)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free this unit's gathered parameters and register the sharded ones (not recursive).

        Example:
            >>> model.reshard()  # doctest: +SKIP
        """
        self._fsdp_unit.swap_out()
        self._fsdp_unit.reshard()


def share_comm_ctx(modules: List[FSDPModule]) -> None:
    """Let several FSDP roots share one communication context (pipeline stages).

    shardprop's units always share one: collectives run on the current stream and at
    most one reduce-scatter is in flight across every root, which is what sharing
    gives torch's. This checks the modules and changes nothing else.

    Example:
        >>> mesh = init_device_mesh("cpu", (4,))
        >>> stage0, stage1 = fully_shard(nn.Linear(4, 4), mesh=mesh), fully_shard(nn.Linear(4, 4), mesh=mesh)
        >>> share_comm_ctx([stage0, stage1])
    """
    _units_of(modules, "share_comm_ctx")


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` gather and reshard like ``forward`` (a no-op on a plain module).

    Example:
        >>> class Net(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.lin = nn.Linear(8, 8)
        ...     def forward(self, x):
        ...         return self.lin(x)
        ...     def generate(self, x):
        ...         return self.lin(x).argmax(-1)
        >>> net = fully_shard(Net(), mesh=init_device_mesh("cpu", (4,)))
        >>> register_fsdp_forward_method(net, "generate")
        >>> net.generate(torch.ones(2, 8)).shape      # parameters gathered around it
        torch.Size([2])
    """
    if not isinstance(module, FSDPModule):
        return  # as torch: the same code runs with and without fully_shard
    if not hasattr(module, method_name):
        raise ValueError(f"register_fsdp_forward_method: {type(module).__name__} has no method {method_name!r}")
    orig = getattr(module, method_name)

    @functools.wraps(orig)
    def wrapped(self, *args, **kwargs):
        args, kwargs = pre_forward(self, args, kwargs)
        out = orig(*args, **kwargs)
        return post_forward(self, args, kwargs, out)

    setattr(module, method_name, wrapped.__get__(module, type(module)))


__all__ = ["FSDPModule", "register_fsdp_forward_method", "share_comm_ctx"]
