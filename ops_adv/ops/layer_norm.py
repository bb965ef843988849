"""layer_norm: F.layer_norm over the last dimension through the tuned kernel; `ops_adv::layer_norm`."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kernel_space._common import DTYPE_CODE

from .._dispatch import lookup, register_function
from .._op import _compiled_vendor, _fresh, _last_dim, _is_compiling, _op_needed, _rows_ok, _traced, _tracing_state, define


def layer_norm(x: torch.Tensor, normalized_shape: Any = None, weight: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """F.layer_norm(x, normalized_shape, weight, bias, eps); normalizing the last dimension runs the tuned
    kernel. The short form `layer_norm(x, weight, bias, eps)` (the last dimension) is accepted too."""
    if isinstance(normalized_shape, torch.Tensor):  # layer_norm(x, weight[, bias[, eps]])
        normalized_shape, weight, bias, eps = None, *_short_form(normalized_shape, weight, bias, eps)
    if normalized_shape is not None and not _last_dim(x, normalized_shape):
        return F.layer_norm(x, normalized_shape, weight, bias, eps)
    if weight is None or not _rows_ok(x, weight, bias):
        return F.layer_norm(x, x.shape[-1:] if normalized_shape is None else normalized_shape, weight, bias, eps)
    if _traced(x, weight, bias):
        if _compiled_vendor("layer_norm", x.device):
            return F.layer_norm(x, x.shape[-1:], weight, bias, eps)
        if not _is_compiling() and _tracing_state() is None and (not x.numel() or not _op_needed("layer_norm", x, weight)):
            return F.layer_norm(x, x.shape[-1:], weight, bias, eps)
        return torch.ops.ops_adv.layer_norm(x, weight, bias, float(eps))
    return _layer_norm(x, weight, bias, float(eps))


def _short_form(weight, b, c, eps):
    """(weight, bias, eps) of layer_norm(x, weight, b, c, eps) in the short form: b is the bias, c the eps;
    or, keywords aside, layer_norm(x, weight, None, eps) / layer_norm(x, weight, bias=b)."""
    if b is not None:
        return weight, b, (c if c is not None else eps)
    if c is not None and not isinstance(c, torch.Tensor):
        return weight, None, c
    return weight, c, eps


def _kernel_args(x, normalized_shape=None, weight=None, bias=None, eps=1e-5):
    """This call's arguments as the layer_norm kernels take them ((x, weight, bias), {eps}), or None: torch's function runs it."""
    if isinstance(normalized_shape, torch.Tensor):
        normalized_shape, weight, bias, eps = None, *_short_form(normalized_shape, weight, bias, eps)
    if (normalized_shape is not None and not _last_dim(x, normalized_shape)) or weight is None \
            or not _rows_ok(x, weight, bias):
        return None
    return (x, weight, bias), {"eps": float(eps)}


def _layer_norm(x, weight, bias, eps: float) -> torch.Tensor:
    cols = x.shape[-1]
    rows = x.numel() // cols if cols else 0
    if not (rows and cols):
        return F.layer_norm(x, x.shape[-1:], weight, bias, eps)
    fn = lookup("layer_norm", (rows, cols, DTYPE_CODE[x.dtype]), x.device)
    miss = getattr(fn, "vendor_miss", None)
    if miss is not None:  # no winner: torch's function itself, the miss counted
        miss()
        return F.layer_norm(x, x.shape[-1:], weight, bias, eps)
    return fn(x, weight, bias, eps)


# --------------------------------------------------------------------------- custom operator


def _layer_norm_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    return _fresh(_layer_norm(x, weight, bias, eps), (x, weight))


def _fake(x, weight, bias, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup(ctx, inputs, output):
    x, weight, bias, eps = inputs
    ctx.eps, ctx.has_bias = eps, bias is not None
    ctx.save_for_backward(x, weight, bias)


def _backward(ctx, g):
    x, weight, bias = ctx.saved_tensors
    shape = [x.shape[-1]]
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, shape, weight, bias, ctx.eps)
    mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]]
    gx, gw, gb = torch.ops.aten.native_layer_norm_backward(g.contiguous(), x, shape, mean, rstd, weight, bias, mask)
    return gx, gw, gb, None


define("layer_norm", _layer_norm_op, _fake, setup=_setup, backward=_backward)
register_function("layer_norm", layer_norm, _kernel_args)
