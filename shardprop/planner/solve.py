"""One mesh shape's plan as an integer program, solved by HiGHS (``scipy.optimize.milp``).

Decisions: the block boundary's layout ``b`` (replicated, or sequence-sharded: sequence
parallelism), and per unit (each region of the block, the embedding, the output Linear) a
choice ``c`` among the options the rules allow (:mod:`.units`). Variables: ``beta[b]`` (binary,
one boundary) and ``z[u, b, c]`` (binary, ``sum_c z[u, b, c] = beta[b]``): a unit's cost depends
on the boundary around it (what its input and output must be moved as), so each pair is priced.

Objective: the predicted step time on one rank, forward and backward, of

- compute: each unit's ops (matmul flops, elementwise bytes) over dp x cp (the batch and the
  sequence split) and over tp when the unit is sharded;
- tp communication: the redistributions at each unit's edges and their backward duals, from the
  calibrated alpha-beta model (:mod:`.costs`);
- dp communication (``fully_shard`` over dp): all-gather of each unit's parameters forward and
  backward, reduce-scatter of the gradients, plus one latency per collective per unit.

Block units count ``repeats`` times. Memory per rank (parameters, gradients and AdamW state
over tp and dp, saved activations over tp, dp and cp, the unsharded units in flight) is a
constraint when a budget is given.

    >>> sol = solve_shape(units, Shape(dp=2, tp=2), CostModel.default())  # doctest: +SKIP
    >>> sol.step_time, sol.memory  # doctest: +SKIP
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from shardprop.planner.costs import CostModel, transition_time
from shardprop.planner.units import Units
from shardprop.tensor.placement import Partial, Replicate, Shard

__all__ = ["Shape", "Choice", "Solution", "solve_shape", "ADAMW_FACTOR"]

R, S1, P, SL = Replicate(), Shard(1), Partial(), Shard(-1)
ADAMW_FACTOR = 4  # parameter + gradient + two AdamW states


@dataclass(frozen=True)
class Shape:
    """A mesh shape: data parallel (``fully_shard``) x context parallel x tensor parallel (x pipeline stages)."""

    dp: int = 1
    tp: int = 1
    cp: int = 1
    pp: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.cp * self.pp

    def __str__(self) -> str:
        parts = [f"{n} {v}" for n, v in (("pp", self.pp), ("dp", self.dp), ("cp", self.cp), ("tp", self.tp)) if v > 1]
        return " x ".join(parts) or "1 rank"


@dataclass(frozen=True)
class Choice:
    """One unit's decision with its predicted costs (seconds per step, bytes per rank), counted with repeats."""

    unit: str            # "block.attention", "embedding", "output", "block boundary"
    choice: str          # "colwise+rowwise", "replicate", "vocab-sharded", "sequence-parallel", ...
    compute: float
    comm: float
    memory: float
    runner_up: str       # the best other option for this unit, all else equal ("" if none)
    runner_up_delta: float


@dataclass(frozen=True)
class Solution:
    """The solver's answer for one mesh shape."""

    shape: Shape
    boundary: str                      # "replicate" or "sequence-parallel"
    choices: Tuple[Choice, ...]
    compute: float
    tp_comm: float
    dp_comm: float
    overhead: float
    memory: float
    param_memory: float
    solve_seconds: float

    @property
    def step_time(self) -> float:
        return self.compute + self.tp_comm + self.dp_comm + self.overhead

    def of(self, unit: str) -> str:
        return next(c.choice for c in self.choices if c.unit == unit)


def _options(u: Units, shape: Shape, cm: CostModel, sp: Optional[bool] = None, loss_parallel: bool = False
             ) -> Dict[str, Dict[Tuple[str, str], Tuple[float, float, float]]]:
    """unit -> (boundary, choice) -> (compute s, comm s, memory bytes), counted with repeats.

    ``sp``: force sequence parallelism on (True) or off (False); None lets the solver choose.
    """
    k, a = shape.tp, shape.dp * shape.cp
    dp = a  # fully_shard spans dp x cp (torchtitan's dp_shard_cp)
    n = u.repeats
    bounds = (["replicate"] if sp is not True else []) + (["sequence-parallel"] if u.sp_ok and k > 1 and sp is not False else [])
    lay = {"replicate": R, "sequence-parallel": S1}
    tt = lambda s, d, nbytes: transition_time(s, d, nbytes / a, k, cm)

    def params(nbytes: float, unit_w: int) -> Tuple[float, float]:
        """(dp comm s, memory) of parameters of ``nbytes`` already over tp, in ``unit_w`` units."""
        mem = ADAMW_FACTOR * nbytes / dp + (2 * nbytes / max(unit_w, 1) if dp > 1 else 0.0)
        return fsdp_time(cm, dp, nbytes), mem

    out: Dict[str, Dict] = {}
    for r in u.regions:
        opts = {}
        pbytes = sum(l.param_bytes for l in r.entries + ((r.exit,) if r.exit else ()))
        for b in bounds:
            L = lay[b]
            for c in (["colwise+rowwise"] if r.shardable and k > 1 else []) + ["replicate"]:
                shard = c != "replicate"
                comp = r.compute / a / (k if shard else 1)
                if shard:
                    comm = tt(L, R, r.in_bytes) + tt(P, L, r.out_bytes) + (tt(R, P, r.in_bytes) if L == R else 0.0)
                    if L == R:  # Megatron's f and g: the input gradient is partial over tp
                        comm += cm.collective("all_reduce", k, r.in_bytes / a)
                else:
                    comm = tt(L, R, r.in_bytes) + tt(R, L, r.out_bytes)
                dpc, mem = params(pbytes / (k if shard else 1), n * max(len(u.regions), 1))
                mem += r.act_bytes / a / (k if shard else 1)
                opts[(b, c)] = (n * comp, n * (comm + dpc), n * mem)
        out[f"block.{r.path}"] = opts
    opts = {}
    for b in bounds:
        sp = b == "sequence-parallel"
        comp = u.block_rest_compute / a / (k if sp else 1)
        # Under sequence parallelism each norm's weight gradient is partial over tp: one all-reduce per norm.
        norms = max(len(u.block_norms), 1)
        comm = norms * cm.collective("all_reduce", k, u.block_norm_bytes / norms) if sp else 0.0
        dpc, mem = params(u.block_norm_bytes, n)
        mem += u.block_rest_act / a / (k if sp else 1)
        # The root's other ops (the final norm) follow the boundary too.
        comp += u.root_compute / a / (k if sp else 1)
        dpc2, mem2 = params(u.root_rest_param_bytes, 1)
        if sp and u.final_norm:
            dpc2 += cm.collective("all_reduce", k, u.root_rest_param_bytes)
        opts[(b, b)] = (n * comp, n * (comm + dpc) + dpc2, n * mem + mem2)
    if shape.cp > 1:  # ring attention: each block passes its k/v shard cp - 1 times forward, k/v and grads twice back
        for b in bounds:
            kv = u.kv_bytes / a / (k if any(r.shardable for r in u.regions) and k > 1 else 1)
            comp, comm, mem = opts[(b, b)]
            opts[(b, b)] = (comp, comm + n * 3 * cm.collective("all_gather", shape.cp, kv), mem)
    out["block boundary"] = opts
    if n > 1:  # activation checkpointing of every block: recompute each forward, keep only block inputs
        opts = {}
        for b in bounds:
            sp = b == "sequence-parallel"
            split = lambda r: k if (r.shardable and k > 1) else 1
            acts = sum(r.act_bytes / a / split(r) for r in u.regions) + u.block_rest_act / a / (k if sp else 1)
            fwd = (sum(r.compute / a / split(r) for r in u.regions) + u.block_rest_compute / a / (k if sp else 1)) / 3
            opts[(b, "off")] = (0.0, 0.0, 0.0)
            opts[(b, "every block")] = (n * fwd, 0.0, -(n - 1) * acts + n * u.boundary_bytes / a / (k if sp else 1))
        out["activation checkpointing"] = opts
    if u.embedding is not None:
        e, opts = u.embedding, {}
        for b in bounds:
            L = lay[b]
            for c in (["vocab-sharded"] if e.rowwise_ok else []) + ["replicate"]:
                shard = c != "replicate"
                comm = tt(P, L, u.boundary_bytes) if shard else tt(R, L, u.boundary_bytes)
                dpc, mem = params(e.param_bytes / (k if shard else 1), 1)
                opts[(b, c)] = (u.embedding_compute / a, comm + dpc, mem)
        out["embedding"] = opts
    if u.output is not None:
        o, opts = u.output, {}
        for b in bounds:
            L = lay[b]
            cols = ["colwise"] + (["colwise, loss parallel"] if loss_parallel else []) if o.colwise_ok and k > 1 else []
            for c in cols + ["replicate"]:
                shard = c != "replicate"
                comm = tt(L, R, u.boundary_bytes)
                if c == "colwise":  # the logits are gathered (loss parallelism keeps them vocab-sharded)
                    comm += tt(SL, R, u.output_bytes)
                    if L == R:
                        comm += cm.collective("all_reduce", k, u.boundary_bytes / a)
                dpc, mem = params(o.param_bytes / (k if shard else 1), 1)
                mem += 2 * u.output_bytes / a / (k if c == "colwise, loss parallel" else 1)  # logits and their softmax
                opts[(b, c)] = (u.output_compute / a / (k if shard else 1), comm + dpc, mem)
        out["output"] = opts
    return out


def solve_shape(u: Units, shape: Shape, cm: CostModel, *, memory_per_rank: Optional[float] = None,
                sequence_parallel: Optional[bool] = None, loss_parallel: bool = False,
                time_limit: float = 30.0) -> Optional[Solution]:
    """Solve one mesh shape with HiGHS; None when no plan fits ``memory_per_rank`` (bytes).

        >>> solve_shape(units, Shape(tp=2), CostModel.default()).boundary  # doctest: +SKIP
        'sequence-parallel'
    """
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    t0 = time.perf_counter()
    opts = _options(u, shape, cm, sequence_parallel, loss_parallel)
    if not opts.get("block boundary") and u.block_prefix:
        return None
    bounds = sorted({b for o in opts.values() for b, _ in o})
    cols: List[Tuple[str, str, str]] = [("beta", b, "") for b in bounds]
    for unit, o in opts.items():
        cols += [(unit, b, c) for b, c in sorted(o)]
    index = {c: i for i, c in enumerate(cols)}
    cost = np.array([0.0 if c[0] == "beta" else sum(opts[c[0]][(c[1], c[2])][:2]) for c in cols])
    mem = np.array([0.0 if c[0] == "beta" else opts[c[0]][(c[1], c[2])][2] for c in cols])
    rows, rc, vals, lb, ub = [], [], [], [], []

    def row(entries, lo, hi):
        for c, v in entries:
            rows.append(len(lb))
            rc.append(c)
            vals.append(v)
        lb.append(lo)
        ub.append(hi)

    row([(index[("beta", b, "")], 1.0) for b in bounds], 1, 1)
    for unit, o in opts.items():
        for b in bounds:
            row([(index[(unit, b, c)], 1.0) for bb, c in o if bb == b] + [(index[("beta", b, "")], -1.0)], 0, 0)
    if memory_per_rank is not None:
        row([(i, m) for i, m in enumerate(mem) if m], -np.inf, float(memory_per_rank))
    A = coo_matrix((vals, (rows, rc)), shape=(len(lb), len(cols))).tocsr()
    res = milp(cost, constraints=LinearConstraint(A, np.array(lb, float), np.array(ub, float)),
               integrality=np.ones(len(cols)), bounds=Bounds(0, 1), options={"time_limit": time_limit})
    if res.x is None:
        return None
    on = [cols[i] for i, v in enumerate(res.x) if v > 0.5]
    b = next(c[1] for c in on if c[0] == "beta")
    choices = []
    compute = comm_total = memory = 0.0
    for unit, bb, c in on:
        if unit == "beta":
            continue
        comp, comm, m = opts[unit][(bb, c)]
        others = [(sum(v[:2]) - comp - comm, cc) for (b2, cc), v in opts[unit].items() if b2 == bb and cc != c]
        if unit == "block boundary":
            others = [(_total(opts, b2) - _total(opts, bb), b2) for b2 in bounds if b2 != bb]
        delta, name = min(others) if others else (0.0, "")
        choices.append(Choice(unit, c, comp, comm, m, name, delta))
        compute += comp
        comm_total += comm
        memory += m
    pmem = _param_memory(u, shape, on)
    # Eager overhead: every traced op forward and twice in backward, and AdamW's ~12 ops per parameter
    # tensor (on DTensors, through the dispatcher, once anything is sharded).
    sharded = shape.world > 1
    overhead = 3 * u.n_ops * cm.op_overhead + 12 * u.n_params * (cm.dtensor_overhead if sharded else cm.op_overhead)
    dp_lat = 0.0
    g = shape.dp * shape.cp
    if g > 1:  # one all-gather (x2) and one reduce-scatter per fully_shard unit
        dp_lat = (u.repeats + 1) * (2 * cm.latency("all_gather", g) + cm.latency("reduce_scatter", g))
    dp_bw = sum(_dp_part(u, shape, cm, c) for c in on if c[0] != "beta")
    return Solution(shape, b, tuple(choices), compute, comm_total - dp_bw, dp_bw + dp_lat, overhead, memory, pmem,
                    time.perf_counter() - t0)


def _total(opts, b) -> float:
    """Step time of the best plan with boundary ``b`` (each unit at its best option under it)."""
    return sum(min(sum(v[:2]) for (bb, _), v in o.items() if bb == b) for o in opts.values()
               if any(bb == b for bb, _ in o))


def _dp_part(u: Units, shape: Shape, cm: CostModel, col) -> float:
    """The dp share of a chosen option's communication (for the report's split)."""
    if shape.dp * shape.cp <= 1:
        return 0.0
    unit, b, c = col
    if unit == "activation checkpointing":
        return 0.0
    k, dp = shape.tp, shape.dp * shape.cp
    shard = c not in ("replicate",) and unit not in ("block boundary",)
    if unit.startswith("block.") and unit != "block boundary":
        r = next(r for r in u.regions if f"block.{r.path}" == unit)
        nbytes = u.repeats * sum(l.param_bytes for l in r.entries + ((r.exit,) if r.exit else ())) / (k if shard else 1)
    elif unit == "block boundary":
        nbytes = u.repeats * u.block_norm_bytes + u.root_rest_param_bytes
    elif unit == "embedding":
        nbytes = u.embedding.param_bytes / (k if shard else 1)
    else:
        nbytes = u.output.param_bytes / (k if shard else 1)
    return fsdp_time(cm, dp, nbytes)


def fsdp_time(cm: CostModel, dp: int, nbytes: float) -> float:
    """Size-proportional seconds ``fully_shard`` spends per step on parameters of ``nbytes`` (unsharded) over dp.

    Two all-gathers (forward, and backward's re-gather) and one gradient reduce-scatter, plus the copies
    around them: each gathered buffer is copied out to the parameters, each gradient packed into the
    reduce-scatter's buffer (a read and a write of the unsharded bytes each). Latencies are counted per unit.
    """
    if dp <= 1:
        return 0.0
    copies = 3 * cm.elementwise(2 * nbytes)
    return 2 * cm.bandwidth_time("all_gather", dp, nbytes / dp) + cm.bandwidth_time("reduce_scatter", dp, nbytes) + copies


def _param_memory(u: Units, shape: Shape, on) -> float:
    k, dp = shape.tp, shape.dp * shape.cp
    total = 0.0
    for unit, b, c in on:
        shard = c not in ("replicate", "beta") and unit not in ("block boundary", "beta")
        if unit in ("beta", "activation checkpointing"):
            continue
        if unit == "block boundary":
            nbytes = u.repeats * u.block_norm_bytes + u.root_rest_param_bytes
        elif unit == "embedding":
            nbytes = u.embedding.param_bytes
        elif unit == "output":
            nbytes = u.output.param_bytes
        else:
            r = next(r for r in u.regions if f"block.{r.path}" == unit)
            nbytes = u.repeats * sum(l.param_bytes for l in r.entries + ((r.exit,) if r.exit else ()))
        total += ADAMW_FACTOR * nbytes / (k if shard else 1) / dp
    return total
