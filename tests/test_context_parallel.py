"""Context parallelism: ring attention and ``context_parallel`` against one process, on 4 gloo ranks.

The oracle is plain torch on the whole sequence, computed on every rank; each rank compares its
own part (the layout ``context_parallel_shard`` gives) of outputs and input gradients.
"""
import os
import threading

import pytest
import torch

from tests.rankpool import run_on_ranks


def _cp_mesh(n=4):
    from shardprop import init_device_mesh
    return init_device_mesh("cpu", (n,), mesh_dim_names=("cp",))


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _ring_cases(seq):
    import torch.nn.functional as F
    from shardprop.parallel.cp.context_parallel import context_parallel_shard
    from shardprop.parallel.cp.ring_attention import ring_attention
    mesh = _cp_mesh()
    errs = {}
    for dtype in (torch.float64, torch.float32):
        g = torch.Generator().manual_seed(7)
        q, k, v, do = (torch.randn(2, 3, seq, 8, generator=g, dtype=dtype) for _ in range(4))
        for causal in (True, False):
            fq, fk, fv = (t.clone().requires_grad_() for t in (q, k, v))
            ref = F.scaled_dot_product_attention(fq, fk, fv, is_causal=causal)
            ref.backward(do)
            for balanced in (True, False):
                for method in ("ring", "allgather"):
                    shard = lambda t: context_parallel_shard(t.detach(), mesh, 2, balanced)
                    lq, lk, lv = (shard(t).requires_grad_() for t in (q, k, v))
                    out = ring_attention(lq, lk, lv, mesh, is_causal=causal, balanced=balanced, method=method)
                    out.backward(shard(do))
                    key = (str(dtype), causal, balanced, method)
                    errs[key] = max(_rel(out, shard(ref)), _rel(lq.grad, shard(fq.grad)),
                                    _rel(lk.grad, shard(fk.grad)), _rel(lv.grad, shard(fv.grad)))
    return errs


def test_ring_attention_matches_one_process():
    for errs in run_on_ranks(4, _ring_cases, 64, timeout=120):
        for (dtype, causal, balanced, method), e in errs.items():
            bound = 1e-12 if "64" in dtype else 1e-5
            assert e < bound, (dtype, causal, balanced, method, e)


def _sdpa_in_context():
    """F.sdpa inside the context equals one process; buffers sharded inside, restored after, even on error."""
    import torch.nn.functional as F
    import shardprop
    from shardprop.parallel.cp.context_parallel import context_parallel_unshard
    mesh = _cp_mesh()
    rank = torch.distributed.get_rank()
    g = torch.Generator().manual_seed(3)
    seq = 32
    x = torch.randn(2, seq, 4, 8, generator=g, dtype=torch.float64)  # [b, s, h, d]: the buffer to shard
    pos = torch.arange(seq)
    w = torch.randn(8, 8, generator=g, dtype=torch.float64, requires_grad=True)
    keep = x.clone()

    def attend(inp):
        h = (inp @ w).transpose(1, 2)
        return F.scaled_dot_product_attention(h, h, h, is_causal=True)

    ref = attend(x)
    ref.sum().backward()
    ref_grad, w.grad = w.grad.clone(), None
    seen = {}
    other = {}

    def elsewhere():  # another thread's SDPA is plain attention while the context is active
        a = torch.randn(1, 1, 6, 4, dtype=torch.float64)
        other["err"] = (F.scaled_dot_product_attention(a, a, a) -
                        torch.softmax(a @ a.transpose(-1, -2) / 2, -1) @ a).abs().max().item()

    with shardprop.context_parallel(mesh, buffers=[x, pos], buffer_seq_dims=[1, 0], no_restore_buffers={pos}):
        seen["shape"], seen["pos"] = tuple(x.shape), pos.tolist()
        out = attend(x)
        t = threading.Thread(target=elsewhere)
        t.start()
        t.join()
        full, = context_parallel_unshard(mesh, [out], [2])
        out.sum().backward()
    torch.distributed.all_reduce(w.grad)
    seen["out_err"] = _rel(full, ref)
    seen["grad_err"] = _rel(w.grad, ref_grad)
    seen["restored"] = torch.equal(x, keep)
    seen["pos_after"] = tuple(pos.shape)
    seen["other_thread_err"] = other["err"]
    try:
        with shardprop.context_parallel(mesh, buffers=[x], buffer_seq_dims=[1]):
            raise KeyError("boom")
    except KeyError:
        pass
    seen["restored_after_error"] = torch.equal(x, keep)
    a = torch.randn(1, 1, 6, 4, dtype=torch.float64)  # outside: plain attention again
    seen["after_err"] = (F.scaled_dot_product_attention(a, a, a) -
                         torch.softmax(a @ a.transpose(-1, -2) / 2, -1) @ a).abs().max().item()
    with pytest.raises(ValueError, match="not divisible"):
        with shardprop.context_parallel(mesh, buffers=[torch.zeros(2, 30)], buffer_seq_dims=[1]):
            pass
    with pytest.raises(NotImplementedError, match="attn_mask"):
        with shardprop.context_parallel(mesh, buffers=[x], buffer_seq_dims=[1]):
            h = x.transpose(1, 2)
            F.scaled_dot_product_attention(h, h, h, attn_mask=torch.ones(8, 8, dtype=torch.bool))
    seen["restored_after_refusal"] = torch.equal(x, keep)
    from shardprop.parallel.cp.ring_attention import set_rotate_method
    notes = []
    for forced in ("auto", "ring"):
        old = set_rotate_method(forced)
        try:
            with shardprop.context_parallel(mesh, buffers=[x], buffer_seq_dims=[1]), shardprop.explain() as ex:
                attend(x)
        finally:
            set_rotate_method(old)
        notes.append(str(ex).splitlines()[-1])
    seen["notes"] = notes
    # DTensor q/k/v Shard(seq) on the cp mesh give a DTensor of the same output; GQA's heads are shared.
    from shardprop import DTensor, Shard
    qg = torch.randn(2, 4, seq, 8, generator=g, dtype=torch.float64)
    kg = torch.randn(2, 2, seq, 8, generator=g, dtype=torch.float64)
    ref_gqa = F.scaled_dot_product_attention(qg, kg, kg, is_causal=True, enable_gqa=True)
    with shardprop.context_parallel(mesh, buffers=[qg, kg], buffer_seq_dims=[2, 2]):
        plain = F.scaled_dot_product_attention(qg, kg, kg, is_causal=True, enable_gqa=True)
        dq, dk = (DTensor.from_local(t, mesh, (Shard(2),)) for t in (qg, kg))
        dt = F.scaled_dot_product_attention(dq, dk, dk, is_causal=True, enable_gqa=True)
        seen["dtensor"] = (type(dt).__name__, tuple(dt.placements), torch.equal(dt.to_local(), plain))
        full, = context_parallel_unshard(mesh, [plain], [2])
        q2 = qg[:, :2]  # the aten CPU kernel called directly: ring attention too, with its log-sum-exp
        o2, l2 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q2, kg, kg, 0.0, True)
        seen["aten_flash"] = (_rel(o2, F.scaled_dot_product_attention(q2, kg, kg, is_causal=True)), tuple(l2.shape))
    seen["gqa_err"] = _rel(full, ref_gqa)
    seen["rank"] = rank
    return seen


def shardprop_Shard(d):
    from shardprop import Shard
    return Shard(d)


def test_context_parallel_sdpa_and_buffers():
    for seen in run_on_ranks(4, _sdpa_in_context, timeout=120):
        r = seen["rank"]
        assert seen["shape"] == (2, 8, 4, 8)
        assert seen["pos"] == list(range(4 * r, 4 * r + 4)) + list(range(28 - 4 * r, 32 - 4 * r))  # head + tail
        assert seen["out_err"] < 1e-12 and seen["grad_err"] < 1e-12, seen
        assert seen["restored"] and seen["restored_after_error"] and seen["restored_after_refusal"]
        assert seen["pos_after"] == (8,)  # no_restore_buffers stay sharded
        assert seen["other_thread_err"] < 1e-12 and seen["after_err"] < 1e-12
        # explain() names the method: a short sequence all-gathers K/V (the cost model), forced ring rings.
        assert seen["notes"][0].startswith("context_parallel SDPA") and "-> allgather" in seen["notes"][0], seen["notes"]
        assert "-> ring" in seen["notes"][1], seen["notes"]
        assert seen["dtensor"] == ("DTensor", (shardprop_Shard(2),), True), seen["dtensor"]
        assert seen["gqa_err"] < 1e-12, seen["gqa_err"]
        assert seen["aten_flash"][0] < 1e-12 and seen["aten_flash"][1] == (2, 2, 8), seen["aten_flash"]


def _model_case(seq, dtype, n_layers=2, dim=64, heads=4):
    import shardprop
    from shardprop.demo.model import Llama, LlamaConfig, cp_buffers, lm_loss, synthetic_batch
    mesh = _cp_mesh()
    cfg = LlamaConfig(dim=dim, n_layers=n_layers, n_heads=heads, vocab_size=256, seq_len=seq, sdpa=True)
    model = Llama(cfg, seed=0).to(dtype)
    tokens, targets = synthetic_batch(cfg, batch=2, step=0, seed=0)
    ref_loss = lm_loss(model(tokens), targets)
    ref_loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    buffers, dims = cp_buffers(model, tokens, targets)
    with shardprop.context_parallel(mesh, buffers=buffers, buffer_seq_dims=dims, no_restore_buffers={tokens, targets}):
        assert tuple(tokens.shape) == (2, seq // 4)
        loss = lm_loss(model(tokens), targets)
        loss.backward()
    loss = loss.detach().clone()
    torch.distributed.all_reduce(loss)
    loss /= 4
    err = {"loss": _rel(loss, ref_loss.detach())}
    for n, p in model.named_parameters():
        torch.distributed.all_reduce(p.grad)
        p.grad /= 4
        err[n] = _rel(p.grad, ref[n])
    err["rope_restored"] = tuple(model.layers[0].attention.rope_cos.shape)[0] == seq
    return err


def test_demo_model_matches_one_process():
    for err in run_on_ranks(4, _model_case, 256, torch.float32, timeout=120):
        assert err.pop("rope_restored")
        worst = max(err.items(), key=lambda kv: kv[1])
        assert worst[1] < 1e-5, worst


@pytest.mark.slow
def test_demo_model_long_sequence_matches_one_process():
    for err in run_on_ranks(4, _model_case, 4096, torch.float32, 2, 64, 4, timeout=600):
        assert err.pop("rope_restored")
        worst = max(err.items(), key=lambda kv: kv[1])
        assert worst[1] < 1e-5, worst


def _cp_tp_case(seq):
    """2x2 (cp, tp): the demo model parallelized over tp, context parallel over cp, against one process."""
    import shardprop
    from shardprop.demo.model import Llama, LlamaConfig, cp_buffers, lm_loss, synthetic_batch, tp_plan
    from shardprop.mesh.collectives import all_reduce
    mesh = shardprop.init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    cfg = LlamaConfig(dim=64, n_layers=2, n_heads=4, vocab_size=256, seq_len=seq, sdpa=True)
    ref_model = Llama(cfg, seed=0)
    tokens, targets = synthetic_batch(cfg, batch=2, step=0, seed=0)
    ref_loss = lm_loss(ref_model(tokens), targets)
    ref_loss.backward()
    model = shardprop.parallelize_module(Llama(cfg, seed=0), mesh["tp"], tp_plan())
    buffers, dims = cp_buffers(model, tokens, targets)
    with shardprop.context_parallel(mesh["cp"], buffers=buffers, buffer_seq_dims=dims,
                                    no_restore_buffers={tokens, targets}):
        assert tuple(tokens.shape) == (2, seq // 2)  # the context really shards (else this test proves nothing)
        loss = lm_loss(model(tokens), targets)
        loss.backward()
    loss = all_reduce(loss.detach().reshape(1).clone(), mesh["cp"], 0, "avg")
    err = {"loss": _rel(loss[0], ref_loss.detach())}
    ref = dict(ref_model.named_parameters())
    for n, p in model.named_parameters():
        g = p.grad
        local = g.to_local() if isinstance(g, shardprop.DTensor) else g
        all_reduce(local, mesh["cp"], 0, "avg", inplace=True)
        full = g.full_tensor() if isinstance(g, shardprop.DTensor) else local
        err[n] = _rel(full, ref[n].grad)
    return err


def test_cp_tp_2x2_demo_model_matches_one_process():
    for err in run_on_ranks(4, _cp_tp_case, 128, timeout=180):
        worst = max(err.items(), key=lambda kv: kv[1])
        assert worst[1] < 1e-5, worst


def _demo(argv):
    from shardprop.demo import train as demo
    from shardprop.demo.cp_train import cp_main
    return cp_main(demo.parser().parse_args(argv), demo.config_from, demo.compare, demo.RTOL)


def test_demo_cp_flag_matches_one_process():
    argv = ["--cp", "4", "--steps", "2", "--dim", "32", "--layers", "1", "--vocab", "64", "--seq", "128", "--batch", "2"]
    results = run_on_ranks(4, _demo, argv, timeout=180)
    assert results[0]["ok"] is True, results[0]
    assert len(results[0]["losses"]) == 2
    for r in results[1:]:
        assert r["losses"] == pytest.approx(results[0]["losses"], rel=1e-6)


def _cp_fsdp_case(seq):
    """fully_shard over the cp ranks (they hold one batch's sequence parts): its gradient average is CP's."""
    import shardprop
    from shardprop.demo.model import Llama, LlamaConfig, cp_buffers, lm_loss, synthetic_batch
    mesh = _cp_mesh()
    cfg = LlamaConfig(dim=64, n_layers=2, n_heads=4, vocab_size=256, seq_len=seq, sdpa=True)
    ref_model = Llama(cfg, seed=0)
    tokens, targets = synthetic_batch(cfg, batch=2, step=0, seed=0)
    ref_loss = lm_loss(ref_model(tokens), targets)
    ref_loss.backward()
    model = Llama(cfg, seed=0)
    for block in model.layers:
        shardprop.fully_shard(block, mesh=mesh)
    shardprop.fully_shard(model, mesh=mesh)
    buffers, dims = cp_buffers(model, tokens, targets)
    with shardprop.context_parallel(mesh, buffers=buffers, buffer_seq_dims=dims, no_restore_buffers={tokens, targets}):
        assert tuple(tokens.shape) == (2, seq // 4)
        lm_loss(model(tokens), targets).backward()
    ref = dict(ref_model.named_parameters())
    return {n: _rel(p.grad.full_tensor(), ref[n].grad) for n, p in model.named_parameters()}


def test_cp_with_fully_shard_matches_one_process():
    for err in run_on_ranks(4, _cp_fsdp_case, 128, timeout=180):
        worst = max(err.items(), key=lambda kv: kv[1])
        assert worst[1] < 1e-5, worst


def _cp_compile_case(backend):
    """torch.compile of the model inside the context: the ring runs eagerly at a graph break, the rest compiled."""
    import shardprop
    from shardprop.demo.model import Llama, LlamaConfig, cp_buffers, lm_loss, synthetic_batch
    torch._dynamo.reset()
    mesh = _cp_mesh()
    cfg = LlamaConfig(dim=32, n_layers=1, n_heads=2, vocab_size=64, seq_len=64, sdpa=True)
    ref_model = Llama(cfg, seed=0)
    tokens, targets = synthetic_batch(cfg, batch=2, step=0, seed=0)
    lm_loss(ref_model(tokens), targets).backward()
    model = Llama(cfg, seed=0)
    run = torch.compile(model, backend=backend)
    buffers, dims = cp_buffers(model, tokens, targets)
    with shardprop.context_parallel(mesh, buffers=buffers, buffer_seq_dims=dims, no_restore_buffers={tokens, targets}):
        assert tuple(tokens.shape) == (2, 16)
        lm_loss(run(tokens), targets).backward()
    ref = dict(ref_model.named_parameters())
    err = {}
    for n, p in model.named_parameters():
        torch.distributed.all_reduce(p.grad)
        err[n] = _rel(p.grad / 4, ref[n].grad)
    return err


@pytest.mark.slow  # dynamo's first import and tracing on 4 ranks: about a minute here
def test_cp_under_torch_compile_matches_one_process():
    for err in run_on_ranks(4, _cp_compile_case, "aot_eager", timeout=300):
        worst = max(err.items(), key=lambda kv: kv[1])
        assert worst[1] < 1e-5, worst
