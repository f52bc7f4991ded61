"""CUDA tier: redistribution, cross-mesh moves and DCP with CUDA DTensors.

The random redistribution sweep (tests/test_staging.py's transitions: 1-d/2-d meshes, uneven
shapes, Partial sources, async) on 4 ranks sharing the GPU over gloo (the staged paths for real)
and on a one-rank NCCL mesh; cross-mesh moves (1-d 4 <-> 2x2, disjoint rank sets) and a DCP
save on one layout loaded onto another. Every value is checked against the plain global tensor
(and, on gloo, against the same transition on CPU tensors). Skipped without a CUDA device.
"""
import pytest
import torch

from tests import cuda_tier as T
from tests.test_staging import _examples

pytestmark = pytest.mark.cuda


def _sweep(mesh_shape, examples):
    """Rank side: each transition on CUDA tensors against the plain global tensor and the same on CPU."""
    from shardprop import Partial, init_device_mesh
    from shardprop.mesh.transport import staging
    from tests.test_redistribute import _reference_chunk
    from tests.test_staging import _redistribute_once
    cuda_mesh = init_device_mesh("cuda", mesh_shape)
    cpu_mesh = init_device_mesh("cpu", mesh_shape)
    problems = []
    staging.stats.clear()
    for ex in examples:
        dst = ex[2]
        try:
            on_cpu = _redistribute_once(cpu_mesh, ex)
            on_gpu = _redistribute_once(cuda_mesh, ex, T.device())
        except Exception as e:
            problems.append(f"{ex}: raised {type(e).__name__}: {e}")
            break  # ranks may be out of step
        if not any(type(p) is Partial for p in dst):
            want = _reference_chunk(on_cpu[1], cuda_mesh.shape, cuda_mesh.get_coordinate(), dst)
            problems.append(T.close(on_gpu[0], want, f"{ex} local vs torch.chunk"))
        for what, g, c in zip(("local", "full", "grad"), on_gpu, on_cpu):
            if (g is None) != (c is None):
                problems.append(f"{ex}: {what} None on one device only")
            elif g is not None:
                if g.device.type != "cuda":
                    problems.append(f"{ex}: {what} on {g.device}")
                problems.append(T.close(g, c, f"{ex} {what} cuda vs cpu", rtol=1e-5, atol=1e-5))
    return [p for p in problems if p], dict(staging.stats)


@pytest.mark.parametrize("name,shape", [("1d", (4,)), ("2d", (2, 2))])
def test_redistribution_sweep_four_ranks_sharing_the_gpu(name, shape):
    results = T.shared(_sweep, shape, _examples(len(shape), 40, 101), timeout=600)
    T.no_problems([r[0] for r in results])
    staged = sum(sum(r[1].values()) for r in results)
    assert staged > 0, "no call was staged through host memory: is the cuda mesh on gloo?"


@pytest.mark.parametrize("shape", [(1,), (1, 1)])
def test_redistribution_sweep_one_rank_nccl(shape):
    results = T.nccl(1, _sweep, shape, _examples(len(shape), 40, 202), timeout=600)
    T.no_problems([r[0] for r in results])
    assert not any(r[1] for r in results), "NCCL carries CUDA memory: nothing should be staged"


# ---------------------------------------------------------------- cross-mesh moves

CROSS = [  # (shape, source mesh rows, codes, target mesh rows, codes)
    ((8, 6), [0, 1, 2, 3], ["S0"], [[0, 1], [2, 3]], ["S1", "S0"]),
    ((8, 6), [[0, 1], [2, 3]], ["R", "S1"], [0, 1, 2, 3], ["S0"]),
    ((7, 5), [0, 1], ["S0"], [2, 3], ["S1"]),           # disjoint rank sets, uneven
    ((7, 5), [0, 1, 2, 3], ["Psum"], [[0, 2], [1, 3]], ["S0", "R"]),
]


def _cross_mesh():
    """Rank side: every CROSS move with CUDA tensors; values against torch.chunk of the global tensor."""
    from shardprop import DTensor, DeviceMesh, distribute_tensor
    from tests.test_cross_mesh import _placements
    dev = T.device()
    problems = []
    for i, (shape, src_rows, src_codes, dst_rows, dst_codes) in enumerate(CROSS):
        full = torch.randint(-9, 9, shape, generator=torch.Generator().manual_seed(i)).float()
        src, dst = DeviceMesh("cuda", src_rows), DeviceMesh("cuda", dst_rows)
        pl = _placements(src_codes)
        if src.get_coordinate() is None:
            x = DTensor.from_local(torch.empty((0,) * full.ndim, device=dev), src, pl, shape=full.shape,
                                   stride=full.stride())
        else:
            x = distribute_tensor(full.to(dev), src, pl)
        y = x.redistribute(dst, _placements(dst_codes))
        want = _chunk_of(full, dst, dst_codes)
        got = y.to_local()
        if got.numel() and got.device.type != "cuda":
            problems.append(f"move {i}: result on {got.device}")
        if not torch.equal(got.cpu(), want):
            problems.append(f"move {i} {src_rows}{src_codes} -> {dst_rows}{dst_codes}: {got.tolist()} != {want.tolist()}")
    return problems


def _chunk_of(full, mesh, codes):
    """This rank's piece of ``full`` under ``codes`` on ``mesh`` by torch.chunk (Partial sum: rank 0 holds it)."""
    coord = mesh.get_coordinate()
    if coord is None:
        return torch.empty((0,) * full.ndim)
    out = full
    for m, c in enumerate(codes):
        if c.startswith("S"):
            d = int(c[1:])
            pieces = torch.chunk(out, mesh.shape[m], dim=d)
            out = pieces[coord[m]] if coord[m] < len(pieces) else out.narrow(d, out.shape[d], 0)
    return out


def test_cross_mesh_moves_four_ranks_sharing_the_gpu():
    T.no_problems(T.shared(_cross_mesh, timeout=300))


# ---------------------------------------------------------------- DCP

def _dcp_reshard(root):
    """Rank side: save CUDA DTensors on a 1-d mesh, load onto a 2x2 mesh with other placements."""
    import os

    import torch.distributed.checkpoint as dcp
    from shardprop import Replicate, Shard, distribute_tensor, init_device_mesh
    dev = T.device()
    one = init_device_mesh("cuda", (4,))
    two = init_device_mesh("cuda", (2, 2))
    g = torch.Generator().manual_seed(0)
    fulls = {"w": torch.randn(9, 6, generator=g), "b": torch.randn(6, generator=g)}
    state = {"w": distribute_tensor(fulls["w"].to(dev), one, [Shard(0)]),
             "b": distribute_tensor(fulls["b"].to(dev), one, [Replicate()])}
    path = os.path.join(root, "ckpt")
    dcp.save(state, checkpoint_id=path)
    target = {"w": distribute_tensor(torch.zeros(9, 6, device=dev), two, [Shard(1), Shard(0)]),
              "b": distribute_tensor(torch.zeros(6, device=dev), two, [Replicate(), Shard(0)])}
    dcp.load(target, checkpoint_id=path)
    problems = []
    for k, t in target.items():
        if t.to_local().device.type != "cuda":
            problems.append(f"{k}: loaded onto {t.to_local().device}")
        if not torch.equal(t.full_tensor().cpu(), fulls[k]):
            problems.append(f"{k}: loaded {t.full_tensor().tolist()} != saved {fulls[k].tolist()}")
    return problems


def test_dcp_save_load_reshard_four_ranks_sharing_the_gpu(tmp_path):
    T.no_problems(T.shared(_dcp_reshard, str(tmp_path), timeout=300))
