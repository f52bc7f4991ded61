"""The front page's example as a whole program: 4 ranks, `torchrun --nproc-per-node 4 docs/examples/quickstart.py`."""
import torch

import shardprop
from shardprop import Replicate, Shard, distribute_tensor, init_device_mesh

mesh = init_device_mesh("cpu", (4,))                 # under torchrun, 4 ranks
torch.manual_seed(0)                                  # the same values on every rank
x = distribute_tensor(torch.randn(8, 16), mesh, [Shard(0)])
w = distribute_tensor(torch.randn(16, 4), mesh, [Replicate()])
with shardprop.explain() as ex:
    y = (x @ w).relu()                                # stays S(0): no communication
print(y.placements)                                   # (Shard(dim=0),)
print(y.redistribute(placements=[Replicate()]).to_local().shape)  # torch.Size([8, 4])
with mesh:                                            # as torch's: the mesh argument may be left out
    z = distribute_tensor(torch.ones(8), placements=[Shard(0)])
print(z.to_local())                                   # tensor([1., 1.])
