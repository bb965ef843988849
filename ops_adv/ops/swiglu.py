"""swiglu: act(gate) * up in one op, with the torch composite's exact semantics; `ops_adv::swiglu`.

swiglu(gate, up=None, *, activation="silu") -> F.silu(gate) * up, or with activation="gelu_tanh" (GeGLU, Gemma's
MLP) F.gelu(gate, approximate="tanh") * up; with `up` None, gate is a merged [..., 2I] gate_up tensor.
Covered calls run the table's kernel eagerly, or the custom operator under tracing or autograd;
anything else runs the torch composite itself.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kernel_space._common import DTYPE_CODE

from .._dispatch import lookup, register_function
from .._op import _compiled_vendor, _fresh, _functorch, _pair_ok, _traced, define

ACTIVATIONS = ("silu", "gelu_tanh")


def _split(gate: torch.Tensor, up: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    if up is None:
        n = gate.shape[-1] // 2
        return gate[..., :n], gate[..., n:]
    return gate, up


def _act(g: torch.Tensor, activation: str) -> torch.Tensor:
    return F.silu(g) if activation == "silu" else F.gelu(g, approximate="tanh")


def _swiglu_composite(gate, up, activation="silu"):
    g, u = _split(gate, up)
    return _act(g, activation) * u


def swiglu(gate: torch.Tensor, up: torch.Tensor | None = None, *, activation: str = "silu") -> torch.Tensor:
    """act(gate) * up, act F.silu or (activation="gelu_tanh") F.gelu(approximate="tanh"); with `up` None, `gate`
    is one [..., 2I] tensor, gate then up (vLLM's SiluAndMul)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"swiglu: activation {activation!r} is not one of {', '.join(ACTIVATIONS)}")
    if up is None and (gate.dim() < 1 or gate.shape[-1] % 2):
        raise ValueError(f"swiglu: a merged gate_up tensor needs an even last dimension (gate then up), not shape "
                         f"{tuple(gate.shape)}; pass gate and up as two tensors")
    if gate.dim() < 1 or gate.dtype not in DTYPE_CODE or _functorch() or (up is None and gate.shape[-1] % 2) \
            or (up is not None and not _pair_ok(gate, up)):
        return _swiglu_composite(gate, up, activation)
    if _traced(gate, up):
        if _compiled_vendor("swiglu", gate.device):
            return _swiglu_composite(gate, up, activation)
        if activation == "silu":  # the operator's call as it always was
            return torch.ops.ops_adv.swiglu(gate, up)
        return torch.ops.ops_adv.swiglu(gate, up, activation)
    return _swiglu(gate, up, activation)


def _swiglu(gate, up, activation="silu"):
    n = gate.shape[-1]
    rows = gate.numel() // n if n else 0
    cols = n // 2 if up is None else n
    if not (rows and cols) or gate.dtype not in DTYPE_CODE:
        return _swiglu_composite(gate, up, activation)
    fn = lookup("swiglu", (rows, cols, up is None, DTYPE_CODE[gate.dtype], activation), gate.device)
    # SiLU's implementations take (gate, up) as they always did; GeGLU's are told their activation
    return fn(gate, up) if activation == "silu" else fn(gate, up, activation=activation)


# --------------------------------------------------------------------------- custom operator


def _swiglu_op(gate: torch.Tensor, up: torch.Tensor | None, activation: str = "silu") -> torch.Tensor:
    return _fresh(_swiglu(gate, up, activation), (gate,) if up is None else (gate, up))


def _fake(gate, up, activation="silu"):
    shape = gate.shape[:-1] + (gate.shape[-1] // 2,) if up is None else gate.shape
    return gate.new_empty(shape)


def _setup(ctx, inputs, output):
    gate, up = inputs[:2]
    ctx.merged = up is None
    ctx.activation = inputs[2] if len(inputs) > 2 else "silu"
    ctx.save_for_backward(gate, up)


_K = math.sqrt(2 / math.pi)


def _backward(ctx, go):
    gate, up = ctx.saved_tensors
    g, u = _split(gate, None if ctx.merged else up)
    hi = torch.promote_types(gate.dtype, torch.float32)
    gf, uf, gof = g.to(hi), u.to(hi), go.to(hi)
    if ctx.activation == "silu":
        sig = torch.sigmoid(gf)
        gg = gof * uf * sig * (1 + gf * (1 - sig))
        gu = gof * gf * sig
    else:  # gelu_tanh(g) = g * sigmoid(2z), z = k (g + 0.044715 g^3)
        s = torch.sigmoid(2 * _K * (gf + 0.044715 * gf ** 3))
        gg = gof * uf * (s + gf * 2 * s * (1 - s) * _K * (1 + 3 * 0.044715 * gf * gf))
        gu = gof * gf * s
    if ctx.merged:
        return torch.cat([gg, gu], -1).to(gate.dtype), None, None
    return gg.to(gate.dtype), gu.to(up.dtype), None


define("swiglu", _swiglu_op, _fake, setup=_setup, backward=_backward)
register_function("swiglu", swiglu)
