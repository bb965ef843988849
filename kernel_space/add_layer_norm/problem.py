"""add_layer_norm: h = x + residual (in the input dtype), then layer_norm(h) over the last dimension.
Returns (normed, h); x may have any number of leading dims (rows). The problem, its inputs and reference."""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .. import _rowwise
from .._common import DTYPE_CODE, generator, randn


class AddLayerNormProblem(NamedTuple):
    rows: int
    cols: int
    dtype: str = "fp32"


def signature(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
              eps: float = 1e-5) -> tuple:
    cols = x.shape[-1]
    return (x.numel() // cols, cols, DTYPE_CODE[x.dtype])


def make_inputs(p: AddLayerNormProblem, device, seed: int = 0):
    g = generator(seed)
    x = randn((p.rows, p.cols), p.dtype, device, g)
    residual = randn((p.rows, p.cols), p.dtype, device, g)
    w = _rowwise.weight(p.cols, p.dtype, device, g, 1.0)
    return (x, residual, w, _rowwise.weight(p.cols, p.dtype, device, g, 0.0)), {"eps": 1e-5}


def reference(x, residual, weight, bias=None, eps: float = 1e-5) -> torch.Tensor:
    """The normed output (what the tuner checks; the new residual is x + residual in x's dtype)."""
    hi = _rowwise.hi
    h = x + residual  # rounded to the input dtype, as the model's own add is
    return F.layer_norm(hi(h), (x.shape[-1],), hi(weight), None if bias is None else hi(bias), eps)


SPEC = _rowwise.register("add_layer_norm", AddLayerNormProblem, signature=signature, make_inputs=make_inputs,
                         reference=reference, flops=lambda p: 9.0 * p.rows * p.cols,
                         # x and residual read, normed and h written, weight and bias read
                         bytes_moved=lambda p: _rowwise.norm_bytes(p, 2, row_tensors=4))
