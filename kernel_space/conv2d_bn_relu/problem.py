"""conv2d_bn_relu: relu?(F.conv2d(x, weight, bias)) with the BatchNorm already folded into weight and bias.

x (N, C, H, W), weight (K, C, R, S), bias (K,), all of one dtype; square stride/padding/dilation,
groups 1. `relu` False covers conv + BN alone. `layout` is the caller's memory format of x, as in
conv2d: candidates that run in the other format convert first, and the conversion is timed.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .._common import DTYPE_CODE, ITEMSIZE, conv_fp32, generator, randn
from .._registry import define_op
from ..conv2d import problem as conv2d


class ConvBnReluProblem(NamedTuple):
    N: int
    C: int
    H: int
    W: int
    K: int
    R: int
    S: int
    stride: int = 1
    padding: int = 0
    dilation: int = 1
    layout: str = "nchw"
    dtype: str = "fp32"
    relu: bool = True


def signature(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, stride: int = 1, padding: int = 0,
              dilation: int = 1, relu: bool = True) -> tuple:
    N, C, H, W = x.shape
    K, _, R, S = weight.shape
    nhwc = not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)
    return (N, C, H, W, K, R, S, stride, padding, dilation, "nhwc" if nhwc else "nchw", DTYPE_CODE[x.dtype], relu)


def make_inputs(p: ConvBnReluProblem, device, seed: int = 0):
    g = generator(seed)
    x, w = conv2d.operands(p, device, g)
    b = randn((p.K,), p.dtype, device, g, scale=0.5)  # a folded shift: some channels mostly negative
    return (x, w, b), {"stride": p.stride, "padding": p.padding, "dilation": p.dilation, "relu": p.relu}


def reference(x, weight, bias, stride: int = 1, padding: int = 0, dilation: int = 1, relu: bool = True) -> torch.Tensor:
    y = conv_fp32(x, weight, bias, stride=stride, padding=padding, dilation=dilation)
    return torch.relu(y) if relu else y


def default_problems(device_class: str) -> list[ConvBnReluProblem]:
    if device_class == "cpu":
        return [
            ConvBnReluProblem(2, 16, 16, 16, 32, 3, 3, 1, 1, 1, "nchw"),
            ConvBnReluProblem(2, 16, 16, 16, 32, 3, 3, 1, 1, 1, "nhwc"),
            ConvBnReluProblem(4, 32, 15, 15, 64, 1, 1, 2, 0, 1, "nchw", relu=False),
        ]
    # ResNet-50's convolutions at batch 32, each followed by BN + ReLU.
    return [
        ConvBnReluProblem(32, C, H, H, K, R, R, s, pad, 1, layout, "bf16")
        for layout in ("nhwc", "nchw")
        for C, H, K, R, s, pad in conv2d._RESNET50
    ]


SPEC = define_op("conv2d_bn_relu", ConvBnReluProblem, signature, make_inputs, reference,
                 size_fields=("N", "C", "H", "W", "K", "R", "S"), streaming=("N",), flops=conv2d.flops,
                 bytes_moved=lambda p: conv2d.bytes_moved(p) + p.K * ITEMSIZE[p.dtype],  # + the bias
                 default_problems=default_problems)
