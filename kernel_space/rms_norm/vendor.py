"""rms_norm vendor kernels: F.rms_norm (a float32 composite before torch 2.4), and the composite of Gemma's (1 + weight)
RMSNorm."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .._registry import register_vendor
from .problem import plain_only

# Registered by a call, not a decorator: its check is `plain_only(of=torch_rms_norm)`, which names the function itself.
if hasattr(F, "rms_norm"):

    def torch_rms_norm(x, weight, eps: float = 1e-6):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

else:  # torch < 2.4

    def torch_rms_norm(x, weight, eps: float = 1e-6):
        h = x.float()
        return (h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps)).to(x.dtype) * weight

register_vendor("rms_norm", "torch_rms_norm", check=plain_only(of=torch_rms_norm))(torch_rms_norm)


# The (1 + weight) problems' vendor (torch_rms_norm refuses them). Ranked below torch_rms_norm, which stays the plain
# problems' default; it runs them too (the same F.rms_norm), as every rms_norm vendor runs every default problem.
@register_vendor("rms_norm", "torch_rms_norm_unit_offset", priority=95)
def torch_rms_norm_unit_offset(x, weight, eps: float = 1e-6, unit_offset: bool = False):
    """With `unit_offset`, Gemma's RMSNorm: fp32 statistics and scale (1 + weight), cast to x's dtype at the end."""
    if not unit_offset:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(x.dtype)
