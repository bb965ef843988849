"""gemm vendor kernel: torch.matmul (cuBLAS on CUDA, oneDNN/MKL on the CPU)."""
from __future__ import annotations

import torch

from .._registry import register_vendor


@register_vendor("gemm", "torch_matmul")
def torch_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a, b)
