"""``python bench/moe.py``: an expert-parallel MoE training step, shardprop's ExpertParallel against a floor.

4 CPU ranks (gloo, one thread each), ep=4: the demo's DeepSeek-style MoE layer
(``shardprop.demo.moe.MoE``: top-k router, stacked routed experts, one shared expert), each
rank holding E/4 experts and bringing its own tokens. One step = forward + backward + AdamW.
Contenders:

* ``floor``: torchtitan's pattern written by hand on plain tensors: one all-to-all of the
  token counts, one uneven all-to-all of the tokens (``dist.all_to_all_single`` with splits),
  a regroup by local expert, the experts' compute (the demo's: one grouped matmul per weight
  where it runs, else a loop), the inverse regroup and an all-to-all
  back; backward the two token all-to-alls inverted. Plain ``torch.distributed`` on the
  default gloo group;
* ``ours``: ``parallelize_module(moe.experts, mesh, ExpertParallel())``, shardprop's
  collectives on their default transport (on one host: direct shared-memory messages);
* ``ours gloo``: the same with ``SHARDPROP_DIRECT_COLLECTIVES`` off for its steps
  (``direct_collectives.set_enabled(False)``): shardprop on gloo's own collectives, the
  floor's transport.

In every contender the parameters outside the experts (router, shared expert) are replicated
and their gradients summed by one flat gloo all-reduce (the same call in each). Contenders
alternate step by step after a warm-up; medians over ``--reps`` rounds (max over ranks per
step); each median over the floor's. Step 0 checks that every contender's loss equals the
floor's. Collectives per step: the floor's own count, shardprop's ``comm_counter``.

Goal (issue 31): ours <= 1.2x floor.

    python bench/moe.py [--reps 20] [--warmup 3] [--dim 128] [--hidden 256] [--experts 8] [--top-k 2]
                        [--tokens 256] [--json out.json]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _launch import launch  # noqa: E402

WORLD = 4
GOAL = 1.2


class _AllToAll(torch.autograd.Function):
    """Rows out by ``send`` splits, in by ``recv`` splits (gloo's all_to_all_single); backward the inverse."""

    @staticmethod
    def forward(ctx, x, send, recv, counter):
        ctx.send, ctx.recv, ctx.counter = send, recv, counter
        out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send)
        counter["all_to_all"] += 1
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((sum(ctx.send),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv)
        ctx.counter["all_to_all"] += 1
        return out, None, None, None


class FloorExperts(torch.nn.Module):
    """This rank's slice of the stacked experts as plain parameters, and torchtitan's dispatch/combine by hand."""

    def __init__(self, full, n: int, me: int, counter):
        super().__init__()
        L = full.num_experts // n
        self.n, self.L, self.counter = n, L, counter
        for name in ("w1", "w2", "w3"):
            setattr(self, name, torch.nn.Parameter(getattr(full, name).detach()[me * L:(me + 1) * L].clone()))

    def forward(self, x, num_tokens_per_expert):
        n, L = self.n, self.L
        # 1. counts: how many of my tokens go to each peer's experts; what each peer sends me.
        recv = torch.empty_like(num_tokens_per_expert)
        dist.all_to_all_single(recv, num_tokens_per_expert)
        self.counter["all_to_all"] += 1
        recv = recv.view(n, L)
        send_splits = num_tokens_per_expert.view(n, L).sum(1).tolist()
        recv_splits = recv.sum(1).tolist()
        # 2. tokens there, in (source rank, local expert) order.
        got = _AllToAll.apply(x, send_splits, recv_splits, self.counter)
        # 3. regroup to (local expert, source rank) order: the experts' input.
        sizes = recv.t().reshape(-1)
        starts = (torch.cumsum(recv.reshape(-1), 0) - recv.reshape(-1)).view(n, L).t().reshape(-1)
        dst_starts = torch.cumsum(sizes, 0) - sizes
        idx = torch.repeat_interleave(starts - dst_starts, sizes) + torch.arange(int(sizes.sum()))
        routed = got[idx]
        # The experts' compute of the demo's module (grouped matmul where it runs, else the loop).
        from shardprop.demo.moe import expert_swiglu
        y = expert_swiglu(routed, recv.sum(0), self.w1, self.w2, self.w3)
        # 4. inverse regroup, tokens back.
        back = y.new_zeros(y.shape).index_copy(0, idx, y)
        return _AllToAll.apply(back, recv_splits, send_splits, self.counter)


class _Contender:
    def __init__(self, name: str, ref, args, mesh):
        from shardprop import ExpertParallel, parallelize_module
        self.name, self.args = name, args
        self.counter = {"all_to_all": 0}
        self.model = copy.deepcopy(ref)
        if name == "floor":
            self.model.experts = FloorExperts(ref.experts, WORLD, dist.get_rank(), self.counter)
        else:
            parallelize_module(self.model.experts, mesh, ExpertParallel())
        self.replicated = [p for n, p in self.model.named_parameters() if not n.startswith("experts.")]
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)

    def step(self, i: int) -> float:
        from shardprop.mesh.transport import direct_collectives
        old = direct_collectives.set_enabled(False) if self.name == "ours gloo" else None
        try:
            g = torch.Generator().manual_seed(1000 * i + dist.get_rank())
            # With a gradient, as from a layer below: the dispatch is differentiated too.
            x = torch.randn(self.args.tokens, self.args.dim, generator=g).requires_grad_()
            loss = self.model(x).pow(2).mean()
            loss.backward()
            # The replicated parameters' gradients: one flat gloo all-reduce, the same in every contender.
            flat = torch.cat([p.grad.reshape(-1) for p in self.replicated])
            dist.all_reduce(flat)
            off = 0
            for p in self.replicated:
                p.grad.copy_(flat[off:off + p.numel()].view_as(p.grad))
                off += p.numel()
            self.opt.step()
            self.opt.zero_grad()
            return loss.item()
        finally:
            if old is not None:
                direct_collectives.set_enabled(old)


def _collectives(c: _Contender, i: int) -> dict:
    from shardprop import comm_counter
    c.counter["all_to_all"] = 0
    with comm_counter() as cc:
        c.step(i)
    if c.name == "floor":
        return {"all_to_all": c.counter["all_to_all"], "all_reduce (gloo, replicated grads)": 1}
    out = {k: n for k, (n, _) in cc.counts.items()}
    out["all_reduce (gloo, replicated grads)"] = 1
    return out


def bench_ranks(rank, world, args):
    from shardprop import init_device_mesh
    from shardprop.demo.moe import MoE
    torch.manual_seed(0)
    ref = MoE(dim=args.dim, hidden=args.hidden, num_experts=args.experts, top_k=args.top_k)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    cs = {name: _Contender(name, ref, args, mesh) for name in ("floor", "ours", "ours gloo")}
    losses = {name: c.step(0) for name, c in cs.items()}  # same init, same tokens: same loss
    for name, loss in losses.items():
        if abs(loss - losses["floor"]) > 1e-4 * max(1.0, abs(losses["floor"])):
            raise AssertionError(f"step 0: {name} loss {loss} != floor {losses['floor']}")
    for w in range(1, args.warmup):
        for c in cs.values():
            c.step(w)
    samples = {name: [] for name in cs}
    step = args.warmup
    for _ in range(args.reps):
        for name, c in cs.items():
            dist.barrier()
            t0 = time.perf_counter()
            c.step(step)
            el = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(el, op=dist.ReduceOp.MAX)
            samples[name].append(el.item() * 1e3)
        step += 1
    colls = {name: _collectives(c, step) for name, c in cs.items()}
    med = {name: statistics.median(s) for name, s in samples.items()}
    return {"config": vars(args), "median_ms": med,
            "ratio_to_floor": {n: m / med["floor"] for n, m in med.items()},
            "collectives_per_step": colls, "step0_loss": losses}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--tokens", type=int, default=256, help="tokens per rank")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    if args.experts % WORLD:
        p.error(f"--experts must divide by ep={WORLD}")
    res = launch(bench_ranks, WORLD, args)
    print(f"MoE step (fwd + bwd + AdamW), ep={WORLD} on {WORLD} CPU ranks: dim {args.dim}, hidden {args.hidden}, "
          f"{args.experts} experts, top-{args.top_k}, {args.tokens} tokens/rank; {args.reps} interleaved reps")
    print(f"{'contender':<11} {'median ms':>10} {'x floor':>8}  collectives per step")
    for name, m in res["median_ms"].items():
        colls = ", ".join(f"{k} {v}" for k, v in res["collectives_per_step"][name].items())
        print(f"{name:<11} {m:>10.2f} {res['ratio_to_floor'][name]:>8.2f}  {colls}")
    r = res["ratio_to_floor"]["ours"]
    print(f"goal ours <= {GOAL}x floor: {'met' if r <= GOAL else 'NOT met'} ({r:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
