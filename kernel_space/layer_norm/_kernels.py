"""layer_norm's Triton kernels and their launch (needs triton); rms_norm runs them with RMS=True.

Statistics are accumulated in fp32 whatever the input dtype.
"""
# No `from __future__ import annotations`: Triton reads the tl.constexpr annotations.
import torch
import triton
import triton.language as tl

from .._rowwise import block_n, grid, rows_view
from .._rowwise_jit import row_offsets


@triton.jit
def _single_tile(X, Y, w, b, tile, rows, cols, stride_x, stride_y, eps,
                 RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    r, rl = row_offsets(tile, rows, ROWS)
    c = tl.arange(0, BLOCK_N)
    cmask = c[None, :] < cols
    x = tl.load(X + rl[:, None] * stride_x + c[None, :], mask=cmask, other=0.0).to(tl.float32)
    if RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=1) / cols
        xc = tl.where(cmask, x - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / cols + eps)
    y = xc * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        y += b[None, :]
    yp = Y + r[:, None].to(tl.int64) * stride_y + c[None, :]
    tl.store(yp, y.to(Y.dtype.element_ty), mask=(r[:, None] < rows) & cmask)


@triton.jit
def norm_single(X, W, B, Y, rows, cols, stride_x, stride_y, eps,
                RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
                PERSISTENT: tl.constexpr, NUM_STAGES: tl.constexpr):
    """The whole row in registers: one read of x, one write of y."""
    c = tl.arange(0, BLOCK_N)
    w = tl.load(W + c, mask=c < cols, other=0.0).to(tl.float32)
    b = w
    if HAS_BIAS:
        b = tl.load(B + c, mask=c < cols, other=0.0).to(tl.float32)
    pid = tl.program_id(0)
    if PERSISTENT:
        # Weights stay in registers across tiles; the next tile's load is pipelined.
        for tile in tl.range(pid, tl.cdiv(rows, ROWS), tl.num_programs(0), num_stages=NUM_STAGES):
            _single_tile(X, Y, w, b, tile, rows, cols, stride_x, stride_y, eps, RMS, HAS_BIAS, BLOCK_N, ROWS)
    else:
        _single_tile(X, Y, w, b, pid, rows, cols, stride_x, stride_y, eps, RMS, HAS_BIAS, BLOCK_N, ROWS)


@triton.jit
def _looped_tile(X, W, B, Y, tile, rows, cols, stride_x, stride_y, eps,
                 RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
                 NUM_STAGES: tl.constexpr):
    r, rl = row_offsets(tile, rows, ROWS)
    xrow = X + rl[:, None] * stride_x
    mean = tl.zeros([ROWS], dtype=tl.float32)
    m2 = tl.zeros([ROWS], dtype=tl.float32)
    for start in tl.range(0, cols, BLOCK_N, num_stages=NUM_STAGES):
        c = start + tl.arange(0, BLOCK_N)
        cmask = c[None, :] < cols
        x = tl.load(xrow + c[None, :], mask=cmask, other=0.0).to(tl.float32)
        if RMS:
            m2 += tl.sum(x * x, axis=1)
        else:
            # Chan et al.: merge the block's mean and M2 into the running ones (stable in one read).
            nb = tl.minimum(cols - start, BLOCK_N).to(tl.float32)
            na = start * 1.0
            bmean = tl.sum(x, axis=1) / nb
            d = tl.where(cmask, x - bmean[:, None], 0.0)
            delta = bmean - mean
            mean += delta * (nb / (na + nb))
            m2 += tl.sum(d * d, axis=1) + delta * delta * (na * nb / (na + nb))
    rstd = tl.rsqrt(m2 / cols + eps)
    yrow = Y + r[:, None].to(tl.int64) * stride_y
    rmask = r[:, None] < rows
    for start in tl.range(0, cols, BLOCK_N, num_stages=NUM_STAGES):
        c = start + tl.arange(0, BLOCK_N)
        cmask = c[None, :] < cols
        x = tl.load(xrow + c[None, :], mask=cmask, other=0.0).to(tl.float32)
        w = tl.load(W + c, mask=c < cols, other=0.0).to(tl.float32)
        if RMS:
            y = x * rstd[:, None] * w[None, :]
        else:
            y = (x - mean[:, None]) * rstd[:, None] * w[None, :]
        if HAS_BIAS:
            y += tl.load(B + c, mask=c < cols, other=0.0).to(tl.float32)[None, :]
        tl.store(yrow + c[None, :], y.to(Y.dtype.element_ty), mask=rmask & cmask)


@triton.jit
def norm_looped(X, W, B, Y, rows, cols, stride_x, stride_y, eps,
                RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
                PERSISTENT: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Rows longer than BLOCK_N: statistics over column blocks, then a second pass to normalise."""
    pid = tl.program_id(0)
    if PERSISTENT:
        # Triton pipelines innermost loops only: num_stages acts on the column loops.
        for tile in range(pid, tl.cdiv(rows, ROWS), tl.num_programs(0)):
            _looped_tile(X, W, B, Y, tile, rows, cols, stride_x, stride_y, eps, RMS, HAS_BIAS, BLOCK_N, ROWS,
                         NUM_STAGES)
    else:
        _looped_tile(X, W, B, Y, pid, rows, cols, stride_x, stride_y, eps, RMS, HAS_BIAS, BLOCK_N, ROWS, NUM_STAGES)


def launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, *, rms: bool,
           out: torch.Tensor | None, BLOCK_N: int, ROWS_PER_PROGRAM: int, PROGRAMS_PER_SM: int,
           num_warps: int, num_stages: int) -> torch.Tensor:
    x2, y2, y = rows_view(x, out)
    rows, cols = x2.shape
    BLOCK_N = block_n(BLOCK_N, cols)
    weight = weight.contiguous()
    bias = bias.contiguous() if bias is not None else None
    kernel = norm_single if BLOCK_N >= cols else norm_looped
    kernel[grid(rows, ROWS_PER_PROGRAM, PROGRAMS_PER_SM, x.device)](
        x2, weight, bias if bias is not None else weight, y2, rows, cols, x2.stride(0), y2.stride(0), eps,
        RMS=rms, HAS_BIAS=bias is not None, BLOCK_N=BLOCK_N, ROWS=ROWS_PER_PROGRAM,
        PERSISTENT=PROGRAMS_PER_SM > 0, NUM_STAGES=num_stages, num_warps=num_warps, num_stages=num_stages,
    )
    return y
