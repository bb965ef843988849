"""layer_norm and rms_norm over the last dimension; x may have any number of leading dims (rows)."""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import _rowwise
from ._common import DTYPE_CODE, DTYPES, ITEMSIZE, generator, randn, tolerance
from ._registry import OpSpec, register_impl, register_op


class LayerNormProblem(NamedTuple):
    rows: int
    cols: int
    dtype: str = "fp32"


class RmsNormProblem(NamedTuple):
    rows: int
    cols: int
    dtype: str = "fp32"


def layer_norm_signature(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, eps: float = 1e-5) -> tuple:
    cols = x.shape[-1]
    return (x.numel() // cols, cols, DTYPE_CODE[x.dtype])


def rms_norm_signature(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> tuple:
    cols = x.shape[-1]
    return (x.numel() // cols, cols, DTYPE_CODE[x.dtype])


def _weight(cols: int, dtype: str, device, g: torch.Generator, mean: float) -> torch.Tensor:
    return (mean + 0.1 * torch.randn(cols, generator=g)).to(device=device, dtype=DTYPES[dtype])


def layer_norm_inputs(p: LayerNormProblem, device, seed: int = 0):
    g = generator(seed)
    x = randn((p.rows, p.cols), p.dtype, device, g)
    return (x, _weight(p.cols, p.dtype, device, g, 1.0), _weight(p.cols, p.dtype, device, g, 0.0)), {"eps": 1e-5}


def rms_norm_inputs(p: RmsNormProblem, device, seed: int = 0):
    g = generator(seed)
    x = randn((p.rows, p.cols), p.dtype, device, g)
    return (x, _weight(p.cols, p.dtype, device, g, 1.0)), {"eps": 1e-6}


def _hi(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float64 if t.device.type == "cpu" else torch.float32)


def layer_norm_reference(x, weight, bias=None, eps: float = 1e-5) -> torch.Tensor:
    return F.layer_norm(_hi(x), (x.shape[-1],), _hi(weight), None if bias is None else _hi(bias), eps)


def rms_norm_reference(x, weight, eps: float = 1e-6) -> torch.Tensor:
    h = _hi(x)
    return h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps) * _hi(weight)


def _bytes(p, params_per_col: int) -> float:
    return float((2 * p.rows + params_per_col) * p.cols * ITEMSIZE[p.dtype])


register_op(
    OpSpec(
        name="layer_norm",
        problem=LayerNormProblem,
        signature=layer_norm_signature,
        make_inputs=layer_norm_inputs,
        reference=layer_norm_reference,
        tolerance=tolerance,
        flops=lambda p: 8.0 * p.rows * p.cols,
        bytes_moved=lambda p: _bytes(p, 2),
        size_fields=("rows", "cols"),
        default_problems=lambda device_class: _rowwise.default_problems(LayerNormProblem, device_class),
    )
)
register_op(
    OpSpec(
        name="rms_norm",
        problem=RmsNormProblem,
        signature=rms_norm_signature,
        make_inputs=rms_norm_inputs,
        reference=rms_norm_reference,
        tolerance=tolerance,
        flops=lambda p: 4.0 * p.rows * p.cols,
        bytes_moved=lambda p: _bytes(p, 1),
        size_fields=("rows", "cols"),
        default_problems=lambda device_class: _rowwise.default_problems(RmsNormProblem, device_class),
    )
)


@register_impl("layer_norm", name="torch_layer_norm", priority=100, backends=("cpu", "cuda"), vendor=True)
def torch_layer_norm(x, weight, bias=None, eps: float = 1e-5):
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


if hasattr(F, "rms_norm"):

    @register_impl("rms_norm", name="torch_rms_norm", priority=100, backends=("cpu", "cuda"), vendor=True)
    def torch_rms_norm(x, weight, eps: float = 1e-6):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

else:  # torch < 2.4

    @register_impl("rms_norm", name="torch_rms_norm", priority=100, backends=("cpu", "cuda"), vendor=True)
    def torch_rms_norm(x, weight, eps: float = 1e-6):
        h = x.float()
        return (h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


@register_impl(
    "layer_norm",
    name="triton_layer_norm",
    priority=50,
    backends=("cuda",),
    space=_rowwise.SPACE,
    check=_rowwise.check,
    requires=("triton",),
)
def triton_layer_norm(x, weight, bias=None, eps: float = 1e-5, *, BLOCK_N=0, ROWS_PER_PROGRAM=1,
                      PROGRAMS_PER_SM=0, num_warps=8, num_stages=1, out=None):
    """Triton layer norm; `out` (shaped like x, unit column stride) receives the result when given."""
    from ._triton_norm_kernels import launch

    return launch(x, weight, bias, eps, rms=False, out=out, BLOCK_N=BLOCK_N, ROWS_PER_PROGRAM=ROWS_PER_PROGRAM,
                  PROGRAMS_PER_SM=PROGRAMS_PER_SM, num_warps=num_warps, num_stages=num_stages)


@register_impl(
    "rms_norm",
    name="triton_rms_norm",
    priority=50,
    backends=("cuda",),
    space=_rowwise.SPACE,
    check=_rowwise.check,
    requires=("triton",),
)
def triton_rms_norm(x, weight, eps: float = 1e-6, *, BLOCK_N=0, ROWS_PER_PROGRAM=1, PROGRAMS_PER_SM=0,
                    num_warps=8, num_stages=1, out=None):
    """Triton RMS norm; `out` (shaped like x, unit column stride) receives the result when given."""
    from ._triton_norm_kernels import launch

    return launch(x, weight, None, eps, rms=True, out=out, BLOCK_N=BLOCK_N, ROWS_PER_PROGRAM=ROWS_PER_PROGRAM,
                  PROGRAMS_PER_SM=PROGRAMS_PER_SM, num_warps=num_warps, num_stages=num_stages)
