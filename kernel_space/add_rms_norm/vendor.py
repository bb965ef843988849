"""add_rms_norm vendor kernels: the eager torch composite (what a Llama block runs), and the composite of a Gemma block's
add + (1 + weight) RMSNorm; Liger's are in `liger`."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .._registry import register_vendor
from .problem import plain_only, unit_offset_only


# Registered by a call, not a decorator: its check is `plain_only(of=torch_add_rms_norm)`, which names the function.
def torch_add_rms_norm(x, residual, weight, eps: float = 1e-6):
    h = x + residual
    if hasattr(F, "rms_norm"):
        return F.rms_norm(h, (h.shape[-1],), weight, eps), h
    f = h.float()  # torch < 2.4
    return (f * torch.rsqrt(f.square().mean(-1, keepdim=True) + eps)).to(h.dtype) * weight, h


register_vendor("add_rms_norm", "torch_add_rms_norm", check=plain_only(of=torch_add_rms_norm))(torch_add_rms_norm)


# The (1 + weight) problems' vendor (torch_add_rms_norm refuses them); the plain ones stay torch_add_rms_norm's alone.
@register_vendor("add_rms_norm", "torch_add_rms_norm_unit_offset", priority=95, check=unit_offset_only)
def torch_add_rms_norm_unit_offset(x, residual, weight, eps: float = 1e-6, unit_offset: bool = True):
    """h = x + residual in x's dtype, then Gemma's RMSNorm of h: fp32 statistics and (1 + weight), cast at the end."""
    h = x + residual
    f = h.float()
    return (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(h.dtype), h
