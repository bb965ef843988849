"""What the row-wise ops (the norms, softmax, swiglu) share: op specs, problems, inputs, Triton space, checks,
launch geometry.

Needs no triton: the kernels themselves live in each op's `_kernels`.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from ._common import DTYPES, ITEMSIZE, pow2_at_least
from ._registry import OpSpec, define_op

# One program normalises a ROWS_PER_PROGRAM x BLOCK_N tile. BLOCK_N 0 holds the whole row in
# registers (the next power of two: one read of x); a BLOCK_N shorter than the row loops over
# column blocks (two reads, the second mostly from L2). PROGRAMS_PER_SM > 0 launches a persistent
# grid that loops over row tiles (weights loaded once, the next tile's loads pipelined by
# num_stages); 0 launches one program per row tile.
SPACE: dict[str, tuple] = {
    "BLOCK_N": (0, 512, 1024, 2048, 4096, 8192, 16384),
    "ROWS_PER_PROGRAM": (1, 2, 4, 8, 16),
    "PROGRAMS_PER_SM": (0, 1, 2, 4, 8),
    "num_warps": (8, 1, 2, 4, 16, 32),
    "num_stages": (1, 2, 3, 4),
}

_MIN_BYTES_PER_THREAD = 16  # one 128-bit load each; fewer means idle or replicated threads
_MAX_FP32_PER_THREAD = 64  # the tile lives in fp32 registers; beyond this ptxas spills
# Pipelined loads stage through shared memory: num_stages - 1 tiles (Triton 3.9 for sm_90,
# compiled offline); H100/H200 give a block 227 KiB, and the reductions take a little.
_SMEM_BYTES = 200 << 10
_WARPS_PER_SM = 64


def check(p: Any, c) -> str | None:
    """Why a Triton row-wise config cannot or should not run problem `p`, or None."""
    bn, rpp, warps, stages, pps = (
        c["BLOCK_N"], c["ROWS_PER_PROGRAM"], c["num_warps"], c["num_stages"], c["PROGRAMS_PER_SM"],
    )
    if bn >= p.cols:
        return f"BLOCK_N {bn} covers the {p.cols}-column row: BLOCK_N 0 is that single pass"
    bn = block_n(bn, p.cols)
    if rpp > pow2_at_least(p.rows, 1):
        return f"ROWS_PER_PROGRAM {rpp} exceeds the {p.rows} rows"
    tile, threads = rpp * bn, 32 * warps
    if tile * ITEMSIZE[p.dtype] < _MIN_BYTES_PER_THREAD * threads:
        return f"a {rpp}x{bn} {p.dtype} tile gives each of {threads} threads under {_MIN_BYTES_PER_THREAD} bytes"
    if tile > _MAX_FP32_PER_THREAD * threads:
        return f"a {rpp}x{bn} tile needs over {_MAX_FP32_PER_THREAD} fp32 registers a thread with {warps} warps"
    if pps * warps > _WARPS_PER_SM:
        return f"{pps} programs of {warps} warps do not fit on one SM ({_WARPS_PER_SM} warps): not persistent"
    if stages > 1:
        if bn >= p.cols and not pps:
            return "num_stages pipelines a loop; a single-pass, non-persistent program has none"
        # each stage also holds a block of the weight and bias vectors (seen: 240 KiB asked for
        # 4 stages of an 8x4096 bf16 layer_norm tile under Triton 3.6)
        if (stages - 1) * (tile + 2 * bn) * ITEMSIZE[p.dtype] > _SMEM_BYTES:
            return f"{stages} stages of a {rpp}x{bn} tile need over {_SMEM_BYTES >> 10} KiB shared memory"
    return None


def block_n(bn: int, cols: int) -> int:
    """The column block a BLOCK_N choice means for rows of `cols`."""
    return bn or pow2_at_least(cols)


def register(name: str, problem: type, *, signature: Callable[..., tuple], make_inputs: Callable[..., tuple],
             reference: Callable[..., Any], flops: Callable[[Any], float], bytes_moved: Callable[[Any], float],
             problems: Callable[[str], list] | None = None) -> OpSpec:
    """Register a row-wise op: problems of `rows` (streaming) x `cols`, the dtype's tolerance, and
    the row-wise default problems unless the op gives its own `problems(device_class)`."""
    return define_op(name, problem, signature, make_inputs, reference, size_fields=("rows", "cols"), streaming=("rows",),
                     flops=flops, bytes_moved=bytes_moved,
                     default_problems=problems or functools.partial(default_problems, problem))


def default_problems(problem: type, device_class: str) -> list:
    if device_class == "cpu":
        return [problem(256, 1024), problem(1024, 768), problem(64, 4096)]
    # At least 8M elements each, so the GPU runs at steady-state bandwidth.
    return [
        problem(4096, 4096, "bf16"),
        problem(2048, 8192, "bf16"),
        problem(1024, 16384, "bf16"),
        problem(8192, 8192, "bf16"),
        problem(4096, 4096, "fp16"),
        problem(1024, 16384, "fp16"),
        problem(4096, 4096, "fp32"),
    ]


def weight(cols: int, dtype: str, device, g: torch.Generator, mean: float) -> torch.Tensor:
    """A norm's weight or bias vector: `mean` plus small noise."""
    return (mean + 0.1 * torch.randn(cols, generator=g)).to(device=device, dtype=DTYPES[dtype])


def hi(t: torch.Tensor) -> torch.Tensor:
    """The precision references compute in: float64 on the CPU, float32 on GPUs."""
    return t.to(torch.float64 if t.device.type == "cpu" else torch.float32)


def norm_bytes(p: Any, params_per_col: int, row_tensors: int = 2) -> float:
    """Bytes a norm moves: `row_tensors` rows x cols tensors (x read, y written, and for the fused
    residual add, residual read and h written) and its per-column parameter vectors."""
    return float((row_tensors * p.rows + params_per_col) * p.cols * ITEMSIZE[p.dtype])


def rows_view(x: torch.Tensor, out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x as rows x cols with unit column stride, out as rows x cols, out as returned)."""
    cols = x.shape[-1]
    x2 = x.reshape(-1, cols)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    return x2, y.view(-1, cols), y


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def grid(rows: int, rows_per_program: int, programs_per_sm: int, device: torch.device) -> tuple[int]:
    tiles = -(-rows // rows_per_program)
    if not programs_per_sm:
        return (tiles,)
    if device.type == "cuda":
        sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    else:
        sms = 2  # the interpreter: still loop over several tiles per program
    return (min(tiles, programs_per_sm * sms),)


# --------------------------------------------------------------------------- variant fields (rms_norm's unit_offset, swiglu's activation)


class DefaultsLeftOut:
    """A problem NamedTuple's base (first, before the NamedTuple) whose dict form (keys, table rows, explain, study
    names) leaves the `_left_out` fields out at their defaults: every problem known before such a field keeps its form."""
    __slots__ = ()
    _left_out: tuple = ()

    def _asdict(self) -> dict:
        d = super()._asdict()
        for f in self._left_out:
            if d[f] == self._field_defaults[f]:
                del d[f]
        return d


def plain_only_for(is_variant: Callable[[Any], bool], why: str) -> Callable[..., Any]:
    """`plain_only(check=None, *, of=None)` for an op with a variant field: the check of an implementation written
    before the field. It refuses the variant problems (`why`), which that implementation does not compute, and decides
    every other problem as `check` does (None: runs it). `__wrapped__` names `check`, or for an implementation with no
    check the implementation `of` itself, which is what its version hashes: winners tuned before keep their version."""

    def plain_only(check: Any = None, *, of: Any = None) -> Any:
        def refuse(p: Any, params: Any) -> str | None:
            if is_variant(p):
                return why
            return None if check is None else check(p, params)

        refuse.__wrapped__ = check if check is not None else of
        return refuse

    return plain_only
