"""add_rms_norm's Liger-Kernel candidates: its fused residual add + RMS norm, plain and (1 + weight) (CUDA only)."""
from __future__ import annotations

from .._liger import liger_attr, needs_attr, register_liger
from .problem import plain_only, unit_offset_only


@register_liger("add_rms_norm", "liger_add_rms_norm",
                check=plain_only(needs_attr("ops.fused_add_rms_norm", "LigerFusedAddRMSNormFunction")))
def add_rms_norm(x, residual, weight, eps: float = 1e-6):
    y, h = liger_attr("ops.fused_add_rms_norm", "LigerFusedAddRMSNormFunction").apply(
        x, residual, weight, eps, 0.0, "llama", False)
    return y, h


@register_liger("add_rms_norm", "liger_add_rms_norm_unit_offset",
                check=needs_attr("ops.fused_add_rms_norm", "LigerFusedAddRMSNormFunction", unit_offset_only))
def add_rms_norm_unit_offset(x, residual, weight, eps: float = 1e-6, unit_offset: bool = True):
    # offset 1.0 and casting_mode "gemma" (all in fp32, cast once): Gemma's RMSNorm of x + residual
    y, h = liger_attr("ops.fused_add_rms_norm", "LigerFusedAddRMSNormFunction").apply(
        x, residual, weight, eps, 1.0, "gemma", False)
    return y, h
