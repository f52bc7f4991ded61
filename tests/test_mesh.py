"""DeviceMesh basics, the collectives of shardprop.mesh (sync and async), and
user errors that must be clear and raised on every rank without a hang.

Error jobs catch the error inside the rank with pytest.raises, then run one
more collective on the default group: if some rank had gone on into a
collective the others skipped, that collective would mismatch or time out.
"""

import pytest
import torch
import torch.distributed as dist

from shardprop import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh
from shardprop.mesh import collectives as C
from shardprop.mesh.async_tensor import AsyncTensor
from tests.rankpool import run_on_ranks

ERROR_TIMEOUT = 45  # seconds: an error job that takes longer than this hangs


def _in_step():
    """A collective over every rank: returns the world size if all ranks got here."""
    t = torch.ones(1)
    dist.all_reduce(t)
    return int(t.item())


# ---------------------------------------------------------------- mesh basics


def _mesh_basics_2d():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp, dp, both, swapped = mesh["tp"], mesh["dp"], mesh["dp", "tp"], mesh["tp", "dp"]

    def ranks(group):
        return dist.get_process_group_ranks(group)

    # one collective per group proves the group really holds those ranks
    sums = {}
    for name in ("dp", "tp"):
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t, group=mesh.get_group(name))
        sums[name] = t.item()
    return dict(
        coord=mesh.get_coordinate(), size=mesh.size(), size_dp=mesh.size("dp"), size_tp=mesh.size(1),
        shape=mesh.shape, ndim=mesh.ndim, rank=mesh.get_rank(),
        local_dp=mesh.get_local_rank("dp"), local_tp=mesh.get_local_rank("tp"), local_1=mesh.get_local_rank(1),
        tp_mesh=tp.mesh.tolist(), tp_names=tp.mesh_dim_names, tp_size=tp.size(), tp_coord=tp.get_coordinate(),
        dp_mesh=dp.mesh.tolist(), dp_coord=dp.get_coordinate(),
        both_mesh=both.mesh.tolist(), both_names=both.mesh_dim_names, both_eq=both == mesh,
        swapped_mesh=swapped.mesh.tolist(), swapped_names=swapped.mesh_dim_names,
        group_dp=ranks(mesh.get_group("dp")), group_tp=ranks(mesh.get_group("tp")),
        group_0=ranks(mesh.get_group(0)), sub_group_tp=ranks(tp.get_group()), sums=sums,
        repr=repr(mesh), tp_repr=repr(tp),
        same=mesh == init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")),
        other=mesh == init_device_mesh("cpu", (4,)),
    )


def test_mesh_basics_2d():
    for r, got in enumerate(run_on_ranks(4, _mesh_basics_2d)):
        dp, tp = divmod(r, 2)
        assert got["coord"] == [dp, tp]
        assert (got["size"], got["size_dp"], got["size_tp"]) == (4, 2, 2)
        assert got["shape"] == (2, 2) and got["ndim"] == 2 and got["rank"] == r
        assert (got["local_dp"], got["local_tp"], got["local_1"]) == (dp, tp, tp)
        assert got["tp_mesh"] == [2 * dp, 2 * dp + 1] and got["tp_names"] == ("tp",)
        assert got["tp_size"] == 2 and got["tp_coord"] == [tp]
        assert got["dp_mesh"] == [tp, tp + 2] and got["dp_coord"] == [dp]
        assert got["both_mesh"] == [[0, 1], [2, 3]] and got["both_names"] == ("dp", "tp") and got["both_eq"]
        assert got["swapped_mesh"] == [[0, 2], [1, 3]] and got["swapped_names"] == ("tp", "dp")
        assert got["group_dp"] == [tp, tp + 2] and got["group_0"] == [tp, tp + 2]
        assert got["group_tp"] == [2 * dp, 2 * dp + 1] == got["sub_group_tp"]
        assert got["sums"] == {"dp": float(tp + tp + 2), "tp": float(4 * dp + 1)}
        assert "DeviceMesh" in got["repr"] and "'cpu'" in got["repr"] and "[[0, 1], [2, 3]]" in got["repr"]
        assert "dp" in got["repr"] and "tp" in got["repr"]
        assert f"[{2 * dp}, {2 * dp + 1}]" in got["tp_repr"]
        assert got["same"] and not got["other"]


def _mesh_basics_3d():
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("a", "b", "c"))
    ac = mesh["a", "c"]
    # a DTensor on the 2-d slice: a fused gather needs the slice's own (0, 1) group
    full = torch.arange(24.).reshape(4, 6)
    x = distribute_tensor(full, ac, [Shard(0), Shard(1)], src_data_rank=None)
    back = x.redistribute(placements=[Replicate(), Replicate()]).to_local()
    return dict(coord=mesh.get_coordinate(), size=mesh.size(), ac_mesh=ac.mesh.tolist(), ac_coord=ac.get_coordinate(),
                b_group=dist.get_process_group_ranks(mesh.get_group("b")),
                local=x.to_local().tolist(), back_ok=torch.equal(back, full))


def test_mesh_basics_3d():
    full = torch.arange(24.).reshape(4, 6)
    for r, got in enumerate(run_on_ranks(8, _mesh_basics_3d)):
        a, b, c = r // 4, (r // 2) % 2, r % 2
        assert got["coord"] == [a, b, c] and got["size"] == 8
        assert got["ac_mesh"] == [[2 * b, 2 * b + 1], [4 + 2 * b, 4 + 2 * b + 1]]
        assert got["ac_coord"] == [a, c]
        assert got["b_group"] == [4 * a + c, 4 * a + 2 + c]
        assert got["local"] == full[2 * a:2 * a + 2, 3 * c:3 * c + 3].tolist()
        assert got["back_ok"]


def _distribute_on_submesh():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    r = dist.get_rank()
    mine = torch.arange(8.) + 100 * r  # different on every rank
    try:
        x = distribute_tensor(mine, mesh["tp"], [Shard(0)])  # default src_data_rank
    except Exception as e:
        return f"{type(e).__name__}: {e}", _in_step()
    return x.full_tensor().tolist(), _in_step()


def test_distribute_tensor_on_a_submesh_by_default():
    """On mesh["tp"] of a 2x2 mesh (ranks {0, 1} and {2, 3}), distribute_tensor
    with the default source works on every rank: the source is the first rank
    of each sub-mesh, as in torch's DTensor ("group rank 0 on each mesh dim")."""
    for r, (full, in_step) in enumerate(run_on_ranks(4, _distribute_on_submesh, timeout=ERROR_TIMEOUT)):
        first = 2 * (r // 2)
        assert full == (torch.arange(8.) + 100 * first).tolist(), f"rank {r}: {full}"
        assert in_step == 4


# ---------------------------------------------------------------- collectives


def _collectives(async_op):
    """Every collective along "tp", "dp" and both dims at once; returns
    {name: (is AsyncTensor, result as a list)}."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    r = dist.get_rank()
    out = {}

    def record(name, res, check_input=None):
        is_async = isinstance(res, AsyncTensor)
        value = res.wait() if is_async else res
        out[name] = (is_async, value.tolist())

    for dims in ("tp", "dp", (0, 1)):
        key = dims if isinstance(dims, str) else "both"
        mine = torch.tensor([[10. * r, 10. * r + 1]])
        record(f"all_gather/{key}", C.all_gather(mine, mesh, dims, async_op=async_op))
        for op in ("sum", "avg", "max", "min"):
            t = torch.arange(8.).reshape(4, 2) * (r + 1)
            kept = t.clone()
            record(f"reduce_scatter/{op}/{key}", C.reduce_scatter(t, mesh, dims, op, async_op=async_op))
            out[f"reduce_scatter/{op}/{key}/input"] = (False, [torch.equal(t, kept)])
            t = torch.tensor([1. + r, -2. * r])
            res = C.all_reduce(t, mesh, dims, op, async_op=async_op)
            record(f"all_reduce/{op}/{key}", res)
            out[f"all_reduce/{op}/{key}/input"] = (False, [torch.equal(t, torch.tensor([1. + r, -2. * r]))])
        n = 2 if isinstance(dims, str) else 4
        t = torch.tensor([[100. * r + i] for i in range(n)])  # row i goes to group index i
        record(f"all_to_all/{key}", C.all_to_all(t, mesh, dims, async_op=async_op))
        t = torch.full((3,), float(r))
        record(f"broadcast/{key}", C.broadcast(t, mesh, dims, src=1, async_op=async_op))
        chunks = [torch.full((2,), 10. * r + i) for i in range(n)]
        record(f"scatter/{key}", C.scatter(chunks, torch.empty(2), mesh, dims, src=n - 1, async_op=async_op))
    # uneven all-to-all along tp: rank index i of the group sends i+1 rows to index 0, 1 row to index 1
    idx = mesh.get_local_rank("tp")
    send = [idx + 1, 1]
    t = torch.tensor([[1000. * r + j] for j in range(sum(send))])
    recv = [1, 2] if idx == 0 else [1, 1]
    record("all_to_all/uneven", C.all_to_all(t, mesh, "tp", recv, send, async_op=async_op))
    # an AsyncTensor waits on first use by any op
    if async_op:
        res = C.all_reduce(torch.tensor([float(r)]), mesh, "tp", async_op=True)
        out["first_use"] = (isinstance(res, AsyncTensor), (res + 1).tolist())
    return out


def _expected_collectives(r):
    dp, tp = divmod(r, 2)
    groups = {"tp": [2 * dp, 2 * dp + 1], "dp": [tp, tp + 2], "both": [0, 1, 2, 3]}
    exp = {}
    for key, g in groups.items():
        n = len(g)
        exp[f"all_gather/{key}"] = [[10. * q, 10. * q + 1] for q in g]
        for op in ("sum", "avg", "max", "min"):
            each = [torch.arange(8.).reshape(4, 2) * (q + 1) for q in g]
            red = {"sum": sum(each), "avg": sum(each) / n, "max": each[-1], "min": each[0]}[op]
            me = g.index(r)
            rows = 4 // n
            exp[f"reduce_scatter/{op}/{key}"] = red[me * rows:(me + 1) * rows].tolist()
            exp[f"reduce_scatter/{op}/{key}/input"] = [True]
            vals = [torch.tensor([1. + q, -2. * q]) for q in g]
            stacked = torch.stack(vals)
            exp[f"all_reduce/{op}/{key}"] = {"sum": stacked.sum(0), "avg": stacked.mean(0),
                                             "max": stacked.max(0).values, "min": stacked.min(0).values}[op].tolist()
            exp[f"all_reduce/{op}/{key}/input"] = [True]
        me = g.index(r)
        exp[f"all_to_all/{key}"] = [[100. * q + me] for q in g]
        exp[f"broadcast/{key}"] = [float(g[1])] * 3
        exp[f"scatter/{key}"] = [10. * g[-1] + me] * 2
    tp_group = groups["tp"]
    if tp == 0:  # receives 1 row from itself (its row 0) and 2 from index 1 (rows 0, 1)
        exp["all_to_all/uneven"] = [[1000. * tp_group[0]], [1000. * tp_group[1]], [1000. * tp_group[1] + 1]]
    else:  # receives row 1 of index 0 and row 2 of itself
        exp["all_to_all/uneven"] = [[1000. * tp_group[0] + 1], [1000. * tp_group[1] + 2]]
    return exp


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_collectives(async_op):
    for r, got in enumerate(run_on_ranks(4, _collectives, async_op)):
        exp = _expected_collectives(r)
        if async_op:
            is_async, value = got.pop("first_use")
            assert is_async and value == [float(2 * (r // 2) + 2 * (r // 2) + 1) + 1]
        assert set(got) == set(exp)
        for name, want in exp.items():
            is_async, value = got[name]
            if not name.endswith("/input"):
                assert is_async == async_op, f"rank {r}, {name}: AsyncTensor={is_async}"
            assert torch.allclose(torch.tensor(value), torch.tensor(want)), f"rank {r}, {name}: {value} != {want}"


# ---------------------------------------------------------------- errors, raised on every rank


def _error_job(case):
    """Runs one faulty call inside pytest.raises; returns (message, ranks in step)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    t = torch.arange(12.).reshape(4, 3)
    r = dist.get_rank()
    if case == "shard dim out of range":
        with pytest.raises(ValueError) as info:
            distribute_tensor(t, mesh, [Shard(2), Replicate()])
    elif case == "redistribute shard dim out of range":
        x = distribute_tensor(t, mesh, [Shard(0), Replicate()])
        with pytest.raises(ValueError) as info:
            x.redistribute(placements=[Replicate(), Shard(-3)])
    elif case == "placement count":
        with pytest.raises(ValueError) as info:
            distribute_tensor(t, mesh, [Shard(0)])
    elif case == "redistribute placement count":
        x = distribute_tensor(t, mesh, [Shard(0), Replicate()])
        with pytest.raises(ValueError) as info:
            x.redistribute(placements=[Replicate(), Replicate(), Replicate()])
    elif case == "mesh size":
        with pytest.raises(ValueError) as info:
            init_device_mesh("cpu", (3, 2))
    elif case == "unknown dim name":
        with pytest.raises(KeyError) as info:
            mesh["pp"]
    elif case == "unknown dim name in size":
        with pytest.raises(KeyError) as info:
            mesh.size("pp")
    elif case == "unknown dim name in get_group":
        with pytest.raises(KeyError) as info:
            mesh.get_group("pp")
    elif case == "from_local run_check shapes":
        local = torch.ones(3 if r == 3 else 2, 3)  # rank 3 alone holds 3 rows
        with pytest.raises(ValueError) as info:
            DTensor.from_local(local, mesh, [Shard(0), Replicate()], run_check=True)
    elif case == "from_local run_check ndim":
        local = torch.ones(2, 3) if r != 1 else torch.ones(2, 3, 1)
        with pytest.raises(ValueError) as info:
            DTensor.from_local(local, mesh, [Shard(0), Replicate()], run_check=True)
    elif case == "redistribute without placements":
        # (a move to another mesh works now: tests/test_cross_mesh.py)
        other = init_device_mesh("cpu", (4,))
        x = distribute_tensor(t, mesh, [Shard(0), Replicate()])
        with pytest.raises(ValueError) as info:
            x.redistribute(other)
    else:
        raise AssertionError(case)
    return str(info.value), _in_step()


@pytest.mark.parametrize("case,words", [
    ("shard dim out of range", ["S(2)", "out of range", "2-d"]),
    ("redistribute shard dim out of range", ["S(-3)", "out of range"]),
    ("placement count", ["1 placements", "2-d mesh"]),
    ("redistribute placement count", ["3 placements", "2-d mesh"]),
    ("mesh size", ["(3, 2)", "6", "world size is 4"]),
    ("unknown dim name", ["pp", "dp", "tp"]),
    ("unknown dim name in size", ["pp"]),
    ("unknown dim name in get_group", ["pp"]),
    ("from_local run_check shapes", ["inconsistent", "rank 3"]),
    ("from_local run_check ndim", ["inconsistent"]),
    ("redistribute without placements", ["give the target placements"]),
])
def test_errors_are_clear_and_on_every_rank(case, words):
    results = run_on_ranks(4, _error_job, case, timeout=ERROR_TIMEOUT)
    for r, (msg, in_step) in enumerate(results):
        for w in words:
            assert w in msg, f"rank {r}: {w!r} not in {msg!r}"
        assert in_step == 4, f"rank {r}"


def _from_local_run_check_ok():
    """Consistent uneven shards pass run_check and give the right global shape."""
    mesh = init_device_mesh("cpu", (2, 2))
    dp, tp = mesh.get_coordinate()
    rows = [[2, 1], [1, 1]][dp][tp]  # [S(0), S(0)] of 5 rows: 3|2, then 2|1 and 1|1
    x = DTensor.from_local(torch.full((rows, 3), float(dist.get_rank())), mesh, [Shard(0), Shard(0)],
                           run_check=True)
    y = DTensor.from_local(torch.ones(2, 3), mesh, [Replicate(), Shard(1)], run_check=True)
    return tuple(x.shape), x.full_tensor()[:, 0].tolist(), tuple(y.shape)


def test_from_local_run_check_accepts_consistent_uneven_shards():
    for shape, col, yshape in run_on_ranks(4, _from_local_run_check_ok, timeout=ERROR_TIMEOUT):
        assert shape == (5, 3) and col == [0., 0., 1., 2., 3.] and yshape == (2, 6)


def _mixed_meshes_op():
    a = init_device_mesh("cpu", (2, 2))
    b = init_device_mesh("cpu", (4,))
    x = distribute_tensor(torch.ones(4, 4), a, [Shard(0), Replicate()])
    y = distribute_tensor(torch.ones(4, 4), b, [Shard(0)])
    z = distribute_tensor(torch.ones(4, 4), a, [Replicate(), Replicate()])
    same_mesh_ok = torch.equal((x + z).full_tensor(), torch.full((4, 4), 2.))  # ops work at all
    try:
        x + y
    except Exception as e:  # caught here so that the pool survives an unexpected error type
        return isinstance(e, RuntimeError), f"{type(e).__name__}: {e}", same_mesh_ok, _in_step()
    return False, "no error", same_mesh_ok, _in_step()


def test_op_on_dtensors_of_different_meshes_raises_everywhere():
    for r, (is_runtime_error, msg, same_mesh_ok, in_step) in enumerate(
            run_on_ranks(4, _mixed_meshes_op, timeout=ERROR_TIMEOUT)):
        assert same_mesh_ok, f"rank {r}: an op on one mesh failed"
        assert is_runtime_error and "different meshes" in msg, f"rank {r}: {msg}"
        assert "[[0, 1], [2, 3]]" in msg and "[0, 1, 2, 3]" in msg, f"rank {r}: {msg}"
        assert in_step == 4


# ---------------------------------------------------------------- rank order along mesh dims


def _rank_order_cases():
    from shardprop import DeviceMesh
    out = {}
    try:  # along its only dim this mesh lists ranks out of order: groups would misplace the data
        DeviceMesh("cpu", [1, 0, 3, 2])
        out["unordered"] = None
    except ValueError as e:
        out["unordered"] = str(e)
    # A transposed 2-d mesh is fine along each dim; the fused gather over both dims must not be used.
    mesh = DeviceMesh("cpu", [[0, 2], [1, 3]])
    full = torch.arange(48.).reshape(8, 6)
    dt = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
    out["full_ok"] = bool(torch.equal(dt.full_tensor(), full))
    dt = distribute_tensor(full, mesh, [Shard(0), Shard(0)])
    out["nested_ok"] = bool(torch.equal(dt.full_tensor(), full))
    out["in_step"] = _in_step()
    return out


def test_mesh_dims_must_list_ranks_in_ascending_order():
    for r in run_on_ranks(4, _rank_order_cases, timeout=ERROR_TIMEOUT):
        assert r["unordered"] is not None and "ascending order" in r["unordered"], r
        assert r["full_ok"] and r["nested_ok"], r
        assert r["in_step"] == 4
