"""The rule checker's calls as dispatch sees them: the cache key of a call, and out= targets.

An op that writes into keyword tensors (``out=``, ``aten.min.dim_min``'s ``min=``/``min_indices=``)
is checked with those targets placed as the rule places the outputs, as a caller who follows
the rule would place them.
"""
from __future__ import annotations

from shardprop.debug.check_layouts import map_tensors
from shardprop.dispatch import dispatcher as _dispatch
from shardprop.dispatch import propagate as _prop
from shardprop.dispatch.op_schema import OpSchema
from shardprop.tensor.dtensor import DTensor
from shardprop.tensor.layout import local_shape_and_offset
from shardprop.tensor.placement import Replicate


def build_schema(op, dt_args, dt_kwargs) -> OpSchema:
    """The cache key dispatch would build for this call (its own flattening, so they agree)."""
    largs, key = [], []
    _dispatch._flatten(dt_args, largs, key)
    kkey = ()
    if dt_kwargs:
        vals, kk = [], []
        _dispatch._flatten(dt_kwargs.values(), vals, kk)
        kkey = tuple(zip(dt_kwargs.keys(), kk))
    return OpSchema(op, tuple(key), kkey)


def out_dtensors(op, dt_args, dt_kwargs, written, mesh):
    """``dt_kwargs`` with each out= tensor a DTensor placed as the rule places that output.

    The rule is asked with replicated stand-ins first (it may read the out= specs, as
    torch's rules get them), then the targets are made to match its answer, as a caller
    who follows the rule would; their contents are overwritten by the op.
    """
    def stand_in(t):
        return DTensor.from_local(t.new_empty(t.shape), mesh, (Replicate(),) * mesh.ndim, shape=t.shape,
                                  stride=t.stride())

    probe = dict(dt_kwargs)
    for name in written:
        probe[name] = map_tensors(dt_kwargs[name], stand_in)
    sharding = _prop._propagate_uncounted(build_schema(op, dt_args, probe), check_out=False)
    specs = iter(sharding.out_specs)

    def placed(t):
        spec = next(specs, None)
        if spec is None:  # the op returns fewer tensors than it writes: leave it replicated
            return stand_in(t)
        local, _ = local_shape_and_offset(t.shape, mesh.shape, mesh._coord, spec.placements)
        return DTensor.from_local(t.new_empty(local), mesh, spec.placements, shape=t.shape, stride=t.stride())

    out = dict(dt_kwargs)
    for name in written:
        out[name] = map_tensors(dt_kwargs[name], placed)
    return out
