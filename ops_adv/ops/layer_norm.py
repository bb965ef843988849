"""layer_norm: F.layer_norm over the last dimension through the tuned kernel; `ops_adv::layer_norm`."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernel_space._common import DTYPE_CODE

from .._dispatch import lookup, register_function
from .._op import _fresh, _is_compiling, _op_needed, _rows_ok, _traced, _tracing_state, define


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None = None,
               eps: float = 1e-5) -> torch.Tensor:
    """F.layer_norm(x, (x.shape[-1],), weight, bias, eps)."""
    if weight is None or not _rows_ok(x, weight, bias):
        return F.layer_norm(x, x.shape[-1:], weight, bias, eps)
    if _traced(x, weight, bias):
        if not _is_compiling() and _tracing_state() is None and (not x.numel() or not _op_needed("layer_norm", x, weight)):
            return F.layer_norm(x, x.shape[-1:], weight, bias, eps)
        return torch.ops.ops_adv.layer_norm(x, weight, bias, float(eps))
    return _layer_norm(x, weight, bias, float(eps))


def _layer_norm(x, weight, bias, eps: float) -> torch.Tensor:
    cols = x.shape[-1]
    rows = x.numel() // cols if cols else 0
    if not (rows and cols):
        return F.layer_norm(x, x.shape[-1:], weight, bias, eps)
    return lookup("layer_norm", (rows, cols, DTYPE_CODE[x.dtype]), x.device)(x, weight, bias, eps)


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
register_function("layer_norm", layer_norm)
