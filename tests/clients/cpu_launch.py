"""Run torchtitan's trainer on CPU gloo ranks: CPU stand-ins, then ``python -m torchtitan.train ARGS``.

    torchrun --nproc-per-node 4 tests/clients/cpu_launch.py --module llama3 --config llama3_debugmodel ...
    torchrun --nproc-per-node 4 -m shardprop.launch tests/clients/cpu_launch.py --module llama3 ...

torchtitan is written for accelerators. This script patches (in this worker process only, never on disk)
what it needs to run on CPU, the same way on torch's stack and under ``python -m shardprop.launch``, and
then hands over to ``torchtitan.train`` as ``python -m`` would. Nothing here touches DTensor, device meshes
or FSDP: the stand-ins are below (torch, gloo) or beside (attention kernel, device module) the stack that
is compared.

- device: ``torchtitan.tools.utils`` picks ``cuda`` when no accelerator is seen; here it is ``cpu`` with a
  device module (``torch.cpu`` plus the memory-statistics calls torchtitan's metrics make, answering 0);
- attention: the debug model's flex attention is ``torch.compile(flex_attention)`` with inductor autotuning
  (no CPU backward); here it is the same masked softmax attention in plain torch ops (the BlockMask's
  ``mask_mod`` made dense), and ``create_attention_mask`` is the eager ``create_block_mask``;
- ``torch.distributed.set_timeout`` (torchtitan calls it; torch 2.13 has no such function): the private
  ``_set_pg_timeout`` it became;
- reductions: gloo has no ``PREMUL_SUM``; torch's ``fully_shard`` uses it for a gradient divide factor,
  here it becomes a division then ``SUM``.

Recording: with ``CLIENTS_RECORD=path``, global rank 0 appends JSON lines to ``path``: once built, the types
of the model's parameters (whose DTensor ran), then one per logged step: the step, the loss and grad norm as
full-precision floats (torchtitan's log rounds them) and the tps torchtitan computes.
"""
from __future__ import annotations

import importlib
import json
import os
import runpy
import sys
import time
import types

import torch


def _cpu_device_module() -> types.ModuleType:
    mod = types.ModuleType("cpu_device_module")
    for name in dir(torch.cpu):
        if not name.startswith("__"):
            setattr(mod, name, getattr(torch.cpu, name))
    mod.current_device = lambda: 0
    mod.set_device = lambda device: None
    mod.get_device_name = lambda device=None: "cpu"
    mod.get_device_properties = lambda device=None: types.SimpleNamespace(total_memory=64 * 1024 ** 3, name="cpu")
    mod.reset_peak_memory_stats = lambda device=None: None
    mod.empty_cache = lambda: None
    mod.memory_stats = lambda device=None: {}
    mod.memory = types.SimpleNamespace(_record_memory_history=lambda *a, **k: None, _snapshot=lambda: {})
    return mod


def _patch_device() -> None:
    import torch._utils as tu

    original = tu._get_available_device_type
    tu._get_available_device_type = lambda: "cpu"
    try:
        import torchtitan.tools.utils as utils
    finally:
        tu._get_available_device_type = original
    utils.device_type = "cpu"
    utils.device_module = _cpu_device_module()


def _dense_attention(q, k, v, *, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                     return_aux=None, kernel_options=None):
    """What flex_attention computes (with ``block_mask``'s ``mask_mod``), in plain differentiable torch ops."""
    from torch.nn.attention.flex_attention import AuxOutput, create_mask

    assert score_mod is None, "the CPU attention stand-in takes no score_mod"
    B, H, L, E = q.shape
    S = k.shape[-2]
    if enable_gqa and k.shape[1] != H:
        k = k.repeat_interleave(H // k.shape[1], dim=1)
        v = v.repeat_interleave(H // v.shape[1], dim=1)
    scale = 1.0 / (E ** 0.5) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale
    if block_mask is not None:
        mask = create_mask(block_mask.mask_mod, B, 1, L, S, device=q.device)
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.exp(scores - lse.unsqueeze(-1)) @ v
    want_lse = return_aux is not None and getattr(return_aux, "lse", False)
    return out, AuxOutput(lse=lse if want_lse else None, max_scores=None)


def _patch_attention() -> None:
    from torch.nn.attention.flex_attention import create_block_mask

    import torchtitan.models.common.attention as attention
    import torchtitan.models.common.decoder as decoder

    attention.FlexAttention._compiled_flex_attn = staticmethod(_dense_attention)

    def eager_mask(*args, **kwargs):
        kwargs.pop("separate_full_blocks", None)
        return create_block_mask(*args, _compile=False, **kwargs)

    attention.create_attention_mask = eager_mask
    decoder.create_attention_mask = eager_mask


def _patch_distributed() -> None:
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = lambda timeout, group=None: c10d._set_pg_timeout(timeout, group)
    # importlib, not an import statement: under shardprop.launch a statement here would get shardprop's
    # stand-in; this patch is for torch's fully_shard (shardprop's never reads it).
    collectives = importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_collectives")
    original = collectives._get_gradient_divide_factors

    def sum_only(*args, **kwargs):  # gloo: SUM then divide, as torch does for MTIA
        kwargs["force_sum_reduction_for_comms"] = True
        return original(*args[:5], **kwargs)

    collectives._get_gradient_divide_factors = sum_only


def _patch_recording(path: str) -> None:
    from torchtitan.components.metrics import MetricsProcessor

    original = MetricsProcessor.log

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        # tps as torchtitan computes it (tokens since the last log over the time since), read just before it does
        tps = self.ntokens_since_last_log / ((time.perf_counter() - self.time_last_log)
                                             * self.parallel_dims.non_data_parallel_size)
        if int(os.environ.get("RANK", "0")) == 0:
            with open(path, "a") as f:
                f.write(json.dumps({"step": step, "loss": float(global_avg_loss), "max_loss": float(global_max_loss),
                                    "grad_norm": float(grad_norm), "tps": tps}) + "\n")
        return original(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)

    MetricsProcessor.log = log

    from torchtitan.trainer import Trainer

    original_init = Trainer.__init__

    def init(self, *args, **kwargs):  # which DTensor the parameters are: torch's or shardprop's
        original_init(self, *args, **kwargs)
        if int(os.environ.get("RANK", "0")) == 0:
            kinds = sorted({f"{type(p).__module__}.{type(p).__qualname__}"
                            for part in self.model_parts for p in part.parameters()})
            with open(path, "a") as f:
                f.write(json.dumps({"parameter_types": kinds}) + "\n")

    Trainer.__init__ = init


def main() -> None:
    torch.set_num_threads(int(os.environ.get("CLIENTS_THREADS", "1")))
    _patch_device()
    _patch_distributed()
    _patch_attention()
    if os.environ.get("CLIENTS_RECORD"):
        _patch_recording(os.environ["CLIENTS_RECORD"])
    sys.argv = ["torchtitan.train"] + sys.argv[1:]
    runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
