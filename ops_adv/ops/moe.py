"""moe: a sparse mixture-of-experts block's routed experts in one op; `ops_adv::moe`.

moe(hidden_states, router_logits, w13, w2, top_k, *, renormalize=True, activation="silu"): softmax over the E
experts of router_logits, the top_k, renormalised (Mixtral; `renormalize=False`: Qwen2-MoE's norm_topk_prob off),
then per token sum_k w_k * down_e(silu(gate_e(x)) * up_e(x)), with w13 [E, 2N, K] (gate rows, then up rows) and
w2 [E, K, N]: transformers' gate_up_proj and down_proj. hidden_states [..., K], router_logits [..., E].
Eager calls run the table's winner, else the vendor default (transformers' expert loop); a call that needs
gradients, mixes dtypes or devices, or runs under autocast or torch.func runs that loop itself (the op has no
backward of its own); under torch.compile or export the `ops_adv::moe` custom operator runs (fullgraph works).
A call whose shapes do not fit raises ValueError whatever the table holds.
"""
from __future__ import annotations

import torch

from kernel_space._common import DTYPE_CODE
from kernel_space.moe.vendor import torch_experts_loop

from .._dispatch import cache_for, lookup, register_function
from .._op import _autocast, _fresh, _functorch, _traced, define

_moe_cache = cache_for("moe")
ACTIVATIONS = ("silu",)


def _shapes(x, router_logits, w13, w2, top_k, activation) -> tuple[int, int, int]:
    """(E, N, K), or ValueError saying which argument does not fit."""
    for name, t in (("hidden_states", x), ("router_logits", router_logits), ("w13", w13), ("w2", w2)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"moe: {name} must be a tensor, not {type(t).__name__}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"moe: activation {activation!r} is not supported; use one of {', '.join(ACTIVATIONS)}")
    if x.dim() < 1:
        raise ValueError("moe: hidden_states must have a last (hidden) dimension, not be a scalar")
    K = x.shape[-1]
    if w13.dim() != 3 or w13.shape[1] % 2 or w13.shape[2] != K:
        raise ValueError(f"moe: w13 must be [E, 2N, K] (gate rows then up rows) with K={K} from hidden_states, "
                         f"not shape {tuple(w13.shape)}")
    E, N = w13.shape[0], w13.shape[1] // 2
    if tuple(w2.shape) != (E, K, N):
        raise ValueError(f"moe: w2 must be [E, K, N] = {(E, K, N)} to match w13 {tuple(w13.shape)}, not {tuple(w2.shape)}")
    if router_logits.dim() < 1 or router_logits.shape[-1] != E or router_logits.numel() // max(E, 1) != x.numel() // max(K, 1):
        raise ValueError(f"moe: router_logits must be [tokens, E] with E={E} experts and the {x.numel() // max(K, 1)} "
                         f"tokens of hidden_states, not shape {tuple(router_logits.shape)}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= E:
        raise ValueError(f"moe: top_k must be an int from 1 to the {E} experts, not {top_k!r}")
    return E, N, K


def moe(hidden_states: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int, *,
        renormalize: bool = True, activation: str = "silu") -> torch.Tensor:
    """Routed experts of a sparse MoE block: [..., K] in, [..., K] out (router_logits [..., E])."""
    E, N, K = _shapes(hidden_states, router_logits, w13, w2, top_k, activation)
    renormalize = bool(renormalize)
    x = hidden_states.reshape(-1, K)
    logits = router_logits.reshape(-1, E)
    dt, dev = x.dtype, x.device
    if dt not in DTYPE_CODE or w13.dtype is not dt or w2.dtype is not dt or not logits.dtype.is_floating_point \
            or w13.device != dev or w2.device != dev or logits.device != dev or not (x.shape[0] and N and K) \
            or _autocast() or _functorch() or (torch.is_grad_enabled() and any(
                t.requires_grad for t in (x, logits, w13, w2))):
        return torch_experts_loop(x, logits, w13, w2, top_k=top_k, renormalize=renormalize).view(hidden_states.shape)
    if _traced(x, logits, w13, w2):  # the operator even for a vendor-only table: the loop's .tolist() breaks a graph
        return torch.ops.ops_adv.moe(x, logits, w13, w2, top_k, renormalize).view(hidden_states.shape)
    return _moe(x, logits, w13, w2, top_k, renormalize).view(hidden_states.shape)


def problem_of(x, w13, w2, top_k: int, renormalize: bool) -> tuple:
    """The moe problem of a [T, K] call (the table's key)."""
    return (x.shape[0], w13.shape[0], top_k, w2.shape[-1], x.shape[1], DTYPE_CODE[x.dtype], "silu", renormalize)


def _moe(x, logits, w13, w2, top_k: int, renormalize: bool) -> torch.Tensor:
    key = (problem_of(x, w13, w2, top_k, renormalize), x.device)
    fn = _moe_cache.get(key)
    if fn is None:
        fn = lookup("moe", *key)
    return fn(x, logits, w13, w2, top_k=top_k, activation="silu", renormalize=renormalize)


def _kernel_args(hidden_states, router_logits, w13, w2, top_k, *, renormalize=True, activation="silu"):
    """moe's arguments as the kernels take them, or None where the expert loop runs the call."""
    E, N, K = _shapes(hidden_states, router_logits, w13, w2, top_k, activation)
    x, dt = hidden_states.reshape(-1, K), hidden_states.dtype
    if dt not in DTYPE_CODE or w13.dtype is not dt or w2.dtype is not dt or not x.shape[0]:
        return None
    return (x, router_logits.reshape(-1, E), w13, w2), {"top_k": top_k, "activation": activation,
                                                        "renormalize": bool(renormalize)}


# --------------------------------------------------------------------------- custom operator


def _moe_op(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
            renormalize: bool) -> torch.Tensor:
    return _fresh(_moe(x, router_logits, w13, w2, top_k, renormalize), (x,))


def _fake(x, router_logits, w13, w2, top_k, renormalize):
    return x.new_empty(x.shape)


define("moe", _moe_op, _fake)
register_function("moe", moe, kernel_args=_kernel_args)
