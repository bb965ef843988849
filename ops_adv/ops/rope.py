"""rope: rotary position embedding of q and k, as transformers' `apply_rotary_pos_emb` computes it.

`rope(q, k, cos, sin, positions=None, *, interleaved=False, inplace=False, layout="bshd")` rotates
q (B, S, Hq, D) or (T, Hq, D) and k (same, Hkv heads); `layout="bhsd"` takes transformers' (B, H, S, D).
cos/sin are per-token tables, (S, D) or (B, S, D) with duplicated halves (rotate-half) or
duplicated pairs (interleaved) as the model's rotary embedding returns them, or (S, D/2) /
(B, S, D/2); with `positions` (B, S) or (S,) (or (T,)) they are a (max_pos, D/2 or D) cache read there.
The kernels read one half of a full-width table: the halves must be equal, as every
rotary embedding makes them.

A call the kernels do not cover (other dtypes, cos/sin of another dtype, which promotes, tables
needing grad, shapes that do not match) runs the torch composite, whose results are transformers'
bit for bit. Covered calls: eager, one signature and dict lookup; traced or needing grad, the
`ops_adv::rope` custom operator (its gradient is rope with -sin). In place under tracing or
autograd runs the out-of-place operator and copies into q and k, which torch.compile functionalises.
"""
from __future__ import annotations

import torch

from kernel_space._common import DTYPE_CODE
from kernel_space.rope.vendor import composite, full_tables

from .._dispatch import cache_for, lookup, register_function
from .._op import _compiled_vendor, _functorch, _grad_enabled, _is_compiling, _tracing_state, define

_rope_cache = cache_for("rope")
_INT = (torch.int64, torch.int32)
_increment_version = torch.autograd.graph.increment_version


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None = None,
         *, interleaved: bool = False, inplace: bool = False, layout: str = "bshd") -> tuple[torch.Tensor, torch.Tensor]:
    """(q_out, k_out): q and k rotated; with `inplace`, written into q and k, which are returned."""
    if layout not in ("bshd", "bhsd"):
        raise ValueError(f"rope: layout {layout!r} is not one of 'bshd' (B, S, H, D) and 'bhsd' (B, H, S, D)")
    if _functorch() or not _covered(q, k, cos, sin, positions, layout):
        return _composite(q, k, cos, sin, positions, interleaved, inplace, layout)
    if _compiled_vendor("rope", q.device):
        return _composite(q, k, cos, sin, positions, interleaved, inplace, layout)
    if _is_compiling() or _tracing_state() is not None or (_grad_enabled() and (q.requires_grad or k.requires_grad)):
        qo, ko = torch.ops.ops_adv.rope(q, k, cos, sin, positions, bool(interleaved), layout)
        if inplace:
            return q.copy_(qo), k.copy_(ko)
        return qo, ko
    if inplace and not (_writable(q) and _writable(k)):  # torch's error, which the kernel's raw writes would skip
        return _composite(q, k, cos, sin, positions, interleaved, inplace, layout)
    return _rope(q, k, cos, sin, positions, bool(interleaved), layout, inplace)


def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' `apply_rotary_pos_emb`: q, k (B, H, S, D) with unsqueeze_dim 1, (B, S, H, D) with 2."""
    # full-width tables only: transformers' formula refuses a (B, S, D/2) table, which rope() would widen
    if q.dim() == 4 and cos.dim() == 3 and cos.shape[-1] == q.shape[-1] and unsqueeze_dim in (1, 2, -2, -3):
        return rope(q, k, cos, sin, layout="bhsd" if unsqueeze_dim in (1, -3) else "bshd")
    c, s = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return composite(q, c, s, False), composite(k, c, s, False)


def apply_rotary_pos_emb_partial(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                 unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The partial-rotary form of transformers' formula (GPT-NeoX's rotary_pct, Phi-3's partial_rotary_factor):
    the first cos.shape[-1] features of q and k rotate, the rest pass through."""
    rd, D = cos.shape[-1], q.shape[-1]
    if rd < D and k.shape[-1] == D and rd % 2 == 0:
        qr, kr = apply_rotary_pos_emb(q[..., :rd], k[..., :rd], cos, sin, unsqueeze_dim)
        return torch.cat([qr, q[..., rd:]], -1), torch.cat([kr, k[..., rd:]], -1)
    return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)


def _covered(q, k, cos, sin, positions, layout: str) -> bool:
    """Whether the kernels compute exactly this call (else the composite runs it)."""
    dt = q.dtype
    if dt not in DTYPE_CODE or k.dtype is not dt or cos.dtype is not dt or sin.dtype is not dt:
        return False
    qs, ks, cs = q.shape, k.shape, cos.shape
    nd = len(qs)
    if len(ks) != nd or sin.shape != cs or cos.requires_grad or sin.requires_grad:
        return False
    D = qs[-1]
    if not D or D % 2 or ks[-1] != D or cs[-1] not in (D, D // 2) or q.stride(-1) != 1 or k.stride(-1) != 1:
        return False
    dev = q.get_device()
    if k.get_device() != dev or cos.get_device() != dev or sin.get_device() != dev:
        return False
    if nd == 4:
        if layout == "bhsd":
            B, S = qs[0], qs[2]
            if ks[0] != B or ks[2] != S:
                return False
        else:
            B, S = qs[0], qs[1]
            if ks[0] != B or ks[1] != S:
                return False
    elif nd == 3 and layout == "bshd":
        B, S = 1, qs[0]
        if ks[0] != S:
            return False
    else:
        return False
    if positions is None:
        lead = cs[:-1]
        return lead == (S,) or (len(lead) == 2 and lead[1] == S and lead[0] in (1, B))
    if positions.dtype not in _INT or positions.get_device() != dev or len(cs) != 2:
        return False
    ps = positions.shape
    return ps == (S,) or (nd == 4 and ps == (B, S))


def _writable(t: torch.Tensor) -> bool:
    """Whether torch's in-place ops accept `t` (else the composite runs and raises torch's error, which a
    kernel's raw writes would skip): not an inference tensor outside inference mode, no overlapping elements."""
    if t.is_inference() and not torch.is_inference_mode_enabled():
        return False
    return torch._debug_has_internal_overlap(t) != 1


def _bshd(x: torch.Tensor, layout: str) -> torch.Tensor:
    return x.transpose(1, 2) if layout == "bhsd" else x


def _rope(q, k, cos, sin, positions, interleaved: bool, layout: str, inplace: bool):
    """The eager path for a covered call: the tuned implementation, writing into fresh outputs or q and k."""
    qs, ks = q.shape, k.shape
    D, (Hq, Hkv) = qs[-1], ((qs[1], ks[1]) if layout == "bhsd" else (qs[-2], ks[-2]))
    T = q.numel() // (Hq * D) if Hq else 0
    if not (T and Hkv) or q.dtype not in DTYPE_CODE:
        # no tokens, no heads on one side (the other is still rotated), or float64 (the operator called
        # directly, as gradcheck does): the composite
        return _composite(q, k, cos, sin, positions, interleaved, inplace, layout)
    key = ((T, Hq, Hkv, D, interleaved, positions is not None, DTYPE_CODE[q.dtype]), q.device)
    fn = _rope_cache.get(key)
    if fn is None:
        fn = lookup("rope", *key)
    miss = getattr(fn, "vendor_miss", None)
    if miss is not None:  # no winner: the vendor's formula in the caller's layout, no repacking (~2x on the CPU)
        miss()
        return _composite(q, k, cos, sin, positions, interleaved, inplace, layout)
    qo, ko = (q, k) if inplace else (torch.empty_like(q), torch.empty_like(k))
    q4, k4 = _bshd(q, layout), _bshd(k, layout)
    fn(q4, k4, cos, sin, positions, interleaved=interleaved, out=(_bshd(qo, layout), _bshd(ko, layout)))
    if inplace:  # a kernel's raw writes: tell autograd q and k changed, as torch's in-place ops do
        _increment_version((q, k))
    return qo, ko


def _composite(q, k, cos, sin, positions, interleaved: bool, inplace: bool, layout: str):
    """transformers' formula in torch ops (its exact results); in place, written into q and k."""
    c, s = full_tables(q, cos, sin, positions, interleaved)  # (..., S, 1, D)
    if layout == "bhsd":  # computed in the caller's layout, as transformers does: on a transposed view it took 2x
        c, s = c.transpose(-3, -2), s.transpose(-3, -2)  # (..., 1, S, D)
    if not inplace:
        return composite(q, c, s, interleaved), composite(k, c, s, interleaved)
    return _into(q, c, s, interleaved), _into(k, c, s, interleaved)  # the caller's tensors, as the kernel path returns


def _into(x, c, s, interleaved: bool) -> torch.Tensor:
    # Dynamo refuses a non-contiguous out= (a transposed view of transformers' q): computed, then copied in
    return composite(x, c, s, interleaved, x) if x.is_contiguous() else x.copy_(composite(x, c, s, interleaved))


# --------------------------------------------------------------------------- custom operator


def _rope_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None,
             interleaved: bool, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _rope(q, k, cos, sin, positions, interleaved, layout, False)


def _fake(q, k, cos, sin, positions, interleaved, layout):
    return torch.empty_like(q), torch.empty_like(k)


def _setup(ctx, inputs, output):
    q, k, cos, sin, positions, interleaved, layout = inputs
    ctx.attrs = (interleaved, layout)
    ctx.save_for_backward(cos, sin, positions)


def _backward(ctx, gq, gk):
    """rope's gradient is rope with -sin."""
    cos, sin, positions = ctx.saved_tensors
    interleaved, layout = ctx.attrs
    gq, gk = torch.ops.ops_adv.rope(gq.contiguous(), gk.contiguous(), cos, -sin, positions, interleaved, layout)
    return gq, gk, None, None, None, None, None


define("rope", _rope_op, _fake, setup=_setup, backward=_backward)
register_function("rope", rope)
