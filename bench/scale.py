"""Scale by simulation: per-rank costs of shardprop and torch's DTensor from 4 to 65,536 ranks.

Every row runs in its own subprocess (the default group is process-wide) on torch's fake
backend (``init_process_group("fake", store=FakeStore())``): one process plays one rank of
any world size, and every collective returns at once, so what is timed is the per-rank work of
the engine itself. Both contenders run on the same backend, each in a fresh process:

* ours:  ``shardprop`` (``init_device_mesh``, ``DTensor``, ``plan_redistribute``, ...)
* torch: ``torch.distributed.device_mesh.init_device_mesh`` + ``torch.distributed.tensor``

Columns (per rank, rank 3 of the world):

* ``mesh ms`` / ``mesh KB``: building the mesh (its process groups included): wall time, and
  Python heap growth (tracemalloc) plus resident memory growth, both kept after the build;
* ``hit us``: cache-hit dispatch overhead of ``x + y`` and ``x @ w`` (mean of the two): time per
  call minus the same call on the local tensors;
* ``miss us``: cache-miss propagation: the first ``x + y`` on a new shape, minus the local call;
* ``plan us``: redistribution planning of ``[S(0), R.., S(1)] -> [S(1), R.., S(0)]`` (1-d:
  ``S(0) -> S(1)``) on a new shape: ours ``plan_redistribute``, torch ``_gen_transform_infos``;
* ``setup s``: ``parallelize_module`` (torchtitan-style TP plan) then ``fully_shard`` of every
  block and the root, for a 70B Llama 3 (dim 8192, 80 layers, ffn 28672, vocab 128256) on the
  meta device, on the 2-d (dp, tp) meshes only.

Usage::

    .venv/bin/python bench/scale.py                 # the table; writes bench/scale.png
    .venv/bin/python bench/scale.py --quick         # 4 ... 4096 ranks, no 70B setup
    .venv/bin/python bench/scale.py --json out.json # also the raw figures

The plot needs matplotlib, which is not a dependency: ``.venv/bin/pip install matplotlib``
first (without it the tables are printed and no PNG is written).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import tracemalloc

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# (world, mesh shape); the 2-d shapes are (dp, tp) and also get the 70B setup row.
CONFIGS = [
    (4, (4,)), (4, (2, 2)),
    (64, (64,)), (64, (8, 8)), (64, (4, 4, 4)),
    (512, (512,)), (512, (64, 8)), (512, (8, 8, 8)),
    (4096, (4096,)), (4096, (512, 8)), (4096, (16, 16, 16)), (4096, (8, 8, 8, 8)),
    (65536, (65536,)), (65536, (8192, 8)), (65536, (64, 32, 32)), (65536, (16, 16, 16, 16)),
]
RANK = 3


def _rss_kb() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def _api(impl: str):
    """The names both contenders share, from ours or torch's packages."""
    from types import SimpleNamespace
    if impl == "ours":
        import shardprop as P
        from shardprop.tensor.redistribute import plan_redistribute

        def plan(x, dst):
            return plan_redistribute(x._spec, tuple(dst))

        return SimpleNamespace(init_device_mesh=P.init_device_mesh, Shard=P.Shard, Replicate=P.Replicate,
                               from_local=P.DTensor.from_local, plan=plan, P=P,
                               parallelize_module=P.parallelize_module, fully_shard=P.fully_shard)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._redistribute import _gen_transform_infos
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.distributed.fsdp import fully_shard

    def plan(x, dst):
        spec = x._spec
        return _gen_transform_infos(spec, DTensorSpec(spec.mesh, tuple(dst), tensor_meta=spec.tensor_meta))

    return SimpleNamespace(init_device_mesh=init_device_mesh, Shard=Shard, Replicate=Replicate,
                           from_local=DTensor.from_local, plan=plan, P=None,
                           parallelize_module=parallelize_module, fully_shard=fully_shard)


def _per_call(fn, n: int) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t) / n)
    return best


def _styles(impl: str):
    from types import SimpleNamespace
    if impl == "ours":
        from shardprop.demo.model import shardprop_styles
        return shardprop_styles()
    import torch.distributed.tensor as T
    import torch.distributed.tensor.parallel as TP
    return SimpleNamespace(Shard=T.Shard, Replicate=T.Replicate, ColwiseParallel=TP.ColwiseParallel,
                           RowwiseParallel=TP.RowwiseParallel, SequenceParallel=TP.SequenceParallel,
                           PrepareModuleInput=TP.PrepareModuleInput)


def one(impl: str, world: int, shape, setup: bool) -> dict:
    """Measure one contender on one mesh, in this (fresh) process."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=RANK % world, world_size=world)
    A = _api(impl)
    # Warm the torch ops both builds use, so neither pays their first call.
    warm = torch.arange(world).reshape(shape)
    warm.flatten().diff().bincount(), (warm == 0).nonzero(), (warm * warm).sum(), warm.diff(dim=0).all()
    torch.unique(warm), warm.sort(), warm[(0,) * (len(shape) - 1)].tolist()
    out = {"impl": impl, "world": world, "shape": list(shape)}
    tracemalloc.start()
    rss0, heap0 = _rss_kb(), tracemalloc.get_traced_memory()[0]
    t = time.perf_counter()
    mesh = A.init_device_mesh("cpu", shape, mesh_dim_names=tuple(f"d{i}" for i in range(len(shape))))
    out["mesh_ms"] = (time.perf_counter() - t) * 1e3
    out["mesh_heap_kb"] = (tracemalloc.get_traced_memory()[0] - heap0) / 1024
    out["mesh_rss_kb"] = _rss_kb() - rss0
    tracemalloc.stop()

    n = len(shape)
    R, S = A.Replicate(), A.Shard
    pl = [R] * n
    pl[-1] = S(0)
    x = A.from_local(torch.randn(4, 16), mesh, pl, run_check=False)
    y = A.from_local(torch.randn(4, 16), mesh, pl, run_check=False)
    w = A.from_local(torch.randn(16, 16), mesh, [R] * n, run_check=False)
    xl, yl, wl = x.to_local(), y.to_local(), w.to_local()
    hit_add = _per_call(lambda: x + y, 300) - _per_call(lambda: xl + yl, 300)
    hit_mm = _per_call(lambda: x @ w, 300) - _per_call(lambda: xl @ wl, 300)
    out["hit_us"] = (hit_add + hit_mm) / 2 * 1e6

    misses = []
    for i in range(1, 21):  # a new shape is a new schema: a cache miss for both
        a = A.from_local(torch.randn(4, 16 + i), mesh, pl, run_check=False)
        b = A.from_local(torch.randn(4, 16 + i), mesh, pl, run_check=False)
        al, bl = a.to_local(), b.to_local()
        local = _per_call(lambda: al + bl, 20)
        t = time.perf_counter()
        a + b
        misses.append(time.perf_counter() - t - local)
    out["miss_us"] = statistics.median(misses) * 1e6

    src = [R] * n
    dst = [R] * n
    src[0], dst[0] = S(0), S(1)
    if n > 1:
        src[-1], dst[-1] = S(1), S(0)
    plans = []
    for i in range(1, 21):
        a = A.from_local(torch.randn(8, 8 + i), mesh, src, run_check=False)
        t = time.perf_counter()
        A.plan(a, dst)
        plans.append(time.perf_counter() - t)
    out["plan_us"] = statistics.median(plans) * 1e6

    if setup and n == 2:
        out["setup_s"] = _setup(impl, A, mesh)
    return out


def _setup(impl: str, A, mesh) -> float:
    """parallelize_module + fully_shard of a 70B Llama 3 on the meta device; seconds (or -1: failed)."""
    import torch
    from shardprop.demo.model import Llama, LlamaConfig, tp_plan
    cfg = LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256, seq_len=256, ffn_dim=28672)
    with torch.device("meta"):
        model = Llama(cfg)
    dp, tp = mesh["d0"], mesh["d1"]
    t = time.perf_counter()
    try:
        A.parallelize_module(model, tp, tp_plan(_styles(impl)))
        for block in model.layers:
            A.fully_shard(block, mesh=dp)
        A.fully_shard(model, mesh=dp)
    except Exception as e:  # reported, not hidden: the table shows "failed" and the reason goes to stderr
        print(f"{impl} setup failed: {type(e).__name__}: {e}", file=sys.stderr)
        return -1.0
    return time.perf_counter() - t


def run_row(impl: str, world: int, shape, setup: bool, timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--one", impl, str(world), "x".join(map(str, shape))]
    if setup:
        cmd.append("--setup")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"impl": impl, "world": world, "shape": list(shape), "error": f"timeout {timeout:.0f} s"}
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode != 0 or not lines:
        tail = (p.stderr.strip().splitlines() or ["?"])[-1]
        return {"impl": impl, "world": world, "shape": list(shape), "error": tail[:120]}
    if p.stderr.strip():
        sys.stderr.write(p.stderr)
    return json.loads(lines[-1])


def _fmt(v, spec):
    if v is None:
        return "-"
    if isinstance(v, float) and v < 0:
        return "failed"
    return format(v, spec)


def table(rows) -> str:
    from tabulate import tabulate
    by = {}
    for r in rows:
        by.setdefault((r["world"], tuple(r["shape"])), {})[r["impl"]] = r
    out = []
    cols = [("mesh_ms", ".1f"), ("mesh_kb", ".0f"), ("hit_us", ".1f"), ("miss_us", ".0f"), ("plan_us", ".0f"),
            ("setup_s", ".2f")]
    for (world, shape), pair in by.items():
        line = [world, "x".join(map(str, shape))]
        for key, spec in cols:
            for impl in ("ours", "torch"):
                r = pair.get(impl, {})
                if "error" in r:
                    line.append("err")
                    continue
                v = (r["mesh_heap_kb"] + max(r["mesh_rss_kb"], 0)) if key == "mesh_kb" and "mesh_heap_kb" in r \
                    else r.get(key)
                line.append(_fmt(v, spec))
        out.append(line)
    headers = ["world", "mesh"] + [f"{k} {i}" for k, _ in cols for i in ("ours", "torch")]
    return tabulate(out, headers=headers)


def plot(rows, path: str) -> None:
    """world size vs each figure, ours and torch, on the largest mesh of each dimensionality."""
    series = {}
    for key in ("mesh_ms", "hit_us", "miss_us", "plan_us"):
        for r in rows:
            if "error" in r or r.get(key) is None:
                continue
            label = f"{key} {r['impl']} {len(r['shape'])}-d"
            series.setdefault(key, {}).setdefault(label, []).append((r["world"], max(r[key], 1e-3)))
    import matplotlib  # ImportError: main() says how to install it
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(series), figsize=(5 * len(series), 4))
    for ax, (key, lines) in zip(axes, series.items()):
        for label, pts in sorted(lines.items()):
            pts.sort()
            style = "-" if " ours " in label else "--"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=label.split(" ", 1)[1])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("world size (ranks)")
        ax.set_title(key)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--one", nargs=3, metavar=("IMPL", "WORLD", "SHAPE"), help=argparse.SUPPRESS)
    p.add_argument("--setup", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="worlds up to 4096, no 70B setup")
    p.add_argument("--no-setup", action="store_true", help="skip the 70B fully_shard + parallelize_module rows")
    p.add_argument("--json", default=None, help="write the raw figures here")
    p.add_argument("--png", default=os.path.join(HERE, "scale.png"))
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per row before it counts as failed")
    args = p.parse_args(argv)
    if args.one:
        impl, world, shape = args.one
        print(json.dumps(one(impl, int(world), tuple(int(s) for s in shape.split("x")), args.setup)))
        return
    setup = not (args.quick or args.no_setup)
    rows = []
    for world, shape in CONFIGS:
        if args.quick and world > 4096:
            continue
        for impl in ("ours", "torch"):
            r = run_row(impl, world, shape, setup and len(shape) == 2, args.timeout)
            rows.append(r)
            print(f"# {impl:5s} {world:6d} {'x'.join(map(str, shape)):12s} "
                  + (r["error"] if "error" in r else " ".join(f"{k}={v:.4g}" for k, v in r.items()
                                                             if isinstance(v, float))), flush=True)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    try:
        plot(rows, args.png)
        print(f"plot: {args.png}")
    except ImportError:
        print("plot: matplotlib is not installed (.venv/bin/pip install matplotlib); no PNG written")


if __name__ == "__main__":
    main()
