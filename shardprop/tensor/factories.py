"""DTensor factories, as ``torch.distributed.tensor`` has them: ``zeros``, ``ones``, ``empty``,
``full``, ``rand``, ``randn``, ``linspace``, ``logspace``.

Each rank makes only its own shard (Shard pieces in ``torch.chunk`` order, uneven shapes
included); no rank builds the full tensor, and nothing is communicated.

Where shardprop differs from the reference, on purpose:

- ``rand``/``randn`` give each shard exactly the matching piece of what one device draws for the
  global shape after the same seed (``torch.manual_seed(s)`` on every rank, or
  ``shardprop.manual_seed(s, mesh)``), as shardprop's random ops do; replicas agree, shards differ,
  and the generator ends where one device's would. This works on CPU meshes too (the reference's
  raise ``AssertionError`` there). See ``shardprop.tensor.random_shards`` for how and at what cost.
- ``Partial`` placements hold the factory's value as their reduction, as ``distribute_tensor`` does:
  ``ones(4, placements=[Partial()])`` is ones (index 0 of the mesh dim holds them, the others zeros, or
  ones for ``product``; ``avg``/``max``/``min`` hold them everywhere). The reference fills every rank, so its sum is mesh-size.
- On a rank outside ``device_mesh`` every factory returns, as torch's do, the global spec over an
  empty local tensor (shape ``(0,)``); ``rand``/``randn`` draw nothing there (the generator of a rank
  outside stays where it was, as in torch, whose outside ranks skip the random kernel).
- ``linspace``/``logspace`` compute each point in float64 from its global index, with torch's
  two-sided formula (from ``start`` in the first half, from ``end`` in the second); values agree with
  ``torch.linspace`` to rounding, not always bit for bit (torch's vector kernel rounds differently).

Example:
    >>> mesh = init_device_mesh("cpu", (4,))  # doctest: +SKIP
    >>> w = shardprop.randn(10, 6, device_mesh=mesh, placements=[Shard(0)])  # doctest: +SKIP
    >>> w.to_local().shape  # rank 3 of 4 (torch.chunk: 3, 3, 3, 1)  # doctest: +SKIP
    torch.Size([1, 6])
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from shardprop.mesh.device_mesh import mesh_or_current
from shardprop.tensor import random_shards
from shardprop.tensor.dtensor import DTensor, make_spec
from shardprop.tensor.layout import local_shape_and_offset
from shardprop.tensor.placement import Replicate, normalize_placements, partial_fill

__all__ = ["zeros", "ones", "empty", "full", "rand", "randn", "linspace", "logspace"]


def _size(size) -> torch.Size:
    """``f(2, 3)``, ``f((2, 3))``, ``f([2, 3])`` and ``f(torch.Size(...))`` all name the shape (2, 3)."""
    if len(size) == 1 and isinstance(size[0], (list, tuple, torch.Size)):
        size = size[0]
    try:
        return torch.Size([int(s) for s in size])
    except (TypeError, ValueError):
        raise TypeError(f"expected a shape of ints, got {size!r}") from None


def _layout(name: str, size: torch.Size, device_mesh, placements, layout):
    """(mesh, placements, local shape, offset, device) for a factory call; checks the arguments."""
    if layout != torch.strided:
        raise ValueError(f"shardprop.{name}: layout {layout} is not supported; only torch.strided")
    if any(s < 0 for s in size):
        raise ValueError(f"shardprop.{name}: negative size in {tuple(size)}")
    mesh = mesh_or_current(device_mesh)  # torch's factories take the `with mesh:` mesh too
    if placements is None:
        placements = [Replicate()] * mesh.ndim
    placements = normalize_placements(placements, len(size), mesh.ndim, f"shardprop.{name}")
    if mesh._coord is None:  # as torch: the global spec over an empty shard (random ones draw nothing)
        shape, offset = (0,), (0,) * len(size)
    else:
        shape, offset = local_shape_and_offset(size, mesh.shape, mesh._coord, placements)
    device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device(mesh.device_type)
    return mesh, placements, shape, offset, device


def _holds_identity(mesh, placements):
    """This rank's part of a sum/product Partial value off index 0 (0 or 1; None: it holds the value)."""
    coord = mesh._coord
    return None if coord is None else partial_fill(placements, coord)


def _wrap(local: torch.Tensor, mesh, placements, size, requires_grad: bool) -> DTensor:
    spec = make_spec(mesh, placements, size, None, local.dtype)
    return DTensor(local, spec, requires_grad=requires_grad)


def _filled(name, size, fill, dtype, layout, requires_grad, device_mesh, placements) -> DTensor:
    size = _size(size)
    mesh, placements, shape, _, device = _layout(name, size, device_mesh, placements, layout)
    if fill is None:
        local = torch.empty(shape, dtype=dtype, device=device)
    elif name != "full":  # zeros/ones: the default dtype, where full infers one from the value
        held = _holds_identity(mesh, placements)
        local = (torch.zeros if (fill if held is None else held) == 0 else torch.ones)(shape, dtype=dtype, device=device)
    elif _holds_identity(mesh, placements) is not None:
        local = torch.full(shape, _holds_identity(mesh, placements), dtype=torch.full((), fill, dtype=dtype).dtype,
                           device=device)
    else:
        local = torch.full(shape, fill, dtype=dtype, device=device)
    return _wrap(local, mesh, placements, size, requires_grad)


def zeros(*size, requires_grad: bool = False, dtype: Optional[torch.dtype] = None, layout: torch.layout = torch.strided,
          device_mesh=None, placements: Optional[Sequence] = None) -> DTensor:
    """A DTensor of zeros of shape ``size`` (each rank makes only its shard).

    Example:
        >>> mesh = init_device_mesh("cpu", (4,))
        >>> z = shardprop.zeros(8, 4, device_mesh=mesh, placements=[Shard(0)])
        >>> z.to_local().shape  # 4 ranks
        torch.Size([2, 4])
    """
    return _filled("zeros", size, 0, dtype, layout, requires_grad, device_mesh, placements)


def ones(*size, dtype: Optional[torch.dtype] = None, layout: torch.layout = torch.strided, requires_grad: bool = False,
         device_mesh=None, placements: Optional[Sequence] = None) -> DTensor:
    """A DTensor of ones of shape ``size`` (each rank makes only its shard).

    Example:
        >>> mesh = init_device_mesh("cpu", (4,))
        >>> shardprop.ones(5, device_mesh=mesh, placements=[Shard(0)]).to_local()  # rank 0 of 4 (rank 2: one, rank 3: none)
        tensor([1., 1.])
    """
    return _filled("ones", size, 1, dtype, layout, requires_grad, device_mesh, placements)


def empty(*size, dtype: Optional[torch.dtype] = None, layout: torch.layout = torch.strided, requires_grad: bool = False,
          device_mesh=None, placements: Optional[Sequence] = None) -> DTensor:
    """An uninitialised DTensor of shape ``size`` (each rank allocates only its shard).

    Example:
        >>> mesh = init_device_mesh("cpu", (4,))
        >>> shardprop.empty(8, 4, device_mesh=mesh, placements=[Shard(1)]).to_local().shape
        torch.Size([8, 1])
    """
    return _filled("empty", size, None, dtype, layout, requires_grad, device_mesh, placements)


def full(size, fill_value, *, dtype: Optional[torch.dtype] = None, layout: torch.layout = torch.strided,
         requires_grad: bool = False, device_mesh=None, placements: Optional[Sequence] = None) -> DTensor:
    """A DTensor of shape ``size`` filled with ``fill_value`` (dtype inferred as ``torch.full`` does).

    Example:
        >>> mesh = init_device_mesh("cpu", (4,))
        >>> shardprop.full((4, 4), 7, device_mesh=mesh).dtype
        torch.int64
    """
    return _filled("full", (size,), fill_value, dtype, layout, requires_grad, device_mesh, placements)


def _random(name, kind, size, requires_grad, dtype, layout, device_mesh, placements) -> DTensor:
    size = _size(size)
    mesh, placements, shape, offset, device = _layout(name, size, device_mesh, placements, layout)
    dtype = dtype if dtype is not None else torch.get_default_dtype()
    if mesh._coord is None:  # torch's ranks outside the mesh draw nothing: their generators stay put
        return _wrap(torch.empty(shape, dtype=dtype, device=device), mesh, placements, size, requires_grad)
    local = random_shards.draw_shard(kind, size, offset, shape, dtype, device)
    held = _holds_identity(mesh, placements)
    if held is not None:
        local.fill_(held)
    return _wrap(local, mesh, placements, size, requires_grad)


def rand(*size, requires_grad: bool = False, dtype: Optional[torch.dtype] = None, layout: torch.layout = torch.strided,
         device_mesh=None, placements: Optional[Sequence] = None) -> DTensor:
    """A DTensor of uniform [0, 1) values: each shard is the matching piece of one device's ``torch.rand``.

    Seed every rank alike first (``torch.manual_seed`` or ``shardprop.manual_seed``). Works on CPU meshes.

    Example:
        >>> mesh = init_device_mesh("cpu", (4,))
        >>> _ = torch.manual_seed(0); x = shardprop.rand(8, 4, device_mesh=mesh, placements=[Shard(0)])
        >>> _ = torch.manual_seed(0); torch.equal(x.full_tensor(), torch.rand(8, 4))
        True
    """
    return _random("rand", "uniform", size, requires_grad, dtype, layout, device_mesh, placements)


def randn(*size, requires_grad: bool = False, dtype: Optional[torch.dtype] = None, layout: torch.layout = torch.strided,
          device_mesh=None, placements: Optional[Sequence] = None) -> DTensor:
    """A DTensor of standard normal values: each shard is the matching piece of one device's ``torch.randn``.

    Example:
        >>> mesh = init_device_mesh("cpu", (4,))
        >>> _ = torch.manual_seed(0); x = shardprop.randn(8, 4, device_mesh=mesh, placements=[Shard(1)])
        >>> _ = torch.manual_seed(0); torch.equal(x.full_tensor(), torch.randn(8, 4))
        True
    """
    return _random("randn", "normal", size, requires_grad, dtype, layout, device_mesh, placements)


def _scalar(name: str, v):
    if isinstance(v, torch.Tensor):
        if v.dim() != 0:
            raise ValueError(f"shardprop.{name}: start and end must be numbers or 0-dim tensors, got shape {tuple(v.shape)}")
        return v.item()
    return v


def _spaced(name, start, end, steps, base, dtype, layout, requires_grad, device_mesh, placements) -> DTensor:
    start, end, steps = _scalar(name, start), _scalar(name, end), int(steps)
    if steps < 0:
        raise ValueError(f"shardprop.{name}: number of steps must be non-negative, got {steps}")
    size = torch.Size([steps])
    mesh, placements, shape, offset, device = _layout(name, size, device_mesh, placements, layout)
    if dtype is None:  # what torch.linspace would choose for these arguments
        dtype = torch.linspace(start, end, 0).dtype
    cplx = dtype.is_complex or isinstance(start, complex) or isinstance(end, complex)
    work = torch.complex128 if cplx else torch.float64
    i = torch.arange(offset[0], offset[0] + shape[0], dtype=torch.float64, device=device)
    if steps == 1:
        x = torch.full(shape, start, dtype=work, device=device)
    else:
        step = (end - start) / (steps - 1)
        x = torch.where(i < steps // 2, start + step * i, end - step * (steps - 1 - i)).to(work)
    if base is not None:
        x = torch.pow(torch.tensor(base, dtype=work, device=device), x)
    local = x.to(dtype)
    held = _holds_identity(mesh, placements)
    if held is not None:
        local.fill_(held)
    return _wrap(local, mesh, placements, size, requires_grad)


def linspace(start, end, steps, *, dtype: Optional[torch.dtype] = None, layout: torch.layout = torch.strided,
             requires_grad: bool = False, device_mesh=None, placements: Optional[Sequence] = None) -> DTensor:
    """A 1-d DTensor of ``steps`` evenly spaced values from ``start`` to ``end`` (each rank computes its shard).

    Example:
        >>> mesh = init_device_mesh("cpu", (4,))
        >>> shardprop.linspace(0, 1, 5, device_mesh=mesh, placements=[Shard(0)]).full_tensor()
        tensor([0.0000, 0.2500, 0.5000, 0.7500, 1.0000])
    """
    return _spaced("linspace", start, end, steps, None, dtype, layout, requires_grad, device_mesh, placements)


def logspace(start, end, steps, base=10.0, *, dtype: Optional[torch.dtype] = None, layout: torch.layout = torch.strided,
             requires_grad: bool = False, device_mesh=None, placements: Optional[Sequence] = None) -> DTensor:
    """A 1-d DTensor of ``steps`` values from ``base ** start`` to ``base ** end`` on a log scale.

    Example:
        >>> mesh = init_device_mesh("cpu", (4,))
        >>> shardprop.logspace(0, 3, 4, device_mesh=mesh, placements=[Shard(0)]).full_tensor()
        tensor([   1.,   10.,  100., 1000.])
    """
    return _spaced("logspace", start, end, steps, base, dtype, layout, requires_grad, device_mesh, placements)
