"""softmax vendor kernel: torch.softmax."""
from __future__ import annotations

import torch

from .._registry import register_vendor


@register_vendor("softmax", "torch_softmax")
def torch_softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, dim=-1)
