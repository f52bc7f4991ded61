"""Losses, convolution, attention and normalization on sharded DTensors, forward and backward,
against plain torch on the full tensors.

Every rank builds the same full tensors from a seed, runs the function on DTensors laid out
as given and on the full tensors, and compares outputs and input gradients; layout checks
say where the rule should keep a shard (no gather of the activations). Each test is one
round trip to a 4-rank pool.
"""

import torch
import torch.nn.functional as F

from shardprop import Replicate, Shard, distribute_tensor, init_device_mesh
from tests.rankpool import run_on_ranks

R = Replicate()


def _rand(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).float()


def _check(fn, fulls, placements, seed, what, expect=None, const=()):
    """Run ``fn`` on DTensors and on full tensors; compare outputs and gradients.

    ``expect``: placements the (first) DTensor output must have, or None; ``const``:
    indices of inputs that take no gradient (class weights, running statistics).
    """
    mesh = init_device_mesh("cpu", (4,) if len(placements[0]) == 1 else (2, 2))
    grad = [f.is_floating_point() and i not in const for i, f in enumerate(fulls)]
    ref_in = [f.clone().requires_grad_(g) for f, g in zip(fulls, grad)]
    dt_in = [distribute_tensor(f.clone(), mesh, p).requires_grad_(g) for f, p, g in zip(fulls, placements, grad)]
    ref = fn(*ref_in)
    out = fn(*dt_in)
    ref_t = ref if isinstance(ref, tuple) else (ref,)
    out_t = out if isinstance(out, tuple) else (out,)
    if expect is not None and tuple(out_t[0].placements) != tuple(expect):
        raise AssertionError(f"{what}: output placements {list(out_t[0].placements)}, expected {list(expect)}")
    for i, (a, b) in enumerate(zip(out_t, ref_t)):
        torch.testing.assert_close(a.full_tensor(), b, msg=lambda m: f"{what} output {i}: {m}")
    g = _rand(ref_t[0].shape, seed + 1000)
    (ref_t[0] * g).sum().backward()
    gd = distribute_tensor(g, mesh, [R if p.is_partial() else p for p in out_t[0].placements])
    (out_t[0] * gd).sum().backward()
    for i, (a, b) in enumerate(zip(dt_in, ref_in)):
        if b.grad is not None:
            torch.testing.assert_close(a.grad.full_tensor(), b.grad, msg=lambda m: f"{what} grad {i}: {m}")


def _S(d, n=1):
    return [Shard(d)] * n


# ---------------------------------------------------------------- losses


def _nll_cases(n_mesh):
    seed = 0
    for batch in (8, 6):  # 6 splits unevenly over 4 ranks
        for reduction in ("none", "sum", "mean"):
            # target sharded like the logits (unweighted, nll), or replicated (weighted, cross entropy)
            for tp, weighted, fn in ((_S(0, n_mesh), False, "nll"), ([R] * n_mesh, True, "ce")):
                seed += 1
                x = _rand((batch, 5), seed)
                t = torch.arange(batch) % 5
                t[1] = -100  # ignored
                w = _rand((5,), seed + 7).abs() if weighted else torch.ones(5)
                what = f"{fn} {reduction} N={batch} mesh={n_mesh} target={tp}"
                if fn == "nll":
                    f = lambda x, t, w: F.nll_loss(F.log_softmax(x, -1), t, weight=w, reduction=reduction)  # noqa
                else:
                    f = lambda x, t, w: F.cross_entropy(x, t, weight=w, reduction=reduction)  # noqa
                _check(f, [x, t, w], [_S(0, n_mesh), tp, [R] * n_mesh], seed, what, const=(2,),
                       expect=_S(0, n_mesh) if reduction == "none" else None)
        # image-shaped (nll_loss2d), sharded on a spatial dim
        x = _rand((2, 3, batch, 4), seed)
        t = torch.randint(0, 3, (2, batch, 4), generator=torch.Generator().manual_seed(seed))
        for reduction in ("none", "sum", "mean"):
            _check(lambda x, t: F.cross_entropy(x, t, reduction=reduction),
                   [x, t], [_S(2, n_mesh), _S(1, n_mesh)], seed, f"ce2d {reduction} N={batch} mesh={n_mesh}")
    return True


def test_nll_cross_entropy_sharded():
    assert all(run_on_ranks(4, _nll_cases, 1, timeout=120))
    assert all(run_on_ranks(4, _nll_cases, 2, timeout=120))


def _elementwise_loss_cases():
    seed = 50
    for fn in (F.mse_loss, F.smooth_l1_loss, F.binary_cross_entropy_with_logits):
        for reduction in ("none", "sum", "mean"):
            for n_mesh, batch in ((1, 6), (2, 8)):
                seed += 1
                a, b = _rand((batch, 3), seed), _rand((batch, 3), seed + 1).sigmoid()
                _check(lambda a, b: fn(a, b, reduction=reduction), [a, b],
                       [_S(0, n_mesh), _S(0, n_mesh)], seed, f"{fn.__name__} {reduction} N={batch}")
    return True


def test_elementwise_losses_sharded():
    assert all(run_on_ranks(4, _elementwise_loss_cases, timeout=120))


# ---------------------------------------------------------------- conv


def _conv_cases():
    seed = 100
    for n_mesh in (1, 2):
        for batch in (8, 5):
            seed += 1
            x, w, b = _rand((batch, 4, 6, 6), seed), _rand((8, 4, 3, 3), seed + 1), _rand((8,), seed + 2)
            # batch-sharded input, replicated weight: output stays batch-sharded
            _check(lambda x, w, b: F.conv2d(x, w, b, padding=1), [x, w, b],
                   [_S(0, n_mesh), [R] * n_mesh, [R] * n_mesh], seed, f"conv batch N={batch}",
                   expect=_S(0, n_mesh))
            # out-channel sharded weight and bias: output channel-sharded
            _check(lambda x, w, b: F.conv2d(x, w, b), [x, w, b],
                   [[R] * n_mesh, _S(0, n_mesh), _S(0, n_mesh)], seed, "conv out-channel", expect=_S(1, n_mesh))
            # in-channel sharded input and weight (no bias): a contraction
            _check(lambda x, w: F.conv2d(x, w, stride=2), [x, w], [_S(1, n_mesh), _S(1, n_mesh)], seed,
                   "conv in-channel")
            wt = _rand((4, 3, 3, 3), seed + 3)
            _check(lambda x, w: F.conv_transpose2d(x, w), [x, wt], [_S(0, n_mesh), [R] * n_mesh], seed,
                   "conv_transpose batch", expect=_S(0, n_mesh))
            _check(lambda x: F.max_pool2d(x, 2), [x], [_S(1, n_mesh)], seed, "max_pool2d channel",
                   expect=_S(1, n_mesh))
            _check(lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"), [x], [_S(0, n_mesh)], seed,
                   "upsample bilinear batch", expect=_S(0, n_mesh))
            _check(lambda x: F.adaptive_avg_pool2d(x, 3), [x], [_S(0, n_mesh)], seed, "adaptive avg pool")
    return True


def test_conv_pool_sharded():
    assert all(run_on_ranks(4, _conv_cases, timeout=120))


# ---------------------------------------------------------------- attention


def _sdpa_cases():
    seed = 200
    for n_mesh in (1, 2):
        for causal in (False, True):
            for d in (0, 1, 2):
                seed += 1
                q, k, v = (_rand((4, 8, 8, 5), seed + i) for i in range(3))
                if d == 2:  # query sequence: k and v whole
                    pl = [_S(2, n_mesh), [R] * n_mesh, [R] * n_mesh]
                else:
                    pl = [_S(d, n_mesh)] * 3
                expect = None if (d == 2 and causal) else _S(d, n_mesh)
                _check(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal), [q, k, v], pl,
                       seed, f"sdpa causal={causal} shard {d}", expect=expect)
    return True


def test_sdpa_sharded():
    assert all(run_on_ranks(4, _sdpa_cases, timeout=120))


# ---------------------------------------------------------------- norms


def _norm_cases():
    seed = 300
    for n_mesh in (1, 2):
        for batch in (8, 6):
            seed += 1
            x, w, b = _rand((batch, 6, 5), seed), _rand((6,), seed + 1), _rand((6,), seed + 2)
            _check(lambda x, w, b: F.group_norm(x, 3, w, b), [x, w, b],
                   [_S(0, n_mesh), [R] * n_mesh, [R] * n_mesh], seed, f"group_norm N={batch}", expect=_S(0, n_mesh))
            y, g = _rand((batch, 4, 8), seed + 3), _rand((8,), seed + 4)
            _check(lambda y, g: F.rms_norm(y, (8,), g), [y, g], [_S(0, n_mesh), [R] * n_mesh], seed,
                   f"rms_norm N={batch}", expect=_S(0, n_mesh))
            rm, rv = _rand((6,), seed + 5), _rand((6,), seed + 6).abs()
            _check(lambda x, w, b, rm, rv: F.batch_norm(x, rm, rv, w, b, training=False), [x, w, b, rm, rv],
                   [_S(0, n_mesh)] + [[R] * n_mesh] * 4, seed, "batch_norm eval",
                   expect=_S(0, n_mesh) if batch == 8 else None,  # 6 leaves a rank empty: no batch shard
                   const=(3, 4))
            # 8 channels: every rank gets some (an empty channel chunk is never offered)
            x8, w8, b8 = _rand((batch, 8, 5), seed + 8), _rand((8,), seed + 9), _rand((8,), seed + 10)
            _check(lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True), [x8, w8, b8],
                   [_S(1, n_mesh), _S(0, n_mesh), _S(0, n_mesh)], seed, "batch_norm train channel",
                   expect=_S(1, n_mesh))
            _check(F.prelu, [x, _rand((6,), seed + 7)], [_S(2, n_mesh), [R] * n_mesh], seed, "prelu",
                   expect=_S(2, n_mesh))
    return True


def test_norms_sharded():
    assert all(run_on_ranks(4, _norm_cases, timeout=120))


def _batch_norm_running_stats():
    """Training batch norm updates running stats in place: both replicated and channel-sharded stats
    must end up equal to plain torch's."""
    mesh = init_device_mesh("cpu", (4,))
    x = _rand((6, 8, 3), 1)
    for stat_pl, x_pl in (([R], [Shard(0)]), ([Shard(0)], [Shard(1)])):
        rm, rv = torch.zeros(8), torch.ones(8)
        ref = F.batch_norm(x, rm, rv, training=True, momentum=0.5)
        drm, drv = distribute_tensor(torch.zeros(8), mesh, stat_pl), distribute_tensor(torch.ones(8), mesh, stat_pl)
        out = F.batch_norm(distribute_tensor(x, mesh, x_pl), drm, drv, training=True, momentum=0.5)
        torch.testing.assert_close(out.full_tensor(), ref)
        torch.testing.assert_close(drm.full_tensor(), rm, msg=lambda m: f"running_mean {stat_pl}: {m}")
        torch.testing.assert_close(drv.full_tensor(), rv, msg=lambda m: f"running_var {stat_pl}: {m}")
    return True


def test_batch_norm_running_stats():
    assert all(run_on_ranks(4, _batch_norm_running_stats))


def _sdpa_dropout_on_shards():
    import shardprop
    mesh = init_device_mesh("cpu", (4,))
    g = torch.Generator().manual_seed(1)
    full = [torch.randn(2, 4, 6, 8, generator=g) for _ in range(3)]
    q, k, v = (distribute_tensor(t, mesh, [Shard(1)]) for t in full)
    shardprop.manual_seed(7, mesh)
    got = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3).full_tensor()
    torch.manual_seed(7)
    want = F.scaled_dot_product_attention(*full, dropout_p=0.3)
    return torch.allclose(got, want, atol=1e-6)


def test_sdpa_dropout_on_head_shards_equals_single_device():
    # CPU takes the math path with dropout: its masks come from shardprop.dispatch.random_ops, shard by shard.
    assert all(run_on_ranks(4, _sdpa_dropout_on_shards))
