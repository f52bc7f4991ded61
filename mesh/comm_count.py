"""Counting the collectives shardprop issues: :class:`CommCounter` and :func:`comm_counter`.

``shardprop.mesh.collectives`` (the only place shardprop issues collectives for tensor data) calls
:func:`count` for each collective while a counter is active (one check of ``state.counters`` when none is).

Example:
    >>> with comm_counter() as c:
    ...     pass
    >>> c.counts
    {}
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Iterator, Optional, Tuple

import torch

from shardprop.mesh.state import module_state

# The counters now active (a nested counter counts too); empty means "count nothing".
state = module_state(counters=())


class CommCounter:
    """Collectives issued while active: ``counts`` maps kind -> (count, bytes).

    ``bytes`` is the size of the tensor this rank hands to the collective (its input:
    the local piece for all_gather, the full input for reduce_scatter and all_to_all,
    the tensor for all_reduce and broadcast) or, for scatter, of the piece it receives.
    It is a payload size, not the wire traffic of a particular algorithm.

    Example:
        >>> x = distribute_tensor(torch.ones(8, 128), init_device_mesh("cpu", (4,)), [Shard(0)])
        >>> with comm_counter() as c:
        ...     y = x.redistribute(placements=[Replicate()])
        >>> c.counts
        {'all_gather': (1, 1024)}
    """

    def __init__(self) -> None:
        self.counts: Dict[str, Tuple[int, int]] = {}
        # (kind, group size) -> (count, bytes); group size 0 where unknown (point-to-point messages)
        self.by_group: Dict[Tuple[str, int], Tuple[int, int]] = {}

    def add(self, kind: str, nbytes: int, group_size: int = 0) -> None:
        n, b = self.counts.get(kind, (0, 0))
        self.counts[kind] = (n + 1, b + nbytes)
        n, b = self.by_group.get((kind, group_size), (0, 0))
        self.by_group[(kind, group_size)] = (n + 1, b + nbytes)

    @property
    def total(self) -> Tuple[int, int]:
        """(collectives, bytes) over all kinds."""
        return (sum(n for n, _ in self.counts.values()), sum(b for _, b in self.counts.values()))

    def reset(self) -> None:
        self.counts.clear()
        self.by_group.clear()

    def __repr__(self) -> str:
        body = ", ".join(f"{k}: {n} ({b} B)" for k, (n, b) in sorted(self.counts.items()))
        return f"CommCounter({body or 'none'})"


@contextmanager
def comm_counter(counter: Optional[CommCounter] = None) -> Iterator[CommCounter]:
    """Count the collectives shardprop issues inside the ``with`` block (into ``counter`` if given).

    Example:
        >>> x = distribute_tensor(torch.ones(8, 128), init_device_mesh("cpu", (4,)), [Shard(0)])
        >>> with comm_counter() as c:
        ...     total = x.sum().full_tensor()       # a Partial sum, all-reduced
        ...     y = x.redistribute(placements=[Replicate()])
        >>> c.counts  # {kind: (count, bytes)}
        {'all_reduce': (1, 4), 'all_gather': (1, 1024)}
    """
    c = CommCounter() if counter is None else counter
    state.counters = state.counters + (c,)
    try:
        yield c
    finally:
        state.counters = tuple(x for x in state.counters if x is not c)


def count(kind: str, t: torch.Tensor, group_size: int = 0) -> None:
    nbytes = t.numel() * t.element_size()
    for c in state.counters:
        c.add(kind, nbytes, group_size)


__all__ = ["CommCounter", "comm_counter", "count", "state"]
