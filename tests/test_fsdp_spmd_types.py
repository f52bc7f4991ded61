"""fully_shard(mesh, dp_mesh_dims=...) over parameters annotated by the ``spmd_types`` package.

torchtitan's default backend computes on plain tensors: a tensor-parallel weight is this rank's piece,
``V`` on "tp" with a PartitionSpec naming the dim it splits; a norm weight is ``R`` on "tp" (its gradient
is a partial sum there). fully_shard stores each as a DTensor on the whole (dp, tp) mesh, hands the
module the gathered plain piece, and sums an R weight's gradient over "tp" before the dp reduce-scatter.
Skipped where ``spmd_types`` is not installed (the clients tier's venv has it; torchtitan runs it there).
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.rankpool import run_on_ranks

spmd = pytest.importorskip("spmd_types")
pytestmark = pytest.mark.timeout(120)


class Net(nn.Module):
    def __init__(self, w, g):
        super().__init__()
        self.w = nn.Parameter(w.clone())   # this tp rank's rows of a (8, 4) weight
        self.g = nn.Parameter(g.clone())   # a (4,) norm-like weight, whole on every rank

    def forward(self, x):
        return (x * self.g) @ self.w.t()


def _case():
    import spmd_types as spmd
    from spmd_types.types import PartitionSpec
    from shardprop import DataParallelMeshDims, fully_shard, init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_axis, tp_axis = (spmd.MeshAxis.of(mesh.get_group(n)) for n in ("dp", "tp"))
    me_dp, me_tp = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    torch.manual_seed(0)
    w_full, g_full = torch.randn(8, 4), torch.randn(4)
    net = Net(w_full.chunk(2)[me_tp], g_full)
    spmd.assert_type(net.w, {dp_axis: spmd.R, tp_axis: spmd.V}, PartitionSpec(tp_axis, None))
    spmd.assert_type(net.g, {dp_axis: spmd.R, tp_axis: spmd.R})
    fully_shard(net, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    layout = (tuple(str(p) for p in net.w.placements), tuple(net.w.shape), tuple(str(p) for p in net.g.placements))
    # each (dp, tp) rank brings its own batch: the R weight's gradient sums over tp, then averages over dp
    xs = torch.randn(2, 2, 3, 4)
    out = net(xs[me_dp, me_tp])
    plain = type(out) is torch.Tensor
    out.sum().backward()
    g_grad = net.g.grad.full_tensor()
    w_grad = net.w.grad.full_tensor()
    want_g = torch.zeros(4)
    want_w = torch.zeros(8, 4)
    for d in range(2):
        for t in range(2):
            g = g_full.clone().requires_grad_()
            w = w_full.clone().requires_grad_()
            ((xs[d, t] * g) @ w.chunk(2)[t].t()).sum().backward()
            want_g += g.grad / 2
            want_w += w.grad / 2
    return layout, plain, torch.allclose(g_grad, want_g, atol=1e-5), torch.allclose(w_grad, want_w, atol=1e-5)


def test_spmd_types_annotated_parameters_store_as_dtensors_compute_plain_and_reduce_as_typed():
    for layout, plain, g_ok, w_ok in run_on_ranks(4, _case):
        assert layout == (("S(1)", "S(0)"), (8, 4), ("S(0)", "R")), layout
        assert plain and g_ok and w_ok, (plain, g_ok, w_ok)
