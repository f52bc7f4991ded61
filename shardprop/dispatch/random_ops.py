"""Random ops on DTensors that reproduce a single-device run, on CPU and CUDA.

Scheme (simple and exact): every rank draws the *whole* global-shape tensor from
its default generator, then keeps its own chunk. Because all ranks start from
the same generator state (see :func:`manual_seed`) and consume the same number
of random values, their generators stay in step, replicas get identical values,
and each shard equals the matching slice of what one device draws for the same
global shape, strides and generator state. A TP run thus reproduces a
single-device run bit for bit.

Known limit: each rank draws the full tensor (time and a temporary of the global
size), not just its shard. That is fine for dropout masks of activations and
parameter init at the sizes shardprop targets; an offset-based generator (as
Philox offsets on CUDA would allow) would avoid it.

Only DTensors see global shapes. Two consequences: a plain local tensor (e.g. the
output of ``ColwiseParallel()`` with its default ``use_local_output=True``) gets a
mask drawn for its local shape only, so keep activations that go through dropout
as DTensors (``use_local_output=False``) to reproduce one device; and data-parallel
ranks holding different slices of a batch as separate tensors draw the *same*
mask for their different samples (their generators are in step), which does not
reproduce a single-device run over the whole batch unless dropout is off.

Dropout: on CPU ``F.dropout`` decomposes into ``empty_like``, ``bernoulli_``,
``div_`` and ``mul`` (all handled: ``bernoulli_`` here, the rest by the pointwise
rules). On CUDA it calls ``aten.native_dropout``, handled here like the CPU
kernel: ``mask = bernoulli(1 - p)`` drawn by the real kernel on the full shape,
``output = input * (mask * 1/(1-p))``. The mask is the same on every rank, so
dropout is linear in its input: a ``Partial(sum/avg)`` input stays ``Partial``
(as the CPU decomposition's ``mul`` rule also keeps it), saving an all-reduce;
the result then equals single device up to the rounding of the final sum.
On CUDA the mask is bit-identical (the fused kernel draws it); the output is
computed as on CPU and may differ from the fused kernel in the last bit for
half-precision inputs (untested here: no GPU on this machine).

Example:
    >>> mesh = init_device_mesh("cpu", (2,))  # doctest: +SKIP
    >>> shardprop.manual_seed(0, mesh)  # doctest: +SKIP
    >>> x = distribute_tensor(torch.ones(4, 6), mesh, [Shard(1)])  # doctest: +SKIP
    >>> torch.nn.functional.dropout(x, 0.5).full_tensor()  # == dropout of torch.ones(4, 6) after torch.manual_seed(0)  # doctest: +SKIP
"""
from __future__ import annotations

import torch

from shardprop.dispatch import dispatcher as _dispatch
from shardprop.mesh import collectives as C
from shardprop.tensor.dtensor import DTensor, local_chunk, make_spec
from shardprop.tensor.placement import Partial, Replicate, partial_fill, without_partial
from shardprop.tensor.redistribute import redistribute_local

aten = torch.ops.aten

# In-place ops that overwrite ``self`` with fresh random values (self's values are not read).
FILL_INPLACE = [
    aten.uniform_.default, aten.normal_.default, aten.exponential_.default, aten.cauchy_.default,
    aten.log_normal_.default, aten.geometric_.default, aten.random_.default, getattr(aten.random_, "from"),
    aten.random_.to, aten.bernoulli_.float, aten.bernoulli_.Tensor,
]
# Out-of-place ops whose output has ``self``'s shape and whose values ``self`` does not affect.
SHAPE_ONLY = [
    aten.rand_like.default, aten.rand_like.generator, aten.randn_like.default, aten.randn_like.generator,
    aten.randint_like.default, aten.randint_like.low_dtype, aten.randint_like.Tensor,
    aten.randint_like.generator, aten.randint_like.low_generator_dtype, aten.randint_like.Tensor_generator,
    aten.bernoulli.p,
]
# Out-of-place ops that read their tensor inputs' values (probabilities, means, rates).
VALUE_READING = [
    aten.bernoulli.default, aten.bernoulli.Tensor, aten.normal.Tensor_float, aten.normal.float_Tensor,
    aten.normal.Tensor_Tensor, aten.poisson.default, aten.binomial.default,
]


def manual_seed(seed: int, mesh) -> None:
    """Seed the default generator of ``mesh``'s device type with ``seed`` on every rank.

    Collective over the whole mesh: one small all-reduce checks that every rank
    passed the same seed, and raises on every rank if not (different seeds would
    silently make replicas diverge).

    Example:
        >>> mesh = init_device_mesh("cpu", (2, 2))
        >>> shardprop.manual_seed(1234, mesh)
        >>> x = shardprop.rand(8, device_mesh=mesh, placements=[Shard(0), Replicate()])
        >>> _ = torch.manual_seed(1234); torch.equal(x.full_tensor(), torch.rand(8))  # one device's draw
        True
    """
    seed = int(seed)
    if not 0 <= seed < 2 ** 64:
        raise ValueError(f"manual_seed: seed must be in [0, 2**64), got {seed}")
    if mesh._coord is None:
        raise RuntimeError(f"manual_seed: this rank is not in {mesh}")
    device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")
    lo, hi = seed & 0xFFFFFFFF, seed >> 32
    # max of (x, -x) per word: every rank holds x exactly when max == x and max(-x) == -x.
    mine = torch.tensor([lo, hi, -lo, -hi], dtype=torch.int64, device=device)
    seen = C.all_reduce(mine, mesh, tuple(range(mesh.ndim)), "max").tolist()
    if seen != mine.tolist():
        raise RuntimeError(f"manual_seed: ranks of {mesh} passed different seeds (this rank: {seed}); "
                           "every rank must pass the same seed")
    _seed_device_generator(seed, mesh)


def manual_seed_as_torch(seed: int, mesh) -> None:
    """``torch.distributed.tensor._random.manual_seed``'s semantics: seed this rank's generator, no cross-rank check.

    What the launcher gives programs written for torch. torch documents that its ``manual_seed`` does not check
    the seed, and trainers rely on it: with pipeline parallelism they pass the world mesh with a seed that differs
    per pipeline stage. The rank must be in ``mesh``, as torch requires.
    :func:`manual_seed` (shardprop's own name) checks that every rank passed the same seed.

    Example:
        >>> mesh = init_device_mesh("cpu", (2, 2))  # doctest: +SKIP
        >>> manual_seed_as_torch(1234 + stage, mesh)  # doctest: +SKIP
    """
    seed = int(seed) % 2 ** 64
    if mesh._coord is None:
        raise RuntimeError(f"manual_seed requires the current rank to be a part of the device mesh {mesh}")
    _seed_device_generator(seed, mesh)


def _seed_device_generator(seed: int, mesh) -> None:
    if mesh.device_type == "cuda":
        torch.cuda.manual_seed(seed)
    elif mesh.device_type == "cpu":
        torch.manual_seed(seed)
    else:
        getattr(torch, mesh.device_type).manual_seed(seed)


# ---------------------------------------------------------------- helpers
_no_partial = without_partial


def _empty_global(spec, device) -> torch.Tensor:
    """An uninitialised tensor of the global shape and strides (what one device would hold)."""
    m = spec.tensor_meta
    return torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device=device)


def _full(a: DTensor) -> torch.Tensor:
    """The global value of a DTensor argument (a gather; only for ops that read values)."""
    spec = a._spec
    if spec.is_replicated:
        return a._local_tensor
    return redistribute_local(a._local_tensor, spec, (Replicate(),) * spec.mesh.ndim)


def _plain(x, self_full=None, self_obj=None):
    """Replace DTensors in an argument by their global values (``self_obj`` by ``self_full``)."""
    if x is self_obj and self_full is not None:
        return self_full
    if isinstance(x, DTensor):
        return _full(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_plain(v, self_full, self_obj) for v in x)
    return x


def _wrap_chunk(full: torch.Tensor, mesh, placements) -> DTensor:
    spec = make_spec(mesh, placements, full.shape, full.stride(), full.dtype)
    return _dispatch.wrap(local_chunk(full, mesh, placements), spec)


def _first_dtensor(args, kwargs) -> DTensor:
    for a in list(args) + list((kwargs or {}).values()):
        if isinstance(a, DTensor):
            return a
    raise TypeError("shardprop.dispatch.random_ops: no DTensor argument")


# ---------------------------------------------------------------- handlers
def _fill_inplace(op, args, kwargs):
    """``self.uniform_(...)`` and friends: draw the full tensor, keep this rank's chunk."""
    self = args[0]
    spec = self._spec
    local = self._local_tensor
    full = _empty_global(spec, local.device)
    op(full, *[_plain(a) for a in args[1:]], **{k: _plain(v) for k, v in (kwargs or {}).items()})
    mesh = spec.mesh
    # A Partial(sum/product) tensor holds the value once: on index 0 of the mesh dim, zeros (ones) elsewhere.
    held = partial_fill(spec.placements, mesh._coord)
    if held is not None:
        local.fill_(held)
    else:
        local.copy_(local_chunk(full, mesh, spec.placements))
    return self


def _shape_only(op, args, kwargs):
    """``rand_like(self)`` and friends: same as on an uninitialised full tensor of self's layout."""
    self = args[0]
    spec = self._spec
    full = op(_empty_global(spec, self._local_tensor.device), *[_plain(a) for a in args[1:]],
              **{k: _plain(v) for k, v in (kwargs or {}).items()})
    return _wrap_chunk(full, spec.mesh, _no_partial(spec.placements))


def _value_reading(op, args, kwargs):
    """``bernoulli(probs)`` and friends: run on the global inputs, keep this rank's chunk."""
    first = _first_dtensor(args, kwargs)
    full = op(*[_plain(a) for a in args], **{k: _plain(v) for k, v in (kwargs or {}).items()})
    spec = first._spec
    placements = _no_partial(spec.placements) if full.shape == spec.shape else (Replicate(),) * spec.mesh.ndim
    return _wrap_chunk(full, spec.mesh, placements)


def _native_dropout(op, args, kwargs):
    """Dropout as aten's kernel does it, with the mask drawn on the full shape."""
    kwargs = kwargs or {}
    x = args[0]
    p = args[1] if len(args) > 1 else kwargs["p"]
    train = args[2] if len(args) > 2 else kwargs.get("train")
    spec = x._spec
    local = x._local_tensor
    # With one mask on every rank, dropout is linear in its input: Partial(sum/avg) passes
    # through (no all-reduce). Max/min partials are reduced first (kept simple and safe).
    placements = tuple(Replicate() if type(p) is Partial and p.reduce_op not in ("sum", "avg") else p
                       for p in spec.placements)
    if placements != spec.placements:
        local = redistribute_local(local, spec, placements)
    mesh = spec.mesh
    out_spec = make_spec(mesh, placements, spec.shape, spec.tensor_meta.stride, spec.dtype)
    mask_spec = make_spec(mesh, _no_partial(placements), spec.shape, spec.tensor_meta.stride, torch.bool)
    if train is False:  # no randomness: the input and an all-true mask
        return (_dispatch.wrap(local.clone(), out_spec),
                _dispatch.wrap(torch.ones_like(local, dtype=torch.bool), mask_spec))
    # The real kernel on a full-size tensor draws the mask exactly as one device would
    # (the mask does not depend on the input's values).
    zeros = _empty_global(spec, local.device).zero_()
    full_mask = op(zeros, p, train)[1]
    mask = local_chunk(full_mask, mesh, placements)  # local_chunk cuts Shard dims only
    keep = 1.0 - p
    scale = 0.0 if keep == 0 else 1.0 / keep
    # CPU kernel order: the mask in the input dtype, scaled (rounded once), then multiplied.
    out = local * mask.to(local.dtype).mul_(scale)
    return _dispatch.wrap(out, out_spec), _dispatch.wrap(mask, mask_spec)


def _register() -> None:
    for ops, handler in ((FILL_INPLACE, _fill_inplace), (SHAPE_ONLY, _shape_only),
                         (VALUE_READING, _value_reading), ([aten.native_dropout.default], _native_dropout)):
        for op in ops:
            _dispatch.register_special(op, handler)


_register()
