"""decode attention's Triton kernels (flash-decoding) and their launch (needs triton).

One program loads the K/V blocks of its split once for HEADS_PER_PROGRAM query heads that
share a K/V head (x Sq query rows, padded to a tl.dot tile) and keeps an online softmax in
fp32. With one split it writes the output; with several it writes normalised partials and
their log-sum-exp, and `_decode_combine` merges them. A key mask (one byte a key, read once per
program for all its heads) hides keys inside the blocks.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@triton.jit
def _seq_len(LENS, b, Skv, HAS_LENS: tl.constexpr):
    """Keys sequence b sees: seq_lens[b] clamped to [0, Skv], or Skv."""
    if HAS_LENS:
        L = tl.load(LENS + b).to(tl.int32)
        return tl.maximum(tl.minimum(L, Skv), 0)
    return Skv


@triton.jit
def _split_len(L, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys per split of a sequence of L keys: whole blocks, at least one."""
    per = tl.cdiv(tl.cdiv(L, NUM_SPLITS), BLOCK_N) * BLOCK_N
    return tl.maximum(per, BLOCK_N)


@triton.jit
def _decode_blocks(
    acc, l_i, m_i, q, K, V, KM,
    stride_kn, stride_kd, stride_vn, stride_vd, stride_kmn,
    lim, lo, hi, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    HAS_MASK: tl.constexpr,
):
    """Online softmax over key blocks [lo, hi). MASKED blocks may cross hi or a row's causal limit `lim`;
    with HAS_MASK, KM (this sequence's key mask) hides keys in every block."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    kt_ptrs = K + offs_d[:, None] * stride_kd + offs_n[None, :] * stride_kn  # Kᵀ tile (BLOCK_D, BLOCK_N)
    v_ptrs = V + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        # A mask along D only when D was padded: one on the contiguous axis stops vector loads.
        if MASKED:
            col_ok = cols < hi
            if HEAD_DIM == BLOCK_D:
                kt = tl.load(kt_ptrs + start_n * stride_kn, mask=col_ok[None, :], other=0.0)
                v = tl.load(v_ptrs + start_n * stride_vn, mask=col_ok[:, None], other=0.0)
            else:
                kt = tl.load(kt_ptrs + start_n * stride_kn, mask=col_ok[None, :] & d_ok[:, None], other=0.0)
                v = tl.load(v_ptrs + start_n * stride_vn, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        elif HEAD_DIM == BLOCK_D:
            kt = tl.load(kt_ptrs + start_n * stride_kn)
            v = tl.load(v_ptrs + start_n * stride_vn)
        else:
            kt = tl.load(kt_ptrs + start_n * stride_kn, mask=d_ok[:, None], other=0.0)
            v = tl.load(v_ptrs + start_n * stride_vn, mask=d_ok[None, :], other=0.0)
        qk = tl.dot(q, kt) * qk_scale  # scores in log2 units
        if MASKED:
            qk = tl.where(col_ok[None, :] & (cols[None, :] <= lim[:, None]), qk, float("-inf"))
        if HAS_MASK:
            keep = tl.load(KM + cols * stride_kmn, mask=cols < hi, other=0) != 0
            qk = tl.where(keep[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        if MASKED or HAS_MASK:
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _decode_fwd(
    Q, K, V, O, LENS, KM, Part, Lse, qk_scale,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_kmb, stride_kmn,
    Hq, Hkv, Sq, Skv,
    GROUP: tl.constexpr, HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_LENS: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
):
    pid_g = tl.program_id(0)  # fastest: programs of one K/V head run together and share it in L2
    pid_s = tl.program_id(1)
    pid_bk = tl.program_id(2)
    b = pid_bk // Hkv
    kvh = pid_bk % Hkv
    L = _seq_len(LENS, b, Skv, HAS_LENS)
    if NUM_SPLITS > 1:
        per = _split_len(L, NUM_SPLITS, BLOCK_N)
        start = pid_s * per
        if start >= L:
            return  # nothing to do: the combine counts only splits that start inside L
        end = tl.minimum(start + per, L)
    else:
        start = 0
        end = L

    # Row r of the tile: query head kvh*GROUP + pid_g*HEADS + r // Sq, query position r % Sq.
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < HEADS * Sq
    qpos = rows % Sq
    qhead = (kvh * GROUP + pid_g * HEADS + rows // Sq).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    io_mask = row_ok[:, None]
    if HEAD_DIM != BLOCK_D:
        io_mask = io_mask & (offs_d < HEAD_DIM)[None, :]
    b64 = b.to(tl.int64)
    q_ptrs = Q + b64 * stride_qb + qhead[:, None] * stride_qh + qpos[:, None] * stride_qm + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=io_mask, other=0.0)
    K += b64 * stride_kb + kvh.to(tl.int64) * stride_kh
    V += b64 * stride_vb + kvh.to(tl.int64) * stride_vh
    KM += b64 * stride_kmb

    # Keys below `safe` are visible to every row: blocks wholly below it need no mask.
    if CAUSAL:
        lim = L - Sq + qpos  # bottom-right: query i sees keys j <= L - Sq + i
        safe = L - Sq + 1
    else:
        lim = tl.full([BLOCK_M], 0, tl.int32) + L - 1
        safe = L
    full = start + tl.maximum(tl.minimum(end, safe) - start, 0) // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    acc, l_i, m_i = _decode_blocks(
        acc, l_i, m_i, q, K, V, KM, stride_kn, stride_kd, stride_vn, stride_vd, stride_kmn,
        lim, start, full, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_N, False, HAS_MASK,
    )
    acc, l_i, m_i = _decode_blocks(
        acc, l_i, m_i, q, K, V, KM, stride_kn, stride_kd, stride_vn, stride_vd, stride_kmn,
        lim, full, end, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_N, True, HAS_MASK,
    )
    seen = l_i > 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]  # a row that saw no key gives 0
    if NUM_SPLITS > 1:
        part_row = ((b64 * Hq + qhead) * Sq + qpos) * NUM_SPLITS + pid_s
        tl.store(Part + part_row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=io_mask)
        lse = tl.where(seen, m_i + tl.math.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(Lse + part_row, lse, mask=row_ok)
    else:
        o_ptrs = O + b64 * stride_ob + qhead[:, None] * stride_oh + qpos[:, None] * stride_om + offs_d[None, :] * stride_od
        tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=io_mask)


@triton.jit
def _decode_combine(
    O, LENS, Part, Lse,
    stride_ob, stride_oh, stride_om, stride_od,
    Hq, Sq, Skv,
    NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HAS_LENS: tl.constexpr,
):
    """Merge one query row's split partials by their log-sum-exp (splits past the sequence were never written)."""
    row = tl.program_id(0).to(tl.int64)  # ((b * Hq) + h) * Sq + i
    b = row // (Hq * Sq)
    h = (row // Sq) % Hq
    i = row % Sq
    L = _seq_len(LENS, b, Skv, HAS_LENS)
    n_valid = tl.cdiv(L, _split_len(L, NUM_SPLITS, BLOCK_N))
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < n_valid
    lse = tl.load(Lse + row * NUM_SPLITS + offs_s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(lse - m)  # 0 for splits that saw nothing
    part = tl.load(
        Part + (row * NUM_SPLITS + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_ok[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0,
    )
    total = tl.sum(w, 0)
    o = tl.sum(part * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(O + b * stride_ob + h * stride_oh + i * stride_om + offs_d * stride_od, o.to(O.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor | None, causal: bool,
    BLOCK_N: int, num_splits: int, HEADS_PER_PROGRAM: int, num_warps: int, num_stages: int,
    scale: float | None = None, key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    B, Hq, Sq, D = q.shape
    _, Hkv, Skv, _ = k.shape
    if k.shape != (B, Hkv, Skv, D) or v.shape != k.shape or Hq % Hkv:
        raise ValueError(f"decode_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match")
    group = Hq // Hkv
    heads = HEADS_PER_PROGRAM or group
    out = q.new_empty((B, Hq, Sq, D))
    block_d = max(16, triton.next_power_of_2(D))
    block_m = max(16, triton.next_power_of_2(heads * Sq))
    qk_scale = _LOG2E * (scale if scale is not None else 1.0 / math.sqrt(D))
    lens = seq_lens if seq_lens is not None else out  # never read without seq_lens
    if key_mask is not None:
        if key_mask.shape != (B, Skv) or key_mask.dtype != torch.bool:
            raise ValueError(f"decode_attention: key_mask must be bool of shape ({B}, {Skv}), not {key_mask.dtype} "
                             f"of shape {tuple(key_mask.shape)}")
        km = key_mask.view(torch.uint8)  # the same bytes, any strides (a view of a 4-D mask's last row)
    else:
        km = out  # never read without key_mask
    if num_splits > 1:
        part = torch.empty((B * Hq * Sq, num_splits, D), device=q.device, dtype=torch.float32)
        lse = torch.empty((B * Hq * Sq, num_splits), device=q.device, dtype=torch.float32)
    else:
        part = lse = out  # never touched with one split
    _decode_fwd[(group // heads, num_splits, B * Hkv)](
        q, k, v, out, lens, km, part, lse, qk_scale,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        *(km.stride() if key_mask is not None else (0, 0)),
        Hq, Hkv, Sq, Skv,
        GROUP=group, HEADS=heads, NUM_SPLITS=num_splits,
        HEAD_DIM=D, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
        HAS_LENS=seq_lens is not None, CAUSAL=bool(causal), HAS_MASK=key_mask is not None,
        num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        _decode_combine[(B * Hq * Sq,)](
            out, lens, part, lse, *out.stride(), Hq, Sq, Skv,
            NUM_SPLITS=num_splits, SPLITS_P2=triton.next_power_of_2(num_splits), BLOCK_N=BLOCK_N,
            HEAD_DIM=D, BLOCK_D=block_d, HAS_LENS=seq_lens is not None,
            num_warps=4 if block_d >= 128 else 2,
        )
    return out
