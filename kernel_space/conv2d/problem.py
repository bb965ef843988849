"""conv2d: F.conv2d(x, weight) with x (N, C, H, W), weight (K, C, R, S), square stride/padding/dilation, groups 1.

`layout` is the caller's memory format of x: "nchw" (contiguous) or "nhwc" (torch.channels_last).
Candidates that run in the other format convert first, and the conversion is part of their
time. The output is NCHW-shaped in whatever memory format the candidate produces.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .._common import DTYPE_CODE, ITEMSIZE, conv_fp32, generator, randn
from .._registry import define_op


class Conv2dProblem(NamedTuple):
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


def signature(x: torch.Tensor, weight: torch.Tensor, stride: int = 1, padding: int = 0, dilation: int = 1) -> tuple:
    N, C, H, W = x.shape
    K, _, R, S = weight.shape
    # A tensor that is both (C == 1, or H == W == 1) counts as nchw.
    nhwc = not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)
    return (N, C, H, W, K, R, S, stride, padding, dilation, "nhwc" if nhwc else "nchw", DTYPE_CODE[x.dtype])


def out_hw(p: Conv2dProblem) -> tuple[int, int]:
    P = (p.H + 2 * p.padding - p.dilation * (p.R - 1) - 1) // p.stride + 1
    Q = (p.W + 2 * p.padding - p.dilation * (p.S - 1) - 1) // p.stride + 1
    return P, Q


def operands(p, device, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """x and a unit-variance-output weight for a conv problem (conv2d's or conv2d_bn_relu's), in its layout."""
    x = randn((p.N, p.C, p.H, p.W), p.dtype, device, g)
    w = randn((p.K, p.C, p.R, p.S), p.dtype, device, g, scale=(p.C * p.R * p.S) ** -0.5)
    if p.layout == "nhwc":  # a channels_last model: activations and weights both
        x = x.contiguous(memory_format=torch.channels_last)
        w = w.contiguous(memory_format=torch.channels_last)
    return x, w


def make_inputs(p: Conv2dProblem, device, seed: int = 0):
    return operands(p, device, generator(seed)), {"stride": p.stride, "padding": p.padding, "dilation": p.dilation}


def reference(x, weight, stride: int = 1, padding: int = 0, dilation: int = 1) -> torch.Tensor:
    return conv_fp32(x, weight, None, stride=stride, padding=padding, dilation=dilation)


def flops(p) -> float:
    """A conv problem's multiply-adds, twice (conv2d's or conv2d_bn_relu's)."""
    P, Q = out_hw(p)
    return 2.0 * p.N * p.K * P * Q * p.C * p.R * p.S


def bytes_moved(p) -> float:
    """x and weight read, the output written (conv2d's or conv2d_bn_relu's, whose bias adds K)."""
    P, Q = out_hw(p)
    return float((p.N * p.C * p.H * p.W + p.K * p.C * p.R * p.S + p.N * p.K * P * Q) * ITEMSIZE[p.dtype])


# ResNet-50 convolutions at batch 32: (C, H=W, K, R=S, stride, padding).
_RESNET50 = [
    (64, 56, 64, 3, 1, 1),
    (256, 56, 64, 1, 1, 0),
    (128, 28, 128, 3, 1, 1),
    (256, 14, 256, 3, 2, 1),
    (512, 7, 2048, 1, 1, 0),
]


def default_problems(device_class: str) -> list[Conv2dProblem]:
    if device_class == "cpu":
        return [
            Conv2dProblem(2, 16, 16, 16, 32, 3, 3, 1, 1, 1, "nchw"),
            Conv2dProblem(2, 16, 16, 16, 32, 3, 3, 1, 1, 1, "nhwc"),
            Conv2dProblem(4, 32, 15, 15, 64, 1, 1, 2, 0, 1, "nchw"),
        ]
    out = [
        Conv2dProblem(32, C, H, H, K, R, R, s, pad, 1, layout, "bf16")
        for layout in ("nhwc", "nchw")
        for C, H, K, R, s, pad in _RESNET50
    ]
    out += [Conv2dProblem(32, C, H, H, K, R, R, s, pad, 1, "nhwc", "fp16") for C, H, K, R, s, pad in _RESNET50[::4]]
    return out


SPEC = define_op("conv2d", Conv2dProblem, signature, make_inputs, reference,
                 size_fields=("N", "C", "H", "W", "K", "R", "S"), streaming=("N",), flops=flops,
                 bytes_moved=bytes_moved, default_problems=default_problems)
