"""conv2d_bn_relu vendor kernels: F.conv2d with the folded weight and bias, then in-place ReLU;
as called, and in each fixed memory format (cuDNN; oneDNN on the CPU)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .._registry import register_vendor


@register_vendor("conv2d_bn_relu", "torch_conv_bias_relu")
def torch_conv_bias_relu(x, weight, bias, stride: int = 1, padding: int = 0, dilation: int = 1, relu: bool = True):
    """F.conv2d (bias included) on the tensors as given, then relu_: what a folded model gets without ops-adv."""
    y = F.conv2d(x, weight, bias, stride=stride, padding=padding, dilation=dilation)
    return y.relu_() if relu else y


def _conv_in(fmt: torch.memory_format):
    def run(x, weight, bias, stride: int = 1, padding: int = 0, dilation: int = 1, relu: bool = True):
        x, weight = x.contiguous(memory_format=fmt), weight.contiguous(memory_format=fmt)
        y = F.conv2d(x, weight, bias, stride=stride, padding=padding, dilation=dilation)
        return y.relu_() if relu else y

    return run


# cuDNN (on the CPU, oneDNN) in a fixed memory format, converting the caller's tensors first.
register_vendor("conv2d_bn_relu", "cudnn_nchw", priority=95)(_conv_in(torch.contiguous_format))
register_vendor("conv2d_bn_relu", "cudnn_nhwc", priority=94)(_conv_in(torch.channels_last))


def _fused_in(fmt: torch.memory_format):
    def run(x, weight, bias, stride: int = 1, padding: int = 0, dilation: int = 1, relu: bool = True):
        x, weight = x.contiguous(memory_format=fmt), weight.contiguous(memory_format=fmt)
        return torch.cudnn_convolution_relu(x, weight, bias, (stride, stride), (padding, padding), (dilation, dilation), 1)

    return run


def _needs_relu(p, params) -> str | None:
    return None if p.relu else "cudnn_convolution_relu always applies ReLU"


# cuDNN's own conv + bias + ReLU in one call (the runtime-fusion graph torch's freezing passes use);
# below the plain conv in priority until measured.
register_vendor("conv2d_bn_relu", "cudnn_fused_nchw", priority=90, backends=("cuda",), check=_needs_relu)(
    _fused_in(torch.contiguous_format))
register_vendor("conv2d_bn_relu", "cudnn_fused_nhwc", priority=89, backends=("cuda",), check=_needs_relu)(
    _fused_in(torch.channels_last))
