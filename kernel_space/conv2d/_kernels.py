"""conv2d's Triton kernel (implicit GEMM) and its launch (needs triton; `triton.py` imports this on the first call).

GEMM view: M = N·P·Q output pixels, N = K output channels, reduction over (r, s, c). Each
reduction step is one filter tap (r, s) and one block of BLOCK_K channels, so the channel
offsets of a step are contiguous and, in NHWC, so are the addresses (vectorised loads).
"""
# No `from __future__ import annotations`: Triton reads the tl.constexpr annotations.
import torch
import triton
import triton.language as tl

_GROUP_M = 8  # row tiles that share a weight tile in L2 (the usual grouped launch order)


@triton.jit
def conv2d_kernel(X, Wt, Y, Bias, N, C, H, W, K, P, Q,
                  sxn, sxc, sxh, sxw, swk, swc, swr, sws, syn, syk, syp, syq,
                  R: tl.constexpr, S: tl.constexpr, STRIDE: tl.constexpr, PAD: tl.constexpr, DIL: tl.constexpr,
                  NHWC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr, RELU: tl.constexpr):
    M = N * P * Q
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(K, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < K
    img = offs_m // (P * Q)
    pq = offs_m % (P * Q)
    p = pq // Q
    q = pq % Q
    h0 = p * STRIDE - PAD
    w0 = q * STRIDE - PAD
    x_img = X + img * sxn
    w_out = Wt + offs_n * swk

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    c_blocks = tl.cdiv(C, BLOCK_K)
    for i in range(0, R * S * c_blocks):  # pipelined by the launch's num_stages (it feeds a dot)
        rs = i // c_blocks
        c = (i % c_blocks) * BLOCK_K + offs_k
        r = rs // S
        s = rs % S
        h = h0 + r * DIL
        w = w0 + s * DIL
        a_ok = m_ok & (h >= 0) & (h < H) & (w >= 0) & (w < W)
        c_ok = c < C
        pix = h * sxh + w * sxw
        tap = r * swr + s * sws
        if NHWC:  # channels contiguous: 16-byte loads along c
            a = tl.load(x_img[:, None] + pix[:, None] + c[None, :] * sxc, mask=a_ok[:, None] & c_ok[None, :], other=0.0)
            b = tl.load(w_out[None, :] + c[:, None] * swc + tap, mask=c_ok[:, None] & n_ok[None, :], other=0.0)
        else:
            # Nothing is provably contiguous: lay tiles out with output pixels (NCHW: mostly
            # adjacent addresses) across threads, and weights (KCRS) with channels across threads.
            a = tl.trans(tl.load(x_img[None, :] + pix[None, :] + c[:, None] * sxc,
                                 mask=a_ok[None, :] & c_ok[:, None], other=0.0))
            b = tl.trans(tl.load(w_out[:, None] + c[None, :] * swc + tap, mask=n_ok[:, None] & c_ok[None, :], other=0.0))
        acc = tl.dot(a, b, acc)

    # Epilogue (conv2d_bn_relu): a per-channel bias (BatchNorm folded in) and ReLU, in fp32 before the cast.
    if HAS_BIAS:
        acc += tl.load(Bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if RELU:
        acc = tl.maximum(acc, 0.0)

    y_pix = Y + img * syn + p * syp + q * syq
    if NHWC:
        tl.store(y_pix[:, None] + offs_n[None, :] * syk, acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
    else:
        y = tl.trans(acc.to(Y.dtype.element_ty))
        tl.store(y_pix[None, :] + offs_n[:, None] * syk, y, mask=m_ok[None, :] & n_ok[:, None])


def conv2d(x: torch.Tensor, weight: torch.Tensor, stride: int, padding: int, dilation: int, *, layout: str,
           BLOCK_M: int, BLOCK_N: int, BLOCK_K: int, num_warps: int, num_stages: int,
           out: torch.Tensor | None = None, bias: torch.Tensor | None = None, relu: bool = False) -> torch.Tensor:
    """Convolve in `layout` ("nhwc" or "nchw"), converting x and weight to it when they differ;
    then add `bias` (K,) per output channel and apply ReLU when asked (fp32 epilogue)."""
    fmt = torch.channels_last if layout == "nhwc" else torch.contiguous_format
    x = x.contiguous(memory_format=fmt)
    weight = weight.contiguous(memory_format=fmt)
    N, C, H, W = x.shape
    K, _, R, S = weight.shape
    P = (H + 2 * padding - dilation * (R - 1) - 1) // stride + 1
    Q = (W + 2 * padding - dilation * (S - 1) - 1) // stride + 1
    if out is None:
        out = torch.empty((N, K, P, Q), dtype=x.dtype, device=x.device, memory_format=fmt)
    grid = (triton.cdiv(N * P * Q, BLOCK_M) * triton.cdiv(K, BLOCK_N),)
    conv2d_kernel[grid](
        x, weight, out, bias if bias is not None else out, N, C, H, W, K, P, Q, *x.stride(), *weight.stride(), *out.stride(),
        R=R, S=S, STRIDE=stride, PAD=padding, DIL=dilation, NHWC=layout == "nhwc",
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, GROUP_M=_GROUP_M,
        HAS_BIAS=bias is not None, RELU=relu,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
