"""rms_norm vendor kernel: F.rms_norm (a float32 composite before torch 2.4)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .._registry import register_vendor


if hasattr(F, "rms_norm"):

    @register_vendor("rms_norm", "torch_rms_norm")
    def torch_rms_norm(x, weight, eps: float = 1e-6):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

else:  # torch < 2.4

    @register_vendor("rms_norm", "torch_rms_norm")
    def torch_rms_norm(x, weight, eps: float = 1e-6):
        h = x.float()
        return (h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps)).to(x.dtype) * weight
