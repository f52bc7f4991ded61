"""Ops on DTensors against plain torch, with torch's OpInfo samples (tests/opinfo_harness.py).

``OPS`` is the table to extend: an op_db key (``name`` or ``name.variant_test_name``; a bare
name with several OpInfos checks them all) -> the mesh variants expected to pass. Every
(op, variant) is checked; the ones not listed as expected are still held to "no wrong
results". A few batched pool runs per variant keep this file to a few minutes.
"""
import datetime
import json
import os
import random

import pytest
import torch.distributed as dist

from tests.opinfo_harness import (ENGINES, ERROR, PASS, SKIP, VARIANTS, WRONG, Engine, check_opinfo,
                                  placement_choices, placement_combos, run_checks)
from tests.rankpool import get_pool, run_on_ranks

ALL = ("1d", "2d", "uneven", "backward")  # VARIANTS also has "inference": a sample of it below
FORWARD = ("1d", "2d", "uneven")
assert set(ALL) | {"inference"} == set(VARIANTS), "a new harness variant: decide how CI checks it"

OPS = {
    # pointwise
    "add": ALL, "sub": ALL, "mul": ALL, "div": ALL, "nn.functional.relu": ALL, "neg": ALL, "exp": ALL,
    "tanh": ALL, "sigmoid": ALL, "where": ALL, "clamp": ALL, "pow": ALL,
    # matmul
    "mm": ALL, "addmm": ALL, "bmm": ALL,
    # reductions and normalisations
    "sum": ALL, "mean": ALL, "softmax": ALL, "log_softmax": ALL, "nn.functional.layer_norm": ALL,
    # embedding
    "nn.functional.embedding": ALL,
    # views and tensor ops
    "clone": ALL, "view": ALL, "reshape": ALL, "transpose": ALL, "permute": ALL, "t": ALL, "expand": ALL,
    "squeeze": ALL, "squeeze.multiple": ALL, "unsqueeze": ALL, "flatten": ALL, "unflatten": ALL, "split": ALL,
    "split.list_args": ALL, "chunk": ALL, "unbind": ALL, "narrow": ALL, "select": ALL,
    "movedim": ALL,
    # the families the op-coverage issue names (forward where an op has no float gradient)
    "nn.functional.nll_loss": ALL, "nn.functional.cross_entropy": ALL, "nn.functional.mse_loss": ALL,
    "cumsum": ALL, "cumprod": ALL, "topk": ALL, "sort": ALL, "flip": ALL, "roll": ALL, "tril": ALL, "triu": ALL,
    "gather": ALL, "scatter": ALL, "scatter_add": ALL, "scatter_reduce.sum": ALL, "index_select": ALL,
    "index_add": ALL, "index_put": ALL, "take_along_dim": ALL, "masked_fill": ALL, "__getitem__": ALL,
    "var": ALL, "std": ALL, "logsumexp": ALL, "linalg.vector_norm": ALL, "max.reduction_with_dim": ALL,
    "argmax": FORWARD, "prod": FORWARD, "nonzero": FORWARD, "unique": FORWARD, "masked_select": ALL,
    "nn.functional.gelu": ALL, "nn.functional.silu": ALL, "nn.functional.group_norm": ALL,
    "nn.functional.conv2d": ALL, "nn.functional.max_pool2d": ALL, "constant_pad_nd": ALL, "repeat": ALL,
    "diagonal": ALL, "lerp": ALL, "addcmul": ALL, "einsum": ALL, "matmul": ALL, "nn.functional.linear": ALL,
    "stack": ALL, "cat": ALL, "zeros_like": FORWARD, "linalg.inv": ALL,
    "nn.functional.rms_norm": ALL,
    # training batch norm: global statistics on a sharded batch, running stats of any placement
    "nn.functional.batch_norm": ALL, "_batch_norm_with_update": ALL,
    # plain tensors torch's Python composites make inside the op (random test matrices), verified identical;
    # C++ composites (linalg.matrix_power(x, 0), batched matrix_rank) look like the user's own call and need
    # implicit_replication(), as with torch's DTensor (tests/test_plain_tensors.py)
    "svd_lowrank": ("1d",), "masked.var": FORWARD,
    # raw storage and resizing; a random op under OpInfo's own seed, checked against one process
    "as_strided": FORWARD, "resize_": ("1d",), "nn.functional.dropout": ("1d", "backward"),
}

# Few samples and combinations per op: enough to exercise every rule path, fast enough for CI.
CHECK_ARGS = dict(max_samples=3, max_combos=6)

_results = {}  # variant -> {op: result}


def results_for(variant):
    """Every op of OPS (of INFERENCE_OPS for "inference") checked for ``variant`` (batched pool
    runs, cached for the session)."""
    if variant not in _results:
        ops = INFERENCE_OPS if variant == "inference" else list(OPS)
        _results[variant] = run_checks(get_pool(4), ops, variant, chunk=15, **CHECK_ARGS)
    return _results[variant]


def _describe(res):
    where = f"\n  first failing combination: {res['combo']}" if res["combo"] else ""
    return (f"{res['op']} [{res['variant']}]: {res['outcome']} after {res['combos']} combinations "
            f"({res['sharded_combos']} sharded) on {res['samples']} samples: {res['detail']}{where}")


@pytest.mark.parametrize("variant", ALL)
@pytest.mark.parametrize("op", list(OPS))
def test_op_matches_torch(op, variant):
    if variant not in OPS[op]:
        pytest.skip(f"{op} is not expected to pass {variant} yet (see OPS)")
    res = results_for(variant)[op]
    if res["outcome"] == SKIP:
        pytest.skip(_describe(res))
    assert res["outcome"] == PASS, _describe(res)


# Under torch.inference_mode() CompositeImplicitAutograd ops reach the engine whole (in grad mode
# and no_grad torch decomposes them first). A modest sample for CI: ops of OPS that are composite
# (decomposed by shardprop as torch would, or served by a rule of their own), and a few that are not.
# `make sweep` runs every op_db entry in this mode.
INFERENCE_OPS = [
    "nn.functional.linear", "matmul", "einsum", "nn.functional.layer_norm", "nn.functional.group_norm",
    "nn.functional.rms_norm", "nn.functional.cross_entropy", "nn.functional.nll_loss", "softmax",
    "log_softmax", "nn.functional.conv2d", "nn.functional.max_pool2d", "nn.functional.gelu",
    "flatten", "unflatten", "reshape", "movedim", "chunk", "narrow", "split.list_args", "var", "std",
    "where", "__getitem__", "index_put", "masked_fill", "mm", "sum", "add", "nn.functional.embedding",
]


@pytest.mark.parametrize("op", INFERENCE_OPS)
def test_op_matches_torch_in_inference_mode(op):
    res = results_for("inference")[op]
    if res["outcome"] == SKIP:
        pytest.skip(_describe(res))
    assert res["outcome"] == PASS, _describe(res)


@pytest.mark.parametrize("variant", ALL + ("inference",))
def test_no_wrong_results(variant):
    # A missing rule raises; a wrong rule silently corrupts training: never acceptable.
    wrong = [_describe(r) for r in results_for(variant).values() if r["outcome"] == WRONG]
    assert not wrong, "\n".join(wrong)


# ---------------------------------------------------------------- the harness itself
def test_placement_choices():
    assert placement_choices((8, 5, 0), "1d") == [("R",), ("S0",)]
    assert placement_choices((8, 5, 0), "uneven") == [("R",), ("S1",)]
    assert placement_choices((4, 6), "2d") == [
        ("R", "R"), ("S0", "R"), ("S1", "R"), ("R", "S0"), ("R", "S1"), ("S0", "S1"), ("S1", "S0"), ("S0", "S0")]
    assert placement_choices((), "2d") == [("R", "R")]


def test_placement_combos():
    choices = [placement_choices(s, "2d") for s in [(4, 6), (6,), (2, 4, 6)]]
    combos = placement_combos(choices, "2d", 8, random.Random(0))
    assert combos == placement_combos(choices, "2d", 8, random.Random(0)), "not deterministic"
    assert len(combos) == 8 and len(set(combos)) == 8, combos
    assert combos[0] == (("R", "R"),) * 3, "all-Replicate comes first"
    assert all(c in cs for combo in combos for c, cs in zip(combo, choices)), combos
    uneven = placement_combos([placement_choices((5, 3), "uneven")], "uneven", 8, random.Random(0))
    assert uneven == [(("S0",),), (("S1",),)], "uneven checks shards only"


def _lossy_engine(base: Engine, kind: str) -> Engine:
    """An engine that breaks sharded results: off by one ("wrong") or raising ("error")."""

    def full_tensor(x):
        sharded = any(p.is_shard() for p in x.placements)
        if sharded and kind == "error":
            raise RuntimeError("lossy engine: refuses sharded tensors")
        return base.full_tensor(x) + (1.0 if sharded else 0.0)

    return base._replace(name=f"lossy-{kind}", full_tensor=full_tensor)


def _check_with_lossy_engine(op, variant, kind):
    name = f"lossy-{kind}"
    ENGINES[name] = lambda: _lossy_engine(ENGINES["shardprop"](), kind)
    return check_opinfo(op, variant, name, **CHECK_ARGS)


def _check_with_rank_seed(op, variant):
    return check_opinfo(op, variant, seed=dist.get_rank(), **CHECK_ARGS)


@pytest.mark.parametrize("kind, outcome", [("wrong", WRONG), ("error", ERROR)])
def test_harness_reports_broken_engine(kind, outcome):
    res = run_on_ranks(4, _check_with_lossy_engine, "mul", "1d", kind)
    assert [r["outcome"] for r in res] == [outcome] * 4, _describe(res[0])
    assert res[0]["combo"] and "S" in res[0]["combo"], res[0]
    assert not res[0]["desync"], res[0]


def test_harness_random_ops_under_their_own_seed_are_checked():
    # empty_like reads uninitialized memory: no single right answer, skipped. rand_like draws under
    # OpInfo's own seed (the same result for any outer seed): checked against one process, and
    # shardprop's random ops reproduce it.
    res = run_checks(get_pool(4), ["empty_like", "new_empty", "rand_like"], "1d", **CHECK_ARGS)
    assert [r["outcome"] for r in res.values()] == [SKIP, SKIP, PASS], res
    # which check sees it first (between ranks or between runs) depends on the allocator: either skips
    assert "random or uninitialized memory" in res["empty_like"]["detail"], res["empty_like"]


def test_harness_reports_nondeterministic_samples():
    res = run_on_ranks(4, _check_with_rank_seed, "mul", "1d")
    assert [r["outcome"] for r in res] == [SKIP] * 4, res[0]
    assert "nondeterministic samples" in res[0]["detail"], res[0]


# ---------------------------------------------------------------- regression over the sweep's list
# tests/passing_ops.json holds every op the full sweep (bench/op_sweep.py --write-passing) saw
# pass. All of them do not fit the CI budget, so each run checks a sample that rotates daily;
# SHARDPROP_OPINFO_SEED=<n> replays a given day's sample, SHARDPROP_OPINFO_SAMPLE=<k> resizes it.
PASSING_PATH = os.path.join(os.path.dirname(__file__), "passing_ops.json")
SAMPLE_SIZE = int(os.environ.get("SHARDPROP_OPINFO_SAMPLE", "20"))  # a new sample every day (seed)
SAMPLE_SEED = int(os.environ.get("SHARDPROP_OPINFO_SEED", datetime.date.today().toordinal()))


def passing_sample(variant: str) -> list:
    """The ops of passing_ops.json checked for ``variant`` in this run (not already in OPS)."""
    with open(PASSING_PATH) as f:
        listed = sorted(set(json.load(f).get(variant, [])) - set(OPS))
    rng = random.Random(f"{SAMPLE_SEED}-{variant}")
    return sorted(rng.sample(listed, min(SAMPLE_SIZE, len(listed))))


@pytest.mark.parametrize("variant", ALL)
def test_passing_ops_do_not_regress(variant):
    ops = passing_sample(variant)
    assert ops, f"tests/passing_ops.json lists no ops for {variant}"
    results = run_checks(get_pool(4), ops, variant, chunk=15, **CHECK_ARGS)
    broken = [_describe(r) for r in results.values() if r["outcome"] not in (PASS, SKIP)]
    assert not broken, (f"{len(broken)} of {len(ops)} sampled passing ops regressed "
                        f"(replay with SHARDPROP_OPINFO_SEED={SAMPLE_SEED}):\n" + "\n".join(broken))
