"""MixedPrecisionPolicy: the dtypes fully_shard computes and reduces gradients in."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes for a fully_shard unit; ``None`` keeps the parameter's own dtype.

    ``param_dtype``: the gathered (full) parameters and so the forward/backward compute.
    ``reduce_dtype``: the gradient reduce-scatter; None keeps the parameter's own dtype
    (torch 2.15's rule; before 2.15 torch fell back to ``param_dtype``).
    ``output_dtype``: forward outputs of the unit are cast to it (None: left alone).
    ``cast_forward_inputs``: cast floating-point forward inputs to ``param_dtype``.
    ``param_dtype_override_fn(param)``: per parameter, None / ``param_dtype`` (the default
    dtype) or the parameter's own dtype (keep it); one unit must end up with one dtype.
    The sharded parameters, their gradients and the optimizer state keep the
    parameters' original dtype (float32 master weights).

    Example:
        >>> MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=None, cast_forward_inputs=True, param_dtype_override_fn=None)
    """

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True
    param_dtype_override_fn: Optional[Callable[[torch.nn.Parameter], Optional[torch.dtype]]] = field(
        default=None, kw_only=True)

    def compute_dtype(self, orig: torch.dtype) -> torch.dtype:
        """The dtype a parameter of dtype ``orig`` is gathered and computed in."""
        return self.param_dtype or orig

    def grad_reduce_dtype(self, orig: torch.dtype) -> torch.dtype:
        """The dtype gradients of a parameter of dtype ``orig`` are reduce-scattered in."""
        return self.reduce_dtype or orig

    def param_compute_dtype(self, param: torch.nn.Parameter) -> torch.dtype:
        """The compute dtype of one parameter, after ``param_dtype_override_fn``."""
        if self.param_dtype_override_fn is not None:
            dt = self.param_dtype_override_fn(param)
            if dt is not None:
                if dt not in (self.param_dtype, param.dtype):
                    raise ValueError(f"MixedPrecisionPolicy: param_dtype_override_fn must return None, param_dtype "
                                     f"or the parameter's own dtype, got {dt} for a {param.dtype} parameter")
                return dt
        return self.compute_dtype(param.dtype)
