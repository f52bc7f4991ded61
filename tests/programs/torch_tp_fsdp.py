"""A training script written for torch's DTensor stack (no shardprop in it): TP x FSDP on 2x2, funcol, DCP.

Run as it is (torch's stack) or through ``python -m shardprop.launch`` (shardprop's): tests/test_launch.py
compares the losses it prints. Usage: torchrun --nproc-per-node 4 torch_tp_fsdp.py CHECKPOINT_DIR
"""
import json
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(16, 32)
        self.down = torch.nn.Linear(32, 16)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def main(ckpt: str) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(MLP(), MLP())
    for block in model:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
        rows = slice(4 * mesh["dp"].get_local_rank(), 4 * mesh["dp"].get_local_rank() + 4)
        loss = ((model(x[rows]) - y[rows]) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = funcol.all_reduce(loss.detach(), "sum", group=mesh["dp"])  # a mesh as the group
        losses.append(float(total) / 2)
    dcp.save({"model": model.state_dict()}, checkpoint_id=ckpt)
    weight = model[0].up.weight
    out = {"losses": losses, "dtensor": type(weight).__module__, "placements": str(weight.placements),
           "is_dtensor": isinstance(weight, DTensor), "shard": weight.placements[0] == Shard(0) or
           weight.placements == (Shard(0), Shard(0)), "replicate": Replicate() == Replicate()}
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
