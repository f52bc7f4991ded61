"""All-to-all with split sizes known only at run time (token routing for mixtures of experts).

Why a module of its own: the rows each rank sends to each peer (tokens routed to the
experts a peer holds) are decided by the data, so the receiving side learns its split sizes
only from the senders. :func:`all_to_all_uneven` therefore exchanges the sizes first, in one
small even all-to-all, and then moves the rows with the uneven all-to-all of
``collectives.py`` (counted by ``comm_counter()``, staged through host memory where the
backend cannot carry the device's memory, the direct CPU transport where it applies).

The size exchange also carries what every rank must agree on (bytes per row) and a status
word: a rank whose own arguments are wrong (splits that do not sum to its rows, a wrong
number of splits, a negative size) still takes part in the exchange, so every rank of the
group learns of the error and raises the same ``ValueError`` instead of waiting forever for
a message that never comes.

The row move is differentiable: its backward is the inverse all-to-all (splits swapped).

Example:
    >>> out = all_to_all_uneven(x, mesh, "ep", [3, 0, 1, 2])  # 4 ranks; sizes exchanged  # doctest: +SKIP
"""
from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch

from shardprop.mesh import collectives
from shardprop.mesh.collectives import MeshDims

# One record per peer in the size exchange: rows sent to that peer, the sender's status,
# elements per row and bytes per element (a peer must read rows of the same size).
_RECORD = 4
_OK = 0
# Status codes a rank sends when its own arguments are wrong (every rank then raises).
_PROBLEMS = {
    1: "wrong number of split sizes",
    2: "split sizes that do not sum to its rows",
    3: "a negative split size",
    4: "a 0-d tensor (rows are dim 0)",
}
_CALLER = 100  # codes from here on: reasons the caller gives (``exchange_splits(reasons=...)``)


def _own_problem(t: torch.Tensor, splits: Sequence[int], n: int) -> Tuple[int, str]:
    """This rank's status code and the message for it (``(0, "")`` when its arguments are fine)."""
    if not t.ndim:
        return 4, "gave a 0-d tensor"
    if len(splits) != n:
        return 1, f"gave {len(splits)} split sizes for a group of {n} ranks"
    if sum(splits) != t.shape[0]:
        return 2, f"gave split sizes {splits} summing to {sum(splits)} for a tensor of {t.shape[0]} rows"
    if any(x < 0 for x in splits):
        return 3, f"gave a negative split size in {splits}"
    return _OK, ""


def _as_ints(splits) -> List[int]:
    if isinstance(splits, torch.Tensor):
        return [int(x) for x in splits.tolist()]
    return [int(x) for x in splits]


def exchange_splits(t: torch.Tensor, mesh, dims: MeshDims, input_splits, *, what: str = "all_to_all_uneven",
                    extra: Optional[torch.Tensor] = None, reasons: Sequence[str] = (),
                    problem: Optional[Tuple[int, str]] = None) -> Tuple[List[int], Optional[torch.Tensor]]:
    """The rows each peer will send this rank (its output splits), from every rank's ``input_splits``.

    One small even all-to-all of int64 records. Raises the same ``ValueError`` on every rank of
    the group when any rank's splits do not fit its tensor, or ranks disagree on the row size.
    ``extra`` (int64, ``[n, k]``: row ``j`` for peer ``j``) rides along in the same message; the
    rows received from each peer come back as the second result (``[n, k]``), else None.
    A caller that checked its own arguments passes ``problem=(i, detail)`` (``reasons[i]`` is the
    short reason every rank prints; ``reasons`` is the same list on every rank): every rank raises.

    Example:
        >>> mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
        >>> out_splits, _ = exchange_splits(torch.randn(6, 8), mesh, "ep", [3, 0, 1, 2])
        >>> out_splits  # on rank 0: 3 rows from every rank
        [3, 3, 3, 3]
    """
    group, ranks, n = collectives.resolve(mesh, dims)
    splits = _as_ints(input_splits)
    if problem is not None:
        code, message = _CALLER + problem[0], problem[1]
    else:
        code, message = _own_problem(t, splits, n)
    row = math.prod(t.shape[1:]) if t.ndim else -1
    rec = torch.zeros(n, _RECORD, dtype=torch.int64)
    if code == _OK:
        rec[:, 0] = torch.tensor(splits, dtype=torch.int64)
    rec[:, 1] = code
    rec[:, 2] = row
    rec[:, 3] = t.element_size()
    if extra is not None:
        if tuple(extra.shape[:1]) != (n,):
            raise ValueError(f"shardprop {what}: extra records of shape {tuple(extra.shape)}, want ({n}, k)")
        rec = torch.cat([rec, extra.to(torch.int64).cpu().reshape(n, -1)], 1)
    width = rec.shape[1]
    # On t's device: a backend for that device may carry nothing else (NCCL, for one).
    got = collectives.all_to_all(rec.to(t.device).reshape(-1), mesh, dims).reshape(n, width).cpu()
    _raise_on_any_problem(got, ranks, code, message, (row, t.element_size()), what, reasons)
    return [int(x) for x in got[:, 0].tolist()], (got[:, _RECORD:] if extra is not None else None)


def _reason(code: int, reasons: Sequence[str]) -> str:
    if code >= _CALLER and code - _CALLER < len(reasons):
        return reasons[code - _CALLER]
    return _PROBLEMS.get(code, f"status {code}")


def _raise_on_any_problem(got: torch.Tensor, ranks, code: int, message: str, mine: Tuple[int, int],
                          what: str, reasons: Sequence[str] = ()) -> None:
    """Raise on every rank if any rank reported a problem or peers disagree on the row size."""
    bad = [(ranks[i], int(c)) for i, c in enumerate(got[:, 1].tolist()) if c != _OK]
    if bad:
        who = ", ".join(f"rank {r} ({_reason(c, reasons)})" for r, c in bad)
        local = f"; this rank {message}" if code != _OK else ""
        raise ValueError(f"shardprop {what}: bad arguments on {who}{local}. Every rank of the group "
                         "raises this error; no rows were sent")
    rows = {(ranks[i], int(e), int(b)) for i, (e, b) in enumerate(got[:, 2:4].tolist())}
    if any((e, b) != mine for _, e, b in rows):
        shapes = ", ".join(f"rank {r}: {e} elements x {b} B" for r, e, b in sorted(rows))
        raise ValueError(f"shardprop {what}: ranks disagree on the size of a row ({shapes}); every rank must send "
                         "rows of the same shape and dtype. Every rank of the group raises this error")


class AllToAllUneven(torch.autograd.Function):
    """The row move: forward sends ``input_splits``, backward sends the gradient back (splits swapped).

    Under torch.compile it is recorded whole (``shardprop.tensor.compile_support`` marks it
    allow_in_graph): on fake tensors ``collectives.all_to_all`` issues the functional
    all-to-all, so a graph holds it when both split lists are given (exchanging them needs data).

    Example:
        >>> y = AllToAllUneven.apply(x, mesh, 0, [2, 0, 1, 1], [1, 1, 2, 0], False)  # doctest: +SKIP
    """

    @staticmethod
    def forward(ctx, t, mesh, dims, output_splits, input_splits, async_op):
        ctx.route = (mesh, dims, output_splits, input_splits)
        return collectives.all_to_all(t, mesh, dims, output_splits, input_splits, async_op=async_op)

    @staticmethod
    def backward(ctx, grad):
        mesh, dims, output_splits, input_splits = ctx.route
        back = collectives.all_to_all(grad.contiguous(), mesh, dims, input_splits, output_splits)
        return back, None, None, None, None, None


def all_to_all_uneven(t: torch.Tensor, mesh, dims: MeshDims, input_splits, output_splits=None, *,
                      async_op: bool = False) -> torch.Tensor:
    """Send ``input_splits[j]`` rows (dim 0) of ``t`` to rank ``j`` of the group; receive into one tensor.

    ``output_splits[i]`` is the number of rows rank ``i`` sends here; when None (the usual case:
    routing decides them) they are exchanged first in one small all-to-all that also checks
    every rank's arguments (a bad one raises on every rank). Given ``output_splits`` are trusted:
    they must match what the peers send. Zero sizes are fine. Differentiable: the gradient goes
    back by the inverse all-to-all. With ``async_op`` the rows travel while the caller works
    (the size exchange itself completes first) and the result is an ``AsyncTensor``; with
    autograd recording, the move is synchronous. Traceable by torch.compile when both split
    lists are given (plain ints: the graph is specialised on them).

    Example:
        >>> mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
        >>> x = torch.randn(6, 8, requires_grad=True)
        >>> y = all_to_all_uneven(x, mesh, "ep", [3, 0, 1, 2])  # rows from every peer
        >>> y.shape  # on rank 0: 3 rows from each of the 4 ranks
        torch.Size([12, 8])
        >>> y.sum().backward()  # x.grad: ones, through the inverse all-to-all
        >>> torch.equal(x.grad, torch.ones(6, 8))
        True
    """
    input_splits = _as_ints(input_splits)
    if output_splits is None:
        output_splits, _ = exchange_splits(t, mesh, dims, input_splits)
    else:
        output_splits = _as_ints(output_splits)
    if t.requires_grad and torch.is_grad_enabled():
        return AllToAllUneven.apply(t, mesh, dims, output_splits, input_splits, False)
    return collectives.all_to_all(t, mesh, dims, output_splits, input_splits, async_op=async_op)


__all__ = ["AllToAllUneven", "all_to_all_uneven", "exchange_splits"]
