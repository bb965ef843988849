"""add_rms_norm: h = x + residual (in the input dtype, as a Llama block adds), then rms_norm(h) * weight.
Returns (normed, h); x may have any number of leading dims (rows). The problem, its inputs and reference.
With `unit_offset` the scale is (1 + weight), as Gemma's RMSNorm computes it (see rms_norm)."""
from __future__ import annotations

from typing import NamedTuple

import torch

from .. import _rowwise
from .._common import DTYPE_CODE, generator, randn


class _AddRmsNormProblem(NamedTuple):
    rows: int
    cols: int
    dtype: str = "fp32"
    unit_offset: bool = False  # last, defaulted: problems and tables written before it read as x * weight


class AddRmsNormProblem(_rowwise.DefaultsLeftOut, _AddRmsNormProblem):
    """Its dict form leaves `unit_offset` out at its default: every problem known before the field keeps its key."""
    __slots__ = ()
    _left_out = ("unit_offset",)


def signature(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
              unit_offset: bool = False) -> tuple:
    cols = x.shape[-1]
    return (x.numel() // cols, cols, DTYPE_CODE[x.dtype], unit_offset)


def make_inputs(p: AddRmsNormProblem, device, seed: int = 0):
    g = generator(seed)
    x = randn((p.rows, p.cols), p.dtype, device, g)
    residual = randn((p.rows, p.cols), p.dtype, device, g)
    if p.unit_offset:  # weights near 0, as (1 + w) models keep them
        return (x, residual, _rowwise.weight(p.cols, p.dtype, device, g, 0.0)), {"eps": 1e-6, "unit_offset": True}
    return (x, residual, _rowwise.weight(p.cols, p.dtype, device, g, 1.0)), {"eps": 1e-6}


def reference(x, residual, weight, eps: float = 1e-6, unit_offset: bool = False) -> torch.Tensor:
    """The normed output (what the tuner checks; the new residual is x + residual in x's dtype)."""
    h = _rowwise.hi(x + residual)  # rounded to the input dtype, as the model's own add is
    w = _rowwise.hi(weight)
    return h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps) * (1 + w if unit_offset else w)


def unit_offset_only(p, params) -> str | None:
    """Check of the (1 + weight) implementations; the others run the plain problems."""
    return None if p.unit_offset else "runs (1 + weight) problems only (unit_offset)"


# the check of an implementation written before `unit_offset` (see _rowwise.plain_only_for)
plain_only = _rowwise.plain_only_for(lambda p: p.unit_offset, "scales by weight, not (1 + weight): the *_unit_offset implementations run this")


SPEC = _rowwise.register("add_rms_norm", AddRmsNormProblem, signature=signature, make_inputs=make_inputs,
                         reference=reference, flops=lambda p: 5.0 * p.rows * p.cols,
                         # x and residual read, normed and h written, weight read
                         bytes_moved=lambda p: _rowwise.norm_bytes(p, 1, row_tensors=4))
