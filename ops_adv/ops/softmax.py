"""softmax: torch.softmax over the last dimension through the tuned kernel; `ops_adv::softmax`."""
from __future__ import annotations

import torch

from kernel_space._common import DTYPE_CODE

from .._dispatch import lookup, register_function
from .._op import _compiled_vendor, _autocast, _functorch, _fresh, _is_compiling, _op_needed, _traced, _tracing_state, define


def softmax(x: torch.Tensor, dim: int = -1, dtype: torch.dtype | None = None) -> torch.Tensor:
    """torch.softmax(x, dim, dtype); the last dimension without a dtype change runs the tuned kernel."""
    if dtype is not None or x.dim() < 1 or dim not in (-1, x.dim() - 1) or x.dtype not in DTYPE_CODE or _autocast() or _functorch():
        return torch.softmax(x, dim, dtype=dtype)
    if _traced(x):
        if _compiled_vendor("softmax", x.device):
            return torch.softmax(x, -1)
        if not _is_compiling() and _tracing_state() is None and (not x.numel() or not _op_needed("softmax", x)):
            return torch.softmax(x, -1)
        return torch.ops.ops_adv.softmax(x)
    return _softmax(x)


def _kernel_args(x, dim=-1, dtype=None):
    """This call's arguments as the softmax kernels take them ((x,), {}), or None: torch's function runs it."""
    if dtype is not None or x.dim() < 1 or dim not in (-1, x.dim() - 1) or x.dtype not in DTYPE_CODE:
        return None
    return (x,), {}


def _softmax(x: torch.Tensor) -> torch.Tensor:
    cols = x.shape[-1]
    rows = x.numel() // cols if cols else 0
    if not (rows and cols):
        return torch.softmax(x, -1)
    return lookup("softmax", (rows, cols, DTYPE_CODE[x.dtype]), x.device)(x)


# --------------------------------------------------------------------------- custom operator


def _softmax_op(x: torch.Tensor) -> torch.Tensor:
    return _fresh(_softmax(x), (x,))


def _fake(x):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(output)
    ctx.in_dtype = inputs[0].dtype


def _backward(ctx, g):
    (y,) = ctx.saved_tensors
    return torch._softmax_backward_data(g.contiguous(), y, -1, ctx.in_dtype)


define("softmax", _softmax_op, _fake, setup=_setup, backward=_backward)
register_function("softmax", softmax, _kernel_args)
