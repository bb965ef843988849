"""linear's Triton kernels: gemm's (`..gemm._kernels`), whose epilogue adds the bias and applies
the activation in fp32 before the cast."""
from __future__ import annotations

from ..gemm._kernels import ACTIVATIONS, gemm, gemm_tma, gemv_decode, splitk_decode

__all__ = ["ACTIVATIONS", "gemm", "gemm_tma", "gemv_decode", "splitk_decode"]
