"""Benchmark checkpoints: DCP save/load of a ~200 MB tensor-parallel model, shardprop vs torch.distributed.tensor.

Spawns 4 CPU ranks (gloo on 127.0.0.1, one thread each). The model is a stack of bias-free
``Linear`` layers (``--layers`` x ``--dim`` x ``4*dim``, float32; default 8 x 1280 x 5120, 200 MiB),
column/row-parallel over the ``tp`` dim of a 2x2 ``("dp", "tp")`` mesh (so every shard has a
dp replica), built once with shardprop's ``parallelize_module`` and once with torch's, from the
same seed. Both go through the same calls:

* save:            ``dcp.save({"model": model.state_dict()})``
* load (same):     ``dcp.load`` into the model that wrote it
* load (reshard):  ``dcp.load`` into the same model over a 1-d tp=4 mesh
* bytes per rank:  this rank's ``__<rank>_*.distcp`` files after a save

The contenders alternate, first one then the other, for ``--reps`` rounds; a barrier precedes
and follows every timed call (the time is rank 0's), the table shows medians and ours/ref.
Checkpoints go to ``--dir`` (default /dev/shm, so the disk's noise does not drown the
difference; each is deleted after its round). Loaded values are checked against each other.

A second table times the other workflows on the same model (ours vs the reference's own way to
do the same, or its error; 3 alternating runs each, medians): async_save, full state dict gather and load, and a
cross-mesh redistribute of one layer's weight.

Targets: save and load time ratios <= 1.0; bytes per rank equal to the reference's or fewer.

Usage::

    python bench/checkpoint.py [--reps 5] [--layers 8] [--dim 1280] [--dir /dev/shm] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _launch import launch  # noqa: E402

WORLD = 4


def _model(layers: int, dim: int):
    torch.manual_seed(0)
    mods = []
    for i in range(layers):
        mods.append(torch.nn.Linear(dim, 4 * dim, bias=False) if i % 2 == 0 else torch.nn.Linear(4 * dim, dim, bias=False))
    return torch.nn.Sequential(*mods)


def _plan(styles, layers: int):
    col, row = styles
    return {str(i): (col() if i % 2 == 0 else row()) for i in range(layers)}


def _build(kind: str, mesh_shape, layers: int, dim: int):
    """(model, its tp mesh, the full mesh) for ``kind`` in ("ours", "ref")."""
    if kind == "ours":
        from shardprop import ColwiseParallel, RowwiseParallel, init_device_mesh, parallelize_module
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    names = ("dp", "tp") if len(mesh_shape) == 2 else ("tp",)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    tp = mesh["tp"]
    model = parallelize_module(_model(layers, dim), tp, _plan((ColwiseParallel, RowwiseParallel), layers))
    return model, tp, mesh


def _timed(fn):
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    dist.barrier()
    return time.perf_counter() - t0, out


def _my_bytes(path: str) -> int:
    me = dist.get_rank()
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.startswith(f"__{me}_"))


def _locals(model):
    return [p.to_local().clone() for p in model.parameters()]


def body(rank: int, world: int, reps: int, layers: int, dim: int, root: str) -> dict:
    import torch.distributed.checkpoint as dcp
    warnings.filterwarnings("ignore")
    models = {k: {"2x2": _build(k, (2, 2), layers, dim), "4": _build(k, (4,), layers, dim)} for k in ("ours", "ref")}
    for k in models:  # the resharding targets start from other values
        with torch.no_grad():
            for p in models[k]["4"][0].parameters():
                p.zero_()
    times = {k: {"save": [], "load": [], "load_reshard": []} for k in models}
    nbytes = {}
    for rep in range(reps):
        for k in (("ours", "ref") if rep % 2 == 0 else ("ref", "ours")):
            path = os.path.join(root, f"{k}-{rep}")
            src, dst = models[k]["2x2"][0], models[k]["4"][0]
            t, _ = _timed(lambda: dcp.save({"model": src.state_dict()}, checkpoint_id=path))
            times[k]["save"].append(t)
            if rep == 0:
                nbytes[k] = _my_bytes(path)
            t, _ = _timed(lambda: dcp.load({"model": src.state_dict()}, checkpoint_id=path))
            times[k]["load"].append(t)
            t, _ = _timed(lambda: dcp.load({"model": dst.state_dict()}, checkpoint_id=path))
            times[k]["load_reshard"].append(t)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path)
    same = all(torch.equal(a, b) for a, b in zip(_locals(models["ours"]["4"][0]), _locals(models["ref"]["4"][0])))
    full_ok = all(torch.equal(p.full_tensor(), q) for p, q in zip(models["ours"]["4"][0].parameters(),
                                                                      _model(layers, dim).parameters()))
    all_bytes = [None] * world
    dist.all_gather_object(all_bytes, nbytes)
    workflows = _workflows(models, root, layers, dim)
    med = {k: {op: statistics.median(v) for op, v in ops.items()} for k, ops in times.items()}
    return dict(times=times, median=med, bytes=all_bytes, values_match=same and full_ok, workflows=workflows,
                model_mb=sum(p.numel() for p in _model(layers, dim).parameters()) * 4 / 2**20)


WORKFLOW_REPS = 3


def _try_once(fn):
    try:
        t, _ = _timed(fn)
        return dict(ok=True, seconds=t)
    except BaseException as e:  # CheckpointException is a BaseException
        dist.barrier()
        return dict(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}")


def _pair(ours, ref):
    """Run both contenders WORKFLOW_REPS times, alternating; (ours, ref) with median seconds (or the error)."""
    runs = {"o": [], "r": []}
    for rep in range(WORKFLOW_REPS):
        for k in (("o", "r") if rep % 2 == 0 else ("r", "o")):
            if runs[k] and not runs[k][-1]["ok"]:
                continue  # it failed: once is enough
            runs[k].append(_try_once(ours if k == "o" else ref))
    out = []
    for k in ("o", "r"):
        bad = [r for r in runs[k] if not r["ok"]]
        out.append(bad[0] if bad else dict(ok=True, seconds=statistics.median(r["seconds"] for r in runs[k])))
    return tuple(out)


def _workflows(models, root, layers, dim) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    import shardprop
    me = dist.get_rank()
    out = {}
    ours, ref = models["ours"]["2x2"][0], models["ref"]["2x2"][0]
    ours4, ref4 = models["ours"]["4"][0], models["ref"]["4"][0]

    def async_save(model, name):
        fut = dcp.async_save({"model": model.state_dict()}, checkpoint_id=os.path.join(root, f"async-{name}"))
        fut.result()
    out["dcp.async_save + wait"] = _pair(lambda: async_save(ours, "ours"), lambda: async_save(ref, "ref"))
    full = {}
    out["full state dict gather (rank 0, cpu)"] = _pair(
        lambda: full.__setitem__("ours", shardprop.full_state_dict(ours)),
        lambda: full.__setitem__("ref", get_model_state_dict(
            ref, options=StateDictOptions(full_state_dict=True, cpu_offload=True))))
    plain = _model(layers, dim).state_dict()
    gathered_ok = me != 0 or all(torch.equal(full["ours"][k], v) for k, v in plain.items())
    out["model.load_state_dict(full sd)"] = _pair(lambda: ours4.load_state_dict(dict(plain)),
                                                  lambda: ref4.load_state_dict(dict(plain)))
    out["full sd from rank 0 only"] = _pair(
        lambda: shardprop.load_full_state_dict(ours4, dict(plain) if me == 0 else None),
        lambda: set_model_state_dict(ref4, dict(plain) if me == 0 else {}, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True)))  # (it replaces the dict's entries)
    loaded_ok = all(torch.equal(p.full_tensor(), plain[k]) for k, p in ours4.named_parameters())
    # One layer's weight from the 2x2 mesh ([S(0), S(1)]) to the 1-d mesh ([S(1)]), over the same ranks.
    from torch.distributed.tensor import Shard as RS, distribute_tensor as rdist
    w = plain["0.weight"]
    mo, mr = models["ours"]["2x2"][2], models["ref"]["2x2"][2]
    xo = shardprop.distribute_tensor(w, mo, [shardprop.Shard(0), shardprop.Shard(1)])
    xr = rdist(w, mr, [RS(0), RS(1)])
    m1o, m1r = models["ours"]["4"][2], models["ref"]["4"][2]
    moved = {}
    out["redistribute to another mesh (2x2 -> 4)"] = _pair(
        lambda: moved.__setitem__("o", xo.redistribute(m1o, [shardprop.Shard(1)])),
        lambda: xr.redistribute(m1r, [RS(1)]))
    moved_ok = "o" in moved and torch.equal(moved["o"].full_tensor(), w)
    shutil.rmtree(os.path.join(root, "async-ours"), ignore_errors=True) if me == 0 else None
    shutil.rmtree(os.path.join(root, "async-ref"), ignore_errors=True) if me == 0 else None
    return dict(rows=out, checks=dict(gathered=gathered_ok, loaded=loaded_ok, moved=moved_ok))


def _fmt(r):
    return f"{r['seconds'] * 1e3:9.1f} ms" if r["ok"] else "  fails"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=1280)
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = ap.parse_args(argv)
    root = tempfile.mkdtemp(prefix="shardprop-ckpt-", dir=args.dir)
    try:
        r = launch(body, WORLD, args.reps, args.layers, args.dim, root, timeout_s=600)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"DCP, {r['model_mb']:.0f} MB model, tp over a 2x2 (dp, tp) mesh, 4 ranks, {args.reps} rounds, "
          f"medians (rank 0), checkpoints in {args.dir or 'tmp'}")
    print(f"{'':<26}{'ours':>10}{'reference':>12}{'ours/ref':>10}")
    ratios = {}
    for op, label in (("save", "dcp.save"), ("load", "dcp.load, same layout"), ("load_reshard", "dcp.load, 2x2 -> 4")):
        o, f = r["median"]["ours"][op], r["median"]["ref"][op]
        ratios[op] = o / f
        print(f"{label:<26}{o * 1e3:8.0f} ms{f * 1e3:9.0f} ms{o / f:10.2f}")
    print("\nbytes written per rank (MB):")
    for k in ("ours", "ref"):
        print(f"  {k:<10}" + "  ".join(f"{b[k] / 2**20:7.1f}" for b in r["bytes"]))
    print(f"values after the resharded load match the reference's and the model's: {r['values_match']}")
    print(f"\n{'workflow (same model)':<42}{'ours':>12}{'reference':>14}")
    for name, (o, f) in r["workflows"]["rows"].items():
        print(f"{name:<42}{_fmt(o):>12}{_fmt(f):>14}" + ("" if f["ok"] else f"   ({f['error']})"))
    print(f"checks: {r['workflows']['checks']}")
    result = dict(ratios=ratios, **r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    main()
