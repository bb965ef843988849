"""add_rms_norm vendor kernel: the eager torch composite (what a Llama block runs); Liger's is in `liger`."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .._registry import register_vendor
from .problem import unit_offset_only


@register_vendor("add_rms_norm", "torch_add_rms_norm")
def torch_add_rms_norm(x, residual, weight, eps: float = 1e-6):
    h = x + residual
    if hasattr(F, "rms_norm"):
        return F.rms_norm(h, (h.shape[-1],), weight, eps), h
    f = h.float()  # torch < 2.4
    return (f * torch.rsqrt(f.square().mean(-1, keepdim=True) + eps)).to(h.dtype) * weight, h



# Its own implementation (torch_add_rms_norm and its winners stay as they were); the default of (1 + weight)
# problems, refused for the plain ones.
@register_vendor("add_rms_norm", "torch_add_rms_norm_unit_offset", priority=110, check=unit_offset_only)
def torch_add_rms_norm_unit_offset(x, residual, weight, eps: float = 1e-6, unit_offset: bool = True):
    """h = x + residual in x's dtype, then Gemma's RMSNorm of h: fp32 statistics and (1 + weight), cast at the end."""
    h = x + residual
    f = h.float()
    return (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(h.dtype), h
