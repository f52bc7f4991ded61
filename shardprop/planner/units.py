"""The units the planner decides for, read off the trace, and the options the engine's rules allow each.

Why units and not single ops: a tensor-parallel region (the modules between a colwise and a
rowwise Linear, attention or an MLP) runs on local shards, with ``-1`` heads in its views; on
global shapes the same ops look unshardable (a view of ``[b, h, s, d]`` to ``[b*h, s, d]`` cannot
keep a head shard as one DTensor). So the planner decides per unit, and asks the rules of the
unit's own ops whether an option is possible:

- a *region* (a child of the repeated block holding Linears) may be sharded iff each entry
  Linear's matmul offers the colwise option ``[R, S(1)] -> S(1)``, its exit Linear's the rowwise
  ``[S(1), S(0)] -> P``, and every view after an entry Linear keeps the shard at this tp size
  (heads divisible by tp);
- the block boundary may be sequence-sharded (sequence parallelism) iff every op of the block
  outside the regions (norms, residual adds) offers ``Shard(1)`` in and out;
- the embedding may be vocab-sharded iff its rule offers ``[S(0), R] -> P``; the output Linear
  colwise as above.

    >>> us = find_units(model, graph, strategies(graph, 2), 2)  # doctest: +SKIP
    >>> [u.path for u in us.regions]  # doctest: +SKIP
    ['attention', 'feed_forward']
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch.nn as nn

from shardprop.planner.candidates import Strategy
from shardprop.planner.costs import CostModel, is_view, node_cost
from shardprop.planner.trace import Graph, Ref
from shardprop.tensor.placement import Partial, Replicate, Shard

__all__ = ["Linear", "Region", "Units", "find_units"]

R = Replicate()
_MM = ("aten.mm.default", "aten.addmm.default")


@dataclass(frozen=True)
class Linear:
    """One ``nn.Linear`` (or the embedding): its module path (relative to the block for block members)."""

    path: str
    param_bytes: float
    in_features: int
    out_features: int
    colwise_ok: bool
    rowwise_ok: bool


@dataclass(frozen=True)
class Region:
    """A child module of the repeated block that holds Linears: sharded as a whole, or not at all."""

    path: str                       # relative to the block, e.g. "attention"
    entries: Tuple[Linear, ...]     # Linears fed from outside the region: colwise
    exit: Optional[Linear]          # the Linear whose output leaves the region: rowwise
    shardable: bool
    why_not: str
    compute: float                  # forward + backward seconds, one process, whole batch
    act_bytes: float                # saved activations (whole batch)
    in_bytes: float                 # the region's input activation
    out_bytes: float


@dataclass(frozen=True)
class Units:
    """Everything the solver decides over, with one-process costs (whole batch, forward + backward)."""

    regions: Tuple[Region, ...]
    block_rest_compute: float       # the block's ops outside regions (norms, residual adds)
    block_rest_act: float
    block_norm_bytes: float         # replicated parameters of the block (norm weights)
    block_param_bytes: float
    sp_ok: bool
    sp_why_not: str
    boundary_bytes: float           # the block's input activation
    embedding: Optional[Linear]
    embedding_path: str
    output: Optional[Linear]
    output_path: str
    output_bytes: float             # logits
    root_compute: float             # root ops outside embedding/output (final norm)
    root_rest_param_bytes: float
    output_compute: float
    embedding_compute: float
    final_norm: str                 # path of the final norm ("" if none)
    block_norms: Tuple[str, ...]    # norm modules of the block (relative)
    repeats: int
    block_prefix: str
    n_ops: int
    n_params: int = 0               # parameter tensors (the optimizer's per-tensor ops)
    kv_bytes: float = 0.0           # keys and values entering the block's SDPA (whole batch): ring attention's traffic
    seq_len: int = 0


def _bytes(meta) -> float:
    return math.prod(meta.shape) * meta.dtype.itemsize if meta is not None else 0.0


def _under(scope: str, path: str) -> bool:
    return scope == path or scope.startswith(path + ".")


def _has(strats, ins, outs) -> bool:
    return any(s.ins == ins and s.outs[:len(outs)] == outs for s in strats)


def find_units(model: nn.Module, graph: Graph, strats: Dict[int, Tuple[Strategy, ...]], k: int,
               cm: CostModel) -> Units:
    """Read the block's regions, the root's embedding and output, and what the rules allow each at tp ``k``."""
    nodes = graph.nodes
    block = graph.block_prefix
    mods = dict(model.named_modules())
    params = {n.name: n for n in nodes if n.kind == "param"}
    consumers = graph.consumers()
    mm_of: Dict[str, int] = {}
    for n in nodes:
        if n.kind == "op" and str(n.op) in _MM and isinstance(mods.get(n.scope), nn.Linear):
            mm_of[n.scope] = n.index

    def linear(path: str, rel: str) -> Linear:
        mod = mods[path]
        w = params.get(path + ".weight")
        nbytes = sum(_bytes(params[path + "." + p].metas[0]) for p, _ in mod.named_parameters() if path + "." + p in params)
        i = mm_of.get(path)
        col = row = False
        if i is not None and k > 1:
            s = strats[i]
            col = _has(s, (R, Shard(1)), (Shard(1),)) and mod.out_features % k == 0
            row = _has(s, (Shard(1), Shard(0)), (Partial(),)) and mod.in_features % k == 0
        elif k == 1:
            col = row = True
        return Linear(rel, nbytes if w is not None else 0.0, mod.in_features, mod.out_features, col, row)

    def views_keep(path: str) -> bool:
        """Every view after this Linear's matmul keeps its column shard (heads divisible by tp)."""
        i = mm_of.get(path)
        if i is None or k == 1:
            return True
        todo, ok = [(Ref(i), Shard(1))], True
        while todo:
            r, have = todo.pop()
            for v, pos in consumers.get(r, []):
                n = nodes[v]
                if is_view(n) and n.scope.startswith(path.rpartition(".")[0]):
                    nxt = [s.outs[0] for s in strats[v] if s.ins and s.ins[0] == have
                           and s.outs[0] is not None and s.outs[0].is_shard()]
                    ok &= bool(nxt)
                    if nxt:
                        todo.append((Ref(v), nxt[0]))
        return ok

    regions: List[Region] = []
    in_regions = set()
    if block:
        bmod = mods[block]
        for cname, child in bmod.named_children():
            cpath = f"{block}.{cname}"
            lins = [p for p, m in child.named_modules(prefix=cpath) if isinstance(m, nn.Linear)]
            if not lins:
                continue
            in_regions.add(cpath)
            cin, cout = graph.module_io.get(cpath, ((), ()))
            out_ref = cout[0] if cout else None
            entries, exit_ = [], None
            for p in lins:
                lin = linear(p, p[len(block) + 1:])
                lin_out = graph.module_io.get(p, ((), ()))[1]
                if out_ref is not None and lin_out and _feeds(graph, lin_out[0], out_ref):
                    exit_ = lin
                else:
                    entries.append(lin)
            why = ""
            if k > 1:
                if exit_ is None or not exit_.rowwise_ok:
                    why = "no rowwise exit Linear the matmul rule can shard"
                elif not all(e.colwise_ok for e in entries):
                    why = "an entry Linear's matmul rule offers no colwise option at this tp"
                elif not all(views_keep(block + "." + e.path) for e in entries):
                    why = "a view after a colwise Linear cannot keep the shard (heads not divisible by tp)"
            region_nodes = [n for n in nodes if n.kind == "op" and _under(n.scope, cpath)]
            regions.append(Region(
                cname, tuple(entries), exit_, not why, why,
                sum(node_cost(n, graph, cm) for n in region_nodes),
                sum(_bytes(m) for n in region_nodes if not is_view(n) for m in n.metas),
                sum(_bytes(nodes[r.node].metas[r.out]) for r in cin[:1]),
                sum(_bytes(nodes[r.node].metas[r.out]) for r in cout[:1])))
    rest = [n for n in nodes if n.kind == "op" and n.in_block and not any(_under(n.scope, p) for p in in_regions)]
    sp_bad = [n for n in rest if not is_view(n) and not any(s.outs and s.outs[0] == Shard(1) for s in strats[n.index])]
    sp_why = f"{sp_bad[0].op} in {sp_bad[0].scope or 'the block'} offers no Shard(1)" if sp_bad and k > 1 else ""
    kw_regions = [r.path for r in regions if graph.module_kw.get(f"{block}.{r.path}")]
    if kw_regions and k > 1:
        # HF-style blocks (inputs by keyword) build their rotary tables and masks from the embedding
        # output's shape, which sequence parallelism would make the local piece's.
        sp_why = sp_why or f"{kw_regions[0]} takes its input by keyword (HF style: positions come from the local shape)"
    bin_meta = nodes[graph.block_input].metas[0] if graph.block_input is not None else None
    if bin_meta is not None and (len(bin_meta.shape) < 2 or bin_meta.shape[1] % k):
        sp_why = sp_why or "the sequence is not divisible by tp"
    block_params = [n for n in nodes if n.kind == "param" and n.in_block]
    reg_param_names = {block + "." + lin.path + ".weight" for r in regions for lin in r.entries + ((r.exit,) if r.exit else ())}
    norms = tuple(p[len(block) + 1:] for p, m in mods.items() if block and _under(p, block) and p != block
                  and "norm" in type(m).__name__.lower())
    # The root: an embedding, a final Linear (the output), and whatever else (the final norm).
    emb_path = next((p for p, m in mods.items() if isinstance(m, nn.Embedding) and not _under(p, block or "\0")), "")
    out_path = ""
    for p, m in mods.items():
        if isinstance(m, nn.Linear) and not (block and _under(p, block.rpartition(".")[0] or block)) and p in mm_of:
            out_path = p
    embedding = None
    if emb_path:
        w = params.get(emb_path + ".weight")
        e = next((n for n in nodes if n.kind == "op" and n.scope == emb_path and "embedding" in str(n.op)), None)
        ok = e is not None and k > 1 and _has(strats[e.index], (Shard(0), R), (Partial(),)) \
            and mods[emb_path].num_embeddings % k == 0
        embedding = Linear(emb_path, _bytes(w.metas[0]) if w else 0.0, mods[emb_path].num_embeddings,
                           mods[emb_path].embedding_dim, False, ok)
    output = linear(out_path, out_path) if out_path else None
    root_ops = [n for n in nodes if n.kind == "op" and not n.in_block]
    out_ops = [n for n in root_ops if out_path and _under(n.scope, out_path)]
    emb_ops = [n for n in root_ops if emb_path and _under(n.scope, emb_path)]
    other = [n for n in root_ops if n not in out_ops and n not in emb_ops]
    final_norm = next((p for p, m in mods.items() if "norm" in type(m).__name__.lower()
                       and not (block and _under(p, block.rpartition(".")[0] or block))), "")
    return Units(
        tuple(regions), sum(node_cost(n, graph, cm) for n in rest),
        sum(_bytes(m) for n in rest if not is_view(n) for m in n.metas),
        sum(_bytes(n.metas[0]) for n in block_params if n.name not in reg_param_names),
        sum(_bytes(n.metas[0]) for n in block_params),
        not sp_why, sp_why, _bytes(bin_meta) if bin_meta is not None else 0.0,
        embedding, emb_path, output, out_path,
        sum(_bytes(m) for n in out_ops if str(n.op) in _MM for m in n.metas),
        sum(node_cost(n, graph, cm) for n in other),
        sum(_bytes(n.metas[0]) for n in nodes if n.kind == "param" and not n.in_block and not _under(n.scope, block or "\0")
            and n.name not in (emb_path + ".weight", out_path + ".weight") and not n.scope.startswith((block.rpartition(".")[0] + ".") if block else "\0")),
        sum(node_cost(n, graph, cm) for n in out_ops), sum(node_cost(n, graph, cm) for n in emb_ops),
        final_norm, norms, graph.repeats, block, sum((graph.repeats if n.in_block else 1) for n in nodes if n.kind == "op"),
        sum(graph.repeats if n.in_block else 1 for n in nodes if n.kind == "param"
            and (n.in_block or not (block and _under(n.scope, block.rpartition(".")[0] or block)))),
        sum(_bytes(nodes[r.node].metas[r.out]) for n in nodes if n.in_block and "scaled_dot_product" in str(n.op)
            for r in n.refs[1:3]),
        int(bin_meta.shape[1]) if bin_meta is not None and len(bin_meta.shape) > 1 else 0)


def _feeds(graph: Graph, src: Ref, dst: Ref) -> bool:
    """Whether ``dst`` is ``src`` or computed from it through views only (a Linear's output leaving its module)."""
    if src == dst:
        return True
    n = graph.nodes[dst.node]
    return is_view(n) and any(_feeds(graph, src, r) for r in n.refs)
