"""``_StridedShard``: torch's layout, rank by rank, against torch's own DTensor in the same job.

Each rank job builds the same tensors with torch's ``distribute_tensor`` (torch's ``_StridedShard``)
and ours, and compares local shards; then ``full_tensor``, redistribution both ways and ops,
against the plain full tensor.
"""
import pytest
import torch

from tests.rankpool import run_on_ranks

# (mesh shape, placements as (kind, dim, split_factor)) -- kinds: "ss" strided, "s" shard, "r" replicate
LAYOUTS = [
    ((2, 2), (("ss", 0, 2), ("s", 0))),     # FSDP over TP: row r*2+c on rank (c, r)
    ((2, 2), (("s", 0), ("ss", 0, 2))),
    ((2, 2), (("ss", 1, 2), ("r",))),
    ((2, 2), (("ss", 0, 3), ("s", 1))),
    ((4,), (("ss", 0, 2),)),
    ((4,), (("ss", 1, 3),)),
]
SHAPES = [(8, 6), (9, 7), (5, 3)]  # even, uneven, fewer rows than pieces


def _ours(spec):
    from shardprop import Replicate, Shard, _StridedShard
    kind = spec[0]
    return Replicate() if kind == "r" else Shard(spec[1]) if kind == "s" else _StridedShard(spec[1], split_factor=spec[2])


def _theirs(spec):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard
    kind = spec[0]
    return Replicate() if kind == "r" else Shard(spec[1]) if kind == "s" else _StridedShard(spec[1], split_factor=spec[2])


def _layouts_match():
    import shardprop as P
    from torch.distributed.device_mesh import init_device_mesh as ref_mesh
    from torch.distributed.tensor import distribute_tensor as ref_distribute
    out = []
    for mesh_shape, layout in LAYOUTS:
        mesh, rmesh = P.init_device_mesh("cpu", mesh_shape), ref_mesh("cpu", mesh_shape)
        ours, theirs = [_ours(s) for s in layout], [_theirs(s) for s in layout]
        for shape in SHAPES:
            full = torch.arange(float(shape[0] * shape[1])).reshape(shape)
            x = P.distribute_tensor(full, mesh, ours)
            # src_data_rank=None: torch 2.13's scatter path asserts on uneven strided pieces (no padding),
            # its local split is the layout itself.
            ref = ref_distribute(full, rmesh, theirs, src_data_rank=None)
            tag = (mesh_shape, layout, shape)
            out.append((tag, "local", torch.equal(x.to_local(), ref.to_local())))
            out.append((tag, "torch_objects", torch.equal(P.distribute_tensor(full, mesh, theirs).to_local(),
                                                          ref.to_local())))
            out.append((tag, "local_only", torch.equal(P.distribute_tensor(full, mesh, ours, src_data_rank=None)
                                                       .to_local(), ref.to_local())))
            out.append((tag, "full", torch.equal(x.full_tensor(), full)))
            rep = [P.Replicate()] * len(mesh_shape)
            out.append((tag, "to_replicate", torch.equal(x.redistribute(mesh, rep).to_local(), full)))
            back = P.distribute_tensor(full, mesh, rep).redistribute(mesh, ours)
            out.append((tag, "from_replicate", torch.equal(back.to_local(), ref.to_local())))
            plain = [P.Shard(0)] + [P.Replicate()] * (len(mesh_shape) - 1)
            y = x.redistribute(mesh, plain)
            out.append((tag, "to_shard", torch.equal(y.to_local(), P.distribute_tensor(full, mesh, plain).to_local())))
            out.append((tag, "shard_back", torch.equal(y.redistribute(mesh, ours).to_local(), ref.to_local())))
            # Partial -> strided: each rank's partial is full / world, summed gives full
            n = mesh.size()
            part = P.DTensor.from_local(full / n, mesh, [P.Partial()] * len(mesh_shape), run_check=False)
            out.append((tag, "from_partial", torch.allclose(part.redistribute(mesh, ours).to_local(), ref.to_local())))
            # from_local with the strided layout and the global shape, then back to full
            z = P.DTensor.from_local(ref.to_local(), mesh, ours, shape=full.shape, stride=full.stride())
            out.append((tag, "from_local", torch.equal(z.full_tensor(), full)))
    return out


def test_layouts_match_torch():
    for res in run_on_ranks(4, _layouts_match):
        bad = [(tag, what) for tag, what, ok in res if not ok]
        assert not bad, bad


def test_placement_value_semantics():
    from shardprop import Shard, _StridedShard
    from shardprop.tensor.placement import as_placement, normalize_placements
    from torch.distributed.tensor.placement_types import _StridedShard as TorchStrided
    p = _StridedShard(0, split_factor=2)
    assert repr(p) == "_S(0, sf=2)" and p == _StridedShard(0, 2) and hash(p) == hash(_StridedShard(0, 2))
    assert p != Shard(0) and p != _StridedShard(0, split_factor=3)
    assert p.is_shard() is TorchStrided(0, split_factor=2).is_shard()  # torch's answer (False on 2.13-2.15)
    with pytest.raises(AttributeError):
        p.dim = 1
    assert as_placement(TorchStrided(1, split_factor=3)) == _StridedShard(1, split_factor=3)
    assert normalize_placements([TorchStrided(-1, split_factor=2)], 2, 1) == (_StridedShard(1, split_factor=2),)
    with pytest.raises(ValueError, match="_S.2, sf=2. is out of range"):
        normalize_placements([_StridedShard(2, split_factor=2)], 2, 1)
    with pytest.raises(ValueError, match="split_factor"):
        _StridedShard(0, split_factor=0)


def _ops_on_strided():
    import shardprop as P
    from torch.distributed.device_mesh import init_device_mesh as ref_mesh
    from torch.distributed.tensor import distribute_tensor as ref_distribute
    out = []
    for mesh_shape, layout in LAYOUTS:
        mesh = P.init_device_mesh("cpu", mesh_shape)
        ours = [_ours(s) for s in layout]
        torch.manual_seed(0)
        a, b, w = torch.randn(9, 7), torch.randn(9, 7), torch.randn(7, 5)
        x, y = P.distribute_tensor(a, mesh, ours), P.distribute_tensor(b, mesh, ours)
        rep = [P.Replicate()] * len(mesh_shape)
        wd = P.distribute_tensor(w, mesh, rep)
        tag = (mesh_shape, layout)
        out.append((tag, "add", torch.allclose((x + y).full_tensor(), a + b)))
        out.append((tag, "mixed_add", torch.allclose((x + P.distribute_tensor(b, mesh, rep)).full_tensor(), a + b)))
        out.append((tag, "relu", torch.allclose(torch.relu(x).full_tensor(), torch.relu(a))))
        out.append((tag, "mm", torch.allclose((x @ wd).full_tensor(), a @ w, atol=1e-5)))
        out.append((tag, "sum", torch.allclose(x.sum().full_tensor(), a.sum(), atol=1e-5)))
        out.append((tag, "sum1", torch.allclose(x.sum(1).full_tensor(), a.sum(1), atol=1e-5)))
        xg = P.distribute_tensor(a, mesh, ours).requires_grad_()
        (xg * 2).sum().backward()
        out.append((tag, "grad", torch.allclose(xg.grad.full_tensor(), torch.full_like(a, 2.0))))
        try:
            x.add_(1.0)
            out.append((tag, "inplace_refused", False))
        except Exception as e:  # a gathered copy cannot stand in for the target
            out.append((tag, "inplace_refused", "_S(" in str(e)))
    return out


def test_ops_on_strided():
    for res in run_on_ranks(4, _ops_on_strided):
        bad = [(tag, what) for tag, what, ok in res if not ok]
        assert not bad, bad


def _dcp_refuses_strided():
    import shardprop as P
    mesh = P.init_device_mesh("cpu", (2, 2))
    x = P.distribute_tensor(torch.arange(16.0).reshape(8, 2), mesh, [P._StridedShard(0, split_factor=2), P.Shard(0)])
    got = []
    for hook in (lambda: x.__create_chunk_list__(), lambda: x.__create_write_items__("w", x)):
        try:
            hook()
            got.append(False)
        except NotImplementedError as e:  # never a silently wrong chunk
            got.append("_S(0, sf=2)" in str(e))
    return got


def test_dcp_refuses_strided():
    assert run_on_ranks(4, _dcp_refuses_strided) == [[True, True]] * 4


def test_torch_name_maps_to_ours():
    import shardprop
    from shardprop.interop.torch_names import resolve
    for mod in ("torch.distributed.tensor.placement_types", "torch.distributed._tensor.placement_types"):
        assert resolve(mod, "_StridedShard") is shardprop._StridedShard
