"""Moving a DTensor to another mesh: ``dt.redistribute(other_mesh, placements)``.

The meshes may cover the same ranks (1-d 4 <-> 2x2), overlapping ones, or disjoint ones
(ranks 0-1 -> ranks 2-3: a pipeline hand-off, a train -> inference weight move). Each rank
sends exactly the overlap of its box with each target box (:func:`chunks.plan_transfers`,
the box arithmetic the DCP protocol also uses), point-to-point on the default group in one
``dist.batch_isend_irecv``; a piece a rank already holds is copied locally. Partial sources
are reduced on their own mesh first; a Partial target is made from the replicated value
locally (no communication).

Every rank of either mesh must call it with a DTensor of the source spec: on a rank outside the
source mesh that is what ``distribute_tensor``, ``DTensor.from_local`` or a factory over the source
mesh returns there (the global spec over an empty shard, as in torch); a rank in neither mesh does
nothing. Ranks outside the target mesh get a DTensor with an empty ``(0,)`` local tensor. Before
any data moves, all ranks of the move agree that each can take part (``handshake``): where one
cannot (its shard does not fit the spec, or it was asked for a different move), every rank raises
within one round trip instead of waiting for the collective timeout.

Autograd: when both meshes cover the same set of ranks, the gradient is moved back the same
way (every rank takes part in the backward, as in the forward). Between different rank sets
the backward raises: the ranks that only sent would never run it, so it cannot be collective.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from shardprop.checkpoint import handshake
from shardprop.checkpoint.chunks import narrow, plan_transfers, relative, shard_box
from shardprop.mesh import collectives as C
from shardprop.mesh.async_tensor import wait_all
from shardprop.tensor import conversions as _conv
from shardprop.tensor.dtensor import DTensor, make_spec
from shardprop.tensor.placement import Replicate, normalize_placements, without_partial
from shardprop.tensor.redistribute import redistribute_local


_no_partial = without_partial


def move_local(local, src_spec, dst_mesh, dst_placements) -> torch.Tensor:
    """This rank's shard of the tensor ``src_spec`` describes, laid out on ``dst_mesh`` as ``dst_placements``.

    ``local`` is this rank's source shard (ignored outside the source mesh). Returns the new
    shard (an empty ``(0,)`` tensor outside ``dst_mesh``, as torch gives ranks outside a mesh).
    Before any data moves, the ranks of both meshes agree that all of them can go ahead
    (:func:`handshake.agree`): a rank that cannot raises, and so does every other rank of the
    move, at once, instead of waiting for messages that will never come.

    Example:
        >>> local = move_local(dt.to_local(), dt._spec, mesh_23, (Shard(0),))  # doctest: +SKIP
    """
    src_mesh, shape, dtype = src_spec.mesh, tuple(src_spec.shape), src_spec.dtype
    src_placements = src_spec.placements
    in_src, in_dst = src_mesh._coord is not None, dst_mesh._coord is not None
    if not (in_src or in_dst):
        return torch.empty(0, dtype=dtype)
    problem = None
    try:
        device = _device_of(dst_mesh if not in_src else src_mesh)
        if in_src:
            local = wait_all(local)
            device = local.device
            _check_local(local, src_spec)
    except Exception as e:  # told to every rank of the move below, then raised here
        problem = e
    handshake.agree(src_mesh._flat + dst_mesh._flat, describe(src_spec, dst_mesh, dst_placements), problem, device)
    if in_src and src_spec.has_partial:  # the value must exist before pieces of it can move
        local = redistribute_local(local, src_spec, _no_partial(src_placements))
    src_placements = _no_partial(src_placements)
    target = _no_partial(dst_placements)
    me = dist.get_rank()
    mine_src = shard_box(shape, src_mesh.shape, src_mesh._coord, src_placements) if in_src else None
    mine_dst = shard_box(shape, dst_mesh.shape, dst_mesh._coord, target) if in_dst else None
    out = torch.empty(mine_dst[1] if in_dst else (0,), dtype=dtype, device=device)
    sends, recvs, received = [], [], []
    for tag, t in enumerate(plan_transfers(shape, src_mesh, src_placements, dst_mesh, target)):
        if t.src == me and t.dst == me:
            narrow(out, relative(t.box, mine_dst)).copy_(narrow(local, relative(t.box, mine_src)))
        elif t.src == me:
            sends.append((narrow(local, relative(t.box, mine_src)), t.dst, tag))
        elif t.dst == me:
            view = narrow(out, relative(t.box, mine_dst))
            direct = view.is_contiguous()  # receive in place when the piece is one run of memory
            buf = view if direct else torch.empty(t.box[1], dtype=dtype, device=device)
            recvs.append((buf, t.src, tag))
            if not direct:
                received.append((view, buf))
    # The two meshes share no process group: the messages travel on the default one.
    C.send_recv(sends, recvs, None, out)
    for view, buf in received:
        view.copy_(buf)
    if in_dst and tuple(dst_placements) != target:  # Replicate -> Partial is local
        spec = make_spec(dst_mesh, target, shape, None, dtype)
        out = redistribute_local(out, spec, tuple(dst_placements))
    return out


def _check_local(local: torch.Tensor, spec) -> None:
    """Raise where this rank's source shard does not fit the spec every rank of the move relies on."""
    want = shard_box(tuple(spec.shape), spec.mesh.shape, spec.mesh._coord, spec.placements)[1]
    if tuple(local.shape) != tuple(want) or local.dtype != spec.dtype:
        raise ValueError(f"redistribute to another mesh: rank {dist.get_rank()} holds a {local.dtype} shard of shape "
                         f"{tuple(local.shape)}, but {list(spec.placements)} of a {spec.dtype} tensor of shape "
                         f"{tuple(spec.shape)} on {spec.mesh} puts a {tuple(want)} shard there")


def describe(src_spec, dst_mesh, dst_placements) -> str:
    """The move as every rank of it must see it (compared by digest before any data moves).

    Example:
        >>> describe(x._spec, mesh_23, (Shard(0),))  # doctest: +SKIP
        '(8, 4) torch.float32 ranks (0, 1) [S(0)] -> ranks (2, 3) [S(0)]'
    """
    def where(mesh):
        return f"ranks {mesh._flat}" + (f" as {tuple(mesh.shape)}" if len(mesh.shape) > 1 else "")
    return (f"{tuple(src_spec.shape)} {src_spec.dtype} {where(src_spec.mesh)} {list(src_spec.placements)} -> "
            f"{where(dst_mesh)} {list(dst_placements)}")


@dataclass(frozen=True)
class RankList:
    """A 1-d target made of plain global ranks, with no process groups (point-to-point needs none).

    Enough of a mesh for :func:`move_local` and :func:`chunks.plan_transfers` (a Replicate or Shard
    target): ``RankList.of([0], "cpu")`` is "rank 0 alone", the target of a gather to one rank.
    """

    device_type: str
    _flat: Tuple[int, ...]
    _coord: Optional[Tuple[int]]

    @property
    def shape(self) -> Tuple[int]:
        return (len(self._flat),)

    @staticmethod
    def of(ranks, device_type: str) -> "RankList":
        """The ranks ``ranks`` (global), seen from this rank."""
        ranks = tuple(int(r) for r in ranks)
        me = dist.get_rank()
        return RankList(device_type, ranks, (ranks.index(me),) if me in ranks else None)


def _device_of(mesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _same_ranks(a, b) -> bool:
    return set(a._flat) == set(b._flat)


class CrossMesh(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dt, dst_mesh, dst_placements):
        src = dt._spec
        ctx.src, ctx.dst_mesh = src, dst_mesh
        local = move_local(dt._local_tensor, src, dst_mesh, dst_placements)
        spec = make_spec(dst_mesh, dst_placements, src.shape, src.tensor_meta.stride, src.dtype)
        return DTensor(local, spec, requires_grad=False)

    @staticmethod
    def backward(ctx, grad):
        src, dst_mesh = ctx.src, ctx.dst_mesh
        if not _same_ranks(src.mesh, dst_mesh):
            raise RuntimeError(
                f"redistribute to another mesh: no backward from {dst_mesh} to {src.mesh}, which hold different "
                "ranks (the ranks that only sent would never run it); detach() before moving, or move the "
                "gradient yourself with redistribute(other_mesh, ...)")
        _conv._check_partial_grad(src.placements, "cross-mesh redistribute backward")
        target = _conv.grad_placements_for(src.placements)
        local = move_local(grad._local_tensor, grad._spec, src.mesh, target)
        return DTensor(local, src.with_placements(target)), None, None


def redistribute_to_mesh(dt: DTensor, device_mesh, placements, async_op: bool = False) -> DTensor:
    """``dt`` laid out on another mesh (the hook ``DTensor.redistribute`` calls for a different mesh).

    ``async_op`` is accepted for symmetry and ignored: the move waits for its messages.

    Example:
        >>> y = x.redistribute(mesh_23, [Shard(0)])  # x lives on ranks 0-1; run on all 4 ranks  # doctest: +SKIP
    """
    src_mesh = dt._spec.mesh
    try:
        if placements is None:
            placements = [Replicate()] * device_mesh.ndim
        placements = normalize_placements(placements, dt.ndim, device_mesh.ndim, "redistribute")
        if device_mesh.device_type != src_mesh.device_type:
            raise ValueError(f"redistribute: cannot move from a {src_mesh.device_type} mesh to a "
                             f"{device_mesh.device_type} mesh")
    except Exception as e:
        if src_mesh._coord is not None or device_mesh._coord is not None:  # the others must not wait for us
            handshake.agree(src_mesh._flat + device_mesh._flat, "", e, _device_of(src_mesh))
        raise
    return CrossMesh.apply(dt, device_mesh, placements)

