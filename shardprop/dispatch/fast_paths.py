"""One switch for every eager fast path, and how the fast paths report to ``explain()``.

The fast paths (the TP styles' local matmuls and lookups in ``parallel.fused_linear``, the
sequence-parallel norms in ``parallel.fused_norm``, the coalesced ``Partial -> Replicate``
gradient sync in ``parallel.grad_sync``, the optimizer foreach default in
``parallel.optim_foreach``, the ``detach`` shortcut in ``ops.scalar``) are optimisations of what
the engine does on DTensors, not second definitions of it. Turning them off makes every one run
the DTensor (engine) path instead: for debugging, and for the differential test that checks both
paths give the same answer.

The switch is read at call time (the setting ``fast_paths``, one attribute load on the hot path): a
model parallelized with the fast paths on runs the DTensor path while they are off, and the other
way round. Its start value comes from ``SHARDPROP_FAST_PATHS`` (``0``/``false``/``off`` turn them
off; unset leaves them on).

A module forward's fast path subclasses :class:`FastPath`, which owns what they all check (the
switch, torch.compile, the recorder) and the step-aside to the engine path; it gives ``eligible()``
and ``local_forward()``. Every fast path is listed in :data:`REGISTRY` with its engine twin (what
runs when it is off or steps aside); the differential test iterates that registry.

Fast paths report what they ran (local ops, and the collectives they issued, also in backward) to
the same ``hooks.recorder`` the dispatcher reports op calls to, through
``recorder.record_fast(op, what, inputs, outputs, collectives)`` when the recorder has it.

Example:
    >>> import shardprop
    >>> with shardprop.fast_paths(False):
    ...     shardprop.fast_paths_enabled()
    False
"""
from __future__ import annotations

import contextlib
from typing import Dict, NamedTuple, Tuple

import torch

from shardprop.dispatch.hooks import hooks as _hooks
from shardprop.mesh import collectives as _C
from shardprop.mesh import config as _config

# The switch is the setting ``fast_paths`` (config.values.fast_paths: one attribute load per check).
settings = _config.values


def set_fast_paths(on: bool) -> bool:
    """Turn every eager fast path on or off (read at call time); returns the previous setting.

    Example:
        >>> old = set_fast_paths(False); set_fast_paths(old)
        False
    """
    return _config.set("fast_paths", on)


def fast_paths_enabled() -> bool:
    """Whether the eager fast paths run (see :func:`set_fast_paths`).

    Example:
        >>> fast_paths_enabled() in (True, False)
        True
    """
    return settings.fast_paths


@contextlib.contextmanager
def fast_paths(on: bool = True):
    """Run the block with the fast paths on or off, then restore the previous setting.

    Example:
        >>> with fast_paths(False):  # every style, norm, grad sync and optimizer runs on DTensors
        ...     fast_paths_enabled()
        False
    """
    old = set_fast_paths(on)
    try:
        yield
    finally:
        set_fast_paths(old)


class _Tap(_C.CommCounter):
    """A comm counter that also keeps each collective, in order: (kind, bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list = []

    def add(self, kind: str, nbytes: int, group_size: int = 0) -> None:
        super().add(kind, nbytes, group_size)
        self.events.append((kind, nbytes))


def recording() -> bool:
    """Whether a recorder (``explain()``) listens; fast paths then go through :func:`run_recorded`."""
    return _hooks.recorder is not None


def run_recorded(op: str, what: str, inputs: tuple, mesh_dims: tuple, fn, *args):
    """``fn(*args)``, reported to the recorder as the local op ``op`` with the collectives it issued.

    ``inputs`` are the placements the fast path took its inputs in; the output placements are
    read from the result when it is a DTensor. Costs nothing when no recorder listens (callers
    check :func:`recording` first).

    Example:
        >>> run_recorded("linear", "ColwiseParallel on 'up'", ((Replicate(),),), (0,), fwd, x)  # doctest: +SKIP
    """
    rec = _hooks.recorder
    if rec is None or not hasattr(rec, "record_fast"):
        return fn(*args)
    tap = _Tap()
    with _C.comm_counter(tap):
        out = fn(*args)
    outs = tuple(getattr(o, "placements", None) for o in (out if isinstance(out, tuple) else (out,)))
    rec.record_fast(op, what, inputs, outs, tuple((kind, mesh_dims, nbytes) for kind, nbytes in tap.events))
    return out


_is_compiling = torch.compiler.is_compiling


class FastPath:
    """A module forward on local tensors with explicit collectives, standing in for the DTensor forward.

    ``forward(module, x)`` is what the style installs (through ``functools.partial``, so a deep copy
    of the model rebinds it). It runs ``engine(module, x)``, the DTensor (engine) path, when the fast
    paths are off, while torch.compile traces, for a non-tensor input, or when ``eligible`` says
    no; else ``local_forward(module, x, *plan)``, reported to ``explain()`` when it listens.

    A subclass gives:

    - ``eligible(module, x)``: a tuple (the plan ``local_forward`` takes), or None to step aside;
    - ``local_forward(module, x, *plan)``: the forward on local tensors;
    - ``describe(module, x, plan)``: (local op name, what ran, input placements, mesh dims) for ``explain()``;
    - ``_CACHES``: attributes holding caches, emptied when pickled (specs are per process).

    A fast path is immutable after construction: a deep copy is the object itself (the mesh is shared,
    as DTensors share it).

    Example:
        >>> module.forward = functools.partial(MyFastPath(engine=hooked).forward, module)  # doctest: +SKIP
    """

    _CACHES: tuple = ()

    def __init__(self, engine):
        self.engine = engine

    def __deepcopy__(self, memo):
        return self

    def __getstate__(self):
        return {**vars(self), **{name: {} for name in self._CACHES}}

    def forward(self, module, input):  # noqa: A002 (the wrapped forwards' argument name: module(input=x) works)
        """The fast forward, or the engine's where the fast path does not apply (see the class docstring)."""
        x = input
        if not settings.fast_paths or _is_compiling() or not isinstance(x, torch.Tensor):
            return self.engine(module, x)
        plan = self.eligible(module, x)
        if plan is None:
            return self.engine(module, x)
        if _hooks.recorder is not None:
            op, what, inputs, mesh_dims = self.describe(module, x, plan)
            return run_recorded(op, what, inputs, mesh_dims, self.local_forward, module, x, *plan)
        return self.local_forward(module, x, *plan)

    def eligible(self, module, x):
        raise NotImplementedError

    def local_forward(self, module, x, *plan):
        raise NotImplementedError

    def describe(self, module, x, plan) -> tuple:
        raise NotImplementedError


class Entry(NamedTuple):
    """A fast path and its engine twin: what runs instead when the fast path is off or steps aside."""

    name: str
    fast: str     # where the fast path lives (module.qualname)
    engine: str   # its engine twin
    styles: Tuple[str, ...]  # the parallel styles (or calls) that install or take it


# Every eager fast path, with its engine twin. tests/test_fast_path_differential.py draws cases that
# cover each entry (and fails on an entry it does not cover).
REGISTRY: Dict[str, Entry] = {}


def register(name: str, fast: str, engine: str, styles: Tuple[str, ...]) -> None:
    """List a fast path and its engine twin in :data:`REGISTRY`.

    Example:
        >>> register("linear", "shardprop.parallel.fast.fused_linear.FusedLinear",
        ...          "the styles' DTensor hooks around nn.Linear.forward", ("ColwiseParallel",))  # doctest: +SKIP
    """
    if name in REGISTRY:
        raise ValueError(f"fast path {name!r} is registered already ({REGISTRY[name].fast})")
    REGISTRY[name] = Entry(name, fast, engine, tuple(styles))


__all__ = ["FastPath", "REGISTRY", "fast_paths", "fast_paths_enabled", "register", "set_fast_paths", "run_recorded",
           "recording"]
