"""rms_norm on CUDA through Triton: the row-wise space and check, and the launch wrapper."""
from __future__ import annotations

from .. import _rowwise
from .._registry import LazyModule, register_triton
from .problem import plain_only

_kernels = LazyModule(__package__ + "._kernels")


@register_triton("rms_norm", "triton_rms_norm", space=_rowwise.SPACE, check=plain_only(_rowwise.check))
def triton_rms_norm(x, weight, eps: float = 1e-6, *, BLOCK_N=0, ROWS_PER_PROGRAM=1, PROGRAMS_PER_SM=0,
                    num_warps=8, num_stages=1, out=None):
    """Triton RMS norm; `out` (shaped like x, unit column stride) receives the result when given."""
    return _kernels.launch(x, weight, None, eps, rms=True, out=out, BLOCK_N=BLOCK_N, ROWS_PER_PROGRAM=ROWS_PER_PROGRAM,
                           PROGRAMS_PER_SM=PROGRAMS_PER_SM, num_warps=num_warps, num_stages=num_stages)


def unit_check(p, c) -> str | None:
    # A plain problem is triton_rms_norm's to search: this kernel offers it its default configuration alone.
    if not p.unit_offset and dict(c) != {k: v[0] for k, v in _rowwise.SPACE.items()}:
        return "plain problems run this kernel in its default configuration only (triton_rms_norm searches them)"
    return _rowwise.check(p, c)


@register_triton("rms_norm", "triton_rms_norm_unit_offset", space=_rowwise.SPACE, check=unit_check)
def triton_rms_norm_unit_offset(x, weight, eps: float = 1e-6, unit_offset: bool = False, *, BLOCK_N=0,
                                ROWS_PER_PROGRAM=1, PROGRAMS_PER_SM=0, num_warps=8, num_stages=1):
    """Triton RMS norm scaled by (1 + weight) with `unit_offset` (Gemma's RMSNorm), by weight without; fp32, one cast."""
    return _kernels.launch_unit(x, weight, eps, unit_offset, BLOCK_N=BLOCK_N, ROWS_PER_PROGRAM=ROWS_PER_PROGRAM,
                                PROGRAMS_PER_SM=PROGRAMS_PER_SM, num_warps=num_warps, num_stages=num_stages)
