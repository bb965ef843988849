"""add_rms_norm's Liger-Kernel candidate: its fused residual add + RMS norm (CUDA only)."""
from __future__ import annotations

from .._liger import liger_attr, needs_attr, register_liger


@register_liger("add_rms_norm", "liger_add_rms_norm",
                check=needs_attr("ops.fused_add_rms_norm", "LigerFusedAddRMSNormFunction"))
def add_rms_norm(x, residual, weight, eps: float = 1e-6):
    y, h = liger_attr("ops.fused_add_rms_norm", "LigerFusedAddRMSNormFunction").apply(
        x, residual, weight, eps, 0.0, "llama", False)
    return y, h
