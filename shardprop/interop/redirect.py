"""Point a program's imports of torch's DTensor stack at shardprop, leaving torch's own imports alone.

One module name (``torch.distributed.tensor``) cannot be two modules in ``sys.modules``, so the
redirection happens where an import statement runs: Python calls ``builtins.__import__`` with the
importing module's globals, and :func:`redirect_torch_imports` wraps it. An import of a module in
:data:`torch_names.TABLE` from any module outside ``torch`` (and outside shardprop) gets shardprop's
stand-in module; torch's own modules (DCP, dynamo, pipelining, ...) get torch's, as do imports
through ``importlib.import_module``, which does not go through ``__import__``.

``from torch.distributed.tensor import DTensor`` gets ours directly. ``import torch.distributed.tensor``
(which binds ``torch``) and ``import torch.distributed._functional_collectives as funcol`` get a view
of ``torch`` that is torch in every attribute except the path down to the stand-in.

Example (a program's module, here ``train``; shardprop's own modules are never redirected):
    >>> program = {"__name__": "train"}
    >>> with redirect_torch_imports():
    ...     exec("from torch.distributed.tensor import Shard", program)
    >>> program["Shard"] is __import__("shardprop").Shard
    True
"""
from __future__ import annotations

import builtins
import contextlib
import sys
import types
from typing import Dict

from shardprop.interop import torch_names
from shardprop.mesh.state import module_state

_original_import = builtins.__import__


class StandIn(types.ModuleType):
    """shardprop's stand-in for one torch module: its names resolved from the table on first use."""

    def __init__(self, torch_name: str) -> None:
        super().__init__(torch_name, f"shardprop's stand-in for {torch_name} (shardprop.interop.torch_names)")
        self.__torch_name__ = torch_name
        # Where a name is missing, ``from X import name`` says "cannot import name ... (<this file>)": the table.
        self.__file__ = torch_names.__file__
        self.__all__ = sorted(torch_names.TABLE.get(torch_name, ()))

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        sub = f"{self.__torch_name__}.{name}"
        value = _stand_in(sub) if _redirected(sub) else torch_names.resolve(self.__torch_name__, name)
        setattr(self, name, value)  # the next lookup is a plain attribute read
        return value


class _View(types.ModuleType):
    """A torch package as the program sees it: torch's attributes, but the path to a stand-in goes to ours."""

    def __init__(self, real: types.ModuleType, overrides: Dict[str, object]) -> None:
        super().__init__(real.__name__, real.__doc__)
        self.__dict__.update({k: v for k, v in vars(real).items() if k not in ("__name__", "__doc__")})
        self.__dict__.update(overrides)
        self.__real__ = real

    def __getattr__(self, name: str):  # what torch added after the view was made (lazily imported submodules)
        return getattr(self.__real__, name)


_state = module_state(
    stand_ins={},
    views={},  # torch package name -> the program's view of it (see _view_down_to)
    depth=0,
)


def _redirected(torch_name: str) -> bool:
    """Below a stand-in: a module of the table, or a package on the way to one (``torch.distributed.fsdp._fully_shard``)."""
    table = torch_names.TABLE
    return torch_name in table or any(k.startswith(torch_name + ".") for k in table if k.startswith("torch.distributed."))


def _stand_in(torch_name: str) -> StandIn:
    got = _state.stand_ins.get(torch_name)
    if got is None:
        got = _state.stand_ins[torch_name] = StandIn(torch_name)
    return got


def _program_import(importer) -> bool:
    """Whether an import statement in the module with globals ``importer`` belongs to the program."""
    name = importer.get("__name__", "") if isinstance(importer, dict) else ""
    return not (name == "torch" or name.startswith(("torch.", "shardprop.", "shardprop")))


def _view_down_to(torch_name: str):
    """``torch`` whose attribute path down to ``torch_name`` ends at our stand-ins (the rest is torch's).

    The path is torch's own packages down to the first redirected module, then stand-ins, whose
    attributes lead to the stand-ins below them: ``torch.distributed.tensor`` is never torch's on that
    path. One view per package, shared by every import statement, so paths added by earlier imports stay.
    """
    parts = torch_name.split(".")
    k = next(k for k in range(2, len(parts) + 1) if ".".join(parts[:k]) in torch_names.TABLE)
    node: object = _stand_in(".".join(parts[:k]))
    for depth in range(k - 1, 0, -1):
        parent = ".".join(parts[:depth])
        view = _state.views.get(parent)
        if view is None:
            real = sys.modules.get(parent) or _original_import(parent, fromlist=["_"])
            view = _state.views[parent] = _View(real, {})
        setattr(view, parts[depth], node)
        node = view
    return node


def _redirecting_import(name, globals=None, locals=None, fromlist=(), level=0):  # noqa: A002 (__import__'s names)
    if level == 0 and name in torch_names.TABLE and _program_import(globals):
        if fromlist:
            return _stand_in(name)
        return _view_down_to(name)
    return _original_import(name, globals, locals, fromlist, level)


def install() -> None:
    """Start redirecting (nested calls count; :func:`uninstall` undoes one).

    Example:
        >>> install(); uninstall()
    """
    if _state.depth == 0:
        builtins.__import__ = _redirecting_import
    _state.depth += 1


def uninstall() -> None:
    """Stop redirecting once every :func:`install` has been undone (a no-op when not installed).

    Example:
        >>> uninstall()
    """
    if _state.depth == 0:
        return
    _state.depth -= 1
    if _state.depth == 0 and builtins.__import__ is _redirecting_import:
        builtins.__import__ = _original_import


@contextlib.contextmanager
def redirect_torch_imports():
    """Inside the block, the program's imports of torch's DTensor stack give shardprop's names.

    Example:
        >>> program = {"__name__": "train"}
        >>> with redirect_torch_imports():
        ...     exec("import torch.distributed.device_mesh as dm", program)
        >>> program["dm"].init_device_mesh is __import__("shardprop").init_device_mesh
        True
    """
    install()
    try:
        yield
    finally:
        uninstall()


__all__ = ["StandIn", "install", "uninstall", "redirect_torch_imports"]
