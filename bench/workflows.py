"""The workflows around a training step, tried as a new user would: shardprop vs torch.distributed.tensor.

On 2 gloo ranks, a two-layer MLP (Linear 8->16, ReLU, Linear 16->4) under ``ColwiseParallel`` /
``RowwiseParallel`` of each engine. ``WORKFLOWS`` is the table: a row name -> one small function
per engine, ``fn(eng)``, run on every rank; it raises when the workflow fails (values are
compared with single-process torch where there is one) and returns an optional note. A row passes
when it passes on every rank. Add rows (DCP, full state dicts, ...) as functions in the table.

Usage::

    python bench/workflows.py [--rows inference,pickle] [--json out.json]

Prints a markdown table: pass, fail (with the error, shortened), or n/a (the engine has no such tool).
"""
from __future__ import annotations

import argparse
import copy
import io
import json
import os
import pickle
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _launch import launch  # noqa: E402

WORLD = 2
NA = "n/a"


class NotAvailable(Exception):
    """The engine has no such tool: the row reads n/a."""


# ------------------------------------------------------------------ engines
def shardprop_engine() -> SimpleNamespace:
    import shardprop as sp
    return SimpleNamespace(name="shardprop", init_device_mesh=sp.init_device_mesh, DTensor=sp.DTensor,
                           distribute_tensor=sp.distribute_tensor, Shard=sp.Shard, Replicate=sp.Replicate,
                           ColwiseParallel=sp.ColwiseParallel, RowwiseParallel=sp.RowwiseParallel,
                           parallelize_module=sp.parallelize_module, check_sharding_rule=sp.check_sharding_rule)


def reference_engine() -> SimpleNamespace:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    return SimpleNamespace(name="reference", init_device_mesh=init_device_mesh, DTensor=DTensor,
                           distribute_tensor=distribute_tensor, Shard=Shard, Replicate=Replicate,
                           ColwiseParallel=ColwiseParallel, RowwiseParallel=RowwiseParallel,
                           parallelize_module=parallelize_module, check_sharding_rule=None)


ENGINES = {"shardprop": shardprop_engine, "reference": reference_engine}


# ------------------------------------------------------------------ the model
def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def batch() -> torch.Tensor:
    return torch.randn(5, 8, generator=torch.Generator().manual_seed(1))


def parallel_mlp(eng):
    """(single-process model, the same weights parallelized, mesh)."""
    mesh = eng.init_device_mesh("cpu", (WORLD,))
    ref = mlp()
    model = eng.parallelize_module(copy.deepcopy(ref), mesh, {"0": eng.ColwiseParallel(), "2": eng.RowwiseParallel()})
    return ref, model, mesh


def _close(a, b, what):
    a = a.full_tensor() if hasattr(a, "full_tensor") else a
    if not torch.allclose(a, b, atol=1e-5, rtol=1e-4):
        raise AssertionError(f"{what}: differs from single-process torch by {(a - b).abs().max().item():.3g}")


# ------------------------------------------------------------------ workflows
def forward_inference_mode(eng):
    ref, model, _ = parallel_mlp(eng)
    with torch.inference_mode():
        _close(model(batch()), ref(batch()), "output")


def forward_no_grad(eng):
    ref, model, _ = parallel_mlp(eng)
    with torch.no_grad():
        _close(model(batch()), ref(batch()), "output")


def view_of_weight_inference_mode(eng):
    """``x @ w.T`` on a parameter made outside inference mode (custom modules, tied weights)."""
    ref, model, mesh = parallel_mlp(eng)
    with torch.inference_mode():
        x = eng.distribute_tensor(batch(), mesh, [eng.Replicate()])
        _close(x @ model[0].weight.T, batch() @ ref[0].weight.T, "x @ w.T")


def generate_llama_inference_mode(eng):
    """Greedy decoding under inference_mode: the demo's Llama under its TP plan (sequence parallel,
    attention, RMSNorm, rope), a sliding window of the model's length, against one process."""
    from shardprop.demo.model import Llama, LlamaConfig, shardprop_styles, synthetic_batch, tp_plan
    from tp import torch_styles
    styles = shardprop_styles() if eng.name == "shardprop" else torch_styles()
    mesh = eng.init_device_mesh("cpu", (WORLD,))
    cfg = LlamaConfig(dim=32, n_layers=2, n_heads=4, vocab_size=64, seq_len=8)
    ref = Llama(cfg, seed=3)
    model = eng.parallelize_module(Llama(cfg, seed=3), mesh, tp_plan(styles))
    ours, want = synthetic_batch(cfg, 2, 0)[0], synthetic_batch(cfg, 2, 0)[0]
    with torch.inference_mode():
        for _ in range(4):
            logits = model(ours[:, -cfg.seq_len:])
            _close(logits, ref(want[:, -cfg.seq_len:]), "logits")
            ours = torch.cat([ours, logits[:, -1:].argmax(-1)], 1)
            want = torch.cat([want, ref(want[:, -cfg.seq_len:])[:, -1:].argmax(-1)], 1)
    if not torch.equal(ours, want):
        raise AssertionError("generated tokens differ from one process's")


def deepcopy_module(eng):
    ref, model, _ = parallel_mlp(eng)
    twin = copy.deepcopy(model)
    for p, q in zip(twin.parameters(), model.parameters()):
        if p.to_local().data_ptr() == q.to_local().data_ptr():
            raise AssertionError("the copy shares a parameter with the original")
    _close(twin(batch()), ref(batch()), "copy's output")
    with torch.no_grad():
        twin[0].weight.mul_(2.0)
    _close(model(batch()), ref(batch()), "original's output after changing the copy")


def save_load_state_dict(eng):
    """torch.save(model.state_dict()) per rank; torch.load with its default weights_only=True."""
    ref, model, _ = parallel_mlp(eng)
    f = io.BytesIO()
    torch.save(model.state_dict(), f)
    f.seek(0)
    sd = torch.load(f)
    _, fresh, _ = parallel_mlp(eng)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh.load_state_dict(sd)
    _close(fresh(batch()), ref(batch()), "loaded model's output")


def save_load_whole_model(eng):
    """torch.save(model) of the whole parallelized module (its hooks included); torch.load(weights_only=False)."""
    ref, model, _ = parallel_mlp(eng)
    f = io.BytesIO()
    torch.save(model, f)
    f.seek(0)
    loaded = torch.load(f, weights_only=False)
    _close(loaded(batch()), ref(batch()), "loaded model's output")


def to_bfloat16(eng):
    """model.to(torch.bfloat16) on the parallelized model, then a forward (bf16 inference)."""
    ref, model, _ = parallel_mlp(eng)
    model.to(torch.bfloat16)
    ref.to(torch.bfloat16)
    out, want = model(batch().bfloat16()), ref(batch().bfloat16())
    out = out.full_tensor() if hasattr(out, "full_tensor") else out
    if out.dtype != torch.bfloat16 or not torch.allclose(out.float(), want.float(), atol=3e-2, rtol=3e-2):
        raise AssertionError(f"bf16 output ({out.dtype}) differs from single-process torch")


def meta_init(eng):
    """Deferred init (torchtitan): build on meta, parallelize, to_empty(device="cpu"), fill from full weights."""
    ref = mlp()
    with torch.device("meta"):
        model = mlp()
    mesh = eng.init_device_mesh("cpu", (WORLD,))
    model = eng.parallelize_module(model, mesh, {"0": eng.ColwiseParallel(), "2": eng.RowwiseParallel()})
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p, q in zip(model.parameters(), ref.parameters()):
            p.copy_(eng.distribute_tensor(q.detach(), p.device_mesh, p.placements))
    _close(model(batch()), ref(batch()), "output")


def pickle_dtensor(eng):
    mesh = eng.init_device_mesh("cpu", (WORLD,))
    full = torch.randn(5, 3, generator=torch.Generator().manual_seed(2))
    dt = eng.distribute_tensor(full, mesh, [eng.Shard(0)])
    back = pickle.loads(pickle.dumps(dt))
    _close(back, full, "unpickled DTensor")


def check_rule_unseeded(eng):
    if eng.check_sharding_rule is None:
        raise NotAvailable("no sharding-rule checker")
    mesh = eng.init_device_mesh("cpu", (WORLD,))
    # Fresh processes share torch's default seed; real ranks have drawn different numbers by now
    # (data order, dropout): make each rank's generator its own, so the samples differ.
    torch.manual_seed(1000 + dist.get_rank())
    report = eng.check_sharding_rule(torch.ops.aten.mm.default, torch.randn(8, 6), torch.randn(6, 4), mesh=mesh)
    if not report.ok or report.errors:
        raise AssertionError(report.summary())


def _ckpt_dir(name):
    """A checkpoint folder every rank names alike (the launch's port is the same on all ranks)."""
    import tempfile
    return os.path.join(tempfile.gettempdir(), f"workflows-{os.environ.get('MASTER_PORT', '0')}-{name}")


def _dcp_roundtrip(eng, name, src_pl, dst_pl, save):
    full = torch.randn(6, 4, generator=torch.Generator().manual_seed(5))
    mesh = eng.init_device_mesh("cpu", (WORLD,))
    path = _ckpt_dir(name)
    save({"w": eng.distribute_tensor(full, mesh, src_pl(eng))}, path)
    dst = eng.distribute_tensor(torch.zeros(6, 4), mesh, dst_pl(eng))
    import torch.distributed.checkpoint as dcp
    dcp.load({"w": dst}, checkpoint_id=path)
    _close(dst, full, "loaded tensor")


def _dcp_save(state, path):
    import torch.distributed.checkpoint as dcp
    dcp.save(state, checkpoint_id=path)


def _dcp_async_save(state, path):
    import torch.distributed.checkpoint as dcp
    dcp.async_save(state, checkpoint_id=path).result()


def dcp_same_layout(eng):
    _dcp_roundtrip(eng, "same", lambda e: [e.Shard(0)], lambda e: [e.Shard(0)], _dcp_save)


def dcp_resharded(eng):
    _dcp_roundtrip(eng, "reshard", lambda e: [e.Shard(0)], lambda e: [e.Shard(1)], _dcp_save)


def dcp_async(eng):
    _dcp_roundtrip(eng, "async", lambda e: [e.Shard(1)], lambda e: [e.Replicate()], _dcp_async_save)


def load_plain_full_state_dict(eng):
    """model.load_state_dict(single_device_model.state_dict()) into a parallelized model."""
    ref, model, _ = parallel_mlp(eng)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.5)
    model.load_state_dict(ref.state_dict())
    _close(model(batch()), ref(batch()), "output after loading a plain state dict")


def gather_full_state_dict(eng):
    """A plain full state dict on rank 0 (Hugging Face save_pretrained style)."""
    ref, model, _ = parallel_mlp(eng)
    if eng.name == "shardprop":
        import shardprop
        sd = shardprop.full_state_dict(model)
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        for k, v in ref.state_dict().items():
            if type(sd[k]) is not torch.Tensor:
                raise AssertionError(f"{k} is a {type(sd[k]).__name__}, not a plain tensor")
            _close(sd[k], v, k)


def redistribute_other_mesh(eng):
    """A 1-d mesh over both ranks to a 2-d (1, 2) mesh over the same ranks."""
    full = torch.randn(6, 4, generator=torch.Generator().manual_seed(6))
    a = eng.init_device_mesh("cpu", (WORLD,))
    b = eng.init_device_mesh("cpu", (1, WORLD))
    dt = eng.distribute_tensor(full, a, [eng.Shard(0)])
    _close(dt.redistribute(b, [eng.Replicate(), eng.Shard(1)]), full, "moved tensor")


def compile_train_step(eng):
    """torch.compile(model) (aot_eager), forward and backward, against one process."""
    ref, model, _ = parallel_mlp(eng)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    out = compiled(batch())
    _close(out, ref(batch()), "compiled output")
    (out.full_tensor() if hasattr(out, "full_tensor") else out).sum().backward()
    ref(batch()).sum().backward()
    _close(model[0].weight.grad, ref[0].weight.grad, "gradient")


def fully_shard_step(eng):
    """fully_shard (FSDP2 style) on the MLP, one SGD step on each rank's half of the batch."""
    mesh = eng.init_device_mesh("cpu", (WORLD,))
    ref = mlp()
    model = copy.deepcopy(ref)
    if eng.name == "shardprop":
        from shardprop import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    fully_shard(model, mesh=mesh)
    x = batch()[:4]
    model(x.chunk(WORLD)[dist.get_rank()]).sum().backward()
    ref(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        _close(p.grad, q.grad / WORLD, f"{name}.grad")  # FSDP averages over dp ranks


WORKFLOWS = {
    "forward under inference_mode": forward_inference_mode,
    "forward under no_grad": forward_no_grad,
    "inference_mode: x @ w.T on a weight": view_of_weight_inference_mode,
    "greedy generate() under inference_mode (TP Llama)": generate_llama_inference_mode,
    "copy.deepcopy(model)": deepcopy_module,
    "torch.save/load(model.state_dict()), weights_only default": save_load_state_dict,
    "torch.save/load(model), the whole module": save_load_whole_model,
    "model.to(torch.bfloat16), forward": to_bfloat16,
    "meta-device init, to_empty, fill from full weights": meta_init,
    "pickle of a DTensor": pickle_dtensor,
    "check_sharding_rule, unseeded per-rank samples": check_rule_unseeded,
    "dcp.save / dcp.load, same layout": dcp_same_layout,
    "dcp.load onto other placements (resharding)": dcp_resharded,
    "dcp.async_save, then load replicated": dcp_async,
    "model.load_state_dict(plain full state dict)": load_plain_full_state_dict,
    "full state dict gathered to rank 0": gather_full_state_dict,
    "redistribute to another mesh": redistribute_other_mesh,
    "torch.compile(model, fullgraph=True), fwd+bwd": compile_train_step,
    "fully_shard, one backward": fully_shard_step,
}


# ------------------------------------------------------------------ running
def _outcome(fn, eng) -> str:
    try:
        note = fn(eng)
        return "pass" + (f" ({note})" if note else "")
    except NotAvailable as e:
        return f"{NA} ({e})"
    except Exception as e:
        return "fail: " + " ".join(f"{type(e).__name__}: {e}".split())[:160]


def body(rank, world_size, rows, engines):
    import warnings
    warnings.filterwarnings("ignore")
    engs = {name: ENGINES[name]() for name in engines}
    results = {}
    for row in rows:
        for name, eng in engs.items():
            mine = _outcome(WORKFLOWS[row], eng)
            every = [None] * world_size
            dist.all_gather_object(every, mine)  # a row passes when it passes on every rank
            bad = [o for o in every if not o.startswith("pass")]
            results[(row, name)] = bad[0] if bad else every[0]
    return results


def table(results, rows, engines) -> str:
    head = "| workflow | " + " | ".join("shardprop" if e == "shardprop" else "torch.distributed.tensor"
                                         for e in engines) + " |"
    lines = [head, "|" + " --- |" * (len(engines) + 1)]
    for row in rows:
        cells = [results[(row, e)].replace("|", "/") for e in engines]
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    passed = {e: sum(results[(r, e)].startswith("pass") for r in rows) for e in engines}
    lines.append("\npassed: " + ", ".join(f"{e} {passed[e]}/{len(rows)}" for e in engines))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="", help="comma-separated substrings of row names (default: every row)")
    p.add_argument("--engines", default="shardprop,reference")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    keys = [k for k in args.rows.split(",") if k]
    rows = [r for r in WORKFLOWS if not keys or any(k in r for k in keys)]
    engines = [e for e in args.engines.split(",") if e]
    results = launch(body, WORLD, rows, engines, timeout_s=60.0)
    print(table(results, rows, engines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({f"{r} [{e}]": v for (r, e), v in results.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
