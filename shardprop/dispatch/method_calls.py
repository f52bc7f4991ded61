"""Cheaper local calls for a few hot aten overloads: torch's generated ``Tensor`` methods.

The dispatcher runs an op on the local shards through the overload's C++ callable
(``op._op``), which matches the Python arguments against the schema generically. For
the ops torch.optim's per-parameter loop makes on every parameter at every step (and
a few other common ones), the generated ``torch.Tensor`` method does the same call
with a faster argument parser: 1-3 us less per call inside ``__torch_dispatch__``.

An entry is only correct if the method's own overload resolution lands on exactly the
listed overload for every argument form the dispatcher can pass it (the overload's
schema, positional arguments then keyword-only ones, Python numbers for Scalars and
wrapped numbers). That holds for these: their other overloads are either hidden from
Python (``.Scalar`` twins of ``.Tensor`` ones) or need an argument the listed
overload does not take (``rounding_mode``, ``out``). ``tests/test_optim_step.py``
checks each entry under a dispatch mode that records which overload actually ran.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten
_T = torch.Tensor

# overload -> the torch.Tensor method that resolves to it
METHOD_CALLS = {
    aten.add.Tensor: _T.add,
    aten.add_.Tensor: _T.add_,
    aten.sub.Tensor: _T.sub,
    aten.sub_.Tensor: _T.sub_,
    aten.mul.Tensor: _T.mul,
    aten.mul_.Tensor: _T.mul_,
    aten.div.Tensor: _T.div,
    aten.div_.Tensor: _T.div_,
    aten.sqrt.default: _T.sqrt,
    aten.lerp_.Scalar: _T.lerp_,
    aten.addcmul_.default: _T.addcmul_,
    aten.addcdiv_.default: _T.addcdiv_,
    aten.copy_.default: _T.copy_,
    aten.clone.default: _T.clone,
    aten.neg.default: _T.neg,
    aten.exp.default: _T.exp,
    aten.relu.default: _T.relu,
    aten.mm.default: _T.mm,
    aten.t.default: _T.t,
    aten.transpose.int: _T.transpose,
    aten.unsqueeze.default: _T.unsqueeze,
}


def local_callable(op):
    """The fastest correct callable that runs ``op`` on plain tensors.

    Example:
        >>> local_callable(torch.ops.aten.mul_.Tensor) is torch.Tensor.mul_
        True
    """
    fn = METHOD_CALLS.get(op)
    return fn if fn is not None else getattr(op, "_op", op)
