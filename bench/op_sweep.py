"""Sweep every float32 op of torch's op_db through the OpInfo harness.

For each mesh variant (1d, 2d, uneven, backward, inference; see tests/opinfo_harness.py) every op
is checked on a pool of 4 gloo ranks and gets one outcome: pass, wrong, error or skip.
An op that hangs or kills a rank is recorded as an error and the rest run in a fresh pool.

Usage::

    python bench/op_sweep.py                                  # every op, every variant
    python bench/op_sweep.py --variants 1d --json sweep.json  # per-op outcomes as JSON
    python bench/op_sweep.py --ops add,mm,view --variants 1d,2d
    python bench/op_sweep.py --engine reference               # torch.distributed.tensor
    python bench/op_sweep.py --engine both                    # both, side by side (make sweep)
    python bench/op_sweep.py --write-passing                  # update tests/passing_ops.json

Exits with 1 when any op gives a wrong result.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from tests.opinfo_harness import ENGINES, OUTCOMES, VARIANTS, list_op_keys, run_checks  # noqa: E402
from tests.rankpool import RankPool  # noqa: E402

PASSING_PATH = os.path.join(REPO, "tests", "passing_ops.json")
_MISSING_RULE = re.compile(r"(aten\.[\w.]+) has no sharding rule")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=sorted(ENGINES) + ["both"], default="shardprop",
                   help="the engine under test; 'both' runs shardprop, then the reference, and tabulates them")
    p.add_argument("--ops", default="", help="comma-separated op_db keys (default: every float32 op)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {list(VARIANTS)}")
    p.add_argument("--json", metavar="PATH", help="write per-op outcomes here")
    p.add_argument("--write-passing", action="store_true", help=f"update {os.path.relpath(PASSING_PATH, REPO)}")
    p.add_argument("--max-samples", type=int, default=4)
    p.add_argument("--max-combos", type=int, default=8)
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per op before it counts as a hang")
    p.add_argument("--chunk", type=int, default=25, help="ops per pool run")
    p.add_argument("--top", type=int, default=25, help="failing ops listed per variant and outcome")
    args = p.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad:
        p.error(f"unknown variants {bad}; choose from {list(VARIANTS)}")
    if args.write_passing and args.engine == "reference":
        p.error("--write-passing records shardprop's passing ops; drop it for --engine reference")
    return args


def _progress(total: int, variant: str, t0: float):
    done = collections.Counter()

    def report(res):
        done[res["outcome"]] += 1
        n = sum(done.values())
        if res["outcome"] == "wrong":
            print(f"  WRONG {res['op']} [{variant}]: {res['detail']} ({res['combo']})", file=sys.stderr, flush=True)
        if n % 25 == 0 or n == total:
            counts = " ".join(f"{k}={done[k]}" for k in OUTCOMES)
            print(f"  [{variant}] {n}/{total} {counts} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr,
                  flush=True)

    return report


def summarize(variant: str, results: dict, seconds: float, top: int) -> str:
    """Counts per outcome, the wrong and erroring ops, and the missing rules that block most ops."""
    counts = collections.Counter(r["outcome"] for r in results.values())
    # A pass whose samples had no dim to shard only shows the op runs replicated.
    replicated = sum(r["outcome"] == "pass" and r["sharded_combos"] == 0 for r in results.values())
    lines = [f"== {variant}: {len(results)} ops in {seconds:.0f} s: "
             + ", ".join(f"{k} {counts[k]}" for k in OUTCOMES)
             + f" ({replicated} of the passes checked replicated inputs only)"]
    for outcome in ("wrong", "error"):
        bad = sorted((r for r in results.values() if r["outcome"] == outcome), key=lambda r: r["op"])
        if not bad:
            continue
        lines.append(f"-- {outcome} ({len(bad)}):")
        for r in bad[:top]:
            lines.append(f"   {r['op']}: {r['detail'][:160]}" + (f"  @ {r['combo']}" if r["combo"] else ""))
        if len(bad) > top:
            lines.append(f"   ... and {len(bad) - top} more (see --json)")
    causes = collections.Counter(error_cause(r["detail"]) for r in results.values() if r["outcome"] == "error")
    if causes:
        lines.append("-- most common errors (ops blocked):")
        lines += [f"   {n:4d}  {cause}" for cause, n in causes.most_common(15)]
    return "\n".join(lines)


def error_cause(detail: str) -> str:
    """A short signature for grouping errors: the missing rule, or the message without numbers.

    Example:
        >>> error_cause("ShardingError: aten.cat.default has no sharding rule (inputs: [R] (3,))")
        'no rule for aten.cat.default'
    """
    m = _MISSING_RULE.search(detail)
    if m:
        return f"no rule for {m.group(1)}"
    detail = re.sub(r"^\[[^\]]*\] ", "", detail)  # "[div.trunc_rounding] " prefix
    return re.sub(r"\d+", "N", detail)[:110]


def write_passing(all_results: dict, path: str = PASSING_PATH) -> None:
    """Update ``{variant: [passing ops]}``: ops checked in this run are re-decided, others kept."""
    data = {}
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    for variant, results in all_results.items():
        keep = {op for op in data.get(variant, []) if op not in results}
        data[variant] = sorted(keep | {op for op, r in results.items() if r["outcome"] == "pass"})
    with open(path, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")


def _write_json(path, engine, config, seconds, all_results) -> None:
    with open(path, "w") as f:
        json.dump(dict(engine=engine, config=config, seconds=seconds, results=all_results), f, indent=1)


def table(by_engine: dict) -> str:
    """pass / wrong / error (skip) per variant, one column per engine, as a Markdown table.

    Example:
        >>> print(table({"shardprop": {"1d": {"add": {"outcome": "pass"}}}}))
        | variant | shardprop: pass / wrong / error (skip) |
        | --- | --- |
        | 1d | 1 / 0 / 0 (0) |
    """
    engines = list(by_engine)
    variants = [v for v in VARIANTS if any(v in by_engine[e] for e in engines)]
    lines = ["| variant | " + " | ".join(f"{e}: pass / wrong / error (skip)" for e in engines) + " |",
             "| --- |" + " --- |" * len(engines)]
    for v in variants:
        cells = []
        for e in engines:
            c = collections.Counter(r["outcome"] for r in by_engine[e].get(v, {}).values())
            cells.append(f"{c['pass']} / {c['wrong']} / {c['error']} ({c['skip']})" if c else "-")
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    engines = ["shardprop", "reference"] if args.engine == "both" else [args.engine]
    pool = RankPool(4, timeout=120.0, collective_timeout=15.0)
    by_engine, seconds = {}, {}
    try:
        ops = [o for o in args.ops.split(",") if o] or pool.run(list_op_keys, timeout=300)[0]
        print(f"{len(ops)} ops, variants {args.variants}, engines {engines} "
              f"(pool up in {time.perf_counter() - t_start:.0f} s)", flush=True)
        kw = dict(max_samples=args.max_samples, max_combos=args.max_combos)
        for engine in engines:
            all_results = by_engine[engine] = {}
            secs = seconds[engine] = {}
            for variant in args.variants:
                t0 = time.perf_counter()
                all_results[variant] = run_checks(pool, ops, variant, engine, chunk=args.chunk,
                                                  timeout_per_op=args.timeout,
                                                  progress=_progress(len(ops), variant, t0), **kw)
                secs[variant] = time.perf_counter() - t0
                print(f"[{engine}] " + summarize(variant, all_results[variant], secs[variant], args.top), flush=True)
                if args.json:  # after each variant: a long sweep that dies later keeps what it has
                    _write_json(args.json, args.engine, kw, seconds if args.engine == "both" else secs,
                                by_engine if args.engine == "both" else all_results)
    finally:
        pool.shutdown()
    import torch
    print(f"\noutcomes per variant ({len(ops)} op_db entries, torch {torch.__version__}):")
    print(table(by_engine))
    print(f"total {time.perf_counter() - t_start:.0f} s")
    if args.json:
        print(f"wrote {args.json}")
    if args.write_passing:
        write_passing(by_engine["shardprop"])
        print(f"updated {os.path.relpath(PASSING_PATH, REPO)}")
    # A wrong result of shardprop is a silent correctness bug: fail the run (errors are only missing
    # coverage; the reference's results are reported, not judged).
    mine = by_engine.get("shardprop", by_engine.get(args.engine, {}))
    return 1 if any(r["outcome"] == "wrong" for res in mine.values() for r in res.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
