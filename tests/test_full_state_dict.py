"""Full state dicts on 4 real gloo ranks: gather a tensor-parallel model into a plain state dict that
a single-device model loads, and load a plain full state dict into a parallelized model
(``model.load_state_dict`` just works), with ``src_data_rank`` semantics. The oracle is the same
model built from the same seed in one process.
"""

import torch
import torch.nn.functional as F
from torch import nn

from tests.rankpool import run_on_ranks


class MLP(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.up = nn.Linear(8, 12)
        self.down = nn.Linear(12, 6)  # 6 rows of output over 4 ranks: uneven
        self.norm = nn.LayerNorm(6)
        self.register_buffer("scale", torch.arange(6.0))

    def forward(self, x):
        return self.norm(self.down(F.relu(self.up(x)))) * self.scale


def _tp(model, mesh):
    from shardprop import ColwiseParallel, RowwiseParallel, parallelize_module
    return parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})


def _meshes():
    from shardprop import init_device_mesh
    return {"1d": init_device_mesh("cpu", (4,)),
            "tp": init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"]}


def _gather(mesh_name, rank0_only):
    import torch.distributed as dist
    from shardprop import comm_counter, full_state_dict
    model = _tp(MLP(seed=1), _meshes()[mesh_name])
    # Train a step so the values differ from the seed's: the gather must carry the live values.
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    with comm_counter() as c:
        sd = full_state_dict(model, rank0_only=rank0_only)
    plain = MLP(seed=1)
    with torch.no_grad():
        for p in plain.parameters():
            p.mul_(1.5)
    ok = None
    if sd:
        fresh = MLP(seed=99)
        fresh.load_state_dict(sd)  # a single-device model loads it as is
        x = torch.randn(3, 8)
        ok = (all(type(v) is torch.Tensor for v in sd.values())
              and all(torch.equal(sd[k], v) for k, v in plain.state_dict().items())
              and torch.allclose(fresh(x), plain(x)))
    return dist.get_rank(), sorted(sd), ok, c.counts.get("send", (0, 0))[1]


def test_full_state_dict_on_rank0_only():
    keys = sorted(MLP().state_dict())
    for mesh_name in ("1d", "tp"):
        results = run_on_ranks(4, _gather, mesh_name, True)
        assert results[0][1:3] == (keys, True)
        assert all(r[1:3] == ([], None) for r in results[1:])
        sent = sum(r[3] for r in results)
        # Rank 0 receives each parameter's pieces it lacks, from one replica only: a sharded
        # parameter's other shards, nothing for replicated ones (it holds them already).
        sharded = (8 * 12 + 12 + 12 * 6) * 4  # up.weight, up.bias, down.weight
        n = 4 if mesh_name == "1d" else 2
        assert sent == sharded * (n - 1) // n, (mesh_name, sent)


def test_full_state_dict_everywhere():
    keys = sorted(MLP().state_dict())
    for rank, got, ok, _ in run_on_ranks(4, _gather, "tp", False):
        assert (got, ok) == (keys, True), rank


def _load(mesh_name, how):
    import torch.distributed as dist
    from shardprop import DTensor, comm_counter, load_full_state_dict
    model = _tp(MLP(seed=5), _meshes()[mesh_name])
    true = MLP(seed=7)
    me = dist.get_rank()
    # Only the source's data matters: the other ranks pass other values (or nothing at all).
    sd = true.state_dict() if me == 0 or how == "local" else MLP(seed=100 + me).state_dict()
    with comm_counter() as c:
        if how == "none_elsewhere":
            load_full_state_dict(model, sd if me == 0 else None)
        elif how == "local":
            load_full_state_dict(model, sd, src_data_rank=None)
        else:
            model.load_state_dict(sd)  # the hook parallelize_module installed
    placements = {k: tuple(v.placements) for k, v in model.state_dict().items() if isinstance(v, DTensor)}
    ok = all(torch.equal(v.full_tensor() if isinstance(v, DTensor) else v, true.state_dict()[k])
             for k, v in model.state_dict().items() if k != "scale")
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    out = model(x)
    out = out.full_tensor() if isinstance(out, DTensor) else out
    return ok, placements, torch.allclose(out, true(x), atol=1e-6), sum(n for n, _ in c.counts.values())


def test_load_state_dict_of_a_plain_full_state_dict():
    from shardprop import Shard
    for mesh_name in ("1d", "tp"):
        for ok, placements, same_output, _ in run_on_ranks(4, _load, mesh_name, "hook"):
            assert ok and same_output
            assert placements["up.weight"] == (Shard(0),) and placements["down.weight"] == (Shard(1),)
            assert "norm.weight" not in placements  # not in the plan: stays a plain tensor


def test_load_full_state_dict_helpers():
    for ok, _, same_output, _ in run_on_ranks(4, _load, "1d", "none_elsewhere"):
        assert ok and same_output  # other ranks passed None: meta placeholders, rank 0's data
    for ok, _, same_output, collectives in run_on_ranks(4, _load, "1d", "local"):
        assert ok and same_output and collectives == 0  # src_data_rank=None cuts locally


def _distribute_module_hook():
    from shardprop import Shard, distribute_module, distribute_tensor
    from shardprop import init_device_mesh

    def rows(name, mod, mesh):
        if isinstance(mod, nn.Linear):
            mod.weight = nn.Parameter(distribute_tensor(mod.weight.detach(), mesh, [Shard(0)]))

    model = distribute_module(MLP(seed=3), init_device_mesh("cpu", (4,)), rows)
    true = MLP(seed=4)
    model.load_state_dict(true.state_dict())
    return all(torch.equal(v.full_tensor(), true.state_dict()[k]) for k, v in model.state_dict().items())


def test_distribute_module_installs_the_hook():
    assert run_on_ranks(4, _distribute_module_hook) == [True] * 4


def _size_mismatch():
    model = _tp(MLP(), _meshes()["1d"])
    sd = MLP().state_dict()
    sd["up.weight"] = torch.zeros(13, 8)
    try:
        model.load_state_dict(sd)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_a_size_mismatch_is_reported_by_name():
    for msg in run_on_ranks(4, _size_mismatch):
        assert "up.weight" in msg and "size mismatch" in msg
