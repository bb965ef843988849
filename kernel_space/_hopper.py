"""Hopper (sm_90) resource budgets and lowering rules that the Triton validity checks share."""
from __future__ import annotations

# H100/H200 give a block up to 227 KiB of shared memory; 3 KiB stay spare for anything
# the compiler adds (Triton 3.9 adds nothing to these kernels). A100 (163 KiB) fails the rest.
SMEM_BUDGET = 224 * 1024
# Register budgets per thread, from sm_90 builds with Triton 3.9. Accumulator: 128x256 tiles
# take 208 registers with 8 warps, but spill 736 bytes with 4 (256 accumulator registers).
# mma.sync also holds its operand tiles in registers: estimates up to ~200 built without
# spills, 320 and more spilled 250-450 bytes.
MAX_ACC_REGS = 128
MAX_MMA_SYNC_REGS = 240


def warpgroup_mma(block_m: int, num_warps: int) -> bool:
    """Whether Triton lowers this tile's dots to Hopper warpgroup MMA rather than mma.sync.

    Warpgroup MMA needs whole warpgroups (4 warps) of 64 rows; every sm_90 build of these
    kernels followed this rule.
    """
    return num_warps % 4 == 0 and block_m >= 64


def smem_buffers(num_stages: int, wgmma: bool) -> int:
    """Tile buffers a `num_stages` pipeline allocates (as Triton 3.9 reports for sm_90).

    Warpgroup MMA reads operands from shared memory while the next loads land: one buffer
    per stage. mma.sync copies operands to registers first, which frees a buffer.
    """
    return num_stages if wgmma else max(1, num_stages - 1)
