"""shardprop's settings, declared once: name, environment variable, type, default, doc.

Every ``SHARDPROP_*`` variable is read here, once, at import; every switch shardprop has (the
public setters such as ``set_fast_paths`` or ``set_collective_timeout`` are thin wrappers) reads
and writes the one :data:`values` object. A hot path reads a setting as one attribute load
(``values.fast_paths``), the same cost as the module global each room kept before.

A setting whose change must reach state derived from it (the propagation cache's size, the
installed decompositions, the buffer pool) has watchers: its owning module registers them with
:func:`watch`, and :func:`set` calls them after each change.

This module sits on the ground floor (``shardprop.mesh``) so that every room may import it;
``shardprop.config`` re-exports it.

Example:
    >>> from shardprop import config
    >>> with config.patch(fast_paths=False):
    ...     config.values.fast_paths
    False
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")


class Setting:
    """One setting: its name, environment variable (or None), type, default and what it does.

    ``kind`` is ``bool``, ``int``, ``float``, ``str`` or a tuple of the allowed strings.

    Example:
        >>> s = BY_NAME["fast_paths"]
        >>> s.env, s.kind, s.default
        ('SHARDPROP_FAST_PATHS', <class 'bool'>, True)
        >>> s.from_env({"SHARDPROP_FAST_PATHS": "off"})
        False
    """

    __slots__ = ("name", "env", "kind", "default", "doc")

    def __init__(self, name: str, env: Optional[str], kind, default, doc: str):
        self.name, self.env, self.kind, self.default, self.doc = name, env, kind, default, doc

    def coerce(self, value):
        """``value`` as this setting's type (a setter's argument, or text from the environment)."""
        kind = self.kind
        if isinstance(kind, tuple):
            if value not in kind:
                raise ValueError(f"shardprop setting {self.name}: {value!r}; want one of {kind}")
            return value
        if kind is bool and isinstance(value, str):
            text = value.strip().lower()
            if text in _TRUE:
                return True
            if text in _FALSE:
                return False
            raise ValueError(f"shardprop setting {self.name}: {value!r} is not a switch; "
                             f"want one of {_TRUE + _FALSE}")
        if value is None and (kind is int or self.default is None):
            return None  # an unbounded size (cache_size), or "decided by the backend" (the fsdp_* switches)
        return kind(value)

    def from_env(self, environ=os.environ):
        """The value the environment gives (the default where the variable is unset or empty)."""
        text = environ.get(self.env, "") if self.env else ""
        if text.strip() == "":
            return self.default
        try:
            return self.coerce(text)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{self.env}={text!r}: {e}") from None


SETTINGS: Tuple[Setting, ...] = (
    Setting("fast_paths", "SHARDPROP_FAST_PATHS", bool, True,
            "Eager fast paths for the common module patterns (TP linear/norm, FSDP, DDP); off runs every op "
            "through the engine."),
    Setting("cache_size", "SHARDPROP_CACHE_SIZE", int, 65536,
            "Entries of the sharding-propagation cache (0: no cache)."),
    Setting("cache_stats", "SHARDPROP_CACHE_STATS", bool, False,
            "Print the propagation cache table at exit (rank 0)."),
    Setting("fallback_to_replicate", "SHARDPROP_FALLBACK_REPLICATE", bool, False,
            "Run ops without a sharding rule on replicated inputs (with a warning) instead of raising."),
    Setting("decompose", "SHARDPROP_DECOMPOSE", bool, False,
            "Run every op without a rule as torch's decomposition of it, where torch has one."),
    Setting("collective_timeout", "SHARDPROP_COLLECTIVE_TIMEOUT", float, 300.0,
            "Seconds before a collective a peer never joins fails (process groups created from then on, "
            "and explicit waits)."),
    Setting("direct_collectives", "SHARDPROP_DIRECT_COLLECTIVES", bool, True,
            "Small CPU collectives as point-to-point messages; off uses the backend's collectives."),
    Setting("shm_transport", "SHARDPROP_SHM_TRANSPORT", bool, True,
            "Same-host point-to-point messages through shared-memory rings (x86 only); off keeps gloo's."),
    Setting("host_id", "SHARDPROP_HOST_ID", str, "",
            "This rank's host identity for the shared-memory transport (default: hostname and boot id); "
            "ranks with different ids talk over the backend, as on separate hosts."),
    Setting("shm_ring_mb", "SHARDPROP_SHM_RING_MB", float, 4.0,
            "Ring size per same-host peer, in MB (messages up to half of it go in one piece)."),
    Setting("shm_spins", "SHARDPROP_SHM_SPINS", int, 200,
            "How often a waiting rank yields its core before it sleeps on its pipe."),
    Setting("force_staging", "SHARDPROP_FORCE_STAGING", ("", "cuda", "all"), "",
            "Stage CPU collectives through host copies as for CUDA tensors (tests without a GPU)."),
    Setting("allow_any_torch", "SHARDPROP_ALLOW_ANY_TORCH", bool, False,
            "Import on a torch outside the supported range (a warning instead of an error)."),
    Setting("buffer_reuse", None, bool, True,
            "Reuse redistribution output buffers (CPU; where torch exposes storage use counts)."),
    Setting("buffer_max_bytes", None, int, 1 << 30,
            "Bytes the redistribution buffer pool keeps at most (in use or idle)."),
    Setting("buffer_max_buffers", None, int, 16,
            "Buffers the redistribution buffer pool keeps at most."),
    Setting("optimizer_foreach", None, bool, True,
            "Run optimizer steps over DTensor parameter groups with torch's foreach kernels when the "
            "group left foreach at None."),
    Setting("cp_rotate_method", None, ("auto", "ring", "allgather"), "auto",
            "How context-parallel attention passes key/value shards: a ring, one all-gather, or the cost "
            "model's choice."),
    # fully_shard's collectives; unset (None): by backend, on except on CPU (gloo).
    Setting("fsdp_gather_into_views", None, bool, None,
            "fully_shard units all-gather in one coalesced call straight into the parameters' views (no copy; "
            "unset: on except on CPU, where gloo's coalesced call copies and one flat gather is cheaper)."),
    Setting("fsdp_async_gather", None, bool, None,
            "fully_shard units all-gather asynchronously, so the next unit's gather overlaps this unit's compute "
            "(unset: on except on CPU, where gloo holds a flat temporary while in flight)."),
    Setting("fsdp_async_reduce", None, bool, None,
            "fully_shard units reduce-scatter asynchronously, overlapping the rest of backward (unset: on except "
            "on CPU, where the packed gradients would stay in the peak of every unit's backward)."),
)

"""Every setting, in the order of the settings table.

Example:
    >>> [s.name for s in SETTINGS][:3]
    ['fast_paths', 'cache_size', 'cache_stats']
"""

BY_NAME: Dict[str, Setting] = {s.name: s for s in SETTINGS}
"""The settings by name.

Example:
    >>> BY_NAME["cache_size"].env
    'SHARDPROP_CACHE_SIZE'
"""


class Values:
    """The current value of every setting, as attributes (one load each on a hot path).

    Example:
        >>> isinstance(values, Values)
        True
        >>> values.fast_paths = False
        Traceback (most recent call last):
        ...
        AttributeError: shardprop settings change through config.set('fast_paths', ...) or config.patch(fast_paths=...), so that what depends on them follows
    """

    __slots__ = tuple(BY_NAME)

    def __setattr__(self, name, value):
        raise AttributeError(f"shardprop settings change through config.set({name!r}, ...) or config.patch("
                             f"{name}=...), so that what depends on them follows")

    def __repr__(self):
        return "Values(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in BY_NAME) + ")"


values = Values()
"""The current value of every setting (read ``values.NAME``; change it with :func:`set` or :func:`patch`).

Example:
    >>> with patch(cache_size=1024):
    ...     values.cache_size
    1024
"""
for _s in SETTINGS:
    object.__setattr__(values, _s.name, _s.from_env())
del _s

_watchers: Dict[str, List[Callable[[Any], None]]] = {}
_lock = threading.RLock()


def _setting(name: str) -> Setting:
    try:
        return BY_NAME[name]
    except KeyError:
        raise AttributeError(f"shardprop has no setting {name!r}; settings are {sorted(BY_NAME)}") from None


def get(name: str):
    """The current value of setting ``name``.

    Example:
        >>> get("cache_size") >= 0
        True
    """
    _setting(name)
    return getattr(values, name)


def set(name: str, value) -> Any:  # noqa: A001 - config.set reads as what it does
    """Set ``name`` to ``value`` (converted to the setting's type), run its watchers; returns the old value.

    Example:
        >>> old = set("fast_paths", False); set("fast_paths", old)
        False
    """
    setting = _setting(name)
    new = setting.coerce(value)
    with _lock:
        old = getattr(values, name)
        object.__setattr__(values, name, new)
        for fn in _watchers.get(name, ()):
            fn(new)
    return old


@contextlib.contextmanager
def patch(**settings):
    """Set settings for the duration of a ``with`` block, then restore them (watchers run both ways).

    Example:
        >>> with patch(fast_paths=False, cache_size=0):
        ...     pass
    """
    for name in settings:
        _setting(name)
    olds = []
    try:
        for name, value in settings.items():
            olds.append((name, set(name, value)))
        yield values
    finally:
        for name, old in reversed(olds):
            set(name, old)


def watch(name: str, fn: Callable[[Any], None]) -> None:
    """Call ``fn(new_value)`` after each change of setting ``name`` (by the module that owns derived state).

    Example:
        >>> seen = []
        >>> watch("cache_size", seen.append)
        >>> with patch(cache_size=1024):
        ...     pass
        >>> seen[0]
        1024
    """
    _setting(name)
    _watchers.setdefault(name, []).append(fn)


def default(name: str):
    """The value the environment gave ``name`` at import (its declared default where unset).

    Example:
        >>> default("cache_stats") in (True, False)
        True
    """
    return _setting(name).from_env()


def render_table() -> str:
    """The settings table of the docs (``docs/reference/settings.md``, markdown), rendered from :data:`SETTINGS`.

    Example:
        >>> render_table().splitlines()[0]
        '| Setting | Environment variable | Default | What it does |'
    """
    rows = ["| Setting | Environment variable | Default | What it does |", "|---|---|---|---|"]
    for s in SETTINGS:
        env = f"`{s.env}`" if s.env else "(none)"
        if isinstance(s.kind, tuple):
            shown = " / ".join(repr(c) for c in s.kind) + f" (default {s.default!r})"
        elif s.kind is bool:
            shown = "unset" if s.default is None else "on" if s.default else "off"
        else:
            shown = f"{s.default:g}" if s.kind is float else str(s.default)
        rows.append(f"| `{s.name}` | {env} | {shown} | {s.doc} |")
    return "\n".join(rows) + "\n"
