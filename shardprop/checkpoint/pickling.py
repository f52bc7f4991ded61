"""Pickling DTensors: ``pickle``, ``copy.deepcopy`` and ``torch.save``/``torch.load``.

A DTensor pickles as what it is: its global size, stride, dtype and ``requires_grad``
(the wrapper), this rank's local tensor, and its spec (placements, global meta, and the
mesh as data: device type, ranks, shape, dim names; never a process group, see
``DeviceMesh.__reduce__``). Unpickling rebinds the spec to the matching mesh of the
unpickling process and checks that the local tensor fits it.

It goes through torch's own route for tensor subclasses (``torch._tensor._rebuild_from_type_v2``
with ``torch._utils._rebuild_wrapper_subclass``, both allowed by ``torch.load``'s
``weights_only`` unpickler), so ``torch.load(f)`` with its default ``weights_only=True``
loads our DTensors once exactly our value types are allowlisted: ``DTensor``,
``DTensorSpec``, ``TensorMeta``, ``Shard``, ``Replicate``, ``Partial``, ``DeviceMesh``
(done at import). Nothing else is allowed, so a file naming any other class still fails.

``copy.deepcopy`` gives a DTensor with its own copy of the local tensor on the same spec
(the same mesh object): deep-copying a parallelized module gives independent parameters.

Example:
    >>> torch.save(model.state_dict(), f"ckpt.rank{rank}.pt")        # doctest: +SKIP
    >>> model.load_state_dict(torch.load(f"ckpt.rank{rank}.pt"))      # weights_only=True  # doctest: +SKIP
    >>> twin = copy.deepcopy(model)                                   # doctest: +SKIP
"""
from __future__ import annotations

import copy

import torch

from shardprop.mesh import AsyncTensor, DeviceMesh
from shardprop.tensor.dtensor import DTensor
from shardprop.tensor.layout import local_shape_and_offset
from shardprop.tensor.placement import REDUCE_OPS, Partial, Replicate, Shard
from shardprop.tensor.spec import DTensorSpec, TensorMeta

# Exactly the types a pickled DTensor holds besides what torch allows already.
SAFE_GLOBALS = [DTensor, DTensorSpec, TensorMeta, Shard, Replicate, Partial, DeviceMesh]
_STATE_KEYS = ("_local_tensor", "_spec", "_is_param", "_grad_hooks")


def _rebindable_hooks(t: torch.Tensor) -> tuple:
    """The tensor's gradient hooks that can follow it into a copy: those with ``rebind(tensor)``.

    torch drops tensor hooks when it pickles or copies a parameter; a parallel style's hook
    (``shardprop.parallel.fast.grad_sync.GradLike``) lays the gradient out like the parameter, so a
    copy without it would train on the wrong gradient layout. Closures stay dropped, as in torch.
    """
    hooks = getattr(t, "_backward_hooks", None)
    return tuple(h for h in hooks.values() if callable(getattr(h, "rebind", None))) if hooks else ()


def _register_hooks(t: torch.Tensor, hooks) -> None:
    if t.requires_grad:
        for h in hooks:
            t.register_hook(h.rebind(t))


def reduce_ex(self: DTensor, proto):
    """DTensor.__reduce_ex__: the wrapper's metadata, then (local tensor, spec) as its state."""
    local = self._local_tensor
    if isinstance(local, AsyncTensor):  # a collective still in flight: pickle its result
        local = local.wait()
    state = {"_local_tensor": local.detach(), "_spec": self._spec}  # requires_grad lives on the wrapper
    if getattr(self, "_is_param", False):  # nn.Parameter(dtensor) is a DTensor marked as a parameter
        state["_is_param"] = True
    hooks = _rebindable_hooks(self)
    if hooks:
        state["_grad_hooks"] = hooks
    wrapper = (type(self), self.dtype, tuple(self.shape), self.stride(), 0, self.layout, local.device,
               self.requires_grad)
    return (torch._tensor._rebuild_from_type_v2, (torch._utils._rebuild_wrapper_subclass, type(self), wrapper, state))


def setstate(self: DTensor, state) -> None:
    """DTensor.__setstate__ (called by ``_rebuild_from_type_v2``): check the state, then set it."""
    if type(state) is not dict or not set(state) <= set(_STATE_KEYS) or not {"_local_tensor", "_spec"} <= set(state):
        raise ValueError(f"DTensor: malformed pickled state (keys {sorted(state) if type(state) is dict else state!r})")
    local, spec = state["_local_tensor"], state["_spec"]
    if not isinstance(local, torch.Tensor) or isinstance(local, DTensor) or type(spec) is not DTensorSpec:
        raise ValueError(f"DTensor: pickled state holds a {type(local).__name__} and a {type(spec).__name__}, "
                         "expected a plain tensor and a DTensorSpec")
    mesh = spec.mesh
    if type(mesh) is not DeviceMesh:
        raise ValueError(f"DTensor: pickled spec's mesh is a {type(mesh).__name__}, not a DeviceMesh")
    placements = _checked_placements(spec.placements, len(spec.tensor_meta.shape), mesh.ndim)
    meta = spec.tensor_meta
    if tuple(meta.shape) != tuple(self.shape) or meta.dtype != self.dtype or local.dtype != self.dtype:
        raise ValueError(f"DTensor: pickled spec {spec} does not match the tensor ({tuple(self.shape)}, {self.dtype}) "
                         f"or its local {local.dtype} shard")
    if mesh._coord is not None:
        want = tuple(local_shape_and_offset(meta.shape, mesh.shape, mesh._coord, placements)[0])
        if tuple(local.shape) != want:
            raise ValueError(
                f"DTensor: the pickled local shard has shape {tuple(local.shape)}, but this rank's "
                f"(coordinate {tuple(mesh._coord)}) shard of a {tuple(meta.shape)} tensor placed "
                f"{list(placements)} on {mesh} has shape {want}; was the file saved by another rank?")
    self._local_tensor = local
    self._spec = DTensorSpec(mesh, placements, TensorMeta(torch.Size(meta.shape), tuple(meta.stride), meta.dtype))
    if state.get("_is_param"):
        self._is_param = True
    hooks = state.get("_grad_hooks", ())
    if type(hooks) is not tuple or not all(callable(getattr(h, "rebind", None)) for h in hooks):
        raise ValueError(f"DTensor: malformed pickled gradient hooks {hooks!r}")
    _register_hooks(self, hooks)


def _checked_placements(placements, ndim: int, mesh_ndim: int) -> tuple:
    """Placements rebuilt through their constructors (which validate), one per mesh dim."""
    if type(placements) is not tuple or len(placements) != mesh_ndim:
        raise ValueError(f"DTensor: pickled placements {placements!r} do not give one per mesh dim ({mesh_ndim})")
    out = []
    for p in placements:
        if type(p) is Shard and type(p.dim) is int and 0 <= p.dim < ndim:
            out.append(Shard(p.dim))
        elif type(p) is Replicate:
            out.append(Replicate())
        elif type(p) is Partial and p.reduce_op in REDUCE_OPS:
            out.append(Partial(p.reduce_op))
        else:
            raise ValueError(f"DTensor: invalid pickled placement {p!r} for a {ndim}-d tensor")
    return tuple(out)


def deepcopy_dtensor(self: DTensor, memo) -> DTensor:
    """DTensor.__deepcopy__: its own copy of the local tensor, the same spec (and mesh)."""
    if id(self) in memo:
        return memo[id(self)]
    if not self.is_leaf:
        raise RuntimeError("Only Tensors created explicitly by the user (graph leaves) support the deepcopy "
                           "protocol at the moment (a DTensor too); deep-copy a detached DTensor instead")
    local = self._local_tensor
    if isinstance(local, AsyncTensor):
        local = local.wait()
    with torch.no_grad():
        local = copy.deepcopy(local.detach(), memo)
    new = DTensor(local, self._spec, requires_grad=self.requires_grad)
    if getattr(self, "_is_param", False):
        new._is_param = True
    _register_hooks(new, _rebindable_hooks(self))
    if self.grad is not None:
        new.grad = copy.deepcopy(self.grad, memo)
    memo[id(self)] = new
    return new


# DTensor's __reduce_ex__/__setstate__/__deepcopy__ are the functions above, given to the class in
# shardprop/assembly.py (this room is above the class's own).
torch.serialization.add_safe_globals(SAFE_GLOBALS)
