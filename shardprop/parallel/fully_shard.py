"""fully_shard: fully sharded data parallelism (FSDP2's API) on shardprop DTensors.

``fully_shard(block)`` for each block, then ``fully_shard(model)``: every
parameter becomes a ``Shard`` DTensor over the dp mesh dim (an ``nn.Parameter``
still), so parameters, gradients and optimizer state take 1/dp of the memory.
Around each unit's forward the module computes on plain full tensors gathered by
one all-gather (prefetched one unit ahead, forward and backward; asynchronous except on
gloo, see :data:`shardprop.parallel.fsdp_unit.ASYNC_GATHER`); its gradients
leave in one reduce-scatter that overlaps the rest of backward (at most one in
flight: the next unit's launch completes the previous one, as torch's does). See
:mod:`shardprop.parallel.fsdp_unit` (run time) and :mod:`shardprop.parallel.flat_buffers`
(memory layout).

On a ``("dp", "tp")`` mesh, after ``parallelize_module(model, mesh["tp"], plan)``,
``fully_shard(block, mesh=mesh["dp"])`` shards each tp-local tensor over dp. The
dp dim splits tensor dim 0, unless tp already splits dim 0 (column-parallel
weights): then dp splits dim 1, so the spec (``[S(1), S(0)]`` on the 2-D mesh) says
exactly what each rank holds; a 1-d such parameter (a column-parallel bias) stays
whole over dp (``[R, S(0)]``). No strided-shard placement is ever needed.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map_only

from shardprop.parallel.flat_buffers import REPLICATED, ParamSlot, UnitBuffers
from shardprop.parallel.fsdp_unit import FSDPUnit
from shardprop.parallel.mixed_precision import MixedPrecisionPolicy
from shardprop.tensor.dtensor import DTensor, make_spec
from shardprop.tensor.layout import chunk_bounds
from shardprop.tensor.placement import Replicate, Shard
from shardprop.tensor.spec import DTensorSpec, TensorMeta

_DEFAULT_MESHES: Dict[str, object] = {}


class FSDPModule:
    """Mixed into the class of every ``fully_shard``-ed module (FSDP2's names).

    Example:
        >>> model.set_requires_gradient_sync(False)  # accumulate without reducing  # doctest: +SKIP
    """

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """With False, backward keeps the full gradients locally (no reduce-scatter) until a step with True.

        Example:
            >>> model.set_requires_gradient_sync(False); loss1.backward()  # doctest: +SKIP
            >>> model.set_requires_gradient_sync(True); loss2.backward()   # reduces the sum  # doctest: +SKIP
        """
        for unit in _units_under(self) if recurse else [self._fsdp_unit]:
            unit.requires_gradient_sync = requires_gradient_sync

    def unshard(self) -> None:
        """Gather this unit's parameters now (they stay gathered until :meth:`reshard`)."""
        self._fsdp_unit.wait_unsharded()

    def reshard(self) -> None:
        """Free this unit's gathered parameters."""
        self._fsdp_unit.reshard()


def _units_under(module: nn.Module) -> List[FSDPUnit]:
    return [m._fsdp_unit for m in module.modules() if getattr(m, "_fsdp_unit", None) is not None]


# ---------------------------------------------------------------- root state (one per forward root)


class _RootState:
    """Forward order, prefetching and the end-of-backward callback of a root unit."""

    def __init__(self, root: FSDPUnit) -> None:
        self.root = root
        self.units = _units_under(root.module)
        self.order: List[FSDPUnit] = []        # forward (pre-forward) order seen in the last iteration
        self.post_order: List[FSDPUnit] = []   # order in which forwards ended: backward runs it in reverse
        self._recording: List[FSDPUnit] = []
        self._post_recording: List[FSDPUnit] = []
        self.in_forward = False
        self.callback_queued = False

    def next_in_forward(self, unit: FSDPUnit) -> Optional[FSDPUnit]:
        return _neighbour(self.order, unit, +1)

    def next_in_backward(self, unit: FSDPUnit) -> Optional[FSDPUnit]:
        return _neighbour(self.post_order, unit, -1)

    def end_of_backward(self) -> None:
        # Units finish in a fixed (construction) order, so every rank issues any leftover
        # reduce-scatter in the same order.
        for unit in self.units:
            unit.finish_gradients()
        self.callback_queued = False


def _neighbour(order, unit, step):
    try:
        i = order.index(unit) + step
    except ValueError:
        return None
    return order[i] if 0 <= i < len(order) else None


_active_root: Optional[_RootState] = None


# ---------------------------------------------------------------- hooks


def _cast_inputs(unit: FSDPUnit, args, kwargs):
    dt = unit.mp_policy.param_dtype
    if dt is None or not unit.mp_policy.cast_forward_inputs:
        return args, kwargs
    cast = lambda t: t.to(dt) if t.is_floating_point() and not isinstance(t, DTensor) else t  # noqa: E731
    return tree_map_only(torch.Tensor, cast, (args, kwargs))


def _pre_forward(module, args, kwargs):
    global _active_root
    unit: FSDPUnit = module._fsdp_unit
    if _active_root is None:  # the outermost unit of this forward is the root
        if unit._root_state is None:
            unit._root_state = _RootState(unit)
            for u in unit._root_state.units:
                u.is_root = u is unit
        _active_root = unit._root_state
        _active_root._recording = []
        _active_root._post_recording = []
        _active_root.in_forward = True
    state = _active_root
    state._recording.append(unit)
    unit.wait_unsharded()
    nxt = state.next_in_forward(unit)
    if nxt is not None:
        nxt.unshard()  # prefetch: overlaps this unit's forward
    unit.swap_in()
    unit.ran_forward = True
    return _cast_inputs(unit, args, kwargs)


def _post_forward(module, args, kwargs, output):
    global _active_root
    unit: FSDPUnit = module._fsdp_unit
    state = _active_root
    unit.swap_out()
    grad = torch.is_grad_enabled()
    is_root = state is not None and state.root is unit
    # The root's parameters are needed again first thing in backward: it keeps them.
    if (unit.reshard_after_forward and not is_root) or not grad:
        unit.reshard()
    if state is not None:
        state._post_recording.append(unit)
    if is_root:
        state.order, state.post_order = state._recording, state._post_recording
        state.in_forward = False
        _active_root = None
    if grad:
        _register_pre_backward(unit, state, output)
    dt = unit.mp_policy.output_dtype
    if dt is not None:
        output = tree_map_only(torch.Tensor, lambda t: t.to(dt) if t.is_floating_point() else t, output)
    return output


def _register_pre_backward(unit: FSDPUnit, state: _RootState, output) -> None:
    tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    if not tensors:
        return
    fired = [False]

    def hook(grad):
        if fired[0]:
            return grad
        fired[0] = True
        if not state.callback_queued:
            state.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(state.end_of_backward)
        unit.wait_unsharded()
        unit.start_backward()
        prev = state.next_in_backward(unit)
        if prev is not None:
            prev.unshard()  # prefetch: overlaps this unit's backward
        return grad

    for t in tensors:
        t.register_hook(hook)


# ---------------------------------------------------------------- construction


def _resolve_dp_mesh(mesh, dim, device_type: str):
    from shardprop.mesh.device_mesh import DeviceMesh
    import torch.distributed as dist
    if mesh is None:  # one dp dim over every rank, built once per device type
        if device_type not in _DEFAULT_MESHES:
            _DEFAULT_MESHES[device_type] = DeviceMesh(device_type, torch.arange(dist.get_world_size()), ("dp",))
        return _DEFAULT_MESHES[device_type]
    if dim is None:
        if mesh.ndim == 1:
            return mesh
        dim = "dp"
    if isinstance(dim, str):
        names = mesh.mesh_dim_names or ()
        if dim not in names:
            raise ValueError(f"fully_shard: the mesh {mesh} has no dim {dim!r} (its dims are {tuple(names)}); "
                             f"pass mesh=mesh['dp'] or dim=<one of them>")
    elif not -mesh.ndim <= dim < mesh.ndim:
        raise ValueError(f"fully_shard: mesh dim {dim} does not exist on the {mesh.ndim}-d mesh {mesh}")
    if mesh.ndim == 1:
        return mesh
    if not mesh.mesh_dim_names:
        raise ValueError(f"fully_shard: name the dims of the {mesh.ndim}-d mesh {mesh} to pick the dp dim")
    return mesh[dim if isinstance(dim, str) else mesh.mesh_dim_names[dim]]


def _managed_params(module: nn.Module):
    """(owner, name, fqn, param) for each parameter of ``module`` not managed by a nested unit."""
    out, seen = [], set()

    def visit(m, prefix):
        if m is not module and getattr(m, "_fsdp_unit", None) is not None:
            return
        for name, p in m._parameters.items():
            if p is None:
                continue
            if id(p) in seen:
                raise NotImplementedError(f"fully_shard: parameter {prefix + name!r} is shared (tied) with another "
                                          f"module in the same unit; tied parameters are not supported")
            seen.add(id(p))
            out.append((m, name, prefix + name, p))
        for cname, child in m._modules.items():
            if child is not None:
                visit(child, prefix + cname + ".")

    visit(module, "")
    return out


def _two_d_layout(fqn: str, p: DTensor, dp_mesh):
    """(parent mesh, dp dim index in it, tp placement, tensor dim dp splits) for a DTensor parameter."""
    tp_mesh = p._spec.mesh
    parent = getattr(dp_mesh, "_parent", None)
    # Meshes compare by value (specs are interned, so the tp mesh may be an equal object sliced
    # earlier): the tp mesh must be the parent's other dim through this rank.
    other = None
    if parent is not None and parent.ndim == 2 and parent.mesh_dim_names and tp_mesh.ndim == 1:
        other = parent[[n for n in parent.mesh_dim_names if n != dp_mesh.mesh_dim_names[0]][0]]
    if other is None or other != tp_mesh:
        raise ValueError(f"fully_shard: parameter {fqn!r} is a DTensor on {tp_mesh}, which is not the other dim "
                         f"of the 2-d mesh the dp mesh {dp_mesh} was sliced from; slice both from one "
                         f"('dp', 'tp') mesh")
    dp_name, tp_name = dp_mesh.mesh_dim_names[0], tp_mesh.mesh_dim_names[0]
    (tp_pl,) = p._spec.placements
    if tp_pl.is_partial():
        raise NotImplementedError(f"fully_shard: parameter {fqn!r} is Partial on {tp_name!r}")
    dim = 0
    if type(tp_pl) is Shard and tp_pl.dim == 0:
        # Splitting the tp piece again on dim 0 would need a strided-shard placement (shardprop has
        # none). dp splits dim 1 of a column-parallel weight instead ([S(1) on dp, S(0) on tp] is
        # exact); a 1-d one (a bias) stays whole on every dp rank ([R on dp, S(0) on tp]).
        dim = 1 if p.ndim >= 2 else REPLICATED
    return parent, parent.mesh_dim_names.index(dp_name), tp_pl, dim


def fully_shard(module: nn.Module, *, mesh=None, reshard_after_forward: bool = True,
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(), dim=None) -> nn.Module:
    """Shard ``module``'s parameters over the dp mesh dim; gather them around its forward and backward.

    Apply it to each block first, then to the root (a unit owns the parameters not
    owned by a nested unit). Every rank must build the model identically (same
    initial values): each keeps its own piece. ``mesh`` is a 1-d dp mesh (or a mesh
    with a ``dim`` named ``"dp"``); the default is one dim over all ranks. After
    backward, ``param.grad`` holds the dp-averaged gradient's shard.

    Example:
        >>> for block in model.layers:  # doctest: +SKIP
        ...     fully_shard(block, mesh=mesh["dp"])
        >>> fully_shard(model, mesh=mesh["dp"])  # doctest: +SKIP
        >>> loss = model(x_local).mean(); loss.backward(); opt.step()  # doctest: +SKIP
    """
    if getattr(module, "_fsdp_unit", None) is not None:
        raise ValueError(f"fully_shard: {type(module).__name__} is already fully_shard-ed; wrap each module once")
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"fully_shard: mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    first = next(module.parameters(), None)
    dp_mesh = _resolve_dp_mesh(mesh, dim, first.device.type if first is not None else "cpu")
    if dp_mesh._coord is None:
        raise RuntimeError(f"fully_shard: this rank is not in the dp mesh {dp_mesh}")
    D, me = dp_mesh.size(), dp_mesh._coord[0]
    params = _managed_params(module)
    meshes = {p._spec.mesh for *_, p in params if isinstance(p, DTensor)}
    if len(meshes) > 1:
        raise ValueError(f"fully_shard: the parameters of {type(module).__name__} live on different meshes "
                         f"{sorted(map(repr, meshes))}; one unit's parameters must share one mesh")
    slots, sources, specs = [], [], []
    for m, name, fqn, p in params:
        if p.ndim == 0:
            raise NotImplementedError(f"fully_shard: parameter {fqn!r} is 0-d; give it shape (1,)")
        if isinstance(p, DTensor):
            parent, dp_at, tp_pl, sdim = _two_d_layout(fqn, p, dp_mesh)
            local = p._local_tensor.detach()
            if sdim > 0 and local.shape[sdim] % D:
                raise NotImplementedError(f"fully_shard: parameter {fqn!r}: its tp-local dim {sdim} "
                                          f"({local.shape[sdim]}) must divide by dp={D}")
            placements = [None, None]
            placements[dp_at], placements[1 - dp_at] = (Shard(sdim) if sdim != REPLICATED else Replicate()), tp_pl
            spec = make_spec(parent, placements, p.shape, dtype=p.dtype)
            tp_spec = p._spec
        else:
            local, sdim, tp_spec = p.detach(), 0, None
            spec = make_spec(dp_mesh, [Shard(0)], p.shape, dtype=p.dtype)
        slots.append(ParamSlot(m, name, fqn, None, local.shape, sdim, D, me, p.dtype, p.requires_grad,
                               tp_spec=tp_spec))
        sources.append(local)
        specs.append(spec)
    dtypes = {s.orig_dtype for s in slots}
    if len(dtypes) > 1:
        raise NotImplementedError(f"fully_shard: parameters of one unit must share a dtype, got {sorted(map(str, dtypes))}")
    buffers = None
    if slots:
        orig = slots[0].orig_dtype
        device = sources[0].device
        buffers = UnitBuffers(slots, orig, mp_policy.compute_dtype(orig), mp_policy.grad_reduce_dtype(orig), device)
        with torch.no_grad():
            for s, src, spec in zip(slots, sources, specs):
                if s.dim == REPLICATED:
                    s.local_view = buffers.slot_view(s, buffers.shard)
                    s.local_view.copy_(src)
                else:
                    off, n = chunk_bounds(src.shape[s.dim], D, me)
                    s.local_view = buffers.slot_view(s, buffers.shard, n)
                    s.local_view.copy_(src.narrow(s.dim, off, n))
                s.sharded = nn.Parameter(DTensor(s.local_view, spec), requires_grad=s.requires_grad)
                s.sharded._local_tensor = s.local_view
                full = buffers.full_view(s)
                if s.tp_spec is not None:
                    fspec = DTensorSpec(s.tp_spec.mesh, s.tp_spec.placements,
                                        TensorMeta(s.tp_spec.shape, s.tp_spec.tensor_meta.stride, full.dtype))
                    s.full_param = nn.Parameter(DTensor(full, fspec), requires_grad=s.requires_grad)
                    s.full_param._local_tensor = full
                else:
                    s.full_param = nn.Parameter(full, requires_grad=s.requires_grad)
                s.module._parameters[s.name] = s.sharded
        buffers.free_full()
    unit = FSDPUnit(module, slots, buffers, dp_mesh, reshard_after_forward, mp_policy)
    unit._root_state = None
    module._fsdp_unit = unit
    cls = module.__class__
    module.__class__ = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    module.register_forward_pre_hook(_pre_forward, with_kwargs=True)
    module.register_forward_hook(_post_forward, with_kwargs=True)
    return module
