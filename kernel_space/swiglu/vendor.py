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


def _liger_check(p, params):
    # the merged layout needs LigerFusedGateUpSiLUMulFunction (a newer release than the two-tensor kernel)
    return _liger.missing("ops.swiglu", "LigerFusedGateUpSiLUMulFunction" if p.merged else "LigerSiLUMulFunction")


_liger.register_liger("swiglu", "liger_swiglu", check=_liger_check)(_liger.swiglu)
