"""rms_norm vendor kernel: F.rms_norm (a float32 composite before torch 2.4)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .._registry import register_vendor
from .problem import unit_offset_only


if hasattr(F, "rms_norm"):

    @register_vendor("rms_norm", "torch_rms_norm")
    def torch_rms_norm(x, weight, eps: float = 1e-6):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

else:  # torch < 2.4

    @register_vendor("rms_norm", "torch_rms_norm")
    def torch_rms_norm(x, weight, eps: float = 1e-6):
        h = x.float()
        return (h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


# Its own implementation, so torch_rms_norm (and the winners of tables made before) stay as they were; ranked above it
# so a (1 + weight) problem's default is this one, and refused for the plain ones, whose default stays torch_rms_norm.
@register_vendor("rms_norm", "torch_rms_norm_unit_offset", priority=110, check=unit_offset_only)
def torch_rms_norm_unit_offset(x, weight, eps: float = 1e-6, unit_offset: bool = True):
    """Gemma's RMSNorm: fp32 statistics and scale (1 + weight), cast to x's dtype at the end."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(x.dtype)
