"""attention forward: softmax(Q Kᵀ / √D) V over (B, H, S, D) tensors.

Causal masking is aligned top-left (query i sees keys 0..i), as torch's
scaled_dot_product_attention does, also when Sq != Skv.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .._common import DTYPE_CODE, ITEMSIZE, generator, randn
from .._registry import define_op


class AttentionProblem(NamedTuple):
    B: int
    H: int
    Sq: int
    Skv: int
    D: int
    causal: bool = False
    dtype: str = "fp32"


def signature(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> tuple:
    B, H, Sq, D = q.shape
    return (B, H, Sq, k.shape[2], D, bool(causal), DTYPE_CODE[q.dtype])


def make_inputs(p: AttentionProblem, device, seed: int = 0):
    g = generator(seed)
    q = randn((p.B, p.H, p.Sq, p.D), p.dtype, device, g)
    k = randn((p.B, p.H, p.Skv, p.D), p.dtype, device, g)
    v = randn((p.B, p.H, p.Skv, p.D), p.dtype, device, g)
    return (q, k, v), {"causal": p.causal}


def reference(q, k, v, causal: bool = False) -> torch.Tensor:
    hi = torch.float64 if q.device.type == "cpu" else torch.float32
    s = (q.to(hi) @ k.to(hi).transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        Sq, Skv = s.shape[-2:]
        mask = torch.ones(Sq, Skv, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, dim=-1).nan_to_num(0.0) @ v.to(hi)


def _flops(p: AttentionProblem) -> float:
    f = 4.0 * p.B * p.H * p.Sq * p.Skv * p.D
    return f / 2 if p.causal else f


def default_problems(device_class: str) -> list[AttentionProblem]:
    if device_class == "cpu":
        return [
            AttentionProblem(1, 4, 256, 256, 64),
            AttentionProblem(1, 4, 256, 256, 64, causal=True),
            AttentionProblem(2, 4, 128, 512, 64),
        ]
    return [
        AttentionProblem(4, 32, 2048, 2048, 128, False, "bf16"),
        AttentionProblem(4, 32, 2048, 2048, 128, True, "bf16"),
        AttentionProblem(1, 32, 8192, 8192, 128, True, "bf16"),
        AttentionProblem(16, 16, 512, 512, 64, False, "fp16"),
        AttentionProblem(8, 32, 1024, 4096, 128, False, "bf16"),
    ]


SPEC = define_op("attention", AttentionProblem, signature, make_inputs, reference,
                 size_fields=("B", "H", "Sq", "Skv", "D"), streaming=("B", "Sq", "Skv"), flops=_flops,
                 bytes_moved=lambda p: float(p.B * p.H * (2 * p.Sq + 2 * p.Skv) * p.D * ITEMSIZE[p.dtype]),
                 default_problems=default_problems)
