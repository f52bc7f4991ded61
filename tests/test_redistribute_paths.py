"""The faster redistribution paths: point-to-point permutations and handed-over temporaries.

- point to point (``permute.py``): every transition that can take it, on 2x2 and 1-d meshes of 4
  real gloo ranks, even and uneven shapes: values equal the shard ``torch.chunk`` cuts, the input
  is never modified, gradients flow back through it, ``comm_counter`` and ``explain`` see it;
- the planner takes it for permutations and keeps the collectives where they move less;
- temporaries (``(a @ b).redistribute(...)``) all-reduce in place, while every tensor somebody
  still holds (the DTensor, its local tensor, a view of it, a result autograd saved) is left alone;
- cost model honesty: for each bench transition the cheaper-priced plan also moves no more bytes
  than the other (deterministic), and is not measurably slower (timing, slow).
"""
import statistics
import time

import pytest
import torch
import torch.distributed as dist

from tests.rankpool import run_on_ranks


def _pl(codes):
    from shardprop import Partial, Replicate, Shard
    return tuple(Replicate() if c == "R" else Partial() if c == "P" else Shard(int(c[1:])) for c in codes)


def _chunk(full, mesh_shape, coord, placements):
    """This coordinate's shard cut with torch.chunk, outermost mesh dim first (no shardprop involved)."""
    from shardprop import Shard
    out = full
    for m, p in enumerate(placements):
        if type(p) is Shard:
            pieces = torch.chunk(out, mesh_shape[m], dim=p.dim) if out.shape[p.dim] else ()
            out = pieces[coord[m]] if coord[m] < len(pieces) else out.narrow(p.dim, out.shape[p.dim], 0)
    return out


def _full(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- point to point: values, input, autograd
P2P_2X2 = [("S0", "R"), ("R", "S0")], [("S0", "S1"), ("S1", "S0")], [("S0", "S0"), ("S0", "S1")], \
    [("S1", "R"), ("R", "S1")], [("S0", "R"), ("S1", "R")], [("S0", "S1"), ("R", "S0")], \
    [("S1", "S0"), ("S0", "S0")], [("S0", "S0"), ("S1", "S1")]
P2P_1D = [("S0",), ("S1",)], [("S1",), ("S0",)], [("S0",), ("R",)], [("R",), ("S1",)]
SHAPES = [(8, 12), (5, 3), (7, 9), (2, 3), (4, 1)]


def _p2p_values(mesh_shape, cases, shapes):
    """Rank side: run every case through the point-to-point path itself, forward and backward."""
    from shardprop import DTensor, init_device_mesh
    from shardprop.tensor import permute
    from shardprop.tensor.spec import DTensorSpec  # noqa: F401  (the spec type run_p2p reads)

    mesh = init_device_mesh("cpu", mesh_shape)
    coord = mesh.get_coordinate()
    errors = []
    for shape in shapes:
        full, g_full = _full(shape, 1), _full(shape, 2)
        for src_c, dst_c in cases:
            src, dst = _pl(src_c), _pl(dst_c)
            what = f"{mesh_shape} {shape} {src_c}->{dst_c}"
            mine = _chunk(full, mesh.shape, coord, src).clone()
            before = mine.clone()
            x = DTensor.from_local(mine, mesh, src, shape=shape)
            # the path itself (the planner may prefer a collective for some of these)
            for async_op in (False, True):
                got = permute.run_p2p(mine, x._spec, src, dst, False, async_op)
                got = got.wait() if async_op else got
                if not torch.equal(got, _chunk(full, mesh.shape, coord, dst)):
                    errors.append(f"{what} async={async_op}: wrong shard")
            if not torch.equal(mine, before):
                errors.append(f"{what}: the input changed")
            # through redistribute (whatever plan it picks) with autograd
            leaf = mine.clone().requires_grad_(True)
            y = DTensor.from_local(leaf, mesh, src, shape=shape).redistribute(placements=dst)
            (y.to_local() * _chunk(g_full, mesh.shape, coord, dst)).sum().backward()
            if not torch.equal(y.to_local().detach(), _chunk(full, mesh.shape, coord, dst)):
                errors.append(f"{what}: redistribute gave a wrong shard")
            if leaf.grad is None or not torch.equal(leaf.grad, _chunk(g_full, mesh.shape, coord, src)):
                errors.append(f"{what}: wrong gradient")
    return errors


@pytest.mark.parametrize("mesh_shape,cases", [((2, 2), P2P_2X2), ((4,), P2P_1D)], ids=["2x2", "1d"])
def test_p2p_values_input_and_gradients(mesh_shape, cases):
    for rank, errors in enumerate(run_on_ranks(4, _p2p_values, mesh_shape, cases, SHAPES)):
        assert not errors, f"rank {rank}: " + "; ".join(errors[:8])


# ---------------------------------------------------------------- the planner's choice, counted and explained
PICKS = [  # (mesh, shape, src, dst, expected plan kinds)
    ((2, 2), (64, 64), ("S0", "R"), ("R", "S0"), ["p2p"]),
    ((2, 2), (64, 64), ("S0", "S1"), ("S1", "S0"), ["p2p"]),
    ((2, 2), (64, 64), ("S0", "S0"), ("S0", "S1"), ["p2p"]),
    ((2, 2), (65, 63), ("S0", "S1"), ("S1", "S0"), ["p2p"]),
    ((2, 2), (64, 64), ("S0", "S1"), ("R", "R"), ["all_gather"]),
    ((4,), (64, 64), ("S0",), ("R",), ["all_gather"]),
    ((4,), (64, 64), ("S0",), ("S1",), ["all_to_all"]),
    ((2, 2), (64, 64), ("P", "R"), ("R", "R"), ["all_reduce"]),
]


def _pick(mesh_shape, shape, src_c, dst_c):
    import shardprop
    from shardprop import comm_counter, distribute_tensor, init_device_mesh, plan_redistribute
    from shardprop.tensor import permute

    mesh = init_device_mesh("cpu", mesh_shape)
    src, dst = _pl(src_c), _pl(dst_c)
    full = _full(shape, 3)
    x = distribute_tensor(full, mesh, [p if type(p).__name__ != "Partial" else _pl("R")[0] for p in src])
    if "P" in src_c:  # a real Partial: local values that sum to full
        x = shardprop.DTensor.from_local(x.to_local() / 2, mesh, src, shape=shape)
    kinds = [s.kind for s in plan_redistribute(x._spec, dst).steps]
    with comm_counter() as c:
        y = x.redistribute(placements=dst)
    ok = torch.allclose(y.to_local(), _chunk(full, mesh.shape, mesh.get_coordinate(), dst), atol=1e-6)
    with shardprop.explain() as ex:  # one input must move to the other's layout: the op's implicit redistribution
        torch.add(x, y)
    expected = None
    if kinds == ["p2p"]:
        sent, recv = permute.moved_bytes_per_rank(shape, mesh, src, dst, 4)[dist.get_rank()]
        expected = (sent, recv)
    return kinds, dict(c.counts), ok, expected, str(ex)


@pytest.mark.parametrize("mesh_shape,shape,src,dst,kinds", PICKS)
def test_planner_picks_and_counts(mesh_shape, shape, src, dst, kinds):
    for rank, (got, counts, ok, expected, _) in enumerate(run_on_ranks(4, _pick, mesh_shape, shape, src, dst)):
        assert got == kinds, f"rank {rank}: plan {got}, expected {kinds}"
        assert ok, f"rank {rank}: wrong shard"
        if expected is not None:
            sent, recv = expected
            assert counts.get("send", (0, 0))[1] == sent and counts.get("recv", (0, 0))[1] == recv, \
                f"rank {rank}: counted {counts}, moved (sent, received) {expected}"
            assert sent + recv > 0 or rank in (0, 3), f"rank {rank}: nothing moved"
        else:
            assert set(counts) == set(kinds), f"rank {rank}: counted {counts}"


def test_explain_shows_p2p():
    _, _, _, _, text = run_on_ranks(4, _pick, (2, 2), (64, 64), ("S0", "R"), ("R", "S0"))[1]
    assert "p2p" in text, text


# ---------------------------------------------------------------- temporaries: in place, and never what someone holds
def _temporaries():
    import shardprop.mesh.collectives as C
    from shardprop import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (4,))
    rank = dist.get_rank()
    R, P = [Replicate()], [Partial()]
    addend = _full((6, 5), 10 + rank)
    total = sum(_full((6, 5), 10 + r) for r in range(4))
    a = DTensor.from_local(addend.clone(), mesh, P)
    inplace = []
    real = C.all_reduce

    def spy(*args, **kwargs):
        inplace.append(kwargs.get("inplace", False))
        return real(*args, **kwargs)

    out = {}
    C.all_reduce = spy
    try:
        # 1. a temporary: reduced in place, right value, `a` untouched
        y = (a * 2).redistribute(placements=R)
        out["temp"] = (inplace[-1], torch.allclose(y.to_local(), 2 * total, atol=1e-5), torch.equal(a.to_local(), addend))
        # 2. held by a name: copied
        held = a * 2
        before = held.to_local().clone()
        y = held.redistribute(placements=R)
        out["held"] = (inplace[-1], torch.allclose(y.to_local(), 2 * total, atol=1e-5), torch.equal(held.to_local(), before))
        # 3. held in a container
        box = [a * 2]
        before = box[0].to_local().clone()
        y = box[0].redistribute(placements=R)
        out["container"] = (inplace[-1], torch.allclose(y.to_local(), 2 * total, atol=1e-5),
                            torch.equal(box[0].to_local(), before))
        # 4. the user keeps the local tensor of a fresh DTensor
        keep = []

        def make():
            t = a * 2
            keep.append(t.to_local())
            return t
        y = make().redistribute(placements=R)
        out["local_kept"] = (inplace[-1], torch.allclose(y.to_local(), 2 * total, atol=1e-5),
                             torch.allclose(keep[0], 2 * addend))
        # 5. a view of the local tensor survives
        views = []

        def make_view():
            t = a * 2
            views.append(t.to_local()[1:])
            return t
        y = make_view().redistribute(placements=R)
        out["view_kept"] = (inplace[-1], torch.allclose(y.to_local(), 2 * total, atol=1e-5),
                            torch.allclose(views[0], 2 * addend[1:]))
        # 6. from_local of the user's tensor: never written
        mine = addend.clone()
        y = DTensor.from_local(mine, mesh, P).redistribute(placements=R)
        out["from_local"] = (inplace[-1], torch.allclose(y.to_local(), total, atol=1e-5), torch.equal(mine, addend))
        # 7. full_tensor of a temporary
        f = (a * 2).full_tensor()
        out["full_tensor"] = (inplace[-1], torch.allclose(f, 2 * total, atol=1e-5), torch.equal(a.to_local(), addend))
        # 8. async, temporary
        y = (a * 2).redistribute(placements=R, async_op=True)
        out["async"] = (inplace[-1], torch.allclose(y.to_local() + 0, 2 * total, atol=1e-5), True)
        # 9. with autograd: the gradient of a Partial(sum) input is the upstream one
        leaf = addend.clone().requires_grad_(True)
        w = DTensor.from_local(leaf, mesh, P)
        g = _full((6, 5), 99)
        (w * 3).redistribute(placements=R).to_local().mul(g).sum().backward()
        out["grad"] = (inplace[-1], torch.allclose(leaf.grad, 3 * g, atol=1e-5), torch.equal(leaf.detach(), addend))
        # 10. a result autograd saved for backward is never written
        seen = []

        class SaveOut(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                y = x * 2
                ctx.save_for_backward(y)
                return y

            @staticmethod
            def backward(ctx, grad):
                (y,) = ctx.saved_tensors
                seen.append(y.to_local().clone())
                return grad * 2

        leaf = addend.clone().requires_grad_(True)
        r = SaveOut.apply(DTensor.from_local(leaf, mesh, P)).redistribute(placements=R)
        r.to_local().sum().backward()
        out["saved"] = (inplace[-1], torch.allclose(r.to_local(), 2 * total, atol=1e-5),
                        torch.allclose(seen[0], 2 * addend))
        # 11. Replicate -> Shard of a temporary: the right rows, the source left whole
        rep = distribute_tensor(_full((8, 3), 5), mesh, R)
        s = (rep + 0).redistribute(placements=[Shard(0)])
        out["R->S temp"] = (None, torch.equal(s.to_local(), _full((8, 3), 5).chunk(4)[rank]),
                            torch.equal(rep.to_local(), _full((8, 3), 5)))
    finally:
        C.all_reduce = real
    return out


# case -> whether the all-reduce may run in place
_INPLACE = {"temp": True, "held": False, "container": False, "local_kept": False, "view_kept": False,
            "from_local": False, "full_tensor": True, "async": True, "grad": True, "saved": False, "R->S temp": None}


def test_temporaries_in_place_and_held_tensors_untouched():
    for rank, out in enumerate(run_on_ranks(4, _temporaries)):
        for case, (inplace, value_ok, untouched) in out.items():
            assert value_ok, f"rank {rank} {case}: wrong value"
            assert untouched, f"rank {rank} {case}: a tensor the user holds changed"
            if _INPLACE[case] is not None:
                assert inplace == _INPLACE[case], f"rank {rank} {case}: in place {inplace}, expected {_INPLACE[case]}"


# ---------------------------------------------------------------- prepared programs: repeated calls
# (mesh, src, dst): every step kind, through the program a plan keeps after its first eager run.
REPEATED = [((4,), ("S0",), ("R",)), ((4,), ("S1",), ("R",)), ((4,), ("P",), ("R",)), ((4,), ("P",), ("S0",)),
            ((4,), ("P",), ("S1",)), ((4,), ("S0",), ("S1",)), ((4,), ("S1",), ("S0",)), ((4,), ("R",), ("S0",)),
            ((4,), ("R",), ("S1",)), ((4,), ("R",), ("P",)), ((4,), ("S1",), ("P",)),
            ((2, 2), ("S0", "S1"), ("R", "R")), ((2, 2), ("S0", "R"), ("R", "S0")), ((2, 2), ("S0", "S0"), ("R", "R")),
            ((2, 2), ("R", "R"), ("S0", "S1")), ((2, 2), ("P", "R"), ("R", "R")), ((2, 2), ("P", "R"), ("S1", "S0")),
            ((2, 2), ("S1", "S1"), ("S0", "R"))]
REPEATED_SHAPES = [(8, 12), (7, 9), (5, 3), (2, 6, 5)]


def _value_and_local(mesh, src, shape, full_seed):
    """(the global value, this rank's local tensor) for placements ``src``; Partial dims sum per-rank addends."""
    from shardprop import Partial
    coord = mesh.get_coordinate()
    pdims = [m for m, p in enumerate(src) if type(p) is Partial]
    if not pdims:
        full = _full(shape, full_seed)
        return full, _chunk(full, mesh.shape, coord, src).clone()
    # Partial on mesh dim m: the addend depends on the coordinate along m only; the value is their sum.
    m = pdims[0]
    addends = [_full(shape, full_seed + 100 * i) for i in range(mesh.shape[m])]
    rest = tuple(p if k != m else _pl("R")[0] for k, p in enumerate(src))
    return sum(addends), _chunk(addends[coord[m]], mesh.shape, coord, rest).clone()


def _repeated(mesh_shape, cases, shapes):
    """Rank side: each transition three times (sync twice, async once) on the same source."""
    from shardprop import DTensor, Partial, Shard, init_device_mesh, plan_redistribute

    mesh = init_device_mesh("cpu", mesh_shape)
    coord = mesh.get_coordinate()
    errors = []
    for shape in shapes:
        for src_c, dst_c in cases:
            src, dst = _pl(src_c), _pl(dst_c)
            if any(type(p) is Shard and p.dim >= len(shape) for p in src + dst):
                continue
            what = f"{mesh_shape} {shape} {src_c}->{dst_c}"
            value, local = _value_and_local(mesh, src, shape, 7)
            before = local.clone()
            x = DTensor.from_local(local, mesh, src, shape=shape)
            if "P" in dst_c:  # to Partial: the value survives the reduction
                def check(y):
                    return torch.allclose(y.redistribute(placements=_pl(("R",) * len(dst))).to_local(), value, atol=1e-5)
            else:
                want = _chunk(value, mesh.shape, coord, dst)

                def check(y):
                    got = y.to_local()
                    return got.shape == want.shape and torch.allclose(got, want, atol=1e-5)
            y1 = x.redistribute(placements=list(dst))
            kept = y1.to_local().clone()
            plan = plan_redistribute(x._spec, dst)
            prog = plan.prepared[0]
            y2 = x.redistribute(placements=list(dst))
            y3 = x.redistribute(placements=dst, async_op=True)
            y4 = x.redistribute(placements=dst)  # while y3 may still be in flight: its buffers are not reused
            for name, y in (("first", y1), ("second", y2), ("async", y3), ("after async", y4)):
                if not check(y):
                    errors.append(f"{what}: {name} call gave a wrong shard")
            if not torch.equal(y1.to_local(), kept):
                errors.append(f"{what}: the first result changed when the call was repeated")
            if not torch.equal(local, before):
                errors.append(f"{what}: the input changed")
            if y2.to_local().numel() and y2.to_local().untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
                errors.append(f"{what}: the result aliases the input")
            if prog is None or prog.src is not x._spec or plan.prepared[0] is not prog:
                errors.append(f"{what}: the plan was not prepared once and kept")
            if any(type(p) is Partial for p in src):
                continue
            # The same through a differentiable source, and the gradient back.
            leaf = local.clone().requires_grad_(True)
            g = _full(tuple(y1.shape), 11)
            for _ in range(2):
                leaf.grad = None
                yg = DTensor.from_local(leaf, mesh, src, shape=shape).redistribute(placements=dst)
                if "P" in dst_c:
                    continue
                (yg.to_local() * _chunk(g, mesh.shape, coord, dst)).sum().backward()
                if not torch.allclose(leaf.grad, _chunk(g, mesh.shape, coord, src), atol=1e-5):
                    errors.append(f"{what}: wrong gradient")
    return errors


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["1d", "2x2"])
def test_repeated_redistribution_values(mesh_shape):
    cases = [(s, d) for m, s, d in REPEATED if m == mesh_shape]
    for rank, errors in enumerate(run_on_ranks(4, _repeated, mesh_shape, cases, REPEATED_SHAPES)):
        assert not errors, f"rank {rank}: " + "; ".join(errors[:8])


def _target_cache():
    from shardprop import Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (4,))
    full = _full((8, 12), 3)
    x = distribute_tensor(full, mesh, [Shard(0)])
    out = {"first": torch.equal(x.redistribute(placements=[Shard(1)]).to_local(), full.chunk(4, 1)[dist.get_rank()])}
    out["negative dim"] = torch.equal(x.redistribute(placements=[Shard(-1)]).to_local(), full.chunk(4, 1)[dist.get_rank()])
    out["negative dim spec"] = x.redistribute(placements=(Shard(-1),)).placements == (Shard(1),)
    for bad in ([Shard(2)], [Replicate(), Replicate()], ["R"], [[Shard(0)]]):
        try:
            x.redistribute(placements=bad)
            out[f"bad {bad}"] = False
        except (ValueError, TypeError):
            out[f"bad {bad}"] = True
    out["same"] = x.redistribute(placements=[Shard(0)]).to_local() is x.to_local()
    return out


def test_target_cache_checks_every_new_placement_list():
    for rank, out in enumerate(run_on_ranks(4, _target_cache)):
        assert all(out.values()), f"rank {rank}: " + ", ".join(k for k, v in out.items() if not v)


# ---------------------------------------------------------------- cost model honesty
# Bench transitions: (mesh, src, dst), priced at the bench's sizes (square float32, side n).
BENCH = [((4,), ("S0",), ("R",)), ((4,), ("S1",), ("R",)), ((4,), ("S0",), ("S1",)), ((4,), ("R",), ("S0",)),
         ((2, 2), ("S0", "S1"), ("R", "R")), ((2, 2), ("S0", "R"), ("R", "S0")),
         ((2, 2), ("S0", "S1"), ("S1", "S0")), ((2, 2), ("S0", "S0"), ("S0", "S1"))]


def _wire_bytes(kind, payload, k):
    """Bytes one rank receives in a ring collective of ``payload`` bytes handed in, over ``k`` ranks."""
    return {"all_gather": payload * (k - 1), "all_to_all": payload * (k - 1) / k,
            "reduce_scatter": payload * (k - 1) / k, "all_reduce": 2 * payload * (k - 1) / k}[kind]


def _both_plans(mesh_shape, src_c, dst_c, n):
    """Per rank: the two prices, and the bytes each plan really received here (run under comm_counter)."""
    from shardprop import comm_counter, distribute_tensor, init_device_mesh, plan_redistribute
    from shardprop.tensor.redistribute import p2p_plan, run_plan

    mesh = init_device_mesh("cpu", mesh_shape)
    src, dst = _pl(src_c), _pl(dst_c)
    x = distribute_tensor(_full((n, n), 4), mesh, src)
    chosen = plan_redistribute(x._spec, dst)
    coll = chosen.fallback or chosen
    p2p = p2p_plan(x._spec, dst)
    received = {}
    for name, plan in (("collective", coll), ("p2p", p2p)):
        if plan is None:
            continue
        with comm_counter() as c:
            run_plan(x.to_local(), x._spec, plan)
        if name == "p2p":
            received[name] = c.counts.get("recv", (0, 0))[1]
        else:
            steps = [s for s in plan.collectives]
            received[name] = sum(_wire_bytes(s.kind, c.counts[s.kind][1] / c.counts[s.kind][0],
                                             _group_size(mesh, s.mesh_dims)) for s in steps)
    return ([s.kind for s in chosen.steps], coll.cost, p2p.cost if p2p else None, received)


def _group_size(mesh, dims):
    k = 1
    for m in dims:
        k *= mesh.shape[m]
    return k


@pytest.mark.parametrize("n", [64, 512, 2048])
@pytest.mark.parametrize("mesh_shape,src,dst", BENCH)
def test_cheaper_price_moves_no_more_bytes(mesh_shape, src, dst, n):
    """The planner's pick never moves more bytes, busiest rank and all ranks together, than the other plan.

    Fails if the prices misrank (a wrong COST_FACTOR or a byte estimate off by a factor): then the
    pick would be a plan that moves more. A point-to-point plan passed over for moving fewer bytes
    is allowed only when it talks to more peers (its latency), never on bytes alone.
    """
    per_rank = run_on_ranks(4, _both_plans, mesh_shape, src, dst, n)
    kinds, coll_cost, p2p_cost, _ = per_rank[0]
    if p2p_cost is None:
        return  # nothing to compare: no point-to-point plan for this transition
    coll = [r[3]["collective"] for r in per_rank]
    p2p = [r[3]["p2p"] for r in per_rank]
    if kinds == ["p2p"]:
        assert max(p2p) <= max(coll) and sum(p2p) < sum(coll), \
            f"picked p2p (price {p2p_cost} < {coll_cost}) but it receives {p2p} vs the collectives' {coll}"
    else:
        fewer = max(p2p) < max(coll) and sum(p2p) < sum(coll)
        if fewer:
            from shardprop.tensor.redistribute import LATENCY
            assert p2p_cost - coll_cost <= 4 * LATENCY, \
                f"kept the collectives (price {coll_cost} <= {p2p_cost}) though p2p receives {p2p} vs {coll}"


def _time_both(mesh_shape, src_c, dst_c, n, reps):
    from shardprop import distribute_tensor, init_device_mesh, plan_redistribute
    from shardprop.tensor.redistribute import p2p_plan, run_plan

    mesh = init_device_mesh("cpu", mesh_shape)
    src, dst = _pl(src_c), _pl(dst_c)
    x = distribute_tensor(_full((n, n), 4), mesh, src)
    chosen = plan_redistribute(x._spec, dst)
    plans = {"collective": chosen.fallback or chosen, "p2p": p2p_plan(x._spec, dst)}
    local = x.to_local()
    times = {k: [] for k in plans}
    for i in range(reps + 1):
        for name in (list(plans) if i % 2 else list(plans)[::-1]):
            dist.barrier()
            t0 = time.perf_counter()
            run_plan(local, x._spec, plans[name])
            el = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(el, op=dist.ReduceOp.MAX)
            if i:
                times[name].append(el.item())
    return [s.kind for s in chosen.steps], {k: statistics.median(v) for k, v in times.items()}


# Measured on gloo (4 CPU ranks on 2 shared cores, 16 MB) before CPU all-gathers became direct
# messages themselves (mesh/transport/direct_collectives.py): a direct point-to-point gather beat gloo's ring
# all-gather by 1.2x (S(0)->R) to 2.2x ([S(0),S(1)]->[R,R]); the prices tie on bytes and the
# collective wins on latency. Now both plans send direct messages on CPU; the mark stays non-strict
# for SHARDPROP_DIRECT_COLLECTIVES=0, where the misranking is still there.
_RING_GATHER = pytest.mark.xfail(reason="gloo's ring all-gather is slower than direct messages at 16 MB; "
                                        "the cost model prices them equal", strict=False)
_TIMED = [pytest.param(*b, marks=_RING_GATHER) if b[2] in (("R",), ("R", "R")) else b
          for b in BENCH if b[1] != ("R",)]


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape,src,dst", _TIMED)
def test_cheaper_price_is_not_measurably_slower(mesh_shape, src, dst):
    kinds, t = run_on_ranks(4, _time_both, mesh_shape, src, dst, 2048, 7)[0]
    chosen, other = ("p2p", "collective") if kinds == ["p2p"] else ("collective", "p2p")
    assert t[chosen] <= 1.3 * t[other], f"picked {chosen} ({t[chosen] * 1e3:.2f} ms) over {other} ({t[other] * 1e3:.2f} ms)"
