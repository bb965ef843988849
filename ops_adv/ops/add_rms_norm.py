"""add_rms_norm: residual add + RMS norm in one op, with the torch composite's exact semantics; `ops_adv::add_rms_norm`.

add_rms_norm(x, residual, weight, eps=None) -> (rms_norm(x + residual) * weight, x + residual)
add_rms_norm(..., unit_offset=True): the norm scales by (1 + weight) as Gemma's does (fp32, cast once).

As the other ops (`ops_adv._op`): a call ops-adv covers (fp16/bf16/fp32, matching shapes, dtypes
and devices) runs the table's kernel eagerly, or the custom operator under tracing or autograd;
anything else runs the torch composite itself, so it works, fails, broadcasts and promotes
exactly as torch does.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernel_space._common import DTYPE_CODE

from .._dispatch import lookup, register_function
from .._op import _compiled_vendor, _autocast, _both, _fresh, _pair_ok, _rms_grads, _rows_ok, _traced, define, unit_offset_composite


def _rms(h: torch.Tensor, weight: torch.Tensor | None, eps: float | None) -> torch.Tensor:
    return F.rms_norm(h, h.shape[-1:], weight, eps)


def _add_rms_composite(x, residual, weight, eps, unit_offset=False):
    h = x + residual
    if unit_offset:
        return unit_offset_composite(h, weight, eps), h
    return _rms(h, weight, eps), h


def _default_eps(x: torch.Tensor) -> float:
    """F.rms_norm's eps=None: the epsilon of the type it computes in (fp32 for 16-bit inputs)."""
    return torch.finfo(torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype).eps


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                 eps: float | None = None, *, unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual; (F.rms_norm(h, (h.shape[-1],), weight, eps), h). `eps=None` is torch's default.
    `unit_offset=True`: the norm scales by (1 + weight), in fp32, cast once (Gemma's RMSNorm)."""
    if unit_offset and weight is None:
        raise ValueError("add_rms_norm(unit_offset=True) scales by (1 + weight): pass that weight")
    if weight is None or not _rows_ok(x, weight) or not _pair_ok(x, residual) or _autocast():
        return _add_rms_composite(x, residual, weight, eps, unit_offset)
    eps = (torch.finfo(torch.float32).eps if unit_offset else _default_eps(x)) if eps is None else float(eps)
    if _traced(x, residual, weight):
        if _compiled_vendor("add_rms_norm", x.device):
            return _add_rms_composite(x, residual, weight, eps, unit_offset)
        if unit_offset:
            return torch.ops.ops_adv.add_rms_norm(x, residual, weight, eps, True)
        return torch.ops.ops_adv.add_rms_norm(x, residual, weight, eps)
    return _add_rms_norm(x, residual, weight, eps, unit_offset)


def _add_rms_norm(x, residual, weight, eps: float, unit_offset: bool = False):
    cols = x.shape[-1]
    rows = x.numel() // cols if cols else 0
    if not (rows and cols) or x.dtype not in DTYPE_CODE:  # the operator called directly with float64
        return _add_rms_composite(x, residual, weight, eps, unit_offset)
    fn = lookup("add_rms_norm", (rows, cols, DTYPE_CODE[x.dtype], unit_offset), x.device)
    return fn(x, residual, weight, eps, unit_offset=True) if unit_offset else fn(x, residual, weight, eps)


# --------------------------------------------------------------------------- custom operator


def _plus(gh: torch.Tensor, g_res: torch.Tensor | None) -> torch.Tensor:
    return gh if g_res is None else gh + g_res.to(gh.dtype)


def _add_rms_norm_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float, unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    y, h = _add_rms_norm(x, residual, weight, eps, unit_offset)
    return _fresh(y, (x, residual, weight)), _fresh(h, (x, residual, weight))


def _fake(x, residual, weight, eps, unit_offset=False):
    return torch.empty_like(x, memory_format=torch.contiguous_format), \
        torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup(ctx, inputs, output):
    ctx.eps = inputs[3]
    ctx.unit_offset = len(inputs) > 4 and inputs[4]
    ctx.save_for_backward(output[1], inputs[2])


def _backward(ctx, g, g_res):
    h, weight = ctx.saved_tensors
    if g is None:
        g = torch.zeros_like(h)
    # d(1 + w)/dw = 1: (1 + weight)'s gradient is weight's
    gh, gw = _rms_grads(h, 1.0 + weight.float() if ctx.unit_offset else weight, ctx.eps, g)
    gh = _plus(gh, g_res)
    gh = gh.to(h.dtype)
    return (*_both(ctx, gh), gw.to(weight.dtype), None, None)


define("add_rms_norm", _add_rms_norm_op, _fake, setup=_setup, backward=_backward)
register_function("add_rms_norm", add_rms_norm)
