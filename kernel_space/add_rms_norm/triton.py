"""add_rms_norm on CUDA through Triton: add_layer_norm's space and check, and the launch wrapper."""
from __future__ import annotations

from .. import _rowwise
from .._registry import LazyModule, register_triton
from ..add_layer_norm.triton import check
from .problem import plain_only

_kernels = LazyModule(__package__ + "._kernels")


@register_triton("add_rms_norm", "triton_add_rms_norm", space=_rowwise.SPACE, check=plain_only(check))
def triton_add_rms_norm(x, residual, weight, eps: float = 1e-6, *, BLOCK_N=0, ROWS_PER_PROGRAM=1, PROGRAMS_PER_SM=0,
                        num_warps=8, num_stages=1):
    """Triton residual add + RMS norm: (normed, x + residual)."""
    return _kernels.launch(x, residual, weight, None, eps, rms=True, BLOCK_N=BLOCK_N,
                           ROWS_PER_PROGRAM=ROWS_PER_PROGRAM, PROGRAMS_PER_SM=PROGRAMS_PER_SM,
                           num_warps=num_warps, num_stages=num_stages)


def unit_check(p, c) -> str | None:
    # A plain problem is triton_add_rms_norm's to search: this kernel offers it its default configuration alone.
    if not p.unit_offset and dict(c) != {k: v[0] for k, v in _rowwise.SPACE.items()}:
        return "plain problems run this kernel in its default configuration only (triton_add_rms_norm searches them)"
    return check(p, c)


@register_triton("add_rms_norm", "triton_add_rms_norm_unit_offset", space=_rowwise.SPACE, check=unit_check)
def triton_add_rms_norm_unit_offset(x, residual, weight, eps: float = 1e-6, unit_offset: bool = False, *, BLOCK_N=0,
                                    ROWS_PER_PROGRAM=1, PROGRAMS_PER_SM=0, num_warps=8, num_stages=1):
    """Triton residual add + RMS norm scaled by (1 + weight) with `unit_offset` (Gemma), by weight without:
    (normed, x + residual)."""
    return _kernels.launch_unit(x, residual, weight, eps, unit_offset, BLOCK_N=BLOCK_N,
                                ROWS_PER_PROGRAM=ROWS_PER_PROGRAM, PROGRAMS_PER_SM=PROGRAMS_PER_SM,
                                num_warps=num_warps, num_stages=num_stages)
