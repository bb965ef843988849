"""linear vendor kernels: F.linear then torch's activation; torch._addmm_activation (cuBLASLt's
fused bias + ReLU/GELU epilogue on CUDA) where its activation is the one asked for."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .._registry import register_vendor
from .problem import LinearProblem, activate


@register_vendor("linear", "torch_linear")
def torch_linear(x, weight, bias=None, activation: str = "none"):
    return activate(F.linear(x, weight, bias), activation)


# torch._addmm_activation(bias, x, W.T, use_gelu) computes relu or gelu of the product plus bias.
# Its GELU is the tanh form on CUDA (cuBLASLt's GELU epilogue; the non-Lt path calls
# gelu_(result, "tanh"), aten/src/ATen/native/cuda/Blas.cpp) but the erf form on the CPU
# (gelu_(result), native/LinearAlgebra.cpp; checked on torch 2.14): one registration per backend.
def _addmm_check(allowed: tuple[str, ...]):
    def check(p: LinearProblem, c) -> str | None:
        if not p.bias:
            return "torch._addmm_activation needs a bias"
        if p.activation not in allowed:
            return f"torch._addmm_activation here computes {' or '.join(allowed)}, not {p.activation}"
        return None

    return check


@register_vendor("linear", "torch_addmm_activation", priority=90, backends=("cuda",),
                 check=_addmm_check(("relu", "gelu_tanh")))
def torch_addmm_activation(x, weight, bias=None, activation: str = "relu"):
    return torch._addmm_activation(bias, x, weight.t(), use_gelu=activation == "gelu_tanh")


@register_vendor("linear", "torch_addmm_activation_cpu", priority=90, backends=("cpu",),
                 check=_addmm_check(("relu", "gelu")))
def torch_addmm_activation_cpu(x, weight, bias=None, activation: str = "relu"):
    return torch._addmm_activation(bias, x, weight.t(), use_gelu=activation == "gelu")
