"""Tensor parallelism x data parallelism on 2x2 ranks: the demo's Llama, torchtitan's plan with loss parallelism,
gradients all-reduced over dp; checked against one process. `torchrun --nproc-per-node 4 docs/examples/tp_dp_train.py`."""
import math

import torch
import torch.distributed as dist

import shardprop
from shardprop import comm_counter, init_device_mesh, loss_parallel, parallelize_module, replicate_gradients
from shardprop.demo.model import Llama, LlamaConfig, lm_loss, reference_losses, synthetic_batch, tp_plan

cfg = LlamaConfig(dim=64, n_layers=2, n_heads=4, vocab_size=256, seq_len=32)
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
model = parallelize_module(Llama(cfg, seed=0), mesh["tp"], tp_plan(loss_parallel=True))  # same weights everywhere
dp = replicate_gradients(model, mesh, "dp")           # bucketed async all-reduce of gradients over dp
opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)

losses = []
for step in range(3):
    tokens, targets = synthetic_batch(cfg, batch=8, step=step)   # the global batch; each dp rank takes its rows
    with comm_counter() as counter:
        logits = model(dp.split_batch(tokens))        # vocab-sharded logits: a DTensor, Shard(2) over tp
        with loss_parallel():                         # cross-entropy without gathering the vocabulary
            loss = lm_loss(logits, dp.split_batch(targets))
            loss.backward()
        dp.finish()                                   # waits for the bucket all-reduces
        opt.step()
        opt.zero_grad()
    # Each dp rank's loss is the mean over its rows; the global mean averages them.
    total = torch.tensor([loss.full_tensor().item() if isinstance(loss, shardprop.DTensor) else loss.item()])
    dist.all_reduce(total)
    losses.append(total.item() / dist.get_world_size())

expected = reference_losses(cfg, steps=3, batch=8, optimizer="adamw")
if dist.get_rank() == 0:
    print("losses", [round(x, 4) for x in losses])
    print("collectives in the last step", counter.counts)
    print("matches one process:", all(math.isclose(a, b, rel_tol=1e-4) for a, b in zip(losses, expected)))
assert all(math.isclose(a, b, rel_tol=1e-4) for a, b in zip(losses, expected)), (losses, expected)
