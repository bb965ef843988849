"""rms_norm over the last dimension; x may have any number of leading dims (rows). The problem, its inputs and reference.

With `unit_offset` the scale is (1 + weight), computed as Gemma's RMSNorm does: x in fp32, times fp32 (1 + weight),
then cast to x's dtype (Llama's casts before the weight)."""
from __future__ import annotations

from typing import NamedTuple

import torch

from .. import _rowwise
from .._common import DTYPE_CODE, generator, randn


class _RmsNormProblem(NamedTuple):
    rows: int
    cols: int
    dtype: str = "fp32"
    unit_offset: bool = False  # last, defaulted: problems and tables written before it read as x * weight


class RmsNormProblem(_rowwise.DefaultsLeftOut, _RmsNormProblem):
    """Its dict form leaves `unit_offset` out at its default: every problem known before the field keeps its key."""
    __slots__ = ()
    _left_out = ("unit_offset",)


def signature(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, unit_offset: bool = False) -> tuple:
    cols = x.shape[-1]
    return (x.numel() // cols, cols, DTYPE_CODE[x.dtype], unit_offset)


def make_inputs(p: RmsNormProblem, device, seed: int = 0):
    g = generator(seed)
    x = randn((p.rows, p.cols), p.dtype, device, g)
    if p.unit_offset:  # weights near 0, as (1 + w) models keep them
        return (x, _rowwise.weight(p.cols, p.dtype, device, g, 0.0)), {"eps": 1e-6, "unit_offset": True}
    return (x, _rowwise.weight(p.cols, p.dtype, device, g, 1.0)), {"eps": 1e-6}


def reference(x, weight, eps: float = 1e-6, unit_offset: bool = False) -> torch.Tensor:
    h = _rowwise.hi(x)
    w = _rowwise.hi(weight)
    return h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps) * (1 + w if unit_offset else w)


def unit_offset_only(p, params) -> str | None:
    """Check of the (1 + weight) implementations; the others run the plain problems."""
    return None if p.unit_offset else "runs (1 + weight) problems only (unit_offset)"


# the check of an implementation written before `unit_offset` (see _rowwise.plain_only_for)
plain_only = _rowwise.plain_only_for(lambda p: p.unit_offset, "scales by weight, not (1 + weight): the *_unit_offset implementations run this")


SPEC = _rowwise.register("rms_norm", RmsNormProblem, signature=signature, make_inputs=make_inputs, reference=reference,
                         flops=lambda p: 4.0 * p.rows * p.cols, bytes_moved=lambda p: _rowwise.norm_bytes(p, 1))
