"""swiglu's Triton kernels (SiLU and GeLU-tanh gates) and their launches (needs triton)."""
# No `from __future__ import annotations`: Triton reads the tl.constexpr annotations.
import torch
import triton
import triton.language as tl

from .._rowwise_jit import row_offsets


@triton.jit
def swiglu_kernel(G, U, Y, rows, cols, stride_g, stride_u, stride_y,
                  BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    r, rl = row_offsets(tl.program_id(0), rows, ROWS)
    c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = c[None, :] < cols
    g = tl.load(G + rl[:, None] * stride_g + c[None, :], mask=cmask, other=0.0).to(tl.float32)
    u = tl.load(U + rl[:, None] * stride_u + c[None, :], mask=cmask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(Y + r[:, None].to(tl.int64) * stride_y + c[None, :], y.to(Y.dtype.element_ty),
             mask=(r[:, None] < rows) & cmask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def launch(gate: torch.Tensor, up: torch.Tensor | None, *, BLOCK_N: int, ROWS_PER_PROGRAM: int,
           num_warps: int) -> torch.Tensor:
    if up is None:  # merged: gate and up are the two halves of each row
        gu = _rows(gate)
        cols = gu.shape[1] // 2
        g2, u2 = gu[:, :cols], gu[:, cols:]
        shape = gate.shape[:-1] + (cols,)
    else:
        g2, u2 = _rows(gate), _rows(up)
        cols = g2.shape[1]
        shape = gate.shape
    rows = g2.shape[0]
    y = torch.empty(shape, dtype=gate.dtype, device=gate.device)
    y2 = y.view(rows, cols)
    if rows and cols:
        grid = (triton.cdiv(rows, ROWS_PER_PROGRAM), triton.cdiv(cols, BLOCK_N))
        swiglu_kernel[grid](g2, u2, y2, rows, cols, g2.stride(0), u2.stride(0), y2.stride(0),
                            BLOCK_N=BLOCK_N, ROWS=ROWS_PER_PROGRAM, num_warps=num_warps)
    return y


# GeGLU (Gemma's MLP): gelu_tanh(g) * u (GELU; SiLU without). Its own kernel and launch, so swiglu_kernel's version (and
# its winners) stay as they were. gelu_tanh(g) = 0.5 g (1 + tanh(z)) = g * sigmoid(2 z), z = sqrt(2/pi) (g + 0.044715 g^3).
@triton.jit
def geglu_kernel(G, U, Y, rows, cols, stride_g, stride_u, stride_y,
                 GELU: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    r, rl = row_offsets(tl.program_id(0), rows, ROWS)
    c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = c[None, :] < cols
    g = tl.load(G + rl[:, None] * stride_g + c[None, :], mask=cmask, other=0.0).to(tl.float32)
    u = tl.load(U + rl[:, None] * stride_u + c[None, :], mask=cmask, other=0.0).to(tl.float32)
    if GELU:
        y = g * tl.sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g)) * u  # sigmoid(2 z)
    else:
        y = g * tl.sigmoid(g) * u
    tl.store(Y + r[:, None].to(tl.int64) * stride_y + c[None, :], y.to(Y.dtype.element_ty),
             mask=(r[:, None] < rows) & cmask)


def launch_geglu(gate: torch.Tensor, up: torch.Tensor | None, gelu: bool, *, BLOCK_N: int, ROWS_PER_PROGRAM: int,
                 num_warps: int) -> torch.Tensor:
    if up is None:
        gu = _rows(gate)
        cols = gu.shape[1] // 2
        g2, u2 = gu[:, :cols], gu[:, cols:]
        shape = gate.shape[:-1] + (cols,)
    else:
        g2, u2 = _rows(gate), _rows(up)
        cols = g2.shape[1]
        shape = gate.shape
    rows = g2.shape[0]
    y = torch.empty(shape, dtype=gate.dtype, device=gate.device)
    y2 = y.view(rows, cols)
    if rows and cols:
        grid = (triton.cdiv(rows, ROWS_PER_PROGRAM), triton.cdiv(cols, BLOCK_N))
        geglu_kernel[grid](g2, u2, y2, rows, cols, g2.stride(0), u2.stride(0), y2.stride(0), GELU=bool(gelu),
                           BLOCK_N=BLOCK_N, ROWS=ROWS_PER_PROGRAM, num_warps=num_warps)
    return y
