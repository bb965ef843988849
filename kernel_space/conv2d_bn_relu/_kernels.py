"""conv2d_bn_relu's launch (needs triton): conv2d's implicit-GEMM kernel with its bias + ReLU epilogue on."""
from __future__ import annotations

import torch

from ..conv2d._kernels import conv2d


def conv2d_bn_relu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, stride: int, padding: int, dilation: int,
                   relu: bool, *, layout: str, BLOCK_M: int, BLOCK_N: int, BLOCK_K: int, num_warps: int,
                   num_stages: int, out: torch.Tensor | None = None) -> torch.Tensor:
    return conv2d(x, weight, stride, padding, dilation, layout=layout, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                  BLOCK_K=BLOCK_K, num_warps=num_warps, num_stages=num_stages, out=out, bias=bias, relu=relu)
