"""fully_shard as torchtitan 0.3.0 calls it (torch 2.15's semantics), on 4 gloo ranks.

* a list of modules as one unit: ``fully_shard([model.norm, model.head])`` (torchtitan's last layers),
  tied weights in one group (``[tok_embeddings, norm, lm_head]``), and the chunked-loss loop of
  torchtitan's ``ChunkedLossWrapper`` (the model skips the head; the head runs per chunk);
* ``dp_mesh_dims=DataParallelMeshDims(...)`` over a whole mesh whose parameters are DTensors
  (FSDP, flattened shard dims, HSDP, FSDP + TP), and the combinations refused;
* the mesh-info names torchtitan's expert path imports (``FSDPMeshInfo``, ``ShardPlacementResult``,
  ``_get_mesh_info``).

Every training job is compared with one process on the full batch; the plain group also with
torch's own ``fully_shard`` in the same job.
"""
import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tests.rankpool import run_on_ranks

D, V, STEPS = 8, 6, 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(D, 2 * D)
        self.down = nn.Linear(2 * D, D)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class Net(nn.Module):
    """torchtitan's decoder in miniature: embeddings, blocks, norm, head (optionally tied, optionally skipped)."""

    def __init__(self, tied=False):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, D)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)
        if tied:
            self.head.weight = self.emb.weight
        self.skip_head = False

    def forward(self, tokens):
        h = self.emb(tokens)
        for layer in self.layers:
            h = layer(h)
        h = self.norm(h)
        return h if self.skip_head else self.head(h)


def _batch(step, rows=None):
    g = torch.Generator().manual_seed(10 + step)
    x, y = torch.randint(0, V, (8, 3), generator=g), torch.randint(0, V, (8, 3), generator=g)
    if rows is None:
        r = dist.get_rank()
        rows = slice(2 * r, 2 * r + 2)
    return x[rows], y[rows]


def _loss(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _params(model):
    return {n: _full(p.detach()).clone() for n, p in model.named_parameters()}


def _reference(tied=False):
    """One process, the whole batch, same steps: the parameters after STEPS AdamW steps."""
    model = Net(tied)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    for step in range(STEPS):
        x, y = _batch(step, slice(None))
        _loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return _params(model)


def _api(impl):
    if impl == "torch":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, fully_shard
    else:
        from shardprop import FSDPModule, fully_shard, init_device_mesh
    return fully_shard, init_device_mesh, FSDPModule


def _grouped(impl, tied=False):
    fully_shard, init, _ = _api(impl)
    mesh = init("cpu", (4,), mesh_dim_names=("dp",))
    model = Net(tied)
    group = [model.emb, model.norm, model.head] if tied else [model.norm, model.head]
    if not tied:
        fully_shard(model.emb, mesh=mesh)
    returned = fully_shard(group, mesh=mesh, reshard_after_forward=True)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, returned is group


# ---------------------------------------------------------------- a list of modules as one unit


@contextlib.contextmanager
def _counting_gathers():
    """Count shardprop's all-gathers while active (the test patches the collectives module, then restores it)."""
    from shardprop.mesh import collectives as C
    count, saved = [0], {n: getattr(C, n) for n in ("all_gather", "all_gather_into_views")}

    def wrap(fn):
        def inner(*a, **k):
            count[0] += 1
            return fn(*a, **k)
        return inner
    for n, fn in saved.items():
        setattr(C, n, wrap(fn))
    try:
        yield count
    finally:
        for n, fn in saved.items():
            setattr(C, n, fn)


def _group_job(impl):
    _, _, FSDPModule = _api(impl)
    model, returns_list = _grouped(impl)
    out = {"returns_list": returns_list,
           "fsdp_modules": all(isinstance(m, FSDPModule) for m in (model.norm, model.head))}
    seen = []
    # After norm's forward (the group's first module) the head's parameters are already the gathered ones.
    model.norm.register_forward_hook(lambda m, a, o: seen.append(type(model.head.weight).__name__))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    gathers = []
    for step in range(STEPS):
        x, y = _batch(step)
        if impl == "shardprop" and step == STEPS - 1:
            with _counting_gathers() as count:
                _loss(model(x), y).backward()
            gathers.append(count[0])
        else:
            _loss(model(x), y).backward()
        out.setdefault("after_forward", type(model.head.weight).__name__)
        opt.step()
        opt.zero_grad()
    out["head_during_norm"] = seen[0]
    out["params"] = _params(model)
    out["gathers"] = gathers
    if impl == "shardprop":
        from shardprop.parallel.fsdp.hooks import units_under
        units = units_under(model)
        out["units"] = len(units)
        out["shared"] = model.norm._fsdp_unit is model.head._fsdp_unit
        model.head.set_reshard_after_forward(False)  # acts on the shared unit
        out["norm_follows"] = model.norm._fsdp_unit.reshard_after_forward
    return out


def test_a_list_of_modules_is_one_unit_as_in_torch():
    ref = _reference()
    mine = run_on_ranks(4, _group_job, "shardprop")
    theirs = run_on_ranks(4, _group_job, "torch")
    for ours, torch_out in zip(mine, theirs):
        assert ours["returns_list"] and torch_out["returns_list"]
        assert ours["fsdp_modules"] and torch_out["fsdp_modules"]
        assert ours["head_during_norm"] == "Parameter" and torch_out["head_during_norm"] != "DTensor"
        assert ours["after_forward"] == "DTensor" and torch_out["after_forward"] == "DTensor"
        # root, emb, 2 blocks, the group: counted once though two modules hold it
        assert ours["units"] == 5 and ours["shared"] and ours["norm_follows"] is False
        # Forward: emb, 2 blocks, the group once (not once per module); the root has no parameters of
        # its own. Backward gathers the same 4 again (all reshard after forward).
        assert ours["gathers"] == [8]
        for name, want in ref.items():
            torch.testing.assert_close(ours["params"][name], want, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(ours["params"][name], torch_out["params"][name], atol=1e-5, rtol=1e-5)


def _tied_job():
    model, _ = _grouped("shardprop", tied=True)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    for step in range(STEPS):
        x, y = _batch(step)
        _loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return _params(model), model.head.weight is model.emb.weight


def test_tied_weights_in_one_group():
    ref = _reference(tied=True)
    for params, still_tied in run_on_ranks(4, _tied_job):
        assert still_tied
        for name, want in ref.items():
            torch.testing.assert_close(params[name], want, atol=1e-5, rtol=1e-5)


def _chunked_job(chunks=2):
    """torchtitan's ChunkedLossWrapper: forward without the head, then the head per chunk, each its own backward."""
    model, _ = _grouped("shardprop")
    model.skip_head = True
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    head = model.head
    for step in range(STEPS):
        x, y = _batch(step)
        h = model(x)
        pieces = [c.detach().requires_grad_(True) for c in h.chunk(chunks, dim=1)]
        labels = y.chunk(chunks, dim=1)
        head.set_reshard_after_forward(False)
        head.set_reshard_after_backward(False)
        head.set_requires_gradient_sync(False, recurse=False)
        head.unshard()
        grads = []
        for i, (piece, lab) in enumerate(zip(pieces, labels)):
            if i == chunks - 1:
                head.set_requires_gradient_sync(True, recurse=False)
            logits = head(piece)
            # the chunk's share of the whole batch's mean cross entropy
            loss = F.cross_entropy(logits.flatten(0, 1), lab.flatten(), reduction="sum") / y.numel()
            loss.backward()
            grads.append(piece.grad)
        head.set_reshard_after_forward(True)
        head.set_reshard_after_backward(True)
        head.set_requires_gradient_sync(True, recurse=False)
        head.reshard()
        h.backward(torch.cat(grads, dim=1))
        opt.step()
        opt.zero_grad()
    return _params(model)


def test_chunked_loss_runs_the_head_apart():
    ref = _reference()
    for params in run_on_ranks(4, _chunked_job):
        for name, want in ref.items():
            torch.testing.assert_close(params[name], want, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- dp_mesh_dims


def _distribute(model, mesh, tp):
    """Every parameter a DTensor on the whole mesh, Replicate on the dp dims; blocks Megatron-style on tp."""
    from shardprop import DTensor, Replicate, Shard, distribute_tensor
    for name, mod in model.named_modules():
        for pname, p in list(mod._parameters.items()):
            if p is None:
                continue
            pl = [Replicate()] * mesh.ndim
            if tp is not None and name.startswith("layers."):
                if name.endswith("up"):
                    pl[tp] = Shard(0)
                elif name.endswith("down") and pname == "weight":
                    pl[tp] = Shard(1)
            mod._parameters[pname] = nn.Parameter(distribute_tensor(p.detach(), mesh, pl))
    assert all(isinstance(p, DTensor) for p in model.parameters())


def _spmd_job(names, shape, dims_kw, tp=None):
    from shardprop import DataParallelMeshDims, DTensor, Replicate, Shard, fully_shard, init_device_mesh
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    dims = DataParallelMeshDims(**dims_kw)
    model = Net()
    _distribute(model, mesh, tp)
    fully_shard(model.emb, mesh=mesh, dp_mesh_dims=dims)
    fully_shard([model.norm, model.head], mesh=mesh, dp_mesh_dims=dims)
    for block in model.layers:
        fully_shard(block, mesh=mesh, dp_mesh_dims=dims)
    fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    for m in model.modules():
        if hasattr(m, "set_gradient_divide_factor"):
            m.set_gradient_divide_factor(1.0)  # as torchtitan: the gradients of the global loss, summed
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    batch_on = [Shard(0) if n in dims.shard_names + dims.replicate_names else Replicate() for n in names]
    for step in range(STEPS):
        x, y = _batch(step, slice(None))
        xd = DTensor.from_local(_local_rows(x, mesh, batch_on), mesh, batch_on)
        yd = DTensor.from_local(_local_rows(y, mesh, batch_on), mesh, batch_on)
        loss = F.cross_entropy(model(xd).flatten(0, 1), yd.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
    return _params(model), [(type(p).__name__, getattr(p, "dim", None)) for p in model.layers[0].up.weight.placements]


def _local_rows(t, mesh, placements):
    from shardprop import Replicate, distribute_tensor
    return distribute_tensor(t, mesh, placements)._local_tensor if placements != [Replicate()] * mesh.ndim else t


S0, S1, R = ("Shard", 0), ("Shard", 1), ("Replicate", None)


@pytest.mark.parametrize("names,shape,dims_kw,tp,placed", [
    (("dp_shard",), (4,), dict(shard="dp_shard"), None, [S0]),
    (("dp_shard", "cp"), (2, 2), dict(shard=("dp_shard", "cp")), None, [S0]),  # on the flattened dim
    (("dp_replicate", "dp_shard"), (2, 2), dict(shard="dp_shard", replicate="dp_replicate"), None, [R, S0]),
    (("dp_shard", "tp"), (2, 2), dict(shard="dp_shard"), 1, [S1, S0]),  # tp splits rows: dp splits columns
], ids=["fsdp", "flattened", "hsdp", "fsdp+tp"])
def test_dp_mesh_dims_trains_like_one_process(names, shape, dims_kw, tp, placed):
    ref = _reference()
    for params, placements in run_on_ranks(4, _spmd_job, names, shape, dims_kw, tp):
        for name, want in ref.items():
            torch.testing.assert_close(params[name], want, atol=1e-5, rtol=1e-5)
        assert placements == placed


def _refusals():
    from shardprop import DataParallelMeshDims, fully_shard, init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    hsdp_tp = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    out = {}
    cases = {
        "ddp": (mesh, DataParallelMeshDims(replicate="dp_shard"), nn.Linear(2, 2)),
        "missing": (mesh, DataParallelMeshDims(shard="fsdp"), nn.Linear(2, 2)),
        "hsdp+tp": (hsdp_tp, DataParallelMeshDims(shard="dp_shard", replicate="dp_replicate"), nn.Linear(2, 2)),
        "plain": (mesh, DataParallelMeshDims(shard="dp_shard"), nn.Linear(2, 2)),
    }
    for key, (m, dims, mod) in cases.items():
        try:
            fully_shard(mod, mesh=m, dp_mesh_dims=dims)
            out[key] = None
        except (ValueError, NotImplementedError) as e:
            out[key] = (type(e).__name__, str(e))
    return out


def test_dp_mesh_dims_refusals_name_the_combination():
    from shardprop import DataParallelMeshDims
    with pytest.raises(ValueError, match="shard= or replicate="):
        DataParallelMeshDims()
    out = run_on_ranks(4, _refusals)[0]
    assert out["ddp"][0] == "NotImplementedError" and "replicate only" in out["ddp"][1]
    assert out["missing"][0] == "ValueError" and "'fsdp'" in out["missing"][1]
    assert out["hsdp+tp"][0] == "NotImplementedError" and "HSDP" in out["hsdp+tp"][1]
    assert out["plain"][0] == "ValueError" and "plain tensor" in out["plain"][1]


# ---------------------------------------------------------------- mesh infos


def _mesh_infos():
    from shardprop import DataParallelMeshDims, Shard, fully_shard, init_device_mesh
    from shardprop.parallel.fsdp import FSDPMeshInfo, HSDPMeshInfo, ShardPlacementResult, _get_mesh_info
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "ep"))
    flat = _get_mesh_info(mesh, DataParallelMeshDims(shard=("dp_shard", "ep")))
    one = _get_mesh_info(mesh["dp_shard"])
    hsdp = _get_mesh_info(mesh)
    out = dict(flat=(type(flat).__name__, flat.shard_mesh_size, flat.shard_mesh_rank, flat.is_spmd_mesh),
               one=(type(one).__name__, one.shard_mesh_size, one.shard_mesh_rank == mesh.get_local_rank("dp_shard")),
               hsdp=(isinstance(hsdp, HSDPMeshInfo), hsdp.replicate_mesh_size, hsdp.shard_mesh_size))
    dp = mesh["dp_shard"]
    info = _get_mesh_info(dp)
    model = nn.Linear(4, 4)
    torch.manual_seed(0)
    fully_shard(model, mesh=dp, shard_placement_fn=lambda p: ShardPlacementResult(Shard(1), info)
                if p.ndim == 2 else ShardPlacementResult(Shard(0), info))
    out["placement"] = model.weight.placements[0] == Shard(1) and model.bias.placements[0] == Shard(0)
    other = _get_mesh_info(mesh["ep"])
    lin = nn.Linear(4, 4)
    fully_shard(lin, mesh=dp, shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), other if p.ndim == 2 else info))
    unit = lin._fsdp_unit  # the bias over dp_shard (the call's mesh), the weight in a member unit over ep
    out["other"] = (unit.dp_mesh == mesh["dp_shard"], [m.dp_mesh == mesh["ep"] for m in unit.members],
                    lin.weight.device_mesh == mesh["ep"], lin.bias.device_mesh == mesh["dp_shard"])
    out["is_fsdp_info"] = isinstance(info, FSDPMeshInfo)
    return out


def test_mesh_infos_as_torchtitan_uses_them():
    for rank, out in enumerate(run_on_ranks(4, _mesh_infos)):
        assert out["flat"] == ("FSDPMeshInfo", 4, rank, True)  # (dp_shard, ep) flattened: rank order
        assert out["one"][:2] == ("FSDPMeshInfo", 2) and out["one"][2]
        assert out["hsdp"] == (True, 2, 2)
        assert out["placement"] is True
        assert out["other"] == (True, [True], True, True)
        assert out["is_fsdp_info"]
