"""The training recipes of torchtitan and torchtune, as rank jobs for the recipes tier and bench/recipes.py.

One job builds the demo's Llama as a recipe says, on shardprop or on torch's own stack
(``torch.distributed.tensor`` + torch's ``fully_shard``: the reference, allowed in tests),
trains it a few AdamW steps on this rank's rows of the batch and returns the losses (averaged
over the data-parallel ranks) and the full parameters, named as in one process. The one-process
run of the same recipe (AC changes no numbers; LoRA's frozen weights do) is :func:`reference`.

A recipe is a dict: ``mesh`` ("dp4", "2x2" = dp x tp, "hsdp" = replicate x shard), ``ac``
(None or a mode of ``shardprop.demo.recipes.AC_MODES``), ``shard_inner`` (``fully_shard`` the block
inside its checkpoint wrapper, as torchtune does), ``lora`` (bool), ``compile`` (None,
"wrap" or "module": see :func:`compile_blocks`; ``backend``, default aot_eager), ``accumulate`` (two micro-batches, the
first without gradient sync, then ``clip_grad_norm_``).
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

STEPS = 3
BATCH = 8

# The recipes, by the name the tier, the bench and the closing notes use.
RECIPES = {
    "fsdp+ac": dict(ac="full"),
    "fsdp+ac-reentrant": dict(ac="reentrant"),
    "fsdp+checkpoint-inside-unit": dict(ac="inner"),
    "fsdp+selective-ac": dict(ac="selective"),
    "tp+fsdp+ac": dict(mesh="2x2", ac="full"),
    "tp+fsdp+selective-ac": dict(mesh="2x2", ac="selective"),
    "hsdp+ac": dict(mesh="hsdp", ac="full"),
    "lora+fsdp": dict(lora=True),
    "lora+fsdp+ac": dict(lora=True, ac="full"),
    "lora+ac-around-fsdp-unit(torchtune order)": dict(lora=True, ac="full", shard_inner=True),
    "ac-reentrant-around-fsdp-unit": dict(ac="reentrant", shard_inner=True),
    "tp+fsdp+accumulate+clip": dict(mesh="2x2", accumulate=True),
    "fsdp+ac+compile(torchtitan)": dict(ac="full", compile="wrap"),
    "lora+fsdp+ac+compile(torchtune)": dict(lora=True, ac="full", compile="module"),
    "tp+fsdp+selective-ac+compile": dict(mesh="2x2", ac="selective", compile="wrap"),
}


def cfg(**size):
    """The model of the recipes: tiny by default; ``size`` overrides (the bench's larger model)."""
    from shardprop.demo.model import LlamaConfig
    return LlamaConfig(**{**dict(dim=32, n_layers=2, n_heads=4, vocab_size=64, seq_len=8), **size})


def _engine(engine: str) -> SimpleNamespace:
    if engine == "shardprop":
        import shardprop as P
        return SimpleNamespace(init_device_mesh=P.init_device_mesh, fully_shard=P.fully_shard,
                               parallelize_module=P.parallelize_module, Shard=P.Shard, Replicate=P.Replicate,
                               ColwiseParallel=P.ColwiseParallel, RowwiseParallel=P.RowwiseParallel,
                               SequenceParallel=P.SequenceParallel, PrepareModuleInput=P.PrepareModuleInput)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    return SimpleNamespace(init_device_mesh=init_device_mesh, fully_shard=fully_shard,
                           parallelize_module=parallelize_module, Shard=Shard, Replicate=Replicate,
                           ColwiseParallel=ColwiseParallel, RowwiseParallel=RowwiseParallel,
                           SequenceParallel=SequenceParallel, PrepareModuleInput=PrepareModuleInput)


def build(recipe: dict, engine: str = "shardprop", config=None):
    """(model, data-parallel mesh) for ``recipe`` on this rank; data-parallel rows are ``dp.size()`` pieces."""
    from shardprop.demo.model import Llama, tp_plan
    from shardprop.demo.recipes import add_lora, apply_ac
    E = _engine(engine)
    model = Llama(config or cfg(), 0)
    if recipe.get("lora"):
        add_lora(model, rank=4)
    kind = recipe.get("mesh", "dp4")
    if kind == "2x2":
        mesh = E.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = E.parallelize_module(model, mesh["tp"], tp_plan(E))
        dp_mesh = mesh["dp"]
    elif kind == "hsdp":
        dp_mesh = E.init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    else:
        dp_mesh = E.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp",))
    apply_ac(model, recipe.get("ac"))
    compile_blocks(model, recipe)
    for block in model.layers:
        # torchtune's order: the unit is the block inside its checkpoint wrapper (the recomputation
        # then runs the unit's hooks again, inside backward); torchtitan's: the wrapper is the unit.
        inner = getattr(block, "_checkpoint_wrapped_module", None)
        E.fully_shard(inner if recipe.get("shard_inner") and inner is not None else block, mesh=dp_mesh)
    E.fully_shard(model, mesh=dp_mesh)
    return model, dp_mesh


def compile_blocks(model, recipe: dict) -> None:
    """Per-block compile as torchtitan does it ("wrap": ``torch.compile(block, fullgraph=True)`` replaces
    the block) or as torchtune does it ("module": ``block.compile()`` in place, hooks included)."""
    how, backend = recipe.get("compile"), recipe.get("backend", "aot_eager")
    if how:  # the rank pool outlives a job: code compiled for an earlier job's model must not be reused
        torch._dynamo.reset()
    for i, block in enumerate(model.layers):
        if how == "wrap":
            model.layers[i] = torch.compile(block, backend=backend, fullgraph=True)
        elif how == "module":
            block.compile(backend=backend)


def _rows(t, dp_mesh):
    # A 2-d data-parallel mesh (HSDP) spans every rank in order: its flat index is the rank.
    i = dp_mesh.get_local_rank() if dp_mesh.ndim == 1 else dist.get_rank()
    return t.chunk(dp_mesh.size())[i]


def _optimizer(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)


def _full(p):
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()


def run_steps(recipe: dict, model, opt, dp, steps) -> list:
    """Train ``model`` on the given steps' batches (this rank's rows of ``dp``); the losses averaged over all ranks."""
    from shardprop.demo.model import synthetic_batch
    losses = []
    for step in steps:
        x, y = (_rows(t, dp) for t in synthetic_batch(cfg(), BATCH, step, 0))
        losses.append(mean_over_ranks(one_step(recipe, model, opt, x, y)))
    return losses


def one_step(recipe: dict, model, opt, x, y):
    """One optimizer step on ``(x, y)``; its loss. With ``accumulate``: two half micro-batches (the first
    without gradient sync where the model has the switch), clipping at norm 1, then the loss of the whole."""
    from shardprop.demo.model import lm_loss
    if recipe.get("accumulate"):
        sync = getattr(model, "set_requires_gradient_sync", None)
        h = x.shape[0] // 2
        for last, part in ((False, slice(0, h)), (True, slice(h, None))):
            if sync is not None:
                sync(last)
            (lm_loss(model(x[part]), y[part]) / 2).backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        with torch.no_grad():
            loss = lm_loss(model(x), y)
    else:
        loss = lm_loss(model(x), y)
        loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def mean_over_ranks(loss) -> float:
    """The mean over every rank of a per-rank loss."""
    t = loss.detach().reshape(1).clone()
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def full_params(model) -> dict:
    """{name as in one process: full parameter}."""
    from shardprop.demo.recipes import strip_wrapper_names
    return {strip_wrapper_names(n): _full(p) for n, p in model.named_parameters()}


def train(recipe: dict, engine: str = "shardprop", steps: int = STEPS):
    """(losses, {name: full parameter}) after ``steps`` AdamW steps of ``recipe`` on this rank."""
    model, dp = build(recipe, engine)
    opt = _optimizer(model)
    losses = run_steps(recipe, model, opt, dp, range(steps))
    return losses, full_params(model)


class PipelineHalf(torch.nn.Module):
    """One of two pipeline stages of the demo's Llama: embedding + block 0, or block 1 + norm + output.

    Blocks keep their global index as their name (a ModuleDict), so parameter names are those of one process.
    """

    def __init__(self, full, stage: int) -> None:
        super().__init__()
        n = len(full.layers)
        own = range(0, n // 2) if stage == 0 else range(n // 2, n)
        self.tok_embeddings = full.tok_embeddings if stage == 0 else None
        self.layers = torch.nn.ModuleDict({str(i): full.layers[i] for i in own})
        self.norm = full.norm if stage == 1 else None
        self.output = full.output if stage == 1 else None

    def forward(self, h):
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        for block in self.layers.values():
            h = block(h)
        return self.output(self.norm(h)) if self.output is not None else h


def plan_key_matches(module, key: str) -> bool:
    """Whether a plan key (``*`` wildcards) names a submodule of ``module``."""
    import fnmatch
    return any(fnmatch.fnmatchcase(name, key) for name, _ in module.named_modules())


def reference(recipe: dict, steps: int = STEPS):
    """The same recipe in one process on the full batch."""
    from shardprop.demo.model import Llama, synthetic_batch
    from shardprop.demo.recipes import add_lora, apply_ac, strip_wrapper_names
    model = Llama(cfg(), 0)
    if recipe.get("lora"):
        add_lora(model, rank=4)
    apply_ac(model, recipe.get("ac"))
    opt = _optimizer(model)
    losses = [one_step(recipe, model, opt, *synthetic_batch(cfg(), BATCH, step, 0)).item() for step in range(steps)]
    return losses, {strip_wrapper_names(n): p.detach().clone() for n, p in model.named_parameters()}


def compare(got, want, atol=1e-4):
    """Problems (empty when ``got`` equals ``want``: losses and parameters within ``atol``)."""
    problems = []
    (losses, params), (ref_losses, ref_params) = got, want
    if any(abs(a - b) > atol for a, b in zip(losses, ref_losses)):
        problems.append(f"losses {losses} != {ref_losses}")
    if set(params) != set(ref_params):
        problems.append(f"parameter names differ: {sorted(set(params) ^ set(ref_params))[:6]}")
    for n in sorted(set(params) & set(ref_params)):
        d = (params[n].float() - ref_params[n].float()).abs().max().item() if params[n].numel() else 0.0
        if params[n].shape != ref_params[n].shape or d > atol:
            problems.append(f"{n}: max abs diff {d:.3g}")
    return problems
