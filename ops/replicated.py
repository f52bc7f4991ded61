"""Ops that run only on whole tensors: every input is replicated, every output is replicated.

This is always correct for an op that gives the same result on every rank from the same
inputs (no randomness, no rank-dependent state), and better than an error: the price is
gathering the inputs. Each group below says why no shard survives.

Two paths:

* ``REPLICATED``: ops whose output shapes meta tensors can tell; a rule with the single
  all-Replicate option (the engine gathers the inputs first).
* ``RUN_WHOLE``: ops whose output shape depends on the values (nonzero, unique, ...) or
  that have no meta kernel; a special handler gathers the inputs, runs the op and wraps
  each tensor output as a replicated DTensor of whatever shape it came out.

``as_strided`` and friends read the input's storage: they are right on a replicated
copy only when the global tensor is dense (no gaps between its elements, which a copy
would fill with garbage) and the view stays inside it (a ``storage_offset`` counts from the
DTensor's first element, its global tensor taken as its own storage, as for a fresh contiguous
tensor); otherwise the rule raises a ``ShardingError`` naming the op, the placements and why.

Example:
    >>> x = distribute_tensor(torch.randn(8, 8), mesh, [Shard(0)])  # doctest: +SKIP
    >>> torch.linalg.inv(x).placements   # gathered, inverted on every rank  # doctest: +SKIP
    (Replicate(),)
"""
from __future__ import annotations

import torch

from shardprop.dispatch.hooks import hooks as _hooks
from shardprop.dispatch.dispatcher import register_special, wrap
from shardprop.dispatch.plain_tensors import joins_as_replicate, plain_tensor_error, same_on_every_rank
from shardprop.dispatch.propagate import ShardingError
from shardprop.mesh.compat import aten_ops
from shardprop.dispatch.registry import register_local_call, rule
from shardprop.tensor.dtensor import DTensor, local_chunk
from shardprop.tensor.placement import Replicate
from shardprop.tensor.redistribute import redistribute_local
from shardprop.tensor.spec import DTensorSpec, TensorMeta

from .along_dim import arg

aten = torch.ops.aten
R = Replicate()

# (packet names, overloads or None for all) per group
REPLICATED = [
    # factorizations, solves, inverses and determinants couple every row with every column
    (["_linalg_svd", "linalg_qr", "_linalg_eigh", "linalg_eig", "linalg_inv_ex", "_linalg_solve_ex", "cholesky",
      "cholesky_inverse", "cholesky_solve", "linalg_cholesky_ex", "linalg_lu", "linalg_lu_factor_ex",
      "linalg_lu_solve", "lu_unpack", "linalg_ldl_factor_ex", "linalg_ldl_solve", "_linalg_det", "_linalg_slogdet",
      "linalg_householder_product", "triangular_solve", "linalg_solve_triangular", "linalg_matrix_exp", "ormqr",
      "linalg_cross", "_linalg_eigvals", "linalg_polar", "linalg_matrix_sqrth"], None),
    # raises on every rank alike when the (replicated) LAPACK info says so; returns nothing
    (["_linalg_check_errors"], None),
    (["linalg_pinv"], ("atol_rtol_tensor", "atol_rtol_float", "default", "rcond_tensor")),
    # Fourier transforms mix every element of the transformed dims
    (["_fft_r2c", "_fft_c2r", "_fft_c2c"], None),
    # counts, bins and lookups against a whole table
    (["nonzero_static", "histc", "bucketize", "searchsorted", "isin", "segment_reduce", "_segment_reduce_backward"],
     None),
    # pairwise distances and full reductions with no Partial to combine them
    (["_cdist_forward", "_cdist_backward", "_pdist_forward", "_pdist_backward", "_euclidean_dist", "dist",
      "hash_tensor"], None),
    (["median", "nanmedian"], ("default",)),
    # factories whose endpoints are 0-d tensors
    (["linspace", "logspace"], ("Tensor_Tensor", "Tensor_Scalar", "Scalar_Tensor")),
    # ops over lists of tensors of different shapes
    (["_chunk_cat", "block_diag"], None),
    # random draws over whole rows or windows: every rank draws the whole result from its generator,
    # in step with the others' (random_ops), so all hold what one process draws
    (["multinomial", "fractional_max_pool2d", "fractional_max_pool3d", "fractional_max_pool2d_backward"], None),
    (["rrelu_with_noise_backward"], None),
]

# Output shape depends on the values, or no meta kernel: run on the gathered inputs.
RUN_WHOLE = [
    (["nonzero", "masked_select", "_unique2", "unique_consecutive", "unique_dim", "unique_dim_consecutive",
      "_histogramdd_from_bin_tensors", "_histogramdd_bin_edges", "_histogramdd_from_bin_cts", "geqrf",
      "linalg_lstsq", "allclose", "bincount", "_unique"], ("default",)),
    (["repeat_interleave"], ("Tensor",)),
    (["histogram"], ("bins_tensor", "bin_ct")),
    (["fractional_max_pool3d_backward"], ("default",)),  # no meta kernel
]

# Read raw storage: replicated and dense only (see the module docstring).
STRIDED = [aten.as_strided.default, aten.as_strided_copy.default, aten.as_strided_scatter.default]


# Ops of other libraries torch ships, by namespace: (packet names, overloads or None) per group.
REPLICATED_ELSEWHERE = {
    # 2.15's nn.functional.linear_cross_entropy: matmul and loss fused, chunked over the batch
    "torch_nn": [(["_linear_cross_entropy_batch_chunked", "_linear_cross_entropy_batch_chunked_no_reduction"],
                  None)],
}


def _ops(groups, namespace="aten") -> list:
    return [op for names, overloads in groups for op in aten_ops(names, overloads, namespace)]


def replicate_option(ctx) -> tuple:
    """The one option: every DTensor input and every tensor output Replicate."""
    return ((R,) * len(ctx.specs), tuple(None if m is None else R for m in ctx.out_metas))


@rule(*_ops(REPLICATED), *(op for ns, groups in REPLICATED_ELSEWHERE.items() for op in _ops(groups, ns)))
def replicated(ctx):
    return [replicate_option(ctx)]


# ------------------------------------------------------------------ raw storage
def _dense(shape, stride) -> bool:
    """Whether the strides lay the elements out with no gaps and no overlap (any dim order)."""
    expect = 1
    for size, st in sorted((d for d in zip(shape, stride) if d[0] != 1), key=lambda d: d[1]):
        if st != expect:
            return False
        expect *= size
    return True


@rule(*STRIDED)
def strided(ctx):
    x = ctx.specs[0]
    size, stride = arg(ctx, "size"), arg(ctx, "stride")
    # A DTensor's storage is its dense global tensor, starting at its first element (offset 0),
    # as for a fresh contiguous tensor; an offset counts from there.
    offset = arg(ctx, "storage_offset", None) or 0
    if not _dense(x.shape, x.tensor_meta.stride):
        raise ShardingError(f"{ctx.op}: the DTensor (placements {list(x.placements)}, shape {tuple(x.shape)}, "
                            f"stride {x.tensor_meta.stride}) is not dense, so it has no storage to view; "
                            "call .contiguous() first")
    numel = x.tensor_meta.shape.numel()
    if any(n == 0 for n in size):
        return [replicate_option(ctx)]
    last = offset + sum((n - 1) * s for n, s in zip(size, stride))
    if offset >= 0 and 0 <= last < numel and min(stride, default=0) >= 0:
        return [replicate_option(ctx)]
    raise ShardingError(f"{ctx.op}: size {list(size)}, stride {list(stride)}, storage_offset {offset} reaches "
                        f"outside the DTensor's {numel} elements (placements {list(x.placements)}); a DTensor's "
                        "storage is its own global tensor, nothing before or after it")


def _with_global_strides(op, out, largs, lkwargs):
    """Run on a copy of the input laid out with the global tensor's strides (storage order matters)."""
    m = out.in_specs[0].tensor_meta
    x = largs[0]
    if tuple(x.stride()) != tuple(m.stride) or x.storage_offset() != 0:
        x = torch.empty_strided(m.shape, m.stride, dtype=x.dtype, device=x.device).copy_(x)
    return op(x, *largs[1:], **lkwargs)


for _op in STRIDED:
    register_local_call(_op, _with_global_strides)


# ------------------------------------------------------------------ run whole
def _gathered(args, mesh_box):
    """args with every DTensor replaced by its full value (same structure, lists stay lists)."""
    t = type(args)
    if isinstance(args, DTensor):
        spec = args._spec
        if mesh_box and mesh_box[0] != spec.mesh:
            raise ShardingError("shardprop: DTensor arguments on different meshes")
        mesh_box[:] = [spec.mesh]
        if spec.is_replicated:
            return args._local_tensor
        return redistribute_local(args._local_tensor, spec, (R,) * spec.mesh.ndim)
    if t is list or t is tuple:
        return t(_gathered(a, mesh_box) for a in args)
    if isinstance(args, torch.Tensor) and args.dim() > 0 and not (
            joins_as_replicate(args, mesh_box[0], bool(_hooks.implicit_replication)) is True if mesh_box else same_on_every_rank(args)):
        raise plain_tensor_error(args)
    return args


def _wrap_replicated(res, mesh):
    if isinstance(res, torch.Tensor):
        spec = DTensorSpec(mesh, (R,) * mesh.ndim, TensorMeta(res.shape, res.stride(), res.dtype))
        return wrap(res, spec)
    if isinstance(res, (tuple, list)):
        return type(res)(_wrap_replicated(r, mesh) for r in res)
    return res


def run_whole(op, args, kwargs):
    """Gather every DTensor argument, run ``op`` on every rank, wrap tensor outputs as Replicate.

    Example:
        >>> run_whole(aten.nonzero.default, (x,), {})  # x a sharded DTensor  # doctest: +SKIP
    """
    mesh_box = []
    largs = _gathered(tuple(args), mesh_box)
    lkwargs = {k: _gathered(v, mesh_box) for k, v in (kwargs or {}).items()}
    return _wrap_replicated(op(*largs, **lkwargs), mesh_box[0])


for _op in _ops(RUN_WHOLE):
    register_special(_op, run_whole)


# ------------------------------------------------------------------ rrelu
def _rrelu_with_noise(op, args, kwargs):
    """``rrelu_with_noise(self, noise, ...)`` draws ``noise`` in place: run it on the full tensors on every
    rank (generators in step: what one process draws), then keep each rank's chunk of output and noise.

    Example:
        >>> torch.nn.functional.rrelu(x, training=True)  # x a DTensor  # doctest: +SKIP
    """
    x, noise = args[0], args[1]
    if not isinstance(x, DTensor):
        raise ShardingError(f"{op}: expected a DTensor input, got {type(x).__name__}")
    mesh = x._spec.mesh
    full_x = _gathered(x, [])
    full_noise = _gathered(noise, []).clone() if isinstance(noise, DTensor) else noise
    out = op(full_x, full_noise, *args[2:], **(kwargs or {}))
    if isinstance(noise, DTensor):
        noise._local_tensor.copy_(local_chunk(full_noise, mesh, noise._spec.placements))
    spec = DTensorSpec(mesh, x._spec.placements, TensorMeta(out.shape, out.stride(), out.dtype))
    return wrap(local_chunk(out, mesh, x._spec.placements), spec)


for _op in aten_ops(["rrelu_with_noise"], ("default",)):
    register_special(_op, _rrelu_with_noise)
