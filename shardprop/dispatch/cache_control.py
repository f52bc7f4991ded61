"""Controls over the propagation cache: clear it, resize it, switch the replicate fallback.

They live apart from ``propagate`` because clearing must zero the dispatcher's call counters
with the cache (the answers live in each op's entry, ``answers.cache``): data flows
dispatcher -> propagate, so only a module above both may touch both.
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
    _config.set("cache_size", n)  # the cache's watcher resizes (and empties) it, _resized zeroes the counters


def _resized(n) -> None:
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
