"""add_layer_norm: residual add + layer norm in one op, with the torch composite's exact semantics;
`ops_adv::add_layer_norm`.

add_layer_norm(x, residual, weight, bias=None, eps=1e-5) -> (layer_norm(x + residual), x + residual)

As `add_rms_norm`: covered calls run the table's kernel eagerly, or the custom operator under
tracing or autograd; anything else runs the torch composite itself.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernel_space._common import DTYPE_CODE

from .._dispatch import lookup, register_function
from .._op import _compiled_vendor, _autocast, _both, _fresh, _pair_ok, _rows_ok, _traced, define


def _add_ln_composite(x, residual, weight, bias, eps):
    h = x + residual
    return F.layer_norm(h, h.shape[-1:], weight, bias, eps), h


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                   bias: torch.Tensor | None = None, eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual; (F.layer_norm(h, (h.shape[-1],), weight, bias, eps), h)."""
    if weight is None or not _rows_ok(x, weight, bias) or not _pair_ok(x, residual) or _autocast():
        return _add_ln_composite(x, residual, weight, bias, eps)
    if _traced(x, residual, weight, bias):
        if _compiled_vendor("add_layer_norm", x.device):
            return _add_ln_composite(x, residual, weight, bias, eps)
        return torch.ops.ops_adv.add_layer_norm(x, residual, weight, bias, float(eps))
    return _add_layer_norm(x, residual, weight, bias, float(eps))


def _add_layer_norm(x, residual, weight, bias, eps: float):
    cols = x.shape[-1]
    rows = x.numel() // cols if cols else 0
    if not (rows and cols) or x.dtype not in DTYPE_CODE:
        return _add_ln_composite(x, residual, weight, bias, eps)
    return lookup("add_layer_norm", (rows, cols, DTYPE_CODE[x.dtype]), x.device)(x, residual, weight, bias, eps)


# --------------------------------------------------------------------------- custom operator


def _add_layer_norm_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    y, h = _add_layer_norm(x, residual, weight, bias, eps)
    return _fresh(y, (x, residual, weight)), _fresh(h, (x, residual, weight))


def _fake(x, residual, weight, bias, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format), \
        torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup(ctx, inputs, output):
    x, residual, weight, bias, eps = inputs
    ctx.eps, ctx.has_bias = eps, bias is not None
    ctx.save_for_backward(output[1], weight, bias)


def _backward(ctx, g, g_res):
    h, weight, bias = ctx.saved_tensors
    if g is None:
        g = torch.zeros_like(h)
    shape = [h.shape[-1]]
    _, mean, rstd = torch.ops.aten.native_layer_norm(h, shape, weight, bias, ctx.eps)
    mask = [True, ctx.needs_input_grad[2], ctx.has_bias and ctx.needs_input_grad[3]]
    gh, gw, gb = torch.ops.aten.native_layer_norm_backward(g.contiguous(), h, shape, mean, rstd, weight, bias, mask)
    if g_res is not None:
        gh = gh + g_res
    return (*_both(ctx, gh), gw, gb, None)


define("add_layer_norm", _add_layer_norm_op, _fake, setup=_setup, backward=_backward)
register_function("add_layer_norm", add_layer_norm)
