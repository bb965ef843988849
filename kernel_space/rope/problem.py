"""rope: q (tokens, Hq, D) and k (tokens, Hkv, D) rotated by per-token angles. The problem, its inputs and reference.

Canonical form: q and k as (B, S, H, D) or (T, H, D) with unit stride along D (other strides free,
so transformers' (B, H, S, D) is the transposed view of the same problem). cos/sin are either
per-token tables, (S, D) or (B, S, D) as transformers' LlamaRotaryEmbedding returns them (their
halves duplicated), or a (max_pos, D/2) cache read at `positions` (B, S) (`positions=True`).
Layouts: rotate-half (Llama: pair i is (i, i + D/2)) or interleaved (GPT-J: pair i is (2i, 2i+1)).

Every implementation returns, without `out`, q's and k's results packed head-wise in one
(..., Hq + Hkv, D) tensor (what the reference returns, so one comparison gates both); with
`out=(q_out, k_out)` it writes those (they may be q and k themselves: in place) and returns them.
In place moves the same bytes through the same kernel, so it shares the out-of-place problem:
a problem field would need inputs the tuner's shared, reused inputs cannot give (it rotates them).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .._common import DTYPE_CODE, DTYPES, ITEMSIZE, generator, randn
from .._registry import define_op


class RopeProblem(NamedTuple):
    tokens: int  # B * S
    Hq: int
    Hkv: int
    D: int
    interleaved: bool = False  # GPT-J pairs (2i, 2i+1); else rotate-half (i, i + D/2)
    positions: bool = False  # cos/sin gathered from a (max_pos, D/2) cache at `positions`
    dtype: str = "fp32"


def signature(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              positions: torch.Tensor | None = None, *, interleaved: bool = False, out=None) -> tuple:
    D = q.shape[-1]
    Hq = q.shape[-2]
    return (q.numel() // (Hq * D), Hq, k.shape[-2], D, bool(interleaved), positions is not None, DTYPE_CODE[q.dtype])


def make_inputs(p: RopeProblem, device, seed: int = 0):
    g = generator(seed)
    q = randn((p.tokens, p.Hq, p.D), p.dtype, device, g)
    k = randn((p.tokens, p.Hkv, p.D), p.dtype, device, g)
    if p.positions:
        max_pos = max(2 * p.tokens, 64)
        pos = torch.randint(0, max_pos, (p.tokens,), generator=g).to(device)
        angles = _angles(torch.arange(max_pos, dtype=torch.float64), p.D)  # (max_pos, D/2)
        cos, sin = angles.cos(), angles.sin()
    else:
        pos = None
        angles = _angles(torch.arange(p.tokens, dtype=torch.float64), p.D)
        # transformers' tables: rotate-half repeats the halves, GPT-J repeats each frequency twice
        angles = angles.repeat_interleave(2, -1) if p.interleaved else torch.cat([angles, angles], -1)
        cos, sin = angles.cos(), angles.sin()
    dt = DTYPES[p.dtype]
    return (q, k, cos.to(device, dt), sin.to(device, dt), pos), {"interleaved": p.interleaved}


def _angles(pos: torch.Tensor, D: int, base: float = 10000.0) -> torch.Tensor:
    inv = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    return pos[:, None] * inv[None, :]


def half_tables(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None,
                interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin as (..., tokens, 1, D/2) per-token angles that broadcast against q (..., tokens, H, D)."""
    half = q.shape[-1] // 2
    if positions is not None:
        cos, sin = cos[positions], sin[positions]  # (..., D/2) from the cache
    if cos.shape[-1] != half:  # a full-width transformers table
        cos, sin = (cos[..., ::2], sin[..., ::2]) if interleaved else (cos[..., :half], sin[..., :half])
    return cos.unsqueeze(-2), sin.unsqueeze(-2)


def rotate(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x rotated pairwise by (c, s) of shape (..., D/2), in x's precision."""
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], -1).flatten(-2)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)


def reference(q, k, cos, sin, positions=None, *, interleaved: bool = False, out=None) -> torch.Tensor:
    """q's and k's rotations packed head-wise, (..., Hq + Hkv, D), in float64 (CPU) or float32 (GPU)."""
    hi = torch.float64 if q.device.type == "cpu" else torch.float32
    c, s = half_tables(q, cos.to(hi), sin.to(hi), positions, interleaved)
    return torch.cat([rotate(q.to(hi), c, s, interleaved), rotate(k.to(hi), c, s, interleaved)], -2)


def default_problems(device_class: str) -> list[RopeProblem]:
    if device_class == "cpu":
        return [RopeProblem(37, 4, 2, 64), RopeProblem(16, 4, 4, 16, True), RopeProblem(20, 4, 1, 32, False, True)]
    # Llama-3-8B / Mistral-7B (32/8/128) and Qwen2-7B (28/4/128) at prefill and decode token counts.
    out = []
    for hq, hkv in ((32, 8), (28, 4)):
        for t in (1, 32, 2048, 8192, 16384):
            out.append(RopeProblem(t, hq, hkv, 128, False, False, "bf16"))
    out += [RopeProblem(8192, 32, 8, 128, True, False, "bf16"), RopeProblem(8192, 32, 8, 128, False, True, "bf16"),
            RopeProblem(8192, 32, 8, 128, False, False, "fp16"), RopeProblem(2048, 16, 16, 64, False, False, "bf16")]
    return out


def bytes_moved(p: RopeProblem) -> float:
    """q and k read and written, and a cos and sin row (D/2 each) per token."""
    return float((2 * (p.Hq + p.Hkv) * p.D + p.D) * p.tokens * ITEMSIZE[p.dtype])


SPEC = define_op("rope", RopeProblem, signature, make_inputs, reference, size_fields=("tokens", "Hq", "Hkv", "D"),
                 streaming=("tokens",), flops=lambda p: 3.0 * p.tokens * (p.Hq + p.Hkv) * p.D,
                 bytes_moved=bytes_moved, default_problems=default_problems)
