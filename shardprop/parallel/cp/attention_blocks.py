"""Attention on one (query block, key/value block) pair, the log-sum-exp merge, and the causal schedule.

Ring attention computes a rank's output as a sequence of block attentions, one per key/value
block it sees, each giving a partial output ``o_b`` and the log-sum-exp ``l_b`` of its scores
per query row. Two partials merge exactly::

    l = logaddexp(l_a, l_b);   o = o_a * exp(l_a - l) + o_b * exp(l_b - l)

(written below with a sigmoid, which never overflows). The backward of one block needs only
the *final* output and log-sum-exp of its rows (``P = exp(S - l)``, ``D = rowsum(dO * O)``),
so the blocks' gradients are independent and simply add up.

On CPU the fused kernel (``_scaled_dot_product_flash_attention_for_cpu`` and its backward,
which take and return exactly these quantities) does each block without materialising the
score matrix; elsewhere (other devices, unusual shapes) a plain-torch version of the same
formulas runs.

The causal schedule (:func:`block_kind`) says which part of a block pair attends, for a rank
that holds either one contiguous chunk of the sequence or, load balanced, the head chunk ``r``
and the mirrored tail chunk ``2n-1-r`` of ``2n`` chunks:

- ``"causal"``: the rank's own keys (the diagonal block): causal over its local sequence,
  which is in increasing position order in both layouts;
- ``"full"``: every query row sees every key of the block;
- ``"kv_head"`` (balanced, source before us): every query sees the block's head chunk only;
- ``"q_tail"`` (balanced, source after us): only our tail-chunk queries see the whole block;
- ``"skip"`` (contiguous, source after us): nothing.

Balanced, every rank does the same work at every step (half a block pair off the diagonal).

Example:
    >>> q = k = v = torch.randn(1, 2, 4, 8, dtype=torch.float64)
    >>> o, l = block_forward(q, k, v, causal=True, scale=8 ** -0.5)
    >>> torch.allclose(o, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    True
"""
from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F

from shardprop.mesh import compat

__all__ = ["KINDS", "accum_dtype", "block_backward", "block_forward", "block_kind", "merge_into"]

KINDS = ("causal", "full", "kv_head", "q_tail", "skip")
_FUSED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def block_kind(rank: int, source: int, causal: bool, balanced: bool) -> str:
    """What rank ``rank``'s queries do with the key/value block of rank ``source`` (see the module doc).

    Example:
        >>> [block_kind(1, s, True, True) for s in range(4)]
        ['kv_head', 'causal', 'q_tail', 'q_tail']
    """
    if not causal:
        return "full"
    if source == rank:
        return "causal"
    if balanced:
        return "kv_head" if source < rank else "q_tail"
    return "full" if source < rank else "skip"


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype partial outputs and gradients accumulate in: float32 for half types, else ``dtype``.

    Example:
        >>> accum_dtype(torch.bfloat16)
        torch.float32
    """
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _fused(q: torch.Tensor, v: torch.Tensor) -> bool:
    return (compat.cpu_flash_attention is not None and q.device.type == "cpu" and q.dtype in _FUSED_DTYPES
            and q.shape[-1] == v.shape[-1])


def _scores(q, k, causal: bool, scale: float) -> torch.Tensor:
    s = torch.matmul(q.to(accum_dtype(q.dtype)), k.to(accum_dtype(q.dtype)).transpose(-2, -1)) * scale
    if causal:
        n_q, n_k = s.shape[-2], s.shape[-1]
        s = s.masked_fill(torch.ones(n_q, n_k, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` ``[..., Sq, D]`` over ``k``/``v`` ``[..., Sk, D]``: (output, log-sum-exp per row).

    ``causal`` masks top-left aligned (used only with ``Sq == Sk``). The output has ``q``'s dtype;
    the log-sum-exp is float32 (float64 for float64 inputs).

    Example:
        >>> o, l = block_forward(torch.ones(1, 1, 2, 4), torch.ones(1, 1, 3, 4), torch.ones(1, 1, 3, 4), False, 0.5)
        >>> l.shape
        torch.Size([1, 1, 2])
    """
    if _fused(q, v):
        out, lse = compat.cpu_flash_attention(q, k, v, 0.0, causal, attn_mask=None, scale=scale)
        return out, lse
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.to(s.dtype))
    return out.to(q.dtype), lse


def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, causal: bool, scale: float):
    """Gradients (dq, dk, dv) of one block, given the rows' *final* output and log-sum-exp.

    Example:
        >>> q = k = v = torch.randn(1, 1, 3, 4, dtype=torch.float64)
        >>> o, l = block_forward(q, k, v, False, 0.5)
        >>> [g.shape for g in block_backward(torch.ones_like(o), q, k, v, o, l, False, 0.5)][0]
        torch.Size([1, 1, 3, 4])
    """
    if _fused(q, v):
        return compat.cpu_flash_attention_backward(dout, q, k, v, out, lse, 0.0, causal, attn_mask=None, scale=scale)
    acc = accum_dtype(q.dtype)
    s = _scores(q, k, causal, scale)
    p = torch.exp(s - lse.to(acc).unsqueeze(-1))
    do = dout.to(acc)
    dv = torch.matmul(p.transpose(-2, -1), do)
    dp = torch.matmul(do, v.to(acc).transpose(-2, -1))
    ds = p * (dp - (do * out.to(acc)).sum(-1, keepdim=True))
    dq = torch.matmul(ds, k.to(acc)) * scale
    dk = torch.matmul(ds.transpose(-2, -1), q.to(acc)) * scale
    return dq, dk, dv


def merge_into(out: torch.Tensor, lse: torch.Tensor, blk_out: torch.Tensor, blk_lse: torch.Tensor) -> None:
    """Fold one block's partial (``blk_out``, ``blk_lse``) into the running (``out``, ``lse``), in place.

    ``out``/``lse`` may be views (rows of the running result); ``out`` is in the accumulation dtype.

    Example:
        >>> o, l = torch.zeros(1, 2), torch.tensor([0.0]); merge_into(o, l, torch.ones(1, 2), torch.tensor([0.0]))
        >>> o
        tensor([[0.5000, 0.5000]])
    """
    blk_lse = blk_lse.to(lse.dtype)
    w = torch.sigmoid(blk_lse - lse).unsqueeze(-1).to(out.dtype)
    out.sub_(w * (out - blk_out.to(out.dtype)))
    lse.sub_(F.logsigmoid(lse - blk_lse))
