"""The space of training recipes the recipe differential draws from, and one rank job that trains a recipe.

A recipe is a dict over :data:`AXES`: the parallelism (``tp``: TP over 4 ranks; ``tp+fsdp``: TP on "tp"
x ``fully_shard`` on "dp", 2x2; ``fsdp``: dp=4; ``ep``: a mixture-of-experts layer, experts over 4 ranks;
``cp``: context parallelism over "cp" x ``fully_shard`` over all 4), the TP plan (``sp``: torchtitan's,
sequence parallel between blocks; ``megatron``: replicated activations, the row-parallel all-reduce),
activation checkpointing (none, full, reentrant, inside the unit, selective under one of
:data:`POLICIES`), compile (eager, or torchtitan's per-block ``torch.compile``), precision (fp32, bf16
autocast), frozen parameters and hooks (forward pre-hooks on every block, tensor hooks on every
parameter). :func:`train` runs one recipe on this rank with the fast paths as asked; :func:`reference`
runs it in one process. The recipe differential (``tests/test_recipe_differential.py``) compares both
fast-path settings with each other and with one process.
"""
from __future__ import annotations

import collections
import dataclasses
import functools

import torch
import torch.distributed as dist
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from tests import recipes

_MM = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")
_SAVE, _RECOMPUTE = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE


def _save_matmuls(ctx, op, *args, **kwargs):
    return _SAVE if op in _MM else _RECOMPUTE


def _save_everything(ctx, op, *args, **kwargs):
    return _SAVE


def _save_nothing(ctx, op, *args, **kwargs):
    return _RECOMPUTE


def _save_all_but_matmuls(ctx, op, *args, **kwargs):
    return _RECOMPUTE if op in _MM else _SAVE


def _save_collectives(ctx, op, *args, **kwargs):
    return _SAVE if op.namespace in _COLLECTIVE_NAMESPACES else _RECOMPUTE


# torchtitan's op-list policy: the compute ops below saved, every second mm recomputed (its counter is per
# checkpoint call, and counts the forward and the recomputation separately).
_TORCHTITAN_SAVE = {torch.ops.aten.mm.default, torch.ops.aten.max.default,
                    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
                    torch.ops.aten._scaled_dot_product_efficient_attention.default,
                    torch.ops._c10d_functional.reduce_scatter_tensor.default}


def _torchtitan_policy(meta, ctx, op, *args, **kwargs):
    key = "recompute_mm" if ctx.is_recompute else "forward_mm"
    if op == torch.ops.aten.mm.default:
        meta[key] += 1
    save = op in _TORCHTITAN_SAVE and not (op == torch.ops.aten.mm.default and meta[key] % 2 == 0)
    return _SAVE if save else _RECOMPUTE


def _torchtitan_contexts():
    return create_selective_checkpoint_contexts(functools.partial(_torchtitan_policy, collections.defaultdict(int)))


def _contexts(policy):
    return functools.partial(create_selective_checkpoint_contexts, policy)


# name -> context_fn for torch.utils.checkpoint (a new pair of contexts per call)
POLICIES = {
    "save-matmuls": _contexts(_save_matmuls),
    "save-everything": _contexts(_save_everything),
    "save-nothing": _contexts(_save_nothing),
    "save-all-but-matmuls": _contexts(_save_all_but_matmuls),
    "save-collectives": _contexts(_save_collectives),
    "torchtitan-op-list": _torchtitan_contexts,
}

AXES = {
    "par": ("tp", "tp+fsdp", "fsdp", "ep", "cp"),
    "plan": ("sp", "megatron"),
    "ac": (None, "full", "reentrant", "inner", "selective"),
    "policy": tuple(POLICIES),
    "compile": (None, "wrap"),
    "dtype": ("fp32", "bf16"),
    "frozen": (False, True),
    "hooks": (False, True),
}
# Which recipe elements reach each registered fast path (shardprop.dispatch.fast_paths.REGISTRY); a fast
# path registered without an entry here fails the differential's coverage test.
FAST_PATHS_REACHED_BY = {
    "linear": {"par": ("tp", "tp+fsdp")},
    "embedding": {"par": ("tp", "tp+fsdp")},
    "sp_norm": {"par": ("tp", "tp+fsdp"), "plan": ("sp",)},
    "grad_sync": {"par": ("tp", "tp+fsdp"), "plan": ("sp",)},
    "optimizer_foreach": {"par": AXES["par"]},
    "detach": {"par": AXES["par"]},
}


def describe(recipe: dict) -> str:
    """A short name for a recipe, for test ids and closing notes."""
    parts = [recipe["par"]]
    if recipe["par"] in ("tp", "tp+fsdp"):
        parts.append(recipe["plan"])
    if recipe["ac"]:
        parts.append(f"sac:{recipe['policy']}" if recipe["ac"] == "selective" else f"ac:{recipe['ac']}")
    parts += [x for x, on in (("compile", recipe["compile"]), ("bf16", recipe["dtype"] == "bf16"),
                              ("frozen", recipe["frozen"]), ("hooks", recipe["hooks"])) if on]
    return "+".join(parts)


# ---------------------------------------------------------------- models
class MoEModel(torch.nn.Module):
    """A residual mixture-of-experts layer: ``x + moe(x)``; ``layers`` holds it, so AC wraps it like a block."""

    def __init__(self) -> None:
        super().__init__()
        from shardprop.demo.moe import MoE
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList([MoE(dim=16, hidden=24, num_experts=8, top_k=2)])

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def _config(recipe):
    return dataclasses.replace(recipes.cfg(), sdpa=recipe["par"] == "cp")


def _model(recipe):
    """The recipe's model before any parallelism (the same on every rank and in one process)."""
    if recipe["par"] == "ep":
        model = MoEModel()
        if recipe["frozen"]:
            model.layers[0].router.requires_grad_(False)
    else:
        from shardprop.demo.model import Llama
        model = Llama(_config(recipe), 0)
        if recipe["frozen"]:  # a frozen embedding and frozen column-parallel weights beside trainable ones
            model.tok_embeddings.requires_grad_(False)
            for block in model.layers:
                block.attention.wq.requires_grad_(False)
    if recipe["hooks"]:
        for layer in model.layers:
            layer.register_forward_pre_hook(lambda m, args: (args[0] * 0.5,) + tuple(args[1:]))
    return model


def _hook_parameters(model, recipe):
    if recipe["hooks"]:
        for p in model.parameters():
            if p.requires_grad:
                p.register_hook(lambda g: g * 0.5)


def megatron_plan(P) -> dict:
    """Megatron TP without sequence parallelism: activations replicated, row-parallel outputs all-reduced."""
    R = P.Replicate()
    plan = {"tok_embeddings": P.RowwiseParallel(input_layouts=R), "output": P.ColwiseParallel(output_layouts=R)}
    for lin in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
        plan[f"layers.*.{lin}"] = P.ColwiseParallel()
    for lin in ("attention.wo", "feed_forward.w2"):
        plan[f"layers.*.{lin}"] = P.RowwiseParallel()
    return plan


def _ac_and_compile(model, recipe):
    from shardprop.demo.recipes import apply_ac
    apply_ac(model, recipe["ac"], POLICIES[recipe["policy"]] if recipe["ac"] == "selective" else None)
    recipes.compile_blocks(model, recipe)


class _Run:
    """How one recipe trains on this rank: the model, the batch rows, the context of a step, the loss."""

    def __init__(self, recipe: dict, distributed: bool) -> None:
        self.recipe, self.distributed = recipe, distributed
        self.model = _model(recipe)
        self.rows, self.context, self.split = None, None, 1
        if distributed:
            self._parallelize()
        else:
            _ac_and_compile(self.model, recipe)
        _hook_parameters(self.model, recipe)
        params = [p for p in self.model.parameters() if p.requires_grad]
        # bf16: SGD, so a rounding difference in a gradient stays a rounding difference in the parameter
        # (AdamW's normalised step turns the sign of a near-zero gradient into a whole step of lr).
        self.opt = torch.optim.SGD(params, lr=0.1) if recipe["dtype"] == "bf16" else \
            torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)

    def _parallelize(self):
        import shardprop as P
        from shardprop.demo.model import tp_plan
        recipe, model = self.recipe, self.model
        par = recipe["par"]
        plan = megatron_plan(P) if recipe["plan"] == "megatron" else tp_plan()
        units = None
        if par == "tp":
            P.parallelize_module(model, P.init_device_mesh("cpu", (4,), mesh_dim_names=("tp",)), plan)
        elif par == "tp+fsdp":
            mesh = P.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            P.parallelize_module(model, mesh["tp"], plan)
            units, self.rows = mesh["dp"], (mesh["dp"].get_local_rank(), 2)
        elif par == "fsdp":
            units = P.init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
            self.rows = (dist.get_rank(), 4)
        elif par == "cp":
            mesh = P.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
            units = P.init_device_mesh("cpu", (4,), mesh_dim_names=("dp_cp",))
            self.rows, self.context = (mesh["dp"].get_local_rank(), 2), mesh["cp"]
        else:  # ep: tokens split over the ranks, the plain parameters' gradients summed after backward
            mesh = P.init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
            P.parallelize_module(model.layers[0].experts, mesh, P.ExpertParallel())
            self.rows = (dist.get_rank(), 4)
        _ac_and_compile(model, recipe)
        if units is not None:
            for block in model.layers:
                P.fully_shard(block, mesh=units)
            P.fully_shard(model, mesh=units)

    def batch(self, step):
        if self.recipe["par"] == "ep":
            from shardprop.demo.moe import synthetic_batch
            x, y = synthetic_batch(step, 4, 6, 16)
        else:
            from shardprop.demo.model import synthetic_batch
            x, y = synthetic_batch(_config(self.recipe), recipes.BATCH, step, 0)
        if self.rows is not None:
            i, n = self.rows
            x, y = x.chunk(n)[i], y.chunk(n)[i]
        return x, y

    def step(self, step) -> float:
        import contextlib
        x, y = self.batch(step)
        ctx = contextlib.nullcontext()
        if self.context is not None:
            import shardprop as P
            from shardprop.demo.model import cp_buffers
            buffers, dims = cp_buffers(self.model, x, y)
            ctx = P.context_parallel(self.context, buffers=buffers, buffer_seq_dims=dims, no_restore_buffers={x, y})
        with ctx:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.recipe["dtype"] == "bf16"):
                out = self.model(x)
            if self.recipe["par"] == "ep":  # normalised by the global count: the ranks' losses sum to the whole
                loss = ((out.float() - y) ** 2).sum() / (y.numel() * (4 if self.distributed else 1))
            else:
                from shardprop.demo.model import lm_loss
                loss = lm_loss(out.float(), y)
            loss.backward()
        if self.distributed and self.recipe["par"] == "ep":
            for p in self.model.parameters():
                if p.grad is not None and not hasattr(p.grad, "placements"):
                    dist.all_reduce(p.grad)
            whole = loss.detach().clone()
            dist.all_reduce(whole)
            loss_value = whole.item()
        else:
            loss_value = recipes.mean_over_ranks(loss) if self.distributed else loss.item()
        self.opt.step()
        self.opt.zero_grad()
        return loss_value

    def params(self) -> dict:
        from shardprop.demo.recipes import strip_wrapper_names
        return {strip_wrapper_names(n): (p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone())
                for n, p in self.model.named_parameters()}


def train(recipe: dict, fast: bool, steps: int = recipes.STEPS):
    """(losses, {name: full parameter}) of ``recipe`` on this rank, the fast paths on or off."""
    import shardprop
    with shardprop.fast_paths(fast):
        run = _Run(recipe, distributed=True)
        return [run.step(s) for s in range(steps)], run.params()


def train_both(cases: list) -> list:
    """For each recipe: (fast paths on, fast paths off) results, or the error each raised (as text)."""
    out = []
    for recipe in cases:
        pair = []
        for fast in (True, False):
            try:
                pair.append(train(recipe, fast))
            except Exception as e:  # noqa: BLE001 (reported per recipe; an error on every rank, no collective left)
                pair.append(f"{type(e).__name__}: {e}"[:400])
        out.append(tuple(pair))
    return out


def reference(recipe: dict, steps: int = recipes.STEPS):
    """The recipe in one process on the whole batch (AC and compile change no numbers)."""
    run = _Run(recipe, distributed=False)
    return [run.step(s) for s in range(steps)], run.params()
