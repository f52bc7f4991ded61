"""The flat buffers of one fully_shard unit: where each parameter's shard and full copy live.

Every parameter of a unit gets a *slot* in these flat buffers:

* the **shard buffer** (the parameters' dtype, persistent): this rank's dp piece,
  padded to ``ceil(rows / dp)`` rows so that every rank's slot has the same size.
  The sharded DTensor parameter's local tensor is a view of it, so the optimizer
  updates it in place, and the buffer is the all-gather's input as it is;
* the **full buffer** (compute dtype, allocated per gather, freed by resizing its
  storage to 0; the full parameters are views of it that survive the freeing).
  Filled either straight by a coalesced all-gather whose outputs are the parameters'
  regions (rank ``r``'s piece lands in rows ``[r*chunk, (r+1)*chunk)``: no copy on
  NCCL), or by one copy from a flat all-gather of the shard buffers (:meth:`copy_out`;
  cheaper on gloo, whose coalesced all-gather copies anyway);
* the **packed gradients** ([dp, grad numel], reduce dtype, per backward): rank ``r``'s
  piece of every gradient in row ``r``, so one flat reduce-scatter leaves each rank a
  buffer laid out like the trainable prefix of its shard buffer (trainable slots come first
  there); the sharded gradients are views of it. Frozen parameters are not in it.

A parameter sharded on a dim other than 0 (2-D meshes, where tp already splits
dim 0) is gathered piece-major and rearranged by the copy; a ``REPLICATED`` slot
(a 1-d parameter tp already splits) holds the whole tensor on every dp rank.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional

import torch

from shardprop.tensor.dtensor import DTensor
from shardprop.tensor.layout import chunk_bounds
from shardprop.tensor.spec import DTensorSpec, TensorMeta

# ParamSlot.dim of a parameter kept whole on every dp rank (a column-parallel bias on 2-D meshes:
# tp already splits its only dim). Its slot holds the whole tensor; its gradient is averaged by
# packing it into every rank's row of the unit's one reduce-scatter.
REPLICATED = -1


@dataclass
class ParamSlot:
    """One parameter of a unit: its owner, its shapes and its offsets in the unit's flat buffers."""

    module: torch.nn.Module
    name: str
    fqn: str
    sharded: torch.nn.Parameter           # the DTensor parameter the optimizer sees
    full_shape: torch.Size                # the tensor the dp dim splits (global, or tp-local on 2-D)
    dim: int                              # the dim the dp mesh dim splits
    dp: int                               # dp size
    dp_index: int
    orig_dtype: torch.dtype
    requires_grad: bool
    shard_off: int = 0                    # offset of the slot in the shard / gradient buffers
    full_off: int = 0                     # offset of the region in the full buffer
    full_param: Optional[torch.Tensor] = None   # the leaf the module computes with
    local_view: Optional[torch.Tensor] = None   # this rank's piece, a view of the shard buffer
    tp_spec: object = None                # 2-D: spec of the tp-local full tensor as a DTensor on the tp mesh
    hooks: list = field(default_factory=list)
    # Mesh dims of ``tp_spec`` whose gradient placement is taken as it comes (dp_mesh_dims: the dp
    # dims, where a Partial gradient is this rank's contribution to the reduce-scatter).
    keep_dims: tuple = ()
    # Other (module, name) owners of the same parameter (tied weights in one unit): swapped along.
    aliases: list = field(default_factory=list)
    # spmd_types' parameters: the module computes on the plain tp-local piece, and its gradient is a
    # partial sum over these mesh dims of ``tp_spec`` (R-annotated model-parallel axes).
    plain_compute: bool = False
    grad_sum_dims: tuple = ()

    def owners(self):
        """Every (module, name) that registers this parameter."""
        return [(self.module, self.name)] + self.aliases

    @property
    def chunk(self) -> int:
        """Padded length of one rank's piece along ``dim``."""
        return -(-self.full_shape[self.dim] // self.dp)

    @property
    def local_len(self) -> Optional[int]:
        """Length of this rank's piece along ``dim`` (None: the whole tensor, for a replicated slot)."""
        if self.dim == REPLICATED:
            return None
        return chunk_bounds(self.full_shape[self.dim], self.dp, self.dp_index)[1]

    @property
    def piece_shape(self) -> torch.Size:
        """Shape of one rank's padded piece."""
        if self.dim == REPLICATED:
            return torch.Size(self.full_shape)
        s = list(self.full_shape)
        s[self.dim] = self.chunk
        return torch.Size(s)

    @property
    def slot_numel(self) -> int:
        return math.prod(self.piece_shape)

    @property
    def region_numel(self) -> int:
        return self.dp * self.slot_numel

    @property
    def gathered_shape(self) -> torch.Size:
        """Shape the all-gather writes: pieces stacked along dim 0."""
        s = list(self.piece_shape)
        s[0] *= self.dp
        return torch.Size(s)


class UnitBuffers:
    """The shard, full and gradient-shard buffers of one unit (see the module docstring).

    Example:
        >>> bufs = UnitBuffers(slots, compute_dtype, reduce_dtype)  # doctest: +SKIP
        >>> bufs.alloc_full(); outs, ins = bufs.gather_args(bufs.shard)  # doctest: +SKIP
    """

    def __init__(self, slots: List[ParamSlot], param_dtype: torch.dtype, compute_dtype: torch.dtype,
                 reduce_dtype: torch.dtype, device, shard_device=None, pin_memory: bool = False) -> None:
        self.slots = slots
        self.compute_dtype = compute_dtype
        self.reduce_dtype = reduce_dtype
        off = full = 0
        for s in slots:
            s.full_off = full
            full += s.region_numel if s.dim == 0 else math.prod(s.full_shape)
        # Trainable slots first in the shard layout: their gradients are then a prefix of it, and the
        # reduce-scatter carries that prefix alone (frozen parameters get no gradient and no traffic).
        for s in sorted(slots, key=lambda s: not s.requires_grad):
            s.shard_off = off
            off += s.slot_numel
        self.shard_numel, self.full_numel = off, full
        self.grad_numel = sum(s.slot_numel for s in slots if s.requires_grad)
        # The shard buffer lives on ``shard_device`` (the host, with CPUOffloadPolicy), the rest on ``device``.
        self.shard = torch.zeros(off, dtype=param_dtype, device=shard_device or device, pin_memory=pin_memory)
        # Allocated until fully_shard has made the full views (set_ checks bounds), then freed.
        self.full = torch.empty(full, dtype=compute_dtype, device=device)
        self.full_nbytes = full * self.full.element_size()

    # ---- shards --------------------------------------------------------------------
    def slot_view(self, s: ParamSlot, buf: torch.Tensor, length: Optional[int] = None) -> torch.Tensor:
        """``s``'s piece in a shard-shaped buffer: padded (``length=None``) or its first ``length`` rows."""
        piece = buf[s.shard_off:s.shard_off + s.slot_numel].view(s.piece_shape)
        return piece if length is None else piece.narrow(s.dim, 0, length)

    def hold_piece(self, s: ParamSlot, piece: torch.Tensor) -> torch.Tensor:
        """Make ``s``'s slot hold ``piece`` (this rank's piece, unpadded) and return the slot's view of it."""
        s.local_view = self.slot_view(s, self.shard, s.local_len)
        with torch.no_grad():
            s.local_view.copy_(piece)
        return s.local_view

    def full_param(self, s: ParamSlot) -> torch.nn.Parameter:
        """The leaf ``s``'s module computes with: a view of the full buffer (a DTensor on the tp mesh on 2-D)."""
        full = self.full_view(s)
        if s.tp_spec is None or s.plain_compute:
            return torch.nn.Parameter(full, requires_grad=s.requires_grad)
        t = s.tp_spec
        spec = DTensorSpec(t.mesh, t.placements, TensorMeta(t.shape, t.tensor_meta.stride, full.dtype))
        param = torch.nn.Parameter(DTensor(full, spec), requires_grad=s.requires_grad)
        param._local_tensor = full
        return param

    # ---- full buffer ----------------------------------------------------------------
    @property
    def full_allocated(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0

    def alloc_full(self) -> None:
        """Give the full buffer its memory back (views made earlier see the new memory)."""
        if not self.full_allocated:
            self.full.untyped_storage().resize_(self.full_nbytes)

    def free_full(self) -> None:
        """Free the full buffer; the full parameters keep their (now empty) storage for next time."""
        if self.full_allocated:
            self.full.untyped_storage().resize_(0)

    def full_view(self, s: ParamSlot) -> torch.Tensor:
        """A tensor over ``s``'s full parameter in the full buffer, with its own version counter.

        Its own counter matters: writing the next gather into the buffer must not look,
        to autograd, like an in-place change of the tensor saved for backward.
        """
        shape = s.full_shape
        stride = torch.empty(shape, device="meta").stride()
        t = torch.empty(0, dtype=self.compute_dtype, device=self.full.device)
        return t.set_(self.full.untyped_storage(), s.full_off, shape, stride)

    def gather_args(self, shard: torch.Tensor, staging: Optional[torch.Tensor]):
        """(outputs, inputs) of the unit's all-gather: per slot, the gathered region and this rank's piece."""
        outs, ins, soff = [], [], 0
        for s in self.slots:
            ins.append(self.slot_view(s, shard))
            if s.dim == 0:
                out = self.full[s.full_off:s.full_off + s.region_numel]
            else:
                out = staging[soff:soff + s.region_numel]
                soff += s.region_numel
            outs.append(out.view(s.gathered_shape))
        return outs, ins

    def copy_out(self, gathered: torch.Tensor) -> None:
        """Copy a flat all-gather of the shard buffers ([dp * shard numel], rank-major) into the full tensors."""
        rows = gathered.view(self.slots[0].dp, self.shard_numel)
        for s in self.slots:
            pieces = rows[:, s.shard_off:s.shard_off + s.slot_numel].view((s.dp,) + tuple(s.piece_shape))
            if s.dim == 0:
                dst = self.full[s.full_off:s.full_off + s.region_numel].view(pieces.shape)
                dst.copy_(pieces)
            elif s.dim == REPLICATED:
                self.full[s.full_off:s.full_off + math.prod(s.full_shape)].view(s.full_shape).copy_(pieces[0])
            else:  # piece r holds [r*chunk, (r+1)*chunk) along s.dim
                dst = self.full[s.full_off:s.full_off + math.prod(s.full_shape)]
                dst.view(s.full_shape[:s.dim] + (s.dp, s.chunk) + s.full_shape[s.dim + 1:]).copy_(
                    pieces.movedim(0, s.dim))

    def staging_numel(self) -> int:
        """Elements of the staging region needed by slots gathered on a dim other than 0."""
        return sum(s.region_numel for s in self.slots if s.dim != 0)

    def place_staged(self, staging: torch.Tensor) -> None:
        """Copy slots gathered piece-major (dim != 0) from the staging region into their full tensors."""
        soff = 0
        for s in self.slots:
            if s.dim == 0:
                continue
            pieces = staging[soff:soff + s.region_numel].view((s.dp,) + tuple(s.piece_shape))
            soff += s.region_numel
            dst = self.full[s.full_off:s.full_off + math.prod(s.full_shape)].view(s.full_shape)
            if s.dim == REPLICATED:
                dst.copy_(pieces[0])
                continue
            # piece r holds columns [r*chunk, (r+1)*chunk) along s.dim
            dst.view(s.full_shape[:s.dim] + (s.dp, s.chunk) + s.full_shape[s.dim + 1:]).copy_(
                pieces.movedim(0, s.dim))

    # ---- gradients ------------------------------------------------------------------
    def pack_gradient(self, s: ParamSlot, packed: torch.Tensor, grad: Optional[torch.Tensor]) -> None:
        """Copy ``grad`` (or zeros) of a trainable slot into the reduce-scatter input ``packed`` ([dp, grad numel]).

        Rank ``r``'s piece of every gradient goes to row ``r`` at the slot's offset, so one
        reduce-scatter of ``packed`` leaves each rank its pieces, laid out like the shard buffer.
        The copy also casts to the reduce dtype. (gloo's coalesced reduce-scatter, which would take
        the gradients as they are, is several times slower than one flat one.)
        """
        dst = packed[:, s.shard_off:s.shard_off + s.slot_numel].view((s.dp,) + tuple(s.piece_shape))
        if grad is None:
            dst.zero_()
        elif s.dim == REPLICATED:  # every row: the reduce-scatter then leaves each rank the average
            dst.copy_(grad.unsqueeze(0).expand(dst.shape))
        elif s.dim != 0:  # [.., dp*chunk, ..] -> [dp, .., chunk, ..]
            split = grad.reshape(s.full_shape[:s.dim] + (s.dp, s.chunk) + s.full_shape[s.dim + 1:])
            dst.copy_(split.movedim(s.dim, 0))
        else:
            rows, c = s.full_shape[0], s.chunk
            whole = rows // c  # ranks whose piece is complete
            if whole:
                dst[:whole].copy_(grad[:whole * c].view((whole, c) + tuple(s.full_shape[1:])))
            if whole < s.dp:  # the ragged piece, then empty ones
                left = rows - whole * c
                dst[whole, :left].copy_(grad[whole * c:])
                dst[whole, left:].zero_()
                dst[whole + 1:].zero_()
