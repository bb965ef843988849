"""gemm: C = A @ B with A (M, K), B (K, N); A or B may be transposed views."""
from __future__ import annotations

from typing import NamedTuple

import torch

from ._common import DTYPE_CODE, ITEMSIZE, generator, num_threads, randn, tolerance, cpu_thread_choices
from ._registry import OpSpec, register_impl, register_op


class GemmProblem(NamedTuple):
    M: int
    N: int
    K: int
    dtype: str = "fp32"
    trans_a: bool = False
    trans_b: bool = False


def signature(a: torch.Tensor, b: torch.Tensor) -> tuple:
    # A plain tuple equal to the GemmProblem: building the NamedTuple costs more than the rest.
    M, K = a.shape
    return (M, b.shape[1], K, DTYPE_CODE[a.dtype], not a.is_contiguous(), not b.is_contiguous())


def make_inputs(p: GemmProblem, device, seed: int = 0):
    g = generator(seed)
    a = randn((p.K, p.M) if p.trans_a else (p.M, p.K), p.dtype, device, g)
    b = randn((p.N, p.K) if p.trans_b else (p.K, p.N), p.dtype, device, g)
    return (a.t() if p.trans_a else a, b.t() if p.trans_b else b), {}


def reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.device.type == "cpu":
        return a.double() @ b.double()
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return a.float() @ b.float()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def default_problems(device_class: str) -> list[GemmProblem]:
    if device_class == "cpu":
        return [
            GemmProblem(256, 256, 256),
            GemmProblem(512, 512, 512),
            GemmProblem(16, 2048, 512),
            GemmProblem(384, 768, 384, trans_b=True),
        ]
    return [
        GemmProblem(4096, 4096, 4096, "bf16"),
        GemmProblem(4096, 14336, 4096, "bf16"),
        GemmProblem(1000, 1000, 1000, "bf16"),
        GemmProblem(16, 4096, 4096, "bf16"),
        GemmProblem(64, 14336, 4096, "bf16"),
        GemmProblem(1, 4096, 4096, "bf16"),
        GemmProblem(4096, 4096, 4096, "fp16"),
        GemmProblem(2048, 2048, 2048, "fp32"),
    ]


SPEC = register_op(
    OpSpec(
        name="gemm",
        problem=GemmProblem,
        signature=signature,
        make_inputs=make_inputs,
        reference=reference,
        tolerance=tolerance,
        flops=lambda p: 2.0 * p.M * p.N * p.K,
        bytes_moved=lambda p: float((p.M * p.K + p.K * p.N + p.M * p.N) * ITEMSIZE[p.dtype]),
        size_fields=("M", "N", "K"),
        default_problems=default_problems,
    )
)


@register_impl("gemm", name="torch_matmul", priority=100, backends=("cpu", "cuda"), vendor=True)
def torch_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a, b)


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
        "threads": cpu_thread_choices(),
    },
    check=_check_blocked,
)
def cpu_blocked(a, b, *, block_m=128, block_n=128, block_k=0, threads=0):
    """Cache-blocked gemm: one product per (M, N) tile, K split into panels when block_k > 0."""
    M, K = a.shape
    N = b.shape[1]
    out = torch.empty((M, N), dtype=a.dtype, device=a.device)
    bk = block_k or K
    with num_threads(threads):
        for i in range(0, M, block_m):
            ai = a[i : i + block_m]
            for j in range(0, N, block_n):
                o = out[i : i + block_m, j : j + block_n]
                bj = b[:, j : j + block_n]
                torch.mm(ai[:, :bk], bj[:bk], out=o)
                for k in range(bk, K, bk):
                    o.addmm_(ai[:, k : k + bk], bj[k : k + bk])
    return out
