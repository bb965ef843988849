"""rms_norm: F.rms_norm over the last dimension through the tuned kernel; `ops_adv::rms_norm`."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kernel_space._common import DTYPE_CODE

from .._dispatch import cache_for, lookup, register_function
from .._op import _compiled_vendor, _fresh, _last_dim, _is_compiling, _op_needed, _rms_grads, _rows_ok, _traced, _tracing_state, define

_rms_cache = cache_for("rms_norm")


def rms_norm(x: torch.Tensor, normalized_shape: Any = None, weight: torch.Tensor | None = None,
             eps: float | None = None) -> torch.Tensor:
    """F.rms_norm(x, normalized_shape, weight, eps); normalizing the last dimension runs the tuned kernel.

    `eps=None` is torch's default, not a constant of ours. The short form `rms_norm(x, weight, eps)`
    (the last dimension) is accepted too.
    """
    if isinstance(normalized_shape, torch.Tensor):  # rms_norm(x, weight[, eps])
        normalized_shape, weight, eps = None, normalized_shape, (weight if weight is not None else eps)
    if normalized_shape is not None and not _last_dim(x, normalized_shape):
        return F.rms_norm(x, normalized_shape, weight, eps)
    if weight is None or not _rows_ok(x, weight):
        return F.rms_norm(x, x.shape[-1:] if normalized_shape is None else normalized_shape, weight, eps)
    if eps is None:  # as F.rms_norm: the epsilon of the type it computes in (fp32 for 16-bit inputs)
        eps = torch.finfo(torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype).eps
    if _traced(x, weight):
        if _compiled_vendor("rms_norm", x.device):
            return F.rms_norm(x, x.shape[-1:], weight, eps)
        if not _is_compiling() and _tracing_state() is None and (not x.numel() or not _op_needed("rms_norm", x, weight)):
            return F.rms_norm(x, x.shape[-1:], weight, eps)
        return torch.ops.ops_adv.rms_norm(x, weight, float(eps))
    cols = x.shape[-1]  # _rms_norm, inlined: this is the hot path
    rows = x.numel() // cols if cols else 0
    if not rows:
        return F.rms_norm(x, x.shape[-1:], weight, eps)
    key = ((rows, cols, DTYPE_CODE[x.dtype]), x.device)
    fn = _rms_cache.get(key)
    if fn is None:
        fn = lookup("rms_norm", *key)
    return fn(x, weight, float(eps))


def _kernel_args(x, normalized_shape=None, weight=None, eps=None):
    """This call's arguments as the rms_norm kernels take them ((x, weight), {eps}), or None: torch's function runs it."""
    if isinstance(normalized_shape, torch.Tensor):
        normalized_shape, weight, eps = None, normalized_shape, (weight if weight is not None else eps)
    if (normalized_shape is not None and not _last_dim(x, normalized_shape)) or weight is None or not _rows_ok(x, weight):
        return None
    if eps is None:
        eps = torch.finfo(torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype).eps
    return (x, weight), {"eps": float(eps)}


def _rms_norm(x, weight, eps: float) -> torch.Tensor:
    cols = x.shape[-1]
    rows = x.numel() // cols if cols else 0
    if not (rows and cols):
        return F.rms_norm(x, x.shape[-1:], weight, eps)
    return lookup("rms_norm", (rows, cols, DTYPE_CODE[x.dtype]), x.device)(x, weight, eps)


# --------------------------------------------------------------------------- custom operator


def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _fresh(_rms_norm(x, weight, eps), (x, weight))


def _fake(x, weight, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.eps = eps
    ctx.save_for_backward(x, weight)


def _backward(ctx, g):
    x, weight = ctx.saved_tensors
    gx, gw = _rms_grads(x, weight, ctx.eps, g)
    return gx.to(x.dtype), gw.to(weight.dtype), None


define("rms_norm", _rms_norm_op, _fake, setup=_setup, backward=_backward)
register_function("rms_norm", rms_norm, _kernel_args)
