"""``PrepareModuleInputOutput``: ``PrepareModuleInput`` and ``PrepareModuleOutput`` on one module.

Built from the two styles (each keeps its own checks, hooks and errors), as
``torch.distributed.tensor.parallel.PrepareModuleInputOutput`` is.
"""
from __future__ import annotations

from shardprop.parallel.tp.styles import ParallelStyle, PrepareModuleInput, PrepareModuleOutput


class PrepareModuleInputOutput(ParallelStyle):
    """Convert a module's inputs (before forward) and outputs (after it) between layouts.

    Keyword arguments are those of :class:`PrepareModuleInput` (``input_layouts``,
    ``desired_input_layouts``, ``input_kwarg_layouts``, ``desired_input_kwarg_layouts``, and
    ``use_local_input``: the module receives plain local tensors) and of
    :class:`PrepareModuleOutput` (``output_layouts``, ``desired_output_layouts``,
    ``use_local_output``, default True).

    Example (attention gets a replicated input; its replicated output leaves sharded)::

        >>> style = PrepareModuleInputOutput(
        ...     input_layouts=(Shard(0), None), desired_input_layouts=(Replicate(), None),
        ...     output_layouts=Replicate(), desired_output_layouts=Shard(0))
        >>> parallelize_module(block, mesh, {"attn": style})  # doctest: +SKIP
    """

    def __init__(self, *, input_layouts=None, desired_input_layouts=None, input_kwarg_layouts=None,
                 desired_input_kwarg_layouts=None, use_local_input: bool = False, output_layouts,
                 desired_output_layouts, use_local_output: bool = True):
        self.prepare_module_input = PrepareModuleInput(
            input_layouts=input_layouts, desired_input_layouts=desired_input_layouts,
            input_kwarg_layouts=input_kwarg_layouts, desired_input_kwarg_layouts=desired_input_kwarg_layouts,
            use_local_output=use_local_input)
        self.prepare_module_output = PrepareModuleOutput(
            output_layouts=output_layouts, desired_output_layouts=desired_output_layouts,
            use_local_output=use_local_output)

    def _apply(self, module, mesh, name=""):
        self.prepare_module_input._apply(module, mesh, name)
        self.prepare_module_output._apply(module, mesh, name)
        return module

    def __repr__(self) -> str:
        i, o = self.prepare_module_input, self.prepare_module_output
        return (f"PrepareModuleInputOutput(input_layouts={i.input_layouts}, desired_input_layouts="
                f"{i.desired_input_layouts}, input_kwarg_layouts={i.input_kwarg_layouts}, "
                f"desired_input_kwarg_layouts={i.desired_input_kwarg_layouts}, use_local_input={i.use_local_output}, "
                f"output_layouts={o.output_layouts}, desired_output_layouts={o.desired_output_layouts}, "
                f"use_local_output={o.use_local_output})")


__all__ = ["PrepareModuleInputOutput"]
