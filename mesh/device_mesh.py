"""DeviceMesh: an n-d array of ranks with one process group per mesh dim.

Groups for every mesh dim (and for every set of two or more mesh dims, used by
fused collectives that span several dims at once) are created when the mesh is
built, never later: creation is collective and slow, lookups are a dict access.
"""
from __future__ import annotations

import copyreg
import itertools
import threading
import weakref
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from shardprop.mesh import compat
from shardprop.mesh import groups as _groups
from shardprop.mesh import layout as _layouts
from shardprop.mesh import reshape as _reshape
from shardprop.mesh.transport import shm_transport

DimRef = Union[int, str]

# Every live mesh of this process by a small integer key, in order of creation (weak values: the
# registry never keeps a mesh alive). A compiled graph names a mesh by its key (__fx_repr__), and
# unpickling rebinds to the newest live mesh with the pickled data (the one a user just made).
_by_key: "weakref.WeakValueDictionary[int, DeviceMesh]" = weakref.WeakValueDictionary()
_next_key = itertools.count()


# Whether this process ever built a mesh it is not in (a pipeline stage's sub-mesh, say). The
# dispatcher reads it before looking for such a mesh among a special op's arguments, so a process
# whose meshes all hold it never looks. Set by DeviceMesh.__init__ only.


class _Flags:
    """This process's mesh facts, in one object (no `global` statements)."""

    __slots__ = ("excluded_from_some_mesh",)


flags = _Flags()
flags.excluded_from_some_mesh = False


def mesh_by_key(key: int) -> "DeviceMesh":
    """The live mesh with this key (what a compiled graph's code calls to name a mesh).

    Example:
        >>> mesh_by_key(mesh._graph_key) is mesh  # doctest: +SKIP
        True
    """
    return _by_key[key]


def _newest_live(key: tuple) -> Optional["DeviceMesh"]:
    """The newest live mesh whose data (device type, ranks, shape, dim names) is ``key``."""
    found = [(k, m) for k, m in list(_by_key.items()) if m._key() == key]
    return max(found, key=lambda km: km[0])[1] if found else None


def _live_meshes() -> List["DeviceMesh"]:
    return list(_by_key.values())


# Meshes entered with ``with mesh:`` on this thread, innermost last (torch keeps the same per-thread stack).
_entered = threading.local()


def _stack() -> list:
    stack = getattr(_entered, "meshes", None)
    if stack is None:
        stack = _entered.meshes = []
    return stack


def current_mesh() -> "DeviceMesh":
    """The innermost mesh entered with ``with mesh:`` on this thread; RuntimeError if there is none.

    Entry points whose ``device_mesh`` is optional in torch (``distribute_tensor``, ``from_local``,
    ``distribute_module``, ``parallelize_module``, the factories) take it from here when left out.

    Example:
        >>> with mesh:  # doctest: +SKIP
        ...     current_mesh() is mesh
        True
    """
    stack = _stack()
    if not stack:
        raise RuntimeError("No device mesh is currently active: pass device_mesh, or call inside `with mesh:`")
    return stack[-1]


def mesh_or_current(device_mesh) -> "DeviceMesh":
    """``device_mesh`` if given, else :func:`current_mesh` (what torch's entry points do with a missing mesh).

    Example:
        >>> mesh_or_current(None) is mesh  # inside `with mesh:`  # doctest: +SKIP
        True
    """
    return device_mesh if device_mesh is not None else current_mesh()


# Meshes up to this many ranks keep their flat rank tuple from construction (see DeviceMesh.__init__).
_EAGER_FLAT = 4096

# First argument of DeviceMesh.__new__ when a pickle (not a user) builds a mesh: see __reduce__.
_PICKLED = "shardprop.DeviceMesh/v1"


# Which sets of dims get a group, and their rank lists: shared with mesh/reshape.py, so they live in groups.py.
_combos, _rank_lists, _my_list = _groups.combos, _groups.rank_lists, _groups.my_list


class DeviceMesh(compat.OpaqueValueBase):  # the base lets compile hold a mesh as a value
    """An n-d mesh of ranks, with its process groups created eagerly.

    Example:
        >>> mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
        >>> mesh["tp"].size()
        2
    """

    def __new__(cls, *args, **kwargs):
        if args and type(args[0]) is str and args[0] == _PICKLED:  # from a pickle: rebind, never build
            return _rebind(*args[1:])
        return super().__new__(cls)

    def __init__(self, device_type: str, mesh, mesh_dim_names: Optional[Sequence[str]] = None, *, _parent=None,
                 _dim_groups=None, _layout=None, _rank_map=None, _built_groups=None):
        if type(device_type) is str and device_type == _PICKLED:  # DeviceMesh(_PICKLED, ...) called as a constructor: __new__ rebound it
            return
        self.device_type = device_type
        self.mesh = torch.as_tensor(mesh, dtype=torch.int64, device="cpu").detach().clone()
        if self.mesh.ndim == 0:
            self.mesh = self.mesh.reshape(1)
        self.ndim: int = self.mesh.ndim
        self.shape: Tuple[int, ...] = tuple(self.mesh.shape)
        self.mesh_dim_names = tuple(mesh_dim_names) if mesh_dim_names is not None else None
        self._validate()
        # The mesh this one was sliced from (None for a root mesh): fully_shard combines a
        # parameter's tp mesh and its dp mesh into their common parent.
        self._parent = _parent if isinstance(_parent, DeviceMesh) else None
        # Where the mesh sits in its universe of ranks (see mesh/layout.py): what _flatten, _unflatten
        # and _concatenate compute with. Given by whoever derives a mesh; a root's is found from its ranks.
        if _layout is None:
            _rank_map, _layout = _layouts.place(self.mesh, self._parent._rank_map if self._parent else None)
        self._layout: _layouts.MeshLayout = _layout
        self._rank_map: torch.Tensor = _rank_map
        self._flattened: Dict[str, "DeviceMesh"] = {}  # name -> dim flattened from this root (root[name] slices it)
        # Every rank as Python ints: built now for meshes up to _EAGER_FLAT ranks (later a first use
        # could fall inside torch.compile's tracing, whose FakeTensorMode refuses reading a real
        # tensor); on bigger meshes only when asked (pickling, checkpoints), never on the hot path.
        self._flat_ranks: Optional[Tuple[int, ...]] = None
        if self.mesh.numel() <= _EAGER_FLAT:
            self._flat_ranks = tuple(self.mesh.flatten().tolist())
        # Hashed from two position-weighted sums (equality compares every rank): no per-rank Python
        # object, so a mesh of 65,536 ranks costs its one int64 tensor (as torch's does).
        flat = self.mesh.flatten()
        weights = torch.arange(1, flat.numel() + 1, dtype=torch.int64)
        fingerprint = (int(flat.sum()), int((flat * weights).sum()))
        self._hash = hash((device_type, fingerprint, tuple(self.mesh.shape), self.mesh_dim_names))
        me = dist.get_rank()
        where = (self.mesh == me).nonzero()
        self._coord: Optional[Tuple[int, ...]] = tuple(where[0].tolist()) if len(where) else None
        if self._coord is None:
            flags.excluded_from_some_mesh = True
        # dims tuple -> (group, ranks of my group in mesh order); None where this rank is absent.
        self._groups: Dict[Tuple[int, ...], Tuple[Optional[dist.ProcessGroup], List[int]]] = {}
        backend = _groups.backend_for(device_type)
        if _dim_groups is not None:  # from_group: the caller's groups, nothing created (not collective)
            self._adopt(_dim_groups, backend)
        elif _built_groups is not None:  # mesh/reshape.py made or found them
            self._groups.update(_built_groups)
        elif _parent is None and backend == "gloo":  # collective, like creating the groups below
            shm_transport.attach()
        # On the fake backend only this rank's groups are created (one per set of dims): cost flat
        # in the world size. Elsewhere every rank creates every group, in one order (see
        # groups.own_groups_only); NCCL splits every group of a dim off in one collective call.
        own_only = _groups.own_groups_only(backend)
        for dims in (() if _dim_groups is not None or _built_groups is not None else _combos(self.mesh.ndim)):
            mine = _my_list(self.mesh, self._coord, dims) if self._coord is not None else []
            if _parent is None and not own_only:
                group = _groups.create_groups(_rank_lists(self.mesh, dims), backend)
            elif _parent is None:
                group = _groups.create_group(mine, backend) if mine else None
            else:  # a slice reuses its parent's groups and never creates one
                group = self._parents_group(mine) if len(dims) == 1 else None
                group = group or (_groups.lookup(backend, mine) if mine else None)
                if group is None and len(dims) > 1:
                    continue
            self._groups[dims] = (group, mine)
        self._graph_key = next(_next_key)  # registered once built: a failed mesh is never found
        _by_key[self._graph_key] = self

    def _parents_group(self, mine) -> Optional[dist.ProcessGroup]:
        """The parent's group over ``mine`` along one of its dims: it may have its own backend (an
        ``_unflatten`` backend_override such as "fake"), which a lookup by this mesh's backend misses."""
        if self._parent is None or not mine:
            return None
        return next((g for dims, (g, r) in self._parent._groups.items() if len(dims) == 1 and r == mine), None)

    def _adopt(self, groups, backend: str) -> None:
        """Take one given process group per mesh dim (see :meth:`from_group`); checks each one's ranks."""
        me = dist.get_rank()
        if self._coord is None:
            raise ValueError(f"DeviceMesh.from_group: this rank ({me}) is not in the mesh {self.mesh.tolist()}")
        for d, group in enumerate(groups):
            mine = _my_list(self.mesh, self._coord, (d,))
            if not isinstance(group, dist.ProcessGroup):
                raise ValueError(f"DeviceMesh.from_group: group {d} is {group!r}, not a ProcessGroup this rank belongs "
                                 f"to (this rank's ranks along mesh dim {d} are {mine})")
            ranks = dist.get_process_group_ranks(group)
            if sorted(ranks) != mine:
                raise ValueError(f"DeviceMesh.from_group: group {d} has ranks {ranks}, but along mesh dim {d} of "
                                 f"{self.mesh.tolist()} this rank's ranks are {mine}")
            self._groups[(d,)] = (group, mine)
        if self.ndim > 1:  # the group over every dim (from_local checks, p2p): one that exists, or none
            flat = list(self._flat)
            if sorted(flat) == list(range(dist.get_world_size())):
                self._groups[tuple(range(self.ndim))] = (dist.group.WORLD, flat)
            elif _groups.lookup(backend, sorted(flat)) is not None:
                self._groups[tuple(range(self.ndim))] = (_groups.lookup(backend, sorted(flat)), flat)

    @staticmethod
    def from_group(group, device_type: str, mesh=None, *, mesh_dim_names: Optional[Sequence[str]] = None) -> "DeviceMesh":
        """A mesh over existing process groups, as ``torch.distributed.device_mesh.DeviceMesh.from_group``.

        One group gives a 1-d mesh over its ranks (``mesh``, if given, must list them). A list of
        groups gives an n-d mesh: ``mesh`` (the global ranks, n-d) and ``mesh_dim_names`` are then
        required, and group ``d`` must be this rank's group along mesh dim ``d``. No group is
        created and nothing is communicated, so only the ranks of the mesh need call it. For
        n-d meshes the group over all dims is the default group when the mesh spans the world
        (or one made earlier over those ranks); otherwise there is none, and what needs it
        (``from_local(run_check=True)``, fused multi-dim collectives) raises or steps aside.

        Example:
            >>> tp = dist.new_group([0, 1]); dp = dist.new_group([0, 2])  # and the others' groups  # doctest: +SKIP
            >>> m = DeviceMesh.from_group([dp, tp], "cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))  # doctest: +SKIP
        """
        if isinstance(group, dist.ProcessGroup):
            ranks = dist.get_process_group_ranks(group)
            if mesh is not None and torch.as_tensor(mesh).flatten().tolist() != ranks:
                raise ValueError(f"DeviceMesh.from_group: mesh {torch.as_tensor(mesh).tolist()} does not list the "
                                 f"group's ranks {ranks}")
            return DeviceMesh(device_type, ranks, mesh_dim_names, _dim_groups=[group])
        if not isinstance(group, (list, tuple)):
            raise ValueError(f"DeviceMesh.from_group: expects a ProcessGroup this rank belongs to, or a list of them; "
                             f"got {group!r}")
        groups = list(group)
        if not groups:
            raise ValueError("DeviceMesh.from_group: expects at least one ProcessGroup")
        if mesh is None or mesh_dim_names is None:
            raise ValueError("DeviceMesh.from_group: with a list of groups, pass mesh= and mesh_dim_names=")
        layout = torch.as_tensor(mesh, dtype=torch.int64, device="cpu")
        if layout.ndim != len(groups):
            raise ValueError(f"DeviceMesh.from_group: a {layout.ndim}-d mesh {layout.tolist()} for {len(groups)} "
                             "groups; give one group per mesh dim")
        return DeviceMesh(device_type, layout, mesh_dim_names, _dim_groups=groups)

    def get_all_groups(self) -> List[dist.ProcessGroup]:
        """The process group of each mesh dim, in order.

        Example:
            >>> [g.size() for g in init_device_mesh("cpu", (2, 2)).get_all_groups()]  # doctest: +SKIP
            [2, 2]
        """
        return [self.get_group(d) for d in range(self.ndim)]

    @property
    def _flat(self) -> Tuple[int, ...]:
        """Every rank of the mesh, row-major (built on first use: a tuple of world-size Python ints)."""
        if self._flat_ranks is None:
            self._flat_ranks = tuple(self.mesh.flatten().tolist())
        return self._flat_ranks

    def _validate(self) -> None:
        # Vectorised: a mesh of 65,536 ranks is checked without a Python object per rank.
        flat = self.mesh.flatten()
        if flat.numel() > 1 and int(torch.bincount(flat - flat.min()).max()) > 1:  # (unique/sort: 10x slower)
            raise ValueError(f"DeviceMesh: ranks must be unique, got {self.mesh.tolist()}")
        if self.mesh_dim_names is not None:
            if len(self.mesh_dim_names) != self.mesh.ndim:
                raise ValueError(
                    f"DeviceMesh: {len(self.mesh_dim_names)} dim names {self.mesh_dim_names} "
                    f"for a {self.mesh.ndim}-d mesh"
                )
            if len(set(self.mesh_dim_names)) != len(self.mesh_dim_names):
                raise ValueError(f"DeviceMesh: duplicate dim names {self.mesh_dim_names}")
        if not dist.is_initialized():
            raise RuntimeError("DeviceMesh: torch.distributed is not initialised; use init_device_mesh")
        outside = (flat < 0) | (flat >= dist.get_world_size())
        if bool(outside.any()):
            bad = flat[outside].tolist()
            raise ValueError(f"DeviceMesh: ranks {bad} are outside the world of size {dist.get_world_size()}")
        # c10d orders a group's members by global rank, and every collective here puts rank i's piece
        # at mesh index i: along a mesh dim the two orders must agree, or data lands on the wrong rank.
        for d in range(self.mesh.ndim):
            if self.mesh.shape[d] < 2 or bool((self.mesh.diff(dim=d) > 0).all()):
                continue
            for ranks in _rank_lists(self.mesh, (d,)):
                if ranks != sorted(ranks):
                    raise ValueError(
                        f"DeviceMesh: along mesh dim {d} the ranks {ranks} are not in ascending order (mesh "
                        f"{self.mesh.tolist()}); process groups order their members by rank, so each mesh dim must "
                        "list its ranks in ascending order (transpose or relabel the mesh)")

    # ---- identity -------------------------------------------------------------
    def _key(self) -> tuple:
        return (self.device_type, self._flat, tuple(self.mesh.shape), self.mesh_dim_names)

    def __reduce__(self):
        """Pickle as data: device type, ranks, shape, dim names; never the process groups.

        Unpickling (``pickle``, ``torch.load``, also with ``weights_only=True``) rebinds to the
        mesh with that data in the unpickling process (see :func:`_rebind`).

        Example:
            >>> pickle.loads(pickle.dumps(mesh)) is mesh  # doctest: +SKIP
            True
        """
        # copyreg.__newobj__ pickles as NEWOBJ: DeviceMesh.__new__(DeviceMesh, _PICKLED, ...), which
        # needs only this class allowlisted for torch.load(weights_only=True), and runs no __init__.
        return (copyreg.__newobj__, (DeviceMesh, _PICKLED, *self._key()))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        if self is other:
            return True
        if not isinstance(other, DeviceMesh) or self._hash != other._hash:
            return False
        return (self.device_type, self._flat, self.mesh.shape, self.mesh_dim_names) == (
            other.device_type, other._flat, other.mesh.shape, other.mesh_dim_names)

    def __deepcopy__(self, memo) -> "DeviceMesh":
        # A mesh owns process groups: a copy would be a second mesh over the same groups
        # (copy.deepcopy of a model, and torch.compile's guard metadata, keep the mesh itself).
        return self

    def __copy__(self) -> "DeviceMesh":
        return self

    def __enter__(self) -> "DeviceMesh":
        """``with mesh:`` makes this the current mesh (see :func:`current_mesh`) until the block ends."""
        _stack().append(self)
        return self

    def __exit__(self, *exc) -> None:
        _stack().pop()

    def __fx_repr__(self):
        """How generated graph code names this mesh (torch.compile's opaque value-type protocol)."""
        return f"mesh_by_key({self._graph_key})", {"mesh_by_key": mesh_by_key}

    def __repr__(self) -> str:
        names = f", mesh_dim_names={self.mesh_dim_names}" if self.mesh_dim_names else ""
        return f"DeviceMesh({self.device_type!r}, {self.mesh.tolist()}{names})"

    # ---- shape ----------------------------------------------------------------
    # ``ndim`` (number of mesh dims) and ``shape`` (e.g. ``(2, 2)``) are plain attributes set in __init__,
    # not properties: dynamo cannot read a property of a mesh inside compiled code (it walks the class
    # for a source it does not have: "cls_source must not be None for MRO walk"), so ``mesh.size(0)``,
    # ``mesh.ndim`` or ``mesh.get_local_rank()`` in a compiled forward failed where eager worked.

    def size(self, dim: Optional[DimRef] = None) -> int:
        """Number of ranks in the mesh, or along one mesh dim.

        Example:
            >>> mesh.size(), mesh.size("tp")  # doctest: +SKIP
            (4, 2)
        """
        if dim is None:
            return self.mesh.numel()
        return self.mesh.shape[self.dim_index(dim)]

    def dim_index(self, dim: DimRef) -> int:
        """Resolve a mesh dim given by name or (possibly negative) index."""
        if isinstance(dim, str):
            if not self.mesh_dim_names or dim not in self.mesh_dim_names:
                raise KeyError(f"DeviceMesh: no mesh dim named {dim!r}; dims are {self.mesh_dim_names}")
            return self.mesh_dim_names.index(dim)
        if not -self.ndim <= dim < self.ndim:
            raise IndexError(f"DeviceMesh: mesh dim {dim} out of range for a {self.ndim}-d mesh")
        return dim % self.ndim

    # ---- this rank ------------------------------------------------------------
    def get_coordinate(self) -> Optional[List[int]]:
        """This rank's coordinate in the mesh, or None if it is not in it."""
        return list(self._coord) if self._coord is not None else None

    def get_rank(self) -> int:
        """This rank's global rank."""
        return dist.get_rank()

    def get_local_rank(self, dim: DimRef = 0) -> int:
        """This rank's index along one mesh dim."""
        return self._coord[self.dim_index(dim)]

    def get_group(self, dim: DimRef = 0) -> dist.ProcessGroup:
        """The process group along one mesh dim (created with the mesh), or of a dim flattened from the root."""
        if isinstance(dim, str) and dim not in (self.mesh_dim_names or ()):
            group = _reshape.flattened_group(self, dim)
            if group is not None:
                return group
        return self._groups[(self.dim_index(dim),)][0]

    def group_for(self, dims: Tuple[int, ...]):
        """(group, ranks) spanning a sorted tuple of mesh dims, or None if not available."""
        return self._groups.get(dims)

    def group_in_order(self, dims: Tuple[int, ...]) -> bool:
        """Whether the group over ``dims`` exists and lists its ranks in ascending (c10d's) order.

        Worked out once per set of dims (the list can hold thousands of ranks), then a dict lookup.

        Example:
            >>> mesh.group_in_order((0, 1))  # doctest: +SKIP
            True
        """
        known = self.__dict__.setdefault("_in_order", {})
        if dims not in known:
            entry = self._groups.get(dims)
            known[dims] = entry is not None and _groups.ascending(entry[1])
        return known[dims]

    # ---- slicing --------------------------------------------------------------
    def __getitem__(self, names: Union[str, Tuple[str, ...]]) -> "DeviceMesh":
        """Sub-mesh over the named dims through this rank, e.g. ``mesh["tp"]``.

        Example:
            >>> mesh["dp", "tp"]  # doctest: +SKIP
        """
        if isinstance(names, str):
            names = (names,)
        if self._flattened and any(n in self._flattened for n in names):  # a dim flattened from this root
            return _reshape.slice_flattened(self, tuple(names))
        dims = [self.dim_index(n) for n in names]
        if len(set(dims)) != len(dims):
            raise ValueError(f"DeviceMesh: repeated dims in {names}")
        if self._coord is None:
            raise RuntimeError(f"DeviceMesh: rank {dist.get_rank()} is not in {self}")
        index = tuple(slice(None) if d in dims else self._coord[d] for d in range(self.ndim))
        sub = self.mesh[index]
        kept = [d for d in range(self.ndim) if d in dims]
        sub = sub.permute(*[kept.index(d) for d in dims])
        return DeviceMesh(self.device_type, sub, tuple(names) if self.mesh_dim_names else None, _parent=self,
                          _layout=self._layout.select(dims), _rank_map=self._rank_map)

    # ---- torch's private mesh-building API (torchtitan builds every mesh with it): see mesh/reshape.py
    def _flatten(self, mesh_dim_name: Optional[str] = None, backend_override=None) -> "DeviceMesh":
        """A 1-d mesh over all dims of this one, sliceable from the root by its name (torch's ``_flatten``).

        Example:
            >>> mesh["dp", "cp"]._flatten("dp_cp") is mesh["dp_cp"]  # doctest: +SKIP
            True
        """
        return _reshape.flatten(self, mesh_dim_name, backend_override)

    def _unflatten(self, dim: DimRef, mesh_sizes: Sequence[int], mesh_dim_names: Sequence[str],
                   backend_override=None) -> "DeviceMesh":
        """This mesh with dim ``dim`` split into dims of ``mesh_sizes`` (torch's ``_unflatten``).

        Example:
            >>> world._unflatten(0, (2, 2), ("dp", "tp")).shape  # doctest: +SKIP
            (2, 2)
        """
        return _reshape.unflatten(self, dim, mesh_sizes, mesh_dim_names, backend_override)

    @staticmethod
    def _concatenate(device_mesh_list: Sequence["DeviceMesh"]) -> "DeviceMesh":
        """One mesh whose dims are the given meshes' dims, over their common ranks (torch's ``_concatenate``).

        Example:
            >>> DeviceMesh._concatenate([mesh["dp"], mesh["tp"]]) == mesh  # doctest: +SKIP
            True
        """
        return _reshape.concatenate(device_mesh_list)

    def _get_root_mesh(self) -> "DeviceMesh":
        """The mesh this one was sliced, flattened or unflattened from, ultimately (itself for a root)."""
        return _reshape.root_of(self)


def _describe(device_type, flat, shape, names) -> str:
    layout = torch.tensor(flat, dtype=torch.int64).reshape(shape).tolist() if flat else []
    return f"DeviceMesh({device_type!r}, {layout}" + (f", mesh_dim_names={names})" if names else ")")


def _rebind(device_type, flat, shape, names) -> DeviceMesh:
    """The mesh of this process that a pickled mesh names: a live mesh with the same data, or
    one rebuilt over process groups this process already has. Never creates a group (that is
    collective, and unpickling is not); raises naming the mismatch when neither exists.

    Example:
        >>> _rebind("cpu", (0, 1), (2,), ("tp",)) is mesh  # a live mesh over ranks 0, 1 named tp  # doctest: +SKIP
        True
    """
    ok = (type(device_type) is str and type(flat) is tuple and all(type(r) is int for r in flat)
          and type(shape) is tuple and all(type(n) is int and n >= 0 for n in shape)
          and (names is None or (type(names) is tuple and all(type(n) is str for n in names))))
    if not ok or len(flat) != _prod(shape):
        raise ValueError(f"DeviceMesh: malformed pickled mesh data {(device_type, flat, shape, names)!r}")
    what = _describe(device_type, flat, shape, names)
    if not dist.is_initialized():
        raise RuntimeError(f"cannot unpickle {what}: torch.distributed is not initialised in this process; "
                           "create the mesh first (init_device_mesh), then load")
    live = _newest_live((device_type, flat, shape, names))
    if live is not None:
        return live
    me, world = dist.get_rank(), dist.get_world_size()
    others = sorted({repr(m) for m in _live_meshes()}) or ["none"]
    hint = f"meshes in this process: {', '.join(others)}"
    outside = [r for r in flat if not 0 <= r < world]
    if outside:
        raise ValueError(f"cannot unpickle {what}: ranks {outside} are outside this world of {world} ranks; {hint}")
    if me not in flat:
        raise ValueError(f"cannot unpickle {what}: this rank ({me}) is not in it and no such mesh exists here "
                         f"(was the file saved by another rank?); {hint}")
    if device_type == "cuda" and torch.cuda.device_count() == 0:  # its groups may be gloo's, shared with CPU meshes
        raise ValueError(f"cannot unpickle {what}: this process sees no CUDA device, so no such mesh exists here; "
                         f"create the mesh (init_device_mesh, on a machine with a GPU) before loading; {hint}")
    # A mesh nobody holds any more (a slice such as mesh["tp"]) whose groups exist: rebuild it.
    backend = _groups.backend_for(device_type)
    layout = torch.tensor(flat, dtype=torch.int64).reshape(shape)
    coord = tuple((layout == me).nonzero()[0].tolist())
    for d in range(len(shape)):
        mine = _my_list(layout, coord, (d,))
        if _groups.lookup(backend, mine) is None:
            raise ValueError(f"cannot unpickle {what}: no mesh with a {device_type} group over ranks {mine} "
                             f"(its dim {d}) exists in this process; create the mesh (init_device_mesh, or a "
                             f"slice of one) before loading; {hint}")
    return DeviceMesh(device_type, layout, names, _parent=_REUSE_GROUPS)


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


_REUSE_GROUPS = object()  # _parent for a mesh rebuilt from groups that exist (never creates one)


def init_device_mesh(device_type: str, mesh_shape: Sequence[int], *, mesh_dim_names: Optional[Sequence[str]] = None) -> DeviceMesh:
    """Build a mesh over all ranks, initialising the default group from the environment if needed.

    Example:
        >>> mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        >>> mesh["dp"].size(), mesh["tp"].size(), mesh.ndim
        (2, 2, 2)
    """
    _groups.ensure_default_group(device_type)
    mesh_shape = tuple(int(s) for s in mesh_shape)
    n = 1
    for s in mesh_shape:
        n *= s
    world = dist.get_world_size()
    if n != world:
        raise ValueError(f"init_device_mesh: mesh shape {mesh_shape} has {n} ranks but the world size is {world}")
    if device_type == "cuda":  # a clear error without a GPU; ranks beyond the GPUs share them (gloo)
        _groups.check_nccl_devices(1, torch.cuda.device_count())
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    return DeviceMesh(device_type, torch.arange(n).reshape(mesh_shape), mesh_dim_names)
