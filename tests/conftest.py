"""Session-wide test setup: the `gpu` marker and shutting down rank pools."""

import os

import pytest

from tests.rankpool import shutdown_all


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs at least 2 CUDA devices; skipped otherwise")
    config.addinivalue_line("markers", "slow: long variants; run with SHARDPROP_SLOW=1")


def pytest_collection_modifyitems(config, items):
    if not os.environ.get("SHARDPROP_SLOW"):
        skip_slow = pytest.mark.skip(reason="slow: set SHARDPROP_SLOW=1 to run")
        for item in items:
            if item.get_closest_marker("slow"):
                item.add_marker(skip_slow)
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch  # only when a gpu test was collected: the import costs seconds

    if torch.cuda.device_count() < 2:
        skip = pytest.mark.skip(reason=f"needs >= 2 CUDA devices, found {torch.cuda.device_count()}")
        for item in gpu_items:
            item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    # Kill the workers of every cached pool rather than leave it to atexit.
    shutdown_all()
