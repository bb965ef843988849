"""attention's Triton kernels (flash-attention forward) and their launch (needs triton)."""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@triton.jit
def _attn_blocks(
    acc, l_i, m_i, q, K, V,
    stride_kn, stride_kd, stride_vn, stride_vd,
    offs_m, lo, hi, Skv, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr,
):
    """Online softmax over key blocks [lo, hi); MASKED blocks may cross Skv or the causal diagonal."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    kt_ptrs = K + offs_d[:, None] * stride_kd + offs_n[None, :] * stride_kn  # Kᵀ tile (BLOCK_D, BLOCK_N)
    v_ptrs = V + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        # Masks along D only when D was padded to a power of two: any mask on the
        # contiguous axis would stop vectorised loads.
        if MASKED:
            col_ok = cols < Skv
            if HEAD_DIM == BLOCK_D:
                kt = tl.load(kt_ptrs + start_n * stride_kn, mask=col_ok[None, :], other=0.0)
            else:
                kt = tl.load(kt_ptrs + start_n * stride_kn, mask=col_ok[None, :] & d_ok[:, None], other=0.0)
        elif HEAD_DIM == BLOCK_D:
            kt = tl.load(kt_ptrs + start_n * stride_kn)
        else:
            kt = tl.load(kt_ptrs + start_n * stride_kn, mask=d_ok[:, None], other=0.0)
        qk = tl.dot(q, kt) * qk_scale  # scores in log2 units
        if MASKED:
            ok = col_ok[None, :]
            if CAUSAL:
                ok = ok & (cols[None, :] <= offs_m[:, None])
            qk = tl.where(ok, qk, float("-inf"))
        # Every row's first block holds key 0, which it always sees: m_new is finite.
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if MASKED:
            if HEAD_DIM == BLOCK_D:
                v = tl.load(v_ptrs + start_n * stride_vn, mask=col_ok[:, None], other=0.0)
            else:
                v = tl.load(v_ptrs + start_n * stride_vn, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        elif HEAD_DIM == BLOCK_D:
            v = tl.load(v_ptrs + start_n * stride_vn)
        else:
            v = tl.load(v_ptrs + start_n * stride_vn, mask=d_ok[None, :], other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(
    Q, K, V, O, qk_scale,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    H, Sq, Skv,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    pid_m = tl.program_id(0)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m  # longest rows (most key blocks) start first
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // H).to(tl.int64)
    off_h = (pid_bh % H).to(tl.int64)
    Q += off_b * stride_qb + off_h * stride_qh
    K += off_b * stride_kb + off_h * stride_kh
    V += off_b * stride_vb + off_h * stride_vh
    O += off_b * stride_ob + off_h * stride_oh

    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < Sq
    io_mask = row_ok[:, None]
    if HEAD_DIM != BLOCK_D:
        io_mask = io_mask & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(Q + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd, mask=io_mask, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Keys [0, full) are visible to every row of the block and inside Skv: no masks.
    # Keys [full, hi) cross Skv or the diagonal (query i sees keys 0..i); keys past hi
    # are invisible to the whole block and never loaded.
    if CAUSAL:
        hi = tl.minimum(Skv, start_m + BLOCK_M)
        full = tl.minimum((start_m + 1) // BLOCK_N * BLOCK_N, Skv // BLOCK_N * BLOCK_N)
    else:
        hi = Skv
        full = Skv // BLOCK_N * BLOCK_N
    acc, l_i, m_i = _attn_blocks(
        acc, l_i, m_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
        offs_m, 0, full, Skv, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_N, False, CAUSAL,
    )
    acc, l_i, m_i = _attn_blocks(
        acc, l_i, m_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
        offs_m, full, hi, Skv, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_N, True, CAUSAL,
    )
    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # a row that saw no key outputs 0
    o = acc / l_i[:, None]
    tl.store(O + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od, o.to(O.dtype.element_ty), mask=io_mask)


_SIDE_STREAMS: dict[int, list[torch.cuda.Stream]] = {}


def _side_streams(device: torch.device, n: int) -> list[torch.cuda.Stream]:
    """n streams besides the current one, created once per device."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    have = _SIDE_STREAMS.setdefault(idx, [])
    while len(have) < n:
        have.append(torch.cuda.Stream(device=idx))
    return have[:n]


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
    BLOCK_M: int, BLOCK_N: int, num_warps: int, num_stages: int, streams: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    B, H, Sq, D = q.shape
    Skv = k.shape[2]
    if k.shape != (B, H, Skv, D) or v.shape != k.shape:
        raise ValueError(f"attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match")
    if out is None:
        out = q.new_empty(q.shape)
    block_d = max(16, triton.next_power_of_2(D))
    qk_scale = _LOG2E / math.sqrt(D)

    def launch(qc, kc, vc, oc):
        _attn_fwd[(triton.cdiv(Sq, BLOCK_M), qc.shape[0] * H)](
            qc, kc, vc, oc, qk_scale,
            *qc.stride(), *kc.stride(), *vc.stride(), *oc.stride(),
            H, Sq, Skv,
            HEAD_DIM=D, BLOCK_D=block_d, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, CAUSAL=bool(causal),
            num_warps=num_warps, num_stages=num_stages,
        )

    n = min(streams, B)
    if n == 1:
        launch(q, k, v, out)
        return out
    bounds = [(B * i // n, B * (i + 1) // n) for i in range(n)]
    chunks = [(q[b0:b1], k[b0:b1], v[b0:b1], out[b0:b1]) for b0, b1 in bounds]
    if not q.is_cuda:
        for c in chunks:
            launch(*c)
        return out
    # Chunk 0 runs on the current stream, the others on side streams that start after
    # the work already queued and that the current stream waits for before returning.
    cur = torch.cuda.current_stream(q.device)
    side = _side_streams(q.device, n - 1)
    for s, c in zip(side, chunks[1:]):
        s.wait_stream(cur)
        with torch.cuda.stream(s):
            launch(*c)
    launch(*chunks[0])
    for s in side:
        cur.wait_stream(s)
    return out
