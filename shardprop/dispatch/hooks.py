"""What other rooms plug into the dispatcher, in one object: ``hooks``, changed only through the setters here.

- ``recorder``: ``explain()``'s recorder (``record(schema, out)``; fast paths call ``record_fast``).
- ``explicit_mode``: ``explicit()``'s guard, called with (schema, out) before an implicit redistribution.
- ``implicit_replication``: the depth of open ``implicit_replication()`` blocks (plain tensors join as
  Replicate); read only after a plain tensor was found, never on the hot path.
- ``first_call_hook``: called once per op at its first call when it has no special handler; returns the
  handler to install (decompose's decomposition handler) or None.

The dispatcher reads ``hooks.recorder`` (one attribute load) on its hot path.

Example:
    >>> old = set_recorder(my_recorder)  # doctest: +SKIP
    >>> set_recorder(old)                # doctest: +SKIP
"""
from __future__ import annotations


class Hooks:
    """The dispatcher's hooks (see the module docstring); change them with the module's setters."""

    __slots__ = ("recorder", "explicit_mode", "implicit_replication", "first_call_hook")

    def __init__(self):
        for name, value in (("recorder", None), ("explicit_mode", None), ("implicit_replication", 0),
                            ("first_call_hook", None)):
            object.__setattr__(self, name, value)

    def __setattr__(self, name, value):
        raise AttributeError(f"dispatch hooks change through shardprop.dispatch.hooks.set_{name}(...)")


hooks = Hooks()


def _swap(name: str, value):
    old = getattr(hooks, name)
    object.__setattr__(hooks, name, value)
    return old


def set_recorder(recorder):
    """Install ``recorder`` (or None); returns the previous one.

    Example:
        >>> set_recorder(set_recorder(None))  # doctest: +SKIP
    """
    return _swap("recorder", recorder)


def set_explicit_mode(guard):
    """Install ``guard(schema, out)`` run before implicit redistributions (or None); returns the previous one.

    Example:
        >>> set_explicit_mode(set_explicit_mode(None))  # doctest: +SKIP
    """
    return _swap("explicit_mode", guard)


def set_implicit_replication(depth: int) -> int:
    """Set the depth of open ``implicit_replication()`` blocks; returns the previous depth.

    Example:
        >>> old = set_implicit_replication(1); set_implicit_replication(old)
        1
    """
    return _swap("implicit_replication", int(depth))


def set_first_call_hook(fn):
    """Install ``fn(op) -> handler or None``, asked once per op at its first call; returns the previous one.

    Example:
        >>> set_first_call_hook(set_first_call_hook(None))  # doctest: +SKIP
    """
    return _swap("first_call_hook", fn)
