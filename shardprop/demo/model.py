"""A small Llama-style transformer, its tensor-parallel plan, and a single-process reference run.

The model is written for tensor parallelism the way torchtitan's is: attention
reshapes with ``-1`` heads, so the same code runs on all heads (one process)
or on the local heads of a column-sharded ``wq``/``wk``/``wv`` (TP). Every op
is plain PyTorch; nothing here knows about meshes except :func:`tp_plan`.

    >>> cfg = LlamaConfig(dim=64, n_layers=2, n_heads=4, vocab_size=256, seq_len=32)
    >>> model = Llama(cfg, seed=0)
    >>> tokens, targets = synthetic_batch(cfg, batch=8, step=0, seed=0)
    >>> loss = lm_loss(model(tokens), targets)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["LlamaConfig", "Llama", "tp_plan", "cp_buffers", "synthetic_batch", "lm_loss", "make_optimizer", "reference_losses"]


@dataclass(frozen=True)
class LlamaConfig:
    """Model size. ``ffn_dim`` defaults to the Llama rule (2/3 of 4*dim, rounded up to ``multiple_of``)."""

    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    # Grouped-query attention (Llama 3: 8 kv heads for 64 query heads); None: one kv head per query head.
    n_kv_heads: Optional[int] = None
    vocab_size: int = 256
    seq_len: int = 32
    ffn_dim: Optional[int] = None
    multiple_of: int = 32
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Attention through F.scaled_dot_product_attention (is_causal) instead of matmul + mask + softmax:
    # what context parallelism intercepts (``--cp``), and no seq x seq mask buffer at long sequences.
    sdpa: bool = False

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def hidden_dim(self) -> int:
        if self.ffn_dim is not None:
            return self.ffn_dim
        h = int(2 * 4 * self.dim / 3)
        return self.multiple_of * ((h + self.multiple_of - 1) // self.multiple_of)


# torch's own RMSNorm: ``x * rsqrt(mean(x^2) + eps) * weight`` (the formula this model always used;
# state-dict key ``weight``). Being torch's class, a SequenceParallel style runs it on the local
# sequence piece without DTensor dispatch (shardprop.parallel.fast.fused_norm).
RMSNorm = nn.RMSNorm


def rope_tables(head_dim: int, seq_len: int, theta: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape ``[seq_len, head_dim]`` for the rotate-half form of RoPE (real-valued)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    ang = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv)
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().float(), ang.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (i, i + head_dim/2) pair of ``x`` ``[b, s, h, hd]`` by its position's angle."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    s = x.shape[1]
    # The tables are float32 buffers: cast them, so bf16 activations (mixed precision) stay bf16.
    cos, sin = cos[:s, None, :].to(x.dtype), sin[:s, None, :].to(x.dtype)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Causal multi-head attention with RoPE: matmul, additive mask, softmax, matmul."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.n_rep = cfg.n_heads // cfg.kv_heads  # query heads per kv head (local or global: the same ratio)
        kv_dim = cfg.kv_heads * cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, kv_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, kv_dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        cos, sin = rope_tables(cfg.head_dim, cfg.seq_len, cfg.rope_theta)
        # Not persistent and not parameters: tensor-parallel styles leave them alone (plain tensors
        # meet only the local q/k, which are plain tensors too under colwise wq/wk).
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.sdpa = cfg.sdpa
        if not cfg.sdpa:
            mask = torch.full((cfg.seq_len, cfg.seq_len), float("-inf")).triu(1)
            self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, x):
        b, s = x.shape[0], x.shape[1]
        # -1 heads: all heads on one process, the local heads under column-sharded projections.
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q = apply_rope(q, self.rope_cos, self.rope_sin).transpose(1, 2)
        k = apply_rope(k, self.rope_cos, self.rope_sin).transpose(1, 2)
        v = v.transpose(1, 2)
        if self.n_rep > 1:  # grouped-query attention: each kv head serves n_rep query heads
            k = k.repeat_interleave(self.n_rep, dim=1)
            v = v.repeat_interleave(self.n_rep, dim=1)
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.wo(y.transpose(1, 2).reshape(b, s, -1))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        scores = scores + self.causal_mask[:s, :s].to(scores.dtype)
        y = torch.softmax(scores, dim=-1) @ v
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Token embedding, ``n_layers`` blocks, final RMSNorm, output projection. Init is a function of ``seed``."""

    def __init__(self, cfg: LlamaConfig, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        if any(p.is_meta for p in self.parameters()):  # on the meta device (a dry run) there is nothing to fill
            return
        # A private generator, in definition order: every rank builds bit-identical weights
        # without touching the global RNG.
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                std = 0.02 if p.dim() > 1 and "embeddings" not in name else 1.0
                p.copy_(torch.randn(p.shape, generator=g) * std)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def tp_plan(P=None, *, loss_parallel: bool = False) -> dict:
    """The tensor-parallel plan (torchtitan style: Megatron TP plus sequence parallelism for norms).

    ``P`` is the namespace the styles and placements come from: ``shardprop`` (default) or
    the reference's styles (``bench/tp.py`` builds that namespace; product code never imports the reference). Activations between blocks are sharded on the
    sequence dim (``Shard(1)``); attention and the MLP gather them, compute on local heads /
    hidden units, and reduce-scatter back.

        >>> model = parallelize_module(Llama(cfg), mesh["tp"], tp_plan())  # doctest: +SKIP
    """
    if P is None:
        P = shardprop_styles()
    S1, R = P.Shard(1), P.Replicate()
    return {
        "tok_embeddings": P.RowwiseParallel(input_layouts=R, output_layouts=S1),
        "norm": P.SequenceParallel(),
        "output": P.ColwiseParallel(
            input_layouts=S1,
            output_layouts=P.Shard(-1) if loss_parallel else R,
            use_local_output=not loss_parallel,
        ),
        "layers.*.attention_norm": P.SequenceParallel(),
        "layers.*.attention": P.PrepareModuleInput(input_layouts=(S1,), desired_input_layouts=(R,)),
        "layers.*.attention.wq": P.ColwiseParallel(),
        "layers.*.attention.wk": P.ColwiseParallel(),
        "layers.*.attention.wv": P.ColwiseParallel(),
        "layers.*.attention.wo": P.RowwiseParallel(output_layouts=S1),
        "layers.*.ffn_norm": P.SequenceParallel(),
        "layers.*.feed_forward": P.PrepareModuleInput(input_layouts=(S1,), desired_input_layouts=(R,)),
        "layers.*.feed_forward.w1": P.ColwiseParallel(),
        "layers.*.feed_forward.w2": P.RowwiseParallel(output_layouts=S1),
        "layers.*.feed_forward.w3": P.ColwiseParallel(),
    }


def shardprop_styles() -> SimpleNamespace:
    """shardprop's styles and placements under the names :func:`tp_plan` uses."""
    import shardprop as ps
    return SimpleNamespace(Shard=ps.Shard, Replicate=ps.Replicate, ColwiseParallel=ps.ColwiseParallel,
                           RowwiseParallel=ps.RowwiseParallel, SequenceParallel=ps.SequenceParallel,
                           PrepareModuleInput=ps.PrepareModuleInput)


def cp_buffers(model: "Llama", *tensors: torch.Tensor) -> Tuple[List[torch.Tensor], List[int]]:
    """What context parallelism shards on the sequence dim: ``tensors`` ``[batch, seq]`` (dim 1) and every RoPE table (dim 0).

    Example:
        >>> buffers, dims = cp_buffers(model, tokens, targets)  # doctest: +SKIP
        >>> with shardprop.context_parallel(mesh, buffers=buffers, buffer_seq_dims=dims): ...  # doctest: +SKIP
    """
    tables = [b for name, b in model.named_buffers() if name.endswith(("rope_cos", "rope_sin"))]
    return list(tensors) + tables, [1] * len(tensors) + [0] * len(tables)


def synthetic_batch(cfg: LlamaConfig, batch: int, step: int, seed: int = 0):
    """Inputs and next-token targets ``[batch, seq_len]``: arithmetic sequences mod vocab (learnable).

    A function of (seed, step) only, so every rank builds the same global batch and a dp rank
    takes its rows.
    """
    g = torch.Generator().manual_seed(seed * 100003 + step)
    start = torch.randint(0, cfg.vocab_size, (batch, 1), generator=g)
    stride = torch.randint(1, 8, (batch, 1), generator=g)
    seq = (start + stride * torch.arange(cfg.seq_len + 1)) % cfg.vocab_size
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def lm_loss(logits, targets) -> torch.Tensor:
    """Mean next-token cross-entropy over every position."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def make_optimizer(name: str, params, lr: Optional[float] = None):
    """SGD or AdamW with the demo's settings; ``foreach=False`` keeps to per-tensor ops."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr or 0.1, foreach=False)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr or 1e-2, weight_decay=0.01, foreach=False)
    raise ValueError(f"unknown optimizer {name!r} (sgd, adamw)")


def reference_losses(cfg: LlamaConfig, steps: int, batch: int, seed: int = 0, optimizer: str = "adamw",
                     device: str = "cpu", on_step: Optional[Callable[[int, float], None]] = None,
                     lora: int = 0) -> List[float]:
    """Train the model on one process for ``steps`` steps; the per-step losses (the baseline TP must match).

    ``lora``: with LoRA adapters of that rank (``shardprop.demo.recipes.add_lora``), the rest frozen.

        >>> reference_losses(LlamaConfig(), steps=2, batch=4)  # doctest: +SKIP
        [5.61..., 5.52...]
    """
    model = Llama(cfg, seed)
    if lora:
        from shardprop.demo.recipes import add_lora
        add_lora(model, rank=lora)
    model = model.to(device)
    opt = make_optimizer(optimizer, model.parameters())
    losses = []
    for step in range(steps):
        tokens, targets = (t.to(device) for t in synthetic_batch(cfg, batch, step, seed))
        loss = lm_loss(model(tokens), targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, losses[-1])
    return losses
