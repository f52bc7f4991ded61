"""Process groups: default-group start-up, timeouts, and one cache of sub-groups.

Communicator creation is expensive and collective (every rank must take part, in
the same order), so groups are created once, eagerly, when a mesh is built, and
kept in a cache keyed by their rank list. Later meshes over the same ranks reuse
them; nothing creates a group lazily inside a collective call.
"""
from __future__ import annotations

import collections.abc
import datetime
import itertools
import os
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from shardprop.mesh import compat, config
from shardprop.mesh.config import values as _settings


# cache_key(backend, ranks) -> ProcessGroup, or None on ranks outside the group (NCCL splits).
_group_cache: Dict[Tuple[str, Tuple[int, ...]], Optional[dist.ProcessGroup]] = {}


def set_collective_timeout(seconds: float) -> None:
    """Set the timeout of process groups created from now on.

    A collective that a peer never joins (it died, or diverged) fails after this
    long instead of hanging.

    Example:
        >>> set_collective_timeout(30)
    """
    config.set("collective_timeout", seconds)


def collective_timeout() -> datetime.timedelta:
    """The timeout given to new process groups and to explicit waits.

    Example:
        >>> collective_timeout().total_seconds() > 0
        True
    """
    return datetime.timedelta(seconds=_settings.collective_timeout)


# Backends whose groups we create ourselves (gloo on CPU, NCCL on CUDA). A default group that
# names neither (torch's "fake" backend for dry runs, MPI, UCC, a vendor's) may live on a store
# that cannot host a gloo group (FakeStore: c10d asserts "Not implemented"), so mesh groups then
# follow the default group's backend instead.
_OURS = ("gloo", "nccl")


def default_backends() -> Dict[str, str]:
    """``{device type: backend}`` of the default group (``{}`` before it exists).

    Example:
        >>> default_backends()  # after init_process_group("cpu:gloo,cuda:nccl")  # doctest: +SKIP
        {'cpu': 'gloo', 'cuda': 'nccl'}
    """
    if not dist.is_initialized():
        return {}
    # get_backend names every device's backend of a mixed group ("cpu:gloo,cuda:nccl"), as given.
    text = str(dist.get_backend()).lower()
    if text == "undefined":  # init_process_group() without a backend: torch's per-device defaults
        text = str(dist.get_backend_config()).lower()
    if ":" not in text:  # one backend for every device ("gloo", "fake")
        return {"*": text}
    pairs = (item.split(":", 1) for item in text.split(",") if ":" in item)
    return {dev.strip(): be.strip() for dev, be in pairs}


def follows_default(backend: str) -> bool:
    """Whether groups of ``backend`` are created with the default group's backend (not one we name).

    Example:
        >>> follows_default("gloo")
        False
    """
    return backend not in _OURS


def backend_for(device_type: str) -> str:
    """The c10d backend of a mesh's groups for a device type: NCCL on CUDA, gloo otherwise.

    A CUDA mesh in a world whose default group has no NCCL (``init_process_group("gloo")``, as
    for several ranks sharing one GPU: NCCL refuses two ranks on one device) gets gloo groups;
    collectives then stage what gloo cannot carry on the GPU through host memory (mesh/transport/staging.py).
    Mixed defaults (``"cpu:gloo,cuda:nccl"``) give gloo to CPU meshes and NCCL to CUDA ones. A
    default group naming neither gloo nor NCCL (``"fake"``, ``"mpi"``, ...) is followed: the name
    returned is its backend, and groups are created without naming one (:func:`follows_default`).

    Example:
        >>> backend_for("cpu")
        'gloo'
    """
    known = default_backends()
    if known and not any(b in _OURS for b in known.values()):
        return known.get(device_type, known.get("*", next(iter(known.values()))))
    if device_type != "cuda":
        return "gloo"
    if known and "nccl" not in known.values():
        return "gloo"
    return "nccl"


def check_nccl_devices(world_per_host: int, devices: int) -> None:
    """Raise a clear error when ranks on one host outnumber its GPUs for NCCL (which refuses shared GPUs).

    Example:
        >>> check_nccl_devices(4, 8)
        >>> check_nccl_devices(4, 1)  # doctest: +SKIP
        RuntimeError: shardprop: 4 ranks per host on 1 CUDA device(s) ...
    """
    if devices < 1:
        raise RuntimeError("shardprop: a CUDA mesh needs a CUDA device, and torch.cuda.device_count() is 0 "
                           "(use device_type 'cpu', or a CUDA build of torch on a machine with a GPU)")
    if world_per_host > devices:
        raise RuntimeError(
            f"shardprop: {world_per_host} ranks per host on {devices} CUDA device(s): NCCL needs one GPU per rank "
            "(it fails with 'Duplicate GPU detected'). Start the default group with gloo instead "
            "(ensure_default_group('cuda', backend='gloo') or init_process_group('gloo')): the ranks then share "
            "the GPUs, CUDA tensors travel over gloo, point-to-point moves staged through host memory.")


def ensure_default_group(device_type: str, backend: Optional[str] = None) -> None:
    """Initialise the default process group from the environment if needed.

    Reuses an existing default group. On CUDA the group is initialised eagerly
    with ``device_id`` so sub-groups can be split from its communicator.
    ``backend="gloo"`` on CUDA: ranks may share GPUs (see :func:`backend_for`).

    Example:
        >>> ensure_default_group("cpu")  # doctest: +SKIP
    """
    if dist.is_initialized():
        return
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            "shardprop: the default process group is not initialised and the environment "
            f"lacks {missing}; launch with torchrun or call torch.distributed.init_process_group first"
        )
    kwargs = {}
    backend = backend or backend_for(device_type)
    if device_type == "cuda":
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        check_nccl_devices(local_world if backend == "nccl" else 1, torch.cuda.device_count())
        local_rank = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        if backend == "nccl":
            kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(backend=backend, timeout=collective_timeout(), **kwargs)


def create_groups(all_rank_lists: Iterable[Sequence[int]], backend: str, *, named: bool = False,
                  options=None) -> Optional[dist.ProcessGroup]:
    """Create (or reuse) one group per rank list; return the one holding this rank.

    Every rank must call this with the same lists in the same order: group creation is
    collective over the default group. On NCCL the lists (one partition of the ranks) are split
    from the default communicator in one call. (On the fake backend meshes take
    :func:`create_group`, which only the members call.) ``named=True`` creates the groups with
    ``backend`` even where the default group's backend would be followed (a mesh dim's
    ``backend_override``, e.g. ``"fake"``); ``options`` are c10d's backend options, passed on.

    Example:
        >>> create_groups([[0, 1], [2, 3]], "nccl")  # doctest: +SKIP
    """
    me = dist.get_rank()
    keys = [cache_key(backend, ranks) for ranks in all_rank_lists]
    todo = [k for k in keys if k not in _group_cache]
    if todo and backend == "nccl" and compat.split_group is not None:
        extra = {"pg_options": options} if options is not None else {}
        split = compat.split_group(split_ranks=[list(k[1]) for k in todo], timeout=collective_timeout(), **extra)
        for k in todo:
            _group_cache[k] = split if me in k[1] else None
    else:
        name = backend if named or not follows_default(backend) else None
        extra = {"pg_options": options} if options is not None else {}
        if name == "fake":
            compat.register_fake_backend()
        for k in todo:
            _group_cache[k] = dist.new_group(list(k[1]), timeout=collective_timeout(), backend=name, **extra)
    for k in keys:
        if me in k[1]:
            return _group_cache[k]
    return None


class RankRange(collections.abc.Sequence):
    """Evenly spaced ranks held as a ``range`` (O(1) memory) that compares and prints like a list.

    A mesh of 65,536 ranks keeps its group over every dim as ``RankRange(range(0, 65536))``
    instead of a Python int per rank. Equal to any list, tuple or range with the same ranks.

    Example:
        >>> RankRange(range(0, 6, 2)) == [0, 2, 4]
        True
    """

    __slots__ = ("span",)
    __hash__ = None  # as a list's: equal to lists, so never a dict key (cache_key uses the range)

    def __init__(self, span: range):
        self.span = span

    def __len__(self) -> int:
        return len(self.span)

    def __getitem__(self, i):
        return list(self.span[i]) if isinstance(i, slice) else self.span[i]

    def __iter__(self):
        return iter(self.span)

    def __contains__(self, r) -> bool:
        return r in self.span

    def index(self, r, *args) -> int:
        return self.span.index(r, *args)

    def __eq__(self, other) -> bool:
        if isinstance(other, RankRange):
            return self.span == other.span
        if isinstance(other, (list, tuple, range)):
            return len(other) == len(self.span) and all(a == b for a, b in zip(self.span, other))
        return NotImplemented

    def __add__(self, other) -> list:
        return list(self.span) + list(other)

    def __radd__(self, other) -> list:
        return list(other) + list(self.span)

    def __repr__(self) -> str:
        return repr(list(self.span)) if len(self.span) <= 16 else f"RankRange({self.span!r})"


def ascending(ranks) -> bool:
    """Whether ``ranks`` are in ascending order (O(1) for a :class:`RankRange`).

    Example:
        >>> ascending([0, 2, 1]), ascending(RankRange(range(0, 8)))
        (False, True)
    """
    if isinstance(ranks, RankRange):
        return ranks.span.step > 0
    return all(a < b for a, b in zip(ranks, ranks[1:]))


# Lists shorter than this stay plain lists (small meshes: nothing changes for them).
_COMPACT_FROM = 64


def compact(ranks) -> Sequence[int]:
    """``ranks`` (a 1-d tensor or a sequence) as a :class:`RankRange` when long and evenly spaced, else a list.

    Example:
        >>> compact(list(range(0, 256, 2))) == list(range(0, 256, 2)), compact([0, 1, 3])
        (True, [0, 1, 3])
    """
    if isinstance(ranks, RankRange):
        return ranks
    if isinstance(ranks, range):
        return RankRange(ranks) if len(ranks) >= _COMPACT_FROM else list(ranks)
    t = torch.as_tensor(ranks, dtype=torch.int64).flatten()
    n = t.numel()
    if n >= _COMPACT_FROM:
        step = int(t[1] - t[0])
        if step > 0 and bool((t.diff() == step).all()):
            return RankRange(range(int(t[0]), int(t[0]) + step * n, step))
    return t.tolist()


def cache_key(backend: str, ranks) -> Tuple[str, object]:
    """The key of the group over ``ranks`` in the group cache: a ``range`` when long and evenly spaced, else a tuple.

    Example:
        >>> cache_key("gloo", [0, 1])
        ('gloo', (0, 1))
    """
    ranks = compact(ranks)
    return backend, ranks.span if isinstance(ranks, RankRange) else tuple(ranks)


def lookup(backend: str, ranks) -> Optional[dist.ProcessGroup]:
    """The cached group over ``ranks``, or None (never creates one).

    Example:
        >>> lookup("gloo", [0, 1])  # doctest: +SKIP
    """
    return _group_cache.get(cache_key(backend, ranks))


def own_groups_only(backend: str) -> bool:
    """Whether a mesh creates only the groups holding this rank (else every group, on every rank).

    Only on torch's fake backend, where one process plays one rank and no peer has to agree on
    anything. Elsewhere every rank creates every group of a mesh in one order, as torch's own
    DeviceMesh does: c10d numbers groups with a per-process counter that every rank must advance
    alike (torch 2.15 salts even ``use_local_synchronization`` groups' names with it), so a rank
    that skipped the groups it is not in would later rendezvous under another name and hang.

    Example:
        >>> own_groups_only("gloo")
        False
    """
    return backend == "fake"


def create_group(ranks: Sequence[int], backend: str) -> dist.ProcessGroup:
    """Create (or reuse) the group over ``ranks``, which hold this rank; only those ranks call it.

    For the fake backend (:func:`own_groups_only`): a rank of a mesh of N ranks creates its own
    few groups, never the N / size others, so building a mesh costs the same at 4 ranks as at
    65,536. A group over the whole world is the default group itself.

    Example:
        >>> create_group([0, 1], "gloo")  # on ranks 0 and 1  # doctest: +SKIP
    """
    key = cache_key(backend, ranks)
    group = _group_cache.get(key)
    if group is not None:
        return group
    follow = follows_default(backend)
    world = dist.get_world_size()
    if follow and len(key[1]) == world and (key[1] == range(world) or key[1] == tuple(range(world))):
        group = dist.group.WORLD
    else:
        group = dist.new_group(list(key[1]), timeout=collective_timeout(), backend=None if follow else backend,
                               use_local_synchronization=True)
    _group_cache[key] = group
    return group


# ---- which groups a mesh has, and their rank lists ---------------------------------
def combos(ndim: int) -> List[Tuple[int, ...]]:
    """Every set of mesh dims that gets a group: singles, and larger sets for ndim <= 3."""
    out = [(d,) for d in range(ndim)]
    sizes = range(2, ndim + 1) if ndim <= 3 else [ndim]
    for k in sizes:
        out.extend(itertools.combinations(range(ndim), k))
    return out


def rank_lists(mesh: torch.Tensor, dims: Tuple[int, ...]) -> List[List[int]]:
    """All rank lists along ``dims`` (flattened row-major), one per coordinate of the other dims."""
    others = [d for d in range(mesh.ndim) if d not in dims]
    moved = mesh.permute(*others, *dims).reshape(-1, *[mesh.shape[d] for d in dims])
    return [row.flatten().tolist() for row in moved]


def my_list(mesh: torch.Tensor, coord: Tuple[int, ...], dims: Tuple[int, ...]) -> Sequence[int]:
    """The ranks along ``dims`` through ``coord`` (flattened row-major): one rank's entry of :func:`rank_lists`.

    Evenly spaced ranks come back as a ``range`` (see :func:`compact`).

    Example:
        >>> my_list(torch.tensor([[0, 1], [3, 2]]), (1, 0), (1,))
        [3, 2]
    """
    index = tuple(slice(None) if d in dims else coord[d] for d in range(mesh.ndim))
    return compact(mesh[index].flatten())
