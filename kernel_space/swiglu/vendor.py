"""swiglu vendor kernels: the eager torch composites F.silu(gate) * up and (GeGLU) F.gelu(gate, approximate="tanh") * up;
Liger's are in `liger`."""
from __future__ import annotations

import torch.nn.functional as F

from .._registry import register_vendor
from .problem import act, split


@register_vendor("swiglu", "torch_swiglu")
def torch_swiglu(gate, up=None):
    g, u = split(gate, up)
    return F.silu(g) * u


def _geglu_only(p, params) -> str | None:
    return None if p.activation == "gelu_tanh" else f"runs GeLU-tanh gates only (this one is {p.activation}: torch_swiglu)"


# Its own implementation, so torch_swiglu (and the SiLU winners of tables made before) stay as they were; ranked
# above it so a GeLU-tanh problem's default is this one, and refused for SiLU ones, whose default stays torch_swiglu.
@register_vendor("swiglu", "torch_geglu", priority=110, check=_geglu_only)
def torch_geglu(gate, up=None, activation="gelu_tanh"):
    g, u = split(gate, up)
    return act(g, activation) * u
