"""The fused RMS norm ops (aten._fused_rms_norm and its backward) on sharded DTensors.

torch.rms_norm reaches these ops on CUDA; on the CPU build the forward is composite (it
decomposes before any rule sees it) and the backward has only a Meta kernel. To run the
CUDA path on gloo ranks, each rank job registers CPU kernels for the ops that lack one
(the plain formula, written here), for the duration of the job only: with a CPU kernel
the forward no longer decomposes above autograd, so autograd records the fused backward
exactly as on CUDA. The oracle is F.rms_norm (torch's own composite) on the full tensors.
"""
import contextlib

import pytest
import torch
import torch.nn.functional as F

import shardprop
from shardprop import Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from shardprop.debug.check_rule import check_sharding_rule
from tests.rankpool import run_on_ranks

aten = torch.ops.aten
R = Replicate()
FWD, BWD = "aten::_fused_rms_norm", "aten::_fused_rms_norm_backward"


def _rand(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).float()


def _eps(x, eps):
    return torch.finfo(torch.float32 if x.dtype != torch.float64 else torch.float64).eps if eps is None else eps


def _inner(x, normalized_shape):
    return list(range(x.dim() - len(normalized_shape), x.dim()))


def _fwd_kernel(x, normalized_shape, weight, eps):
    dims = _inner(x, normalized_shape)
    rstd = torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + _eps(x, eps))
    out = x * rstd
    return (out * weight if weight is not None else out), rstd


def _bwd_kernel(grad_out, x, normalized_shape, rstd, weight, output_mask):
    dims = _inner(x, normalized_shape)
    xhat = x * rstd
    g = grad_out * weight if weight is not None else grad_out
    n = 1
    for s in normalized_shape:
        n *= s
    grad_input = grad_weight = None
    if output_mask[0]:
        grad_input = rstd * (g - xhat * (xhat * g).sum(dims, keepdim=True) / n)
    if output_mask[1] and weight is not None:
        outer = list(range(x.dim() - len(normalized_shape)))
        grad_weight = (grad_out * xhat).sum(outer) if outer else grad_out * xhat
    return grad_input, grad_weight


@contextlib.contextmanager
def _cpu_kernels():
    """CPU kernels for the fused ops that have none on this build, removed on exit."""
    lib = torch.library.Library("aten", "IMPL")
    try:
        for name, fn in ((FWD, _fwd_kernel), (BWD, _bwd_kernel)):
            if not torch._C._dispatch_has_kernel_for_dispatch_key(name, "CPU"):
                lib.impl(name.split("::")[1], fn, "CPU")
        yield
    finally:
        lib._destroy()


def _fused(x, normalized_shape, weight, eps):
    return aten._fused_rms_norm.default(x, normalized_shape, weight, eps)


# ---------------------------------------------------------------- DTensor runs against one process
CASES = [  # (mesh shape, input placements, input shape, normalized shape)
    ((4,), [Shard(0)], (6, 5, 8), [8]),      # 6 rows over 4 ranks: uneven
    ((4,), [Shard(1)], (3, 8, 8), [8]),
    ((4,), [R], (3, 5, 8), [8]),
    ((4,), [Shard(0)], (6, 4, 8), [4, 8]),   # two normalized dims
    ((2, 2), [Shard(0), Shard(1)], (4, 6, 8), [8]),
    ((2, 2), [Shard(1), Shard(1)], (2, 8, 8), [8]),
]


def _case(mesh_shape, placements, shape, norm, weighted, grads, seed):
    """One forward and backward; returns a list of failure texts (empty: all equal)."""
    what = f"mesh={mesh_shape} {placements} {shape} over {norm} weight={weighted} grads={grads}"
    mesh = init_device_mesh("cpu", mesh_shape)
    x, w, g = _rand(shape, seed), _rand(norm, seed + 1), _rand(shape, seed + 2)
    ref_x, ref_w = x.clone().requires_grad_(grads[0]), w.clone().requires_grad_(grads[1])
    ref = F.rms_norm(ref_x, norm, ref_w if weighted else None, 1e-6)
    (ref * g).sum().backward()
    dx = distribute_tensor(x, mesh, placements).requires_grad_(grads[0])
    dw = distribute_tensor(w, mesh, [R] * len(mesh_shape)).requires_grad_(grads[1])
    out, rstd = _fused(dx, norm, dw if weighted else None, 1e-6)
    (out * distribute_tensor(g, mesh, placements)).sum().backward()
    bad = []
    if tuple(out.placements) != tuple(placements) or tuple(rstd.placements) != tuple(placements):
        bad.append(f"{what}: out {out.placements}, rstd {rstd.placements}, input {placements}")
    checks = [("out", out.full_tensor(), ref.detach())]
    if grads[0]:
        if tuple(dx.grad.placements) != tuple(placements):
            bad.append(f"{what}: grad input {dx.grad.placements}")
        checks.append(("grad input", dx.grad.full_tensor(), ref_x.grad))
    if weighted and grads[1]:
        checks.append(("grad weight", dw.grad.full_tensor(), ref_w.grad))
    for name, got, want in checks:
        if not torch.allclose(got, want, atol=1e-5, rtol=1e-4):
            bad.append(f"{what}: {name} differs by {(got - want).abs().max():.3g}")
    return bad


def _dtensor_runs(mesh_shape):
    with _cpu_kernels():
        # The fused backward must be what autograd recorded (else this test proves nothing).
        probe = _rand((2, 4), 0).requires_grad_()
        fn = _fused(probe, [4], None, None)[0].grad_fn
        if "FusedRmsNorm" not in type(fn).__name__:
            return [f"autograd recorded {type(fn).__name__}, not the fused backward"]
        bad = []
        for i, (ms, pl, shape, norm) in enumerate(CASES):
            if ms != mesh_shape:
                continue
            # output_mask: both grads, grad input only, grad weight only; and no weight at all.
            for weighted, grads in ((True, (True, True)), (True, (True, False)), (True, (False, True)),
                                    (False, (True, False))):
                bad += _case(ms, pl, shape, norm, weighted, grads, seed=10 * i)
        return bad


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_fused_rms_norm_matches_one_process(mesh_shape):
    bad = run_on_ranks(4, _dtensor_runs, mesh_shape)[0]
    assert not bad, "\n".join(bad)


def _partial_weight():
    """A sum-Partial weight (a row-parallel result, say) passes to out and to grad input without a reduction."""
    with _cpu_kernels():
        mesh = init_device_mesh("cpu", (4,))
        x, w, g = _rand((3, 8), 1), _rand((8,), 2), _rand((3, 8), 3)
        parts = distribute_tensor(w, mesh, [R]).redistribute(mesh, [Partial("sum")])
        dx = distribute_tensor(x, mesh, [R]).requires_grad_()
        out, _ = _fused(dx, [8], parts, 1e-6)
        placement = out.placements[0]
        out_full = out.full_tensor()
        gi, gw = aten._fused_rms_norm_backward(distribute_tensor(g, mesh, [R]), dx.detach(), [8],
                                               _fused(dx.detach(), [8], None, 1e-6)[1], parts, [True, True])
        ref_x = x.clone().requires_grad_()
        ref_w = w.clone().requires_grad_()
        (F.rms_norm(ref_x, [8], ref_w, 1e-6) * g).sum().backward()
        return (str(placement), torch.allclose(out_full, F.rms_norm(x, [8], w, 1e-6), atol=1e-5),
                str(gi.placements[0]), torch.allclose(gi.full_tensor(), ref_x.grad, atol=1e-5),
                str(gw.placements[0]), torch.allclose(gw.full_tensor(), ref_w.grad, atol=1e-5))


def test_partial_weight_passes_through():
    placement, out_ok, gi_placement, gi_ok, gw_placement, gw_ok = run_on_ranks(4, _partial_weight)[0]
    assert placement == "P(sum)" and out_ok
    assert gi_placement == "P(sum)" and gi_ok
    assert gw_placement == "R" and gw_ok


# ---------------------------------------------------------------- the rule checker accepts both rules
def _summary(report):
    return {"ok": report.ok, "text": str(report), "errors": [f"{f.inputs}: {f.message}" for f in report.errors],
            "missing": [str(f) for f in report.missing],
            "accepted": len(report.accepted), "checked": report.checked}


def _check_rules(mesh_shape):
    """Sampled layouts (nothing incorrect, nothing missed) plus the layouts the rules must keep as they are."""
    mesh = shardprop.init_device_mesh("cpu", mesh_shape)
    m = len(mesh_shape)
    S0, RR, PS = (Shard(0),) * m, (R,) * m, (Partial("sum"),) * m
    x, w, g = _rand((5, 6), 0), _rand((6,), 1), _rand((5, 6), 2)
    out = []
    with _cpu_kernels():
        rstd = _fwd_kernel(x, [6], None, 1e-6)[1]
        cases = [  # (op, args, layouts the rule must keep as they are)
            (aten._fused_rms_norm.default, (x, [6], w, 1e-6), [(S0, RR), (RR, RR), (RR, PS)]),
            (aten._fused_rms_norm_backward.default, (g, x, [6], rstd, w, [True, True]),
             [(S0, S0, S0, RR), (RR,) * 4, (PS, RR, RR, RR), (RR, RR, RR, PS)]),
            (aten._fused_rms_norm_backward.default, (g, x, [6], rstd, None, [True, False]),
             [(S0, S0, S0), (RR,) * 3, (PS, RR, RR)]),
        ]
        for op, args, keep in cases:
            sampled = check_sharding_rule(op, *args, mesh=mesh, max_combos=200)
            kept = check_sharding_rule(op, *args, mesh=mesh, input_layouts=keep)
            out.append((_summary(sampled), _summary(kept)))
    return out


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_check_sharding_rule_accepts_rms_norm_rules(mesh_shape):
    for sampled, kept in run_on_ranks(4, _check_rules, mesh_shape)[0]:
        for s in (sampled, kept):
            assert s["ok"] and not s["errors"] and not s["missing"], s["text"]
        assert kept["accepted"] == kept["checked"], kept["text"]


# ---------------------------------------------------------------- the compiled path (as on CUDA)
def _compiled():
    """torch.compile of a sequence-sharded fused RMS norm: AOTAutograd traces the fused forward and
    backward through the rules (on CUDA the backward had none), and matches one process."""
    from torch._dynamo.backends.common import aot_autograd
    from functorch.compile import make_boxed_func
    torch._dynamo.reset()
    graphs = {"fw": [], "bw": []}

    def keep(kind):
        def compiler(gm, example_inputs):
            graphs[kind].append(gm)
            return make_boxed_func(gm.forward)
        return compiler

    with _cpu_kernels():
        mesh = init_device_mesh("cpu", (4,))
        x, w, g = _rand((2, 8, 8), 1), _rand((8,), 2), _rand((2, 8, 8), 3)
        dx = distribute_tensor(x, mesh, [Shard(1)]).requires_grad_()
        dw = distribute_tensor(w, mesh, [R]).requires_grad_()
        fn = torch.compile(lambda a, b: _fused(a, [8], b, 1e-6)[0], fullgraph=True,
                           backend=aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw")))
        out = fn(dx, dw)
        (out * distribute_tensor(g, mesh, [Shard(1)])).sum().backward()
        ref_x, ref_w = x.clone().requires_grad_(), w.clone().requires_grad_()
        (F.rms_norm(ref_x, [8], ref_w, 1e-6) * g).sum().backward()
        targets = {str(n.target) for kind in graphs for gm in graphs[kind] for n in gm.graph.nodes}
        result = {"placements": (str(out.placements[0]), str(dx.grad.placements[0])),
                  "out": torch.allclose(out.full_tensor(), F.rms_norm(x, [8], w, 1e-6), atol=1e-5),
                  "grad_x": torch.allclose(dx.grad.full_tensor(), ref_x.grad, atol=1e-5),
                  "grad_w": torch.allclose(dw.grad.full_tensor(), ref_w.grad, atol=1e-5),
                  "fused_ops": sorted(t for t in targets if "fused_rms_norm" in t)}
    torch._dynamo.reset()
    return result


def test_compiled_fused_rms_norm_sequence_sharded():
    r = run_on_ranks(4, _compiled)[0]
    assert r["placements"] == ("S(1)", "S(1)"), r  # the activations are never gathered
    assert r["out"] and r["grad_x"] and r["grad_w"], r
    assert r["fused_ops"] == ["aten._fused_rms_norm.default", "aten._fused_rms_norm_backward.default"], r
