"""SequenceParallel's eager fast path for torch's norms (shardprop.parallel.fast.fused_norm) and the coalesced
Partial -> Replicate gradient reduction (shardprop.parallel.fast.grad_sync), against one process of plain torch.

Covered: LayerNorm with and without bias, without affine parameters, RMSNorm; outputs, input and
parameter gradients, parameters after SGD and AdamW steps; tp=2 and the tp dim of a 2x2 dp x tp
mesh; one all-reduce for all replicated-parameter gradients of a backward; gradient accumulation
over two backwards; ``torch.autograd.grad``; a custom norm module keeps the DTensor path; a step on a
one-rank tp mesh issues no collective at all (as torch's DTensor issues none).
"""
import copy

import torch
import torch.nn.functional as F
from torch import nn

from shardprop import (ColwiseParallel, DTensor, Replicate, RowwiseParallel, SequenceParallel, Shard, comm_counter,
                       init_device_mesh, parallelize_module)
from shardprop.tensor.dtensor import local_chunk
from tests.rankpool import run_on_ranks

TOL = dict(atol=1e-5, rtol=1e-5)


class MyRMSNorm(nn.Module):
    """A norm torch does not know: SequenceParallel must keep the DTensor path for it."""

    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


NORMS = {
    "layernorm": lambda: nn.LayerNorm(8),
    "layernorm_nobias": lambda: nn.LayerNorm(8, bias=False),
    "layernorm_noaffine": lambda: nn.LayerNorm(8, elementwise_affine=False),
    "rmsnorm": lambda: nn.RMSNorm(8, eps=1e-6),
    "custom": lambda: MyRMSNorm(8),
}


class Block(nn.Module):
    """norm -> column-parallel up -> gelu -> row-parallel down (+ residual) -> norm."""

    def __init__(self, make_norm):
        super().__init__()
        self.n1, self.n2 = make_norm(), make_norm()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.n2(x + self.down(F.gelu(self.up(self.n1(x)))))


PLAN = {"n1": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1)), "n2": SequenceParallel(use_local_output=True)}


def _dispatches() -> int:
    from shardprop.dispatch.dispatcher import call_counts
    return sum(call_counts().values())


def _check_grads(where, model, ref):
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert isinstance(p, DTensor) and p.grad is not None, f"{where}: {name} grad {p.grad}"
        assert p.grad.placements == p.placements, f"{where}: grad of {name}: {p.grad.placements} vs {p.placements}"
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, **TOL, msg=lambda m: f"{where}: grad {name}: {m}")


def _cases(mesh_shape):
    if len(mesh_shape) == 1:
        tp, dp_rank = init_device_mesh("cpu", mesh_shape), 0
    else:
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp"))
        tp, dp_rank = mesh["tp"], mesh.get_local_rank(0)
    n = tp.size()
    seq = lambda t: local_chunk(t, tp, [Shard(1)])  # noqa: E731
    optims = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
              "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01)}
    counts = {}
    for kind, make in NORMS.items():
        for oname, opt in optims.items():
            # AdamW on two norm kinds, and only the main kinds on the 2x2 mesh: keeps the test fast.
            if (oname == "adamw" and kind not in ("layernorm", "rmsnorm")) or \
                    (len(mesh_shape) == 2 and (oname == "sgd" or kind not in ("layernorm", "rmsnorm"))):
                continue
            where = f"{kind} {oname} mesh={mesh_shape}"
            torch.manual_seed(0)
            ref = Block(make)
            with torch.no_grad():
                for p in ref.parameters():
                    p.add_(torch.randn_like(p) * 0.1)
            model = parallelize_module(copy.deepcopy(ref), tp, dict(PLAN))
            fast = "forward" in vars(model.n1)
            assert fast == (kind != "custom"), f"{where}: fast path installed: {fast}"
            o, o_ref = opt(model.parameters()), opt(ref.parameters())
            for step in range(2):
                torch.manual_seed(100 * step + dp_rank)
                x = torch.randn(2, 2 * n, 8)
                xr = x.clone().requires_grad_()
                xin = seq(x).clone().requires_grad_()
                with comm_counter() as fwd:
                    out = model(xin)
                out_ref = ref(xr)
                torch.testing.assert_close(out, seq(out_ref), **TOL, msg=lambda m: f"{where}: output: {m}")
                g = torch.randn_like(out_ref)
                with comm_counter() as bwd:
                    (out * seq(g)).sum().backward()
                (out_ref * g).sum().backward()
                torch.testing.assert_close(xin.grad, seq(xr.grad), **TOL, msg=lambda m: f"{where}: x grad: {m}")
                _check_grads(where, model, ref)
                counts[kind] = ({k: c for k, (c, _) in fwd.counts.items()},
                                {k: c for k, (c, _) in bwd.counts.items()})
                o.step(), o_ref.step()
                o.zero_grad(set_to_none=True), o_ref.zero_grad(set_to_none=True)
                for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
                    torch.testing.assert_close(p.full_tensor(), q, **TOL,
                                               msg=lambda m: f"{where} step {step}: param {name}: {m}")

        if len(mesh_shape) == 2:
            continue
        # Gradient accumulation over two backwards, then torch.autograd.grad (the per-hook path).
        torch.manual_seed(1)
        ref = Block(make)
        model = parallelize_module(copy.deepcopy(ref), tp, dict(PLAN))
        for step in range(2):
            x = torch.randn(2, 2 * n, 8)
            model(seq(x)).sum().backward()
            ref(x).sum().backward()
        _check_grads(f"{kind} accumulated", model, ref)
        if kind == "rmsnorm":
            # A backward that raises after n2's gradient was deferred, then a whole one: the
            # second must flush its own deferred gradients (the first's callback never ran).
            def boom(grad):
                raise RuntimeError("boom")
            xin = seq(torch.randn(2, 2 * n, 8)).requires_grad_()
            xin.register_hook(boom)
            try:
                model(xin).sum().backward()
            except RuntimeError as e:
                assert "boom" in str(e), e
            else:
                raise AssertionError("the backward did not raise")
            model.zero_grad(set_to_none=True)
            ref.zero_grad(set_to_none=True)
            x = torch.randn(2, 2 * n, 8)
            model(seq(x)).sum().backward()
            ref(x).sum().backward()
            _check_grads(f"{kind} after a failed backward", model, ref)
        x = torch.randn(2, 2 * n, 8)
        params = list(model.parameters())
        got = torch.autograd.grad(model(seq(x)).sum(), params)
        want = torch.autograd.grad(ref(x).sum(), list(ref.parameters()))
        for (name, p), a, b in zip(model.named_parameters(), got, want):
            assert a.placements == p.placements, f"{kind} autograd.grad {name}: {a.placements}"
            torch.testing.assert_close(a.full_tensor(), b, **TOL, msg=lambda m: f"{kind} autograd.grad {name}: {m}")
        # Forward of the norm alone on a plain piece: no DTensor op on the fast path.
        before = _dispatches()
        model.n2(seq(x))
        counts[kind + " norm dispatches"] = _dispatches() - before
    return counts


def _expect_counts(counts):
    for kind, value in counts.items():
        if kind.endswith("norm dispatches"):
            assert (value == 0) == (not kind.startswith("custom")), (kind, value)
            continue
        fwd, bwd = value
        assert "all_reduce" not in fwd, (kind, fwd)
        # One all-reduce for every replicated parameter's partial gradient (norm weights and biases,
        # the row-parallel bias): coalesced at the end of the backward.
        assert bwd.get("all_reduce") == 1, (kind, bwd)


def test_sp_fast_tp2():
    counts = run_on_ranks(2, _cases, (2,))
    _expect_counts(counts[0])


def test_sp_fast_dp_tp():
    counts = run_on_ranks(4, _cases, (2, 2))
    _expect_counts(counts[0])


# ---------------------------------------------------------------- tp=1: a collective over one rank is a copy
def _tp1_counts():
    """Collectives of one training step on a one-rank tp mesh, shardprop's and the reference's (torch's DTensor)."""
    import torch.distributed.tensor.parallel as ref_tp
    from torch.distributed.device_mesh import init_device_mesh as ref_mesh
    from torch.distributed.tensor import Replicate as RefR, Shard as RefS
    from torch.distributed.tensor.debug import CommDebugMode

    from shardprop.demo.model import Llama, LlamaConfig, lm_loss, synthetic_batch, tp_plan
    from types import SimpleNamespace
    ref_styles = SimpleNamespace(Shard=RefS, Replicate=RefR, ColwiseParallel=ref_tp.ColwiseParallel,
                                 RowwiseParallel=ref_tp.RowwiseParallel, SequenceParallel=ref_tp.SequenceParallel,
                                 PrepareModuleInput=ref_tp.PrepareModuleInput)
    cfg = LlamaConfig(dim=16, n_layers=2, n_heads=2, vocab_size=32, seq_len=8)
    tokens, targets = synthetic_batch(cfg, 2, 0)
    plain_mlp = {"up": ColwiseParallel(), "down": RowwiseParallel()}  # no sequence parallelism: the R <-> P paths
    out = {}
    for name, build in (("llama", lambda: parallelize_module(Llama(cfg, 0), init_device_mesh("cpu", (1,)),
                                                             tp_plan())),
                        ("mlp", lambda: parallelize_module(_MLP(), init_device_mesh("cpu", (1,)), plain_mlp))):
        model = build()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
        counts = []
        for _ in range(2):  # the first step builds caches; both must issue nothing
            with comm_counter() as c:
                y = model(tokens) if name == "llama" else model(torch.randn(4, 8))
                loss = lm_loss(y, targets) if name == "llama" else y.pow(2).sum()
                opt.zero_grad()
                loss.backward()
                opt.step()
            counts.append(dict(c.counts))
        out[name] = counts
    ref = ref_tp.parallelize_module(Llama(cfg, 0), ref_mesh("cpu", (1,)), tp_plan(ref_styles))
    with CommDebugMode() as mode:
        lm_loss(ref(tokens), targets).backward()
    out["reference"] = mode.get_total_counts()
    return out


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def test_tp1_step_issues_no_collectives():
    out = run_on_ranks(1, _tp1_counts)[0]
    assert out["reference"] == 0, out
    assert out["llama"] == [{}, {}], out  # was {'all_reduce': 1} a step: the coalesced gradient sync
    assert out["mlp"] == [{}, {}], out
