"""fully_shard over expert-parallel experts (ep2 x dp2 on 4 gloo ranks) against one process.

torchtitan's expert-FSDP layout: the 4 ranks are one data-parallel group (each brings a
quarter of the batch); the experts are ``Shard(0)`` over "ep" (2 ranks) and ``fully_shard``-ed
over "efsdp", the ranks with the same ep coordinate (the other dim of the 2x2 mesh), while
every other parameter (gates, shared experts, the head) is ``fully_shard``-ed over all 4 ranks.
An ep rank's expert gradient sums its ep group's tokens, so the experts' unit divides its
reduction by the data-parallel size (4), not by its own mesh size (2)
(``set_gradient_divide_factor``, as torchtitan does). Losses and the parameters after 3 AdamW
steps must equal one process, with and without activation checkpointing around each MoE block.
"""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn

from tests.rankpool import run_on_ranks

pytestmark = pytest.mark.timeout(240)
STEPS, ATOL = 3, 1e-4


class Net(nn.Module):
    """Two DeepSeek-style MoE blocks (residual) and a linear head; ``ac`` checkpoints each block."""

    def __init__(self, dim=16, hidden=24, num_experts=8, layers=2):
        super().__init__()
        from shardprop.demo.moe import MoE
        self.layers = nn.ModuleList(MoE(dim, hidden, num_experts, top_k=2) for _ in range(layers))
        self.head = nn.Linear(dim, dim)
        self.ac = False

    def forward(self, x):
        for layer in self.layers:
            if self.ac:
                x = x + torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
            else:
                x = x + layer(x)
        return self.head(x)


def _batch(step, b=8, s=6, dim=16):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(b, s, dim, generator=g), torch.randn(b, s, dim, generator=g)


def _dim1(param):
    # torchtitan's experts' shard_placement_fn when efsdp * ep > experts: the dim fully_shard picks anyway.
    from shardprop import Shard
    return Shard(1)


def _per_parameter_mesh(layer, efsdp, dp, expert_dim):
    """torchtitan's shard_placement_fn under EP (distributed/fsdp.py): experts over efsdp on ``expert_dim``
    (0 when the experts outnumber efsdp x ep: a strided shard), every other parameter over the whole dp mesh."""
    from shardprop import Shard
    from shardprop.parallel.fsdp import ShardPlacementResult, _get_mesh_info
    experts, e_info, d_info = set(layer.experts.parameters()), _get_mesh_info(efsdp), _get_mesh_info(dp)
    dim = {"experts-dim0": 0, "experts-dim1": 1}[expert_dim]
    return lambda p: ShardPlacementResult(Shard(dim), e_info) if p in experts else ShardPlacementResult(Shard(0), d_info)


def _build(ac, shard_placement=None, compiled=False, one_call=None):
    """(one-process reference, the ep2 x dp2 copy, the 2x2 mesh) on this rank."""
    from shardprop import ExpertParallel, fully_shard, init_device_mesh, parallelize_module
    shard_placement = {None: None, "dim1": _dim1}[shard_placement]
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    model.ac = ac
    # rank = 2 * efsdp + ep: the ep groups are {0, 1}, {2, 3}; the experts' dp groups {0, 2}, {1, 3}.
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
    dp = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    for layer in model.layers:
        parallelize_module(layer.experts, mesh["ep"], ExpertParallel())
        if one_call:  # torchtitan's: one fully_shard per block, a mesh per parameter
            fully_shard(layer, mesh=dp, shard_placement_fn=_per_parameter_mesh(layer, mesh["efsdp"], dp, one_call))
            layer.set_gradient_divide_factor(dp.size())
            continue
        fully_shard(layer.experts, mesh=mesh["efsdp"], shard_placement_fn=shard_placement)
        layer.experts.set_gradient_divide_factor(dp.size())
        fully_shard(layer, mesh=dp)
        if compiled:  # torchtitan's order: each block compiled in place, after sharding
            layer.compile()
    fully_shard(model, mesh=dp)
    return ref, model, mesh


def _train(ac=False, shard_placement=None, compiled=False, one_call=None):
    ref, model, mesh = _build(ac, shard_placement, compiled, one_call)
    me = dist.get_rank()
    layouts = {n: (tuple(p.placements), tuple(p.to_local().shape)) for n, p in model.named_parameters()}
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses, ref_losses = [], []
    for step in range(STEPS):
        x, y = _batch(step)
        ref_loss = ((ref(x) - y) ** 2).mean()
        ref_loss.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        # The usual data-parallel loss: this rank's mean; FSDP averages the gradients.
        loss = ((model(x.chunk(4)[me]) - y.chunk(4)[me]) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        whole = loss.detach().clone()
        dist.all_reduce(whole)
        losses.append(whole.item() / 4)
        ref_losses.append(ref_loss.item())
    errors = []
    want = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        try:
            torch.testing.assert_close(p.full_tensor(), want[name].detach(), atol=ATOL, rtol=ATOL)
        except AssertionError as e:
            errors.append(f"{name}: {str(e).splitlines()[0]}")
    return losses, ref_losses, errors, layouts, me


@pytest.mark.parametrize("ac,placement,compiled", [(False, None, False), (True, None, False), (False, "dim1", False),
                                                  (True, None, True)],
                         ids=["plain", "checkpointed", "shard_placement_fn-dim1", "checkpointed-compiled"])
def test_experts_fully_sharded_over_efsdp_train_like_one_process(ac, placement, compiled):
    for losses, ref_losses, errors, layouts, me in run_on_ranks(4, _train, ac, placement, compiled,
                                                                timeout=240 if compiled else 60):
        assert not errors, "\n".join(errors)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=ATOL, rtol=ATOL)
        # Experts: Shard(0) on ep (8 / 2 = 4 experts), then dp splits dim 1 over efsdp ([S(1), S(0)]
        # on the (efsdp, ep) mesh: no strided shard); the rest: Shard(0) over all 4 ranks.
        pl, shape = layouts["layers.0.experts.w1"]
        assert [str(p) for p in pl] == ["S(1)", "S(0)"] and shape == (4, 8, 24), layouts["layers.0.experts.w1"]
        pl, shape = layouts["layers.0.experts.w2"]
        assert [str(p) for p in pl] == ["S(1)", "S(0)"] and shape == (4, 12, 16), layouts["layers.0.experts.w2"]
        pl, shape = layouts["layers.1.router.gate.weight"]
        assert [str(p) for p in pl] == ["S(0)"] and shape == (2, 16), layouts["layers.1.router.gate.weight"]
        pl, shape = layouts["head.weight"]
        assert [str(p) for p in pl] == ["S(0)"] and shape == (4, 16), layouts["head.weight"]


@pytest.mark.parametrize("one_call,ac", [("experts-dim0", False), ("experts-dim1", False), ("experts-dim0", True)],
                         ids=["dim0", "dim1", "dim0-checkpointed"])
def test_one_fully_shard_with_a_mesh_per_parameter_trains_like_one_process(one_call, ac):
    """torchtitan's EP layout in one call per block: ShardPlacementResult puts the experts in a member unit
    over efsdp (dim 0 on top of ep's dim 0 is torch's strided shard), the rest over the whole dp mesh; also
    with each block checkpointed (the recomputation re-gathers both members)."""
    for losses, ref_losses, errors, layouts, me in run_on_ranks(4, _train, ac, None, False, one_call, timeout=60):
        assert not errors, "\n".join(errors)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=ATOL, rtol=ATOL)
        pl, shape = layouts["layers.0.experts.w1"]
        want = (["_S(0, sf=2)", "S(0)"], (2, 16, 24)) if one_call == "experts-dim0" else (["S(1)", "S(0)"], (4, 8, 24))
        assert ([str(p) for p in pl], shape) == want, layouts["layers.0.experts.w1"]
        pl, shape = layouts["layers.1.router.gate.weight"]
        assert [str(p) for p in pl] == ["S(0)"] and shape == (2, 16), layouts["layers.1.router.gate.weight"]


def _refused_dim():
    """shard_placement_fn naming another dim than the one ep leaves for dp: a clear error."""
    from shardprop import ExpertParallel, Shard, fully_shard, init_device_mesh, parallelize_module
    from shardprop.demo.moe import GroupedExperts
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
    experts = parallelize_module(GroupedExperts(16, 24, 8), mesh["ep"], ExpertParallel())
    try:
        fully_shard(experts, mesh=mesh["efsdp"], shard_placement_fn=lambda p: Shard(2))
    except NotImplementedError as e:
        return str(e)
    return None


def test_shard_placement_fn_on_expert_dtensor_refuses_other_dims():
    for msg in run_on_ranks(4, _refused_dim):
        assert msg is not None and "S(2)" in msg and "fixed: Shard(1)" in msg, msg
