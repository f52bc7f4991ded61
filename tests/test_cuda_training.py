"""CUDA tier: training on GPUs against one GPU.

The demo (TP on 2x2 and 1x4, fully_shard on dp=4 and 2x2, compiled with inductor) on 4 ranks
sharing the GPU over gloo and on a one-rank NCCL mesh; bf16 autocast and MixedPrecisionPolicy;
dropout on a TP model equal to one GPU. Skipped without a CUDA device (``make test-gpu``).
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests import cuda_tier as T

pytestmark = pytest.mark.cuda


def _demo(argv):
    """Rank side: the demo's rank_main on this rank (the group exists); its summary."""
    from shardprop.demo.train import parser, rank_main
    args = parser().parse_args(["--device", "cuda"] + list(argv))
    summary = rank_main(args)
    return dict(ok=summary["ok"], max_rel=summary["max_rel"], losses=summary["losses"])


def _check_demo(per_rank):
    first = per_rank[0]
    assert first["ok"] is True, f"demo on CUDA differs from one GPU: max rel {first['max_rel']}"
    assert all(r["losses"] == first["losses"] for r in per_rank), "ranks disagree on the losses"


@pytest.mark.parametrize("argv", [["--mesh", "2x2"], ["--mesh", "1x4"], ["--mesh", "2x2", "--loss-parallel"],
                                  ["--fsdp", "--mesh", "4"], ["--fsdp", "--mesh", "2x2"]],
                         ids=["tp2x2", "tp1x4", "loss_parallel", "fsdp_dp4", "fsdp_2x2"])
def test_demo_four_ranks_sharing_the_gpu(argv):
    _check_demo(T.shared(_demo, ["--steps", "5"] + argv, timeout=600))


@pytest.mark.parametrize("argv", [["--mesh", "1"], ["--fsdp", "--mesh", "1"]], ids=["tp1", "fsdp1"])
def test_demo_one_rank_nccl_mesh(argv):
    _check_demo(T.nccl(1, _demo, ["--steps", "5"] + argv, timeout=300))


def test_demo_compiled_with_inductor_on_a_tp_model():
    # triton kernels from inductor on every rank; collectives inside the graph (gloo: staged in-graph).
    _check_demo(T.shared(_demo, ["--steps", "3", "--mesh", "1x4", "--compile"], timeout=600))


def test_demo_compiled_one_rank_nccl():
    _check_demo(T.nccl(1, _demo, ["--steps", "3", "--mesh", "1", "--compile"], timeout=600))


def test_demo_command_line_on_cuda():
    # The user's command: one GPU -> 4 ranks over gloo; >= 4 GPUs -> NCCL. It exits non-zero on FAIL.
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "shardprop.demo", "--device", "cuda", "--steps", "3"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "carrying" in out.stdout and "PASS" in out.stdout, out.stdout[-3000:]


# ---------------------------------------------------------------- bf16

def _tp_autocast_bf16():
    """TP Llama under torch.autocast(bf16) against the same model on one GPU under autocast."""
    import shardprop as sp
    from shardprop.demo.model import Llama, LlamaConfig, lm_loss, synthetic_batch, tp_plan
    cfg = LlamaConfig(dim=64, n_layers=2, n_heads=4, vocab_size=128, seq_len=16)
    mesh = sp.init_device_mesh("cuda", (torch.distributed.get_world_size(),))
    dev = T.device()
    plain = Llama(cfg, 0).to(dev)
    model = sp.parallelize_module(Llama(cfg, 0).to(dev), mesh, tp_plan())
    x, y = (t.to(dev) for t in synthetic_batch(cfg, 4, 0, 0))
    problems = []
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want = lm_loss(plain(x), y)
        got = lm_loss(model(x), y)
    got = got.full_tensor() if isinstance(got, sp.DTensor) else got
    problems.append(T.close(got, want, "bf16 autocast loss", rtol=2e-2, atol=2e-2))
    want.backward()
    got.backward()
    wq = model.layers[0].attention.wq.weight.grad.full_tensor()
    problems.append(T.rel_close(wq, plain.layers[0].attention.wq.weight.grad, "bf16 autocast wq grad", 5e-2))
    return [p for p in problems if p]


def test_bf16_autocast_tp_four_ranks_sharing_the_gpu():
    T.no_problems(T.shared(_tp_autocast_bf16, timeout=300))


def test_bf16_autocast_tp_one_rank_nccl():
    T.no_problems(T.nccl(1, _tp_autocast_bf16, timeout=300))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(16, 24), nn.Linear(24, 8)

    def forward(self, x):
        return self.b(F.gelu(self.a(x)))


def _fsdp_mixed_precision():
    """fully_shard(dp) with MixedPrecisionPolicy(bf16 params, fp32 reduce) vs plain fp32 on one GPU."""
    import shardprop as sp
    n = torch.distributed.get_world_size()
    mesh = sp.init_device_mesh("cuda", (n,), mesh_dim_names=("dp",))
    dev = T.device()
    plain = _Net().to(dev)
    model = _Net().to(dev)
    policy = sp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    sp.fully_shard(model.a, mesh=mesh, mp_policy=policy)
    sp.fully_shard(model, mesh=mesh, mp_policy=policy)
    opt_p = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    opt_m = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    problems = []
    for step in range(5):
        x = torch.randn(4 * n, 16, generator=g).to(dev)
        y = torch.randn(4 * n, 8, generator=g).to(dev)
        lp = F.mse_loss(plain(x), y)
        lp.backward()
        opt_p.step()
        opt_p.zero_grad()
        mine = x.chunk(n)[mesh.get_local_rank()], y.chunk(n)[mesh.get_local_rank()]
        lm = F.mse_loss(model(mine[0]).float(), mine[1])
        lm.backward()
        opt_m.step()
        opt_m.zero_grad()
        total = lm.detach().reshape(1).clone()
        torch.distributed.all_reduce(total)
        problems.append(T.close(total / n, lp.detach().reshape(1), f"step {step} loss", rtol=3e-2, atol=3e-2))
    for name, p in model.named_parameters():
        if p.dtype != torch.float32:
            problems.append(f"{name}: sharded parameter is {p.dtype}, expected float32 master weights")
        # AdamW moves each entry by ~lr per step whatever the gradient's size: a wrong gradient shows
        # in the mean difference (~1e-2 after 5 steps), bf16 rounding gives ~1e-3 (as tests/test_fully_shard.py).
        diff = (p.full_tensor() - dict(plain.named_parameters())[name]).abs()
        if not (diff.mean() < 3e-3 and diff.max() < 8e-2):
            problems.append(f"{name} after 5 steps: mean diff {diff.mean().item():.3g}, max {diff.max().item():.3g}")
    return [p for p in problems if p]


def test_mixed_precision_policy_four_ranks_sharing_the_gpu():
    T.no_problems(T.shared(_fsdp_mixed_precision, timeout=300))


def test_mixed_precision_policy_one_rank_nccl():
    T.no_problems(T.nccl(1, _fsdp_mixed_precision, timeout=300))


# ---------------------------------------------------------------- RNG

def _dropout_equals_one_gpu():
    """Sharded dropout (native_dropout on CUDA) draws what one GPU draws after the same seed."""
    import shardprop as sp
    from shardprop import Replicate, Shard, distribute_tensor
    n = torch.distributed.get_world_size()
    mesh = sp.init_device_mesh("cuda", (n,))
    dev = T.device()
    x = torch.randn(4 * n, 12, generator=torch.Generator().manual_seed(2)).to(dev)
    problems = []
    for placements in ([Shard(0)], [Shard(1)] if 12 % n == 0 else [Shard(0)], [Replicate()]):
        torch.cuda.manual_seed(5)
        want = F.dropout(x, 0.3)
        sp.manual_seed(5, mesh)
        got = F.dropout(distribute_tensor(x, mesh, placements), 0.3).full_tensor()
        problems.append(T.close(got, want, f"dropout {placements}", rtol=0, atol=1e-6))
    return [p for p in problems if p]


def test_dropout_four_ranks_sharing_the_gpu():
    T.no_problems(T.shared(_dropout_equals_one_gpu, timeout=120))


def test_dropout_one_rank_nccl():
    T.no_problems(T.nccl(1, _dropout_equals_one_gpu, timeout=120))
