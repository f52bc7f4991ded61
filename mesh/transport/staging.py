"""Which collectives a backend runs on a device's memory, and staging through host memory where it cannot.

Why: gloo reads and writes raw pointers. For CUDA tensors it has its own code only in some
calls; ProcessGroupGloo (torch 2.11 to 2.15) has CUDA work for allreduce, broadcast, allgather
(``all_gather_into_tensor`` goes through it), gather, scatter, reduce and alltoall, and none
for send/recv: handed a CUDA pointer, the socket write fails (``writev ... Bad address``), gloo's
pair dies and the peers wait forever. So each call is looked up in :data:`TABLE` by
``(backend, device type)``; where it says :data:`STAGE`, ``collectives.py`` copies the tensors
to host memory, runs the call there (on the CPU paths: direct messages, shared memory) and
copies the result back. :data:`UNSUPPORTED` raises a clear error before anything is posted.

Routes (``-`` = not listed: :data:`DIRECT`, the backend is trusted):

==========  ======  ==========  ==============  ==========  =========  =======  ================  =========
backend     device  all_reduce  reduce_scatter  all_gather  broadcast  scatter  all_gather_views  send_recv
==========  ======  ==========  ==============  ==========  =========  =======  ================  =========
gloo        cpu     direct      direct          direct      direct     direct   direct            direct
gloo        cuda    direct      stage           direct      direct     direct   stage             stage
nccl        cuda    direct      direct          direct      direct     direct   direct            direct
nccl        cpu     unsupported (NCCL carries CUDA memory only)
==========  ======  ==========  ==============  ==========  =========  =======  ================  =========

``all_to_all`` on gloo/cuda is staged too: gloo has CUDA alltoall work, but no GPU run has
exercised it with shardprop's uneven splits; staging costs what gloo's own CUDA paths cost
(they copy through host memory as well). The uneven all-to-all of ``uneven_all_to_all.py``
(MoE token routing: its size exchange and its rows) goes through the same ``all_to_all`` call,
so it takes this route too.

Testing without a GPU: :func:`force` (or ``SHARDPROP_FORCE_STAGING=cuda|all``) makes CPU
tensors on gloo take the gloo/cuda routes (``cuda``) or stage every call (``all``).

Example:
    >>> route("send_recv", "cuda", "gloo")
    'stage'
    >>> route("all_reduce", "cuda", "gloo")
    'direct'
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Iterator, Optional, Tuple

import torch
import torch.distributed as dist

from shardprop.mesh import config
from shardprop.mesh.config import values as _settings
from shardprop.mesh.state import module_state

DIRECT, STAGE, UNSUPPORTED = "direct", "stage", "unsupported"
CALLS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "scatter", "all_gather_views",
         "send_recv")

# (backend, device type) -> {call: route}; calls not listed are DIRECT. Rows not listed: DIRECT.
TABLE: Dict[Tuple[str, str], Dict[str, str]] = {
    ("gloo", "cuda"): {"reduce_scatter": STAGE, "all_to_all": STAGE, "all_gather_views": STAGE, "send_recv": STAGE},
    ("nccl", "cpu"): {c: UNSUPPORTED for c in CALLS},
}

_MODES = ("", "cuda", "all")


_state = module_state(inside=0)  # > 0 while a staged call runs its host copy (never staged again)
# Staged calls by kind since the last ``stats.clear()`` (tests check that staging really ran).
stats: Dict[str, int] = {}


def route(call: str, device_type: str, backend: str) -> str:
    """How ``call`` runs on a tensor of ``device_type`` over a group of ``backend``: direct, stage or unsupported.

    ``backend`` may be a device map as torch writes it (``"cpu:gloo,cuda:nccl"``).

    Example:
        >>> route("reduce_scatter", "cuda", "cpu:gloo,cuda:nccl")
        'direct'
    """
    if call not in CALLS:
        raise ValueError(f"shardprop staging: unknown call {call!r}; calls are {CALLS}")
    return TABLE.get((backend_of(backend, device_type), device_type), {}).get(call, DIRECT)


def backend_of(backend: str, device_type: str) -> str:
    """The backend that carries ``device_type`` in a backend string (plain or ``"cpu:gloo,cuda:nccl"``).

    Example:
        >>> backend_of("cpu:gloo,cuda:nccl", "cpu")
        'gloo'
    """
    backend = str(backend).lower()
    if ":" not in backend:
        return backend
    pairs = dict(p.split(":", 1) for p in backend.split(",") if ":" in p)
    return pairs.get(device_type, next(iter(pairs.values()), backend))


_group_backend: dict = {}


def group_backend(group) -> str:
    """The backend string of a process group (cached; None: the default group).

    Example:
        >>> group_backend(mesh.get_group(0))  # doctest: +SKIP
        'gloo'
    """
    hit = _group_backend.get(group)
    if hit is None:
        if len(_group_backend) > 1024:
            _group_backend.clear()
        hit = _group_backend[group] = str(dist.get_backend(group))
    return hit


def forced() -> str:
    """The forced mode now in effect: ``""`` (off), ``"cuda"`` or ``"all"`` (off inside a staged call's host copy).

    Example:
        >>> forced() in ("", "cuda", "all")
        True
    """
    return _settings.force_staging if not _state.inside else ""


def force(mode: str) -> str:
    """Make CPU tensors on gloo take the gloo/cuda routes (``"cuda"``), stage every call (``"all"``), or not (``""``).

    Returns the previous mode. For tests: the staged path runs without a GPU.

    Example:
        >>> old = force("all"); force(old)
        'all'
    """
    if mode not in _MODES:
        raise ValueError(f"shardprop staging: mode {mode!r}; want one of {_MODES}")
    return config.set("force_staging", mode)


def decide(call: str, t: torch.Tensor, group) -> str:
    """The route of ``call`` on ``t`` over ``group``, with the forced mode applied (callers check ``is_cpu`` first).

    Example:
        >>> decide("send_recv", torch.ones(1), None)  # doctest: +SKIP
        'direct'
    """
    device = t.device.type
    mode = forced()
    if device == "cpu" and mode:
        if backend_of(group_backend(group), "cpu") != "gloo":
            return DIRECT
        r = STAGE if mode == "all" else route(call, "cuda", "gloo")
    else:
        r = route(call, device, group_backend(group))
    if r == STAGE:
        stats[call] = stats.get(call, 0) + 1
    if r == UNSUPPORTED:
        raise RuntimeError(f"shardprop: {call} of a {device} tensor ({tuple(t.shape)}, {t.dtype}) on a "
                           f"{group_backend(group)} process group: that backend cannot carry {device} memory. "
                           "Use a CUDA mesh for NCCL (tensors on the GPU), or a gloo group for CPU tensors.")
    return r


@contextmanager
def host_call() -> Iterator[None]:
    """Inside: the host copies of a staged call are never staged again (forced mode off).

    Example:
        >>> with host_call():
        ...     forced()
        ''
    """
    _state.inside += 1
    try:
        yield
    finally:
        _state.inside -= 1


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A contiguous host copy of ``t`` (always a new tensor, also for a CPU ``t``: the forced path copies too).

    Example:
        >>> to_host(torch.ones(2)).device.type
        'cpu'
    """
    return torch.empty(t.shape, dtype=t.dtype, device="cpu").copy_(t)


def host_empty(like: torch.Tensor, shape: Optional[Tuple[int, ...]] = None) -> torch.Tensor:
    """An uninitialised host tensor of ``like``'s dtype (and shape unless given).

    Example:
        >>> host_empty(torch.ones(2, 3)).shape
        torch.Size([2, 3])
    """
    return torch.empty(like.shape if shape is None else shape, dtype=like.dtype, device="cpu")


def to_device(h: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A new tensor on ``like``'s device holding host tensor ``h``.

    Example:
        >>> to_device(torch.ones(2), torch.zeros(1)).tolist()
        [1.0, 1.0]
    """
    return torch.empty(h.shape, dtype=h.dtype, device=like.device).copy_(h)


__all__ = ["CALLS", "DIRECT", "STAGE", "TABLE", "UNSUPPORTED", "backend_of", "decide", "force", "forced",
           "group_backend", "host_call", "host_empty", "route", "stats", "to_device", "to_host"]
