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


def _two_meshes():
    """Parameters on a (dp, tp) mesh and on its dp sub-mesh (fully_shard beside TP) in one optimizer
    and one clip_grad_norm_: each list op runs once per mesh; values as on plain tensors."""
    import shardprop
    from shardprop import Shard, distribute_tensor, init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    g = torch.Generator().manual_seed(0)
    shapes = [(4, 6), (6,), (8, 4), (5,)]
    meshes = [(mesh, [Shard(0), Shard(1)]), (mesh["dp"], [Shard(0)]), (mesh, [Shard(1), Shard(0)]),
              (mesh["dp"], [Shard(0)])]
    init = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(2)]
    errors = []
    for foreach in (None, True, False):
        ours = [torch.nn.Parameter(distribute_tensor(t, m, p)) for t, (m, p) in zip(init, meshes)]
        ref = [torch.nn.Parameter(t.clone()) for t in init]
        opt, ropt = torch.optim.AdamW(ours, foreach=foreach), torch.optim.AdamW(ref, foreach=foreach)
        for step in grads:
            for p, r, gr in zip(ours, ref, step):
                p.grad = distribute_tensor(gr, p.device_mesh, p.placements)
                r.grad = gr.clone()
            norm = torch.nn.utils.clip_grad_norm_(ours, 1.0, foreach=foreach)
            rnorm = torch.nn.utils.clip_grad_norm_(ref, 1.0, foreach=foreach)
            norm = norm.full_tensor() if isinstance(norm, shardprop.DTensor) else norm
            if not torch.allclose(norm, rnorm, atol=1e-5):
                errors.append(f"foreach={foreach}: grad norm {norm} vs {rnorm}")
            opt.step()
            ropt.step()
        for i, (p, r) in enumerate(zip(ours, ref)):
            if not torch.allclose(p.full_tensor(), r, atol=1e-5):
                errors.append(f"foreach={foreach}: param {i} differs after two steps")
    return errors


def test_list_ops_over_parameters_of_two_meshes_run_per_mesh():
    assert run_on_ranks(4, _two_meshes) == [[]] * 4
