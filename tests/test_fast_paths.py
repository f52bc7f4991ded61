"""The fast-path switch (``shardprop.set_fast_paths`` / ``fast_paths`` / ``SHARDPROP_FAST_PATHS``) and
``explain()`` seeing the fast paths.

* the switch is read at call time: a model parallelized with the fast paths on runs the DTensor path
  (dispatcher calls) while they are off, and one parallelized with them off runs the fast path;
* a Colwise -> Rowwise MLP under CPU bf16 autocast returns bfloat16 with the fast paths on and off,
  equal to one process;
* ``explain()`` lists the fast path's local matmuls and its all-reduces (forward and backward), and
  the number and kinds of collectives it lists equal what ``comm_counter()`` counts.
"""
import os
import subprocess
import sys

import torch
from torch import nn

from tests.rankpool import run_on_ranks
from tests.test_tp_fused_linear import MLP  # the same Colwise -> Rowwise MLP


def _model(fast_at_parallelize: bool):
    import shardprop
    from shardprop import ColwiseParallel, RowwiseParallel, init_device_mesh, parallelize_module
    mesh = init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    ref = MLP()
    model = MLP()
    model.load_state_dict(ref.state_dict())
    with shardprop.fast_paths(fast_at_parallelize):
        parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model, ref


def _dispatches() -> int:
    from shardprop.dispatch.dispatcher import call_counts
    return sum(call_counts().values())


def _switch_at_call_time():
    import shardprop
    out = {}
    for at_parallelize in (True, False):
        model, ref = _model(at_parallelize)
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
        for at_call in (True, False):
            with shardprop.fast_paths(at_call):
                before = _dispatches()
                y = model(x)
                calls = _dispatches() - before
            torch.testing.assert_close(y, ref(x), atol=1e-5, rtol=1e-5)
            out[(at_parallelize, at_call)] = calls
    return out


def test_switch_is_read_at_call_time():
    out = run_on_ranks(4, _switch_at_call_time)[0]
    for at_parallelize in (True, False):
        assert out[(at_parallelize, True)] == 0, out      # the fast path: no DTensor dispatch at all
        assert out[(at_parallelize, False)] >= 2, out     # the DTensor path: matmuls through the dispatcher


def _other_fast_paths_follow_the_switch():
    """The optimizer foreach default and the coalesced gradient all-reduce follow the switch too."""
    import shardprop
    from shardprop import Replicate, SequenceParallel, Shard, distribute_tensor, init_device_mesh, parallelize_module
    mesh = init_device_mesh("cpu", (4,))
    out = {}
    for fast in (True, False):
        params = [torch.nn.Parameter(distribute_tensor(torch.ones(8, 4), mesh, [pl]))
                  for pl in (Shard(0), Replicate(), Shard(1), Replicate(), Shard(0))]
        for p in params:
            p.grad = torch.ones_like(p)
        opt = torch.optim.AdamW(params)
        with shardprop.fast_paths(fast):
            before = _dispatches()
            opt.step()
            steps = _dispatches() - before
        norms = nn.Sequential(nn.LayerNorm(8), nn.RMSNorm(8))
        parallelize_module(norms, mesh, {"0": SequenceParallel(), "1": SequenceParallel()})
        x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(4))
        with shardprop.fast_paths(fast), shardprop.comm_counter() as c:
            norms(x).to_local().sum().backward()
        out[fast] = (steps, c.counts.get("all_reduce", (0, 0))[0])
    return out


def test_optimizer_default_and_gradient_coalescing_follow_the_switch():
    out = run_on_ranks(4, _other_fast_paths_follow_the_switch)[0]
    (fast_steps, fast_reduces), (slow_steps, slow_reduces) = out[True], out[False]
    assert 2 * fast_steps < slow_steps, out    # foreach list ops (and first-step state) vs the per-parameter loop
    assert fast_reduces == 1 and slow_reduces == 3, out  # one coalesced all-reduce vs one per weight/bias


def _autocast_bf16():
    import shardprop
    model, ref = _model(True)
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(2))
    out = {}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = ref(x)
        for fast in (True, False):
            with shardprop.fast_paths(fast):
                y = model(x)
            out[fast] = y.dtype
            torch.testing.assert_close(y.float(), want.float(), atol=2e-2, rtol=2e-2)
    return out, want.dtype


def test_mlp_under_bf16_autocast_returns_bf16_on_both_paths():
    out, want = run_on_ranks(4, _autocast_bf16)[0]
    assert want == torch.bfloat16
    assert out == {True: torch.bfloat16, False: torch.bfloat16}


def _explain_sees_fast_path():
    import shardprop
    model, _ = _model(True)
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(3), requires_grad=True)
    with shardprop.comm_counter() as c, shardprop.explain() as ex:
        model(x).sum().backward()
    fast = [r for r in ex.records if r.is_fast_path]
    listed = [k for r in ex.records for _, k, _, _ in r.collectives]
    counted = {k: n for k, (n, _) in c.counts.items()}
    text = str(ex)
    # and nothing recorded once the block is over
    n = len(ex)
    model(x)
    return [(r.op, r.what, [k for _, k, _, _ in r.collectives]) for r in fast], listed, counted, text, n, len(ex)


def test_explain_lists_fast_path_matmuls_and_collectives_agreeing_with_comm_counter():
    fast, listed, counted, text, n, n_after = run_on_ranks(4, _explain_sees_fast_path)[0]
    linears = [(op, what) for op, what, _ in fast if op.startswith("linear")]
    assert len(linears) == 2 and "'up'" in linears[0][1] and "'down'" in linears[1][1], fast
    down = [ks for op, what, ks in fast if "'down'" in what]
    assert down == [["all_reduce"]], fast  # the row-parallel output's all-reduce, in forward
    assert any("backward" in what and ks == ["all_reduce"] for _, what, ks in fast), fast  # input grad
    assert sorted(listed) == sorted(k for k, n in counted.items() for _ in range(n)), (listed, counted)
    assert counted.get("all_reduce") == 2, counted
    assert "linear (local)" in text and "all_reduce" in text
    assert n_after == n


def test_env_var_turns_fast_paths_off():
    code = "import shardprop; print(shardprop.fast_paths_enabled())"
    env = dict(os.environ, SHARDPROP_FAST_PATHS="0")  # one interpreter (importing torch costs seconds)
    got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert got.stdout.strip() == "False", (got.stdout, got.stderr)
    from shardprop.mesh.config import BY_NAME
    fast = BY_NAME["fast_paths"]
    assert not any(fast.coerce(t) for t in ("0", "off", "false", "OFF")) and fast.coerce("1")


def test_switch_api_restores_previous_setting():
    import shardprop
    before = shardprop.fast_paths_enabled()
    with shardprop.fast_paths(False):
        assert shardprop.fast_paths_enabled() is False
        assert shardprop.set_fast_paths(True) is False
        assert shardprop.fast_paths_enabled() is True
    assert shardprop.fast_paths_enabled() is before


class _TwoMeshNet(nn.Module):
    """TP layers (on the 2-D mesh once fully_shard runs on dp) and layers outside the plan (on dp alone)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(6, 8), nn.Linear(8, 6)
        self.norm, self.head = nn.LayerNorm(6), nn.Linear(6, 4)

    def forward(self, x):
        return self.head(self.norm(self.down(torch.relu(self.up(x)))))


def _adamw_2x2(foreach, fast):
    import shardprop
    from shardprop import ColwiseParallel, RowwiseParallel, fully_shard, init_device_mesh, parallelize_module
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"]
    torch.manual_seed(5)
    ref = _TwoMeshNet()
    model = _TwoMeshNet()
    model.load_state_dict(ref.state_dict())
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model, mesh=dp)
    meshes = {n: p.device_mesh.ndim for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, foreach=foreach)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01, foreach=foreach)
    gen = torch.Generator().manual_seed(6)
    with shardprop.fast_paths(fast):
        for _ in range(5):
            x = torch.randn(8, 6, generator=gen)
            model(x.chunk(2)[dp.get_local_rank()]).square().mean().backward()
            ref(x).square().mean().backward()
            opt.step(), ropt.step()
            opt.zero_grad(), ropt.zero_grad()
    diffs = {n: (p.full_tensor() - r).abs().max().item()
             for (n, p), (_, r) in zip(model.named_parameters(), ref.named_parameters())}
    return meshes, diffs, opt.param_groups[0]["foreach"]


def _adamw_2x2_all():
    return {(foreach, fast): _adamw_2x2(foreach, fast) for foreach in (None, True, False) for fast in (True, False)}


def test_adamw_five_steps_on_dp_x_tp_equal_one_process_for_every_foreach():
    out = run_on_ranks(4, _adamw_2x2_all, timeout=300)[0]
    assert len(out) == 6
    for (foreach, fast), (meshes, diffs, kept) in out.items():
        assert meshes["up.weight"] == 2 and meshes["head.weight"] == 1, meshes  # two meshes in one optimizer
        assert max(diffs.values()) < 1e-5, (foreach, fast, diffs)
        assert kept is foreach  # the group's setting is what the user gave
