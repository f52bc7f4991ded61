"""Trace a model's forward once on the meta device into a graph of aten ops, repeated blocks kept once.

Why meta: the trace costs no memory and no compute at any size (Llama3-70B's 80 blocks trace in a
second or two), and the graph needs shapes only. Why aten ops: they are what the engine's rules are
written for, so every candidate placement the planner considers is one the engine would accept.

A transformer is a stack of identical blocks: the first block of the first ``ModuleList`` whose
children share a class and parameter shapes is recorded; the others run (their outputs are needed)
but are not recorded. The first block's input becomes a ``block_input`` node, its output is where
every later block's output comes from, and the graph says how many times the block runs
(:attr:`Graph.repeats`): the solver counts a block node's costs that many times.

    >>> g = trace_model(model, (tokens,))  # doctest: +SKIP
    >>> g.repeats, len(g.nodes)  # doctest: +SKIP
    (32, 140)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from shardprop.dispatch import registry
from shardprop.tensor.spec import TensorMeta

__all__ = ["Ref", "Node", "Graph", "trace_model", "find_blocks"]

# Ops that tell nothing about layout and never reach a rule (metadata reads, aliases of a whole tensor).
_SKIP = {"aten.detach.default", "aten.lift_fresh.default", "aten._to_copy.default"}


@dataclass(frozen=True)
class Ref:
    """Output ``out`` of node ``node``: how a tensor argument names what produced it."""

    node: int
    out: int = 0


@dataclass(frozen=True)
class Node:
    """One traced op, parameter, buffer, model input or block input.

    ``kind``: "op", "param", "buffer", "input" or "block_input". ``args``/``kwargs`` hold
    :class:`Ref` where the call had a tensor; ``metas`` the outputs' TensorMeta (None for
    non-tensors). ``scope`` is the innermost module's path, ``in_block`` whether the node belongs to the
    recorded (repeated) block.
    """

    index: int
    kind: str
    op: object
    args: tuple
    kwargs: tuple
    metas: Tuple[Optional[TensorMeta], ...]
    scope: str
    in_block: bool
    name: str = ""

    @property
    def refs(self) -> Tuple[Ref, ...]:
        """Every tensor argument, in order (positional, then keyword), as the schema's specs are."""
        flat, _ = tree_flatten((list(self.args), [v for _, v in self.kwargs]))
        return tuple(a for a in flat if type(a) is Ref)


@dataclass
class Graph:
    """The traced forward: nodes in execution order, the repeated block and the model's outputs."""

    nodes: List[Node]
    outputs: Tuple[Ref, ...]
    repeats: int                     # how many times the recorded block runs (1: no repeated block)
    block_prefix: str                # e.g. "layers.0" ("" without a block)
    block_input: Optional[int]       # the block_input node
    block_output: Optional[Ref]      # what the recorded block returns
    module_io: Dict[str, Tuple[Tuple[Ref, ...], Tuple[Ref, ...]]]  # module path -> (input refs, output refs)
    module_types: Dict[str, type]
    module_kw: Dict[str, str]        # module path -> keyword its first tensor input came by ("" if positional)

    def consumers(self) -> Dict[Ref, List[Tuple[int, int]]]:
        """Ref -> [(consumer node, argument position among its refs)]."""
        out: Dict[Ref, List[Tuple[int, int]]] = {}
        for n in self.nodes:
            for i, r in enumerate(n.refs):
                out.setdefault(r, []).append((n.index, i))
        return out


def find_blocks(model: nn.Module) -> Tuple[str, List[str]]:
    """The first list of identical blocks: ``("layers", ["layers.0", ...])``, or ``("", [])``.

    Identical: one class, one list of parameter shapes. Example:
        >>> find_blocks(Llama(LlamaConfig(n_layers=2)))  # doctest: +SKIP
        ('layers', ['layers.0', 'layers.1'])
    """
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.ModuleList, nn.Sequential)) and len(mod) >= 2:
            kids = list(mod.children())
            sig = [(type(k), tuple((n, tuple(p.shape)) for n, p in k.named_parameters())) for k in kids]
            if len(set(sig)) == 1 and sig[0][1]:
                return name, [f"{name}.{i}" if name else str(i) for i in range(len(kids))]
    return "", []


class _Recorder(TorchDispatchMode):
    def __init__(self, tracer: "_Tracer"):
        super().__init__()
        self.t = tracer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            out = func(*args, **kwargs)
        except RuntimeError:
            # Some meta kernels are stricter than the device kernels (_grouped_mm's wants bf16): the
            # engine keeps an output-meta override for those, as propagation does.
            fn = registry.entry(func).output_meta
            if fn is None:
                raise
            out = fn(*args, **kwargs)
        self.t.record(func, args, kwargs, out)
        return out


class _FusedAttention(torch.overrides.TorchFunctionMode):
    """SDPA as the fused CPU kernel's op (what training runs), not the math path meta tensors fall back to.

    On meta, ``F.scaled_dot_product_attention`` decomposes into the math path, whose ``seq x seq``
    scores would count as memory the fused kernel never holds.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            q, k, v = args[:3]
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            if mask is None and not kwargs.get("dropout_p", 0.0) and q.shape[-3] == k.shape[-3] and q.dim() == 4:
                return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(
                    q, k, v, is_causal=kwargs.get("is_causal", False), scale=kwargs.get("scale"))[0]
        return func(*args, **kwargs)


class _Tracer:
    def __init__(self):
        self.nodes: List[Node] = []
        self.ids: Dict[int, Ref] = {}
        self.keep: list = []             # tensors whose id is in self.ids (ids must not be reused)
        self.scope: List[str] = [""]
        self.recording = True
        self.block = ""

    def in_block(self) -> bool:
        return bool(self.block) and (self.scope[-1] == self.block or self.scope[-1].startswith(self.block + "."))

    def add(self, kind, op, args, kwargs, metas, name="") -> int:
        i = len(self.nodes)
        self.nodes.append(Node(i, kind, op, args, kwargs, metas, self.scope[-1], self.in_block(), name))
        return i

    def bind(self, t: torch.Tensor, ref: Ref) -> None:
        self.ids[id(t)] = ref
        self.keep.append(t)

    def ref_of(self, t: torch.Tensor) -> Ref:
        r = self.ids.get(id(t))
        if r is None:  # a tensor from outside the trace (a constant made in forward): replicated input
            r = Ref(self.add("buffer", None, (), (), (_meta(t),), name="<constant>"))
            self.bind(t, r)
        return r

    def record(self, func, args, kwargs, out) -> None:
        if not self.recording:
            return
        if str(func) in _SKIP and isinstance(out, torch.Tensor) and args and isinstance(args[0], torch.Tensor):
            self.bind(out, self.ref_of(args[0]))  # an alias keeps its source's node
            return
        to_key = lambda a: self.ref_of(a) if isinstance(a, torch.Tensor) else (tuple(a) if isinstance(a, list) else a)
        kargs = tree_map(to_key, tuple(args))
        kargs = tuple(tuple(a) if isinstance(a, list) else a for a in kargs)
        kkw = tuple((k, tree_map(to_key, v)) for k, v in kwargs.items())
        outs = out if isinstance(out, (tuple, list)) else (out,)
        metas = tuple(_meta(o) if isinstance(o, torch.Tensor) else None for o in outs)
        if all(m is None for m in metas):
            return
        i = self.add("op", func, kargs, kkw, metas)
        for j, o in enumerate(outs):
            if isinstance(o, torch.Tensor):
                self.bind(o, Ref(i, j))


def _meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(t.shape, t.stride(), t.dtype)


def _to_meta(x):
    return x.to("meta") if isinstance(x, torch.Tensor) else x


def trace_model(model: nn.Module, example_inputs: tuple) -> Graph:
    """Run ``model(*example_inputs)`` once on meta copies of its tensors and record its aten ops.

    The model itself is not changed (its parameters may be real, meta or anything torch can
    describe on meta). Example:
        >>> g = trace_model(model, (tokens,))  # doctest: +SKIP
    """
    t = _Tracer()
    prefix, blocks = find_blocks(model)
    t.block = blocks[0] if blocks else ""
    state = {}
    for name, p in model.named_parameters():
        m = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device="meta")
        state[name] = m
        t.bind(m, Ref(t.add("param", None, (), (), (_meta(m),), name=name)))
        t.nodes[-1] = _replace_scope(t.nodes[-1], name, t.block)
    for name, b in model.named_buffers():
        m = torch.empty_strided(b.shape, b.stride(), dtype=b.dtype, device="meta")
        state[name] = m
        t.bind(m, Ref(t.add("buffer", None, (), (), (_meta(m),), name=name)))
        t.nodes[-1] = _replace_scope(t.nodes[-1], name, t.block)
    inputs = tree_map(_to_meta, tuple(example_inputs))
    for k, x in enumerate(tree_flatten(inputs)[0]):
        if isinstance(x, torch.Tensor):
            t.bind(x, Ref(t.add("input", None, (), (), (_meta(x),), name=f"input{k}")))
    module_io: Dict[str, tuple] = {}
    types = {name: type(m) for name, m in model.named_modules()}
    io_of = lambda v: tuple(t.ids[id(a)] for a in tree_flatten(v)[0] if isinstance(a, torch.Tensor) and id(a) in t.ids)
    block_io = {}

    module_kw: Dict[str, str] = {}

    def pre(name):
        def hook(mod, args, kwargs):
            t.scope.append(name)
            if name in blocks[1:]:
                t.recording = False
            kw = "" if args and isinstance(args[0], torch.Tensor) else next(
                (k for k, v in kwargs.items() if isinstance(v, torch.Tensor)), "")
            first = args[0] if not kw else kwargs[kw]
            if name == t.block and isinstance(first, torch.Tensor):
                src = t.ids.get(id(first))
                with torch.utils._python_dispatch._disable_current_modes():
                    x = first.view(first.shape)
                i = t.add("block_input", None, (src,), (), (_meta(x),), name=name)
                t.bind(x, Ref(i))
                block_io["in"] = i
                if kw:
                    kwargs = {**kwargs, kw: x}
                else:
                    args = (x,) + tuple(args[1:])
            if t.recording:
                module_io[name] = (io_of((args, kwargs if kw else {})), ())
                module_kw[name] = kw
            return args, kwargs
        return hook

    def post(name):
        def hook(mod, args, out):
            if name == t.block:
                first = out if isinstance(out, torch.Tensor) else out[0] if isinstance(out, (tuple, list)) else None
                block_io["out"] = t.ids.get(id(first)) if isinstance(first, torch.Tensor) else None
            if name in blocks[1:]:
                t.recording = True
                if isinstance(out, torch.Tensor) and block_io.get("out") is not None:
                    t.bind(out, block_io["out"])
            if name in module_io and t.recording:
                module_io[name] = (module_io[name][0], io_of(out))
            t.scope.pop()
        return hook

    handles = []
    for name, mod in model.named_modules():
        if name:
            handles.append(mod.register_forward_pre_hook(pre(name), with_kwargs=True))
            handles.append(mod.register_forward_hook(post(name)))
    try:
        with torch.no_grad(), _FusedAttention(), _Recorder(t):
            out = torch.func.functional_call(model, state, inputs)
    finally:
        for h in handles:
            h.remove()
    outputs = io_of(out)
    return Graph(t.nodes, outputs, max(1, len(blocks)), t.block, block_io.get("in"), block_io.get("out"),
                 module_io, types, module_kw)


def _replace_scope(n: Node, name: str, block: str) -> Node:
    scope = name.rpartition(".")[0]
    inb = bool(block) and (scope == block or scope.startswith(block + "."))
    return Node(n.index, n.kind, n.op, n.args, n.kwargs, n.metas, scope, inb, n.name)
