"""The eager fast path of SequenceParallel on torch's per-token norms: the norm on the local sequence piece.

``nn.LayerNorm`` and ``nn.RMSNorm`` (torch's own classes, not subclasses) normalize each
token on its own and draw no random numbers, so on a sequence-sharded input each rank can
run the norm on its local piece with the local (replicated) weights: no DTensor dispatch
per op. Parameters stay DTensor ``nn.Parameter``s: the local weight is taken through a
one-node autograd path (``grad_sync.ParamLocal``) whose backward hands the local weight
gradient (this rank's sum over its sequence piece, a ``Partial`` value) to the end-of-backward
all-reduce that makes ``param.grad`` ``Replicate`` (coalesced with the others). The output is
the ``Shard(seq)`` DTensor of the local result (``WrapLocal``, its spec cached per shape; or
the local result with ``use_local_output``), as the DTensor path gives. Under ``torch.compile``, for other module
types, when the sequence dim is a normalized dim, or with the fast paths switched off
(``shardprop.set_fast_paths(False)``, read at call time), the DTensor path runs. While ``explain()``
listens, each call is reported to it as a local norm.

Example:
    >>> parallelize_module(model, tp_mesh, {"norm": SequenceParallel()})  # doctest: +SKIP
    >>> model.norm(x_seq_piece)  # F.rms_norm on the local piece; weight grad Partial -> Replicate
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from shardprop.dispatch import fast_paths as _fast
from shardprop.parallel.fast.autograd_apply import direct_apply
from shardprop.parallel.fast.fused_linear import LocalOf, WrapLocal, on_mesh
from shardprop.parallel.fast.grad_sync import ParamLocal
from shardprop.tensor.dtensor import DTensor, make_spec
from shardprop.tensor.placement import Partial, Shard

_P = (Partial(),)
_KNOWN = (nn.LayerNorm, nn.RMSNorm)
_param_local = direct_apply(ParamLocal)
_local_of = direct_apply(LocalOf)
_wrap_local = direct_apply(WrapLocal)


class FusedNorm(_fast.FastPath):
    """A sequence-parallel norm's fast forward (a fast path, see ``FastPath``): mesh, sequence dim, output kind.

    ``forward(module, input)`` is installed as the module's ``forward`` via ``functools.partial``;
    ``engine(module, x)`` is the DTensor path.
    """

    _CACHES = ("_seq", "_out_spec")  # rebuilt on use (specs are per process)

    def __init__(self, mesh, sequence_dim: int, use_local_output: bool, hooked):
        super().__init__(hooked)
        self.mesh, self.sequence_dim, self.use_local = mesh, sequence_dim, use_local_output
        self._seq = {}
        self._out_spec = {}  # (global shape, dtype) -> the output's Shard(seq) spec (contiguous)

    def eligible(self, module, x):
        """(sequence placements, weight, bias), or None to take the DTensor path."""
        ndim = x.ndim
        seq = self._seq.get(ndim)
        if seq is None:
            d = self.sequence_dim + ndim if self.sequence_dim < 0 else self.sequence_dim
            seq = self._seq[ndim] = (Shard(d),) if 0 <= d < ndim - len(module.normalized_shape) else ()
        w, b = module.weight, getattr(module, "bias", None)
        if not seq or not on_mesh(self.mesh, w, b) or (isinstance(x, DTensor) and x._spec.mesh != self.mesh):
            # the sequence dim is normalized over, or plain parameters or ones off the style's mesh
            # (fully_shard's resharded parameters): the engine path, which errors clearly where it must
            return None
        return seq, w, b

    def describe(self, module, x, plan) -> tuple:
        have = x.placements if isinstance(x, DTensor) else plan[0]
        name = "rms_norm (local)" if type(module) is nn.RMSNorm else "layer_norm (local)"
        return name, "fast path: SequenceParallel norm", (have,), (0,)

    def local_forward(self, module, x, seq, w, b):
        """The norm on this rank's sequence piece; a Shard(seq) DTensor out (local with use_local_output)."""
        mesh = self.mesh
        if isinstance(x, DTensor):
            if x._spec.placements != seq:
                x = x.redistribute(placements=seq)
            shape = x._spec.shape
            xl = _local_of(x, x._spec) if x.requires_grad else x._local_tensor
        else:
            xl, shape = x, None
        wl = None if w is None else _param_local(w, w._spec.with_placements(_P))
        if type(module) is nn.RMSNorm:
            y = F.rms_norm(xl, module.normalized_shape, wl, module.eps)
        else:
            bl = None if b is None else _param_local(b, b._spec.with_placements(_P))
            y = F.layer_norm(xl, module.normalized_shape, wl, bl, module.eps)
        if self.use_local:
            return y
        if shape is None:  # a plain input is this rank's even piece of the sequence
            shape = list(y.shape)
            shape[seq[0].dim] *= mesh.size()
        if not y.is_contiguous():
            return DTensor.from_local(y, mesh, seq, shape=tuple(shape))
        key = (tuple(shape), y.dtype)
        spec = self._out_spec.get(key)
        if spec is None:
            if len(self._out_spec) >= 256:  # many shapes (varying sequence lengths): keep it bounded
                self._out_spec.clear()
            spec = self._out_spec[key] = make_spec(mesh, seq, shape, None, y.dtype)
        return _wrap_local(y, spec)


def install_norm(module: nn.Module, mesh, sequence_dim: int, use_local_output: bool, hooked) -> bool:
    """Give ``module`` the local-piece forward if it is exactly ``nn.LayerNorm`` or ``nn.RMSNorm``.

    Returns False (keep the DTensor hooks) for any other module, a subclass, or a module whose
    ``forward`` was replaced.

    Example:
        >>> install_norm(nn.RMSNorm(64), tp_mesh, 1, False, hooked)  # doctest: +SKIP
        True
    """
    if type(module) not in _KNOWN or "forward" in vars(module):
        return False
    fused = FusedNorm(mesh, sequence_dim, use_local_output, hooked)
    module.forward = functools.partial(fused.forward, module)
    return True


__all__ = ["FusedNorm", "install_norm"]


_fast.register("sp_norm", "shardprop.parallel.fast.fused_norm.FusedNorm",
               "SequenceParallel's DTensor hooks around LayerNorm/RMSNorm (the norm rules on Shard(seq))",
               ("SequenceParallel",))
