"""rms_norm's Triton kernels: layer_norm's kernels with RMS=True (no mean, no bias), and their launch; and the
(1 + weight) kernels (Gemma's RMSNorm; UNIT=False scales by weight), kept apart so the plain ones' versions and winners stay as they were."""
# No `from __future__ import annotations`: Triton reads the tl.constexpr annotations.
import torch
import triton
import triton.language as tl

from .._rowwise import block_n, grid, rows_view
from .._rowwise_jit import row_offsets
from ..layer_norm._kernels import launch, norm_looped, norm_single  # noqa: F401


@triton.jit
def _unit_single_tile(X, Y, w1, tile, rows, cols, stride_x, stride_y, eps, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    r, rl = row_offsets(tile, rows, ROWS)
    c = tl.arange(0, BLOCK_N)
    cmask = c[None, :] < cols
    x = tl.load(X + rl[:, None] * stride_x + c[None, :], mask=cmask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / cols + eps)
    y = x * rstd[:, None] * w1[None, :]
    tl.store(Y + r[:, None].to(tl.int64) * stride_y + c[None, :], y.to(Y.dtype.element_ty),
             mask=(r[:, None] < rows) & cmask)


@triton.jit
def unit_norm_single(X, W, Y, rows, cols, stride_x, stride_y, eps, UNIT: tl.constexpr, BLOCK_N: tl.constexpr,
                     ROWS: tl.constexpr, PERSISTENT: tl.constexpr, NUM_STAGES: tl.constexpr):
    """The whole row in registers; the scale (1 + w with UNIT, else w) is formed in fp32 once per program."""
    c = tl.arange(0, BLOCK_N)
    w1 = tl.load(W + c, mask=c < cols, other=0.0).to(tl.float32)
    if UNIT:
        w1 = 1.0 + w1
    pid = tl.program_id(0)
    if PERSISTENT:
        for tile in tl.range(pid, tl.cdiv(rows, ROWS), tl.num_programs(0), num_stages=NUM_STAGES):
            _unit_single_tile(X, Y, w1, tile, rows, cols, stride_x, stride_y, eps, BLOCK_N, ROWS)
    else:
        _unit_single_tile(X, Y, w1, pid, rows, cols, stride_x, stride_y, eps, BLOCK_N, ROWS)


@triton.jit
def _unit_looped_tile(X, W, Y, tile, rows, cols, stride_x, stride_y, eps, UNIT: tl.constexpr, BLOCK_N: tl.constexpr,
                      ROWS: tl.constexpr, NUM_STAGES: tl.constexpr):
    r, rl = row_offsets(tile, rows, ROWS)
    xrow = X + rl[:, None] * stride_x
    m2 = tl.zeros([ROWS], dtype=tl.float32)
    for start in tl.range(0, cols, BLOCK_N, num_stages=NUM_STAGES):
        c = start + tl.arange(0, BLOCK_N)
        x = tl.load(xrow + c[None, :], mask=c[None, :] < cols, other=0.0).to(tl.float32)
        m2 += tl.sum(x * x, axis=1)
    rstd = tl.rsqrt(m2 / cols + eps)
    yrow = Y + r[:, None].to(tl.int64) * stride_y
    rmask = r[:, None] < rows
    for start in tl.range(0, cols, BLOCK_N, num_stages=NUM_STAGES):
        c = start + tl.arange(0, BLOCK_N)
        cmask = c[None, :] < cols
        x = tl.load(xrow + c[None, :], mask=cmask, other=0.0).to(tl.float32)
        w1 = tl.load(W + c, mask=c < cols, other=0.0).to(tl.float32)
        if UNIT:
            w1 = 1.0 + w1
        tl.store(yrow + c[None, :], (x * rstd[:, None] * w1[None, :]).to(Y.dtype.element_ty), mask=rmask & cmask)


@triton.jit
def unit_norm_looped(X, W, Y, rows, cols, stride_x, stride_y, eps, UNIT: tl.constexpr, BLOCK_N: tl.constexpr,
                     ROWS: tl.constexpr, PERSISTENT: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Rows longer than BLOCK_N: statistics over column blocks, then a second pass to scale."""
    pid = tl.program_id(0)
    if PERSISTENT:
        for tile in range(pid, tl.cdiv(rows, ROWS), tl.num_programs(0)):
            _unit_looped_tile(X, W, Y, tile, rows, cols, stride_x, stride_y, eps, UNIT, BLOCK_N, ROWS, NUM_STAGES)
    else:
        _unit_looped_tile(X, W, Y, pid, rows, cols, stride_x, stride_y, eps, UNIT, BLOCK_N, ROWS, NUM_STAGES)


def launch_unit(x: torch.Tensor, weight: torch.Tensor, eps: float, unit: bool, *, BLOCK_N: int, ROWS_PER_PROGRAM: int,
                PROGRAMS_PER_SM: int, num_warps: int, num_stages: int) -> torch.Tensor:
    x2, y2, y = rows_view(x, None)
    rows, cols = x2.shape
    BLOCK_N = block_n(BLOCK_N, cols)
    kernel = unit_norm_single if BLOCK_N >= cols else unit_norm_looped
    kernel[grid(rows, ROWS_PER_PROGRAM, PROGRAMS_PER_SM, x.device)](
        x2, weight.contiguous(), y2, rows, cols, x2.stride(0), y2.stride(0), eps, UNIT=bool(unit), BLOCK_N=BLOCK_N,
        ROWS=ROWS_PER_PROGRAM, PERSISTENT=PROGRAMS_PER_SM > 0, NUM_STAGES=num_stages, num_warps=num_warps,
        num_stages=num_stages,
    )
    return y
