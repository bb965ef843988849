"""softmax over the last dimension; x may have any number of leading dims (rows). The problem, its inputs and reference."""
from __future__ import annotations

from typing import NamedTuple

import torch

from .. import _rowwise
from .._common import DTYPE_CODE, ITEMSIZE, generator, randn


class SoftmaxProblem(NamedTuple):
    rows: int
    cols: int
    dtype: str = "fp32"


def signature(x: torch.Tensor) -> tuple:
    cols = x.shape[-1]
    return (x.numel() // cols, cols, DTYPE_CODE[x.dtype])


def make_inputs(p: SoftmaxProblem, device, seed: int = 0):
    # Scale 4 gives peaked rows, as logits have: exercises the max subtraction.
    return (randn((p.rows, p.cols), p.dtype, device, generator(seed), scale=4.0),), {}


def reference(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x.to(torch.float64 if x.device.type == "cpu" else torch.float32), dim=-1)


SPEC = _rowwise.register("softmax", SoftmaxProblem, signature=signature, make_inputs=make_inputs, reference=reference,
                         flops=lambda p: 5.0 * p.rows * p.cols,
                         bytes_moved=lambda p: float(2 * p.rows * p.cols * ITEMSIZE[p.dtype]))
