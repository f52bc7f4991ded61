"""Redistribution: random placement transitions (Hypothesis), regressions,
autograd, async, distribute_tensor's source rank, and plan shapes.

Hypothesis runs in the parent: each drawn example is a *batch* of transitions
(shape, source and target placements, seed) sent to the ranks in one
``run_on_ranks`` call, so the price of a round trip is paid once per batch.
Every rank draws nothing itself: it rebuilds the same global tensor from the
seed, so all ranks make identical choices.
"""

import math
import traceback

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from shardprop import (DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh,
                       plan_redistribute)
from shardprop.tensor.dtensor import local_chunk
from shardprop.mesh.async_tensor import AsyncTensor, wait_all
from tests.rankpool import get_pool, run_on_ranks

MESHES = {  # name -> (world size, mesh shape)
    "1d": (4, (4,)),
    "2d": (4, (2, 2)),
    "3d": (8, (2, 2, 2)),
}

REDUCE_OPS = ("sum", "avg", "max", "min")


# ---------------------------------------------------------------- reference helpers (rank side)


def _reference_chunk(full, mesh_shape, coord, placements):
    """This coordinate's shard, cut with torch.chunk independently of shardprop:
    mesh dims sharding one tensor dim split it in turn, outermost first; ranks
    past the last chunk torch.chunk returns hold an empty piece."""
    out = full
    for m, p in enumerate(placements):
        if type(p) is Shard:
            pieces = torch.chunk(out, mesh_shape[m], dim=p.dim) if out.shape[p.dim] else ()
            if coord[m] < len(pieces):
                out = pieces[coord[m]]
            else:
                out = out.narrow(p.dim, out.shape[p.dim], 0)
    return out


def _full(shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _partial_local(full, mesh, placements, seed):
    """A shard whose Partial mesh dims really hold different values per rank.

    local = full_shard * prod(1/k for sum dims) + sum of per-dim perturbations:
    zero-sum for sum/avg dims, <= 0 with a 0 at one index for max, >= 0 with a
    0 at one index for min. Every reduction then leaves the others' properties
    intact, so the reduced value is ``full`` whatever order the dims reduce in.
    """
    coord = mesh.get_coordinate()
    local = _reference_chunk(full, mesh.shape, coord, placements).clone().double()
    g = torch.Generator().manual_seed(seed + 1)
    for m, p in enumerate(placements):
        if type(p) is not Partial:
            continue
        k = mesh.shape[m]
        noise = torch.randn((k,) + tuple(local.shape), generator=g, dtype=torch.float64)
        if p.reduce_op == "sum":
            local = local / k
            noise = noise - noise.mean(0, keepdim=True)
        elif p.reduce_op == "avg":
            noise = noise - noise.mean(0, keepdim=True)
        else:
            winner = int(torch.randint(k, (), generator=g))
            noise = noise.abs()
            noise[winner] = 0
            if p.reduce_op == "max":
                noise = -noise
        local = local + noise[coord[m]]
    return local.to(full.dtype)


def _describe(ex):
    shape, src, dst, seed, source, async_op, grad = ex
    return (f"shape={shape} {list(src)} -> {list(dst)} seed={seed} source={source} "
            f"async_op={async_op} grad={grad}")


def _close(got, want, exact):
    if got.shape != want.shape:
        return False
    return torch.equal(got, want) if exact else torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def _noncontiguous(t):
    """The same values in a non-contiguous tensor (every other element of a buffer)."""
    buf = torch.zeros(tuple(t.shape) + (2,), dtype=t.dtype)[..., 0]
    buf.copy_(t)
    return buf


def _differentiable(placements):
    return not any(type(p) is Partial and p.reduce_op in ("max", "min") for p in placements)


def _run_batch(mesh_shape, batch):
    """Rank side of the property test: returns one entry per example, None when
    it passed, else a message. Stops at the first exception (ranks may be out of
    step after one)."""
    mesh = init_device_mesh("cpu", mesh_shape)
    coord = mesh.get_coordinate()
    results = []
    for ex in batch:
        shape, src, dst, seed, source, async_op, grad = ex
        try:
            full = _full(shape, seed)
            has_partial = any(type(p) is Partial for p in (*src, *dst))
            exact = not has_partial
            leaf = None
            if source == "distribute":
                x = distribute_tensor(full, mesh, src)
            else:
                # Partial source dims hold really different values per rank here.
                local = _partial_local(full, mesh, src, seed)
                if source == "from_local_noncontig":
                    local = _noncontiguous(local)
                if grad and _differentiable(src) and _differentiable(dst):
                    local = leaf = local.clone().requires_grad_(True)
                x = DTensor.from_local(local, mesh, src, shape=full.shape, stride=full.stride())
            before = x.to_local().detach().clone()
            y = x.redistribute(placements=dst, async_op=async_op)
            problems = []
            if tuple(y.placements) != tuple(dst) or y.shape != full.shape:
                problems.append(f"result is {list(y.placements)} {tuple(y.shape)}")
            if not torch.equal(x.to_local().detach(), before):
                problems.append("redistribute wrote into its input's local tensor")
            out_local = wait_all(y.to_local())
            if tuple(src) != tuple(dst) and out_local.numel() and \
                    out_local.untyped_storage().data_ptr() == x.to_local().untyped_storage().data_ptr():
                problems.append("the result's local tensor shares memory with the input's")
            if not any(type(p) is Partial for p in dst):
                want = _reference_chunk(full, mesh.shape, coord, dst)
                got = y.to_local().detach()
                if not _close(got, want, exact):
                    problems.append(f"local shard {tuple(got.shape)} {got} != expected {tuple(want.shape)} {want}")
                if not torch.equal(local_chunk(full, mesh, dst), want):
                    problems.append("shardprop.dtensor.local_chunk disagrees with torch.chunk")
            back = y.full_tensor()
            if not _close(back.detach(), full, exact):
                problems.append(f"full_tensor() {tuple(back.shape)} {back} != original {full}")
            if leaf is not None:
                G = _full(shape, seed + 2)
                (back * G).sum().backward()
                plain = [Replicate() if type(p) is Partial else p for p in src]
                want = _reference_chunk(G, mesh.shape, coord, plain)
                for m, p in enumerate(src):
                    if type(p) is Partial and p.reduce_op == "avg":
                        want = want / mesh.shape[m]
                if leaf.grad is None or not _close(leaf.grad, want, exact=False):
                    ratio = ""
                    if leaf.grad is not None and leaf.grad.shape == want.shape and want.norm() > 0:
                        ratio = f" (got/expected ~ {float((leaf.grad * want).sum() / (want * want).sum()):.3g})"
                    problems.append(f"gradient{ratio} {leaf.grad} != expected {want}")
            results.append("; ".join(problems) or None)
        except Exception:
            results.append("raised:\n" + traceback.format_exc())
            break
    return results


# ---------------------------------------------------------------- strategies (parent side)


@st.composite
def _placement(draw, ndim):
    kinds = ["R", "P"] + (["S"] * 2 if ndim else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "S":
        return Shard(draw(st.integers(0, ndim - 1)))
    if kind == "R":
        return Replicate()
    return Partial(draw(st.sampled_from(REDUCE_OPS)))


@st.composite
def _example(draw, mesh_ndim):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.sampled_from(range(10)), min_size=ndim, max_size=ndim)))
    src = tuple(draw(_placement(ndim)) for _ in range(mesh_ndim))
    dst = tuple(draw(_placement(ndim)) for _ in range(mesh_ndim))
    seed = draw(st.integers(0, 2**31 - 1))
    source = draw(st.sampled_from(["distribute", "from_local", "from_local_noncontig"]))
    async_op = draw(st.booleans())
    grad = draw(st.booleans())
    return (shape, src, dst, seed, source, async_op, grad)


def _check_batch(mesh_name, batch):
    world, mesh_shape = MESHES[mesh_name]
    per_rank = run_on_ranks(world, _run_batch, mesh_shape, batch, timeout=120)
    failures = {}  # example index -> (ranks, first message)
    for rank, results in enumerate(per_rank):
        for i, res in enumerate(results):
            if res is not None:
                failures.setdefault(i, ([], res))[0].append(rank)
    if any(len(results) < len(batch) for results in per_rank):
        get_pool(world).shutdown()  # an exception may have left the ranks out of step
    if failures:
        lines = [f"{len(failures)} of {len(batch)} transitions failed on mesh {mesh_shape}:"]
        for i, (ranks, msg) in sorted(failures.items())[:10]:
            lines.append(f"- {_describe(batch[i])}\n  ranks {ranks}: {msg if len(msg) < 1500 else msg[:1500] + ' ...'}")
        raise AssertionError("\n".join(lines))


# Per mesh: `examples` batches of batch/2..batch transitions each (several
# hundred in all; one costs ~10 ms on 4 ranks, ~25 ms on 8, on 2 idle cores).
# No shrinking: one step costs a round trip to the ranks, and hundreds of them
# take minutes; the message names each failing transition instead.
_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
                 phases=[Phase.explicit, Phase.reuse, Phase.generate], print_blob=True)


@pytest.mark.parametrize("mesh_name,examples,batch", [("1d", 10, 60), ("2d", 10, 60), ("3d", 5, 50)])
def test_redistribute_roundtrip_property(mesh_name, examples, batch):
    mesh_ndim = len(MESHES[mesh_name][1])

    @settings(max_examples=examples, **_SETTINGS)
    @given(st.lists(_example(mesh_ndim), min_size=batch // 2, max_size=batch))
    def prop(b):
        _check_batch(mesh_name, b)

    prop()


# ---------------------------------------------------------------- regression: uneven nested shards


def _nested_uneven_to_replicate(rows, cols):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)
    x = distribute_tensor(full, mesh, [Shard(0), Shard(0)])
    y = x.redistribute(placements=[Replicate(), Replicate()])
    return x.to_local().tolist(), y.to_local().tolist(), y.full_tensor().tolist()


def test_nested_uneven_shard_to_replicate_keeps_all_rows():
    """(5, 3) as [S(0), S(0)] on 2x2 is split 3|2 by dp, then 2|1 and 1|1 by tp;
    gathering back to [R, R] must give all five rows on every rank."""
    full = torch.arange(15, dtype=torch.float32).reshape(5, 3).tolist()
    results = run_on_ranks(4, _nested_uneven_to_replicate, 5, 3)
    assert [r[0] for r in results] == [full[0:2], full[2:3], full[3:4], full[4:5]]
    for rank, (_, replicated, back) in enumerate(results):
        assert replicated == full, f"rank {rank}"
        assert back == full, f"rank {rank}"


# ---------------------------------------------------------------- autograd


def _grad_case(case):
    """Rank side: returns (forward value, input grad, expected forward, expected grad) as lists.

    The loss is the same scalar on every rank (or, for sharded outputs, each
    rank's share of it); the gradient of a Partial(avg) input is 1/n of the
    upstream one, of a Partial(sum) input the upstream one itself."""
    mesh = init_device_mesh("cpu", (2, 2))
    coord = mesh.get_coordinate()
    rank = dist.get_rank()
    shape = (5, 3)
    W = _full(shape, 11)      # the global input
    G = _full(shape, 12)      # upstream gradient weights
    RR = [Replicate(), Replicate()]
    if case in ("S->R", "SS->RR", "S0->S1", "full_tensor"):
        src, dst = {"S->R": ([Shard(0), Replicate()], RR), "SS->RR": ([Shard(0), Shard(1)], RR),
                    "S0->S1": ([Shard(0), Replicate()], [Shard(1), Replicate()]),
                    "full_tensor": ([Shard(1), Shard(0)], None)}[case]
        leaf = _reference_chunk(W, mesh.shape, coord, src).clone().requires_grad_(True)
        d = DTensor.from_local(leaf, mesh, src, shape=shape)
        if dst is None:
            out, g_out = d.full_tensor(), G
        else:
            out = d.redistribute(placements=dst).to_local()
            g_out = _reference_chunk(G, mesh.shape, coord, dst)
        (out * g_out).sum().backward()
        want_out, want_grad = _reference_chunk(W, mesh.shape, coord, dst or RR), _reference_chunk(G, mesh.shape, coord, src)
    elif case in ("P(sum)->R", "P(avg)->R", "P(sum)->S"):
        op = case[2:5]
        dst = [Shard(0), Replicate()] if case.endswith("S") else RR
        leaf = _full(shape, 100 + rank).requires_grad_(True)  # differs on every rank
        d = DTensor.from_local(leaf, mesh, [Partial(op), Replicate()])
        out = d.redistribute(placements=dst).to_local()
        (out * _reference_chunk(G, mesh.shape, coord, dst)).sum().backward()
        # the partials along mesh dim 0: the ranks with my tp coordinate
        total = sum(_full(shape, 100 + r) for r in range(4) if r % 2 == coord[1])
        want_out = _reference_chunk(total / 2 if op == "avg" else total, mesh.shape, coord, dst)
        want_grad = G / 2 if op == "avg" else G
    elif case == "R->P(avg)->R":  # the value never changes, so neither may the gradient
        leaf = W.clone().requires_grad_(True)
        d = DTensor.from_local(leaf, mesh, RR)
        out = d.redistribute(placements=[Partial("avg"), Replicate()]).redistribute(placements=RR).to_local()
        (out * G).sum().backward()
        want_out, want_grad = W, G
    elif case == "R->S":
        leaf = W.clone().requires_grad_(True)
        dst = [Shard(0), Shard(1)]
        d = DTensor.from_local(leaf, mesh, RR)
        out = d.redistribute(placements=dst).to_local()
        (out * _reference_chunk(G, mesh.shape, coord, dst)).sum().backward()
        want_out, want_grad = _reference_chunk(W, mesh.shape, coord, dst), G
    elif case == "to_local(grad_placements=P)":
        # every rank's local gradient is a partial sum of the replicated input's gradient
        leaf = W.clone().requires_grad_(True)
        out = DTensor.from_local(leaf, mesh, RR).to_local(grad_placements=[Partial(), Partial()])
        (out * _full(shape, 200 + rank)).sum().backward()
        want_out, want_grad = W, sum(_full(shape, 200 + r) for r in range(4))
    else:
        raise AssertionError(case)
    assert leaf.grad is not None and type(leaf.grad) is torch.Tensor, type(leaf.grad)
    return out.detach().tolist(), leaf.grad.tolist(), want_out.tolist(), want_grad.tolist()


@pytest.mark.parametrize("case", ["S->R", "SS->RR", "S0->S1", "P(sum)->R", "P(avg)->R", "P(sum)->S", "R->S",
                                  "R->P(avg)->R", "full_tensor", "to_local(grad_placements=P)"])
def test_gradients(case):
    for rank, (out, grad, want_out, want_grad) in enumerate(run_on_ranks(4, _grad_case, case)):
        out, grad, want_out, want_grad = map(torch.tensor, (out, grad, want_out, want_grad))
        ok = out.shape == want_out.shape and torch.allclose(out, want_out, atol=1e-5)
        assert ok, f"rank {rank}: forward {out} != expected {want_out}"
        ok = grad.shape == want_grad.shape and torch.allclose(grad, want_grad, atol=1e-5)
        assert ok, f"rank {rank}: gradient {grad} != expected {want_grad}"


def _max_partial_backward():
    mesh = init_device_mesh("cpu", (4,))
    leaf = torch.ones(3, requires_grad=True)
    out = DTensor.from_local(leaf, mesh, [Partial("max")]).redistribute(placements=[Replicate()]).to_local()
    with pytest.raises(RuntimeError) as info:
        out.sum().backward()
    return str(info.value)


def test_no_gradient_through_partial_max_is_a_clear_error():
    for msg in run_on_ranks(4, _max_partial_backward):
        assert "P(max)" in msg and "gradient" in msg


# ---------------------------------------------------------------- async_op


_ASYNC_CASES = [  # (shape, src, dst) on a 2x2 mesh
    ((6, 4), (Shard(0), Replicate()), (Replicate(), Replicate())),
    ((5, 3), (Shard(0), Replicate()), (Replicate(), Replicate())),
    ((6, 4), (Partial(), Replicate()), (Replicate(), Replicate())),
    ((6, 4), (Replicate(), Partial("avg")), (Replicate(), Replicate())),
    ((6, 4), (Shard(0), Replicate()), (Shard(1), Replicate())),
    ((5, 7), (Replicate(), Shard(1)), (Replicate(), Shard(0))),
    ((6, 4), (Partial(), Replicate()), (Shard(0), Replicate())),
    ((5, 3), (Replicate(), Partial("max")), (Replicate(), Shard(0))),
    ((4, 6), (Shard(0), Shard(1)), (Replicate(), Replicate())),
    ((5, 3), (Shard(0), Shard(0)), (Replicate(), Replicate())),
    ((6, 4), (Shard(0), Shard(1)), (Shard(1), Shard(0))),
]


def _async_vs_sync(cases):
    mesh = init_device_mesh("cpu", (2, 2))
    out = []
    for i, (shape, src, dst) in enumerate(cases):
        full = _full(shape, 1000 + i)
        x = distribute_tensor(full, mesh, src)
        sync = x.redistribute(placements=dst)
        asy = x.redistribute(placements=dst, async_op=True)
        local = asy.to_local()
        last = plan_redistribute(x._spec, tuple(dst)).steps[-1].kind
        is_async = isinstance(local, AsyncTensor)
        same_meta = local.shape == sync.to_local().shape and local.dtype == sync.to_local().dtype
        equal = torch.equal(local, sync.to_local())  # first use: waits
        full_equal = torch.allclose(asy.full_tensor(), full, atol=1e-6)
        out.append((last, is_async, same_meta, equal, tuple(asy.placements) == tuple(dst), full_equal))
    return out


def test_async_redistribute_matches_sync():
    for rank, results in enumerate(run_on_ranks(4, _async_vs_sync, _ASYNC_CASES)):
        for (shape, src, dst), (last, is_async, same_meta, equal, placements_ok, full_ok) in zip(_ASYNC_CASES, results):
            what = f"rank {rank}: {shape} {list(src)} -> {list(dst)}"
            collective = last in ("all_gather", "all_to_all", "all_reduce", "reduce_scatter", "p2p")
            assert is_async == collective, f"{what}: last step {last}, AsyncTensor result: {is_async}"
            assert same_meta and placements_ok, what
            assert equal, f"{what}: async result differs from the sync one"
            assert full_ok, what
    # at least most cases end with a collective, or this test checks little
    assert sum(r[1] for r in results) >= 8


# ---------------------------------------------------------------- distribute_tensor's src_data_rank


_SRC_PLACEMENTS = [
    (Shard(0), Shard(1)), (Shard(0), Shard(0)), (Replicate(), Shard(1)), (Shard(1), Replicate()),
    (Replicate(), Replicate()), (Partial(), Shard(0)), (Shard(0), Partial("avg")), (Partial("max"), Replicate()),
    (Partial("min"), Partial()),
]


def _rank_data(base, rank):
    return base * (rank + 1) + 100 * rank


def _distribute_from(src_data_rank, placements_list, mesh_shape):
    mesh = init_device_mesh("cpu", mesh_shape)
    coord = mesh.get_coordinate()
    rank = dist.get_rank()
    base = _full((5, 3), 7)
    mine = _rank_data(base, rank)
    source = mine if src_data_rank is None else _rank_data(base, src_data_rank)
    out = []
    for placements in placements_list:
        data = mine.clone()
        x = distribute_tensor(data, mesh, list(placements), src_data_rank=src_data_rank)
        want = _reference_chunk(source, mesh.shape, coord, placements)
        for m, p in enumerate(placements):  # a replicated value as Partial(sum) lives on index 0 only
            if type(p) is Partial and p.reduce_op == "sum" and coord[m] != 0:
                want = torch.zeros_like(want)
        local_ok = x.to_local().shape == want.shape and torch.equal(x.to_local(), want)
        untouched = torch.equal(data, mine)
        if src_data_rank is None:
            full_ok = True  # ranks disagree: there is no one global value to compare with
        else:
            full_ok = torch.allclose(x.full_tensor(), source, atol=1e-5)
        out.append((local_ok, untouched, full_ok, tuple(x.placements) == tuple(placements)))
    return out


@pytest.mark.parametrize("src_data_rank", [0, 1, 3, None])
@pytest.mark.parametrize("mesh_shape", [(2, 2), (4,)])
def test_distribute_tensor_src_data_rank(src_data_rank, mesh_shape):
    placements = _SRC_PLACEMENTS if len(mesh_shape) == 2 else \
        [(Shard(0),), (Shard(1),), (Replicate(),), (Partial(),), (Partial("avg"),)]
    for rank, results in enumerate(run_on_ranks(4, _distribute_from, src_data_rank, placements, mesh_shape)):
        for p, (local_ok, untouched, full_ok, placements_ok) in zip(placements, results):
            what = f"rank {rank}, {list(p)}, src_data_rank={src_data_rank}"
            assert local_ok, f"{what}: wrong local shard"
            assert untouched, f"{what}: distribute_tensor wrote into the caller's tensor"
            assert full_ok, f"{what}: full_tensor() is not the source rank's data"
            assert placements_ok, what


def _bad_src_rank():
    mesh = init_device_mesh("cpu", (4,))
    with pytest.raises(ValueError) as info:
        distribute_tensor(torch.ones(4), mesh, [Shard(0)], src_data_rank=7)
    t = torch.ones(1)
    dist.all_reduce(t)  # every rank is still in step
    return str(info.value), t.item()


def test_distribute_tensor_bad_src_rank_raises_everywhere():
    for msg, total in run_on_ranks(4, _bad_src_rank, timeout=30):
        assert "src_data_rank" in msg and "7" in msg
        assert total == 4


# ---------------------------------------------------------------- plans


_COLLECTIVES = ("all_gather", "all_to_all", "all_reduce", "reduce_scatter", "broadcast", "scatter")


def _plan_and_count(mesh_shape, shape, src, dst):
    """(plan step kinds, their mesh dims, collectives actually called, result correct)."""
    import shardprop.mesh.collectives as C

    mesh = init_device_mesh("cpu", mesh_shape)
    full = _full(shape, 5)
    x = distribute_tensor(full, mesh, list(src))
    plan = plan_redistribute(x._spec, tuple(dst))
    called = []
    saved = {name: getattr(C, name) for name in _COLLECTIVES}

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            called.append(name)
            return fn(*args, **kwargs)
        return wrapper

    try:
        for name, fn in saved.items():
            setattr(C, name, counting(name, fn))
        y = x.redistribute(placements=list(dst))
        local = y.to_local().clone()
    finally:
        for name, fn in saved.items():
            setattr(C, name, fn)
    ok = torch.allclose(local, _reference_chunk(full, mesh.shape, mesh.get_coordinate(), dst), atol=1e-6) \
        if not any(type(p) is Partial for p in dst) else True
    return [s.kind for s in plan.steps], [s.mesh_dims for s in plan.steps], called, ok


@pytest.mark.parametrize("mesh_shape,shape,src,dst,kinds,dims", [
    ((4,), (8, 8), (Shard(0),), (Shard(1),), ["all_to_all"], [(0,)]),
    ((4,), (5, 7), (Shard(0),), (Shard(1),), ["all_to_all"], [(0,)]),
    ((2, 2), (4, 6), (Shard(0), Shard(1)), (Replicate(), Replicate()), ["all_gather"], [(0, 1)]),
    ((4,), (6, 2), (Partial(),), (Replicate(),), ["all_reduce"], [(0,)]),
    ((2, 2), (6, 2), (Partial(), Replicate()), (Replicate(), Replicate()), ["all_reduce"], [(0,)]),
    ((2, 2), (6, 2), (Partial(), Partial()), (Replicate(), Replicate()), ["all_reduce"], [(0, 1)]),
], ids=["S0-S1", "S0-S1-uneven", "S0S1-RR-fused", "P-R", "PR-RR", "PP-RR-fused"])
def test_plan_shapes(mesh_shape, shape, src, dst, kinds, dims):
    world = math.prod(mesh_shape)
    for rank, (got_kinds, got_dims, called, ok) in enumerate(
            run_on_ranks(world, _plan_and_count, mesh_shape, shape, src, dst)):
        assert got_kinds == kinds and got_dims == dims, f"rank {rank}: plan {got_kinds} over {got_dims}"
        assert called == kinds, f"rank {rank}: ran collectives {called}"
        assert ok, f"rank {rank}: wrong result"
