"""Save a tensor-parallel model with torch.distributed.checkpoint on 4 ranks, load it into a 2x2 TP x `fully_shard`
model: loading reshards. `torchrun --nproc-per-node 4 docs/examples/checkpoint_reshard.py`."""
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from shardprop import fully_shard, init_device_mesh, parallelize_module
from shardprop.demo.model import Llama, LlamaConfig, tp_plan

cfg = LlamaConfig(dim=64, n_layers=2, n_heads=4, vocab_size=256, seq_len=32)
path = [tempfile.mkdtemp(prefix="shardprop-ckpt-") if dist.get_rank() == 0 else None]
dist.broadcast_object_list(path)                      # one fresh directory, named by rank 0
ckpt = os.path.join(path[0], "step-100")

tp4 = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
saved = parallelize_module(Llama(cfg, seed=0), tp4, tp_plan())
dcp.save({"model": saved.state_dict()}, checkpoint_id=ckpt)   # each rank writes its own shards

mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
loaded = parallelize_module(Llama(cfg, seed=1), mesh["tp"], tp_plan())   # other weights, other layout
for block in loaded.layers:
    fully_shard(block, mesh=mesh["dp"])
fully_shard(loaded, mesh=mesh["dp"])
state = {"model": loaded.state_dict()}
dcp.load(state, checkpoint_id=ckpt)                   # reads only the pieces overlapping each shard
loaded.load_state_dict(state["model"])

same = all(torch.equal(a.full_tensor(), b.full_tensor())
           for a, b in zip(saved.parameters(), loaded.parameters()))
w = loaded.layers[0].attention.wq.weight
if dist.get_rank() == 0:
    print("saved as", saved.layers[0].attention.wq.weight.placements, "loaded as", w.placements)
    print("every parameter equal:", same)
    shutil.rmtree(path[0])
assert same
