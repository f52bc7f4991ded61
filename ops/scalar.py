"""Ops that return Python values (not tensors): the answer must be the global one on every rank; and detach."""
from __future__ import annotations

import torch

from shardprop.dispatch.hooks import hooks as _hooks
from shardprop.dispatch import fast_paths as _fast
from shardprop.mesh.config import values as _settings
from shardprop.dispatch.dispatcher import register_special
from shardprop.tensor.placement import Replicate
from shardprop.tensor.redistribute import redistribute_local

aten = torch.ops.aten


def _replicated_local(dt):
    """This DTensor's full value on every rank (communicates only if it is not replicated)."""
    spec = dt._spec
    if spec.is_replicated:
        return dt._local_tensor
    return redistribute_local(dt._local_tensor, spec, (Replicate(),) * spec.mesh.ndim)


def _item(op, args, kwargs):
    return op(_replicated_local(args[0]))


def _equal(op, args, kwargs):
    a, b = args
    if a.shape != b.shape:
        return False
    return op(_replicated_local(a), _replicated_local(b))


def _same_size(op, args, kwargs):
    return args[0].shape == args[1].shape


def _is_pinned(op, args, kwargs):
    # Whether this rank's shard is in pinned memory (torch.distributed.checkpoint and staging ask).
    return op(args[0]._local_tensor, *args[1:], **kwargs)


register_special(aten._local_scalar_dense.default, _item)
register_special(aten.is_pinned.default, _is_pinned, outside_safe=True)
register_special(aten.equal.default, _equal)
register_special(aten.is_same_size.default, _same_size, outside_safe=True)


# ---------------------------------------------------------------- detach: the hottest copy-free op
# Autograd detaches every DTensor gradient it stores in ``.grad`` (AccumulateGrad), once per
# parameter per step. The result is the same shard under the same spec, so the rule path
# (flatten, schema, cached propagation) is skipped; explain() recording and inference mode
# (whose view wrappers need care) still take it, and so does everything with the fast paths off.
def _detach(op, args, kwargs):
    from shardprop.dispatch import dispatcher
    if kwargs or _hooks.recorder is not None or torch.is_inference_mode_enabled() or not _settings.fast_paths:
        return dispatcher.run(op, args, kwargs)
    a = args[0]
    return dispatcher.wrap(a._local_tensor.detach(), a._spec)


register_special(aten.detach.default, _detach, outside_safe=True)  # local, or the rule path


_fast.register("detach", "shardprop.ops.scalar._detach",
               "the rule-based detach through the dispatcher", ("AccumulateGrad",))
