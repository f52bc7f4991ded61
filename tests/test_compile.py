"""torch.compile over shardprop DTensors, on real gloo ranks, against plain torch on one process.

Every case compiles on each rank and compares outputs and gradients with the same
model run eagerly on full tensors (each rank builds that reference itself):

- the AOT graph of a ColwiseParallel -> RowwiseParallel MLP holds exactly one
  ``_c10d_functional.all_reduce`` + ``wait_tensor`` forward, no collective backward
  (its input needs no gradient) and no DTensor anywhere; inductor runs it too;
- from_local / distribute_tensor / redistribute / to_local / full_tensor in one ``fullgraph=True`` function;
- the demo Llama with each transformer block compiled ``fullgraph=True`` (``eager`` backend),
  and the whole model under ``aot_eager`` with no graph break at all;
- dynamic shapes: a new batch size (MLP) or sequence length (the demo model: slow, SHARDPROP_SLOW=1)
  reuses the graph (no recompile);
- an op with no rule raises the ShardingError message while tracing;
- dropout in a compiled block reproduces the single-process eager run;
- 2x2 dp x tp: the whole model compiled, gradients averaged over dp by the bucket hooks.

Compiles dominate the time (2 cores): one ``run_on_ranks`` call per group of cases.
"""
import pytest
import torch

from tests.rankpool import run_on_ranks

pytestmark = pytest.mark.timeout(300)

ATOL, RTOL = 1e-5, 1e-4


def _close(errors, name, got, want):
    got = got.full_tensor() if hasattr(got, "full_tensor") else got
    try:
        torch.testing.assert_close(got.detach(), want.detach(), atol=ATOL, rtol=RTOL)
    except AssertionError as e:
        errors.append(f"{name}: {str(e).splitlines()[0]}")


def _grads(errors, prefix, model, ref):
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        name = name.replace("_orig_mod.", "")
        if p.grad is None:
            errors.append(f"{prefix} grad {name}: None")
        else:
            _close(errors, f"{prefix} grad {name}", p.grad, ref_params[name].grad)


class _MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _capture():
    """An aot_eager-like backend that keeps the forward and backward graphs it compiles."""
    from torch._dynamo.backends.common import aot_autograd
    from functorch.compile import make_boxed_func
    graphs = {"fw": [], "bw": []}

    def keep(kind):
        def compiler(gm, example_inputs):
            graphs[kind].append(gm)
            return make_boxed_func(gm.forward)
        return compiler
    return aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw")), graphs


def _collectives(gm):
    return [str(n.target) for n in gm.graph.nodes
            if n.op == "call_function" and "_c10d_functional" in str(n.target)]


def _dtensor_nodes(gm):
    """Nodes whose target or value is a DTensor (a desugared graph has none)."""
    from shardprop import DTensor
    bad = []
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        vals = val if isinstance(val, (list, tuple)) else [val]
        if any(isinstance(v, DTensor) for v in vals) or "shardprop" in str(n.target):
            bad.append(n.format_node())
    return bad


def _tp_mlp_pair():
    """A fresh dynamo, a 2-rank mesh, a plain MLP and its Colwise -> Rowwise copy with the same weights."""
    import shardprop as sp
    torch._dynamo.reset()
    mesh = sp.init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    ref = _MLP()
    model = _MLP()
    model.load_state_dict(ref.state_dict())
    sp.parallelize_module(model, mesh, {"up": sp.ColwiseParallel(), "down": sp.RowwiseParallel()})
    return mesh, ref, model


def _mlp_cases(with_inductor):
    mesh, ref, model = _tp_mlp_pair()
    errors = []
    backend, graphs = _capture()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    x = torch.randn(4, 8)
    out = compiled(x)
    out.sum().backward()
    want = ref(x)
    want.sum().backward()
    _close(errors, "mlp out", out, want)
    _grads(errors, "mlp", model, ref)
    fw, bw = graphs["fw"], graphs["bw"]
    if len(fw) != 1 or len(bw) != 1:
        errors.append(f"expected one forward and one backward graph, got {len(fw)} and {len(bw)}")
    else:
        got = _collectives(fw[0])
        want_c = ["_c10d_functional.all_reduce.default", "_c10d_functional.wait_tensor.default"]
        if got != want_c:
            errors.append(f"forward collectives {got}, expected {want_c}")
        if _collectives(bw[0]):
            errors.append(f"backward collectives {_collectives(bw[0])}, expected none")
        bad = _dtensor_nodes(fw[0]) + _dtensor_nodes(bw[0])
        if bad:
            errors.append(f"DTensor left in the AOT graphs: {bad[:3]}")
        ar = [n for n in fw[0].graph.nodes if "all_reduce" in str(n.target)]
        if ar and ar[0].args[2] != mesh.get_group(0).group_name:
            errors.append(f"all_reduce names group {ar[0].args[2]!r}, not the tp group")
    if with_inductor:
        model.zero_grad()
        ref.zero_grad()
        fast = torch.compile(model, backend="inductor", fullgraph=True)
        x = torch.randn(6, 8)
        out = fast(x)
        out.sum().backward()
        want = ref(x)
        want.sum().backward()
        _close(errors, "inductor out", out, want)
        _grads(errors, "inductor", model, ref)
    return errors


def _conversions():
    """from_local, distribute_tensor, redistribute (gather, reduce-scatter, all-to-all, uneven), to_local,
    full_tensor in one graph."""
    import shardprop as sp
    from shardprop import Partial, Replicate, Shard
    torch._dynamo.reset()
    mesh = sp.init_device_mesh("cpu", (2,))
    rank = torch.distributed.get_rank()
    errors = []
    torch.manual_seed(0)
    full = torch.randn(4, 6, requires_grad=True)
    w = torch.randn(6, 6)

    def fn(local, w):
        x = sp.DTensor.from_local(local, mesh, [Shard(0)])          # rows split
        d = sp.distribute_tensor(w, mesh, [Shard(1)])                 # rank 0's w, columns split
        w = d.redistribute(placements=[Replicate()]).to_local()       # all-gather: w again
        y = x.redistribute(placements=[Replicate()])                  # all-gather
        p = sp.DTensor.from_local(y.to_local() @ w, mesh, [Partial()])  # each rank a partial sum
        s = p.redistribute(placements=[Shard(1)])                     # reduce-scatter
        t = s.redistribute(placements=[Shard(0)])                     # all-to-all
        u = sp.DTensor.from_local(local[:, :5], mesh, [Shard(0)]).redistribute(placements=[Shard(1)])
        return s.full_tensor().sin().sum() + t.full_tensor().cos().sum(), s.to_local(), u.full_tensor()

    local = full.detach()[2 * rank:2 * rank + 2].clone().requires_grad_(True)
    loss, shard, uneven = torch.compile(fn, backend="aot_eager", fullgraph=True)(local, w)
    loss.backward()
    full_w = full @ w * 2  # two partial sums of the same product
    _close(errors, "loss", loss, full_w.sin().sum() + full_w.cos().sum())
    _close(errors, "shard", shard, full_w[:, 3 * rank:3 * rank + 3])
    _close(errors, "uneven all-to-all (5 columns over 2 ranks)", uneven, full[:, :5])
    # Gradients follow DTensor's rules (a Replicate to_local's gradient is not summed over the
    # ranks that used it): the oracle is the same function run eagerly.
    eager_local = local.detach().clone().requires_grad_(True)
    fn(eager_local, w)[0].backward()
    _close(errors, "grad of the local rows", local.grad, eager_local.grad)
    # The tangent protocol AOTAutograd calls on incoming gradients: Partial becomes Replicate.
    p = sp.DTensor.from_local(torch.full((2, 3), float(rank + 1)), mesh, [Partial()])
    t = p.__coerce_tangent_metadata__()
    if tuple(t.placements) != (Replicate(),):
        errors.append(f"tangent coerced to {t.placements}, expected [R]")
    _close(errors, "coerced tangent", t.to_local(), torch.full((2, 3), 3.0))
    s1 = sp.DTensor.from_local(torch.ones(2, 3), mesh, [Replicate()])
    same = s1.__coerce_same_metadata_as_tangent__(s1.__tensor_flatten__()[1])
    if tuple(same.placements) != (Replicate(),):
        errors.append(f"coerce_same_metadata_as_tangent gave {same.placements}")
    return errors


def _demo_model(cfg):
    import shardprop as sp
    from shardprop.demo.model import Llama, tp_plan
    mesh = sp.init_device_mesh("cpu", (2,))
    return sp.parallelize_module(Llama(cfg, 0), mesh, tp_plan()), Llama(cfg, 0)


def _blocks_and_whole():
    """Each block compiled fullgraph (eager backend); then the whole model under aot_eager."""
    from torch._dynamo.utils import counters
    from shardprop.demo.model import LlamaConfig, lm_loss, synthetic_batch
    errors = []
    cfg = LlamaConfig(dim=32, n_layers=2, n_heads=4, vocab_size=64, seq_len=8)
    tokens, targets = synthetic_batch(cfg, 3, 0)

    torch._dynamo.reset()
    model, ref = _demo_model(cfg)
    for i, layer in enumerate(model.layers):
        model.layers[i] = torch.compile(layer, backend="eager", fullgraph=True)
    loss = lm_loss(model(tokens), targets)
    loss.backward()
    want = lm_loss(ref(tokens), targets)
    want.backward()
    _close(errors, "blocks loss", loss, want)
    _grads(errors, "blocks", model, ref)

    torch._dynamo.reset()
    counters.clear()
    model, ref = _demo_model(cfg)
    backend, graphs = _capture()
    compiled = torch.compile(model, backend=backend)
    loss = lm_loss(compiled(tokens), targets)
    loss.backward()
    want = lm_loss(ref(tokens), targets)
    want.backward()
    _close(errors, "whole-model loss", loss, want)
    _grads(errors, "whole model", model, ref)
    if counters["graph_break"]:
        errors.append(f"graph breaks in the whole model: {dict(counters['graph_break'])}")
    if counters["stats"]["unique_graphs"] != 1:
        errors.append(f"{counters['stats']['unique_graphs']} graphs for the whole model, expected 1")
    errors += _plan_collectives(graphs, cfg.n_layers)
    return errors


def _plan_collectives(graphs, n_layers):
    """The collectives tp_plan needs, counted from the plan: forward, per block two gathers (attention
    and MLP inputs) and two reduce-scatters (their outputs), plus the embedding's reduce-scatter and the
    output's input and logits gathers; backward, each gather's gradient reduce-scatters once (the
    gradients of q, k, v or w1, w3 add up first, Partial, then one reduce-scatter) and each
    reduce-scatter's gradient gathers; the logits gather's gradient is a local slice. No all-reduce."""
    from collections import Counter

    def count(gms):
        c = Counter(str(n.target).split(".")[1] for gm in gms for n in gm.graph.nodes
                    if n.op == "call_function" and "_c10d_functional" in str(n.target))
        c.pop("wait_tensor", None)
        return dict(c)
    gathers, scatters = 2 * n_layers + 2, 2 * n_layers + 1
    want = {"fw": {"all_gather_into_tensor": gathers, "reduce_scatter_tensor": scatters},
            "bw": {"reduce_scatter_tensor": gathers - 1, "all_gather_into_tensor": scatters}}
    return [f"whole model {kind} collectives {count(graphs[kind])}, expected {want[kind]}"
            for kind in ("fw", "bw") if count(graphs[kind]) != want[kind]]


def _dynamic_batch_mlp():
    """mark_dynamic on the batch dim of a colwise->rowwise MLP: matmul, pointwise, view and the
    backward's sum reduction on symbolic sizes; three batch sizes, one graph."""
    import shardprop as sp
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    mesh = sp.init_device_mesh("cpu", (2,))
    errors = []
    torch.manual_seed(0)
    ref = _MLP()
    model = _MLP()
    model.load_state_dict(ref.state_dict())
    sp.parallelize_module(model, mesh, {"up": sp.ColwiseParallel(), "down": sp.RowwiseParallel()})
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    for n in (5, 7, 9):
        x = torch.randn(n, 8)
        torch._dynamo.mark_dynamic(x, 0)
        model.zero_grad()
        ref.zero_grad()
        out = compiled(x)
        (out * out).mean().backward()
        want = ref(x)
        (want * want).mean().backward()
        _close(errors, f"batch {n} out", out, want)
        _grads(errors, f"batch {n}", model, ref)
    graphs = counters["stats"]["unique_graphs"]
    if graphs != 1:
        errors.append(f"{graphs} graphs for 3 batch sizes, expected 1 (recompiled per size)")
    return errors


def _dynamic_seq():
    """mark_dynamic on the sequence dim: three lengths, one graph."""
    from torch._dynamo.utils import counters
    from shardprop.demo.model import LlamaConfig, lm_loss, synthetic_batch
    errors = []
    cfg = LlamaConfig(dim=32, n_layers=1, n_heads=4, vocab_size=64, seq_len=16)
    torch._dynamo.reset()
    counters.clear()
    model, ref = _demo_model(cfg)
    compiled = torch.compile(model, backend="aot_eager")
    # Not 16: slicing the 16-long rope/mask buffers to their full length is a separate case
    # for torch itself (it guards s != 16), DTensor or not.
    for s in (8, 12, 14):
        tokens, targets = (t[:, :s].contiguous() for t in synthetic_batch(cfg, 3, s))
        torch._dynamo.mark_dynamic(tokens, 1)
        model.zero_grad()
        ref.zero_grad()
        loss = lm_loss(compiled(tokens), targets)
        loss.backward()
        want = lm_loss(ref(tokens), targets)
        want.backward()
        _close(errors, f"seq {s} loss", loss, want)
        _grads(errors, f"seq {s}", model, ref)
    graphs = counters["stats"]["unique_graphs"]
    if graphs != 1:
        errors.append(f"{graphs} graphs for 3 sequence lengths, expected 1 (recompiled per length)")
    return errors


_TWICE = None


def _twice_op():
    """A custom op nobody wrote a sharding rule for (defined once per worker)."""
    global _TWICE
    if _TWICE is None:
        @torch.library.custom_op("shardprop_test::twice", mutates_args=())
        def twice(x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @twice.register_fake
        def _(x):
            return torch.empty_like(x)
        _TWICE = torch.ops.shardprop_test.twice.default
    return _TWICE


def _no_rule_error():
    import shardprop as sp
    from shardprop import Shard
    torch._dynamo.reset()
    mesh = sp.init_device_mesh("cpu", (2,))
    x = sp.distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)])
    twice = _twice_op()
    try:
        torch.compile(lambda t: twice(t) + 1, backend="aot_eager", fullgraph=True)(x)
    except Exception as e:  # noqa: BLE001  (dynamo wraps it; the message must survive)
        chain, cur = [], e
        while cur is not None:
            chain.append(cur)
            cur = cur.__cause__ or cur.__context__
        text = "\n".join(str(c) for c in chain)
        if "shardprop_test.twice" not in text or "has no sharding rule" not in text:
            return [f"error without the rule message: {type(e).__name__}: {str(e)[:300]}"]
        if not any(isinstance(c, sp.ShardingError) for c in chain) and "ShardingError" not in text:
            return [f"not a ShardingError: {type(e).__name__}"]
        return []
    return ["an op with no rule compiled without error"]


def _dropout():
    """Dropout in a compiled (aot_eager) region reproduces one process's eager dropout."""
    import shardprop as sp
    from shardprop import Shard
    torch._dynamo.reset()
    mesh = sp.init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    full = torch.randn(6, 8)
    sp.manual_seed(5, mesh)
    x = sp.distribute_tensor(full, mesh, [Shard(1)])
    got = torch.compile(lambda t: torch.nn.functional.dropout(t, 0.5) * 2, backend="aot_eager", fullgraph=True)(x)
    torch.manual_seed(5)
    want = torch.nn.functional.dropout(full, 0.5) * 2
    errors = []
    _close(errors, "dropout", got, want)
    return errors


def _compiled_optimizer_step():
    """AdamW (foreach=False) step compiled over DTensor parameters (dynamo writes addcmul_ / addcdiv_
    as mul + prims.fma): the parameters after two steps equal plain eager AdamW's on one process."""
    import shardprop as sp
    mesh, ref, model = _tp_mlp_pair()
    errors = []
    opts = [torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.01, foreach=False) for m in (model, ref)]
    step = torch.compile(opts[0].step, backend="aot_eager")  # (torch.optim breaks the graph on purpose)
    for i in range(2):
        x = torch.randn(4, 8)
        for m, o in zip((model, ref), opts):
            o.zero_grad()
            m(x).pow(2).sum().backward()
        step()
        opts[1].step()
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        if not isinstance(p, sp.DTensor):
            errors.append(f"{name} is not a DTensor")
        _close(errors, f"param {name} after two compiled steps", p, ref_params[name])
    return errors


def _dp_tp_whole_model():
    """2x2 dp x tp: the whole model compiled (aot_eager), gradients averaged over dp by the buckets."""
    import shardprop as sp
    from shardprop.demo.model import Llama, LlamaConfig, lm_loss, synthetic_batch, tp_plan
    torch._dynamo.reset()
    errors = []
    cfg = LlamaConfig(dim=32, n_layers=1, n_heads=4, vocab_size=64, seq_len=8)
    mesh = sp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = sp.parallelize_module(Llama(cfg, 0), mesh["tp"], tp_plan())
    ref = Llama(cfg, 0)
    sync = sp.replicate_gradients(model, mesh, "dp")
    tokens, targets = synthetic_batch(cfg, 4, 0)
    compiled = torch.compile(model, backend="aot_eager")
    loss = lm_loss(compiled(sync.split_batch(tokens)), sync.split_batch(targets))
    loss.backward()
    sync.finish()
    want = lm_loss(ref(tokens), targets)
    want.backward()
    _grads(errors, "dp x tp", model, ref)
    return errors


def _report(results):
    errors = [f"rank {r}: {e}" for r, errs in enumerate(results) for e in errs]
    assert not errors, "\n".join(errors)


def test_mlp_graph_collectives_and_inductor():
    _report(run_on_ranks(2, _mlp_cases, True, timeout=240))


def test_conversions_in_one_graph():
    _report(run_on_ranks(2, _conversions, timeout=120))


def test_demo_blocks_fullgraph_and_whole_model():
    _report(run_on_ranks(2, _blocks_and_whole, timeout=240))


def test_dynamic_batch_no_recompile():
    _report(run_on_ranks(2, _dynamic_batch_mlp, timeout=120))


@pytest.mark.slow
def test_dynamic_sequence_length_no_recompile():
    _report(run_on_ranks(2, _dynamic_seq, timeout=240))


def test_no_rule_raises_sharding_error_while_tracing():
    _report(run_on_ranks(2, _no_rule_error, timeout=120))


def test_dropout_compiled_matches_one_process():
    _report(run_on_ranks(2, _dropout, timeout=120))


def test_compiled_optimizer_step_on_dtensor_params():
    _report(run_on_ranks(2, _compiled_optimizer_step, timeout=180))


@pytest.mark.slow  # CI time; the whole demo model is compiled in test_demo_blocks_fullgraph_and_whole_model
def test_dp_tp_whole_model_compiled():
    _report(run_on_ranks(4, _dp_tp_whole_model, timeout=300))
