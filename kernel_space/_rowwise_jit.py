"""Triton helpers the row-wise kernels share (needs triton; imported by the ops' `_kernels`)."""
# No `from __future__ import annotations`: Triton reads the tl.constexpr annotations.
import triton
import triton.language as tl


@triton.jit
def row_offsets(tile, rows, ROWS: tl.constexpr):
    r = tile * ROWS + tl.arange(0, ROWS)
    # Rows past the end load the last row (no row mask on loads, no NaN) and are never stored.
    return r, tl.minimum(r, rows - 1).to(tl.int64)
