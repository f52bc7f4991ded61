"""MixedPrecisionPolicy: the dtypes fully_shard computes and reduces gradients in."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes for a fully_shard unit; ``None`` keeps the parameter's own dtype.

    ``param_dtype``: the gathered (full) parameters and so the forward/backward compute.
    ``reduce_dtype``: the gradient reduce-scatter (defaults to ``param_dtype``).
    ``output_dtype``: forward outputs of the unit are cast to it (None: left alone).
    ``cast_forward_inputs``: cast floating-point forward inputs to ``param_dtype``.
    The sharded parameters, their gradients and the optimizer state keep the
    parameters' original dtype (float32 master weights).

    Example:
        >>> MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=None, cast_forward_inputs=True)
    """

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True

    def compute_dtype(self, orig: torch.dtype) -> torch.dtype:
        """The dtype a parameter of dtype ``orig`` is gathered and computed in."""
        return self.param_dtype or orig

    def grad_reduce_dtype(self, orig: torch.dtype) -> torch.dtype:
        """The dtype gradients of a parameter of dtype ``orig`` are reduce-scattered in."""
        return self.reduce_dtype or self.param_dtype or orig
