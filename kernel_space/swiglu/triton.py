"""swiglu on CUDA through Triton: an element-wise space, its check, and the launch wrapper."""
from __future__ import annotations

from typing import Any

from .._common import ITEMSIZE, pow2_at_least
from .._registry import LazyModule, register_triton
from .problem import plain_only

_kernels = LazyModule(__package__ + "._kernels")

# One program computes a ROWS_PER_PROGRAM x BLOCK_N tile of the output (a 2-D grid: row tiles x
# column blocks). Wider tiles mean fewer, longer programs; at decode (a few rows) narrow column
# blocks give the GPU enough programs.
SPACE: dict[str, tuple] = {
    "BLOCK_N": (1024, 256, 512, 2048, 4096),
    "ROWS_PER_PROGRAM": (1, 2, 4, 8),
    "num_warps": (4, 1, 2, 8, 16),
}
_MIN_BYTES_PER_THREAD = 16  # one 128-bit load per operand
_MAX_ELEMS_PER_THREAD = 32  # gate, up and the fp32 product in registers


def check(p: Any, c) -> str | None:
    bn, rpp, warps = c["BLOCK_N"], c["ROWS_PER_PROGRAM"], c["num_warps"]
    if bn > pow2_at_least(p.cols):
        return f"BLOCK_N {bn} is wider than the {p.cols}-column row needs ({pow2_at_least(p.cols)})"
    if rpp > pow2_at_least(p.rows, 1):
        return f"ROWS_PER_PROGRAM {rpp} exceeds the {p.rows} rows"
    tile, threads = rpp * bn, 32 * warps
    if tile * ITEMSIZE[p.dtype] < _MIN_BYTES_PER_THREAD * threads:
        return f"a {rpp}x{bn} {p.dtype} tile gives each of {threads} threads under {_MIN_BYTES_PER_THREAD} bytes"
    if tile > _MAX_ELEMS_PER_THREAD * threads:
        return f"a {rpp}x{bn} tile needs over {_MAX_ELEMS_PER_THREAD} elements a thread with {warps} warps"
    return None


@register_triton("swiglu", "triton_swiglu", space=SPACE, check=plain_only(check))
def triton_swiglu(gate, up=None, *, BLOCK_N=1024, ROWS_PER_PROGRAM=1, num_warps=4):
    """Triton silu(gate) * up (silu in fp32, one rounding); `up` None reads a merged [..., 2I] gate_up."""
    return _kernels.launch(gate, up, BLOCK_N=BLOCK_N, ROWS_PER_PROGRAM=ROWS_PER_PROGRAM, num_warps=num_warps)


def geglu_check(p: Any, c) -> str | None:
    # A SiLU problem is triton_swiglu's to search: this kernel offers it its default configuration alone.
    if p.activation == "silu" and dict(c) != {k: v[0] for k, v in SPACE.items()}:
        return "SiLU problems run this kernel in its default configuration only (triton_swiglu searches them)"
    return check(p, c)


@register_triton("swiglu", "triton_geglu", space=SPACE, check=geglu_check)
def triton_geglu(gate, up=None, activation="silu", *, BLOCK_N=1024, ROWS_PER_PROGRAM=1, num_warps=4):
    """Triton act(gate) * up, act GeLU-tanh (activation="gelu_tanh") or SiLU, in fp32 with one rounding; `up` None
    reads a merged [..., 2I] gate_up."""
    return _kernels.launch_geglu(gate, up, activation == "gelu_tanh", BLOCK_N=BLOCK_N,
                                 ROWS_PER_PROGRAM=ROWS_PER_PROGRAM, num_warps=num_warps)
