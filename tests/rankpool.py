"""Long-lived pools of gloo ranks for multi-rank tests.

Starting a rank (a fresh interpreter that imports torch and joins a process
group) costs seconds, so each world size gets one pool of worker processes
that stays up for the whole session and runs test bodies on demand::

    import torch, torch.distributed as dist
    from tests.rankpool import run_on_ranks

    def _sum_of_ranks():                  # module level: pickled by reference
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        return t.item()

    def test_sum():
        assert run_on_ranks(4, _sum_of_ranks) == [6.0] * 4

Inside a job, ``torch.distributed`` is already initialised: use
``dist.get_rank()`` / ``dist.get_world_size()``.  If any rank fails or the
job times out, the pool is killed (the other ranks may be stuck in a
collective, or their process groups out of step) and restarted before the
next job.

This module must not import torch at top level: the workers set
SHARDPROP_COLLECTIVE_TIMEOUT before anything reads it.
"""

import collections
import faulthandler
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta

__all__ = ["RankPool", "RankError", "RankTimeout", "run_on_ranks", "run_on_backend", "get_pool", "shutdown_all"]

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Once one rank has failed, how long to wait for the others before killing
# them: long enough to collect the same error from every rank when the bug is
# everywhere, short enough not to wait for gloo's collective timeout.
_ERROR_GRACE_S = 1.0


class RankError(RuntimeError):
    """A job (or the pool start-up) failed on one or more ranks; the message
    holds each failing rank's traceback."""


class RankTimeout(RankError, TimeoutError):
    """A job did not finish on every rank within its timeout; the message
    holds the Python stacks of the ranks that were still running."""


# --------------------------------------------------------------------------
# worker side


def _worker_main(rank, world_size, port, conn, log_path, collective_timeout, backend):
    # Before torch or shardprop is imported (jobs import test modules, which
    # import shardprop): both read these at import time.
    os.environ["SHARDPROP_COLLECTIVE_TIMEOUT"] = f"{collective_timeout:g}"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)

    # All output, including C++ warnings from gloo, goes to a per-rank log that
    # the parent forwards into the current test's captured stderr.
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    if sys.stdout is not None:
        sys.stdout.reconfigure(line_buffering=True)  # survive a kill on timeout
    # On a timeout the parent sends SIGUSR1 to dump the stuck stacks.
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    _exit_when_orphaned()

    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # 8 ranks share 2 cores
        kwargs = {}
        if "nccl" in backend:  # one GPU per rank (NCCL refuses two ranks on one GPU)
            torch.cuda.set_device(rank % torch.cuda.device_count())
            kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            init_method=f"tcp://127.0.0.1:{port}",
            timeout=timedelta(seconds=collective_timeout),
            **kwargs,
        )
        reply = ("ok", os.getpid())
    except BaseException:
        reply = ("err", traceback.format_exc())
    conn.send_bytes(pickle.dumps(reply))

    while True:
        try:
            job = conn.recv_bytes()
        except (EOFError, OSError):  # parent closed the pipe or died
            os._exit(0)
        try:
            fn, args, kwargs = pickle.loads(job)
            data = pickle.dumps(("ok", fn(*args, **kwargs)))
        except BaseException as e:  # also pytest's skip/fail, which are BaseException
            # Skip this frame: the traceback starts in the job.
            tb = e.__traceback__.tb_next or e.__traceback__
            data = pickle.dumps(("err", "".join(traceback.format_exception(type(e), e, tb))))
        sys.stdout.flush()
        sys.stderr.flush()
        conn.send_bytes(data)


def _exit_when_orphaned(interval=0.5):
    """Die with the parent, even while blocked in a collective."""
    parent = os.getppid()
    # Linux: the kernel kills us, and no extra thread clutters stack dumps.
    # (It fires when the parent *thread* that started us exits, so create
    # pools from a long-lived thread: pytest's main thread.)
    try:
        import ctypes

        PR_SET_PDEATHSIG = 1
        if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL) == 0:
            if os.getppid() != parent:  # died before prctl took effect
                os._exit(1)
            return
    except (OSError, AttributeError):
        pass

    def watch():  # elsewhere: poll (gloo releases the GIL while it waits)
        while os.getppid() == parent:
            time.sleep(interval)
        os._exit(1)

    threading.Thread(target=watch, name="orphan-watchdog", daemon=True).start()


# --------------------------------------------------------------------------
# parent side


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _name(fn):
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


class RankPool:
    """``world_size`` worker processes, each rank of one gloo process group.

    ``timeout`` is the default per-``run`` limit in seconds;
    ``collective_timeout`` is the process group's timeout, also exported to
    the workers as SHARDPROP_COLLECTIVE_TIMEOUT.  The workers start in the
    constructor and are restarted lazily after a failure.

    Example::

        pool = RankPool(2)
        assert pool.run(_sum_of_ranks) == [1.0, 1.0]
        pool.shutdown()
    """

    def __init__(self, world_size, timeout=60.0, collective_timeout=20.0,
                 backend="gloo", startup_timeout=120.0):
        self.world_size = world_size
        self.timeout = timeout
        self.collective_timeout = collective_timeout
        self.backend = backend
        self.startup_timeout = startup_timeout
        self._procs, self._conns, self._logs = [], [], []
        self.start()

    @property
    def alive(self):
        """True while the workers are up (False after a failure, until the next run)."""
        return bool(self._procs)

    @property
    def pids(self):
        return [p.pid for p in self._procs]

    def start(self):
        """Start the workers if they are not running (a no-op otherwise)."""
        if self._procs:
            return
        # The free port can be taken between probing and binding: retry once.
        for attempt in range(2):
            try:
                self._spawn()
                return
            except RankError:
                if attempt:
                    raise

    def _spawn(self):
        # spawn, not fork: the parent may already run torch's threads.
        ctx = mp.get_context("spawn")
        port = _free_port()
        logdir = tempfile.mkdtemp(prefix=f"rankpool{self.world_size}-")
        for rank in range(self.world_size):
            log_path = os.path.join(logdir, f"rank{rank}.log")
            self._logs.append(open(log_path, "w+b"))  # our reading end
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, self.world_size, port, child_end, log_path,
                      self.collective_timeout, self.backend),
                name=f"rankpool{self.world_size}-rank{rank}",
                daemon=True,  # terminated by multiprocessing at interpreter exit
            )
            proc.start()
            child_end.close()  # so that a dead worker reads as EOF here
            self._procs.append(proc)
            self._conns.append(parent_end)
        replies = self._gather(self.startup_timeout)
        # Every worker that replied has opened its log: unlink them now, so
        # that nothing is left behind even if this process is killed.
        shutil.rmtree(logdir, ignore_errors=True)
        if all(replies.get(r, ("",))[0] == "ok" for r in range(self.world_size)):
            self._take_output()  # drop start-up chatter
            return
        output = self._take_output()
        self.shutdown()
        raise RankError(self._report(f"starting {self.world_size} ranks", replies, output))

    def run(self, fn, *args, timeout=None, **kwargs):
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in
        rank order.

        ``fn`` must be a module-level function (it is pickled by reference)
        and its arguments and results picklable.  Raises RankError with the
        failing ranks' tracebacks if any rank raises or dies, RankTimeout if
        the job takes longer than ``timeout`` seconds (default: the pool's);
        either way the workers are killed and restarted on the next run.

        Example::

            ranks = pool.run(torch.distributed.get_rank)   # [0, 1, 2, 3]
        """
        __tracebackhide__ = True  # pytest: show the test and the ranks' tracebacks, not this
        try:
            job = pickle.dumps((fn, args, kwargs))
        except Exception as e:  # before anything is sent: the pool stays usable
            raise TypeError(f"cannot send {_name(fn)} to the ranks: {e!r}; "
                            "jobs must be module-level functions with picklable arguments") from e
        self.start()
        limit = self.timeout if timeout is None else timeout
        replies = {}
        try:
            for rank, conn in enumerate(self._conns):
                try:
                    conn.send_bytes(job)
                except OSError:
                    replies[rank] = ("err", f"worker died before the job (exit code {self._procs[rank].exitcode})")
            replies = self._gather(limit, replies)
        except BaseException:  # e.g. pytest-timeout or Ctrl-C: the ranks are mid-job
            self.shutdown()
            raise

        stuck = [r for r in range(self.world_size) if r not in replies]
        failed = [r for r, (status, _) in replies.items() if status != "ok"]
        if not stuck and not failed:
            self._forward(self._take_output())
            return [replies[r][1] for r in range(self.world_size)]

        if stuck and not failed:  # dump the stuck ranks' Python stacks into their logs
            for r in stuck:
                os.kill(self._procs[r].pid, signal.SIGUSR1)
            time.sleep(0.5)
        output = self._take_output()
        self.shutdown()
        what = f"{_name(fn)} on {self.world_size} ranks"
        if failed:
            self._forward(output)
            raise RankError(self._report(what, replies, {}))
        self._forward({r: text for r, text in output.items() if r not in stuck})
        raise RankTimeout(
            f"{what} timed out after {limit:g} s (workers killed; the next run restarts them); "
            f"ranks {stuck} were still running; their output ends with their Python stacks.\n"
            + self._outputs(output, stuck))

    def _gather(self, timeout, replies=None):
        """Collect the ranks' replies until all arrived, the timeout passed, or
        ``_ERROR_GRACE_S`` after the first failure.  Returns {rank: (status, value)}."""
        replies = {} if replies is None else dict(replies)
        deadline = time.monotonic() + timeout
        if any(status != "ok" for status, _ in replies.values()):
            deadline = min(deadline, time.monotonic() + _ERROR_GRACE_S)
        waiting = {self._conns[r]: r for r in range(self.world_size) if r not in replies}
        while waiting:
            ready = mp.connection.wait(list(waiting), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for conn in ready:
                rank = waiting.pop(conn)
                try:
                    replies[rank] = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    self._procs[rank].join(1)
                    replies[rank] = ("err", f"worker process died (exit code {self._procs[rank].exitcode})")
                except Exception:
                    replies[rank] = ("err", "could not unpickle the result:\n" + traceback.format_exc())
                if replies[rank][0] != "ok":
                    deadline = min(deadline, time.monotonic() + _ERROR_GRACE_S)
        return replies

    def _report(self, what, replies, output):
        failed = sorted(r for r, (status, _) in replies.items() if status != "ok")
        stuck = [r for r in range(self.world_size) if r not in replies]
        lines = [f"{what} failed on rank{'s' if len(failed) > 1 else ''} "
                 f"{', '.join(map(str, failed))} (workers killed; the next run restarts them)"]
        if stuck:
            lines.append(f"ranks {stuck} had not finished (blocked in a collective?) and were killed")
        for r in failed:
            lines += ["", f"---- rank {r} ----", replies[r][1].rstrip()]
        return "\n".join(lines) + "\n" + self._outputs(output, sorted(output))

    @staticmethod
    def _outputs(output, ranks):
        return "".join(f"\n---- rank {r} output ----\n{output[r].rstrip()}\n"
                       for r in ranks if output.get(r, "").strip())

    def _take_output(self):
        """{rank: text} written by each worker since the last call."""
        out = {}
        for rank, log in enumerate(self._logs):
            data = log.read()  # from where the last read stopped
            if data:
                out[rank] = data.decode(errors="replace")
        return out

    @staticmethod
    def _forward(output):
        # Into the parent's stderr, which pytest captures per test and shows
        # only when that test fails.
        for rank, text in sorted(output.items()):
            sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in text.splitlines()))

    def shutdown(self):
        """Kill the workers (they may be stuck in C code, so no polite exit)."""
        for proc in self._procs:
            proc.kill()
        for proc in self._procs:
            proc.join(5)
        for conn in self._conns:
            conn.close()
        for log in self._logs:
            log.close()
        self._procs, self._conns, self._logs = [], [], []

    def __repr__(self):
        return f"RankPool(world_size={self.world_size}, alive={self.alive})"


# --------------------------------------------------------------------------
# session-wide cache

# At most this many pools have live workers: 8 + 4 ranks is plenty for 2 cores.
MAX_LIVE_POOLS = 2
_POOLS = collections.OrderedDict()  # world_size -> RankPool, least recently used first


def get_pool(world_size, backend="gloo"):
    """The session's pool for ``world_size`` ranks of ``backend``, started if
    needed; shuts down the least recently used pools beyond MAX_LIVE_POOLS.

    A gloo pool is keyed by its size alone; others by (size, backend). The
    CUDA tier runs 4 ranks sharing one GPU on the ordinary gloo pool (each
    rank puts its tensors on cuda:0) and NCCL meshes on ``backend="nccl"``.

    Example::

        get_pool(4).run(torch.distributed.get_world_size)  # [4, 4, 4, 4]
        get_pool(1, "nccl")  # one rank, one GPU
    """
    key = world_size if backend == "gloo" else (world_size, backend)
    pool = _POOLS.pop(key, None)
    live = [p for p in _POOLS.values() if p.alive]
    for old in live[: max(0, len(live) - (MAX_LIVE_POOLS - 1))]:
        old.shutdown()  # before starting new workers, to bound memory
    if pool is None:
        # The CUDA tier (make test-gpu) sets a longer limit: ranks sharing one GPU compile
        # (inductor) or warm up at different speeds before they meet in a collective.
        pool = RankPool(world_size, backend=backend,
                        collective_timeout=float(os.environ.get("SHARDPROP_TEST_COLLECTIVE_TIMEOUT", "20")))
    _POOLS[key] = pool
    return pool


def run_on_ranks(world_size, fn, *args, **kwargs):
    """``get_pool(world_size).run(fn, *args, **kwargs)``; ``timeout=`` is the
    per-call limit in seconds and is not passed on to ``fn``.

    Example::

        assert run_on_ranks(2, _sum_of_ranks) == [1.0, 1.0]
    """
    __tracebackhide__ = True
    return get_pool(world_size).run(fn, *args, **kwargs)


def run_on_backend(backend, world_size, fn, *args, **kwargs):
    """``run_on_ranks`` on a pool of ``backend`` (e.g. ``"nccl"``: one GPU per rank).

    Example::

        run_on_backend("nccl", 1, _sum_of_ranks)  # [0.0]
    """
    __tracebackhide__ = True
    return get_pool(world_size, backend).run(fn, *args, **kwargs)


def shutdown_all():
    """Kill every cached pool (pytest calls this at session end)."""
    while _POOLS:
        _POOLS.popitem()[1].shutdown()
