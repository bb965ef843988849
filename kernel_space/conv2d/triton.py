"""conv2d on CUDA through Triton: implicit GEMM in NHWC or NCHW; the space, the check and the launch wrapper."""
from __future__ import annotations

from .._common import ITEMSIZE, pow2_at_least
from .._registry import LazyModule, register_triton
from .problem import Conv2dProblem, out_hw

_kernels = LazyModule(__package__ + "._kernels")

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


SPACE = {
    "layout": ("nhwc", "nchw"),  # the layout the kernel runs in
    "BLOCK_M": (128, 64, 256, 32),
    "BLOCK_N": (64, 128, 256, 32),
    "BLOCK_K": (64, 32, 128, 16),
    "num_warps": (4, 8),
    "num_stages": (3, 2, 4, 5),
}


@register_triton(
    "conv2d",
    "triton_implicit_gemm",
    space=SPACE,
    check=_check_implicit_gemm,
)
def triton_implicit_gemm(x, weight, stride: int = 1, padding: int = 0, dilation: int = 1, *, layout="nhwc",
                         BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3, out=None):
    """Implicit-GEMM conv in `layout`; `out` (N, K, P, Q) in any memory format receives the result when given."""
    return _kernels.conv2d(x, weight, stride, padding, dilation, layout=layout, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                          BLOCK_K=BLOCK_K, num_warps=num_warps, num_stages=num_stages, out=out)
