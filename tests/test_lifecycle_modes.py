"""Every autograd mode gives the same results (shardprop/dispatch/decompose.py, dispatcher views).

Under ``torch.inference_mode()`` CompositeImplicitAutograd ops (``linear``, ``matmul``, ...)
reach ``__torch_dispatch__`` whole; with autograd on (grad mode, ``no_grad``) torch
decomposes them first. shardprop runs their composite kernel, decided at an op's first
call, so:

* a tensor-parallel MLP's forward is the same in grad mode, ``no_grad`` and
  ``inference_mode``, and equals single-process torch;
* views of normal tensors (weights made outside inference mode) work under
  ``inference_mode``, and are normal tensors there, as torch makes them;
* ops with a rule get no handler (nothing per call); a composite op without a rule gets
  the decomposition handler; a rule registered later wins over it.
"""
import copy

import torch

from tests.rankpool import run_on_ranks

aten = torch.ops.aten
MODES = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference": torch.inference_mode}


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


class _Views(torch.nn.Module):
    """Views of parameters inside forward: ``.T``, ``view``, ``split``, ``narrow``, ``unbind``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.w = torch.nn.Parameter(torch.randn(8, 6))
        self.b = torch.nn.Parameter(torch.randn(2, 3))

    def forward(self, x):
        a, c = self.w.T.split([2, 4], dim=0)          # (2, 8), (4, 8)
        y = x @ self.w + self.b.view(6)                # (n, 6)
        z = y.narrow(1, 0, 2) + x @ a.T                # (n, 2)
        first = (x @ c.T).unbind(1)[0]                 # (n,)
        return torch.cat([z, first.unsqueeze(1)], 1)


def _modes_match_torch():
    import shardprop as sp
    mesh = sp.init_device_mesh("cpu", (2,))
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(2))
    out = {}
    ref = _mlp()
    model = sp.parallelize_module(copy.deepcopy(ref), mesh, {"0": sp.ColwiseParallel(), "2": sp.RowwiseParallel()})
    vref = _Views()
    views = sp.distribute_module(copy.deepcopy(vref), mesh)  # replicated parameters
    for name, mode in MODES.items():
        with mode():
            y = model(x)
            yv = views(sp.distribute_tensor(x, mesh, [sp.Shard(0)]))
            out[f"mlp_{name}"] = (torch.allclose(y, ref(x), atol=1e-6, rtol=1e-5), y.is_inference())
            out[f"views_{name}"] = torch.allclose(yv.full_tensor(), vref(x), atol=1e-6, rtol=1e-5)
    # The modes agree bit for bit with each other (the same kernels run in each).
    with torch.no_grad():
        a = model(x)
    with torch.inference_mode():
        b = model(x)
    out["no_grad_equals_inference"] = bool(torch.equal(a, b))
    # Grad mode afterwards: backward still works and matches torch.
    model(x).sum().backward()
    ref(x).sum().backward()
    out["grad_after"] = all(torch.allclose(p.grad.full_tensor(), q.grad, atol=1e-5)
                            for p, q in zip(model.parameters(), ref.parameters()))
    return out


def test_every_autograd_mode_matches_torch():
    for out in run_on_ranks(2, _modes_match_torch):
        for name in MODES:
            close, inference = out[f"mlp_{name}"]
            assert close, (name, out)
            assert inference == (name == "inference"), (name, out)
            assert out[f"views_{name}"], (name, out)
        assert out["no_grad_equals_inference"] and out["grad_after"], out


def _inference_views():
    """Under inference_mode a view of a normal DTensor is normal, of an inference one inference."""
    import shardprop as sp
    mesh = sp.init_device_mesh("cpu", (2,))
    normal = sp.distribute_tensor(torch.randn(4, 6), mesh, [sp.Shard(0)])
    plain = torch.randn(4, 6)
    with torch.inference_mode():
        inf = sp.distribute_tensor(torch.randn(4, 6), mesh, [sp.Shard(0)])
        got = {
            "t": (normal.t().is_inference(), plain.t().is_inference()),
            "split": (normal.split(2, 1)[0].is_inference(), plain.split(2, 1)[0].is_inference()),
            "view_of_inference": (inf.view(24).is_inference(), torch.randn(4, 6).view(24).is_inference()),
            "op": ((normal + 1).is_inference(), (plain + 1).is_inference()),
            # a view that must move its input first (S(0) -> R for view(24)): a copy, made the same way
            "copied_view": (normal.view(24).is_inference(), plain.view(24).is_inference()),
        }
    return got


def test_views_in_inference_mode_are_made_as_torch_makes_them():
    for got in run_on_ranks(2, _inference_views):
        for name, (ours, torchs) in got.items():
            assert ours == torchs, (name, got)


def _define_composite_op():
    """spmodes::scale2, CompositeImplicitAutograd (2 * x): like linear, it reaches us only in inference."""
    if not hasattr(torch.ops.spmodes, "scale2"):
        lib = torch.library.Library("spmodes", "DEF")
        lib.define("scale2(Tensor x) -> Tensor")
        lib.impl("scale2", lambda x: torch.mul(x, 2.0), "CompositeImplicitAutograd")
        _define_composite_op.lib = lib
    return torch.ops.spmodes.scale2.default


def _decided_once():
    import shardprop as sp
    from shardprop.dispatch import decompose, registry
    mesh = sp.init_device_mesh("cpu", (2,))
    scale2 = _define_composite_op()
    x = sp.distribute_tensor(torch.randn(4, 3), mesh, [sp.Shard(0)])
    w = sp.distribute_tensor(torch.randn(3, 5), mesh, [sp.Replicate()])
    out = {}
    with torch.inference_mode():
        torch.nn.functional.linear(x, w.t())
        torch.mm(x, w)
        y = scale2(x)
    out["linear_handler"] = registry.entries[aten.linear.default].special is decompose._handler
    out["mm_no_handler"] = registry.entries[aten.mm.default].special is None
    out["composite_decomposed"] = (decompose.is_decomposed(scale2), y.placements == (sp.Shard(0),),
                                   bool(torch.equal(y.full_tensor(), 2 * x.full_tensor())))
    calls = []

    @sp.register_sharding(scale2)
    def scale2_rule(x):
        calls.append(1)
        return [([sp.Replicate()], [sp.Replicate()])]

    try:
        with torch.inference_mode():
            y = scale2(x)
        out["rule_wins"] = (len(calls) == 1, y.placements == (sp.Replicate(),),
                            bool(torch.equal(y.full_tensor(), 2 * x.full_tensor())))
    finally:
        sp.unregister_sharding(scale2)
    with torch.inference_mode():  # the rule is gone: decomposed again
        y = scale2(x)
    out["decomposed_again"] = y.placements == (sp.Shard(0),)
    return out


def test_decomposition_is_decided_once_and_a_rule_wins():
    for out in run_on_ranks(2, _decided_once):
        assert out["linear_handler"] and out["mm_no_handler"], out
        assert all(out["composite_decomposed"]), out
        assert all(out["rule_wins"]), out
        assert out["decomposed_again"], out


def _llama_modes():
    """The demo's Llama under its TP plan (attention, RMSNorm, rope, embedding, sequence parallel)."""
    import shardprop as sp
    from shardprop.demo.model import Llama, LlamaConfig, synthetic_batch, tp_plan
    mesh = sp.init_device_mesh("cpu", (2,))
    cfg = LlamaConfig(dim=32, n_layers=1, n_heads=4, vocab_size=64, seq_len=8)
    ref = Llama(cfg, seed=3)
    model = sp.parallelize_module(Llama(cfg, seed=3), mesh, tp_plan())
    tokens, _ = synthetic_batch(cfg, 2, 0)
    want = ref(tokens)
    out = {}
    for name, mode in MODES.items():
        with mode():
            out[name] = bool(torch.allclose(model(tokens), want, atol=1e-5, rtol=1e-4))
    return out


def test_llama_tp_forward_in_every_mode():
    for out in run_on_ranks(2, _llama_modes):
        assert all(out.values()), out
