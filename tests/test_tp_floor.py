"""The hand-written floors of ``bench/tp.py --floor`` (``bench/tp_floor.py``) train like one process.

Both floors (Megatron TP, and Megatron TP with sequence parallelism) must give the single-process
model's losses over a few SGD steps (so forward, every gradient and the norm-gradient all-reduce
are right), and the SP floor must issue exactly the collectives of the demo's ``tp_plan``.
Built with ``comm="shm"`` (shardprop's collectives instead of gloo's), each floor must give the
same loss and gradients as with ``comm="gloo"``, and make its collectives through shardprop.
"""
import os
import sys

import pytest
import torch
import torch.distributed as dist

from tests.rankpool import run_on_ranks

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

CFG = dict(dim=32, n_layers=2, n_heads=4, vocab_size=64, seq_len=8)
STEPS, BATCH = 3, 2


def _floor_losses(kind):
    from tp_floor import megatron_floor, megatron_sp_floor

    from shardprop.demo.model import LlamaConfig, lm_loss, make_optimizer, synthetic_batch
    cfg = LlamaConfig(**CFG)
    model = (megatron_sp_floor if kind == "sp" else megatron_floor)(cfg, seed=0)
    opt = make_optimizer("sgd", model.parameters())
    losses = []
    for step in range(STEPS):
        tokens, targets = synthetic_batch(cfg, BATCH, step)
        loss = lm_loss(model(tokens), targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if kind == "sp":
            model.sync_grads()
        opt.step()
        losses.append(loss.item())
    return losses


def _one_step(kind, comm):
    """(loss, {param name: local grad}, collectives shardprop counted) of one fwd + bwd (+ grad sync)."""
    from tp_floor import megatron_floor, megatron_sp_floor

    import shardprop
    from shardprop.demo.model import LlamaConfig, lm_loss, synthetic_batch
    cfg = LlamaConfig(**CFG)
    model = (megatron_sp_floor if kind == "sp" else megatron_floor)(cfg, seed=0, comm=comm)
    tokens, targets = synthetic_batch(cfg, BATCH, 0)
    with shardprop.comm_counter() as counter:
        loss = lm_loss(model(tokens), targets)
        loss.backward()
        if kind == "sp":
            model.sync_grads()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return loss.item(), grads, counter.total[0]


def _gloo_and_shm(kind):
    return _one_step(kind, "gloo"), _one_step(kind, "shm")


@pytest.mark.parametrize("kind", ["megatron", "sp"])
def test_shm_floor_matches_gloo_floor(kind):
    from shardprop.demo.model import Llama, LlamaConfig, lm_loss, synthetic_batch
    cfg = LlamaConfig(**CFG)
    tokens, targets = synthetic_batch(cfg, BATCH, 0)
    want = lm_loss(Llama(cfg, 0)(tokens), targets).item()  # one process, plain torch
    for (gloo_loss, gloo_grads, gloo_calls), (shm_loss, shm_grads, shm_calls) in run_on_ranks(4, _gloo_and_shm, kind):
        assert gloo_loss == pytest.approx(want, rel=1e-5) and shm_loss == pytest.approx(want, rel=1e-5)
        assert shm_grads.keys() == gloo_grads.keys()
        for name, g in gloo_grads.items():
            torch.testing.assert_close(shm_grads[name], g, atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")
        assert gloo_calls == 0 and shm_calls > 0  # gloo's collectives vs shardprop's


def test_unknown_comm_is_an_error():
    from tp_floor import _make_comm
    with pytest.raises(ValueError, match="comm='tcp'"):
        _make_comm("tcp")


@pytest.mark.slow  # checks bench code; SHARDPROP_SLOW=1 make test runs it
@pytest.mark.parametrize("kind", ["megatron", "sp"])
def test_floor_matches_one_process(kind):
    from shardprop.demo.model import LlamaConfig, reference_losses
    want = reference_losses(LlamaConfig(**CFG), STEPS, BATCH, optimizer="sgd")
    for got in run_on_ranks(4, _floor_losses, kind):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=1e-5)


def _count_calls(kind):
    """Collectives per training step of the SP floor (by patching the c10d entry points it calls)."""
    import tp_floor

    from shardprop.demo.model import LlamaConfig, lm_loss, synthetic_batch
    cfg = LlamaConfig(**CFG)
    counts = {}

    def counting(name, fn):
        def call(*a, **k):
            counts[name] = counts.get(name, 0) + 1
            return fn(*a, **k)
        return call

    saved = (tp_floor._all_gather_flat, tp_floor._reduce_scatter_flat, dist.all_reduce, dist.all_gather)
    tp_floor._all_gather_flat = counting("all_gather", saved[0])
    tp_floor._reduce_scatter_flat = counting("reduce_scatter", saved[1])
    tp_floor.dist.all_reduce = counting("all_reduce", saved[2])
    tp_floor.dist.all_gather = counting("all_gather", saved[3])
    try:
        model = tp_floor.megatron_sp_floor(cfg, seed=0)
        tokens, targets = synthetic_batch(cfg, BATCH, 0)
        lm_loss(model(tokens), targets).backward()
        model.sync_grads()
    finally:
        tp_floor._all_gather_flat, tp_floor._reduce_scatter_flat = saved[0], saved[1]
        dist.all_reduce, dist.all_gather = saved[2], saved[3]
    return counts


def _count_ours():
    import shardprop
    from shardprop.demo.model import Llama, LlamaConfig, lm_loss, synthetic_batch, tp_plan
    cfg = LlamaConfig(**CFG)
    mesh = shardprop.init_device_mesh("cpu", (4,))
    model = shardprop.parallelize_module(Llama(cfg, 0), mesh, tp_plan())
    tokens, targets = synthetic_batch(cfg, BATCH, 0)
    with shardprop.comm_counter() as k:
        lm_loss(model(tokens), targets).backward()
    return {kind: n for kind, (n, _) in k.counts.items()}


@pytest.mark.slow
def test_sp_floor_communicates_like_tp_plan():
    floor = run_on_ranks(4, _count_calls, "sp")[0]
    ours = run_on_ranks(4, _count_ours)[0]
    layers = CFG["n_layers"]
    # forward: embedding RS, per layer 2 x (AG + RS), output AG, logits AG; backward mirrors it
    # (logits: a slice), plus one all-reduce of the norm weights' gradients.
    assert floor == {"reduce_scatter": 2 + 4 * layers, "all_gather": 3 + 4 * layers, "all_reduce": 1}
    assert ours == floor
