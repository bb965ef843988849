"""Fused row-wise ops: residual add + norm, and SwiGLU, with the torch composite's exact semantics.

Same pattern as `_ops`: a call ops-adv covers (fp16/bf16/fp32, matching shapes, dtypes and
devices) runs the table's kernel eagerly, or the `ops_adv::<op>` custom operator under tracing
or autograd; anything else runs the torch composite itself, so it works, fails, broadcasts and
promotes exactly as torch does.

- add_rms_norm(x, residual, weight, eps=None) -> (rms_norm(x + residual) * weight, x + residual)
- add_layer_norm(x, residual, weight, bias=None, eps=1e-5) -> (layer_norm(x + residual), x + residual)
- swiglu(gate, up=None) -> silu(gate) * up; with `up` None, gate is a merged [..., 2I] gate_up tensor
- llama_mlp_forward(mlp, x): down(swiglu(gate(x), up(x))) of a Llama-style MLP through these ops
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kernel_space._common import DTYPE_CODE

from ._dispatch import lookup
from ._ops import _autocast, _fresh, _rms_grads, _rows_ok, _traced, linear

# --------------------------------------------------------------------------- composites (torch's semantics)



def _rms(h: torch.Tensor, weight: torch.Tensor | None, eps: float | None) -> torch.Tensor:
    return F.rms_norm(h, h.shape[-1:], weight, eps)


def _add_rms_composite(x, residual, weight, eps):
    h = x + residual
    return _rms(h, weight, eps), h


def _add_ln_composite(x, residual, weight, bias, eps):
    h = x + residual
    return F.layer_norm(h, h.shape[-1:], weight, bias, eps), h


def _split(gate: torch.Tensor, up: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    if up is None:
        n = gate.shape[-1] // 2
        return gate[..., :n], gate[..., n:]
    return gate, up


def _swiglu_composite(gate, up):
    g, u = _split(gate, up)
    return F.silu(g) * u


def _pair_ok(x: torch.Tensor, residual: torch.Tensor) -> bool:
    return torch.is_tensor(residual) and residual.shape == x.shape and residual.dtype is x.dtype \
        and residual.device == x.device


def _default_eps(x: torch.Tensor) -> float:
    """F.rms_norm's eps=None: the epsilon of the type it computes in (fp32 for 16-bit inputs)."""
    return torch.finfo(torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype).eps


# --------------------------------------------------------------------------- add + norm


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                 eps: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual; (F.rms_norm(h, (h.shape[-1],), weight, eps), h). `eps=None` is torch's default."""
    if weight is None or not _rows_ok(x, weight) or not _pair_ok(x, residual) or _autocast():
        return _add_rms_composite(x, residual, weight, eps)
    eps = _default_eps(x) if eps is None else float(eps)
    if _traced(x, residual, weight):
        return torch.ops.ops_adv.add_rms_norm(x, residual, weight, eps)
    return _add_rms_norm(x, residual, weight, eps)


def _add_rms_norm(x, residual, weight, eps: float):
    cols = x.shape[-1]
    rows = x.numel() // cols if cols else 0
    if not (rows and cols) or x.dtype not in DTYPE_CODE:  # the operator called directly with float64
        return _add_rms_composite(x, residual, weight, eps)
    return lookup("add_rms_norm", (rows, cols, DTYPE_CODE[x.dtype]), x.device)(x, residual, weight, eps)


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                   bias: torch.Tensor | None = None, eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """h = x + residual; (F.layer_norm(h, (h.shape[-1],), weight, bias, eps), h)."""
    if weight is None or not _rows_ok(x, weight, bias) or not _pair_ok(x, residual) or _autocast():
        return _add_ln_composite(x, residual, weight, bias, eps)
    if _traced(x, residual, weight, bias):
        return torch.ops.ops_adv.add_layer_norm(x, residual, weight, bias, float(eps))
    return _add_layer_norm(x, residual, weight, bias, float(eps))


def _add_layer_norm(x, residual, weight, bias, eps: float):
    cols = x.shape[-1]
    rows = x.numel() // cols if cols else 0
    if not (rows and cols) or x.dtype not in DTYPE_CODE:
        return _add_ln_composite(x, residual, weight, bias, eps)
    return lookup("add_layer_norm", (rows, cols, DTYPE_CODE[x.dtype]), x.device)(x, residual, weight, bias, eps)


# --------------------------------------------------------------------------- swiglu


def swiglu(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """F.silu(gate) * up; with `up` None, `gate` is one [..., 2I] tensor, gate then up (vLLM's SiluAndMul)."""
    if up is None and (gate.dim() < 1 or gate.shape[-1] % 2):
        raise ValueError(f"swiglu: a merged gate_up tensor needs an even last dimension (gate then up), not shape "
                         f"{tuple(gate.shape)}; pass gate and up as two tensors")
    if gate.dim() < 1 or gate.dtype not in DTYPE_CODE or (up is None and gate.shape[-1] % 2) \
            or (up is not None and not _pair_ok(gate, up)):
        return _swiglu_composite(gate, up)
    if _traced(gate, up):
        return torch.ops.ops_adv.swiglu(gate, up)
    return _swiglu(gate, up)


def _swiglu(gate, up):
    n = gate.shape[-1]
    rows = gate.numel() // n if n else 0
    cols = n // 2 if up is None else n
    if not (rows and cols) or gate.dtype not in DTYPE_CODE:
        return _swiglu_composite(gate, up)
    return lookup("swiglu", (rows, cols, up is None, DTYPE_CODE[gate.dtype]), gate.device)(gate, up)


# --------------------------------------------------------------------------- model helpers


def is_swiglu_mlp(mlp: Any) -> bool:
    """Whether `mlp` is a Llama-style MLP `llama_mlp_forward` computes: down(silu(gate(x)) * up(x)),
    with separate gate_proj/up_proj or one merged gate_up_proj (gate rows first), and a SiLU activation."""
    act = getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None)
    silu = isinstance(act, torch.nn.SiLU) or act is F.silu or type(act).__name__ == "SiLUActivation"
    linears = [getattr(mlp, n, None) for n in ("gate_up_proj", "down_proj")]
    merged = all(isinstance(m, torch.nn.Linear) for m in linears)
    split = all(isinstance(getattr(mlp, n, None), torch.nn.Linear) for n in ("gate_proj", "up_proj", "down_proj"))
    return silu and (merged or split)


def llama_mlp_forward(mlp: Any, x: torch.Tensor) -> torch.Tensor:
    """down_proj(silu(gate_proj(x)) * up_proj(x)) through ops_adv's linear and swiglu; a merged
    gate_up_proj runs as one projection and the merged swiglu layout."""
    if not is_swiglu_mlp(mlp):
        raise TypeError(f"{type(mlp).__name__} is not a SiLU-gated MLP with gate_proj/up_proj (or gate_up_proj) "
                        "and down_proj Linears; call it directly")
    gate_up = getattr(mlp, "gate_up_proj", None)
    if isinstance(gate_up, torch.nn.Linear):
        h = swiglu(linear(x, gate_up.weight, gate_up.bias))
    else:
        h = swiglu(linear(x, mlp.gate_proj.weight, mlp.gate_proj.bias), linear(x, mlp.up_proj.weight, mlp.up_proj.bias))
    return linear(h, mlp.down_proj.weight, mlp.down_proj.bias)


# --------------------------------------------------------------------------- custom operators

_lib_ops: dict[str, Any] = {}


def _plus(gh: torch.Tensor, g_res: torch.Tensor | None) -> torch.Tensor:
    return gh if g_res is None else gh + g_res.to(gh.dtype)


def _both(ctx, gh: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """x and residual get the same gradient: a copy for the second only when both need it."""
    need_x, need_r = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    return (gh if need_x else None), ((gh.clone() if need_x else gh) if need_r else None)


def _define_fused() -> None:
    """Register `ops_adv::add_rms_norm`, `ops_adv::add_layer_norm`, `ops_adv::swiglu` with fake kernels
    and autograd formulas (torch ops in backward)."""
    from torch.library import custom_op

    @custom_op("ops_adv::add_rms_norm", mutates_args=())
    def add_rms_norm_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        y, h = _add_rms_norm(x, residual, weight, eps)
        return _fresh(y, (x, residual, weight)), _fresh(h, (x, residual, weight))

    @add_rms_norm_op.register_fake
    def _(x, residual, weight, eps):
        return torch.empty_like(x, memory_format=torch.contiguous_format), \
            torch.empty_like(x, memory_format=torch.contiguous_format)

    def add_rms_norm_setup(ctx, inputs, output):
        ctx.eps = inputs[3]
        ctx.save_for_backward(output[1], inputs[2])

    def add_rms_norm_backward(ctx, g, g_res):
        h, weight = ctx.saved_tensors
        if g is None:
            g = torch.zeros_like(h)
        gh, gw = _rms_grads(h, weight, ctx.eps, g)
        gh = _plus(gh, g_res)
        gh = gh.to(h.dtype)
        return (*_both(ctx, gh), gw.to(weight.dtype), None)

    add_rms_norm_op.register_autograd(add_rms_norm_backward, setup_context=add_rms_norm_setup)

    @custom_op("ops_adv::add_layer_norm", mutates_args=())
    def add_layer_norm_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        y, h = _add_layer_norm(x, residual, weight, bias, eps)
        return _fresh(y, (x, residual, weight)), _fresh(h, (x, residual, weight))

    @add_layer_norm_op.register_fake
    def _(x, residual, weight, bias, eps):
        return torch.empty_like(x, memory_format=torch.contiguous_format), \
            torch.empty_like(x, memory_format=torch.contiguous_format)

    def add_layer_norm_setup(ctx, inputs, output):
        x, residual, weight, bias, eps = inputs
        ctx.eps, ctx.has_bias = eps, bias is not None
        ctx.save_for_backward(output[1], weight, bias)

    def add_layer_norm_backward(ctx, g, g_res):
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

    add_layer_norm_op.register_autograd(add_layer_norm_backward, setup_context=add_layer_norm_setup)

    @custom_op("ops_adv::swiglu", mutates_args=())
    def swiglu_op(gate: torch.Tensor, up: torch.Tensor | None) -> torch.Tensor:
        return _fresh(_swiglu(gate, up), (gate,) if up is None else (gate, up))

    @swiglu_op.register_fake
    def _(gate, up):
        shape = gate.shape[:-1] + (gate.shape[-1] // 2,) if up is None else gate.shape
        return gate.new_empty(shape)

    def swiglu_setup(ctx, inputs, output):
        gate, up = inputs
        ctx.merged = up is None
        ctx.save_for_backward(gate, up)

    def swiglu_backward(ctx, go):
        gate, up = ctx.saved_tensors
        g, u = _split(gate, None if ctx.merged else up)
        hi = torch.promote_types(gate.dtype, torch.float32)
        gf, uf, gof = g.to(hi), u.to(hi), go.to(hi)
        sig = torch.sigmoid(gf)
        gg = gof * uf * sig * (1 + gf * (1 - sig))
        gu = gof * gf * sig
        if ctx.merged:
            return torch.cat([gg, gu], -1).to(gate.dtype), None
        return gg.to(gate.dtype), gu.to(up.dtype)

    swiglu_op.register_autograd(swiglu_backward, setup_context=swiglu_setup)
    _lib_ops.update(add_rms_norm=add_rms_norm_op, add_layer_norm=add_layer_norm_op, swiglu=swiglu_op)


_define_fused()
