"""shardprop.check.check_sharding_rule: it finds wrong rules, missing options, and passes right ones.

Deliberately wrong or poor user rules (register_sharding overrides the built-in)
show that the checker catches what it claims to; the built-in rules of every op
family are then checked on small samples and must have no incorrect entry.
"""
import pytest
import torch

import shardprop
from shardprop import Partial, Replicate, Shard
from shardprop.debug.check_rule import check_sharding_rule
from shardprop.dispatch.registry import lookup
from tests.rankpool import run_on_ranks

aten = torch.ops.aten
R, P = Replicate(), Partial


def _summary(report):
    """Plain data for the parent to assert on (pytest rewrites asserts there, not on the ranks)."""
    return {
        "ok": report.ok,
        "text": str(report),
        "incorrect": [str(f) for f in report.incorrect],
        "missing": [str(f) for f in report.missing],
        "accepted": [str(f) for f in report.accepted],
        "errors": [f"{f.inputs}: {f.message}" for f in report.errors],
        "total": report.total,
        "checked": report.checked,
        "all_replicate_accepted": report.find(
            "accepted", [(R,) * len(report.mesh_shape)] * len(report.arg_names)) is not None,
    }


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=_gen(seed))


# ------------------------------------------------------------------ deliberately bad rules
def _relu_claimed_linear(x):
    return [((P("sum"),), (P("sum"),)), ((R,), (R,))]


def _mm_replicate_only(a, b):
    return [((R, R), (R,))]


def _with_user_rule(op, fn, body):
    shardprop.register_sharding(op)(fn)
    try:
        return body()
    finally:
        shardprop.unregister_sharding(op)


def _bad_rules_1d():
    mesh = shardprop.init_device_mesh("cpu", (4,))
    relu = _with_user_rule(aten.relu.default, _relu_claimed_linear,
                           lambda: check_sharding_rule(aten.relu.default, _randn(7, 6), mesh=mesh))
    # Uneven shapes on purpose: 7 rows and 6 inner columns over 4 ranks leave short and empty pieces.
    mm = _with_user_rule(aten.mm.default, _mm_replicate_only,
                         lambda: check_sharding_rule(aten.mm.default, _randn(7, 6), _randn(6, 5, seed=1), mesh=mesh))
    restored = lookup(aten.relu.default).user is False and lookup(aten.mm.default).user is False
    return _summary(relu), _summary(mm), restored


def test_wrong_rule_is_incorrect_and_poor_rule_is_missing():
    relu, mm, restored = run_on_ranks(4, _bad_rules_1d)[0]
    assert restored
    assert not relu["ok"], relu["text"]
    assert relu["incorrect"] == ["(P(sum),) -> P(sum)"], relu["text"]
    assert "(R,) -> R" in relu["accepted"], relu["text"]
    # relu is monotone: it commutes with max and min, and keeps shards; the rule misses those.
    for f in ["(S(0),) -> S(0)", "(S(1),) -> S(1)", "(P(max),) -> P(max)", "(P(min),) -> P(min)"]:
        assert f in relu["missing"], relu["text"]
    assert relu["total"] == relu["checked"] == 7

    assert mm["ok"], mm["text"]
    assert mm["accepted"] == ["(R, R) -> R"], mm["text"]
    for f in ["(S(0), R) -> S(0)", "(S(1), S(0)) -> P(sum)", "(R, S(1)) -> S(1)", "(P(sum), R) -> P(sum)",
              "(R, P(avg)) -> P(avg)"]:
        assert f in mm["missing"], mm["text"]
    # Nonlinear combinations must not be offered as missing: max partials do not pass through a product.
    assert not any("P(max)" in f or "P(min)" in f for f in mm["missing"]), mm["text"]
    assert mm["total"] == mm["checked"] == 49


def _bad_rules_2d():
    mesh = shardprop.init_device_mesh("cpu", (2, 2))
    relu = _with_user_rule(aten.relu.default, _relu_claimed_linear,
                           lambda: check_sharding_rule(aten.relu.default, _randn(5, 6), mesh=mesh))
    layouts = [((Shard(0), R), (R, R)), ((Shard(1), R), (Shard(0), R)), ((Shard(0), Shard(1)), (R, Shard(0))),
               ((Shard(1), Shard(1)), (Shard(0), Shard(0))), ((P("max"), R), (R, R))]
    mm = _with_user_rule(aten.mm.default, _mm_replicate_only,
                         lambda: check_sharding_rule(aten.mm.default, _randn(5, 6), _randn(6, 3, seed=1), mesh=mesh,
                                                     input_layouts=layouts))
    capped = check_sharding_rule(aten.mm.default, _randn(5, 6), _randn(6, 3, seed=1), mesh=mesh, max_combos=60)
    return _summary(relu), _summary(mm), _summary(capped)


def test_2d_mesh():
    relu, mm, capped = run_on_ranks(4, _bad_rules_2d)[0]
    # A per-mesh-dim rule accepts P(sum) on either mesh dim independently: every such layout is wrong.
    for f in ["([P(sum), R],) -> [P(sum), R]", "([R, P(sum)],) -> [R, P(sum)]",
              "([P(sum), P(sum)],) -> [P(sum), P(sum)]"]:
        assert f in relu["incorrect"], relu["text"]
    assert len(relu["incorrect"]) == 3, relu["text"]
    for f in ["([S(1), S(0)],) -> [S(1), S(0)]", "([P(max), P(max)],) -> [P(max), P(max)]",
              "([P(min), S(1)],) -> [P(min), S(1)]"]:
        assert f in relu["missing"], relu["text"]
    assert relu["total"] == 49

    assert mm["checked"] == 5, mm["text"]
    for f in ["([S(0), R], [R, R]) -> [S(0), R]", "([S(1), R], [S(0), R]) -> [P(sum), R]",
              "([S(0), S(1)], [R, S(0)]) -> [S(0), P(sum)]", "([S(1), S(1)], [S(0), S(0)]) -> [P(sum), P(sum)]"]:
        assert f in mm["missing"], mm["text"]
    assert len(mm["missing"]) == 4, mm["text"]  # (P(max), R) @ R is not a max-partial product

    assert capped["ok"], capped["text"]
    assert capped["total"] == 49 * 49 and capped["checked"] == 60, capped["text"]
    assert "60 of 2401 input combinations checked" in capped["text"]
    assert capped["all_replicate_accepted"], capped["text"]  # always in the sample


def _unseeded_samples():
    """Each rank passes its own unseeded samples, as a new user would: rank 0's are checked."""
    import torch.distributed as dist
    from shardprop.debug import check_rule
    mesh = shardprop.init_device_mesh("cpu", (4,))
    mine = torch.randn(8, 6) + dist.get_rank()  # differs between ranks, whatever the seed
    report = check_sharding_rule(aten.mm.default, mine, torch.randn(6, 4), mesh=mesh)
    # What every rank got: rank 0's tensors (values, strides), kwargs and plain arguments.
    args = (mine, mine.t(), [torch.randn(3), 2.5 + dist.get_rank()])
    got_args, got_kwargs = check_rule._first_ranks_sample(args, {"w": mine * 2}, mesh, 0, mesh.get_group(0))
    sent = [None] * dist.get_world_size()
    dist.all_gather_object(sent, (args, mine * 2))
    rank0_args, rank0_w = sent[0]
    same = (torch.equal(got_args[0], rank0_args[0]) and torch.equal(got_args[1], rank0_args[1])
            and got_args[1].stride() == (1, 6) and torch.equal(got_args[2][0], rank0_args[2][0])
            and got_args[2][1] == 2.5 and torch.equal(got_kwargs["w"], rank0_w))
    return {**_summary(report), "same_as_rank0": same}


def test_unseeded_samples_use_rank0s():
    res = run_on_ranks(4, _unseeded_samples)
    assert all(r["same_as_rank0"] for r in res), "a rank did not get rank 0's sample"
    assert all(r["text"] == res[0]["text"] for r in res), "ranks reported differently"
    assert res[0]["ok"] and not res[0]["errors"], res[0]["text"]
    assert res[0]["all_replicate_accepted"], res[0]["text"]


# ------------------------------------------------------------------ built-in rules, family by family
def _sample(name):
    """(op, args, kwargs) of a small sample call per family; shapes chosen to shard unevenly over 4 ranks."""
    x = _randn(5, 6)
    idx = torch.randint(0, 10, (3, 5), generator=_gen(3))
    return {
        "add": (aten.add.Tensor, (x, _randn(6, seed=1)), {}),
        "relu": (aten.relu.default, (x,), {}),
        "mul_scalar": (aten.mul.Tensor, (x, torch.tensor(1.5)), {}),
        "mm": (aten.mm.default, (x, _randn(6, 3, seed=1)), {}),
        "bmm": (aten.bmm.default, (_randn(2, 5, 3), _randn(2, 3, 4, seed=1)), {}),
        "sum_dim": (aten.sum.dim_IntList, (x, [1]), {}),
        "sum_dim_keepdim": (aten.sum.dim_IntList, (x, [0], True), {}),
        "sum": (aten.sum.default, (x,), {}),
        "mean_dim": (aten.mean.dim, (x, [1]), {}),
        "amax": (aten.amax.default, (x, [0]), {}),
        "softmax": (aten._softmax.default, (x, 1, False), {}),
        "log_softmax": (aten._log_softmax.default, (x, 0, False), {}),
        "layer_norm": (aten.native_layer_norm.default, (x, [6], _randn(6, seed=1), _randn(6, seed=2), 1e-5), {}),
        "embedding": (aten.embedding.default, (_randn(10, 4), idx), {}),
        "view": (aten.view.default, (_randn(4, 6), [2, 12]), {}),
        "view_flatten": (aten.view.default, (_randn(4, 2, 3), [8, 3]), {}),
        "transpose": (aten.transpose.int, (x, 0, 1), {}),
        "t": (aten.t.default, (x,), {}),
        "unsqueeze": (aten.unsqueeze.default, (x, 1), {}),
        "clone": (aten.clone.default, (x,), {}),
        "cat": (aten.cat.default, ([_randn(3, 4), _randn(2, 4, seed=1)], 0), {}),
        "where": (aten.where.self, (torch.rand(5, 6, generator=_gen(4)) > 0.5, x, _randn(5, 6, seed=1)), {}),
    }[name]


FAMILIES = ["add", "relu", "mul_scalar", "mm", "bmm", "sum_dim", "sum_dim_keepdim", "sum", "mean_dim", "amax",
            "softmax", "log_softmax", "layer_norm", "embedding", "view", "view_flatten", "transpose", "t",
            "unsqueeze", "clone", "cat", "where"]


# Families with many combinations are checked on a deterministic sample of them (time).
MAX_COMBOS = {"layer_norm": 80, "where": 80}


def _check_family(name):
    op, args, kwargs = _sample(name)
    if lookup(op) is None:
        return None
    mesh = shardprop.init_device_mesh("cpu", (4,))
    return _summary(check_sharding_rule(op, *args, mesh=mesh, max_combos=MAX_COMBOS.get(name), **kwargs))


@pytest.mark.parametrize("name", FAMILIES)
def test_builtin_rule_has_no_incorrect_entry(name):
    op = _sample(name)[0]
    if lookup(op) is None:
        pytest.skip(f"no rule registered for {op} yet")
    s = run_on_ranks(4, _check_family, name)[0]
    assert s["ok"] and not s["incorrect"], s["text"]
    # Every rule that can run replicated accepts all-replicated inputs as they are.
    assert s["all_replicate_accepted"], s["text"]
    assert s["checked"] == min(s["total"], MAX_COMBOS.get(name, s["total"])) and s["total"] > 1, s["text"]
