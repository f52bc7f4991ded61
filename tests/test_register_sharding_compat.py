"""register_sharding as torch's (issue 30, item 4), side by side with torch's on the same gloo ranks.

The same rule, written to torch's contract (``(output_placements, input_placements)`` pairs,
one input entry per argument with None for non-tensor ones), is registered with torch's
``register_sharding`` and with ``shardprop.experimental.register_sharding``; every call must
give the same values and placements, and the rule must see the same arguments:

- (a) a custom op whose first argument is a ``str``;
- (b) an op with tensor keyword arguments: ``aten.min.dim_min``'s ``min=``/``min_indices=``
  (written by the op) and a custom op with a keyword-only tensor; bools reach the rule as
  bools (``argmax``'s ``keepdim``);
- (c) ``check_sharding_rule`` on (a) and (b): a right rule passes, a wrong one is flagged.

shardprop's own ``register_sharding`` (top level, ``(inputs, outputs)``) takes the per-argument
form too, and a rule in torch's order given to it is an error, not a silent misplacement.
"""
from contextlib import contextmanager
from types import SimpleNamespace

import torch

import shardprop as sp
from tests.rankpool import run_on_ranks

aten = torch.ops.aten


# Custom ops, defined once per process (here, and in each rank when it imports this module).
@torch.library.custom_op("sprs_compat::tag", mutates_args=())
def _tag(name: str, x: torch.Tensor) -> torch.Tensor:
    return x.relu() + len(name)  # not linear: a rule claiming Partial is wrong


@_tag.register_fake
def _(name, x):
    return torch.empty_like(x)


# custom_op refuses keyword-only tensors; the lower-level Library API defines one.
_LIB = torch.library.Library("sprs_compat", "FRAGMENT")
_LIB.define("mul_kw(Tensor x, *, Tensor w) -> Tensor")
_LIB.impl("mul_kw", lambda x, *, w: x * w, "CPU")
_LIB.impl("mul_kw", lambda x, *, w: torch.empty_like(x), "Meta")


TAG = torch.ops.sprs_compat.tag.default
MUL_KW = torch.ops.sprs_compat.mul_kw.default
_MISSING = object()


def _apis():
    """(name, namespace) for torch's DTensor (the reference) and shardprop's."""
    import torch.distributed.tensor as T
    from torch.distributed.device_mesh import init_device_mesh
    ref = SimpleNamespace(name="ref", init_device_mesh=init_device_mesh, distribute_tensor=T.distribute_tensor,
                          R=T.Replicate, S=T.Shard, P=T.Partial, rule=_torch_rule)
    ours = SimpleNamespace(name="ours", init_device_mesh=sp.init_device_mesh, distribute_tensor=sp.distribute_tensor,
                           R=sp.Replicate, S=sp.Shard, P=sp.Partial, rule=_our_rule)
    return ref, ours


@contextmanager
def _torch_rule(op, fn):
    """torch's register_sharding for the block only: the rank pool outlives this test."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental import register_sharding
    prop = DTensor._op_dispatcher.sharding_propagator
    tables = [getattr(prop, n) for n in ("op_strategy_funcs", "op_to_schema_info", "op_single_dim_strategy_funcs",
                                         "op_to_schema_info_for_single_dim_strategy") if hasattr(prop, n)]
    saved = [t.get(op, _MISSING) for t in tables]
    for t in tables[2:]:  # a single-dim strategy would be consulted before the registered one
        t.pop(op, None)
    register_sharding(op)(fn)
    prop.propagate_op_sharding.cache_clear()
    try:
        yield
    finally:
        for t, v in zip(tables, saved):
            if v is _MISSING:
                t.pop(op, None)
            else:
                t[op] = v
        prop.propagate_op_sharding.cache_clear()


@contextmanager
def _our_rule(op, fn):
    from shardprop.experimental import register_sharding
    register_sharding(op)(fn)
    try:
        yield
    finally:
        sp.unregister_sharding(op)


@contextmanager
def _our_rule_top_level(op, fn):
    sp.register_sharding(op)(fn)
    try:
        yield
    finally:
        sp.unregister_sharding(op)


def _pl(placements):
    """Placements as plain strings, the same for both libraries."""
    out = []
    for p in placements:
        if p.is_replicate():
            out.append("R")
        elif p.is_shard():
            out.append(f"S({p.dim})")
        else:
            out.append(f"P({p.reduce_op})")
    return tuple(out)


def _kind(v):
    """What a rule argument is, the same for both libraries (both spec classes are DTensorSpec)."""
    return type(v).__name__ if not isinstance(v, (str, int)) else f"{type(v).__name__}:{v!r}"


def _raises(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 (the message is the result)
        return f"{type(e).__name__}: {e}"
    return None


# ---------------------------------------------------------------- (a) a leading str argument
def _tag_rule(api, seen):
    def tag_rule(name, x):
        seen.append((_kind(name), _kind(x)))
        return [([api.R()], [None, api.R()]), ([api.S(0)], [None, api.S(0)])]
    return tag_rule


def _leading_str():
    out = {}
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(1))
    for api in _apis():
        mesh = api.init_device_mesh("cpu", (4,))
        seen = []
        with api.rule(TAG, _tag_rule(api, seen)):
            for pl in ([api.R()], [api.S(0)], [api.S(1)]):
                try:
                    y = TAG("abc", api.distribute_tensor(x, mesh, pl))
                except (ValueError, RuntimeError) as e:  # torch 2.11's register_sharding finds no mesh past a leading str
                    assert api.name == "ref" and "Cannot find device mesh" in str(e), e
                    out[api.name, _pl(pl)] = None
                    continue
                out[api.name, _pl(pl)] = (_pl(y.placements), y.full_tensor())
        out[api.name, "seen"] = seen[0] if seen else None
    # shardprop's own API: (inputs, outputs), inputs per argument with None for the str.
    mesh = sp.init_device_mesh("cpu", (4,))
    R, S = sp.Replicate, sp.Shard
    with _our_rule_top_level(TAG, lambda name, x: [([None, R()], [R()]), ([None, S(0)], [S(0)])]):
        y = TAG("abc", sp.distribute_tensor(x, mesh, [S(0)]))
        out["top level"] = (_pl(y.placements), y.full_tensor())
    # torch's order given to the top-level API: an error that names the order (was: output placed as None).
    with _our_rule_top_level(TAG, lambda name, x: [([R()], [None, R()])]):
        out["swapped"] = _raises(lambda: TAG("abc", sp.distribute_tensor(x, mesh, [R()])))
    # A non-tensor argument given a placement: named in the error.
    with _our_rule_top_level(TAG, lambda name, x: [([R(), R()], [R()])]):
        out["misaligned"] = _raises(lambda: TAG("abc", sp.distribute_tensor(x, mesh, [R()])))
    out["expected"] = x.relu() + 3
    return out


def test_leading_str_argument_as_torch():
    out = run_on_ranks(4, _leading_str)[0]
    torch_runs_it = out["ref", ("R",)] is not None  # not on torch 2.11 (no mesh found past the str)
    for pl in (("R",), ("S(0)",), ("S(1)",)):
        ref, ours = out["ref", pl], out["ours", pl]
        assert torch.equal(ours[1], out["expected"]), pl
        if torch_runs_it:
            # From S(1) the rule offers R (all-gather) and S(0) (all-to-all): torch's cost model takes the
            # all-gather, shardprop's the all-to-all (fewer bytes per rank), for every op, not only user rules.
            assert ours[0] == ref[0] or pl == ("S(1)",), (pl, ours[0], ref[0])
            assert torch.equal(ours[1], ref[1]), pl
    if torch_runs_it:
        assert out["ref", ("S(1)",)][0] == ("R",) and out["ref", "seen"] == ("str:'abc'", "DTensorSpec")
    assert out["ours", ("S(1)",)][0] == ("S(0)",)
    assert out["ours", ("S(0)",)][0] == ("S(0)",)  # the sharded option is taken, not a gather
    assert out["ours", "seen"] == ("str:'abc'", "DTensorSpec"), out["ours", "seen"]
    assert out["top level"][0] == ("S(0)",) and torch.equal(out["top level"][1], out["expected"])
    assert out["swapped"] and "ShardingError" in out["swapped"] and "(inputs, outputs)" in out["swapped"]
    assert out["misaligned"] and "'name' is not a DTensor" in out["misaligned"], out["misaligned"]


# ---------------------------------------------------------------- (b) tensor keyword arguments
def _min_rule(api, seen):
    def min_dim_strategy(x, dim, keepdim, min, min_indices):
        seen.append((_kind(x), _kind(dim), _kind(keepdim), _kind(min), _kind(min_indices)))
        options = [([api.R(), api.R()], [api.R(), None, None, api.R(), api.R()])]
        if dim != 0:
            options.append(([api.S(0), api.S(0)], [api.S(0), None, None, api.S(0), api.S(0)]))
        return options
    return min_dim_strategy


def _mul_kw_rule(api, seen):
    def mul_kw_rule(x, *, w):
        seen.append((_kind(x), _kind(w)))
        return [([api.R()], [api.R(), api.R()]), ([api.S(0)], [api.S(0), api.S(0)])]
    return mul_kw_rule


def _argmax_rule(api):
    def argmax_rule(x, dim=None, keepdim=False):  # torch's own test: shards only when keepdim
        options = [([api.R()], [api.R(), None, None])]
        if keepdim:
            options += [([api.S(d)], [api.S(d), None, None]) for d in range(x.ndim) if d != dim]
        return options
    return argmax_rule


def _tensor_kwargs():
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(8, 6, generator=gen), torch.randn(8, 6, generator=gen)
    out = {}
    for api in _apis():
        mesh = api.init_device_mesh("cpu", (4,))
        dist = lambda t, p: api.distribute_tensor(t, mesh, [p])  # noqa: E731
        seen = []
        with api.rule(aten.min.dim_min, _min_rule(api, seen)):
            for p in (api.R(), api.S(0)):
                v, i = dist(torch.zeros(8, 1), p), dist(torch.zeros(8, 1, dtype=torch.long), p)
                res = torch.min(dist(x, p), dim=1, keepdim=True, out=(v, i))
                out[api.name, "min", _pl([p])] = (_pl(res[0].placements), _pl(res[1].placements),
                                                  res[0].full_tensor(), res[1].full_tensor(),
                                                  res[0] is v and res[1] is i, _pl(v.placements))
        out[api.name, "min seen"] = seen[0]
        seen = []
        with api.rule(MUL_KW, _mul_kw_rule(api, seen)):
            for px, pw in ((api.S(0), api.S(0)), (api.R(), api.R()), (api.R(), api.S(0))):
                try:
                    y = MUL_KW(dist(x, px), w=dist(w, pw))
                    out[api.name, "mul_kw", _pl([px, pw])] = (_pl(y.placements), y.full_tensor())
                except RuntimeError as e:  # torch 2.13 runs a keyword tensor unredistributed (R, S(0))
                    out[api.name, "mul_kw", _pl([px, pw])] = f"{type(e).__name__}: {e}"
        out[api.name, "mul_kw seen"] = seen[0]
        with api.rule(aten.argmax.default, _argmax_rule(api)):
            for keepdim in (False, True):
                y = torch.argmax(dist(x, api.S(0)), dim=1, keepdim=keepdim)
                out[api.name, "argmax", keepdim] = (_pl(y.placements), y.full_tensor())
    out["expected"] = {"min": torch.min(x, dim=1, keepdim=True), "mul_kw": x * w,
                       "argmax": {k: torch.argmax(x, dim=1, keepdim=k) for k in (False, True)}}
    return out


def test_tensor_kwargs_as_torch():
    out = run_on_ranks(4, _tensor_kwargs)[0]
    exp = out["expected"]
    for pl in (("R",), ("S(0)",)):
        ref, ours = out["ref", "min", pl], out["ours", "min", pl]
        assert ours[:2] == ref[:2] == (pl, pl), (pl, ours[:2], ref[:2])
        assert torch.equal(ours[2], exp["min"].values) and torch.equal(ours[3], exp["min"].indices), pl
        assert torch.equal(ref[2], ours[2]) and torch.equal(ref[3], ours[3]), pl
        assert ours[4] == ref[4] and ours[5] == ref[5], (pl, ours[4:], ref[4:])  # out= written, returned
    # The rule got the out= tensors' specs by keyword, and keepdim as a bool.
    assert out["ours", "min seen"] == out["ref", "min seen"] == (
        "DTensorSpec", "int:1", "bool:True", "DTensorSpec", "DTensorSpec"), (out["ours", "min seen"], out["ref", "min seen"])
    for pls in (("S(0)", "S(0)"), ("R", "R"), ("R", "S(0)")):
        ref, ours = out["ref", "mul_kw", pls], out["ours", "mul_kw", pls]
        assert not isinstance(ours, str), (pls, ours)
        assert torch.allclose(ours[1], exp["mul_kw"]), pls
        # Where the keyword tensor must move, torch 2.13 passes it unmoved and the kernel fails on
        # mismatched shards; shardprop moves it as any input. Compared wherever torch gives a result.
        if not isinstance(ref, str) or pls != ("R", "S(0)"):
            assert ours[0] == ref[0] and torch.allclose(ref[1], ours[1]), (pls, ours, ref)
    assert out["ours", "mul_kw seen"] == out["ref", "mul_kw seen"] == ("DTensorSpec", "DTensorSpec")
    for keepdim in (False, True):
        ref, ours = out["ref", "argmax", keepdim], out["ours", "argmax", keepdim]
        assert ours[0] == ref[0], (keepdim, ours[0], ref[0])
        assert torch.equal(ours[1], exp["argmax"][keepdim]), keepdim
    assert out["ours", "argmax", False][0] == ("R",) and out["ours", "argmax", True][0] == ("S(0)",)


# ---------------------------------------------------------------- (c) the rule checker on both
def _report(r):
    return {"ok": r.ok, "text": str(r), "incorrect": [str(f) for f in r.incorrect],
            "messages": [f.message for f in r.incorrect], "accepted": [str(f) for f in r.accepted],
            "errors": [f"{f.inputs}: {f.message}" for f in r.errors]}


def _checks():
    from shardprop.debug.check_rule import check_sharding_rule
    from shardprop.experimental import register_sharding
    R, S, P = sp.Replicate, sp.Shard, sp.Partial
    mesh = sp.init_device_mesh("cpu", (4,))
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(7, 8, generator=gen)  # 7 rows: uneven over 4 ranks on purpose
    out = {}

    def check(op, rule, *args, **kwargs):
        register_sharding(op)(rule)
        try:
            return _report(check_sharding_rule(op, *args, mesh=mesh, **kwargs))
        finally:
            sp.unregister_sharding(op)

    good_tag = lambda name, x: [([R()], [None, R()]), ([S(0)], [None, S(0)]), ([S(1)], [None, S(1)])]  # noqa: E731
    wrong_tag = lambda name, x: good_tag(name, x) + [([P("sum")], [None, P("sum")])]  # noqa: E731
    out["tag good"] = check(TAG, good_tag, "abc", x)
    out["tag wrong"] = check(TAG, wrong_tag, "abc", x)

    def good_min(x, dim, keepdim, min, min_indices):
        return [([R(), R()], [R(), None, None, R(), R()]),
                ([S(0), S(0)], [S(0), None, None, S(0), S(0)])]

    def wrong_min(x, dim, keepdim, min, min_indices):  # min of local mins is right, local indices are not
        return good_min(x, dim, keepdim, min, min_indices) + [
            ([P("min"), P("min")], [S(1), None, None, P("min"), P("min")])]

    targets = dict(min=torch.empty(7, 1), min_indices=torch.empty(7, 1, dtype=torch.long))
    out["min good"] = check(aten.min.dim_min, good_min, x, 1, True, **targets)
    out["min wrong"] = check(aten.min.dim_min, wrong_min, x, 1, True, **targets)
    return out


def test_check_sharding_rule_covers_both():
    out = run_on_ranks(4, _checks)[0]
    good, wrong = out["tag good"], out["tag wrong"]
    assert good["ok"] and not good["errors"], good["text"]
    assert "(S(0),) -> S(0)" in good["accepted"] and "(S(1),) -> S(1)" in good["accepted"], good["text"]
    assert not wrong["ok"] and wrong["incorrect"] == ["(P(sum),) -> P(sum)"], wrong["text"]
    good, wrong = out["min good"], out["min wrong"]
    assert good["ok"] and not good["errors"], good["text"]
    assert "(S(0),) -> (S(0), S(0))" in good["accepted"], good["text"]
    assert "(R,) -> (R, R)" in good["accepted"], good["text"]
    assert not wrong["ok"] and wrong["incorrect"] == ["(S(1),) -> (P(min), P(min))"], wrong["text"]
    assert wrong["messages"] == ["output 1 is wrong as P(min)"], wrong["text"]  # the values are right
