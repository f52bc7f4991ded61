"""The dispatcher and its cache: hits and misses, rule overrides, explain, explicit, errors."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.rankpool import run_on_ranks

aten = torch.ops.aten


def _mesh():
    from shardprop import init_device_mesh
    return init_device_mesh("cpu", (4,))


# ------------------------------------------------------------------ cache behaviour
def _cache_hits_and_misses():
    import shardprop
    from shardprop import Replicate, Shard, distribute_tensor
    mesh = _mesh()
    x = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
    y = distribute_tensor(torch.randn(8, 4), mesh, [Replicate()])
    # A first meta run imports torch._dynamo, whose import hooks register rules, which clears
    # the cache (and the counters) in the middle of that call: warm up before counting.
    x.sum(0) + y
    shardprop.clear_cache()

    def row(op):
        return next((r for r in shardprop.cache_stats() if r["op"] == op), None)

    torch.add(x, y)
    first = row("aten.add.Tensor")
    torch.add(x, y)
    second = row("aten.add.Tensor")
    torch.add(x, y, alpha=2)          # differs only in a non-tensor argument: a miss
    third = row("aten.add.Tensor")
    x.sum(0)
    x.sum(1)                          # another dim: a miss
    x.sum(1)
    sums = row("aten.sum.dim_IntList")
    x * 0.5
    x * 0.25                          # floats never change sharding: shared entry, a hit
    muls = row("aten.mul.Tensor")
    table = shardprop.debug.stats.format_cache_stats()
    return first, second, third, sums, muls, table


def test_second_identical_call_hits_and_non_tensor_args_miss():
    first, second, third, sums, muls, table = run_on_ranks(4, _cache_hits_and_misses)[0]
    assert (first["calls"], first["misses"]) == (1, 1)
    assert (second["calls"], second["hits"], second["misses"]) == (2, 1, 1)
    assert (third["calls"], third["misses"]) == (3, 2), "a different alpha must be a cache miss"
    assert (sums["calls"], sums["hits"], sums["misses"]) == (3, 1, 2)
    assert (muls["calls"], muls["misses"]) == (2, 1)
    assert third["live_entries"] == 2
    assert "TOTAL" in table and "aten.add.Tensor" in table and "hit rate" in table


def _cache_bounded():
    from shardprop import Shard, config, distribute_tensor
    from shardprop.dispatch import propagate
    mesh = _mesh()
    xs = [distribute_tensor(torch.randn(4 * (i + 1), 4), mesh, [Shard(0)]) for i in range(6)]
    sizes = []
    with config.patch(cache_size=3):  # resizing empties the cache
        for x in xs:  # six shapes: six misses
            torch.relu(x)
            sizes.append(propagate.cache_info().currsize)
        torch.relu(xs[-1])  # a hit: nothing added
        sizes.append(propagate.cache_info().currsize)
    with config.patch(cache_size=0):
        for x in xs:
            torch.relu(x)
        off = propagate.cache_info().currsize
    return sizes, off, propagate.cache_info().maxsize == config.default("cache_size")


def test_the_one_cache_keeps_within_its_size():
    sizes, off, restored = run_on_ranks(4, _cache_bounded)[0]
    assert sizes == [1, 2, 3, 1, 2, 3, 3], "a full cache starts over; a hit adds nothing"
    assert off == 0 and restored


def _propagate_cached_vs_uncached(cases):
    from shardprop import Partial, Replicate, Shard, distribute_tensor
    from shardprop.dispatch.dispatcher import _flatten
    from shardprop.dispatch.op_schema import OpSchema
    from shardprop.dispatch.propagate import _propagate_uncounted, propagate
    mesh = _mesh()
    placements = {"R": Replicate(), "S0": Shard(0), "S1": Shard(1), "P": Partial()}
    ops = {"add": aten.add.Tensor, "mul": aten.mul.Tensor, "mm": aten.mm.default, "relu": aten.relu.default,
           "sum1": aten.sum.dim_IntList, "t": aten.t.default}
    out = []
    for op_name, pa, pb, rows, cols in cases:
        a = distribute_tensor(torch.randn(rows, cols), mesh, [placements[pa]])
        b = distribute_tensor(torch.randn(cols if op_name == "mm" else rows, cols), mesh, [placements[pb]])
        op = ops[op_name]
        args = {"add": (a, b), "mul": (a, b), "mm": (a, b), "relu": (a,), "sum1": (a, [1]), "t": (a,)}[op_name]
        largs, key = [], []
        _flatten(args, largs, key)
        schema = OpSchema(op, tuple(key), ())
        try:
            cached = propagate(schema)
            again = propagate(OpSchema(op, tuple(key), ()))
            fresh = _propagate_uncounted(schema)
            out.append((cached == fresh, again is cached, cached.out_specs == fresh.out_specs))
        except Exception as e:  # both must fail alike
            try:
                _propagate_uncounted(schema)
                out.append(("cached raised, uncached did not", type(e).__name__))
            except Exception as e2:
                out.append((type(e) is type(e2), True, True))
    return out


_case = st.tuples(st.sampled_from(["add", "mul", "mm", "relu", "sum1", "t"]),
                  st.sampled_from(["R", "S0", "S1", "P"]), st.sampled_from(["R", "S0", "S1", "P"]),
                  st.integers(1, 9), st.integers(1, 9))


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(_case, min_size=10, max_size=25))
def test_cached_and_uncached_propagation_agree(cases):
    for res in run_on_ranks(4, _propagate_cached_vs_uncached, cases):
        for case, r in zip(cases, res):
            assert r == (True, True, True), f"{case}: {r}"


# ------------------------------------------------------------------ overrides of built-in rules
def _override_builtins():
    import shardprop
    from shardprop import Replicate, Shard, distribute_tensor
    mesh = _mesh()
    x = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
    w = distribute_tensor(torch.randn(4, 6), mesh, [Replicate()])
    before = (torch.relu(x).placements, torch.mm(x, w).placements)

    @shardprop.register_sharding(aten.relu.default)
    def relu_replicated(a):
        return [([Replicate()], [Replicate()])]

    @shardprop.register_sharding(aten.mm.default)
    def mm_replicated(a, b):
        return [([Replicate(), Replicate()], [Replicate()])]

    r, m = torch.relu(x), torch.mm(x, w)
    during = (r.placements, m.placements)
    ok = torch.allclose(r.full_tensor(), torch.relu(x.full_tensor())) and \
        torch.allclose(m.full_tensor(), x.full_tensor() @ w.full_tensor())
    shardprop.unregister_sharding(aten.relu.default)
    shardprop.unregister_sharding(aten.mm.default)
    after = (torch.relu(x).placements, torch.mm(x, w).placements)
    return before, during, after, ok


def test_user_rule_overrides_builtin_relu_and_mm_and_is_removable():
    from shardprop import Replicate, Shard
    before, during, after, ok = run_on_ranks(4, _override_builtins)[0]
    assert before == ((Shard(0),), (Shard(0),))
    assert during == ((Replicate(),), (Replicate(),)), "the user rule must win over the built-in"
    assert ok
    assert after == before, "unregistering must bring the built-in rule back"


def _ruleless_op():
    """A custom op no rule will ever cover (built-in aten ops keep gaining rules)."""
    if not hasattr(torch.ops, "sptest") or not hasattr(torch.ops.sptest, "cummax_values"):
        @torch.library.custom_op("sptest::cummax_values", mutates_args=())
        def cummax_values(x: torch.Tensor, dim: int) -> torch.Tensor:
            return torch.cummax(x, dim)[0]

        @cummax_values.register_fake
        def _(x, dim):
            return torch.empty_like(x)
    return torch.ops.sptest.cummax_values.default


def _custom_op():
    import shardprop
    from shardprop import Replicate, Shard, distribute_tensor
    if not hasattr(torch.ops, "sptest") or not hasattr(torch.ops.sptest, "scale"):
        @torch.library.custom_op("sptest::scale", mutates_args=())
        def scale(x: torch.Tensor, f: float) -> torch.Tensor:
            return x * f

        @scale.register_fake
        def _(x, f):
            return torch.empty_like(x)
    op = torch.ops.sptest.scale.default
    mesh = _mesh()
    full = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))  # the same on every rank
    x = distribute_tensor(full, mesh, [Shard(0)])
    try:
        torch.ops.sptest.scale(x, 2.0)
        no_rule = None
    except Exception as e:
        no_rule = str(e)

    @shardprop.register_sharding(op)
    def scale_rule(x, f):
        return [([Shard(d)], [Shard(d)]) for d in range(x.ndim)] + [([Replicate()], [Replicate()])]

    y = torch.ops.sptest.scale(x, 2.0)
    report = shardprop.check_sharding_rule(op, full, 2.0)
    shardprop.unregister_sharding(op)
    return no_rule, y.placements, torch.allclose(y.full_tensor(), full * 2.0), report.ok


def test_custom_op_with_registered_rule():
    from shardprop import Shard
    no_rule, placements, ok, report_ok = run_on_ranks(4, _custom_op)[0]
    assert no_rule is not None and "sptest.scale.default" in no_rule and "register_sharding" in no_rule
    assert placements == (Shard(0),) and ok and report_ok


# ------------------------------------------------------------------ explain / explicit
def _explain_and_explicit():
    import warnings
    import shardprop
    from shardprop import Replicate, Shard, distribute_tensor
    mesh = _mesh()
    a = distribute_tensor(torch.randn(8, 8), mesh, [Shard(0)])
    b = distribute_tensor(torch.randn(8, 8), mesh, [Shard(1)])
    with shardprop.explain() as ex:
        c = a + b
    rec = ex.records[0]
    text = str(ex)
    with shardprop.explicit("raise"):
        same = a + a  # nothing to move: fine
        try:
            a + b
            raised = None
        except shardprop.ImplicitRedistributionError as e:
            raised = str(e)
        explicit_ok = a.redistribute(placements=[Replicate()]) is not None
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with shardprop.explicit("warn"):
            a + b
    return (rec.op, rec.inputs, rec.needed, rec.outputs, len(rec.candidates), rec.collectives, text, raised,
            explicit_ok, [str(x.message) for x in w], same.placements, c.placements)


def test_explain_records_choice_costs_and_collectives_and_explicit_guards():
    from shardprop import Shard
    (op, inputs, needed, outputs, n_cand, collectives, text, raised, explicit_ok, warned, same,
     c) = run_on_ranks(4, _explain_and_explicit)[0]
    assert op == "aten.add.Tensor"
    assert inputs == ((Shard(0),), (Shard(1),))
    assert len(set(needed)) == 1 and outputs == (needed[0],), "inputs must meet on one layout"
    assert n_cand >= 3
    assert len(collectives) == 1 and collectives[0][1] == "all_to_all", collectives
    assert "aten.add.Tensor" in text and "all_to_all" in text and "candidates" in text
    assert raised is not None and "aten.add.Tensor" in raised and "S(1)" in raised
    assert explicit_ok and same == (Shard(0),)
    assert any("aten.add.Tensor" in m for m in warned)


# ------------------------------------------------------------------ errors
def _errors():
    import shardprop
    from shardprop import Partial, Replicate, Shard, distribute_tensor
    mesh = _mesh()
    x = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
    msgs = {}
    try:
        x + torch.randn(8, 4)
    except shardprop.ShardingError as e:
        msgs["plain"] = str(e)
    scalar_ok = torch.allclose((x + torch.tensor(2.0)).full_tensor(), x.full_tensor() + 2)
    op = _ruleless_op()
    try:
        op(x, 0)
    except Exception as e:
        msgs["no_rule"] = str(e)
    shardprop.set_fallback_to_replicate(True)
    try:
        import warnings
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            vals = op(x, 0)
        fallback_ok = torch.allclose(vals.full_tensor(), torch.cummax(x.full_tensor(), 0)[0])
    finally:
        shardprop.set_fallback_to_replicate(False)
    try:
        x.cumsum_(0)  # along the sharded dim: only a replicated target works, and x must stay S(0)
    except Exception as e:
        msgs["inplace"] = str(e)
    # A Partial target is reduced in place first: p keeps its value (plus one), now replicated.
    p = distribute_tensor(torch.randn(8, 4), mesh, [Partial()])
    before = p.full_tensor()
    same_p = p.add_(1.0)
    partial_ok = (same_p is p and p.placements == (Replicate(),)
                  and torch.allclose(p.full_tensor(), before + 1.0))
    same = x.add_(1.0)
    return msgs, scalar_ok, fallback_ok, same is x and partial_ok


def test_clear_errors():
    msgs, scalar_ok, fallback_ok, inplace_returns_self = run_on_ranks(4, _errors)[0]
    assert "distribute_tensor" in msgs["plain"] and "from_local" in msgs["plain"]
    assert scalar_ok
    assert "sptest.cummax_values.default" in msgs["no_rule"] and "register_sharding" in msgs["no_rule"]
    assert "S(0)" in msgs["no_rule"]
    assert fallback_ok
    assert "aten.cumsum_.default" in msgs["inplace"] and "S(0)" in msgs["inplace"], msgs["inplace"]
    assert inplace_returns_self


def test_cache_stats_printed_at_exit_on_rank0(tmp_path):
    script = tmp_path / "s.py"
    script.write_text(textwrap.dedent("""
        import os, torch, torch.distributed as dist
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29000 + os.getpid() % 2000))
        dist.init_process_group("gloo", rank=0, world_size=1)
        from shardprop import init_device_mesh, distribute_tensor, Shard
        x = distribute_tensor(torch.ones(4, 4), init_device_mesh("cpu", (1,)), [Shard(0)])
        (x + x).relu()
        dist.destroy_process_group()
    """))
    env = dict(os.environ, SHARDPROP_CACHE_STATS="1")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "aten.add.Tensor" in out.stdout and "aten.relu.default" in out.stdout and "TOTAL" in out.stdout


def _writes_through_views():
    import shardprop
    from shardprop import Shard, distribute_tensor
    mesh = _mesh()
    full = torch.arange(64.0).reshape(4, 4, 4)
    x = distribute_tensor(full, mesh, [Shard(2)])
    x[:, 1, :] = 7.0  # select on an unsharded dim: a real view, the write reaches x
    expect = full.clone()
    expect[:, 1, :] = 7.0
    through = torch.equal(x.full_tensor(), expect)
    try:
        x[:, :, 0] = 7.0  # select on the sharded dim: the view is a gathered copy
        err = None
    except shardprop.ShardingError as e:
        err = str(e)
    # Once the base is gone, the copy is just a tensor (autograd accumulating into a gradient).
    w = distribute_tensor(torch.randn(5, 3), mesh, [Shard(0)]).requires_grad_()
    for _ in range(2):
        w.view(15).sum().backward()  # uneven S(0) of (5, 3) -> (15,): the view's grad is a copy
    accumulated = torch.equal(w.grad.full_tensor(), torch.full((5, 3), 2.0))
    return through, err, accumulated


def test_in_place_write_into_a_copied_view_raises():
    through, err, accumulated = run_on_ranks(4, _writes_through_views)[0]
    assert through, "a write through a real view must reach the base"
    assert err is not None and "copy, not a view" in err and "aten.select.int" in err, err
    assert accumulated


def test_plain_tensors_taken_as_replicated_are_the_ones_backward_formulas_build():
    from shardprop.dispatch.dispatcher import same_on_every_rank
    assert same_on_every_rank(torch.tensor([1, 2]))                 # indices torch builds from lists
    assert same_on_every_rank(torch.zeros(3, 2))                    # at::zeros in backward formulas
    assert not same_on_every_rank(torch.ones(3))                    # data, outside a backward pass
    assert not same_on_every_rank(torch.full((2,), 2.0))            # data: may differ between ranks
    assert not same_on_every_rank(torch.tensor([0.0, 1.0]))
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            seen.append(same_on_every_rank(torch.ones(1).expand(5, 1, 5)))  # at::ones (2.11's cumprod)
            seen.append(same_on_every_rank(torch.full((2,), 2.0)))
            return grad

    Probe.apply(torch.ones(2, requires_grad=True)).sum().backward()
    assert seen == [True, False]
