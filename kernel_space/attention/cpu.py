"""attention on the CPU: query tiles, with an online softmax over key tiles (flash-style); never changes the thread count."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from .._registry import register_impl

if TYPE_CHECKING:
    from .problem import AttentionProblem


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
    },
    check=_check_chunked,
)
def cpu_chunked(q, k, v, causal: bool = False, *, block_q=64, block_kv=0):
    """Attention over query tiles; with block_kv, an online softmax over key tiles (flash-style)."""
    Sq, D = q.shape[-2:]
    Skv = k.shape[-2]
    scale = 1.0 / math.sqrt(D)
    out = torch.empty_like(q)
    kt = k.transpose(-1, -2)
    bkv = block_kv or Skv
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
