"""shardprop on torch's fake process-group backend: one process plays one rank of a huge world.

Each case runs in a fresh subprocess (the default group is process-wide, and every case wants its
own world size). What is checked: meshes build with groups of the default group's backend (ours,
gloo, cannot live on a FakeStore), only this rank's groups are created, ops dispatch, and
redistribution planning at 65,536 ranks finishes (it used to price every pair of ranks).
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRELUDE = """
import json, time, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
torch.set_num_threads(1)
def start(world, rank=3):
    dist.init_process_group("fake", store=FakeStore(), rank=rank % world, world_size=world)
import shardprop as sp
from shardprop import Shard, Replicate, Partial
"""


def run(body: str, timeout: float = 240) -> dict:
    """Run ``body`` (after PRELUDE) in a fresh interpreter; it prints one JSON line as its last line."""
    code = PRELUDE + textwrap.dedent(body)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_mesh_of_65536_ranks_builds_only_this_ranks_groups():
    out = run("""
        start(65536)
        from torch.distributed import distributed_c10d as c10d
        before = len(c10d._world.pg_map)
        t = time.perf_counter()
        mesh = sp.init_device_mesh("cpu", (64, 32, 32), mesh_dim_names=("dp", "cp", "tp"))
        secs = time.perf_counter() - t
        sizes = [mesh.get_group(d).size() for d in range(3)]
        ranks = [sorted(dist.get_process_group_ranks(mesh.get_group(d))) for d in range(3)]
        print(json.dumps(dict(secs=secs, made=len(c10d._world.pg_map) - before, sizes=sizes,
                              ranks=[r[:3] + r[-1:] for r in ranks], coord=mesh.get_coordinate(),
                              backend=dist.get_backend(mesh.get_group(0)))))
    """)
    assert out["sizes"] == [64, 32, 32]
    assert out["coord"] == [0, 0, 3]
    # rank 3 = (0, 0, 3): tp is ranks 0..31, cp ranks 3, 35, ..., dp ranks 3, 1027, ...
    assert out["ranks"] == [[3, 1027, 2051, 64515], [3, 35, 67, 995], [0, 1, 2, 31]]
    # One group per dim and per set of dims through this rank (7 sets for 3 dims; the set of all
    # dims is the default group itself), not the 1024 + 2048 + 2048 groups of the whole mesh.
    assert out["made"] <= 6, out
    assert out["backend"] == "fake"
    assert out["secs"] < 20, out  # about 0.02 s here; torch's init_device_mesh takes about 0.7 s


def test_ops_and_redistribution_dispatch_on_the_fake_backend():
    out = run("""
        start(64)
        mesh = sp.init_device_mesh("cpu", (4, 16), mesh_dim_names=("dp", "tp"))
        x = sp.distribute_tensor(torch.randn(64, 32), mesh, [Replicate(), Shard(0)])
        w = sp.distribute_tensor(torch.randn(32, 8), mesh, [Replicate(), Replicate()])
        y = x @ w
        z = (y * 2).sum(0)
        g = x.redistribute(mesh, [Shard(1), Replicate()])
        print(json.dumps(dict(y=[str(p) for p in y.placements], y_local=list(y.to_local().shape),
                              z=[str(p) for p in z.placements], g_local=list(g.to_local().shape),
                              shape=list(z.shape))))
    """)
    assert out["y"] == ["R", "S(0)"] and out["y_local"] == [4, 8]
    assert out["z"] == ["R", "P(sum)"] and out["shape"] == [8]
    assert out["g_local"] == [64, 8]  # gathered over tp (values: whatever the fake backend left), cut over dp


def test_planning_at_65536_ranks_finishes_and_small_plans_keep_point_to_point():
    out = run("""
        start(65536)
        from shardprop.tensor.redistribute import plan_redistribute
        mesh = sp.init_device_mesh("cpu", (256, 256))
        t = time.perf_counter()
        kinds = []
        for src, dst in [((Shard(0), Replicate()), (Replicate(), Shard(0))),
                         ((Shard(0), Shard(1)), (Shard(1), Shard(0))),
                         ((Shard(0), Replicate()), (Shard(1), Replicate()))]:
            x = sp.DTensor.from_local(torch.randn(4, 1024), mesh, src, run_check=False)
            kinds.append([s.kind for s in plan_redistribute(x._spec, dst).steps])
        secs = time.perf_counter() - t
        print(json.dumps(dict(secs=secs, kinds=kinds)))
    """)
    assert out["secs"] < 10, out  # milliseconds here; pricing every pair of 65,536 ranks never finished
    assert all(k and "p2p" not in k for k in out["kinds"]), out
    small = run("""
        start(4)
        from shardprop.tensor.redistribute import plan_redistribute
        mesh = sp.init_device_mesh("cpu", (2, 2))
        x = sp.DTensor.from_local(torch.randn(4, 8), mesh, (Shard(0), Replicate()), run_check=False)
        print(json.dumps([s.kind for s in plan_redistribute(x._spec, (Replicate(), Shard(0))).steps]))
    """)
    assert small == ["p2p"]  # the 2x2 swap of the redistribute tests still goes point to point


def test_cache_hit_dispatch_costs_the_same_at_4_and_65536_ranks():
    body = """
        start({world})
        mesh = sp.init_device_mesh("cpu", {shape})
        n = len(mesh.shape)
        pl = [Replicate()] * n
        pl[-1] = Shard(0)
        x = sp.DTensor.from_local(torch.randn(4, 16), mesh, pl, run_check=False)
        y = sp.DTensor.from_local(torch.randn(4, 16), mesh, pl, run_check=False)
        x + y
        best = 1e9
        for _ in range(7):
            t = time.perf_counter()
            for _ in range(300):
                x + y
            best = min(best, (time.perf_counter() - t) / 300)
        print(json.dumps(best))
    """
    small = run(body.format(world=4, shape=(2, 2)))
    big = run(body.format(world=65536, shape=(64, 32, 32)))
    # Within 10% on a quiet machine (bench/scale.py); 2x here leaves room for a shared one while
    # still failing on anything that walks the world's ranks per call.
    assert big < 2 * small + 5e-6, (small, big)


def test_backend_for_follows_defaults_it_cannot_use(monkeypatch):
    import torch.distributed as dist
    from shardprop.mesh import groups
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    cases = {"gloo": ("gloo", "gloo"), "nccl": ("gloo", "nccl"), "cpu:gloo,cuda:nccl": ("gloo", "nccl"),
             "cpu:gloo,cuda:gloo": ("gloo", "gloo"), "fake": ("fake", "fake"),
             "cpu:fake,cuda:fake": ("fake", "fake"), "mpi": ("mpi", "mpi")}
    for config, (cpu, cuda) in cases.items():
        monkeypatch.setattr(dist, "get_backend", lambda group=None, c=config: c)
        assert (groups.backend_for("cpu"), groups.backend_for("cuda")) == (cpu, cuda), config
    assert groups.follows_default("fake") and not groups.follows_default("gloo")


@pytest.mark.parametrize("ranks", [list(range(0, 256, 2)), [0, 1, 3]])
def test_rank_lists_compare_like_lists(ranks):
    from shardprop.mesh.groups import RankRange, ascending, cache_key, compact
    c = compact(ranks)
    assert c == ranks and ranks == c and list(c) == ranks and len(c) == len(ranks)
    assert ascending(c) and c[0] == ranks[0] and c[-1] == ranks[-1] and ranks[1] in c
    assert isinstance(c, RankRange) == (len(ranks) >= 64)
    assert cache_key("gloo", ranks) == cache_key("gloo", list(ranks))
