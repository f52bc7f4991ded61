"""shardprop's settings table: every setting declared once, with its environment variable, type, default and doc.

Declared in ``shardprop.mesh.config`` (the ground floor, so every room may read it); this module
re-exports it as the public name.

Example:
    >>> import shardprop
    >>> with shardprop.config.patch(fast_paths=False, cache_size=0):
    ...     shardprop.config.values.fast_paths
    False
    >>> print(shardprop.config.render_table())  # doctest: +SKIP
"""
from shardprop.mesh.config import (  # noqa: F401 - the public names
    BY_NAME, SETTINGS, Setting, Values, default, get, patch, render_table, set, values, watch)

__all__ = ["BY_NAME", "SETTINGS", "Setting", "Values", "default", "get", "patch", "render_table", "set", "values",
           "watch"]
