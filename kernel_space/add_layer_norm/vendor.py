"""add_layer_norm vendor kernels: the eager torch composite (what a model runs without ops-adv)."""
from __future__ import annotations

import torch.nn.functional as F

from .._registry import register_vendor


@register_vendor("add_layer_norm", "torch_add_layer_norm")
def torch_add_layer_norm(x, residual, weight, bias=None, eps: float = 1e-5):
    h = x + residual
    return F.layer_norm(h, (h.shape[-1],), weight, bias, eps), h
