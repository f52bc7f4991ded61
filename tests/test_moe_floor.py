"""The hand-written floor of ``bench/moe.py`` computes what ExpertParallel computes (4 gloo ranks, ep=4).

The floor (torchtitan's dispatch/combine by hand on plain tensors over gloo) and both shardprop
contenders start from the same weights and see the same tokens: over 3 AdamW steps their losses
and their experts (this rank's slice) must agree, and each must make 5 all-to-alls per step
(counts, tokens there and back, the two token moves inverted in backward).
"""
import os
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from tests.rankpool import run_on_ranks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
pytestmark = pytest.mark.timeout(240)


def _contenders():
    from moe import _collectives, _Contender

    from shardprop import init_device_mesh
    from shardprop.demo.moe import MoE
    torch.manual_seed(0)
    args = SimpleNamespace(dim=16, hidden=24, experts=8, top_k=2, tokens=20)
    ref = MoE(dim=16, hidden=24, num_experts=8, top_k=2)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("ep",))
    cs = {name: _Contender(name, ref, args, mesh) for name in ("floor", "ours", "ours gloo")}
    losses = {name: [c.step(i) for i in range(3)] for name, c in cs.items()}
    experts = {name: {k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
                      for k, v in c.model.experts.named_parameters()} for name, c in cs.items()}
    colls = {name: _collectives(c, 3)["all_to_all"] for name, c in cs.items()}
    return losses, experts, colls


def test_floor_matches_expert_parallel():
    for losses, experts, colls in run_on_ranks(4, _contenders):
        for name in ("ours", "ours gloo"):
            torch.testing.assert_close(torch.tensor(losses[name]), torch.tensor(losses["floor"]), atol=1e-5, rtol=1e-5)
            for k, v in experts["floor"].items():
                torch.testing.assert_close(experts[name][k], v, atol=1e-5, rtol=1e-5)
        assert colls == {"floor": 5, "ours": 5, "ours gloo": 5}, colls
