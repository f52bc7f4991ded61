"""The planner's cost model: collective time, compute time and memory, from a calibration.

A collective of kind ``c`` over ``k`` ranks that moves ``m`` bytes per rank takes
``alpha(c, k) + m / bandwidth(c, k)`` (the alpha-beta model, fitted by :mod:`.calibrate` from
measured times), plus, inside a training step, ``step_latency(k)``: the wait for late peers, which
lock-step micro-benchmarks do not see (fitted from timed training steps). Bytes moved per rank are the ring algorithms' (all-gather of a shard ``s``:
``s (k-1)``; reduce-scatter of ``b``: ``b (k-1)/k``; all-reduce: twice that; all-to-all:
``b (k-1)/k``). A matmul of ``f`` flops takes ``f / flops``; any other op reads and writes its
bytes at ``elementwise`` bytes/s; every eager op costs ``op_overhead`` seconds more.

Without a measured calibration the built-in :data:`CPU_DEFAULT` (this project's CI machine:
gloo on 2 cores) is used; :data:`PRESETS` holds a GPU-cluster profile for planning on paper.

    >>> cm = CostModel.default()
    >>> cm.collective("all_gather", 4, 1 << 20) > cm.collective("all_gather", 4, 1 << 10)
    True
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from shardprop.tensor.placement import Placement, Replicate, Shard

__all__ = ["CostModel", "CPU_DEFAULT", "PRESETS", "transition_time", "moved_bytes", "default_path", "node_cost", "is_view"]

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


def moved_bytes(kind: str, k: int, nbytes: float) -> float:
    """Bytes one rank sends for ``kind`` over ``k`` ranks on an input of ``nbytes`` (ring algorithms).

    ``nbytes`` is the rank's input: its shard for all-gather, the full buffer otherwise.
        >>> moved_bytes("all_reduce", 4, 400.0)
        600.0
    """
    if k <= 1:
        return 0.0
    if kind == "all_gather":
        return nbytes * (k - 1)
    if kind == "all_reduce":
        return 2 * nbytes * (k - 1) / k
    return nbytes * (k - 1) / k


@dataclass(frozen=True)
class CostModel:
    """Fitted constants: ``links[(kind, k)] = (alpha_s, bytes_per_s)``; compute rates per rank.

    ``source`` says where the numbers come from ("measured on <host> ...", "built-in default").

    Example:
        >>> cm = CostModel.default()  # this machine's calibration if saved, else the built-in CPU profile
        >>> cm.source.startswith(("measured", "built-in")), cm.matmul_flops > 0
        (True, True)
    """

    links: Tuple[Tuple[str, int, float, float], ...]
    matmul_flops: float
    elementwise_bytes: float
    op_overhead: float
    source: str = "built-in default"
    backend: str = "gloo"
    # One eager op on a DTensor through the dispatcher (the optimizer's per-parameter ops under FSDP or TP).
    dtensor_overhead: float = 6e-5
    # Measured / predicted compute of a reference training step (calibrate): what flops and bytes miss
    # (kernel efficiency at training's shapes, allocator, autograd bookkeeping).
    compute_scale: float = 1.0
    # Extra seconds each blocking collective over k ranks costs inside a training step, as ((k, s), ...): the
    # wait for peers that arrive late (on an oversubscribed CPU, a descheduled peer). Micro-benchmarks run the
    # ranks in lock step and miss it; calibrate() fits it from timed training steps of three mesh shapes.
    step_latency: Tuple[Tuple[int, float], ...] = ()

    def _skew(self, k: int) -> float:
        if k <= 1 or not self.step_latency:
            return 0.0
        table = dict(self.step_latency)
        return table.get(k, table[min(table, key=lambda n: abs(math.log(n / k)))])

    def _link(self, kind: str, k: int) -> Tuple[float, float]:
        table = {(c, n): (a, b) for c, n, a, b in self.links}
        if (kind, k) in table:
            return table[(kind, k)]
        sizes = sorted(n for c, n in table if c == kind) or sorted(n for _, n in table)
        kind = kind if any(c == kind for c, _ in table) else next(iter(table))[0]
        near = min(sizes, key=lambda n: abs(n - k))
        a, b = table[(kind, near)]
        # A ring's latency grows with its hops; its bandwidth per rank stays.
        return a * max(k - 1, 1) / max(near - 1, 1), b

    def collective(self, kind: str, k: int, nbytes: float) -> float:
        """Seconds for one ``kind`` over ``k`` ranks on an input of ``nbytes`` per rank."""
        if k <= 1 or nbytes <= 0:
            return 0.0
        a, b = self._link(kind, k)
        return a + self._skew(k) + moved_bytes(kind, k, nbytes) / b

    def bandwidth_time(self, kind: str, k: int, nbytes: float) -> float:
        """The size-proportional part of :meth:`collective` (what batching many tensors into one call keeps)."""
        if k <= 1:
            return 0.0
        return moved_bytes(kind, k, nbytes) / self._link(kind, k)[1]

    def latency(self, kind: str, k: int) -> float:
        return 0.0 if k <= 1 else self._link(kind, k)[0] + self._skew(k)

    def matmul(self, flops: float) -> float:
        return self.compute_scale * flops / self.matmul_flops

    def elementwise(self, nbytes: float) -> float:
        return self.compute_scale * nbytes / self.elementwise_bytes

    def to_json(self) -> dict:
        return {"links": [list(x) for x in self.links], "matmul_flops": self.matmul_flops,
                "elementwise_bytes": self.elementwise_bytes, "op_overhead": self.op_overhead,
                "source": self.source, "backend": self.backend, "dtensor_overhead": self.dtensor_overhead,
                "compute_scale": self.compute_scale, "step_latency": [list(x) for x in self.step_latency]}

    @classmethod
    def from_json(cls, d: dict) -> "CostModel":
        return cls(tuple(tuple(x) for x in d["links"]), d["matmul_flops"], d["elementwise_bytes"],
                   d["op_overhead"], d.get("source", "file"), d.get("backend", "gloo"), d.get("dtensor_overhead", 6e-5),
                   d.get("compute_scale", 1.0), tuple((int(k), s) for k, s in d.get("step_latency", ())))

    @classmethod
    def load(cls, path: Optional[str] = None) -> Optional["CostModel"]:
        """The saved calibration at ``path`` (default :func:`default_path`), or None if there is none."""
        path = path or default_path()
        if not os.path.exists(path):
            return None
        with open(path) as f:
            return cls.from_json(json.load(f))

    @classmethod
    def preset(cls, name: str) -> "CostModel":
        """A built-in profile: "cpu" (this project's CI machine) or "h100" (a GPU cluster, for planning on paper)."""
        return PRESETS[name]

    @classmethod
    def default(cls) -> "CostModel":
        """The saved calibration if this machine has one, else :data:`CPU_DEFAULT`."""
        return cls.load() or CPU_DEFAULT


def default_path() -> str:
    """``$XDG_CACHE_HOME/shardprop/calibration.json`` (``~/.cache/...`` without it)."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "shardprop", "calibration.json")


def _links(alpha: Dict[str, float], bw: Dict[str, float], sizes=(2, 4)) -> tuple:
    return tuple((c, k, alpha[c] * (k - 1), bw[c]) for c in KINDS for k in sizes)


# Measured on this project's CI machine (gloo with the shared-memory transport, 4 ranks on 2 cores,
# 2026-11): tens of microseconds per hop, ~1 GB/s per rank; what tests use without calibrating.
CPU_DEFAULT = CostModel(
    _links({"all_gather": 1.5e-4, "reduce_scatter": 2.0e-4, "all_reduce": 2.5e-4, "all_to_all": 2.0e-4},
           {"all_gather": 1.0e9, "reduce_scatter": 0.7e9, "all_reduce": 0.7e9, "all_to_all": 0.8e9}),
    matmul_flops=1.5e10, elementwise_bytes=2.0e9, op_overhead=1.2e-5, source="built-in default (CPU, gloo)")

# A GPU cluster on paper (H100-class: NVLink inside a node of 8, a 400 Gb/s NIC per GPU across nodes):
# planning Llama3-8B/70B for hundreds of ranks with the fake backend uses this.
PRESETS = {
    "cpu": CPU_DEFAULT,
    "h100": CostModel(
        tuple((c, k, 1e-5 * (k - 1) ** 0.5 + (2e-5 if k > 8 else 0.0), 1.5e11 if k <= 8 else 4.0e10)
              for c in KINDS for k in (2, 4, 8, 16, 32, 64, 128, 256, 512)),
        matmul_flops=4.0e14, elementwise_bytes=2.0e12, op_overhead=5e-6, source="preset h100 (on paper)",
        backend="nccl", dtensor_overhead=3e-5),
}


def transition_time(src: Placement, dst: Placement, nbytes: float, k: int, cm: CostModel) -> float:
    """Forward plus backward seconds to move a tensor of ``nbytes`` (global) from ``src`` to ``dst`` on ``k`` ranks.

    Each forward move has a backward dual: a gather's is a reduce-scatter, a free chunk's a
    gather, an all-reduce's nothing.
        >>> transition_time(Shard(1), Replicate(), 4096.0, 2, CPU_DEFAULT) > 0
        True
    """
    if src == dst or k <= 1:
        return 0.0
    shard = nbytes / k
    ts, td = type(src), type(dst)
    if ts is Replicate:
        if td is Shard:  # a local chunk; its backward gathers the gradient
            return cm.collective("all_gather", k, shard)
        return 0.0  # to Partial: zeros off rank 0 (backward: the gradient as is)
    if ts is Shard:
        if td is Replicate:
            return cm.collective("all_gather", k, shard) + cm.collective("reduce_scatter", k, nbytes)
        if td is Shard:
            return 2 * cm.collective("all_to_all", k, shard)
        return cm.collective("all_gather", k, shard) + cm.collective("reduce_scatter", k, nbytes)
    # Partial
    if td is Replicate:
        return cm.collective("all_reduce", k, nbytes)
    if td is Shard:
        return cm.collective("reduce_scatter", k, nbytes) + cm.collective("all_gather", k, shard)
    return cm.collective("all_reduce", k, nbytes) if src != dst else 0.0


_VIEW_WORDS = ("view", "transpose", "expand", "unsqueeze", "squeeze", "slice", "alias", "permute", ".t.",
               "select", "split", "unbind", "detach")
_MATMUL = {"aten.mm.default", "aten.bmm.default", "aten.addmm.default", "aten.baddbmm.default"}


def is_view(node) -> bool:
    """Whether a traced node is a view (no compute, no memory of its own)."""
    name = str(node.op)
    return node.kind == "op" and any(w in name for w in _VIEW_WORDS)


def _bytes(meta) -> float:
    return math.prod(meta.shape) * meta.dtype.itemsize if meta is not None else 0.0


def node_cost(node, graph, cm: CostModel) -> float:
    """Forward + backward seconds of a traced node on one process (unsharded, whole batch).

    Matmuls (grouped ones and attention too) by their flops, anything else by the bytes it reads and writes;
    backward is taken as twice the forward.
    """
    if node.kind != "op" or is_view(node):
        return 0.0
    name = str(node.op)
    metas = [graph.nodes[r.node].metas[r.out] for r in node.refs]
    if name in _MATMUL and len(metas) >= 2:
        a, b = metas[-2], metas[-1]
        return 3 * cm.matmul(2 * math.prod(a.shape) * b.shape[-1])
    if name == "aten._grouped_mm.default" and len(metas) >= 2:  # MoE experts: each row of a meets one group's [k, n]
        return 3 * cm.matmul(2 * math.prod(metas[0].shape) * metas[1].shape[-1])
    if "scaled_dot_product" in name and len(metas) >= 3:
        q, k = metas[0], metas[1]
        return 3 * cm.matmul(4 * math.prod(q.shape) * k.shape[-2] / 2)  # causal: half the scores
    moved = sum(_bytes(m) for m in metas) + sum(_bytes(m) for m in node.metas)
    return 3 * cm.elementwise(moved)
