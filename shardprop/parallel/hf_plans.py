"""parallelize_hf: lay a Hugging Face transformers model out over a mesh from the plans it ships.

transformers (5.x) models carry a tensor-parallel plan (``model.tp_plan``, from the config's
``base_model_tp_plan`` plus the head's ``_tp_plan``) and MoE models an expert-parallel plan
(``model.ep_plan``): dotted module (or parameter) names with ``*`` for the layer number, each mapped to
a style string. This module maps each string to one of shardprop's styles and applies them:

plan string                           shardprop style
------------------------------------  -----------------------------------------------------------------
colwise                               ColwiseParallel()                     (output Shard(-1), local)
colwise_gather_output, colwise_rep    ColwiseParallel(output_layouts=Replicate())
rowwise (on a Linear)                 RowwiseParallel()                     (input Shard(-1), output Replicate)
rowwise_split_input, rowwise_rep      RowwiseParallel(input_layouts=Replicate())
embedding_rowwise                     RowwiseParallel(input_layouts=Replicate()) on the Embedding (vocab)
embedding_colwise                     ColwiseParallel(output_layouts=Replicate()) on the Embedding (dim)
replicate                             nothing (the parameter stays a plain, replicated tensor)
replicated_with_grad_allreduce        GradSumOverTP(): plain parameters, gradients summed over tp
moe_tp_experts (+ its parameters'     HFExperts over tp (each expert's hidden dim)
  packed_colwise / rowwise)
ep_dispatch_experts (+ grouped_gemm)  HFExperts over ep (experts), and over ep x tp on a 2-d mesh

As in transformers, an ep plan takes precedence over tp rules on the experts. Any other string (e.g.
``sequence_parallel``, ``packed_rowwise``, ``mla_kv_a_proj``, ``all_reduce``, ``local_params``)
raises a ValueError naming the string and the module.
"""
from __future__ import annotations

import fnmatch
import functools
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from shardprop.mesh import collectives
from shardprop.parallel.ep.hf_experts import HFExperts
from shardprop.parallel.tp.parallelize import match_submodules, parallelize_module
from shardprop.parallel.tp.styles import ColwiseParallel, ParallelStyle, RowwiseParallel
from shardprop.tensor.placement import Replicate

class GradSumOverTP(ParallelStyle):
    """Parameters kept whole (plain tensors) on every tp rank, their gradients summed over tp.

    For a module that runs on this rank's slice of a sharded activation with shared weights, e.g.
    Qwen3's per-head ``q_norm`` / ``k_norm`` between a colwise projection and attention: each rank
    sees only its heads, so its gradient is a partial sum. A hook on each parameter all-reduces it
    (once per backward: the hook sees the gradient summed over the parameter's uses).

    Example:
        >>> parallelize_module(model, tp_mesh, {"layers.*.self_attn.q_norm": GradSumOverTP()})  # doctest: +SKIP
    """

    def _apply(self, module: nn.Module, mesh, name: str = "") -> nn.Module:
        for p in module.parameters():
            if p.requires_grad:
                p.register_hook(functools.partial(_sum_over, mesh))  # a partial: torch.save(model) pickles it
        return module


def _sum_over(mesh, grad: torch.Tensor) -> torch.Tensor:
    return collectives.all_reduce(grad, mesh, 0)


# Module-level plan strings -> a factory of the shardprop style (fresh per use: styles carry src_data_rank).
_TP_STYLES = {
    "colwise": lambda: ColwiseParallel(),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise": lambda: RowwiseParallel(),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    "embedding_colwise": lambda: ColwiseParallel(output_layouts=Replicate()),
    "replicated_with_grad_allreduce": lambda: GradSumOverTP(),
}
# Strings on the parameters of an experts module, whose module entry says how it is laid out.
_EXPERT_PARAM_STRINGS = {"moe_tp_experts": {"packed_colwise", "rowwise"}, "ep_dispatch_experts": {"grouped_gemm"}}
SUPPORTED = sorted(set(_TP_STYLES) | {"replicate", "moe_tp_experts", "packed_colwise", "ep_dispatch_experts",
                                      "grouped_gemm"})


def _dims(mesh) -> Tuple[bool, bool]:
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim == 1 and not names:
        return False, True  # an unnamed 1-d mesh: tensor parallel
    unknown = [n for n in names if n not in ("ep", "tp")]
    if unknown or mesh.ndim > 2 or len(set(names)) != len(names):
        raise ValueError(f"parallelize_hf: wants a mesh with dims named 'tp' and/or 'ep', got {mesh} with names "
                         f"{names}; pass e.g. init_device_mesh('cpu', (2, 2), mesh_dim_names=('ep', 'tp'))")
    return "ep" in names, "tp" in names


def _entries(model: nn.Module, plan: Dict[str, str]) -> List[Tuple[str, str, str, Optional[str]]]:
    """(plan key, style string, module name, parameter name or None) for every module or parameter a key names."""
    out = []
    for key, style in plan.items():
        found = [(n, None) for n, _ in match_submodules(model, key)]
        if not found and "." in key:  # a parameter entry: the module, then the parameter's name
            mod_key, pname = key.rsplit(".", 1)
            found = [(n, p) for n, m in match_submodules(model, mod_key)
                     for p, _ in m.named_parameters(recurse=False) if fnmatch.fnmatchcase(p, pname)]
        out.extend((key, style, n, p) for n, p in found)
    return out


def _check_heads(model: nn.Module, tp: int) -> None:
    """Colwise q/k/v give each rank ``heads / tp`` heads; the model's views use -1 heads, so they must divide."""
    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    heads = getattr(cfg, "num_attention_heads", None)
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    for what, n in (("num_attention_heads", heads), ("num_key_value_heads", kv)):
        if isinstance(n, int) and n % tp:
            raise ValueError(f"parallelize_hf: {what}={n} does not split over tp={tp}: a rank would hold part of "
                             "a head (pick a tp that divides the attention and key/value head counts)")


def _check_tied(model: nn.Module, entries) -> None:
    planned = {}
    for key, _, mname, pname in entries:
        mod = model.get_submodule(mname)
        for n, p in mod.named_parameters(recurse=pname is None):
            if pname is None or n == pname:
                planned.setdefault(id(p), []).append(f"{mname}.{n}")
    shared = [names for names in planned.values() if len(set(names)) > 1]
    if shared:
        raise ValueError(f"parallelize_hf: parameters {shared[0]} are one tensor (tied weights) under two plan "
                         "entries; untie them (config.tie_word_embeddings=False) or drop one entry from tp_plan")


def parallelize_hf(model: nn.Module, mesh, *, tp_plan: Optional[Dict[str, str]] = None,
                   ep_plan: Optional[Dict[str, str]] = None, src_data_rank: Optional[int] = 0) -> nn.Module:
    """Parallelize a transformers model from its own plans (``model.tp_plan``, ``model.ep_plan``) onto ``mesh``.

    ``mesh``: a 1-d mesh named ``"tp"`` (or unnamed) for tensor parallelism, ``"ep"`` for expert parallelism
    (the batch split over ep; every other parameter stays a plain replicated tensor, to be data-parallel
    over ep), or a 2-d ``("ep", "tp")`` mesh: tensor parallelism over tp and experts over ep x tp (each ep
    index brings its own batch, the same on its tp ranks). ``tp_plan`` / ``ep_plan`` override the model's.
    Raises ValueError for a plan string shardprop does not support (naming it and the module), for head
    counts tp does not divide, and for tied weights under two entries.

    Example:
        >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=64, num_attention_heads=4, ...))  # doctest: +SKIP
        >>> parallelize_hf(model, init_device_mesh("cpu", (4,), mesh_dim_names=("tp",)))  # doctest: +SKIP
        >>> logits = model(input_ids).logits  # replicated: lm_head is colwise_gather_output  # doctest: +SKIP
    """
    has_ep, has_tp = _dims(mesh)
    tp_plan = dict(getattr(model, "tp_plan", None) or {}) if tp_plan is None else dict(tp_plan)
    ep_plan = dict(getattr(model, "ep_plan", None) or {}) if ep_plan is None else dict(ep_plan)
    if has_ep and not ep_plan:
        raise ValueError(f"parallelize_hf: the mesh has an 'ep' dim but {type(model).__name__} has no ep_plan "
                         "(config.base_model_ep_plan); pass ep_plan= or use a 'tp' mesh")
    if has_tp and not tp_plan:
        raise ValueError(f"parallelize_hf: {type(model).__name__} has no tp_plan (config.base_model_tp_plan); "
                         "pass tp_plan=")
    ep_entries = _entries(model, ep_plan) if has_ep else []
    experts = {n for _, s, n, p in ep_entries if p is None and s == "ep_dispatch_experts"}
    # As transformers: tp rules on the experts (or inside them) give way to the ep plan.
    tp_entries = [e for e in (_entries(model, tp_plan) if has_tp else [])
                  if not any(e[2] == x or e[2].startswith(x + ".") for x in experts)]
    _check_tied(model, tp_entries)
    if has_tp:
        _check_heads(model, mesh["tp"].size() if mesh.ndim == 2 else mesh.size())
    tp_experts = {n for _, s, n, p in tp_entries if p is None and s == "moe_tp_experts"}

    tp_styles: Dict[str, ParallelStyle] = {}
    for source, (key, style, name, pname) in [("ep", e) for e in ep_entries] + [("tp", e) for e in tp_entries]:
        if pname is not None:  # a parameter's string: only as part of an experts module's layout
            owner = name if name in experts | tp_experts else None
            allowed = _EXPERT_PARAM_STRINGS["ep_dispatch_experts" if owner in experts else "moe_tp_experts"]
            if owner is None or style not in allowed:
                raise ValueError(f"parallelize_hf: plan string {style!r} on parameter {name}.{pname} (plan key "
                                 f"{key!r}) is not supported there; shardprop takes parameter entries only on the "
                                 f"parameters of an experts module (ep_dispatch_experts: grouped_gemm; moe_tp_experts: "
                                 f"packed_colwise, rowwise). Supported strings: {SUPPORTED}")
            continue
        if style == "replicate" or style == ("ep_dispatch_experts" if source == "ep" else "moe_tp_experts"):
            continue  # experts: laid out below, with both mesh dims
        if style not in _TP_STYLES or source == "ep":
            raise ValueError(f"parallelize_hf: plan string {style!r} on module {name!r} (plan key {key!r}) is not "
                             f"supported; supported strings: {SUPPORTED}")
        tp_styles[name] = _TP_STYLES[style]()
    if tp_styles:
        parallelize_module(model, mesh["tp"] if mesh.ndim == 2 else mesh, tp_styles, src_data_rank=src_data_rank)
    for name in sorted(experts | tp_experts):
        sub = mesh if name in experts else (mesh["tp"] if mesh.ndim == 2 else mesh)
        if sub.mesh_dim_names is None:
            raise ValueError(f"parallelize_hf: the experts {name!r} (moe_tp_experts) need a mesh dim named 'tp'")
        parallelize_module(model.get_submodule(name), sub, HFExperts(), src_data_rank=src_data_rank)
    return model


__all__ = ["GradSumOverTP", "parallelize_hf", "SUPPORTED"]
