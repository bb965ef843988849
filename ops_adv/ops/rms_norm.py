"""rms_norm: F.rms_norm over the last dimension through the tuned kernel; `ops_adv::rms_norm`.

`unit_offset=True` scales by (1 + weight) as Gemma's RMSNorm does: x in fp32, times fp32 (1 + weight), cast
to x's dtype once (`unit_offset_composite`)."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kernel_space._common import DTYPE_CODE

from .._dispatch import cache_for, lookup, register_function
from .._op import (_compiled_vendor, _fresh, _last_dim, _is_compiling, _op_needed, _rms_grads, _rows_ok, _traced,
                  _tracing_state, define, unit_offset_composite)

_rms_cache = cache_for("rms_norm")


def rms_norm(x: torch.Tensor, normalized_shape: Any = None, weight: torch.Tensor | None = None,
             eps: float | None = None, *, unit_offset: bool = False) -> torch.Tensor:
    """F.rms_norm(x, normalized_shape, weight, eps); normalizing the last dimension runs the tuned kernel.

    `eps=None` is torch's default, not a constant of ours. The short form `rms_norm(x, weight, eps)`
    (the last dimension) is accepted too. `unit_offset=True`: scale by (1 + weight) (Gemma), last dimension only.
    """
    if isinstance(normalized_shape, torch.Tensor):  # rms_norm(x, weight[, eps])
        normalized_shape, weight, eps = None, normalized_shape, (weight if weight is not None else eps)
    if unit_offset:
        return _rms_norm_unit(x, normalized_shape, weight, eps)
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
    key = ((rows, cols, DTYPE_CODE[x.dtype], False), x.device)
    fn = _rms_cache.get(key)
    if fn is None:
        fn = lookup("rms_norm", *key)
    return fn(x, weight, float(eps))


def _rms_norm_unit(x, normalized_shape, weight, eps) -> torch.Tensor:
    if weight is None or (normalized_shape is not None and not _last_dim(x, normalized_shape)):
        raise ValueError("rms_norm(unit_offset=True) scales the last dimension by (1 + weight): pass that weight")
    if not _rows_ok(x, weight):
        return unit_offset_composite(x, weight, eps)
    if eps is None:  # computed in fp32 whatever x's dtype
        eps = torch.finfo(torch.float32).eps
    if _traced(x, weight):
        if _compiled_vendor("rms_norm", x.device):
            return unit_offset_composite(x, weight, eps)
        if not _is_compiling() and _tracing_state() is None and (
                not x.numel() or not _op_needed("rms_norm", x, weight, eps, True)):
            return unit_offset_composite(x, weight, eps)
        return torch.ops.ops_adv.rms_norm(x, weight, float(eps), True)
    return _rms_norm(x, weight, float(eps), True)


def _kernel_args(x, normalized_shape=None, weight=None, eps=None, *, unit_offset=False):
    """This call's arguments as the rms_norm kernels take them ((x, weight), {eps}), or None: torch's function runs it."""
    if isinstance(normalized_shape, torch.Tensor):
        normalized_shape, weight, eps = None, normalized_shape, (weight if weight is not None else eps)
    if (normalized_shape is not None and not _last_dim(x, normalized_shape)) or weight is None or not _rows_ok(x, weight):
        return None
    if eps is None:
        eps = torch.finfo(torch.float32 if x.dtype in (torch.float16, torch.bfloat16) or unit_offset else x.dtype).eps
    return (x, weight), ({"eps": float(eps), "unit_offset": True} if unit_offset else {"eps": float(eps)})


def _rms_norm(x, weight, eps: float, unit_offset: bool = False) -> torch.Tensor:
    cols = x.shape[-1]
    rows = x.numel() // cols if cols else 0
    if not (rows and cols) or x.dtype not in DTYPE_CODE:  # the operator called directly with float64
        return unit_offset_composite(x, weight, eps) if unit_offset else F.rms_norm(x, x.shape[-1:], weight, eps)
    fn = lookup("rms_norm", (rows, cols, DTYPE_CODE[x.dtype], unit_offset), x.device)
    return fn(x, weight, eps, unit_offset=True) if unit_offset else fn(x, weight, eps)


# --------------------------------------------------------------------------- custom operator


def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    return _fresh(_rms_norm(x, weight, eps, unit_offset), (x, weight))


def _fake(x, weight, eps, unit_offset=False):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup(ctx, inputs, output):
    x, weight, eps = inputs[:3]
    ctx.eps = eps
    ctx.unit_offset = len(inputs) > 3 and inputs[3]
    ctx.save_for_backward(x, weight)


def _backward(ctx, g):
    x, weight = ctx.saved_tensors
    # d(1 + w)/dw = 1: (1 + weight)'s gradient is weight's
    gx, gw = _rms_grads(x, 1.0 + weight.float() if ctx.unit_offset else weight, ctx.eps, g)
    return gx.to(x.dtype), gw.to(weight.dtype), None, None


define("rms_norm", _rms_norm_op, _fake, setup=_setup, backward=_backward)
register_function("rms_norm", rms_norm, _kernel_args)
