"""decode attention on CUDA through Triton: flash-decoding (K/V split across programs, fp32 online
softmax, log-sum-exp combine), grouped query heads sharing each K/V load.

The space, the validity check and the launch wrapper; the kernels (`_kernels`) load on the
first call, so this module imports without triton.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Mapping

from .._common import ITEMSIZE, pow2_at_least
from .._hopper import SMEM_BUDGET, smem_buffers, warpgroup_mma
from .._registry import LazyModule, register_triton
from .problem import DecodeAttentionProblem

if TYPE_CHECKING:
    import torch

MAX_HEAD_DIM = 256
MAX_ROWS = 128  # query rows of one program (heads x Sq): past this the score tile no longer fits registers
# Estimated registers a thread (see `check`), calibrated on this kernel built for sm_90 with Triton
# 3.6 (bf16, D 128, ptxas resource usage): under warpgroup MMA estimates up to 96 built without
# spills, 128 and more spilled 248-1440 bytes; under mma.sync up to 100 built clean, 164 and more
# spilled 40-1584 bytes.
MAX_TILE_REGS = 104
MAX_MMA_SYNC_REGS = 128

SPACE: dict[str, tuple] = {
    "BLOCK_N": (64, 32, 128, 256, 16),
    # Programs along the keys of one sequence: fills the GPU when B x Hkv is small.
    "num_splits": (1, 2, 4, 8, 16, 32, 64),
    # Query heads per program, all sharing one K/V head (0: the whole group); must divide Hq / Hkv.
    "HEADS_PER_PROGRAM": (0, 1, 2, 4, 8),
    "num_warps": (4, 2, 8, 1),
    "num_stages": (2, 3, 4, 1),
}


def heads_per_program(p: DecodeAttentionProblem, c: Mapping[str, Any]) -> int:
    return c["HEADS_PER_PROGRAM"] or p.Hq // p.Hkv


def smem_bytes(p: DecodeAttentionProblem, c: Mapping[str, Any]) -> int:
    """Shared memory for the Q tile and the pipelined K and V tiles (D padded to a power of two)."""
    bm = pow2_at_least(heads_per_program(p, c) * p.Sq)
    buffers = smem_buffers(c["num_stages"], warpgroup_mma(bm, c["num_warps"]))
    return (bm + 2 * buffers * c["BLOCK_N"]) * pow2_at_least(p.D) * ITEMSIZE[p.dtype]


def check(p: DecodeAttentionProblem, c: Mapping[str, Any]) -> str | None:
    """Why configuration `c` is not worth compiling for `p`, or None."""
    if p.dtype not in ITEMSIZE:
        return f"dtype {p.dtype} is not supported"
    if p.D > MAX_HEAD_DIM:
        return f"head dim {p.D} is over {MAX_HEAD_DIM}"
    if p.Hkv <= 0 or p.Hq % p.Hkv:
        return f"Hq={p.Hq} is not a multiple of Hkv={p.Hkv}"
    group = p.Hq // p.Hkv
    heads = heads_per_program(p, c)
    if group % heads:
        return f"HEADS_PER_PROGRAM {heads} does not divide the {group} query heads per K/V head"
    if c["HEADS_PER_PROGRAM"] == group and group > 1:
        return f"HEADS_PER_PROGRAM {heads} is the whole group: the same as 0"
    rows = heads * p.Sq
    if rows > MAX_ROWS:
        return f"{heads} heads x Sq={p.Sq} make {rows} query rows per program (at most {MAX_ROWS}); use fewer heads per program"
    bn, warps, splits = c["BLOCK_N"], c["num_warps"], c["num_splits"]
    if bn > pow2_at_least(p.Skv):
        return f"BLOCK_N {bn} is larger than Skv={p.Skv} needs"
    blocks = -(-p.Skv // bn)
    if splits > blocks:
        return f"num_splits {splits} is more than the {blocks} key blocks of BLOCK_N {bn} in Skv={p.Skv}"
    smem = smem_bytes(p, c)
    if smem > SMEM_BUDGET:
        return f"Q, and {c['num_stages']} stages of K and V tiles, need {smem // 1024} KiB of shared memory (budget {SMEM_BUDGET // 1024} KiB)"
    bm, d = pow2_at_least(rows), pow2_at_least(p.D)
    words = bm * (d + bn)
    limit = MAX_TILE_REGS
    if not warpgroup_mma(bm, warps):
        words += (bm * d + 2 * d * bn + bm * bn) * ITEMSIZE[p.dtype] // 4
        limit = MAX_MMA_SYNC_REGS
    regs = words // (32 * warps)
    if regs > limit:
        return f"{bm} rows, BLOCK_N {bn} and D {p.D} need about {regs} registers per thread with {warps} warps (at most {limit})"
    return None


def programs(p: DecodeAttentionProblem, c: Mapping[str, Any]) -> int:
    """Programs one launch runs: (query-head groups x K/V heads x sequences) x splits."""
    return p.B * p.Hq // heads_per_program(p, c) * c["num_splits"]


def adapt(tuned: DecodeAttentionProblem, p: DecodeAttentionProblem, c: Mapping[str, Any]) -> dict[str, Any]:
    """A winner tuned for `tuned` fitted to `p`: the split count that gives `p` the tuned launch's number of
    programs (the split-KV trade of filling the GPU against combining partial results, as the tuner found
    it) times sqrt(p's keys / the tuned keys), within the key blocks `p` has; the other parameters as tuned.

    The square root: a longer cache wants more splits at the same width. Replayed on an H100 sweep of four
    problems (B 1/8 x 639/4223 keys, `benchmarks/results/2026-12-05-h100-borrowed-decode.json`), matching
    programs alone put the 12 borrowed winners at 1.17x the best (geometric mean, worst 1.78x, one at 0.86x
    the vendor); with the root at 1.09x (worst 1.37x, none below 1.30x the vendor)."""
    c = dict(c)
    if p.Hkv <= 0 or tuned.Hkv <= 0 or (p.Hq // p.Hkv) % heads_per_program(p, c):
        return c
    want = programs(tuned, c) / max(1, p.B * p.Hq // heads_per_program(p, c)) * math.sqrt(max(1, p.Skv) / max(1, tuned.Skv))
    blocks = -(-p.Skv // c["BLOCK_N"])
    fits = [s for s in SPACE["num_splits"] if s <= blocks] or [1]
    c["num_splits"] = min(fits, key=lambda s: (abs(math.log2(s / max(want, 1e-9))), s))
    return c


_kernels = LazyModule(__package__ + "._kernels")


@register_triton("decode_attention", "triton_decode", space=SPACE, check=check, adapt=adapt)
def triton_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_lens: torch.Tensor | None = None,
    causal: bool = False,
    *,
    BLOCK_N: int = 64,
    num_splits: int = 1,
    HEADS_PER_PROGRAM: int = 0,
    num_warps: int = 4,
    num_stages: int = 2,
    scale: float | None = None,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention for q (B, Hq, Sq, D) against k, v (B, Hkv, Skv, D) of any strides; a new output."""
    return _kernels.decode_attention(q, k, v, seq_lens, causal, BLOCK_N, num_splits, HEADS_PER_PROGRAM,
                                     num_warps, num_stages, scale=scale, key_mask=key_mask)
