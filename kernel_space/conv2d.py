"""conv2d: F.conv2d(x, weight) with x (N, C, H, W), weight (K, C, R, S), square stride/padding/dilation, groups 1.

`layout` is the caller's memory format of x: "nchw" (contiguous) or "nhwc" (torch.channels_last).
Candidates that run in the other format convert first, and the conversion is part of their
time. The output is NCHW-shaped in whatever memory format the candidate produces.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ._common import DTYPE_CODE, ITEMSIZE, generator, pow2_at_least, randn, tolerance
from ._registry import OpSpec, register_impl, register_op


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


def make_inputs(p: Conv2dProblem, device, seed: int = 0):
    g = generator(seed)
    x = randn((p.N, p.C, p.H, p.W), p.dtype, device, g)
    w = randn((p.K, p.C, p.R, p.S), p.dtype, device, g, scale=(p.C * p.R * p.S) ** -0.5)
    if p.layout == "nhwc":  # a channels_last model: activations and weights both
        x = x.contiguous(memory_format=torch.channels_last)
        w = w.contiguous(memory_format=torch.channels_last)
    return (x, w), {"stride": p.stride, "padding": p.padding, "dilation": p.dilation}


def reference(x, weight, stride: int = 1, padding: int = 0, dilation: int = 1) -> torch.Tensor:
    if x.device.type == "cpu":
        return F.conv2d(x.double(), weight.double(), stride=stride, padding=padding, dilation=dilation)
    prev = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        return F.conv2d(x.float(), weight.float(), stride=stride, padding=padding, dilation=dilation)
    finally:
        torch.backends.cudnn.allow_tf32 = prev


def _flops(p: Conv2dProblem) -> float:
    P, Q = out_hw(p)
    return 2.0 * p.N * p.K * P * Q * p.C * p.R * p.S


def _bytes(p: Conv2dProblem) -> float:
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


register_op(
    OpSpec(
        name="conv2d",
        problem=Conv2dProblem,
        signature=signature,
        make_inputs=make_inputs,
        reference=reference,
        tolerance=tolerance,
        flops=_flops,
        bytes_moved=_bytes,
        size_fields=("N", "C", "H", "W", "K", "R", "S"),
        default_problems=default_problems,
    )
)


@register_impl("conv2d", name="torch_conv2d", priority=100, backends=("cpu", "cuda"), vendor=True)
def torch_conv2d(x, weight, stride: int = 1, padding: int = 0, dilation: int = 1):
    """F.conv2d on the tensors as given: what the caller gets without ops-adv."""
    return F.conv2d(x, weight, stride=stride, padding=padding, dilation=dilation)


def _conv_in(fmt: torch.memory_format):
    def run(x, weight, stride: int = 1, padding: int = 0, dilation: int = 1):
        x, weight = x.contiguous(memory_format=fmt), weight.contiguous(memory_format=fmt)
        return F.conv2d(x, weight, stride=stride, padding=padding, dilation=dilation)

    return run


# cuDNN (on the CPU, oneDNN) in a fixed memory format, converting the caller's tensors first.
register_impl("conv2d", name="cudnn_nchw", priority=95, backends=("cpu", "cuda"), vendor=True)(
    _conv_in(torch.contiguous_format)
)
register_impl("conv2d", name="cudnn_nhwc", priority=94, backends=("cpu", "cuda"), vendor=True)(
    _conv_in(torch.channels_last)
)

_SMEM_BYTES = 227 << 10  # H100/H200 shared memory a block may use
_MAX_ACC_PER_THREAD = 128  # fp32 accumulator registers a thread; beyond this ptxas spills
_MAX_SCALAR_LOADS = 64


def _check_implicit_gemm(p: Conv2dProblem, c) -> str | None:
    P, Q = out_hw(p)
    if P <= 0 or Q <= 0:
        return f"the filter does not fit the {p.H}x{p.W} padded input"
    bm, bn, bk, warps, stages = c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["num_warps"], c["num_stages"]
    M = p.N * P * Q
    if bm > pow2_at_least(M):
        return f"BLOCK_M {bm} is over the {M} output pixels"
    if bn > pow2_at_least(p.K):
        return f"BLOCK_N {bn} is over the {p.K} output channels"
    if bk > pow2_at_least(p.C):
        return f"BLOCK_K {bk} is over the {p.C} input channels"
    smem = stages * (bm + bn) * bk * ITEMSIZE[p.dtype]
    if smem > _SMEM_BYTES:
        return f"{stages} stages of {bm}x{bk} and {bk}x{bn} tiles need {smem >> 10} KiB of shared memory"
    if bm * bn > _MAX_ACC_PER_THREAD * 32 * warps:
        return f"a {bm}x{bn} accumulator needs over {_MAX_ACC_PER_THREAD} registers a thread with {warps} warps"
    if c["layout"] == "nchw" and (bm + bn) * bk > _MAX_SCALAR_LOADS * 32 * warps:
        # Measured offline for sm_90 (Triton 3.9): element-wise loads hold a 64-bit address each; past this, spills.
        return f"nchw loads {bm}x{bk} and {bk}x{bn} tiles element by element: over {_MAX_SCALAR_LOADS} a thread"
    k_steps = p.R * p.S * -(-p.C // bk)
    if k_steps < stages - 1:
        return f"num_stages {stages} exceeds the {k_steps} reduction steps it would pipeline"
    if max(p.N * p.C * p.H * p.W, p.N * p.K * P * Q) >= 2**31:
        return "tensors over 2^31 elements need 64-bit indexing"
    return None


@register_impl(
    "conv2d",
    name="triton_implicit_gemm",
    priority=50,
    backends=("cuda",),
    space={
        "layout": ("nhwc", "nchw"),  # the layout the kernel runs in
        "BLOCK_M": (128, 64, 256, 32),
        "BLOCK_N": (64, 128, 256, 32),
        "BLOCK_K": (64, 32, 128, 16),
        "num_warps": (4, 8),
        "num_stages": (3, 2, 4, 5),
    },
    check=_check_implicit_gemm,
    requires=("triton",),
)
def triton_implicit_gemm(x, weight, stride: int = 1, padding: int = 0, dilation: int = 1, *, layout="nhwc",
                         BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3, out=None):
    """Implicit-GEMM conv in `layout`; `out` (N, K, P, Q) in any memory format receives the result when given."""
    from ._triton_conv_kernels import conv2d

    return conv2d(x, weight, stride, padding, dilation, layout=layout, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                  BLOCK_K=BLOCK_K, num_warps=num_warps, num_stages=num_stages, out=out)
