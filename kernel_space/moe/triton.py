"""moe on CUDA through Triton: routing, alignment by expert, and two grouped gemms (gated SiLU fused into the
first's epilogue, the routing weight into the second's). The space is the serving engines' fused_moe space, so a
winner's parameters are a config of their per-device files (`tuner.export.export_moe_configs`)."""
from __future__ import annotations

from typing import Any, Mapping

from .._common import ITEMSIZE, pow2_at_least
from .._hopper import MAX_ACC_REGS, MAX_MMA_SYNC_REGS, SMEM_BUDGET, smem_buffers, warpgroup_mma
from .._registry import LazyModule, register_triton
from .problem import ACTIVATIONS, MoeProblem
from .problem import padded_slots

_kernels = LazyModule(__package__ + "._kernels")

SPACE: dict[str, tuple] = {
    # Decode (a few tokens per expert) wants 16-row blocks and many column tiles to cover the SMs while the
    # weights stream by; prefill wants 64-128-row blocks (vLLM's tuned H100/H200 configs span the same ranges).
    "BLOCK_SIZE_M": (64, 16, 32, 128, 256),
    "BLOCK_SIZE_N": (64, 32, 128, 256),
    "BLOCK_SIZE_K": (64, 32, 128, 256),
    "GROUP_SIZE_M": (8, 1, 16, 32, 64),
    "num_warps": (4, 8, 2),
    "num_stages": (3, 2, 4, 5),
}


def problem_error(p: MoeProblem) -> str | None:
    """Why no implementation computes `p`, or None."""
    if p.activation not in ACTIVATIONS:
        return f"activation {p.activation!r} is not one of {', '.join(ACTIVATIONS)}"
    if p.top_k > p.E:
        return f"top_k {p.top_k} exceeds the {p.E} experts"
    return None


def check(p: MoeProblem, c: Mapping[str, Any]) -> str | None:
    """Why configuration `c` is not worth compiling for `p`, or None."""
    why = problem_error(p)
    if why or p.dtype not in ITEMSIZE:
        return why or f"dtype {p.dtype} is not supported"
    bm, bn, bk, warps, group = c["BLOCK_SIZE_M"], c["BLOCK_SIZE_N"], c["BLOCK_SIZE_K"], c["num_warps"], c["GROUP_SIZE_M"]
    if bm > pow2_at_least(p.T):  # an expert gets each token at most once
        return f"BLOCK_SIZE_M {bm} is larger than an expert's at most {p.T} tokens need"
    if bn > pow2_at_least(max(p.N, p.K)):
        return f"BLOCK_SIZE_N {bn} is larger than N={p.N} and K={p.K} need"
    if bk > pow2_at_least(max(p.N, p.K)):
        return f"BLOCK_SIZE_K {bk} is larger than K={p.K} and N={p.N} need"
    blocks_m = -(-padded_slots(p.T * p.top_k, p.E, bm) // bm)
    smaller = [g for g in SPACE["GROUP_SIZE_M"] if g < group]
    if smaller and blocks_m <= max(smaller):
        return f"GROUP_SIZE_M {group} orders at most {blocks_m} row blocks as GROUP_SIZE_M {max(smaller)} does"
    threads = 32 * warps
    if bm * bn < 4 * threads:
        return f"a {bm}x{bn} tile leaves some of {warps} warps without a 16x8 MMA tile"
    # the gate/up kernel is the larger: an A tile, two B tiles and two accumulators
    size = ITEMSIZE[p.dtype]
    smem = smem_buffers(c["num_stages"], warpgroup_mma(bm, warps)) * (bm * bk + 2 * bk * bn) * size
    if smem > SMEM_BUDGET:
        return f"{c['num_stages']} stages of a {bm}x{bk} tile and two {bk}x{bn} tiles need {smem // 1024} KiB of shared memory (budget {SMEM_BUDGET // 1024} KiB)"
    if 2 * bm * bn > MAX_ACC_REGS * threads:
        return f"two {bm}x{bn} accumulators need {2 * bm * bn // threads} registers per thread with {warps} warps (at most {MAX_ACC_REGS})"
    if not warpgroup_mma(bm, warps):
        regs = (2 * bm * bn + (bm * bk + 2 * bk * bn) * size // 4) // threads
        if regs > MAX_MMA_SYNC_REGS:
            return f"mma.sync holds two {bm}x{bn} accumulators and the operand tiles in about {regs} registers per thread with {warps} warps (at most {MAX_MMA_SYNC_REGS})"
    return None


def adapt(tuned: MoeProblem, p: MoeProblem, params: Mapping[str, Any]) -> dict[str, Any]:
    """A near token count's winner, its row block no larger than this count's tokens need."""
    return {**params, "BLOCK_SIZE_M": min(params["BLOCK_SIZE_M"], pow2_at_least(p.T))}


@register_triton("moe", "triton_fused_moe", space=SPACE, check=check, adapt=adapt)
def triton_fused_moe(x, router_logits, w13, w2, *, top_k: int, activation: str = "silu", renormalize: bool = True,
                     BLOCK_SIZE_M: int = 64, BLOCK_SIZE_N: int = 64, BLOCK_SIZE_K: int = 64, GROUP_SIZE_M: int = 8,
                     num_warps: int = 4, num_stages: int = 3):
    """Routed experts through two grouped Triton gemms; fp32 accumulation, the intermediate in x's dtype."""
    return _kernels.fused_moe(x, router_logits, w13, w2, top_k, renormalize, BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K,
                              GROUP_SIZE_M, num_warps, num_stages)
