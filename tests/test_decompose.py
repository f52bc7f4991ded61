"""The decomposition path (shardprop/decompose.py) for ops without a sharding rule.

Custom ops (torch.library) stand in for rule-less aten ops, so the tests do not depend
on which aten ops happen to have rules: ``spdecomp::axpy`` (decomposes into mul and add),
``spdecomp::loop`` (its decomposition calls itself).

* a decomposed op matches plain torch on sharded inputs, and keeps the shard its
  pieces' rules keep (no blanket replication);
* without the opt-in the op raises, naming register_sharding and the opt-in;
  ``set_decompose_fallback(True)`` turns it on, ``False`` off again;
* a rule (registered later) wins: the decomposition is no longer called;
* a decomposition that calls its own op raises a ShardingError, not a RecursionError;
* every op of the curated table has a decomposition and no rule (a later rule must
  make the table entry dead, not shadow the rule).
"""

import pytest
import torch

from tests.rankpool import run_on_ranks

CALLS = {"axpy": 0}


def _define_ops():
    """Define the test ops and their decompositions once per process."""
    if hasattr(torch.ops.spdecomp, "axpy") and "default" in torch.ops.spdecomp.axpy.overloads():
        return torch.ops.spdecomp.axpy.default, torch.ops.spdecomp.loop.default
    lib = torch.library.Library("spdecomp", "DEF")
    lib.define("axpy(Tensor x, Tensor y, float a) -> Tensor")
    lib.define("loop(Tensor x) -> Tensor")
    lib.impl("axpy", lambda x, y, a: a * x + y, "CompositeExplicitAutograd")
    lib.impl("loop", lambda x: x.clone(), "CompositeExplicitAutograd")
    _define_ops.lib = lib  # keep the library alive
    axpy, loop = torch.ops.spdecomp.axpy.default, torch.ops.spdecomp.loop.default

    def axpy_decomp(x, y, a):
        CALLS["axpy"] += 1
        return torch.add(torch.mul(x, a), y)

    def loop_decomp(x):
        return torch.ops.spdecomp.loop.default(x)

    from torch._decomp import decomposition_table
    decomposition_table[axpy] = axpy_decomp
    decomposition_table[loop] = loop_decomp
    return axpy, loop


def _cleanup(ops):
    # The test ops keep their decomposition_table entries: the pool's processes outlive this test.
    from shardprop.dispatch import decompose
    from shardprop import set_decompose_fallback, unregister_sharding
    set_decompose_fallback(False)
    for op in ops:
        unregister_sharding(op)
        decompose.uninstall(op)


def _scenarios():
    import shardprop
    from shardprop.dispatch import decompose
    from shardprop import Replicate, Shard, ShardingError, distribute_tensor, init_device_mesh
    from shardprop.debug.explain import explain
    axpy, loop = _define_ops()
    mesh = init_device_mesh("cpu", (4,))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(9, 6, generator=g), torch.randn(9, 6, generator=g)
    dx, dy = distribute_tensor(x, mesh, [Shard(0)]), distribute_tensor(y, mesh, [Shard(0)])
    out = {}
    try:
        # 1. off: the no-rule error names both ways out
        try:
            axpy(dx, dy, 2.0)
            out["off"] = "no error"
        except ShardingError as e:
            out["off"] = str(e)
        # 2. the opt-in: matches torch, keeps the shard, no collective
        shardprop.set_decompose_fallback(True)
        before = CALLS["axpy"]
        with explain() as ex:
            r = axpy(dx, dy, 2.0)
        out["on_close"] = bool(torch.allclose(r.full_tensor(), 2.0 * x + y))
        out["on_placements"] = tuple(r.placements)
        out["on_collectives"] = sum(len(rec.collectives) for rec in ex.records)
        out["on_calls"] = CALLS["axpy"] - before
        # mixed layouts: the pieces' rules redistribute as they would for add
        dyr = distribute_tensor(y, mesh, [Replicate()])
        out["mixed_close"] = bool(torch.allclose(axpy(dx, dyr, -0.5).full_tensor(), -0.5 * x + y))
        # 3. recursion: a clean ShardingError
        try:
            loop(dx)
            out["loop"] = "no error"
        except ShardingError as e:
            out["loop"] = "ShardingError: " + str(e)
        except RecursionError:
            out["loop"] = "RecursionError"
        # 4. off again
        shardprop.set_decompose_fallback(False)
        try:
            axpy(dx, dy, 2.0)
            out["off_again"] = "no error"
        except ShardingError:
            out["off_again"] = "ShardingError"
        # 5. per-op install (the curated path) and a later rule winning over it
        decompose.install(axpy)
        out["installed_close"] = bool(torch.allclose(axpy(dx, dy, 3.0).full_tensor(), 3.0 * x + y))

        @shardprop.register_sharding(axpy)
        def axpy_rule(x, y, a):
            return [([Replicate(), Replicate()], [Replicate()])]

        before = CALLS["axpy"]
        r = axpy(dx, dy, 3.0)
        out["rule_calls"] = CALLS["axpy"] - before
        out["rule_placements"] = tuple(r.placements)
        out["rule_close"] = bool(torch.allclose(r.full_tensor(), 3.0 * x + y))
        out["rule_decomposed"] = decompose.is_decomposed(axpy)
    finally:
        _cleanup([axpy, loop])
    return out


@pytest.fixture(scope="module")
def scenarios():
    per_rank = run_on_ranks(4, _scenarios, timeout=120)
    assert all(r == per_rank[0] for r in per_rank), "ranks disagree"
    return per_rank[0]


def test_no_rule_error_names_both_remedies(scenarios):
    msg = scenarios["off"]
    assert "has no sharding rule" in msg and "register_sharding" in msg, msg
    assert "set_decompose_fallback" in msg and "SHARDPROP_DECOMPOSE" in msg, msg


def test_opt_in_matches_torch_and_keeps_shard(scenarios):
    from shardprop import Shard
    assert scenarios["on_close"] and scenarios["mixed_close"]
    assert scenarios["on_placements"] == (Shard(0),)
    assert scenarios["on_collectives"] == 0
    assert scenarios["on_calls"] == 1


def test_opt_out_again(scenarios):
    assert scenarios["off_again"] == "ShardingError"


def test_recursion_is_an_error_not_a_loop(scenarios):
    assert scenarios["loop"].startswith("ShardingError"), scenarios["loop"]
    assert "calls" in scenarios["loop"] and "again" in scenarios["loop"], scenarios["loop"]


def test_rule_wins_over_decomposition(scenarios):
    from shardprop import Replicate
    assert scenarios["installed_close"]
    assert scenarios["rule_calls"] == 0
    assert scenarios["rule_placements"] == (Replicate(),)
    assert scenarios["rule_close"] and not scenarios["rule_decomposed"]


def test_curated_table_has_decompositions_and_no_rules():
    from shardprop.dispatch import decompose
    from shardprop.dispatch import registry
    for op in decompose._curated():
        assert decompose.decomposition(op) is not None, f"{op}: torch has no decomposition"
        if registry.lookup(op) is not None:
            assert not decompose.is_decomposed(op), f"{op}: has a rule, yet its decomposition runs"
    assert len(decompose._curated()) == len(decompose.DEFAULT_OPS), "a name in DEFAULT_OPS is not an aten op"


def _curated_real_ops():
    """The curated aten.norm overloads (or their rules, if one has appeared) on sharded inputs."""
    from shardprop import Replicate, Shard, distribute_tensor, init_device_mesh
    aten = torch.ops.aten
    problems = []
    for mesh_shape, layouts in [((4,), [[Shard(0)], [Shard(1)], [Replicate()]]),
                                ((2, 2), [[Shard(0), Shard(1)], [Shard(1), Replicate()]])]:
        mesh = init_device_mesh("cpu", mesh_shape)
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(9, 6, generator=g), torch.randn(9, 6, generator=g)
        calls = [
            ("norm.ScalarOpt_dim p=2 dim=1", lambda t, u: aten.norm.ScalarOpt_dim(t, 2, [1], False)),
            ("norm.ScalarOpt_dim p=3 dim=0 keepdim", lambda t, u: aten.norm.ScalarOpt_dim(t, 3.0, [0], True)),
            ("norm.Scalar", lambda t, u: aten.norm.Scalar(t, 2)),
            ("norm.ScalarOpt_dtype", lambda t, u: aten.norm.ScalarOpt_dtype(t, 1, dtype=torch.float64)),
            ("pairwise_distance", lambda t, u: torch.nn.functional.pairwise_distance(t, u)),
        ]
        for pl in layouts:
            dx, dy = distribute_tensor(x, mesh, pl), distribute_tensor(y, mesh, pl)
            for name, fn in calls:
                try:
                    torch.testing.assert_close(fn(dx, dy).full_tensor(), fn(x, y))
                except Exception as e:
                    problems.append(f"{mesh_shape} {pl} {name}: {type(e).__name__}: {str(e)[:200]}")
    return problems


def test_curated_ops_match_torch_on_shards():
    problems = run_on_ranks(4, _curated_real_ops, timeout=120)[0]
    assert not problems, "\n".join(problems)
