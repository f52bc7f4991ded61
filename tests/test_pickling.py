"""Pickling DTensors and meshes (shardprop/checkpoint/pickling.py, DeviceMesh.__reduce__).

* DTensors round-trip through ``pickle``, ``torch.save``/``torch.load`` (``weights_only``
  True, the default, and False) and ``copy.deepcopy``: Shard, Replicate, Partial, a 2x2
  mesh, uneven shards; values compared with the full tensor plain torch made;
* a mesh pickles as data and rebinds to this process's mesh (the same object); a slice
  nobody holds any more is rebuilt over the groups that exist; a mesh that does not exist
  here, or a process without torch.distributed, gives an error naming it;
* ``copy.deepcopy`` of a parallelized module: independent parameters, same outputs;
  ``torch.save(model.state_dict())`` loads (weights_only) into a fresh parallelized model;
* ``torch.save(model)`` of a whole parallelized module (the demo Llama under its sequence-parallel
  plan: hooks, fused forwards) and ``copy.deepcopy`` of it: the copy trains one step exactly like
  single-process torch, and its replicated parameters keep their gradient layout (the
  ``GradLike`` hooks follow the parameters);
* ``weights_only`` still refuses any other class, and only our value types are allowlisted.
"""
import copy
import io
import pickle

import pytest
import torch

from tests.rankpool import run_on_ranks


def _full(shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _cases():
    """(name, mesh shape, placements, global shape) of the layouts checked."""
    from shardprop import Partial, Replicate, Shard
    return [
        ("shard0", (4,), [Shard(0)], (8, 6)),
        ("shard1_uneven", (4,), [Shard(1)], (3, 7)),
        ("replicate", (4,), [Replicate()], (5, 2)),
        ("partial", (4,), [Partial()], (4, 4)),
        ("mesh2x2", (2, 2), [Shard(0), Shard(1)], (6, 5)),
        ("nested_uneven", (2, 2), [Shard(0), Shard(0)], (5, 3)),
    ]


def _roundtrips(how: str):
    """Every case through ``how``; returns problems (empty when all round-trip)."""
    import shardprop as sp
    problems = []
    meshes = {}
    for i, (name, mshape, placements, shape) in enumerate(_cases()):
        mesh = meshes.setdefault(mshape, sp.init_device_mesh("cpu", mshape))
        full = _full(shape, i)
        if placements[0] == sp.Partial():
            # Partial: each rank holds a part; the parts add up to `full`.
            part = full / 4 + torch.distributed.get_rank() - 1.5
            dt = sp.DTensor.from_local(part, mesh, placements, shape=shape)
        else:
            dt = sp.distribute_tensor(full, mesh, placements)
        dt.requires_grad_(name == "shard0")
        if how == "pickle":
            back = pickle.loads(pickle.dumps(dt))
        elif how == "deepcopy":
            back = copy.deepcopy(dt)
        else:
            f = io.BytesIO()
            torch.save({"t": dt}, f)
            f.seek(0)
            back = torch.load(f, weights_only=(how == "torch_load_weights_only"))["t"]
        what = f"{name} via {how}"
        if type(back) is not sp.DTensor:
            problems.append(f"{what}: got a {type(back).__name__}")
            continue
        # Specs are interned, and equal meshes interchangeable: the spec may hold an equal mesh
        # made earlier in this worker. The copy must be on the very mesh object the original is on.
        if back.device_mesh is not dt.device_mesh or back.device_mesh != mesh or back.placements != dt.placements:
            problems.append(f"{what}: mesh {back.device_mesh} (same object: {back.device_mesh is dt.device_mesh}), "
                            f"placements {back.placements}")
        if back.shape != dt.shape or back.requires_grad != dt.requires_grad:
            problems.append(f"{what}: shape {back.shape}, requires_grad {back.requires_grad}")
        if not torch.equal(back.to_local(), dt.to_local()):
            problems.append(f"{what}: local tensor differs")
        if not torch.allclose(back.detach().full_tensor(), full, atol=1e-6):
            problems.append(f"{what}: full tensor differs from plain torch's")
        if back._local_tensor.untyped_storage().data_ptr() == dt._local_tensor.untyped_storage().data_ptr():
            problems.append(f"{what}: shares the local tensor's storage")
    return problems


@pytest.mark.parametrize("how", ["pickle", "torch_load_weights_only", "torch_load", "deepcopy"])
def test_dtensor_roundtrip(how):
    per_rank = run_on_ranks(4, _roundtrips, how)
    problems = [p for r, ps in enumerate(per_rank) for p in (f"rank {r}: {x}" for x in ps)]
    assert not problems, "\n".join(problems)


def _deepcopy_independent():
    import shardprop as sp
    mesh = sp.init_device_mesh("cpu", (2,))
    dt = sp.distribute_tensor(_full((4, 3), 0), mesh, [sp.Shard(0)])
    twin = copy.deepcopy(dt)
    twin.add_(1.0)  # in place on the copy
    return (bool(torch.equal(dt.full_tensor(), _full((4, 3), 0))),
            bool(torch.equal(twin.full_tensor(), _full((4, 3), 0) + 1)), twin.device_mesh is dt.device_mesh)


def test_deepcopy_is_independent_on_the_same_mesh():
    for untouched, changed, same_mesh in run_on_ranks(2, _deepcopy_independent):
        assert untouched and changed and same_mesh


# ------------------------------------------------------------------ modules and state dicts
def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _tp(model, mesh):
    import shardprop as sp
    return sp.parallelize_module(model, mesh, {"0": sp.ColwiseParallel(), "2": sp.RowwiseParallel()})


def _module_copies():
    import shardprop as sp
    mesh = sp.init_device_mesh("cpu", (2,))
    ref = _mlp()
    model = _tp(copy.deepcopy(ref), mesh)
    x = _full((3, 8), 5)
    out = {}
    twin = copy.deepcopy(model)
    out["twin_params"] = all(type(p) is sp.DTensor and isinstance(p, torch.nn.Parameter) and p is not q
                             and p.device_mesh is q.device_mesh and p.placements == q.placements
                             for p, q in zip(twin.parameters(), model.parameters()))
    out["twin_same_output"] = bool(torch.allclose(twin(x), ref(x), atol=1e-6))
    # Train the copy one step: the original must not move.
    opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    twin(x).sum().backward()
    opt.step()
    out["original_untouched"] = all(torch.equal(p.full_tensor(), q) for p, q in
                                    zip(model.parameters(), ref.parameters()))
    out["twin_moved"] = not torch.equal(twin[0].weight.full_tensor(), ref[0].weight)
    # torch.save of the state dict, torch.load with the default weights_only=True into a fresh model.
    f = io.BytesIO()
    torch.save(twin.state_dict(), f)
    f.seek(0)
    sd = torch.load(f)
    fresh = _tp(_mlp(), mesh)
    fresh.load_state_dict(sd)
    out["loaded_equal"] = all(torch.equal(p.full_tensor(), q.full_tensor()) for p, q in
                              zip(fresh.parameters(), twin.parameters()))
    out["loaded_output"] = bool(torch.allclose(fresh(x), twin(x)))
    return out


def test_deepcopy_and_state_dict_of_a_parallelized_module():
    for out in run_on_ranks(2, _module_copies):
        assert all(out.values()), out


# ------------------------------------------------------------------ meshes
def _mesh_rebinding():
    import shardprop as sp
    from shardprop.mesh import device_mesh as dm
    mesh = sp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = {"same_object": pickle.loads(pickle.dumps(mesh)) is mesh,
           "deepcopy_same": copy.deepcopy(mesh) is mesh}
    # A DTensor on a slice that nobody holds by the time it is loaded: rebuilt over existing groups.
    full = _full((4, 6), 1)
    data = pickle.dumps(sp.distribute_tensor(full, mesh["tp"], [sp.Shard(1)]))
    import gc
    gc.collect()
    back = pickle.loads(data)
    out["slice_rebuilt"] = (back.device_mesh == mesh["tp"] and bool(torch.equal(back.full_tensor(), full)))
    # A mesh no one holds whose groups exist (here: a name never used): rebuilt, no new group.
    from shardprop.mesh import groups
    tp_ranks = tuple(mesh["tp"].mesh.tolist())
    n_groups = len(groups._group_cache)
    rebuilt = dm._rebind("cpu", tp_ranks, (2,), ("never_named",))
    out["rebuilt_on_existing_groups"] = (rebuilt.get_group(0) is mesh["tp"].get_group(0)
                                         and len(groups._group_cache) == n_groups)
    # A mesh this process does not have: an error naming it, and what exists.
    errors = {}
    try:
        dm._rebind("cpu", (0, 1), (2,), ("never_named_either",))
        errors["not_member"] = "no error"
    except ValueError as e:
        errors["not_member"] = str(e)
    for name, args in [("device", ("cuda", (0, 1, 2, 3), (4,), None)),
                       ("outside", ("cpu", tuple(range(8)), (8,), None))]:
        try:
            dm.DeviceMesh.__new__(dm.DeviceMesh, dm._PICKLED, *args)
            errors[name] = "no error"
        except ValueError as e:
            errors[name] = str(e)
    out["errors"] = errors
    return out


def test_mesh_pickles_as_data_and_rebinds():
    for rank, out in enumerate(run_on_ranks(4, _mesh_rebinding)):
        assert out["same_object"] and out["deepcopy_same"] and out["slice_rebuilt"], out
        assert out["rebuilt_on_existing_groups"], out
        if rank < 2:  # ranks 0 and 1 have a group over [0, 1]: rebuilt
            assert out["errors"]["not_member"] == "no error", out["errors"]
        else:
            assert f"this rank ({rank}) is not in it" in out["errors"]["not_member"], out["errors"]
        assert "DeviceMesh('cuda', [0, 1, 2, 3])" in out["errors"]["device"], out["errors"]
        assert "create the mesh" in out["errors"]["device"], out["errors"]
        assert "outside this world of 4 ranks" in out["errors"]["outside"], out["errors"]


def _pickled_per_rank():
    import shardprop as sp
    mesh = sp.init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    return pickle.dumps(sp.distribute_tensor(_full((8, 2), 3), mesh, [sp.Shard(0)]))


def _load_on_a_smaller_world(blobs):
    import shardprop as sp
    import torch.distributed as dist
    sp.init_device_mesh("cpu", (2,))
    try:
        pickle.loads(blobs[dist.get_rank()])
    except ValueError as e:
        return str(e)
    return "loaded"


def test_unpickling_on_a_mismatching_mesh_names_it():
    blobs = run_on_ranks(4, _pickled_per_rank)
    for msg in run_on_ranks(2, _load_on_a_smaller_world, blobs):
        assert "cannot unpickle DeviceMesh('cpu', [0, 1, 2, 3], mesh_dim_names=('tp',))" in msg, msg
        assert "ranks [2, 3] are outside this world of 2 ranks" in msg, msg
        assert "meshes in this process" in msg, msg


def test_unpickling_without_torch_distributed_says_so():
    blob = run_on_ranks(4, _pickled_per_rank)[0]
    import shardprop  # noqa: F401  (registers the pickling hooks in this, non-distributed, process)
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        pickle.loads(blob)


# ------------------------------------------------------------------ weights_only stays strict
class NotAllowed:
    """A class no one allowlisted: weights_only must refuse a file holding one."""


def _evil_file():
    import shardprop as sp
    mesh = sp.init_device_mesh("cpu", (2,))
    f = io.BytesIO()
    torch.save({"w": sp.distribute_tensor(_full((4, 2), 0), mesh, [sp.Shard(0)]), "x": NotAllowed()}, f)
    f.seek(0)
    try:
        torch.load(f)
        return "loaded"
    except pickle.UnpicklingError as e:
        return str(e)


def test_weights_only_still_refuses_other_classes():
    for msg in run_on_ranks(2, _evil_file):
        assert "NotAllowed" in msg, msg


def test_only_our_value_types_are_allowlisted():
    import shardprop
    from shardprop.checkpoint import pickling
    from shardprop.parallel.fast.grad_sync import GradLike
    ours = [g for g in torch.serialization.get_safe_globals()
            if getattr(g, "__module__", "").startswith("shardprop")]
    expected = {shardprop.DTensor, shardprop.DTensorSpec, shardprop.TensorMeta, shardprop.Shard,
                shardprop.Replicate, shardprop.Partial, shardprop.DeviceMesh}
    assert expected == set(pickling.SAFE_GLOBALS)
    # A parameter's gradient-layout hook pickles with it; it holds placements only.
    assert set(ours) == expected | {GradLike}, ours
    assert all(isinstance(g, type) for g in ours), "only classes, no functions"


def _whole_model_copy(how: str):
    """The demo Llama under tp_plan copied by ``how``; the copy trains one SGD step. Problems found."""
    import shardprop as sp
    from shardprop.demo.model import Llama, LlamaConfig, synthetic_batch, tp_plan
    from tests.test_module_conversions import _compare_step
    cfg = LlamaConfig(dim=32, n_layers=1, n_heads=4, vocab_size=64, seq_len=8)
    mesh = sp.init_device_mesh("cpu", (2,))
    model = sp.parallelize_module(Llama(cfg, 0), mesh, tp_plan())
    if how == "deepcopy":
        twin = copy.deepcopy(model)
    else:
        f = io.BytesIO()
        torch.save(model, f)
        f.seek(0)
        twin = torch.load(f, weights_only=False)
    problems = []
    _compare_step(twin, Llama(cfg, 0), synthetic_batch(cfg, 2, 0), problems, how)
    untouched = Llama(cfg, 0)
    for (name, p), q in zip(model.named_parameters(), untouched.parameters()):
        if p.grad is not None or not torch.equal(p.full_tensor(), q):
            problems.append(f"original's {name} changed by training the copy")
    return problems


@pytest.mark.parametrize("how", ["torch.save", pytest.param("deepcopy", marks=pytest.mark.slow)])
def test_whole_parallelized_model_copies_and_trains(how):
    for problems in run_on_ranks(2, _whole_model_copy, how):
        assert not problems, problems
