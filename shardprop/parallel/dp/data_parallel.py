"""Data parallelism over one mesh dim, with gradients all-reduced in buckets (as DDP does).

Each rank of the data-parallel mesh dim (``"dp"`` of a ``("dp", "tp")`` mesh, or a
1-d mesh) runs the same model on its slice of the batch. After backward the
gradients must be averaged over that dim. Doing it one parameter at a time costs
one collective per parameter; instead parameters are grouped into buckets:

* :func:`compute_bucket_assignment_by_size` groups parameters per (dtype, device)
  in reverse order of definition (the order gradients become ready), closing a
  bucket once it holds ``size_limits[0]`` bytes, then ``size_limits[1]``, ... (a
  small first bucket, so the first all-reduce starts early, then the cap);
* :func:`replicate_gradients` registers a post-accumulate-grad hook on every
  parameter. When all gradients of a bucket are ready, they are copied into one
  flat buffer and one asynchronous all-reduce (average over the dp dim) starts,
  overlapping the rest of backward. :meth:`GradientReducer.finish` (call it
  before ``optimizer.step()``) waits and copies the averages back.

Buckets are launched strictly in bucket order, so every rank issues the same
collectives in the same order. A bucket whose gradients never all arrive (a
parameter unused in this step, on some or all ranks) is launched by ``finish()``
with zeros for the missing ones; one extra element per parameter in the buffer
counts how many ranks had a gradient, so a parameter no rank used keeps
``grad is None`` and a parameter some ranks used gets the DDP average (missing
ones count as zero).

Parameters may be plain tensors or DTensors on another mesh (e.g. ``mesh["tp"]``):
for a DTensor the local shard of its gradient is reduced. Peers along the dp dim
hold the same shard layout, and averaging is linear, so this is right whatever
the gradient's placements (``Partial`` included).
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterable, List, Optional, Sequence, Union

import torch

from shardprop.mesh import collectives as C
from shardprop.mesh.async_tensor import wait_all
from shardprop.parallel.param_swap import keep_hooks_on_swap
from shardprop.tensor.dtensor import DTensor
from shardprop.tensor.layout import chunk_bounds

MiB = 1024 * 1024
DEFAULT_SIZE_LIMITS = (1 * MiB, 25 * MiB)


def compute_bucket_assignment_by_size(tensors: Sequence[torch.Tensor],
                                      size_limits: Union[int, Sequence[int]] = DEFAULT_SIZE_LIMITS, *,
                                      order: Optional[Iterable[int]] = None) -> List[List[int]]:
    """Group ``tensors`` into buckets by byte size; return lists of indices into ``tensors``.

    Tensors are visited in ``order`` (default: reverse order of ``tensors``, i.e.
    reverse order of parameter definition, which approximates the order in which
    gradients become ready). Each (dtype, device) pair fills its own bucket; a
    bucket closes once it holds at least the current limit, and each pair then
    moves to the next limit in ``size_limits`` (the last one repeats). Buckets are
    returned in the order they become ready: by the earliest visit of any member.
    Indices inside a bucket are in visiting order.

    With ``order=range(len(tensors))`` this is DDP's ``_compute_bucket_assignment_by_size``.

    Example:
        >>> ts = [torch.empty(10) for _ in range(4)]  # 40 bytes each
        >>> compute_bucket_assignment_by_size(ts, [40, 80])
        [[3], [2, 1], [0]]
        >>> compute_bucket_assignment_by_size(ts, [40, 80], order=range(4))
        [[0], [1, 2], [3]]
    """
    limits = [int(size_limits)] if isinstance(size_limits, int) else [int(x) for x in size_limits]
    if not limits or any(x <= 0 for x in limits):
        raise ValueError(f"compute_bucket_assignment_by_size: size limits must be positive, got {size_limits}")
    order = list(reversed(range(len(tensors)))) if order is None else list(order)
    if sorted(order) != list(range(len(tensors))):
        raise ValueError("compute_bucket_assignment_by_size: order must be a permutation of the tensor indices")
    position = {i: k for k, i in enumerate(order)}
    open_buckets: Dict[tuple, list] = {}  # (dtype, device) -> [indices, bytes]
    limit_index: Dict[tuple, int] = {}
    done: List[List[int]] = []
    for i in order:
        t = tensors[i]
        if t.layout != torch.strided:
            raise ValueError(f"compute_bucket_assignment_by_size: tensor {i} is not dense ({t.layout})")
        key = (t.dtype, t.device)
        bucket = open_buckets.setdefault(key, [[], 0])
        bucket[0].append(i)
        bucket[1] += t.numel() * t.element_size()
        k = limit_index.setdefault(key, 0)
        if bucket[1] >= limits[k]:
            done.append(bucket[0])
            del open_buckets[key]
            limit_index[key] = min(k + 1, len(limits) - 1)
    done.extend(b[0] for b in open_buckets.values() if b[0])
    done.sort(key=lambda b: min(position[i] for i in b))
    return done


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose data a rank holds: a DTensor's local shard, else the tensor itself."""
    return wait_all(t._local_tensor) if isinstance(t, DTensor) else t


class GradientReducer:
    """Averages gradients over one mesh dim in buckets, asynchronously during backward.

    Build it with :func:`replicate_gradients`. Per step: forward and backward on
    this rank's slice of the batch, then :meth:`finish`, then the optimizer step.

    Attributes:
        buckets: lists of parameter indices (into ``params``), in launch order.
        names: the same, as parameter names (when built from a module).

    Example:
        >>> mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        >>> model = nn.Linear(4, 2); opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> dp = replicate_gradients(model, mesh, dim="dp")
        >>> loss = model(dp.split_batch(torch.ones(8, 4))).mean()   # this rank's 2 rows of the batch
        >>> loss.backward(); dp.finish(); opt.step(); opt.zero_grad()
    """

    def __init__(self, params: Sequence[torch.Tensor], mesh, dim: Union[int, str], *,
                 size_limits: Sequence[int] = DEFAULT_SIZE_LIMITS, names: Optional[Sequence[str]] = None,
                 sync_params: bool = True) -> None:
        self.params = list(params)
        self.mesh = mesh
        self.dim = mesh.dim_index(dim)
        self.dp_size = mesh.shape[self.dim]
        self.dp_index = mesh._coord[self.dim]
        self.buckets = compute_bucket_assignment_by_size([_local(p) for p in self.params], size_limits)
        self.names = [[names[i] for i in b] for b in self.buckets] if names is not None else None
        self._bucket_of = {i: b for b, idx in enumerate(self.buckets) for i in idx}
        self._sizes = [[_local(self.params[i]).numel() for i in idx] for idx in self.buckets]
        self._enabled = True
        self._reset()
        if sync_params:
            self.broadcast_parameters()
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self.params)]

    # ---- per-step state -----------------------------------------------------------
    def _reset(self) -> None:
        self._ready = [False] * len(self.params)
        self._pending = [len(b) for b in self.buckets]
        self._next = 0          # the next bucket to launch (buckets launch in order)
        self._inflight: List[Optional[torch.Tensor]] = [None] * len(self.buckets)
        self._had_grad: List[List[bool]] = [[] for _ in self.buckets]

    def _make_hook(self, i: int):
        def hook(p: torch.Tensor) -> None:
            if not self._enabled:
                return
            if self._ready[i]:
                raise RuntimeError(
                    "GradientReducer: a second backward reached a parameter before finish(); call finish() after "
                    "each backward, or accumulate gradients inside `with reducer.no_sync():`")
            self._ready[i] = True
            b = self._bucket_of[i]
            self._pending[b] -= 1
            if self._pending[b] == 0 and b == self._next:
                self._launch_ready()
        return hook

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self._pending[self._next] == 0:
            self._launch(self._next)

    def _launch(self, b: int) -> None:
        """Copy bucket ``b``'s gradients into one flat buffer and start its all-reduce."""
        idx, sizes = self.buckets[b], self._sizes[b]
        first = _local(self.params[idx[0]])
        total = sum(sizes)
        flat = torch.empty(total + len(idx), dtype=first.dtype, device=first.device)
        had = []
        off = 0
        for j, (i, n) in enumerate(zip(idx, sizes)):
            g = self.params[i].grad
            piece = flat[off:off + n]
            if g is None:
                piece.zero_()
            else:
                g = _local(g)
                if g.numel() != n:
                    raise RuntimeError(
                        f"GradientReducer: the gradient of parameter {self._name(i)} holds {g.numel()} local elements, "
                        f"its parameter {n}; a DTensor gradient must be laid out like its parameter's shard")
                piece.view(g.shape).copy_(g)
            flat[total + j] = 0 if g is None else 1
            had.append(g is not None)
            off += n
        self._had_grad[b] = had
        with torch.no_grad():
            self._inflight[b] = C.all_reduce(flat, self.mesh, self.dim, "avg", async_op=True, inplace=True)
        self._next = b + 1

    def _name(self, i: int) -> str:
        if self.names is not None:
            return repr(self.names[self._bucket_of[i]][self.buckets[self._bucket_of[i]].index(i)])
        return f"#{i}"

    # ---- public -------------------------------------------------------------------
    def finish(self) -> None:
        """Launch buckets still waiting (unused parameters), wait for all, write the averages into ``.grad``.

        Call on every rank after backward and before ``optimizer.step()``.

        Example:
            >>> loss.backward(); dp.finish(); opt.step()  # doctest: +SKIP
        """
        if not self._enabled:
            raise RuntimeError("GradientReducer.finish() inside no_sync(): leave no_sync() first")
        while self._next < len(self.buckets):
            self._launch(self._next)
        with torch.no_grad():
            for b, idx in enumerate(self.buckets):
                flat = wait_all(self._inflight[b])
                sizes = self._sizes[b]
                total = sum(sizes)
                off = 0
                for j, (i, n) in enumerate(zip(idx, sizes)):
                    self._write_back(self.params[i], flat[off:off + n], self._had_grad[b][j], float(flat[total + j]))
                    off += n
        self._reset()

    wait = finish

    def _write_back(self, p: torch.Tensor, avg: torch.Tensor, had: bool, presence: float) -> None:
        if had:
            g = _local(p.grad)
            g.copy_(avg.view(g.shape))
        elif presence > 0:  # unused here, used on another rank: take the average (our share was zero)
            local = _local(p)
            g = avg.view(local.shape).clone()
            if isinstance(p, DTensor):
                spec = p._spec
                spec = spec.without_partial()
                g = DTensor(g, spec)
            p.grad = g
        # presence == 0: no rank used p this step; its grad stays None (the optimizer skips it)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients locally; the next step outside reduces the sum.

        Example:
            >>> with dp.no_sync():  # doctest: +SKIP
            ...     model(x1).mean().backward()
            >>> model(x2).mean().backward(); dp.finish()  # doctest: +SKIP
        """
        self._enabled = False
        try:
            yield
        finally:
            self._enabled = True

    @torch.no_grad()
    def broadcast_parameters(self) -> None:
        """Copy every parameter from dp index 0 to the other dp ranks (one broadcast per bucket).

        Example:
            >>> dp.broadcast_parameters()  # doctest: +SKIP
        """
        for idx in self.buckets:
            locals_ = [_local(self.params[i]) for i in idx]
            flat = torch.cat([t.reshape(-1) for t in locals_])
            C.broadcast(flat, self.mesh, self.dim, src=0)
            off = 0
            for t in locals_:
                t.copy_(flat[off:off + t.numel()].view(t.shape))
                off += t.numel()

    def split_batch(self, t: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """This dp rank's slice of a full batch along ``dim`` (``torch.chunk`` order).

        Example:
            >>> dp.split_batch(torch.arange(8)).tolist()  # dp index 1 of 4  # doctest: +SKIP
            [2, 3]
        """
        off, n = chunk_bounds(t.shape[dim], self.dp_size, self.dp_index)
        return t.narrow(dim, off, n)

    def remove(self) -> None:
        """Unregister the hooks (gradients are no longer reduced)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


def replicate_gradients(module_or_params, mesh, dim: Union[int, str, None] = None, *,
                        bucket_cap_mb: float = 25.0, first_bucket_mb: float = 1.0,
                        sync_params: bool = True) -> GradientReducer:
    """Average the gradients of ``module_or_params`` over mesh dim ``dim`` in bucketed async all-reduces.

    ``dim`` defaults to the only dim of a 1-d mesh, else ``"dp"``. Parameters that
    do not require grad are left alone. With ``sync_params`` the parameters are
    first copied from dp index 0 to every dp rank. The first bucket closes at
    ``first_bucket_mb``, later ones at ``bucket_cap_mb``. Every rank of the mesh
    must call it (and ``finish()`` each step) in the same order.

    Example (2x2 dp x tp; the batch is split over dp, the weights over tp):
        >>> mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        >>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        >>> plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
        >>> model = parallelize_module(model, mesh["tp"], plan)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> dp = replicate_gradients(model, mesh, "dp")
        >>> batches = [(torch.randn(4, 8), torch.arange(4))]
        >>> for x, y in batches:
        ...     loss = F.cross_entropy(model(dp.split_batch(x)), dp.split_batch(y))
        ...     loss.backward()
        ...     dp.finish()              # gradients now averaged over dp
        ...     opt.step(); opt.zero_grad()
    """
    if isinstance(module_or_params, torch.nn.Module):
        named = [(n, p) for n, p in module_or_params.named_parameters() if p.requires_grad]
        keep_hooks_on_swap(module_or_params)  # its post-accumulate hooks survive model.to(dtype)
    else:
        named = [(f"#{i}", p) for i, p in enumerate(module_or_params) if p.requires_grad]
    if not named:
        raise ValueError("replicate_gradients: no parameters that require grad")
    if dim is None:
        dim = 0 if mesh.ndim == 1 else "dp"
    if mesh._coord is None:
        raise RuntimeError(f"replicate_gradients: this rank is not in {mesh}")
    limits = (int(first_bucket_mb * MiB), int(bucket_cap_mb * MiB))
    return GradientReducer([p for _, p in named], mesh, dim, size_limits=limits,
                           names=[n for n, _ in named], sync_params=sync_params)
