"""`fully_shard` on 4 ranks: each block is one unit, the root owns the rest; checked against one process.
`torchrun --nproc-per-node 4 docs/examples/fsdp_train.py`."""
import math

import torch
import torch.distributed as dist

from shardprop import fully_shard, init_device_mesh
from shardprop.demo.model import Llama, LlamaConfig, lm_loss, reference_losses, synthetic_batch

cfg = LlamaConfig(dim=64, n_layers=2, n_heads=4, vocab_size=256, seq_len=32)
mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
model = Llama(cfg, seed=0)
for block in model.layers:
    fully_shard(block, mesh=mesh)                     # one all-gather per unit forward, one reduce-scatter backward
fully_shard(model, mesh=mesh)                         # the root: embeddings, final norm, output
opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)   # steps on the shards

rank, n = dist.get_rank(), dist.get_world_size()
losses = []
for step in range(3):
    tokens, targets = synthetic_batch(cfg, batch=8, step=step)
    rows = slice(rank * 8 // n, (rank + 1) * 8 // n)  # this rank's rows of the global batch
    loss = lm_loss(model(tokens[rows]), targets[rows])
    loss.backward()                                   # gradients: the dp average's shard
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    losses.append(total.item() / n)

expected = reference_losses(cfg, steps=3, batch=8, optimizer="adamw")
w = model.layers[0].attention.wq.weight
if rank == 0:
    print("wq:", w.placements, "local", tuple(w.to_local().shape), "of", tuple(w.shape))
    print("losses", [round(x, 4) for x in losses])
    print("matches one process:", all(math.isclose(a, b, rel_tol=1e-4) for a, b in zip(losses, expected)))
assert all(math.isclose(a, b, rel_tol=1e-4) for a, b in zip(losses, expected)), (losses, expected)
