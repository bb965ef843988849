"""layer_norm on CUDA through Triton: the row-wise space and check, and the launch wrapper."""
from __future__ import annotations

from .. import _rowwise
from .._registry import LazyModule, register_triton

_kernels = LazyModule(__package__ + "._kernels")


@register_triton("layer_norm", "triton_layer_norm", space=_rowwise.SPACE, check=_rowwise.check)
def triton_layer_norm(x, weight, bias=None, eps: float = 1e-5, *, BLOCK_N=0, ROWS_PER_PROGRAM=1,
                      PROGRAMS_PER_SM=0, num_warps=8, num_stages=1, out=None):
    """Triton layer norm; `out` (shaped like x, unit column stride) receives the result when given."""
    return _kernels.launch(x, weight, bias, eps, rms=False, out=out, BLOCK_N=BLOCK_N, ROWS_PER_PROGRAM=ROWS_PER_PROGRAM,
                           PROGRAMS_PER_SM=PROGRAMS_PER_SM, num_warps=num_warps, num_stages=num_stages)
