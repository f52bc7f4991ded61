"""A sharding rule for your own op (a `torch.library` custom op), checked by `check_sharding_rule` (4 ranks):
`torchrun --nproc-per-node 4 docs/examples/custom_rule.py`."""
import torch
import torch.distributed as dist

import shardprop
from shardprop import Replicate, Shard, distribute_tensor, init_device_mesh


@torch.library.custom_op("docs_example::scale", mutates_args=())
def scale(x: torch.Tensor, f: float) -> torch.Tensor:
    return x * f


@scale.register_fake
def _(x, f):
    return torch.empty_like(x)


@shardprop.register_sharding(torch.ops.docs_example.scale.default)
def scale_rule(x, f):          # x is the input's DTensorSpec
    return [([Shard(d)], [Shard(d)]) for d in range(x.ndim)] + [([Replicate()], [Replicate()])]


mesh = init_device_mesh("cpu", (4,))
x = distribute_tensor(torch.randn(8, 16), mesh, [Shard(0)])
y = torch.ops.docs_example.scale(x, 2.0)              # runs shard-local, y is S(0)
print(y.placements)                                   # (S(0),)
report = shardprop.check_sharding_rule(torch.ops.docs_example.scale.default, torch.randn(8, 16), 2.0)
if dist.get_rank() == 0:
    print(report)
