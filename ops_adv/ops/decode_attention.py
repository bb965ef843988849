"""decode_attention: a few new query rows per sequence against a ragged, grouped-head K/V cache.

`decode_attention(q, k, v, seq_lens=None, *, causal=False, scale=None, key_mask=None)`: q (B, Hq, Sq, D),
k and v (B, Hkv, Skv, D), Hq a multiple of Hkv (K/V heads are shared, never copied); `seq_lens` (B,)
limits sequence b to keys [0, seq_lens[b]) (a zero length gives zeros); `causal` aligns
bottom-right against each sequence's length; `key_mask` (B, Skv) bool hides key j of sequence b
where it is False (left padding). As the other ops (`ops_adv._op`): eager calls are a
signature and a dict lookup; under torch.compile, tracing or autograd the `ops_adv::decode_attention`
custom operator runs; calls no kernel covers (a custom scale, other ranks or dtypes) run SDPA with
the same semantics. Nothing reads `seq_lens` or `key_mask` on the host, so calls capture in CUDA graphs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernel_space._common import DTYPE_CODE
from kernel_space.decode_attention.problem import visible
from kernel_space.decode_attention.vendor import sdpa_decode

from .._dispatch import cache_for, lookup, register_function
from .._op import _compiled_vendor, _autocast, _functorch, _fresh, _traced, define

_decode_cache = cache_for("decode_attention")
_LENS_DTYPES = (torch.int32, torch.int64)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor | None = None, *,
                     causal: bool = False, scale: float | None = None, key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q kᵀ · scale) v per sequence over its first seq_lens[b] keys where key_mask allows, grouped K/V
    heads, bottom-right causal."""
    dt = q.dtype
    if scale is None and dt in DTYPE_CODE and k.dtype is dt and v.dtype is dt and q.dim() == 4 and k.dim() == 4 \
            and not _autocast() and not _functorch() and k.device == q.device and v.device == q.device:
        qs, ks = q.shape, k.shape
        if ks == v.shape and ks[0] == qs[0] and ks[3] == qs[3] and ks[1] and qs[1] % ks[1] == 0 and (
                seq_lens is None or (isinstance(seq_lens, torch.Tensor) and seq_lens.dim() == 1 and seq_lens.shape[0] == qs[0]
                                     and seq_lens.dtype in _LENS_DTYPES and seq_lens.device == q.device)) and (
                key_mask is None or (isinstance(key_mask, torch.Tensor) and key_mask.dtype == torch.bool
                                     and key_mask.shape == (qs[0], ks[2]) and key_mask.device == q.device)):
            if _compiled_vendor("decode_attention", q.device):
                return _fallback(q, k, v, seq_lens, bool(causal), scale, key_mask)
            if _traced(q, k, v):
                return torch.ops.ops_adv.decode_attention(q, k, v, seq_lens, bool(causal), key_mask)
            return _decode(q, k, v, seq_lens, bool(causal), key_mask)
    return _fallback(q, k, v, seq_lens, bool(causal), scale, key_mask)


def _decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor | None, causal: bool,
            key_mask: torch.Tensor | None = None) -> torch.Tensor:
    B, Hq, Sq, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    if not (B and Hq and Sq and Skv and D) or q.dtype not in DTYPE_CODE:  # empty, or the operator called with float64
        return _fallback(q, k, v, seq_lens, causal, None, key_mask)
    masked = key_mask is not None
    key = ((B, Hq, Hkv, Sq, Skv, D, seq_lens is not None, causal, DTYPE_CODE[q.dtype], masked), q.device)
    fn = _decode_cache.get(key)
    if fn is None:
        fn = lookup("decode_attention", *key)
    if masked:
        return fn(q, k, v, seq_lens, causal, key_mask=key_mask)
    return fn(q, k, v, seq_lens, causal)


def _fallback(q, k, v, seq_lens, causal: bool, scale: float | None, key_mask=None) -> torch.Tensor:
    """SDPA with decode_attention's semantics, for any call the kernels do not cover."""
    if seq_lens is not None:
        if q.dim() != 4:
            raise ValueError(f"decode_attention: seq_lens needs 4-D q, k, v (B, H, S, D), not q of shape {tuple(q.shape)}")
        if not isinstance(seq_lens, torch.Tensor):
            raise TypeError(f"decode_attention: seq_lens must be an int32 or int64 tensor of shape ({q.shape[0]},) "
                            f"on q's device, not {type(seq_lens).__name__}")
        if seq_lens.dtype not in _LENS_DTYPES or tuple(seq_lens.shape) != (q.shape[0],):
            raise ValueError(f"decode_attention: seq_lens must be an int32 or int64 tensor of shape ({q.shape[0]},), "
                             f"not {seq_lens.dtype} of shape {tuple(seq_lens.shape)}")
    if key_mask is not None:
        if q.dim() != 4:
            raise ValueError(f"decode_attention: key_mask needs 4-D q, k, v (B, H, S, D), not q of shape {tuple(q.shape)}")
        if not isinstance(key_mask, torch.Tensor) or key_mask.dtype != torch.bool \
                or tuple(key_mask.shape) != (q.shape[0], k.shape[-2]):
            what = f"{key_mask.dtype} of shape {tuple(key_mask.shape)}" if isinstance(key_mask, torch.Tensor) \
                else type(key_mask).__name__
            raise ValueError(f"decode_attention: key_mask must be a bool tensor of shape ({q.shape[0]}, {k.shape[-2]}) "
                             f"(batch, keys), not {what}")
    if q.dim() == 4:
        return sdpa_decode(q, k, v, seq_lens, causal, scale, key_mask)
    Sq, Skv = q.shape[-2], k.shape[-2]
    ok = None
    if causal and Sq > 1:
        j = torch.arange(Skv, device=q.device)
        ok = j[None, :] <= Skv - Sq + torch.arange(Sq, device=q.device)[:, None]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=ok, scale=scale, enable_gqa=True)
    return out if ok is None else out.masked_fill(~ok.any(-1, keepdim=True), 0.0)


def _decode_grads(q, k, v, seq_lens, causal: bool, g, key_mask=None):
    """Gradients by the math formula in fp32 or wider (memory Hq x Sq x Skv per sequence); grouped heads sum
    into their K/V head."""
    B, Hq, Sq, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    rows = Hq // Hkv * Sq
    scale = D ** -0.5
    hi = torch.promote_types(q.dtype, torch.float32)
    qf = q.to(hi).reshape(B, Hkv, rows, D)
    kf, vf = k.to(hi), v.to(hi)
    gf = g.to(hi).reshape(B, Hkv, rows, D)
    s = qf @ kf.transpose(-1, -2) * scale
    ok = visible(B, Sq, Skv, seq_lens, causal, q.device, key_mask)
    if ok is not None:
        ok = ok.reshape(B, 1, 1, Sq, Skv).expand(B, 1, Hq // Hkv, Sq, Skv).reshape(B, 1, rows, Skv)
        s = s.masked_fill(~ok, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    gv = p.transpose(-1, -2) @ gf
    gp = gf @ vf.transpose(-1, -2)
    gs = p * (gp - (gp * p).sum(-1, keepdim=True))
    gq = (gs @ kf * scale).reshape(B, Hq, Sq, D)
    gk = gs.transpose(-1, -2) @ qf * scale
    return gq.to(q.dtype), gk.to(k.dtype), gv.to(v.dtype)


# --------------------------------------------------------------------------- custom operator


def _decode_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor | None,
               causal: bool, key_mask: torch.Tensor | None = None) -> torch.Tensor:
    return _fresh(_decode(q, k, v, seq_lens, causal, key_mask), (q, k, v))


def _fake(q, k, v, seq_lens, causal, key_mask=None):
    return q.new_empty(q.shape[:-1] + v.shape[-1:])


def _setup(ctx, inputs, output):
    q, k, v, seq_lens, causal, key_mask = inputs
    ctx.causal = causal
    ctx.save_for_backward(q, k, v, seq_lens, key_mask)


def _backward(ctx, g):
    q, k, v, seq_lens, key_mask = ctx.saved_tensors
    return (*_decode_grads(q, k, v, seq_lens, ctx.causal, g, key_mask), None, None, None)


define("decode_attention", _decode_op, _fake, setup=_setup, backward=_backward)
register_function("decode_attention", decode_attention)
