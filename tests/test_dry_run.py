"""The dry run (``python -m shardprop.demo --dry-run``): one rank of a large job on the fake backend.

Each case runs in its own interpreter (the dry run starts a process-wide fake default group).
"""
import json
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _report(model: str, mesh: str, rank: int = 0) -> dict:
    code = ("import json, sys; from shardprop.demo.dry_run import dry_run; "
            f"r = dry_run({model!r}, {mesh!r}, rank={rank}, say=lambda *a: None); print(json.dumps(r))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=ENV)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mesh,rank", [("2x2x2", 0), ("2x2x2", 7), ("4x2", 5), ("8", 3)])
def test_memory_per_rank_matches_the_analytic_count(mesh, rank):
    r = _report("tiny", mesh, rank)
    for key in ("params", "grads", "optim"):
        measured, analytic = r[f"{key}_bytes"], r["analytic"][key]
        assert abs(measured - analytic) <= 0.05 * analytic, (key, measured, analytic)
    dims = r["mesh"]
    tp, shard = dims.get("tp", 1), dims.get("dp", 1) * dims.get("cp", 1)
    sizes = {int(k.split("/")[1]) for k in r["collectives"]}
    assert shard in sizes  # fully_shard's gathers and reduce-scatters
    if tp > 1:
        assert tp in sizes  # tensor parallelism's
    assert f"all_gather/{shard}" in r["collectives"] and f"reduce_scatter/{shard}" in r["collectives"]
    assert r["activations_ac_bytes"] < r["activations_bytes"]


def test_cli_llama3_70b_on_512_ranks_in_under_two_minutes():
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "shardprop.demo", "--dry-run", "--model", "llama3-70b", "--mesh", "16x4x8"],
                       capture_output=True, text=True, timeout=300, env=ENV)
    secs = time.perf_counter() - t
    assert p.returncode == 0, p.stderr[-3000:]
    assert secs < 120, secs
    out = p.stdout
    assert "512 ranks" in out and "parameters" in out and "reduce_scatter" in out, out
    # 70.6e9 parameters over 512 ranks (matrices) in fp32: about 526 MiB of parameters per rank.
    line = next(ln for ln in out.splitlines() if ln.startswith("parameters"))
    assert "525.73 MiB  525.73 MiB" in line, line
