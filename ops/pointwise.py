"""Pointwise ops: the output follows any shared shard; linear ops also carry Partial.

Broadcasting is aligned from the right: an input dim of size 1 that the output
expands cannot be sharded with the output (it must be replicated instead).
"""
from __future__ import annotations

import torch

from shardprop.dispatch.op_schema import FLOAT, ScalarTensor
from shardprop.dispatch.registry import register_local_call, rule
from shardprop.mesh.compat import aten_packets
from shardprop.tensor.compile_support import when_dynamo_loads
from shardprop.tensor.placement import Partial, Replicate, Shard

aten = torch.ops.aten

UNARY = [
    "abs", "acos", "acosh", "asin", "asinh", "atan", "atanh", "bitwise_not", "ceil", "cos", "cosh", "deg2rad",
    "digamma", "erf", "erfc", "erfinv", "exp", "exp2", "expm1", "floor", "frac", "i0", "isnan", "isinf", "isfinite",
    "isneginf", "isposinf", "lgamma", "log", "log10", "log1p", "log2", "logical_not", "logit", "nan_to_num",
    "neg", "positive", "rad2deg", "reciprocal", "relu", "round", "rsqrt", "sgn", "sigmoid", "sign", "signbit",
    "sin", "sinc", "sinh", "sqrt", "square", "tan", "tanh", "trunc", "gelu", "silu", "mish", "hardswish",
    "hardsigmoid", "hardtanh", "elu", "leaky_relu", "softplus", "celu", "selu", "threshold", "clamp", "clamp_min",
    "clamp_max", "clip", "pow", "angle", "conj_physical", "_conj_physical", "_conj", "fix", "logical_and", "logical_or", "logical_xor",
    "mvlgamma", "polygamma", "special_entr", "special_erfcx", "special_i0e", "special_i1", "special_i1e",
    "special_ndtr", "special_ndtri", "special_log_ndtr", "softshrink", "hardshrink",
    "bitwise_left_shift", "bitwise_right_shift",
    # special functions of one tensor
    "special_airy_ai", "special_bessel_j0", "special_bessel_j1", "special_bessel_y0", "special_bessel_y1",
    "special_modified_bessel_i0", "special_modified_bessel_i1", "special_modified_bessel_k0",
    "special_modified_bessel_k1", "special_scaled_modified_bessel_k0", "special_scaled_modified_bessel_k1",
    "special_spherical_bessel_j0",
    # two outputs (mantissa, exponent), both elementwise
    "frexp",
]
BINARY = [
    "atan2", "bitwise_and", "bitwise_or", "bitwise_xor", "copysign", "div", "eq", "floor_divide", "fmax", "fmin",
    "fmod", "ge", "gt", "heaviside", "hypot", "igamma", "igammac", "le", "lt", "maximum", "minimum", "mul", "ne",
    "nextafter", "remainder", "xlogy", "special_xlog1py", "special_zeta", "logaddexp", "logaddexp2", "float_power",
    "true_divide", "ldexp", "add", "sub", "rsub", "where", "addcmul", "addcdiv", "lerp", "masked_fill",
    "threshold_backward", "gelu_backward", "silu_backward", "sigmoid_backward", "tanh_backward",
    "hardswish_backward", "hardsigmoid_backward", "hardtanh_backward", "elu_backward", "leaky_relu_backward",
    "softplus_backward", "logit_backward", "mish_backward", "log_sigmoid_backward", "softshrink_backward", "hardshrink_backward",
    # orthogonal polynomials of (x, n), elementwise in both
    "special_chebyshev_polynomial_t", "special_chebyshev_polynomial_u", "special_chebyshev_polynomial_v",
    "special_chebyshev_polynomial_w", "special_shifted_chebyshev_polynomial_t",
    "special_shifted_chebyshev_polynomial_u", "special_shifted_chebyshev_polynomial_v",
    "special_shifted_chebyshev_polynomial_w", "special_hermite_polynomial_h", "special_hermite_polynomial_he",
    "special_laguerre_polynomial_l", "special_legendre_polynomial_p",
    # complex from (real, imag) or (abs, angle)
    "complex", "polar",
]
# Ops through which a sum-Partial passes unchanged (linear in every DTensor input).
LINEAR_ALL = {"add", "sub", "neg", "positive", "conj_physical", "_conj_physical", "_conj"}
# Ops linear in their first input when every other DTensor input is replicated (x * r, x / r).
LINEAR_FIRST = {"mul", "div", "true_divide"}


def _packets(names):
    return aten_packets(n + suffix for n in names for suffix in ("", "_"))


def _aligned_dim(in_shape, out_ndim: int, d: int):
    """The input dim that output dim ``d`` reads from, or None if broadcast (absent or size 1 expanded)."""
    i = d - (out_ndim - len(in_shape))
    if i < 0:
        return None
    return i


def pointwise_options(ctx, linear_all: bool = False, linear_first: bool = False):
    """Options for a pointwise op: shard any output dim all inputs share; replicate; Partial if linear."""
    specs = ctx.specs
    out = ctx.out_metas[0]
    out_shape = out.shape
    n_out = len(ctx.out_metas)
    options = []
    for d in range(len(out_shape)):
        ins = []
        for s in specs:
            i = _aligned_dim(s.shape, len(out_shape), d)
            if i is None or s.shape[i] != out_shape[d]:
                ins.append(Replicate())
            else:
                ins.append(Shard(i))
        options.append((tuple(ins), (Shard(d),) * n_out))
    options.append((tuple(Replicate() for _ in specs), (Replicate(),) * n_out))
    if linear_all and _scalars_allow_partial(ctx):
        for op in ("sum", "avg"):
            options.append((tuple(Partial(op) for _ in specs), (Partial(op),) * n_out))
    if linear_first and len(specs) >= 1 and _first_arg_is_spec(ctx):
        for op in ("sum", "avg"):
            options.append(((Partial(op),) + tuple(Replicate() for _ in specs[1:]), (Partial(op),) * n_out))
    return options


def _first_arg_is_spec(ctx) -> bool:
    from shardprop.tensor.spec import DTensorSpec
    return bool(ctx.args) and type(ctx.args[0]) is DTensorSpec


def _scalars_allow_partial(ctx) -> bool:
    """add/sub with a Python scalar or plain tensor operand are not linear in the Partial (x_i + c)."""
    from shardprop.tensor.spec import DTensorSpec
    for a in ctx.args:
        if type(a) is not DTensorSpec and (a is FLOAT or type(a) in (int, ScalarTensor)):
            return False
    return True


def _name(op) -> str:
    return op.overloadpacket.__name__.rstrip("_")


# Elementwise overloads of packets whose other overloads are reductions (ops/reduction.py).
ELEMENTWISE_OVERLOADS = [aten.max.other, aten.min.other]


@rule(*_packets(UNARY + BINARY), *ELEMENTWISE_OVERLOADS)
def pointwise(ctx):
    name = _name(ctx.op)
    return pointwise_options(ctx, linear_all=name in LINEAR_ALL, linear_first=name in LINEAR_FIRST)


def _register_fma(dynamo) -> None:
    # prims.fma (a * b + c): dynamo writes addcmul_ / addcdiv_ with a value (AdamW's second moment)
    # as mul + fma while tracing. It is an inductor prim, defined only once torch._inductor's prims
    # are imported, so it is registered when dynamo loads.
    from torch._inductor import inductor_prims  # noqa: F401  (defines torch.ops.prims.fma)
    rule(torch.ops.prims.fma.default)(pointwise)


when_dynamo_loads(_register_fma, "the sharding rule of prims.fma")


def _conj_materialized(op, out, largs, lkwargs):
    """``_conj`` returns a lazily conjugated view (a flag on the tensor); the DTensor wrapper
    cannot carry that flag, so each shard is conjugated for real."""
    return torch.conj_physical(largs[0])


register_local_call(aten._conj.default, _conj_materialized)
