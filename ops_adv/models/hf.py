"""transformers integration: ops_adv attention through AttentionInterface, and Llama-style MLPs.

- `use_attention(model)` registers `hf_attention_forward` as the "ops_adv" attention of a
  transformers model (convert_model calls it): decode steps run decode_attention, other calls
  ops_adv.attention or transformers' SDPA;
- `llama_mlp_forward(mlp, x)`: down(swiglu(gate(x), up(x))) of a Llama-style MLP through ops_adv's
  linear and swiglu.
transformers itself is imported only inside these functions.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops.attention import DECODE_MAX_QUERY, attention
from ..ops.linear import linear
from ..ops.swiglu import swiglu

# --------------------------------------------------------------------------- attention

# Masks made by ops_adv's mask function in the current forward: (q_length, kv_length) -> True when the
# mask is causal over cache slots [0, seq_len) with no padding (then seq_lens can be read off the mask
# on the device and decode_attention computes the same thing). Cleared by a forward pre-hook, so a 4-D
# mask a caller passes in (transformers skips the mask function then) is never taken for one of ours.
_PREFIX_MASKS: dict[tuple[int, int], bool] = {}
# When a list, hf_attention_forward appends the route of each call (benchmarks and tests read it; eager only).
ROUTE_LOG: list[str] | None = None


def _ops_adv_mask(*args: Any, **kwargs: Any) -> Any:
    """transformers' SDPA mask, noting whether it is a plain causal mask over cache slots."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    mask = sdpa_mask(*args, **kwargs)
    if isinstance(mask, torch.Tensor) and mask.dim() == 4:
        pure = (not args and kwargs.get("attention_mask") is None and not kwargs.get("use_vmap")
                and kwargs.get("mask_function", causal_mask_function) is causal_mask_function
                and kwargs.get("local_size") is None and not isinstance(kwargs.get("kv_offset", 0), torch.Tensor)
                and kwargs.get("kv_offset", 0) == 0 and mask.dtype == torch.bool)
        key = (mask.shape[-2], mask.shape[-1])
        _PREFIX_MASKS[key] = pure and _PREFIX_MASKS.get(key, True)  # a shape seen both ways stays False
    return mask


def _clear_masks(module: nn.Module, args: Any) -> None:
    _PREFIX_MASKS.clear()


def use_attention(model: nn.Module) -> list[dict[str, str]]:
    """Make a transformers model's attention ops_adv's (`hf_attention_forward`), with its mask function."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        return []
    try:
        from transformers import AttentionInterface, PreTrainedModel
    except ImportError:
        return [{"module": "", "type": "attention", "converted": "no", "why": "transformers is not importable"}]
    AttentionInterface.register("ops_adv", hf_attention_forward)
    try:  # the masks transformers builds for SDPA (None where is_causal says it all)
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

        ALL_MASK_ATTENTION_FUNCTIONS.register("ops_adv", _ops_adv_mask)
    except ImportError:
        pass
    before = config._attn_implementation
    try:
        if hasattr(model, "set_attn_implementation"):
            model.set_attn_implementation("ops_adv")
        else:
            config._attn_implementation = "ops_adv"
    except Exception as e:  # a model that refuses custom attention keeps its own
        return [{"module": "", "type": "attention", "converted": "no", "why": f"{type(e).__name__}: {e}"}]
    for sub in model.modules():  # sub-configs (vision towers, ...) follow
        c = getattr(sub, "config", None)
        if c is not None and getattr(c, "_attn_implementation", None) == before:
            c._attn_implementation = "ops_adv"
        if isinstance(sub, PreTrainedModel) and not getattr(sub, "_ops_adv_mask_hook", False):  # models make masks
            sub.register_forward_pre_hook(_clear_masks)
            sub._ops_adv_mask_hook = True
    return [{"module": "", "type": "attention", "converted": "yes",
             "why": f"transformers attention '{before}' -> 'ops_adv' (decode steps with a static cache or grouped "
                    "K/V heads run decode_attention; masks, dropout, GQA prefill run SDPA)"}]


def _decode_seq_lens(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None) -> tuple[bool, Any]:
    """(usable, seq_lens) for a decode call, read on the device (no host sync).

    Without a mask every key slot is valid (seq_lens None). With one of ops_adv's plain causal masks
    the last query row allows slots [0, seq_len): its count is seq_len. Any other mask (padding, a
    caller's 4-D mask, sliding windows) cannot be told apart from a prefix without a sync: SDPA then.
    """
    B, Sq, Skv = query.shape[0], query.shape[2], key.shape[2]
    if attention_mask is None:
        return Sq == Skv or Sq == 1, None  # SDPA's is_causal is top-left aligned: only equal lengths agree
    if attention_mask.dim() != 4 or tuple(attention_mask.shape[-2:]) != (Sq, Skv) \
            or not _PREFIX_MASKS.get((Sq, Skv), False) or attention_mask.shape[0] not in (1, B):
        return False, None
    seq = attention_mask[:, 0, -1, :].sum(-1, dtype=torch.int32)
    return True, seq.expand(B).contiguous() if seq.shape[0] != B else seq


def hf_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention contract: (B, H, S, D) in, (B, S, H, D) out, as its SDPA integration does.

    A decode call (query length <= DECODE_MAX_QUERY, no dropout, no extra terms such as attention
    sinks or soft-capping) whose cache holds more slots than its valid length, or whose K/V heads are
    grouped, runs ops_adv's decode_attention (GQA without copying K/V, seq_lens from the mask).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    Hq, Hkv = query.shape[1], key.shape[1]
    Sq, Skv = query.shape[2], key.shape[2]
    causal_flag = is_causal if is_causal is not None else getattr(module, "is_causal", True)

    def log(route: str) -> None:
        if ROUTE_LOG is not None:
            ROUTE_LOG.append(route)

    plain = not dropout and kwargs.get("s_aux") is None and not kwargs.get("softcap") \
        and query.dim() == 4 and key.shape[0] == query.shape[0]
    if plain and Sq <= DECODE_MAX_QUERY and (attention_mask is not None or Hq != Hkv) and Hq % Hkv == 0:
        ok, seq_lens = _decode_seq_lens(query, key, attention_mask)
        if ok:
            from ..ops.decode_attention import decode_attention  # read at call time: tests spy on it

            log("decode_attention")
            default = scaling is None or scaling == query.shape[-1] ** -0.5  # None takes the kernels' path
            out = decode_attention(query, key, value, seq_lens, causal=bool(causal_flag and Sq > 1),
                                   scale=None if default else scaling)
            return out.transpose(1, 2).contiguous(), None
    causal = bool(causal_flag and attention_mask is None and Sq > 1)
    if attention_mask is not None or dropout or Hq != Hkv or (scaling is not None and scaling != query.shape[-1] ** -0.5) \
            or Sq != Skv and causal:
        log("sdpa")
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    log("ops_adv.attention")
    out = attention(query, key, value, is_causal=causal)
    return out.transpose(1, 2).contiguous(), None


# --------------------------------------------------------------------------- MLP


def is_swiglu_mlp(mlp: Any) -> bool:
    """Whether `mlp` is a Llama-style MLP `llama_mlp_forward` computes: down(silu(gate(x)) * up(x)),
    with separate gate_proj/up_proj or one merged gate_up_proj (gate rows first), and a SiLU activation."""
    act = getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None)
    silu = isinstance(act, torch.nn.SiLU) or act is F.silu or type(act).__name__ == "SiLUActivation"
    linears = [getattr(mlp, n, None) for n in ("gate_up_proj", "down_proj")]
    merged = all(isinstance(m, torch.nn.Linear) for m in linears)
    split = all(isinstance(getattr(mlp, n, None), torch.nn.Linear) for n in ("gate_proj", "up_proj", "down_proj"))
    return silu and (merged or split)


def llama_mlp_forward(mlp: Any, x: torch.Tensor) -> torch.Tensor:
    """down_proj(silu(gate_proj(x)) * up_proj(x)) through ops_adv's linear and swiglu; a merged
    gate_up_proj runs as one projection and the merged swiglu layout."""
    if not is_swiglu_mlp(mlp):
        raise TypeError(f"{type(mlp).__name__} is not a SiLU-gated MLP with gate_proj/up_proj (or gate_up_proj) "
                        "and down_proj Linears; call it directly")
    gate_up = getattr(mlp, "gate_up_proj", None)
    if isinstance(gate_up, torch.nn.Linear):
        h = swiglu(linear(x, gate_up.weight, gate_up.bias))
    else:
        h = swiglu(linear(x, mlp.gate_proj.weight, mlp.gate_proj.bias), linear(x, mlp.up_proj.weight, mlp.up_proj.bias))
    return linear(h, mlp.down_proj.weight, mlp.down_proj.bias)
