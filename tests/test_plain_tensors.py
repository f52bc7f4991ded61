"""Plain tensors that torch's Python composites make inside an op on DTensors join as Replicate once the
ranks verify they are identical (shardprop/dispatch/plain_tensors.py); one that differs raises on
every rank alike; a plain tensor the user's own call passes (also through a C++ composite, which looks
the same) raises unless implicit_replication() is active."""
from tests.rankpool import run_on_ranks


def _composites_with_inner_plain_tensors():
    import torch

    import shardprop as sp
    mesh = sp.init_device_mesh("cpu", (4,))
    g = torch.Generator().manual_seed(3)
    a = torch.randn(8, 8, generator=g)
    da = sp.distribute_tensor(a, mesh, [sp.Shard(0)])
    got = {}
    refused = []
    for name, call in (("matrix_power0", lambda: torch.linalg.matrix_power(da, 0)),
                       ("matrix_rank", lambda: torch.linalg.matrix_rank(da.unsqueeze(0).expand(2, 8, 8)))):
        try:  # C++ composites called straight from user code: the inner tensor looks like the user's
            call()
        except sp.ShardingError as e:
            if "plain torch.Tensor" in str(e):
                refused.append(name)
    got["matrix_power0"] = (lambda: torch.linalg.matrix_power(da, 0).full_tensor(), torch.linalg.matrix_power(a, 0))
    got["matrix_rank"] = (lambda: torch.linalg.matrix_rank(da).full_tensor(), torch.linalg.matrix_rank(a))
    torch.manual_seed(5)  # svd_lowrank draws a plain randn test matrix: in step on every rank
    u, s, v = torch.svd_lowrank(da, q=4)
    torch.manual_seed(5)
    ru, rs, rv = torch.svd_lowrank(a, q=4)
    got["svd_lowrank"] = (s.full_tensor(), rs)
    mask = torch.rand(8, 8, generator=g) > 0.3
    got["masked.var"] = (torch.masked._ops.var(da, 1, mask=sp.distribute_tensor(mask, mesh, [sp.Shard(0)])).full_tensor(),
                         torch.masked._ops.var(a, 1, mask=mask))
    q = torch.randn(2, 2, 8, 4, generator=g)
    dq = sp.distribute_tensor(q, mesh, [sp.Shard(1)])
    bool_mask = torch.rand(8, 8, generator=g) > 0.5  # plain bool: becomes a plain float mask inside
    bool_mask[:, 0] = True
    F = torch.nn.functional
    got["sdpa"] = (lambda: F.scaled_dot_product_attention(dq, dq, dq, attn_mask=bool_mask).full_tensor(),
                   F.scaled_dot_product_attention(q, q, q, attn_mask=bool_mask))
    for k, (x, y) in got.items():
        if callable(x):  # a C++ composite: the user opts in, as with torch's DTensor
            with sp.implicit_replication():
                x = x()
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4, msg=k)
    return sorted(got), refused


def test_composites_making_plain_tensors_inside_match_torch():
    res = run_on_ranks(4, _composites_with_inner_plain_tensors)
    assert res == [(["masked.var", "matrix_power0", "matrix_rank", "sdpa", "svd_lowrank"],
                    ["matrix_power0"])] * 4


def _differs_between_ranks():
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import shardprop as sp
    mesh = sp.init_device_mesh("cpu", (2, 2))
    x = sp.distribute_tensor(torch.ones(4, 6), mesh, [sp.Shard(0), sp.Replicate()])
    out = []
    # F.layer_norm (torch's Python) hands the plain weight on: verified, joins when identical.
    for plain in (torch.full((6,), 2.0), torch.full((6,), float(dist.get_rank() == 3))):
        try:
            out.append(float(F.layer_norm(x, (6,), weight=plain, bias=plain).full_tensor().sum()))
        except sp.ShardingError as e:
            out.append("raised" if "not the same on every rank" in str(e) and "(6,)" in str(e) else str(e))
    try:  # the user's own call: refused whatever the values, as torch's DTensor does
        x * torch.full((6,), 2.0)
        out.append("accepted")
    except sp.ShardingError as e:
        out.append("refused" if "plain torch.Tensor" in str(e) else str(e))
    with sp.implicit_replication():
        out.append(float((x * torch.full((6,), 2.0)).full_tensor().sum()))
    return out


def test_plain_tensor_differing_on_one_rank_raises_on_every_rank():
    # Rank 3 alone differs: every rank raises (no rank left waiting), on a 2-d mesh.
    assert run_on_ranks(4, _differs_between_ranks) == [[48.0, "raised", "refused", 48.0]] * 4


def _plain_out_target():
    import torch
    import torch.distributed as dist

    import shardprop as sp
    mesh = sp.init_device_mesh("cpu", (4,))
    a = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
    b = torch.arange(15.).reshape(3, 5)
    buf = torch.full((4, 5), float(dist.get_rank()))  # its old values differ between ranks: never read
    torch.mm(sp.distribute_tensor(a, mesh, [sp.Replicate()]), sp.distribute_tensor(b, mesh, [sp.Replicate()]), out=buf)
    return torch.equal(buf, a @ b)


def test_plain_out_target_receives_the_full_result():
    # torch's chunked linear_cross_entropy writes DTensor matmuls into torch.empty buffers.
    assert run_on_ranks(4, _plain_out_target) == [True] * 4
