"""The recipes tier: torchtitan's and torchtune's training recipes on 4 gloo ranks against one process.

Each recipe (``tests/recipes.py``) trains the demo's Llama 3 AdamW steps with ``fully_shard`` and
what the recipe adds: activation checkpointing in every form torch offers (``checkpoint_wrapper``
reentrant and not, ``checkpoint`` inside a unit's forward, selective AC), tensor parallelism, HSDP,
LoRA's frozen weights, per-block compile (torchtitan's ``torch.compile(block)`` and torchtune's
``block.compile()``), gradient accumulation with clipping. Losses and parameters must equal one
process on the full batch within 1e-4. Then what the recipes need around the step: checkpoints
(resume at another dp degree; LoRA adapters alone), hooks on sharded parameters, pipeline and
context parallelism. ``bench/recipes.py`` compares the same recipes with torch's own stack.

The compiled TP recipe is in the release tier (``make test-release``, or ``SHARDPROP_SLOW=1``).
"""
import tempfile

import pytest
import torch
import torch.distributed as dist

from tests import recipes
from tests.rankpool import run_on_ranks

# The compiled TP recipe runs in the release tier.
RECIPES = {name: pytest.param(r, marks=pytest.mark.release) if name == "tp+fsdp+selective-ac+compile" else r
           for name, r in recipes.RECIPES.items()}


def _train(recipe):
    return recipes.train(recipe)


@pytest.mark.parametrize("recipe", list(RECIPES.values()), ids=list(RECIPES))
def test_recipe_matches_one_process(recipe):
    want = recipes.reference(recipe)
    for rank, got in enumerate(run_on_ranks(4, _train, recipe, timeout=240)):
        problems = recipes.compare(got, want)
        assert not problems, f"rank {rank}: " + "; ".join(problems[:6])


# ---------------------------------------------------------------- collectives and frozen parameters
def _counts(recipe):
    """Collectives of the second step (by kind: count, bytes) and which sharded parameters got a gradient."""
    from shardprop import comm_counter
    from shardprop.demo.model import lm_loss, synthetic_batch
    model, dp = recipes.build(recipe)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(2):
        x, y = (recipes._rows(t, dp) for t in synthetic_batch(recipes.cfg(), recipes.BATCH, step, 0))
        with comm_counter() as c:
            lm_loss(model(x), y).backward()
        with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)  # local shards
    return dict(c.counts), with_grad, {n for n, p in model.named_parameters() if p.requires_grad}, trainable


def test_ac_gathers_each_unit_once_more_for_backward_only():
    # 3 units (2 blocks + root). As torch's fully_shard: forward gathers each, backward gathers the
    # blocks again (the root keeps its parameters) and the recomputation reuses those: 5 all-gathers.
    for counts, _, _, _ in run_on_ranks(4, _counts, dict(ac="full")):
        assert counts["all_gather"][0] == 5, counts
        assert counts["reduce_scatter"][0] == 3, counts


def test_frozen_parameters_get_no_gradient_and_no_reduce_scatter_bytes():
    for counts, with_grad, trainable_names, trainable in run_on_ranks(4, _counts, dict(lora=True, ac="full")):
        assert with_grad == trainable_names and all("lora_" in n for n in with_grad), sorted(with_grad)[:4]
        # The root unit (embedding, norm, output) is all frozen: no reduce-scatter for it. Each block
        # reduce-scatters its adapters' gradients alone (padded pieces: at most one row more per rank).
        n, nbytes = counts["reduce_scatter"]
        assert n == 2, counts
        assert nbytes <= 4 * 4 * (trainable + 4 * 64), (nbytes, trainable)


# ---------------------------------------------------------------- hooks on sharded parameters
def _hooked(sharded: bool):
    """Tensor hooks halve every gradient; a post-accumulate-grad hook steps SGD per parameter (optimizer in backward)."""
    from shardprop.demo.model import Llama, lm_loss, synthetic_batch
    model = Llama(recipes.cfg(), 0)
    dp = None
    if sharded:
        from shardprop import fully_shard, init_device_mesh
        dp = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        for block in model.layers:
            fully_shard(block, mesh=dp)
        fully_shard(model, mesh=dp)
    seen = []

    def step_now(p):
        seen.append(p)
        with torch.no_grad():
            p.sub_(0.1 * p.grad)
        p.grad = None

    for p in model.parameters():
        p.register_hook(lambda g: g * 0.5)
        p.register_post_accumulate_grad_hook(step_now)
    losses = []
    for step in range(2):
        x, y = synthetic_batch(recipes.cfg(), recipes.BATCH, step, 0)
        if dp is not None:
            x, y = recipes._rows(x, dp), recipes._rows(y, dp)
        loss = lm_loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
    params = {n: p.full_tensor() if sharded else p.detach().clone() for n, p in model.named_parameters()}
    return len(seen), params


def test_tensor_and_post_accumulate_hooks_on_sharded_parameters():
    n_ref, want = _hooked(False)
    for n, got in run_on_ranks(4, _hooked, True):
        assert n == n_ref  # every parameter's hook ran once per step
        for name, p in got.items():
            torch.testing.assert_close(p, want[name], atol=1e-5, rtol=0, msg=name)


# ---------------------------------------------------------------- checkpoints inside the recipes
def _resume_other_dp(root):
    """torchtitan: TP + FSDP + AC on 2x2 for 2 steps, DCP save; resume on dp=4 (FSDP + AC) for the third."""
    import torch.distributed.checkpoint as dcp
    import shardprop
    first = dict(mesh="2x2", ac="full")
    model, dp = recipes.build(first)
    opt = recipes._optimizer(model)
    losses = recipes.run_steps(first, model, opt, dp, range(2))
    dcp.save({"model": model.state_dict(), "optim": shardprop.get_optimizer_state_dict(model, opt)},
             checkpoint_id=root)
    second = dict(ac="full")
    model2, dp2 = recipes.build(second)
    opt2 = recipes._optimizer(model2)
    sd = {"model": model2.state_dict(), "optim": shardprop.get_optimizer_state_dict(model2, opt2)}
    dcp.load(sd, checkpoint_id=root)
    shardprop.set_optimizer_state_dict(model2, opt2, sd["optim"])
    losses += recipes.run_steps(second, model2, opt2, dp2, range(2, 3))
    return losses, recipes.full_params(model2)


def _adapters_only(root):
    """torchtune: LoRA + FSDP + AC for 2 steps, save the adapters (and their optimizer state) alone; a
    fresh model (base weights from their own source) loads them and trains the third step."""
    import torch.distributed.checkpoint as dcp
    import shardprop
    from shardprop.demo.recipes import adapter_state_dict
    recipe = dict(lora=True, ac="full")
    model, dp = recipes.build(recipe)
    opt = recipes._optimizer(model)
    losses = recipes.run_steps(recipe, model, opt, dp, range(2))
    adapters = adapter_state_dict(model.state_dict())
    full_keys = len(model.state_dict())
    dcp.save({"model": adapters, "optim": shardprop.get_optimizer_state_dict(model, opt)}, checkpoint_id=root)
    model2, dp2 = recipes.build(recipe)
    opt2 = recipes._optimizer(model2)
    sd = {"model": adapter_state_dict(model2.state_dict()), "optim": shardprop.get_optimizer_state_dict(model2, opt2)}
    dcp.load(sd, checkpoint_id=root)
    model2.load_state_dict(sd["model"], strict=False)
    shardprop.set_optimizer_state_dict(model2, opt2, sd["optim"])
    losses += recipes.run_steps(recipe, model2, opt2, dp2, range(2, 3))
    return losses, recipes.full_params(model2), len(adapters), full_keys


def test_torchtitan_recipe_resumes_at_another_dp_degree():
    want = recipes.reference(dict(ac="full"))
    root = tempfile.mkdtemp(prefix="recipe_resume_")
    for got in run_on_ranks(4, _resume_other_dp, root, timeout=240):
        assert not recipes.compare(got, want), recipes.compare(got, want)[:6]


def test_torchtune_recipe_saves_and_loads_adapters_alone():
    want = recipes.reference(dict(lora=True, ac="full"))
    root = tempfile.mkdtemp(prefix="recipe_lora_")
    for losses, params, n_adapters, n_all in run_on_ranks(4, _adapters_only, root, timeout=240):
        assert n_adapters == 4 * recipes.cfg().n_layers < n_all  # lora_a, lora_b of wq and wv per block
        assert not recipes.compare((losses, params), want), recipes.compare((losses, params), want)[:6]


# ---------------------------------------------------------------- pipeline and context parallelism
def _pipeline(inner: str):
    """torch.distributed.pipelining (GPipe, 2 micro-batches) over "pp", with TP or FSDP inside each stage."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
    from shardprop import fully_shard, init_device_mesh, parallelize_module
    from shardprop.demo.model import Llama, lm_loss, synthetic_batch, tp_plan
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", inner))
    stage_index = mesh["pp"].get_local_rank()
    full = Llama(recipes.cfg(), 0)
    stage = recipes.PipelineHalf(full, stage_index)
    if inner == "tp":
        plan = {k: v for k, v in tp_plan().items() if recipes.plan_key_matches(stage, k)}
        parallelize_module(stage, mesh["tp"], plan)
    else:
        for block in stage.layers.values():
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(stage, mesh=mesh["dp"])
    pipe = PipelineStage(stage, stage_index, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = ScheduleGPipe(pipe, n_microbatches=2, loss_fn=lm_loss)
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-2, weight_decay=0.01)
    losses = []
    for step in range(recipes.STEPS):
        x, y = synthetic_batch(recipes.cfg(), recipes.BATCH, step, 0)
        if inner == "dp":
            x, y = recipes._rows(x, mesh["dp"]), recipes._rows(y, mesh["dp"])
        step_losses = []
        if stage_index == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=step_losses)
        opt.step()
        opt.zero_grad()
        t = torch.stack(step_losses).mean().reshape(1) if step_losses else torch.zeros(1)
        dist.all_reduce(t)
        losses.append(t.item() / 2)  # the two last-stage ranks
    params = {n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for n, p in stage.named_parameters()}
    return losses, params


@pytest.mark.parametrize("inner", ["tp", "dp"])
def test_pipeline_stages_with_tp_or_fsdp_inside(inner):
    ref_losses, ref_params = recipes.reference({})
    out = run_on_ranks(4, _pipeline, inner, timeout=240)
    for losses, _ in out:
        assert losses == pytest.approx(ref_losses, abs=1e-4)
    params = {}
    for _, p in out:
        params.update(p)
    assert set(params) == set(ref_params)
    for n, p in params.items():
        torch.testing.assert_close(p, ref_params[n], atol=1e-4, rtol=0, msg=n)


def _cp_fsdp_ac():
    """Context parallelism over "cp" (2 ranks) x FSDP over all 4 ranks, with activation checkpointing."""
    import dataclasses
    import shardprop
    from shardprop.demo.model import Llama, cp_buffers, synthetic_batch
    from shardprop.demo.recipes import apply_ac, strip_wrapper_names
    cfg = dataclasses.replace(recipes.cfg(), sdpa=True)
    mesh = shardprop.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    flat = shardprop.init_device_mesh("cpu", (4,), mesh_dim_names=("dp_cp",))
    model = apply_ac(Llama(cfg, 0), "full")
    for block in model.layers:
        shardprop.fully_shard(block, mesh=flat)
    shardprop.fully_shard(model, mesh=flat)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    losses = []
    for step in range(recipes.STEPS):
        x, y = (recipes._rows(t, mesh["dp"]) for t in synthetic_batch(cfg, recipes.BATCH, step, 0))
        buffers, dims = cp_buffers(model, x, y)
        with shardprop.context_parallel(mesh["cp"], buffers=buffers, buffer_seq_dims=dims, no_restore_buffers={x, y}):
            loss = recipes.one_step({}, model, opt, x, y)
        losses.append(recipes.mean_over_ranks(loss))
    return losses, {strip_wrapper_names(n): p.full_tensor() for n, p in model.named_parameters()}


def test_context_parallel_with_fsdp_and_ac():
    import dataclasses
    from shardprop.demo.model import Llama, synthetic_batch
    cfg = dataclasses.replace(recipes.cfg(), sdpa=True)
    ref = Llama(cfg, 0)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    ref_losses = [recipes.one_step({}, ref, opt, *synthetic_batch(cfg, recipes.BATCH, step, 0)).item()
                  for step in range(recipes.STEPS)]
    want = (ref_losses, {n: p.detach() for n, p in ref.named_parameters()})
    for got in run_on_ranks(4, _cp_fsdp_ac, timeout=240):
        assert not recipes.compare(got, want), recipes.compare(got, want)[:6]


# ---------------------------------------------------------------- the demo's recipe flags
def _demo(argv):
    from shardprop.demo.train import parser, rank_main
    summary = rank_main(parser().parse_args(argv))
    return summary["ok"], summary["losses"]


@pytest.mark.parametrize("flags", [["--fsdp", "--ac", "selective"], ["--fsdp", "--mesh", "4", "--lora", "4", "--ac", "full"]],
                         ids=["tp+fsdp+selective-ac", "lora+fsdp+ac"])
def test_demo_recipe_flags_match_one_process(flags):
    small = ["--dim", "32", "--layers", "2", "--heads", "4", "--vocab", "64", "--seq", "8", "--batch", "8", "--steps", "3"]
    ok, losses = run_on_ranks(4, _demo, small + flags, timeout=180)[0]
    assert ok and len(losses) == 3
