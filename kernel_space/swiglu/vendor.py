"""swiglu vendor kernels: the eager torch composites F.silu(gate) * up and (GeGLU) F.gelu(gate, approximate="tanh") * up;
Liger's are in `liger`."""
from __future__ import annotations

import torch.nn.functional as F

from .._registry import register_vendor
from .problem import act, gelu_tanh_only, plain_only, split


# Registered by a call, not a decorator: its check is `plain_only(of=torch_swiglu)`, which names the function itself.
def torch_swiglu(gate, up=None):
    g, u = split(gate, up)
    return F.silu(g) * u


register_vendor("swiglu", "torch_swiglu", check=plain_only(of=torch_swiglu))(torch_swiglu)


# The GeLU-tanh problems' vendor (torch_swiglu refuses them); the SiLU ones stay torch_swiglu's alone.
@register_vendor("swiglu", "torch_geglu", priority=95, check=gelu_tanh_only)
def torch_geglu(gate, up=None, activation="gelu_tanh"):
    g, u = split(gate, up)
    return act(g, activation) * u
