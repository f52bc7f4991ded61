"""DCP across expert-parallel layouts: save at ep=4, load at ep=2, train on like an uninterrupted run.

The model (``tests/test_expert_fsdp.Net``: two DeepSeek-style MoE blocks and a head) trains
2 AdamW steps with its experts ``Shard(0)`` over ep=4 (every other parameter replicated, its
gradient all-reduced by hand), then saves model and optimizer state with DCP
(``shardprop.get_optimizer_state_dict``). A fresh model on a 2x2 mesh loads it and trains 2
more steps, in one of two layouts:

* ``ep2+fsdp``: experts over ep=2 and ``fully_shard``-ed over the ranks with the same ep
  coordinate (``[S(1), S(0)]`` on (efsdp, ep)), the rest ``fully_shard``-ed over all 4 ranks;
* ``ep2+replicated``: experts over ep=2, replicated over the other dim (their gradient
  all-reduced over it), the rest replicated.

Losses of all 4 steps and the parameters at the end equal one process running the 4 steps.
"""
import copy
import tempfile

import pytest
import torch
import torch.distributed as dist

from tests.rankpool import run_on_ranks
from tests.test_expert_fsdp import Net, _batch

pytestmark = pytest.mark.timeout(240)
ATOL = 1e-4


def _optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _ep_model(mesh, ep_dim):
    """Net with each block's experts ExpertParallel over ``mesh[ep_dim]`` (same initial values everywhere)."""
    from shardprop import ExpertParallel, parallelize_module
    torch.manual_seed(0)
    model = Net()
    for layer in model.layers:
        parallelize_module(layer.experts, mesh[ep_dim], ExpertParallel())
    return model


def _manual_step(model, opt, step, efsdp_group):
    """One step with hand-written data parallelism: loss normalised by the global count, gradients summed.

    Expert gradients already sum their ep group's tokens; they are summed over the ranks with the
    same ep coordinate (``efsdp_group``, none at ep=4); every other gradient over all ranks.
    """
    x, y = _batch(step)
    me = dist.get_rank()
    loss = ((model(x.chunk(4)[me]) - y.chunk(4)[me]) ** 2).sum() / y.numel()
    loss.backward()
    for name, p in model.named_parameters():
        if ".experts." in name:
            if efsdp_group is not None:
                dist.all_reduce(p.grad.to_local(), group=efsdp_group)
        else:
            dist.all_reduce(p.grad)
    opt.step()
    opt.zero_grad()
    whole = loss.detach().clone()
    dist.all_reduce(whole)
    return whole.item()


def _fsdp_step(model, opt, step):
    """One step under fully_shard: this rank's mean loss (FSDP averages the gradients)."""
    x, y = _batch(step)
    me = dist.get_rank()
    loss = ((model(x.chunk(4)[me]) - y.chunk(4)[me]) ** 2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    whole = loss.detach().clone()
    dist.all_reduce(whole)
    return whole.item() / 4


def _full(p):
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach()


def _resume(root, layout):
    import torch.distributed.checkpoint as dcp
    import shardprop
    from shardprop import fully_shard, init_device_mesh
    torch.manual_seed(0)
    ref = Net()
    ref_opt = _optimizer(ref)
    ref_losses = []
    for step in range(4):
        x, y = _batch(step)
        loss = ((ref(x) - y) ** 2).mean()
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())

    # ep=4: the first two steps, then the checkpoint.
    ep4 = _ep_model(init_device_mesh("cpu", (4,), mesh_dim_names=("ep",)), "ep")
    opt = _optimizer(ep4)
    losses = [_manual_step(ep4, opt, step, None) for step in range(2)]
    dcp.save({"model": ep4.state_dict(), "optim": shardprop.get_optimizer_state_dict(ep4, opt)}, checkpoint_id=root)
    saved = {n: tuple(p.placements) for n, p in ep4.named_parameters() if ".experts." in n}

    # ep=2 on a 2x2 mesh (rank = 2 * efsdp + ep); a fresh model (other initial values: the load must win).
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
    torch.manual_seed(1)
    ep2 = _ep_model(mesh, "ep")
    with torch.no_grad():
        for p in ep2.parameters():
            (p.to_local() if hasattr(p, "to_local") else p).mul_(-1.0)
    if layout == "ep2+fsdp":
        dp = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        for layer in ep2.layers:
            fully_shard(layer.experts, mesh=mesh["efsdp"])
            layer.experts.set_gradient_divide_factor(dp.size())
            fully_shard(layer, mesh=dp)
        fully_shard(ep2, mesh=dp)
    opt2 = _optimizer(ep2)
    sd = {"model": ep2.state_dict(), "optim": shardprop.get_optimizer_state_dict(ep2, opt2)}
    dcp.load(sd, checkpoint_id=root)
    ep2.load_state_dict(sd["model"])  # as torchtitan: the loaded (possibly new) tensors go back into the model
    shardprop.set_optimizer_state_dict(ep2, opt2, sd["optim"])
    loaded = {n: tuple(p.placements) for n, p in ep2.named_parameters() if ".experts." in n}
    for step in range(2, 4):
        if layout == "ep2+fsdp":
            losses.append(_fsdp_step(ep2, opt2, step))
        else:
            losses.append(_manual_step(ep2, opt2, step, mesh.get_group("efsdp")))
    errors = []
    want = dict(ref.named_parameters())
    for name, p in ep2.named_parameters():
        try:
            torch.testing.assert_close(_full(p), want[name].detach(), atol=ATOL, rtol=ATOL)
        except AssertionError as e:
            errors.append(f"{name}: {str(e).splitlines()[0]}")
    # Adam's step count came through too (a fresh optimizer would start at 1 and diverge anyway).
    steps = {float(s["step"]) for s in opt2.state.values()}
    return losses, ref_losses, errors, [str(p) for p in saved["layers.0.experts.w1"]], \
        [str(p) for p in loaded["layers.0.experts.w1"]], steps


@pytest.mark.parametrize("layout", ["ep2+fsdp", "ep2+replicated"])
def test_save_at_ep4_load_at_ep2_trains_like_an_uninterrupted_run(layout):
    root = tempfile.mkdtemp(prefix="dcp_moe_")
    for losses, ref_losses, errors, saved, loaded, steps in run_on_ranks(4, _resume, root, layout):
        assert not errors, "\n".join(errors)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=ATOL, rtol=ATOL)
        assert saved == ["S(0)"]
        assert loaded == (["S(1)", "S(0)"] if layout == "ep2+fsdp" else ["S(0)"]), loaded
        assert steps == {4.0}, steps
