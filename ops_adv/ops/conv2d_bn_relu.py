"""conv2d_bn_relu: an inference Conv2d + BatchNorm2d (+ ReLU) as one op; `ops_adv::conv2d_bn_relu`.

`conv2d_bn_relu(x, weight, bias, ...)` takes the weight and bias with the BatchNorm already
folded in. Eager calls without grad: signature, one dict lookup, the tuned implementation.
Under torch.compile / torch.export / jit.trace: the `ops_adv::conv2d_bn_relu` custom operator
(a fake kernel, no autograd formula). Calls where an input needs grad run the torch composite,
whose gradients are torch's own. The model pass that finds and folds the sites is
`ops_adv.models.conv_bn`.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kernel_space._common import DTYPE_CODE

from .._dispatch import cache_for, lookup, register_function
from .._op import _compiled_vendor, _autocast, _functorch, _conv_format, _fresh, _grad_enabled, _is_compiling, _square, _tracing_state, define

_cache = cache_for("conv2d_bn_relu")


def _composite(x, weight, bias, stride, padding, dilation, relu: bool) -> torch.Tensor:
    y = F.conv2d(x, weight, bias, stride, padding, dilation)
    return F.relu(y) if relu else y


def conv2d_bn_relu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: Any = 1,
                   padding: Any = 0, dilation: Any = 1, relu: bool = True) -> torch.Tensor:
    """relu(F.conv2d(x, weight, bias, stride, padding, dilation)) (no relu when `relu` is False), where
    weight and bias carry a folded BatchNorm; square stride/padding/dilation run the tuned kernel."""
    s, p, d = _square(stride), _square(padding), _square(dilation)
    if s is None or p is None or d is None or bias is None or x.dim() != 4 or weight.dim() != 4 \
            or x.dtype not in DTYPE_CODE or weight.dtype is not x.dtype or bias.dtype is not x.dtype \
            or x.shape[1] != weight.shape[1] or bias.shape != (weight.shape[0],) or _autocast() or _functorch():
        return _composite(x, weight, bias, stride, padding, dilation, relu)  # autocast casts conv2d, no kernel
    if _grad_enabled() and (x.requires_grad or weight.requires_grad or bias.requires_grad):
        return _composite(x, weight, bias, s, p, d, relu)  # inference op: torch's graph gives the gradients
    if _is_compiling() or _tracing_state() is not None:
        if _compiled_vendor("conv2d_bn_relu", x.device):
            return _composite(x, weight, bias, s, p, d, relu)
        return torch.ops.ops_adv.conv2d_bn_relu(x, weight, bias, s, p, d, bool(relu))
    return _run(x, weight, bias, s, p, d, bool(relu))


def _run(x, weight, bias, s: int, p: int, d: int, relu: bool) -> torch.Tensor:
    N, C, H, W = x.shape
    K, _, R, S = weight.shape
    P = (H + 2 * p - d * (R - 1) - 1) // s + 1
    Q = (W + 2 * p - d * (S - 1) - 1) // s + 1
    if not (N and C and K and R and S) or P <= 0 or Q <= 0 or x.device != weight.device or x.device != bias.device:
        return _composite(x, weight, bias, s, p, d, relu)
    nhwc = not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)
    problem = (N, C, H, W, K, R, S, s, p, d, "nhwc" if nhwc else "nchw", DTYPE_CODE[x.dtype], relu)
    fn = _cache.get((problem, x.device))
    if fn is None:
        fn = lookup("conv2d_bn_relu", problem, x.device)
    return fn(x, weight, bias, s, p, d, relu)


# --------------------------------------------------------------------------- custom operator (inference: no autograd)


def _conv2d_bn_relu_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, stride: int, padding: int,
                       dilation: int, relu: bool) -> torch.Tensor:
    return _fresh(_run(x, weight, bias, stride, padding, dilation, relu), (x, weight, bias), _conv_format(x))


def _fake(x, weight, bias, stride, padding, dilation, relu):
    return F.conv2d(x, weight, bias, stride, padding, dilation).contiguous(memory_format=_conv_format(x))


define("conv2d_bn_relu", _conv2d_bn_relu_op, _fake)
register_function("conv2d_bn_relu", conv2d_bn_relu)
