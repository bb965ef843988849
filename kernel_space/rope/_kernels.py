"""rope's Triton kernel and its launch (needs triton; `triton.py` imports this on the first call).

Rotations run in fp32 and round once to the output dtype.
"""
# No `from __future__ import annotations`: Triton reads the tl.constexpr annotations.
import torch
import triton
import triton.language as tl

from .._common import pow2_at_least
from .vendor import split_out


@triton.jit
def _rotate_heads(X, Y, row_x, row_y, tmask, h0, H, sxh, syh, d, dmask, c, s,
                  HALF, INTERLEAVED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_HALF: tl.constexpr):
    """Rotate heads h0 .. h0 + BLOCK_H of X's token rows into Y (which may be X: everything loads first)."""
    h = h0 + tl.arange(0, BLOCK_H)
    hm = tmask[:, None, None] & (h < H)[None, :, None]
    px = X + row_x[:, None, None] + (h * sxh)[None, :, None]
    py = Y + row_y[:, None, None] + (h * syh)[None, :, None]
    if INTERLEAVED:
        # The whole row in one contiguous (vectorised) load, then pairs (2i, 2i+1) split in registers.
        j = tl.arange(0, 2 * BLOCK_HALF)
        m = hm & (j < 2 * HALF)[None, None, :]
        x = tl.load(px + j[None, None, :], mask=m, other=0.0).to(tl.float32)
        x1, x2 = tl.split(tl.reshape(x, (BLOCK_T, BLOCK_H, BLOCK_HALF, 2)))
        y = tl.join(x1 * c - x2 * s, x2 * c + x1 * s)
        tl.store(py + j[None, None, :], tl.reshape(y, (BLOCK_T, BLOCK_H, 2 * BLOCK_HALF)).to(Y.dtype.element_ty), mask=m)
    else:
        m = hm & dmask[None, None, :]
        x1 = tl.load(px + d[None, None, :], mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(px + (d + HALF)[None, None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(py + d[None, None, :], (x1 * c - x2 * s).to(Y.dtype.element_ty), mask=m)
        tl.store(py + (d + HALF)[None, None, :], (x2 * c + x1 * s).to(Y.dtype.element_ty), mask=m)


@triton.jit
def rope_kernel(Q, K, QO, KO, COS, SIN, POS, T, S, Hq, Hkv, HALF,
                sqb, sqs, sqh, skb, sks, skh, sob, sos, soh, skob, skos, skoh,
                scb, scs, scd, spb, sps,
                INTERLEAVED: tl.constexpr, HAS_POS: tl.constexpr, SPLIT_HEADS: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    t = tl.where(tmask, t, 0).to(tl.int64)
    b = t // S
    s_ = t - b * S
    d = tl.arange(0, BLOCK_HALF)
    dmask = d < HALF
    if HAS_POS:
        p = tl.load(POS + b * spb + s_ * sps, mask=tmask, other=0).to(tl.int64)
        crow = p * scs
    else:
        crow = b * scb + s_ * scs
    cm = tmask[:, None] & dmask[None, :]
    cp = crow[:, None] + (d * scd)[None, :]
    c = tl.load(COS + cp, mask=cm, other=0.0).to(tl.float32)[:, None, :]
    s = tl.load(SIN + cp, mask=cm, other=0.0).to(tl.float32)[:, None, :]
    rq, rqo = b * sqb + s_ * sqs, b * sob + s_ * sos
    rk, rko = b * skb + s_ * sks, b * skob + s_ * skos
    if SPLIT_HEADS:
        g = tl.program_id(1)
        nq = tl.cdiv(Hq, BLOCK_H)
        if g < nq:
            _rotate_heads(Q, QO, rq, rqo, tmask, g * BLOCK_H, Hq, sqh, soh, d, dmask, c, s, HALF, INTERLEAVED,
                          BLOCK_T, BLOCK_H, BLOCK_HALF)
        else:
            _rotate_heads(K, KO, rk, rko, tmask, (g - nq) * BLOCK_H, Hkv, skh, skoh, d, dmask, c, s, HALF,
                          INTERLEAVED, BLOCK_T, BLOCK_H, BLOCK_HALF)
    else:
        for h0 in range(0, Hq, BLOCK_H):
            _rotate_heads(Q, QO, rq, rqo, tmask, h0, Hq, sqh, soh, d, dmask, c, s, HALF, INTERLEAVED, BLOCK_T, BLOCK_H, BLOCK_HALF)
        for h0 in range(0, Hkv, BLOCK_H):
            _rotate_heads(K, KO, rk, rko, tmask, h0, Hkv, skh, skoh, d, dmask, c, s, HALF, INTERLEAVED, BLOCK_T, BLOCK_H, BLOCK_HALF)


def _bshd(x: torch.Tensor) -> torch.Tensor:
    """x as a (B, S, H, D) view."""
    return x if x.dim() == 4 else x.reshape((1,) * (4 - x.dim()) + x.shape)


def launch(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None, *,
           interleaved: bool, out, BLOCK_T: int, BLOCK_H: int, SPLIT_HEADS: bool, num_warps: int):
    """q (B, S, Hq, D) or (T, Hq, D), k likewise; any strides with unit stride along D (else copied)."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    qo, ko, ret = split_out(q, k, out)
    q4, k4, qo4, ko4 = _bshd(q), _bshd(k), _bshd(qo), _bshd(ko)
    B, S, Hq, D = q4.shape
    Hkv = k4.shape[2]
    half = D // 2
    if sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    scd = cos.stride(-1) * (2 if interleaved and cos.shape[-1] == D else 1)
    if positions is not None:
        scb, scs = 0, cos.stride(0)  # a (max_pos, D/2 or D) cache
        pos = positions.reshape((1,) * (2 - positions.dim()) + positions.shape) if positions.dim() < 2 else positions
        spb = pos.stride(0) if pos.shape[0] > 1 else 0
        sps = pos.stride(1) if pos.shape[1] > 1 else 0
    else:
        pos, spb, sps = cos, 0, 0
        c3 = cos.reshape((1,) * (3 - cos.dim()) + cos.shape) if cos.dim() < 3 else cos
        scb = c3.stride(0) if c3.shape[0] > 1 else 0
        scs = c3.stride(1) if c3.shape[1] > 1 else 0
    T = B * S
    if T and (Hq or Hkv):
        groups = -(-Hq // BLOCK_H) + -(-Hkv // BLOCK_H) if SPLIT_HEADS else 1
        rope_kernel[(triton.cdiv(T, BLOCK_T), groups)](
            q4, k4, qo4, ko4, cos, sin, pos, T, S, Hq, Hkv, half,
            q4.stride(0), q4.stride(1), q4.stride(2), k4.stride(0), k4.stride(1), k4.stride(2),
            qo4.stride(0), qo4.stride(1), qo4.stride(2), ko4.stride(0), ko4.stride(1), ko4.stride(2),
            scb, scs, scd, spb, sps,
            INTERLEAVED=interleaved, HAS_POS=positions is not None, SPLIT_HEADS=SPLIT_HEADS,
            BLOCK_T=BLOCK_T, BLOCK_H=BLOCK_H, BLOCK_HALF=pow2_at_least(half, 1), num_warps=num_warps,
        )
    return ret
