"""linear: activation(F.linear(x, weight, bias)); `ops_adv::linear`.

Without an activation, `linear` runs the gemm op (x @ weight.T through the gemm table, whose
winners, CPU variants included, serve nn.Linear), then the bias. With one, `linear_fused` runs
the `linear` table, whose kernels add the bias and apply the activation in the gemm's epilogue.

`linear_fused` follows the other ops: calls ops-adv has no kernel for (1-D x, mixed dtypes,
mismatched shapes, a non-contiguous weight, tensors on several devices, empty tensors) run torch
itself, so they work and fail exactly as torch does; covered calls take the eager dict-lookup
path, or the `ops_adv::linear` custom operator under tracing or when an input needs grad.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kernel_space._common import DTYPE_CODE
from kernel_space.linear import ACTIVATIONS, activate

from .._dispatch import _OP_FUNCS, cache_for, lookup, register_function
from .._op import _autocast, _functorch, _fresh, _traced, define

_linear_cache = cache_for("linear")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           activation: str | None = None) -> torch.Tensor:
    """activation(F.linear(x, weight, bias)).

    Without an activation: x (..., in) @ weight.T through the gemm table (a trans_b problem, so
    the gemm winners, CPU variants included, serve nn.Linear), then the bias. With one ("relu",
    "gelu", "gelu_tanh", "silu"): the `linear` table, whose kernels add the bias and apply the
    activation in the gemm's epilogue.
    """
    if activation is not None and activation != "none":
        return linear_fused(x, weight, bias, activation)
    if x.dim() < 1 or weight.dim() != 2 or x.dtype is not weight.dtype or x.dtype not in DTYPE_CODE \
            or (bias is not None and (bias.dtype is not x.dtype or bias.dim() != 1)) or x.shape[-1] != weight.shape[1] \
            or x.numel() == 0 or _autocast() or _functorch():
        return F.linear(x, weight, bias)
    lead = x.shape[:-1]
    y = _OP_FUNCS["gemm"](x.reshape(-1, x.shape[-1]), weight.t())  # ops_adv.gemm
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, weight.shape[0])


def linear_fused(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 activation: str | None = None) -> torch.Tensor:
    """activation(F.linear(x, weight, bias)) through the `linear` table, no activation ("none") included;
    `activation` is None, "none", "relu", "gelu" (erf), "gelu_tanh" or "silu", each as torch's own
    function computes it."""
    act = "none" if activation is None else activation
    if act not in ACTIVATIONS:
        raise ValueError(f"linear: activation {activation!r} is not one of None, {', '.join(map(repr, ACTIVATIONS))}")
    dt = x.dtype
    if x.dim() < 2 or weight.dim() != 2 or weight.dtype is not dt or dt not in DTYPE_CODE \
            or x.shape[-1] != weight.shape[1] or not weight.is_contiguous() or x.device != weight.device \
            or (bias is not None and (bias.dtype is not dt or bias.shape != weight.shape[:1] or bias.device != x.device)) \
            or _autocast() or _functorch():
        return activate(F.linear(x, weight, bias), act)
    if _traced(x, weight, bias):
        return torch.ops.ops_adv.linear(x, weight, bias, act)
    return _linear(x, weight, bias, act)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, act: str) -> torch.Tensor:
    K = x.shape[-1]
    N = weight.shape[0]
    M = x.numel() // K if K else 0
    if not (M and N and K) or x.dtype not in DTYPE_CODE:  # torch's empty or zero result; float64 (gradcheck)
        return activate(F.linear(x, weight, bias), act)
    key = ((M, N, K, bias is not None, act, DTYPE_CODE[x.dtype]), x.device)
    fn = _linear_cache.get(key)
    if fn is None:
        fn = lookup("linear", *key)
    y = fn(x.reshape(M, K), weight, bias, act)
    return y if x.dim() == 2 else y.reshape(*x.shape[:-1], N)


def _activation_grad(g: torch.Tensor, z: torch.Tensor, act: str) -> torch.Tensor:
    """d activation(z) / dz applied to g, by torch's own backward kernels."""
    if act == "relu":
        return torch.ops.aten.threshold_backward(g, z, 0)
    if act == "gelu":
        return torch.ops.aten.gelu_backward(g, z, approximate="none")
    if act == "gelu_tanh":
        return torch.ops.aten.gelu_backward(g, z, approximate="tanh")
    if act == "silu":
        if torch.is_grad_enabled():  # a double backward: silu_backward has no derivative; torch switches likewise
            s = torch.sigmoid(z)
            return g * s * (1 + z * (1 - s))
        return torch.ops.aten.silu_backward(g, z)
    return g


# --------------------------------------------------------------------------- custom operator


def _linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str) -> torch.Tensor:
    return _fresh(_linear(x, weight, bias, activation), (x, weight))


def _fake(x, weight, bias, activation):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _setup(ctx, inputs, output):
    x, weight, bias, activation = inputs
    ctx.act = activation
    ctx.save_for_backward(x, weight, bias)


def _backward(ctx, g):
    x, weight, bias = ctx.saved_tensors
    # The pre-activation is recomputed (vendor ops) rather than kept: the forward writes only y.
    gz = g if ctx.act == "none" else _activation_grad(g, F.linear(x, weight, bias), ctx.act)
    K, N = weight.shape[1], weight.shape[0]
    M = math.prod(x.shape[:-1])  # not reshape(-1, ...): K or N may be 0
    gx = torch.matmul(gz, weight) if ctx.needs_input_grad[0] else None
    gz2 = gz.reshape(M, N)
    gw = gz2.t().matmul(x.reshape(M, K)) if ctx.needs_input_grad[1] else None
    gb = gz2.sum(0) if bias is not None and ctx.needs_input_grad[2] else None
    return gx, gw, gb, None


define("linear", _linear_op, _fake, setup=_setup, backward=_backward)
register_function("linear", linear)
