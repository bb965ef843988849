"""swiglu vendor kernel: the eager torch composite F.silu(gate) * up; Liger's are in `liger`."""
from __future__ import annotations

import torch.nn.functional as F

from .._registry import register_vendor
from .problem import split


@register_vendor("swiglu", "torch_swiglu")
def torch_swiglu(gate, up=None):
    g, u = split(gate, up)
    return F.silu(g) * u
