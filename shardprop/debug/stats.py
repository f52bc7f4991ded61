"""Cache statistics: per-op calls, misses and time spent propagating.

The hot path adds one counter increment per call (``dispatcher.call_counts``); misses are
counted where they are computed (``propagate.miss_counts``), so hits are calls minus misses.
This module only reads those counters: the engine never imports it.
"""
from __future__ import annotations

import atexit
from typing import List

from shardprop.dispatch import dispatcher, propagate
from shardprop.mesh.config import values as _settings


def cache_stats() -> List[dict]:
    """Per-op cache statistics, most-called first.

    Each row: op, calls, hits, misses, hit_rate, live_entries, prop_ms (time spent propagating).

    Example:
        >>> x = distribute_tensor(torch.ones(8), init_device_mesh("cpu", (4,)), [Shard(0)])
        >>> for _ in range(3):
        ...     y = x * 2
        >>> row = next(r for r in shardprop.cache_stats() if r["op"] == "aten.mul.Tensor")
        >>> row["hits"] > 0, sorted(row)
        (True, ['calls', 'hit_rate', 'hits', 'live_entries', 'misses', 'op', 'prop_ms'])
    """
    calls = dispatcher.call_counts()
    live = propagate.cache_info().currsize
    missed = propagate.miss_counts()
    inserted = sum(i for _, i, _ in missed.values())
    # Exact unless the cache evicted entries; then each op's share of the live ones.
    scale = 1.0 if inserted <= live else live / inserted
    rows = []
    for op in set(calls) | set(missed):
        m, ins, seconds = missed.get(op, (0, 0, 0.0))
        c = max(calls.get(op, 0), m)
        rows.append({
            "op": str(op), "calls": c, "hits": c - m, "misses": m,
            "hit_rate": (c - m) / c if c else 0.0,
            "live_entries": round(ins * scale),
            "prop_ms": seconds * 1e3,
        })
    rows.sort(key=lambda r: (-r["calls"], r["op"]))
    return rows


def format_cache_stats() -> str:
    """The statistics as a table, with a totals row."""
    from tabulate import tabulate
    rows = cache_stats()
    table = [[r["op"], r["calls"], r["hits"], r["misses"], f"{100 * r['hit_rate']:.1f}%", r["live_entries"],
              f"{r['prop_ms']:.2f}"] for r in rows]
    c = sum(r["calls"] for r in rows)
    m = sum(r["misses"] for r in rows)
    table.append(["TOTAL", c, c - m, m, f"{100 * (c - m) / c:.1f}%" if c else "-",
                  sum(r["live_entries"] for r in rows), f"{sum(r['prop_ms'] for r in rows):.2f}"])
    return tabulate(table, headers=["op", "calls", "hits", "misses", "hit rate", "live", "prop ms"])


def print_cache_stats() -> None:
    """Print the per-op cache statistics table.

    Example:
        >>> x = distribute_tensor(torch.ones(8), init_device_mesh("cpu", (4,)), [Shard(0)])
        >>> y = x * 2
        >>> shardprop.print_cache_stats()   # rank 0 prints
        op...calls...hits...misses...hit rate...live...prop ms
        ...
        TOTAL...
    """
    print(format_cache_stats())


def _print_at_exit() -> None:
    try:
        import torch.distributed as dist
        if dist.is_initialized() and dist.get_rank() != 0:
            return
    except Exception:
        pass
    if propagate.miss_counts():
        print_cache_stats()


if _settings.cache_stats:
    atexit.register(_print_at_exit)
