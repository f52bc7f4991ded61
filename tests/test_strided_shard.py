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
        x.add_(1.0)  # elementwise on its own layout: in place on the local pieces
        out.append((tag, "inplace", torch.allclose(x.full_tensor(), a + 1) and tuple(x.placements) == tuple(ours)))
        try:
            x.add_(P.distribute_tensor(b, mesh, rep))
            out.append((tag, "mixed_inplace_refused", False))
        except Exception as e:  # another layout: a gathered copy cannot stand in for the target
            out.append((tag, "mixed_inplace_refused", "_S(" in str(e)))
    return out


def test_ops_on_strided():
    for res in run_on_ranks(4, _ops_on_strided):
        bad = [(tag, what) for tag, what, ok in res if not ok]
        assert not bad, bad


def _dcp_with_strided(path):
    """A strided shard nested under a Shard of its dim (one run per rank) saves and loads as one chunk, the
    same chunk torch's DTensor gives; a strided shard that is several runs on a rank is refused."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import distribute_tensor as torch_distribute
    from torch.distributed.tensor.placement_types import Shard as TShard, _StridedShard as TStrided
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    import shardprop as P
    full = torch.arange(16.0).reshape(8, 2)
    mesh = P.init_device_mesh("cpu", (2, 2))
    x = P.distribute_tensor(full, mesh, [P._StridedShard(0, split_factor=2), P.Shard(0)])
    theirs = torch_distribute(full, torch_mesh("cpu", (2, 2)), [TStrided(0, split_factor=2), TShard(0)])
    chunk = lambda t: [(tuple(c.offsets), tuple(c.sizes)) for c in t.__create_chunk_list__()]
    same_chunk = chunk(x) == chunk(theirs)
    dcp.save({"w": x}, checkpoint_id=path)
    back = P.distribute_tensor(torch.zeros(8, 2), mesh, [P.Shard(1), P.Shard(0)])
    dcp.load({"w": back}, checkpoint_id=path)
    again = P.distribute_tensor(torch.zeros(8, 2), mesh, [P._StridedShard(0, split_factor=2), P.Shard(0)])
    dcp.load({"w": again}, checkpoint_id=path)
    several = P.distribute_tensor(full, mesh, [P._StridedShard(0, split_factor=2), P.Replicate()])
    try:
        several.__create_chunk_list__()
        refused = False
    except NotImplementedError as e:  # never a silently wrong chunk
        refused = "_S(0, sf=2)" in str(e)
    return (same_chunk, torch.equal(back.full_tensor(), full), torch.equal(again.to_local(), x.to_local()),
            refused)


def test_dcp_saves_a_strided_shard_that_is_one_box_and_refuses_one_that_is_not(tmp_path):
    assert run_on_ranks(4, _dcp_with_strided, str(tmp_path / "ckpt")) == [(True, True, True, True)] * 4


def test_torch_name_maps_to_ours():
    import shardprop
    from shardprop.interop.torch_names import resolve
    for mod in ("torch.distributed.tensor.placement_types", "torch.distributed._tensor.placement_types"):
        assert resolve(mod, "_StridedShard") is shardprop._StridedShard


def _elementwise_keeps_strided():
    """An optimizer's updates on a strided shard (fully_shard-ed experts): elementwise ops, in place too, on
    inputs of one strided layout run on the local pieces and keep the layout; values as on the whole tensor."""
    import shardprop as P
    mesh = P.init_device_mesh("cpu", (2, 2))
    layout = [P._StridedShard(0, split_factor=2), P.Shard(0)]
    full = torch.arange(1.0, 17.0).reshape(8, 2)
    x, g = P.distribute_tensor(full, mesh, layout), P.distribute_tensor(full.flip(0), mesh, layout)
    m = torch.zeros_like(x)
    m.lerp_(g, 0.1)
    v = torch.zeros_like(x).addcmul_(g, g, value=0.01)
    torch._foreach_addcdiv_([x], [m], [v.sqrt() + 1e-8], [-0.5])
    want_m = torch.zeros_like(full).lerp_(full.flip(0), 0.1)
    want_v = torch.zeros_like(full).addcmul_(full.flip(0), full.flip(0), value=0.01)
    want = full.clone().addcdiv_(want_m, want_v.sqrt() + 1e-8, value=-0.5)
    kept = all(t.placements == tuple(layout) for t in (x, m, v))
    other = P.distribute_tensor(full, mesh, [P.Shard(0), P.Shard(1)])
    try:
        x.add_(other)  # layouts differ: a gathered copy cannot stand in for the target
        refused = False
    except Exception as e:  # noqa: BLE001
        refused = "_S(0, sf=2)" in str(e)
    # torchtitan's fused AdamW over experts (strided, on the (efsdp, ep) mesh) and dense weights on another mesh
    dense = torch.nn.Parameter(P.distribute_tensor(full, P.init_device_mesh("cpu", (4,)), [P.Shard(0)]))
    expert = torch.nn.Parameter(P.distribute_tensor(full, mesh, layout))
    plain = [torch.nn.Parameter(full.clone()) for _ in range(2)]
    for params in ([expert, dense], plain):
        for q in params:
            q.grad = torch.ones_like(q) * 0.5
        torch.optim.AdamW(params, lr=0.1, fused=True).step()
    fused = all(torch.allclose(q.full_tensor(), r.detach()) for q, r in zip((expert, dense), plain)) and \
        expert.placements == tuple(layout)
    return kept, torch.allclose(x.full_tensor(), want), torch.allclose(m.full_tensor(), want_m), refused, fused


def test_elementwise_ops_keep_a_strided_layout_in_place_too():
    assert run_on_ranks(4, _elementwise_keeps_strided) == [(True, True, True, True, True)] * 4
