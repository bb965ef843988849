"""attention vendor kernels: F.scaled_dot_product_attention, and on CUDA each of its backends."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch.nn.functional as F

from .._registry import register_vendor

if TYPE_CHECKING:
    from .problem import AttentionProblem


@register_vendor("attention", "sdpa")
def sdpa(q, k, v, causal: bool = False):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, name)

    def run(q, k, v, causal: bool = False):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def _check_sdpa_flash(p: AttentionProblem, c) -> str | None:
    if p.dtype == "fp32":
        return "flash backend needs fp16 or bf16"
    if p.D > 256 or p.D % 8:
        return f"flash backend needs D ≤ 256 and a multiple of 8, not {p.D}"
    return None


def _check_sdpa_cudnn(p: AttentionProblem, c) -> str | None:
    if p.dtype == "fp32":
        return "cuDNN backend needs fp16 or bf16"
    if p.D > 128 or p.D % 8:
        return f"cuDNN backend needs D ≤ 128 and a multiple of 8, not {p.D}"
    return None


# Each SDPA backend is its own vendor candidate on CUDA, so the tuner compares against the best.
for _name, _backend, _priority, _check in (
    ("sdpa_flash", "FLASH_ATTENTION", 95, _check_sdpa_flash),
    ("sdpa_cudnn", "CUDNN_ATTENTION", 94, _check_sdpa_cudnn),
    ("sdpa_efficient", "EFFICIENT_ATTENTION", 93, None),
):
    register_vendor("attention", _name, priority=_priority, backends=("cuda",), check=_check)(_sdpa_backend(_backend))
