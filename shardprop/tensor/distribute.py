"""distribute_tensor: turn one rank's full tensor into a DTensor over a mesh."""
from __future__ import annotations

from typing import Optional

import torch

from shardprop.mesh import collectives as C
from shardprop.mesh.device_mesh import mesh_or_current
from shardprop.tensor import compile_support
from shardprop.tensor.dtensor import DTensor, local_chunk, make_spec
from shardprop.tensor.layout import chunk_bounds
from shardprop.tensor.placement import Replicate, Shard, _StridedShard, normalize_placements, partial_fill
from shardprop.tensor.strided import strided_positions


def distribute_tensor(tensor: torch.Tensor, device_mesh=None, placements=None, *,
                      src_data_rank: Optional[int] = 0) -> DTensor:
    """Distribute ``tensor`` over ``device_mesh`` (default: the mesh of the enclosing ``with mesh:``) with ``placements``.

    The data of the rank at flat index ``src_data_rank`` of the mesh (the global rank,
    for a mesh over all ranks in order; a sub-mesh's own first rank by default) is what
    every rank ends up with:
    it is scattered along Shard mesh dims and broadcast along the others, one
    mesh dim after another, so each rank receives only its own piece. With
    ``src_data_rank=None`` every rank cuts its shard from its own tensor.

    Example:
        >>> mesh = init_device_mesh("cpu", (4,))
        >>> x = distribute_tensor(torch.arange(8.), mesh, [Shard(0)])
        >>> x.to_local()  # on rank 0; rank 1 holds tensor([2., 3.])
        tensor([0., 1.])
    """
    if isinstance(tensor, DTensor):
        raise ValueError("distribute_tensor: the input already is a DTensor; use .redistribute()")
    mesh = mesh_or_current(device_mesh)
    if placements is None:
        placements = [Replicate()] * mesh.ndim
    placements = normalize_placements(placements, tensor.ndim, mesh.ndim, "distribute_tensor")
    if mesh._coord is None:  # as torch: an empty shard with the global spec, and no communication
        if src_data_rank is not None and not 0 <= src_data_rank < mesh.size():  # the members raise it too
            raise ValueError(f"distribute_tensor: src_data_rank {src_data_rank} is out of range for {mesh} "
                             f"({mesh.size()} ranks)")
        device = tensor.device if tensor.is_meta else _device_of(mesh)
        spec = make_spec(mesh, placements, tensor.shape, None, tensor.dtype)
        return DTensor(tensor.new_empty(0, device=device), spec, requires_grad=tensor.requires_grad)
    if tensor.is_meta:  # deferred init (build on meta, parallelize, to_empty): shapes only, no data to move
        local = local_chunk(tensor.detach(), mesh, placements)
        spec = make_spec(mesh, placements, tensor.shape, None, tensor.dtype)
        return DTensor(local, spec, requires_grad=tensor.requires_grad)
    full = tensor.detach().to(_device_of(mesh))
    if src_data_rank is not None and type(full) is not torch.Tensor and C.is_traced(full):
        # torch.compile: one functional broadcast of the source's tensor over the mesh, then each
        # rank cuts its shard (scatter has no traceable form).
        n = mesh.size()
        if not 0 <= src_data_rank < n:
            raise ValueError(f"distribute_tensor: src_data_rank {src_data_rank} is out of range for {mesh} ({n} ranks)")
        full = C.broadcast(full, mesh, tuple(range(mesh.ndim)), src=src_data_rank)
        local = local_chunk(full, mesh, placements)
    elif src_data_rank is None:
        local = local_chunk(full, mesh, placements)
    else:
        local = _from_source(full, mesh, placements, src_data_rank)
    # A replicated value as Partial: sum (product) keeps it on index 0 only, zeros (ones) elsewhere;
    # avg, max and min keep it everywhere.
    held = partial_fill(placements, mesh._coord)
    if held is not None:
        local = torch.full_like(local, held)
    spec = make_spec(mesh, placements, tensor.shape, None, tensor.dtype)
    return DTensor(local, spec, requires_grad=tensor.requires_grad)


def _device_of(mesh) -> torch.device:
    return torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")


def _from_source(full: torch.Tensor, mesh, placements, src: int) -> torch.Tensor:
    """Scatter/broadcast the source rank's data along each mesh dim in turn (outermost first)."""
    n = mesh.size()
    if not 0 <= src < n:
        raise ValueError(f"distribute_tensor: src_data_rank {src} is out of range for {mesh} ({n} ranks)")
    src_coord = []
    for size in reversed(mesh.shape):  # the mesh position of flat index src, row-major
        src_coord.append(src % size)
        src //= size
    src_coord.reverse()
    me = mesh._coord
    data = full.contiguous()
    for m, p in enumerate(placements):
        # After mesh dims < m, the ranks that agree with the source on dims >= m hold good data;
        # only the groups along m that contain such a rank need to move anything.
        k = mesh.shape[m]
        idle = k == 1 or any(me[j] != src_coord[j] for j in range(m + 1, mesh.ndim))
        if type(p) is _StridedShard:
            # Broadcast the parent, then each rank picks its runs: a scatter would need the
            # pieces packed by index first, and the parent is what this mesh dim splits anyway.
            if not idle:
                if me[m] != src_coord[m]:
                    data = torch.empty_like(data, memory_format=torch.contiguous_format)
                C.broadcast(data, mesh, (m,), src=src_coord[m])
            pos = strided_positions(data.shape[p.dim], k, p.split_factor, me[m])
            data = data.index_select(p.dim, torch.tensor(pos, dtype=torch.long, device=data.device))
            continue
        if idle:  # keep the shard's shape right; a later step overwrites the data
            if type(p) is Shard:
                off, ln = chunk_bounds(data.shape[p.dim], k, me[m])
                data = data.narrow(p.dim, off, ln).contiguous()
            continue
        if type(p) is Shard:
            d = p.dim
            n = data.shape[d]
            c = -(-n // k)
            out = data.new_empty(data.shape[:d] + (c,) + data.shape[d + 1:])
            chunks = None
            if me[m] == src_coord[m]:
                chunks = []
                for r in range(k):
                    off, ln = chunk_bounds(n, k, r)
                    piece = data.narrow(d, off, ln)
                    if ln < c:
                        padded = data.new_zeros(out.shape)
                        padded.narrow(d, 0, ln).copy_(piece)
                        piece = padded
                    chunks.append(piece)
            C.scatter(chunks, out, mesh, (m,), src=src_coord[m])
            _, ln = chunk_bounds(n, k, me[m])
            data = out.narrow(d, 0, ln).contiguous()
        else:
            if me[m] != src_coord[m]:  # receive into a fresh buffer, never into the caller's tensor
                data = torch.empty_like(data, memory_format=torch.contiguous_format)
            C.broadcast(data, mesh, (m,), src=src_coord[m])
    return data if data.data_ptr() != full.data_ptr() or data.numel() == 0 else data.clone()


# torch.compile records a call whole (it cannot trace a wrapper subclass's construction).
compile_support.allow_in_graph(distribute_tensor)
