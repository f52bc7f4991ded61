"""Tests of the multi-rank test harness itself (tests/rankpool.py)."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from tests import rankpool
from tests.rankpool import REPO_ROOT, RankError, RankTimeout, get_pool, run_on_ranks

# Job bodies run in the workers, so they live at module level (pickled by reference).


def _rank_and_sum():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item()


def _worker_setup():
    return os.environ["SHARDPROP_COLLECTIVE_TIMEOUT"], torch.get_num_threads()


def _scaled_rank(offset, *, scale):
    return offset + scale * dist.get_rank()


def _fail_on_rank1():
    if dist.get_rank() == 1:
        raise ValueError("boom from rank 1")
    dist.all_reduce(torch.ones(1))  # never completes: rank 1 never joins


def _die_on_rank0():
    if dist.get_rank() == 0:
        os._exit(3)
    dist.all_reduce(torch.ones(1))


def _sleep_then_rank(seconds):
    time.sleep(seconds)
    return dist.get_rank()


def _print_rank():
    print(f"hello from rank {dist.get_rank()}")


def _dead(pid):
    """True once `pid` has exited (a zombie counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _wait_dead(pids, within):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and not all(_dead(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if not _dead(p)]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_come_back_in_rank_order(world_size):
    total = world_size * (world_size - 1) / 2
    expected = [(rank, world_size, total) for rank in range(world_size)]
    assert run_on_ranks(world_size, _rank_and_sum) == expected


def test_workers_are_configured():
    assert run_on_ranks(2, _worker_setup) == [("20", 1)] * 2


def test_args_and_kwargs_reach_every_rank():
    assert run_on_ranks(2, _scaled_rank, 1, scale=10) == [1, 11]


def test_exception_on_one_rank_is_reported_and_pool_restarts():
    pool = get_pool(4)
    old_pids = pool.run(os.getpid)
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        pool.run(_fail_on_rank1)
    # Far below gloo's 20 s collective timeout: the blocked ranks were killed.
    assert time.monotonic() - start < 10
    message = str(info.value)
    assert "failed on rank 1 " in message
    assert "ValueError: boom from rank 1" in message
    assert "in _fail_on_rank1" in message  # the worker's traceback
    assert "ranks [0, 2, 3] had not finished" in message
    assert _wait_dead(old_pids, within=5) == []
    # The same pool works again, with fresh workers.
    assert pool.run(_rank_and_sum) == [(r, 4, 6.0) for r in range(4)]
    assert set(pool.run(os.getpid)).isdisjoint(old_pids)


def test_dead_worker_is_reported_and_pool_restarts():
    with pytest.raises(RankError) as info:
        run_on_ranks(2, _die_on_rank0)
    # Rank 1 may fail too (gloo sees the connection reset) or still be blocked.
    assert "---- rank 0 ----\nworker process died (exit code 3)" in str(info.value)
    assert run_on_ranks(2, _rank_and_sum) == [(0, 2, 1.0), (1, 2, 1.0)]


def test_timeout_names_the_function_shows_stacks_and_pool_restarts():
    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        run_on_ranks(2, _sleep_then_rank, 60, timeout=1)
    assert time.monotonic() - start < 10
    message = str(info.value)
    assert "test_rankpool._sleep_then_rank" in message
    assert "timed out after 1 s" in message
    assert "in _sleep_then_rank" in message  # faulthandler stack of a stuck rank
    assert run_on_ranks(2, _sleep_then_rank, 0) == [0, 1]


def test_unpicklable_job_is_rejected_without_restart():
    pool = get_pool(2)
    pids = pool.pids
    with pytest.raises(TypeError, match="module-level"):
        pool.run(lambda: 0)
    assert pool.pids == pids and pool.run(_sleep_then_rank, 0) == [0, 1]


def test_worker_output_goes_to_the_tests_captured_stderr(capsys):
    run_on_ranks(2, _print_rank)
    err = capsys.readouterr().err
    assert "[rank 0] hello from rank 0" in err
    assert "[rank 1] hello from rank 1" in err


def test_at_most_two_pools_are_alive():
    for world_size in (1, 2, 4):
        run_on_ranks(world_size, os.getpid)
    assert [n for n, pool in rankpool._POOLS.items() if pool.alive] == [2, 4]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_die_with_their_parent():
    # The parent is SIGKILLed while its workers are busy in a job, so neither
    # atexit nor a closed pipe can stop them: only their orphan watchdog.
    script = (
        "import sys, time\n"
        f"sys.path.insert(0, {REPO_ROOT!r})\n"
        "from tests.rankpool import RankPool\n"
        "pool = RankPool(2)\n"
        "print(*pool.pids, flush=True)\n"
        "pool.run(time.sleep, 300)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2, "the parent failed to start its pool"
        time.sleep(0.5)  # let the job start
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()
    assert _wait_dead(pids, within=10) == []


class _Interrupted(Exception):
    pass


def _raise_interrupted(signum, frame):
    raise _Interrupted


@pytest.mark.skipif(not hasattr(signal, "SIGALRM"), reason="needs SIGALRM")
def test_interrupted_run_tears_the_pool_down():
    # What pytest-timeout or Ctrl-C does: raise in the parent mid-job.  The
    # busy ranks must not answer the next job with this job's results.
    pool = get_pool(2)
    previous = signal.signal(signal.SIGALRM, _raise_interrupted)
    try:
        signal.alarm(1)
        with pytest.raises(_Interrupted):
            pool.run(_sleep_then_rank, 30)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert not pool.alive
    assert pool.run(_scaled_rank, 5, scale=1) == [5, 6]
