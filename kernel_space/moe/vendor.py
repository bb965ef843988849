"""moe vendor kernels: transformers' default experts code (a loop over the experts that got tokens), and
torch._grouped_mm over the token slots sorted by expert (transformers' `grouped_mm` experts implementation)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .._common import ITEMSIZE
from .._registry import register_vendor
from .problem import route


@register_vendor("moe", "torch_experts_loop")
def torch_experts_loop(x, router_logits, w13, w2, *, top_k: int, activation: str = "silu", renormalize: bool = True):
    """MixtralExperts.forward: per expert hit, gather its tokens, gate_up, silu * up, down, weight, index_add."""
    weights, ids = route(router_logits, top_k, renormalize)
    weights = weights.to(x.dtype)
    out = torch.zeros_like(x)
    with torch.no_grad():
        mask = F.one_hot(ids, num_classes=w13.shape[0]).permute(2, 1, 0)  # [E, top_k, T]
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for e in hit[:, 0].tolist():
        k, tok = torch.where(mask[e])
        gate, up = F.linear(x[tok], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e]) * weights[tok, k, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out


def _grouped_mm_missing(p, params) -> str | None:
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__.split('+')[0]} has no torch._grouped_mm"
    size = ITEMSIZE.get(p.dtype, 0)
    if (p.K * size) % 16 or (p.N * size) % 16:  # on the CPU too
        return f"torch._grouped_mm needs rows of x, w13 and w2 in multiples of 16 bytes, not K={p.K}, N={p.N} in {p.dtype}"
    if torch.cuda.is_available():
        # its CUDA kernels: bf16 only; sm_90 (torch < 2.9), sm_80 and newer since
        old = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 9)
        need = (9, 0) if old else (8, 0)
        cap = torch.cuda.get_device_capability()
        if cap < need:
            return f"torch._grouped_mm needs sm_{need[0]}{need[1]} or newer on CUDA, not sm_{cap[0]}{cap[1]}"
        if p.dtype != "bf16":
            return f"torch._grouped_mm on CUDA takes bf16, not {p.dtype}"
    return None


@register_vendor("moe", "torch_grouped_mm", priority=90, check=_grouped_mm_missing)
def torch_grouped_mm(x, router_logits, w13, w2, *, top_k: int, activation: str = "silu", renormalize: bool = True):
    """Slots sorted by expert, two torch._grouped_mm calls over per-expert row offsets, weights, scatter-add."""
    weights, ids = route(router_logits, top_k, renormalize)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(w13.shape[0], dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    offs = torch.cumsum(counts, 0).to(torch.int32)
    tok = order // top_k
    h = torch._grouped_mm(x[tok], w13.transpose(-2, -1), offs=offs)
    n = w2.shape[-1]
    a = F.silu(h[:, :n]) * h[:, n:]
    y = torch._grouped_mm(a, w2.transpose(-2, -1), offs=offs)
    y = y.float() * weights.reshape(-1)[order, None]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, tok, y)
    return out.to(x.dtype)
