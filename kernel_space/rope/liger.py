"""rope's Liger-Kernel candidate: its in-place rope behind the out-of-place signature (CUDA only)."""
from __future__ import annotations

import torch

from .._liger import register_liger
from .vendor import split_out


def _liger_check(p, params) -> str | None:
    if p.interleaved:
        return "Liger's rope has the rotate-half layout only"
    if p.positions:
        return "Liger's rope takes per-token cos/sin tables, not a cache read at positions"
    return None


# Below the torch composite (100): with no table, dispatch keeps the composite.
@register_liger("rope", "liger_rope", check=_liger_check)
def liger_rope(q, k, cos, sin, positions=None, *, interleaved: bool = False, out=None):
    """Liger-Kernel's rope. It rotates a (B, S, H, D)-contiguous q/k in place, so out of place this
    clones q and k first (and packs without `out`): the clones are its cost here, not in a model,
    where it rotates q_proj's output in place (benchmarks/rope.py times that)."""
    from liger_kernel.ops.rope import LigerRopeFunction

    if interleaved or positions is not None:
        raise ValueError("liger_rope: rotate-half with per-token cos/sin tables only")
    q4, k4 = (q, k) if q.dim() == 4 else (q.unsqueeze(0), k.unsqueeze(0))
    S, D = q4.shape[1], q4.shape[-1]
    c = cos.reshape(-1, S, D)  # (1 or B, S, D)
    s = sin.reshape(-1, S, D)
    qc, kc = q4.contiguous().clone(), k4.contiguous().clone()
    qr, kr = LigerRopeFunction.apply(qc.transpose(1, 2), kc.transpose(1, 2), c, s, None, 1)
    qr, kr = qr.transpose(1, 2).reshape(q.shape), kr.transpose(1, 2).reshape(k.shape)
    if out is None:
        return torch.cat((qr, kr), -2)
    qo, ko, ret = split_out(q, k, out)
    qo.copy_(qr)
    ko.copy_(kr)
    return ret
