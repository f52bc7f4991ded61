"""The hand-written Megatron floors: tensor parallelism on plain local tensors, no DTensor.

``megatron_floor`` (no sequence parallelism) is shared by ``bench/tp.py --floor`` (eager contenders vs the floor) and ``bench/tp_compile.py``
(compiled contenders vs the floor). The demo's Llama (``shardprop.demo.model``) with its weights
pre-sliced for this rank (heads and hidden units split, output vocab split) and four
communication points: an all-reduce per row-parallel output in forward (``wo``, ``w2``), one
per block input in backward (attention and MLP inputs, the output projection's input), and an
all-gather of the logits. The embedding and norms stay replicated; no sequence parallelism. The
ranks are the default process group's (a 1-d tp mesh over all ranks).

``megatron_sp_floor`` is the same with sequence parallelism, communicating exactly as the demo's
``tp_plan`` does: the residual stream is this rank's piece of the sequence (dim 1); the embedding
is vocab-sharded and reduce-scattered onto the sequence; norms run on the local piece; attention
and the MLP all-gather the sequence on entry (reduce-scatter backward) and reduce-scatter their
row-parallel output onto it (all-gather backward); the output projection's input is gathered
and the logits all-gathered to full; the norm weights' gradients (partial sums over the
sequence pieces) are all-reduced in one flat buffer by ``model.sync_grads()`` after backward.

    >>> model = megatron_floor(LlamaConfig(), seed=0)  # inside an initialized process group  # doctest: +SKIP
    >>> model = megatron_sp_floor(LlamaConfig(), seed=0)  # doctest: +SKIP
    >>> lm_loss(model(tokens), targets).backward(); model.sync_grads()  # doctest: +SKIP
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["megatron_floor", "megatron_sp_floor"]

# torch 2.13 names the single-buffer collectives *_single (and warns on the old names).
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient backward (a block's input)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad)
        return grad


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward (a row-parallel output, in place); identity backward."""

    @staticmethod
    def forward(ctx, x):
        dist.all_reduce(x)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class _GatherLast(torch.autograd.Function):
    """All-gather along the last dim forward; this rank's slice of the gradient backward."""

    @staticmethod
    def forward(ctx, x):
        n, r = dist.get_world_size(), dist.get_rank()
        ctx.n, ctx.r, ctx.k = n, r, x.shape[-1]
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad.narrow(-1, ctx.r * ctx.k, ctx.k).contiguous()


def _keep_slice(mod, dim: int) -> None:
    """Replace ``mod.weight`` by this rank's even slice of it along ``dim`` (pre-sliced, as by hand)."""
    n, r = dist.get_world_size(), dist.get_rank()
    k = mod.weight.shape[dim] // n
    mod.weight = torch.nn.Parameter(mod.weight.detach().narrow(dim, r * k, k).clone())


def _keep_rows(mod) -> None:
    _keep_slice(mod, 0)


def _keep_cols(mod) -> None:
    _keep_slice(mod, 1)


def _slice_and_hook(model, block_in, row_out) -> None:
    """Megatron's layout on every block: q/k/v/w1/w3 and the output keep rows, wo/w2 columns; the
    block inputs and the output projection's input go through ``block_in``, the row-parallel
    outputs through ``row_out``, and the logits are all-gathered."""
    for layer in model.layers:
        att, ffn = layer.attention, layer.feed_forward
        for lin in (att.wq, att.wk, att.wv, ffn.w1, ffn.w3):
            _keep_rows(lin)
        for lin in (att.wo, ffn.w2):
            _keep_cols(lin)
            lin.register_forward_hook(row_out)
        att.register_forward_pre_hook(block_in)
        ffn.register_forward_pre_hook(block_in)
    _keep_rows(model.output)
    model.output.register_forward_pre_hook(block_in)
    model.output.register_forward_hook(lambda mod, args, out: _GatherLast.apply(out))


def megatron_floor(cfg, seed):
    """The single-process Llama with its weights pre-sliced for this rank and the four comm points hooked."""
    from shardprop.demo.model import Llama
    model = Llama(cfg, seed)

    def copy_in(mod, args):
        return (_CopyToTP.apply(args[0]),) + tuple(args[1:])

    def reduce_out(mod, args, out):
        return _ReduceFromTP.apply(out)

    _slice_and_hook(model, copy_in, reduce_out)
    return model


# ---------------------------------------------------------------- sequence parallelism (dim 1 of [B, S, D])
def _gather_seq(x):
    """[B, s, D] pieces of every rank -> [B, n*s, D]: one flat all-gather, one layout copy."""
    n = dist.get_world_size()
    b, s = x.shape[0], x.shape[1]
    flat = x.new_empty((n * b,) + tuple(x.shape[1:]))
    _all_gather_flat(flat, x.contiguous())
    return flat.view((n, b) + tuple(x.shape[1:])).transpose(0, 1).reshape((b, n * s) + tuple(x.shape[2:]))


def _scatter_seq(y):
    """Partial [B, S, D] -> this rank's summed [B, S/n, D]: one layout copy, one flat reduce-scatter."""
    n = dist.get_world_size()
    b, s = y.shape[0], y.shape[1] // n
    rest = tuple(y.shape[2:])
    stacked = y.reshape((b, n, s) + rest).transpose(0, 1).contiguous()
    out = y.new_empty((b, s) + rest)
    _reduce_scatter_flat(out, stacked.view((n * b, s) + rest))
    return out


class _GatherSeq(torch.autograd.Function):
    """All-gather on the sequence forward (a block's input); reduce-scatter of the gradient backward."""

    @staticmethod
    def forward(ctx, x):
        return _gather_seq(x)

    @staticmethod
    def backward(ctx, grad):
        return _scatter_seq(grad)


class _ScatterSeq(torch.autograd.Function):
    """Reduce-scatter onto the sequence forward (a row-parallel output); all-gather of the gradient backward."""

    @staticmethod
    def forward(ctx, y):
        return _scatter_seq(y)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad)


def megatron_sp_floor(cfg, seed):
    """The single-process Llama pre-sliced for this rank, with tp_plan's sequence-parallel communication.

    ``model.sync_grads()`` (after backward) all-reduces the norm weights' gradients in one buffer.
    """
    from shardprop.demo.model import Llama
    n, r = dist.get_world_size(), dist.get_rank()
    if cfg.seq_len % n or cfg.vocab_size % n:
        raise ValueError(f"megatron_sp_floor: seq_len {cfg.seq_len} and vocab_size {cfg.vocab_size} must be "
                         f"divisible by the {n} ranks")
    model = Llama(cfg, seed)

    def gather_in(mod, args):
        return (_GatherSeq.apply(args[0]),) + tuple(args[1:])

    def scatter_out(mod, args, out):
        return _ScatterSeq.apply(out)

    emb = model.tok_embeddings
    _keep_rows(emb)
    lo, k = r * emb.weight.shape[0], emb.weight.shape[0]

    def embed(tokens):  # the ids this rank holds, zeros elsewhere: a partial sum over ranks
        outside = (tokens < lo) | (tokens >= lo + k)
        y = F.embedding((tokens - lo).masked_fill(outside, 0), emb.weight)
        return _ScatterSeq.apply(y.masked_fill(outside.unsqueeze(-1), 0.0))

    emb.forward = embed
    _slice_and_hook(model, gather_in, scatter_out)
    norms = [m.weight for name, m in model.named_modules() if name.endswith("norm")]

    @torch.no_grad()
    def sync_grads():
        grads = [w.grad for w in norms if w.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        off = 0
        for g in grads:
            g.copy_(flat[off:off + g.numel()].view_as(g))
            off += g.numel()

    model.sync_grads = sync_grads
    return model
