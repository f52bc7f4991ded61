"""Benchmark context parallelism: the demo model at long sequences on cp=4 ranks vs one process.

Spawns 4 CPU ranks (gloo on 127.0.0.1, one thread each). Model: the demo's Llama with SDPA
attention (``sdpa=True``), batch 1. For each sequence length, interleaved: one forward+backward
under ``shardprop.context_parallel`` on all 4 ranks (a barrier before; a sample is the max over
ranks), then the same step on the whole sequence in one process (rank 0, the others wait at a
barrier). Medians; the table gives ratios.

Activation memory per rank: the bytes autograd holds for backward at the end of the forward
(every saved tensor's storage counted once, parameters excluded; ``saved_tensors_hooks``). That
is the peak of what grows with the sequence; transient buffers (one attention block, messages in
flight) come on top and are small next to it.

Load balance: the attention work each rank does in the ring, per rank, at ``--balance-seq``:
rank r's schedule (its block pairs, :func:`block_kind`) run in one process (one thread), rank after
rank interleaved, measured as that thread's CPU time (a loaded machine's waiting does not count), the
least of ``--balance-reps`` repetitions, causal with the head+tail layout and with contiguous chunks. Spread =
(max - min) / mean of the per-rank times. (The ring's wall time is the same on every rank, since
the ranks wait for each other's messages; the work is what balancing evens out.)

Step time is given as wall time (max over ranks) and as the main thread's CPU time (max over ranks:
the compute each rank does, without waiting for messages or for cores on a loaded machine).

Targets: causal load-balanced spread <= 10%; activation memory per rank at cp=4 <= 0.35x one process.
CPU note: 4 ranks share this machine's cores, so step-time ratios say little about a real cluster.

Usage::

    python bench/cp.py [--seqs 1024,2048,4096,8192,16384] [--reps 3] [--dim 64] [--layers 2] [--heads 4]
                       [--balance-seq 8192] [--balance-reps 7] [--balance-only] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _launch import launch  # noqa: E402


def _saved_bytes(model, fn):
    """Run ``fn()`` (a forward) while counting the storages autograd saves (parameters excluded); (result, bytes)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def _step(model, cfg, mesh, tokens, targets):
    import shardprop
    from shardprop.demo.model import cp_buffers, lm_loss
    if mesh is None:
        loss, mem = _saved_bytes(model, lambda: lm_loss(model(tokens), targets))
        loss.backward()
        return mem
    buffers, dims = cp_buffers(model, tokens, targets)
    with shardprop.context_parallel(mesh, buffers=buffers, buffer_seq_dims=dims):
        loss, mem = _saved_bytes(model, lambda: lm_loss(model(tokens), targets))
        loss.backward()
    return mem


def _timed(fn):
    """(wall seconds, main-thread CPU seconds, result), each the max over ranks."""
    dist.barrier()
    t0, c0 = time.perf_counter(), time.thread_time()
    out = fn()
    t = torch.tensor([time.perf_counter() - t0, time.thread_time() - c0])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t[0].item(), t[1].item(), out


def _body(rank, world, seqs, reps, dim, layers, heads):
    import shardprop
    from shardprop.demo.model import Llama, LlamaConfig, synthetic_batch
    mesh = shardprop.init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    rows = []
    for seq in seqs:
        cfg = LlamaConfig(dim=dim, n_layers=layers, n_heads=heads, vocab_size=256, seq_len=seq, sdpa=True)
        model = Llama(cfg, seed=0)
        tokens, targets = synthetic_batch(cfg, batch=1, step=0, seed=0)
        cp_t, one_t, cp_c, one_c, cp_mem, one_mem = [], [], [], [], 0, 0
        for i in range(reps + 1):  # the first round warms up
            t, c, cp_mem = _timed(lambda: _step(model, cfg, mesh, tokens, targets))
            if i:
                cp_t.append(t)
                cp_c.append(c)
            model.zero_grad(set_to_none=True)
            if rank == 0:
                t0, c0 = time.perf_counter(), time.thread_time()
                one_mem = _step(model, cfg, None, tokens, targets)
                if i:
                    one_t.append(time.perf_counter() - t0)
                    one_c.append(time.thread_time() - c0)
                model.zero_grad(set_to_none=True)
            dist.barrier()
        mem = torch.tensor([float(cp_mem)])
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        if rank == 0:
            row = dict(seq=seq, cp_ms=1e3 * statistics.median(cp_t), one_ms=1e3 * statistics.median(one_t),
                       cp_cpu_ms=1e3 * statistics.median(cp_c), one_cpu_ms=1e3 * statistics.median(one_c),
                       cp_mem_mb=mem.item() / 2**20, one_mem_mb=one_mem / 2**20)
            rows.append(row)
            print(f"  seq {seq:6d}: cp=4 {row['cp_ms']:9.1f} ms  one {row['one_ms']:9.1f} ms  "
                  f"mem/rank {row['cp_mem_mb']:8.1f} MB vs {row['one_mem_mb']:8.1f} MB", flush=True)
    return rows


def _balance(seq, n, heads, head_dim, reps):
    """Per-rank attention work (forward + backward of its block pairs), seconds, medians; one process."""
    from shardprop.parallel.cp.attention_blocks import block_kind
    from shardprop.parallel.cp.ring_attention import _pair_backward, _pair_forward
    local = seq // n
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, heads, local, head_dim, generator=g) for _ in range(4))
    out = torch.randn_like(q)
    lse = torch.randn(1, heads, local)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    result = {}
    for balanced in (True, False):
        times = {r: [] for r in range(n)}
        for _ in range(reps):
            for r in range(n):
                t0 = time.thread_time()  # CPU time of this (only) compute thread: the machine's load does not count
                for step in range(n):
                    kind = block_kind(r, (r - step) % n, True, balanced)
                    if kind != "skip":
                        _pair_forward(kind, q, k, v, head_dim ** -0.5)
                        _pair_backward(kind, do, q, k, v, out, lse, head_dim ** -0.5, dq, dk, dv)
                times[r].append(time.thread_time() - t0)
        # The least of the repetitions: the work itself; a shared machine only ever adds to it.
        med = [min(times[r]) for r in range(n)]
        mean = sum(med) / n
        result["balanced" if balanced else "contiguous"] = dict(per_rank_ms=[1e3 * m for m in med],
                                                                spread=(max(med) - min(med)) / mean)
    return result


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", default="1024,2048,4096,8192,16384")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--balance-seq", type=int, default=8192)
    p.add_argument("--balance-reps", type=int, default=7)
    p.add_argument("--balance-only", action="store_true", help="only the per-rank attention work")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    seqs = [int(s) for s in args.seqs.split(",")]
    print(f"context parallelism, cp=4 vs one process; demo Llama dim {args.dim}, {args.layers} layers, "
          f"{args.heads} heads, batch 1")
    rows = [] if args.balance_only else launch(_body, 4, seqs, args.reps, args.dim, args.layers, args.heads,
                                               timeout_s=1800.0)
    torch.set_num_threads(1)
    bal = _balance(args.balance_seq, 4, args.heads, args.dim // args.heads, args.balance_reps)
    print(f"\n{'seq':>6}  {'cp=4 ms':>9}  {'one ms':>9}  {'wall ratio':>10}  {'cpu ratio':>9}  {'mem/rank MB':>11}  "
          f"{'one MB':>8}  {'mem ratio':>9}")
    for r in rows:
        r["time_ratio"], r["mem_ratio"] = r["cp_ms"] / r["one_ms"], r["cp_mem_mb"] / r["one_mem_mb"]
        r["cpu_ratio"] = r["cp_cpu_ms"] / r["one_cpu_ms"]
        print(f"{r['seq']:6d}  {r['cp_ms']:9.1f}  {r['one_ms']:9.1f}  {r['time_ratio']:10.2f}  {r['cpu_ratio']:9.2f}  "
              f"{r['cp_mem_mb']:11.1f}  {r['one_mem_mb']:8.1f}  {r['mem_ratio']:9.3f}")
    print(f"\nper-rank causal attention work at seq {args.balance_seq} (ms, fwd+bwd of its block pairs, least of "
          f"{args.balance_reps}):")
    for name, b in bal.items():
        print(f"  {name:>10}: {', '.join(f'{t:.1f}' for t in b['per_rank_ms'])}  spread {100 * b['spread']:.1f}%")
    print(f"\nTargets: balanced spread {100 * bal['balanced']['spread']:.1f}% <= 10%: "
          f"{'PASS' if bal['balanced']['spread'] <= 0.10 else 'FAIL'}", end="")
    if rows:
        last = rows[-1]
        print(f"; memory per rank at seq {last['seq']} {last['mem_ratio']:.3f}x one process <= 0.35x: "
              f"{'PASS' if last['mem_ratio'] <= 0.35 else 'FAIL'}", end="")
    print()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows=rows, balance=bal, args=vars(args)), f, indent=1)


if __name__ == "__main__":
    main()
