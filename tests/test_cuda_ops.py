"""CUDA tier: op families on CUDA DTensors against plain torch on the GPU, forward and backward.

- a sample of the OpInfo sweep (tests/opinfo_harness.py, engine ``shardprop_cuda``) on 4 ranks
  sharing the GPU over gloo, variants 1d, 2d and backward;
- hand-written families (mm both ways, softmax, layer_norm, embedding, views, cat,
  cross_entropy, topk, Partial -> Shard -> Replicate) on a one-rank NCCL mesh and on 4 gloo
  ranks sharing the GPU, each compared with the same op on plain GPU tensors.
Skipped without a CUDA device (``make test-gpu`` runs it).
"""
import random
import zlib

import pytest
import torch
import torch.nn.functional as F

from tests import cuda_tier as T
from tests.opinfo_harness import PASS, SKIP, run_checks
from tests.rankpool import get_pool

pytestmark = pytest.mark.cuda

# op_db keys the CPU suite holds to "pass" on every variant (tests/test_opinfo.py OPS); a fixed
# sample of them keeps the tier to minutes.
OPINFO_SAMPLE = ["add", "mul", "div", "nn.functional.relu", "exp", "where", "mm", "addmm", "bmm", "sum", "mean",
                 "softmax", "log_softmax", "nn.functional.layer_norm", "nn.functional.embedding", "view", "reshape",
                 "transpose", "permute", "split", "chunk", "narrow", "nn.functional.cross_entropy", "cumsum",
                 "topk", "sort", "gather", "index_select", "var", "logsumexp", "nn.functional.gelu", "matmul",
                 "nn.functional.linear", "stack", "cat", "nn.functional.rms_norm", "einsum", "masked_fill"]


@pytest.mark.parametrize("variant", ["1d", "2d", "backward"])
def test_opinfo_sample_on_cuda(variant):
    results = run_checks(get_pool(4), OPINFO_SAMPLE, variant, engine="shardprop_cuda", chunk=10,
                         timeout_per_op=120.0, max_samples=2, max_combos=4)
    bad = [f"{r['op']}: {r['outcome']} {r['detail']} {r['combo']}" for r in results.values()
           if r["outcome"] not in (PASS, SKIP)]
    assert not bad, "\n".join(bad)
    assert sum(r["outcome"] == PASS for r in results.values()) >= len(OPINFO_SAMPLE) // 2


# ---------------------------------------------------------------- hand-written families

def _cases(n):
    """(name, inputs as (shape, placements or None for a plain tensor, kind), fn). ``n``: the mesh size."""
    from shardprop import Replicate, Shard
    S, R = Shard, Replicate
    return [
        ("mm colwise", [((8, 16), [R()]), ((16, 4 * n), [S(1)])], lambda a, b: a @ b),
        ("mm rowwise (Partial)", [((8, 4 * n), [S(1)]), ((4 * n, 12), [S(0)])], lambda a, b: a @ b),
        ("softmax", [((4 * n, 12), [S(0)])], lambda x: torch.softmax(x, -1)),
        ("layer_norm", [((4 * n, 16), [S(0)]), ((16,), [R()]), ((16,), [R()])],
         lambda x, w, b: F.layer_norm(x, (16,), w, b)),
        ("embedding colwise", [("idx", None), ((20, 4 * n), [S(1)])], lambda i, w: F.embedding(i, w)),
        ("views", [((4 * n, 12), [S(0)])], lambda x: x.view(-1, 3, 4).transpose(1, 2).reshape(-1, 12) * 2),
        ("cat", [((4 * n, 5), [S(0)]), ((4 * n, 7), [S(0)])], lambda a, b: torch.cat([a, b], 1)),
        ("cross_entropy", [((4 * n, 10), [S(0)]), ("target", None)], lambda x, t: F.cross_entropy(x, t)),
        ("topk", [((4 * n, 12), [S(0)])], lambda x: torch.topk(x, 3, dim=-1).values),
    ]


def _inputs(case_inputs, n, dev, mesh, gen):
    """(plain GPU tensors, DTensors) for one case: every rank draws the same values."""
    from shardprop import distribute_tensor
    plain, dts = [], []
    for spec, placements in case_inputs:
        if spec == "idx":
            t = torch.randint(0, 20, (4 * n, 6), generator=gen).to(dev)
        elif spec == "target":
            t = torch.randint(0, 10, (4 * n,), generator=gen).to(dev)
        else:
            t = torch.randn(spec, generator=gen).to(dev)
        plain.append(t.clone().requires_grad_(t.is_floating_point()))
        if placements is None:
            from shardprop import Replicate
            placements = [Replicate()]
        d = distribute_tensor(t.clone(), mesh, placements)
        dts.append(d.requires_grad_(t.is_floating_point()))
    return plain, dts


def _families():
    """Rank side: every case forward and backward; returns problems."""
    import shardprop as sp
    n = torch.distributed.get_world_size()
    mesh = sp.init_device_mesh("cuda", (n,))
    dev = T.device()
    problems = []
    for name, ins, fn in _cases(n):
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))  # the same on every rank (hash() is not)
        plain, dts = _inputs(ins, n, dev, mesh, gen)
        want = fn(*plain)
        out = fn(*dts)
        got = out.full_tensor() if isinstance(out, sp.DTensor) else out
        if got.device.type != "cuda":
            problems.append(f"{name}: result on {got.device}")
        problems.append(T.close(got, want, f"{name} forward"))
        g = torch.randn(want.shape, generator=gen).to(dev)
        (want * g).sum().backward()
        (got * g).sum().backward()
        for i, (p, d) in enumerate(zip(plain, dts)):
            if p.grad is not None:
                dg = d.grad.full_tensor() if d.grad is not None else torch.zeros_like(p)
                problems.append(T.close(dg, p.grad, f"{name} grad {i}"))
    # Partial -> Shard -> Replicate, explicitly
    from shardprop import DTensor, Partial, Replicate, Shard
    full = torch.randn(4 * n, 6, generator=torch.Generator().manual_seed(3)).to(dev)
    p = DTensor.from_local(full / n, mesh, [Partial()])
    s = p.redistribute(mesh, [Shard(0)])
    problems.append(T.close(s.to_local(), full.chunk(n)[mesh.get_local_rank()], "Partial -> Shard local"))
    problems.append(T.close(s.redistribute(mesh, [Replicate()]).to_local(), full, "Shard -> Replicate"))
    return [x for x in problems if x]


def test_families_on_one_rank_nccl_mesh():
    T.no_problems(T.nccl(1, _families, timeout=300))


def test_families_on_four_ranks_sharing_the_gpu():
    T.no_problems(T.shared(_families, timeout=300))


def _random_pointwise_chain(seed):
    """A random chain of pointwise and reduction ops on a sharded CUDA tensor vs plain (cheap fuzz)."""
    import shardprop as sp
    from shardprop import Shard, distribute_tensor
    mesh = sp.init_device_mesh("cuda", (torch.distributed.get_world_size(),))
    rng = random.Random(seed)
    x = torch.randn(8, 12, generator=torch.Generator().manual_seed(seed)).to(T.device())
    d = distribute_tensor(x, mesh, [Shard(rng.randrange(2))])
    for _ in range(6):
        op = rng.choice([torch.sin, torch.exp, lambda t: t * 1.5 + 1, torch.relu, lambda t: t.sum(0, keepdim=True) + t])
        x, d = op(x), op(d)
    return [p for p in [T.close(d.full_tensor(), x, f"chain seed {seed}", rtol=1e-3, atol=1e-3)] if p]


def test_random_chains_on_four_ranks_sharing_the_gpu():
    for seed in range(3):
        T.no_problems(T.shared(_random_pointwise_chain, seed, timeout=120))
