"""softmax's Triton kernels and their launch (needs triton; `triton.py` imports this on the first call)."""
# No `from __future__ import annotations`: Triton reads the tl.constexpr annotations.
import torch
import triton
import triton.language as tl

from .._rowwise import block_n, grid, rows_view
from .._rowwise_jit import row_offsets


@triton.jit
def _single_tile(X, Y, tile, rows, cols, stride_x, stride_y, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    r, rl = row_offsets(tile, rows, ROWS)
    c = tl.arange(0, BLOCK_N)
    cmask = c[None, :] < cols
    x = tl.load(X + rl[:, None] * stride_x + c[None, :], mask=cmask, other=-float("inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=1)[:, None])
    y = e * (1.0 / tl.sum(e, axis=1))[:, None]
    yp = Y + r[:, None].to(tl.int64) * stride_y + c[None, :]
    tl.store(yp, y.to(Y.dtype.element_ty), mask=(r[:, None] < rows) & cmask)


@triton.jit
def softmax_single(X, Y, rows, cols, stride_x, stride_y, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
                   PERSISTENT: tl.constexpr, NUM_STAGES: tl.constexpr):
    """The whole row in registers: one read of x, one write of y."""
    pid = tl.program_id(0)
    if PERSISTENT:
        for tile in tl.range(pid, tl.cdiv(rows, ROWS), tl.num_programs(0), num_stages=NUM_STAGES):
            _single_tile(X, Y, tile, rows, cols, stride_x, stride_y, BLOCK_N, ROWS)
    else:
        _single_tile(X, Y, pid, rows, cols, stride_x, stride_y, BLOCK_N, ROWS)


@triton.jit
def _looped_tile(X, Y, tile, rows, cols, stride_x, stride_y, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
                 NUM_STAGES: tl.constexpr):
    r, rl = row_offsets(tile, rows, ROWS)
    xrow = X + rl[:, None] * stride_x
    m = tl.full([ROWS], -float("inf"), dtype=tl.float32)
    s = tl.zeros([ROWS], dtype=tl.float32)
    # Online softmax: running max and sum rescaled as the max grows (one read for both).
    for start in tl.range(0, cols, BLOCK_N, num_stages=NUM_STAGES):
        c = start + tl.arange(0, BLOCK_N)
        x = tl.load(xrow + c[None, :], mask=c[None, :] < cols, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=1))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new[:, None]), axis=1)
        m = m_new
    inv = 1.0 / s
    yrow = Y + r[:, None].to(tl.int64) * stride_y
    rmask = r[:, None] < rows
    for start in tl.range(0, cols, BLOCK_N, num_stages=NUM_STAGES):
        c = start + tl.arange(0, BLOCK_N)
        cmask = c[None, :] < cols
        x = tl.load(xrow + c[None, :], mask=cmask, other=-float("inf")).to(tl.float32)
        y = tl.exp(x - m[:, None]) * inv[:, None]
        tl.store(yrow + c[None, :], y.to(Y.dtype.element_ty), mask=rmask & cmask)


@triton.jit
def softmax_looped(X, Y, rows, cols, stride_x, stride_y, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
                   PERSISTENT: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Rows longer than BLOCK_N: online max/sum over column blocks, then a second pass to write."""
    pid = tl.program_id(0)
    if PERSISTENT:
        # Triton pipelines innermost loops only: num_stages acts on the column loops.
        for tile in range(pid, tl.cdiv(rows, ROWS), tl.num_programs(0)):
            _looped_tile(X, Y, tile, rows, cols, stride_x, stride_y, BLOCK_N, ROWS, NUM_STAGES)
    else:
        _looped_tile(X, Y, pid, rows, cols, stride_x, stride_y, BLOCK_N, ROWS, NUM_STAGES)


def launch(x: torch.Tensor, *, out: torch.Tensor | None, BLOCK_N: int, ROWS_PER_PROGRAM: int,
           PROGRAMS_PER_SM: int, num_warps: int, num_stages: int) -> torch.Tensor:
    x2, y2, y = rows_view(x, out)
    rows, cols = x2.shape
    BLOCK_N = block_n(BLOCK_N, cols)
    kernel = softmax_single if BLOCK_N >= cols else softmax_looped
    kernel[grid(rows, ROWS_PER_PROGRAM, PROGRAMS_PER_SM, x.device)](
        x2, y2, rows, cols, x2.stride(0), y2.stride(0),
        BLOCK_N=BLOCK_N, ROWS=ROWS_PER_PROGRAM, PERSISTENT=PROGRAMS_PER_SM > 0, NUM_STAGES=num_stages,
        num_warps=num_warps, num_stages=num_stages,
    )
    return y
