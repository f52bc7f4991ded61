"""Staging through host memory (mesh/transport/staging.py): the capability table, and the staged paths run on CPU.

Without a GPU the staged path is exercised by forcing it for CPU tensors (``staging.force``):
``"cuda"`` routes CPU tensors on gloo as CUDA tensors would go, ``"all"`` stages every call.
Random redistributions (1-d/2-d/3-d meshes, uneven shapes, Partial sources) and fully_shard
(dp=4 and 2x2 with TP) must give bit-for-bit what the unstaged path gives, and the staged
calls must really have run (counted in ``staging.stats``).
"""
import random
import types

import pytest
import torch
import torch.distributed as dist

from shardprop.mesh.transport import staging
from tests.rankpool import get_pool, run_on_ranks


# ---------------------------------------------------------------- the table (no ranks)

def _fake(device):
    """A stand-in for a tensor on ``device`` (no GPU needed: only device, shape and dtype are read)."""
    return types.SimpleNamespace(device=torch.device(device), shape=(2, 3), dtype=torch.float32, is_cpu=device == "cpu")


@pytest.mark.parametrize("call,want", [("all_reduce", "direct"), ("broadcast", "direct"), ("all_gather", "direct"),
                                       ("scatter", "direct"), ("reduce_scatter", "stage"), ("all_to_all", "stage"),
                                       ("all_gather_views", "stage"), ("send_recv", "stage")])
def test_gloo_cuda_routes(call, want):
    assert staging.route(call, "cuda", "gloo") == want
    assert staging.route(call, "cpu", "gloo") == "direct"
    assert staging.route(call, "cuda", "nccl") == "direct"
    assert staging.route(call, "cpu", "nccl") == "unsupported"
    # a device map: each device's own backend decides
    assert staging.route(call, "cuda", "cpu:gloo,cuda:nccl") == "direct"
    assert staging.route(call, "cuda", "cpu:nccl,cuda:gloo") == want


def test_unknown_call_and_mode_are_errors():
    with pytest.raises(ValueError, match="unknown call"):
        staging.route("all_gatherr", "cuda", "gloo")
    with pytest.raises(ValueError, match="mode"):
        staging.force("sometimes")


def test_decide_with_devices_mocked(monkeypatch):
    backends = {"g": "gloo", "n": "nccl"}
    monkeypatch.setattr(staging, "group_backend", lambda group: backends[group])
    assert staging.decide("send_recv", _fake("cuda"), "g") == "stage"
    assert staging.decide("all_reduce", _fake("cuda"), "g") == "direct"
    assert staging.decide("send_recv", _fake("cuda"), "n") == "direct"
    assert staging.decide("send_recv", _fake("cpu"), "g") == "direct"
    with pytest.raises(RuntimeError, match="nccl process group: that backend cannot carry cpu memory"):
        staging.decide("all_gather", _fake("cpu"), "n")
    old = staging.force("cuda")
    try:
        assert staging.decide("send_recv", _fake("cpu"), "g") == "stage"
        assert staging.decide("all_reduce", _fake("cpu"), "g") == "direct"
        assert staging.decide("send_recv", _fake("cpu"), "n") == "direct"  # forcing touches gloo only
        staging.force("all")
        assert staging.decide("all_reduce", _fake("cpu"), "g") == "stage"
        with staging.host_call():  # a staged call's host copies are never staged again
            assert staging.decide("all_reduce", _fake("cpu"), "g") == "direct"
    finally:
        staging.force(old)


def test_collectives_route_a_cuda_tensor_on_gloo(monkeypatch):
    # collectives._staged on a CUDA stand-in: one is_cpu test, then the table; traced tensors never stage.
    from shardprop.mesh import collectives as C
    monkeypatch.setattr(staging, "group_backend", lambda group: "gloo")
    assert C._staged("send_recv", _fake("cuda"), None)
    assert C._staged("reduce_scatter", _fake("cuda"), None)
    assert not C._staged("all_reduce", _fake("cuda"), None)
    assert not C._staged("send_recv", torch.ones(2), None)


def test_host_copies_are_new_tensors():
    t = torch.arange(6.).view(2, 3).t()  # strided
    h = staging.to_host(t)
    assert h.is_contiguous() and torch.equal(h, t) and h.data_ptr() != t.data_ptr()
    back = staging.to_device(h, t)
    assert torch.equal(back, t) and back.data_ptr() != h.data_ptr()


def test_shm_and_direct_messages_refuse_device_memory():
    from shardprop.mesh.transport import direct_collectives as direct
    meta = torch.empty(4, device="meta")  # any non-host tensor: refused before anything is posted
    with pytest.raises(TypeError, match="host memory only"):
        direct.exchange([(meta, 1, 0)], [], None)


# ---------------------------------------------------------------- staged paths on ranks

MESHES = {"1d": (4, (4,)), "2d": (4, (2, 2)), "3d": (8, (2, 2, 2))}


def _examples(mesh_ndim, n, seed):
    """``n`` random transitions: shape (uneven sizes, 0-size dims), source and target placements, seed."""
    from shardprop import Partial, Replicate, Shard
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ndim = rng.randint(1, 3)
        shape = tuple(rng.choice([0, 1, 3, 5, 6, 7, 9]) for _ in range(ndim))

        def placement():
            kind = rng.choice("RPSS")
            if kind == "S":
                return Shard(rng.randrange(ndim))
            return Replicate() if kind == "R" else Partial(rng.choice(["sum", "avg", "max", "min"]))
        out.append((shape, tuple(placement() for _ in range(mesh_ndim)), tuple(placement() for _ in range(mesh_ndim)),
                    rng.randrange(2**31), rng.random() < 0.5))
    return out


def _redistribute_once(mesh, ex, device="cpu"):
    """(local result, full tensor, gradient of the source's local tensor or None) of one transition.

    ``device``: where the local tensors live (the CUDA tier passes this rank's GPU with a cuda mesh).
    """
    from shardprop import DTensor, Partial
    from tests.test_redistribute import _full, _partial_local
    from shardprop.mesh.async_tensor import wait_all
    shape, src, dst, seed, async_op = ex
    full = _full(shape, seed)
    local = _partial_local(full, mesh, src, seed).to(device)
    grad_ok = not any(type(p) is Partial and p.reduce_op in ("max", "min") for p in (*src, *dst))
    if grad_ok:
        local = local.clone().requires_grad_(True)
    x = DTensor.from_local(local, mesh, src, shape=full.shape, stride=full.stride())
    y = x.redistribute(placements=dst, async_op=async_op)
    out = wait_all(y.to_local()).detach().clone()
    back = y.full_tensor()
    if grad_ok:
        (back * _full(shape, seed + 2).to(device)).sum().backward()
    return out, back.detach(), (local.grad if grad_ok else None)


def _staged_vs_plain(mesh_shape, examples, mode):
    """Rank side: each transition unstaged, then with staging forced; returns problems and staged-call counts."""
    from shardprop import init_device_mesh
    mesh = init_device_mesh("cpu", mesh_shape)
    problems = []
    staging.stats.clear()
    for ex in examples:
        want = _redistribute_once(mesh, ex)
        old = staging.force(mode)
        try:
            got = _redistribute_once(mesh, ex)
        finally:
            staging.force(old)
        for what, a, b in zip(("local", "full", "grad"), got, want):
            if (a is None) != (b is None) or (a is not None and (a.shape != b.shape or not torch.equal(a, b))):
                problems.append(f"{ex}: {what} staged {a} != unstaged {b}")
    return problems, dict(staging.stats)


def _check_staged(mesh_name, n, seed, mode):
    world, shape = MESHES[mesh_name]
    results = run_on_ranks(world, _staged_vs_plain, shape, _examples(len(shape), n, seed), mode, timeout=180)
    staged = {}
    for problems, stats in results:
        assert not problems, "\n".join(problems[:5])
        for k, v in stats.items():
            staged[k] = staged.get(k, 0) + v
    return staged


@pytest.mark.parametrize("mesh_name,mode", [("1d", "all"), ("2d", "cuda")])
def test_redistribute_staged_matches_unstaged_sample(mesh_name, mode):
    staged = _check_staged(mesh_name, 12, 7, mode)
    assert sum(staged.values()) > 0, "forcing staging staged nothing"
    if mode == "cuda":  # only what gloo cannot carry on a GPU is staged
        assert set(staged) <= {"reduce_scatter", "all_to_all", "all_gather_views", "send_recv"}, staged


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", ["1d", "2d", "3d"])
@pytest.mark.parametrize("mode", ["all", "cuda"])
def test_redistribute_staged_matches_unstaged_sweep(mesh_name, mode):
    staged = _check_staged(mesh_name, 60, 11, mode)
    assert sum(staged.values()) > 0
    if mesh_name != "1d" and mode == "cuda":
        assert staged.get("send_recv", 0) > 0, staged  # point-to-point moves (the hangs on a GPU) were staged


def _fsdp_staged(mode, two_d):
    from tests import test_fully_shard as F
    staging.stats.clear()
    old = staging.force(mode)
    try:
        out = F._fsdp_tp_train(True) if two_d else F._fsdp_train(True)
    finally:
        staging.force(old)
    return out, dict(staging.stats)


@pytest.mark.parametrize("mode", ["cuda", pytest.param("all", marks=pytest.mark.slow)])
def test_fully_shard_dp4_staged(mode):
    from tests import test_fully_shard as F
    ref = F._reference()
    results = run_on_ranks(4, _fsdp_staged, mode, False, timeout=180)
    F._check([r[0] for r in results], ref, 1e-5)
    assert all(stats.get("reduce_scatter", 0) > 0 for _, stats in results), [s for _, s in results]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["cuda", "all"])
def test_fully_shard_2x2_tp_staged(mode):
    from tests import test_fully_shard as F
    ref_losses, ref_params = F._reference_2d()
    for (losses, params, _), stats in run_on_ranks(4, _fsdp_staged, mode, True, timeout=240):
        assert losses == pytest.approx(ref_losses, abs=1e-5)
        for n, p in params.items():
            torch.testing.assert_close(p, ref_params[n], atol=1e-5, rtol=0, msg=n)
        assert stats.get("reduce_scatter", 0) > 0, stats


def _gather_views_staged():
    """fully_shard's coalesced gather into views, staged: the path a CUDA mesh on gloo takes."""
    from tests import test_fully_shard as F
    return F._into_views(_fsdp_staged, "cuda", False)


def test_fully_shard_gather_into_views_staged():
    from tests import test_fully_shard as F
    results = run_on_ranks(4, _gather_views_staged, timeout=180)
    F._check([r[0] for r in results], F._reference(), 1e-5)
    assert all(stats.get("all_gather_views", 0) > 0 for _, stats in results), [s for _, s in results]


# ---------------------------------------------------------------- backend choice for CUDA meshes (mocked)

def test_backend_for_cuda_follows_the_default_group(monkeypatch):
    from shardprop.mesh import groups
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    for default, want in (("gloo", "gloo"), ("nccl", "nccl"), ("cpu:gloo,cuda:nccl", "nccl")):
        monkeypatch.setattr(dist, "get_backend", lambda group=None, d=default: d)
        assert groups.backend_for("cuda") == want, default
        assert groups.backend_for("cpu") == "gloo"
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    assert groups.backend_for("cuda") == "nccl"


def test_nccl_with_shared_gpus_or_no_gpu_is_a_clear_error(monkeypatch):
    from shardprop.mesh import groups
    groups.check_nccl_devices(4, 4)
    with pytest.raises(RuntimeError, match="4 ranks per host on 1 CUDA device.*Duplicate GPU.*gloo"):
        groups.check_nccl_devices(4, 1)
    with pytest.raises(RuntimeError, match="torch.cuda.device_count\\(\\) is 0"):
        groups.check_nccl_devices(1, 0)
    # ensure_default_group refuses before any process group is started
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    started = []
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: started.append(k))
    for k, v in dict(RANK="0", WORLD_SIZE="4", MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with pytest.raises(RuntimeError, match="NCCL needs one GPU per rank"):
        groups.ensure_default_group("cuda")
    assert not started


def _each_call_staged():
    """Rank side: every collective of mesh/collectives.py with staging forced ("all") vs unstaged."""
    from shardprop import init_device_mesh
    from shardprop.mesh import collectives as C
    mesh = init_device_mesh("cpu", (4,))
    me = dist.get_rank()
    g = torch.Generator().manual_seed(me)
    x = torch.randn(8, 3, generator=g)

    def calls():
        out = {}
        out["all_gather"] = C.all_gather(x, mesh, 0)
        out["all_gather_async"] = C.all_gather(x, mesh, 0, async_op=True).wait()
        out["reduce_scatter_avg"] = C.reduce_scatter(x, mesh, 0, "avg")
        out["all_reduce_max"] = C.all_reduce(x, mesh, 0, "max")
        y = x.clone()
        C.all_reduce(y, mesh, 0, inplace=True)
        out["all_reduce_inplace"] = y
        out["all_to_all"] = C.all_to_all(x, mesh, 0)
        split = [1 + (me + j) % 2 for j in range(4)]  # rank r sends 1 + (r + j) % 2 rows to j: symmetric
        out["all_to_all_uneven"] = C.all_to_all(x[:6], mesh, 0, split, split)
        b = x.clone()
        C.broadcast(b, mesh, 0, src=2)
        out["broadcast"] = b
        s = torch.empty(2, 3)
        C.scatter(list(x.chunk(4)) if me == 1 else None, s, mesh, 0, src=1)
        out["scatter"] = s
        flat = torch.empty(4 * 5)
        views = [flat[:8].view(4, 2), flat[8:].view(4, 3)]
        C.all_gather_into_views(views, [x[0, :2].reshape(1, 2), x[1].reshape(1, 3)], flat, mesh, 0)
        out["gather_into_views"] = flat.clone()
        recv = torch.zeros(3, 2)
        C.send_recv([(x[:3, :2], (me + 1) % 4, 0)], [(recv, (me - 1) % 4, 0)], C.p2p_group(mesh), recv)
        out["send_recv"] = recv
        return out

    want = calls()
    staging.stats.clear()
    old = staging.force("all")
    try:
        got = calls()
    finally:
        staging.force(old)
    problems = [k for k in want if not torch.equal(want[k], got[k])]
    return problems, dict(staging.stats)


def test_each_collective_staged_equals_unstaged():
    for problems, stats in run_on_ranks(4, _each_call_staged, timeout=120):
        assert not problems, problems
        assert set(stats) == set(staging.CALLS), stats  # every kind of call went through host memory
