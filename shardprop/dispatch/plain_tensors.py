"""When a plain ``torch.Tensor`` met beside DTensors may join an op as Replicate: checked, not guessed.

torch's own composite code makes plain tensors inside ops on DTensors: ``linalg.matrix_power(a, 0)``
copies ``eye(n)`` into a clone of ``a``, ``linalg.matrix_rank`` builds its tolerance as a float64
tensor, ``svd_lowrank`` draws a random test matrix with ``torch.randn``, ``scaled_dot_product_attention``
turns a bool mask into a float one. None of them is user data: each is a function of shapes, dtypes,
replicated values or the generator state (the same on every rank, see ``random_ops``), so it holds
the same values on every rank, and the op is right when it joins as Replicate.

Which code made a tensor is judged from the Python stack, on this error path only: the nearest
frame outside shardprop (and outside torch's operator plumbing: ``Tensor`` dunders, ``torch.ops``
calls) is torch's own code (a Python composite such as ``svd_lowrank``, ``masked.var``, an OpInfo
wrapper, an ``nn`` module) or the user's. A tensor torch made joins once the ranks verify it: integer
and bool tensors as they are (torch builds them from Python lists: indices, masks); a floating one
when every rank of the mesh holds bit-identical values, which one all-gather of an 8-byte digest
per tensor verifies. A tensor of more than one element that the user passes straight to an op raises, as torch's DTensor
does, unless ``implicit_replication()`` is active (then it joins unchecked, as in torch); inside a backward
pass, what torch's formulas build (zeros, ones) is verified the same way. C++ composites called directly by the user (``linalg.matrix_power(x, 0)``) look like
the user's own call and are refused with the same clear error. A tensor that differs between ranks
raises on every rank alike, so none is left waiting in a collective. Whether to check depends only
on dtype, ndim and the call stack, the same on every rank, so every rank takes part in the same
all-gathers.

While torch.compile traces, values are not known: the older local rule applies (all-zero tensors,
and all-one tensors inside a backward pass, which torch's backward formulas build).

Example:
    >>> same_on_every_rank_checked(torch.eye(3), mesh)  # doctest: +SKIP
    True
"""
from __future__ import annotations

import functools
import hashlib
import os
import sys

import torch

from shardprop.dispatch import hooks as _hooks_mod
from shardprop.dispatch.propagate import ShardingError
from shardprop.mesh import collectives as C
from shardprop.tensor.dtensor import DTensor, make_spec
from shardprop.tensor.placement import Replicate

_Tensor = torch.Tensor
_hooks = _hooks_mod.hooks


def needs_check(t: torch.Tensor) -> bool:
    """Whether a plain tensor's values decide (floating or complex, not 0-dim).

    Example:
        >>> needs_check(torch.ones(2)), needs_check(torch.tensor([1, 2])), needs_check(torch.tensor(1.0))
        (True, False, False)
    """
    return t.ndim > 0 and (t.is_floating_point() or t.is_complex())


def digest(t: torch.Tensor) -> int:
    """A signed 63-bit digest of shape, dtype and bytes.

    Example:
        >>> digest(torch.ones(2)) == digest(torch.ones(2)), digest(torch.ones(2)) == digest(torch.zeros(2))
        (True, False)
    """
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{tuple(t.shape)}{t.dtype}".encode())
    # A fresh contiguous copy: a size-1 dim may carry any stride, which a dtype view refuses.
    data = t.detach().to("cpu").reshape(-1).clone(memory_format=torch.contiguous_format)
    h.update(data.view(torch.uint8).numpy().tobytes())
    return int.from_bytes(h.digest(), "little") >> 1


def local_rule(t: torch.Tensor) -> bool:
    """The check without communication (for traced tensors): all-zero, or all-one inside a backward pass.

    Example:
        >>> local_rule(torch.zeros(3)), local_rule(torch.randn(3))
        (True, False)
    """
    if not needs_check(t) or not bool(t.any()):
        return True
    return torch._C._current_graph_task_id() != -1 and bool((t == 1).all())


def same_on_every_rank_checked(t: torch.Tensor, mesh) -> bool:
    """Whether plain ``t`` is bit-identical on every rank of ``mesh`` (one all-gather of a digest).

    Called by every rank of the mesh for the same tensors (the decision to call depends on dtype
    and ndim only); all ranks get the same answer.

    Example:
        >>> same_on_every_rank_checked(torch.ones(4), mesh)  # doctest: +SKIP
        True
    """
    if not needs_check(t):
        return True
    if type(t) is not torch.Tensor and C.is_traced(t):
        return local_rule(t)
    device = torch.device(mesh.device_type) if mesh.device_type != "cpu" else torch.device("cpu")
    mine = torch.tensor([digest(t)], dtype=torch.int64, device=device)
    dims = tuple(range(mesh.ndim))
    if mesh.group_for(dims) is not None:
        return _all_equal(C.all_gather(mine, mesh, dims))
    # A slice of a bigger mesh may lack the group over all its dims: agree dim by dim, then
    # make every rank's verdict the same (a rank whose groups agree may sit beside one whose do not).
    ok = all([_all_equal(C.all_gather(mine, mesh, (d,))) for d in dims])  # a list: every gather runs
    flag = torch.tensor([0 if ok else 1], dtype=torch.int64, device=device)
    for d in dims:
        flag = C.all_reduce(flag, mesh, (d,), "max")
    return int(flag.item()) == 0


def _all_equal(gathered: torch.Tensor) -> bool:
    return bool((gathered == gathered[0]).all())


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
# torch's operator plumbing between a user's call and the op: not "torch's own code" making tensors.
_PLUMBING = tuple(os.path.join(_TORCH_DIR, p) for p in ("_tensor.py", "_ops.py", "overrides.py",
                                                        os.path.join("utils", "_python_dispatch.py")))


@functools.lru_cache(maxsize=None)
def _shardprop_dirs() -> tuple:
    # shardprop's three folders (shardprop/, ops/, mesh/), read at the first call (all imported by then).
    return tuple(os.path.dirname(sys.modules[m].__file__) + os.sep
                 for m in ("shardprop", "shardprop.ops", "shardprop.mesh") if m in sys.modules)


def made_by_torch() -> bool:
    """Whether the op now dispatching was called by torch's own Python code rather than the user's.

    The nearest frame outside shardprop and torch's operator plumbing decides.

    Example:
        >>> made_by_torch()  # called from a user's script  # doctest: +SKIP
        False
    """
    dirs = _shardprop_dirs()
    f = sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        if name.startswith(dirs) or name in _PLUMBING:
            f = f.f_back
            continue
        return name.startswith(_TORCH_DIR)
    return False


DIFFERS = "differs"  # joins_as_replicate's answer for a tensor torch made that differs between ranks


def joins_as_replicate(t: torch.Tensor, mesh, implicit: bool):
    """True when plain ``t`` met beside DTensors on ``mesh`` joins the op as Replicate (module doc);
    False when it is the user's (refused unchecked), ``DIFFERS`` when verified not identical.

    ``implicit``: ``implicit_replication()`` is active. Called by every rank for the same tensors.

    Example:
        >>> joins_as_replicate(torch.tensor([1, 2]), mesh, False), joins_as_replicate(torch.ones(2), mesh, True)  # doctest: +SKIP
        (True, True)
    """
    if implicit or not needs_check(t):
        return True
    # Never decide on values here: every rank must agree on whether to run the digest's collective.
    if t.numel() != 1 and torch._C._current_graph_task_id() == -1 and not made_by_torch():
        return False  # one element: torch's DTensor takes those as replicated too (ours verifies them)
    return True if same_on_every_rank_checked(t, mesh) else DIFFERS


# ---------------------------------------------------------------- plain tensors met beside DTensors
class PlainTensorError(ShardingError):
    """A plain (non-0-dim) torch.Tensor mixed with DTensors; ``run`` retries integer/bool/all-zero ones as Replicate."""


def plain_tensor_error(a, differs: bool = False) -> Exception:
    # Not a TypeError: torch turns those into NotImplemented for operators (x + t), hiding the message.
    why = ("that torch made inside the op but that is not the same on every rank" if differs else
           "(only 0-dim and one-element tensors, Python scalars, integer/bool tensors and what torch's own code "
           "makes inside an op, verified identical on every rank, join as replicated; inside "
           "shardprop.implicit_replication() plain tensors join as Replicate)")
    return PlainTensorError(
        f"shardprop: an op mixes a DTensor with a plain torch.Tensor of shape {tuple(a.shape)} {why}. Make it "
        "a DTensor first with shardprop.distribute_tensor(t, mesh, placements) or DTensor.from_local(t, mesh, "
        "placements).")


def replicate_plain_indices(args, kwargs, written=()):
    """``args``/``kwargs`` with integer and bool plain tensors wrapped as Replicate DTensors.

    torch builds such tensors itself from Python lists (``x[[1, 2]]`` becomes
    ``aten.index(x, [tensor([1, 2])])``), so they hold the same values on every rank.
    Floating ones join only when verified identical on every rank (``plain_tensors``: what
    torch's composites and backward formulas build inside an op, ``eye``, tolerances,
    zeros); one that differs between ranks raises on every rank: guessing it replicated
    would silently give a wrong result.

    Example:
        >>> replicate_plain_indices((x, [torch.tensor([1, 2])]), None)  # x a DTensor  # doctest: +SKIP
        ((x, [DTensor(... placements=[R])]), None)
    """
    mesh = first_mesh((args, kwargs))

    def conv(a, read=True):
        t = type(a)
        if t is list or t is tuple:
            return t(conv(x, read) for x in a)
        if t is dict:
            return {k: conv(v, k not in written) for k, v in a.items()}
        if isinstance(a, _Tensor) and not isinstance(a, DTensor) and a.ndim > 0:
            # An out= target is written, never read: its old values need not agree (torch.empty buffers).
            if mesh is None:
                raise plain_tensor_error(a)
            # Outside the mesh there is no one to compare with, and nothing is computed.
            check = read and mesh._coord is not None
            verdict = joins_as_replicate(a, mesh, bool(_hooks.implicit_replication)) if check else True
            if verdict is not True:
                raise plain_tensor_error(a, verdict is DIFFERS)
            spec = make_spec(mesh, (Replicate(),) * mesh.ndim, a.shape, a.stride(), a.dtype)
            return DTensor(a, spec)
        return a

    return conv(args), conv(kwargs) if kwargs else kwargs


def same_on_every_rank(t) -> bool:
    """Whether a plain tensor mixed with DTensors may be taken as replicated (see _replicate_plain_indices).

    Example:
        >>> same_on_every_rank(torch.tensor([1, 2])), same_on_every_rank(torch.randn(2))
        (True, False)
    """
    return bool(_hooks.implicit_replication) or local_rule(t)


def first_mesh(a):
    if isinstance(a, DTensor):
        return a._spec.mesh
    if type(a) in (list, tuple):
        items = a
    elif type(a) is dict:
        items = a.values()
    else:
        return None
    for x in items:
        m = first_mesh(x)
        if m is not None:
            return m
    return None
