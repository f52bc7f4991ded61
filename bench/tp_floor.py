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

Both take ``comm``, how every one of their collectives travels (chosen once, when the model is
built): ``"gloo"`` calls c10d's collectives on the default group (``dist.all_reduce``,
``dist.all_gather``, all-gather / reduce-scatter into one tensor); ``"shm"`` makes the same
collectives on the same plain tensors with shardprop's own CPU collectives
(``shardprop.mesh.collectives`` on a 1-d mesh over all ranks): direct messages through shared
memory between ranks of one host, the transport shardprop's DTensors use.

    >>> model = megatron_floor(LlamaConfig(), seed=0)  # inside an initialized process group  # doctest: +SKIP
    >>> model = megatron_sp_floor(LlamaConfig(), seed=0, comm="shm")  # doctest: +SKIP
    >>> lm_loss(model(tokens), targets).backward(); model.sync_grads()  # doctest: +SKIP
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardprop.mesh import compat

__all__ = ["megatron_floor", "megatron_sp_floor"]

# The single-buffer collectives under this torch's names (shardprop.mesh.compat resolves them).
_all_gather_flat = compat.all_gather_flat
_reduce_scatter_flat = compat.reduce_scatter_flat


class _GlooComm:
    """c10d's collectives on the default group (gloo on CPU), the calls the floor always made."""

    name = "gloo"

    def __init__(self):
        self.n, self.r = dist.get_world_size(), dist.get_rank()

    def all_reduce_(self, t):
        """Sum ``t`` (contiguous) over the ranks, in place."""
        dist.all_reduce(t)

    def gather_parts(self, x):
        """Every rank's ``x``, a list in rank order."""
        parts = [torch.empty_like(x) for _ in range(self.n)]
        dist.all_gather(parts, x.contiguous())
        return parts

    def gather_dim0(self, x):
        """Every rank's ``x`` stacked along dim 0 (one new tensor)."""
        flat = x.new_empty((self.n * x.shape[0],) + tuple(x.shape[1:]))
        _all_gather_flat(flat, x.contiguous())
        return flat

    def scatter_dim0(self, stacked):
        """This rank's dim-0 piece of ``stacked`` (contiguous) summed over the ranks."""
        out = stacked.new_empty((stacked.shape[0] // self.n,) + tuple(stacked.shape[1:]))
        _reduce_scatter_flat(out, stacked)
        return out


class _ShmComm(_GlooComm):
    """The same collectives through ``shardprop.mesh.collectives`` (shared memory within a host)."""

    name = "shm"

    def __init__(self):
        super().__init__()
        import shardprop
        from shardprop.mesh import collectives
        self.c = collectives
        self.mesh = shardprop.init_device_mesh("cpu", (self.n,))

    def all_reduce_(self, t):
        out = self.c.all_reduce(t, self.mesh, (0,), inplace=True)
        if out is not t:  # in place whenever t is contiguous; copy back otherwise
            t.copy_(out)

    def gather_parts(self, x):
        return self.gather_dim0(x).view((self.n,) + tuple(x.shape)).unbind(0)

    def gather_dim0(self, x):
        return self.c.all_gather(x, self.mesh, (0,))

    def scatter_dim0(self, stacked):
        return self.c.reduce_scatter(stacked, self.mesh, (0,))


_COMMS = {"gloo": _GlooComm, "shm": _ShmComm}


def _make_comm(comm: str):
    if comm not in _COMMS:
        raise ValueError(f"tp_floor: comm={comm!r} is not one of {sorted(_COMMS)}")
    return _COMMS[comm]()


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient backward (a block's input)."""

    @staticmethod
    def forward(ctx, comm, x):
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        ctx.comm.all_reduce_(grad)
        return None, grad


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward (a row-parallel output, in place); identity backward."""

    @staticmethod
    def forward(ctx, comm, x):
        comm.all_reduce_(x)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return None, grad


class _GatherLast(torch.autograd.Function):
    """All-gather along the last dim forward; this rank's slice of the gradient backward."""

    @staticmethod
    def forward(ctx, comm, x):
        ctx.r, ctx.k = comm.r, x.shape[-1]
        return torch.cat(comm.gather_parts(x), dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return None, grad.narrow(-1, ctx.r * ctx.k, ctx.k).contiguous()


def _keep_slice(mod, dim: int) -> None:
    """Replace ``mod.weight`` by this rank's even slice of it along ``dim`` (pre-sliced, as by hand)."""
    n, r = dist.get_world_size(), dist.get_rank()
    k = mod.weight.shape[dim] // n
    mod.weight = torch.nn.Parameter(mod.weight.detach().narrow(dim, r * k, k).clone())


def _keep_rows(mod) -> None:
    _keep_slice(mod, 0)


def _keep_cols(mod) -> None:
    _keep_slice(mod, 1)


def _slice_and_hook(model, comm, block_in, row_out) -> None:
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
    model.output.register_forward_hook(lambda mod, args, out: _GatherLast.apply(comm, out))


def megatron_floor(cfg, seed, comm="gloo"):
    """The single-process Llama with its weights pre-sliced for this rank and the four comm points hooked.

    ``comm``: ``"gloo"`` (c10d's collectives) or ``"shm"`` (shardprop's), see the module docstring.
    """
    from shardprop.demo.model import Llama
    comm = _make_comm(comm)
    model = Llama(cfg, seed)

    def copy_in(mod, args):
        return (_CopyToTP.apply(comm, args[0]),) + tuple(args[1:])

    def reduce_out(mod, args, out):
        return _ReduceFromTP.apply(comm, out)

    _slice_and_hook(model, comm, copy_in, reduce_out)
    return model


# ---------------------------------------------------------------- sequence parallelism (dim 1 of [B, S, D])
def _gather_seq(comm, x):
    """[B, s, D] pieces of every rank -> [B, n*s, D]: one flat all-gather, one layout copy."""
    n = comm.n
    b, s = x.shape[0], x.shape[1]
    flat = comm.gather_dim0(x)
    return flat.view((n, b) + tuple(x.shape[1:])).transpose(0, 1).reshape((b, n * s) + tuple(x.shape[2:]))


def _scatter_seq(comm, y):
    """Partial [B, S, D] -> this rank's summed [B, S/n, D]: one layout copy, one flat reduce-scatter."""
    n = comm.n
    b, s = y.shape[0], y.shape[1] // n
    rest = tuple(y.shape[2:])
    stacked = y.reshape((b, n, s) + rest).transpose(0, 1).contiguous()
    return comm.scatter_dim0(stacked.view((n * b, s) + rest))


class _SeqComm(torch.autograd.Function):
    """``forward_fn`` forward and ``backward_fn`` on the gradient (each of ``_gather_seq`` / ``_scatter_seq``).

    Gather on entry to a block (reduce-scatter backward); scatter of a row-parallel output (gather backward).
    """

    @staticmethod
    def forward(ctx, comm, forward_fn, backward_fn, x):
        ctx.comm, ctx.backward_fn = comm, backward_fn
        return forward_fn(comm, x)

    @staticmethod
    def backward(ctx, grad):
        return None, None, None, ctx.backward_fn(ctx.comm, grad)


def _gather_seq_op(comm, x):
    return _SeqComm.apply(comm, _gather_seq, _scatter_seq, x)


def _scatter_seq_op(comm, y):
    return _SeqComm.apply(comm, _scatter_seq, _gather_seq, y)


def megatron_sp_floor(cfg, seed, comm="gloo"):
    """The single-process Llama pre-sliced for this rank, with tp_plan's sequence-parallel communication.

    ``model.sync_grads()`` (after backward) all-reduces the norm weights' gradients in one buffer.
    ``comm``: ``"gloo"`` (c10d's collectives) or ``"shm"`` (shardprop's), see the module docstring.
    """
    from shardprop.demo.model import Llama
    n, r = dist.get_world_size(), dist.get_rank()
    if cfg.seq_len % n or cfg.vocab_size % n:
        raise ValueError(f"megatron_sp_floor: seq_len {cfg.seq_len} and vocab_size {cfg.vocab_size} must be "
                         f"divisible by the {n} ranks")
    comm = _make_comm(comm)
    model = Llama(cfg, seed)

    def gather_in(mod, args):
        return (_gather_seq_op(comm, args[0]),) + tuple(args[1:])

    def scatter_out(mod, args, out):
        return _scatter_seq_op(comm, out)

    emb = model.tok_embeddings
    _keep_rows(emb)
    lo, k = r * emb.weight.shape[0], emb.weight.shape[0]

    def embed(tokens):  # the ids this rank holds, zeros elsewhere: a partial sum over ranks
        outside = (tokens < lo) | (tokens >= lo + k)
        y = F.embedding((tokens - lo).masked_fill(outside, 0), emb.weight)
        return _scatter_seq_op(comm, y.masked_fill(outside.unsqueeze(-1), 0.0))

    emb.forward = embed
    _slice_and_hook(model, comm, gather_in, scatter_out)
    norms = [m.weight for name, m in model.named_modules() if name.endswith("norm")]

    @torch.no_grad()
    def sync_grads():
        grads = [w.grad for w in norms if w.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.all_reduce_(flat)
        off = 0
        for g in grads:
            g.copy_(flat[off:off + g.numel()].view_as(g))
            off += g.numel()

    model.sync_grads = sync_grads
    return model
