"""One pattern for a module's mutable state: one object with fixed fields (no `global` statements).

A module that must change a value of its own at run time (a depth counter, the unit in flight)
keeps it as a field of its :func:`module_state` object: reads and writes are one attribute access,
a misspelt field raises instead of creating a new one, and ``tests/test_layout.py`` has no
``global`` statement to find.

Example:
    >>> _state = module_state(depth=0, last=None)
    >>> _state.depth += 1; _state
    State(depth=1, last=None)
"""
from __future__ import annotations


class State:
    """Base of the state objects :func:`module_state` makes (each its own subclass with its fields as slots)."""

    __slots__ = ()

    def __repr__(self):
        return "State(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in type(self).__slots__) + ")"


def module_state(**fields) -> State:
    """A state object with exactly ``fields`` (their initial values); fields can change, none can be added.

    Example:
        >>> module_state(in_flight=None).in_flight is None
        True
    """
    cls = type("State", (State,), {"__slots__": tuple(fields)})
    state = cls()
    for name, value in fields.items():
        setattr(state, name, value)
    return state
