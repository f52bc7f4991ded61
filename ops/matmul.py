"""Matrix products (mm, bmm, addmm, dot, mv, ...) as einsum equations over dim labels.

Each op is one entry of ``EQUATIONS``: the factors' dim labels and the output's,
with a leading ``+`` when argument 0 is an addend broadcast onto the product
(``addmm(bias, a, b) = beta * bias + alpha * a @ b``). One helper turns an
equation into per-mesh-dim options:

* an output label sharded in every operand that has it gives a shard of the
  output (uneven is fine: each rank computes exactly its rows / columns);
* a contracted label sharded in every factor that has it gives ``P(sum)``: both
  factors are cut along one dim of one size, so their chunks line up; an addend
  must then be ``P(sum)`` too (the sum over ranks would otherwise add it k times);
* a Partial factor times replicated others stays Partial (the product is linear
  in each factor), again with a Partial addend;
* a ``P(max)``/``P(min)`` addend plus a replicated product stays so when ``beta``
  is known not to be negative (adding the same value on every rank commutes with
  max; Python float betas reach the rule as a marker, so only int betas qualify);
* all-Replicate is always possible.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch

from shardprop.dispatch.registry import rule
from shardprop.tensor.placement import Partial, Replicate, Shard
from shardprop.tensor.spec import DTensorSpec

aten = torch.ops.aten


class Equation(NamedTuple):
    """Dim labels of an op: ``addend`` (arg 0 broadcasts onto the output), ``factors``, ``out``."""

    addend: bool
    factors: Tuple[str, ...]
    out: str


def parse(eq: str) -> Equation:
    """Parse ``"+mk,kn->mn"`` (leading ``+``: argument 0 is an addend).

    Example:
        >>> parse("+mk,kn->mn")
        Equation(addend=True, factors=('mk', 'kn'), out='mn')
    """
    addend = eq.startswith("+")
    ins, out = eq.lstrip("+").split("->")
    return Equation(addend, tuple(ins.split(",")), out)


# Packets: every overload (functional, out=, in-place, out_dtype) shares the equation.
EQUATIONS = {
    aten.mm: "mk,kn->mn",
    aten.bmm: "bmk,bkn->bmn",
    aten.mv: "mk,k->m",
    aten.dot: "k,k->",
    aten.vdot: "k,k->",  # conj(first) is applied rank-locally: still linear in each factor over the reals
    aten.addmm: "+mk,kn->mn",
    aten.baddbmm: "+bmk,bkn->bmn",
    aten.addbmm: "+bmk,bkn->mn",
    aten.addmv: "+mk,k->m",
    aten.addr: "+m,n->mn",
}
_PARSED = {}
for _p, _eq in EQUATIONS.items():
    _PARSED[_p] = parse(_eq)
    # In-place variants (addmm_, ...) are separate packets with the same equation.
    _inplace = getattr(aten, _p.__name__ + "_", None)
    if _inplace is not None:
        _PARSED[_inplace] = _PARSED[_p]

# A Partial factor passes through with these reduce ops (the product is linear in it).
LINEAR_REDUCE_OPS = ("sum", "avg")


def _operand_labels(eq: Equation, args) -> Tuple[Tuple[str, ...], Optional[object]]:
    """Labels of each DTensor operand (aligned with ctx.specs), and the addend argument (or None)."""
    labels = []
    addend = None
    if eq.addend:
        addend = args[0]
        if type(addend) is DTensorSpec:
            # Broadcasting aligns from the right: a 1-d bias of addmm is the "n" label.
            labels.append(eq.out[len(eq.out) - addend.ndim:] if addend.ndim else "")
        factors = args[1:1 + len(eq.factors)]
    else:
        factors = args[:len(eq.factors)]
    for f, lab in zip(factors, eq.factors):
        if type(f) is not DTensorSpec:
            raise TypeError(f"matmul rule: expected a DTensor factor, got {f!r}")
        labels.append(lab)
    return tuple(labels), addend


def _beta_not_negative(kwargs) -> bool:
    beta = kwargs.get("beta", 1)
    return type(beta) is int and beta >= 0


def einsum_options(eq: Equation, specs, args, kwargs=None) -> list:
    """Per-mesh-dim options for the product ``eq`` with DTensor operands ``specs``.

    Example:
        >>> einsum_options(parse("mk,kn->mn"), (a, b), (a, b))[:2]  # doctest: +SKIP
        [((S(0), R), (S(0),)), ((R, S(1)), (S(1),))]
    """
    labels, addend = _operand_labels(eq, args)
    has_addend_spec = type(addend) is DTensorSpec
    # A plain (replicated) addend would be counted on every rank of a Partial output.
    partial_ok = not eq.addend or has_addend_spec
    size = {}
    for spec, lab in zip(specs[1:] if has_addend_spec else specs, eq.factors):
        for d, label in enumerate(lab):
            size[label] = spec.shape[d]

    def shard_all(label):
        """Each operand sharded along ``label`` where it really has it (not broadcast), else replicated."""
        out = []
        for spec, lab in zip(specs, labels):
            i = lab.find(label)
            out.append(Shard(i) if i >= 0 and spec.shape[i] == size[label] else Replicate())
        return tuple(out)

    options = []
    for j, label in enumerate(eq.out):
        options.append((shard_all(label), (Shard(j),)))
    if partial_ok:
        contracted = [label for label in dict.fromkeys("".join(eq.factors)) if label not in eq.out]
        for label in contracted:
            ins = shard_all(label)
            if has_addend_spec:
                ins = (Partial("sum"),) + ins[1:]
            options.append((ins, (Partial("sum"),)))
        first = 1 if has_addend_spec else 0
        for op in LINEAR_REDUCE_OPS:
            for f in range(first, len(specs)):
                ins = [Replicate()] * len(specs)
                ins[f] = Partial(op)
                if has_addend_spec:
                    ins[0] = Partial(op)
                options.append((tuple(ins), (Partial(op),)))
        if has_addend_spec and _beta_not_negative(kwargs or {}):
            for op in ("max", "min"):
                options.append(((Partial(op),) + (Replicate(),) * (len(specs) - 1), (Partial(op),)))
    options.append((tuple(Replicate() for _ in specs), (Replicate(),)))
    return options


@rule(*_PARSED)
def matmul(ctx):
    return einsum_options(_PARSED[ctx.op.overloadpacket], ctx.specs, ctx.args, ctx.kwargs)
