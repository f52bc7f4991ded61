"""Module-wide conversions of a parallelized model (shardprop/parallel/param_swap.py, distribute_tensor on meta).

``nn.Module._apply`` swaps DTensor parameters in place (``torch.utils.swap_tensors``): it must
not be refused (no weak references to parameters), and the parameters' gradient hooks must
survive it. On the demo Llama under its sequence-parallel plan, 2 ranks:

* ``model.to(torch.bfloat16)`` gives the single-process bf16 model's output; back to float32,
  one training step equals single-process torch and the norm weights' gradients are still
  laid out ``Replicate`` (their hooks were re-installed on the swapped data);
* deferred init, torchtitan's way: build on the meta device, parallelize (no data moves),
  ``to_empty(device="cpu")``, fill every parameter from a full one; the model then trains
  exactly like single-process torch;
* ``replicate_gradients`` on a 2x2 dp x tp mesh keeps launching its buckets during backward
  (post-accumulate hooks) after ``model.to``, and averages over dp.
"""
import torch

from tests.rankpool import run_on_ranks


def _cfg():
    from shardprop.demo.model import LlamaConfig
    return LlamaConfig(dim=32, n_layers=1, n_heads=4, vocab_size=64, seq_len=8)


def _train_step(model, batch):
    from shardprop.demo.model import lm_loss
    tokens, targets = batch
    loss = lm_loss(model(tokens), targets)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(0.5 * p.grad)
    return loss.detach()


def _compare_step(model, ref, batch, problems, what):
    import shardprop as sp
    loss, ref_loss = _train_step(model, batch), _train_step(ref, batch)
    if abs(loss.item() - ref_loss.item()) > 1e-5:
        problems.append(f"{what}: loss {loss.item()} vs one process {ref_loss.item()}")
    grad = model.layers[0].attention_norm.weight.grad
    if grad.placements != (sp.Replicate(),):
        problems.append(f"{what}: norm weight's gradient laid out {grad.placements}, expected (Replicate(),)")
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if not torch.allclose(p.full_tensor(), q, atol=1e-5, rtol=1e-4):
            problems.append(f"{what}: {name} after one step differs from one process")


def _to_dtype():
    import shardprop as sp
    from shardprop.demo.model import Llama, synthetic_batch, tp_plan
    cfg = _cfg()
    mesh = sp.init_device_mesh("cpu", (2,))
    model = sp.parallelize_module(Llama(cfg, 0), mesh, tp_plan())
    ref = Llama(cfg, 0)
    batch = synthetic_batch(cfg, 2, 0)
    problems = []
    model.to(torch.bfloat16)
    ref.to(torch.bfloat16)
    if model.layers[0].attention.wq.weight.dtype != torch.bfloat16:
        problems.append(f"after .to(bfloat16) a weight is {model.layers[0].attention.wq.weight.dtype}")
    with torch.no_grad():
        out, want = model(batch[0]), ref(batch[0])
    if out.dtype != torch.bfloat16 or not torch.allclose(out.float(), want.float(), atol=3e-2, rtol=3e-2):
        problems.append(f"bf16 output ({out.dtype}) differs from one process by {(out.float() - want.float()).abs().max()}")
    model.to(torch.float32)
    ref = Llama(cfg, 0)  # bf16 round trips lose bits: compare against the rounded weights
    with torch.no_grad():
        for (_, p), q in zip(model.named_parameters(), ref.parameters()):
            q.copy_(p.full_tensor())
    _compare_step(model, ref, batch, problems, "after .to(bf16).to(float32)")
    return problems


def test_to_dtype_keeps_gradient_layouts():
    for problems in run_on_ranks(2, _to_dtype):
        assert not problems, problems


def _meta_init():
    import shardprop as sp
    from shardprop.demo.model import Llama, synthetic_batch, tp_plan
    cfg = _cfg()
    mesh = sp.init_device_mesh("cpu", (2,))
    with torch.device("meta"):
        model = Llama(cfg, 0)
    model = sp.parallelize_module(model, mesh, tp_plan())
    problems = [f"{n} holds data on {p.to_local().device} before to_empty"
                for n, p in model.named_parameters() if not p.to_local().is_meta]
    model.to_empty(device="cpu")
    ref = Llama(cfg, 0)
    with torch.no_grad():
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            p.copy_(sp.distribute_tensor(q.detach(), p.device_mesh, p.placements))
        for (_, b), q in zip(model.named_buffers(), ref.buffers()):  # non-persistent tables: recompute
            b.copy_(q)
    _compare_step(model, ref, synthetic_batch(cfg, 2, 0), problems, "meta init")
    return problems


def test_meta_device_init_then_to_empty():
    for problems in run_on_ranks(2, _meta_init):
        assert not problems, problems


def _dp_tp_to():
    import torch.distributed as dist

    import shardprop as sp
    from shardprop.demo.model import Llama, lm_loss, synthetic_batch, tp_plan
    cfg = _cfg()
    mesh = sp.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = sp.parallelize_module(Llama(cfg, 0), mesh["tp"], tp_plan())
    dp = sp.replicate_gradients(model, mesh, "dp")
    model.to(torch.float64).to(torch.float32)  # swaps every parameter twice
    tokens, targets = synthetic_batch(cfg, 4, 0)
    rows = slice(2 * mesh["dp"].get_local_rank(), 2 * mesh["dp"].get_local_rank() + 2)
    lm_loss(model(tokens[rows]), targets[rows]).backward()
    problems = []
    if dp._next != len(dp.buckets):  # finish() would still average them, without overlap
        problems.append(f"{len(dp.buckets) - dp._next} gradient buckets not launched during backward: "
                        "the post-accumulate hooks were lost in the swap")
    dp.finish()
    ref = Llama(cfg, 0)
    lm_loss(ref(tokens), targets).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if not torch.allclose(p.grad.full_tensor(), q.grad, atol=1e-5, rtol=1e-4):
            problems.append(f"{name}: gradient differs from one process on the whole batch "
                            f"(rank {dist.get_rank()})")
    return problems


def test_replicate_gradients_survives_to():
    for problems in run_on_ranks(4, _dp_tp_to):
        assert not problems, problems
