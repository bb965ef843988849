"""rms_norm's Liger-Kernel candidate: an adapter onto its public autograd Function (CUDA only)."""
from __future__ import annotations

from .._liger import liger_attr, needs_attr, register_liger


@register_liger("rms_norm", "liger_rms_norm", check=needs_attr("ops.rms_norm", "LigerRMSNormFunction"))
def rms_norm(x, weight, eps: float = 1e-6):
    # casting_mode "llama": statistics in fp32, normalised x cast to the input dtype, then times weight (HF Llama)
    return liger_attr("ops.rms_norm", "LigerRMSNormFunction").apply(x, weight, eps, 0.0, "llama", False)
