"""The eager fast path of ColwiseParallel / RowwiseParallel on ``nn.Linear``: local compute, explicit collectives.

Instead of running ``F.linear`` on DTensors (``t``, ``mm``/``addmm`` and their backward
each going through the dispatcher), a styled Linear's forward takes the input's local
piece, runs ``F.linear`` on the local weight and bias, and moves data with a few small
autograd functions over mesh collectives, as hand-written Megatron TP does:

style     input (plain, default R / S(-1))       output (default S(-1) / R)
--------  -------------------------------------  -----------------------------------------------
Colwise   R: identity fwd, all-reduce bwd         S(-1): nothing; other: gather fwd, chunk bwd
          S(d): all-gather fwd, reduce-scatter    (e.g. R for full logits)
Rowwise   S(-1): nothing                          R: all-reduce fwd (in place), identity bwd
          other: redistributed, inverse bwd       S(d): reduce-scatter fwd, all-gather bwd

A plain ``nn.Embedding`` (no padding_idx, max_norm, scale_grad_by_freq or sparse) fed plain
replicated token ids takes the same route: a local lookup (masked to this rank's rows when the
vocabulary is sharded, giving a partial sum) and the same output conversions.

DTensor inputs are redistributed to the layout the style needs (differentiable) and
unwrapped with a gradient layout that matches what DTensor dispatch would produce
(``Partial`` for a replicated input of a column-parallel matmul), so the surrounding
DTensor code sees the same layouts as before. Parameters stay DTensor ``nn.Parameter``s:
the local weight is taken through a one-node autograd path (``grad_sync.ParamLocal``) whose
backward puts the local gradient into ``param.grad`` as a DTensor laid out like the parameter
(a ``Partial`` bias gradient joins the end-of-backward all-reduce), so optimizers and
checkpoints see what they saw. Sequence gathers and reduce-scatters go through the planner's
prepared programs (``redistribute_local``: one lookup, then one flat collective and at most one
layout copy). Every collective goes through ``shardprop.mesh.collectives`` (so ``comm_counter()`` counts it);
while ``explain()`` listens, the local op and the collectives of each forward (and of each backward
node that communicates) are reported to it (``dispatch.fast_paths.run_recorded``). Under
``torch.compile``, or with the fast paths switched off (``shardprop.set_fast_paths(False)``, read at
call time), the forward runs the DTensor path.

Example:
    >>> parallelize_module(mlp, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})  # doctest: +SKIP
    >>> mlp(x)  # up: local matmul; down: local matmul + one all-reduce; backward: one all-reduce
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from shardprop.dispatch import fast_paths as _fast
from shardprop.mesh import collectives as C
from shardprop.mesh import compat
from shardprop.mesh.state import module_state
from shardprop.parallel.fast.autograd_apply import direct_apply
from shardprop.parallel.fast.grad_sync import ParamLocal
from shardprop.tensor.dtensor import DTensor, make_spec, stride_like
from shardprop.tensor.layout import local_shape_and_offset
from shardprop.tensor.placement import Partial, Replicate, Shard, normalize_placements
from shardprop.tensor.redistribute import redistribute_local

_R = (Replicate(),)
_P = (Partial(),)
_MESH_DIM = (0,)  # styles run on 1-d meshes


# ---------------------------------------------------------------- autograd pieces
class LocalOf(torch.autograd.Function):
    """A DTensor's local tensor; backward wraps the local gradient as a DTensor with ``grad_spec``."""

    @staticmethod
    def forward(ctx, dt, grad_spec):
        ctx.grad_spec = grad_spec
        local = dt._local_tensor
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad):
        _forget_input()
        spec = ctx.grad_spec
        # The spec's strides must describe the gradient's memory order, not the forward's.
        if grad.is_contiguous():
            spec = spec.contiguous()
        else:
            stride = stride_like(grad, spec.shape)
            if stride != spec.tensor_meta.stride:
                spec = make_spec(spec.mesh, spec.placements, spec.shape, stride, spec.dtype)
        return DTensor(grad, spec), None


class WrapLocal(torch.autograd.Function):
    """A local tensor as the DTensor of ``spec`` (``from_local`` with the spec given); backward: the local gradient.

    ``spec`` must describe ``local`` (its shape on this rank and memory order); a DTensor gradient in
    another layout is brought to ``spec``'s placements first (none of them Partial).
    """

    @staticmethod
    def forward(ctx, local, spec):
        ctx.spec = spec
        return DTensor(local.view_as(local), spec, requires_grad=False)

    @staticmethod
    def backward(ctx, grad):
        if not isinstance(grad, DTensor):
            return grad, None
        want = ctx.spec.placements
        if grad._spec.placements != want:
            return redistribute_local(grad._local_tensor, grad._spec, want), None
        return grad._local_tensor, None


class _CopyIn(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient backward (a replicated input of a column-parallel matmul)."""

    @staticmethod
    def forward(ctx, x, mesh):
        ctx.mesh = mesh
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _forget_input()
        if _fast.recording():
            return _fast.run_recorded("all_reduce", "fast path backward: input gradient of a column-parallel "
                                      "matmul", (_P,), _MESH_DIM, C.all_reduce, grad, ctx.mesh, _MESH_DIM), None
        return C.all_reduce(grad, ctx.mesh, _MESH_DIM), None  # a fresh tensor: autograd may hold grad


class _ReduceOut(torch.autograd.Function):
    """All-reduce forward, in place when nothing else shares the matmul output's memory; identity backward.

    Shared memory is not a rare case: a selective activation-checkpoint policy that saves matmuls keeps
    an alias of the ``mm`` output, and writing the sum into it would replay the sum, not the partial
    value, in the recomputation (then reduce it again). The engine hands a tensor over on the same test.
    """

    @staticmethod
    def forward(ctx, y, mesh):
        out = C.all_reduce(y, mesh, _MESH_DIM, inplace=compat.storage_unshared(y))
        if out is y:  # in place (eager c10d); a traced (functional) all-reduce returns a new tensor
            ctx.mark_dirty(y)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Relayout(torch.autograd.Function):
    """Local piece of ``spec`` -> local piece of ``dst``; backward: a gradient piece in ``grad_src`` -> ``grad_dst``.

    E.g. a sequence-sharded input gathered for a column-parallel matmul (``S(1) -> R``,
    gradient ``P -> S(1)``: a reduce-scatter), or a row-parallel output scattered onto the
    sequence (``P -> S(1)``, gradient ``S(1) -> R``: an all-gather).
    """

    @staticmethod
    def forward(ctx, x, spec, dst, grad_src, grad_dst):
        ctx.grad_spec, ctx.grad_dst = spec.with_placements(grad_src), grad_dst
        out = redistribute_local(x, spec, dst)
        return out.view_as(out) if out is x else out

    @staticmethod
    def backward(ctx, grad):
        _forget_input()
        spec, dst = ctx.grad_spec, ctx.grad_dst
        if _fast.recording():
            return _fast.run_recorded("redistribute", "fast path backward: gradient relayout", (spec.placements,),
                                      _MESH_DIM, redistribute_local, grad, spec, dst), None, None, None, None
        return redistribute_local(grad, spec, dst), None, None, None, None


def _spec_of_local(local: torch.Tensor, mesh, placements, size=None):
    """The spec of a plain tensor taken as this rank's piece of ``placements``.

    ``size`` is the global size of the sharded dim where the caller knows it (a column-parallel
    output's features: the weight's rows, split unevenly in torch.chunk order); without it the
    pieces are taken to be even, as ``DTensor.from_local`` takes them.
    """
    shape = list(local.shape)
    p = placements[0]
    if type(p) is Shard:
        shape[p.dim] = shape[p.dim] * mesh.size() if size is None else size
    return make_spec(mesh, placements, shape, None, local.dtype)


def _grad_placements(placements) -> tuple:
    return _R if type(placements[0]) is Partial else placements


_param_local = direct_apply(ParamLocal)
_local_of = direct_apply(LocalOf)
_copy_in = direct_apply(_CopyIn)
_reduce_out = direct_apply(_ReduceOut)
_relayout = direct_apply(_Relayout)


# ---------------------------------------------------------------- the forward
class FusedLinear(_fast.FastPath):
    """A styled Linear's fast forward (a fast path, see ``FastPath``): mesh, layouts, column- or row-parallel.

    ``forward(module, x)`` is installed as the module's ``forward`` via ``functools.partial``, so
    ``copy.deepcopy`` of the model rebinds it to the copy. ``engine(module, x)`` is the DTensor path
    (the style's hooks around the module's own forward).
    """

    _CACHES = ("_norm", "_rows_of")  # rebuilt on use

    def __init__(self, what: str, colwise: bool, mesh, in_layout, out_layout, use_local_output: bool, hooked):
        super().__init__(hooked)
        self.what, self.colwise, self.mesh = what, colwise, mesh
        self.in_layout, self.out_layout, self.use_local = in_layout, out_layout, use_local_output
        self._norm = {}
        self._rows_of = {}

    def placements(self, layout, ndim: int) -> tuple:
        """``layout`` as a normalized 1-tuple for a tensor of ``ndim`` dims (Shard(-1) -> Shard(ndim-1)), cached."""
        key = (layout, ndim)
        p = self._norm.get(key)
        if p is None:
            p = self._norm[key] = normalize_placements((layout,), ndim, 1, "parallel style")
        return p

    def eligible(self, module, x):
        """(feature-sharded layout, output layout, bias), or None to take the DTensor path."""
        ndim = x.ndim
        last = self.placements(Shard(-1), ndim)
        out = self.placements(self.out_layout, ndim)
        b = module.bias
        if b is not None and not self.colwise and \
                (out == last or (b.requires_grad and not module.weight.requires_grad)):
            # A feature-sharded output needs the bias sharded too. And with a frozen weight, the bias (added
            # after the reduction) would get its gradient before the matmul's backward reads the weight:
            # fully_shard frees the gathered weight once every trainable gradient is in. DTensor path for both.
            return None
        if not on_mesh(self.mesh, module.weight, b):
            return None  # parameters moved off the style's mesh: the engine says what is wrong
        return last, out, b

    def describe(self, module, x, plan) -> tuple:
        have = x.placements if isinstance(x, DTensor) else self.placements(self.in_layout, x.ndim)
        return "linear (local)", f"fast path: {self.what}", (have,), _MESH_DIM

    def local_forward(self, module, x, last, out, b):
        """The Linear's forward under the style: local matmul plus explicit collectives."""
        xl = self._local_input(x, _R if self.colwise else last)
        w = module.weight
        w = _param_local(w, w._spec)
        if self.colwise:
            y = F.linear(xl, w, None if b is None else _param_local(b, b._spec))
            return self._output(y, last, out, None, module.weight._spec.shape[0])
        return self._output(F.linear(xl, w), _P, out, b)

    def _rows(self, w) -> tuple:
        """(first row, number of rows) of this rank's vocabulary shard of ``w`` (cached per spec)."""
        spec = w._spec
        got = self._rows_of.get(spec)
        if got is None:
            mesh = self.mesh
            shape, offset = local_shape_and_offset(spec.shape, mesh.shape, mesh._coord, spec.placements)
            got = self._rows_of[spec] = (offset[0], shape[0])
        return got

    def _output(self, y, have: tuple, out: tuple, b, features=None):
        """The local result ``y`` (laid out as ``have``) in the declared output layout, plus a replicated bias.

        ``features``: the global size of a column-parallel output's feature dim (the weight's), which
        tp need not divide; a partial sum has the global shape already.
        """
        mesh = self.mesh
        spec = None if out == have and self.use_local else \
            make_spec(mesh, have, y.shape, None, y.dtype) if have is _P else _spec_of_local(y, mesh, have, features)
        if out != have:
            if have is _P and out == _R and y.is_contiguous():
                y = _reduce_out(y, mesh)
            else:
                y = _relayout(y, spec, out, _grad_placements(out), _grad_placements(have))
        if b is not None:  # added once, after the reduction (bias is replicated)
            grad_spec = b._spec if out == _R else b._spec.with_placements(_P)  # a sequence piece's sum is partial
            bl = _param_local(b, grad_spec)
            if bl.dtype != y.dtype and torch.is_autocast_enabled(y.device.type):
                bl = bl.to(y.dtype)  # F.linear under autocast casts its bias too: same dtype as the DTensor path
            y = y + bl
        if self.use_local:
            return y
        return DTensor.from_local(y, mesh, out, shape=spec.shape)

    def _local_input(self, x, want: tuple):
        if want is not _R:
            return self._convert_input(x, want)
        # Several column-parallel layers fed the same tensor (q, k, v; w1, w3) share one local input,
        # so autograd sums their input gradients before the one collective that reduces them.
        if not (x.requires_grad and torch.is_grad_enabled()):
            return self._convert_input(x, want)
        last = _state.last_input
        if last is not None and last[0] is x and last[1] == x._version and last[2] is self.mesh \
                and last[3] == self.in_layout:
            return last[4]
        out = self._convert_input(x, want)
        _state.last_input = (x, x._version, self.mesh, self.in_layout, out)
        return out

    def _convert_input(self, x, want: tuple):
        mesh = self.mesh
        if isinstance(x, DTensor):
            if x._spec.mesh != mesh:
                raise ValueError(f"{self.what}: the input DTensor lives on {x._spec.mesh}, the layer's weight on "
                                 f"{mesh}; redistribute it onto the layer's mesh first")
            if x._spec.placements != want:
                x = x.redistribute(placements=want)
            # The gradient of a replicated input of a column-parallel matmul is a partial sum: leave its
            # reduction to whoever made the input (one reduce-scatter for q, k and v together, say).
            spec = x._spec
            return _local_of(x, spec.with_placements(_P) if want is _R else spec)
        have = self.placements(self.in_layout, x.ndim)
        if have == want:
            return _copy_in(x, mesh) if want is _R else x
        grad_want = _P if want is _R else want
        return _relayout(x, _spec_of_local(x, mesh, have), want, grad_want, _grad_placements(have))


class FusedEmbedding(FusedLinear):
    """A styled Embedding's fast forward: a local (masked, for a vocabulary shard) lookup.

    Token ids are plain replicated tensors here (the default input layout); DTensor ids take the
    DTensor path.
    """

    def eligible(self, module, x):
        if isinstance(x, DTensor) or not on_mesh(self.mesh, module.weight, None):
            return None
        return ()

    def describe(self, module, x, plan) -> tuple:
        return "embedding (local)", f"fast path: {self.what}", (_R,), _MESH_DIM

    def local_forward(self, module, x):
        """The Embedding's forward under the style: a local (masked, for a vocabulary shard) lookup."""
        w = module.weight
        wl = _param_local(w, w._spec)
        ndim = x.ndim + 1
        out = self.placements(self.out_layout, ndim)
        if self.colwise:  # the embedding dim is sharded: the lookup gives this rank's features
            return self._output(F.embedding(x, wl), self.placements(Shard(-1), ndim), out, None, w._spec.shape[1])
        lo, rows = self._rows(w)  # the vocabulary is sharded: look up the ids this rank holds, zeros elsewhere
        if rows == 0:
            # An empty trailing shard (a vocabulary tp does not divide): no id is here. Zeros that still
            # depend on the (empty) local weight, so its gradient is an empty tensor as on the other path.
            y = torch.zeros(x.shape + (wl.shape[1],), dtype=wl.dtype, device=wl.device) + wl.sum(0)
        else:
            outside = (x < lo) | (x >= lo + rows)
            y = F.embedding((x - lo).masked_fill(outside, 0), wl).masked_fill(outside.unsqueeze(-1), 0.0)
        return self._output(y, _P, out, None)


# The last replicated local input made with autograd recording: (input, its version, mesh, declared
# input layout, local input). Cleared by the first backward through any node below, so it keeps an
# activation alive only from one forward to its backward (or to the next forward).
_state = module_state(last_input=None)


def on_mesh(mesh, *params) -> bool:
    """Whether each of ``params`` (None: absent) is a DTensor on ``mesh``: fully_shard's resharded
    parameters, for one, are not, and the fast paths leave those to the engine (which says what is wrong).

    Example:
        >>> on_mesh(mesh, linear.weight, linear.bias)  # both parallelized over mesh  # doctest: +SKIP
        True
    """
    for p in params:
        if p is not None and (not isinstance(p, DTensor) or (p._spec.mesh is not mesh and p._spec.mesh != mesh)):
            return False
    return True


def _forget_input() -> None:
    _state.last_input = None


def install(module, what: str, colwise: bool, mesh, in_layout, out_layout, use_local_output: bool,
            hooked) -> bool:
    """Give a styled ``nn.Linear`` the fast forward if the layouts allow it; False to keep the DTensor path.

    Partial input or output layouts keep the DTensor path, and so does a Linear subclass with a
    forward of its own (so do, at call time: the fast paths switched off, a row-parallel bias under a
    feature-sharded output or beside a frozen weight, and parameters not on the style's mesh).

    Example:
        >>> install(lin, "ColwiseParallel on 'wq'", True, mesh, Replicate(), Shard(-1), True, hooked)  # doctest: +SKIP
        True
    """
    if type(in_layout) is Partial or type(out_layout) is Partial:
        return False
    if "forward" in vars(module):
        return False
    if type(module).forward is nn.Linear.forward:
        fused = FusedLinear(what, colwise, mesh, in_layout, out_layout, use_local_output, hooked)
        module.forward = functools.partial(fused.forward, module)
        return True
    plain_lookup = (module.padding_idx is None and module.max_norm is None and not module.scale_grad_by_freq
                    and not module.sparse) if isinstance(module, nn.Embedding) else False
    if type(module).forward is nn.Embedding.forward and plain_lookup and type(in_layout) is Replicate:
        fused = FusedEmbedding(what, colwise, mesh, in_layout, out_layout, use_local_output, hooked)
        module.forward = functools.partial(fused.forward, module)
        return True
    return False  # a subclass with its own forward (LoRA, quantized, ...) computes something else


__all__ = ["FusedLinear", "LocalOf", "WrapLocal", "install"]


_fast.register("linear", "shardprop.parallel.fast.fused_linear.FusedLinear",
               "ColwiseParallel/RowwiseParallel's DTensor hooks around nn.Linear.forward (the engine's rules)",
               ("ColwiseParallel", "RowwiseParallel"))
_fast.register("embedding", "shardprop.parallel.fast.fused_linear.FusedEmbedding",
               "the styles' DTensor hooks around nn.Embedding.forward (the embedding rule, masked lookup)",
               ("ColwiseParallel", "RowwiseParallel"))
