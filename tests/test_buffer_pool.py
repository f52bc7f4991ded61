"""Reuse of redistribution output buffers (mesh/transport/buffer_pool.py): it reuses, and never a held buffer.

A wrong reuse is a silent wrong answer, so most tests try to break it: a result the user keeps,
a view of it, ``.data``/``detach``, a storage handle, a tensor autograd saved, an async result not
yet waited, two results alive at once, a result written in place after the next redistribution.
Each must keep its values (compared with plain torch). One test shows the pool does reuse.
Rank tests lower ``MIN_BYTES`` to 0 so that small tensors go through the pool too.
"""
import gc
import threading

import pytest
import torch

from shardprop.mesh.transport import buffer_pool as bp
from shardprop.mesh import config
from tests.rankpool import run_on_ranks

SHAPE = (512, 1024)  # 2 MB of float32: above MIN_BYTES


@pytest.fixture(autouse=True)
def _fresh_pool():
    bp.set_buffer_reuse(True)
    bp.clear()
    yield
    bp.set_buffer_reuse(True)
    bp.clear()


def _like():
    return torch.empty(0)


def _ptr(t):
    return t.untyped_storage().data_ptr()


# ---------------------------------------------------------------- one process
def test_reuses_a_dropped_buffer():
    a = bp.empty(SHAPE, _like())
    p = _ptr(a)
    before = dict(bp.stats)
    del a
    b = bp.empty(SHAPE, _like())
    assert _ptr(b) == p
    assert bp.stats["reused"] == before["reused"] + 1
    assert b.shape == SHAPE and b.is_contiguous() and b._base is None


def test_other_dtype_same_bytes_reuses():
    a = bp.empty(SHAPE, _like())
    p = _ptr(a)
    del a
    b = bp.empty((SHAPE[0], SHAPE[1] * 2), torch.empty(0, dtype=torch.bfloat16))
    assert _ptr(b) == p and b.dtype == torch.bfloat16


@pytest.mark.parametrize("holder", ["tensor", "view", "data", "detach", "storage", "reshape_view", "list_of_views"])
def test_held_buffer_is_never_reused(holder):
    a = bp.empty(SHAPE, _like()).fill_(3.0)
    held = {"tensor": lambda: a, "view": lambda: a[1:], "data": lambda: a.data, "detach": lambda: a.detach(),
            "storage": lambda: a.untyped_storage(), "reshape_view": lambda: a.view(-1),
            "list_of_views": lambda: list(a.unbind(0))}[holder]()
    p = _ptr(a)
    del a
    b = bp.empty(SHAPE, _like()).fill_(-1.0)
    assert _ptr(b) != p
    if holder == "storage":
        assert torch.frombuffer(bytearray(bytes(held)[:16]), dtype=torch.float32).eq(3.0).all()
    elif holder == "list_of_views":
        assert all(v.eq(3.0).all() for v in held)
    else:
        assert held.eq(3.0).all()


def test_autograd_saved_buffer_is_not_reused():
    a = bp.empty(SHAPE, _like()).copy_(torch.arange(SHAPE[0] * SHAPE[1], dtype=torch.float32).view(SHAPE))
    expect = a.clone()
    w = torch.ones(SHAPE, requires_grad=True)
    z = (w * a).sum()  # saves ``a`` for backward
    del a
    b = bp.empty(SHAPE, _like()).fill_(-5.0)
    z.backward()
    assert torch.equal(w.grad, expect)
    del b


def test_set_and_resize_are_safe():
    a = bp.empty(SHAPE, _like())
    p = _ptr(a)
    a.set_(torch.zeros(3).untyped_storage())  # a leaves the pool's memory: it is free again
    b = bp.empty(SHAPE, _like())
    assert _ptr(b) == p
    b.resize_(SHAPE[0] * 4, SHAPE[1])  # grows the shared storage: no longer what was kept
    del b
    c = bp.empty(SHAPE, _like())
    assert c.untyped_storage().nbytes() == SHAPE[0] * SHAPE[1] * 4


def test_small_cuda_traced_and_disabled_allocate_normally():
    small = bp.empty((4,), _like())
    assert not bp.holds(small)
    bp.set_buffer_reuse(False)
    a = bp.empty(SHAPE, _like())
    p = _ptr(a)
    del a
    assert not bp.holds(bp.empty(SHAPE, _like()))
    assert not bp.buffer_reuse_enabled()
    bp.set_buffer_reuse(True)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        f = bp.empty(SHAPE, mode.from_tensor(torch.empty(1)))
        assert type(f) is not torch.Tensor
    del p


def test_bounded_least_recently_used_first():
    kept = [bp.empty(SHAPE, _like()) for _ in range(config.values.buffer_max_buffers + 3)]
    assert len(bp._kept) == config.values.buffer_max_buffers
    assert sum(1 for t in kept if bp.holds(t)) == config.values.buffer_max_buffers
    assert not bp.holds(kept[0]) and bp.holds(kept[-1])


def test_byte_bound():
    nbytes = SHAPE[0] * SHAPE[1] * 4
    old = config.values.buffer_max_bytes
    try:
        bp.set_buffer_reuse(True, max_bytes=3 * nbytes)
        kept = [bp.empty(SHAPE, _like()) for _ in range(5)]
        assert sum(1 for t in kept if bp.holds(t)) == 3 and bp._state.kept_bytes == 3 * nbytes
    finally:
        bp.set_buffer_reuse(True, max_bytes=old)


def test_threads_never_share_a_buffer():
    errors = []

    def work(value):
        for _ in range(50):
            t = bp.empty(SHAPE, _like()).fill_(value)
            u = bp.empty(SHAPE, _like()).fill_(-value)
            if not (t.eq(value).all() and u.eq(-value).all()):
                errors.append(value)
    threads = [threading.Thread(target=work, args=(float(v),)) for v in range(1, 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


# ---------------------------------------------------------------- on ranks
BENCH_CASES = [(("S0",), ("R",)), (("S1",), ("R",)), (("P",), ("R",)), (("P",), ("S0",)), (("S0",), ("S1",)),
               (("R",), ("S0",)), (("S0", "S1"), ("R", "R")), (("S0", "R"), ("R", "S0")),
               (("S0", "S1"), ("S1", "S0")), (("S0", "S0"), ("S0", "S1")), (("S1",), ("S0",)),
               (("R",), ("P",)), (("S1", "S0"), ("R", "R")), (("P", "S1"), ("R", "S0"))]


def _pl(codes):
    from shardprop import Partial, Replicate, Shard
    return [Replicate() if c == "R" else Partial() if c == "P" else Shard(int(c[1:])) for c in codes]


def _chunk(full, mesh_shape, coord, codes):
    for m, c in enumerate(codes):
        if c.startswith("S"):
            d = int(c[1:])
            pieces = torch.chunk(full, mesh_shape[m], dim=d)
            full = pieces[coord[m]] if coord[m] < len(pieces) else full.narrow(d, full.shape[d], 0)
    return full


def _source(full, mesh, codes, seed_base):
    """A DTensor of value ``full`` laid out as ``codes`` (Partial: rank r holds addend r, which sum to ``full``)."""
    import torch.distributed as dist
    from shardprop import DTensor, distribute_tensor
    coord = mesh.get_coordinate()
    if "P" not in codes:
        return distribute_tensor(full, mesh, _pl(codes))
    k = mesh.shape[codes.index("P")]
    me = coord[codes.index("P")]
    addends = [torch.randn(full.shape, generator=torch.Generator().manual_seed(seed_base + r)) for r in range(k - 1)]
    last = full - sum(addends)
    mine = (addends + [last])[me]
    shard_codes = ["R" if c == "P" else c for c in codes]
    return DTensor.from_local(_chunk(mine, mesh.shape, coord, shard_codes).contiguous(), mesh, _pl(codes),
                              shape=full.shape, stride=full.stride())


def _expect(full, mesh, codes):
    coord = mesh.get_coordinate()
    if "P" in codes:  # Replicate->Partial: only the value is defined
        return None
    return _chunk(full, mesh.shape, coord, codes)


def _every_transition_keeps_values(shape):
    """Each transition three times, all results kept alive, each written in place after the next."""
    from shardprop import init_device_mesh
    from shardprop.mesh.transport import buffer_pool
    buffer_pool.MIN_BYTES, old = 0, buffer_pool.MIN_BYTES
    buffer_pool.clear()
    try:
        errors = []
        for src, dst in BENCH_CASES:
            mesh = init_device_mesh("cpu", (4,) if len(src) == 1 else (2, 2))
            kept = []
            for it in range(3):
                full = torch.randn(shape, generator=torch.Generator().manual_seed(100 * it + len(kept)))
                x = _source(full, mesh, src, 1000 * it)
                y = x.redistribute(placements=_pl(dst))
                value = y.full_tensor()
                if not torch.allclose(value, full, atol=1e-5):
                    errors.append(f"{src}->{dst} it {it}: value")
                want = _expect(full, mesh, dst)
                local = y.to_local()
                if want is not None and not torch.allclose(local, want, atol=1e-5):
                    errors.append(f"{src}->{dst} it {it}: local")
                if kept:  # the previous result, written in place after this redistribution
                    prev, prev_copy = kept[-1]
                    prev.add_(1.0)
                    prev_copy.add_(1.0)
                kept.append((local, local.clone()))
                del x, y, value
            for i, (t, copy) in enumerate(kept):
                if not torch.equal(t, copy):
                    errors.append(f"{src}->{dst}: result {i} changed after later redistributions")
        return errors
    finally:
        buffer_pool.MIN_BYTES = old


@pytest.mark.parametrize("shape", [(8, 12), (7, 9)])
def test_every_bench_transition_keeps_values_with_reuse(shape):
    for errors in run_on_ranks(4, _every_transition_keeps_values, shape):
        assert errors == []


def _reuse_happens_and_holders_keep_values():
    import torch.distributed as dist
    from shardprop import Replicate, Shard, distribute_tensor, init_device_mesh
    from shardprop.mesh.transport import buffer_pool
    buffer_pool.MIN_BYTES, old = 0, buffer_pool.MIN_BYTES
    buffer_pool.clear()
    try:
        mesh = init_device_mesh("cpu", (4,))
        out = {}
        fulls = [torch.randn(16, 8, generator=torch.Generator().manual_seed(s)) for s in range(6)]
        xs = [distribute_tensor(f, mesh, [Shard(0)]) for f in fulls]
        # Reuse: results dropped at once come back in the same memory.
        gc.collect()
        ptrs = set()
        before = buffer_pool.stats["reused"]
        for x, f in zip(xs, fulls):
            y = x.redistribute(placements=[Replicate()]).to_local()
            ptrs.add(y.untyped_storage().data_ptr())
            out.setdefault("dropped_ok", True)
            out["dropped_ok"] &= torch.equal(y, f)
            del y
        out["reused"] = buffer_pool.stats["reused"] - before
        out["distinct_ptrs"] = len(ptrs)
        # Async results not yet waited, several alive at once.
        pend = [x.redistribute(placements=[Replicate()], async_op=True) for x in xs]
        out["async_ok"] = all(torch.equal(p.to_local(), f) for p, f in zip(pend, fulls))
        # A view and an autograd-saved result outlive their tensors.
        view = xs[0].redistribute(placements=[Replicate()]).to_local()[2:5]
        w = torch.ones(16, 8, requires_grad=True)
        saved = xs[1].redistribute(placements=[Replicate()]).to_local()
        z = (w * saved).sum()
        del saved
        for x in xs[2:]:
            x.redistribute(placements=[Replicate()]).to_local().fill_(-7.0)
        z.backward()
        out["view_ok"] = torch.equal(view, fulls[0][2:5])
        out["saved_ok"] = torch.equal(w.grad, fulls[1])
        # Differentiable redistribution: backward reuses too, gradients stay right.
        a = distribute_tensor(fulls[2], mesh, [Shard(0)]).requires_grad_()
        for _ in range(3):
            a.grad = None
            r = a.redistribute(placements=[Replicate()])
            (r.to_local() * fulls[3]).sum().backward()
            out.setdefault("grad_ok", True)
            out["grad_ok"] &= torch.equal(a.grad.full_tensor(), fulls[3])
        # Switched off: no reuse.
        buffer_pool.set_buffer_reuse(False)
        before = buffer_pool.stats["reused"]
        for x in xs:
            x.redistribute(placements=[Replicate()]).to_local()
        out["reused_off"] = buffer_pool.stats["reused"] - before
        dist.barrier()
        return out
    finally:
        buffer_pool.MIN_BYTES = old
        buffer_pool.set_buffer_reuse(True)


def test_reuse_happens_and_holders_keep_values():
    for out in run_on_ranks(4, _reuse_happens_and_holders_keep_values):
        assert out["dropped_ok"] and out["async_ok"] and out["view_ok"] and out["saved_ok"] and out["grad_ok"], out
        # Six results dropped at once: all but the first may reuse (a garbage cycle freed late may cost one more).
        assert out["reused"] >= 4 and out["distinct_ptrs"] <= 2, out
        assert out["reused_off"] == 0, out
