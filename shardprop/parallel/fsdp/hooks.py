"""fully_shard's module hooks: who is the root, forward/backward order, prefetching, resharding.

A unit's forward pre-hook waits for its all-gather, prefetches the next unit's (the
one after it in the last forward, or the units named by
``set_modules_to_forward_prefetch``) and swaps the full parameters in; the forward
hook swaps them out and reshards as ``reshard_after_forward`` says (fully, to a
smaller group, or not at all). A hook on the outputs' gradients does the same for
backward, in reverse post-forward order (or ``set_modules_to_backward_prefetch``),
and the root queues one end-of-backward callback that finishes every unit.

Example:
    >>> module.register_forward_pre_hook(pre_forward, with_kwargs=True)  # done by fully_shard  # doctest: +SKIP
"""
from __future__ import annotations

from typing import List

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map_only

from shardprop.mesh.compat import in_backward
from shardprop.mesh.state import module_state
from shardprop.parallel.fsdp.unit import FSDPUnit
from shardprop.tensor.compile_support import outside_graphs
from shardprop.tensor.dtensor import DTensor


def units_under(*modules: nn.Module) -> List[FSDPUnit]:
    """The fully_shard units of ``modules`` and their submodules, in module order, each once.

    A unit of ``fully_shard([a, b])`` belongs to both modules: it is counted once.

    Example:
        >>> [u.module for u in units_under(model)]  # the root first, then the blocks  # doctest: +SKIP
    """
    out, seen = [], set()
    for module in modules:
        for m in module.modules():
            unit = getattr(m, "_fsdp_unit", None)
            if unit is not None and id(unit) not in seen:
                seen.add(id(unit))
                out.append(unit)
    return out


class RootState:
    """Forward order, prefetching and the end-of-backward callback of a root unit."""

    def __init__(self, root: FSDPUnit) -> None:
        self.root = root
        self.units = units_under(*root.modules)
        self.entry = None  # the module whose forward began this root's forward: its end ends the root's
        self.order: List[FSDPUnit] = []        # forward (pre-forward) order seen in the last iteration
        self.post_order: List[FSDPUnit] = []   # order in which forwards ended: backward runs it in reverse
        self._recording: List[FSDPUnit] = []
        self._post_recording: List[FSDPUnit] = []
        self.in_forward = False
        self.callback_queued = False
        self.is_last_backward = True
        self.manual_finalization = False

    def next_in_forward(self, unit: FSDPUnit) -> List[FSDPUnit]:
        if unit.forward_prefetch is not None:
            return unit.forward_prefetch
        return _neighbour(self.order, unit, +1)

    def next_in_backward(self, unit: FSDPUnit) -> List[FSDPUnit]:
        if unit.backward_prefetch is not None:
            return unit.backward_prefetch
        return _neighbour(self.post_order, unit, -1)

    def end_of_backward(self) -> None:
        self.callback_queued = False
        if self.manual_finalization:
            return  # finalize_backward() finishes the units
        self.finalize(self.is_last_backward)

    def finalize(self, wait: bool) -> None:
        """Finish every unit's backward (reduce what is left, reshard); with ``wait``, write every ``.grad``."""
        # Units finish in a fixed (construction) order, so every rank issues any leftover
        # reduce-scatter (and HSDP all-reduce) in the same order. Not the last backward of a
        # step (set_is_last_backward(False)): the last reduce-scatter stays in flight.
        for unit in self.units:
            unit.finish_gradients(wait=wait)

    def wait_for_gradients(self) -> None:
        """Complete the reduce-scatter still in flight (if any) and write its gradients."""
        for unit in self.units:
            unit.complete_reduce()


def _neighbour(order, unit, step) -> List[FSDPUnit]:
    try:
        i = order.index(unit) + step
    except ValueError:
        return []
    return [order[i]] if 0 <= i < len(order) else []


_state = module_state(active_root=None)


def root_state_of(unit: FSDPUnit) -> RootState:
    """The root state of a unit used as a root (made on first use).

    Example:
        >>> root_state_of(model._fsdp_unit).order  # units in the last forward's order  # doctest: +SKIP
    """
    if unit._root_state is None:
        unit._root_state = RootState(unit)
    return unit._root_state


def state_for(unit: FSDPUnit) -> RootState:
    """The root state ``unit`` last ran under (its own if it has not run yet).

    Example:
        >>> state_for(model.layers[0]._fsdp_unit).is_last_backward  # doctest: +SKIP
    """
    return unit._owner_state if unit._owner_state is not None else root_state_of(unit)


def _cast_inputs(unit: FSDPUnit, args, kwargs):
    dt = unit.mp_policy.param_dtype
    if dt is None or not unit.mp_policy.cast_forward_inputs:
        return args, kwargs
    cast = lambda t: t.to(dt) if t.is_floating_point() and not isinstance(t, DTensor) else t  # noqa: E731
    return tree_map_only(torch.Tensor, cast, (args, kwargs))


# Both hooks run outside compiled graphs: a compiled module (``block.compile()`` compiles its
# hooks too) breaks its graph around them and they run eagerly, as torch's fully_shard hooks do.
@outside_graphs
def pre_forward(module, args, kwargs):
    """Forward pre-hook of a unit: gather (waiting for a prefetch), prefetch the next, swap in.

    Example:
        >>> module.register_forward_pre_hook(pre_forward, with_kwargs=True)  # doctest: +SKIP
    """
    unit: FSDPUnit = module._fsdp_unit
    if in_backward():  # an activation-checkpoint recomputation: compute with the full parameters again
        unit.wait_unsharded()
        unit.swap_in()
        return _cast_inputs(unit, args, kwargs)
    first = not unit.to_run  # the first of the unit's modules to run in this pass (a group has several)
    if first:
        unit.to_run = {id(m) for m in unit.modules}
        unit.pass_token = [False]  # one pre-backward per pass, whichever output's gradient comes first
    if _state.active_root is None:  # the outermost unit of this forward is the root
        state = root_state_of(unit)
        for u in state.units:
            u.is_root = u is unit
            u._owner_state = state
        _state.active_root = state
        state.entry = module
        state._recording = []
        state._post_recording = []
        state.in_forward = True
    state = _state.active_root
    if not first:  # a later module of a group: the parameters are in (gathered again if someone resharded)
        unit.wait_unsharded()
        unit.swap_in()
        return _cast_inputs(unit, args, kwargs)
    state._recording.append(unit)
    unit.wait_unsharded()
    for nxt in state.next_in_forward(unit):
        nxt.unshard()  # prefetch: overlaps this unit's forward
    unit.swap_in()
    unit.ran_forward = True
    if unit.has_frozen and torch.is_grad_enabled():
        _when_inputs_done(unit, args, kwargs)
    return _cast_inputs(unit, args, kwargs)


@outside_graphs
def post_forward(module, args, kwargs, output):
    """Forward hook of a unit: swap the sharded parameters back, reshard, arm the backward hook.

    Example:
        >>> module.register_forward_hook(post_forward, with_kwargs=True)  # doctest: +SKIP
    """
    unit: FSDPUnit = module._fsdp_unit
    if in_backward():  # a recomputation: backward keeps the parameters until the unit's gradients are in
        return _cast_output(unit, output)
    state = _state.active_root
    unit.to_run.discard(id(module))
    if unit.to_run:  # a group with modules still to run: its parameters stay gathered for them
        if torch.is_grad_enabled():
            _register_pre_backward(unit, state, output)
    else:
        _complete_forward(unit, state, output)
    if state is not None and state.root is unit and state.entry is module:
        _end_root_forward(state, output)
    return _cast_output(unit, output)


def _complete_forward(unit: FSDPUnit, state, output) -> None:
    """Every module of the unit ran (or the root's forward ended): sharded parameters back, reshard."""
    unit.to_run.clear()
    unit.swap_out()
    grad = torch.is_grad_enabled()
    is_root = state is not None and state.root is unit
    raf = unit.reshard_after_forward
    if is_root and unit.auto_reshard:
        raf = False  # the root's parameters are needed again first thing in backward: it keeps them
    if raf is True or not grad:
        unit.reshard()
    elif raf is not False:
        unit.reshard_to_group()  # an int: keep a 1/raf piece, re-gathered in backward within its group
    if state is not None:
        state._post_recording.append(unit)
    if grad:
        _register_pre_backward(unit, state, output)


def _end_root_forward(state: RootState, output) -> None:
    """The root's forward ended: finish the groups that ran only some of their modules, as torch does
    (e.g. ``fully_shard([norm, head])`` when the model skips the head for a chunked loss)."""
    for u in state.units:
        if u.to_run:
            _complete_forward(u, state, output)
    state.order, state.post_order = state._recording, state._post_recording
    state.in_forward = False
    _state.active_root = None


def _cast_output(unit: FSDPUnit, output):
    dt = unit.mp_policy.output_dtype
    if dt is not None:
        output = tree_map_only(torch.Tensor, lambda t: t.to(dt) if t.is_floating_point() else t, output)
    return output


def _when_inputs_done(unit: FSDPUnit, args, kwargs) -> None:
    """Call ``unit.inputs_done()`` once backward has computed the gradients of the unit's inputs."""
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    if tensors:  # else the end of backward releases the unit
        torch.autograd.graph.register_multi_grad_hook(tensors, lambda grads: unit.inputs_done())


def _register_pre_backward(unit: FSDPUnit, state: RootState, output) -> None:
    tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    if not tensors or state is None:
        return
    fired = unit.pass_token

    def hook(grad):
        if fired[0]:
            return grad
        fired[0] = True
        if not state.callback_queued:
            state.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(state.end_of_backward)
        if unit.unshard_in_backward:
            unit.wait_unsharded()
        unit.start_backward()
        unit.swap_in_for_backward()
        for prev in state.next_in_backward(unit):
            if prev.unshard_in_backward:
                prev.unshard()  # prefetch: overlaps this unit's backward
        return grad

    for t in tensors:
        t.register_hook(hook)


def reset_iteration(unit: FSDPUnit) -> None:
    """``reset_iter_state`` on the root unit: forget the iteration an exception aborted.

    Example:
        >>> reset_iteration(model._fsdp_unit)  # doctest: +SKIP
    """
    state = unit._root_state
    if state is None or state.root is not unit:
        raise RuntimeError(f"reset_iter_state: call it on the root FSDP module (the one whose forward ran first), "
                           f"not on {type(unit.module).__name__}")
    _state.active_root = None
    state.in_forward = state.callback_queued = False
    state._recording, state._post_recording = [], []
    for u in state.units:
        u.to_run.clear()
        u.reset()


__all__ = ["reset_iteration", "RootState", "units_under", "root_state_of", "state_for", "pre_forward", "post_forward"]
