"""Where the demo's ranks run and which backend carries their tensors.

    --device cpu    ranks on the CPU, gloo (point-to-point through shared memory on one host)
    --device cuda   every rank with a GPU of its own (GPUs >= ranks): NCCL, one GPU per rank;
                    fewer GPUs than ranks (one GPU, or 2-3 GPUs for the default 4 ranks): the
                    ranks share the GPUs round-robin (rank % GPUs) over gloo, which NCCL
                    cannot do ("Duplicate GPU detected"); gloo then carries CUDA tensors, and
                    what it has no CUDA path for is staged through host memory (mesh/transport/staging.py).
                    ``--nproc 2`` on 2 GPUs is NCCL again.
    --device auto   (the default) cuda when torch sees a GPU, else cpu.

Example:
    >>> plan("cuda", None, gpus=1).describe()
    '4 ranks on cuda:0, gloo carrying CUDA tensors (all_reduce, all_gather, broadcast, scatter direct; reduce_scatter, all_to_all, all_gather_views, send_recv staged through host memory)'
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

DEFAULT_RANKS = 4


@dataclass(frozen=True)
class DevicePlan:
    """The demo's ranks: ``nproc`` ranks on ``device`` over ``backend``, ``gpus`` GPUs visible."""

    device: str
    nproc: int
    backend: str
    gpus: int

    def describe(self) -> str:
        """One line saying which backend carries what.

        Example:
            >>> DevicePlan("cpu", 4, "gloo", 0).describe()
            '4 ranks on cpu, gloo carrying CPU tensors'
        """
        if self.device == "cpu":
            return f"{self.nproc} ranks on cpu, gloo carrying CPU tensors"
        used = min(self.nproc, self.gpus)
        where = "cuda:0" if used == 1 else f"cuda:0..cuda:{used - 1}"
        if self.backend == "nccl":
            return f"{self.nproc} ranks on {where}, one GPU per rank, NCCL carrying every collective"
        from shardprop.mesh.transport import staging
        direct = [c for c in staging.CALLS if staging.route(c, "cuda", "gloo") == staging.DIRECT]
        staged = [c for c in staging.CALLS if staging.route(c, "cuda", "gloo") == staging.STAGE]
        share = "" if used == 1 else f" (rank r on cuda:r % {used})"
        return (f"{self.nproc} ranks on {where}{share}, gloo carrying CUDA tensors ({', '.join(direct)} direct; "
                f"{', '.join(staged)} staged through host memory)")


def visible_gpus() -> int:
    """The CUDA devices torch can use here (0 without a CUDA build or a GPU).

    Example:
        >>> visible_gpus() >= 0
        True
    """
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def plan(requested: str, nproc: Optional[int], gpus: int) -> DevicePlan:
    """The device plan for ``--device requested`` with ``nproc`` ranks (None: 4) and ``gpus`` visible GPUs.

    Raises SystemExit with a clear message for ``cuda`` without a GPU.

    Example:
        >>> plan("cuda", None, gpus=8)
        DevicePlan(device='cuda', nproc=4, backend='nccl', gpus=8)
        >>> plan("auto", 2, gpus=0).device
        'cpu'
    """
    if requested not in ("auto", "cpu", "cuda"):
        raise SystemExit(f"--device {requested}: want auto, cpu or cuda")
    n = DEFAULT_RANKS if nproc is None else nproc
    if n < 1:
        raise SystemExit(f"--nproc {n}: want at least one rank")
    device = requested if requested != "auto" else ("cuda" if gpus > 0 else "cpu")
    if device == "cpu":
        return DevicePlan("cpu", n, "gloo", gpus)
    if gpus < 1:
        raise SystemExit("--device cuda: torch sees no CUDA device here (torch.cuda.is_available() is False or "
                         "device_count() is 0; a CPU-only torch build, or no GPU). Use --device cpu.")
    return DevicePlan("cuda", n, "nccl" if gpus >= n else "gloo", gpus)


__all__ = ["DEFAULT_RANKS", "DevicePlan", "plan", "visible_gpus"]
