"""A model built on the meta device, ``fully_shard``-ed, then ``to_empty`` + init: torchtitan's way to build a model.

torchtitan constructs the model under ``torch.device("meta")``, applies ``fully_shard``, then calls
``model.to_empty(device=...)`` and initialises the weights in place. The units used to keep computing
from their buffers on the meta device ("Tensor on device cpu is not on the expected device meta"); now
a unit whose parameters were rebound onto another device moves its buffers there before gathering.
Checked: losses and parameters after 2 AdamW steps equal one process, for FSDP on 4 ranks and for
TP x FSDP on 2x2, with the weights written in place after ``to_empty`` (as ``init_weights`` does).
"""
import pytest
import torch

from tests import recipes
from tests.rankpool import run_on_ranks

pytestmark = pytest.mark.timeout(240)


def _reference(steps=2):
    from shardprop.demo.model import Llama
    model = Llama(recipes.cfg(), 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    losses = [recipes.one_step({}, model, opt, *_batch(s)).item() for s in range(steps)]
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _batch(step):
    from shardprop.demo.model import synthetic_batch
    return synthetic_batch(recipes.cfg(), recipes.BATCH, step, 0)


def _meta_built(two_d: bool, steps=2):
    import shardprop as P
    from shardprop.demo.model import Llama, tp_plan
    with torch.device("meta"):
        model = Llama(recipes.cfg(), 0)
    if two_d:
        mesh = P.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        P.parallelize_module(model, mesh["tp"], tp_plan())
        dp = mesh["dp"]
    else:
        dp = P.init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    for block in model.layers:
        P.fully_shard(block, mesh=dp)
    P.fully_shard(model, mesh=dp)
    assert all(p.device.type == "meta" for p in model.parameters())
    model.to_empty(device="cpu")
    # init_weights: every parameter written in place with the one-process values, buffers recomputed.
    ref = Llama(recipes.cfg(), 0)
    ref_params = dict(ref.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            assert p.device.type == "cpu", name
            p.to_local().copy_(P.distribute_tensor(ref_params[name].detach(), p.device_mesh, p.placements).to_local())
        for (name, b), (_, rb) in zip(model.named_buffers(), ref.named_buffers()):
            b.copy_(rb)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    losses = []
    for step in range(steps):
        x, y = (recipes._rows(t, dp) for t in _batch(step))
        losses.append(recipes.mean_over_ranks(recipes.one_step({}, model, opt, x, y)))
    return losses, recipes.full_params(model)


@pytest.mark.parametrize("two_d", [False, True], ids=["fsdp4", "tp2xfsdp2"])
def test_meta_device_fully_shard_to_empty_init_trains_like_one_process(two_d):
    want = _reference()
    for rank, got in enumerate(run_on_ranks(4, _meta_built, two_d)):
        problems = recipes.compare(got, want)
        assert not problems, f"rank {rank}: " + "; ".join(problems[:6])
