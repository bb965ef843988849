"""swiglu vendor kernels: the eager torch composite F.silu(gate) * up, and Liger's kernels."""
from __future__ import annotations

import torch.nn.functional as F

from .. import _liger
from .._registry import register_vendor
from .problem import split


@register_vendor("swiglu", "torch_swiglu")
def torch_swiglu(gate, up=None):
    g, u = split(gate, up)
    return F.silu(g) * u


def _merged_needs_fused(p, params):
    if p.merged:
        return _liger.needs_attr("ops.swiglu", "LigerFusedGateUpSiLUMulFunction")(p, params)
    return None


_liger.register_liger("swiglu", "liger_swiglu", check=_merged_needs_fused)(_liger.swiglu)
