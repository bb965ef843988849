"""layer_norm's Liger-Kernel candidate: an adapter onto its public autograd Function (CUDA only)."""
from __future__ import annotations

from .._liger import liger_attr, needs_attr, register_liger


@register_liger("layer_norm", "liger_layer_norm", check=needs_attr("ops.layer_norm", "LigerLayerNormFunction"))
def layer_norm(x, weight, bias=None, eps: float = 1e-5):
    if bias is None:
        bias = weight.new_zeros(weight.shape)
    return liger_attr("ops.layer_norm", "LigerLayerNormFunction").apply(x, weight, bias, eps)
