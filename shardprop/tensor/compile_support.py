"""torch.compile support that must wait until torch.compile itself is loaded.

Importing dynamo costs seconds, so shardprop never imports it: the registrations
below run when something else imports ``torch._dynamo`` (``torch.compile`` does),
or at once if it already is imported.

- ``allow_in_graph``: the autograd functions that build or unwrap a DTensor
  (from_local, to_local, redistribute). Dynamo cannot trace
  ``torch.Tensor._make_wrapper_subclass``, so it records each call whole;
  AOTAutograd then runs them on fake local tensors and desugars the DTensors
  into local tensors plus metadata (``DTensor.__tensor_flatten__``).
- ``allow_in_graph`` also for the uneven all-to-all's autograd function
  (``shardprop.mesh.uneven_all_to_all.AllToAllUneven``, MoE token routing): dynamo cannot
  read the mesh inside its forward, AOTAutograd runs it on fake tensors (a functional all-to-all).
- ``DeviceMesh`` as an opaque *value* type, so a mesh can be an argument of those
  calls in a graph: compiled code guards on it by equality and names it through
  ``DeviceMesh.__fx_repr__`` (the API differs per release: ``shardprop.mesh.compat``).

Why an import hook: torch offers no "dynamo has loaded" callback, and importing dynamo
ourselves would cost every eager user seconds. The hook is one finder that answers for
``torch._dynamo`` alone, once, and then removes itself.

A registration never breaks torch: it runs after dynamo's own module has finished
importing, and whatever it raises is caught and kept (:func:`compile_problems`). Eager
code keeps working; compiling a DTensor program then raises :class:`CompileUnsupported`
naming what failed on this torch (``DTensor.__tensor_flatten__`` calls :func:`check_compile`).
"""
from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys
from typing import Callable, List, Tuple

from shardprop.mesh import compat

_DYNAMO = "torch._dynamo"
_pending: List[Tuple[Callable, str]] = []
# "what: error" for every registration that failed on this torch (empty: compile is fully supported).
_problems: List[str] = []


class CompileUnsupported(RuntimeError):
    """torch.compile of a DTensor program cannot work on this torch (a registration failed)."""


def compile_problems() -> List[str]:
    """The registrations for torch.compile that failed on this torch, as ``"what: error"`` lines.

    Example:
        >>> compile_problems()
        []
    """
    return list(_problems)


def check_compile() -> None:
    """Raise :class:`CompileUnsupported` if a registration that torch.compile needs failed.

    Example:
        >>> check_compile()  # nothing failed: returns None
    """
    if _problems:
        raise CompileUnsupported(
            f"torch.compile of DTensor programs does not work on torch {compat.running_torch()}: "
            + "; ".join(_problems)
            + f". Eager DTensor code is unaffected; shardprop's compile support is tested on {compat.range_text()}.")


def allow_in_graph(*fns) -> None:
    """Mark ``fns`` allow_in_graph for dynamo, now or as soon as dynamo is imported.

    Example:
        >>> allow_in_graph(FromLocal, ToLocal)  # doctest: +SKIP
    """
    def register(dynamo):
        for fn in fns:
            dynamo.allow_in_graph(fn)
    when_dynamo_loads(register, "allow_in_graph(" + ", ".join(getattr(f, "__name__", "?") for f in fns) + ")")


# What compiled user code reads of a mesh (torchtitan's helpers call mesh.size(0) in compiled blocks): read on
# the real mesh while tracing, baked in as constants (the mesh itself is a guarded constant).
_MESH_READS = ("size", "ndim", "shape", "get_local_rank", "get_coordinate", "get_rank", "mesh_dim_names",
               "device_type", "dim_index")


def _register_mesh(dynamo) -> None:
    from shardprop.mesh.device_mesh import DeviceMesh
    compat.register_opaque_value(DeviceMesh, _MESH_READS)


# What compiled user code asks of a placement read from a DTensor (torchtitan compares them and reads ``dim``
# before redistributing): answered on the real placement while tracing.
_PLACEMENT_READS = ("is_shard", "is_replicate", "is_partial", "__eq__", "__ne__", "__hash__", "dim",
                    "split_factor", "reduce_op")


def _register_placements(dynamo) -> None:
    from shardprop.tensor.placement import Partial, Replicate, Shard, _StridedShard
    # The concrete classes only: the base has no instances (and no ``__eq__`` of its own to guard with).
    for cls in (Shard, _StridedShard, Replicate, Partial):
        compat.register_opaque_value(cls, [m for m in _PLACEMENT_READS if hasattr(cls, m)])


def _run(fn: Callable, what: str, dynamo) -> None:
    # Never let a registration's failure escape: it would run inside torch's own import.
    try:
        fn(dynamo)
    except Exception as e:  # noqa: BLE001 - any failure is kept and reported at compile time
        _problems.append(f"{what} failed ({type(e).__name__}: {e})")


def when_dynamo_loads(fn: Callable, what: str = "") -> None:
    """Call ``fn(torch._dynamo)`` as soon as dynamo is imported (now, if it already is).

    For registrations that need torch.compile's own modules, e.g. a sharding rule for an
    inductor prim that only exists once inductor is imported. If ``fn`` raises, the error is
    kept (:func:`compile_problems`) and compiling a DTensor program reports it.

    Example:
        >>> when_dynamo_loads(lambda dynamo: print("compile is here"), "a greeting")  # doctest: +SKIP
    """
    what = what or getattr(fn, "__qualname__", repr(fn))
    module = sys.modules.get(_DYNAMO)
    if module is not None and not _Finder.loading:
        _run(fn, what, module)
        return
    _pending.append((fn, what))
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def outside_graphs(fn: Callable) -> Callable:
    """``fn``, run eagerly when a compiled caller reaches it (``torch._dynamo.disable`` once dynamo loads).

    For module hooks whose work is data-dependent host logic and collectives (MoE token routing:
    split sizes read with ``.tolist()``): the compiled graph breaks around them and they run as
    in eager mode, as torch's own fully_shard hooks do. Before dynamo loads it is ``fn`` itself.

    Example:
        >>> hook = outside_graphs(lambda module, args: None)
        >>> hook(None, ()) is None
        True
    """
    impl = [fn]

    def disable(dynamo) -> None:
        impl[0] = dynamo.disable(fn)
        # The wrapper's own frame, entered again after the graph break, is not worth compiling
        # (dynamo would recompile it per argument count until its limit, with warnings).
        compat.skip_frame(dynamo, call.__code__)

    when_dynamo_loads(disable, f"running {getattr(fn, '__qualname__', fn)!s} outside compiled graphs")

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return impl[0](*args, **kwargs)
    return call


def _run_pending(module) -> None:
    while _pending:
        fn, what = _pending.pop(0)
        _run(fn, what, module)


class _Finder(importlib.abc.MetaPathFinder):
    """Runs the pending registrations right after ``torch._dynamo`` finishes importing."""

    loading = False

    def find_spec(self, fullname, path, target=None):
        if fullname != _DYNAMO:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        except Exception:  # noqa: BLE001 - let the normal machinery find (or fail to find) it
            return None
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            _Finder.loading = True
            try:
                exec_module(module)  # torch's own import: its errors are its own
            finally:
                _Finder.loading = False
            _run_pending(module)

        spec.loader.exec_module = exec_then_register
        return spec


when_dynamo_loads(_register_mesh, "registering DeviceMesh as an opaque value type")
when_dynamo_loads(_register_placements, "registering the placements as opaque value types")


def _register_uneven_all_to_all(dynamo) -> None:
    from shardprop.mesh.uneven_all_to_all import AllToAllUneven
    dynamo.allow_in_graph(AllToAllUneven)


when_dynamo_loads(_register_uneven_all_to_all, "allow_in_graph(AllToAllUneven)")
