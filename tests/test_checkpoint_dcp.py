"""torch.distributed.checkpoint (DCP) with shardprop DTensors, on 4 real gloo ranks.

Every value is checked against the plain global tensor each rank rebuilds from a seed.
Covers: save on one layout / load on another (Hypothesis over 1-d and 2x2 meshes, every
placement kind, uneven and empty shards, Partial sources and targets), async_save, each box
written once (no replica twice; bytes per rank no more than the reference DTensor's),
dcp_to_torch_save without shardprop, a save that fails on one rank leaving the previous
checkpoint loadable, and optimizer state (AdamW) through DCP with a different layout.
"""

import os
import subprocess
import sys
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.rankpool import run_on_ranks

MESHES = {"1d": (4,), "2d": (2, 2)}


# ---------------------------------------------------------------- rank side
def _mesh(kind):
    from shardprop import init_device_mesh
    return init_device_mesh("cpu", MESHES[kind])


def _placements(codes):
    from shardprop import Partial, Replicate, Shard
    out = []
    for c in codes:
        if c == "R":
            out.append(Replicate())
        elif c.startswith("P"):
            out.append(Partial(c[1:]))
        else:
            out.append(Shard(int(c[1:])))
    return out


def _full(shape, seed):
    g = torch.Generator().manual_seed(seed)
    # Integer values: partial sums and maxima below are exact in float32.
    return torch.randint(-50, 50, shape, generator=g).float()


def _make(full, kind, codes, seed):
    """A DTensor whose value is ``full``; Partial mesh dims hold genuinely different pieces."""
    from shardprop import DTensor, distribute_tensor
    from shardprop.tensor.dtensor import local_chunk
    mesh = _mesh(kind)
    pl = _placements(codes)
    dt = distribute_tensor(full, mesh, pl)
    ops = {c[1:] for c in codes if c.startswith("P")}
    if len(ops) != 1 or not full.numel():
        return dt
    op = ops.pop()
    g = torch.Generator().manual_seed(seed + 1)
    noise = local_chunk(torch.randint(1, 9, tuple(full.shape), generator=g).float(), mesh, pl)
    local = dt.to_local().clone()
    for m, c in enumerate(codes):
        if not c.startswith("P"):
            continue
        k, me = mesh.shape[m], mesh.get_coordinate()[m]
        if op == "sum":  # +n on every index but the first, which takes -(k-1)n: the sum is unchanged
            local += noise * (1 if me else -(k - 1))
        elif op == "max":  # lower values away from index 0: the maximum is unchanged
            local -= noise * me
        # avg / min: distribute_tensor's copies already are genuine, leave them
    return DTensor.from_local(local, mesh, pl, shape=full.shape, stride=full.stride())


def _roundtrip_batch(root, batch):
    import torch.distributed.checkpoint as dcp
    from shardprop import distribute_tensor
    failures = []
    for i, (shape, src_kind, src_codes, dst_kind, dst_codes, seed) in enumerate(batch):
        try:
            full = _full(shape, seed)
            src = _make(full, src_kind, src_codes, seed)
            path = os.path.join(root, str(i))
            dcp.save({"x": src, "n": {"y": src}}, checkpoint_id=path)
            dst = distribute_tensor(torch.full(shape, 7.0), _mesh(dst_kind), _placements(dst_codes))
            other = distribute_tensor(torch.zeros(shape), _mesh(dst_kind), _placements(dst_codes))
            dcp.load({"x": dst, "n": {"y": other}}, checkpoint_id=path)
            for name, t in (("x", dst), ("n.y", other)):
                got = t.full_tensor()
                if not torch.equal(got, full):
                    failures.append((i, f"{name}: got {got.tolist()} want {full.tolist()}"))
        except Exception as e:  # report every failing case, not only the first
            failures.append((i, f"{type(e).__name__}: {e}"[:800]))
    return failures


def _describe(case):
    shape, sk, sc, dk, dc, _ = case
    return f"{tuple(shape)}: {sk} {sc} -> {dk} {dc}"


def _run_batch(batch):
    root = tempfile.mkdtemp(prefix="dcp_prop_")
    results = run_on_ranks(4, _roundtrip_batch, root, batch, timeout=120)
    bad = {}
    for rank, failures in enumerate(results):
        for i, msg in failures:
            bad.setdefault(i, (rank, msg))
    if bad:
        lines = [f"{len(bad)} of {len(batch)} save/load pairs failed:"]
        lines += [f"- {_describe(batch[i])} (rank {r}): {m}" for i, (r, m) in sorted(bad.items())[:8]]
        raise AssertionError("\n".join(lines))


# ---------------------------------------------------------------- parent side: cases
@st.composite
def _case(draw):
    ndim = draw(st.integers(1, 3))
    shape = draw(st.lists(st.integers(0, 7), min_size=ndim, max_size=ndim).filter(lambda s: 0 not in s)
                 | st.lists(st.integers(0, 3), min_size=ndim, max_size=ndim))
    shard = [f"S{d}" for d in range(ndim)]
    src_kind = draw(st.sampled_from(sorted(MESHES)))
    dst_kind = draw(st.sampled_from(sorted(MESHES)))
    src = st.sampled_from(shard + ["R", "Psum", "Pmax", "Pavg"])
    dst = st.sampled_from(shard + ["R", "Psum", "Pavg"])
    src_codes = [draw(src) for _ in MESHES[src_kind]]
    dst_codes = [draw(dst) for _ in MESHES[dst_kind]]
    return shape, src_kind, src_codes, dst_kind, dst_codes, draw(st.integers(0, 1000))


_SETTINGS = dict(deadline=None, suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate],
                 print_blob=True)


@settings(max_examples=3, **_SETTINGS)
@given(st.lists(_case(), min_size=5, max_size=8))
def test_save_one_layout_load_another(batch):
    _run_batch(batch)


def test_named_resharding_cases():
    """The issue's cases: 2x2 [S(0), S(1)] -> 1-d [S(1)], nested uneven, Replicate, Partial sources."""
    _run_batch([
        ((8, 6), "2d", ["S0", "S1"], "1d", ["S1"], 1),
        ((7, 5), "2d", ["S0", "S1"], "1d", ["S1"], 2),     # uneven
        ((5, 3), "2d", ["S0", "S0"], "1d", ["S1"], 3),     # nested, uneven
        ((5, 3), "1d", ["S1"], "2d", ["S0", "S0"], 4),
        ((6, 4), "2d", ["R", "S1"], "2d", ["S1", "R"], 5),
        ((6, 4), "2d", ["Psum", "S0"], "1d", ["R"], 6),    # Partial reduced before it is written
        ((6, 4), "1d", ["Pmax"], "2d", ["S0", "Psum"], 7),
        ((), "1d", ["Psum"], "2d", ["R", "R"], 8),         # a scalar
        ((1, 3), "1d", ["S0"], "2d", ["S0", "S0"], 9),     # empty shards
    ])


# ---------------------------------------------------------------- each box written once
def _bytes_written(root):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from shardprop import Replicate, Shard, distribute_tensor, init_device_mesh
    from torch.distributed.tensor import distribute_tensor as ref_distribute
    from torch.distributed.tensor import Replicate as RR, Shard as RS
    from torch.distributed.device_mesh import init_device_mesh as ref_mesh
    mesh = init_device_mesh("cpu", (2, 2))
    rmesh = ref_mesh("cpu", (2, 2))
    full = torch.arange(256 * 128, dtype=torch.float32).reshape(256, 128)
    ours = {"a": distribute_tensor(full, mesh, [Replicate(), Shard(0)]),
            "b": distribute_tensor(full + 1, mesh, [Replicate(), Replicate()]),
            "c": distribute_tensor(full + 2, mesh, [Shard(1), Shard(0)])}
    ref = {"a": ref_distribute(full, rmesh, [RR(), RS(0)]),
           "b": ref_distribute(full + 1, rmesh, [RR(), RR()]),
           "c": ref_distribute(full + 2, rmesh, [RS(1), RS(0)])}
    sizes = {}
    for name, sd in (("ours", ours), ("ref", ref)):
        path = os.path.join(root, name)
        dcp.save(sd, checkpoint_id=path)
        dist.barrier()
        sizes[name] = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
                          if f.startswith(f"__{dist.get_rank()}_"))
    md = dcp.FileSystemReader(os.path.join(root, "ours")).read_metadata()
    chunks = {k: [(tuple(c.offsets), tuple(c.sizes)) for c in v.chunks] for k, v in md.state_dict_metadata.items()}
    return sizes, chunks


def test_each_box_written_once_and_no_more_bytes_than_the_reference():
    root = tempfile.mkdtemp(prefix="dcp_bytes_")
    results = run_on_ranks(4, _bytes_written, root, timeout=120)
    chunks = results[0][1]
    assert sorted(chunks["b"]) == [((0, 0), (256, 128))]                 # replicated: one chunk
    assert sorted(chunks["a"]) == [((0, 0), (128, 128)), ((128, 0), (128, 128))]  # dp replicas: written once
    assert len(chunks["c"]) == 4
    tensor_bytes = 3 * 256 * 128 * 4  # each written once; torch.save adds ~1.3 KB per piece
    ours = [r[0]["ours"] for r in results]
    ref = [r[0]["ref"] for r in results]
    assert sum(ours) < tensor_bytes * 1.05, (ours, ref)                 # nothing written twice
    assert sum(ours) <= sum(ref) and max(ours) <= max(ref), (ours, ref)


# ---------------------------------------------------------------- async_save, plain-torch readers
def _async_and_plain(root):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from shardprop import Replicate, Shard, distribute_tensor, init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2))
    full = _full((9, 6), 11)
    x = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
    fut = dcp.async_save({"x": x, "step": torch.tensor(3)}, checkpoint_id=os.path.join(root, "async"))
    fut.result()
    y = distribute_tensor(torch.zeros(9, 6), init_device_mesh("cpu", (4,)), [Shard(1)])
    plain = torch.zeros(9, 6)  # a plain tensor reads the whole value on every rank
    dcp.load({"x": y}, checkpoint_id=os.path.join(root, "async"))
    dcp.load({"x": plain}, checkpoint_id=os.path.join(root, "async"))
    dcp.save({"x": x, "r": distribute_tensor(full * 2, mesh, [Replicate(), Shard(0)])},
             checkpoint_id=os.path.join(root, "plain"))
    dist.barrier()
    return torch.equal(y.full_tensor(), full), torch.equal(plain, full)


_READ_WITHOUT_SHARDPROP = """
import sys, torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
dcp_to_torch_save(sys.argv[1], sys.argv[2])
sd = torch.load(sys.argv[2])
assert "shardprop" not in sys.modules
torch.save({k: v for k, v in sd.items()}, sys.argv[2] + ".plain")
"""


def test_async_save_and_dcp_to_torch_save_without_shardprop():
    root = tempfile.mkdtemp(prefix="dcp_async_")
    assert run_on_ranks(4, _async_and_plain, root, timeout=120) == [(True, True)] * 4
    out = os.path.join(root, "full.pt")
    subprocess.run([sys.executable, "-c", _READ_WITHOUT_SHARDPROP, os.path.join(root, "plain"), out],
                   check=True, env={**os.environ, "PYTHONPATH": ""}, timeout=120)
    sd = torch.load(out + ".plain")
    full = _full((9, 6), 11)
    assert torch.equal(sd["x"], full) and torch.equal(sd["r"], full * 2)


# ---------------------------------------------------------------- a failed save keeps the previous one
def _failed_save(root):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.api import CheckpointException
    from shardprop import Shard, distribute_tensor, init_device_mesh

    class DiesMidWrite(FileSystemWriter):
        def write_data(self, plan, planner):
            fut = super().write_data(plan, planner)  # this rank's files are written ...
            if dist.get_rank() == 1:
                raise OSError("disk gone on rank 1")  # ... then it dies before reporting
            return fut

    mesh = init_device_mesh("cpu", (4,))
    first, second = _full((8, 4), 1), _full((8, 4), 2)
    good = os.path.join(root, "step-1")
    dcp.save({"w": distribute_tensor(first, mesh, [Shard(0)])}, checkpoint_id=good)
    bad = os.path.join(root, "step-2")
    raised = None
    try:
        dcp.save({"w": distribute_tensor(second, mesh, [Shard(0)])}, storage_writer=DiesMidWrite(bad))
    except CheckpointException as e:  # a BaseException, not an Exception
        raised = type(e).__name__
    y = distribute_tensor(torch.zeros(8, 4), mesh, [Shard(1)])
    dcp.load({"w": y}, checkpoint_id=good)
    try:
        dcp.load({"w": distribute_tensor(torch.zeros(8, 4), mesh, [Shard(1)])}, checkpoint_id=bad)
        bad_loads = True
    except BaseException:
        bad_loads = False
    return raised, torch.equal(y.full_tensor(), first), bad_loads


def test_a_save_failing_on_one_rank_leaves_the_previous_checkpoint_loadable():
    root = tempfile.mkdtemp(prefix="dcp_fail_")
    results = run_on_ranks(4, _failed_save, root, timeout=120)
    # Every rank learns of the failure (no hang), the previous checkpoint loads, the torn one does not.
    assert results == [("CheckpointException", True, False)] * 4, results


# ---------------------------------------------------------------- optimizer state, resharded
def _optimizer_roundtrip(root):
    import torch.distributed.checkpoint as dcp
    from torch import nn
    import shardprop
    from shardprop import ColwiseParallel, RowwiseParallel, init_device_mesh, parallelize_module

    def build(mesh):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 8))
        if mesh is not None:
            parallelize_module(m, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        return m

    def step(m, opt, i):
        torch.manual_seed(100 + i)
        loss = m(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    ref = build(None)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    ref_losses = [step(ref, ref_opt, i) for i in range(4)]

    tp4 = build(init_device_mesh("cpu", (4,)))
    opt = torch.optim.AdamW(tp4.parameters(), lr=0.05)
    losses = [step(tp4, opt, i) for i in range(2)]
    dcp.save({"model": tp4.state_dict(), "optim": shardprop.get_optimizer_state_dict(tp4, opt)}, checkpoint_id=root)

    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"]
    tp2 = build(mesh2)
    opt2 = torch.optim.AdamW(tp2.parameters(), lr=0.05)
    sd = {"model": tp2.state_dict(), "optim": shardprop.get_optimizer_state_dict(tp2, opt2)}
    dcp.load(sd, checkpoint_id=root)
    shardprop.set_optimizer_state_dict(tp2, opt2, sd["optim"])
    losses += [step(tp2, opt2, i) for i in range(2, 4)]
    params_ok = all(torch.allclose(p.full_tensor(), q, atol=1e-5)
                    for p, q in zip(tp2.parameters(), ref.parameters()))
    return losses, ref_losses, params_ok


def test_adamw_state_through_dcp_onto_another_mesh_continues_like_one_process():
    root = tempfile.mkdtemp(prefix="dcp_optim_")
    for losses, ref, params_ok in run_on_ranks(4, _optimizer_roundtrip, root, timeout=120):
        assert losses == pytest.approx(ref, rel=1e-5)
        assert params_ok


# ---------------------------------------------------------------- the demo: save, resume on another mesh
def _demo(argv):
    from shardprop.demo.train import parser, rank_main
    summary = rank_main(parser().parse_args(argv))
    return summary["ok"], summary["losses"], summary.get("reference")


def test_demo_resume_on_another_mesh_equals_an_uninterrupted_run():
    root = tempfile.mkdtemp(prefix="dcp_demo_")
    small = ["--dim", "32", "--layers", "1", "--heads", "4", "--vocab", "64", "--seq", "8", "--batch", "4"]
    first = run_on_ranks(4, _demo, small + ["--steps", "2", "--mesh", "2x2", "--checkpoint", root], timeout=180)
    second = run_on_ranks(4, _demo, small + ["--steps", "4", "--mesh", "4", "--resume", root], timeout=180)
    ok, losses, reference = second[0]  # the demo compares with the same steps of a one-process run
    assert first[0][0] and ok and len(losses) == 2
    assert losses == pytest.approx(reference, rel=1e-5)


# ---------------------------------------------------------------- what DCP's own helpers call on tensors
def _torch_helpers(root):
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.metadata import TensorProperties
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)
    from shardprop import ColwiseParallel, RowwiseParallel, Shard, distribute_tensor, init_device_mesh, parallelize_module
    mesh = init_device_mesh("cpu", (4,))
    x = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
    props = TensorProperties.create_from_tensor(x)  # asks is_pinned
    torch.manual_seed(0)
    model = parallelize_module(nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 8)), mesh,
                               {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    # torchtitan's way: torch's own state-dict helpers, then DCP.
    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(sd, checkpoint_id=root)
    torch.manual_seed(1)
    other = parallelize_module(nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 8)), mesh,
                               {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt2 = torch.optim.AdamW(other.parameters())
    sd2 = {"model": get_model_state_dict(other), "optim": get_optimizer_state_dict(other, opt2)}
    dcp.load(sd2, checkpoint_id=root)
    set_model_state_dict(other, sd2["model"])
    set_optimizer_state_dict(other, opt2, sd2["optim"])
    same = all(torch.equal(p.full_tensor(), q.full_tensor()) for p, q in zip(model.parameters(), other.parameters()))
    same_state = all(torch.equal(opt.state[p]["exp_avg"].full_tensor(), opt2.state[q]["exp_avg"].full_tensor())
                     for p, q in zip(model.parameters(), other.parameters()))
    return x.is_pinned(), props.pin_memory, same, same_state


def test_is_pinned_and_torchs_own_state_dict_helpers():
    root = tempfile.mkdtemp(prefix="dcp_helpers_")
    assert run_on_ranks(4, _torch_helpers, root, timeout=120) == [(False, False, True, True)] * 4


def _async_partial(root):
    import torch.distributed.checkpoint as dcp
    from shardprop import Partial, distribute_tensor, init_device_mesh
    x = distribute_tensor(torch.ones(4, 4), init_device_mesh("cpu", (4,)), [Partial()])
    try:
        dcp.async_save({"x": x}, checkpoint_id=root).result()
    except BaseException as e:
        return str(e)
    return "no error"


def test_async_save_of_a_partial_value_says_to_reduce_it_first():
    for msg in run_on_ranks(4, _async_partial, tempfile.mkdtemp(prefix="dcp_ap_"), timeout=120):
        assert "redistribute Partial to Replicate first" in msg, msg[-500:]
