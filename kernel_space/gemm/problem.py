"""gemm: C = A @ B with A (M, K), B (K, N); A or B may be transposed views. The problem, its inputs and reference."""
from __future__ import annotations

from typing import NamedTuple

import torch

from .._common import DTYPE_CODE, ITEMSIZE, generator, randn
from .._registry import define_op


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
        GemmProblem(1, 4096, 4096, "bf16", trans_b=True),  # decode through a Linear weight (x @ W.T)
        GemmProblem(16, 6144, 4096, "bf16", trans_b=True),
        GemmProblem(3000, 5000, 1000, "bf16"),  # rows of 2000 and 10000 bytes: multiples of 16, not of 32
        GemmProblem(4096, 4096, 4096, "fp16"),
        GemmProblem(2048, 2048, 2048, "fp32"),
    ]


SPEC = define_op("gemm", GemmProblem, signature, make_inputs, reference, size_fields=("M", "N", "K"), streaming=("M",),
                 flops=lambda p: 2.0 * p.M * p.N * p.K,
                 bytes_moved=lambda p: float((p.M * p.K + p.K * p.N + p.M * p.N) * ITEMSIZE[p.dtype]),
                 default_problems=default_problems)
