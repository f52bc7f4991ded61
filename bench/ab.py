"""A/B: this checkout's shardprop against another commit's, side by side in one run.

    python bench/ab.py --base a56e0ff [--this REV] [--rounds 10] [--sets 4] [--jobs dispatch,tp4,dp2xtp2] [--json out.json]

On a shared two-core machine the speed of the whole machine drifts by tens of percent between
runs, so two benchmarks run one after the other compare the weather, not the code. Here both
versions run at once, each in its own processes, and take turns: the coordinator asks one side for
a round, waits for its answer, then asks the other (the order flips every round). The side not
running waits in a blocking read, so it takes no CPU from the one that runs. Every round of
both sides therefore sees the same machine, and the ratios are medians over rounds.

The other commit is exported with ``git archive`` into a temporary folder (the repository is not
touched) and both sides import ``shardprop`` from a folder laid out as an install would be (the
``package-dir`` table of each tree's ``pyproject.toml``), so neither uses the editable install.
The harness, the model options and the measurements are this checkout's for both sides; each
side runs its own demo model (``shardprop.demo.model``) and uses public names only.

Jobs:

* ``dispatch``: cache-hit overhead per op (time on a one-rank DTensor minus time on the local
  tensor), the cases of ``bench/dispatch.py``; the table shows each op and the geometric mean.
* ``tp4`` / ``dp2xtp2``: one training step of the demo Llama (forward, backward, dp gradient
  averaging with ``replicate_gradients``, AdamW) on 4 CPU ranks, 1-d tp=4 and 2x2 ("dp", "tp")
  meshes, the plan ``shardprop.demo.model.tp_plan()``; each round times ``--steps`` steps
  (a barrier before each, max over ranks).

Targets: none; it reports this/base per job (below 1.0: this checkout is faster).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# job -> mesh; the TP step jobs are bench/tp.py's MESHES. tp.py is imported only in the ranks, after
# shardprop: importing it puts this checkout's root first on sys.path.
MESHES = {"dispatch": (1,), "tp4": (4,), "dp2xtp2": (2, 2)}


# ---------------------------------------------------------------- the two trees

def export(rev: str, into: str) -> str:
    """Write commit ``rev`` of this repository into ``into`` (``git archive``); return ``into``."""
    os.makedirs(into)
    archive = subprocess.run(["git", "-C", HERE, "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    return into


def overlay(tree: str, into: str) -> str:
    """A folder importing ``shardprop`` from ``tree`` as installed: its ``package-dir`` mapped by symlinks."""
    import tomllib
    with open(os.path.join(tree, "pyproject.toml"), "rb") as f:
        dirs = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    top = os.path.join(into, "shardprop")
    os.makedirs(top)
    for entry in os.listdir(os.path.join(tree, dirs["shardprop"])):
        os.symlink(os.path.join(tree, dirs["shardprop"], entry), os.path.join(top, entry))
    for package, folder in dirs.items():
        if package != "shardprop":  # "shardprop.ops" = "ops": a subpackage kept elsewhere in the tree
            os.symlink(os.path.join(tree, folder), os.path.join(top, package.split(".", 1)[1]))
    return into


# ---------------------------------------------------------------- one side (runs in the ranks)

def _dispatch_job():
    import dispatch as D
    D.DEVICE = "cpu"
    engine = D._Engine("shardprop")
    cases = []
    for name, (make, fn) in D._cases().items():
        local = make(lambda t, shard=None, rg=False: t.clone().requires_grad_(rg))
        dt = make(lambda t, shard=None, rg=False: engine.dist(t.clone(), shard, rg))
        fn(*dt)
        cases.append((name, fn, local, dt))

    def one_round():
        return {name: [(D._timeit(fn, dt, 500) - D._timeit(fn, local, 500)) * 1e6] for name, fn, local, dt in cases}
    return one_round


def _tp_job(shape, steps):
    import tp
    opts = dict(dim=64, layers=2, heads=4, vocab=256, seq=32, batch=8, seed=0)  # bench/tp.py's defaults
    ours = tp._Contender("ours", tp._cfg(opts), shape, opts)
    for i in range(3):  # warm the caches
        ours.step(i)
    state = {"i": 3}

    def one_round():
        out = [tp.timed_step(ours, state["i"] + k) for k in range(steps)]
        state["i"] += steps
        return {"step_ms": out}
    return one_round


def _side(rank, world, job, steps, port, pkg):
    """A rank of one side: build the job, then run a round whenever the coordinator asks rank 0."""
    import torch
    import torch.distributed as dist

    import shardprop
    if not os.path.abspath(shardprop.__file__).startswith(os.path.abspath(pkg) + os.sep):
        raise RuntimeError(f"imported shardprop from {shardprop.__file__}, not from {pkg}")
    one_round = _dispatch_job() if job == "dispatch" else _tp_job(MESHES[job], steps)
    conn = socket.create_connection(("127.0.0.1", port)) if rank == 0 else None
    lines = conn.makefile("rw") if conn else None
    go = torch.zeros(1, dtype=torch.int64)
    while True:
        if rank == 0:
            go.fill_(1 if lines.readline().strip() == "round" else 0)
        if world > 1:
            dist.broadcast(go, 0)  # the idle ranks wait here, in gloo (blocking, no spinning)
        if not go.item():
            break
        result = one_round()
        if rank == 0:
            lines.write(json.dumps(result) + "\n")
            lines.flush()
    if conn:
        conn.close()


def worker(job: str, steps: int, port: int, pkg: str) -> None:
    from _launch import launch
    launch(_side, math.prod(MESHES[job]), job, steps, port, pkg, timeout_s=3600)


# ---------------------------------------------------------------- the coordinator

class _Side:
    def __init__(self, name, pkg, job, steps, listener):
        self.name = name
        env = dict(os.environ, PYTHONPATH=pkg)
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", job, "--steps", str(steps),
                                      "--port", str(listener.getsockname()[1]), "--pkg", pkg], env=env, cwd=pkg)
        listener.settimeout(600)
        conn, _ = listener.accept()
        self.lines = conn.makefile("rw")

    def round(self):
        self.lines.write("round\n")
        self.lines.flush()
        line = self.lines.readline()
        if not line:
            raise RuntimeError(f"the {self.name} side of the A/B exited (see its output above)")
        return json.loads(line)

    def stop(self):
        self.lines.write("stop\n")
        self.lines.flush()
        self.proc.wait(timeout=120)


def ab(job, pkgs, rounds, steps, flip=False):
    """Run ``job`` on both sides in turns; return {side: {metric: [samples]}}.

    ``flip`` builds and first runs the sides in the other order (sets alternate, so neither side is
    always the one started first).
    """
    samples = {side: {} for side in pkgs}
    sides = {}
    try:
        names = list(pkgs)[::-1] if flip else list(pkgs)
        for side in names:  # built one after the other: set-up does not overlap either
            pkg = pkgs[side]
            with socket.create_server(("127.0.0.1", 0)) as listener:
                sides[side] = _Side(side, pkg, job, steps, listener)
        for r in range(rounds):
            for side in (names if r % 2 == 0 else names[::-1]):
                for metric, v in sides[side].round().items():
                    samples[side].setdefault(metric, []).extend(v)
    finally:
        for s in sides.values():
            try:
                s.stop()
            except Exception:
                s.proc.kill()
    return samples


def _ratio(samples, metric):
    a, b = statistics.median(samples["base"][metric]), statistics.median(samples["this"][metric])
    return a, b, b / a


def _geomean(xs):
    # A dispatch overhead is a difference of two timings: on a loaded machine one can come out <= 0, and
    # its ratio means nothing. The mean is over the meaningful ratios (nan when none is).
    xs = [x for x in xs if x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def report(results, base_rev, this_rev):
    """Per job and metric: medians over every set's rounds, this/base, and the spread of the per-set ratios."""
    from tabulate import tabulate
    rows = []
    for job, sets in results.items():
        pooled = {side: {} for side in ("base", "this")}
        for one in sets:
            for side, metrics in one.items():
                for metric, v in metrics.items():
                    pooled[side].setdefault(metric, []).extend(v)
        overall = []
        for metric in pooled["this"]:
            a, b, ratio = _ratio(pooled, metric)
            per_set = [_ratio(one, metric)[2] for one in sets]
            overall.append(ratio)
            unit = "ms" if metric.endswith("_ms") else "us"
            rows.append([job, metric, f"{a:.2f} {unit}", f"{b:.2f} {unit}", ratio,
                         f"{min(per_set):.3f}..{max(per_set):.3f}"])
        if len(overall) > 1:
            rows.append([job, "geomean", "", "", _geomean(overall), ""])
    print(f"\nA/B, side by side in one run: base = {base_rev}, this = {this_rev}; medians over rounds, "
          f"pooled over {len(next(iter(results.values())))} sets of fresh processes\n")
    print(tabulate(rows, headers=["job", "metric", "base", "this", "this/base", "per set"], floatfmt=".3f"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", help="the commit to compare against (any git revision)")
    ap.add_argument("--this", help="a commit to measure instead of the working tree")
    ap.add_argument("--rounds", type=int, default=10, help="rounds per set of processes")
    ap.add_argument("--sets", type=int, default=4, help="fresh sets of processes per job")
    ap.add_argument("--steps", type=int, default=3, help="timed training steps per round (tp jobs)")
    ap.add_argument("--jobs", default="dispatch,tp4,dp2xtp2")
    ap.add_argument("--json")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--pkg", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker, args.steps, args.port, args.pkg)
        return
    if not args.base:
        ap.error("--base REV is required")
    jobs = args.jobs.split(",")
    unknown = [j for j in jobs if j not in MESHES]
    if unknown:
        ap.error(f"unknown jobs {unknown}; known: {sorted(MESHES)}")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="shardprop-ab-") as d:
        base_tree = export(args.base, os.path.join(d, "base-tree"))
        this_tree = export(args.this, os.path.join(d, "this-tree")) if args.this else HERE
        pkgs = {"base": overlay(base_tree, os.path.join(d, "base")), "this": overlay(this_tree, os.path.join(d, "this"))}
        # A set of processes keeps a speed of its own for its life (where its memory and code landed),
        # some percent either way: several fresh sets per job average that out.
        results = {job: [ab(job, pkgs, args.rounds, args.steps, flip=i % 2 == 1) for i in range(args.sets)] for job in jobs}
    report(results, args.base, args.this or "the working tree")
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(base=args.base, this=args.this, rounds=args.rounds, sets=args.sets, steps=args.steps, samples=results), f, indent=1)


if __name__ == "__main__":
    main()
