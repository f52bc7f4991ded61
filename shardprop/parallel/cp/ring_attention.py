"""Ring attention over one mesh dim: sequence-sharded q/k/v, key/value blocks travelling, exact result.

Each rank keeps its query rows. Forward, its key/value block (k and v packed in one flat buffer)
goes to the next rank of the mesh dim while the block in hand is computed, ``n`` steps in all;
the partial outputs merge by the log-sum-exp rule (:mod:`attention_blocks`). Backward, the ring
runs the other way: key/value blocks go to the previous rank and the gradient of each block
(``dk``/``dv``, accumulated in a flat buffer) travels with it, picking up every rank's
contribution, one last hop bringing it home. Messages are point to point
(:func:`shardprop.mesh.collectives.send_recv`: shared memory or gloo on CPU, the backend's
batched send/receive elsewhere), posted before the step's compute so they overlap it.

For short sequences one all-gather of the key/value blocks (and a reduce-scatter of their
gradients) beats ``n - 1`` round trips; :func:`attention_method` picks by a small cost model.

Example:
    >>> out = ring_attention(q, k, v, mesh, is_causal=True, balanced=True)  # doctest: +SKIP
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from shardprop.mesh import collectives
from shardprop.mesh import config as _config
from shardprop.mesh.config import values as _settings
from shardprop.parallel.cp.attention_blocks import accum_dtype, block_backward, block_forward, block_kind, merge_into

__all__ = ["RingPlan", "attention_method", "estimate_costs", "plan_for", "ring_attention", "set_rotate_method"]

METHODS = ("auto", "ring", "allgather")
# The cost model's machine: per-message latency, link bandwidth, attention compute rate. Rough CPU
# figures (gloo/shared memory on one host); they only decide which side of a crossover we are on.
LATENCY_S = 200e-6
BANDWIDTH_BPS = 2e9
FLOPS = 2e10
# Never all-gather more than this per rank (it holds every rank's keys/values at once).
ALLGATHER_MAX_BYTES = 8 << 20
_TAG_FWD, _TAG_BWD_KV, _TAG_BWD_GRAD = 0x2C000, 0x2D000, 0x2E000

def set_rotate_method(method: str) -> str:
    """Force ``"ring"`` or ``"allgather"`` for context-parallel attention, or ``"auto"`` (the cost model); returns the old one.

    Example:
        >>> old = set_rotate_method("ring"); set_rotate_method(old)
        'ring'
    """
    if method not in METHODS:
        raise ValueError(f"context_parallel: rotate method {method!r} is not one of {METHODS}")
    return _config.set("cp_rotate_method", method)


@dataclass(frozen=True)
class RingPlan:
    """Where the ring runs: the mesh (one dim), this rank's place, the global ranks, and the sequence layout."""

    mesh: object
    n: int
    rank: int
    ranks: Tuple[int, ...]
    balanced: bool

    @property
    def next(self) -> int:
        return self.ranks[(self.rank + 1) % self.n]

    @property
    def prev(self) -> int:
        return self.ranks[(self.rank - 1) % self.n]


def plan_for(mesh, balanced: bool) -> RingPlan:
    """The :class:`RingPlan` of this rank on a 1-D ``mesh``.

    Example:
        >>> plan_for(mesh["cp"], balanced=True).n  # doctest: +SKIP
        4
    """
    if mesh.ndim != 1:
        raise ValueError(f"context_parallel: the mesh must have one dim (pass mesh['cp']), got {mesh}")
    _, ranks, n = collectives.resolve(mesh, 0)
    return RingPlan(mesh, n, list(ranks).index(dist.get_rank()), tuple(ranks), balanced)


def estimate_costs(batch: int, heads: int, seq_local: int, head_dim: int, itemsize: int, n: int,
                   causal: bool) -> dict:
    """The cost model's seconds for ``"ring"`` and ``"allgather"`` (forward), for one rank.

    Ring: ``n - 1`` messages of this rank's keys/values, each hidden behind one block's compute
    except its latency. All-gather: one collective moving the same bytes, nothing hidden.

    Example:
        >>> c = estimate_costs(1, 8, 16, 64, 4, 4, True); c["allgather"] < c["ring"]  # tiny blocks: latency decides
        True
    """
    kv_bytes = 2 * batch * heads * seq_local * head_dim * itemsize
    block_s = 4 * batch * heads * seq_local * seq_local * head_dim / FLOPS * (0.5 if causal else 1.0)
    wire_s = kv_bytes / BANDWIDTH_BPS
    ring = (n - 1) * (LATENCY_S + max(wire_s - block_s, 0.0))
    gather = LATENCY_S + (n - 1) * wire_s
    return {"ring": ring, "allgather": gather, "kv_bytes": kv_bytes}


def attention_method(query: torch.Tensor, key: torch.Tensor, n: int, causal: bool = True) -> str:
    """``"ring"`` or ``"allgather"``: what context-parallel attention runs for these local shapes on ``n`` ranks.

    :func:`set_rotate_method` overrides the cost model (:func:`estimate_costs`); more than
    :data:`ALLGATHER_MAX_BYTES` gathered per rank always rings.

    Example:
        >>> attention_method(torch.empty(1, 8, 16, 64), torch.empty(1, 8, 16, 64), 4)
        'allgather'
        >>> attention_method(torch.empty(1, 8, 8192, 64), torch.empty(1, 8, 8192, 64), 4)
        'ring'
    """
    if _settings.cp_rotate_method != "auto":
        return _settings.cp_rotate_method
    b, h, s, d = (math.prod(key.shape[:-3]) if key.dim() > 3 else 1), key.shape[-3], key.shape[-2], key.shape[-1]
    costs = estimate_costs(b, h, s, d, key.element_size(), n, causal)
    if n * costs["kv_bytes"] > ALLGATHER_MAX_BYTES:
        return "ring"
    return "allgather" if costs["allgather"] < costs["ring"] else "ring"


# ------------------------------------------------------------------ one block pair by its kind
# Off the diagonal a balanced rank attends half a block pair: all its queries to the source's head
# chunk (kv_head), or its tail queries to both source chunks (q_tail). Both run as two c x c blocks,
# so every rank's kernels see the same shapes (as one 2c x c or c x 2c call the CPU kernel's speed
# differs by shape: measured 10-12% apart at c = 1024). (q rows, kv rows) of each piece:
_HALVES = {"kv_head": (("head", "head"), ("tail", "head")), "q_tail": (("tail", "head"), ("tail", "tail"))}


def _half(c: int, which: str) -> slice:
    return slice(None, c) if which == "head" else slice(c, None)


def _pieces(kind: str, c: int):
    """(query rows, key rows, causal) of each block call one block pair runs."""
    if kind in _HALVES:
        return [(_half(c, a), _half(c, b), False) for a, b in _HALVES[kind]]
    return [(slice(None), slice(None), kind == "causal")]


def _pair_forward(kind: str, q, k, v, scale: float):
    """[(row slice of the output, partial output, partial log-sum-exp)] of one block pair."""
    out = []
    for qs, ks, causal in _pieces(kind, q.shape[-2] // 2):
        out.append((qs, *block_forward(q[..., qs, :], k[..., ks, :], v[..., ks, :], causal, scale)))
    return out


def _pair_backward(kind: str, dout, q, k, v, out, lse, scale: float, dq, dk, dv) -> None:
    """Add one block pair's gradients into ``dq`` (this rank's rows) and ``dk``/``dv`` (the block's)."""
    for qs, ks, causal in _pieces(kind, q.shape[-2] // 2):
        g = block_backward(dout[..., qs, :], q[..., qs, :], k[..., ks, :], v[..., ks, :], out[..., qs, :],
                           lse[..., qs], causal, scale)
        dq[..., qs, :].add_(g[0]), dk[..., ks, :].add_(g[1]), dv[..., ks, :].add_(g[2])


def _pack(k, v) -> torch.Tensor:
    return torch.cat([k.reshape(-1), v.reshape(-1)])


def _unpack(flat, k_shape, v_shape):
    nk = math.prod(k_shape)
    return flat[:nk].view(k_shape), flat[nk:].view(v_shape)


def _exchange(send, to: int, recv_from: int, tag: int, plan: RingPlan):
    """Post ``send`` to ``to`` and a receive from ``recv_from``; an AsyncTensor of what arrives."""
    buf = torch.empty_like(send)
    return collectives.send_recv([(send, to, tag)], [(buf, recv_from, tag)], collectives.p2p_group(plan.mesh), buf,
                                 async_op=True)


# ------------------------------------------------------------------ forward and backward
def _forward(q, k, v, plan: RingPlan, causal: bool, scale: float, method: str):
    acc = accum_dtype(q.dtype)
    kv = _pack(k, v)
    gathered = collectives.all_gather(kv, plan.mesh, 0) if method == "allgather" and plan.n > 1 else None
    out = lse = None
    for step in range(plan.n):
        src = (plan.rank - step) % plan.n
        pending = None
        if gathered is not None:
            kv = gathered[src * kv.numel():(src + 1) * kv.numel()]
        elif step < plan.n - 1:
            pending = _exchange(kv, plan.next, plan.prev, _TAG_FWD + step, plan)
        kind = block_kind(plan.rank, src, causal, plan.balanced)
        if kind != "skip":
            kk, vv = _unpack(kv, k.shape, v.shape)
            for rows, b_out, b_lse in _pair_forward(kind, q, kk, vv, scale):
                if out is None:  # step 0: this rank's own block covers every row
                    out, lse = b_out.to(acc), b_lse
                else:
                    merge_into(out[..., rows, :], lse[..., rows], b_out, b_lse)
        if pending is not None:
            kv = pending.wait()
    return out.to(q.dtype), lse


def _backward(dout, q, k, v, out, lse, plan: RingPlan, causal: bool, scale: float, method: str):
    acc = accum_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = _pack(k, v)
    numel = kv.numel()
    gathered = collectives.all_gather(kv, plan.mesh, 0) if method == "allgather" and plan.n > 1 else None
    grads = torch.zeros((plan.n, numel), dtype=acc, device=q.device) if gathered is not None else None
    ring = gathered is None and plan.n > 1
    pending_grad = None
    g = None
    for step in range(plan.n):
        src = (plan.rank + step) % plan.n  # the other way round: blocks come from the next rank
        pending_kv = None
        if gathered is not None:
            kv, g = gathered[src * numel:(src + 1) * numel], grads[src]
        else:
            g = torch.zeros(numel, dtype=acc, device=q.device)
            if ring and step < plan.n - 1:
                pending_kv = _exchange(kv, plan.prev, plan.next, _TAG_BWD_KV + step, plan)
        kind = block_kind(plan.rank, src, causal, plan.balanced)
        if kind != "skip":
            kk, vv = _unpack(kv, k.shape, v.shape)
            dk, dv = _unpack(g, k.shape, v.shape)
            _pair_backward(kind, dout, q, kk, vv, out, lse, scale, dq, dk, dv)
        if ring:
            if pending_grad is not None:  # the block's gradient so far, from the ranks before
                g.add_(pending_grad.wait())
            pending_grad = _exchange(g, plan.prev, plan.next, _TAG_BWD_GRAD + step, plan)
        if pending_kv is not None:
            kv = pending_kv.wait()
    if gathered is not None:
        g = collectives.reduce_scatter(grads, plan.mesh, 0).reshape(-1)
    elif ring:
        g = pending_grad.wait()  # this rank's own block, every rank's contribution in it
    dk, dv = _unpack(g, k.shape, v.shape)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan, causal, scale, method):
        out, lse = _forward(q, k, v, plan, causal, scale, method)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (plan, causal, scale, method)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _backward(dout.contiguous(), q, k, v, out, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mesh, *, is_causal: bool = False,
                   scale: Optional[float] = None, balanced: bool = False, method: Optional[str] = None,
                   return_lse: bool = False):
    """Exact attention of sequence-sharded ``q``/``k``/``v`` ``[..., heads, seq_local, head_dim]`` over 1-D ``mesh``.

    Every rank holds the same number of positions: one contiguous chunk in rank order, or with
    ``balanced`` the chunks ``r`` and ``2n-1-r`` of ``2n`` (the layout :func:`context_parallel`
    gives its buffers). ``method``: ``"ring"``, ``"allgather"`` or None (:func:`attention_method`).
    Differentiable in ``q``, ``k``, ``v``; returns the local output (and its log-sum-exp with
    ``return_lse``).

    Example:
        >>> out = ring_attention(q, k, v, mesh["cp"], is_causal=True, balanced=True)  # doctest: +SKIP
    """
    plan = plan_for(mesh, balanced)
    if q.shape[-2] != k.shape[-2] or k.shape[-2] != v.shape[-2]:
        raise ValueError("context_parallel attention: query, key and value must hold the same local sequence length "
                         f"(got {q.shape[-2]}, {k.shape[-2]}, {v.shape[-2]})")
    if balanced and is_causal and q.shape[-2] % 2:
        raise ValueError(f"context_parallel attention: a load-balanced rank holds two equal chunks, but its local "
                         f"sequence length is {q.shape[-2]} (odd)")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    method = method or attention_method(q, k, plan.n, is_causal)
    out, lse = _RingAttention.apply(q, k, v, plan, bool(is_causal), float(scale), method)
    return (out, lse) if return_lse else out
