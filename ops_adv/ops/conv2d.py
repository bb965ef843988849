"""conv2d: F.conv2d's semantics through the tuned kernel for square, ungrouped convolutions; `ops_adv::conv2d`."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kernel_space._common import DTYPE_CODE

from .._dispatch import lookup, register_function
from .._op import _compiled_vendor, _autocast, _functorch, _conv_format, _fresh, _is_compiling, _op_needed, _square, _traced, _tracing_state, define


def conv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, stride: Any = 1,
           padding: Any = 0, dilation: Any = 1, groups: int = 1) -> torch.Tensor:
    """F.conv2d's semantics; square stride/padding/dilation with groups 1 run the tuned kernel."""
    s, p, d = _square(stride), _square(padding), _square(dilation)
    if s is None or p is None or d is None or groups != 1 or x.dim() != 4 or weight.dim() != 4 \
            or x.dtype not in DTYPE_CODE or weight.dtype is not x.dtype or x.shape[1] != weight.shape[1] \
            or (bias is not None and bias.dtype is not x.dtype) or _autocast() or _functorch():
        return F.conv2d(x, weight, bias, stride, padding, dilation, groups)
    if _traced(x, weight, bias):
        if _compiled_vendor("conv2d", x.device):
            return F.conv2d(x, weight, bias, stride, padding, dilation, groups)
        if not _is_compiling() and _tracing_state() is None and (
                not x.numel() or not weight.numel() or x.device != weight.device or not _conv_out_ok(x, weight, s, p, d)
                or not _op_needed("conv2d", x, weight, s, p, d)):
            return F.conv2d(x, weight, bias, stride, padding, dilation, groups)
        return torch.ops.ops_adv.conv2d(x, weight, bias, s, p, d)
    return _conv2d(x, weight, bias, s, p, d)


def _kernel_args(x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """This call's arguments as the conv2d kernels take them ((x, weight), {stride, padding, dilation}; the
    bias is added after the kernel), or None: torch's function runs it."""
    s, p, d = _square(stride), _square(padding), _square(dilation)
    if s is None or p is None or d is None or groups != 1 or x.dim() != 4 or weight.dim() != 4 \
            or x.dtype not in DTYPE_CODE or weight.dtype is not x.dtype or x.shape[1] != weight.shape[1]:
        return None
    return (x, weight), {"stride": s, "padding": p, "dilation": d}


def _conv_out_ok(x, weight, s: int, p: int, d: int) -> bool:
    H, W = x.shape[2:]
    R, S = weight.shape[2:]
    return (H + 2 * p - d * (R - 1) - 1) // s + 1 > 0 and (W + 2 * p - d * (S - 1) - 1) // s + 1 > 0


def _conv2d(x, weight, bias, s: int, p: int, d: int) -> torch.Tensor:
    N, C, H, W = x.shape
    K, _, R, S = weight.shape
    P = (H + 2 * p - d * (R - 1) - 1) // s + 1
    Q = (W + 2 * p - d * (S - 1) - 1) // s + 1
    if not (N and C and K and R and S) or P <= 0 or Q <= 0 or x.device != weight.device:
        return F.conv2d(x, weight, bias, s, p, d)
    nhwc = not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)
    problem = (N, C, H, W, K, R, S, s, p, d, "nhwc" if nhwc else "nchw", DTYPE_CODE[x.dtype])
    y = lookup("conv2d", problem, x.device)(x, weight, s, p, d)
    if bias is not None:
        y = y + bias.view(1, -1, 1, 1)
    return y


# --------------------------------------------------------------------------- custom operator


def _conv2d_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: int, padding: int,
               dilation: int) -> torch.Tensor:
    return _fresh(_conv2d(x, weight, bias, stride, padding, dilation), (x, weight), _conv_format(x))


def _fake(x, weight, bias, stride, padding, dilation):
    return F.conv2d(x, weight, bias, stride, padding, dilation).contiguous(memory_format=_conv_format(x))


def _setup(ctx, inputs, output):
    x, weight, bias, stride, padding, dilation = inputs
    ctx.args = (stride, padding, dilation)
    ctx.bias_sizes = list(bias.shape) if bias is not None else None
    ctx.save_for_backward(x, weight)


def _backward(ctx, g):
    x, weight = ctx.saved_tensors
    s, p, d = ctx.args
    mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.bias_sizes is not None and ctx.needs_input_grad[2]]
    gx, gw, gb = torch.ops.aten.convolution_backward(
        g, x, weight, ctx.bias_sizes, [s, s], [p, p], [d, d], False, [0, 0], 1, mask)
    return gx, gw, gb, None, None, None


define("conv2d", _conv2d_op, _fake, setup=_setup, backward=_backward)
register_function("conv2d", conv2d, _kernel_args)
