"""Reuse of large CPU output buffers of redistribution (no caching allocator on CPU).

glibc serves large allocations with a fresh ``mmap``, so every new multi-MB output of a
collective pays one page fault per 4 KB page on first write: a 64 MB all-gather into a
fresh buffer takes about 1.5x as long as into a warm one. CUDA has a caching allocator;
CPU has none. This pool keeps the memory of outputs it handed out before and hands it out
again, but only when provably nobody else holds it.

How that is proved: the pool keeps one ``UntypedStorage`` handle per buffer and hands out a
*new* tensor on that storage each time (``set_``; never a tensor object it keeps). Every
holder of that memory, a tensor, a view, ``.data``, ``detach()``, an autograd-saved tensor,
an AsyncTensor or a c10d work still in flight, numpy, raises the storage's use count; a
holder of ``t.untyped_storage()`` (torch returns the pool's own handle object) raises that
object's Python refcount. A buffer is handed out again only when both show the pool alone. Anything unusual (torch without the count, shared memory, a resized storage, a
device other than CPU, tensors torch.compile traces) allocates normally.

Bounded: only buffers of at least ``MIN_BYTES``; at most the settings ``buffer_max_buffers`` kept and
``buffer_max_bytes`` in all; the least recently used are forgotten first (forgetting a buffer in
use is harmless: its holders keep it). Off with ``set_buffer_reuse(False)``.
"""
from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from typing import Optional, Sequence

import torch

from shardprop.mesh import compat, config
from shardprop.mesh.config import values as _settings
from shardprop.mesh.state import module_state

# Below this a fresh buffer is as fast (glibc reuses freed memory) and taking one from the pool
# costs more: measured on 4 gloo ranks, a 1 MB all-gather output is 4-11% faster fresh, a 2 MB one
# 16% faster pooled.
MIN_BYTES = 3 << 19          # 1.5 MB

# torch's count of the references to a storage (absent: never reuse).
_use_count = compat.storage_use_count
_USABLE = _use_count is not None
_lock = threading.Lock()
# storage address (StorageImpl*) -> (nbytes, UntypedStorage handle); most recently used last.
_kept: "OrderedDict[int, tuple]" = OrderedDict()


_state = module_state(kept_bytes=0)
# Tally for tests and benches: buffers handed out again, and fresh ones kept.
stats = {"reused": 0, "allocated": 0}


def set_buffer_reuse(enabled: bool, *, max_bytes: Optional[int] = None, max_buffers: Optional[int] = None) -> None:
    """Turn reuse of redistribution output buffers on or off (on by default, CPU only), and bound it.

    Off forgets every kept buffer (tensors handed out keep their memory). ``max_bytes`` and
    ``max_buffers`` bound what the pool keeps (in use or idle; default 1 GiB and 16).

    Example:
        >>> set_buffer_reuse(False); set_buffer_reuse(True, max_bytes=256 << 20)
    """
    # The watchers below forget or evict what the new settings no longer allow.
    if max_bytes is not None:
        config.set("buffer_max_bytes", max_bytes)
    if max_buffers is not None:
        config.set("buffer_max_buffers", max_buffers)
    config.set("buffer_reuse", enabled)


def _follow_settings(_value) -> None:
    with _lock:
        if not (_settings.buffer_reuse and _USABLE):
            _forget_all()
        else:
            _evict()


def buffer_reuse_enabled() -> bool:
    """Whether output buffers are reused.

    Example:
        >>> isinstance(buffer_reuse_enabled(), bool)
        True
    """
    return _settings.buffer_reuse and _USABLE


def clear() -> None:
    """Forget every kept buffer (their holders keep them).

    Example:
        >>> clear()
    """
    with _lock:
        _forget_all()


def _forget_all() -> None:
    _kept.clear()
    _state.kept_bytes = 0


def plain(t: torch.Tensor) -> bool:
    """Whether ``t`` is an eager CPU tensor whose outputs may come from the pool (not traced, not CUDA).

    Callers keep their usual code (``clone``, ``reshape``) otherwise, so traced graphs do not change.

    Example:
        >>> plain(torch.ones(1)) == buffer_reuse_enabled()
        True
    """
    return _settings.buffer_reuse and _USABLE and type(t) is torch.Tensor and t.device.type == "cpu" and not torch.compiler.is_compiling()


def empty(shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """A new contiguous tensor of ``shape`` with ``like``'s dtype and device, its memory maybe reused.

    Its values are undefined, as with ``torch.empty``. The memory is reused only when no
    tensor, view, autograd record or pending collective holds it any more.

    Example:
        >>> empty((4, 4), torch.ones(1)).shape
        torch.Size([4, 4])
    """
    shape = tuple(shape)
    n = 1
    for s in shape:
        n *= s
    nbytes = n * like.element_size()
    if nbytes < MIN_BYTES or not plain(like):
        return like.new_empty(shape)
    storage = _take(nbytes)
    out = torch.empty(0, dtype=like.dtype, device=like.device)
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return out.set_(storage, 0, shape, tuple(reversed(strides)))


def empty_like(t: torch.Tensor) -> torch.Tensor:
    """:func:`empty` of ``t``'s shape (contiguous), dtype and device.

    Example:
        >>> empty_like(torch.ones(3)).shape
        torch.Size([3])
    """
    return empty(t.shape, t)


def _python_refs(handle) -> int:
    return sys.getrefcount(handle)


def _python_refs_in_loop(kept) -> int:
    """What ``_take``'s loop sees as the Python refcount of a kept handle nobody else references."""
    for _, (_, handle) in kept.items():
        return _python_refs(handle)
    return -1


# The Python references the pool itself holds to a handle while ``_take`` looks at it (the dict's
# tuple, the loop's name, the call's argument), measured once by the same loop and call: torch keeps
# one Python object per storage, so ``t.untyped_storage()`` held by a user is the pool's own handle
# and shows only here. Every tensor, view, saved tensor or pending work on the memory shows in the
# storage's use count instead (1: the handle alone).
_OWN_REFS = _python_refs_in_loop(OrderedDict([(0, (0, object()))]))


def _take(nbytes: int) -> torch.UntypedStorage:
    """A storage of ``nbytes`` nobody holds, kept by the pool (a fresh one if none is free)."""
    with _lock:
        for key, (size, storage) in _kept.items():
            if size != nbytes:
                continue
            if _use_count(storage._cdata) == 1 and _python_refs(storage) == _OWN_REFS:
                # A resized or shared storage is not what was kept: forget it.
                if storage.nbytes() != size or storage.is_shared():
                    del _kept[key]
                    _state.kept_bytes -= size
                    break
                _kept.move_to_end(key)
                stats["reused"] += 1
                return storage
        storage = torch.UntypedStorage(nbytes)
        stats["allocated"] += 1
        _kept[storage._cdata] = (nbytes, storage)
        _state.kept_bytes += nbytes
        _evict()
        return storage


def _evict() -> None:
    """Forget the least recently used buffers beyond the bounds (under the lock)."""
    while _kept and (len(_kept) > _settings.buffer_max_buffers or _state.kept_bytes > _settings.buffer_max_bytes):
        _, (size, _) = _kept.popitem(last=False)
        _state.kept_bytes -= size


def idle_bytes() -> int:
    """Bytes the pool keeps that nobody else holds (memory kept for reuse, not in use).

    What a memory measurement leaves out to count tensors in use, as torch's
    ``memory_allocated`` leaves out its caching allocator's reserve.

    Example:
        >>> idle_bytes() >= 0
        True
    """
    with _lock:
        return sum(size for size, storage in _kept.values()
                   if _use_count(storage._cdata) == 1 and _python_refs(storage) == _OWN_REFS)


def holds(t: torch.Tensor) -> int:
    """1 if the pool keeps ``t``'s memory (one extra reference to its storage), else 0.

    Example:
        >>> holds(torch.ones(2))
        0
    """
    if not _kept:
        return 0
    return 1 if t.untyped_storage()._cdata in _kept else 0


for _name in ("buffer_reuse", "buffer_max_bytes", "buffer_max_buffers"):
    config.watch(_name, _follow_settings)
