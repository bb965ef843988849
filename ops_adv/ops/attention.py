"""attention: F.scaled_dot_product_attention's semantics through the tuned kernel; `ops_adv::attention`."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernel_space._common import DTYPE_CODE

from .._dispatch import _OP_FUNCS, cache_for, lookup, register_function
from .._op import _compiled_vendor, _autocast, _functorch, _fresh, _grad_enabled, _is_compiling, _op_needed, _tracing_state, define

DECODE_MAX_QUERY = 16  # query rows up to which grouped-head attention runs decode_attention
# The dispatcher's per-op cache, read directly on the hot path (a function call costs ~150 ns).
_attention_cache = cache_for("attention")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
              dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
              *, causal: bool | None = None) -> torch.Tensor:
    """F.scaled_dot_product_attention's semantics (`causal` is an alias of `is_causal`).

    Grouped K/V heads (`enable_gqa`) with at most 16 query rows and no causal mask run
    `decode_attention`; masks, dropout, a custom scale, other grouped calls and Dv != D run SDPA itself.
    """
    if causal is not None:
        is_causal = causal
    dt = q.dtype
    if attn_mask is None and not dropout_p and scale is None and dt in DTYPE_CODE and k.dtype is dt and v.dtype is dt \
            and not _autocast() and not _functorch():
        qs, ks = q.shape, k.shape
        # 4-D, the same heads and head dim for q, k and v (no grouped K/V, Dv == D)
        if len(qs) == 4 and ks == v.shape and len(ks) == 4 and ks[1] == qs[1] and ks[3] == qs[3] and ks[0] == qs[0]:
            if _compiled_vendor("attention", q.device):
                return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
            if _is_compiling() or _tracing_state() is not None \
                    or (_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
                        and q.numel() and k.numel() and _op_needed("attention", q, k, v, bool(is_causal))):
                return torch.ops.ops_adv.attention(q, k, v, bool(is_causal))
            if _grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
                return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
            B, H, Sq, D = qs
            Skv = ks[2]
            if B and H and Sq and Skv and D:
                key = ((B, H, Sq, Skv, D, bool(is_causal), DTYPE_CODE[dt]), q.device)
                fn = _attention_cache.get(key)
                if fn is None:
                    fn = lookup("attention", *key)
                return fn(q, k, v, bool(is_causal))
        elif enable_gqa and not is_causal and len(qs) == 4 and len(ks) == 4 and ks == v.shape and ks[1] \
                and qs[1] != ks[1] and qs[1] % ks[1] == 0 and qs[2] <= DECODE_MAX_QUERY:
            # grouped K/V heads and a few query rows: the decode op reads K/V once per group, no copy
            return _OP_FUNCS["decode_attention"](q, k, v)  # ops_adv.decode_attention
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                          scale=scale, enable_gqa=enable_gqa)


def _kernel_args(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *, causal=None):
    """This call's arguments as the attention kernels take them ((q, k, v), {causal}), or None: SDPA runs it
    (or decode_attention: explain that op for grouped heads)."""
    if causal is not None:
        is_causal = causal
    dt = q.dtype
    if attn_mask is None and not dropout_p and scale is None and dt in DTYPE_CODE and k.dtype is dt and v.dtype is dt:
        qs, ks = q.shape, k.shape
        if len(qs) == 4 and ks == v.shape and len(ks) == 4 and ks[1] == qs[1] and ks[3] == qs[3] and ks[0] == qs[0]:
            return (q, k, v), {"causal": bool(is_causal)}
    return None


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """The custom operator's body: what the eager path does, for tensors already checked at trace time."""
    B, H, Sq, D = q.shape
    Skv = k.shape[2]
    if k.shape != (B, H, Skv, D) or v.shape != k.shape or not (B and H and Sq and Skv and D):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    key = ((B, H, Sq, Skv, D, causal, DTYPE_CODE[q.dtype]), q.device)
    fn = _attention_cache.get(key)
    if fn is None:
        fn = lookup("attention", *key)
    return fn(q, k, v, causal)


def _attention_grads(q, k, v, g, causal: bool):
    """SDPA's gradients by the math formula in fp32 (memory Sq x Skv per head)."""
    hi = torch.float32
    qf, kf, vf, gf = q.to(hi), k.to(hi), v.to(hi), g.to(hi)
    scale = q.shape[-1] ** -0.5
    s = qf @ kf.transpose(-1, -2) * scale
    if causal:
        Sq, Skv = s.shape[-2:]
        keep = torch.ones(Sq, Skv, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    gv = p.transpose(-1, -2) @ gf
    gp = gf @ vf.transpose(-1, -2)
    gs = p * (gp - (gp * p).sum(-1, keepdim=True))
    gq = gs @ kf * scale
    gk = gs.transpose(-1, -2) @ qf * scale
    return gq.to(q.dtype), gk.to(k.dtype), gv.to(v.dtype)


# --------------------------------------------------------------------------- custom operator


def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    return _fresh(_attention(q, k, v, causal), (q, k, v))


def _fake(q, k, v, causal):
    return q.new_empty(q.shape[:-1] + v.shape[-1:])


def _setup(ctx, inputs, output):
    q, k, v, causal = inputs
    ctx.causal = causal
    ctx.save_for_backward(q, k, v)


def _backward(ctx, g):
    q, k, v = ctx.saved_tensors
    return (*_attention_grads(q, k, v, g, ctx.causal), None)


define("attention", _attention_op, _fake, setup=_setup, backward=_backward)
register_function("attention", attention, _kernel_args)
