"""fully_shard's other 2.15 pieces beside torch's: the unshard handle, forward methods, ignored parameters,
offload policies, the signature, is_last_backward / manual finalization, param_dtype_override_fn and kept
storage. The model, meshes and collective recording come from :mod:`tests.test_fsdp_controls`.
"""
import inspect

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from tests.rankpool import run_on_ranks
from tests.test_fsdp_controls import D, H, Block, Net, _api, _data, _mesh, _micro, _recording, _shard

# ---------------------------------------------------------------- unshard handle, forward methods, ignored


def _handles(impl):
    model = _shard(impl, Net())
    x, y = _data(0)
    out = {}
    if impl == "torch":
        from torch.distributed.fsdp import UnshardHandle
    else:
        from shardprop import UnshardHandle
    handle = model.layers[1].unshard(async_op=True)
    out["handle"] = isinstance(handle, UnshardHandle)
    handle.wait()
    w = model.layers[1].up.weight
    out["after_wait"] = (type(w).__name__, tuple(w.shape))
    log = []
    with _recording(impl, log):
        model(x)  # layers[1] is gathered already: one gather less
    out["gathers"] = sum(1 for e in log if e[0] == "AG")
    model.layers[1].reshard()
    out["after_reshard"] = type(model.layers[1].up.weight).__name__
    out["sync"] = model.layers[2].unshard()
    model.layers[2].reshard()
    return out


def _forward_method(impl):
    from_torch = impl == "torch"
    if from_torch:
        from torch.distributed.fsdp import register_fsdp_forward_method
    else:
        from shardprop import register_fsdp_forward_method
    model = _shard(impl, Net())
    register_fsdp_forward_method(model.layers[0], "encode")
    register_fsdp_forward_method(nn.Linear(2, 2), "forward")  # a plain module: a no-op
    x, _ = _data(0)
    z = model.layers[0].encode(x)
    z.square().sum().backward()
    return z.detach(), model.layers[0].up.weight.grad.full_tensor()


def _ignored(impl):
    model = Net()
    ignored = {model.head.bias}
    fully_shard = _api(impl)[0]
    mesh = _mesh(impl, "1d")
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh, ignored_params=ignored)
    x, y = _data(0)
    (model(x) - y).square().mean().backward()
    b = model.head.bias
    return type(b).__name__, b.grad.clone(), model.head.weight.grad.full_tensor()


def _extras():
    return {impl: (_handles(impl), _forward_method(impl), _ignored(impl)) for impl in ("shardprop", "torch")}


def test_unshard_handle_forward_method_and_ignored_params():
    for out in run_on_ranks(4, _extras):
        ours, ref = out["shardprop"], out["torch"]
        assert ours[0] == ref[0], (ours[0], ref[0])
        assert ours[0]["handle"] is True
        assert ours[0]["after_wait"] == ("Parameter", (H, D)) and ours[0]["after_reshard"] != "Parameter"
        assert ours[0]["gathers"] == 3 and ours[0]["sync"] is None
        for a, b in zip(ours[1], ref[1]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
        assert ours[2][0] == ref[2][0] == "Parameter"  # not sharded
        torch.testing.assert_close(ours[2][1], ref[2][1], atol=1e-5, rtol=0)  # the local, unreduced gradient
        torch.testing.assert_close(ours[2][2], ref[2][2], atol=1e-5, rtol=0)


# ---------------------------------------------------------------- offload, signature


def _offload():
    from shardprop import CPUOffloadPolicy, OffloadPolicy
    out = []
    try:
        _shard("shardprop", Net(), block_kw=dict(offload_policy=CPUOffloadPolicy()))
    except RuntimeError as e:
        out.append(str(e))
    model = _shard("shardprop", Net(), block_kw=dict(offload_policy=CPUOffloadPolicy(pin_memory=False)),
                   root_kw=dict(offload_policy=OffloadPolicy()))
    x, y = _data(0)
    out.append(_micro(model, x, y, 1))
    out.append(_micro(_shard("shardprop", Net()), x, y, 1))
    return out


def test_an_empty_or_odd_module_list_is_refused_clearly():
    import shardprop  # a list of modules is one unit (tests/test_fsdp_groups.py); an empty one is an error
    with pytest.raises(ValueError, match="list of modules"):
        shardprop.fully_shard([])
    with pytest.raises(ValueError, match="list of modules"):
        shardprop.fully_shard([nn.Linear(2, 2), "not a module"])


def test_cpu_offload_on_a_cpu_mesh():
    for err, loss_offload, loss_plain in run_on_ranks(4, _offload):
        assert "CPUOffloadPolicy(pin_memory=True) on a CPU mesh" in err and "pin_memory=False" in err
        assert loss_offload == loss_plain  # host memory already: a no-op, as torch's


def _last_backward_and_override():
    from shardprop import MixedPrecisionPolicy
    from shardprop.parallel.fsdp.hooks import units_under
    model = _shard("shardprop", Net())
    x, y = _data(0)
    model.set_is_last_backward(False)
    _micro(model, x[:2], y[:2], 1)
    in_flight = [u._reduce is not None for u in units_under(model)]
    model.set_is_last_backward(True)
    _micro(model, x[2:], y[2:], 1)
    done = [u._reduce is None for u in units_under(model)] + [p.grad is not None for p in model.parameters()]
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=False,  # inputs follow param_dtype
                              param_dtype_override_fn=lambda p: torch.float32)
    block = _api("shardprop")[0](Block(), mesh=_mesh("shardprop", "1d"), mp_policy=mp)
    seen = []
    block.up.register_forward_pre_hook(lambda m, a: seen.append(m.weight.dtype))
    block(x)
    from shardprop import share_comm_ctx
    manual = _shard("shardprop", Net())
    manual.set_manual_backward_finalization(True)
    _micro(manual, x, y, 1)
    before = [p.grad is None for p in manual.parameters()]  # the end of backward left the work to finalize
    handle = manual.finalize_backward(async_op=True)
    handle.wait()
    after = [p.grad is not None for p in manual.parameters()]
    try:
        share_comm_ctx([manual, nn.Linear(2, 2)])
    except ValueError as e:
        after.append("FSDPModules" in str(e))
    kept = _shard("shardprop", Net())
    kept.set_keep_unsharded_storage(True)
    ptrs = []
    for _ in range(2):
        _micro(kept, x, y, 1)
        ptrs.append([(u.buffers.full_allocated, u.buffers.full.data_ptr()) for u in units_under(kept)])
    return in_flight, done, seen, mp.grad_reduce_dtype(torch.float32), ptrs, any(before), all(after)


def test_is_last_backward_false_dtype_override_and_kept_storage():
    for in_flight, done, seen, reduce_dtype, ptrs, before, after in run_on_ranks(4, _last_backward_and_override):
        assert before and after  # manual finalization: some .grad missing until finalize_backward's handle waits
        assert all(alive for alive, _ in ptrs[0]) and ptrs[0] == ptrs[1], ptrs  # kept storage: same memory
        assert sum(in_flight) == 1, in_flight  # the end of that backward did not wait for the last one
        assert all(done), done
        assert seen == [torch.float32]  # param_dtype_override_fn kept the unit in float32
        assert reduce_dtype == torch.float32  # 2.15: reduce_dtype=None follows the parameter, not param_dtype


def test_signature_mirrors_torch():
    import shardprop
    from torch.distributed.fsdp import fully_shard as ref
    ref_fn = inspect.unwrap(ref)
    ours = list(inspect.signature(shardprop.fully_shard).parameters)
    theirs = [n for n in inspect.signature(ref_fn).parameters if n != "dp_mesh_dims"]  # 2.15: not mirrored
    assert ours[:len(theirs)] == theirs, (ours, theirs)
    assert inspect.signature(shardprop.fully_shard).parameters["reshard_after_forward"].default is None
    for name in ("set_modules_to_forward_prefetch", "set_modules_to_backward_prefetch", "set_reshard_after_backward",
                 "set_reshard_after_forward", "set_is_last_backward", "set_gradient_divide_factor",
                 "set_requires_all_reduce", "set_requires_gradient_sync", "unshard", "reshard"):
        assert callable(getattr(shardprop.FSDPModule, name)), name
    for name in ("fully_shard", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy",
                 "UnshardHandle", "register_fsdp_forward_method"):
        assert name in shardprop.__all__, name


def _offload_cuda():
    from shardprop import CPUOffloadPolicy, fully_shard, init_device_mesh
    torch.cuda.set_device(dist.get_rank())
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    model = Net().cuda()
    for block in model.layers:
        fully_shard(block, mesh=mesh, offload_policy=CPUOffloadPolicy())
    fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy())
    x, y = (t.cuda() for t in _data(0))
    (model(x) - y).square().mean().backward()
    return ({p.to_local().device.type for p in model.parameters()},
            {p.grad.to_local().device.type for p in model.parameters()},
            all(p.to_local().is_pinned() for p in model.layers[0].parameters()))


@pytest.mark.gpu
def test_cpu_offload_on_cuda_keeps_shards_on_the_host():
    # needs one CUDA device per rank and NCCL: skipped on this CPU-only machine
    for params, grads, pinned in run_on_ranks(2, _offload_cuda):
        assert params == {"cpu"} and grads == {"cpu"} and pinned


def _plain_beside_sequence_parallel():
    """One unit holding a sequence-parallel norm (a DTensor weight) and plain Linears fed DTensors: the plain
    weights' gradients come back as DTensors on the tp mesh (partial there); the unit reduces their value."""
    import copy
    import shardprop as P
    torch.manual_seed(0)
    mesh = P.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ref = torch.nn.Sequential(torch.nn.RMSNorm(8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    block = copy.deepcopy(ref)
    P.parallelize_module(block, mesh["tp"], {"0": P.SequenceParallel()})
    P.fully_shard(block, mesh=mesh["dp"])
    xs = torch.randn(2, 2, 4, 8)
    x = P.distribute_tensor(xs[mesh.get_local_rank("dp")], mesh["tp"], [P.Shard(1)])
    block(x).full_tensor().sum().backward()
    ref(xs.flatten(0, 1)).sum().backward()  # both dp batches; fully_shard averages over dp
    return [n for (n, p), (_, r) in zip(block.named_parameters(), ref.named_parameters())
            if not torch.allclose(p.grad.full_tensor(), r.grad / 2, atol=1e-5)]


def test_plain_parameters_beside_sequence_parallel_ones_in_one_unit():
    assert run_on_ranks(4, _plain_beside_sequence_parallel) == [[]] * 4
