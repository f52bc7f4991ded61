"""The probe transformer ``calibrate()`` trains on every mesh shape to fit the in-step costs.

A small pre-norm decoder (embedding, blocks of attention and a SwiGLU MLP, each behind an
RMSNorm, a final norm and an output Linear): the structure autoplan plans for, so a probe step
issues the collectives a real plan does (tensor-parallel region edges, sequence-parallel
norms, ``fully_shard`` units). It lives here, not in the demo, so the planner needs no model
package.

    >>> model, tokens, targets = probe_model(), *probe_batch(8, step=0)
    >>> tuple(model(tokens).shape)
    (8, 128, 512)
"""
from __future__ import annotations

from typing import Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["probe_model", "probe_batch", "probe_loss"]

DIM, LAYERS, HEADS, VOCAB, SEQ = 256, 2, 8, 512, 128


class _Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism each rank sees its own heads.
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        # Attention written out (scores, causal mask, softmax): its costs are the traced ops' own, where a fused
        # kernel's would be its flops at the matmul rate, which CPU kernels do not reach.
        scores = (q @ k.transpose(-2, -1)) / self.head_dim ** 0.5
        mask = torch.full((s, s), float("-inf"), device=x.device).triu(1)
        out = torch.softmax(scores + mask, dim=-1) @ v
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class _MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attention, self.feed_forward = _Attention(dim, heads), _MLP(dim, 3 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class _Decoder(nn.Module):
    def __init__(self, dim: int, layers: int, heads: int, vocab: int):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(_Block(dim, heads) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def probe_model(seed: int = 0) -> nn.Module:
    """The probe decoder (dim 256, 2 blocks, 8 heads, vocab 512), with weights from ``seed``."""
    torch.manual_seed(seed)
    return _Decoder(DIM, LAYERS, HEADS, VOCAB)


def probe_batch(batch: int, step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``batch`` sequences of 128 random tokens and their next-token targets (the same on every rank)."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def probe_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
