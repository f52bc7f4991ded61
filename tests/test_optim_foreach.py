"""torch.optim over DTensor parameters uses the foreach kernels where the user left torch's default.

On 4 gloo ranks, optimizers with ``foreach`` left at ``None`` over DTensor parameters (sharded
several ways) make a handful of dispatches per step instead of several per parameter, give the
parameters of the same optimizer on plain tensors, and leave the group's ``foreach`` at ``None``
(so ``state_dict()`` is unchanged). An explicit ``foreach=False`` and
``set_optimizer_foreach_default(False)`` keep the per-parameter loop.
"""
import torch

from tests.rankpool import run_on_ranks

SHAPES = [(8, 6), (5,), (6, 4), (3, 8), (12,)]
STEPS = 3
OPTIMIZERS = [
    ("AdamW", dict(lr=0.05, weight_decay=0.01)),
    ("Adam", dict(lr=0.05)),
    ("SGD", dict(lr=0.1, momentum=0.9)),
    ("RMSprop", dict(lr=0.01)),
]


def _runs():
    import shardprop
    from shardprop import Replicate, Shard, distribute_tensor, init_device_mesh
    mesh = init_device_mesh("cpu", (4,))
    layouts = [[Shard(0)], [Replicate()], [Shard(1)], [Shard(1)], [Shard(0)]]
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=g) for s in SHAPES]
    grads = [[torch.randn(s, generator=g) for s in SHAPES] for _ in range(STEPS)]
    out = {}
    for name, kw in OPTIMIZERS:
        for mode in ("default", "explicit False", "switched off"):
            plain = [torch.nn.Parameter(t.clone()) for t in init]
            dist_ = [torch.nn.Parameter(distribute_tensor(t.clone(), mesh, pl)) for t, pl in zip(init, layouts)]
            extra = {"foreach": False} if mode == "explicit False" else {}
            o_plain = getattr(torch.optim, name)(plain, **kw)
            o_dist = getattr(torch.optim, name)(dist_, **kw, **extra)
            old = shardprop.set_optimizer_foreach_default(mode != "switched off")
            try:
                for s in range(STEPS):
                    for i, gr in enumerate(grads[s]):
                        plain[i].grad = gr.clone()
                        dist_[i].grad = distribute_tensor(gr.clone(), mesh, layouts[i])
                    o_plain.step()
                    before = sum(r["calls"] for r in shardprop.cache_stats())
                    o_dist.step()
                    calls = sum(r["calls"] for r in shardprop.cache_stats()) - before
            finally:
                shardprop.set_optimizer_foreach_default(old)
            for w, d in zip(plain, dist_):
                torch.testing.assert_close(d.detach().full_tensor(), w.detach(), atol=1e-6, rtol=1e-6)
            groups = o_dist.state_dict()["param_groups"]
            out[(name, mode)] = (calls, groups[0]["foreach"], sorted(groups[0]))
    return out


def test_foreach_where_left_to_default():
    out = run_on_ranks(4, _runs, timeout=300)[0]
    n = len(SHAPES)
    for name, _ in OPTIMIZERS:
        calls, foreach, keys = out[(name, "default")]
        # one dispatch per list op, not per parameter (the per-parameter loop makes several per parameter)
        assert calls < 2 * n, (name, calls)
        assert foreach is None and not any(k.startswith("_shardprop") for k in keys), (name, foreach, keys)
        for mode in ("explicit False", "switched off"):
            loop_calls, foreach, _ = out[(name, mode)]
            assert loop_calls >= 2 * n, (name, mode, loop_calls)
            assert foreach is (False if mode == "explicit False" else None)
