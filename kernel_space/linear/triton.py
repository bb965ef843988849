"""linear on CUDA through Triton: gemm's tiled kernel and split-K decode kernel on x @ W.T, bias
and activation fused into the epilogue. Spaces and checks are gemm's, for the trans_b problem."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from .._registry import LazyModule, register_triton
from ..gemm import triton as gemm_triton
from ..gemm.problem import GemmProblem
from .problem import ACTIVATIONS, LinearProblem

if TYPE_CHECKING:
    import torch

_kernels = LazyModule(__package__ + "._kernels")


def _as_gemm(p: LinearProblem) -> GemmProblem:
    return GemmProblem(p.M, p.N, p.K, p.dtype, False, True)


def check(p: LinearProblem, c: Mapping[str, Any]) -> str | None:
    if p.activation not in ACTIVATIONS:
        return f"activation {p.activation} is not one of {', '.join(ACTIVATIONS)}"
    return gemm_triton.check(_as_gemm(p), c)


def check_decode(p: LinearProblem, c: Mapping[str, Any]) -> str | None:
    if p.activation not in ACTIVATIONS:
        return f"activation {p.activation} is not one of {', '.join(ACTIVATIONS)}"
    return gemm_triton.check_decode(_as_gemm(p), c)


def check_gemv(p: LinearProblem, c: Mapping[str, Any]) -> str | None:
    if p.activation not in ACTIVATIONS:
        return f"activation {p.activation} is not one of {', '.join(ACTIVATIONS)}"
    return gemm_triton.check_gemv(_as_gemm(p), c)


@register_triton("linear", "triton", space=gemm_triton.SPACE, check=check)
def triton_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "none",
    *,
    BLOCK_M: int = 128,
    BLOCK_N: int = 128,
    BLOCK_K: int = 64,
    GROUP_M: int = 8,
    num_warps: int = 8,
    num_stages: int = 3,
    SPLIT_K: int = 1,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """activation(x @ weight.T + bias) for a 2-D x, through the tiled gemm."""
    return _kernels.gemm(x, weight.t(), BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages, SPLIT_K,
                         out=out, bias=bias, activation=activation)


def check_tma(p: LinearProblem, c: Mapping[str, Any]) -> str | None:
    if p.activation not in ACTIVATIONS:
        return f"activation {p.activation} is not one of {', '.join(ACTIVATIONS)}"
    return gemm_triton.check_tma(_as_gemm(p), c)


@register_triton("linear", "triton_tma", space=gemm_triton.TMA_SPACE, check=check_tma, priority=45)
def triton_linear_tma(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "none",
    *,
    BLOCK_M: int = 128,
    BLOCK_N: int = 256,
    BLOCK_K: int = 64,
    GROUP_M: int = 8,
    num_warps: int = 8,
    num_stages: int = 3,
    FLATTEN: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """activation(x @ weight.T + bias) through the persistent TMA gemm (sm_90+)."""
    return _kernels.gemm_tma(x, weight.t(), BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages, FLATTEN,
                             out=out, bias=bias, activation=activation)


@register_triton("linear", "triton_gemv_decode", space=gemm_triton.GEMV_SPACE, check=check_gemv, priority=41)
def triton_linear_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "none",
    *,
    BLOCK_N: int = 32,
    BLOCK_K: int = 256,
    SPLIT_K: int = 4,
    num_warps: int = 4,
    num_stages: int = 4,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """activation(x @ weight.T + bias) for one row of x, through the gemv kernel."""
    return _kernels.gemv_decode(x, weight.t(), BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages, out=out,
                                bias=bias, activation=activation)


@register_triton("linear", "triton_splitk_decode", space=gemm_triton.DECODE_SPACE, check=check_decode, priority=40)
def triton_linear_decode(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str = "none",
    *,
    BLOCK_N: int = 64,
    BLOCK_K: int = 128,
    SPLIT_K: int = 4,
    num_warps: int = 4,
    num_stages: int = 4,
    REDUCE: str = "partials",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """activation(x @ weight.T + bias) for x of at most 64 rows, through the split-K decode kernel."""
    return _kernels.splitk_decode(x, weight.t(), BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages, REDUCE,
                                  out=out, bias=bias, activation=activation)
