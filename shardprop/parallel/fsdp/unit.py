"""One fully_shard unit at run time: gather its parameters, swap them in, reduce-scatter its gradients.

Per step a unit issues one all-gather (of every parameter's shard, into the full
buffer, asynchronously so it can be prefetched) and one reduce-scatter (of every
gradient, launched from the post-accumulate-grad hooks as soon as the unit's last
gradient is ready, so it overlaps the rest of backward). The sharded gradients are
written into ``param.grad`` by :meth:`FSDPUnit.complete_reduce`, when the next unit
launches its reduce-scatter or at the end of backward, whichever comes first.
"""
from __future__ import annotations

import functools
from typing import List, Optional, Sequence, Tuple

import torch

from shardprop.mesh import collectives as C
from shardprop.mesh.async_tensor import wait_all
from shardprop.mesh.config import values as _settings
from shardprop.mesh.state import module_state
from shardprop.parallel.fsdp.flat_buffers import ParamSlot, UnitBuffers
from shardprop.tensor.dtensor import DTensor


# Each collective's mode is a setting (fsdp_gather_into_views, fsdp_async_gather, fsdp_async_reduce in
# shardprop.config); unset, the backend decides: on for every device but CPU. Why off on gloo:
# - into views: gloo's coalesced all-gather flattens the inputs and copies the outputs, so one flat
#   all-gather of the (already flat) shard buffer and one copy into the full parameters is cheaper;
# - async gather: gloo's all-gather holds a flat temporary the size of the output while in flight, so
#   an async prefetch keeps that buffer alive across the current unit's compute, for little overlap;
# - async reduce: the packed gradients (the unit's full size) would stay alive until the next unit's
#   backward completes them, in the peak of every unit's backward (torch's CPU reduce-scatter is
#   synchronous too).


def _by_backend(value, mesh) -> bool:
    return value if value is not None else mesh.device_type != "cpu"


def gather_into_views(mesh) -> bool:
    """Whether units on ``mesh`` gather straight into their parameters' views (``fsdp_gather_into_views``)."""
    return _by_backend(_settings.fsdp_gather_into_views, mesh)


def async_gather(mesh) -> bool:
    """Whether units on ``mesh`` all-gather asynchronously (``fsdp_async_gather``)."""
    return _by_backend(_settings.fsdp_async_gather, mesh)


def async_reduce(mesh) -> bool:
    """Whether units on ``mesh`` reduce-scatter asynchronously (``fsdp_async_reduce``)."""
    return _by_backend(_settings.fsdp_async_reduce, mesh)


# The unit whose reduce-scatter was launched last and is not completed yet.
_state = module_state(in_flight=None)


def _and_members(method):
    """Run ``method`` on the unit, then on each of its member units (same modules, other shard meshes).

    Only for a call from outside the unit: inside one of its methods (``reshard`` waiting for a
    gather, ``release_after_backward`` swapping out) a call concerns this unit alone.
    """
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        if self._in_call or not self.members:
            return method(self, *args, **kwargs)
        self._in_call = True
        try:
            method(self, *args, **kwargs)
        finally:
            self._in_call = False
        for member in self.members:
            method(member, *args, **kwargs)
    return run


def _this_unit_only(method):
    """The per-unit gradient path (``post_backward``, ``release_after_backward``): what it calls concerns
    this unit alone; a member's gradients arrive on their own schedule and it releases itself."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        outer, self._in_call = self._in_call, True
        try:
            return method(self, *args, **kwargs)
        finally:
            self._in_call = outer
    return run


# What FSDPModule's setters change (configure() refuses other names).
_SETTINGS = frozenset({"requires_gradient_sync", "requires_all_reduce", "reshard_after_forward", "auto_reshard",
                       "reshard_after_backward", "gradient_divide_factor", "unshard_in_backward",
                       "keep_unsharded_storage", "all_reduce_hook", "force_sum_reduction"})


class FSDPUnit:
    """The run-time state of one ``fully_shard``-ed module (see the module docstring).

    Example:
        >>> unit = module._fsdp_unit  # doctest: +SKIP
        >>> unit.unshard(); unit.wait_unsharded(); unit.swap_in()  # doctest: +SKIP
    """

    def __init__(self, module, slots: List[ParamSlot], buffers: Optional[UnitBuffers], dp_mesh,
                 reshard_after_forward, mp_policy, *, replicate_mesh=None, post_forward_mesh=None,
                 auto_reshard: bool = False, offload: bool = False) -> None:
        # ``fully_shard([a, b])``: one unit for several modules (a tuple); ``module`` is the first.
        self.modules = tuple(module) if isinstance(module, (list, tuple)) else (module,)
        self.module = self.modules[0]
        self.to_run: set = set()    # ids of the modules yet to run forward in this pass
        self.pass_token = [False]   # shared by the pre-backward hooks of one pass: the first one acts
        self.slots = slots
        self.buffers = buffers
        self.dp_mesh = dp_mesh                  # the shard group: all-gather and reduce-scatter
        self.replicate_mesh = replicate_mesh    # HSDP: gradients all-reduced over it after the reduce-scatter
        self.post_forward_mesh = post_forward_mesh  # reshard_after_forward=<int>: the smaller group
        self.reshard_after_forward = reshard_after_forward  # True, False or the smaller group's size
        self.auto_reshard = auto_reshard        # reshard_after_forward=None: the root keeps its parameters
        self.mp_policy = mp_policy
        self.offload = offload                  # shards and gradient shards live in host memory
        self.requires_gradient_sync = True
        self.requires_all_reduce = True
        self.reshard_after_backward = True
        self.gradient_divide_factor: Optional[float] = None
        self.force_sum_reduction = False
        self.unshard_in_backward = True
        self.keep_unsharded_storage = False
        self.all_reduce_hook = None              # called on the reduced gradient shards before ``.grad``
        self.forward_prefetch: Optional[List["FSDPUnit"]] = None
        self.backward_prefetch: Optional[List["FSDPUnit"]] = None
        self.is_root = False
        self._root_state = None    # the RootState when this unit is a root
        self._owner_state = None   # the RootState of the last forward this unit ran in
        self._gather = None        # the all-gather's result (an AsyncTensor while in flight) until copied out
        self._gather_from_group = False
        self._staging = None
        self._gather_input = None  # keeps the (cast) input alive until the gather finishes
        self._unsharded = False
        self._group_piece = None   # after forward with an int reshard_after_forward: this rank's piece
        self._grad_pending = 0
        self._reduce = None        # (AsyncTensor of the gradient shard buffer, inputs kept alive, all-reduce?, factor)
        self._partial = None       # HSDP without all-reduce: reduce-scattered gradients summed so far
        self.ran_forward = False
        self.backward_started = False
        # A frozen parameter's matmul backward may run after every trainable gradient is in (LoRA): a
        # unit holding one keeps its gathered parameters until backward has passed its inputs.
        self.has_frozen = any(not s.requires_grad for s in slots)
        self._grads_done = False   # this backward: post_backward ran (every trainable gradient is in)
        self._inputs_done = False  # this backward: the gradients of the unit's inputs are computed
        self._into_views = gather_into_views(dp_mesh) and not offload
        self._async_gather = async_gather(dp_mesh)
        # Units over the same modules whose parameters shard over other meshes (a shard_placement_fn's
        # ShardPlacementResult): driven by this one, each with its own all-gather and reduce-scatter.
        self.members: Tuple["FSDPUnit", ...] = ()
        self._in_call = False  # inside one of this unit's methods (see _and_members)
        self._hook_full_params()

    def add_members(self, members: Sequence["FSDPUnit"]) -> None:
        """Make ``members`` (units over the same modules, other shard meshes) follow this unit."""
        self.members = tuple(members)
        self.has_frozen = self.has_frozen or any(m.has_frozen for m in self.members)

    def configure(self, **settings) -> None:
        """Change run-time settings (FSDPModule's setters) of this unit and its members.

        Example:
            >>> unit.configure(requires_gradient_sync=False)  # doctest: +SKIP
        """
        unknown = set(settings) - _SETTINGS
        if unknown:
            raise AttributeError(f"FSDPUnit.configure: no setting {sorted(unknown)}; settings are {sorted(_SETTINGS)}")
        for unit in (self, *self.members):
            for name, value in settings.items():
                setattr(unit, name, value)

    def _hook_full_params(self) -> None:
        for s in self.slots:
            if s.requires_grad:
                s.hooks.append(s.full_param.register_post_accumulate_grad_hook(self._grad_ready))

    # ---- all-gather ------------------------------------------------------------------
    @_and_members
    def unshard(self) -> None:
        """Start the all-gather of every shard into the full buffer (no-op if under way or done).

        When gathers are synchronous (see ``async_gather``) it also finishes it: the gathered
        data waits in the flat result until :meth:`wait_unsharded` copies it out. After
        :meth:`reshard_to_group` it gathers the kept pieces within the smaller group.
        """
        if self.buffers is None or self._unsharded or self._gather is not None:
            return
        if self._group_piece is not None:
            self._gather_from_group = True
            self._gather_input = self._group_piece
            self._gather = C.all_gather(self._group_piece, self.post_forward_mesh, 0, async_op=self._async_gather)
            return
        self._resync_shards()  # may move the buffers (to_empty after fully_shard on meta): read them after
        b = self.buffers
        shard = b.shard
        if shard.device != b.full.device:  # offloaded: host to device first
            shard = shard.to(b.full.device, non_blocking=True)
        if shard.dtype != b.compute_dtype:
            shard = shard.to(b.compute_dtype)
        self._gather_input = shard if self._async_gather else None
        with torch.no_grad():
            if not self._into_views:  # the shard buffer is already flat: gather it as it is
                # Not from the buffer pool: copied out and dropped at once, a pooled output would keep
                # a unit-sized buffer with the pool between steps (memory torch's fully_shard gives back).
                self._gather = C.all_gather(shard, self.dp_mesh, 0, async_op=self._async_gather, pooled=False)
                return  # the full buffer is allocated when the data arrives: one less buffer in flight
            b.alloc_full()
            n = b.staging_numel()
            self._staging = torch.empty(n, dtype=b.compute_dtype, device=b.full.device) if n else None
            outs, ins = b.gather_args(shard, self._staging)
            self._gather = C.all_gather_into_views(outs, ins, b.full, self.dp_mesh, 0, async_op=self._async_gather)

    @_and_members
    def wait_unsharded(self) -> None:
        """Wait for the all-gather (starting it if needed); the full parameters are then valid."""
        if self.buffers is None or self._unsharded:
            return
        self.unshard()
        gathered = wait_all(self._gather)
        with torch.no_grad():
            if self._gather_from_group:  # the flat full buffer, cut in group-size pieces
                self.buffers.alloc_full()
                self.buffers.full.copy_(gathered[:self.buffers.full_numel])
                self._group_piece = None
            elif not self._into_views:
                self.buffers.alloc_full()
                self.buffers.copy_out(gathered)
            elif self._staging is not None:
                self.buffers.place_staged(self._staging)
        self._gather = self._staging = self._gather_input = None
        self._gather_from_group = False
        self._unsharded = True

    @_and_members
    def reshard(self) -> None:
        """Free the full buffer (the saved-for-backward views keep the storage object, not the memory)."""
        if self.buffers is None:
            return
        if self._gather is not None:  # a prefetch nobody used: finish it so the ranks stay in step
            self.wait_unsharded()
        if not self.keep_unsharded_storage:  # kept: the next gather writes into the same memory
            self.buffers.free_full()
        self._group_piece = None
        self._unsharded = False

    @_and_members
    def reset(self) -> None:
        """Forget an iteration an exception aborted: sharded parameters back, nothing pending, no gradients kept."""
        if _state.in_flight is self:
            _state.in_flight = None
        self._gather = self._staging = self._gather_input = None  # issued on every rank or on none: not awaited
        self._gather_from_group = False
        self.swap_out()
        if self.buffers is not None:
            self.buffers.free_full()
        self._unsharded = False
        self._group_piece = self._reduce = self._partial = None
        self.backward_started = False
        self._grad_pending = 0
        for s in self.slots:
            s.full_param.grad = None

    @_and_members
    def reshard_to_group(self) -> None:
        """Keep only this rank's 1/N of the full buffer (N: the post-forward group's size), free the rest.

        Backward then all-gathers within that group of N ranks instead of the whole dp group.
        """
        if self.buffers is None or not self._unsharded:
            return
        b, g = self.buffers, self.post_forward_mesh
        n, i = g.size(), g._coord[0]
        length = -(-b.full_numel // n)
        lo = min(i * length, b.full_numel)
        hi = min(lo + length, b.full_numel)
        piece = torch.zeros(length, dtype=b.compute_dtype, device=b.full.device)
        piece[:hi - lo].copy_(b.full[lo:hi])
        self.reshard()
        self._group_piece = piece

    def _resync_shards(self) -> None:
        """If something rebound a sharded parameter's local tensor, copy it back into its slot.

        A rebinding onto another device (``model.to_empty(device=...)`` after ``fully_shard`` on the meta
        device, as torchtitan builds models; ``model.to(...)``) moves the unit's buffers there first.
        """
        b = self.buffers
        device = self.slots[0].sharded._local_tensor.device
        if device != b.shard.device and not self.offload:
            self._move_buffers(device)
        for s in self.slots:
            local = s.sharded._local_tensor
            if local.data_ptr() != s.local_view.data_ptr() or local.shape != s.local_view.shape:
                with torch.no_grad():
                    s.local_view.copy_(local)
                s.sharded._local_tensor = s.local_view

    def _move_buffers(self, device: torch.device) -> None:
        """New shard and full buffers on ``device``, holding the parameters' (rebound) local tensors;
        new full parameters over them (the hooks move along)."""
        old = self.buffers
        self.buffers = UnitBuffers(self.slots, old.shard.dtype, old.compute_dtype, old.reduce_dtype, device)
        for s in self.slots:
            s.sharded._local_tensor = self.buffers.hold_piece(s, s.sharded._local_tensor)
            for h in s.hooks:
                h.remove()
            s.hooks.clear()
            s.full_param = self.buffers.full_param(s)
        self.buffers.free_full()
        self._hook_full_params()

    # ---- parameter swap --------------------------------------------------------------
    @_and_members
    def swap_in(self) -> None:
        """Point the modules at the full parameters (plain tensors, or DTensors on the tp mesh on 2-D)."""
        for s in self.slots:
            for m, name in s.owners():
                m._parameters[name] = s.full_param

    @_and_members
    def swap_out(self) -> None:
        """Point the modules back at the sharded DTensor parameters."""
        for s in self.slots:
            for m, name in s.owners():
                m._parameters[name] = s.sharded

    @_and_members
    def swap_in_for_backward(self) -> None:
        """Backward reached the unit: the full parameters go back in, for a recomputation (activation
        checkpointing) to see what the forward saw; :meth:`release_after_backward` takes them out."""
        if self._unsharded or self.buffers is None:
            self.swap_in()

    # ---- gradients -------------------------------------------------------------------
    @_and_members
    def start_backward(self) -> None:
        """Backward reached this unit: count the gradients to wait for before its reduce-scatter."""
        self._grad_pending = sum(1 for s in self.slots if s.requires_grad)
        self.backward_started = True
        self._grads_done = self._inputs_done = False

    @_and_members
    def inputs_done(self) -> None:
        """The gradients of the unit's inputs are computed: nothing in the unit reads its parameters any more."""
        self._inputs_done = True
        if self._grads_done or self._grad_pending <= 0:
            self.release_after_backward()

    @_this_unit_only
    def release_after_backward(self) -> None:
        """Sharded parameters back in the modules; free the full buffer (if ``reshard_after_backward``)."""
        self.swap_out()
        if self.reshard_after_backward:
            self.reshard()

    def _grad_ready(self, p: torch.Tensor) -> None:
        if not self.backward_started:
            self.start_backward()
        self._grad_pending -= 1
        if self._grad_pending == 0:
            self.post_backward()

    @_this_unit_only
    def post_backward(self) -> None:
        """The unit's gradients are all there: start their reduce-scatter, free the full buffer.

        With a frozen parameter in the unit the full buffer waits for :meth:`inputs_done` (or the
        end of backward): the frozen parameter's own backward may come after every gradient.
        """
        if self.requires_gradient_sync and any(s.requires_grad for s in self.slots):
            self._launch_reduce()
        self._grads_done = True
        if not self.has_frozen or self._inputs_done:
            self.release_after_backward()
        self.backward_started = False
        self._grad_pending = -1  # done for this backward

    def _local_grad(self, s: ParamSlot) -> Optional[torch.Tensor]:
        g = s.full_param.grad
        if g is None:
            return None
        if isinstance(g, DTensor) and s.tp_spec is None:
            # A plain parameter that met DTensor inputs (taken as replicated): its gradient comes back a
            # DTensor on their mesh, possibly partial; the unit reduces its whole value.
            g = wait_all(g.full_tensor())
        elif isinstance(g, DTensor):  # 2-D: the tp-local gradient laid out like the parameter on tp
            want = tuple(g._spec.placements[i] if i in s.keep_dims else pl
                         for i, pl in enumerate(s.tp_spec.placements))
            if tuple(g._spec.placements) != want:
                g = g.redistribute(s.tp_spec.mesh, want)
            g = wait_all(g._local_tensor)
        elif s.grad_sum_dims:  # spmd_types: R on a model-parallel axis has a partial (P) gradient there
            g = C.all_reduce(g, s.tp_spec.mesh, s.grad_sum_dims, "sum")
        return g

    def _launch_reduce(self) -> None:
        # As torch's fully_shard does: the previous reduce-scatter (another unit's, or this one's
        # left in flight by a backward that was not the last) has had this unit's backward to
        # finish; completing it now frees its packed input before we allocate ours.
        if _state.in_flight is not None:
            _state.in_flight.complete_reduce()
        b = self.buffers
        packed = torch.empty((self.dp_mesh.size(), b.grad_numel), dtype=b.reduce_dtype, device=b.full.device)
        factor = self.gradient_divide_factor
        if factor is None and self.force_sum_reduction:  # sum, then divide by the data-parallel size
            factor = float(self.dp_mesh.size() * (self.replicate_mesh.size() if self.replicate_mesh else 1))
        with torch.no_grad():
            for s in self.slots:
                if s.requires_grad:  # frozen slots are not in the packed layout
                    b.pack_gradient(s, packed, self._local_grad(s))
                    s.full_param.grad = None  # the full gradient is not needed any more
            asynchronous = async_reduce(self.dp_mesh)
            work = C.reduce_scatter(packed.view(-1), self.dp_mesh, 0, "avg" if factor is None else "sum",
                                    async_op=asynchronous)
        # The flags as they are now: the completion may run during a later backward. An async
        # reduce-scatter's input must live until it is done; a finished one's is freed here.
        self._reduce = (work, packed if asynchronous else None, self.requires_all_reduce, factor)
        _state.in_flight = self

    @_and_members
    def finish_gradients(self, wait: bool = True) -> None:
        """End of backward: reduce what never got ready, reshard, and (``wait``) write the gradients into ``.grad``."""
        if self._grad_pending > 0 or self.backward_started:  # some gradient never arrived (unused parameter)
            self.post_backward()
        self.backward_started = False
        self._grad_pending = 0
        self.release_after_backward()
        if wait:
            self.complete_reduce()

    @_and_members
    def complete_reduce(self) -> None:
        """Wait for this unit's reduce-scatter (if any), all-reduce across replicas (HSDP), write ``.grad``."""
        if _state.in_flight is self:
            _state.in_flight = None
        if self._reduce is None:
            return
        work, _, all_reduce, factor = self._reduce
        self._reduce = None
        gshard = wait_all(work)
        with torch.no_grad():
            if self.replicate_mesh is not None:
                if self._partial is not None:  # earlier backwards' reduce-scattered gradients
                    gshard = gshard + self._partial
                    self._partial = None
                if not all_reduce:
                    self._partial = gshard  # summed until a backward that all-reduces
                    return
                gshard = C.all_reduce(gshard, self.replicate_mesh, 0, "avg" if factor is None else "sum",
                                      inplace=True)
            if factor is not None:
                gshard = gshard / factor
            if self.all_reduce_hook is not None:
                self.all_reduce_hook(gshard)
            for s in self.slots:
                if not s.requires_grad:
                    continue
                local = self.buffers.slot_view(s, gshard, s.local_len)
                shard_dev = s.local_view.device
                if local.dtype != s.orig_dtype or local.device != shard_dev:
                    local = local.to(device=shard_dev, dtype=s.orig_dtype)
                _accumulate_sharded_grad(s.sharded, DTensor(local, s.sharded._spec))


def _accumulate_sharded_grad(param: torch.nn.Parameter, grad: DTensor) -> None:
    """Write the reduced gradient shard into ``param.grad`` with the user's hooks on ``param``.

    Autograd computes with the full parameters, so it never runs hooks registered on the
    sharded ones: their tensor hooks see (and may replace) the reduced shard here, and their
    post-accumulate-grad hooks run once it is in ``.grad`` (optimizer-in-backward), as for a leaf.
    """
    for hook in (param._backward_hooks or {}).values():
        out = hook(grad)
        if out is not None:
            grad = out
    if param.grad is None:
        param.grad = grad
    else:
        param.grad._local_tensor.add_(grad._local_tensor)
    for hook in (param._post_accumulate_grad_hooks or {}).values():
        hook(param)
