"""gemm's Triton kernels and their launch (needs triton; `triton.py` imports this on the first call)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gemm_kernel(
    a_ptr, b_ptr, c_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn,
    stride_cs, stride_cm, stride_cn,  # stride_cs: between split-K partials in the workspace
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    if GROUP_M == 1:
        pid_m = pid // num_pid_n
        pid_n = pid % num_pid_n
    else:
        # Walk GROUP_M rows of tiles column by column, so consecutive programs share B in L2.
        per_group = GROUP_M * num_pid_n
        first_m = (pid // per_group) * GROUP_M
        group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_rows
        pid_n = (pid % per_group) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows and columns past the edge wrap back inside the matrix: loads need no M/N mask
    # (only the store is masked) and contiguity survives when M, N are multiples of 16.
    rm = offs_m % M
    rn = offs_n % N
    # Split s owns K tiles s, s + SPLIT_K, ...: balanced, and no split is empty.
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rm[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + rn[None, :] * stride_bn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - k
            a = tl.load(a_ptrs, mask=tl.arange(0, BLOCK_K)[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=tl.arange(0, BLOCK_K)[:, None] < k_left, other=0.0)
        acc = tl.dot(a, b, acc)  # fp32 inputs use tf32
        a_ptrs += BLOCK_K * SPLIT_K * stride_ak
        b_ptrs += BLOCK_K * SPLIT_K * stride_bk

    c_ptrs = c_ptr + pid_k * stride_cs + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SPLIT_K == 1:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(c_ptrs, acc, mask=mask)  # fp32 partial sum


@triton.jit
def _split_k_reduce(
    ws_ptr, c_ptr, N, stride_ws, stride_wm, stride_cm, stride_cn,
    SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    ptrs = ws_ptr + row * stride_wm + offs
    acc = tl.load(ptrs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(ptrs + s * stride_ws, mask=mask, other=0.0)
    tl.store(c_ptr + row * stride_cm + offs * stride_cn, acc.to(c_ptr.dtype.element_ty), mask=mask)


def _new_workspace(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Scratch for split-K partial sums (tests replace it to poison the workspace)."""
    return torch.empty(shape, dtype=torch.float32, device=device)


def gemm(
    a: torch.Tensor, b: torch.Tensor,
    BLOCK_M: int, BLOCK_N: int, BLOCK_K: int, GROUP_M: int, num_warps: int, num_stages: int, SPLIT_K: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    M, K = a.shape
    N = b.shape[1]
    if b.shape[0] != K:
        raise ValueError(f"gemm: a is {tuple(a.shape)} but b is {tuple(b.shape)}")
    if out is None:
        out = torch.empty((M, N), dtype=a.dtype, device=a.device)
    tiles = triton.cdiv(M, BLOCK_M) * triton.cdiv(N, BLOCK_N)
    if SPLIT_K == 1:
        c = out
        cs = 0
    else:
        c = _new_workspace((SPLIT_K, M, N), a.device)
        cs = c.stride(0)
    _gemm_kernel[(tiles, SPLIT_K)](
        a, b, c, M, N, K,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        cs, c.stride(-2), c.stride(-1),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        GROUP_M=GROUP_M, SPLIT_K=SPLIT_K, EVEN_K=K % BLOCK_K == 0,
        num_warps=num_warps, num_stages=num_stages,
    )
    if SPLIT_K > 1:
        block = min(1024, triton.next_power_of_2(N))
        _split_k_reduce[(M, triton.cdiv(N, block))](
            c, out, N, c.stride(0), c.stride(1), out.stride(0), out.stride(1),
            SPLIT_K=SPLIT_K, BLOCK=block, num_warps=4,
        )
    return out
