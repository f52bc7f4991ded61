"""fully_shard's torch-2.15 arguments and FSDPModule's controls, side by side with torch's own fully_shard.

Each case builds the same model on 4 gloo ranks twice, shards it with
``shardprop.fully_shard`` and with ``torch.distributed.fsdp.fully_shard`` with the
same arguments and setter calls, trains a few SGD steps on the same rank-local
rows, and compares losses, parameters and the collectives each issued during
forward/backward: (kind, group size) per call, in issue order, with markers where
each block's forward starts (so prefetching shows as gathers moving earlier).
shardprop's collectives are recorded at ``shardprop.mesh.collectives``, torch's at
``torch.distributed``; ``comm_counter()`` must agree with shardprop's record.
"""
import collections
import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests.rankpool import run_on_ranks

STEPS = 2
D, H = 8, 12


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, H)
        self.down = nn.Linear(H, D)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))

    def encode(self, x):  # a second entry point: register_fsdp_forward_method
        return torch.tanh(self.up(self.norm(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(D, D)
        self.layers = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(D, 4)

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _data(step):
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(16, D, generator=g), torch.randn(16, 4, generator=g)
    r = dist.get_rank()
    return x[4 * r:4 * r + 4], y[4 * r:4 * r + 4]  # every rank is its own data-parallel replica


# ---------------------------------------------------------------- the two implementations


def _api(impl):
    if impl == "torch":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Shard
    else:
        from shardprop import Shard, fully_shard, init_device_mesh
    return fully_shard, init_device_mesh, Shard


_MESHES = {}


def _mesh(impl, kind):
    if (impl, kind) not in _MESHES:  # process groups are made once per worker
        init = _api(impl)[1]
        _MESHES[impl, kind] = (init("cpu", (4,)) if kind == "1d"
                               else init("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
    return _MESHES[impl, kind]


_TORCH_KINDS = {"all_gather_single": ("AG", 2), "all_gather_into_tensor": ("AG", 2),
                "reduce_scatter_single": ("RS", 3), "reduce_scatter_tensor": ("RS", 3), "all_reduce": ("AR", 2)}


@contextlib.contextmanager
def _recording(impl, log):
    """Append (kind, group size) for each collective ``impl`` issues while active."""
    if impl == "torch":
        mod, names = dist, [n for n in _TORCH_KINDS if getattr(dist, n, None) is not None]
    else:
        from shardprop.mesh import collectives as mod
        names = ["all_gather", "all_gather_into_views", "reduce_scatter", "all_reduce"]
    saved = {n: getattr(mod, n) for n in names}
    depth = [0]

    def wrap(name, fn):
        def inner(*args, **kwargs):
            if depth[0] == 0:
                if impl == "torch":
                    kind, at = _TORCH_KINDS[name]
                    group = kwargs.get("group", args[at] if len(args) > at else None)
                    log.append((kind, dist.get_world_size(group)))
                else:
                    mesh, dims = (args[3], args[4]) if name == "all_gather_into_views" else (args[1], args[2])
                    kind = {"all_gather": "AG", "all_gather_into_views": "AG", "reduce_scatter": "RS",
                            "all_reduce": "AR"}[name]
                    log.append((kind, mod.resolve(mesh, dims)[2]))
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        return inner

    for n in names:
        setattr(mod, n, wrap(n, saved[n]))
    try:
        yield log
    finally:
        for n, fn in saved.items():
            setattr(mod, n, fn)


def _markers(model, log):
    for i, block in enumerate(model.layers):
        block.register_forward_pre_hook(lambda m, a, i=i: log.append(f"f{i}"))


# ---------------------------------------------------------------- cases: how to shard, what to call per step


def _shard(impl, model, mesh_kind="1d", block_kw=None, root_kw=None):
    fully_shard, _, _ = _api(impl)
    mesh = _mesh(impl, mesh_kind)
    for block in model.layers:
        fully_shard(block, mesh=mesh, **(block_kw or {}))
    fully_shard(model, mesh=mesh, **(root_kw or {}))
    return model


def _micro(model, x, y, parts, before=None):
    """Backward over ``parts`` micro-batches; ``before(i, n)`` runs setters before each."""
    total = 0.0
    for i in range(parts):
        if before is not None:
            before(i, parts)
        rows = slice(i * len(x) // parts, (i + 1) * len(x) // parts)
        loss = (model(x[rows]) - y[rows]).square().mean() / parts
        loss.backward()
        total += loss.item()
    return total


def _train(impl, case):
    shard, step_fn = CASES[case]
    model = shard(impl, Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    log, losses = [], []
    _markers(model, log)
    for step in range(STEPS):
        x, y = _data(step)
        log.append(f"step{step}")
        with _recording(impl, log):
            loss = step_fn(model, x, y)
        opt.step()
        opt.zero_grad()
        t = torch.tensor([loss])
        dist.all_reduce(t)
        losses.append(t.item() / 4)
    params = {n: p.full_tensor() for n, p in model.named_parameters()}
    placements = {n: [str(pl) for pl in p.placements] for n, p in model.named_parameters()}
    return losses, params, placements, log


def _plain_step(model, x, y):
    return _micro(model, x, y, 1)


def _set_all(model, name, *args):
    for m in [*model.layers, model]:
        getattr(m, name)(*args)


def _divide_step(model, x, y):
    _set_all(model, "set_gradient_divide_factor", 1.0)  # per module, as torch's (not recursive)
    _set_all(model, "set_force_sum_reduction_for_comms", True)  # torch's factor needs PREMUL_SUM otherwise: not on gloo
    return _micro(model, x, y, 1)


def _no_all_reduce_step(model, x, y):
    return _micro(model, x, y, 2, lambda i, n: model.set_requires_all_reduce(i == n - 1))


def _not_last_step(model, x, y):
    return _micro(model, x, y, 2, lambda i, n: model.set_is_last_backward(i == n - 1))


def _keep_gathered_step(model, x, y):
    def before(i, n):
        model.set_requires_gradient_sync(i == n - 1)
        model.set_reshard_after_backward(i == n - 1)
    return _micro(model, x, y, 2, before)


def _manual_finalize_step(model, x, y):
    manual = getattr(model, "set_manual_backward_finalization", None)  # torch 2.15; older: plain backward
    if manual is None:
        return _micro(model, x, y, 1)
    manual(True)
    loss = _micro(model, x, y, 1)
    model.finalize_backward(async_op=True).wait()
    return loss


def _prefetch_step(model, x, y):
    model.layers[0].set_modules_to_forward_prefetch([model.layers[1], model.layers[2]])
    model.layers[2].set_modules_to_backward_prefetch([model.layers[1], model.layers[0]])
    return _micro(model, x, y, 1)


def _no_reshard_step(model, x, y):
    model.set_reshard_after_forward(False)
    return _micro(model, x, y, 1)


def _dim1(impl):
    shard = _api(impl)[2]
    return lambda p: shard(1) if p.ndim == 2 else None


def _shard_inp_apart(impl, model):
    fully_shard, _, _ = _api(impl)
    fully_shard(model.inp, mesh=_mesh(impl, "1d"))  # its weight is not needed in backward (x needs no grad)
    _shard(impl, model)
    model.inp.set_unshard_in_backward(False)
    return model


def _shard_with_hook(impl, model):
    _shard(impl, model)
    for m in [*model.layers, model]:
        m.set_all_reduce_hook(lambda t: t.mul_(2.0))
    return model


def _shard_keeping_storage(impl, model):
    _shard(impl, model)
    keep = getattr(model, "set_keep_unsharded_storage", None)  # torch 2.15; the numbers are the same without
    if keep is not None:
        keep(True)
    return model


class _Boom(RuntimeError):
    pass


def _shard_then_fail(impl, model):
    """An exception in layers[1]'s forward, then reset_iter_state: training goes on as if nothing happened."""
    _shard(impl, model)
    reset = getattr(model, "reset_iter_state", None)  # torch 2.15; older: the plain run is the expectation
    if reset is None:
        return model
    block = model.layers[1]

    def boom(m, args):
        raise _Boom("injected")

    handle = block.up.register_forward_pre_hook(boom)
    try:
        model(_data(0)[0])
    except _Boom:
        pass
    handle.remove()
    try:
        model.layers[0].reset_iter_state()
    except RuntimeError as e:  # not the root
        assert "root" in str(e)
    reset()
    return model


CASES = {
    "default": (lambda impl, m: _shard(impl, m), _plain_step),
    "explicit_true": (lambda impl, m: _shard(impl, m, block_kw=dict(reshard_after_forward=True),
                                             root_kw=dict(reshard_after_forward=True)), _plain_step),
    "reshard_int2": (lambda impl, m: _shard(impl, m, block_kw=dict(reshard_after_forward=2)), _plain_step),
    "shard_dim1": (lambda impl, m: _shard(impl, m, block_kw=dict(shard_placement_fn=_dim1(impl)),
                                          root_kw=dict(shard_placement_fn=_dim1(impl))), _plain_step),
    "hsdp": (lambda impl, m: _shard(impl, m, "2d"), _plain_step),
    "divide_factor": (lambda impl, m: _shard(impl, m), _divide_step),
    "hsdp_no_all_reduce": (lambda impl, m: _shard(impl, m, "2d"), _no_all_reduce_step),
    "not_last_backward": (lambda impl, m: _shard(impl, m), _not_last_step),
    "keep_gathered": (lambda impl, m: _shard(impl, m), _keep_gathered_step),
    "prefetch": (lambda impl, m: _shard(impl, m), _prefetch_step),
    "no_reshard": (lambda impl, m: _shard(impl, m), _no_reshard_step),
    "unshard_in_backward": (_shard_inp_apart, _plain_step),
    "all_reduce_hook": (_shard_with_hook, _plain_step),
    "keep_storage": (_shard_keeping_storage, _plain_step),
    "reset_after_error": (_shard_then_fail, _plain_step),
    "manual_finalize": (lambda impl, m: _shard(impl, m), _manual_finalize_step),
}


def _both(cases):
    return {case: {impl: _train(impl, case) for impl in ("shardprop", "torch")} for case in cases}


def _collectives(log):
    return collections.Counter(e for e in log if isinstance(e, tuple))


def _same_training(runs, atol=1e-5):
    (l1, p1, pl1, _), (l2, p2, pl2, _) = runs["shardprop"], runs["torch"]
    assert l1 == pytest.approx(l2, abs=atol)
    assert set(p1) == set(p2)
    for n in p1:
        torch.testing.assert_close(p1[n], p2[n], atol=atol, rtol=0, msg=n)
    assert _placements_equal(pl1, pl2), (pl1, pl2)


def _placements_equal(a, b):
    norm = lambda s: s.replace("Shard(dim=", "S(").replace("Replicate()", "R")  # noqa: E731
    return all([norm(x) for x in a[n]] == [norm(x) for x in b[n]] for n in a)


# ---------------------------------------------------------------- tests


_GROUP_A = ["default", "explicit_true", "reshard_int2", "shard_dim1", "hsdp", "divide_factor"]
_GROUP_B = ["hsdp_no_all_reduce", "not_last_backward", "keep_gathered", "prefetch", "no_reshard",
            "unshard_in_backward", "all_reduce_hook", "keep_storage", "reset_after_error", "manual_finalize"]


@pytest.fixture(scope="module")
def runs_a():
    return run_on_ranks(4, _both, _GROUP_A)


@pytest.fixture(scope="module")
def runs_b():
    return run_on_ranks(4, _both, _GROUP_B)


@pytest.mark.parametrize("case", _GROUP_A)
def test_training_and_collectives_match_torch(runs_a, case):
    for rank_runs in runs_a:
        runs = rank_runs[case]
        _same_training(runs)
        assert _collectives(runs["shardprop"][3]) == _collectives(runs["torch"][3]), case


@pytest.mark.parametrize("case", _GROUP_B)
def test_setters_match_torch(runs_b, case):
    for rank_runs in runs_b:
        runs = rank_runs[case]
        _same_training(runs)
        assert _collectives(runs["shardprop"][3]) == _collectives(runs["torch"][3]), case


def _per_step(log, kind=None):
    return collections.Counter(e for e in log if isinstance(e, tuple) and (kind is None or e[0] == kind))


def test_reshard_after_forward_int_gathers_within_smaller_groups(runs_a):
    for rank_runs in runs_a:
        log = rank_runs["reshard_int2"]["shardprop"][3]
        c = _per_step(log, "AG")
        # per step: 4 forward gathers over all 4 ranks, 3 backward gathers (the blocks) within groups of 2
        assert c == {("AG", 4): 4 * STEPS, ("AG", 2): 3 * STEPS}, c
        default = _per_step(rank_runs["default"]["shardprop"][3], "AG")
        assert default == {("AG", 4): 7 * STEPS}, default
        explicit = _per_step(rank_runs["explicit_true"]["shardprop"][3], "AG")
        assert explicit == {("AG", 4): 8 * STEPS}, explicit  # an explicit True reshards the root too


def test_hsdp_reduce_scatters_then_all_reduces(runs_a):
    for rank_runs in runs_a:
        losses, params, placements, log = rank_runs["hsdp"]["shardprop"]
        assert _per_step(log) == {("AG", 2): 7 * STEPS, ("RS", 2): 4 * STEPS, ("AR", 2): 4 * STEPS}
        assert placements["layers.0.up.weight"] == ["R", "S(0)"]
        assert placements["layers.0.up.weight"] != rank_runs["default"]["shardprop"][2]["layers.0.up.weight"]


def test_shard_placement_fn_dim1(runs_a):
    for rank_runs in runs_a:
        pl = rank_runs["shard_dim1"]["shardprop"][2]
        assert pl["layers.0.up.weight"] == ["S(1)"] and pl["layers.0.norm.weight"] == ["S(0)"], pl


def test_divide_factor_changes_gradients(runs_a):
    for rank_runs in runs_a:
        default, summed = rank_runs["default"]["shardprop"][1], rank_runs["divide_factor"]["shardprop"][1]
        # SGD on gradients 4x larger (sum over 4 ranks, not mean) moves the parameters elsewhere
        assert not torch.allclose(default["head.weight"], summed["head.weight"], atol=1e-3)


def test_requires_all_reduce_false_skips_the_all_reduce(runs_b):
    for rank_runs in runs_b:
        log = rank_runs["hsdp_no_all_reduce"]["shardprop"][3]
        # two micro-batches per step: two reduce-scatters per unit, one all-reduce per unit
        assert _per_step(log, "RS") == {("RS", 2): 8 * STEPS}
        assert _per_step(log, "AR") == {("AR", 2): 4 * STEPS}


def test_reshard_after_backward_false_saves_the_next_gather(runs_b):
    for rank_runs in runs_b:
        kept = _per_step(rank_runs["keep_gathered"]["shardprop"][3], "AG")
        # micro-batch 1: 7 gathers; micro-batch 2 finds every unit gathered: only the 3 backward re-gathers
        assert kept == {("AG", 4): (7 + 3) * STEPS}, kept
        rs = _per_step(rank_runs["keep_gathered"]["shardprop"][3], "RS")
        assert rs == {("RS", 4): 4 * STEPS}, rs  # no reduce-scatter while gradients are not synced


def test_set_reshard_after_forward_false_skips_backward_gathers(runs_b):
    for rank_runs in runs_b:
        assert _per_step(rank_runs["no_reshard"]["shardprop"][3], "AG") == {("AG", 4): 4 * STEPS}


def test_unshard_in_backward_false_skips_its_backward_gather(runs_b):
    for rank_runs in runs_b:
        # 5 units: 5 forward gathers; backward re-gathers the 3 blocks but not inp
        assert _per_step(rank_runs["unshard_in_backward"]["shardprop"][3], "AG") == {("AG", 4): 8 * STEPS}


def test_all_reduce_hook_changes_gradients(runs_a, runs_b):
    for ra, rb in zip(runs_a, runs_b):
        hooked, default = rb["all_reduce_hook"]["shardprop"][1], ra["default"]["shardprop"][1]
        assert not torch.allclose(hooked["head.weight"], default["head.weight"], atol=1e-3)


def _forward_order(log):
    """The forward part of the first step: gathers and block-forward markers, in order."""
    out = []
    for e in log[1:]:
        if e == "step1":
            break
        out.append(e if isinstance(e, str) else e[0])
    return out[:out.index("f2") + 1]  # backward starts after the last block's forward


def test_forward_prefetch_issues_gathers_earlier(runs_a, runs_b):
    for ra, rb in zip(runs_a, runs_b):
        explicit = _forward_order(rb["prefetch"]["shardprop"][3])
        # layers[0] prefetches layers[1] and layers[2]: both gathers before layers[0]'s forward
        assert explicit == ["AG", "AG", "AG", "AG", "f0", "f1", "f2"], explicit
        assert explicit == _forward_order(rb["prefetch"]["torch"][3])
        default = _forward_order(ra["default"]["shardprop"][3])
        assert default.index("f0") < len(default) - 1 - default[::-1].index("AG"), default  # a gather after f0


def test_backward_prefetch_order_matches_torch(runs_b):
    for rank_runs in runs_b:
        seq = [e[0] for e in rank_runs["prefetch"]["shardprop"][3] if isinstance(e, tuple)]
        ref = [e[0] for e in rank_runs["prefetch"]["torch"][3] if isinstance(e, tuple)]
        first_rs = seq.index("RS")
        # layers[2]'s backward prefetches layers[1] and layers[0]: every backward gather precedes the first
        # reduce-scatter
        assert seq[first_rs:first_rs + 4] == ["RS"] * 4, seq
        assert seq == ref


def test_comm_counter_agrees_with_the_record():
    for counts, log in run_on_ranks(4, _counted):
        assert counts == {"all_gather": log[("AG", 4)], "reduce_scatter": log[("RS", 4)]}, (counts, log)


def _counted():
    from shardprop import comm_counter
    model = _shard("shardprop", Net(), block_kw=dict(reshard_after_forward=2))
    x, y = _data(0)
    log = []
    with comm_counter() as c, _recording("shardprop", log):
        _micro(model, x, y, 1)
    counts = {k: n for k, (n, _) in c.counts.items()}
    # the backward gathers within groups of 2 count as all-gathers too
    counts["all_gather"] -= sum(1 for e in log if e == ("AG", 2))
    return counts, collections.Counter(log)
