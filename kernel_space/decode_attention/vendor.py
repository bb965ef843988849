"""decode attention vendor kernels: F.scaled_dot_product_attention with enable_gqa (K/V heads shared,
not copied by the fused backends), and on CUDA each of its backends as its own candidate.

SDPA has no ragged lengths and aligns `is_causal` top-left, so a ragged, key-masked or causal
(Sq > 1) call gets a boolean mask built on the device from `seq_lens` and `key_mask` (no host read);
rows that see no key, NaN in SDPA, are zeroed as ours are.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .._registry import register_vendor
from .problem import visible

if TYPE_CHECKING:
    from .problem import DecodeAttentionProblem


def sdpa_decode(q, k, v, seq_lens=None, causal: bool = False, scale: float | None = None, key_mask=None):
    """Decode attention through SDPA (whichever backend is enabled): mask only when needed."""
    B, _, Sq, _ = q.shape
    ok = visible(B, Sq, k.shape[2], seq_lens, causal, q.device, key_mask)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=ok, scale=scale, enable_gqa=True)
    if ok is not None:
        out = out.masked_fill(~ok.any(-1, keepdim=True), 0.0)
    return out


@register_vendor("decode_attention", "sdpa")
def sdpa(q, k, v, seq_lens=None, causal: bool = False, key_mask=None):
    return sdpa_decode(q, k, v, seq_lens, causal, key_mask=key_mask)


def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, name)

    def run(q, k, v, seq_lens=None, causal: bool = False, key_mask=None):
        with sdpa_kernel(backend):
            return sdpa_decode(q, k, v, seq_lens, causal, key_mask=key_mask)

    return run


def _needs_mask(p: DecodeAttentionProblem) -> bool:
    return p.ragged or p.masked or (p.causal and p.Sq > 1)


def _half(p: DecodeAttentionProblem, name: str) -> str | None:
    return f"{name} backend needs fp16 or bf16" if p.dtype == "fp32" else None


# What each backend admits, from torch's sdp_utils.cpp (2.5-2.14): flash takes no mask, grouped
# K/V heads, D <= 256; cuDNN D <= 128 (Hopper; its GQA and mask support vary by version, so a
# refusal at run time is a recorded failure); efficient takes masks and, on CUDA, grouped heads;
# math takes everything (it repeats K/V for grouped heads).
def _check_flash(p: DecodeAttentionProblem, c) -> str | None:
    if _needs_mask(p):
        return "flash backend takes no attn_mask (ragged lengths, a key mask or causal with Sq > 1 need one)"
    if p.D > 256 or p.D % 8:
        return f"flash backend needs D <= 256 and a multiple of 8, not {p.D}"
    return _half(p, "flash")


def _check_cudnn(p: DecodeAttentionProblem, c) -> str | None:
    if p.D > 128 or p.D % 8:
        return f"cuDNN backend needs D <= 128 and a multiple of 8, not {p.D}"
    return _half(p, "cuDNN")


def _check_efficient(p: DecodeAttentionProblem, c) -> str | None:
    align = 4 if p.dtype == "fp32" else 8
    if p.D % align:
        return f"efficient backend needs D a multiple of {align} for {p.dtype}, not {p.D}"
    return None


for _name, _backend, _priority, _check in (
    ("sdpa_flash", "FLASH_ATTENTION", 95, _check_flash),
    ("sdpa_cudnn", "CUDNN_ATTENTION", 94, _check_cudnn),
    ("sdpa_efficient", "EFFICIENT_ATTENTION", 93, _check_efficient),
    ("sdpa_math", "MATH", 92, None),
):
    register_vendor("decode_attention", _name, priority=_priority, backends=("cuda",), check=_check)(_sdpa_backend(_backend))
