"""fully_shard's small public value types: offload policies and the unshard handle (FSDP2's names).

Example:
    >>> fully_shard(block, offload_policy=CPUOffloadPolicy(pin_memory=True))  # doctest: +SKIP
    >>> handle = block.unshard(async_op=True); handle.wait()  # doctest: +SKIP
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple, Union


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading: the default ``offload_policy`` of :func:`fully_shard`.

    Example:
        >>> OffloadPolicy()
        OffloadPolicy()
    """


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters and their gradients in host memory between steps.

    Before each all-gather the unit copies its shard host-to-device; after the
    reduce-scatter its gradient shards are copied device-to-host, so the optimizer
    steps on the CPU. ``pin_memory`` pins the host copies (faster, overlappable
    copies). On a CPU mesh everything already lives in host memory: offloading is
    then a no-op with ``pin_memory=False``, and ``pin_memory=True`` is refused with
    a clear error (pinning needs an accelerator; torch raises
    "Cannot access accelerator device when none is available" there).

    Example:
        >>> CPUOffloadPolicy(pin_memory=False)
        CPUOffloadPolicy(pin_memory=False)
    """

    pin_memory: bool = True


def _names(value) -> Tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


@dataclass
class DataParallelMeshDims:
    """Which named dims of a whole (SPMD) mesh are data parallel, for ``fully_shard(dp_mesh_dims=...)``.

    ``shard``: the dim name(s) fully_shard shards parameters over (several are taken as
    one flattened dim); ``replicate``: the HSDP replica dim name(s). At least one must be
    given. The other dims of the mesh (e.g. ``"tp"``) keep the parameters' own placements.

    Example:
        >>> DataParallelMeshDims(shard="dp_shard", replicate="dp_replicate").shard_names
        ('dp_shard',)
    """

    shard: Optional[Union[str, Tuple[str, ...]]] = None
    replicate: Optional[Union[str, Tuple[str, ...]]] = None

    def __post_init__(self):
        if self.shard is None and self.replicate is None:
            raise ValueError("DataParallelMeshDims: give shard= or replicate= (or both)")

    @property
    def shard_names(self) -> Tuple[str, ...]:
        """The shard dim names as a tuple (empty if none)."""
        return _names(self.shard)

    @property
    def replicate_names(self) -> Tuple[str, ...]:
        """The replicate dim names as a tuple (empty if none)."""
        return _names(self.replicate)


class UnshardHandle:
    """What ``FSDPModule.unshard(async_op=True)`` returns: :meth:`wait` finishes the all-gather.

    Example:
        >>> handle = model.layers[1].unshard(async_op=True)  # doctest: +SKIP
        >>> handle.wait()  # the full parameters are registered on the module now  # doctest: +SKIP
    """

    def __init__(self, unit=None) -> None:
        self._unit = unit

    def wait(self) -> None:
        """Wait for the all-gather; the module's parameters are then its full (unsharded) ones."""
        unit, self._unit = self._unit, None
        if unit is not None:
            unit.wait_unsharded()
            unit.swap_in()


class GradientReductionHandle:
    """What ``FSDPModule.finalize_backward(async_op=True)`` returns: :meth:`wait` writes the last gradients.

    Example:
        >>> handle = model.finalize_backward(async_op=True)  # doctest: +SKIP
        >>> handle.wait(); opt.step()  # doctest: +SKIP
    """

    def __init__(self, state=None) -> None:
        self._state = state

    def wait(self) -> None:
        """Wait for the gradient reduction still in flight; every ``.grad`` is then final."""
        state, self._state = self._state, None
        if state is not None:
            state.wait_for_gradients()


__all__ = ["DataParallelMeshDims", "OffloadPolicy", "CPUOffloadPolicy", "UnshardHandle", "GradientReductionHandle"]
