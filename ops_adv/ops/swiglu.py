"""swiglu: F.silu(gate) * up in one op, with the torch composite's exact semantics; `ops_adv::swiglu`.

swiglu(gate, up=None) -> silu(gate) * up; with `up` None, gate is a merged [..., 2I] gate_up tensor.
Covered calls run the table's kernel eagerly, or the custom operator under tracing or autograd;
anything else runs the torch composite itself.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernel_space._common import DTYPE_CODE

from .._dispatch import lookup, register_function
from .._op import _compiled_vendor, _fresh, _functorch, _pair_ok, _traced, define


def _split(gate: torch.Tensor, up: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    if up is None:
        n = gate.shape[-1] // 2
        return gate[..., :n], gate[..., n:]
    return gate, up


def _swiglu_composite(gate, up):
    g, u = _split(gate, up)
    return F.silu(g) * u


def swiglu(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """F.silu(gate) * up; with `up` None, `gate` is one [..., 2I] tensor, gate then up (vLLM's SiluAndMul)."""
    if up is None and (gate.dim() < 1 or gate.shape[-1] % 2):
        raise ValueError(f"swiglu: a merged gate_up tensor needs an even last dimension (gate then up), not shape "
                         f"{tuple(gate.shape)}; pass gate and up as two tensors")
    if gate.dim() < 1 or gate.dtype not in DTYPE_CODE or _functorch() or (up is None and gate.shape[-1] % 2) \
            or (up is not None and not _pair_ok(gate, up)):
        return _swiglu_composite(gate, up)
    if _traced(gate, up):
        if _compiled_vendor("swiglu", gate.device):
            return _swiglu_composite(gate, up)
        return torch.ops.ops_adv.swiglu(gate, up)
    return _swiglu(gate, up)


def _swiglu(gate, up):
    n = gate.shape[-1]
    rows = gate.numel() // n if n else 0
    cols = n // 2 if up is None else n
    if not (rows and cols) or gate.dtype not in DTYPE_CODE:
        return _swiglu_composite(gate, up)
    return lookup("swiglu", (rows, cols, up is None, DTYPE_CODE[gate.dtype]), gate.device)(gate, up)


# --------------------------------------------------------------------------- custom operator


def _swiglu_op(gate: torch.Tensor, up: torch.Tensor | None) -> torch.Tensor:
    return _fresh(_swiglu(gate, up), (gate,) if up is None else (gate, up))


def _fake(gate, up):
    shape = gate.shape[:-1] + (gate.shape[-1] // 2,) if up is None else gate.shape
    return gate.new_empty(shape)


def _setup(ctx, inputs, output):
    gate, up = inputs
    ctx.merged = up is None
    ctx.save_for_backward(gate, up)


def _backward(ctx, go):
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


define("swiglu", _swiglu_op, _fake, setup=_setup, backward=_backward)
register_function("swiglu", swiglu)
