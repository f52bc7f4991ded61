"""torch's private mesh-building API on our DeviceMesh: _flatten, _unflatten, _concatenate, _layout.

The oracle is torch's own DeviceMesh, built in the same rank job with the same calls (the call shapes
torchtitan 0.3 uses, distributed/parallel_dims.py): every derived mesh must have the same ranks,
names, shape, coordinates, local ranks, layout, and groups over the same ranks. A collective over
each of our groups proves it holds those ranks.
"""
import pytest
import torch
import torch.distributed as dist

from tests.rankpool import run_on_ranks


def _flat(t):
    return (t,) if isinstance(t, int) else tuple(x for part in t for x in _flat(part))


def _steps(axes):
    # Size-1 steps say nothing about which ranks a dim holds; torch 2.11 lists them, later releases drop them.
    return tuple(tuple(p for p in ax if p[0] != 1) for ax in axes)


def _torch_axes(layout):
    """torch's _MeshLayout as ours stores it: per dim, its (size, stride) pairs."""
    if hasattr(layout, "axes") or not hasattr(layout, "shape"):  # 2.13+: a sequence of flat layouts
        return tuple(tuple(zip(_flat(ax.shape), _flat(ax.stride))) for ax in layout)
    shape, stride = layout.shape, layout.stride  # 2.11: one pycute layout, a mode per mesh dim
    if isinstance(shape, int):
        shape, stride = (shape,), (stride,)
    return tuple(tuple(zip(_flat(a), _flat(b))) for a, b in zip(shape, stride))


def _facts(mesh, ours: bool):
    """What must agree between our mesh and torch's, on this rank."""
    out = dict(mesh=mesh.mesh.tolist(), names=tuple(mesh.mesh_dim_names or ()), shape=tuple(mesh.shape),
               ndim=mesh.ndim, size=mesh.size(), coord=tuple(mesh.get_coordinate() or ()),
               sizes=[mesh.size(d) for d in range(mesh.ndim)],
               local=[mesh.get_local_rank(d) for d in range(mesh.ndim)],
               groups=[sorted(dist.get_process_group_ranks(mesh.get_group(d))) for d in range(mesh.ndim)],
               backends=[str(dist.get_backend(mesh.get_group(d))) for d in range(mesh.ndim)],  # "fake" overrides
               layout=_steps(mesh._layout.axes if ours else _torch_axes(mesh._layout)))
    return out


def _sum_over(mesh, d):
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t, group=mesh.get_group(d))
    return t.item()


def _titan_meshes(init, pp, dp_replicate, dp_shard, cp, tp, ep):
    """torchtitan 0.3's ParallelDims.build_mesh, every backend's meshes (its exact calls)."""
    world = dist.get_world_size()

    def exists(name, degree):
        return name in ("fsdp", "dp_shard") or (name == "efsdp" and ep > 1) or degree > 1

    def unflatten(world_mesh, names, degrees):
        override = {n: "fake" for n, d in zip(names, degrees) if not exists(n, d)}
        return world_mesh._unflatten(0, degrees, names, backend_override=override)

    batch, fsdp = dp_replicate * dp_shard, dp_shard * cp
    efsdp = fsdp * tp // ep
    world_mesh = init("cpu", (world,), mesh_dim_names=("world",))
    loading = unflatten(world_mesh, ("pp", "batch", "cp", "tp"), (pp, batch, cp, tp))
    loss = loading["batch", "cp"]._flatten("loss_mesh")
    full_dt = unflatten(world_mesh, ("pp", "dp_replicate", "dp_shard", "cp", "tp"), (pp, dp_replicate, dp_shard, cp, tp))
    spmd = unflatten(world_mesh, ("pp", "dp", "cp", "tp"), (pp, batch, cp, tp))["dp", "cp", "tp"]
    legacy = unflatten(world_mesh, ("pp", "dp_replicate", "fsdp", "tp"), (pp, dp_replicate, fsdp, tp))
    sparse = unflatten(world_mesh, ("pp", "dp_replicate", "efsdp", "ep"), (pp, dp_replicate, efsdp, ep))
    meshes = dict(world=world_mesh, loading=loading, loss=loss, full_dt=full_dt, spmd=spmd, legacy=legacy,
                  sparse=sparse, pp=loading["pp"], batch=loading["batch"], cp=loading["cp"], tp=loading["tp"],
                  ep=sparse["ep"], efsdp=sparse["efsdp"], fsdp=legacy["fsdp"], dp_shard=full_dt["dp_shard"],
                  dp=spmd["dp"], dp_replicate=legacy["dp_replicate"], sparse_spmd=sparse["dp_replicate", "efsdp", "ep"],
                  root_loss=world_mesh["loss_mesh"])
    # full_dtensor.py: the storage mesh of a TP parameter under FSDP
    meshes["storage"] = type(world_mesh)._concatenate([legacy["fsdp"], loading["tp"]])
    meshes["storage_ep"] = type(world_mesh)._concatenate([sparse["efsdp"], sparse["ep"]])
    return meshes


def _titan_against_torch(degrees):
    from torch.distributed.device_mesh import init_device_mesh as torch_init
    from shardprop.mesh import init_device_mesh
    from shardprop.mesh.compat import register_fake_backend
    register_fake_backend()  # torch's own fully_shard import registers it in torchtitan
    ours = _titan_meshes(init_device_mesh, *degrees)
    theirs = _titan_meshes(torch_init, *degrees)
    diffs = {}
    for name in ours:
        a, b = _facts(ours[name], True), _facts(theirs[name], False)
        if a != b:
            diffs[name] = {k: (a[k], b[k]) for k in a if a[k] != b[k]}
    # our groups hold the ranks they claim: one collective on each real group
    sums = {n: [_sum_over(ours[n], d) for d in range(ours[n].ndim) if ours[n].size(d) > 1]
            for n in ("loss", "tp", "fsdp", "storage", "efsdp", "batch")}
    expect = {n: [float(sum(_facts(ours[n], True)["groups"][d])) for d in range(ours[n].ndim) if ours[n].size(d) > 1]
              for n in sums}
    same_layout = ours["storage"]._layout == ours["legacy"]["fsdp", "tp"]._layout
    return diffs, sums == expect, same_layout, hash(ours["loss"]._layout) == hash(ours["root_loss"]._layout)


@pytest.mark.parametrize("degrees", [(1, 1, 2, 2, 2, 2), (2, 2, 2, 1, 1, 2)],
                         ids=["dp_shard2-cp2-tp2-ep2", "pp2-dp_rep2-dp_shard2"])
def test_torchtitan_meshes_match_torch(degrees):
    for diffs, sums_ok, same_layout, hash_ok in run_on_ranks(8, _titan_against_torch, degrees):
        assert not diffs, diffs
        assert sums_ok and same_layout and hash_ok


def _flatten_and_slice():
    from torch.distributed.device_mesh import init_device_mesh as torch_init
    from shardprop.mesh import init_device_mesh
    out = []
    for init in (init_device_mesh, torch_init):
        mesh = init("cpu", (2, 2, 2), mesh_dim_names=("dp_shard", "cp", "tp"))
        adjacent = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        apart = mesh["dp_shard", "tp"]._flatten()  # default name: the names joined
        again = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        ours = init is init_device_mesh
        try:
            apart_by_name = mesh["dp_shard_tp"]
        except NotImplementedError:  # torch 2.11 slices a flattened dim only over adjacent dims (2.13+: any)
            out.append(None)
            continue
        facts = [_facts(m, ours) for m in (adjacent, apart, mesh["dp_shard_cp"], apart_by_name)]
        facts.append(sorted(dist.get_process_group_ranks(mesh["tp"].get_group("dp_shard_cp"))))  # by the root's name
        tp = mesh["tp"]
        one_d = tp._flatten("tp") is tp if ours else None
        out.append((facts, apart.mesh_dim_names, again is adjacent, one_d))
    (facts, name, same, one_d), theirs = out
    if theirs is None:  # only ours to check against itself
        return True, None, name == ("dp_shard_tp",), same, one_d
    tfacts, tname, tsame, _ = theirs
    return facts == tfacts, (facts, tfacts), name == tname == ("dp_shard_tp",), same and tsame, one_d


def test_flatten_adjacent_and_apart_dims_slice_from_root_like_torch():
    for equal, both, names_ok, same, one_d in run_on_ranks(8, _flatten_and_slice):
        assert equal, both
        assert names_ok and same and one_d


def _errors_like_torch():
    from shardprop.mesh import DeviceMesh, init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    caught = []
    for bad in (lambda: mesh["dp", "tp"]._flatten("dp"),                       # a root dim's name
                lambda: mesh["dp"]._unflatten(0, (3,), ("a",)),                 # sizes do not multiply
                lambda: mesh._unflatten(0, (1, 2), ("a",)),                     # names and sizes differ
                lambda: mesh._unflatten("nope", (2,), ("a",)),
                lambda: DeviceMesh._concatenate([mesh["dp"], mesh["dp"]]),      # overlapping dims
                lambda: mesh._unflatten(1, (2,), ("x",), backend_override={"y": "gloo"})):
        with pytest.raises((ValueError, RuntimeError)) as info:
            bad()
        caught.append(type(info.value).__name__)
    mesh["dp", "tp"]._flatten("both")
    with pytest.raises(ValueError, match="flattened from"):
        init_device_mesh("cpu", (4,), mesh_dim_names=("w",))  # a new root: no clash with the old one
        mesh["tp"]._flatten("both")  # same name, other dims
    t = torch.ones(1)
    dist.all_reduce(t)  # every rank still in step: no rank went into a collective alone
    return caught


def test_errors_are_clear_and_raised_on_every_rank():
    for caught in run_on_ranks(4, _errors_like_torch):
        assert caught == ["ValueError", "ValueError", "RuntimeError", "ValueError", "RuntimeError", "RuntimeError"]


def _one_universe():
    """Meshes over the same ranks combine, however they were built."""
    from shardprop.mesh import DeviceMesh, init_device_mesh
    a = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    b = DeviceMesh("cpu", [[0, 2], [1, 3]], ("tp2", "dp2"))  # another root, dims in the other order: tp2 is a's tp
    world = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    c = world._unflatten(0, (2, 2), ("x", "tp3"))
    combos = {}
    for label, (outer, inner) in dict(ab=(a["dp"], b["tp2"]), ac=(a["dp"], c["tp3"]), ba=(b["dp2"], a["tp"])).items():
        m = DeviceMesh._concatenate([outer, inner])
        combos[label] = (m.mesh.tolist(), m.mesh_dim_names, m.get_coordinate(),
                         [sorted(dist.get_process_group_ranks(m.get_group(d))) for d in range(2)])
    sub = DeviceMesh("cpu", [0, 1], ("p",)) if dist.get_rank() < 2 else DeviceMesh("cpu", [2, 3], ("p",))
    with pytest.raises(RuntimeError, match="different"):
        DeviceMesh._concatenate([a["dp"], sub])
    return combos


def test_meshes_over_the_same_ranks_are_one_universe():
    for rank, combos in enumerate(run_on_ranks(4, _one_universe)):
        dp, tp = rank // 2, rank % 2
        assert combos["ab"][0] == [[0, 1], [2, 3]] and combos["ab"][2] == [dp, tp], combos
        assert combos["ac"] == (combos["ab"][0], ("dp", "tp3")) + combos["ab"][2:], combos
        assert combos["ba"][0] == [[0, 1], [2, 3]] and combos["ba"][1] == ("dp2", "tp"), combos


def _fsdp_tp_two_roots(split):
    """FSDP + TP with the dp and tp meshes sliced from two meshes unflattened from one world (torchtitan)."""
    from shardprop import ColwiseParallel, RowwiseParallel, fully_shard, init_device_mesh, parallelize_module
    from tests.test_fully_shard import _mlp, _rows
    if split:
        world = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
        tp_mesh = world._unflatten(0, (1, 2, 1, 2), ("pp", "batch", "cp", "tp"),
                                   backend_override={"pp": "fake", "cp": "fake"})["tp"]
        dp_mesh = world._unflatten(0, (1, 1, 2, 2), ("pp", "dp_replicate", "fsdp", "tp"))["fsdp"]
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))
        tp_mesh, dp_mesh = mesh["tp"], mesh["fsdp"]
    model = parallelize_module(_mlp(), tp_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = _rows(torch.randn(8, 6, generator=torch.Generator().manual_seed(4)), dp_mesh)
    for _ in range(2):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return ({n: p.full_tensor() for n, p in model.named_parameters()},
            {n: (str(list(p.placements)), p.device_mesh.mesh.tolist()) for n, p in model.named_parameters()})


def _fsdp_tp_both():
    return _fsdp_tp_two_roots(False), _fsdp_tp_two_roots(True)


def test_fully_shard_combines_dp_and_tp_meshes_of_different_roots():
    for (one_root, one_meta), (two_roots, two_meta) in run_on_ranks(4, _fsdp_tp_both):
        assert one_meta == two_meta, (one_meta, two_meta)
        for n, p in one_root.items():
            torch.testing.assert_close(two_roots[n], p, atol=1e-6, rtol=0, msg=n)


def _fsdp_tp_refused():
    from shardprop import ColwiseParallel, fully_shard, init_device_mesh, parallelize_module
    from tests.test_fully_shard import _mlp
    world = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    tp_mesh = world._unflatten(0, (2, 2), ("dp", "tp"))["tp"]
    same_dim = world._unflatten(0, (2, 2), ("x", "fsdp"))["fsdp"]  # the same ranks as tp: no 2-d mesh
    model = parallelize_module(_mlp(), tp_mesh, {"0": ColwiseParallel()})
    with pytest.raises(ValueError, match="does not combine"):
        fully_shard(model, mesh=same_dim)
    t = torch.ones(1)
    dist.all_reduce(t)
    return True


def test_fully_shard_refuses_meshes_that_do_not_combine():
    assert run_on_ranks(4, _fsdp_tp_refused) == [True] * 4


def test_layout_value_type():
    from shardprop.mesh.layout import MeshLayout
    lay = MeshLayout.from_sizes_strides((1, 2, 2, 2))
    assert lay.sizes == (1, 2, 2, 2) and lay.strides == (0, 4, 2, 1) and lay.numel() == 8 and len(lay) == 4
    apart = lay.select((1, 3)).collapse()
    assert apart.sizes == (4,) and apart.strides == ((4, 1),) and apart.cosize() == 6
    assert apart.positions(8).tolist() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert lay.select((1, 2)).collapse() == MeshLayout.from_sizes_strides((4,), (2,))
    assert MeshLayout.from_sizes_strides((8,)).split(0, (2, 1, 4)) == MeshLayout.from_sizes_strides((2, 1, 4))
    assert apart.split(0, (2, 2)) == lay.select((1, 3))
    assert not MeshLayout.concat([lay.select((1,)), lay.select((1,))]).orthogonal()
    with pytest.raises(AttributeError):
        lay.axes = ()
    import pickle
    assert pickle.loads(pickle.dumps(apart)) == apart and hash(pickle.loads(pickle.dumps(apart))) == hash(apart)


def test_unflatten_and_flatten_on_the_fake_backend_build_only_this_ranks_groups():
    from tests.test_fake_backend import run
    out = run("""
        start(65536)
        from torch.distributed import distributed_c10d as c10d
        world = sp.init_device_mesh("cpu", (65536,), mesh_dim_names=("world",))
        before = len(c10d._world.pg_map)
        t = time.perf_counter()
        m = world._unflatten(0, (8, 64, 8, 16), ("pp", "batch", "cp", "tp"), backend_override={"pp": "fake"})
        loss = m["batch", "cp"]._flatten("loss")
        both = type(m)._concatenate([m["pp"], loss])
        secs = time.perf_counter() - t
        def heads(g):
            r = sorted(dist.get_process_group_ranks(g))
            return r[:3] + r[-1:]
        print(json.dumps(dict(secs=secs, made=len(c10d._world.pg_map) - before, coord=m.get_coordinate(),
                              ranks=[heads(m.get_group(d)) for d in range(4)] + [heads(loss.get_group())],
                              loss=[loss.size(), loss.get_local_rank(), world["loss"].size()],
                              both=[list(both.shape), both.get_coordinate()])))
    """)
    assert out["coord"] == [0, 0, 0, 3]
    assert out["ranks"] == [[3, 8195, 16387, 57347], [3, 131, 259, 8067], [3, 19, 35, 115], [0, 1, 2, 15],
                            [3, 19, 35, 8179]]
    assert out["loss"] == [512, 0, 512] and out["both"] == [[8, 512], [0, 0]]
    assert out["made"] <= 5, out  # one group per new dim through this rank (and the flattened one), no other
    assert out["secs"] < 20, out
