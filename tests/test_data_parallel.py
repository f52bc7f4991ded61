"""Data parallel over a mesh dim with bucketed, asynchronous gradient all-reduces.

Bucket assignment is checked against DDP's known answers and against torch's own
C++ implementation on random inputs. The reducer is checked on 4 ranks against a
single-process run on the full batch: gradients after finish(), parameters after
a few SGD steps, and one collective per bucket per step (counted with
shardprop.comm_counter).
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from shardprop import DTensor, Partial, Replicate, Shard, comm_counter, distribute_tensor, init_device_mesh
from shardprop.parallel.dp.data_parallel import compute_bucket_assignment_by_size, replicate_gradients
from tests.rankpool import run_on_ranks

R = Replicate()


# ---------------------------------------------------------------- bucket assignment (one process)


def _float(n):
    return torch.empty(n, dtype=torch.float)


def _double(n):
    return torch.empty(n, dtype=torch.double)


def test_single_limit_single_dtype():
    ts = [_float(100), _float(200), _float(100), _float(50)]
    assert compute_bucket_assignment_by_size(ts, [400], order=range(4)) == [[0], [1], [2], [3]]
    # reverse order (the default): 50 floats + 100 floats = 600 B closes the first bucket
    assert compute_bucket_assignment_by_size(ts, [400]) == [[3, 2], [1], [0]]


def test_single_limit_multi_dtype():
    ts = [_float(50), _double(25), _float(50), _double(25), _float(50), _double(25)]
    assert compute_bucket_assignment_by_size(ts, [400], order=range(6)) == [[0, 2], [1, 3], [4], [5]]
    assert compute_bucket_assignment_by_size(ts, 400) == [[5, 3], [4, 2], [1], [0]]


def test_multi_limit_single_dtype():
    ts = [_float(10) for _ in range(4)]
    assert compute_bucket_assignment_by_size(ts, [40, 80], order=range(4)) == [[0], [1, 2], [3]]
    assert compute_bucket_assignment_by_size(ts, [40, 80]) == [[3], [2, 1], [0]]


def test_multi_limit_multi_dtype():
    ts = [_float(50), _double(25), _float(50), _double(25), _float(50), _double(25)]
    assert compute_bucket_assignment_by_size(ts, [200, 400], order=range(6)) == [[0], [1], [2, 4], [3, 5]]
    assert compute_bucket_assignment_by_size(ts, [200, 400]) == [[5], [4], [3, 1], [2, 0]]


def test_default_limits_small_first_bucket_then_cap():
    mib = 1024 * 1024
    ts = [_float(mib // 16) for _ in range(30)]  # 256 KiB each, 7.5 MiB in all
    buckets = compute_bucket_assignment_by_size(ts)
    sizes = [sum(ts[i].numel() * 4 for i in b) for b in buckets]
    assert sizes == [1 * mib, 30 * mib // 4 - mib]  # 1 MiB, then the rest (under the 25 MiB cap)
    assert buckets[0] == [29, 28, 27, 26]  # the last-defined parameters first
    big = [_float(mib) for _ in range(60)]  # 4 MiB each: 1 in the first bucket, then 7 per 25 MiB (28 MiB)
    assert [len(b) for b in compute_bucket_assignment_by_size(big)] == [1] + [7] * 8 + [3]


def test_devices_never_share_a_bucket_and_order_follows_readiness():
    ts = [_float(10), torch.empty(10, device="meta"), _float(10), torch.empty(10, device="meta")]
    buckets = compute_bucket_assignment_by_size(ts, [1000])
    assert sorted(map(sorted, buckets)) == [[0, 2], [1, 3]]
    assert buckets == [[3, 1], [2, 0]]  # the bucket holding the first-ready tensor comes first
    assert compute_bucket_assignment_by_size(ts, [1000], order=[2, 1, 0, 3]) == [[2, 0], [1, 3]]


def test_bad_arguments():
    with pytest.raises(ValueError, match="positive"):
        compute_bucket_assignment_by_size([_float(3)], [0])
    with pytest.raises(ValueError, match="permutation"):
        compute_bucket_assignment_by_size([_float(3), _float(3)], [8], order=[0, 0])


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.integers(1, 64), st.sampled_from([torch.float, torch.double, torch.half])),
                   min_size=1, max_size=12),
    limits=st.lists(st.integers(1, 400), min_size=1, max_size=3),
    data=st.data(),
)
def test_matches_torch_reference(sizes, limits, data):
    ts = [torch.empty(n, dtype=dt) for n, dt in sizes]
    order = data.draw(st.permutations(list(range(len(ts)))))
    ours = compute_bucket_assignment_by_size(ts, limits, order=order)
    # torch's takes the tensors in visiting order and tensor_indices as their labels
    theirs, _ = dist._compute_bucket_assignment_by_size([ts[i] for i in order], limits, [False] * len(ts), order)
    assert sorted(map(sorted, ours)) == sorted(map(sorted, theirs))
    assert sorted(i for b in ours for i in b) == list(range(len(ts)))
    firsts = [min(order.index(i) for i in b) for b in ours]
    assert firsts == sorted(firsts)  # buckets in the order they become ready


# ---------------------------------------------------------------- reducer on 4 ranks


def _batches(steps, n, d_in, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, d_in, generator=g) for _ in range(steps)]


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 32)
        self.fc2 = nn.Linear(32, 32)
        self.fc3 = nn.Linear(32, 3)
        self.unused = nn.Parameter(torch.randn(5))     # never in the loss: its grad stays None
        self.sometimes = nn.Parameter(torch.randn(4))  # in the loss on dp index 0 only

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def _dp_plain():
    """1-d dp=4 mesh, a plain model: gradients and SGD steps equal one process on the full batch."""
    mesh = init_device_mesh("cpu", (4,))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = _Net()
    ref = copy.deepcopy(model)
    if rank != 0:  # replicate_gradients must start every rank from dp index 0's parameters
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    dp = replicate_gradients(model, mesh, bucket_cap_mb=4096 / 2 ** 20, first_bucket_mb=512 / 2 ** 20)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=lambda m: f"{n} not synced from dp index 0: {m}")
    nb = len(dp.buckets)
    if nb < 3:
        raise AssertionError(f"expected several buckets with a 4 KiB cap, got {dp.names}")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    launched_in_backward = []
    for step, x in enumerate(_batches(3, 8, 6)):
        loss = model(dp.split_batch(x)).pow(2).mean()
        if dp.dp_index == 0:
            loss = loss + model.sometimes.sum()
        with comm_counter() as in_backward:
            loss.backward()
        with comm_counter() as in_finish:
            dp.finish()
        count = in_backward.total[0] + in_finish.total[0]
        if count != nb or set(in_backward.counts) | set(in_finish.counts) != {"all_reduce"}:
            raise AssertionError(f"step {step}: {in_backward} + {in_finish}, expected {nb} all-reduces (one per bucket)")
        launched_in_backward.append(in_backward.total[0])
        # one process, full batch: the mean over 8 rows; `sometimes` counts 1/4 (one dp rank of four)
        ref_loss = ref(x).pow(2).mean() + ref.sometimes.sum() / 4
        ref_loss.backward()
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            if (p.grad is None) != (q.grad is None):
                raise AssertionError(f"step {step} {n}: grad is {p.grad} here, {q.grad} in the reference")
            if p.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5, msg=lambda m: f"step {step} grad {n}: {m}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=lambda m: f"param {n} after 3 SGD steps: {m}")
    return launched_in_backward, nb


def _tp_params(tp):
    """Weights of a column-then-row parallel MLP on the tp sub-mesh, and their full values."""
    g = torch.Generator().manual_seed(1)
    full = {
        "w1": torch.randn(16, 6, generator=g) * 0.5, "b1": torch.randn(16, generator=g),
        "w2": torch.randn(3, 16, generator=g) * 0.5, "b2": torch.randn(3, generator=g),
        "scale": torch.randn(3, generator=g),
    }
    layout = {"w1": [Shard(0)], "b1": [Shard(0)], "w2": [Shard(1)], "b2": [R], "scale": [R]}
    params = {k: nn.Parameter(distribute_tensor(v, tp, layout[k])) for k, v in full.items()}
    return params, {k: nn.Parameter(v.clone()) for k, v in full.items()}


def _mlp(p, x):
    h = torch.relu(F.linear(x, p["w1"], p["b1"]))
    return (F.linear(h, p["w2"], p["b2"]) * p["scale"]).pow(2).mean()


def _dp_tp():
    """2x2 dp x tp mesh, DTensor parameters on mesh["tp"]: gradients equal one process on the full batch."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = mesh["tp"]
    params, ref = _tp_params(tp)
    names = list(params)
    dp = replicate_gradients([params[k] for k in names], mesh, "dp", bucket_cap_mb=64 / 2 ** 20,
                             first_bucket_mb=32 / 2 ** 20)
    nb = len(dp.buckets)
    if nb < 2:
        raise AssertionError(f"expected several buckets, got {dp.buckets}")
    opt = torch.optim.SGD(list(params.values()), lr=0.05)
    ref_opt = torch.optim.SGD(list(ref.values()), lr=0.05)
    for step, x in enumerate(_batches(3, 8, 6, seed=5)):
        xd = DTensor.from_local(dp.split_batch(x), tp, [R])
        # The tp collectives of this model: one step without the reducer (no_sync) counts them.
        with dp.no_sync(), comm_counter() as tp_only:
            _mlp(params, xd).full_tensor().backward()
        for p in params.values():
            p.grad = None
        with comm_counter() as everything:
            _mlp(params, xd).full_tensor().backward()
            dp.finish()
        extra = everything.total[0] - tp_only.total[0]
        if extra != nb:
            raise AssertionError(f"step {step}: {everything} vs tp only {tp_only}: {extra} extra collectives, "
                                 f"expected {nb} (one per bucket)")
        _mlp(ref, x).backward()
        for k in names:
            torch.testing.assert_close(params[k].grad.full_tensor(), ref[k].grad, atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"step {step} grad {k}: {m}")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for k in names:
        torch.testing.assert_close(params[k].full_tensor(), ref[k], atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"param {k} after 3 SGD steps: {m}")
    return nb


def _double_backward_error():
    mesh = init_device_mesh("cpu", (4,))
    w = nn.Parameter(torch.ones(3))
    dp = replicate_gradients([w], mesh)
    (w * 2).sum().backward()
    try:
        (w * 2).sum().backward()
    except RuntimeError as e:
        ok = "no_sync" in str(e)
    else:
        ok = False
    dp.finish()  # the first bucket was launched: complete it on every rank
    return ok


@pytest.mark.timeout(300)
def test_data_parallel_plain_model_dp4():
    results = run_on_ranks(4, _dp_plain, timeout=180)
    launched, nb = results[0]
    # gradients of used parameters are ready during backward: those buckets overlap backward
    assert all(n >= 1 for n in launched), launched
    assert all(r[1] == nb for r in results)


@pytest.mark.timeout(300)
def test_data_parallel_2x2_dp_tp_dtensor_params():
    nbs = run_on_ranks(4, _dp_tp, timeout=180)
    assert len(set(nbs)) == 1


@pytest.mark.timeout(120)
def test_second_backward_before_finish_is_an_error():
    assert run_on_ranks(4, _double_backward_error, timeout=60) == [True] * 4


# ---------------------------------------------------------------- the collective counter


def _counter_cases():
    from shardprop.mesh import collectives as C

    mesh = init_device_mesh("cpu", (4,))
    x = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])  # 2x4 floats = 32 B per rank
    with comm_counter() as outer:
        with comm_counter() as inner:
            x.redistribute(placements=[R])
        x.redistribute(placements=[Shard(1)])
        DTensor.from_local(torch.ones(3), mesh, [Partial()]).redistribute(placements=[R])
        C.broadcast(torch.ones(5), mesh, 0)
        C.scatter([torch.ones(2)] * 4, torch.empty(2), mesh, 0)
        C.reduce_scatter(torch.ones(8), mesh, 0)
    seen = dict(outer.counts)
    x.redistribute(placements=[R])  # a finished counter stops counting
    if outer.counts != seen:
        raise AssertionError(f"counted after the with block: {outer.counts} vs {seen}")
    return inner.counts, outer.counts


@pytest.mark.timeout(120)
def test_comm_counter_counts_every_kind_and_nests():
    inner, outer = run_on_ranks(4, _counter_cases, timeout=60)[0]
    assert inner == {"all_gather": (1, 32)}
    assert outer == {
        "all_gather": (1, 32), "all_to_all": (1, 32), "all_reduce": (1, 12),
        "broadcast": (1, 20), "scatter": (1, 8), "reduce_scatter": (1, 32),
    }
