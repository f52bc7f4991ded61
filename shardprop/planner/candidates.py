"""Each traced node's candidate strategies, asked of the engine's registered sharding rules.

The planner keeps no table of op strategies of its own: for every aten op it builds the call's
schema with the inputs laid out on a one-dim "paper" mesh (a mesh of ``k`` ranks that exists only
on paper: no process group, nothing to run), calls the op's rule (a user's rule wins, as at run
time) and keeps every option it offers. Some rules (views) answer for the input layout they are
shown, so each op is asked once per layout of its first input (Replicate, Partial, Shard on each
dim), and the answers are pooled.

    >>> strategies(graph, 4)[node.index]  # doctest: +SKIP
    (Strategy(ins=(R, S(0)), outs=(S(1),)), ...)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from torch.utils._pytree import tree_map

from shardprop.planner.trace import Graph, Node, Ref
from shardprop.dispatch import registry
from shardprop.dispatch.op_schema import FLOAT, OpSchema
from shardprop.dispatch.propagate import PropContext, ShardingError
from shardprop.tensor.placement import Partial, Placement, Replicate, Shard
from shardprop.tensor.spec import DTensorSpec

__all__ = ["PaperMesh", "Strategy", "strategies", "tensor_layouts"]

R = Replicate()


@dataclass(frozen=True)
class PaperMesh:
    """A one-dim mesh of ``k`` ranks for asking rules: shape and names only, no process group."""

    k: int

    @property
    def shape(self) -> Tuple[int, ...]:
        return (self.k,)

    @property
    def ndim(self) -> int:
        return 1

    mesh_dim_names = ("tp",)
    device_type = "meta"

    def size(self, dim=None) -> int:
        return self.k


@dataclass(frozen=True)
class Strategy:
    """One way to run a node on the tp mesh dim: a placement per tensor input and per output."""

    ins: Tuple[Placement, ...]
    outs: Tuple[Optional[Placement], ...]

    def __repr__(self) -> str:
        return f"{list(self.ins)}->{list(self.outs)}"


def tensor_layouts(meta, k: int, *, partial: bool = False) -> List[Placement]:
    """Replicate and every even Shard of a tensor of this meta over ``k`` ranks (Partial if asked)."""
    out: List[Placement] = [R]
    if partial:
        out.append(Partial())
    if k > 1:
        out += [Shard(d) for d, n in enumerate(meta.shape) if n % k == 0 and n >= k]
    return out


def _unwrap(p):
    if isinstance(p, (tuple, list)):  # a full rule's entry on a one-dim mesh: one placement
        return p[0] if len(p) == 1 else None
    return p


def _ask(node: Node, graph: Graph, mesh: PaperMesh, first: Placement) -> list:
    """The rule's options for ``node`` with its first tensor input laid out as ``first``."""
    seen = []

    def spec_of(a):
        if type(a) is Ref:
            meta = graph.nodes[a.node].metas[a.out]
            p = first if not seen else R
            seen.append(a)
            return DTensorSpec(mesh, (p,), meta)
        if type(a) is float:
            return FLOAT
        return a

    args = tree_map(spec_of, node.args)
    kwargs = tuple((k, tree_map(spec_of, v)) for k, v in node.kwargs)
    schema = OpSchema(node.op, args, kwargs)
    rule = registry.entry(node.op).rule
    if rule is None:
        return []
    ctx = PropContext(schema)
    try:
        return list(rule.fn(ctx))
    except (ShardingError, NotImplementedError, TypeError, ValueError, RuntimeError, IndexError):
        return []


def _node_strategies(node: Node, graph: Graph, k: int) -> Tuple[Strategy, ...]:
    refs = node.refs
    n_out = len(node.metas)
    if node.kind in ("param", "block_input"):
        return tuple(Strategy((), (p,)) for p in tensor_layouts(node.metas[0], k))
    if node.kind != "op" or not refs:  # inputs, buffers, constants: replicated on tp
        return (Strategy((), tuple(R if m is not None else None for m in node.metas)),)
    mesh = PaperMesh(k)
    first_meta = graph.nodes[refs[0].node].metas[refs[0].out]
    found: Dict[Strategy, None] = {}
    inplace = str(node.op).split(".")[1].endswith("_")
    for seed in tensor_layouts(first_meta, k, partial=True):
        for ins, outs in _ask(node, graph, mesh, seed):
            ins = tuple(_unwrap(p) for p in ins)
            outs = tuple(_unwrap(p) for p in outs)
            if len(ins) != len(refs) or any(p is None for p in ins) or len(outs) > n_out:
                continue
            if any(type(p) not in (Replicate, Shard, Partial) for p in ins + tuple(o for o in outs if o is not None)):
                continue
            outs = outs + (None,) * (n_out - len(outs))
            outs = tuple(None if m is None else (Shard(o.dim % len(m.shape)) if type(o) is Shard else o)
                         for o, m in zip(outs, node.metas))
            if any(o is None and m is not None for o, m in zip(outs, node.metas)):
                continue
            if inplace and outs[0] != ins[0]:
                continue
            found[Strategy(ins, outs)] = None
    rep = Strategy(tuple(R for _ in refs), tuple(R if m is not None else None for m in node.metas))
    if not found or k == 1:
        found = {rep: None}
    return tuple(found)


def strategies(graph: Graph, k: int) -> Dict[int, Tuple[Strategy, ...]]:
    """Node index -> its candidate strategies on a tp dim of ``k`` ranks (from the rules).

    An op with no rule (or a rule that refuses every layout shown) runs replicated, as the
    engine's replicate fallback would run it.

        >>> strategies(trace_model(model, (tokens,)), 2)  # doctest: +SKIP
    """
    return {n.index: _node_strategies(n, graph, k) for n in graph.nodes}
