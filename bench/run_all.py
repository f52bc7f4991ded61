"""Run every benchmark, print each one's table, and write them all to bench/results.json.

Each benchmark runs as its own process (its ranks must not share a process group
with another benchmark's) with ``--json`` pointing at a temporary file; the
results are gathered under the benchmark's name, with the date, the machine and
the torch version, so the figures of the docs (docs/benchmarks.md) can say where they came from.

Usage::

    python bench/run_all.py [--only tp,dispatch] [--out bench/results.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# name -> script and its options; each takes --json PATH (see its docstring for its other options).
BENCHMARKS = {
    "redistribute": "redistribute.py",
    "dispatch": "dispatch.py",
    "tp": "tp.py",
    "tp_floor": "tp.py --floor",
    "dispatch_census": "dispatch_census.py",
    "checkpoint": "checkpoint.py",
    "fsdp": "fsdp.py",
    "recipes": "recipes.py",
    "moe": "moe.py",
    "workflows": "workflows.py",
}


def machine() -> dict:
    """Where the figures come from: CPU model, core count, OS, Python and torch versions."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import torch
    return dict(cpu=cpu, cores=os.cpu_count(), os=platform.platform(), python=platform.python_version(),
                torch=torch.__version__)


def run_one(name: str, script: str) -> dict:
    """Run one benchmark (its output goes straight to ours); its JSON, or the failure."""
    with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as d:
        out = os.path.join(d, "out.json")
        print(f"\n{'=' * 30} {name} ({script}) {'=' * 30}", flush=True)
        t0 = time.perf_counter()
        script, *opts = script.split()
        rc = subprocess.call([sys.executable, os.path.join(HERE, script), *opts, "--json", out])
        took = time.perf_counter() - t0
        if rc != 0 or not os.path.exists(out):
            print(f"{name}: FAILED (exit status {rc})", flush=True)
            return dict(ok=False, returncode=rc, seconds=took)
        with open(out) as f:
            return dict(ok=True, seconds=took, results=json.load(f))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help=f"comma-separated subset of {','.join(BENCHMARKS)}")
    ap.add_argument("--out", default=os.path.join(HERE, "results.json"), help="JSON file (default bench/results.json)")
    args = ap.parse_args(argv)
    names = args.only.split(",") if args.only else list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        ap.error(f"unknown benchmark(s) {unknown}; choose from {list(BENCHMARKS)}")
    report = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), machine=machine(), benchmarks={})
    for name in names:
        report["benchmarks"][name] = run_one(name, BENCHMARKS[name])
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    failed = [n for n, r in report["benchmarks"].items() if not r["ok"]]
    print(f"\nwrote {args.out}" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
