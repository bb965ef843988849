"""linear: activation(F.linear(x, weight, bias)); `ops_adv::linear`.

Without an activation, `linear` runs the gemm op (x @ weight.T through the gemm table, whose
winners, CPU variants included, serve nn.Linear), then the bias; where the gemm choice is the
vendor kernel, F.linear itself (one addmm, so a bf16 result rounds once, as torch's). With one, `linear_fused` runs
the `linear` table, whose kernels add the bias and apply the activation in the gemm's epilogue.

`linear_fused` follows the other ops: calls ops-adv has no kernel for (1-D x, mixed dtypes,
mismatched shapes, a non-contiguous weight, tensors on several devices, empty tensors) run torch
itself, so they work and fail exactly as torch does; covered calls take the eager dict-lookup
path, or the `ops_adv::linear` custom operator under tracing or when an input needs grad.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from kernel_space._common import DTYPE_CODE
from kernel_space.linear import ACTIVATIONS, activate

from kernel_space import get_impl

from .. import _dispatch
from .._dispatch import _OP_FUNCS, cache_for, lookup, register_function
from .._op import _compiled_vendor, _autocast, _fresh, _functorch, _grad_enabled, _is_compiling, _traced, _tracing_state, define

_linear_cache = cache_for("linear")
# (M, N, K, dtype, device) -> the call a contiguous x and weight run without an activation; emptied with the others
_fast_cache = cache_for("linear.gemm")
# (gemm problem, device) -> the call any other covered x runs (grad needed, non-contiguous); emptied likewise
_chosen_cache = cache_for("linear.chosen")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           activation: str | None = None) -> torch.Tensor:
    """activation(F.linear(x, weight, bias)).

    Without an activation: x (..., in) @ weight.T through the gemm table (a trans_b problem, so
    the gemm winners, CPU variants included, serve nn.Linear); where the gemm table's choice is the
    vendor kernel, F.linear itself runs (one addmm with the bias, rounded once as torch's). With one
    ("relu", "gelu", "gelu_tanh", "silu"): the `linear` table, whose kernels add the bias and apply
    the activation in the gemm's epilogue.
    """
    if activation is not None and activation != "none":
        return linear_fused(x, weight, bias, activation)
    dt = x.dtype
    if weight.dtype is not dt or dt not in DTYPE_CODE or weight.dim() != 2 or x.dim() < 1 or _autocast() \
            or _functorch() or (bias is not None and (bias.dtype is not dt or bias.dim() != 1)):
        return F.linear(x, weight, bias)
    K = x.shape[-1]
    if K != weight.shape[1] or not x.numel():
        return F.linear(x, weight, bias)
    if _is_compiling() or _tracing_state() is not None:
        if _compiled_vendor("gemm", x.device):
            return F.linear(x, weight, bias)
        return _via_gemm(x, weight, bias)  # the gemm operator: the graph never depends on the table
    if _grad_enabled() and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)):
        return _chosen(x, weight, bias)
    if x.is_contiguous() and weight.is_contiguous():  # nn.Linear: one dict hit, then the chosen call
        key = (x.numel() // K, weight.shape[0], K, DTYPE_CODE[dt], x.device)
        fn = _fast_cache.get(key)
        if fn is None:
            fn = _resolve_fast(x, weight, key)
        return fn(x, weight, bias)
    return _chosen(x, weight, bias)


def _via_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """ops_adv.gemm(x (M, K), weight.T), then the bias."""
    y = _OP_FUNCS["gemm"](x.reshape(-1, x.shape[-1]), weight.t())
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _gemm_problem(x: torch.Tensor, weight: torch.Tensor) -> tuple:
    return _dispatch.signature_of("gemm")(x.reshape(-1, x.shape[-1]), weight.t())


def _chosen(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear where the gemm table's choice for x @ weight.T is the vendor kernel (counted as that kernel, as
    the contiguous path's is), else the chosen gemm kernel through the gemm op; resolved once per problem."""
    if x.device != weight.device:
        return F.linear(x, weight, bias)  # torch's error
    problem = _gemm_problem(x, weight)
    key = (problem, x.device)
    fn = _chosen_cache.get(key)
    if fn is None:
        impl, _params, _source = _dispatch.decided("gemm", problem, x.device)
        fn = _dispatch.stand_in("gemm", problem, x.device, F.linear) if get_impl("gemm", impl).vendor else _via_gemm
        _dispatch.bounded(_chosen_cache)[key] = fn
    return fn(x, weight, bias)


def _resolve_fast(x: torch.Tensor, weight: torch.Tensor, key: tuple) -> Callable[..., torch.Tensor]:
    """What a contiguous x and weight of this key run: F.linear where the gemm choice is the vendor kernel
    (counted and wrapped as that kernel would be), else the chosen gemm kernel, then the bias."""
    M, N, K, _dt, dev = key
    if weight.device != dev:
        return F.linear  # torch's error
    problem = _gemm_problem(x, weight)
    impl, _params, _source = _dispatch.decided("gemm", problem, dev)
    if get_impl("gemm", impl).vendor:
        fn = _dispatch.stand_in("gemm", problem, dev, F.linear)
    else:
        gemm_fn = lookup("gemm", problem, dev)

        def fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            y = gemm_fn(x.view(M, K), weight.t())
            if bias is not None:
                y = y + bias
            return y if x.dim() == 2 else y.view(*x.shape[:-1], N)

    _dispatch.bounded(_fast_cache)[key] = fn
    return fn


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
        if _compiled_vendor("linear", x.device):
            return activate(F.linear(x, weight, bias), act)
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
