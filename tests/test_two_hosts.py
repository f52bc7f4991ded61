"""Two hosts on one machine: two torchrun agents (``--nnodes 2``, c10d rendezvous on 127.0.0.1), 2 ranks each.

Each agent's ranks get their own ``SHARDPROP_HOST_ID``, so the shared-memory transport pairs ranks
inside a "host" only and gloo carries everything between the hosts (the mixed case a real multi-node
job has). The ranks run ``tests/two_hosts_worker.py``: the demo, a redistribution sweep on a
(host, local) mesh, and a ``fully_shard`` step, each checked against one process.
"""
import os
import shutil
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "two_hosts_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(900)  # four ranks and two agents on a loaded 2-core machine
@pytest.mark.skipif(sys.platform != "linux", reason="the shared-memory transport is Linux-only")
def test_demo_sweep_and_fully_shard_on_two_hosts_under_torchrun():
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    cmd = [torchrun, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--rdzv-id", "shardprop-two-hosts",
           "--max-restarts", "0", "--local-addr", "127.0.0.1", WORKER]
    agents = []
    for host in ("host-a", "host-b"):
        env = dict(os.environ, SHARDPROP_HOST_ID=host, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        agents.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env))
    outs = []
    try:
        for a in agents:
            outs.append(a.communicate(timeout=800)[0])
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
    text = "\n".join(outs)
    assert all(a.returncode == 0 for a in agents), text[-6000:]
    for rank in range(4):
        assert f"TWO-HOSTS OK {rank}" in text, text[-6000:]
    assert "PASS" in text, text[-6000:]  # the demo's comparison with one process
