"""Small API gaps of issue 30, each run side by side with torch.distributed.tensor on the same gloo ranks.

Every case does the same thing with shardprop and with torch's DTensor (the reference) and
asserts the same outcome: values, placements, warnings or the exception type.

- item 2, leniency: ``parallelize_module(model, mesh)`` with no plan warns and returns the
  module; a plan key matching nothing warns and is skipped (``strict=True`` raises);
  ``src_data_rank`` (0, another rank, None) in ``parallelize_module`` and on a style.
- item 3, ``with mesh:``: ``distribute_tensor``, ``DTensor.from_local``, ``parallelize_module`` (and
  shardprop's factories) take the mesh from the innermost enclosing block; none: RuntimeError.
- item 6, ``from_local(run_check=True)``: ranks that disagree on dtype, stride, requires_grad, shape
  or ndim raise ValueError on every rank; replicas come from the first rank of each Replicate dim.
- item 8, ``redistribute(..., forward_dtype=, backward_dtype=)``: collectives run in those dtypes (checked
  by the bytes ``comm_counter`` sees), the result has ``forward_dtype``, the gradient the input's dtype.
- item 7, ``Partial("product")`` (``"prod"`` is the same placement here; torch 2.13 refuses that spelling):
  to Replicate / Shard (uneven too), ``prod`` over a sharded dim and of a product Partial, views.
"""
import warnings

import pytest
import torch
from torch import nn

import shardprop as sp
from tests.rankpool import run_on_ranks


def _ref():
    """torch's DTensor API, as one namespace (tests may import it; product code never does)."""
    import torch.distributed.tensor as T
    import torch.distributed.tensor.parallel as P
    from torch.distributed.device_mesh import init_device_mesh
    from types import SimpleNamespace
    return SimpleNamespace(init_device_mesh=init_device_mesh, distribute_tensor=T.distribute_tensor,
                           DTensor=T.DTensor, Shard=T.Shard, Replicate=T.Replicate, Partial=T.Partial,
                           parallelize_module=P.parallelize_module, ColwiseParallel=P.ColwiseParallel,
                           RowwiseParallel=P.RowwiseParallel, SequenceParallel=P.SequenceParallel)


class _MLP(nn.Module):
    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.down(torch.relu(self.up(x))))


def _warned(fn):
    """(result, [warning texts]) of ``fn()``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


def _raises(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 (the type is the result)
        return type(e).__name__
    return None


# ---------------------------------------------------------------- item 2: leniency, src_data_rank
def _leniency():
    ref = _ref()
    out = {}
    for name, api in (("ours", sp), ("ref", ref)):
        mesh = api.init_device_mesh("cpu", (4,))
        model = _MLP(0)
        got, warned = _warned(lambda: api.parallelize_module(model, mesh))
        out[name, "no plan"] = (got is model, len(warned) > 0, any(isinstance(p, api.DTensor)
                                                                   for p in model.parameters()))
        model = _MLP(0)
        plan = {"up": api.ColwiseParallel(), "nothing.here": api.RowwiseParallel(), "down": api.RowwiseParallel()}
        got, warned = _warned(lambda: api.parallelize_module(model, mesh, plan))
        # The other keys are still applied: up and down are sharded, the model still runs.
        y = model(torch.ones(2, 8))
        out[name, "no match"] = (got is model, any("nothing" in w for w in warned),
                                 [str(p) for p in model.up.weight.placements],
                                 [str(p) for p in model.down.weight.placements], tuple(y.shape))
    for kind in ("no plan", "no match"):
        out["strict", kind] = _raises(
            lambda: sp.parallelize_module(_MLP(0), sp.init_device_mesh("cpu", (4,)),
                                          None if kind == "no plan" else {"nothing": sp.ColwiseParallel()},
                                          strict=True))
    return out


def test_parallelize_leniency_as_torch():
    out = run_on_ranks(4, _leniency)[0]
    for kind in ("no plan", "no match"):
        assert out["ours", kind] == out["ref", kind], (kind, out)
    assert out["ours", "no plan"] == (True, True, False), out
    assert out["ours", "no match"][:2] == (True, True), out
    assert out["strict", "no plan"] == "TypeError" and out["strict", "no match"] == "ValueError", out


def _src_data_rank():
    """Each rank builds its module from its own seed; the parameters kept follow src_data_rank."""
    import torch.distributed as dist
    ref = _ref()
    rank = dist.get_rank()
    out = {}
    for name, api in (("ours", sp), ("ref", ref)):
        for src in (0, 2, None):
            mesh = api.init_device_mesh("cpu", (4,))
            model = _MLP(seed=100 + rank)
            plan = {"up": api.ColwiseParallel(), "down": api.RowwiseParallel(), "norm": api.SequenceParallel()}
            api.parallelize_module(model, mesh, plan, src_data_rank=src)
            out[name, src] = {n: (p.to_local().clone(), [str(q) for q in p.placements])
                              for n, p in model.named_parameters()}
        # A style applied alone takes src_data_rank too.
        model = _MLP(seed=100 + rank)
        api.parallelize_module(model.up, api.init_device_mesh("cpu", (4,)), api.ColwiseParallel(), src_data_rank=None)
        out[name, "style"] = {"up.weight": (model.up.weight.to_local().clone(), [str(q) for q in model.up.weight.placements])}
    return out


def test_parallelize_src_data_rank_as_torch():
    per_rank = run_on_ranks(4, _src_data_rank)
    for rank, out in enumerate(per_rank):
        for key in (0, 2, None, "style"):
            ours, ref = out["ours", key], out["ref", key]
            assert ours.keys() == ref.keys(), key
            for n in ours:
                assert ours[n][1] == ref[n][1], (rank, key, n, ours[n][1], ref[n][1])
                torch.testing.assert_close(ours[n][0], ref[n][0], msg=lambda m: f"rank {rank} src={key} {n}: {m}")
    # The sources really differ: rank 1's shard of up.weight is rank 0's weights with 0, its own with None.
    r1 = per_rank[1]
    assert not torch.equal(r1["ours", 0]["up.weight"][0], r1["ours", None]["up.weight"][0])
    assert not torch.equal(r1["ours", 0]["up.weight"][0], r1["ours", 2]["up.weight"][0])


# ---------------------------------------------------------------- item 3: `with mesh:`
def _mesh_context():
    import torch.distributed as dist
    ref = _ref()
    rank = dist.get_rank()
    out = {}
    for name, api in (("ours", sp), ("ref", ref)):
        mesh = api.init_device_mesh("cpu", (4,))
        sub = api.init_device_mesh("cpu", (2, 2))
        full = torch.arange(24.0).reshape(8, 3)
        got = {}
        with mesh:
            d = api.distribute_tensor(full, placements=[api.Shard(0)])
            f = api.DTensor.from_local(torch.full((2,), float(rank)), placements=[api.Shard(0)])
            z = api.distribute_tensor(full)  # no placements either: replicated
            with sub:  # nested: the innermost mesh wins, and the outer one is back after
                inner = api.DTensor.from_local(torch.ones(1), placements=[api.Shard(0), api.Replicate()])
            after = api.distribute_tensor(full, placements=[api.Shard(1)])
            model = api.parallelize_module(_MLP(0), parallelize_plan={"up": api.ColwiseParallel()})
        for key, t in (("distribute", d), ("from_local", f), ("replicated", z), ("nested", inner), ("after", after),
                       ("parallelize", model.up.weight)):
            got[key] = (t.device_mesh.shape if hasattr(t.device_mesh, "shape") else tuple(t.device_mesh.mesh.shape),
                        [str(p) for p in t.placements], t.to_local().clone(), t.full_tensor().clone())
        got["outside"] = _raises(lambda: api.distribute_tensor(full, placements=[api.Shard(0)]))
        out[name] = got
    with sp.init_device_mesh("cpu", (4,)):
        out["factory"] = tuple(sp.zeros(8, 2, placements=[sp.Shard(0)]).to_local().shape)
    return out


def test_mesh_context_manager_as_torch():
    for rank, out in enumerate(run_on_ranks(4, _mesh_context)):
        ours, ref = out["ours"], out["ref"]
        assert ours["outside"] == ref["outside"] == "RuntimeError", (ours["outside"], ref["outside"])
        for key in ("distribute", "from_local", "replicated", "nested", "after", "parallelize"):
            assert tuple(ours[key][0]) == tuple(ref[key][0]) and ours[key][1] == ref[key][1], (rank, key, ours[key][:2],
                                                                                               ref[key][:2])
            torch.testing.assert_close(ours[key][2], ref[key][2], msg=lambda m: f"rank {rank} {key} local: {m}")
            torch.testing.assert_close(ours[key][3], ref[key][3], msg=lambda m: f"rank {rank} {key} full: {m}")
        assert out["factory"] == (2, 2)


# ---------------------------------------------------------------- item 6: from_local(run_check=True)
def _run_check():
    import torch.distributed as dist
    ref = _ref()
    r = dist.get_rank()
    cases = {  # name -> this rank's local tensor
        "dtype": lambda: torch.ones(2, 3, dtype=torch.float64 if r == 1 else torch.float32),
        "stride": lambda: torch.ones(3, 2).t() if r == 2 else torch.ones(2, 3),
        "requires_grad": lambda: torch.ones(2, 3, requires_grad=(r == 0)),
        "shape": lambda: torch.ones(3 if r == 0 else 2, 3),
        "ndim": lambda: torch.ones(2, 3, 1) if r == 3 else torch.ones(2, 3),
        "values": lambda: torch.full((2, 3), float(r)),              # consistent: replicas come from rank 0
        "transposed everywhere": lambda: torch.full((3, 2), float(r)).t(),
    }
    out = {}
    for name, api in (("ours", sp), ("ref", ref)):
        for mesh_shape, layouts in (((4,), ([api.Shard(0)], [api.Replicate()])),
                                    ((2, 2), ([api.Shard(0), api.Replicate()], [api.Replicate(), api.Shard(1)]))):
            mesh = api.init_device_mesh("cpu", mesh_shape)
            for case, make in cases.items():
                for i, pl in enumerate(layouts):
                    local = make()
                    kept = local.detach().clone()
                    try:
                        d = api.DTensor.from_local(local, mesh, pl, run_check=True)
                        res = ("ok", tuple(d.shape), d.stride(), d.to_local().clone(), d.full_tensor().clone(),
                               torch.equal(local.detach(), kept))
                    except Exception as e:  # noqa: BLE001 (the type is the result)
                        res = (type(e).__name__,)
                    out[name, mesh_shape, case, i] = res
    return out


def test_from_local_run_check_as_torch():
    for rank, out in enumerate(run_on_ranks(4, _run_check)):
        keys = sorted({k[1:] for k in out}, key=str)
        for key in keys:
            ours, ref = out[("ours",) + key], out[("ref",) + key]
            assert ours[0] == ref[0], (rank, key, ours[0], ref[0])
            if ours[0] == "ok":
                assert ours[1:3] == ref[1:3], (rank, key, ours[1:3], ref[1:3])  # global shape and stride
                torch.testing.assert_close(ours[3], ref[3], msg=lambda m: f"rank {rank} {key} local: {m}")
                torch.testing.assert_close(ours[4], ref[4], msg=lambda m: f"rank {rank} {key} full: {m}")
                assert ours[5], (rank, key, "the caller's tensor was changed")
        for case in ("dtype", "stride", "requires_grad", "shape", "ndim"):
            assert out[("ours", (4,), case, 0)][0] == "ValueError", (rank, case)


# ---------------------------------------------------------------- item 8: redistribute's dtypes
def _redistribute_dtypes():
    import torch.distributed as dist
    ref = _ref()
    out = {}
    full = torch.randn(8, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64).float()
    g = torch.randn(8, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64).float()
    for name, api in (("ours", sp), ("ref", ref)):
        mesh = api.init_device_mesh("cpu", (4,))
        for case, src, dst, fwd, bwd in (
                ("gather bf16", [api.Shard(0)], [api.Replicate()], torch.bfloat16, None),
                ("all-to-all bf16, grad fp16", [api.Shard(0)], [api.Shard(1)], torch.bfloat16, torch.float16),
                ("grad only fp16", [api.Shard(0)], [api.Shard(1)], None, torch.float16),
                ("same layout fp64", [api.Shard(0)], [api.Shard(0)], torch.float64, None)):
            x = api.distribute_tensor(full, mesh, src).requires_grad_()
            with sp.comm_counter() as fwd_count:
                y = x.redistribute(mesh, dst, forward_dtype=fwd, backward_dtype=bwd)
            gy = api.distribute_tensor(g, mesh, dst).to(y.dtype)
            with sp.comm_counter() as bwd_count:
                (y * gy).sum().backward()
            out[name, case] = (y.dtype, [str(p)[:1] for p in y.placements], y.full_tensor().float(),
                               x.grad.dtype, [str(p)[:1] for p in x.grad.placements], x.grad.full_tensor(),
                               fwd_count.counts, bwd_count.counts)
        # Without autograd, and a Partial summed in bf16.
        p = api.DTensor.from_local(full[:2] * (dist.get_rank() + 1), mesh, [api.Partial()])
        r = p.redistribute(mesh, [api.Replicate()], forward_dtype=torch.bfloat16)
        out[name, "partial bf16"] = (r.dtype, r.to_local().float())
    out["exact"] = full[:2] * 10  # 1 + 2 + 3 + 4 parts
    return out


def test_redistribute_forward_backward_dtype_as_torch():
    out = run_on_ranks(4, _redistribute_dtypes)[0]
    for case in ("gather bf16", "all-to-all bf16, grad fp16", "grad only fp16", "same layout fp64"):
        ours, ref = out["ours", case], out["ref", case]
        assert ours[0] == ref[0] and ours[1] == ref[1], (case, ours[:2], ref[:2])
        torch.testing.assert_close(ours[2], ref[2], msg=lambda m: f"{case} forward: {m}")
        assert ours[3] == ref[3] == torch.float32 and ours[4] == ref[4], (case, ours[3:5], ref[3:5])
        torch.testing.assert_close(ours[5], ref[5], msg=lambda m: f"{case} grad: {m}")
    # The collectives ran in the requested dtypes (bytes per element), ours counted by comm_counter:
    # rank 0 sends its (2, 6) rows forward and its (8, 2) columns of the gradient backward.
    assert out["ours", "gather bf16"][6] == {"all_gather": (1, 12 * 2)}, out["ours", "gather bf16"][6]
    assert out["ours", "all-to-all bf16, grad fp16"][6] == {"all_to_all": (1, 12 * 2)}
    assert out["ours", "all-to-all bf16, grad fp16"][7] == {"all_to_all": (1, 16 * 2)}
    assert out["ours", "grad only fp16"][6] == {"all_to_all": (1, 12 * 4)}
    assert out["ours", "grad only fp16"][7] == {"all_to_all": (1, 16 * 2)}
    ours, ref = out["ours", "partial bf16"], out["ref", "partial bf16"]
    assert ours[0] == ref[0] == torch.bfloat16
    # Summed in bf16 by both (in different orders, so to bf16's precision, not bit for bit).
    for got in (ours[1], ref[1]):
        torch.testing.assert_close(got, out["exact"], rtol=2 ** -6, atol=2 ** -6)


# ---------------------------------------------------------------- item 7: Partial("product")
def _product():
    import torch.distributed as dist
    ref = _ref()
    r = dist.get_rank()
    local = torch.linspace(0.5, 1.5, 30).reshape(5, 6) + 0.1 * r  # 5 rows: uneven over 4 ranks
    full = torch.arange(1.0, 31.0).reshape(5, 6) / 10
    out = {}
    for name, api in (("ours", sp), ("ref", ref)):
        mesh = api.init_device_mesh("cpu", (4,))
        d = api.DTensor.from_local(local, mesh, [api.Partial("product")])
        got = {"placement": [str(p) for p in d.placements]}
        for key, dst in (("R", [api.Replicate()]), ("S0", [api.Shard(0)]), ("S1", [api.Shard(1)])):
            t = d.redistribute(mesh, dst)
            got[key] = (t.to_local().clone(), t.full_tensor().clone())
        y = d.prod(0)  # prod of a product Partial: still one
        got["prod of P"] = ([str(p) for p in y.placements], y.full_tensor().clone())
        v = d.view(30)  # a view moves elements: the Partial passes
        got["view"] = ([str(p) for p in v.placements], v.full_tensor().clone())
        for dim in (0, 1):  # prod over a sharded dim: each rank's product of its chunk, then their product
            x = api.distribute_tensor(full, mesh, [api.Shard(dim)])
            p = x.prod(dim)
            got[f"prod over S({dim})"] = ([str(q) for q in p.placements], p.full_tensor().clone())
        out[name] = got
    mesh = sp.init_device_mesh("cpu", (4,))
    out["alias"] = sp.Partial("prod") == sp.Partial("product")
    # Replicate -> Partial(product): the value on index 0, ones elsewhere (torch refuses this move).
    dt = sp.distribute_tensor(full, mesh, [sp.Partial("product")])
    out["distribute"] = dt.full_tensor().clone()
    out["ones"] = sp.full((3,), 2.0, device_mesh=mesh, placements=[sp.Partial("product")]).full_tensor().clone()
    out["no grad"] = _raises(lambda: sp.DTensor.from_local(local.clone().requires_grad_(), mesh,
                                                           [sp.Partial("product")]).full_tensor().sum().backward())
    out["exact"] = full
    return out


def test_partial_product_as_torch():
    for rank, out in enumerate(run_on_ranks(4, _product)):
        ours, ref = out["ours"], out["ref"]
        assert ours["placement"] == ref["placement"] == ["P(product)"]
        for key in ("R", "S0", "S1"):
            for i, what in enumerate(("local", "full")):
                torch.testing.assert_close(ours[key][i], ref[key][i], msg=lambda m: f"rank {rank} {key} {what}: {m}")
        for key in ("prod of P", "view", "prod over S(0)", "prod over S(1)"):
            assert ours[key][0] == ref[key][0], (rank, key, ours[key][0], ref[key][0])
            torch.testing.assert_close(ours[key][1], ref[key][1], msg=lambda m: f"rank {rank} {key}: {m}")
        assert ours["prod over S(0)"][0] == ["P(product)"]  # reduced locally, no gather
        assert out["alias"]
        torch.testing.assert_close(out["distribute"], out["exact"])
        torch.testing.assert_close(out["ones"], torch.full((3,), 2.0))
        assert out["no grad"] == "RuntimeError"
