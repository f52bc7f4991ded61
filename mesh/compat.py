"""Everything that differs between the torch releases shardprop supports, probed once at import.

shardprop supports torch 2.11 through 2.15 (``SUPPORTED``). What changes between those releases
lives here and nowhere else; every other module imports the names it needs from this one:

- op names that come and go (2.15 removed ``aten.cholesky``, for instance): :func:`aten_ops`
  builds op tables from what the running torch has;
- the single-buffer collectives (``all_gather_single`` in 2.13+, ``all_gather_into_tensor``
  before), ``dist.split_group``, torch's private storage use count;
- the opaque-type API that lets a mesh be a value in a compiled graph: 2.11 wants the class to
  use torch's ``OpaqueBaseMeta``; 2.14 renamed ``register_opaque_type(typ="value")`` to
  ``register_custom_class(typ="constant")`` and warns on the old name.

Feature probes (``getattr`` on the module that may have a name) rather than version strings,
except for the declared range itself.

Example:
    >>> from shardprop.mesh import compat
    >>> compat.torch_release() >= (2, 11)
    True
"""
from __future__ import annotations

import functools
import importlib
import re
import warnings
from typing import Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from shardprop.mesh import config

# ------------------------------------------------------------------ the declared range
SUPPORTED: Tuple[Tuple[int, int], Tuple[int, int]] = ((2, 11), (2, 15))
# Set to 1 to import on a torch outside SUPPORTED anyway (a warning instead of an error).
ALLOW_ANY_TORCH_ENV = config.BY_NAME["allow_any_torch"].env


def torch_release(version: Optional[str] = None) -> Tuple[int, int]:
    """(major, minor) of a torch version string, by default the running torch's.

    Example:
        >>> torch_release("2.15.0+cu130")
        (2, 15)
    """
    text = torch.__version__ if version is None else version
    m = re.match(r"(\d+)\.(\d+)", str(text))
    if m is None:
        raise ImportError(f"shardprop: cannot read torch's version {text!r}")
    return int(m.group(1)), int(m.group(2))


def running_torch() -> str:
    """The running torch's version string, as messages name it (e.g. ``2.15.0+cu132``)."""
    return torch.__version__


def range_text() -> str:
    """The supported range as people write it, e.g. ``torch 2.11 to 2.15``."""
    (a, b), (c, d) = SUPPORTED
    return f"torch {a}.{b} to {c}.{d}"


def check_torch_release(version: Optional[str] = None) -> None:
    """Raise ImportError at once when the running torch is outside the range shardprop is tested on.

    ``SHARDPROP_ALLOW_ANY_TORCH=1`` turns the error into a warning (at your own risk).

    Example:
        >>> check_torch_release("2.13.0")
        >>> check_torch_release("2.4.1")  # doctest: +SKIP
        ImportError: shardprop supports torch 2.11 to 2.15; this is torch 2.4.1 ...
    """
    text = running_torch() if version is None else version
    release = torch_release(text)
    if SUPPORTED[0] <= release <= SUPPORTED[1]:
        return
    message = (f"shardprop supports {range_text()}; this is torch {text}. Install a torch in that range "
               f"(e.g. pip install 'torch>={SUPPORTED[0][0]}.{SUPPORTED[0][1]},"
               f"<{SUPPORTED[1][0]}.{SUPPORTED[1][1] + 1}'), or set {ALLOW_ANY_TORCH_ENV}=1 to try anyway.")
    if config.values.allow_any_torch:
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        return
    raise ImportError(message)


check_torch_release()

# ------------------------------------------------------------------ op tables
_aten = torch.ops.aten


# Libraries torch defines in Python modules it imports only on first use (absent modules: no ops).
_LIBRARY_MODULES = {"torch_nn": "torch.nn.modules.linear_cross_entropy"}  # 2.15: linear_cross_entropy


def _library(namespace: str):
    module = _LIBRARY_MODULES.get(namespace)
    if module is not None:
        try:
            importlib.import_module(module)
        except ImportError:
            pass
    return getattr(torch.ops, namespace)


def aten_ops(names: Iterable[str], overloads: Optional[Sequence[str]] = None, namespace: str = "aten") -> List:
    """The OpOverloads of the named ops that this torch has; absent names are skipped.

    ``overloads=None`` takes every overload of each op; otherwise only the named ones that exist.
    ``namespace`` reaches other libraries torch ships (2.15's ``torch_nn``, say).

    Example:
        >>> aten_ops(["relu", "no_such_op"], ["default"])
        [<OpOverload(op='aten.relu', overload='default')>]
    """
    library = _aten if namespace == "aten" else _library(namespace)
    out = []
    for name in names:
        packet = getattr(library, name, None)
        if packet is None:
            continue
        available = packet.overloads()
        wanted = available if overloads is None else [o for o in overloads if o in available]
        out += [getattr(packet, o) for o in wanted]
    return out


def aten_packets(names: Iterable[str]) -> List:
    """The aten op packets of ``names`` that this torch has, in order.

    Example:
        >>> [str(p) for p in aten_packets(["mm", "no_such_op"])]
        ['aten.mm']
    """
    return [p for p in (getattr(_aten, n, None) for n in names) if p is not None]


# ------------------------------------------------------------------ collectives and private helpers
# 2.13 names the single-buffer collectives *_single and warns on the old names; 2.11/2.12 have only the old.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# One call that splits many sub-groups off the default communicator (NCCL); None where absent.
split_group = getattr(dist, "split_group", None)


def register_fake_backend() -> None:
    """Make c10d's ``"fake"`` backend known, for a mesh dim given ``backend_override="fake"``.

    torch registers it on import of its testing module ``fake_pg``, which its own FSDP imports, so
    torchtitan (whose size-1 dims are fake) gets it for free under torch, and not under us.

    Example:
        >>> register_fake_backend()
        >>> "FAKE" in dist.Backend._plugins
        True
    """
    if "FAKE" not in getattr(dist.Backend, "_plugins", {}):
        import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake" on import)


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (a checkpoint recomputation runs inside one).

    Example:
        >>> in_backward()
        False
    """
    return torch._C._current_graph_task_id() != -1


@functools.lru_cache(maxsize=None)
def grouped_mm_runs(device_type: str, dtype: torch.dtype, traced: bool = False) -> bool:
    """Whether ``torch._grouped_mm`` runs here: on ``device_type`` in ``dtype``, or (``traced``) on meta
    tensors, as torch.compile's fake tensors need (2.11's meta kernel takes bf16 only; 2.15's any dtype).

    Example:
        >>> isinstance(grouped_mm_runs("cpu", torch.float32), bool)
        True
    """
    # The probe runs once per process, beneath the dispatch modes: a selective-checkpoint policy that saw
    # its ops in a forward but not in the recomputation (cached by then) would find the two sequences differ.
    return beneath_dispatch_modes(_grouped_mm_probe)(device_type, dtype, traced)


def _grouped_mm_probe(device_type: str, dtype: torch.dtype, traced: bool) -> bool:
    fn = getattr(torch, "_grouped_mm", None)
    if fn is None or (device_type == "cuda" and not torch.cuda.is_available()):
        return False
    device = "meta" if traced else device_type
    try:
        a = torch.zeros(4, 8, dtype=dtype, device=device)
        b = torch.zeros(2, 8, 8, dtype=dtype, device=device)
        fn(a, b, offs=torch.tensor([2, 4], dtype=torch.int32, device=device))
        return True
    except Exception:  # any refusal (dtype, device, alignment, missing kernel) means: use the loop
        return False


def skip_frame(dynamo, code) -> None:
    """Tell dynamo never to compile frames of ``code`` (``eval_frame.skip_code``; a no-op where absent).

    Example:
        >>> skip_frame(None, skip_frame.__code__)  # without dynamo: nothing to do
    """
    skip = getattr(getattr(dynamo, "eval_frame", None), "skip_code", None)
    if skip is not None:
        skip(code)


def group_by_name(name: str):
    """The process group torch registered under ``name`` (private in every release; a clear error where absent).

    Example:
        >>> group_by_name(dist.group.WORLD.group_name)  # doctest: +SKIP
    """
    c10d = dist.distributed_c10d
    resolve = getattr(c10d, "_resolve_process_group", None)  # 2.11-2.15: c10d's registry (C++)
    if resolve is not None:
        return resolve(name)
    names = getattr(getattr(c10d, "_world", None), "pg_names", None)  # the Python side's {group: name}
    for group, group_name in (names or {}).items():
        if group_name == name:
            return group
    raise NotImplementedError(f"this torch cannot look a process group up by name ({name!r}); pass the group itself")


# torch's count of the references to a storage (private; None where absent: never guess "sole owner").
storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


def storage_unshared(t: torch.Tensor) -> bool:
    """Whether no other tensor shares ``t``'s memory: no view, no ``detach()`` alias, no copy that a
    selective-checkpoint policy or autograd saved. Only then may shardprop write into ``t`` in place.

    Python references to ``t`` itself are the caller's to rule out; where torch cannot count
    (the private count is absent), the answer is False: never guess "sole owner".

    Example:
        >>> t = torch.ones(3); storage_unshared(t)
        True
        >>> alias = t.detach(); storage_unshared(t)
        False
    """
    if storage_use_count is None or t._base is not None:
        return False
    # ``t``'s own reference and the storage object made here.
    return storage_use_count(t.untyped_storage()._cdata) == 2


# Dispatch modes (torch's selective activation checkpointing, a user's TorchDispatchMode) see the aten
# ops run outside any __torch_dispatch__. shardprop's transport (collectives, redistribution programs)
# runs beneath them, as everything inside DTensor dispatch already does: a mode then sees the same ops
# on the engine path and on a fast path (the compute, not the plumbing), and a checkpoint policy can
# neither cache and replay a collective or a write into one of our buffers (replayed, it would leave
# the buffer unwritten) nor count our internal copies. Tracing modes (fake, proxy, functional) still see
# everything: torch.compile must record the collectives.
_dispatch_stack_len = torch._C._len_torch_dispatch_stack
_INFRA_KEYS = tuple(getattr(torch._C._TorchDispatchModeKey, k) for k in ("FAKE", "PROXY", "FUNCTIONAL")
                    if hasattr(torch._C._TorchDispatchModeKey, k))
_get_infra_mode = torch._C._get_dispatch_mode


def _tracing_mode_active() -> bool:
    return any(_get_infra_mode(k) is not None for k in _INFRA_KEYS)


def beneath_dispatch_modes(fn):
    """``fn`` run with the user's dispatch modes set aside (none active: called as is, one C call).

    Example:
        >>> run = beneath_dispatch_modes(torch.add)
        >>> run(torch.ones(1), 1)
        tensor([2.])
    """
    from torch.utils._python_dispatch import _disable_current_modes

    @functools.wraps(fn)
    def beneath(*args, **kwargs):
        if not _dispatch_stack_len() or _tracing_mode_active():
            return fn(*args, **kwargs)
        with _disable_current_modes():
            return fn(*args, **kwargs)
    return beneath


# The fused CPU attention kernel and its backward (ring attention's per-block compute); None where absent.
cpu_flash_attention = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
cpu_flash_attention_backward = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)

# ------------------------------------------------------------------ compile: a mesh as an opaque value
# The base class of compile's opaque types: its metaclass lets a FakeScriptObject pass isinstance
# checks. 2.11 insists on it for value types; 2.14 renamed it (and warns on the old module).
try:
    from torch._custom_class_base import CustomClassBase as OpaqueValueBase
except ImportError:
    try:
        from torch._opaque_base import OpaqueBase as OpaqueValueBase
    except ImportError:  # pragma: no cover - outside the supported range
        OpaqueValueBase = object


def register_opaque_value(cls: type, read_members=()) -> None:
    """Let instances of ``cls`` be constants in compiled graphs, guarded by ``==``, named by ``__fx_repr__``.

    ``read_members`` (attributes and methods that only read the object) are evaluated on the real object
    while tracing and baked in: 2.11's dynamo refuses any member not registered so ("Member 'size' is not
    registered for this opaque object type"), later releases inline them. Raises whatever this torch
    raises when it cannot (callers decide how loud to be).

    Example:
        >>> register_opaque_value(DeviceMesh, ("size", "ndim"))  # doctest: +SKIP
    """
    from torch._library import opaque_object

    use_real = getattr(getattr(opaque_object, "MemberType", None), "USE_REAL", None)
    members = {name: use_real for name in read_members} if use_real is not None else None
    register_custom_class = getattr(opaque_object, "register_custom_class", None)
    if register_custom_class is not None:  # 2.14+: "value" is now "constant" (the old names warn)
        if not opaque_object.is_custom_class(cls):
            register_custom_class(cls, typ="constant", members=members)
    elif not opaque_object.is_opaque_type(cls):
        opaque_object.register_opaque_type(cls, typ="value", members=members)


def _value_types_need_base() -> bool:
    """Whether this torch wants value-type opaque classes to use ``OpaqueValueBase`` (2.11 wants it of every
    opaque class; later releases exempt value types). Probed by registering a throwaway value class."""
    class _Probe:  # a valid value type wherever the base is not required
        def __eq__(self, other):
            return isinstance(other, _Probe)

        def __hash__(self):
            return 0

        def __fx_repr__(self):
            return "None", {}

    try:
        register_opaque_value(_Probe)
    except TypeError as e:
        return "Base" in str(e)
    except Exception:  # noqa: BLE001 - no opaque types at all: nothing to derive from
        return False
    return False


# The base of shardprop's placements: compile's opaque base where value types need it (2.11), else object,
# whose subclasses keep CPython's fast ``isinstance`` (the base's metaclass answers it in Python).
PLACEMENT_BASE = OpaqueValueBase if _value_types_need_base() else object


def dynamo_traces_redistribute_of(cls: type) -> None:
    """Let dynamo trace ``x.redistribute(...)`` of ``cls`` instances as ordinary Python.

    torch 2.11's dynamo rewrites every tensor's ``.redistribute(...)`` into one call whose arguments
    must be Python constants, written for torch's own DTensor; shardprop's placements are frozen
    dataclasses, which that dynamo cannot make constants (``can't reconstruct arbitrary frozen
    dataclass instances``). For ``cls`` alone this steps aside, so dynamo treats the call like any
    tensor method, as 2.12+ does; other tensors keep torch's handling. No-op where absent (2.12+).

    Example:
        >>> dynamo_traces_redistribute_of(DTensor)  # doctest: +SKIP
    """
    from torch._dynamo.variables.tensor import TensorVariable

    original = TensorVariable.__dict__.get("method_redistribute")
    if original is None or getattr(original, "steps_aside_for", None) is not None:
        return

    def method_redistribute(self, tx, *args, **kwargs):
        if issubclass(self.python_type(), cls):
            return None  # falls through to dynamo's generic tensor-method path
        return original(self, tx, *args, **kwargs)

    method_redistribute.steps_aside_for = cls
    TensorVariable.method_redistribute = method_redistribute


def dynamo_answers_hasattr_of(cls: type) -> None:
    """Let ``hasattr(x, "to_local")`` (and ``getattr`` with a default) on ``cls`` instances answer inside
    compiled code as in eager.

    dynamo models a tensor's method as a generic attribute and answers ``hasattr`` False for every method
    of a tensor subclass (torch's own DTensor included), so duck-typed user code (``hasattr(t,
    "full_tensor")``) takes its other branch under ``torch.compile`` only. For ``cls`` alone, a name the
    class defines (a method, property or class attribute: read statically, never run) answers True, guarded
    on the type; every other tensor and name keeps dynamo's own answer.

    Example:
        >>> dynamo_answers_hasattr_of(DTensor)  # doctest: +SKIP
    """
    import inspect

    from torch._dynamo.variables.tensor import TensorVariable

    original = TensorVariable.__dict__.get("call_obj_hasattr")
    if original is None or getattr(original, "answers_for", None) is not None:
        return

    def call_obj_hasattr(self, tx, name):
        typ = self.python_type()
        if isinstance(typ, type) and issubclass(typ, cls):
            try:
                inspect.getattr_static(typ, name)
            except AttributeError:
                return original(self, tx, name)
            from torch._dynamo.guards import GuardBuilder, install_guard
            from torch._dynamo.variables.constant import ConstantVariable
            if self.source:
                install_guard(self.source.make_guard(GuardBuilder.TYPE_MATCH))
            return ConstantVariable.create(True)
        return original(self, tx, name)

    call_obj_hasattr.answers_for = cls
    TensorVariable.call_obj_hasattr = call_obj_hasattr
