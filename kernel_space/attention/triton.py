"""attention forward on CUDA through Triton: flash attention (online softmax in fp32, exp2).

The space, the validity check and the launch wrapper; the kernels (`_kernels`) load on the
first call, so this module imports without triton.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from .._common import ITEMSIZE, pow2_at_least
from .._hopper import MAX_MMA_SYNC_REGS, SMEM_BUDGET, smem_buffers, warpgroup_mma
from .._registry import LazyModule, register_triton
from .problem import AttentionProblem

if TYPE_CHECKING:
    import torch

MAX_HEAD_DIM = 256
# fp32 registers per thread for the output and score tiles under warpgroup MMA: built for
# sm_90 with Triton 3.9, 160 gave 248-255 registers and at most 88 bytes of spills, 192
# spilled up to 300 bytes. mma.sync also holds Q, Kᵀ, P and V tiles (MAX_MMA_SYNC_REGS).
MAX_TILE_REGS = 160

SPACE: dict[str, tuple] = {
    "BLOCK_M": (128, 64, 32, 16),
    "BLOCK_N": (64, 32, 128, 16),
    "num_warps": (8, 4, 2, 1),
    "num_stages": (3, 2, 4, 1),
    # Batch chunks on concurrent streams: fills the GPU when B*H*Sq/BLOCK_M CTAs are few
    # or uneven (causal), at the cost of a stream join per call.
    "streams": (1, 2, 4),
}


def smem_bytes(p: AttentionProblem, c: Mapping[str, Any]) -> int:
    """Shared memory for the Q tile and the pipelined K and V tiles (D padded to a power of two)."""
    buffers = smem_buffers(c["num_stages"], warpgroup_mma(c["BLOCK_M"], c["num_warps"]))
    return (c["BLOCK_M"] + 2 * buffers * c["BLOCK_N"]) * pow2_at_least(p.D) * ITEMSIZE[p.dtype]


def check(p: AttentionProblem, c: Mapping[str, Any]) -> str | None:
    """Why configuration `c` is not worth compiling for `p`, or None."""
    if p.dtype not in ITEMSIZE:
        return f"dtype {p.dtype} is not supported"
    if p.D > MAX_HEAD_DIM:
        return f"head dim {p.D} is over {MAX_HEAD_DIM}"
    bm, bn, warps = c["BLOCK_M"], c["BLOCK_N"], c["num_warps"]
    if bm > pow2_at_least(p.Sq):
        return f"BLOCK_M {bm} is larger than Sq={p.Sq} needs"
    if bn > pow2_at_least(p.Skv):
        return f"BLOCK_N {bn} is larger than Skv={p.Skv} needs"
    if c["streams"] > p.B:
        return f"streams={c['streams']} needs at least as many batches, not B={p.B}"
    if bm < 16 * warps:
        return f"BLOCK_M {bm} gives each of {warps} warps fewer than 16 query rows"
    smem = smem_bytes(p, c)
    if smem > SMEM_BUDGET:
        return f"Q, and {c['num_stages']} stages of K and V tiles, need {smem // 1024} KiB of shared memory (budget {SMEM_BUDGET // 1024} KiB)"
    d = pow2_at_least(p.D)
    words = bm * (d + bn)
    limit = MAX_TILE_REGS
    if not warpgroup_mma(bm, warps):
        words += (bm * d + 2 * d * bn + bm * bn) * ITEMSIZE[p.dtype] // 4
        limit = MAX_MMA_SYNC_REGS
    regs = words // (32 * warps)
    if regs > limit:
        return f"BLOCK_M {bm}, BLOCK_N {bn} and D {p.D} need about {regs} registers per thread with {warps} warps (at most {limit})"
    return None


_kernels = LazyModule(__package__ + "._kernels")


@register_triton("attention", "triton_flash", space=SPACE, check=check)
def triton_flash(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    *,
    BLOCK_M: int = 128,
    BLOCK_N: int = 64,
    num_warps: int = 8,
    num_stages: int = 3,
    streams: int = 1,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(Q Kᵀ/√D) V for (B, H, S, D) tensors of any strides; `out` receives the result if given."""
    return _kernels.attention(q, k, v, causal, BLOCK_M, BLOCK_N, num_warps, num_stages, streams, out=out)
