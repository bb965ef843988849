"""layer_norm over the last dimension; x may have any number of leading dims (rows). The problem, its inputs and reference."""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .. import _rowwise
from .._common import DTYPE_CODE, generator, randn


class LayerNormProblem(NamedTuple):
    rows: int
    cols: int
    dtype: str = "fp32"


def signature(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, eps: float = 1e-5) -> tuple:
    cols = x.shape[-1]
    return (x.numel() // cols, cols, DTYPE_CODE[x.dtype])


def make_inputs(p: LayerNormProblem, device, seed: int = 0):
    g = generator(seed)
    x = randn((p.rows, p.cols), p.dtype, device, g)
    return (x, _rowwise.weight(p.cols, p.dtype, device, g, 1.0), _rowwise.weight(p.cols, p.dtype, device, g, 0.0)), {"eps": 1e-5}


def reference(x, weight, bias=None, eps: float = 1e-5) -> torch.Tensor:
    hi = _rowwise.hi
    return F.layer_norm(hi(x), (x.shape[-1],), hi(weight), None if bias is None else hi(bias), eps)


SPEC = _rowwise.register("layer_norm", LayerNormProblem, signature=signature, make_inputs=make_inputs,
                         reference=reference, flops=lambda p: 8.0 * p.rows * p.cols,
                         bytes_moved=lambda p: _rowwise.norm_bytes(p, 2))
