"""rms_norm over the last dimension; x may have any number of leading dims (rows). The problem, its inputs and reference."""
from __future__ import annotations

from typing import NamedTuple

import torch

from .. import _rowwise
from .._common import DTYPE_CODE, generator, randn


class RmsNormProblem(NamedTuple):
    rows: int
    cols: int
    dtype: str = "fp32"


def signature(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> tuple:
    cols = x.shape[-1]
    return (x.numel() // cols, cols, DTYPE_CODE[x.dtype])


def make_inputs(p: RmsNormProblem, device, seed: int = 0):
    g = generator(seed)
    x = randn((p.rows, p.cols), p.dtype, device, g)
    return (x, _rowwise.weight(p.cols, p.dtype, device, g, 1.0)), {"eps": 1e-6}


def reference(x, weight, eps: float = 1e-6) -> torch.Tensor:
    h = _rowwise.hi(x)
    return h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps) * _rowwise.hi(weight)


SPEC = _rowwise.register("rms_norm", RmsNormProblem, signature=signature, make_inputs=make_inputs, reference=reference,
                         flops=lambda p: 4.0 * p.rows * p.cols, bytes_moved=lambda p: _rowwise.norm_bytes(p, 1))
