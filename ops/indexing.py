"""Indexing ops: index_select, gather, scatter, index_add/copy/fill/reduce, advanced indexing, take/put.

These ops read or write positions that an index tensor names with *global*
coordinates along the indexed dims, so a shard survives only where local and
global coordinates agree:

* a dim the op does not index (gather/scatter's other dims, index_add's other dims,
  the sliced dims of ``x[:, idx]``) is independent: every tensor that spans it
  (self, index, src, values) is sharded alike and the output keeps the shard. The
  sizes along it must be equal, or the chunks would not line up;
* the indexed dim of the input stays replicated (each rank needs every position an
  index may name);
* a lookup (index_select, gather on ``dim``, take, ``x[idx]``) with a replicated input
  may shard the index tensor: each rank looks up its own index chunk, which is the
  matching chunk of the output;
* a Partial input passes through a lookup (copying elements commutes with every
  reduction); sum-accumulating writes (scatter_add, index_add, index_put with
  accumulate, put with accumulate) are linear in (self, src) jointly, so ``P(sum)``
  on both gives ``P(sum)``; writes of a replicated value into an avg/max/min Partial
  leave that value on every rank, which the reduction keeps.

Bool (or uint8) mask indices make output shapes depend on data; they are turned into
the equivalent integer indices (``mask.nonzero().unbind(1)``) on replicated data before
propagation, so each rank gets the same integer index tensors.
"""
from __future__ import annotations

import torch

from shardprop.dispatch import dispatcher as _dispatch
from shardprop.dispatch import plain_tensors as _plain
from shardprop.dispatch.registry import rule
from shardprop.mesh.compat import aten_packets
from shardprop.tensor.dtensor import DTensor, make_spec
from shardprop.tensor.placement import Partial, Replicate, Shard
from shardprop.tensor.redistribute import redistribute_local
from shardprop.tensor.spec import DTensorSpec

from .args import arg, inputs_by_name

aten = torch.ops.aten
R = Replicate()
PSUM = Partial("sum")
ALL_PARTIALS = (Partial("sum"), Partial("avg"), Partial("max"), Partial("min"))
# Reductions that keep a value every rank writes whole (v, v, ..., v reduces to v).
REPEAT_PARTIALS = (Partial("avg"), Partial("max"), Partial("min"))
_MASK_DTYPES = (torch.bool, torch.uint8)


def _packets(*names):
    return aten_packets(names)


# ------------------------------------------------------------------ argument helpers
_arg = arg
_inputs = inputs_by_name


def _dim(ctx, ndim: int):
    """The op's ``dim`` normalized to [0, ndim) (0 for 0-dim tensors); None for a Dimname."""
    d = _arg(ctx, "dim")
    if type(d) is not int:
        return None
    return d % ndim if ndim else 0


def _is_spec(a) -> bool:
    return type(a) is DTensorSpec


def _replicate(ctx) -> tuple:
    return (_inputs(ctx), (R,))


def _bool(v) -> bool:
    """A bool argument as the schema carries it (a ``<True>``/``<False>`` marker or a default)."""
    return v is _dispatch._TRUE or v is True


# ------------------------------------------------------------------ lookups
@rule(*_packets("index_select"))
def index_select(ctx):
    x, index = ctx.args[0], _arg(ctx, "index")
    dim = _dim(ctx, x.ndim)
    if dim is None:
        return [_replicate(ctx)]
    opts = [(_inputs(ctx, self=Shard(d)), (Shard(d),)) for d in range(x.ndim) if d != dim]
    if _is_spec(index) and index.ndim == 1 and x.ndim >= 1:
        # Each rank selects its own index chunk: the matching chunk of the output's dim.
        opts.append((_inputs(ctx, index=Shard(0)), (Shard(dim),)))
    opts += [(_inputs(ctx, self=p), (p,)) for p in ALL_PARTIALS]
    opts.append(_replicate(ctx))
    return opts


@rule(*_packets("gather"))
def gather(ctx):
    x, index = ctx.args[0], _arg(ctx, "index")
    dim = _dim(ctx, x.ndim)
    if dim is None or not _is_spec(index):
        return [_replicate(ctx)]
    opts = []
    if x.ndim == index.ndim:
        # out[.., i, ..] reads self at the same position on every dim but ``dim``.
        opts += [(_inputs(ctx, self=Shard(d), index=Shard(d)), (Shard(d),))
                 for d in range(x.ndim) if d != dim and x.shape[d] == index.shape[d]]
    if index.ndim > dim:
        # Index values along ``dim`` are global and self is whole: any chunk of index rows works.
        opts.append((_inputs(ctx, index=Shard(dim)), (Shard(dim),)))
    opts += [(_inputs(ctx, self=p), (p,)) for p in ALL_PARTIALS]
    opts.append(_replicate(ctx))
    return opts


@rule(*_packets("take"))
def take(ctx):
    index = _arg(ctx, "index")
    opts = []
    if _is_spec(index):  # out[i] = self.flatten()[index[i]]: elementwise in index
        opts += [(_inputs(ctx, index=Shard(d)), (Shard(d),)) for d in range(index.ndim)]
    opts += [(_inputs(ctx, self=p), (p,)) for p in ALL_PARTIALS]
    opts.append(_replicate(ctx))
    return opts


# ------------------------------------------------------------------ scatter-like writes
SCATTER = _packets("scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_")


@rule(*SCATTER)
def scatter(ctx):
    x, index = ctx.args[0], _arg(ctx, "index")
    src = _arg(ctx, "src")
    if not _is_spec(x) or not _is_spec(index):  # a plain 0-dim self (max's backward on 2.11 makes one)
        return [_replicate(ctx)]
    dim = _dim(ctx, x.ndim)
    if dim is None:
        return [_replicate(ctx)]
    spans = [s for s in (x, index, src) if _is_spec(s)]
    opts = []
    if all(s.ndim == x.ndim for s in spans):
        # Writes land at the same position as the index entry on every dim but ``dim``.
        opts += [(_inputs(ctx, self=Shard(d), index=Shard(d), src=Shard(d)), (Shard(d),))
                 for d in range(x.ndim) if d != dim and len({s.shape[d] for s in spans}) == 1]
    name = ctx.op.overloadpacket.__name__.rstrip("_")
    reduce = _arg(ctx, "reduce")
    summing = name == "scatter_add" or (name == "scatter_reduce" and reduce == "sum")
    if summing and _is_spec(src):
        # self + sum of scattered src (or, without include_self, sum of src where written):
        # linear in (self, src) with index fixed.
        opts.append((_inputs(ctx, self=PSUM, src=PSUM), (PSUM,)))
    if name == "scatter" and reduce is None:
        # Plain overwrite with a replicated src/value: every rank writes the same values.
        opts += [(_inputs(ctx, self=p), (p,)) for p in REPEAT_PARTIALS]
    opts.append(_replicate(ctx))
    return opts


INDEX_WRITE = _packets("index_add", "index_add_", "index_copy", "index_copy_", "index_fill", "index_fill_",
                       "index_reduce", "index_reduce_")


@rule(*INDEX_WRITE)
def index_write(ctx):
    """index_add/copy/fill/reduce(self, dim, index, source|value): self[.., index[i], ..] op= source[.., i, ..]."""
    x = ctx.args[0]
    src = _arg(ctx, "source")
    dim = _dim(ctx, x.ndim)
    if dim is None:
        return [_replicate(ctx)]
    opts = []
    if not _is_spec(src) or src.ndim == x.ndim:
        opts += [(_inputs(ctx, self=Shard(d), source=Shard(d)), (Shard(d),))
                 for d in range(x.ndim) if d != dim and (not _is_spec(src) or src.shape[d] == x.shape[d])]
    name = ctx.op.overloadpacket.__name__.rstrip("_")
    if name == "index_add" and _is_spec(src):
        opts.append((_inputs(ctx, self=PSUM, source=PSUM), (PSUM,)))  # self + alpha * scatter(source)
    if name in ("index_copy", "index_fill"):
        opts += [(_inputs(ctx, self=p), (p,)) for p in REPEAT_PARTIALS]  # replicated value written whole
    opts.append(_replicate(ctx))
    return opts


# ------------------------------------------------------------------ advanced indexing
def _index_map(x_ndim: int, indices: tuple):
    """(self dim -> result dim for the dims no index tensor covers, result ndim), or None.

    ``indices`` as the rule sees it: one DTensorSpec (or None for a full slice) per
    leading dim. Integer index tensors broadcast together; their dims come first in the
    result when they are not adjacent, otherwise in place of the dims they index.

    Example:
        >>> _index_map(3, (None, idx_1d))  # x[:, idx]: dim 0 -> 0, dim 2 -> 2  # doctest: +SKIP
        ({0: 0, 2: 2}, 3)
    """
    pos, free, groups, bnd = 0, [], [], 0
    for j, t in enumerate(indices):
        if t is None:
            free.append(pos)
            pos += 1
        elif _is_spec(t):
            if t.dtype in _MASK_DTYPES:
                return None  # masks are converted to integer indices before propagation
            groups.append(j)
            bnd = max(bnd, t.ndim)
            pos += 1
        else:
            return None
    if pos > x_ndim:
        return None
    free += list(range(pos, x_ndim))
    if not groups:
        return {d: d for d in free}, x_ndim
    first = groups[0]  # dims before the first index tensor (each entry covers one dim)
    adjacent = groups == list(range(groups[0], groups[-1] + 1))
    mapping = {}
    for r, d in enumerate(free):
        if not adjacent:
            mapping[d] = bnd + r
        elif d < first:
            mapping[d] = d
        else:
            mapping[d] = d - len(groups) + bnd
    return mapping, len(free) + bnd


def _aligned(spec, out_shape, r: int):
    """The placement ``spec`` (broadcast against ``out_shape`` from the right) needs for out dim ``r`` sharded."""
    i = r - (len(out_shape) - spec.ndim)
    if i < 0 or spec.shape[i] != out_shape[r]:
        return R
    return Shard(i)


@rule(*_packets("index", "_unsafe_index"))
def index(ctx):
    x, indices = ctx.args[0], _arg(ctx, "indices")
    out = ctx.out_metas[0]
    m = _index_map(x.ndim, indices)
    if m is None or m[1] != len(out.shape):
        return [_replicate(ctx)]
    mapping, _ = m
    opts = [(_inputs(ctx, self=Shard(d)), (Shard(r),)) for d, r in mapping.items() if x.shape[d] == out.shape[r]]
    tensors = [t for t in indices if _is_spec(t)]
    if tensors and len({t.shape for t in tensors}) == 1:
        # Index tensors of one shape (no broadcasting) sharded alike, self whole: each rank
        # looks up its own index chunk, the matching chunk of the index dims of the result.
        groups = [j for j, t in enumerate(indices) if _is_spec(t)]
        adjacent = groups == list(range(groups[0], groups[-1] + 1))
        start = groups[0] if adjacent else 0
        opts += [(_inputs(ctx, indices=Shard(j)), (Shard(start + j),)) for j in range(tensors[0].ndim)]
    opts += [(_inputs(ctx, self=p), (p,)) for p in ALL_PARTIALS]
    opts.append(_replicate(ctx))
    return opts


@rule(*_packets("index_put", "index_put_", "_index_put_impl", "_index_put_impl_", "_unsafe_index_put"))
def index_put(ctx):
    x, indices, values = ctx.args[0], _arg(ctx, "indices"), _arg(ctx, "values")
    m = _index_map(x.ndim, indices)
    opts = []
    if m is not None:
        mapping, res_ndim = m
        for d, r in mapping.items():
            # values broadcast to self[indices] from the right; a broadcast (size-1 or
            # missing) dim of values is replicated, and so is a plain scalar.
            vp = R
            if _is_spec(values):
                i = r - (res_ndim - values.ndim)
                vp = R if i < 0 or values.shape[i] != x.shape[d] else Shard(i)
            opts.append((_inputs(ctx, self=Shard(d), values=vp), (Shard(d),)))
    if _bool(_arg(ctx, "accumulate")) and _is_spec(values):
        opts.append((_inputs(ctx, self=PSUM, values=PSUM), (PSUM,)))  # self + scatter-add(values): linear
    opts.append(_replicate(ctx))
    return opts


@rule(*_packets("put", "put_"))
def put(ctx):
    opts = []
    if _bool(_arg(ctx, "accumulate")) and _is_spec(_arg(ctx, "source")):
        opts.append((_inputs(ctx, self=PSUM, source=PSUM), (PSUM,)))
    opts.append(_replicate(ctx))
    return opts


@rule(*_packets("_unsafe_masked_index"))
def unsafe_masked_index(ctx):
    """where(mask, self[indices], fill): self's free dims shard with the result, mask aligned to it."""
    x, mask, indices = ctx.args[0], _arg(ctx, "mask"), _arg(ctx, "indices")
    out = ctx.out_metas[0]
    m = _index_map(x.ndim, indices)
    opts = []
    if m is not None and m[1] == len(out.shape) and _is_spec(mask):
        for d, r in m[0].items():
            if x.shape[d] == out.shape[r]:
                opts.append((_inputs(ctx, self=Shard(d), mask=_aligned(mask, out.shape, r)), (Shard(r),)))
    opts.append(_replicate(ctx))
    return opts


@rule(*_packets("_unsafe_masked_index_put_accumulate"))
def unsafe_masked_index_put_accumulate(ctx):
    """self.index_put(indices, values * mask, accumulate=True): linear in (self, values)."""
    opts = []
    if _is_spec(_arg(ctx, "values")):
        opts.append((_inputs(ctx, self=PSUM, values=PSUM), (PSUM,)))
    opts.append(_replicate(ctx))
    return opts


@rule(*_packets("masked_scatter", "masked_scatter_", "masked_scatter_backward"))
def masked_scatter(ctx):
    # source elements are consumed in mask order: where each lands depends on the whole mask.
    return [_replicate(ctx)]


# ------------------------------------------------------------------ mask indices
def _as_replicated(local: torch.Tensor, mesh) -> DTensor:
    return DTensor(local, make_spec(mesh, (R,) * mesh.ndim, local.shape, local.stride(), local.dtype))


def _mask_to_long(t, mesh) -> list:
    """A bool/uint8 index as the integer index tensors it stands for (same on every rank)."""
    if isinstance(t, DTensor):
        full = redistribute_local(t._local_tensor, t._spec, (R,) * mesh.ndim)
    else:
        full = t
    return [_as_replicated(c, mesh) for c in full.nonzero().unbind(1)]


def _index_with_masks(op, args, kwargs):
    """Special handler: bool/uint8 mask indices become integer ones, then the rule-based path."""
    kwargs = kwargs or {}
    in_kwargs = len(args) < 2
    indices = kwargs["indices"] if in_kwargs else args[1]
    if indices is None or not any(isinstance(t, torch.Tensor) and t.dtype in _MASK_DTYPES for t in indices):
        return _dispatch.run(op, args, kwargs)
    mesh = _plain.first_mesh((args, kwargs))
    new = []
    for t in indices:
        if isinstance(t, torch.Tensor) and t.dtype in _MASK_DTYPES:
            new += _mask_to_long(t, mesh)
        else:
            new.append(t)
    if in_kwargs:
        kwargs = {**kwargs, "indices": new}
    else:
        args = (args[0], new, *args[2:])
    return _dispatch.run(op, args, kwargs)


for _op in [aten.index.Tensor, aten._unsafe_index.Tensor, aten.index_put.default, aten.index_put_.default,
            aten._index_put_impl_.default, aten._unsafe_index_put.default]:
    _dispatch.register_special(_op, _index_with_masks)
