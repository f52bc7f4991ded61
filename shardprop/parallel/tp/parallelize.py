"""distribute_module and parallelize_module: lay a model out over a mesh.

``distribute_module`` is the low-level tool (parameters to DTensors plus input/output
hooks); ``parallelize_module`` applies tensor-parallel styles (``shardprop.parallel.tp.styles``)
to submodules chosen by dotted names with ``*`` wildcards.
"""
from __future__ import annotations

import fnmatch
import functools
import warnings
from typing import Callable, Dict, List, Optional, Tuple, Union

from torch import nn

from shardprop.mesh.device_mesh import mesh_or_current
from shardprop.parallel.tp.styles import ParallelStyle, check_divisible, distribute_params, replicated
from shardprop.tensor.dtensor import DTensor
from shardprop.tensor.placement import Replicate


# Callables run on a module once distribute_module / parallelize_module has laid it out. Rooms above
# this one add to it through add_on_distributed (shardprop/assembly.py: load_state_dict takes plain full tensors).
on_distributed: List[Callable[[nn.Module], None]] = []


def add_on_distributed(hook: Callable[[nn.Module], None]) -> None:
    """Run ``hook(module)`` on every module distribute_module / parallelize_module lays out (once per hook).

    Example:
        >>> add_on_distributed(lambda module: None)  # doctest: +SKIP
    """
    if hook not in on_distributed:
        on_distributed.append(hook)


def _distributed(module: nn.Module) -> nn.Module:
    for hook in on_distributed:
        hook(module)
    return module


def distribute_module(module: nn.Module, device_mesh=None, partition_fn: Optional[Callable] = None,
                      input_fn: Optional[Callable] = None, output_fn: Optional[Callable] = None) -> nn.Module:
    """Make every parameter and buffer of ``module`` a DTensor on ``device_mesh``; add input/output hooks.

    ``partition_fn(name, submodule, mesh)`` is called for each submodule (``name`` is its dotted
    name, ``""`` for ``module``) and may replace that submodule's parameters with DTensor
    ``nn.Parameter``s of its choice; everything still a plain tensor afterwards is replicated.
    Parameters stay ``nn.Parameter``s (``module.parameters()`` yields them, optimizers update them in
    place). ``input_fn(module, inputs, mesh)`` runs as a forward pre-hook (return the new inputs
    tuple, or None to keep them) and ``output_fn(module, outputs, mesh)`` as a forward hook.

    Example:
        >>> def shard_rows(name, mod, mesh):
        ...     if isinstance(mod, nn.Linear):
        ...         mod.weight = nn.Parameter(distribute_tensor(mod.weight.detach(), mesh, [Shard(0)]))
        >>> distribute_module(model, mesh, shard_rows,
        ...                   input_fn=lambda m, inputs, mesh: tuple(
        ...                       DTensor.from_local(x, mesh, [Replicate()]) for x in inputs))  # doctest: +SKIP
    """
    mesh = mesh_or_current(device_mesh)
    for name, sub in module.named_modules():
        if partition_fn is not None:
            partition_fn(name, sub, mesh)
        distribute_params(sub, mesh, replicated)
        _replicate_buffers(sub, mesh)
    # Partials, not lambdas: torch.save(model) pickles the hooks (when input_fn/output_fn pickle).
    if input_fn is not None:
        module.register_forward_pre_hook(functools.partial(_run_input_fn, input_fn, mesh))
    if output_fn is not None:
        module.register_forward_hook(functools.partial(_run_output_fn, output_fn, mesh))
    return _distributed(module)


def _run_input_fn(input_fn, mesh, mod, inputs):
    return input_fn(mod, inputs, mesh)


def _run_output_fn(output_fn, mesh, mod, inputs, outputs):
    return output_fn(mod, outputs, mesh)


def _replicate_buffers(sub: nn.Module, mesh) -> None:
    from shardprop.tensor.distribute import distribute_tensor
    for bname, b in list(sub.named_buffers(recurse=False)):
        if b is not None and not isinstance(b, DTensor):
            sub._buffers[bname] = distribute_tensor(b, mesh, [Replicate()] * mesh.ndim)


Plan = Union[ParallelStyle, Dict[str, ParallelStyle]]


def match_submodules(module: nn.Module, key: str) -> List[Tuple[str, nn.Module]]:
    """The (dotted name, submodule) pairs that ``key`` names; each dot-separated atom may use ``*``/``?``.

    Example:
        >>> [n for n, _ in match_submodules(model, "layers.*.attention.wq")]  # doctest: +SKIP
        ['layers.0.attention.wq', 'layers.1.attention.wq']
    """
    found = [("", module)]
    for atom in key.split("."):
        found = [(f"{prefix}.{name}" if prefix else name, child)
                 for prefix, mod in found for name, child in mod.named_children()
                 if fnmatch.fnmatchcase(name, atom)]
    return found


def parallelize_module(module: nn.Module, device_mesh=None, parallelize_plan: Optional[Plan] = None, *,
                       src_data_rank: Optional[int] = 0, strict: bool = False) -> nn.Module:
    """Apply tensor-parallel styles to ``module`` on a 1-d mesh.

    ``parallelize_plan`` is one style (for ``module`` itself) or a dict from dotted submodule names
    to styles; an atom of a name may contain ``*`` wildcards (``"layers.*.feed_forward.w1"``). Styles
    are applied in the plan's order. On a multi-dim mesh pass the tensor-parallel sub-mesh,
    ``mesh["tp"]`` (styles that lay a module out over several mesh dims, ``ExpertTensorParallel``,
    take the n-d mesh); without ``device_mesh``, the mesh of the enclosing ``with mesh:``. ``src_data_rank`` is handed to ``distribute_tensor`` for every parameter: the
    mesh rank whose weights every rank ends up with (default 0, the single-device semantics), or
    None for each rank's own weights, cut locally.

    As torch's does, it warns and does nothing for a missing plan, and warns and skips a key that
    matches no submodule; with ``strict=True`` both raise (TypeError, ValueError), and so does a weight
    dim a style shards unevenly (by default uneven dims are split in ``torch.chunk`` order, as torch's).
    Raises ValueError for a style on a module type it does not support.

    Example:
        >>> mesh = init_device_mesh("cpu", (4,))
        >>> mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        >>> mlp = parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        >>> mlp[0].weight.placements, mlp[2].weight.placements
        ((S(0),), (S(1),))
        >>> mlp(torch.randn(4, 8)).shape       # plain tensors in and out
        torch.Size([4, 8])

    Example (a Llama-style model, plain tensor parallelism; attention and MLP each do one
    all-reduce forward and one backward; each rank runs n_heads // tp heads, so the model must
    reshape with the local head count, e.g. ``-1`` instead of ``n_heads`` in ``view``)::

        >>> tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"]  # doctest: +SKIP
        >>> parallelize_module(model, tp, {
        ...     "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
        ...     "layers.*.attention.wq": ColwiseParallel(),   # also wk, wv
        ...     "layers.*.attention.wo": RowwiseParallel(),
        ...     "layers.*.feed_forward.w1": ColwiseParallel(),  # also w3
        ...     "layers.*.feed_forward.w2": RowwiseParallel(),
        ...     "output": ColwiseParallel(use_local_output=False),  # vocab-sharded logits for loss_parallel
        ... })  # doctest: +SKIP

    With sequence parallelism the residual stream is this rank's sequence piece (plain local
    tensors of ``[B, S / tp, D]``); norms run on it, and attention/MLP gather it on entry and
    reduce-scatter on exit::

        >>> parallelize_module(model, tp, {
        ...     "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        ...     "layers.*.attention_norm": SequenceParallel(),
        ...     "layers.*.attention": PrepareModuleInput(input_layouts=(Shard(1), None),
        ...                                              desired_input_layouts=(Replicate(), None),
        ...                                              use_local_output=True),
        ...     "layers.*.attention.wq": ColwiseParallel(),
        ...     "layers.*.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        ...     "layers.*.ffn_norm": SequenceParallel(),
        ...     "layers.*.feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
        ...                                                 desired_input_layouts=(Replicate(),),
        ...                                                 use_local_output=True),
        ...     "layers.*.feed_forward.w1": ColwiseParallel(),
        ...     "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        ...     "norm": SequenceParallel(),
        ...     "output": ColwiseParallel(input_layouts=Shard(1), use_local_output=False),
        ... })  # doctest: +SKIP
    """
    mesh = mesh_or_current(device_mesh)
    if parallelize_plan is None:
        if strict:
            raise TypeError("parallelize_module: no parallelize_plan given (strict=True)")
        warnings.warn("parallelize_module: no parallelize_plan given, so this call does nothing (torch's "
                      "parallelize_module does the same; pass strict=True to raise instead)", stacklevel=2)
        return module
    styles = ([parallelize_plan] if isinstance(parallelize_plan, ParallelStyle)
              else list(parallelize_plan.values()) if isinstance(parallelize_plan, dict) else [])
    if mesh.ndim != 1 and not (styles and all(getattr(s, "takes_nd_mesh", False) for s in styles)):
        names = getattr(mesh, "mesh_dim_names", None)
        hint = f'mesh["{names[-1]}"]' if names else "a 1-d sub-mesh"
        raise ValueError(f"parallelize_module: tensor parallelism needs a 1-d mesh, got a {mesh.ndim}-d mesh "
                         f"{mesh}; pass the tensor-parallel sub-mesh, e.g. {hint}")
    if isinstance(parallelize_plan, ParallelStyle):
        parallelize_plan.src_data_rank = src_data_rank  # the style's attribute, as torch's styles carry it
        _check_even(strict, parallelize_plan, module, mesh, "")
        return _distributed(parallelize_plan._apply(module, mesh, ""))
    if not isinstance(parallelize_plan, dict):
        raise TypeError(f"parallelize_module: the plan must be a ParallelStyle or a dict of name -> style, "
                        f"not {type(parallelize_plan).__name__}")
    for key, style in parallelize_plan.items():
        if not isinstance(style, ParallelStyle):
            raise TypeError(f"parallelize_module: plan key {key!r} maps to {style!r}, which is not a ParallelStyle")
        style.src_data_rank = src_data_rank
        if key == "":
            _check_even(strict, style, module, mesh, "")
            style._apply(module, mesh, "")
            continue
        matches = match_submodules(module, key)
        if not matches:
            msg = (f"parallelize_module: plan key {key!r} ({type(style).__name__}) matches no submodule of "
                   f"{type(module).__name__}; its children are {[n for n, _ in module.named_children()]}")
            if strict:
                raise ValueError(msg)
            warnings.warn(msg + "; skipping it (pass strict=True to raise instead)", stacklevel=2)
            continue
        for name, sub in matches:
            _check_even(strict, style, sub, mesh, name)
            style._apply(sub, mesh, name)
    return _distributed(module)


def _check_even(strict: bool, style, module, mesh, name: str) -> None:
    """With ``strict``, a dim the style would shard unevenly (torch.chunk order otherwise) is a ValueError."""
    if strict and mesh.ndim == 1 and hasattr(style, "sharded_dims"):  # n-d styles check their own layouts
        check_divisible(style, module, mesh, name)


__all__ = ["distribute_module", "parallelize_module", "match_submodules"]
