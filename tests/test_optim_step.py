"""The optimizer step over DTensor parameters: fused kernels, the per-parameter fast path, the memo.

* ``fused=True`` (``_fused_adam_``/``_fused_adamw_``/``_fused_sgd_``/``_fused_adagrad_``, ops/fused_optim.py)
  over parameters placed various ways (uneven, replicated, 2x2) gives the parameters of
  the same fused optimizer on plain tensors, keeps every placement, reduces Partial
  gradients, and makes one DTensor dispatch per step; misplaced written states and
  Partial parameters raise, naming the op.
* Parameter groups mixing plain tensors and DTensors (foreach=True, fused=True) split by
  position and give the plain run's parameters.
* Each Tensor method the dispatcher calls in place of an overload's C++ callable
  (dispatch/method_calls.py) runs exactly that overload, with the same result.
* A propagation answer the dispatcher remembers per op is forgotten when rules change,
  and nothing is remembered with the propagation cache switched off.
(foreach=True/False optimizers over DTensors: tests/test_ops_foreach.py.)
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardprop import Partial, Replicate, Shard
from tests.rankpool import run_on_ranks

R = Replicate()
SHAPES = [(8, 6), (5,), (6, 4), (3, 8)]
LAYOUTS = {
    (4,): [(Shard(0),), (Shard(0),), (Shard(1),), (R,)],
    (2, 2): [(Shard(0), Shard(1)), (R, Shard(0)), (Shard(1), R), (R, R)],
}
FUSED = [
    ("AdamW", dict(lr=0.05, weight_decay=0.01)),
    ("Adam", dict(lr=0.05, amsgrad=True)),
    ("SGD", dict(lr=0.1, momentum=0.9, nesterov=True)),
    ("Adagrad", dict(lr=0.1)),
]
STEPS = 3


def _data():
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=g) for s in SHAPES]
    grads = [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(STEPS)]
    return init, grads


def _fused_runs(mesh_shape):
    import shardprop
    from shardprop import DTensor, distribute_tensor, init_device_mesh
    mesh = init_device_mesh("cpu", mesh_shape)
    layouts = LAYOUTS[mesh_shape]
    n = mesh.size()
    problems, dispatches = [], {}
    init, grads = _data()

    def dgrad(g, i):
        if layouts[i] == (R,) * len(mesh_shape):  # a replicated parameter's gradient as partial sums
            return DTensor.from_local(g / n, mesh, [Partial()] * len(mesh_shape))
        return distribute_tensor(g, mesh, list(layouts[i]))

    for name, kw in FUSED:
        try:
            plain = [torch.nn.Parameter(t.clone()) for t in init]
            dist_ = [torch.nn.Parameter(distribute_tensor(t.clone(), mesh, list(pl))) for t, pl in zip(init, layouts)]
            o_plain = getattr(torch.optim, name)(plain, fused=True, **kw)
            o_dist = getattr(torch.optim, name)(dist_, fused=True, **kw)
            for s in range(STEPS):
                for i, g in enumerate(grads[s]):
                    plain[i].grad = g.clone()
                    dist_[i].grad = dgrad(g.clone(), i)
                o_plain.step()
                if s == STEPS - 1:
                    before = {r["op"]: r["calls"] for r in shardprop.cache_stats()}
                o_dist.step()
            after = {r["op"]: r["calls"] for r in shardprop.cache_stats()}
            dispatches[name] = sum(after.values()) - sum(before.values())
            for i, (w, d) in enumerate(zip(plain, dist_)):
                if d.placements != layouts[i]:
                    problems.append(f"{name}: parameter {i} moved to {d.placements}")
                torch.testing.assert_close(d.detach().full_tensor(), w.detach(), atol=1e-5, rtol=1e-5)
        except Exception as e:
            problems.append(f"{name}: {type(e).__name__}: {str(e)[:400]}")
    return problems, dispatches


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["1d", "2x2"])
def test_fused_optimizers_match_plain_fused_run(mesh_shape):
    problems, dispatches = run_on_ranks(4, _fused_runs, mesh_shape, timeout=300)[0]
    assert not problems, "\n".join(problems)
    assert dispatches == {name: 1 for name, _ in FUSED}, dispatches


def _mixed_runs():
    """Plain parameters beside DTensor ones (norms left unsharded): foreach and fused split by position."""
    from shardprop import distribute_tensor, init_device_mesh
    mesh = init_device_mesh("cpu", (4,))
    layouts = [(Shard(0),), None, (Shard(1),), None]  # None: a plain tensor
    init, grads = _data()
    problems = []
    for name, kw in [("AdamW", dict(lr=0.05, weight_decay=0.01, fused=True)),
                     ("AdamW", dict(lr=0.05, weight_decay=0.01, foreach=True)),
                     ("SGD", dict(lr=0.1, momentum=0.9, foreach=True)), ("SGD", dict(lr=0.1, fused=True))]:
        try:
            wrap = [(lambda t: t) if pl is None else (lambda t, pl=pl: distribute_tensor(t, mesh, list(pl)))
                    for pl in layouts]
            plain = [torch.nn.Parameter(t.clone()) for t in init]
            mixed = [torch.nn.Parameter(w(t.clone())) for w, t in zip(wrap, init)]
            o_plain = getattr(torch.optim, name)(plain, **kw)
            o_mixed = getattr(torch.optim, name)(mixed, **kw)
            for s in range(STEPS):
                for i, g in enumerate(grads[s]):
                    plain[i].grad = g.clone()
                    mixed[i].grad = wrap[i](g.clone())
                o_plain.step()
                o_mixed.step()
            for i, (w, m) in enumerate(zip(plain, mixed)):
                m = m.detach()
                torch.testing.assert_close(m.full_tensor() if layouts[i] else m, w.detach(), atol=1e-5, rtol=1e-5)
        except Exception as e:
            problems.append(f"{name} {kw}: {type(e).__name__}: {str(e)[:400]}")
    return problems


def test_plain_and_dtensor_parameters_mixed_in_one_group():
    problems = run_on_ranks(4, _mixed_runs, timeout=300)[0]
    assert not problems, "\n".join(problems)


def _fused_errors():
    from shardprop import DTensor, distribute_tensor, init_device_mesh
    mesh = init_device_mesh("cpu", (4,))
    aten = torch.ops.aten
    full = torch.randn(8, 4)
    out = {}

    def sgd(params, grads, bufs, **extra):
        aten._fused_sgd_.default(params, grads, bufs, weight_decay=0.0, momentum=0.9, lr=0.1, dampening=0.0,
                                 nesterov=False, maximize=False, is_first_step=False, **extra)

    for case in ("partial param", "misplaced buffer", "misplaced grad, scaled"):
        p = distribute_tensor(full.clone(), mesh, [Shard(0)])
        g = distribute_tensor(full.clone(), mesh, [Shard(0)])
        b = distribute_tensor(full.clone(), mesh, [Shard(0)])
        extra = {}
        if case == "partial param":
            p = DTensor.from_local(full.clone(), mesh, [Partial()])
        elif case == "misplaced buffer":
            b = distribute_tensor(full.clone(), mesh, [R])
        else:
            g = distribute_tensor(full.clone(), mesh, [R])
            extra = dict(grad_scale=torch.tensor(1.0))
        try:
            sgd([p], [g], [b], **extra)
            out[case] = "no error"
        except Exception as e:
            out[case] = f"{type(e).__name__}: {e}"
    return out


def test_fused_optimizer_refuses_what_it_cannot_update_in_place():
    out = run_on_ranks(4, _fused_errors, timeout=120)[0]
    for case, msg in out.items():
        assert "_fused_sgd_" in msg and "Error" in msg, f"{case}: {msg}"
    assert "Partial" in out["partial param"] and "momentum_buffer_list" in out["misplaced buffer"]
    assert "grad_scale" in out["misplaced grad, scaled"]


# ------------------------------------------------------------ method calls
class _Record(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _call_forms(op):
    """Argument forms the dispatcher can pass ``op``: tensors, Python numbers, 0-d tensors, kwargs."""
    g = torch.Generator().manual_seed(1)
    pos, kw = [], {}
    ints = iter([0, 1])
    for a in op._schema.arguments:
        kind = str(a.type)
        if a.kwarg_only:
            if kind in ("Scalar", "number"):
                kw[a.name] = 0.5
        elif kind == "Tensor":
            pos.append(torch.rand(4, 4, generator=g) + 0.5)  # square: every matmul form is valid
        elif kind in ("Scalar", "number"):
            pos.append(0.25)
        elif kind == "int":
            pos.append(next(ints))
    forms = [(pos, kw), (pos, {})]
    names = [a.name for a in op._schema.arguments if not a.kwarg_only]
    if "other" in names:  # binary ops: torch passes a Python number or a 0-d tensor there too
        i = names.index("other")
        for other in (0.75, 2, True, torch.tensor(0.75)):
            forms.append((pos[:i] + [other] + pos[i + 1:], kw))
    return forms


def test_method_calls_run_exactly_their_overload():
    from shardprop.dispatch.method_calls import METHOD_CALLS
    checked = 0
    for op, method in METHOD_CALLS.items():
        for args, kwargs in _call_forms(op):
            a1 = [x.clone() if isinstance(x, torch.Tensor) else x for x in args]
            a2 = [x.clone() if isinstance(x, torch.Tensor) else x for x in args]
            try:
                want = op._op(*a2, **kwargs)
            except RuntimeError as e:  # torch refuses this form (bool - tensor): the method must refuse it too
                with pytest.raises(type(e)):
                    method(*a1, **kwargs)
                continue
            with _Record() as rec:
                got = method(*a1, **kwargs)
            assert rec.ops == [op], f"{op} {args} {kwargs}: the method ran {rec.ops}"
            checked += 1
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            torch.testing.assert_close(a1[0], a2[0], rtol=0, atol=0)  # in-place targets alike
    assert checked >= 2 * len(METHOD_CALLS)  # every entry ran at least its two plain forms


# ------------------------------------------------------------ memo
def _memo_follows_rules():
    import shardprop
    from shardprop import distribute_tensor, init_device_mesh
    mesh = init_device_mesh("cpu", (4,))
    x = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
    aten = torch.ops.aten
    seen = [torch.sqrt(x.abs()).placements]

    @shardprop.register_sharding(aten.sqrt.default)
    def replicate_only(ctx):
        return [((R,), (R,))]

    try:
        seen.append(torch.sqrt(x.abs()).placements)
    finally:
        shardprop.unregister_sharding(aten.sqrt.default)
    seen.append(torch.sqrt(x.abs()).placements)
    # With the propagation cache switched off nothing is remembered: every call propagates.
    from shardprop.dispatch import propagate
    size = propagate.cache_info().maxsize
    shardprop.set_cache_size(0)
    try:
        for _ in range(3):
            torch.sqrt(x.abs())
        misses = next(r["misses"] for r in shardprop.cache_stats() if r["op"] == "aten.sqrt.default")
    finally:
        shardprop.set_cache_size(size)
    return seen, misses


def test_remembered_answers_follow_rule_changes():
    seen, misses = run_on_ranks(4, _memo_follows_rules, timeout=120)[0]
    assert seen == [(Shard(0),), (R,), (Shard(0),)]
    assert misses == 3
