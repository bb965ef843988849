"""add_layer_norm's Triton kernels and their launch (needs triton); add_rms_norm runs them with RMS=True.

h = x + residual is rounded to the input dtype (as torch adds), written out as the new residual,
and normalised from that rounded value, so both outputs match the torch composite.
"""
# No `from __future__ import annotations`: Triton reads the tl.constexpr annotations.
import torch
import triton
import triton.language as tl

from .._rowwise import block_n, grid, rows_view
from .._rowwise_jit import row_offsets


@triton.jit
def _single_tile(X, R, Y, H, w, b, tile, rows, cols, stride_x, stride_r, stride_y, eps,
                 RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
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
    if RMS:
        hc = hf
    else:
        mean = tl.sum(hf, axis=1) / cols
        hc = tl.where(cmask, hf - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(hc * hc, axis=1) / cols + eps)
    y = hc * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        y += b[None, :]
    tl.store(Y + out, y.to(Y.dtype.element_ty), mask=smask)


@triton.jit
def add_norm_single(X, R, W, B, Y, H, rows, cols, stride_x, stride_r, stride_y, eps,
                    RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
                    PERSISTENT: tl.constexpr, NUM_STAGES: tl.constexpr):
    """The whole row in registers: x and residual read once, y and h written once."""
    c = tl.arange(0, BLOCK_N)
    w = tl.load(W + c, mask=c < cols, other=0.0).to(tl.float32)
    b = w
    if HAS_BIAS:
        b = tl.load(B + c, mask=c < cols, other=0.0).to(tl.float32)
    pid = tl.program_id(0)
    if PERSISTENT:
        for tile in tl.range(pid, tl.cdiv(rows, ROWS), tl.num_programs(0), num_stages=NUM_STAGES):
            _single_tile(X, R, Y, H, w, b, tile, rows, cols, stride_x, stride_r, stride_y, eps, RMS, HAS_BIAS,
                         BLOCK_N, ROWS)
    else:
        _single_tile(X, R, Y, H, w, b, pid, rows, cols, stride_x, stride_r, stride_y, eps, RMS, HAS_BIAS,
                     BLOCK_N, ROWS)


@triton.jit
def _looped_tile(X, R, W, B, Y, H, tile, rows, cols, stride_x, stride_r, stride_y, eps,
                 RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
                 NUM_STAGES: tl.constexpr):
    r, rl = row_offsets(tile, rows, ROWS)
    xrow = X + rl[:, None] * stride_x
    rrow = R + rl[:, None] * stride_r
    orow = r[:, None].to(tl.int64) * stride_y
    rmask = r[:, None] < rows
    mean = tl.zeros([ROWS], dtype=tl.float32)
    m2 = tl.zeros([ROWS], dtype=tl.float32)
    for start in tl.range(0, cols, BLOCK_N, num_stages=NUM_STAGES):
        c = start + tl.arange(0, BLOCK_N)
        cmask = c[None, :] < cols
        x = tl.load(xrow + c[None, :], mask=cmask, other=0.0)
        res = tl.load(rrow + c[None, :], mask=cmask, other=0.0)
        h = (x.to(tl.float32) + res.to(tl.float32)).to(H.dtype.element_ty)
        tl.store(H + orow + c[None, :], h, mask=rmask & cmask)
        hf = h.to(tl.float32)
        if RMS:
            m2 += tl.sum(hf * hf, axis=1)
        else:
            # Chan et al.: merge the block's mean and M2 into the running ones (stable in one read).
            nb = tl.minimum(cols - start, BLOCK_N).to(tl.float32)
            na = start * 1.0
            bmean = tl.sum(hf, axis=1) / nb
            d = tl.where(cmask, hf - bmean[:, None], 0.0)
            delta = bmean - mean
            mean += delta * (nb / (na + nb))
            m2 += tl.sum(d * d, axis=1) + delta * delta * (na * nb / (na + nb))
    rstd = tl.rsqrt(m2 / cols + eps)
    # The second pass reads h back (one tensor, mostly from L2) instead of x and residual; the
    # barrier makes this program's h stores visible to all of its threads.
    tl.debug_barrier()
    hrow = H + r[:, None].to(tl.int64) * stride_y
    for start in tl.range(0, cols, BLOCK_N, num_stages=NUM_STAGES):
        c = start + tl.arange(0, BLOCK_N)
        cmask = c[None, :] < cols
        hf = tl.load(hrow + c[None, :], mask=rmask & cmask, other=0.0).to(tl.float32)
        w = tl.load(W + c, mask=c < cols, other=0.0).to(tl.float32)
        if RMS:
            y = hf * rstd[:, None] * w[None, :]
        else:
            y = (hf - mean[:, None]) * rstd[:, None] * w[None, :]
        if HAS_BIAS:
            y += tl.load(B + c, mask=c < cols, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + orow + c[None, :], y.to(Y.dtype.element_ty), mask=rmask & cmask)


@triton.jit
def add_norm_looped(X, R, W, B, Y, H, rows, cols, stride_x, stride_r, stride_y, eps,
                    RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
                    PERSISTENT: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Rows longer than BLOCK_N: add, write h and gather statistics over column blocks, then normalise h."""
    pid = tl.program_id(0)
    if PERSISTENT:
        for tile in range(pid, tl.cdiv(rows, ROWS), tl.num_programs(0)):
            _looped_tile(X, R, W, B, Y, H, tile, rows, cols, stride_x, stride_r, stride_y, eps, RMS, HAS_BIAS,
                         BLOCK_N, ROWS, NUM_STAGES)
    else:
        _looped_tile(X, R, W, B, Y, H, pid, rows, cols, stride_x, stride_r, stride_y, eps, RMS, HAS_BIAS,
                     BLOCK_N, ROWS, NUM_STAGES)


def launch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, *,
           rms: bool, BLOCK_N: int, ROWS_PER_PROGRAM: int, PROGRAMS_PER_SM: int, num_warps: int,
           num_stages: int) -> tuple[torch.Tensor, torch.Tensor]:
    x2, y2, y = rows_view(x, None)
    r2, h2, h = rows_view(residual, None)
    rows, cols = x2.shape
    BLOCK_N = block_n(BLOCK_N, cols)
    weight = weight.contiguous()
    bias = bias.contiguous() if bias is not None else None
    kernel = add_norm_single if BLOCK_N >= cols else add_norm_looped
    kernel[grid(rows, ROWS_PER_PROGRAM, PROGRAMS_PER_SM, x.device)](
        x2, r2, weight, bias if bias is not None else weight, y2, h2, rows, cols, x2.stride(0), r2.stride(0),
        y2.stride(0), eps, RMS=rms, HAS_BIAS=bias is not None, BLOCK_N=BLOCK_N, ROWS=ROWS_PER_PROGRAM,
        PERSISTENT=PROGRAMS_PER_SM > 0, NUM_STAGES=num_stages, num_warps=num_warps, num_stages=num_stages,
    )
    return y, h
