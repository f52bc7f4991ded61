"""Training batch norm on a batch-sharded input: global batch statistics, as ``SyncBatchNorm``.

In training, batch norm normalizes each channel by the mean and variance over every dim but the
channel dim 1. When the input is sharded on such a dim, each rank holds part of the batch; the
rule path would all-gather the whole input. Here each rank reduces its own part and the partial
sums are all-reduced over the mesh dims that shard the batch (two all-reduces: the sum for the
mean, then the sum of squared deviations for the variance: exact and stable, where a one-pass
sum of squares loses digits). The output keeps the input's shard; the saved mean and inverse
std and the running statistics (``running = (1 - momentum) * running + momentum * stat``, the
variance unbiased with the global count) are the global ones on every rank, as one process
over the whole batch computes them.

The backward ops (``native_batch_norm_backward``, ``batch_norm_backward``, training) need
the global sums of ``grad_out`` and ``grad_out * x_hat`` per channel: one all-reduce of both.

Any other case (eval with running statistics, no batch shard, channel-only shards) takes the
rule in ``ops/nn.py``; where that rule refuses (running statistics whose placement no strategy
keeps), the computation here serves it too, with no all-reduce. A channel shard beside the batch shard is gathered first (the per-channel
tensors then are replicated); running statistics of any placement are updated in place through
their full value.

Example:
    >>> x = distribute_tensor(torch.randn(8, 3, 5), mesh, [Shard(0)])  # doctest: +SKIP
    >>> F.batch_norm(x, rm, rv, training=True)  # rm, rv replicated DTensors: updated globally  # doctest: +SKIP
"""
from __future__ import annotations

import math

import torch

from shardprop.dispatch import dispatcher as _dispatch
from shardprop.dispatch.propagate import ShardingError
from shardprop.mesh import collectives as C
from shardprop.tensor.dtensor import DTensor, local_chunk, make_spec
from shardprop.tensor.placement import Partial, Replicate, Shard
from shardprop.tensor.redistribute import redistribute_local

aten = torch.ops.aten
R = Replicate()

# op -> (schema index of the training flag, or True when the op always trains)
FORWARD = {
    "native_batch_norm.default": 5,
    "_native_batch_norm_legit.default": 5,
    "_native_batch_norm_legit.no_stats": 3,
    "_batch_norm_with_update.default": True,
}
BACKWARD = {
    "native_batch_norm_backward.default": 7,
    "batch_norm_backward.default": 7,
}


def _named(op, args, kwargs) -> dict:
    names = [a.name for a in op._schema.arguments]
    out = dict(zip(names, args))
    out.update(kwargs or {})
    return out


def _flag(op, args, kwargs, table) -> bool:
    where = table[_key(op)]
    if where is True:
        return True
    name = op._schema.arguments[where].name
    return bool(_named(op, args, kwargs).get(name))


def _key(op) -> str:
    return f"{op.overloadpacket.__name__}.{op._overloadname}"


def batch_dims(x) -> tuple:
    """Mesh dims on which DTensor ``x`` is sharded along a non-channel dim (the batch shards).

    Example:
        >>> batch_dims(distribute_tensor(torch.ones(8, 3), mesh, [Shard(0)]))  # doctest: +SKIP
        (0,)
    """
    if not isinstance(x, DTensor) or x.ndim < 2:
        return ()
    return tuple(m for m, p in enumerate(x._spec.placements)
                 if isinstance(p, Shard) and p.dim % x.ndim != 1)


def _input_placements(x) -> tuple:
    """Keep the batch shards; everything else (channel shards, Partial) becomes Replicate."""
    return tuple(p if isinstance(p, Shard) and p.dim % x.ndim != 1 else R for p in x._spec.placements)


def _local_as(dt, placements):
    """``dt``'s local tensor moved to ``placements`` (None stays None, plain tensors as they are)."""
    if not isinstance(dt, DTensor):
        return dt
    spec = dt._spec
    if tuple(spec.placements) == tuple(placements):
        return dt._local_tensor
    return redistribute_local(dt._local_tensor, spec, tuple(placements))


def _full(dt):
    if dt is None:
        return None
    return _local_as(dt, (R,) * dt._spec.mesh.ndim)


def _meta(a):
    if isinstance(a, torch.Tensor):
        return torch.empty(a.shape, dtype=a.dtype, device="meta")
    if isinstance(a, (list, tuple)):
        return type(a)(_meta(x) for x in a)
    return a


def _wrap(local, mesh, placements, meta):
    spec = make_spec(mesh, placements, meta.shape, meta.stride(), meta.dtype)
    return _dispatch.wrap(local.to(meta.dtype), spec)


def _global_sum(t, mesh, dims):
    return C.all_reduce(t, mesh, dims) if dims else t


def _shape(x, C_):
    return (1, C_) + (1,) * (x.ndim - 2)


def _forward(op, args, kwargs):
    named = _named(op, args, kwargs)
    x = named["input"]
    dims = batch_dims(x)
    if not _flag(op, args, kwargs, FORWARD) or x.numel() == 0:
        return _dispatch.run(op, args, kwargs)
    if not dims:
        try:  # the rule keeps a channel shard; it refuses when the running stats would have to move
            return _dispatch.run(op, args, kwargs)
        except ShardingError:  # raised while choosing a strategy: on every rank, before any collective
            pass
    mesh = x._spec.mesh
    metas = op(*_meta(args), **{k: _meta(v) for k, v in (kwargs or {}).items()})
    placements = _input_placements(x)
    xl = _local_as(x, placements)
    C_ = x.shape[1]
    n = x.numel() // C_  # global count per channel
    acc = torch.promote_types(x.dtype, torch.float32)
    red = [0] + list(range(2, x.ndim))
    view = _shape(x, C_)
    mean = _global_sum(xl.sum(red, dtype=acc), mesh, dims) / n
    diff = xl.to(acc) - mean.view(view)
    var = _global_sum((diff * diff).sum(red), mesh, dims) / n
    eps = float(named["eps"])
    invstd = torch.rsqrt(var + eps)
    out = diff * invstd.view(view)
    w, b = _full(named.get("weight")), _full(named.get("bias"))
    if w is not None:
        out = out * w.to(acc).view(view)
    if b is not None:
        out = out + b.to(acc).view(view)
    momentum = float(named.get("momentum") or 0.0)
    rm, rv = named.get("running_mean"), named.get("running_var")
    if rm is not None:
        _update(rm, mean, momentum)
    if rv is not None:
        _update(rv, var * (n / (n - 1)) if n > 1 else var * math.inf, momentum)
    rep = (R,) * mesh.ndim
    outs = [_wrap(out, mesh, placements, metas[0]), _wrap(mean, mesh, rep, metas[1]),
            _wrap(invstd, mesh, rep, metas[2])]
    for m in metas[3:]:  # _batch_norm_with_update's reserve: an empty byte tensor on CPU
        outs.append(_wrap(torch.empty(m.shape, dtype=m.dtype), mesh, rep, m))
    return tuple(outs)


def _update(running, stat, momentum: float) -> None:
    """``running = (1 - momentum) * running + momentum * stat`` in place, whatever its placement."""
    if isinstance(running, DTensor):
        spec = running._spec
        if any(isinstance(p, Partial) for p in spec.placements):
            raise ShardingError(
                f"shardprop: training batch norm cannot update a running statistic placed {spec.placements} "
                "(Partial); make it Replicate or Shard(0)")
        full = _full(running)
        new = (full * (1 - momentum) + stat.to(full.dtype) * momentum)
        running._local_tensor.copy_(local_chunk(new, spec.mesh, spec.placements)
                                    if not spec.is_replicated else new)
    else:
        running.mul_(1 - momentum).add_(stat.to(running.dtype), alpha=momentum)


def _backward(op, args, kwargs):
    named = _named(op, args, kwargs)
    x = named["input"]
    dims = batch_dims(x)
    if not _flag(op, args, kwargs, BACKWARD):
        return _dispatch.run(op, args, kwargs)
    if not dims:
        try:
            return _dispatch.run(op, args, kwargs)
        except ShardingError:
            pass
    mesh = x._spec.mesh
    metas = op(*_meta(args), **{k: _meta(v) for k, v in (kwargs or {}).items()})
    placements = _input_placements(x)
    xl = _local_as(x, placements)
    g = named["grad_out"]
    gl = _local_as(g, placements) if isinstance(g, DTensor) else g
    mean = _full(named["save_mean"])
    invstd = _full(named.get("save_invstd", named.get("save_var")))
    w = _full(named.get("weight"))
    C_ = x.shape[1]
    n = x.numel() // C_
    acc = torch.promote_types(x.dtype, torch.float32)
    red = [0] + list(range(2, x.ndim))
    view = _shape(x, C_)
    xhat = (xl.to(acc) - mean.to(acc).view(view)) * invstd.to(acc).view(view)
    ga = gl.to(acc)
    sums = _global_sum(torch.stack([ga.sum(red), (ga * xhat).sum(red)]), mesh, dims)
    sg, sgx = sums[0], sums[1]
    scale = invstd.to(acc) if w is None else invstd.to(acc) * w.to(acc)
    mask = named.get("output_mask") or [True, True, True]
    rep = (R,) * mesh.ndim
    grad_in = None
    if mask[0]:
        grad_in = (ga - (sg / n).view(view) - xhat * (sgx / n).view(view)) * scale.view(view)
        grad_in = _wrap(grad_in, mesh, placements, metas[0])
    grad_w = _wrap(sgx, mesh, rep, metas[1]) if mask[1] and metas[1] is not None else None
    grad_b = _wrap(sg, mesh, rep, metas[2]) if mask[2] and metas[2] is not None else None
    return grad_in, grad_w, grad_b


def _ops(table):
    out = []
    for name in table:
        packet, _, ov = name.partition(".")
        p = getattr(aten, packet, None)
        if p is not None and ov in p.overloads():
            out.append(getattr(p, ov))
    return out


for _op in _ops(FORWARD):
    _dispatch.register_special(_op, _forward)
for _op in _ops(BACKWARD):
    _dispatch.register_special(_op, _backward)
