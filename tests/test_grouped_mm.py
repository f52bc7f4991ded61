"""The grouped-matmul rule (``ops/grouped_mm.py``) and the experts that use it, on 4 gloo ranks.

The rule checker runs ``torch._grouped_mm`` on every input layout of the four operand
layouts (2-d x 3-d tokens by stacked experts, 3-d x 3-d batched, 2-d x 2-d and 3-d x 2-d with
``offs`` cutting a dim into groups): nothing incorrect, nothing missing, and the options that
matter for experts accepted as they are. Then a tensor-parallel SwiGLU over stacked experts,
written with DTensors end to end, equals the plain computation forward and backward, and the
demo's experts give the same result with the kernel and with the per-expert loop.
"""
import pytest
import torch

from shardprop.mesh.compat import grouped_mm_runs
from tests.rankpool import run_on_ranks

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.skipif(not grouped_mm_runs("cpu", torch.float32),
                                 reason="torch._grouped_mm does not run on this torch's CPU in float32")]

OFFS = [8, 8, 24, 32]  # group 1 is empty
# name -> (a shape, b shape, offs?, options the rule must accept as they are)
CASES = {
    "tokens x experts": ((32, 16), (4, 16, 16), True,
                         ["(R, S(2), R) -> S(1)", "(S(1), S(1), R) -> P(sum)", "(P(sum), R, R) -> P(sum)",
                          "(R, R, R) -> R"]),
    "batched": ((4, 16, 16), (4, 16, 16), False,
                ["(S(0), S(0)) -> S(0)", "(S(1), R) -> S(1)", "(R, S(2)) -> S(2)", "(S(2), S(1)) -> P(sum)"]),
    "k grouped": ((16, 32), (32, 16), True, ["(S(0), R, R) -> S(1)", "(R, S(1), R) -> S(2)"]),
    "n grouped": ((4, 16, 16), (16, 32), True, ["(S(1), R, R) -> S(0)", "(S(2), S(0), R) -> P(sum)"]),
}


def _check(name):
    import shardprop
    from shardprop.debug.check_rule import check_sharding_rule
    mesh = shardprop.init_device_mesh("cpu", (4,))
    sa, sb, offs, _ = CASES[name]
    g = torch.Generator().manual_seed(0)
    args = (torch.randn(*sa, generator=g), torch.randn(*sb, generator=g))
    if offs:
        args += (torch.tensor(OFFS, dtype=torch.int32),)
    r = check_sharding_rule(torch.ops.aten._grouped_mm.default, *args, mesh=mesh)
    return {"ok": r.ok, "text": str(r), "incorrect": [str(f) for f in r.incorrect],
            "missing": [str(f) for f in r.missing], "accepted": [str(f) for f in r.accepted],
            "errors": [str(f) for f in r.errors], "checked": r.checked}


@pytest.mark.parametrize("name", list(CASES))
def test_rule_checker_finds_grouped_mm_rule_right_and_complete(name):
    s = run_on_ranks(4, _check, name)[0]
    assert s["ok"] and not s["incorrect"] and not s["errors"], s["text"]
    assert not s["missing"], s["text"]
    for option in CASES[name][3]:
        assert option in s["accepted"], (option, s["text"])
    # offs stays replicated: no accepted option shards it.
    if CASES[name][2]:
        assert all(f.split(" -> ")[0][:-1].rsplit(", ", 1)[-1] == "R" for f in s["accepted"]), s["text"]


def _tp_experts():
    """w1/w3 colwise (hidden sharded), w2 rowwise, tokens replicated: the output is P(sum)."""
    import torch.nn.functional as F
    from shardprop import Replicate, Shard, distribute_tensor, init_device_mesh
    mesh = init_device_mesh("cpu", (4,))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 16, generator=g)
    w1, w3 = torch.randn(4, 16, 32, generator=g), torch.randn(4, 16, 32, generator=g)
    w2 = torch.randn(4, 32, 16, generator=g)
    offs = torch.tensor(OFFS, dtype=torch.int32)
    gmm = torch._grouped_mm

    def swiglu(x, w1, w3, w2, offs):
        return gmm(F.silu(gmm(x, w1, offs=offs)) * gmm(x, w3, offs=offs), w2, offs=offs)

    plain = [t.clone().requires_grad_() for t in (x, w1, w3, w2)]
    want = swiglu(*plain, offs)
    grad_out = torch.randn(want.shape, generator=g)
    want.backward(grad_out)
    rep = [Replicate()]
    dts = [distribute_tensor(t.clone(), mesh, pl).requires_grad_()
           for t, pl in zip((x, w1, w3, w2), (rep, [Shard(2)], [Shard(2)], [Shard(1)]))]
    out = swiglu(*dts, distribute_tensor(offs, mesh, rep))
    placements = str(out.placements)
    out.backward(distribute_tensor(grad_out, mesh, rep))
    errors = []
    for name, got, ref in [("out", out.full_tensor(), want)] + [
            (f"grad {n}", d.grad.full_tensor(), p.grad) for n, d, p in zip(("x", "w1", "w3", "w2"), dts, plain)]:
        try:
            torch.testing.assert_close(got, ref.detach(), atol=1e-4, rtol=1e-4)
        except AssertionError as e:
            errors.append(f"{name}: {str(e).splitlines()[0]}")
    return placements, [str(d.grad.placements) for d in dts], errors


def test_tensor_parallel_grouped_experts_equal_plain():
    for placements, grads, errors in run_on_ranks(4, _tp_experts):
        assert placements == "(Partial(sum),)" or placements == "(P(sum),)", placements
        assert not errors, errors
        assert grads[1:] == ["(Shard(dim=2),)", "(Shard(dim=2),)", "(Shard(dim=1),)"] or \
            grads[1:] == ["(S(2),)", "(S(2),)", "(S(1),)"], grads


def test_demo_experts_kernel_equals_loop():
    from shardprop.demo.moe import GroupedExperts
    torch.manual_seed(0)
    experts = GroupedExperts(16, 24, 8)
    x = torch.randn(20, 16, requires_grad=True)
    counts = torch.tensor([3, 0, 5, 2, 0, 4, 6, 0])
    results = []
    for use in (True, False):
        experts.grouped_mm = use
        x.grad = None
        experts.zero_grad()
        y = experts(x, counts)
        y.backward(torch.ones_like(y))
        results.append((y.detach(), x.grad.clone(), experts.w2.grad.clone()))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    from shardprop.demo.moe import _grouped_mm_fits
    assert _grouped_mm_fits(x, experts.w1, experts.w2)  # automatic: the kernel runs here (else skipped)
    assert not _grouped_mm_fits(torch.randn(3, 6), experts.w1, experts.w2)  # 24-byte rows: the loop
