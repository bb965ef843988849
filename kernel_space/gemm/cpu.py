"""gemm on the CPU: cache-blocked products over torch.mm (never changes the process's thread count)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .._registry import register_impl

if TYPE_CHECKING:
    from .problem import GemmProblem


def _check_blocked(p: GemmProblem, c) -> str | None:
    if c["block_m"] >= 2 * p.M and c["block_m"] > 32:
        return f"block_m {c['block_m']} is over twice M={p.M}"
    if c["block_n"] >= 2 * p.N and c["block_n"] > 32:
        return f"block_n {c['block_n']} is over twice N={p.N}"
    if c["block_k"] and c["block_k"] >= p.K:
        return f"block_k {c['block_k']} does not split K={p.K}"
    return None


@register_impl(
    "gemm",
    name="cpu_blocked",
    priority=10,
    backends=("cpu",),
    space={
        "block_m": (128, 32, 64, 256, 512),
        "block_n": (128, 32, 64, 256, 512),
        "block_k": (0, 64, 128, 256),  # 0: the whole K in one product
    },
    check=_check_blocked,
)
def cpu_blocked(a, b, *, block_m=128, block_n=128, block_k=0):
    """Cache-blocked gemm: one product per (M, N) tile, K split into panels when block_k > 0."""
    M, K = a.shape
    N = b.shape[1]
    out = torch.empty((M, N), dtype=a.dtype, device=a.device)
    bk = block_k or K
    for i in range(0, M, block_m):
        ai = a[i : i + block_m]
        for j in range(0, N, block_n):
            o = out[i : i + block_m, j : j + block_n]
            bj = b[:, j : j + block_n]
            torch.mm(ai[:, :bk], bj[:bk], out=o)
            for k in range(bk, K, bk):
                o.addmm_(ai[:, k : k + bk], bj[k : k + bk])
    return out
