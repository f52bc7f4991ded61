"""Placements made by torch's classes are accepted wherever ours are.

Programs written for torch (torchtitan, and packages such as ``spmd_types`` that hand out torch's
placement objects) pass ``torch.distributed.tensor.Shard(0)`` and friends to our API. Each entry point
takes them by duck typing and computes what it computes with ours: ``distribute_tensor``,
``redistribute``, ``from_local``, ``to_local(grad_placements=...)``, the TP styles' layouts (also
``PrepareModuleInput``'s keyword layouts) and ``fully_shard``'s ``shard_placement_fn``. A torch
``_StridedShard`` becomes ours, never a plain shard (it is another layout), and an object that is no
placement still raises, naming itself.
"""
import pytest
import torch

from tests.rankpool import run_on_ranks


def _with_torch_placements():
    import torch.distributed.tensor as T
    import shardprop as P
    mesh = P.init_device_mesh("cpu", (2,))
    full = torch.arange(24.0).reshape(4, 6)
    got = {}
    x = P.distribute_tensor(full, mesh, [T.Shard(1)])
    got["distribute"] = (x.placements == (P.Shard(1),), torch.equal(x.full_tensor(), full))
    y = x.redistribute(mesh, [T.Replicate()])
    got["redistribute"] = (y.placements == (P.Replicate(),), torch.equal(y.to_local(), full))
    z = P.DTensor.from_local(torch.ones(3), mesh, [T.Partial()])
    got["from_local"] = (z.placements == (P.Partial(),), float(z.full_tensor().sum()))
    w = P.distribute_tensor(full, mesh, [T.Replicate()]).requires_grad_()
    w.to_local(grad_placements=[T.Partial()]).sum().backward()
    got["grad_placements"] = (w.grad.placements, float(w.grad.full_tensor().sum()))
    torch.manual_seed(0)  # the same weights on every rank (the style takes rank 0's)
    lin = torch.nn.Linear(6, 4)
    ref = lin(full)
    P.parallelize_module(lin, mesh, P.ColwiseParallel(input_layouts=T.Shard(0), output_layouts=T.Replicate()))
    me = torch.distributed.get_rank()
    got["style"] = torch.allclose(lin(full.chunk(2)[me]), ref)
    prep = P.PrepareModuleInput(input_kwarg_layouts={"h": T.Shard(0)}, desired_input_kwarg_layouts={"h": T.Replicate()})
    got["kwarg_layouts"] = (prep.input_kwarg_layouts["h"], prep.desired_input_kwarg_layouts["h"])
    block = torch.nn.Linear(6, 6)
    P.fully_shard(block, mesh=mesh, shard_placement_fn=lambda p: T.Shard(p.ndim - 1) if p.ndim == 2 else None)
    got["shard_placement_fn"] = block.weight.placements
    try:
        P.distribute_tensor(full, mesh, ["S(0)"])
        got["not_a_placement"] = None
    except TypeError as e:
        got["not_a_placement"] = str(e)
    strided = getattr(__import__("torch.distributed.tensor.placement_types", fromlist=["_"]), "_StridedShard", None)
    if strided is not None:
        from shardprop.tensor.placement import as_placement
        got["strided"] = as_placement(strided(0, split_factor=2))
    return got


def test_torch_placements_are_taken_as_ours():
    for got in run_on_ranks(2, _with_torch_placements):
        assert got["distribute"] == (True, True)
        assert got["redistribute"] == (True, True)
        assert got["from_local"] == (True, 6.0)  # two ranks' partial ones summed
        # the gradient taken as a partial sum, as torch's Partial says: both ranks' ones summed
        assert repr(got["grad_placements"]) == "((P(sum),), 48.0)"
        assert got["style"] is True
        assert repr(got["kwarg_layouts"]) == "(S(0), R)"
        assert repr(got["shard_placement_fn"]) == "(S(1),)"
        assert "'S(0)' is not a placement" in got["not_a_placement"]
        if "strided" in got:  # ours, same dim and factor: another layout, never relabelled a plain shard
            assert repr(got["strided"]) == "_S(0, sf=2)"
