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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardprop import (DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh,
                       plan_redistribute)
from shardprop.dtensor import local_chunk
from shardprop.mesh.async_tensor import AsyncTensor
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
    shape, src, dst, seed, perturb = ex
    return f"shape={shape} {list(src)} -> {list(dst)} seed={seed} perturb={perturb}"


def _run_batch(mesh_shape, batch):
    """Rank side of the property test: returns one entry per example, None when
    it passed, else a message. Stops at the first exception (ranks may be out of
    step after one)."""
    mesh = init_device_mesh("cpu", mesh_shape)
    coord = mesh.get_coordinate()
    results = []
    for ex in batch:
        shape, src, dst, seed, perturb = ex
        try:
            full = _full(shape, seed)
            has_partial = any(type(p) is Partial for p in (*src, *dst))
            if perturb and any(type(p) is Partial for p in src):
                local = _partial_local(full, mesh, src, seed)
                x = DTensor.from_local(local, mesh, src, shape=full.shape, stride=full.stride())
            else:
                x = distribute_tensor(full, mesh, src)
            before = x.to_local().clone()
            y = x.redistribute(placements=dst)
            problems = []
            if tuple(y.placements) != tuple(dst) or y.shape != full.shape:
                problems.append(f"result is {list(y.placements)} {tuple(y.shape)}")
            if not torch.equal(x.to_local(), before):
                problems.append("redistribute wrote into its input's local tensor")
            if not any(type(p) is Partial for p in dst):
                want = _reference_chunk(full, mesh.shape, coord, dst)
                got = y.to_local()
                if got.shape != want.shape:
                    problems.append(f"local shard shape {tuple(got.shape)}, expected {tuple(want.shape)}")
                elif has_partial and not torch.allclose(got, want, rtol=1e-5, atol=1e-5):
                    problems.append(f"local shard {got} != expected {want}")
                elif not has_partial and not torch.equal(got, want):
                    problems.append(f"local shard {got} != expected {want}")
                if not torch.equal(local_chunk(full, mesh, dst), want):
                    problems.append("shardprop.dtensor.local_chunk disagrees with torch.chunk")
            back = y.full_tensor()
            if back.shape != full.shape:
                problems.append(f"full_tensor() shape {tuple(back.shape)}")
            elif has_partial and not torch.allclose(back, full, rtol=1e-5, atol=1e-5):
                problems.append(f"full_tensor() {back} != original {full}")
            elif not has_partial and not torch.equal(back, full):
                problems.append(f"full_tensor() {back} != original {full}")
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
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim)))
    src = tuple(draw(_placement(ndim)) for _ in range(mesh_ndim))
    dst = tuple(draw(_placement(ndim)) for _ in range(mesh_ndim))
    seed = draw(st.integers(0, 2**31 - 1))
    perturb = draw(st.booleans())
    return (shape, src, dst, seed, perturb)


def _check_batch(mesh_name, batch):
    world, mesh_shape = MESHES[mesh_name]
    try:
        per_rank = run_on_ranks(world, _run_batch, mesh_shape, batch, timeout=120)
    except Exception:
        raise
    failures = []
    for rank, results in enumerate(per_rank):
        for ex, res in zip(batch, results):
            if res is not None:
                failures.append(f"rank {rank}: {_describe(ex)}: {res}")
                break
        if len(results) < len(batch):
            get_pool(world).shutdown()  # an exception may have left ranks out of step
    assert not failures, f"{len(failures)} rank(s) failed on mesh {mesh_shape}:\n" + "\n".join(failures)


# Examples per mesh: EXAMPLES batches of BATCH transitions each.
_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
                 print_blob=True)


@pytest.mark.parametrize("mesh_name,examples,batch", [("1d", 8, 40), ("2d", 8, 40), ("3d", 5, 30)])
def test_redistribute_roundtrip_property(mesh_name, examples, batch):
    mesh_ndim = len(MESHES[mesh_name][1])

    @settings(max_examples=examples, **_SETTINGS)
    @given(st.lists(_example(mesh_ndim), min_size=1, max_size=batch))
    def prop(b):
        _check_batch(mesh_name, b)

    prop()
