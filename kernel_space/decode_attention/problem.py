"""decode attention: softmax(Q Kᵀ / √D) V for Sq (1-16) new tokens against a K/V cache.

q (B, Hq, Sq, D); k, v (B, Hkv, Skv, D) with Hq a multiple of Hkv (grouped-query heads share a
K/V head; nothing is copied). Optional `seq_lens` (B,) int32/int64: sequence b attends to keys
[0, seq_lens[b]) only (a ragged serving batch over a preallocated cache of capacity Skv; lengths
over Skv count as Skv). `causal` aligns bottom-right against each sequence's length L: query i
sees keys j <= L - Sq + i. Optional `key_mask` (B, Skv) bool: sequence b sees key j only where
key_mask[b, j] (left padding, or any padding of a cache's slots). A query row that sees no key
outputs zeros.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .._common import DTYPE_CODE, ITEMSIZE, generator, randn
from .._registry import define_op


class DecodeAttentionProblem(NamedTuple):
    B: int
    Hq: int
    Hkv: int
    Sq: int
    Skv: int
    D: int
    ragged: bool = False  # seq_lens given
    causal: bool = False
    dtype: str = "fp16"
    masked: bool = False  # key_mask given (last, so tables from before it keep their keys)


def signature(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: torch.Tensor | None = None,
              causal: bool = False, key_mask: torch.Tensor | None = None) -> tuple:
    B, Hq, Sq, D = q.shape
    return (B, Hq, k.shape[1], Sq, k.shape[2], D, seq_lens is not None, bool(causal), DTYPE_CODE[q.dtype],
            key_mask is not None)


def make_lens(B: int, Skv: int, g: torch.Generator) -> torch.Tensor:
    """A spread of lengths in [0, Skv]: the first sequence full, the second empty (B > 1), the rest random."""
    lens = torch.randint(1, Skv + 1, (B,), generator=g, dtype=torch.int64)
    lens[0] = Skv
    if B > 1:
        lens[1] = 0
    return lens.to(torch.int32)


def make_key_mask(B: int, Skv: int, g: torch.Generator) -> torch.Tensor:
    """Left padding of a different length per sequence (the first none, at most half the keys), and a
    few keys masked further on (a mask is not always a range)."""
    j = torch.arange(Skv)
    pad = torch.randint(0, max(1, Skv // 2), (B, 1), generator=g)
    pad[0] = 0
    return (j[None, :] >= pad) & (torch.rand(B, Skv, generator=g) > 0.05)


def make_inputs(p: DecodeAttentionProblem, device, seed: int = 0):
    g = generator(seed)
    q = randn((p.B, p.Hq, p.Sq, p.D), p.dtype, device, g)
    k = randn((p.B, p.Hkv, p.Skv, p.D), p.dtype, device, g)
    v = randn((p.B, p.Hkv, p.Skv, p.D), p.dtype, device, g)
    attrs: dict = {"causal": p.causal}
    if p.masked:
        attrs["key_mask"] = make_key_mask(p.B, p.Skv, g).to(device)
    if p.ragged:
        return (q, k, v, make_lens(p.B, p.Skv, g).to(device)), attrs
    return (q, k, v), attrs


def visible(B: int, Sq: int, Skv: int, seq_lens: torch.Tensor | None, causal: bool, device,
            key_mask: torch.Tensor | None = None) -> torch.Tensor | None:
    """Boolean mask (B, 1, Sq, Skv) of the keys each query row sees, or None when it sees all of them.

    Built on the device from `seq_lens` and `key_mask` without reading them on the host (capturable in
    CUDA graphs).
    """
    if key_mask is not None:
        km = key_mask.to(device=device, dtype=torch.bool).view(B, 1, 1, Skv)
        ok = visible(B, Sq, Skv, seq_lens, causal, device)
        return km.expand(B, 1, Sq, Skv) if ok is None else ok & km
    if seq_lens is None and not (causal and Sq > 1):
        return None
    j = torch.arange(Skv, device=device)
    if seq_lens is None:
        L = torch.full((B,), Skv, device=device, dtype=torch.int64)
    else:
        L = seq_lens.to(device=device, dtype=torch.int64).clamp(max=Skv)
    L = L.view(B, 1, 1, 1)
    ok = j.view(1, 1, 1, Skv) < L
    if causal:
        i = torch.arange(Sq, device=device).view(1, 1, Sq, 1)
        ok = ok & (j.view(1, 1, 1, Skv) <= L - Sq + i)
    return ok.expand(B, 1, Sq, Skv)


def reference(q, k, v, seq_lens=None, causal: bool = False, key_mask=None) -> torch.Tensor:
    hi = torch.float64 if q.device.type == "cpu" else torch.float32
    B, Hq, Sq, D = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    qh = q.to(hi).view(B, Hkv, G * Sq, D)  # query heads of one K/V head side by side
    s = (qh @ k.to(hi).transpose(-1, -2)).view(B, Hkv, G, Sq, Skv) / math.sqrt(D)
    ok = visible(B, Sq, Skv, seq_lens, causal, q.device, key_mask)
    if ok is not None:
        s = s.masked_fill(~ok.view(B, 1, 1, Sq, Skv), float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0).view(B, Hkv, G * Sq, Skv)
    return (p @ v.to(hi)).view(B, Hq, Sq, D)


def _flops(p: DecodeAttentionProblem) -> float:
    return 4.0 * p.B * p.Hq * p.Sq * p.Skv * p.D


def _bytes(p: DecodeAttentionProblem) -> float:
    """K and V read once (per K/V head, not per query head), Q read and O written (and a key mask)."""
    return float((2 * p.B * p.Hkv * p.Skv + 2 * p.B * p.Hq * p.Sq) * p.D * ITEMSIZE[p.dtype] + p.masked * p.B * p.Skv)


def default_problems(device_class: str) -> list[DecodeAttentionProblem]:
    P = DecodeAttentionProblem
    if device_class == "cpu":
        return [
            P(2, 8, 2, 1, 200, 64, False, False, "fp32"),  # 200 keys: no block size divides them
            P(3, 8, 2, 4, 333, 64, True, True, "fp32"),  # ragged (one empty sequence), bottom-right causal
            P(4, 4, 4, 1, 96, 32, True, False, "fp16"),
            P(3, 8, 2, 1, 150, 64, True, False, "fp32", True),  # left padding under a ragged cache
        ]
    # Llama-3-8B / Mistral-7B (32 query heads over 8 K/V heads) and Qwen2-7B (28 over 4), D 128.
    return [
        P(1, 32, 8, 1, 4096, 128, False, False, "bf16"),
        P(8, 32, 8, 1, 4096, 128, False, False, "bf16"),
        P(8, 32, 8, 1, 16384, 128, False, False, "bf16"),
        P(32, 32, 8, 1, 4096, 128, True, False, "bf16"),
        P(4, 28, 4, 1, 16384, 128, False, False, "bf16"),
        P(8, 32, 8, 4, 8192, 128, False, True, "bf16"),
        P(16, 32, 8, 1, 32768, 128, True, False, "fp16"),
        P(8, 32, 8, 1, 1024, 128, True, False, "bf16", True),  # left-padded generate()
        P(8, 32, 8, 1, 8192, 128, True, False, "bf16", True),
    ]


SPEC = define_op("decode_attention", DecodeAttentionProblem, signature, make_inputs, reference,
                 size_fields=("B", "Hq", "Hkv", "Sq", "Skv", "D"), streaming=("B", "Skv"), flops=_flops,
                 bytes_moved=_bytes, default_problems=default_problems,
                 twins={"masked": False})  # the key mask is one byte a key: an unmasked winner suits a masked call
