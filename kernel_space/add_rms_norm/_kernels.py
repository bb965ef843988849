"""add_rms_norm's Triton kernels: add_layer_norm's kernels with RMS=True (no mean, no bias), and their launch; and
the (1 + weight) kernels."""
# No `from __future__ import annotations`: Triton reads the tl.constexpr annotations.
import torch
import triton
import triton.language as tl

from .._rowwise import block_n, grid, rows_view
from .._rowwise_jit import row_offsets
from ..add_layer_norm._kernels import add_norm_looped, add_norm_single, launch  # noqa: F401


# The (1 + weight) kernels (Gemma's RMSNorm; UNIT=False scales by weight), kept apart so the plain ones' versions and winners stay as they were.
@triton.jit
def _unit_single_tile(X, R, Y, H, w1, tile, rows, cols, stride_x, stride_r, stride_y, eps,
                      BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    r, rl = row_offsets(tile, rows, ROWS)
    c = tl.arange(0, BLOCK_N)
    cmask = c[None, :] < cols
    x = tl.load(X + rl[:, None] * stride_x + c[None, :], mask=cmask, other=0.0)
    res = tl.load(R + rl[:, None] * stride_r + c[None, :], mask=cmask, other=0.0)
    h = (x.to(tl.float32) + res.to(tl.float32)).to(H.dtype.element_ty)
    out = r[:, None].to(tl.int64) * stride_y + c[None, :]
    smask = (r[:, None] < rows) & cmask
    tl.store(H + out, h, mask=smask)
    hf = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(hf * hf, axis=1) / cols + eps)
    tl.store(Y + out, (hf * rstd[:, None] * w1[None, :]).to(Y.dtype.element_ty), mask=smask)


@triton.jit
def unit_add_norm_single(X, R, W, Y, H, rows, cols, stride_x, stride_r, stride_y, eps, UNIT: tl.constexpr,
                         BLOCK_N: tl.constexpr, ROWS: tl.constexpr, PERSISTENT: tl.constexpr, NUM_STAGES: tl.constexpr):
    """The whole row in registers; the scale (1 + w with UNIT, else w) formed in fp32 once per program."""
    c = tl.arange(0, BLOCK_N)
    w1 = tl.load(W + c, mask=c < cols, other=0.0).to(tl.float32)
    if UNIT:
        w1 = 1.0 + w1
    pid = tl.program_id(0)
    if PERSISTENT:
        for tile in tl.range(pid, tl.cdiv(rows, ROWS), tl.num_programs(0), num_stages=NUM_STAGES):
            _unit_single_tile(X, R, Y, H, w1, tile, rows, cols, stride_x, stride_r, stride_y, eps, BLOCK_N, ROWS)
    else:
        _unit_single_tile(X, R, Y, H, w1, pid, rows, cols, stride_x, stride_r, stride_y, eps, BLOCK_N, ROWS)


@triton.jit
def _unit_looped_tile(X, R, W, Y, H, tile, rows, cols, stride_x, stride_r, stride_y, eps, UNIT: tl.constexpr,
                      BLOCK_N: tl.constexpr, ROWS: tl.constexpr, NUM_STAGES: tl.constexpr):
    r, rl = row_offsets(tile, rows, ROWS)
    xrow = X + rl[:, None] * stride_x
    rrow = R + rl[:, None] * stride_r
    orow = r[:, None].to(tl.int64) * stride_y
    rmask = r[:, None] < rows
    m2 = tl.zeros([ROWS], dtype=tl.float32)
    for start in tl.range(0, cols, BLOCK_N, num_stages=NUM_STAGES):
        c = start + tl.arange(0, BLOCK_N)
        cmask = c[None, :] < cols
        x = tl.load(xrow + c[None, :], mask=cmask, other=0.0)
        res = tl.load(rrow + c[None, :], mask=cmask, other=0.0)
        h = (x.to(tl.float32) + res.to(tl.float32)).to(H.dtype.element_ty)
        tl.store(H + orow + c[None, :], h, mask=rmask & cmask)
        hf = h.to(tl.float32)
        m2 += tl.sum(hf * hf, axis=1)
    rstd = tl.rsqrt(m2 / cols + eps)
    tl.debug_barrier()  # this program's h stores visible to all its threads before the second pass reads h back
    hrow = H + orow
    for start in tl.range(0, cols, BLOCK_N, num_stages=NUM_STAGES):
        c = start + tl.arange(0, BLOCK_N)
        cmask = c[None, :] < cols
        hf = tl.load(hrow + c[None, :], mask=rmask & cmask, other=0.0).to(tl.float32)
        w1 = tl.load(W + c, mask=c < cols, other=0.0).to(tl.float32)
        if UNIT:
            w1 = 1.0 + w1
        tl.store(Y + orow + c[None, :], (hf * rstd[:, None] * w1[None, :]).to(Y.dtype.element_ty), mask=rmask & cmask)


@triton.jit
def unit_add_norm_looped(X, R, W, Y, H, rows, cols, stride_x, stride_r, stride_y, eps, UNIT: tl.constexpr,
                         BLOCK_N: tl.constexpr, ROWS: tl.constexpr, PERSISTENT: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Rows longer than BLOCK_N: add, write h and gather statistics over column blocks, then scale h."""
    pid = tl.program_id(0)
    if PERSISTENT:
        for tile in range(pid, tl.cdiv(rows, ROWS), tl.num_programs(0)):
            _unit_looped_tile(X, R, W, Y, H, tile, rows, cols, stride_x, stride_r, stride_y, eps, UNIT, BLOCK_N, ROWS,
                              NUM_STAGES)
    else:
        _unit_looped_tile(X, R, W, Y, H, pid, rows, cols, stride_x, stride_r, stride_y, eps, UNIT, BLOCK_N, ROWS,
                          NUM_STAGES)


def launch_unit(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, unit: bool, *, BLOCK_N: int,
                ROWS_PER_PROGRAM: int, PROGRAMS_PER_SM: int, num_warps: int,
                num_stages: int) -> tuple[torch.Tensor, torch.Tensor]:
    x2, y2, y = rows_view(x, None)
    r2, h2, h = rows_view(residual, None)
    rows, cols = x2.shape
    BLOCK_N = block_n(BLOCK_N, cols)
    kernel = unit_add_norm_single if BLOCK_N >= cols else unit_add_norm_looped
    kernel[grid(rows, ROWS_PER_PROGRAM, PROGRAMS_PER_SM, x.device)](
        x2, r2, weight.contiguous(), y2, h2, rows, cols, x2.stride(0), r2.stride(0), y2.stride(0), eps, UNIT=bool(unit),
        BLOCK_N=BLOCK_N, ROWS=ROWS_PER_PROGRAM, PERSISTENT=PROGRAMS_PER_SM > 0, NUM_STAGES=num_stages,
        num_warps=num_warps, num_stages=num_stages,
    )
    return y, h
