"""The propagation cache: each op's answers in its entry's memo (``OpEntry.memo``), the one place they are kept.

Lives apart from ``propagate`` (which fills it on a miss) so that the dispatcher's hot path and
``propagate`` share one object, and so that its bookkeeping is in one place.

Example:
    >>> from shardprop.dispatch.answers import cache
    >>> cache.limit == shardprop.config.values.cache_size  # doctest: +SKIP
    True
"""
from __future__ import annotations

from typing import NamedTuple, Optional

from shardprop.dispatch import registry
from shardprop.dispatch.op_schema import OutputSharding
from shardprop.mesh import config as _config
from shardprop.mesh.config import values as _settings


class CacheInfo(NamedTuple):
    """The propagation cache's statistics, as ``functools``' (hits: dispatcher calls answered from it)."""

    hits: int
    misses: int
    maxsize: Optional[int]
    currsize: int


class _Cache:
    """The propagation cache, the one place answers are kept: each op's answers live in its entry's
    ``memo`` ((arg keys, kwarg keys) -> OutputSharding), ``limit`` in all (None: unbounded, 0: none).

    Per-op memos let a hit cost one dict lookup on an object the dispatcher already holds, with no
    OpSchema built and no hash of the op. A full cache starts over (LRU bookkeeping would cost every
    hit). ``size`` counts the answers remembered since the last clear (a memo emptied alone, when its
    op's special handler changes, is recounted when the bound is reached).
    """

    __slots__ = ("limit", "size")

    def resize(self, n) -> None:
        self.limit = n
        self.clear()

    def clear(self) -> None:
        registry.clear_memos()
        self.size = 0

    def remember(self, memo: dict, key, out: OutputSharding) -> None:
        """Keep ``out`` as the answer for ``key`` in ``memo`` (an entry's), within the bound."""
        limit = self.limit
        if limit == 0:
            return
        if limit is not None and self.size >= limit:
            self.size = sum(len(e.memo) for e in registry.entries.values())
            if self.size >= limit:
                self.clear()
        memo[key] = out
        self.size += 1


cache = _Cache()
cache.resize(_settings.cache_size)
_config.watch("cache_size", cache.resize)


def runs_outside(out: OutputSharding) -> bool:
    """Whether this rank is outside the mesh of the op ``out`` answers (the dispatcher keeps its no-op form)."""
    specs = out.in_specs
    return bool(specs) and specs[0].mesh._coord is None
