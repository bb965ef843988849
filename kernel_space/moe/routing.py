"""Routing shared by every moe implementation: softmax over experts, top-k, renormalisation (Mixtral), and the
alignment of token slots by expert that the grouped kernels read (vLLM's moe_align_block_size, in torch ops that
never wait on the GPU, so the path stays capturable in a CUDA graph)."""
from __future__ import annotations

import torch


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, top_k], expert ids int64 [T, top_k]): softmax in fp32 over experts, the top_k largest,
    renormalised to sum to one when `renormalize` (Mixtral, Qwen3-MoE)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def padded_slots(slots: int, experts: int, block_m: int) -> int:
    """An upper bound of the aligned length: each non-empty expert pads its slots to a multiple of block_m."""
    return slots + min(experts, slots) * (block_m - 1)


def align(ids: torch.Tensor, experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token slots (t * top_k + k) grouped by expert, each expert's run padded to a multiple of block_m.

    Returns (sorted_slots int32 [padded_slots], filled with `slots` past each run; expert of each block of
    block_m int32; the aligned length, a one-element int32 tensor). Blocks at or past that length are empty.
    """
    flat = ids.reshape(-1)
    slots = flat.numel()
    dev = flat.device
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    start = torch.cumsum(counts, 0) - counts
    expert_sorted = flat[order]
    pos = pad_end[expert_sorted] - padded[expert_sorted] + torch.arange(slots, device=dev) - start[expert_sorted]
    cap = padded_slots(slots, experts, block_m)
    sorted_slots = torch.full((cap,), slots, dtype=torch.int32, device=dev)
    sorted_slots.scatter_(0, pos, order.to(torch.int32))
    blocks = -(-cap // block_m)
    first = torch.arange(blocks, device=dev) * block_m
    block_expert = torch.searchsorted(pad_end, first, right=True).clamp_(max=experts - 1).to(torch.int32)
    return sorted_slots, block_expert, pad_end[-1:].to(torch.int32)
