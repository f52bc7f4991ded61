"""Ops that return Python values (not tensors): the answer must be the global one on every rank."""
from __future__ import annotations

import torch

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
register_special(aten.is_pinned.default, _is_pinned)
register_special(aten.equal.default, _equal)
register_special(aten.is_same_size.default, _same_size)
