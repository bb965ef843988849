"""rms_norm's Liger-Kernel candidates: adapters onto its public autograd Function, plain and (1 + weight) (CUDA only)."""
from __future__ import annotations

from .._liger import liger_attr, needs_attr, register_liger
from .problem import plain_only, unit_offset_only


@register_liger("rms_norm", "liger_rms_norm",
                check=plain_only(needs_attr("ops.rms_norm", "LigerRMSNormFunction")))
def rms_norm(x, weight, eps: float = 1e-6):
    # casting_mode "llama": statistics in fp32, normalised x cast to the input dtype, then times weight (HF Llama)
    return liger_attr("ops.rms_norm", "LigerRMSNormFunction").apply(x, weight, eps, 0.0, "llama", False)


@register_liger("rms_norm", "liger_rms_norm_unit_offset",
                check=needs_attr("ops.rms_norm", "LigerRMSNormFunction", unit_offset_only))
def rms_norm_unit_offset(x, weight, eps: float = 1e-6, unit_offset: bool = True):
    # offset 1.0 and casting_mode "gemma" (all in fp32, cast once): Gemma's RMSNorm
    return liger_attr("ops.rms_norm", "LigerRMSNormFunction").apply(x, weight, eps, 1.0, "gemma", False)
