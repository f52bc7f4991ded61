"""The demo's device and backend choice (shardprop.demo.devices), with GPU counts mocked."""
import pytest

from shardprop.demo import devices
from shardprop.demo.devices import DevicePlan, plan


@pytest.mark.parametrize("requested,nproc,gpus,want", [
    ("auto", None, 0, DevicePlan("cpu", 4, "gloo", 0)),
    ("cpu", None, 8, DevicePlan("cpu", 4, "gloo", 8)),
    ("auto", None, 1, DevicePlan("cuda", 4, "gloo", 1)),      # one GPU: 4 ranks share it over gloo
    ("cuda", None, 1, DevicePlan("cuda", 4, "gloo", 1)),
    ("cuda", None, 2, DevicePlan("cuda", 4, "gloo", 2)),      # 2-3 GPUs, 4 ranks: shared round-robin, gloo
    ("cuda", None, 3, DevicePlan("cuda", 4, "gloo", 3)),
    ("cuda", 2, 2, DevicePlan("cuda", 2, "nccl", 2)),         # a GPU per rank: NCCL
    ("cuda", None, 4, DevicePlan("cuda", 4, "nccl", 4)),
    ("auto", None, 8, DevicePlan("cuda", 4, "nccl", 8)),
    ("cuda", 1, 1, DevicePlan("cuda", 1, "nccl", 1)),
])
def test_plan(requested, nproc, gpus, want):
    assert plan(requested, nproc, gpus) == want


def test_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(SystemExit, match="--device cuda: torch sees no CUDA device"):
        plan("cuda", None, 0)
    with pytest.raises(SystemExit, match="--nproc 0"):
        plan("cpu", 0, 0)


def test_describe_names_backend_and_staging():
    one = plan("cuda", None, 1).describe()
    assert one.startswith("4 ranks on cuda:0, gloo carrying CUDA tensors")
    assert "send_recv" in one.split("direct;")[1] and "staged through host memory" in one
    assert "all_reduce" in one.split("direct;")[0]
    assert "rank r on cuda:r % 2" in plan("cuda", None, 2).describe()
    assert plan("cuda", None, 8).describe() == "4 ranks on cuda:0..cuda:3, one GPU per rank, NCCL carrying every collective"
    assert plan("cpu", None, 0).describe() == "4 ranks on cpu, gloo carrying CPU tensors"


def test_demo_main_refuses_cuda_without_gpu(monkeypatch):
    # The demo's entry point with the GPU count mocked to 0: a clear message, nothing spawned.
    from shardprop.demo import train
    monkeypatch.setattr(devices, "visible_gpus", lambda: 0)
    monkeypatch.delenv("RANK", raising=False)
    spawned = []
    monkeypatch.setattr("torch.multiprocessing.spawn", lambda *a, **k: spawned.append(a))
    with pytest.raises(SystemExit, match="no CUDA device"):
        train.main(["--device", "cuda", "--steps", "1"])
    assert not spawned


def test_demo_main_one_gpu_spawns_four_gloo_ranks(monkeypatch):
    from shardprop.demo import train
    monkeypatch.setattr(devices, "visible_gpus", lambda: 1)
    monkeypatch.delenv("RANK", raising=False)
    spawned = []
    monkeypatch.setattr("torch.multiprocessing.spawn", lambda fn, args, nprocs: spawned.append((args, nprocs)))
    train.main(["--steps", "1"])
    (args, nprocs), = spawned
    assert nprocs == 4 and args[0] == 4
    ns = args[2]
    assert (ns.device, ns.backend) == ("cuda", "gloo")
    assert ns.placement.startswith("4 ranks on cuda:0, gloo carrying CUDA tensors")


def _bench(name):
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", name)
    spec = importlib.util.spec_from_file_location(f"_bench_{name[:-3]}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cuda_benchmarks_refuse_clearly_without_a_gpu(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="--device cuda: torch sees no CUDA device"):
        _bench("dispatch.py")._setup("cuda")
    with pytest.raises(SystemExit, match="tp_cuda.py: torch sees no CUDA device"):
        _bench("tp_cuda.py").main([])
