"""``implicit_replication()``: plain tensors that join DTensor ops count as Replicate, inside the context only.

Outside it, a plain (non-0-dim, non-integer) tensor mixed with DTensors raises
``PlainTensorError`` as always. The flag is read only on that error path, so the hot path
(ops on DTensors alone) costs nothing more, active or not.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from shardprop.dispatch import hooks as _hooks


@contextmanager
def implicit_replication() -> Iterator[None]:
    """Treat plain ``torch.Tensor`` arguments of DTensor ops as replicated on the DTensors' mesh.

    As in ``torch.distributed.tensor.experimental.implicit_replication``: the caller vouches that
    the plain tensor holds the same value on every rank (a wrong guess gives wrong results, as in
    torch). Nests; thread-global, like torch's.

    Example:
        >>> x = distribute_tensor(torch.ones(4, 4), init_device_mesh("cpu", (4,)), [Shard(0)])
        >>> with implicit_replication():
        ...     y = x + torch.arange(4.0)  # the plain tensor joins as Replicate
        >>> y.placements
        (S(0),)
    """
    _hooks.set_implicit_replication(_hooks.hooks.implicit_replication + 1)
    try:
        yield
    finally:
        _hooks.set_implicit_replication(_hooks.hooks.implicit_replication - 1)


def implicit_replication_active() -> bool:
    """Whether an ``implicit_replication()`` context is open.

    Example:
        >>> implicit_replication_active()
        False
    """
    return _hooks.hooks.implicit_replication > 0


__all__ = ["implicit_replication", "implicit_replication_active"]
