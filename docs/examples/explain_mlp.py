"""What `explain()`, `comm_counter()` and the cache statistics print for a tensor-parallel MLP (4 ranks):
`torchrun --nproc-per-node 4 docs/examples/explain_mlp.py`."""
import torch
import torch.distributed as dist
from torch import nn

import shardprop
from shardprop import ColwiseParallel, RowwiseParallel, comm_counter, init_device_mesh, parallelize_module

mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
torch.manual_seed(0)
mlp = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
mlp = parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
x = torch.randn(8, 16)

shardprop.clear_cache()
with shardprop.explain() as ex, comm_counter() as counter:
    mlp(x).sum().backward()
if dist.get_rank() == 0:
    print(ex)
    print(counter.counts)

a = shardprop.distribute_tensor(torch.randn(8, 16), mesh, [shardprop.Shard(0)])
for _ in range(3):
    a = a * 0.5                                       # one miss, then hits
if dist.get_rank() == 0:
    shardprop.print_cache_stats()
    print(shardprop.cache_stats()[:2])
with shardprop.fast_paths(False), shardprop.explain() as ex:
    mlp(x)
if dist.get_rank() == 0:
    print(ex)
