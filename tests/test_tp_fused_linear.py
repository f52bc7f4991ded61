"""The eager fast path of ColwiseParallel / RowwiseParallel on nn.Linear (shardprop.parallel.fast.fused_linear)
against the same modules on one process: outputs, losses, input and parameter gradients, and
parameters after SGD and AdamW steps; on tp=2 and on the tp dim of a 2x2 dp x tp mesh.

Covered: bias or not; ``use_local_output`` True/False; plain and DTensor inputs; sequence-parallel
input ``Shard(1)`` and output ``Shard(1)``; ``output_layouts=Replicate()``; the collectives
``comm_counter()`` sees (Megatron's count, and one backward all-reduce for q/k/v sharing an input).
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardprop import (ColwiseParallel, DTensor, Replicate, RowwiseParallel, Shard, comm_counter,
                       distribute_tensor, init_device_mesh, parallelize_module)
from shardprop.tensor.dtensor import local_chunk
from tests.rankpool import run_on_ranks

R = Replicate()
TOL = dict(atol=1e-5, rtol=1e-5)


class MLP(nn.Module):
    def __init__(self, bias=True):
        super().__init__()
        self.up = nn.Linear(8, 16, bias=bias)
        self.down = nn.Linear(16, 8, bias=bias)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class QKV(nn.Module):
    """Three column-parallel layers on one input, summed, then a row-parallel one."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(8, 16, bias=False) for _ in range(3))
        self.o = nn.Linear(16, 8, bias=False)

    def forward(self, x):
        return self.o(self.q(x) * self.k(x) + self.v(x))


class Doubled(nn.Linear):
    """A Linear subclass with a forward of its own: the styles keep the DTensor path for it."""

    def forward(self, x):
        return super().forward(x) * 2


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _dispatches() -> int:
    from shardprop.dispatch.dispatcher import call_counts
    return sum(call_counts().values())


def _counts(c):
    return {k: n for k, (n, _) in c.counts.items()}


def _compare(where, model, ref, x_in, x_full, local_of, grad_of_x, opt=None, steps=1):
    """Forward/backward both ``steps`` times (with an optimizer step after each when ``opt`` is given)."""
    opts = None
    if opt is not None:
        opts = (opt(model.parameters()), opt(ref.parameters()))
    for step in range(steps):
        xr = x_full.detach().clone()
        xr.requires_grad_(xr.is_floating_point())
        out, out_ref = model(x_in), ref(xr)
        want = local_of(out_ref)
        got = _full(out) if isinstance(out, DTensor) else out
        want = out_ref if isinstance(out, DTensor) else want
        torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{where} step {step}: output: {m}")
        g = torch.randn_like(out_ref)
        loss = (got * (g if isinstance(out, DTensor) else local_of(g))).sum()
        loss_ref = (out_ref * g).sum()
        loss.backward()
        loss_ref.backward()
        if step == 0 and grad_of_x is not None:
            torch.testing.assert_close(_full(grad_of_x()), grad_of_x.want(xr.grad), **TOL,
                                       msg=lambda m: f"{where}: input grad: {m}")
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            assert isinstance(p, DTensor) and isinstance(p, nn.Parameter), f"{where}: {name} not a DTensor Parameter"
            assert p.grad is not None and p.grad.placements == p.placements, \
                f"{where}: grad of {name}: {None if p.grad is None else p.grad.placements} vs {p.placements}"
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, **TOL,
                                       msg=lambda m: f"{where} step {step}: grad of {name}: {m}")
        if opts is None:
            return
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            torch.testing.assert_close(p.full_tensor(), q, **TOL, msg=lambda m: f"{where} step {step}: {name}: {m}")
        if x_in.is_floating_point() and x_in.grad is not None:
            x_in.grad = None


class _XGrad:
    """The input's gradient on this rank and what it must equal (a function of the full gradient)."""

    def __init__(self, x, want):
        self.x, self.want = x, want

    def __call__(self):
        return self.x.grad


def _cases(dp_mesh_shape):
    """Every case on the tp mesh (the 1-d mesh, or the tp dim of a 2x2 dp x tp mesh)."""
    if len(dp_mesh_shape) == 1:
        mesh = init_device_mesh("cpu", dp_mesh_shape)
        tp, dp_rank = mesh, 0
    else:
        mesh = init_device_mesh("cpu", dp_mesh_shape, mesh_dim_names=("dp", "tp"))
        tp, dp_rank = mesh["tp"], mesh.get_local_rank(0)
    n = tp.size()
    seq = lambda t: local_chunk(t, tp, [Shard(1)])  # noqa: E731
    same = lambda t: t  # noqa: E731
    counts = {}
    optims = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
              "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01)}

    two_d = len(dp_mesh_shape) == 2  # the tp dim of a 2x2 mesh: the main cases only (the 1-d run has them all)
    for bias in (True, False):
        for oname, opt in optims.items():
            if two_d and (oname == "sgd" or not bias):
                continue
            # Megatron MLP, plain replicated input.
            torch.manual_seed(0)
            ref = MLP(bias)
            model = parallelize_module(copy.deepcopy(ref), tp, {"up": ColwiseParallel(), "down": RowwiseParallel()})
            torch.manual_seed(10 + dp_rank)  # each dp group its own data
            x = torch.randn(2, 2 * n, 8)
            xin = x.clone().requires_grad_()
            _compare(f"MLP bias={bias} {oname}", model, ref, xin, x, same, _XGrad(xin, same), opt, steps=2)
            before = _dispatches()
            with comm_counter() as fwd:
                out = model(xin)
            # The fast path: local matmuls, no DTensor op in forward.
            assert _dispatches() == before, f"MLP forward dispatched DTensor ops: {_dispatches() - before}"
            with comm_counter() as bwd:
                out.sum().backward()
            counts[f"mlp bias={bias}"] = (_counts(fwd), _counts(bwd))

            # Sequence parallel: input Shard(1) in, output Shard(1) out, plain local tensors.
            torch.manual_seed(1)
            ref = MLP(bias)
            model = parallelize_module(copy.deepcopy(ref), tp, {"up": ColwiseParallel(input_layouts=Shard(1)),
                                                                "down": RowwiseParallel(output_layouts=Shard(1))})
            torch.manual_seed(20 + dp_rank)
            x = torch.randn(2, 2 * n, 8)
            xin = seq(x).requires_grad_()
            _compare(f"SP MLP bias={bias} {oname}", model, ref, xin, x, seq, _XGrad(xin, seq), opt, steps=2)
            with comm_counter() as fwd:
                out = model(xin)
            assert out.shape == (2, 2, 8), out.shape
            with comm_counter() as bwd:
                out.sum().backward()
            counts[f"sp bias={bias}"] = (_counts(fwd), _counts(bwd))

        if two_d:
            continue
        # Column-parallel with a replicated output (full logits), as a DTensor or a local tensor.
        for use_local in (True, False):
            torch.manual_seed(2)
            ref = nn.Linear(8, 4 * n, bias=bias)
            model = parallelize_module(copy.deepcopy(ref), tp, ColwiseParallel(output_layouts=R,
                                                                                use_local_output=use_local))
            x = torch.randn(3, 8)
            xin = x.clone().requires_grad_()
            _compare(f"colwise R out local={use_local} bias={bias}", model, ref, xin, x, same, _XGrad(xin, same))
            out = model(x)
            assert isinstance(out, DTensor) != use_local and out.shape == (3, 4 * n), (type(out), out.shape)
            if not use_local:
                assert out.placements == (R,), out.placements

        # Column-parallel default output (Shard(-1)) as a DTensor; row-parallel fed a DTensor Shard(-1).
        torch.manual_seed(3)
        ref = MLP(bias)
        model = parallelize_module(copy.deepcopy(ref), tp, {"up": ColwiseParallel(use_local_output=False),
                                                            "down": RowwiseParallel(use_local_output=False)})
        x = torch.randn(2, 3, 8)
        xin = x.clone().requires_grad_()
        _compare(f"DTensor outputs bias={bias}", model, ref, xin, x, same, _XGrad(xin, same))
        mid = model.up(x)
        assert isinstance(mid, DTensor) and mid.placements == (Shard(2),), mid
        out = model(x)
        assert isinstance(out, DTensor) and out.placements == (R,), out

        # DTensor inputs: replicated, and sequence-sharded (redistributed inside the layer).
        for placement in (R, Shard(1)):
            torch.manual_seed(4)
            ref = MLP(bias)
            model = parallelize_module(copy.deepcopy(ref), tp, {"up": ColwiseParallel(), "down": RowwiseParallel()})
            x = torch.randn(2, 2 * n, 8)
            xin = distribute_tensor(x, tp, [placement]).requires_grad_()
            _compare(f"DTensor input {placement} bias={bias}", model, ref, xin, x, same,
                     _XGrad(xin, same))

    # Row-parallel fed a replicated plain input (it takes its own slice), output Shard(1).
    torch.manual_seed(5)
    ref = nn.Linear(4 * n, 8)
    model = parallelize_module(copy.deepcopy(ref), tp, RowwiseParallel(input_layouts=R, output_layouts=Shard(1)))
    x = torch.randn(2, 2 * n, 4 * n)
    xin = x.clone().requires_grad_()
    _compare("rowwise R in, S(1) out", model, ref, xin, x, seq, _XGrad(xin, same))

    # q, k, v on one input: one backward all-reduce for the three.
    torch.manual_seed(6)
    ref = QKV()
    model = parallelize_module(copy.deepcopy(ref), tp, {"q": ColwiseParallel(), "k": ColwiseParallel(),
                                                        "v": ColwiseParallel(), "o": RowwiseParallel()})
    x = torch.randn(2, 3, 8)
    xin = x.clone().requires_grad_()
    _compare("qkv", model, ref, xin, x, same, _XGrad(xin, same), optims["adamw"], steps=2)
    with comm_counter() as fwd:
        out = model(xin)
    with comm_counter() as bwd:
        out.sum().backward()
    counts["qkv"] = (_counts(fwd), _counts(bwd))
    with torch.no_grad():  # no autograd: no shared input kept, same values
        torch.testing.assert_close(model(x), ref(x), **TOL)

    # Embeddings: vocabulary-sharded (uneven: 5 * n + 1 rows) into Shard(1) or Replicate, and
    # dim-sharded (default Shard(-1) out, and Replicate).
    for style, local_of in ((RowwiseParallel(input_layouts=R, output_layouts=Shard(1)), seq),
                            (RowwiseParallel(), same),
                            (ColwiseParallel(), lambda t: local_chunk(t, tp, [Shard(2)])),
                            (ColwiseParallel(output_layouts=R, use_local_output=False), same)):
        torch.manual_seed(8)
        ref = nn.Embedding(5 * n + 1 if isinstance(style, RowwiseParallel) else 11, 4 * n)
        model = parallelize_module(copy.deepcopy(ref), tp, style)
        ids = torch.randint(0, ref.num_embeddings, (2, 2 * n))
        _compare(f"embedding {style}", model, ref, ids, ids, local_of, None, optims["adamw"], steps=2)
        before = _dispatches()
        model(ids)
        assert _dispatches() == before, f"embedding {style}: the DTensor path ran"

    # Layouts the fast path leaves to the DTensor path: a subclass's own forward; a row-parallel bias
    # under a feature-sharded output.
    torch.manual_seed(7)
    ref = nn.Sequential(Doubled(8, 16), nn.ReLU(), nn.Linear(16, 4 * n))
    model = parallelize_module(copy.deepcopy(ref), tp, {"0": ColwiseParallel(),
                                                        "2": RowwiseParallel(output_layouts=Shard(-1))})
    x = torch.randn(3, 8)
    xin = x.clone().requires_grad_()
    _compare("subclass forward; rowwise bias, S(-1) out", model, ref, xin, x,
             lambda t: local_chunk(t, tp, [Shard(1)]), _XGrad(xin, same))
    return counts


# 2x2 is slow here; tests/test_tp_model.py checks the styled model on 2x2 (fast path included) in CI.
@pytest.mark.parametrize("shape", [(2,), pytest.param((2, 2), marks=pytest.mark.slow)], ids=["tp2", "dp2xtp2"])
def test_fused_linear_matches_single_process(shape):
    world = 1
    for s in shape:
        world *= s
    counts = run_on_ranks(world, _cases, shape)[0]
    ar1 = ({"all_reduce": 1}, {"all_reduce": 1})
    sp = ({"all_gather": 1, "reduce_scatter": 1}, {"all_gather": 1, "reduce_scatter": 1})
    # The replicated bias of a sequence-sharded row-parallel output: each rank's gradient covers its
    # sequence piece, so one all-reduce more.
    sp_bias = (sp[0], dict(sp[1], all_reduce=1))
    want = {"mlp bias=True": ar1, "mlp bias=False": ar1, "sp bias=True": sp_bias, "sp bias=False": sp, "qkv": ar1}
    if len(shape) == 2:
        want = {k: v for k, v in want.items() if "False" not in k}
    assert counts == want, counts


def _compiled_fallback():
    """Under torch.compile the styled Linear traces (the DTensor path) with no graph break."""
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    ref = MLP()
    model = parallelize_module(copy.deepcopy(ref), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    x = torch.randn(2, 3, 8)
    out = torch.compile(model, backend="eager", fullgraph=True)(x)
    torch.testing.assert_close(out, ref(x), **TOL)
    return True


def test_compiled_styled_linear_has_no_graph_break():
    assert run_on_ranks(2, _compiled_fallback) == [True, True]


def _param_grad_handover():
    """Styled parameters' gradients: hooks still run, backward(inputs=...) and accumulation as autograd does."""
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    ref = MLP()
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel(output_layouts=Shard(1))}
    model = parallelize_module(copy.deepcopy(ref), mesh, plan)
    seq = lambda t: local_chunk(t, mesh, [Shard(1)])  # noqa: E731
    x = torch.randn(2, 4, 8)
    g = torch.randn(2, 4, 8)

    def backward(**kw):
        (model(x) * seq(g)).sum().backward(**kw)
        (ref(x) * g).sum().backward(**kw)

    # A user's tensor hook on a weight and a post-accumulate hook on a bias: both see the gradient.
    seen = {}

    def hook(t):
        seen["hook"] = t.full_tensor()

    def post(p):
        seen["post"] = p.grad.full_tensor()
    model.up.weight.register_hook(hook)
    model.down.bias.register_post_accumulate_grad_hook(post)
    backward()
    torch.testing.assert_close(seen["hook"], ref.up.weight.grad, **TOL)
    torch.testing.assert_close(seen["post"], ref.down.bias.grad, **TOL)
    # Accumulation into existing gradients (the second backward adds).
    backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert p.grad.placements == p.placements, (name, p.grad.placements)
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, **TOL, msg=lambda m: f"accumulated {name}: {m}")
    # backward(inputs=...): only the named parameters get gradients.
    model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    (model(x) * seq(g)).sum().backward(inputs=[model.down.weight, model.down.bias])
    (ref(x) * g).sum().backward(inputs=[ref.down.weight, ref.down.bias])
    assert model.up.weight.grad is None and model.up.bias.grad is None
    torch.testing.assert_close(model.down.weight.grad.full_tensor(), ref.down.weight.grad, **TOL)
    torch.testing.assert_close(model.down.bias.grad.full_tensor(), ref.down.bias.grad, **TOL)
    return True


def test_param_gradient_handover():
    assert run_on_ranks(2, _param_grad_handover) == [True, True]


def _autocast_mlp():
    """Colwise -> Rowwise MLP with biases under CPU autocast (bf16): dtype, output and gradients
    as one process under the same autocast (F.linear casts weight, input and bias alike)."""
    torch.manual_seed(0)
    ref = MLP(bias=True)
    model = parallelize_module(copy.deepcopy(ref), init_device_mesh("cpu", (2,)),
                               {"up": ColwiseParallel(), "down": RowwiseParallel()})
    x = torch.randn(4, 8)
    errors = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = ref(x)
        got = _full(model(x))
    if got.dtype != want.dtype:
        errors.append(f"dtype {got.dtype}, one process gives {want.dtype}")
    else:
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    want.float().sum().backward()
    got.float().sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if _full(p.grad).dtype != q.grad.dtype:
            errors.append(f"grad {name}: {_full(p.grad).dtype} vs {q.grad.dtype}")
        else:
            torch.testing.assert_close(_full(p.grad), q.grad, atol=5e-2, rtol=5e-2)
    return errors


def test_autocast_bf16_output_dtype_matches_one_process():
    assert run_on_ranks(2, _autocast_mlp) == [[], []]
