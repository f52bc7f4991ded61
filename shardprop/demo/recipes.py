"""The pieces torchtitan's and torchtune's recipes add to a model: activation checkpointing and LoRA.

Both are plain torch (``torch.utils.checkpoint`` and ordinary modules), applied the way those
projects apply them: AC wraps each transformer block after tensor parallelism and before
``fully_shard``; LoRA replaces chosen linears by a frozen base plus trainable low-rank adapters
and freezes everything else. The demo, the recipes tests and ``bench/recipes.py`` share them.

    >>> model = Llama(cfg)                                  # doctest: +SKIP
    >>> add_lora(model, rank=4); apply_ac(model, "full")    # doctest: +SKIP
    >>> for block in model.layers: fully_shard(block, mesh=mesh)  # doctest: +SKIP
"""
from __future__ import annotations

import functools
import math
from typing import Dict, Iterable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

__all__ = ["AC_MODES", "apply_ac", "LoRALinear", "add_lora", "adapter_state_dict", "strip_wrapper_names"]

# full: checkpoint_wrapper-style non-reentrant AC of each block; reentrant: the same, reentrant;
# selective: non-reentrant with a policy that saves matmul outputs (torchtitan's "op" SAC);
# inner: torch.utils.checkpoint.checkpoint called inside each block's forward, per sub-layer.
AC_MODES = ("full", "reentrant", "selective", "inner")

_SAVE = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)


def _save_matmuls(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE


class Checkpointed(nn.Module):
    """A sub-layer run under ``torch.utils.checkpoint.checkpoint`` from its parent's forward.

    The wrapped module is the child ``inner``, so its parameters are named ``inner.*``
    (:func:`strip_wrapper_names` maps them back).
    """

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)


def apply_ac(model: nn.Module, mode: Optional[str], context_fn=None) -> nn.Module:
    """Checkpoint each block of ``model.layers`` as ``mode`` says (None: nothing); returns ``model``.

    ``inner`` checkpoints the attention and feed-forward sub-layers inside each block's own
    forward (the block stays the unit ``fully_shard`` sees); the other modes wrap the block.
    ``selective`` takes ``context_fn`` (a new pair of selective-checkpoint contexts per call, as
    ``torch.utils.checkpoint`` wants) or saves matmul outputs by default.

    Example:
        >>> apply_ac(model, "selective")  # doctest: +SKIP
    """
    if mode is None:
        return model
    if mode not in AC_MODES:
        raise ValueError(f"activation checkpointing mode {mode!r}: expected one of {AC_MODES}")
    # torch's own wrapper, as torchtitan and torchtune use it (not the reference DTensor stack).
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
    for i, block in enumerate(model.layers):
        if mode == "inner":
            block.attention = Checkpointed(block.attention)
            block.feed_forward = Checkpointed(block.feed_forward)
        elif mode == "reentrant":
            model.layers[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.REENTRANT)
        elif mode == "selective":
            ctx = context_fn or functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
            model.layers[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, context_fn=ctx)
        else:
            model.layers[i] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    return model


def strip_wrapper_names(name: str) -> str:
    """A parameter name without what the AC wrappers and ``torch.compile`` add to it."""
    for part in ("inner.", "_checkpoint_wrapped_module.", "_orig_mod."):
        name = name.replace(part, "")
    return name


class LoRALinear(nn.Module):
    """``base(x) + scale * B(A(x))`` with ``base`` frozen; ``B`` starts at zero, so the output starts as ``base``'s."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float = 16.0, seed: int = 0) -> None:
        super().__init__()
        self.base = base
        self.base.weight.requires_grad_(False)
        if self.base.bias is not None:
            self.base.bias.requires_grad_(False)
        g = torch.Generator().manual_seed(seed)
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features, generator=g) / math.sqrt(base.in_features))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))
        self.scale = alpha / rank

    def forward(self, x):
        return self.base(x) + self.scale * F.linear(F.linear(x, self.lora_a), self.lora_b)


def add_lora(model: nn.Module, rank: int = 4, targets: Iterable[str] = ("wq", "wv")) -> nn.Module:
    """torchtune's LoRA: adapters on the attention's ``targets``, every other parameter frozen.

    Example:
        >>> add_lora(model, rank=8)  # doctest: +SKIP
        >>> [n for n, p in model.named_parameters() if p.requires_grad][:2]  # doctest: +SKIP
        ['layers.0.attention.wq.lora_a', 'layers.0.attention.wq.lora_b']
    """
    for p in model.parameters():
        p.requires_grad_(False)
    for i, block in enumerate(model.layers):
        for t in targets:
            setattr(block.attention, t, LoRALinear(getattr(block.attention, t), rank, seed=100 + i))
    return model


def adapter_state_dict(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The adapters of a state dict (torchtune's adapter-only checkpoint)."""
    return {k: v for k, v in state.items() if "lora_" in k}
