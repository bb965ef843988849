"""A correct but deliberately slow gemm, so that a test can act while a tune is still running."""
from __future__ import annotations

import time

import torch

from kernel_space import register_impl


@register_impl("gemm", name="slow_matmul", priority=1, space={"delay_ms": (60, 70, 80), "variant": tuple(range(10))})
def slow_matmul(a, b, *, delay_ms=60, variant=0):
    time.sleep(delay_ms / 1000)
    return torch.matmul(a, b)
