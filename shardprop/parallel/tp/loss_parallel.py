"""loss_parallel(): cross-entropy on class-sharded (vocab-sharded) logits, without gathering them.

``F.cross_entropy`` decomposes (torch 2.13, CPU) into ``_log_softmax`` + ``nll_loss_forward``
(``nll_loss2d_forward`` for inputs of more than 2 dims) and, backward, ``nll_loss_backward`` +
``_log_softmax_backward_data``. While the context is active those four (six) ops get special
handlers that work on the local class shard:

* log_softmax: all-reduce (max) the per-row max and all-reduce (sum) the per-row sum of exp;
  each rank normalises its own columns. Output: same layout as the logits.
* nll_loss: each rank picks the targets that fall in its class range (others masked to 0)
  and the per-row values are summed across the class shards (an all-reduce of a ``[N]``
  vector for ``reduction="none"``, of one scalar otherwise).
* backward: the nll gradient is written locally (-weight at the target column, where this
  rank holds it); the log_softmax backward all-reduces one per-row sum.

No rank ever holds more than its ``[N, C / tp]`` piece. Ops whose class dim is not sharded
take the normal path. Other mesh dims may shard the batch dims (logits and targets alike):
``sum``/``mean`` losses then come out ``Partial("sum")`` on those mesh dims.
"""
from __future__ import annotations

import contextlib

import torch

from shardprop.dispatch import dispatcher as _dispatch
from shardprop.mesh import collectives as C
from shardprop.mesh.state import module_state
from shardprop.tensor.dtensor import DTensor, local_chunk, make_spec
from shardprop.tensor.placement import Partial, Replicate, Shard, without_partial
from shardprop.tensor.redistribute import redistribute_local

aten = torch.ops.aten
R = Replicate()
_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}  # at::Reduction


# ---------------------------------------------------------------- helpers
def _without_partial(x: DTensor):
    """(local, spec) of ``x`` with any Partial mesh dims reduced to Replicate."""
    spec = x._spec
    if not spec.has_partial:
        return x._local_tensor, spec
    target = without_partial(spec.placements)
    return redistribute_local(x._local_tensor, spec, target), spec.with_placements(target)


def _local_as(x, spec_placements, like_spec):
    """Local tensor of ``x`` (DTensor or plain full tensor) laid out as ``spec_placements``."""
    if isinstance(x, DTensor):
        if x._spec.placements == spec_placements:
            return x._local_tensor
        return redistribute_local(x._local_tensor, x._spec, spec_placements)
    return local_chunk(x, like_spec.mesh, spec_placements)


def _wrap_like(local, mesh, placements, meta_out):
    return _dispatch.wrap(local, make_spec(mesh, placements, meta_out.shape, meta_out.stride(), meta_out.dtype))


def _meta(spec_or_tensor):
    if isinstance(spec_or_tensor, torch.Tensor):
        t = spec_or_tensor
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    m = spec_or_tensor.tensor_meta
    return torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device="meta")


def _class_range(spec, dim: int):
    """(offset, size) of this rank's slice of dim ``dim``."""
    shape, offset = spec.local_box()
    return offset[dim], shape[dim]


def _fallback(op, args, kwargs):
    prev = _saved.get(op)
    return prev(op, args, kwargs) if prev is not None else _dispatch.run(op, args, kwargs)


# ---------------------------------------------------------------- log_softmax
def _log_softmax(op, args, kwargs):
    x, dim, half_to_float = (list(args) + [None, False])[:3]
    if kwargs:
        dim, half_to_float = kwargs.get("dim", dim), kwargs.get("half_to_float", half_to_float)
    dim = dim % x.ndim
    if not isinstance(x, DTensor) or not x._spec.shard_mesh_dims(dim) or half_to_float:
        return _fallback(op, args, kwargs)
    local, spec = _without_partial(x)
    dims = spec.shard_mesh_dims(dim)
    if local.shape[dim] == 0:  # an empty trailing shard of an uneven class dim
        row_max = local.new_full(local.shape[:dim] + (1,) + local.shape[dim + 1:], float("-inf"))
    else:
        row_max = local.amax(dim, keepdim=True)
    row_max = C.all_reduce(row_max, spec.mesh, dims, "max", inplace=True)
    row_max = row_max.masked_fill(torch.isinf(row_max), 0)  # all -inf rows: keep them -inf, not nan
    shifted = local - row_max
    sum_exp = C.all_reduce(shifted.exp().sum(dim, keepdim=True), spec.mesh, dims, "sum", inplace=True)
    out = shifted.sub_(sum_exp.log_())
    return _wrap_like(out, spec.mesh, spec.placements, op(_meta(spec), dim, False))


def _log_softmax_backward(op, args, kwargs):
    grad, output, dim, input_dtype = args
    dim = dim % output.ndim
    if not isinstance(output, DTensor) or not output._spec.shard_mesh_dims(dim):
        return _fallback(op, args, kwargs)
    out_local, spec = _without_partial(output)
    g = _local_as(grad, spec.placements, spec)
    dims = spec.shard_mesh_dims(dim)
    row_sum = C.all_reduce(g.sum(dim, keepdim=True), spec.mesh, dims, "sum", inplace=True)
    res = g - out_local.exp() * row_sum
    return _wrap_like(res, spec.mesh, spec.placements, op(_meta(grad), _meta(spec), dim, input_dtype))


# ---------------------------------------------------------------- nll_loss
def _target_placements(spec) -> tuple:
    """Target layout for logits ``spec`` (class dim 1): batch shards follow, class shards replicate."""
    out = []
    for p in spec.placements:
        if type(p) is Shard and p.dim != 1:
            out.append(Shard(p.dim if p.dim == 0 else p.dim - 1))
        else:
            out.append(R)
    return tuple(out)


def _batch_mesh_dims(spec) -> tuple:
    return tuple(m for m, p in enumerate(spec.placements) if type(p) is Shard and p.dim != 1)


def _picks(x_local, spec, target_local, weight, ignore_index):
    """(inside, local column index, per-sample weight) for the targets this rank holds."""
    offset, rows = _class_range(spec, 1)
    valid = target_local != ignore_index
    t_loc = target_local - offset
    inside = valid & (t_loc >= 0) & (t_loc < rows)
    col = t_loc.masked_fill(~inside, 0)
    if weight is None:
        w = valid.to(x_local.dtype)
    else:
        full_w = weight.full_tensor() if isinstance(weight, DTensor) else weight
        w = full_w.to(x_local.dtype)[target_local.masked_fill(~valid, 0)] * valid
    return inside, col, w, rows


def _nll_args(args, kwargs, names):
    vals = dict(zip(names, args))
    vals.update(kwargs or {})
    return [vals.get(n) for n in names]


def _nll_forward(op, args, kwargs):
    x, target, weight, reduction, ignore_index = _nll_args(
        args, kwargs, ("self", "target", "weight", "reduction", "ignore_index"))
    if not isinstance(x, DTensor) or x.ndim < 2 or not x._spec.shard_mesh_dims(1):
        return _fallback(op, args, kwargs)
    x_local, spec = _without_partial(x)
    mesh = spec.mesh
    t_pl = _target_placements(spec)
    t_local = _local_as(target, t_pl, spec)
    inside, col, w, rows = _picks(x_local, spec, t_local, weight, ignore_index)
    if rows:
        picked = x_local.gather(1, col.unsqueeze(1)).squeeze(1).masked_fill(~inside, 0)
    else:
        picked = x_local.new_zeros(t_local.shape)
    per_sample = -picked * w
    class_dims, batch_dims = spec.shard_mesh_dims(1), _batch_mesh_dims(spec)
    total = w.sum()
    if batch_dims:
        total = C.all_reduce(total, mesh, batch_dims, "sum", inplace=True)
    how = _REDUCTIONS[reduction]
    if how == "none":
        loss, loss_pl = per_sample, t_pl
    else:
        loss = per_sample.sum()
        if how == "mean":
            loss = loss / total
        loss_pl = tuple(Partial("sum") if m in batch_dims else R for m in range(mesh.ndim))
    loss = C.all_reduce(loss, mesh, class_dims, "sum", inplace=True)
    meta_loss, meta_total = op(_meta(spec), _meta_target(target, spec), None, reduction, ignore_index)
    replicated = (R,) * mesh.ndim
    return (_wrap_like(loss, mesh, loss_pl, meta_loss), _wrap_like(total, mesh, replicated, meta_total))


def _meta_target(target, spec):
    if isinstance(target, DTensor):
        return _meta(target._spec)
    return _meta(target)


def _nll_backward(op, args, kwargs):
    grad, x, target, weight, reduction, ignore_index, total_weight = _nll_args(
        args, kwargs, ("grad_output", "self", "target", "weight", "reduction", "ignore_index", "total_weight"))
    if not isinstance(x, DTensor) or x.ndim < 2 or not x._spec.shard_mesh_dims(1):
        return _fallback(op, args, kwargs)
    spec = x._spec
    if spec.has_partial:
        spec = spec.without_partial()
    mesh = spec.mesh
    t_pl = _target_placements(spec)
    t_local = _local_as(target, t_pl, spec)
    x_shape, _ = spec.local_box()
    inside, col, w, rows = _picks(torch.empty((), dtype=spec.dtype), spec, t_local, weight, ignore_index)
    how = _REDUCTIONS[reduction]
    g = _local_as(grad, t_pl if how == "none" else (R,) * mesh.ndim, spec)
    if how == "mean":
        total = total_weight._local_tensor if isinstance(total_weight, DTensor) else total_weight
        g = g / total
    vals = (-w * g * inside).to(spec.dtype)
    res = torch.zeros(x_shape, dtype=spec.dtype, device=t_local.device)
    if rows:
        res.scatter_(1, col.unsqueeze(1), vals.unsqueeze(1))
    meta = op(_meta(grad._spec if isinstance(grad, DTensor) else grad), _meta(spec), _meta_target(target, spec),
              None, reduction, ignore_index, _meta(total_weight._spec if isinstance(total_weight, DTensor)
                                                   else total_weight))
    return _wrap_like(res, mesh, spec.placements, meta)


HANDLERS = {
    aten._log_softmax.default: _log_softmax,
    aten._log_softmax_backward_data.default: _log_softmax_backward,
    aten.nll_loss_forward.default: _nll_forward,
    aten.nll_loss2d_forward.default: _nll_forward,
    aten.nll_loss_backward.default: _nll_backward,
    aten.nll_loss2d_backward.default: _nll_backward,
}

_saved = {}  # op -> the special handler that was there before the context (None: the rule path)


_state = module_state(depth=0)


@contextlib.contextmanager
def loss_parallel():
    """Within this context, ``F.cross_entropy`` / ``F.nll_loss`` on logits sharded on the class dim
    (``Shard(1)`` of ``[N, C]``, the output of ``ColwiseParallel(use_local_output=False)`` flattened to
    tokens) run shard by shard, forward and backward; the full logits never exist on any rank.

    Targets may be a replicated DTensor or a plain full tensor (the same on every rank). The loss
    is replicated over the class-sharding mesh dims. Call ``backward()`` inside the context too.
    Reductions ``mean``/``sum``/``none``, ``ignore_index`` and class ``weight`` are supported;
    ``[B, C, S]`` inputs too (``logits.transpose(1, 2)``), though flattening ``[B, S, C]`` to
    ``[B*S, C]`` is the usual form.

    Example:
        >>> mesh = init_device_mesh("cpu", (4,))
        >>> head = parallelize_module(nn.Linear(8, 32), mesh, ColwiseParallel(use_local_output=False))
        >>> logits = head(torch.randn(2, 3, 8))   # DTensor [2, 3, 32], Shard(2): vocab-sharded
        >>> targets = torch.arange(6).view(2, 3)
        >>> with loss_parallel():
        ...     loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        ...     loss.backward()
    """
    if _state.depth == 0:
        for op, handler in HANDLERS.items():
            _saved[op] = _dispatch.special_handler(op)
            _dispatch.register_special(op, handler)
    _state.depth += 1
    try:
        yield
    finally:
        _state.depth -= 1
        if _state.depth == 0:
            for op in HANDLERS:
                prev = _saved.pop(op, None)
                if prev is None:
                    _dispatch.unregister_special(op)  # also resets the op's entry (handler, memo, call counter)
                else:
                    _dispatch.register_special(op, prev)


__all__ = ["loss_parallel"]
