"""Tensor-parallel styles: how one submodule's parameters, inputs and outputs are laid out.

A style is a small immutable description; ``parallelize_module`` applies it to a
submodule on a 1-d (tensor-parallel) mesh. The styles mirror the names and
defaults of ``torch.distributed.tensor.parallel``:

style                 parameters                             input (default)     output (default)
-------------------   -------------------------------------  ------------------  ------------------
ColwiseParallel       Linear W S(0), b S(0); Embedding S(1)  Replicate           Shard(-1), local
RowwiseParallel       Linear W S(1), b R;    Embedding S(0)  Shard(-1); R (emb)  Replicate, local
SequenceParallel      replicated                             Shard(seq)          Shard(seq), DTensor
PrepareModuleInput    untouched                              given -> desired    untouched
PrepareModuleOutput   untouched                              untouched           given -> desired

Plain-tensor inputs are taken to be this rank's piece of the declared input layout
(``DTensor.from_local``, no check) and then redistributed to the layout the style needs;
DTensor inputs are redistributed directly. Everything is differentiable.

A sharded dim that tp does not divide is split in ``torch.chunk`` order (10 over 4: 3, 3, 3, 1;
trailing ranks may be empty), as torch does; ``check_divisible`` is the old error, for a strict
mode. A plain input piece is taken to be an even share (torch's ``from_local`` does the same),
except a Linear's feature dim, whose global size is the weight's: so a Colwise -> Rowwise pair
with an uneven hidden dim works through plain local tensors. An uneven sequence needs DTensors
between the styles (``use_local_output=False``), which carry the global shape.

Example (a Megatron-style MLP: one all-reduce forward, one backward)::

    >>> plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}  # doctest: +SKIP
    >>> parallelize_module(mlp, mesh, plan)  # doctest: +SKIP
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import nn

from shardprop.parallel.fast.fused_linear import install
from shardprop.parallel.fast.fused_norm import install_norm
from shardprop.parallel.fast.grad_sync import grad_like
from shardprop.parallel.param_swap import keep_hooks_on_swap
from shardprop.tensor.dtensor import DTensor
from shardprop.tensor.placement import Placement, Replicate, Shard, as_placement, normalize_placements

R = Replicate()


# ---------------------------------------------------------------- layout conversion
_is_compiling = torch.compiler.is_compiling


def _placements_of(layout: Placement, ndim: int) -> tuple:
    if _is_compiling():  # dynamo need not trace a cache
        return normalize_placements((layout,), ndim, 1, "parallel style")
    return _normalized(layout, ndim)


@functools.lru_cache(maxsize=256)
def _normalized(layout: Placement, ndim: int) -> tuple:
    return normalize_placements((layout,), ndim, 1, "parallel style")


def to_dtensor(x, mesh, layout: Placement, desired: Optional[Placement], last_size: Optional[int] = None):
    """``x`` as a DTensor laid out as ``desired``: plain tensors are this rank's piece of ``layout``.

    Non-tensors pass through unchanged. ``desired=None`` keeps the layout as is. A plain piece is
    taken to be an even share (as ``DTensor.from_local`` takes it), except that ``last_size``, where
    given, is the global size of the last dim (a Linear's ``in_features``): a piece of a feature dim
    that tp does not divide, in torch.chunk order, then gets the right global shape.

    Example:
        >>> to_dtensor(torch.ones(2, 4), mesh, Shard(0), Replicate()).shape  # 4 ranks  # doctest: +SKIP
        torch.Size([8, 4])
        >>> to_dtensor(torch.ones(2, 3), mesh, Shard(-1), None, last_size=10).shape  # pieces 3, 3, 3, 1  # doctest: +SKIP
        torch.Size([2, 10])
    """
    if not isinstance(x, torch.Tensor):
        return x
    if not isinstance(x, DTensor):
        shape = None
        if last_size is not None and type(layout) is Shard and layout.dim in (-1, x.ndim - 1):
            shape = x.shape[:-1] + (last_size,)
        x = DTensor.from_local(x, mesh, (layout,), run_check=False, shape=shape)
    if desired is not None:
        want = _placements_of(desired, x.ndim)
        # Under torch.compile the layout is not read here (the graph cannot hold placements):
        # redistributing to the same layout is free. Eagerly a repeated change runs the planner's
        # prepared program (one lookup; see shardprop.tensor.redistribute).
        if _is_compiling() or x._spec.placements != want:
            x = x.redistribute(placements=want)
    return x


def _maybe_local(x, use_local_output: bool):
    return x.to_local() if use_local_output and isinstance(x, DTensor) else x


def _as_tuple(v) -> tuple:
    return tuple(_ours(x) for x in v) if isinstance(v, (tuple, list)) else (_ours(v),)


def _ours(layout):
    """A style's layout as our placement: torch's placements (a program written for torch) are taken by shape."""
    if layout is None:
        return None
    p = as_placement(layout)
    if p is None:
        raise TypeError(f"parallel style: {layout!r} is not a placement (use Shard(d), Replicate() or Partial())")
    return p


def distribute_params(module: nn.Module, mesh, placement_of, src_data_rank: Optional[int] = 0) -> None:
    """Make each direct parameter of ``module`` a DTensor Parameter laid out as ``placement_of(name)``.

    ``src_data_rank`` goes to ``distribute_tensor``: whose values every rank gets (None: its own).
    ``placement_of`` may return a tuple, one placement per mesh dim, for a multi-dim mesh.

    Parameters that are DTensors already are kept (a module styled twice keeps its first
    layout). The gradient of each parameter is laid out like the parameter (a hook
    redistributes it if the backward produced another layout, e.g. ``Partial`` from a
    sequence-sharded layer norm; ``Partial -> Replicate`` ones are coalesced into one
    all-reduce at the end of ``backward()``, see ``grad_sync``), so optimizer states and
    updates stay local.

    Example:
        >>> distribute_params(linear, mesh, {"weight": Shard(0), "bias": Shard(0)}.get)  # doctest: +SKIP
    """
    from shardprop.tensor.distribute import distribute_tensor
    for name, p in list(module.named_parameters(recurse=False)):
        if p is None or isinstance(p, DTensor):
            continue
        placement = placement_of(name) or R
        # One placement (a 1-d mesh), or one per mesh dim (styles for n-d meshes, e.g. ExpertTensorParallel).
        placements = list(placement) if isinstance(placement, (tuple, list)) else [placement]
        dt = distribute_tensor(p.detach(), mesh, placements, src_data_rank=src_data_rank)
        param = nn.Parameter(dt, requires_grad=p.requires_grad)
        if p.requires_grad:
            param.register_hook(grad_like(param, param.placements))
            keep_hooks_on_swap(module)  # model.to(dtype) swaps DTensor parameters in place
        module.register_parameter(name, param)


def check_divisible(style: "ParallelStyle", module: nn.Module, mesh, module_name: str = "") -> None:
    """Raise a ValueError naming the module, style, parameter and sizes if ``style`` would shard a parameter
    of ``module`` unevenly over ``mesh``.

    Uneven pieces are not an error by default (torch.chunk order, as torch lays them out); this is the
    check for a strict mode to call before ``style._apply``.

    Example:
        >>> check_divisible(ColwiseParallel(), nn.Linear(16, 10), mesh_of_4, "up")  # doctest: +SKIP
        ValueError: parallelize_module: ColwiseParallel on 'up' (Linear) shards weight dim 0 of size 10 ...
    """
    n = mesh.size()
    for param, dim in style.sharded_dims(module):
        size = getattr(module, param).shape[dim]
        if size % n:
            raise ValueError(
                f"parallelize_module: {type(style).__name__} on {module_name!r} ({type(module).__name__}) shards "
                f"{param} dim {dim} of size {size} over a mesh of size {n}, which does not divide it (strict mode "
                f"wants equal shards: pick sizes divisible by {n}, or leave strict mode for torch.chunk pieces)")


def _unsupported(style: str, module_name: str, module: nn.Module, supported: str) -> ValueError:
    return ValueError(f"parallelize_module: {style} does not support {module_name!r} of type "
                      f"{type(module).__name__}; it supports {supported}")


# ---------------------------------------------------------------- styles
class ParallelStyle:
    """Base class: a style lays out one module on a 1-d mesh via ``_apply(module, mesh, name)``.

    Subclasses install parameters (``distribute_params``) and forward hooks, and return the module.
    ``src_data_rank`` (set by ``parallelize_module``, as torch's styles carry it) is the mesh rank
    whose parameter values every rank gets; None: each rank keeps its own.

    Example:
        >>> isinstance(ColwiseParallel(), ParallelStyle)
        True
    """

    src_data_rank: Optional[int] = 0
    # Whether the style lays a module out over a multi-dim mesh (parallelize_module otherwise wants 1-d).
    takes_nd_mesh = False

    def _apply(self, module: nn.Module, mesh, name: str = "") -> nn.Module:
        raise NotImplementedError

    def sharded_dims(self, module: nn.Module) -> tuple:
        """``(parameter name, dim)`` of each parameter of ``module`` this style shards (see ``check_divisible``)."""
        return ()

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({fields})"


class _LinearStyle(ParallelStyle):
    """Shared by Colwise and Rowwise: input/output conversion hooks around a Linear or Embedding."""

    def __init__(self, *, input_layouts: Optional[Placement] = None, output_layouts: Optional[Placement] = None,
                 use_local_output: bool = True):
        self.input_layouts = _ours(input_layouts)
        self.output_layouts = _ours(output_layouts)
        self.use_local_output = use_local_output

    # (param placements, default input layout, desired input, raw output layout) per module kind
    def _layouts(self, kind: str):
        raise NotImplementedError

    def sharded_dims(self, module):
        kind = _kind(module)
        if kind is None:
            return ()
        return tuple((name, p.dim) for name, p in self._layouts(kind)[0].items()
                     if type(p) is Shard and getattr(module, name, None) is not None)

    def _apply(self, module, mesh, name=""):
        style = type(self).__name__
        kind = _kind(module)
        if kind is None:
            raise _unsupported(style, name, module, "nn.Linear and nn.Embedding")
        params, in_default, desired_in, out_default = self._layouts(kind)
        distribute_params(module, mesh, params.get, self.src_data_rank)
        in_layout = self.input_layouts or in_default
        out_layout = self.output_layouts or out_default
        use_local = self.use_local_output
        # A Linear's input features are the weight's columns: a plain input piece of them (a column-parallel
        # output before a row-parallel layer) gets its global size from there, even where tp does not divide it.
        in_features = module.weight.shape[1] if kind == "linear" else None
        # Hooks are partials of module-level functions, so torch.save(model) can pickle them.
        pre = functools.partial(_linear_pre, mesh, in_layout, desired_in, in_features)
        post = functools.partial(_linear_post, mesh, out_layout, use_local)
        # Eager: local matmul / lookup plus explicit collectives (fused_linear); this DTensor path is
        # kept for torch.compile and for layouts the fast path does not cover.
        hooked = functools.partial(_hooked_forward, pre, post)

        if install(module, f"{style} on {name!r}", isinstance(self, ColwiseParallel), mesh, in_layout, out_layout,
                   use_local, hooked):
            return module
        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)
        return module


def _kind(module) -> Optional[str]:
    return "linear" if isinstance(module, nn.Linear) else "embedding" if isinstance(module, nn.Embedding) else None


def _linear_pre(mesh, in_layout, desired_in, in_features, mod, inputs):
    return (to_dtensor(inputs[0], mesh, in_layout, desired_in, in_features),) + tuple(inputs[1:])


def _linear_post(mesh, out_layout, use_local, mod, inputs, output):
    return _maybe_local(to_dtensor(output, mesh, out_layout, out_layout), use_local)


def _hooked_forward(pre, post, mod, x):
    """The module's own forward between its style's input and output conversions (the DTensor path)."""
    return post(mod, None, type(mod).forward(mod, *pre(mod, (x,))))


class ColwiseParallel(_LinearStyle):
    """Shard the output features: ``nn.Linear`` weight ``Shard(0)`` and bias ``Shard(0)``; ``nn.Embedding``
    weight ``Shard(1)`` (the embedding dim).

    Args:
        input_layouts: layout of a plain-tensor input (default ``Replicate()``); it is redistributed to
            ``Replicate()`` before the matmul (an all-gather if it was, e.g., sequence-sharded).
        output_layouts: the output layout wanted (default ``Shard(-1)``, what the matmul gives for free).
        use_local_output: return the local shard as a plain tensor (default) instead of the DTensor.

    Example:
        >>> mesh = init_device_mesh("cpu", (4,))
        >>> mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        >>> mlp = parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        >>> mlp[0].weight.to_local().shape     # this rank's 16 / 4 output features
        torch.Size([4, 8])
        >>> # logits kept vocab-sharded for loss_parallel():
        >>> parallelize_module(model, tp_mesh, {"output": ColwiseParallel(use_local_output=False)})  # doctest: +SKIP
    """

    def _layouts(self, kind):
        if kind == "linear":
            return {"weight": Shard(0), "bias": Shard(0)}, R, R, Shard(-1)
        return {"weight": Shard(1)}, R, R, Shard(-1)


class RowwiseParallel(_LinearStyle):
    """Shard the input features: ``nn.Linear`` weight ``Shard(1)``, bias replicated (added once); the
    matmul gives a ``Partial`` sum, reduced into ``output_layouts``. ``nn.Embedding``: the vocabulary is
    sharded (weight ``Shard(0)``), each rank looks up the ids it holds, the sum is the lookup.

    Args:
        input_layouts: layout of a plain-tensor input (default ``Shard(-1)`` for Linear, the output of a
            ColwiseParallel before it; ``Replicate()`` for Embedding token ids).
        output_layouts: default ``Replicate()`` (an all-reduce); ``Shard(1)`` gives a reduce-scatter onto
            the sequence dim, the entry to a ``SequenceParallel`` region.
        use_local_output: return the local tensor (default) instead of the DTensor.

    Example:
        >>> plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        ...         "attention.wo": RowwiseParallel(output_layouts=Shard(1))}
    """

    def _layouts(self, kind):
        if kind == "linear":
            return {"weight": Shard(1), "bias": R}, Shard(-1), Shard(-1), R
        return {"weight": Shard(0)}, R, R, R


class SequenceParallel(ParallelStyle):
    """Run a norm or dropout on sequence-sharded activations; parameters replicated.

    The input becomes ``Shard(sequence_dim)`` (a plain tensor is taken to be this rank's piece of the
    sequence; a DTensor in another layout is redistributed), and the output stays a sequence-sharded
    DTensor (``use_local_output=False``) for the next style to consume. Gradients of the replicated
    parameters (partial sums over the sequence pieces) are all-reduced into their layout: in
    ``loss.backward()`` all of them together, in one all-reduce at the end (``grad_sync``).
    In eager mode ``nn.LayerNorm`` and ``nn.RMSNorm`` (torch's classes) run on the local
    sequence piece without DTensor dispatch (``fused_norm``); other modules run on DTensors.

    Example:
        >>> plan = {"attention_norm": SequenceParallel(), "attention": PrepareModuleInput(
        ...     input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))}
        >>> norm = parallelize_module(nn.LayerNorm(8), init_device_mesh("cpu", (4,)), SequenceParallel())
        >>> y = norm(torch.randn(2, 3, 8))        # this rank's 3 tokens of a 12-token sequence
        >>> y.placements, y.shape
        ((S(1),), torch.Size([2, 12, 8]))
    """

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False):
        self.sequence_dim = sequence_dim
        self.use_local_output = use_local_output

    def _apply(self, module, mesh, name=""):
        for sub in module.modules():
            distribute_params(sub, mesh, replicated, self.src_data_rank)
        seq = Shard(self.sequence_dim)
        use_local = self.use_local_output
        pre = functools.partial(_sequence_pre, mesh, seq)
        post = functools.partial(_sequence_post, use_local)
        # Eager: torch's own per-token norms run on the local sequence piece (fused_norm); any other
        # module (it may mix tokens or draw random numbers) and torch.compile keep this DTensor path.
        hooked = functools.partial(_hooked_forward, pre, post)

        if install_norm(module, mesh, self.sequence_dim, use_local, hooked):
            return module
        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)
        return module


def _sequence_pre(mesh, seq, mod, inputs):
    return tuple(to_dtensor(x, mesh, seq, seq) for x in inputs)


def _sequence_post(use_local, mod, inputs, output):
    return _maybe_local(output, use_local)


def replicated(name: str) -> Replicate:
    """``placement_of`` for :func:`distribute_params` that replicates every parameter (picklable, unlike a lambda).

    Example:
        >>> distribute_params(norm, mesh, replicated)  # doctest: +SKIP
    """
    return R


def _convert_all(values, layouts, desired, mesh, use_local: bool, what: str):
    if len(values) != len(layouts):
        raise ValueError(f"{what}: {len(layouts)} layouts {list(layouts)} for {len(values)} values; "
                         "give one layout per value (None for values to leave alone)")
    out = []
    for v, lay, want in zip(values, layouts, desired):
        if lay is None:
            out.append(v)
            continue
        if isinstance(v, DTensor) and not _is_compiling() and v.placements != _placements_of(lay, v.ndim):
            raise ValueError(f"{what}: a DTensor laid out as {list(v.placements)} where the declared "
                             f"layout is {lay!r}")
        out.append(_maybe_local(to_dtensor(v, mesh, lay, want), use_local))
    return out


def _check_pairs(layouts, desired, what: str) -> None:
    if len(layouts) != len(desired):
        raise ValueError(f"{what}: {len(layouts)} layouts but {len(desired)} desired layouts; give one of each "
                         "per value")


class PrepareModuleInput(ParallelStyle):
    """Convert a module's inputs from ``input_layouts`` to ``desired_input_layouts`` before forward.

    One layout per positional input (``None`` leaves that input alone); keyword inputs by name
    via ``input_kwarg_layouts`` / ``desired_input_kwarg_layouts``. With ``use_local_output=True``
    the module receives plain local tensors.

    Example (attention fed from a sequence-parallel norm: gather the sequence)::

        >>> style = PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None),
        ...                            use_local_output=True)
    """

    def __init__(self, *, input_layouts=None, desired_input_layouts=None, input_kwarg_layouts=None,
                 desired_input_kwarg_layouts=None, use_local_output: bool = False):
        self.input_layouts = _as_tuple(input_layouts) if input_layouts is not None else None
        self.desired_input_layouts = _as_tuple(desired_input_layouts) if desired_input_layouts is not None else None
        if self.input_layouts is not None:
            _check_pairs(self.input_layouts, self.desired_input_layouts or (), "PrepareModuleInput")
        self.input_kwarg_layouts = {k: _ours(v) for k, v in (input_kwarg_layouts or {}).items()}
        self.desired_input_kwarg_layouts = {k: _ours(v) for k, v in (desired_input_kwarg_layouts or {}).items()}
        if set(self.input_kwarg_layouts) != set(self.desired_input_kwarg_layouts):
            raise ValueError("PrepareModuleInput: input_kwarg_layouts and desired_input_kwarg_layouts must name "
                             "the same keyword inputs")
        self.use_local_output = use_local_output

    def _apply(self, module, mesh, name=""):
        pre = functools.partial(_prepare_input, self, mesh, f"PrepareModuleInput on {name!r}")
        module.register_forward_pre_hook(pre, with_kwargs=True)
        return module


def _prepare_input(style: PrepareModuleInput, mesh, what: str, mod, args, kwargs):
    layouts, desired, use_local = style.input_layouts, style.desired_input_layouts, style.use_local_output
    if layouts is not None:
        args = tuple(_convert_all(args, layouts, desired, mesh, use_local, what))
    for k, lay in style.input_kwarg_layouts.items():
        if k in kwargs:
            want = style.desired_input_kwarg_layouts[k]
            kwargs[k], = _convert_all((kwargs[k],), (lay,), (want,), mesh, use_local, what)
    return args, kwargs


class PrepareModuleOutput(ParallelStyle):
    """Convert a module's outputs from ``output_layouts`` to ``desired_output_layouts`` after forward.

    One layout per output (a single output, or each element of a returned tuple; ``None`` leaves it
    alone). ``use_local_output=True`` (default) returns plain local tensors.

    Example (a sequence-parallel block hands a replicated activation to the next stage)::

        >>> style = PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate())
    """

    def __init__(self, *, output_layouts, desired_output_layouts, use_local_output: bool = True):
        self.output_layouts = _as_tuple(output_layouts)
        self.desired_output_layouts = _as_tuple(desired_output_layouts)
        _check_pairs(self.output_layouts, self.desired_output_layouts, "PrepareModuleOutput")
        self.use_local_output = use_local_output

    def _apply(self, module, mesh, name=""):
        module.register_forward_hook(functools.partial(_prepare_output, self, mesh, f"PrepareModuleOutput on {name!r}"))
        return module


def _prepare_output(style: PrepareModuleOutput, mesh, what: str, mod, inputs, output):
    layouts, desired, use_local = style.output_layouts, style.desired_output_layouts, style.use_local_output
    if isinstance(output, (tuple, list)):
        return type(output)(_convert_all(output, layouts, desired, mesh, use_local, what))
    return _convert_all((output,), layouts, desired, mesh, use_local, what)[0]


__all__ = ["ParallelStyle", "ColwiseParallel", "RowwiseParallel", "SequenceParallel", "PrepareModuleInput",
           "PrepareModuleOutput", "to_dtensor", "distribute_params", "replicated"]
