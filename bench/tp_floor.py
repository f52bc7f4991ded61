"""The hand-written Megatron floor: tensor parallelism on plain local tensors, no DTensor.

Shared by ``bench/tp.py --floor`` (eager contenders vs the floor) and ``bench/tp_compile.py``
(compiled contenders vs the floor). The demo's Llama (``shardprop.demo.model``) with its weights
pre-sliced for this rank (heads and hidden units split, output vocab split) and four
communication points: an all-reduce per row-parallel output in forward (``wo``, ``w2``), one
per block input in backward (attention and MLP inputs, the output projection's input), and an
all-gather of the logits. The embedding and norms stay replicated; no sequence parallelism. The
ranks are the default process group's (a 1-d tp mesh over all ranks).

    >>> model = megatron_floor(LlamaConfig(), seed=0)  # inside an initialized process group  # doctest: +SKIP
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["megatron_floor"]


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


def megatron_floor(cfg, seed):
    """The single-process Llama with its weights pre-sliced for this rank and the four comm points hooked."""
    from shardprop.demo.model import Llama
    n, r = dist.get_world_size(), dist.get_rank()
    model = Llama(cfg, seed)

    def rows(lin):
        k = lin.weight.shape[0] // n
        lin.weight = torch.nn.Parameter(lin.weight.detach()[r * k:(r + 1) * k].clone())

    def cols(lin):
        k = lin.weight.shape[1] // n
        lin.weight = torch.nn.Parameter(lin.weight.detach()[:, r * k:(r + 1) * k].clone())

    def copy_in(mod, args):
        return (_CopyToTP.apply(args[0]),) + tuple(args[1:])

    def reduce_out(mod, args, out):
        return _ReduceFromTP.apply(out)

    for layer in model.layers:
        att, ffn = layer.attention, layer.feed_forward
        for lin in (att.wq, att.wk, att.wv, ffn.w1, ffn.w3):
            rows(lin)
        for lin in (att.wo, ffn.w2):
            cols(lin)
            lin.register_forward_hook(reduce_out)
        att.register_forward_pre_hook(copy_in)
        ffn.register_forward_pre_hook(copy_in)
    rows(model.output)
    model.output.register_forward_pre_hook(copy_in)
    model.output.register_forward_hook(lambda mod, args, out: _GatherLast.apply(out))
    return model
