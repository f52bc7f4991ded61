"""CUDA tier: shardprop's NCCL paths, written to c10d's contract, run on a one-rank NCCL mesh.

``split_group`` (mesh groups split off the default communicator), the coalesced all-gather
into views (fully_shard's gather), ``batch_isend_irecv`` (send_recv, here to oneself), and
ordering of asynchronous collectives (AsyncTensor waits, out of order). Where there are two or
more GPUs (marker ``gpu``) the same checks and a redistribution sweep run over NCCL with one GPU
per rank. Skipped without a CUDA device.
"""
import pytest
import torch
import torch.distributed as dist

from tests import cuda_tier as T
from tests.test_staging import _examples

pytestmark = pytest.mark.cuda


def _nccl_paths(expect="nccl"):
    """Rank side: each path's result against what it must be; returns problems.

    ``expect``: the backend a CUDA mesh must get in this world (nccl; gloo where ranks share a GPU).
    """
    from shardprop import init_device_mesh
    from shardprop.mesh import collectives as C
    from shardprop.mesh import compat
    from shardprop.mesh.groups import backend_for
    n = dist.get_world_size()
    dev = T.device()
    problems = []
    if backend_for("cuda") != expect:
        problems.append(f"a CUDA mesh in this world should use {expect}, got {backend_for('cuda')}")
    mesh = init_device_mesh("cuda", (n, 1), mesh_dim_names=("a", "b"))  # groups for (0,), (1,), (0, 1)
    group = mesh.get_group("a")
    if expect == "nccl" and compat.split_group is not None and dist.get_backend(group) != "nccl":
        problems.append(f"mesh group backend {dist.get_backend(group)}, expected nccl (split_group)")
    me = dist.get_rank()
    # all-reduce / all-gather / reduce-scatter along each dim
    t = torch.full((4, 3), float(me + 1), device=dev)
    total = float(sum(range(1, n + 1)))
    problems.append(T.close(C.all_reduce(t, mesh, "a"), torch.full((4, 3), total), "all_reduce"))
    g = C.all_gather(t, mesh, "a")
    problems.append(T.close(g, torch.cat([torch.full((4, 3), float(r + 1)) for r in range(n)]), "all_gather"))
    rs = C.reduce_scatter(torch.ones(2 * n, 3, device=dev), mesh, "a")
    problems.append(T.close(rs, torch.full((2, 3), float(n)), "reduce_scatter"))
    # coalesced all-gather into views of one flat buffer (fully_shard's path on NCCL)
    flat = torch.empty(n * 10, device=dev)
    a, b = flat[: n * 4].view(n * 2, 2), flat[n * 4:].view(n * 2, 3)
    x1 = torch.full((2, 2), float(me), device=dev)
    x2 = torch.full((2, 3), float(me) + 0.5, device=dev)
    res = C.all_gather_into_views([a, b], [x1, x2], flat, mesh, "a", async_op=True)
    res = res.wait() if hasattr(res, "wait") else res
    problems.append(T.close(a, torch.cat([torch.full((2, 2), float(r)) for r in range(n)]), "gather into view a"))
    problems.append(T.close(b, torch.cat([torch.full((2, 3), r + 0.5) for r in range(n)]), "gather into view b"))
    # batch_isend_irecv: each rank sends to the next and receives from the previous (itself when n == 1)
    send = torch.arange(6.0, device=dev) + 100 * me
    out = torch.empty(6, device=dev)
    C.send_recv([(send, (me + 1) % n, 0)], [(out, (me - 1) % n, 0)], C.p2p_group(mesh), out)
    problems.append(T.close(out, torch.arange(6.0) + 100 * ((me - 1) % n), "send_recv (batch_isend_irecv)"))
    # a strided receive (staged in a buffer and copied into place by finish)
    big = torch.zeros(6, 4, device=dev)
    C.send_recv([(send.view(6, 1), (me + 1) % n, 1)], [(big[:, 1:2], (me - 1) % n, 1)], C.p2p_group(mesh), big)
    problems.append(T.close(big[:, 1], torch.arange(6.0) + 100 * ((me - 1) % n), "send_recv into a strided view"))
    # asynchronous collectives waited out of order, then used by an op on the current stream
    first = C.all_reduce(torch.full((256,), 1.0, device=dev), mesh, "a", async_op=True)
    second = C.all_gather(torch.full((128,), 2.0, device=dev), mesh, "a", async_op=True)
    s2 = second * 1
    s1 = first + 0
    problems.append(T.close(s1, torch.full((256,), float(n)), "async all_reduce waited second"))
    problems.append(T.close(s2, torch.full((128 * n,), 2.0), "async all_gather waited first"))
    # an async result consumed on another stream after wait: the data must be there
    third = C.all_reduce(torch.full((64,), 3.0, device=dev), mesh, "a", async_op=True)
    ready = third.wait()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = ready * 2
    torch.cuda.current_stream().wait_stream(side)
    problems.append(T.close(on_side, torch.full((64,), 6.0 * n), "async result used on a side stream"))
    torch.cuda.synchronize()
    return [p for p in problems if p]


def test_nccl_paths_one_rank():
    T.no_problems(T.nccl(1, _nccl_paths, timeout=300))


def test_gloo_cuda_paths_four_ranks_sharing_the_gpu():
    # The same calls on gloo with CUDA tensors: staged where gloo has no CUDA path, never a crash or hang.
    T.no_problems(T.shared(_gloo_paths, timeout=300))


def _gloo_paths():
    from shardprop.mesh.transport import staging
    staging.stats.clear()
    problems = _nccl_paths("gloo")
    if not staging.stats.get("send_recv"):
        problems.append(f"send_recv of CUDA tensors on gloo was not staged: {staging.stats}")
    return problems


# ---------------------------------------------------------------- two or more GPUs: NCCL, one GPU per rank

def _world():
    return min(4, torch.cuda.device_count())


@pytest.mark.gpu
def test_nccl_paths_multi_gpu():
    T.no_problems(T.nccl(_world(), _nccl_paths, timeout=300))


@pytest.mark.gpu
def test_redistribution_sweep_multi_gpu_nccl():
    from tests.test_cuda_redistribute import _sweep
    n = _world()
    shape = (n,) if n != 4 else (2, 2)
    results = T.nccl(n, _sweep, shape, _examples(len(shape), 40, 303), timeout=600)
    T.no_problems([r[0] for r in results])


@pytest.mark.gpu
def test_demo_multi_gpu_nccl():
    from tests.test_cuda_training import _check_demo, _demo
    n = _world()
    mesh = "2x2" if n == 4 else str(n)
    _check_demo(T.nccl(n, _demo, ["--steps", "5", "--mesh", mesh], timeout=600))
    _check_demo(T.nccl(n, _demo, ["--steps", "5", "--mesh", mesh, "--fsdp"], timeout=600))
