"""linear: y = activation(x @ W.T + b) with x (M, K), W (N, K) as nn.Linear stores it, b (N,) or none.
The problem, its inputs and reference."""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .._common import DTYPE_CODE, ITEMSIZE, generator, randn
from .._registry import define_op

# "gelu" is F.gelu's default (erf); "gelu_tanh" is F.gelu(approximate="tanh").
ACTIVATIONS = ("none", "relu", "gelu", "gelu_tanh", "silu")


class LinearProblem(NamedTuple):
    M: int
    N: int
    K: int
    bias: bool = False
    activation: str = "none"
    dtype: str = "fp32"


def signature(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str = "none") -> tuple:
    K = x.shape[-1]
    return (x.numel() // K, weight.shape[0], K, bias is not None, activation, DTYPE_CODE[x.dtype])


def activate(y: torch.Tensor, activation: str) -> torch.Tensor:
    """torch's own activation functions, by name."""
    if activation == "none":
        return y
    if activation == "relu":
        return F.relu(y)
    if activation == "gelu":
        return F.gelu(y)
    if activation == "gelu_tanh":
        return F.gelu(y, approximate="tanh")
    if activation == "silu":
        return F.silu(y)
    raise ValueError(f"activation {activation!r} is not one of {', '.join(ACTIVATIONS)}")


def make_inputs(p: LinearProblem, device, seed: int = 0):
    g = generator(seed)
    x = randn((p.M, p.K), p.dtype, device, g)
    # Weights scaled as nn.Linear initialises them, so pre-activations are O(1): the
    # activation's curved part is exercised, not only its tails.
    w = randn((p.N, p.K), p.dtype, device, g, scale=p.K ** -0.5)
    b = randn((p.N,), p.dtype, device, g, scale=0.5) if p.bias else None
    return (x, w, b), {"activation": p.activation}


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
              activation: str = "none") -> torch.Tensor:
    hi = torch.float64 if x.device.type == "cpu" else torch.float32
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        y = F.linear(x.to(hi), weight.to(hi), None if bias is None else bias.to(hi))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    return activate(y, activation)


def default_problems(device_class: str) -> list[LinearProblem]:
    if device_class == "cpu":
        return [
            LinearProblem(64, 256, 128, True, "gelu"),
            LinearProblem(4, 512, 256, False, "silu"),
            LinearProblem(128, 384, 256, True, "relu"),
        ]
    # Llama-3-8B decode and prefill projections, a BERT-style MLP with bias + GELU.
    return [
        LinearProblem(1, 14336, 4096, False, "silu", "bf16"),
        LinearProblem(16, 14336, 4096, False, "silu", "bf16"),
        LinearProblem(4096, 14336, 4096, False, "silu", "bf16"),
        LinearProblem(8, 6144, 4096, True, "none", "bf16"),
        LinearProblem(4096, 3072, 768, True, "gelu", "bf16"),
        LinearProblem(4096, 3072, 768, True, "gelu_tanh", "fp16"),
        LinearProblem(2048, 4096, 1024, True, "relu", "fp32"),
    ]


SPEC = define_op("linear", LinearProblem, signature, make_inputs, reference, size_fields=("M", "N", "K"),
                 streaming=("M",), choices={"activation": ACTIVATIONS}, flops=lambda p: 2.0 * p.M * p.N * p.K,
                 bytes_moved=lambda p: float((p.M * p.K + p.N * p.K + p.M * p.N + (p.N if p.bias else 0)) * ITEMSIZE[p.dtype]),
                 default_problems=default_problems)
