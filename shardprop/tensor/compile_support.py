"""torch.compile support that must wait until torch.compile itself is loaded.

Importing dynamo costs seconds, so shardprop never imports it: the registrations
below run when something else imports ``torch._dynamo`` (``torch.compile`` does),
or at once if it already is imported.

- ``allow_in_graph``: the autograd functions that build or unwrap a DTensor
  (from_local, to_local, redistribute). Dynamo cannot trace
  ``torch.Tensor._make_wrapper_subclass``, so it records each call whole;
  AOTAutograd then runs them on fake local tensors and desugars the DTensors
  into local tensors plus metadata (``DTensor.__tensor_flatten__``).
- ``DeviceMesh`` as an opaque *value* type, so a mesh can be an argument of those
  calls in a graph: compiled code guards on it by equality and names it through
  ``DeviceMesh.__fx_repr__``.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Callable, List

_DYNAMO = "torch._dynamo"
_pending: List[Callable] = []


def allow_in_graph(*fns) -> None:
    """Mark ``fns`` allow_in_graph for dynamo, now or as soon as dynamo is imported.

    Example:
        >>> allow_in_graph(FromLocal, ToLocal)  # doctest: +SKIP
    """
    def register(dynamo):
        for fn in fns:
            dynamo.allow_in_graph(fn)
    when_dynamo_loads(register)


def _register_mesh(dynamo) -> None:
    from torch._library.opaque_object import is_opaque_type, register_opaque_type

    from shardprop.mesh.device_mesh import DeviceMesh
    if not is_opaque_type(DeviceMesh):
        register_opaque_type(DeviceMesh, typ="value")


def when_dynamo_loads(fn: Callable) -> None:
    """Call ``fn(torch._dynamo)`` as soon as dynamo is imported (now, if it already is).

    For registrations that need torch.compile's own modules, e.g. a sharding rule for an
    inductor prim that only exists once inductor is imported.

    Example:
        >>> when_dynamo_loads(lambda dynamo: print("compile is here"))  # doctest: +SKIP
    """
    module = sys.modules.get(_DYNAMO)
    if module is not None and not _Finder.loading:
        fn(module)
        return
    _pending.append(fn)
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


class _Finder(importlib.abc.MetaPathFinder):
    """Runs the pending registrations right after ``torch._dynamo`` finishes importing."""

    loading = False

    def find_spec(self, fullname, path, target=None):
        if fullname != _DYNAMO:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            _Finder.loading = True
            try:
                exec_module(module)
            finally:
                _Finder.loading = False
            while _pending:
                _pending.pop(0)(module)

        spec.loader.exec_module = exec_then_register
        return spec


when_dynamo_loads(_register_mesh)
