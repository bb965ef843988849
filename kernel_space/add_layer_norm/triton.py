"""add_layer_norm on CUDA through Triton: the row-wise space, its check, and the launch wrapper."""
from __future__ import annotations

from typing import Any

from .. import _rowwise
from .._common import ITEMSIZE
from .._registry import LazyModule, register_triton

_kernels = LazyModule(__package__ + "._kernels")
_SMEM_BYTES = 200 << 10


def check(p: Any, c) -> str | None:
    """The row-wise check, with pipelined stages holding two input tiles (x and residual)."""
    why = _rowwise.check(p, c)
    if why is None and c["num_stages"] > 1:
        rpp, bn = c["ROWS_PER_PROGRAM"], _rowwise.block_n(c["BLOCK_N"], p.cols)
        if (c["num_stages"] - 1) * (2 * rpp * bn + 2 * bn) * ITEMSIZE[p.dtype] > _SMEM_BYTES:
            return f"{c['num_stages']} stages of two {rpp}x{bn} tiles need over {_SMEM_BYTES >> 10} KiB shared memory"
    return why


@register_triton("add_layer_norm", "triton_add_layer_norm", space=_rowwise.SPACE, check=check)
def triton_add_layer_norm(x, residual, weight, bias=None, eps: float = 1e-5, *, BLOCK_N=0, ROWS_PER_PROGRAM=1,
                          PROGRAMS_PER_SM=0, num_warps=8, num_stages=1):
    """Triton residual add + layer norm: (normed, x + residual)."""
    return _kernels.launch(x, residual, weight, bias, eps, rms=False, BLOCK_N=BLOCK_N,
                           ROWS_PER_PROGRAM=ROWS_PER_PROGRAM, PROGRAMS_PER_SM=PROGRAMS_PER_SM,
                           num_warps=num_warps, num_stages=num_stages)
