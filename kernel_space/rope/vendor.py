"""rope vendor candidate: the eager torch composite (transformers' formula), and the helpers Liger's adapter shares."""
from __future__ import annotations

import torch

from .._registry import register_vendor


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' rotate_half: (x1, x2) -> (-x2, x1) over the two halves of the last dim."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_every_two(x: torch.Tensor) -> torch.Tensor:
    """transformers' GPT-J rotate_every_two: pairs (2i, 2i+1) -> (-x[2i+1], x[2i])."""
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def full_tables(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor | None,
                interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin as full-width (..., tokens, 1, D) tables (transformers' form) that broadcast against q (..., tokens, H, D)."""
    if positions is not None:
        cos, sin = cos[positions], sin[positions]
    if cos.shape[-1] != q.shape[-1]:  # a (…, D/2) cache row: widen it as the model's table would be
        if interleaved:
            cos, sin = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
        else:
            cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    return cos.unsqueeze(-2), sin.unsqueeze(-2)


def composite(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """x * cos + rotate(x) * sin in x's dtype, as transformers computes it; `out` (may be x) receives it."""
    rot = rotate_every_two(x) if interleaved else rotate_half(x)
    return torch.add(x * cos, rot * sin, out=out)


def split_out(q: torch.Tensor, k: torch.Tensor, out) -> tuple[torch.Tensor, torch.Tensor, object]:
    """(q_out, k_out, what to return): views of a packed (..., Hq + Hkv, D) tensor, or the given pair."""
    Hq = q.shape[-2]
    if out is None:
        out = q.new_empty(q.shape[:-2] + (Hq + k.shape[-2], q.shape[-1]))
    if isinstance(out, torch.Tensor):
        return out[..., :Hq, :], out[..., Hq:, :], out
    return out[0], out[1], tuple(out)


@register_vendor("rope", "torch_rope")
def torch_rope(q, k, cos, sin, positions=None, *, interleaved: bool = False, out=None):
    """The eager composite: q * cos + rotate_half(q) * sin (and k), several elementwise kernels each."""
    qo, ko, ret = split_out(q, k, out)
    c, s = full_tables(q, cos, sin, positions, interleaved)
    composite(q, c, s, interleaved, qo)
    composite(k, c, s, interleaved, ko)
    return ret
