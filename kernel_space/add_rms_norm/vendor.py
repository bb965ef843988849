"""add_rms_norm vendor kernel: the eager torch composite (what a Llama block runs); Liger's is in `liger`."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .._registry import register_vendor


@register_vendor("add_rms_norm", "torch_add_rms_norm")
def torch_add_rms_norm(x, residual, weight, eps: float = 1e-6):
    h = x + residual
    if hasattr(F, "rms_norm"):
        return F.rms_norm(h, (h.shape[-1],), weight, eps), h
    f = h.float()  # torch < 2.4
    return (f * torch.rsqrt(f.square().mean(-1, keepdim=True) + eps)).to(h.dtype) * weight, h

