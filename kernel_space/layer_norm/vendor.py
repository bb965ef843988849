"""layer_norm vendor kernel: F.layer_norm."""
from __future__ import annotations

import torch.nn.functional as F

from .._registry import register_vendor


@register_vendor("layer_norm", "torch_layer_norm")
def torch_layer_norm(x, weight, bias=None, eps: float = 1e-5):
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
