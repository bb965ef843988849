"""moe: a sparse mixture-of-experts block's experts (Mixtral, Qwen-MoE). From router logits [T, E]: softmax over
experts, top_k, renormalised (Mixtral); then out[t] = sum_k w_k * down_e(silu(gate_e(x)) * up_e(x)) with
w13 [E, 2N, K] (gate rows, then up rows; transformers' gate_up_proj) and w2 [E, K, N] (down_proj).
The problem, its inputs and reference; the routing every implementation shares: softmax over experts, top-k,
renormalisation, and the alignment of token slots by expert that the grouped kernels read (vLLM's
moe_align_block_size, in torch ops that never wait on the GPU, so the path stays capturable in a CUDA graph)."""
from __future__ import annotations

from typing import NamedTuple

import torch

from .._common import DTYPE_CODE, DTYPES, ITEMSIZE, generator, randn
from .._registry import define_op

ACTIVATIONS = ("silu",)


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


class MoeProblem(NamedTuple):
    T: int  # tokens
    E: int  # experts
    top_k: int
    N: int  # intermediate size of one expert
    K: int  # hidden size
    dtype: str = "fp32"
    activation: str = "silu"
    renormalize: bool = True


def signature(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *, top_k: int,
              activation: str = "silu", renormalize: bool = True) -> tuple:
    return (x.shape[0], w13.shape[0], top_k, w2.shape[-1], x.shape[-1], DTYPE_CODE[x.dtype], activation, renormalize)


def make_inputs(p: MoeProblem, device, seed: int = 0):
    g = generator(seed)
    x = randn((p.T, p.K), p.dtype, device, g)
    # distinct logits a bf16 step apart (ranks spread over [-2, 2)): every implementation picks the same experts
    ranks = torch.argsort(torch.rand((p.T, p.E), generator=g), dim=-1).float()
    logits = (ranks * (4.0 / p.E) - 2.0).to(device=device, dtype=DTYPES[p.dtype])
    w13 = randn((p.E, 2 * p.N, p.K), p.dtype, device, g, p.K ** -0.5)
    w2 = randn((p.E, p.K, p.N), p.dtype, device, g, p.N ** -0.5)
    return (x, logits, w13, w2), {"top_k": p.top_k, "activation": p.activation, "renormalize": p.renormalize}


def reference(x, router_logits, w13, w2, *, top_k: int, activation: str = "silu", renormalize: bool = True):
    """Per expert, in float64 on the CPU or true fp32 on a GPU (no TF32)."""
    hi = torch.float64 if x.device.type == "cpu" else torch.float32
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        weights, ids = route(router_logits.to(hi), top_k, renormalize)
        xh = x.to(hi)
        out = torch.zeros(x.shape, dtype=hi, device=x.device)
        n = w2.shape[-1]
        for e in range(w13.shape[0]):
            tok, k = torch.where(ids == e)
            if tok.numel() == 0:
                continue
            h = xh[tok] @ w13[e].to(hi).t()
            a = torch.nn.functional.silu(h[:, :n]) * h[:, n:]
            out.index_add_(0, tok, (a @ w2[e].to(hi).t()) * weights[tok, k, None].to(hi))
        return out
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def default_problems(device_class: str) -> list[MoeProblem]:
    if device_class == "cpu":
        return [MoeProblem(t, 8, 2, 256, 128) for t in (1, 16, 128)]
    # Mixtral-8x7B (E 8, top-2, hidden 4096, intermediate 14336), Qwen3-30B-A3B (E 128, top-8, 2048, 768)
    dims = ((8, 2, 14336, 4096), (128, 8, 768, 2048))
    return [MoeProblem(t, e, k, n, h, "bf16") for e, k, n, h in dims for t in (1, 8, 64, 512, 4096)]


def flops(p: MoeProblem) -> float:
    return 2.0 * p.T * p.top_k * 3 * p.N * p.K


def bytes_moved(p: MoeProblem) -> float:
    """Activations in and out, and the weights of the experts the tokens can reach."""
    experts = min(p.E, p.T * p.top_k)
    return float((2 * p.T * p.K + experts * 3 * p.N * p.K) * ITEMSIZE[p.dtype])


SPEC = define_op("moe", MoeProblem, signature, make_inputs, reference, size_fields=("T", "E", "top_k", "N", "K"),
                 streaming=("T",), choices={"activation": ACTIVATIONS}, flops=flops, bytes_moved=bytes_moved,
                 default_problems=default_problems,
                 twins={"renormalize": True})  # renormalising top_k weights is a few flops: the same kernel suits both
