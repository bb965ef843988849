"""attention forward: softmax(Q Kᵀ / √D) V over (B, H, S, D) tensors.

Causal masking is aligned top-left (query i sees keys 0..i), as torch's
scaled_dot_product_attention does, also when Sq != Skv.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ._common import DTYPE_CODE, ITEMSIZE, cpu_thread_choices, generator, num_threads, randn, tolerance
from ._registry import OpSpec, register_impl, register_op


class AttentionProblem(NamedTuple):
    B: int
    H: int
    Sq: int
    Skv: int
    D: int
    causal: bool = False
    dtype: str = "fp32"


def signature(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False) -> tuple:
    B, H, Sq, D = q.shape
    return (B, H, Sq, k.shape[2], D, bool(causal), DTYPE_CODE[q.dtype])


def make_inputs(p: AttentionProblem, device, seed: int = 0):
    g = generator(seed)
    q = randn((p.B, p.H, p.Sq, p.D), p.dtype, device, g)
    k = randn((p.B, p.H, p.Skv, p.D), p.dtype, device, g)
    v = randn((p.B, p.H, p.Skv, p.D), p.dtype, device, g)
    return (q, k, v), {"causal": p.causal}


def reference(q, k, v, causal: bool = False) -> torch.Tensor:
    hi = torch.float64 if q.device.type == "cpu" else torch.float32
    s = (q.to(hi) @ k.to(hi).transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        Sq, Skv = s.shape[-2:]
        mask = torch.ones(Sq, Skv, dtype=torch.bool, device=q.device).tril()
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, dim=-1).nan_to_num(0.0) @ v.to(hi)


def _flops(p: AttentionProblem) -> float:
    f = 4.0 * p.B * p.H * p.Sq * p.Skv * p.D
    return f / 2 if p.causal else f


def default_problems(device_class: str) -> list[AttentionProblem]:
    if device_class == "cpu":
        return [
            AttentionProblem(1, 4, 256, 256, 64),
            AttentionProblem(1, 4, 256, 256, 64, causal=True),
            AttentionProblem(2, 4, 128, 512, 64),
        ]
    return [
        AttentionProblem(4, 32, 2048, 2048, 128, False, "bf16"),
        AttentionProblem(4, 32, 2048, 2048, 128, True, "bf16"),
        AttentionProblem(1, 32, 8192, 8192, 128, True, "bf16"),
        AttentionProblem(16, 16, 512, 512, 64, False, "fp16"),
        AttentionProblem(8, 32, 1024, 4096, 128, False, "bf16"),
    ]


SPEC = register_op(
    OpSpec(
        name="attention",
        problem=AttentionProblem,
        signature=signature,
        make_inputs=make_inputs,
        reference=reference,
        tolerance=tolerance,
        flops=_flops,
        bytes_moved=lambda p: float(p.B * p.H * (2 * p.Sq + 2 * p.Skv) * p.D * ITEMSIZE[p.dtype]),
        size_fields=("B", "H", "Sq", "Skv", "D"),
        default_problems=default_problems,
    )
)


@register_impl("attention", name="sdpa", priority=100, backends=("cpu", "cuda"), vendor=True)
def sdpa(q, k, v, causal: bool = False):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _check_chunked(p: AttentionProblem, c) -> str | None:
    if c["block_q"] >= 2 * p.Sq and c["block_q"] > 16:
        return f"block_q {c['block_q']} is over twice Sq={p.Sq}"
    if c["block_kv"] and c["block_kv"] >= p.Skv:
        return f"block_kv {c['block_kv']} does not split Skv={p.Skv}"
    return None


@register_impl(
    "attention",
    name="cpu_chunked",
    priority=10,
    backends=("cpu",),
    space={
        "block_q": (64, 16, 32, 128, 256, 512),
        "block_kv": (0, 64, 128, 256),  # 0: all keys at once; else online softmax over key blocks
        "threads": cpu_thread_choices(),
    },
    check=_check_chunked,
)
def cpu_chunked(q, k, v, causal: bool = False, *, block_q=64, block_kv=0, threads=0):
    """Attention over query tiles; with block_kv, an online softmax over key tiles (flash-style)."""
    Sq, D = q.shape[-2:]
    Skv = k.shape[-2]
    scale = 1.0 / math.sqrt(D)
    out = torch.empty_like(q)
    kt = k.transpose(-1, -2)
    bkv = block_kv or Skv
    with num_threads(threads):
        for i in range(0, Sq, block_q):
            qi = q[..., i : i + block_q, :] * scale
            rows = qi.shape[-2]
            kv_end = min(Skv, i + rows) if causal else Skv
            m = torch.full(qi.shape[:-1] + (1,), float("-inf"), dtype=torch.float32, device=q.device)
            l = torch.zeros_like(m)
            acc = torch.zeros(qi.shape, dtype=torch.float32, device=q.device)
            for j in range(0, kv_end, bkv):
                s = (qi @ kt[..., j : j + bkv]).float()
                if causal and j + s.shape[-1] > i:
                    qpos = torch.arange(i, i + rows, device=q.device).unsqueeze(1)
                    kpos = torch.arange(j, j + s.shape[-1], device=q.device).unsqueeze(0)
                    s = s.masked_fill(kpos > qpos, float("-inf"))
                m_new = torch.maximum(m, s.amax(-1, keepdim=True))
                p = torch.exp(s - m_new)
                alpha = torch.exp(m - m_new)
                l = l * alpha + p.sum(-1, keepdim=True)
                acc = acc * alpha + p.to(v.dtype) @ v[..., j : j + bkv, :]
                m = m_new
            out[..., i : i + rows, :] = (acc / l).to(q.dtype)
    return out


def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, name)

    def run(q, k, v, causal: bool = False):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def _check_sdpa_flash(p: AttentionProblem, c) -> str | None:
    if p.dtype == "fp32":
        return "flash backend needs fp16 or bf16"
    if p.D > 256 or p.D % 8:
        return f"flash backend needs D ≤ 256 and a multiple of 8, not {p.D}"
    return None


def _check_sdpa_cudnn(p: AttentionProblem, c) -> str | None:
    if p.dtype == "fp32":
        return "cuDNN backend needs fp16 or bf16"
    if p.D > 128 or p.D % 8:
        return f"cuDNN backend needs D ≤ 128 and a multiple of 8, not {p.D}"
    return None


# Each SDPA backend is its own vendor candidate on CUDA, so the tuner compares against the best.
register_impl("attention", name="sdpa_flash", priority=95, backends=("cuda",), vendor=True, check=_check_sdpa_flash)(
    _sdpa_backend("FLASH_ATTENTION")
)
register_impl("attention", name="sdpa_cudnn", priority=94, backends=("cuda",), vendor=True, check=_check_sdpa_cudnn)(
    _sdpa_backend("CUDNN_ATTENTION")
)
register_impl("attention", name="sdpa_efficient", priority=93, backends=("cuda",), vendor=True)(
    _sdpa_backend("EFFICIENT_ATTENTION")
)
