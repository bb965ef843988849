"""add_rms_norm: h = x + residual (in the input dtype, as a Llama block adds), then rms_norm(h) * weight.
Returns (normed, h); x may have any number of leading dims (rows). The problem, its inputs and reference."""
from __future__ import annotations

from typing import NamedTuple

import torch

from .. import _rowwise
from .._common import DTYPE_CODE, generator, randn


class AddRmsNormProblem(NamedTuple):
    rows: int
    cols: int
    dtype: str = "fp32"


def signature(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> tuple:
    cols = x.shape[-1]
    return (x.numel() // cols, cols, DTYPE_CODE[x.dtype])


def make_inputs(p: AddRmsNormProblem, device, seed: int = 0):
    g = generator(seed)
    x = randn((p.rows, p.cols), p.dtype, device, g)
    residual = randn((p.rows, p.cols), p.dtype, device, g)
    return (x, residual, _rowwise.weight(p.cols, p.dtype, device, g, 1.0)), {"eps": 1e-6}


def reference(x, residual, weight, eps: float = 1e-6) -> torch.Tensor:
    """The normed output (what the tuner checks; the new residual is x + residual in x's dtype)."""
    h = _rowwise.hi(x + residual)  # rounded to the input dtype, as the model's own add is
    return h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps) * _rowwise.hi(weight)


SPEC = _rowwise.register("add_rms_norm", AddRmsNormProblem, signature=signature, make_inputs=make_inputs,
                         reference=reference, flops=lambda p: 5.0 * p.rows * p.cols,
                         # x and residual read, normed and h written, weight read
                         bytes_moved=lambda p: _rowwise.norm_bytes(p, 1, row_tensors=4))
