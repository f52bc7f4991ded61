"""Benchmark redistribution: shardprop vs torch.distributed.tensor vs the raw c10d floor.

Spawns 4 CPU ranks (gloo on 127.0.0.1, one thread each). For every transition
of a float32 global tensor, at each size (1, 16 and 64 MB by default), it times

* ours:      ``shardprop`` ``x.redistribute(placements=...)``
* reference: ``torch.distributed.tensor`` ``x.redistribute(placements=...)``
* raw:       the bare c10d collective that moves the same bytes (the floor); for
             permutation transitions (each rank needs at most one other rank's piece)
             the floor is one ``batch_isend_irecv`` of exactly the needed bytes
* direct:    the same bytes as raw moved by direct point-to-point messages, by hand on
             preallocated buffers (every rank sends its pieces straight to every peer): on
             CPU this beats gloo's all-gather / reduce-scatter / all-to-all, which copy
             through temporaries, so it is the lower floor a hand-written program reaches;
             the same as raw for the other rows. Shown for the reader; the targets use raw
* alloc:     raw, but allocating its output on every call as any redistribution must
             (and copying a Partial input first, which a caller still holds): shown for
             the reader, to tell allocation (page faults of fresh buffers, large on CPU
             where nothing caches them) from our own overhead; the targets use raw

interleaved in rotating order, a ``dist.barrier()`` before every timed call;
each sample is the max over ranks of that rank's elapsed time, and the table
shows medians. Each transition is also checked once: ours and the reference
must produce the same local shard (and match the expected one).

Targets (issue 13): geomean of ours/raw over every row and size <= 1.15, and no
row slower than the reference. Per row, for the reader: ours <= 1.10x raw for
transitions along dim 0, <= 1.5x where a layout copy is unavoidable.

Usage::

    python bench/redistribute.py [--reps 10] [--warmup 3] [--sizes 1,16,64] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from shardprop.mesh import compat

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _launch import launch  # noqa: E402

WORLD = 4
DIM0_TARGET = 1.10     # ours/raw where the data already lies in collective order
LAYOUT_TARGET = 1.50   # ours/raw where a layout copy (pack or unpack) is unavoidable
GEOMEAN_TARGET = 1.15  # geomean of ours/raw over all rows and sizes
SIZES_MB = (1.0, 16.0, 64.0)
CONTENDERS = ("ours", "ref", "raw", "alloc", "direct")

# The single-buffer collectives under this torch's names (shardprop.mesh.compat resolves them).
_all_gather_flat = compat.all_gather_flat
_reduce_scatter_flat = compat.reduce_scatter_flat


@dataclass(frozen=True)
class Case:
    """One transition: placements as tokens 'S0', 'S1', 'R', 'P' (Partial sum), one per mesh dim."""

    name: str
    mesh_shape: Tuple[int, ...]
    src: Tuple[str, ...]
    dst: Tuple[str, ...]
    target: float
    floor: str  # what the raw contender does (for the JSON and the reader)
    # The source is the Partial output of ``S(1) @ S(0)`` (timed with it), not a tensor held by the bench.
    mm: bool = False


CASES = [
    Case("S(0)->R", (4,), ("S0",), ("R",), DIM0_TARGET, "all_gather_single of the local shard"),
    Case("S(1)->R", (4,), ("S1",), ("R",), LAYOUT_TARGET, "all_gather_single of the local shard (no layout copy)"),
    Case("P->R", (4,), ("P",), ("R",), DIM0_TARGET, "in-place all_reduce of the full-size tensor"),
    Case("P->S(0)", (4,), ("P",), ("S0",), DIM0_TARGET, "reduce_scatter_single of the full-size tensor"),
    Case("S(0)->S(1)", (4,), ("S0",), ("S1",), LAYOUT_TARGET, "all_to_all_single of the local shard's bytes"),
    # R->S(0) moves nothing. The floor is a copy of this rank's chunk (clone of
    # t.chunk(4)[r]; .contiguous() alone is a no-op view for dim 0), because the
    # result must not alias the input: the reference clones here too.
    Case("R->S(0)", (4,), ("R",), ("S0",), DIM0_TARGET, "clone of the local dim-0 chunk (no communication)"),
    Case("[S(0),S(1)]->[R,R] 2x2", (2, 2), ("S0", "S1"), ("R", "R"), LAYOUT_TARGET,
         "one all_gather_single over all 4 ranks of the local block"),
    # Permutations: each rank needs at most one other rank's piece.
    Case("[S(0),R]->[R,S(0)] 2x2", (2, 2), ("S0", "R"), ("R", "S0"), DIM0_TARGET,
         "batch_isend_irecv: ranks 1 and 2 swap their halves (ranks 0 and 3 keep theirs)"),
    Case("[S(0),S(1)]->[S(1),S(0)] 2x2", (2, 2), ("S0", "S1"), ("S1", "S0"), DIM0_TARGET,
         "batch_isend_irecv: ranks 1 and 2 swap their blocks"),
    Case("[S(0),S(0)]->[S(0),S(1)] 2x2", (2, 2), ("S0", "S0"), ("S0", "S1"), LAYOUT_TARGET,
         "batch_isend_irecv: ranks 0-1 and 2-3 swap half their rows (packed once, outside the timing)"),
    # The Partial a row-parallel matmul leaves: a temporary nobody else holds, reduced in place.
    Case("mm->P->R", (4,), ("P",), ("R",), DIM0_TARGET,
         "local mm of the two shards, then an in-place all_reduce of its output", mm=True),
]
MM_INNER = 4  # inner (contracted) size of each rank's shard in the mm row: the matmul stays cheap


# ------------------------------------------------------------------ per-rank side
def _placements(tokens, lib) -> list:
    """Turn tokens into placements of ``lib`` (a dict with Shard, Replicate, Partial)."""
    out = []
    for tok in tokens:
        if tok.startswith("S"):
            out.append(lib["Shard"](int(tok[1:])))
        elif tok == "R":
            out.append(lib["Replicate"]())
        elif tok == "P":
            out.append(lib["Partial"]())
        else:
            raise ValueError(tok)
    return out


def _expected_local(full: torch.Tensor, coord, dst) -> torch.Tensor:
    """This rank's shard of ``full`` for placements ``dst`` (even chunks, outermost mesh dim first)."""
    mesh_shape = (2, 2) if len(coord) == 2 else (WORLD,)
    for m, tok in enumerate(dst):
        if tok.startswith("S"):
            full = full.chunk(mesh_shape[m], dim=int(tok[1:]))[coord[m]]
    return full


def _materialize(local: torch.Tensor) -> torch.Tensor:
    """Wait for a result that may still be in flight (the reference's AsyncCollectiveTensor)."""
    wait = getattr(local, "wait", None)
    return wait() if callable(wait) else local


def _swap(rank: int, partner: int, send: torch.Tensor, recv) -> Callable[[], None]:
    """One batch_isend_irecv exchanging ``send`` for a buffer ``recv()`` with ``partner`` (nothing where it is this rank)."""
    if partner == rank:
        return lambda: None

    def run():
        ops = [dist.P2POp(dist.isend, send, partner, tag=7), dist.P2POp(dist.irecv, recv(), partner, tag=7)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    return run


def _raw_floor(case: Case, n: int, rank: int, full: torch.Tensor, mm_args=None,
               fresh: bool = False) -> Callable[[], torch.Tensor]:
    """The bare c10d call moving the same bytes as ``case``: buffers allocated once, or each call if ``fresh``."""
    i, j = rank // 2, rank % 2  # coordinate on the 2x2 mesh

    def out_like(t_or_shape):
        shape = t_or_shape.shape if isinstance(t_or_shape, torch.Tensor) else t_or_shape
        if fresh:
            return lambda: torch.empty(shape)
        once = torch.empty(shape)
        return lambda: once
    if case.mm:
        a, b = mm_args
        return lambda: dist.all_reduce(torch.mm(a, b))
    if case.src == ("S0", "S1") and case.dst == ("R", "R"):
        block = full.chunk(2, 0)[rank // 2].chunk(2, 1)[rank % 2].contiguous()
        out = out_like((WORLD * block.numel(),))
        return lambda: _all_gather_flat(out(), block.reshape(-1))
    if case.src == ("S0", "R") and case.dst == ("R", "S0"):  # rows half i -> rows half j
        mine = full.chunk(2, 0)[i].contiguous()
        return _swap(rank, 2 * j + i, mine, out_like(mine))
    if case.src == ("S0", "S1") and case.dst == ("S1", "S0"):  # block (i, j) -> block (j, i)
        mine = full.chunk(2, 0)[i].chunk(2, 1)[j].contiguous()
        return _swap(rank, 2 * j + i, mine, out_like(mine))
    if case.src == ("S0", "S0") and case.dst == ("S0", "S1"):  # rows quarter 2i+j -> rows half i, cols half j
        send = full.chunk(4, 0)[2 * i + j].chunk(2, 1)[1 - j].contiguous()
        return _swap(rank, 2 * i + 1 - j, send, out_like(send))
    if case.src == ("S0",) and case.dst == ("R",) or case.src == ("S1",) and case.dst == ("R",):
        shard = full.chunk(WORLD, int(case.src[0][1]))[rank].contiguous()
        out = out_like((WORLD * shard.numel(),))
        return lambda: _all_gather_flat(out(), shard.reshape(-1))
    if case.src == ("P",) and case.dst == ("R",):
        buf = torch.zeros(n, n)  # reduced in place over and over: zeros never overflow
        if fresh:  # the caller holds its Partial input: reduce a copy
            return lambda: dist.all_reduce(buf.clone())
        return lambda: dist.all_reduce(buf)
    if case.src == ("P",) and case.dst == ("S0",):
        inp = torch.ones(n, n)
        out = out_like((n // WORLD, n))
        return lambda: _reduce_scatter_flat(out(), inp)
    if case.src == ("S0",) and case.dst == ("S1",):
        shard = full.chunk(WORLD, 0)[rank].contiguous()
        out = out_like(shard)
        return lambda: dist.all_to_all_single(out(), shard)
    if case.src == ("R",) and case.dst == ("S0",):
        return lambda: full.chunk(WORLD, 0)[rank].clone()
    raise ValueError(case.name)


def _exchange(rank: int, sends: List[torch.Tensor], recvs: List[torch.Tensor]) -> None:
    """Send ``sends[j]`` to rank j and receive rank j's message into ``recvs[j]`` (own piece copied), one batch."""
    ops = []
    for k in range(1, WORLD):
        to, frm = (rank + k) % WORLD, (rank - k) % WORLD
        ops += [dist.P2POp(dist.isend, sends[to], to, tag=9), dist.P2POp(dist.irecv, recvs[frm], frm, tag=9)]
    works = dist.batch_isend_irecv(ops)
    recvs[rank].copy_(sends[rank])
    for w in works:
        w.wait()


def _direct_floor(case: Case, n: int, rank: int, full: torch.Tensor) -> Optional[Callable[[], None]]:
    """The same bytes as ``raw`` moved by direct messages, by hand on preallocated buffers; None where that is raw.

    Gloo's all-gather, reduce-scatter and all-to-all copy through temporaries of the whole
    output; each rank sending its pieces straight to every peer does not. This is the lower
    floor a hand-written program reaches on CPU; shown beside ``raw`` for the reader.
    """
    if case.mm or case.src == ("P",) and case.dst == ("R",) or len(case.mesh_shape) == 2 and case.dst != ("R", "R") \
            or case.src == ("R",):
        return None  # all-reduce (gloo's ring at these sizes), copies and swaps: raw already is the floor
    if case.src == ("S0", "S1"):
        mine = full.chunk(2, 0)[rank // 2].chunk(2, 1)[rank % 2].contiguous()
    elif case.src == ("P",):  # P -> S(0): every rank's dim-0 piece of its addend to its owner, summed there
        inp = torch.ones(n, n)
        stacked, out = torch.empty(WORLD, n // WORLD, n), torch.empty(n // WORLD, n)

        def reduce_scatter():
            _exchange(rank, list(inp.chunk(WORLD)), list(stacked.unbind(0)))
            torch.sum(stacked, 0, out=out)
        return reduce_scatter
    else:
        mine = full.chunk(WORLD, int(case.src[0][1]))[rank].contiguous()
    if case.dst == ("S1",):  # S(0) -> S(1): the raw all-to-all's bytes, dim-0 slice j to rank j
        out = torch.empty_like(mine)
        return lambda: _exchange(rank, list(mine.chunk(WORLD)), list(out.chunk(WORLD)))
    out = torch.empty((WORLD,) + tuple(mine.shape))
    return lambda: _exchange(rank, [mine] * WORLD, list(out.unbind(0)))


def _check(case: Case, run_ours, run_ref, in_local: torch.Tensor, expected: torch.Tensor) -> Dict:
    """Run each side once and compare local results; flags are agreed over all ranks."""
    before = in_local.clone()
    y_ours = _materialize(run_ours())
    y_ref = _materialize(run_ref())
    exact = "P" not in case.src

    def same(a, b):
        if a.shape != b.shape:
            return False
        return torch.equal(a, b) if exact else torch.allclose(a, b, rtol=1e-5, atol=1e-4)

    in_ptr = in_local.untyped_storage().data_ptr()
    flags = torch.tensor([
        float(same(y_ours, y_ref)),
        float(same(y_ours, expected)),
        float(same(y_ref, expected)),
        float(y_ours.is_contiguous()),
        float(torch.equal(in_local, before)),
    ])
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    aliased = torch.tensor([float(y_ours.untyped_storage().data_ptr() == in_ptr)])
    dist.all_reduce(aliased, op=dist.ReduceOp.MAX)
    diff = torch.tensor([(y_ours.double() - y_ref.double()).abs().max().item()
                         if y_ours.shape == y_ref.shape and y_ours.numel() else 0.0 if y_ours.shape == y_ref.shape
                         else float("inf")])
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return {"ours_eq_ref": bool(flags[0]), "ours_eq_expected": bool(flags[1]),
            "ref_eq_expected": bool(flags[2]), "ours_contiguous": bool(flags[3]),
            "input_unchanged": bool(flags[4]),
            "ours_aliases_input": bool(aliased[0]), "max_abs_diff": diff.item(),
            "ours_shape": list(y_ours.shape), "ref_shape": list(y_ref.shape)}


def _time_case(fns: Dict[str, Callable], reps: int, warmup: int) -> Dict[str, List[float]]:
    """Interleaved timing; returns per-contender samples in ms (max over ranks)."""
    timed = tuple(name for name in CONTENDERS if fns[name] is not None)
    for _ in range(warmup):
        for name in timed:
            fns[name]()
    samples = {name: [] for name in CONTENDERS}
    for i in range(reps):
        k = i % len(timed)
        order = timed[k:] + timed[:k]
        elapsed = torch.zeros(len(CONTENDERS), dtype=torch.float64)
        for name in order:
            dist.barrier()
            t0 = time.perf_counter()
            fns[name]()
            elapsed[CONTENDERS.index(name)] = time.perf_counter() - t0
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        for j, name in enumerate(CONTENDERS):
            samples[name].append(elapsed[j].item() * 1e3)
    for name in CONTENDERS:  # no floor of its own: the raw one is it
        if fns[name] is None:
            samples[name] = list(samples["raw"])
    return samples


def bench_ranks(rank: int, world_size: int, sizes_mb: List[float], reps: int, warmup: int,
                compare_reuse: bool = False) -> Dict:
    """Body run on each rank; rank 0's return value is the result dict (keyed "transition @ N MB")."""
    global CONTENDERS
    assert world_size == WORLD
    if compare_reuse:  # one more contender: ours with output buffer reuse off
        CONTENDERS = CONTENDERS + ("noreuse",)
    results = {}
    for size_mb in sizes_mb:
        results.update(_bench_size(rank, size_mb, reps, warmup))
    return results


def _bench_size(rank: int, size_mb: float, reps: int, warmup: int) -> Dict:
    import shardprop
    from shardprop import Partial, Replicate, Shard, distribute_tensor, init_device_mesh, plan_redistribute
    from torch.distributed.device_mesh import init_device_mesh as ref_init_device_mesh
    from torch.distributed.tensor import DTensor as RefDTensor
    from torch.distributed.tensor import Partial as RP, Replicate as RR, Shard as RS
    from torch.distributed.tensor import distribute_tensor as ref_distribute

    n = _side_for(size_mb)
    ours_lib = {"Shard": Shard, "Replicate": Replicate, "Partial": Partial}
    ref_lib = {"Shard": RS, "Replicate": RR, "Partial": RP}
    meshes = {shape: (init_device_mesh("cpu", shape), ref_init_device_mesh("cpu", shape))
              for shape in sorted({c.mesh_shape for c in CASES})}

    full = torch.randn(n, n, generator=torch.Generator().manual_seed(0))
    # Partial inputs: each rank holds a different full-size addend; the value is their sum.
    partial_sum = torch.zeros(n, n)
    for r in range(WORLD):
        addend = torch.randn(n, n, generator=torch.Generator().manual_seed(1000 + r))
        partial_sum += addend
        if r == rank:
            my_addend = addend
    # The mm row: (n, 4k) @ (4k, n), the first sharded on dim 1, the second on dim 0.
    mm_a = torch.randn(n, WORLD * MM_INNER, generator=torch.Generator().manual_seed(7))
    mm_b = torch.randn(WORLD * MM_INNER, n, generator=torch.Generator().manual_seed(8))

    results = {}
    for case in CASES:
        mesh, ref_mesh = meshes[case.mesh_shape]
        coord = (rank // 2, rank % 2) if len(case.mesh_shape) == 2 else (rank,)
        src_o, dst_o = _placements(case.src, ours_lib), _placements(case.dst, ours_lib)
        src_r, dst_r = _placements(case.src, ref_lib), _placements(case.dst, ref_lib)
        mm_args = None
        if case.mm:
            a, b = distribute_tensor(mm_a, mesh, [Shard(1)]), distribute_tensor(mm_b, mesh, [Shard(0)])
            ar, br = ref_distribute(mm_a, ref_mesh, [RS(1)]), ref_distribute(mm_b, ref_mesh, [RS(0)])
            mm_args = (a.to_local(), b.to_local())
            x = torch.mm(a, b)
            value, in_local = mm_a @ mm_b, a.to_local()
            run_ours = lambda: torch.mm(a, b).redistribute(placements=dst_o).to_local()  # noqa: E731
            run_ref = lambda: torch.mm(ar, br).redistribute(placements=dst_r).to_local()  # noqa: E731
        else:
            if "P" in case.src:
                x = shardprop.DTensor.from_local(my_addend.clone(), mesh, src_o)
                xr = RefDTensor.from_local(my_addend.clone(), ref_mesh, src_r)
                value = partial_sum
            else:
                x = distribute_tensor(full, mesh, src_o)
                xr = ref_distribute(full, ref_mesh, src_r)
                value = full
            in_local = x.to_local()
            run_ours = lambda: x.redistribute(placements=dst_o).to_local()  # noqa: E731
            run_ref = lambda: xr.redistribute(placements=dst_r).to_local()  # noqa: E731
        plan = plan_redistribute(x._spec, tuple(dst_o))
        key = f"{case.name} @ {size_mb:g} MB"
        entry = {"case": case.name, "size_mb": size_mb, "n": n, "floor": case.floor, "target": case.target,
                 "plan": [repr(s) for s in plan.steps]}
        try:
            entry["check"] = _check(case, run_ours, run_ref, in_local, _expected_local(value, coord, case.dst))
            fns = {
                "ours": lambda: _materialize(run_ours()),
                "ref": lambda: _materialize(run_ref()),
                "raw": _raw_floor(case, n, rank, full, mm_args),
                "alloc": _raw_floor(case, n, rank, full, mm_args, fresh=True),
                "direct": _direct_floor(case, n, rank, full),
            }
            if "noreuse" in CONTENDERS:
                fns["noreuse"] = _without_reuse(fns["ours"])
            samples = _time_case(fns, reps, warmup)
            entry["samples_ms"] = samples
            for name in CONTENDERS:
                entry[f"{name}_ms"] = statistics.median(samples[name])
                q = statistics.quantiles(samples[name], n=4)
                entry[f"{name}_iqr_ms"] = [q[0], q[2]]
            # Same-repetition ratios share the load of that moment: a steadier ours-vs-ref signal.
            paired = [o / r for o, r in zip(samples["ours"], samples["ref"])]
            entry["paired_ours_over_ref"] = statistics.median(paired)
            entry["ours_faster_in"] = sum(p < 1 for p in paired)
        except Exception as e:  # record and go on: one broken transition should not hide the rest
            entry["error"] = f"{type(e).__name__}: {e}"  # (a rank-local failure hangs until the timeout)
            print(f"[rank {rank}] {key}: {entry['error']}", file=sys.stderr, flush=True)
        results[key] = entry
        dist.barrier()
    return results


def _without_reuse(run: Callable) -> Callable:
    """``run`` with shardprop's output buffer reuse off (kept buffers stay kept for ``ours``)."""
    from shardprop.mesh import config

    def call():
        with config.patch(buffer_reuse=False):  # forgets the kept buffers; ours' warm-up keeps them again
            return run()
    return call


# ------------------------------------------------------------------ driver side
def _side_for(size_mb: float) -> int:
    """Side of a square float32 tensor of about ``size_mb`` MB, divisible by 4."""
    n = int(math.sqrt(size_mb * 2**20 / 4))
    return max(4, n - n % 4)


def _geomean(xs: List[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def report(results: Dict, reps: int) -> None:
    """Print the table, the geomeans, the checks and the rows that miss their target."""
    from tabulate import tabulate

    rows, misses, warnings, notes = [], [], [], []
    for name, r in results.items():
        if "error" in r:
            warnings.append(f"  ERROR {name}: {r['error']}")
            misses.append(f"  {name}: failed")
            continue
        ours, ref, raw, alloc, direct = r["ours_ms"], r["ref_ms"], r["raw_ms"], r["alloc_ms"], r["direct_ms"]
        r["ours_over_raw"], r["ref_over_raw"], r["ours_over_ref"] = ours / raw, ref / raw, ours / ref
        r["ours_over_alloc"], r["ours_over_direct"] = ours / alloc, ours / direct
        rows.append([r["case"], f"{r['size_mb']:g}", ours, ref, raw, ours / raw, ref / raw, ours / ref, ours / alloc,
                     direct, ours / direct])
        why = []
        if ours / raw > r["target"]:
            why.append(f"ours/raw {ours / raw:.2f} > {r['target']:.2f}")
        if ours > ref:
            why.append(f"slower than the reference ({ours / ref:.2f}x; ours faster in "
                       f"{r['ours_faster_in']}/{reps} same-rep pairs)")
        r["meets_target"] = not why
        if why:
            misses.append(f"  {name}: " + "; ".join(why))
        c = r["check"]
        if not c["ours_eq_ref"]:
            warnings.append(f"  WARNING {name}: ours != reference (max |diff| {c['max_abs_diff']:.3g}, "
                            f"shapes {c['ours_shape']} vs {c['ref_shape']})")
        if not c["ours_eq_expected"]:
            warnings.append(f"  WARNING {name}: ours != expected shard")
        if not c["ref_eq_expected"]:
            warnings.append(f"  WARNING {name}: reference != expected shard")
        if not c["input_unchanged"]:
            warnings.append(f"  WARNING {name}: the input changed")
        if c["ours_aliases_input"]:
            notes.append(f"  note {name}: ours returns a view of the input (the reference copies)")
    sizes = sorted({r["size_mb"] for r in results.values() if "size_mb" in r})
    print(f"\nredistribute: {WORLD} ranks (gloo, 1 thread each), float32 square tensors of "
          f"{', '.join(f'{s:g}' for s in sizes)} MB, median of {reps} reps, ms = max over ranks\n")
    print(tabulate(rows, headers=["transition", "MB", "ours ms", "reference ms", "raw ms", "ours/raw", "ref/raw",
                                  "ours/ref", "ours/(raw+alloc)", "direct ms", "ours/direct"], floatfmt=".3f"))
    g_ours = _geomean([r[5] for r in rows])
    g_ref = _geomean([r[6] for r in rows])
    per_size = {s: (_geomean([r[5] for r in rows if r[1] == f"{s:g}"]), _geomean([r[6] for r in rows if r[1] == f"{s:g}"]))
                for s in sizes}
    for s, (go, gr) in per_size.items():
        print(f"geomean at {s:g} MB: ours/raw {go:.3f}   ref/raw {gr:.3f}")
    g_alloc = _geomean([r[8] for r in rows])
    g_direct = _geomean([r[10] for r in rows])
    print(f"\ngeomean over {len(rows)} rows: ours/raw {g_ours:.3f} (target <= {GEOMEAN_TARGET})   ref/raw {g_ref:.3f}"
          f"   ours/(raw+alloc) {g_alloc:.3f}   ours/direct {g_direct:.3f}")
    with_noreuse = [r for r in results.values() if "noreuse_ms" in r]
    if with_noreuse:
        print("\nbuffer reuse: ours (reuse on) vs noreuse (reuse off), same run")
        print(tabulate([[r["case"], f"{r['size_mb']:g}", r["ours_ms"], r["noreuse_ms"], r["ours_ms"] / r["noreuse_ms"],
                         r["noreuse_ms"] / r["raw_ms"]] for r in with_noreuse],
                       headers=["transition", "MB", "ours ms", "noreuse ms", "ours/noreuse", "noreuse/raw"],
                       floatfmt=".3f"))
        g_nr = _geomean([r["noreuse_ms"] / r["raw_ms"] for r in with_noreuse])
        print(f"geomean noreuse/raw {g_nr:.3f}   ours/noreuse "
              f"{_geomean([r['ours_ms'] / r['noreuse_ms'] for r in with_noreuse]):.3f}")
        for s in sizes:
            rs = [r for r in with_noreuse if r["size_mb"] == s]
            print(f"  at {s:g} MB: ours/raw {_geomean([r['ours_ms'] / r['raw_ms'] for r in rs]):.3f}   "
                  f"noreuse/raw {_geomean([r['noreuse_ms'] / r['raw_ms'] for r in rs]):.3f}")
    print("\nplans (ours):")
    for name, r in results.items():
        if r.get("size_mb") == sizes[-1]:
            print(f"  {r['case']}: " + ("; ".join(r["plan"]) or "(no steps)"))
    print("\nchecks: " + ("ours == reference == expected shard on every transition, inputs unchanged"
                          if not warnings else ""))
    for w in warnings + notes:
        print(w)
    print(f"\nper-row targets (ours/raw <= {DIM0_TARGET} along dim 0, <= {LAYOUT_TARGET} with a layout copy, "
          "ours <= reference): " + ("all met" if not misses else "missed by"))
    for m in misses:
        print(m)
    results["_summary"] = {"geomean_ours_over_raw": g_ours, "geomean_ref_over_raw": g_ref,
                           "geomean_ours_over_raw_alloc": g_alloc, "sizes_mb": sizes,
                           "per_size": {f"{s:g}": v for s, v in per_size.items()}, "world_size": WORLD,
                           "geomean_target": GEOMEAN_TARGET}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=10, help="timed repetitions per contender (default 10)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed warm-up rounds (default 3)")
    ap.add_argument("--sizes", default=",".join(f"{s:g}" for s in SIZES_MB),
                    help="comma-separated global tensor sizes in MB (default 1,16,64)")
    ap.add_argument("--size-mb", type=float, help="one size only (same as --sizes N)")
    ap.add_argument("--compare-reuse", action="store_true",
                    help="add a contender: ours with output buffer reuse off (shardprop.set_buffer_reuse)")
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON, keyed by transition and size")
    args = ap.parse_args(argv)
    if args.reps < 2:
        ap.error("--reps must be at least 2")
    try:
        sizes = [args.size_mb] if args.size_mb else [float(x) for x in args.sizes.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--sizes: expected numbers like 1,16,64, got {args.sizes!r}")
    if not sizes or min(sizes) <= 0:
        ap.error("--sizes: give at least one positive size")

    t0 = time.perf_counter()
    results = launch(bench_ranks, WORLD, sizes, args.reps, args.warmup, args.compare_reuse,
                     timeout_s=900 if args.compare_reuse else 600)
    report(results, args.reps)
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
