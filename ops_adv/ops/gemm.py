"""gemm: torch.matmul of two matrices through the tuned kernel; `ops_adv::gemm`."""
from __future__ import annotations

import torch

from kernel_space._common import DTYPE_CODE

from .._dispatch import cache_for, lookup, register_function
from .._op import _compiled_vendor, _autocast, _functorch, _fresh, _grad_enabled, _is_compiling, _op_needed, _tracing_state, define

# The dispatcher's per-op cache, read directly on the hot path (a function call costs ~150 ns).
_gemm_cache = cache_for("gemm")


def gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.matmul(a, b); 2-D fp16/bf16/fp32 products run the tuned kernel."""
    dt, sa, sb = a.dtype, a.shape, b.shape
    if len(sa) != 2 or len(sb) != 2 or b.dtype is not dt or dt not in DTYPE_CODE or _autocast() or _functorch():
        return torch.matmul(a, b)
    if _is_compiling() or _tracing_state() is not None:
        if _compiled_vendor("gemm", a.device):
            return torch.matmul(a, b)
        return torch.ops.ops_adv.gemm(a, b)
    if _grad_enabled() and (a.requires_grad or b.requires_grad):
        if a.shape[1] != b.shape[0] or not a.numel() or not b.numel() or a.device != b.device \
                or not _op_needed("gemm", a, b):
            return torch.matmul(a, b)
        return torch.ops.ops_adv.gemm(a, b)
    # _gemm, inlined: this is the hot path
    M, K = sa
    K2, N = sb
    dev = a.device
    if K != K2 or not (M and N and K) or b.device != dev:
        return torch.matmul(a, b)  # torch's error, or its empty/zero result
    key = ((M, N, K, DTYPE_CODE[dt], _trans(a), _trans(b)), dev)
    fn = _gemm_cache.get(key)
    if fn is None:
        fn = lookup("gemm", *key)
    return fn(a, b)


def _trans(t: torch.Tensor) -> bool:
    """Whether a 2-D operand is stored transposed (column-major), as the kernels read it: a row-major
    column slice (row stride > columns) is not, whatever is_contiguous says."""
    if t.is_contiguous():
        return False
    st = t.stride()
    return st[0] == 1 and st[1] != 1


def problem(a: torch.Tensor, b: torch.Tensor) -> tuple:
    """The gemm problem of a @ b as dispatch keys it (M, N, K, dtype, trans_a, trans_b)."""
    M, K = a.shape
    return (M, b.shape[1], K, DTYPE_CODE[a.dtype], _trans(a), _trans(b))


def _gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    M, K = a.shape
    K2, N = b.shape
    if K != K2 or not (M and N and K) or a.device != b.device:
        return torch.matmul(a, b)  # torch's error, or its empty/zero result
    key = ((M, N, K, DTYPE_CODE[a.dtype], _trans(a), _trans(b)), a.device)
    fn = _gemm_cache.get(key)
    if fn is None:
        fn = lookup("gemm", *key)
    return fn(a, b)


# --------------------------------------------------------------------------- custom operator


def _gemm_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _fresh(_gemm(a, b), (a, b))


def _fake(a, b):
    return torch.matmul(a, b).contiguous()


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, g):
    a, b = ctx.saved_tensors
    ga = torch.matmul(g, b.t()) if ctx.needs_input_grad[0] else None
    gb = torch.matmul(a.t(), g) if ctx.needs_input_grad[1] else None
    return ga, gb


define("gemm", _gemm_op, _fake, setup=_setup, backward=_backward)
register_function("gemm", gemm, signature=problem)
