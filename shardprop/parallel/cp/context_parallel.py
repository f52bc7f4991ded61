"""``context_parallel``: sequence-shard buffers in place and run SDPA as ring attention, for a ``with`` block.

torch's ``torch.distributed.tensor.experimental.context_parallel`` with the same signature and
semantics, the way torchtitan uses it: the model stays a plain module; its sequence-carrying
buffers (token ids, labels, position tables) are cut to this rank's part of the sequence for the
duration of the block and restored after; every ``F.scaled_dot_product_attention`` inside runs
as ring attention over ``mesh`` (:mod:`ring_attention`) on the local, sequence-sharded q/k/v.

Layout: with ``2n`` chunks of the sequence (``n`` ranks), rank ``r`` holds chunks ``r`` and
``2n-1-r`` (load balanced, the default when the sequence divides by ``2n``: under a causal mask
every rank then does the same work), else the contiguous chunk ``r``. Uneven sequences are an
error.

How SDPA is intercepted: a ``TorchFunctionMode`` entered for the block. Modes are per thread, so
other threads' attention is untouched, and the mode leaves on exit, exceptions included. It sees
``F.scaled_dot_product_attention`` and direct calls of the aten SDPA ops; every other function
passes through unchanged (ring attention's own ops run below the mode).

Example:
    >>> with context_parallel(mesh["cp"], buffers=[tokens, labels], buffer_seq_dims=[1, 1]):  # doctest: +SKIP
    ...     loss = loss_fn(model(tokens), labels)
    ...     loss.backward()
"""
from __future__ import annotations

import contextlib
import sys
import threading
from typing import Iterator, List, Optional, Sequence, Set

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from shardprop.dispatch.hooks import hooks as _hooks
from shardprop.mesh import collectives, compat
from shardprop.parallel.cp.ring_attention import attention_method, estimate_costs, ring_attention
from shardprop.tensor.dtensor import DTensor
from shardprop.tensor.placement import Shard

__all__ = ["context_parallel", "context_parallel_shard", "context_parallel_unshard", "load_balanced"]

_SDPA = {F.scaled_dot_product_attention} | set(compat.aten_packets(["scaled_dot_product_attention"])) \
    | set(compat.aten_ops(["scaled_dot_product_attention"]))
_FLASH_CPU = set(compat.aten_packets(["_scaled_dot_product_flash_attention_for_cpu"])) \
    | set(compat.aten_ops(["_scaled_dot_product_flash_attention_for_cpu"]))
# SDPA kernels ring attention does not stand in for: inside the block they would silently attend
# only the local keys, so they raise.
_OTHER_KERNELS = ["_scaled_dot_product_attention_math", "_scaled_dot_product_efficient_attention",
                  "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention",
                  "_scaled_dot_product_fused_attention_overrideable", "_scaled_dot_product_attention_math_for_mps"]
_REFUSED = set(compat.aten_packets(_OTHER_KERNELS)) | set(compat.aten_ops(_OTHER_KERNELS))

_active = threading.local()


def load_balanced(seq_len: int, n: int) -> bool:
    """Whether a sequence of ``seq_len`` positions is laid out head+tail on ``n`` ranks (torch's rule: divides by ``2n``).

    Example:
        >>> load_balanced(4096, 4), load_balanced(4100, 4)
        (True, False)
    """
    return n > 1 and seq_len % (2 * n) == 0


def _rank_of(mesh) -> int:
    _, ranks, _ = collectives.resolve(mesh, 0)
    return list(ranks).index(dist.get_rank())


def _check_mesh(mesh) -> None:
    if mesh.ndim != 1:
        raise ValueError(f"context_parallel: the mesh must have one dim (pass e.g. mesh['cp']), got {mesh}")


def context_parallel_shard(t: torch.Tensor, mesh, seq_dim: int, load_balance: bool) -> torch.Tensor:
    """This rank's part of ``t`` along ``seq_dim`` (a new tensor): chunks ``r`` and ``2n-1-r`` of ``2n``, or chunk ``r`` of ``n``.

    Example:
        >>> context_parallel_shard(torch.arange(16), mesh, 0, True)  # rank 1 of 4  # doctest: +SKIP
        tensor([ 2,  3, 12, 13])
    """
    _check_mesh(mesh)
    n, r = mesh.size(), _rank_of(mesh)
    length = t.shape[seq_dim]
    pieces = 2 * n if load_balance else n
    if length % pieces:
        raise ValueError(f"context_parallel: a buffer of shape {tuple(t.shape)} has {length} positions on dim "
                         f"{seq_dim}, not divisible into {pieces} equal chunks for {n} ranks "
                         f"({'load balanced' if load_balance else 'contiguous'}); pad the sequence")
    c = length // pieces
    if not load_balance:
        return t.narrow(seq_dim, r * c, c).clone()
    return torch.cat([t.narrow(seq_dim, r * c, c), t.narrow(seq_dim, (pieces - 1 - r) * c, c)], dim=seq_dim)


@torch.no_grad()
def context_parallel_unshard(mesh, buffers: Sequence[torch.Tensor], seq_dims: Sequence[int],
                             load_balance: Optional[bool] = None) -> List[torch.Tensor]:
    """The whole sequence of each context-parallel-sharded tensor (in position order), on every rank.

    ``load_balance`` None: the layout :func:`context_parallel` picks for the full length. Not
    differentiable (as torch's): for inspecting outputs.

    Example:
        >>> mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("cp",))
        >>> x = torch.arange(16.).view(1, 16)
        >>> with context_parallel(mesh["cp"], buffers=[x], buffer_seq_dims=[1]):
        ...     out = x * 10                        # this rank's head and tail chunks
        >>> full, = context_parallel_unshard(mesh["cp"], [out], [1])
        >>> torch.equal(full, torch.arange(16.).view(1, 16) * 10)
        True
    """
    _check_mesh(mesh)
    n = mesh.size()
    out = []
    for t, d in zip(buffers, seq_dims):
        d = d % t.dim()
        balanced = load_balanced(t.shape[d] * n, n) if load_balance is None else load_balance
        g = collectives.all_gather(t.movedim(d, 0).contiguous(), mesh, 0).movedim(0, d)  # rank order
        if balanced and n > 1:
            chunks = g.split(t.shape[d] // 2, dim=d)  # rank r's head is piece 2r, its tail 2r+1
            g = torch.cat([chunks[2 * i] for i in range(n)] + [chunks[2 * (n - 1 - i) + 1] for i in range(n)], dim=d)
        out.append(g.clone())
    return out


def _eager(fn):
    """``fn``, run eagerly at a graph break when torch.compile traces it (the ring's messages are c10d
    calls on real tensors). Only once dynamo is loaded: without it nothing compiles, and shardprop
    must not import it (``torch.compiler.disable`` does)."""
    if "torch._dynamo" not in sys.modules:
        return fn
    return torch.compiler.disable(fn)


class _ContextParallelMode(TorchFunctionMode):
    """Runs SDPA as ring attention over ``mesh``; every other function unchanged."""

    def __init__(self, mesh, balanced: bool) -> None:
        super().__init__()
        self.mesh, self.balanced = mesh, balanced

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SDPA:
            return self._sdpa(*args, **kwargs)
        if func in _FLASH_CPU:
            return self._flash_cpu(*args, **kwargs)
        if func in _REFUSED:
            raise NotImplementedError(f"context_parallel: {func} on sequence-sharded tensors is not supported inside "
                                      "the context; call F.scaled_dot_product_attention")
        return func(*args, **kwargs)

    def _local(self, name: str, t):
        if not isinstance(t, DTensor):
            return t
        if t.device_mesh != self.mesh or tuple(t.placements) != (Shard(t.dim() - 2),):
            raise NotImplementedError(
                f"context_parallel: SDPA's {name} is a DTensor on {t.device_mesh} with {tuple(t.placements)}; inside "
                f"the context q/k/v must be plain local tensors or DTensors Shard({t.dim() - 2}) on the cp mesh")
        return t.to_local()

    def _ring(self, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse):
        if attn_mask is not None:
            raise NotImplementedError("context_parallel: SDPA with attn_mask is not supported (use is_causal=True)")
        if dropout_p:
            raise NotImplementedError(f"context_parallel: SDPA with dropout_p={dropout_p} is not supported")
        wrap = isinstance(query, DTensor)
        q, k, v = self._local("query", query), self._local("key", key), self._local("value", value)
        if enable_gqa and k.shape[-3] != q.shape[-3]:  # grouped-query: each key/value head serves a group
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
            v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
        method = attention_method(q, k, self.mesh.size(), is_causal)
        if _hooks.recorder is not None and hasattr(_hooks.recorder, "note"):  # inside explain()
            _hooks.recorder.note(self._describe(q, k, is_causal, method))
        res = ring_attention(q, k, v, self.mesh, is_causal=is_causal, scale=scale, balanced=self.balanced,
                             method=method, return_lse=return_lse)
        if wrap:
            out = res[0] if return_lse else res
            out = DTensor.from_local(out, self.mesh, (Shard(out.dim() - 2),))
            return (out, res[1]) if return_lse else out
        return res

    def _describe(self, q, k, causal: bool, method: str) -> str:
        n = self.mesh.size()
        b = 1
        for d in k.shape[:-3]:
            b *= d
        c = estimate_costs(b, k.shape[-3], k.shape[-2], k.shape[-1], k.element_size(), n, causal)
        layout = "head+tail" if self.balanced else "contiguous"
        return (f"context_parallel SDPA: q {tuple(q.shape)} k {tuple(k.shape)} local, {n} ranks, {layout}"
                f"{', causal' if causal else ''} -> {method} (cost model: ring {1e3 * c['ring']:.2f} ms, "
                f"allgather {1e3 * c['allgather']:.2f} ms, K/V {c['kv_bytes']} B per rank)")

    def _sdpa(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        return _eager(self._ring)(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, False)

    def _flash_cpu(self, query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
        return _eager(self._ring)(query, key, value, attn_mask, dropout_p, is_causal, scale, False, True)


class _RecomputeInMode:
    """Puts the context's mode back around module forwards that run inside backward.

    Autograd runs backward without the torch-function modes of the caller, so an
    activation-checkpoint recomputation inside the ``with`` block would run SDPA on the local
    sequence alone. While the context is open, global module hooks re-enter the mode for a
    module called from backward (a checkpointed block or sub-layer) and leave it after.
    A checkpointed plain function (not a module) is not covered.
    """

    def __init__(self, mesh, balanced: bool) -> None:
        self.mesh, self.balanced = mesh, balanced
        self._entered: List[tuple] = []  # (module, mode) entered by the pre-hook, innermost last
        self._handles = []

    def __enter__(self):
        from torch.nn.modules import module as nn_module
        self._handles = [nn_module.register_module_forward_pre_hook(self._pre),
                         nn_module.register_module_forward_hook(self._post, always_call=True)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        while self._entered:
            self._entered.pop()[1].__exit__(None, None, None)

    def _pre(self, module, args):
        if not compat.in_backward() or self._entered:
            return None  # not in backward, or the mode is already back on
        mode = _ContextParallelMode(self.mesh, self.balanced)
        mode.__enter__()
        self._entered.append((module, mode))
        return None

    def _post(self, module, args, output):
        if self._entered and self._entered[-1][0] is module:
            self._entered.pop()[1].__exit__(None, None, None)
        return None


@contextlib.contextmanager
def context_parallel(mesh, *, buffers: Optional[List[torch.Tensor]] = None,
                     buffer_seq_dims: Optional[List[int]] = None,
                     no_restore_buffers: Optional[Set[torch.Tensor]] = None,
                     load_balance: Optional[bool] = None) -> Iterator[None]:
    """Shard ``buffers`` on their sequence dims in place and run SDPA as ring attention over ``mesh`` until exit.

    Same arguments as torch's ``context_parallel``: ``buffers`` (not parameters) are resized to
    this rank's part of the sequence (their ``buffer_seq_dims``) and restored on exit, except
    those in ``no_restore_buffers``. ``load_balance`` (shardprop's; torch sets it globally):
    None lays the sequence out head+tail when the first buffer's length divides by ``2n``
    (:func:`load_balanced`), True/False force it (False: contiguous chunks). q/k/v reaching SDPA
    inside must be this layout: computed from the sharded buffers, as a model does.

    Example:
        >>> mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("cp",))
        >>> _ = torch.manual_seed(0)
        >>> q, k, v = (torch.randn(1, 2, 32, 8) for _ in range(3))   # [batch, heads, sequence, head dim]
        >>> expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        >>> with context_parallel(mesh["cp"], buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
        ...     print(q.shape)                                           # this rank's 8 of 32 positions
        ...     out = F.scaled_dot_product_attention(q, k, v, is_causal=True)   # ring attention
        torch.Size([1, 2, 8, 8])
        >>> q.shape                                                      # restored on exit
        torch.Size([1, 2, 32, 8])
        >>> torch.allclose(context_parallel_unshard(mesh["cp"], [out], [2])[0], expected, atol=1e-5)
        True

        A model's training step (tokens and labels stay cut: ``no_restore_buffers``):

        >>> with context_parallel(mesh["cp"], buffers=[tokens, labels, model.rope_cos],
        ...                       buffer_seq_dims=[1, 1, 0], no_restore_buffers={tokens, labels}):  # doctest: +SKIP
        ...     lm_loss(model(tokens), labels).backward()
    """
    _check_mesh(mesh)
    buffers = [] if buffers is None else list(buffers)
    seq_dims = [] if buffer_seq_dims is None else list(buffer_seq_dims)
    no_restore = set() if no_restore_buffers is None else no_restore_buffers
    if len(buffers) != len(seq_dims):
        raise ValueError(f"context_parallel: {len(buffers)} buffers but {len(seq_dims)} buffer_seq_dims")
    for b in no_restore:
        if not any(b is x for x in buffers):
            raise ValueError("context_parallel: no_restore_buffers must be a subset of buffers")
    if any(isinstance(b, torch.nn.Parameter) for b in buffers):
        raise ValueError("context_parallel: buffers must not contain parameters")
    if getattr(_active, "on", False):
        raise RuntimeError("context_parallel: already inside a context_parallel block on this thread")
    n = mesh.size()
    if load_balance is None:
        load_balance = bool(buffers) and load_balanced(buffers[0].shape[seq_dims[0]], n)
    shards = [context_parallel_shard(b, mesh, d, load_balance) for b, d in zip(buffers, seq_dims)]
    originals = [None if any(b is x for x in no_restore) else b.clone() for b in buffers]
    with torch.no_grad():
        for b, s in zip(buffers, shards):
            b.resize_(s.shape)
            b.copy_(s)
    del shards
    _active.on = True
    try:
        with _ContextParallelMode(mesh, load_balance), _RecomputeInMode(mesh, load_balance):
            yield
    finally:
        _active.on = False
        with torch.no_grad():
            for b, o in zip(buffers, originals):
                if o is not None:
                    b.resize_(o.shape)
                    b.copy_(o)
