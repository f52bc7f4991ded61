"""Session-wide test setup: the `cuda`, `gpu` and `clients` markers, and shutting down rank pools.

The CUDA tier (``make test-gpu``): `cuda` tests need one CUDA device, `gpu` tests two or more;
both are skipped where torch sees fewer (a CPU machine, a CPU build of torch).
The clients tier (``make test-clients``, ``SHARDPROP_CLIENTS=1``): tests/clients/ runs torchtitan's trainer
on both stacks; without the variable it is not even collected (it needs torchtitan and takes minutes).
"""

import os

import pytest

from tests.rankpool import shutdown_all

collect_ignore = [] if os.environ.get("SHARDPROP_CLIENTS") else ["clients"]


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs at least 2 CUDA devices; skipped otherwise")
    config.addinivalue_line("markers", "cuda: needs at least 1 CUDA device; skipped otherwise")
    config.addinivalue_line("markers", "slow: long variants; run with SHARDPROP_SLOW=1")
    config.addinivalue_line("markers", "release: run by the release tier (SHARDPROP_RELEASE=1, make test-release) "
                                       "and with SHARDPROP_SLOW=1")
    config.addinivalue_line("markers", "clients: the clients tier (torchtitan on torch's stack and on shardprop); "
                                       "collected only with SHARDPROP_CLIENTS=1 (make test-clients)")


def pytest_collection_modifyitems(config, items):
    if not os.environ.get("SHARDPROP_SLOW"):
        skip_slow = pytest.mark.skip(reason="slow: set SHARDPROP_SLOW=1 to run")
        for item in items:
            if item.get_closest_marker("slow"):
                item.add_marker(skip_slow)
    if not (os.environ.get("SHARDPROP_SLOW") or os.environ.get("SHARDPROP_RELEASE")):
        skip_release = pytest.mark.skip(reason="release tier: set SHARDPROP_RELEASE=1 (make test-release) to run")
        for item in items:
            if item.get_closest_marker("release"):
                item.add_marker(skip_release)
    if not os.environ.get("SHARDPROP_CLIENTS"):
        skip_clients = pytest.mark.skip(reason="clients tier: set SHARDPROP_CLIENTS=1 (make test-clients) to run")
        for item in items:
            if item.get_closest_marker("clients"):
                item.add_marker(skip_clients)
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    cuda_items = [item for item in items if item.get_closest_marker("cuda") and not item.get_closest_marker("gpu")]
    if not gpu_items and not cuda_items:
        return
    import torch  # only when a gpu test was collected: the import costs seconds

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for need, marked in ((2, gpu_items), (1, cuda_items)):
        if count < need:
            skip = pytest.mark.skip(reason=f"needs >= {need} CUDA device(s), found {count}")
            for item in marked:
                item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    # Kill the workers of every cached pool rather than leave it to atexit.
    shutdown_all()
