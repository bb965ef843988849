"""conv2d_bn_relu on CUDA through Triton: conv2d's implicit GEMM with a bias + ReLU epilogue (same space and check)."""
from __future__ import annotations

from .._registry import LazyModule, register_triton
from ..conv2d.triton import SPACE, _check_implicit_gemm

_kernels = LazyModule(__package__ + "._kernels")


@register_triton("conv2d_bn_relu", "triton_implicit_gemm", space=SPACE, check=_check_implicit_gemm)
def triton_implicit_gemm(x, weight, bias, stride: int = 1, padding: int = 0, dilation: int = 1, relu: bool = True, *,
                         layout="nhwc", BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3, out=None):
    """Implicit-GEMM conv + bias (+ ReLU) in `layout`; `out` (N, K, P, Q) in any memory format receives the result."""
    return _kernels.conv2d_bn_relu(x, weight, bias, stride, padding, dilation, relu, layout=layout, BLOCK_M=BLOCK_M,
                                   BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=num_warps, num_stages=num_stages, out=out)
