"""Random ops on DTensors reproduce a single-device run (shardprop.dispatch.random_ops).

Every case seeds with shardprop.manual_seed, runs the op on the plain full tensor,
re-seeds, runs it on a DTensor, and compares the gathered result bit for bit
(rtol=atol=0). The generators must also stay in step: after the DTensor op each
rank draws once more and that draw must equal the single-device one.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import shardprop
from shardprop import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from tests.rankpool import run_on_ranks

R = Replicate()
EXACT = dict(rtol=0, atol=0)
# (mesh shape, placements) pairs; shapes below are uneven on purpose (5 and 7 over 2 and 4 ranks).
LAYOUTS = [
    ((4,), [R]), ((4,), [Shard(0)]), ((4,), [Shard(1)]),
    ((2, 2), [R, R]), ((2, 2), [Shard(0), Shard(1)]), ((2, 2), [Shard(1), R]), ((2, 2), [Shard(0), Shard(0)]),
    ((2, 2), [R, Shard(1)]),
]
SHAPES = [(8, 4), (5, 7)]


def _rand(shape, seed, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def _same(actual, expected, what):
    if isinstance(actual, DTensor):
        actual = actual.full_tensor()
    torch.testing.assert_close(actual, expected, **EXACT, msg=lambda m: f"{what}: {m}")


def _after_draw(mesh, what):
    """The generators of all ranks are still in step with a single device's."""
    mine = torch.rand(3)
    everyone = [torch.empty(3) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    for r, t in enumerate(everyone):
        _same(t, mine, f"{what}: rank {r}'s generator drifted")
    return mine


def _check(mesh, what, single, distributed):
    """single() on plain tensors and distributed() on DTensors, from the same seed, agree exactly."""
    shardprop.manual_seed(1234, mesh)
    ref = single()
    ref_next = torch.rand(3)
    shardprop.manual_seed(1234, mesh)
    out = distributed()
    refs = ref if isinstance(ref, tuple) else (ref,)
    outs = out if isinstance(out, tuple) else (out,)
    for i, (a, e) in enumerate(zip(outs, refs)):
        _same(a, e, f"{what} output {i}")
    _same(_after_draw(mesh, what), ref_next, f"{what}: generator state after the op")
    return outs


# ---------------------------------------------------------------- rank bodies


def _dropout_cases(which):
    done = []
    for mesh_shape, placements in LAYOUTS:
        if len(mesh_shape) != which:
            continue
        mesh = init_device_mesh("cpu", mesh_shape)
        for shape in SHAPES:
            for dtype in (torch.float32, torch.float64, torch.bfloat16) if shape == (5, 7) else (torch.float32,):
                x = _rand(shape, 1, dtype)
                what = f"dropout {mesh_shape} {placements} {shape} {dtype}"
                d = distribute_tensor(x, mesh, placements)
                (out,) = _check(mesh, what, lambda: F.dropout(x, 0.3), lambda: F.dropout(d, 0.3))
                if tuple(out.placements) != tuple(placements):
                    raise AssertionError(f"{what}: placements {out.placements}, expected {placements}")
                # aten.native_dropout (what CUDA's F.dropout calls): output and bool mask.
                _check(mesh, "native_" + what, lambda: torch.native_dropout(x, 0.3, True),
                       lambda: torch.native_dropout(d, 0.3, True))
                done.append(what)
        # train=False and p edge cases of native_dropout
        x = _rand((5, 7), 2)
        d = distribute_tensor(x, mesh, placements)
        for p, train in ((0.5, False), (0.0, True), (1.0, True), (0.5, None)):
            _check(mesh, f"native_dropout p={p} train={train}", lambda: torch.native_dropout(x, p, train),
                   lambda: torch.native_dropout(d, p, train))
        _same(F.dropout(d, 0.5, training=False), x, "dropout in eval mode")
    return done


def _dropout_replicas_identical():
    """A replicated activation gets the same mask on every rank (not just the right full value)."""
    mesh = init_device_mesh("cpu", (2, 2))
    shardprop.manual_seed(7, mesh)
    d = distribute_tensor(torch.ones(16, 16), mesh, [R, Shard(0)])
    local = F.dropout(d, 0.5).to_local()
    everyone = [torch.empty_like(local) for _ in range(4)]
    dist.all_gather(everyone, local.contiguous())
    coord = mesh.get_coordinate()
    for r, t in enumerate(everyone):
        peer = (r // 2, r % 2)
        if peer[1] == coord[1]:  # a replica of this rank's shard along the "R" mesh dim
            _same(t, local, f"rank {r} vs rank {dist.get_rank()}: replica masks differ")
        elif torch.equal(t, local):
            raise AssertionError("different shards drew the same mask: chunks are not being taken")
    return True


def _dropout_partial_and_backward():
    """Partial(sum) inputs pass through dropout, max is reduced first; gradients match single-device autograd."""
    for mesh_shape in ((4,), (2, 2)):
        mesh = init_device_mesh("cpu", mesh_shape)
        # Partial(sum): dropout of the sum, not of each rank's summand.
        parts = [_rand((6, 5), 10 + r).mul(4).round() for r in range(4)]  # integral: sums exact in any order
        full = torch.stack(parts).sum(0)
        pd = DTensor.from_local(parts[dist.get_rank()].clone(), mesh, [Partial()] * mesh.ndim)
        # Dropout is linear for a fixed mask: the Partial passes through, and the result equals
        # single device up to the rounding of the final sum (x_r * m summed, not (sum x_r) * m).
        for name, fn in (("F.dropout", lambda t: F.dropout(t, 0.4)),
                         ("native_dropout", lambda t: torch.native_dropout(t, 0.4, True))):
            shardprop.manual_seed(9, mesh)
            ref = fn(full)
            shardprop.manual_seed(9, mesh)
            out = fn(pd)
            for a, e in zip(out if isinstance(out, tuple) else (out,), ref if isinstance(ref, tuple) else (ref,)):
                torch.testing.assert_close(a.full_tensor(), e, msg=lambda m: f"{name} of Partial {mesh_shape}: {m}")
            if name == "native_dropout" and (out[0].placements != pd.placements or out[1].placements != (R,) * mesh.ndim):
                raise AssertionError(f"native_dropout of Partial: placements {out[0].placements}, {out[1].placements}")
        mx = DTensor.from_local(parts[dist.get_rank()].clone(), mesh, [Partial("max")] * mesh.ndim)
        _check(mesh, f"native_dropout of Partial(max) {mesh_shape}",
               lambda: torch.native_dropout(torch.stack(parts).amax(0), 0.4, True),
               lambda: torch.native_dropout(mx, 0.4, True))
        for placements in ([Shard(0)] * mesh.ndim, [Shard(1)] + [R] * (mesh.ndim - 1)):
            x = _rand((6, 5), 3)
            gy = _rand((6, 5), 4)
            for fn in (lambda t: F.dropout(t, 0.4), lambda t: torch.native_dropout(t, 0.4, True)[0]):
                shardprop.manual_seed(5, mesh)
                xl = x.clone().requires_grad_()
                (fn(xl) * gy).sum().backward()
                shardprop.manual_seed(5, mesh)
                xd = distribute_tensor(x, mesh, placements).requires_grad_()
                (fn(xd) * distribute_tensor(gy, mesh, placements)).sum().backward()
                _same(xd.grad, xl.grad, f"dropout backward {mesh_shape} {placements}")
    return True


def _init_and_like_cases(which):
    """In-place init of DTensor parameters and *_like / bernoulli ops equal single device."""
    for mesh_shape, placements in LAYOUTS:
        if len(mesh_shape) != which:
            continue
        mesh = init_device_mesh("cpu", mesh_shape)
        for shape in SHAPES[1:]:  # the uneven one
            what = f"{mesh_shape} {placements} {shape}"

            def param():
                return nn.Parameter(distribute_tensor(torch.zeros(shape), mesh, placements))

            inits = {
                "uniform_": lambda t: nn.init.uniform_(t, -2, 3),
                "normal_": lambda t: nn.init.normal_(t, 1.0, 0.5),
                "kaiming_uniform_": lambda t: nn.init.kaiming_uniform_(t, a=5 ** 0.5),
                "xavier_normal_": nn.init.xavier_normal_,
                "trunc_normal_": nn.init.trunc_normal_,
                "exponential_": lambda t: t.data.exponential_(2.0),
                "bernoulli_": lambda t: t.data.bernoulli_(0.3),
                "random_": lambda t: t.data.random_(0, 10),
            }
            for name, init in inits.items():
                p = param()
                with torch.no_grad():
                    _check(mesh, f"{name} {what}", lambda: init(torch.zeros(shape)), lambda: (init(p), p)[1])
                if not isinstance(p, nn.Parameter) and not isinstance(p, DTensor):
                    raise AssertionError(f"{name}: the parameter lost its type")
            x = _rand(shape, 3)
            d = distribute_tensor(x, mesh, placements)
            probs = torch.sigmoid(x)
            dprobs = distribute_tensor(probs, mesh, placements)
            likes = {
                "rand_like": (lambda: torch.rand_like(x), lambda: torch.rand_like(d)),
                "randn_like": (lambda: torch.randn_like(x, dtype=torch.float64),
                               lambda: torch.randn_like(d, dtype=torch.float64)),
                "randint_like": (lambda: torch.randint_like(x, 3, 9), lambda: torch.randint_like(d, 3, 9)),
                "bernoulli(probs)": (lambda: torch.bernoulli(probs), lambda: torch.bernoulli(dprobs)),
                "bernoulli(p)": (lambda: torch.bernoulli(x, 0.25), lambda: torch.bernoulli(d, 0.25)),
            }
            for name, (single, distributed) in likes.items():
                (out,) = _check(mesh, f"{name} {what}", single, distributed)
                if tuple(out.placements) != tuple(placements):
                    raise AssertionError(f"{name} {what}: placements {out.placements}")
        # in-place fill of a Partial(sum) tensor keeps the value it stands for
        pd = DTensor.from_local(torch.ones(4, 3), mesh, [Partial()] * mesh.ndim)
        _check(mesh, "uniform_ on Partial", lambda: torch.zeros(4, 3).uniform_(), lambda: pd.uniform_())
    return True


def _seed_mismatch():
    mesh = init_device_mesh("cpu", (2, 2))
    try:
        shardprop.manual_seed(1 if dist.get_rank() == 3 else 0, mesh)
    except RuntimeError as e:
        return "different seeds" in str(e)
    return False


# ---------------------------------------------------------------- tests


@pytest.mark.timeout(400)
@pytest.mark.parametrize("mesh_ndim", [1, 2])
def test_dropout_equals_single_device(mesh_ndim):
    results = run_on_ranks(4, _dropout_cases, mesh_ndim, timeout=180)
    assert len(results[0]) == 4 * sum(len(m) == mesh_ndim for m, _ in LAYOUTS)


@pytest.mark.timeout(120)
def test_dropout_masks_identical_on_replicas():
    assert run_on_ranks(4, _dropout_replicas_identical) == [True] * 4


@pytest.mark.timeout(120)
def test_dropout_partial_input_and_backward():
    assert run_on_ranks(4, _dropout_partial_and_backward, timeout=180) == [True] * 4


@pytest.mark.timeout(400)
@pytest.mark.parametrize("mesh_ndim", [1, 2])
def test_init_and_like_ops_equal_single_device(mesh_ndim):
    assert run_on_ranks(4, _init_and_like_cases, mesh_ndim, timeout=180) == [True] * 4


@pytest.mark.timeout(120)
def test_manual_seed_rejects_different_seeds_on_every_rank():
    assert run_on_ranks(4, _seed_mismatch) == [True] * 4


class _DropMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 24)
        self.drop = nn.Dropout(0.3)
        self.down = nn.Linear(24, 8)

    def forward(self, x):
        return self.down(self.drop(torch.relu(self.up(x))))


def _tp_dropout_model(mesh_shape):
    """A column/row-parallel MLP with dropout on the sharded hidden activation equals one device."""
    import copy

    from shardprop import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", mesh_shape)
    torch.manual_seed(0)
    ref = _DropMLP()
    # use_local_output=False: the hidden activation stays a DTensor, so dropout sees its global shape
    # (with plain local tensors each rank would draw a mask for its piece alone).
    plan = {"up": ColwiseParallel(use_local_output=False), "down": RowwiseParallel()}
    model = parallelize_module(copy.deepcopy(ref), mesh, plan)
    x = _rand((6, 8), 1)
    for step in range(2):
        shardprop.manual_seed(100 + step, mesh)
        ref_out = ref(x)
        ref_out.pow(2).sum().backward()
        shardprop.manual_seed(100 + step, mesh)
        out = model(x)
        out.pow(2).sum().backward()
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5, msg=lambda m: f"step {step} output: {m}")
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"step {step} grad {n}: {m}")
            p.grad = None
            q.grad = None
    return True


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mesh_shape", [(4,)])
def test_tensor_parallel_model_with_dropout_equals_single_device(mesh_shape):
    assert run_on_ranks(4, _tp_dropout_model, mesh_shape, timeout=180) == [True] * 4
