"""conv2d vendor kernels: F.conv2d as called, and in each fixed memory format (cuDNN; oneDNN on the CPU)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .._registry import register_vendor


@register_vendor("conv2d", "torch_conv2d")
def torch_conv2d(x, weight, stride: int = 1, padding: int = 0, dilation: int = 1):
    """F.conv2d on the tensors as given: what the caller gets without ops-adv."""
    return F.conv2d(x, weight, stride=stride, padding=padding, dilation=dilation)


def _conv_in(fmt: torch.memory_format):
    def run(x, weight, stride: int = 1, padding: int = 0, dilation: int = 1):
        x, weight = x.contiguous(memory_format=fmt), weight.contiguous(memory_format=fmt)
        return F.conv2d(x, weight, stride=stride, padding=padding, dilation=dilation)

    return run


# cuDNN (on the CPU, oneDNN) in a fixed memory format, converting the caller's tensors first.
register_vendor("conv2d", "cudnn_nchw", priority=95)(_conv_in(torch.contiguous_format))
register_vendor("conv2d", "cudnn_nhwc", priority=94)(_conv_in(torch.channels_last))
