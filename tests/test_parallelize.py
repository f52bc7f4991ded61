"""Tensor parallelism: distribute_module, parallelize_module and the parallel styles, against
the same modules on one device (outputs, input and parameter gradients, one SGD step).

Every rank builds the same module from the same seed; a deep copy is the single-device
reference. Cases are batched so each test is one round trip to the rank pool.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardprop import (ColwiseParallel, DTensor, PrepareModuleInput, PrepareModuleOutput, Replicate,
                       RowwiseParallel, SequenceParallel, Shard, comm_counter, distribute_module, distribute_tensor,
                       init_device_mesh, parallelize_module)
from shardprop.tensor.dtensor import local_chunk
from shardprop.parallel.tp.parallelize import match_submodules
from tests.rankpool import run_on_ranks

R = Replicate()
ATOL = dict(atol=1e-5, rtol=1e-5)


class MLP(nn.Module):
    def __init__(self, dim=8, hidden=16, bias=True):
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=bias)
        self.down = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = MLP(dim)

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Stack(nn.Module):
    def __init__(self, n=3, dim=8):
        super().__init__()
        self.layers = nn.ModuleList(Block(dim) for _ in range(n))
        self.head = nn.Linear(dim, 4)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


# ---------------------------------------------------------------- rank-side helpers
def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _check_grads(model, ref, where, all_distributed=True):
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert isinstance(p, nn.Parameter), f"{where}: {name} is not an nn.Parameter"
        assert p.grad is not None, f"{where}: {name} has no gradient"
        if all_distributed or isinstance(p, DTensor):
            assert isinstance(p, DTensor), f"{where}: {name} is not a DTensor"
            assert p.grad.placements == p.placements, f"{where}: {name} grad {p.grad.placements} vs {p.placements}"
        torch.testing.assert_close(_full(p.grad), q.grad, **ATOL, msg=lambda m: f"{where}: grad of {name}: {m}")


def _sgd_step_matches(model, ref, where):
    opt, opt_ref = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    before = {n: p for n, p in model.named_parameters()}
    opt.step()
    opt_ref.step()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert p is before[name], f"{where}: {name} was replaced, not updated in place"
        torch.testing.assert_close(p.full_tensor(), q, **ATOL, msg=lambda m: f"{where}: {name} after SGD: {m}")


def _run_pair(model, ref, x, where, out_full=_full):
    """Forward and backward both; compare outputs, input grads, parameter grads and one SGD step."""
    xr = x.detach().clone().requires_grad_()
    x = x.detach().clone().requires_grad_()
    out, out_ref = model(x), ref(xr)
    torch.testing.assert_close(out_full(out), out_ref, **ATOL, msg=lambda m: f"{where}: output: {m}")
    g = torch.randn_like(out_ref)
    (out_full(out) * g).sum().backward()
    (out_ref * g).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, **ATOL, msg=lambda m: f"{where}: input grad: {m}")
    _check_grads(model, ref, where)
    _sgd_step_matches(model, ref, where)


# ---------------------------------------------------------------- MLP
def _mlp_cases(tp):
    mesh = init_device_mesh("cpu", (tp,))
    for bias in (True, False):
        torch.manual_seed(0)
        model = MLP(bias=bias)
        ref = copy.deepcopy(model)
        parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
        assert model.up.weight.placements == (Shard(0),) and model.down.weight.placements == (Shard(1),)
        assert model.up.weight.to_local().shape == (16 // tp, 8), "colwise weight is not row-sharded"
        if bias:
            assert model.up.bias.placements == (Shard(0),) and model.down.bias.placements == (R,)
        _run_pair(model, ref, torch.randn(2, 3, 8), f"MLP tp={tp} bias={bias}")
        # Megatron's count: one all-reduce forward (the row-wise output), one backward (the input grad).
        x = torch.randn(2, 3, 8, requires_grad=True)
        with comm_counter() as fwd:
            out = model(x)
        with comm_counter() as bwd:
            out.sum().backward()
        kinds = (fwd.counts, bwd.counts)
        assert [{k: n for k, (n, _) in c.items()} for c in kinds] == [{"all_reduce": 1}] * 2, f"bias={bias}: {kinds}"

    # Sequence-parallel entry and exit: input sharded on dim 1, output reduce-scattered onto it.
    torch.manual_seed(1)
    model = MLP()
    ref = copy.deepcopy(model)
    parallelize_module(model, mesh, {"up": ColwiseParallel(input_layouts=Shard(1)),
                                     "down": RowwiseParallel(output_layouts=Shard(1))})
    x = torch.randn(2, 4 * tp, 8)
    local_x = local_chunk(x, mesh, [Shard(1)]).requires_grad_()
    out = model(local_x)
    assert not isinstance(out, DTensor) and out.shape == (2, 4, 8), f"sequence-sharded output {out.shape}"
    torch.testing.assert_close(out, local_chunk(ref(x), mesh, [Shard(1)]), **ATOL)


@pytest.mark.parametrize("tp", [2, 4])
def test_mlp_colwise_rowwise_matches_single_device(tp):
    run_on_ranks(tp, _mlp_cases, tp)


# ---------------------------------------------------------------- embedding, norms, prepare styles, wildcards
def _embedding_cases():
    mesh = init_device_mesh("cpu", (4,))
    torch.manual_seed(5)  # the same ids on every rank
    ids = torch.randint(0, 10, (2, 5))

    # Row-wise (vocab-sharded) embedding, vocab 10 uneven over 4 ranks: Partial lookup, all-reduced.
    torch.manual_seed(0)
    emb = nn.Embedding(10, 8)
    ref = copy.deepcopy(emb)
    parallelize_module(emb, mesh, RowwiseParallel())
    assert emb.weight.placements == (Shard(0),)
    out = emb(ids)
    assert not isinstance(out, DTensor)
    torch.testing.assert_close(out, ref(ids))
    g = torch.randn(2, 5, 8)
    (out * g).sum().backward()
    (ref(ids) * g).sum().backward()
    _check_grads(emb, ref, "rowwise embedding")

    # Row-wise embedding straight into sequence parallelism: reduce-scatter onto the sequence dim.
    torch.manual_seed(0)
    emb = nn.Embedding(10, 8)
    ref = copy.deepcopy(emb)
    parallelize_module(emb, mesh, RowwiseParallel(output_layouts=Shard(1), use_local_output=False))
    ids8 = torch.randint(0, 10, (2, 8))
    out = emb(ids8)
    assert out.placements == (Shard(1),), out.placements
    torch.testing.assert_close(out.full_tensor(), ref(ids8))

    # Column-wise embedding: the embedding dim is sharded.
    torch.manual_seed(0)
    emb = nn.Embedding(10, 8)
    ref = copy.deepcopy(emb)
    parallelize_module(emb, mesh, ColwiseParallel(use_local_output=False))
    assert emb.weight.placements == (Shard(1),)
    out = emb(ids)
    assert out.placements == (Shard(2),), out.placements
    (out.full_tensor() * g).sum().backward()
    (ref(ids) * g).sum().backward()
    torch.testing.assert_close(out.full_tensor(), ref(ids))
    _check_grads(emb, ref, "colwise embedding")



def _sequence_parallel_cases():
    mesh = init_device_mesh("cpu", (4,))
    # SequenceParallel norms: a plain input is this rank's piece of the sequence.
    for make in (lambda: nn.LayerNorm(6), lambda: nn.RMSNorm(6), lambda: nn.Dropout(0.0)):
        torch.manual_seed(0)
        norm = make()
        with torch.no_grad():
            for p in norm.parameters():
                p.add_(torch.randn_like(p))
        ref = copy.deepcopy(norm)
        parallelize_module(norm, mesh, SequenceParallel())
        x = torch.randn(2, 8, 6, requires_grad=True)
        local_x = local_chunk(x.detach(), mesh, [Shard(1)]).requires_grad_()
        out = norm(local_x)
        assert isinstance(out, DTensor) and out.placements == (Shard(1),), f"{norm}: {out.placements}"
        out_ref = ref(x)
        torch.testing.assert_close(out.full_tensor(), out_ref, **ATOL)
        gy = torch.randn(2, 8, 6)
        (out.to_local() * local_chunk(gy, mesh, [Shard(1)])).sum().backward()
        (out_ref * gy).sum().backward()
        torch.testing.assert_close(local_x.grad, local_chunk(x.grad, mesh, [Shard(1)]), **ATOL)
        if list(norm.parameters()):
            _check_grads(norm, ref, f"SequenceParallel {type(norm).__name__}")



def _prepare_and_wildcard_cases():
    mesh = init_device_mesh("cpu", (4,))
    # PrepareModuleInput (positional and keyword) and PrepareModuleOutput.
    class Scale(nn.Module):
        def forward(self, x, factor, *, shift=None):
            assert not isinstance(x, DTensor) and x.shape == (4, 8), f"module saw {type(x).__name__} {x.shape}"
            return x * factor + shift

    mod = Scale()
    parallelize_module(mod, mesh, PrepareModuleInput(
        input_layouts=(Shard(1), None), desired_input_layouts=(R, None),
        input_kwarg_layouts={"shift": Shard(0)}, desired_input_kwarg_layouts={"shift": R}, use_local_output=True))
    x, shift = torch.randn(4, 8), torch.randn(4, 8)
    out = mod(local_chunk(x, mesh, [Shard(1)]), 3.0, shift=local_chunk(shift, mesh, [Shard(0)]))
    torch.testing.assert_close(out, x * 3.0 + shift)

    lin = nn.Linear(8, 8)
    ref = copy.deepcopy(lin)
    parallelize_module(lin, mesh, {"": ColwiseParallel(output_layouts=R, use_local_output=False)})  # "" = itself
    parallelize_module(lin, mesh, PrepareModuleOutput(output_layouts=R, desired_output_layouts=Shard(0)))
    x = torch.randn(8, 8)
    out = lin(x)
    torch.testing.assert_close(out, local_chunk(ref(x), mesh, [Shard(0)]), **ATOL)

    # Wildcard plan keys over a stack of blocks; the norms stay plain (replicated) modules.
    torch.manual_seed(0)
    model = Stack()
    ref = copy.deepcopy(model)
    parallelize_module(model, mesh, {"layers.*.mlp.up": ColwiseParallel(),
                                     "layers.*.mlp.down": RowwiseParallel(use_local_output=False)})
    for i in range(3):
        assert model.layers[i].mlp.up.weight.placements == (Shard(0),), f"layer {i} not sharded"
    distribute_module(model, mesh)  # everything else replicated
    assert model.head.weight.placements == (R,) and model.layers[0].norm.weight.placements == (R,)

    def rep_in(mod, inputs, mesh):
        return tuple(DTensor.from_local(x, mesh, [R]) for x in inputs)

    model.layers[0].register_forward_pre_hook(lambda mod, inputs: rep_in(mod, inputs, mesh))
    _run_pair(model, ref, torch.randn(2, 3, 8), "wildcard stack")


@pytest.mark.parametrize("cases", [_embedding_cases, _sequence_parallel_cases, _prepare_and_wildcard_cases],
                         ids=["embedding", "sequence_parallel", "prepare_and_wildcards"])
def test_layers(cases):
    run_on_ranks(4, cases)


# ---------------------------------------------------------------- distribute_module
def _distribute_module_cases():
    mesh = init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 4))
    model.eval()
    ref = copy.deepcopy(model)
    seen = []

    def partition(name, mod, mesh):
        seen.append(name)
        if isinstance(mod, nn.Linear):
            mod.weight = nn.Parameter(distribute_tensor(mod.weight.detach(), mesh, [Shard(0)]))

    def input_fn(mod, inputs, mesh):
        return tuple(DTensor.from_local(x, mesh, [R]) for x in inputs)

    def output_fn(mod, outputs, mesh):
        return outputs.full_tensor()

    distribute_module(model, mesh, partition, input_fn, output_fn)
    assert seen == ["", "0", "1", "2"], seen
    assert model[0].weight.placements == (Shard(0),) and model[0].bias.placements == (R,)
    assert isinstance(model[1].running_mean, DTensor), "buffers are not DTensors"
    names = [n for n, _ in model.named_parameters()]
    assert names == [n for n, _ in ref.named_parameters()], names
    x = torch.randn(5, 8)
    out = model(x)
    assert not isinstance(out, DTensor)
    torch.testing.assert_close(out, ref(x), **ATOL)
    out.sum().backward()
    ref(x).sum().backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, **ATOL, msg=lambda m: f"{name}: {m}")
    _sgd_step_matches(model, ref, "distribute_module")


def test_distribute_module():
    run_on_ranks(4, _distribute_module_cases)


# ---------------------------------------------------------------- errors
def _error_cases():
    mesh = init_device_mesh("cpu", (4,))
    got = {}

    def expect(tag, fn, *needles):
        try:
            fn()
        except ValueError as e:
            msg = str(e)
            missing = [n for n in needles if n not in msg]
            assert not missing, f"{tag}: message lacks {missing}: {msg}"
            got[tag] = msg
            return
        raise AssertionError(f"{tag}: no ValueError")

    expect("no match", lambda: parallelize_module(Stack(), mesh, {"layers.*.mlp.gate": ColwiseParallel()},
                                                  strict=True),  # (the default warns, as torch does)
           "layers.*.mlp.gate", "ColwiseParallel", "matches no submodule")
    expect("bad type", lambda: parallelize_module(Block(), mesh, {"norm": ColwiseParallel()}),
           "ColwiseParallel", "'norm'", "LayerNorm", "nn.Linear")
    expect("bad type rowwise", lambda: parallelize_module(Block(), mesh, {"mlp": RowwiseParallel()}),
           "RowwiseParallel", "'mlp'", "MLP")
    # A dim tp does not divide is no error (as in torch): pieces in torch.chunk order, 6 over 4 -> 2, 2, 2, 0.
    # tests/test_uneven_tp.py covers every style; here the MLP that used to raise.
    torch.manual_seed(0)
    model = MLP(8, 6)
    ref = copy.deepcopy(model)
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    want = (2, 2, 2, 0)[mesh.get_local_rank()]
    assert model.up.weight.to_local().shape == (want, 8) and model.down.weight.to_local().shape == (8, want)
    _run_pair(model, ref, torch.randn(3, 8), "uneven hidden dim 6 over 4")
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    expect("2-d mesh", lambda: parallelize_module(MLP(), mesh2, {"up": ColwiseParallel()}), "1-d mesh", 'mesh["tp"]')
    # The tp sub-mesh of a 2-d mesh is accepted, and a model on it matches single device.
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    parallelize_module(model, mesh2["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    _run_pair(model, ref, torch.randn(3, 8), "tp sub-mesh of 2x2")
    return sorted(got)


def test_errors():
    tags = run_on_ranks(4, _error_cases)[0]
    assert len(tags) == 4, tags


def test_match_submodules_wildcards():
    model = Stack()
    names = lambda key: [n for n, _ in match_submodules(model, key)]
    assert names("layers.*.mlp.up") == ["layers.0.mlp.up", "layers.1.mlp.up", "layers.2.mlp.up"]
    assert names("layers.1.*") == ["layers.1.norm", "layers.1.mlp"]
    assert names("layers.*.mlp.*") == [f"layers.{i}.mlp.{w}" for i in range(3) for w in ("up", "down")]
    assert names("head") == ["head"]
    assert names("layers.?.norm") == [f"layers.{i}.norm" for i in range(3)]
    assert names("layers.*.attention") == []


# ---------------------------------------------------------------- a small Llama-style model, the documented plans
class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x, scale):
        b, s, _ = x.shape
        # -1 heads: each rank holds heads // tp of them under tensor parallelism.
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return self.wo(a.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Layer(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attention, self.feed_forward = Attention(dim, heads), FeedForward(dim, 2 * dim)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x), 0.5)
        return x + self.feed_forward(self.ffn_norm(x))


class TinyLM(nn.Module):
    def __init__(self, vocab=20, dim=16, heads=4, layers=2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Layer(dim, heads) for _ in range(layers))
        self.norm, self.output = nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def _tp_plan(sequence_parallel):
    if not sequence_parallel:
        return {"tok_embeddings": RowwiseParallel(input_layouts=R),
                "layers.*.attention.w[qkv]": ColwiseParallel(), "layers.*.attention.wo": RowwiseParallel(),
                "layers.*.feed_forward.w[13]": ColwiseParallel(), "layers.*.feed_forward.w2": RowwiseParallel(),
                "output": ColwiseParallel(use_local_output=False)}
    gather = dict(desired_input_layouts=(R,), use_local_output=True)
    return {"tok_embeddings": RowwiseParallel(input_layouts=R, output_layouts=Shard(1)),
            "layers.*.attention_norm": SequenceParallel(),
            "layers.*.attention": PrepareModuleInput(input_layouts=(Shard(1), None),
                                                     desired_input_layouts=(R, None), use_local_output=True),
            "layers.*.attention.w[qkv]": ColwiseParallel(),
            "layers.*.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "layers.*.ffn_norm": SequenceParallel(),
            "layers.*.feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), **gather),
            "layers.*.feed_forward.w[13]": ColwiseParallel(),
            "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), use_local_output=False)}


def _tiny_lm_cases(sequence_parallel):
    from shardprop import loss_parallel
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"]
    torch.manual_seed(0)
    model = TinyLM()
    ref = copy.deepcopy(model)
    parallelize_module(model, mesh, _tp_plan(sequence_parallel))
    # Without sequence parallelism the norms stay plain modules on plain (replicated) activations.
    tokens = torch.randint(0, 20, (2, 8))
    targets = torch.roll(tokens, -1, 1)
    opt, opt_ref = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(2):
        logits = model(tokens)
        assert logits.placements == (Shard(2),), logits.placements
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            loss.backward()
        ref_loss = F.cross_entropy(ref(tokens).flatten(0, 1), targets.flatten())
        ref_loss.backward()
        torch.testing.assert_close(loss.full_tensor(), ref_loss, **ATOL, msg=lambda m: f"step {step} loss: {m}")
        _check_grads(model, ref, f"TinyLM sp={sequence_parallel} step {step}", all_distributed=sequence_parallel)
        opt.step(), opt_ref.step(), opt.zero_grad(), opt_ref.zero_grad()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(_full(p), q, **ATOL, msg=lambda m: f"{name} after AdamW: {m}")


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp_sp"])
def test_tiny_lm_plans_match_single_device(sequence_parallel):
    run_on_ranks(4, _tiny_lm_cases, sequence_parallel)
