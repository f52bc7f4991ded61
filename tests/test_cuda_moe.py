"""CUDA tier: mixture of experts on GPUs (skipped without a CUDA device; ``make test-gpu``).

The uneven all-to-all on CUDA tensors of 4 ranks sharing the GPU over gloo (staged through the
host: gloo/cuda all_to_all is staged in mesh/transport/staging.py) against every rank's data, and the demo's
MoE (``--moe``) on ep=4 and ep2 x tp2 sharing the GPU, and on a one-rank NCCL mesh, against one GPU.
"""
import pytest
import torch
import torch.distributed as dist

from tests import cuda_tier as T

pytestmark = pytest.mark.cuda


def _uneven_on_gpu():
    from shardprop import init_device_mesh
    from shardprop.mesh import all_to_all_uneven
    from shardprop.mesh.transport import staging
    mesh = init_device_mesh("cuda", (4,))
    dev, me, n = T.device(), dist.get_rank(), 4
    sizes = [[(r * 3 + j) % 4 for j in range(n)] for r in range(n)]
    data = [torch.randn(sum(sizes[r]), 5, generator=torch.Generator().manual_seed(r)) for r in range(n)]
    staging.stats.clear()
    x = data[me].to(dev).requires_grad_()
    got = all_to_all_uneven(x, mesh, 0, sizes[me])
    problems = [T.close(got, torch.cat([data[r].split(sizes[r])[me] for r in range(n)]), "uneven all_to_all")]
    got.sum().backward()
    problems.append(T.close(x.grad, torch.ones_like(data[me]), "its gradient"))
    if got.device.type != "cuda":
        problems.append(f"result on {got.device}, not the GPU")
    if "gloo" in str(dist.get_backend(mesh.get_group(0))) and not staging.stats.get("all_to_all"):
        problems.append("a gloo group carried CUDA tensors without staging them")
    return [p for p in problems if p]


def test_uneven_all_to_all_four_ranks_sharing_the_gpu():
    T.no_problems(T.shared(_uneven_on_gpu, timeout=300))


def _demo_moe(argv):
    from shardprop.demo import train as demo
    from shardprop.demo.moe_train import moe_main
    args = demo.parser().parse_args(["--device", "cuda", "--moe", "--steps", "3", "--dim", "32"] + list(argv))
    summary = moe_main(args, demo.compare, demo.RTOL, "cuda")
    return dict(ok=summary["ok"], max_rel=summary["max_rel"], losses=summary["losses"])


@pytest.mark.parametrize("mesh", ["4", "2x2"], ids=["ep4", "ep2xtp2"])
def test_demo_moe_four_ranks_sharing_the_gpu(mesh):
    per_rank = T.shared(_demo_moe, ["--mesh", mesh], timeout=600)
    assert per_rank[0]["ok"] is True, per_rank[0]
    assert all(r["losses"] == per_rank[0]["losses"] for r in per_rank)


def test_demo_moe_one_rank_nccl_mesh():
    per_rank = T.nccl(1, _demo_moe, ["--mesh", "1", "--batch", "4"], timeout=300)
    assert per_rank[0]["ok"] is True, per_rank[0]
