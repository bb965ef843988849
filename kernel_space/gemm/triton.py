"""gemm on CUDA through Triton: a tiled tensor-core kernel (grouped tile order, optional split-K),
and a split-K kernel for decode (M <= 64) that reduces in the same launch.

The space, the validity check and the launch wrapper; the kernels (`_kernels`) load on the
first call, so this module imports without triton.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from .._common import ITEMSIZE, pow2_at_least
from .._hopper import MAX_ACC_REGS, MAX_MMA_SYNC_REGS, SMEM_BUDGET, smem_buffers, warpgroup_mma
from .._registry import LazyModule, register_triton
from .problem import GemmProblem

if TYPE_CHECKING:
    import torch

SPACE: dict[str, tuple] = {
    # Large tiles (128x256x64, 8 warps, 3 stages; 128x128x64, 4 stages) are where Triton
    # gets close to cuBLAS on Hopper; 16..64-row tiles, deep BLOCK_K and SPLIT_K are for
    # decode shapes (M <= 64), which are bound by reading B and need many CTAs in flight.
    "BLOCK_M": (128, 16, 32, 64, 256),
    "BLOCK_N": (128, 32, 64, 256),
    "BLOCK_K": (64, 32, 128, 256, 512),
    "GROUP_M": (8, 1, 4, 16),
    "num_warps": (8, 4, 2),
    "num_stages": (3, 2, 4, 5),
    "SPLIT_K": (1, 2, 4, 8),
}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def smem_bytes(p: GemmProblem, c: Mapping[str, Any]) -> int:
    """Shared memory the pipelined A and B tiles take."""
    buffers = smem_buffers(c["num_stages"], warpgroup_mma(c["BLOCK_M"], c["num_warps"]))
    return buffers * (c["BLOCK_M"] * c["BLOCK_K"] + c["BLOCK_K"] * c["BLOCK_N"]) * ITEMSIZE[p.dtype]


def check(p: GemmProblem, c: Mapping[str, Any]) -> str | None:
    """Why configuration `c` is not worth compiling for `p`, or None."""
    if p.dtype not in ITEMSIZE:
        return f"dtype {p.dtype} is not supported"
    bm, bn, bk = c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]
    warps, split, group = c["num_warps"], c["SPLIT_K"], c["GROUP_M"]
    for name, block, dim in (("BLOCK_M", bm, p.M), ("BLOCK_N", bn, p.N), ("BLOCK_K", bk, p.K)):
        if block > pow2_at_least(dim):
            return f"{name} {block} is larger than {name[-1]}={dim} needs"
    tiles_m = _cdiv(p.M, bm)
    if split > 1:
        # An H100 has 132 SMs: split K only where the output tiles alone cannot fill it.
        tiles = tiles_m * _cdiv(p.N, bn)
        if p.M > 64 and tiles > 128:
            return f"SPLIT_K is for M <= 64 or at most 128 output tiles, not M={p.M} with {tiles} tiles"
        if _cdiv(p.K, split) < bk:
            return f"SPLIT_K {split} leaves less than BLOCK_K={bk} of K={p.K} per split"
    smaller = [g for g in SPACE["GROUP_M"] if g < group]
    if smaller and tiles_m <= max(smaller):
        # A duplicate: with this few rows of tiles, the launch order is the same.
        return f"GROUP_M {group} orders {tiles_m} rows of tiles as GROUP_M {max(smaller)} does"
    threads = 32 * warps
    if bm * bn < 4 * threads:
        return f"a {bm}x{bn} tile leaves some of {warps} warps without a 16x8 MMA tile"
    smem = smem_bytes(p, c)
    if smem > SMEM_BUDGET:
        return f"{c['num_stages']} stages of {bm}x{bk} and {bk}x{bn} tiles need {smem // 1024} KiB of shared memory (budget {SMEM_BUDGET // 1024} KiB)"
    if bm * bn > MAX_ACC_REGS * threads:
        return f"a {bm}x{bn} accumulator needs {bm * bn // threads} registers per thread with {warps} warps (at most {MAX_ACC_REGS})"
    if not warpgroup_mma(bm, warps):
        regs = (bm * bn + (bm * bk + bk * bn) * ITEMSIZE[p.dtype] // 4) // threads
        if regs > MAX_MMA_SYNC_REGS:
            return f"mma.sync holds the accumulator and {bm}x{bk}, {bk}x{bn} operand tiles in about {regs} registers per thread with {warps} warps (at most {MAX_MMA_SYNC_REGS})"
    return None


_kernels = LazyModule(__package__ + "._kernels")


@register_triton("gemm", "triton", space=SPACE, check=check)
def triton_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    BLOCK_M: int = 128,
    BLOCK_N: int = 128,
    BLOCK_K: int = 64,
    GROUP_M: int = 8,
    num_warps: int = 8,
    num_stages: int = 3,
    SPLIT_K: int = 1,
    out: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    activation: str = "none",
) -> torch.Tensor:
    """C = A @ B (+ bias, then activation, in fp32) for fp16/bf16/fp32 (tf32 products) with any
    strides; `out` receives C if given."""
    return _kernels.gemm(a, b, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages, SPLIT_K, out=out,
                         bias=bias, activation=activation)


DECODE_SPACE: dict[str, tuple] = {
    # Decode reads all of B once: what matters is bytes in flight per SM (BLOCK_N x BLOCK_K x
    # num_stages) and enough CTAs (N tiles x SPLIT_K) to cover 132 SMs several times.
    "BLOCK_N": (64, 16, 32, 128),
    "BLOCK_K": (128, 64, 256, 512),
    "SPLIT_K": (4, 1, 2, 8, 16),
    "num_warps": (4, 2, 8),
    "num_stages": (4, 2, 3, 5, 6),
}
DECODE_MAX_M = 64
# N tiles from which SPLIT_K > 1 only adds partial-sum traffic: 8 waves of an H200's 132 SMs.
DECODE_SPLIT_TILES = 8 * 132


def decode_block_m(M: int) -> int:
    """The decode kernel's row tile: all of M, padded to the 16 rows of an MMA."""
    return pow2_at_least(M)


def check_decode(p: GemmProblem, c: Mapping[str, Any]) -> str | None:
    """Why decode configuration `c` is not worth compiling for `p`, or None."""
    if p.dtype not in ITEMSIZE:
        return f"dtype {p.dtype} is not supported"
    if p.M > DECODE_MAX_M:
        return f"the split-K decode kernel is for M <= {DECODE_MAX_M}, not M={p.M}"
    bn, bk, split, warps = c["BLOCK_N"], c["BLOCK_K"], c["SPLIT_K"], c["num_warps"]
    if bn > pow2_at_least(p.N):
        return f"BLOCK_N {bn} is larger than N={p.N} needs"
    if bk > pow2_at_least(p.K):
        return f"BLOCK_K {bk} is larger than K={p.K} needs"
    k_tiles = _cdiv(p.K, bk)
    if split > k_tiles:
        return f"SPLIT_K {split} leaves some splits without a K tile (K={p.K} is {k_tiles} tiles of {bk})"
    tiles = _cdiv(p.N, bn)
    if split > 1 and tiles >= DECODE_SPLIT_TILES:
        return f"{tiles} N tiles fill the GPU without SPLIT_K {split}, which would only add partial sums"
    bm = decode_block_m(p.M)
    threads = 32 * warps
    if bm * bn < 4 * threads:
        return f"a {bm}x{bn} tile leaves some of {warps} warps without a 16x8 MMA tile"
    buffers = smem_buffers(c["num_stages"], warpgroup_mma(bm, warps))
    smem = buffers * (bm * bk + bk * bn) * ITEMSIZE[p.dtype]
    if smem > SMEM_BUDGET:
        return f"{c['num_stages']} stages of {bm}x{bk} and {bk}x{bn} tiles need {smem // 1024} KiB of shared memory (budget {SMEM_BUDGET // 1024} KiB)"
    if not warpgroup_mma(bm, warps):
        regs = (bm * bn + (bm * bk + bk * bn) * ITEMSIZE[p.dtype] // 4) // threads
        if regs > MAX_MMA_SYNC_REGS:
            return f"mma.sync holds the accumulator and {bm}x{bk}, {bk}x{bn} operand tiles in about {regs} registers per thread with {warps} warps (at most {MAX_MMA_SYNC_REGS})"
    return None


@register_triton("gemm", "triton_splitk_decode", space=DECODE_SPACE, check=check_decode, priority=40)
def triton_splitk_decode(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    BLOCK_N: int = 64,
    BLOCK_K: int = 128,
    SPLIT_K: int = 4,
    num_warps: int = 4,
    num_stages: int = 4,
    REDUCE: str = "partials",
    out: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    activation: str = "none",
) -> torch.Tensor:
    """C = A @ B for M <= 64 (decode; B is usually a Linear weight's W.T) in one launch: split-K
    partials reduced by the last program of each N tile, then bias and activation in fp32."""
    return _kernels.splitk_decode(a, b, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages, REDUCE, out=out,
                                  bias=bias, activation=activation)


GEMV_SPACE: dict[str, tuple] = {
    # First values: the best of a sweep at M=1 on an H100 for 4096x4096 and 4096x14336 weights (qkv's 6144x4096
    # liked BLOCK_K 128): four splits of 32 rows.
    "BLOCK_N": (32, 16, 64, 128),
    "BLOCK_K": (256, 128, 512),
    "SPLIT_K": (4, 1, 2, 8, 16),
    "num_warps": (4, 2, 8),
    "num_stages": (4, 2, 3, 5),
}
GEMV_MAX_REGS = 128  # fp32 accumulator registers per thread


def check_gemv(p: GemmProblem, c: Mapping[str, Any]) -> str | None:
    """Why gemv configuration `c` is not worth compiling for `p`, or None."""
    if p.dtype not in ITEMSIZE:
        return f"dtype {p.dtype} is not supported"
    if p.M != 1:
        return f"the gemv kernel is for one row (M=1), not M={p.M}"
    bn, bk, split = c["BLOCK_N"], c["BLOCK_K"], c["SPLIT_K"]
    if bn > pow2_at_least(p.N):
        return f"BLOCK_N {bn} is larger than N={p.N} needs"
    if bk > pow2_at_least(p.K):
        return f"BLOCK_K {bk} is larger than K={p.K} needs"
    k_tiles = _cdiv(p.K, bk)
    if split > k_tiles:
        return f"SPLIT_K {split} leaves some splits without a K tile (K={p.K} is {k_tiles} tiles of {bk})"
    tiles = _cdiv(p.N, bn)
    if split > 1 and tiles >= DECODE_SPLIT_TILES:
        return f"{tiles} N tiles fill the GPU without SPLIT_K {split}, which would only add partial sums"
    regs = bn * bk // (32 * c["num_warps"])
    if regs > GEMV_MAX_REGS:
        return f"a {bn}x{bk} fp32 accumulator is {regs} registers per thread with {c['num_warps']} warps (at most {GEMV_MAX_REGS})"
    return None


@register_triton("gemm", "triton_gemv_decode", space=GEMV_SPACE, check=check_gemv, priority=41)
def triton_gemv_decode(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    BLOCK_N: int = 32,
    BLOCK_K: int = 256,
    SPLIT_K: int = 4,
    num_warps: int = 4,
    num_stages: int = 4,
    out: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    activation: str = "none",
) -> torch.Tensor:
    """C = A @ B for one row of A (decode at batch 1) in one launch: multiply-adds, no MMA; split-K partials
    reduced by the last program of each N tile, then bias and activation in fp32."""
    return _kernels.gemv_decode(a, b, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages, out=out, bias=bias,
                                activation=activation)


TMA_SPACE: dict[str, tuple] = {
    # Persistent (one program per SM) with TMA tile loads: for large problems on sm_90, where
    # the launch-per-tile kernel loses to cuBLAS on wave quantisation and address arithmetic.
    "BLOCK_M": (128, 64),
    "BLOCK_N": (256, 128, 64),
    "BLOCK_K": (64, 128),
    "GROUP_M": (8, 4, 16),
    "num_warps": (8, 4),
    "num_stages": (3, 4, 2, 5),
    "FLATTEN": (True, False),
}


def _tma_supported() -> str | None:
    """Why this process cannot run TMA kernels, or None (sm_90+, or Triton's interpreter)."""
    import os

    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    import torch

    if not torch.cuda.is_available():
        return "TMA needs a CUDA device"
    if torch.cuda.get_device_capability() < (9, 0):
        return f"TMA needs sm_90 or newer, not sm_{''.join(map(str, torch.cuda.get_device_capability()))}"
    return None


def check_tma(p: GemmProblem, c: Mapping[str, Any]) -> str | None:
    """Why TMA configuration `c` is not worth compiling for `p`, or None."""
    if p.dtype not in ITEMSIZE:
        return f"dtype {p.dtype} is not supported"
    size = ITEMSIZE[p.dtype]
    # TMA describes row-major tiles with 16-byte aligned rows: of A (or A.T), B (or B.T) and C.
    rows = {"A": p.M if p.trans_a else p.K, "B": p.K if p.trans_b else p.N, "C": p.N}
    for name, row in rows.items():
        if row * size % 16:
            return f"rows of {name} are {row * size} bytes, not a multiple of the 16 TMA needs"
    bm, bn, bk, warps = c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["num_warps"]
    for name, block, dim in (("BLOCK_M", bm, p.M), ("BLOCK_N", bn, p.N), ("BLOCK_K", bk, p.K)):
        if block > pow2_at_least(dim):
            return f"{name} {block} is larger than {name[-1]}={dim} needs"
    if p.M <= DECODE_MAX_M:
        return f"M={p.M} is a decode shape: the split-K decode kernel covers it"
    smaller = [g for g in TMA_SPACE["GROUP_M"] if g < c["GROUP_M"]]
    if smaller and _cdiv(p.M, bm) <= max(smaller):
        return f"GROUP_M {c['GROUP_M']} orders {_cdiv(p.M, bm)} rows of tiles as GROUP_M {max(smaller)} does"
    threads = 32 * warps
    smem = (c["num_stages"] * (bm * bk + bk * bn) + bm * bn) * size  # + the tile C is stored from
    if smem > SMEM_BUDGET:
        return f"{c['num_stages']} stages of {bm}x{bk} and {bk}x{bn} tiles and a {bm}x{bn} output tile need {smem // 1024} KiB of shared memory (budget {SMEM_BUDGET // 1024} KiB)"
    if bm * bn > MAX_ACC_REGS * threads:
        return f"a {bm}x{bn} accumulator needs {bm * bn // threads} registers per thread with {warps} warps (at most {MAX_ACC_REGS})"
    if not warpgroup_mma(bm, warps):
        return f"BLOCK_M {bm} with {warps} warps is not warpgroup MMA, which the TMA kernel is for"
    return _tma_supported()


@register_triton("gemm", "triton_tma", space=TMA_SPACE, check=check_tma, priority=45)
def triton_tma(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    BLOCK_M: int = 128,
    BLOCK_N: int = 256,
    BLOCK_K: int = 64,
    GROUP_M: int = 8,
    num_warps: int = 8,
    num_stages: int = 3,
    FLATTEN: bool = True,
    out: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    activation: str = "none",
) -> torch.Tensor:
    """C = A @ B through a persistent TMA kernel (sm_90+): one program per SM over grouped tiles."""
    return _kernels.gemm_tma(a, b, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages, FLATTEN, out=out,
                             bias=bias, activation=activation)
