"""ExpertParallel (``shardprop.parallel.ep``) on 4 gloo ranks against one process.

Each rank builds the same DeepSeek-style MoE layer (``tests/moe_model.py``: 8 experts, top-2,
a shared expert) from one seed; the copy on one process runs the full batch as the reference.
The parallel copy has its experts sharded over ep=4 and each rank runs its quarter of the
batch (ExpertTensorParallel: ep=2 x tp=2, each expert's hidden dim split over tp, the two tp
ranks of an ep index running the same half). Losses, the input's and the experts' gradients,
the other parameters' gradients (summed over ep, as data parallelism would) and the parameters
after 3 AdamW steps must agree, also under activation checkpointing and torch.compile. Routing alone is checked against every rank's tokens, with random counts
(zeros included); bad counts on one rank raise the same error on every rank within seconds.
"""
import copy
import time

import pytest
import torch
import torch.distributed as dist
import torch.utils.checkpoint

from tests.closeness import Closeness
from tests.rankpool import run_on_ranks

pytestmark = pytest.mark.timeout(240)
ATOL, RTOL = 1e-4, 1e-4


def _batch(seed=0, b=8, s=6, dim=16):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, s, dim, generator=g), torch.randn(b, s, dim, generator=g)


def _loss(out, tgt, total):
    # Normalised by the global element count: the ranks' losses sum to the one-process loss.
    return ((out - tgt) ** 2).sum() / total


def _train(steps=3, ac=False, etp=False, compiled=False, bias=False):
    from shardprop import ExpertParallel, ExpertTensorParallel, Shard, comm_counter, init_device_mesh, parallelize_module
    from shardprop.demo.moe import MoE
    torch.manual_seed(0)
    ref = MoE(dim=16, hidden=24, num_experts=8, top_k=2, expert_bias=bias)
    model = copy.deepcopy(ref)
    if etp:  # ep=2 x tp=2: rank 2 * i + j is ep index i, tp index j; the tp pair holds the same tokens
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "tp"))
        parallelize_module(model.experts, mesh, ExpertTensorParallel())
        me, n = dist.get_rank() // 2, 2
        ep_group = mesh.get_group("ep")
    else:
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
        parallelize_module(model.experts, mesh["ep"], ExpertParallel())
        me, n = dist.get_rank(), 4
        ep_group = None
    close = Closeness(ATOL, RTOL)

    w1 = model.experts.w1
    if etp:
        assert w1.placements == (Shard(0), Shard(2)) and w1.to_local().shape == (4, 16, 12), w1.placements
        assert model.experts.w2.placements == (Shard(0), Shard(1))
    else:
        assert w1.placements == (Shard(0),) and w1.to_local().shape == (2, 16, 24)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    # Compiled: the whole layer; routing's split sizes are data (a graph break where they are read).
    run = torch.compile(model) if compiled else model
    ref_params = dict(ref.named_parameters())
    counts = []
    for step in range(steps):
        x, tgt = _batch(step)
        total = tgt.numel()
        # Inputs with gradients (as from a layer below): the dispatch is differentiated too.
        x_ref = x.clone().requires_grad_()
        ref_loss = _loss(ref(x_ref), tgt, total)
        ref_loss.backward()
        mine = x.chunk(n)[me].clone().requires_grad_()
        with comm_counter() as c:
            if ac:  # the recomputation in backward dispatches again (same counts, same route)
                out = torch.utils.checkpoint.checkpoint(run, mine, use_reentrant=False)
            else:
                out = run(mine)
            loss = _loss(out, tgt.chunk(n)[me], total)
            fwd = dict(c.counts)
            loss.backward()
        counts.append((fwd.get("all_to_all", (0, 0))[0], c.counts.get("all_to_all", (0, 0))[0],
                       fwd.get("all_reduce", (0, 0))[0], c.counts.get("all_reduce", (0, 0))[0]))
        whole = loss.detach().clone()
        dist.all_reduce(whole, group=ep_group)
        close(f"step {step} loss", whole, ref_loss)
        close(f"step {step} input grad", mine.grad, x_ref.grad.chunk(n)[me])
        for name, p in model.named_parameters():
            if name.startswith("experts."):
                # The experts' gradient: this rank's experts, laid out like the weight.
                assert p.grad.placements == p.placements, (name, p.grad.placements)
                if not etp:  # this rank's experts' piece, without any communication
                    close(f"step {step} grad {name}", p.grad.to_local(), ref_params[name].grad.chunk(n)[me])
                else:
                    close(f"step {step} grad {name}", p.grad.full_tensor(), ref_params[name].grad)
            else:
                dist.all_reduce(p.grad, group=ep_group)  # replicated parameters: data parallel over ep
                close(f"step {step} grad {name}", p.grad, ref_params[name].grad)
        opt_ref.step()
        opt.step()
        opt_ref.zero_grad()
        opt.zero_grad()
        if bias:  # load balancing: every rank's counts summed, as the one process counts its whole batch
            ref.router.update_expert_bias(ref.tokens_per_expert, rate=0.05)
            load = model.tokens_per_expert.clone()
            dist.all_reduce(load, group=ep_group)
            model.router.update_expert_bias(load, rate=0.05)
            close(f"step {step} expert bias", model.router.expert_bias, ref.router.expert_bias)
        for name, p in model.named_parameters():
            got = p.full_tensor() if name.startswith("experts.") else p
            close(f"step {step} param {name}", got, ref_params[name])
    return close.errors, close.checked, counts


@pytest.mark.parametrize("ac,etp,compiled,bias", [(False, False, False, False), (True, False, False, False),
                                                   (False, True, False, False), (True, True, True, False),
                                                   (False, False, False, True)],
                         ids=["ep4", "ep4-checkpointed", "ep2xtp2", "ep2xtp2-checkpointed-compiled",
                              "ep4-expert-bias"])
def test_expert_parallel_trains_like_one_process(ac, etp, compiled, bias):
    out = run_on_ranks(4, _train, ac=ac, etp=etp, compiled=compiled, bias=bias, timeout=240 if compiled else 60)
    for errors, checked, counts in out:
        assert not errors, "\n".join(errors)
        # loss, input grad, then 7 parameters' gradients and values per step (and the router's bias)
        assert checked == 3 * (2 + 2 * 7 + bias)
        # all-to-alls (forward, forward + backward): counts, tokens there, tokens back; backward: the two
        # token moves inverted (with activation checkpointing, after the forward's three again).
        # all-reduces over tp (ep x tp only): the partial outputs forward, the tokens' gradient backward
        # (with activation checkpointing, after the forward's one again).
        assert counts == [(3, 8 if ac else 5, 1 if etp else 0, (3 if ac else 2) if etp else 0)] * 3, counts


def _routing():
    """dispatch/combine alone: every rank's tokens land on the rank of their expert, in expert order."""
    from shardprop import init_device_mesh
    from shardprop.parallel.ep import combine, dispatch
    mesh = init_device_mesh("cpu", (4,))
    me, n, E = dist.get_rank(), 4, 8
    L = E // n
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        cnt = torch.randint(0, 4, (n, E), generator=g)
        cnt[torch.rand(n, E, generator=g) < 0.4] = 0
        # Row value = (source rank, expert, index) so the placement of every row is checkable.
        xs = [torch.cat([torch.tensor([[r, e, i]] * 1, dtype=torch.float32).repeat(1, 2)
                         for e in range(E) for i in range(int(cnt[r, e]))] or [torch.zeros(0, 6)])
              for r in range(n)]
        x = xs[me].clone().requires_grad_()
        routed, local_counts, route = dispatch(x, cnt[me], mesh, 0, E, width=6)
        want = torch.cat([xs[r][int(cnt[r, :e].sum()):int(cnt[r, :e + 1].sum())]
                          for e in range(me * L, (me + 1) * L) for r in range(n)])
        assert torch.equal(routed, want), (seed, routed, want)
        assert local_counts.tolist() == cnt[:, me * L:(me + 1) * L].sum(0).tolist()
        assert route.tokens_per_local_expert == local_counts.tolist()
        back = combine(routed * 3, route)
        assert torch.equal(back, xs[me] * 3)
        back.sum().backward()
        assert torch.equal(x.grad, torch.full_like(x, 3.0))
    return True


def test_routing_sends_tokens_to_their_experts_and_back():
    assert run_on_ranks(4, _routing) == [True] * 4


def _bad_counts(kind):
    from shardprop import ExpertParallel, init_device_mesh, parallelize_module
    from shardprop.demo.moe import GroupedExperts
    torch.manual_seed(0)
    experts = GroupedExperts(16, 24, 8)
    parallelize_module(experts, init_device_mesh("cpu", (4,)), ExpertParallel())
    me = dist.get_rank()
    counts = torch.tensor([1, 0, 2, 1, 0, 3, 1, 0])
    x = torch.randn(8, 16)
    if me == 2 and kind == "sum":
        counts = torch.tensor([1, 0, 2, 1, 0, 3, 1, 1])
    if me == 1 and kind == "experts":
        counts = torch.tensor([1, 0, 2, 1, 0, 3, 1, 0, 0, 0])
    if me == 3 and kind == "width":
        x = torch.randn(8, 12)
    t0 = time.monotonic()
    try:
        experts(x, counts)
    except ValueError as e:
        return str(e), time.monotonic() - t0
    return None, time.monotonic() - t0


@pytest.mark.parametrize("kind,says", [
    ("sum", "rank 2 (the token count differs from the sum of num_tokens_per_expert)"),
    ("experts", "rank 1 (num_tokens_per_expert has the wrong number of experts)"),
    ("width", "rank 3 (tokens of the wrong width)")])
def test_mismatched_counts_raise_on_every_rank(kind, says):
    out = run_on_ranks(4, _bad_counts, kind, timeout=30)
    for msg, took in out:
        assert msg is not None and says in msg and "Every rank" in msg, out
        assert took < 5, out
    # No rank was left inside a collective: the same pool runs the routing check next.
    assert run_on_ranks(4, _routing) == [True] * 4


def _refusals():
    from shardprop import ExpertParallel, ExpertTensorParallel, init_device_mesh, parallelize_module
    from shardprop.demo.moe import GroupedExperts
    m2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "tp"))
    cases = [(GroupedExperts(16, 24, 6), init_device_mesh("cpu", (4,)), ExpertParallel()),  # 6 experts over 4
             (GroupedExperts(16, 24, 8), m2, ExpertParallel()),                          # a 2-d mesh
             (GroupedExperts(16, 25, 8), m2, ExpertTensorParallel())]                    # hidden 25 over tp=2
    out = []
    for experts, mesh, style in cases:
        try:
            parallelize_module(experts, mesh, style)
            out.append(None)
        except ValueError as e:
            out.append(str(e))
    return out


def test_layouts_that_do_not_fit_are_refused():
    for msgs in run_on_ranks(4, _refusals):
        assert all(m is not None for m in msgs), msgs
        assert "ExpertParallel" in msgs[0] and "w1" in msgs[0], msgs[0]
        assert "1-d mesh" in msgs[1], msgs[1]
        assert "ExpertTensorParallel" in msgs[2] and "hidden" in msgs[2] and "tp=2" in msgs[2], msgs[2]


def _load_and_explain():
    from shardprop import ExpertParallel, comm_counter, expert_load, explain, init_device_mesh, parallelize_module
    from shardprop.parallel.ep import local_load
    from shardprop.demo.moe import GroupedExperts
    torch.manual_seed(0)
    experts = GroupedExperts(16, 24, 8)
    parallelize_module(experts, init_device_mesh("cpu", (4,)), ExpertParallel(), strict=True)
    me = dist.get_rank()
    table = torch.randint(0, 5, (4, 8), generator=torch.Generator().manual_seed(3))
    with explain() as ex:
        experts(torch.randn(int(table[me].sum()), 16), table[me])
    ops = [r.op for r in ex.records if r.is_fast_path]
    assert ops == ["moe_dispatch", "moe_combine"], ops
    kinds = [[k for _, k, _, _ in r.collectives] for r in ex.records if r.is_fast_path]
    assert kinds == [["all_to_all", "all_to_all"], ["all_to_all"]], kinds
    mine = table[:, 2 * me:2 * me + 2].sum(0).tolist()
    assert any(f"local experts got tokens {mine}" in n for n in ex.notes), ex.notes
    assert "moe_dispatch" in str(ex)
    assert local_load(experts) == mine
    with comm_counter() as c:
        load = expert_load(experts)
    assert c.counts["all_gather"][0] == 1
    per_expert = table.sum(0)
    assert load.tokens_per_expert == per_expert.tolist()
    assert load.tokens_per_rank == per_expert.view(4, 2).sum(1).tolist()
    assert abs(load.imbalance - per_expert.max().item() / per_expert.float().mean().item()) < 1e-9
    return str(load)


def test_expert_load_and_explain_show_tokens_per_expert():
    out = run_on_ranks(4, _load_and_explain)
    assert len(set(out)) == 1 and "tokens per expert" in out[0], out


def _demo(argv):
    from shardprop.demo import train as demo
    from shardprop.demo.moe_train import moe_main
    return moe_main(demo.parser().parse_args(argv), demo.compare, demo.RTOL)


@pytest.mark.parametrize("mesh", ["4", "2x2"])
def test_demo_moe_flag_matches_one_process(mesh):
    argv = ["--moe", "--mesh", mesh, "--steps", "3", "--dim", "16", "--seq", "8", "--batch", "4"]
    results = run_on_ranks(4, _demo, argv, timeout=180)
    assert results[0]["ok"] is True, results[0]
    assert len(results[0]["losses"]) == 3 and len(set(results[0]["losses"])) == 3
    for r in results[1:]:
        assert r["losses"] == pytest.approx(results[0]["losses"], rel=1e-6)
        assert r["loads"] == results[0]["loads"]  # expert_load gathers the same picture on every rank
    # top-2 of 8 experts: every step routes 2 x 32 token copies
    assert all(sum(tokens) == 2 * 4 * 8 for tokens, _ in results[0]["loads"])
