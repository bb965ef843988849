"""softmax on CUDA through Triton: the row-wise space and check, and the launch wrapper."""
from __future__ import annotations

from .. import _rowwise
from .._registry import LazyModule, register_triton

_kernels = LazyModule(__package__ + "._kernels")


@register_triton("softmax", "triton_softmax", space=_rowwise.SPACE, check=_rowwise.check)
def triton_softmax(x, *, BLOCK_N=0, ROWS_PER_PROGRAM=1, PROGRAMS_PER_SM=0, num_warps=8, num_stages=1, out=None):
    """Triton softmax: single pass for BLOCK_N 0 (or one covering the row), else an online softmax over column blocks."""
    return _kernels.launch(x, out=out, BLOCK_N=BLOCK_N, ROWS_PER_PROGRAM=ROWS_PER_PROGRAM, PROGRAMS_PER_SM=PROGRAMS_PER_SM,
                           num_warps=num_warps, num_stages=num_stages)
