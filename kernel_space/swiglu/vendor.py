"""swiglu vendor kernels: the eager torch composites F.silu(gate) * up and (GeGLU) F.gelu(gate, approximate="tanh") * up;
Liger's are in `liger`."""
from __future__ import annotations

import torch.nn.functional as F

from .._registry import register_vendor
from .problem import act, gelu_tanh_only, split


@register_vendor("swiglu", "torch_swiglu")
def torch_swiglu(gate, up=None):
    g, u = split(gate, up)
    return F.silu(g) * u


# Its own implementation, so torch_swiglu (and the SiLU winners of tables made before) stay as they were; ranked
# above it so a GeLU-tanh problem's default is this one, and refused for SiLU ones, whose default stays torch_swiglu.
@register_vendor("swiglu", "torch_geglu", priority=110, check=gelu_tanh_only)
def torch_geglu(gate, up=None, activation="gelu_tanh"):
    g, u = split(gate, up)
    return act(g, activation) * u
