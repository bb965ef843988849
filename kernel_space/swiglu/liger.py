"""swiglu's Liger-Kernel candidates: its SiLU-mul kernels, two-tensor and merged gate_up, and its GeLU-mul (GeGLU) (CUDA only)."""
from __future__ import annotations

from .. import _liger
from .._liger import liger_attr, needs_attr, register_liger
from .problem import gelu_tanh_only, plain_only, split


def _liger_check(p, params):
    # the merged layout needs LigerFusedGateUpSiLUMulFunction (a newer release than the two-tensor kernel)
    return _liger.missing("ops.swiglu", "LigerFusedGateUpSiLUMulFunction" if p.merged else "LigerSiLUMulFunction")


@register_liger("swiglu", "liger_swiglu", check=plain_only(_liger_check))
def swiglu(gate, up=None):
    if up is None:  # one [..., 2I] tensor: gate then up
        return liger_attr("ops.swiglu", "LigerFusedGateUpSiLUMulFunction").apply(gate.contiguous())
    # its kernel walks gate, up and out with one row stride: contiguous operands
    return liger_attr("ops.swiglu", "LigerSiLUMulFunction").apply(gate.contiguous(), up.contiguous())


@register_liger("swiglu", "liger_geglu", check=needs_attr("ops.geglu", "LigerGELUMulFunction", gelu_tanh_only))
def geglu(gate, up=None, activation="gelu_tanh"):
    """Liger's GeGLU (GeLU with the tanh approximation, times up); a merged gate_up is split into contiguous halves."""
    g, u = split(gate, up)
    return liger_attr("ops.geglu", "LigerGELUMulFunction").apply(g.contiguous(), u.contiguous())
