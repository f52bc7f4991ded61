"""One rank of the two-host tier (``tests/test_two_hosts.py``), started by torchrun.

Two torchrun agents on one machine, each with its own ``SHARDPROP_HOST_ID``, give 2 "hosts" x 2
ranks: shared memory carries the messages inside a host, gloo between them. The rank runs the demo
(it checks its losses against one process), then a redistribution sweep on a (host, local) mesh and
one ``fully_shard`` step against one process, and prints ``TWO-HOSTS OK <rank>`` at the end.
"""
import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise SystemExit(f"rank {os.environ.get('RANK')}: {what}")


def _transport_peers_are_this_hosts_ranks() -> None:
    from shardprop.mesh.transport import shm_transport
    me, host = dist.get_rank(), os.environ["SHARDPROP_HOST_ID"]
    ids = [None] * dist.get_world_size()
    dist.all_gather_object(ids, host)
    same = [r for r, h in enumerate(ids) if h == host and r != me]
    t = shm_transport.active()
    peers = sorted(t._out) if t is not None else []
    _check(peers == same and len(same) == 1, f"shared-memory peers {peers}, but this host's other ranks are {same}")


def _sweep(mesh) -> int:
    from shardprop import Partial, Replicate, Shard, distribute_tensor
    from shardprop.mesh.transport import shm_transport
    full = torch.arange(10 * 6, dtype=torch.float32).reshape(10, 6)  # 10 rows: uneven over 4 ranks
    options = [Shard(0), Shard(1), Replicate()]
    before = shm_transport.active().messages_sent
    n = 0
    for a in options:
        for b in options:
            x = distribute_tensor(full, mesh, [a, b])
            for c in options:
                for d in options:
                    y = x.redistribute(mesh, [c, d])
                    _check(torch.equal(y.full_tensor(), full), f"[{a}, {b}] -> [{c}, {d}] lost values")
                    n += 1
    x = distribute_tensor(full, mesh, [Replicate(), Replicate()]).redistribute(mesh, [Partial(), Partial()])
    for target in ([Replicate(), Replicate()], [Shard(0), Shard(1)], [Replicate(), Shard(0)]):
        _check(torch.equal(x.redistribute(mesh, target).full_tensor(), full), f"[P, P] -> {target} lost values")
        n += 1
    _check(shm_transport.active().messages_sent > before, "no message went through shared memory inside the host")
    return n


def _fully_shard_step() -> None:
    from shardprop import fully_shard, init_device_mesh
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    ref = copy.deepcopy(model)
    x = torch.randn(8, 8)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    r, n = dist.get_rank(), dist.get_world_size()
    rows = x.shape[0] // n
    model(x[r * rows:(r + 1) * rows]).pow(2).sum().backward()
    opt.step()
    (ref(x).pow(2).sum() / n).backward()  # fully_shard averages gradients over the ranks
    ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        _check(torch.allclose(p.full_tensor(), q, atol=1e-5), f"fully_shard step: {name} differs from one process")


def _stage(what: str) -> None:
    print(f"rank {os.environ.get('RANK')} ({os.environ.get('SHARDPROP_HOST_ID')}): {what}", flush=True)


def main() -> None:
    # One default group for everything: the demo, started inside it, uses it as it is (a second
    # init_process_group after destroy_process_group under torchrun's agent store hung here).
    _stage("group")
    dist.init_process_group("gloo")
    try:
        from shardprop import init_device_mesh
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("host", "local"))
        _transport_peers_are_this_hosts_ranks()
        _stage("sweep")
        n = _sweep(mesh)
        _stage("fully_shard")
        _fully_shard_step()
        _stage("demo")
        from shardprop.demo.train import main as demo
        demo(["--mesh", "2x2", "--steps", "3", "--device", "cpu"])  # raises on a loss mismatch
        dist.barrier()
        print(f"TWO-HOSTS OK {dist.get_rank()} ({n} redistributions)", flush=True)
    finally:
        dist.destroy_process_group()

if __name__ == "__main__":
    sys.exit(main())
