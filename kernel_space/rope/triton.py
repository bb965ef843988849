"""rope on CUDA through Triton: the space, the validity check, and the launch wrapper."""
from __future__ import annotations

from .._common import ITEMSIZE, pow2_at_least
from .._registry import LazyModule, register_triton

_kernels = LazyModule(__package__ + "._kernels")

# A program rotates BLOCK_T tokens: cos/sin rows loaded once, then BLOCK_H heads at a time over
# q's heads and k's heads (SPLIT_HEADS False), or one BLOCK_H group of them per program along a
# second grid axis (SPLIT_HEADS True: more programs for decode's few tokens, cos/sin reloaded per group).
SPACE: dict[str, tuple] = {
    "BLOCK_T": (2, 1, 4, 8, 16, 32),
    "BLOCK_H": (8, 1, 2, 4, 16, 32),
    "SPLIT_HEADS": (False, True),
    "num_warps": (4, 1, 2, 8, 16),
}

_MIN_BYTES_PER_THREAD = 16  # one 128-bit load per half row each; fewer leaves threads idle or replicated
_MAX_FP32_PER_THREAD = 64  # both halves and both results live in fp32 registers


def check(p, c) -> str | None:
    """Why config `c` cannot or should not run problem `p`, or None."""
    bt, bh, warps = c["BLOCK_T"], c["BLOCK_H"], c["num_warps"]
    if p.D % 2:
        return f"head dim {p.D} is odd: rope rotates pairs"
    if bt > pow2_at_least(p.tokens, 1):
        return f"BLOCK_T {bt} exceeds the {p.tokens} tokens"
    if bh > pow2_at_least(max(p.Hq, p.Hkv), 1):
        return f"BLOCK_H {bh} exceeds the {max(p.Hq, p.Hkv)} heads"
    half = pow2_at_least(p.D // 2, 1)
    tile, threads = bt * bh * half, 32 * warps
    if warps > 1 and tile * ITEMSIZE[p.dtype] < _MIN_BYTES_PER_THREAD * threads:  # one warp: the floor
        return f"a {bt}x{bh}x{half} tile gives each of {threads} threads under {_MIN_BYTES_PER_THREAD} bytes a half"
    if 4 * tile > _MAX_FP32_PER_THREAD * threads:
        return f"a {bt}x{bh}x{half} tile needs over {_MAX_FP32_PER_THREAD} fp32 registers a thread with {warps} warps"
    return None


@register_triton("rope", "triton_rope", space=SPACE, check=check)
def triton_rope(q, k, cos, sin, positions=None, *, interleaved: bool = False, out=None,
                BLOCK_T=2, BLOCK_H=8, SPLIT_HEADS=False, num_warps=4):
    """q and k rotated in one launch; `out=(q_out, k_out)` may be (q, k) (in place)."""
    return _kernels.launch(q, k, cos, sin, positions, interleaved=interleaved, out=out, BLOCK_T=BLOCK_T,
                           BLOCK_H=BLOCK_H, SPLIT_HEADS=SPLIT_HEADS, num_warps=num_warps)
