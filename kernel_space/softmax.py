"""softmax over the last dimension; x may have any number of leading dims (rows)."""
from __future__ import annotations

from typing import NamedTuple

import torch

from . import _rowwise
from ._common import DTYPE_CODE, ITEMSIZE, generator, randn, tolerance
from ._registry import OpSpec, register_impl, register_op


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


register_op(
    OpSpec(
        name="softmax",
        problem=SoftmaxProblem,
        signature=signature,
        make_inputs=make_inputs,
        reference=reference,
        tolerance=tolerance,
        flops=lambda p: 5.0 * p.rows * p.cols,
        bytes_moved=lambda p: float(2 * p.rows * p.cols * ITEMSIZE[p.dtype]),
        size_fields=("rows", "cols"),
        default_problems=lambda device_class: _rowwise.default_problems(SoftmaxProblem, device_class),
    )
)


@register_impl("softmax", name="torch_softmax", priority=100, backends=("cpu", "cuda"), vendor=True)
def torch_softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, dim=-1)


@register_impl(
    "softmax",
    name="triton_softmax",
    priority=50,
    backends=("cuda",),
    space=_rowwise.SPACE,
    check=_rowwise.check,
    requires=("triton",),
)
def triton_softmax(x, *, BLOCK_N=0, ROWS_PER_PROGRAM=1, PROGRAMS_PER_SM=0, num_warps=8, num_stages=1, out=None):
    """Triton softmax: single pass for BLOCK_N 0 (or one covering the row), else an online softmax over column blocks."""
    from ._triton_softmax_kernels import launch

    return launch(x, out=out, BLOCK_N=BLOCK_N, ROWS_PER_PROGRAM=ROWS_PER_PROGRAM, PROGRAMS_PER_SM=PROGRAMS_PER_SM,
                  num_warps=num_warps, num_stages=num_stages)
