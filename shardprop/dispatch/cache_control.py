"""Controls over the propagation cache: clear it, resize it, switch the replicate fallback.

They live apart from ``propagate`` because resizing must rebind the dispatcher's reference
to the cached function (the hot path calls it without an attribute lookup), and clearing
must zero the dispatcher's call counters with the cache: data flows dispatcher -> propagate,
so only a module above both may touch both.
"""
from __future__ import annotations

from shardprop.dispatch import dispatcher, propagate, registry
from shardprop.mesh import config as _config


def clear_cache() -> None:
    """Empty the propagation cache (and its statistics).

    Example:
        >>> shardprop.clear_cache()
    """
    propagate.cache_clear()
    dispatcher.clear_memos()
    reset_counts()


def reset_counts() -> None:
    """Zero the per-op call and miss counters that ``cache_stats()`` reports."""
    dispatcher.reset_counts()
    propagate.reset_miss_counts()


def set_cache_size(n: int) -> None:
    """Resize the propagation cache (clears it).

    Example:
        >>> shardprop.set_cache_size(1 << 20)
    """
    _config.set("cache_size", n)  # propagate's watcher resizes the cache, _resized clears the memos


def _resized(n) -> None:
    dispatcher.clear_memos()
    reset_counts()


def set_fallback_to_replicate(enabled: bool) -> None:
    """Run ops that have no rule on replicated inputs (with a warning) instead of raising.

    Example:
        >>> shardprop.set_fallback_to_replicate(True)
    """
    propagate.set_fallback(enabled)
    clear_cache()


registry.add_listener(clear_cache)  # a new or removed rule invalidates cached strategies
_config.watch("cache_size", _resized)
