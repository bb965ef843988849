"""transformers integration: ops_adv attention through AttentionInterface, and Llama-style MLPs.

- `use_attention(model)` registers `hf_attention_forward` as the "ops_adv" attention of a
  transformers model (convert_model calls it): decode steps run decode_attention, other calls
  ops_adv.attention or transformers' SDPA; calls with keywords it does not fully understand (T5's
  position bias, soft-capping, ...) run the model's original attention implementation;
- `llama_mlp_forward(mlp, x)`: down(swiglu(gate(x), up(x))) of a Llama-style MLP through ops_adv's
  linear and swiglu.
transformers itself is imported only inside these functions.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from .._op import _is_compiling, _tracing_state, _vendor_only
from .merge import runs_own as _runs_own
from ..ops.attention import DECODE_MAX_QUERY, attention
from ..ops.linear import linear
from ..ops.swiglu import swiglu

# --------------------------------------------------------------------------- attention

# Masks made by ops_adv's mask function that are plain causal masks over cache slots [0, seq_len) (no
# padding, no window) carry this stride on their head dimension. That dimension has size 1, so its stride
# changes nothing (not even is_contiguous(), so generate()'s .contiguous() keeps it); it is host metadata that
# torch.compile guards on, so the route is decided without reading the mask. Causal masks and-ed with a 2-D
# padding mask (left padding, or transformers 5.17's all-ones mask) carry `_PADDED_STRIDE`: their last query
# row is the key mask. Any other mask (a window, a caller's 4-D mask, a copy) lacks both and runs SDPA.
_PREFIX_STRIDE = 0x0AD5_1DE5
_PADDED_STRIDE = 0x0AD5_1DE7
# When a list, hf_attention_forward appends the route of each call (benchmarks and tests read it; eager only).
ROUTE_LOG: list[str] | None = None


def _ops_adv_mask(*args: Any, **kwargs: Any) -> Any:
    """transformers' SDPA mask; a causal mask over cache slots comes back marked: `_PREFIX_STRIDE` without
    padding, `_PADDED_STRIDE` with a 2-D padding mask."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    mask = sdpa_mask(*args, **kwargs)
    if isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[1] == 1 and mask.dtype == torch.bool \
            and not _runs_own(mask):  # with nothing tuned the original attention takes the mask as it is
        kv_offset = kwargs.get("kv_offset", 0)
        causal = (not args and not kwargs.get("use_vmap")
                  and kwargs.get("mask_function", causal_mask_function) is causal_mask_function
                  and kwargs.get("local_size") is None and not isinstance(kv_offset, torch.Tensor) and kv_offset == 0)
        # attention_mask is the 2-D padding mask: transformers >= 5.2x's generate() passes None when it is all ones
        padding = kwargs.get("attention_mask")
        marker = None if not causal else _PREFIX_STRIDE if padding is None else \
            _PADDED_STRIDE if isinstance(padding, torch.Tensor) and padding.dim() == 2 else None
        if marker is not None:
            mask = mask.contiguous()
            mask = mask.as_strided(mask.shape, (mask.stride(0), marker, mask.stride(2), mask.stride(3)))
    return mask


def _clear_masks(module: nn.Module, args: Any) -> None:
    """No-op: a forward pre-hook older conversions registered (kept so their pickles load)."""


def _register() -> "_Registered":
    """Register "ops_adv" with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register("ops_adv", hf_attention_forward)
    try:  # the masks transformers builds for SDPA (None where is_causal says it all)
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

        ALL_MASK_ATTENTION_FUNCTIONS.register("ops_adv", _ops_adv_mask)
    except ImportError:
        pass
    return _Registered()


class _Registered:
    """Kept on a converted model: unpickling it (another process, torch.load) registers "ops_adv" again."""

    def __reduce__(self):
        return (_register, ())


def use_attention(model: nn.Module) -> list[dict[str, str]]:
    """Make a transformers model's attention ops_adv's (`hf_attention_forward`), with its mask function."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        return []
    try:
        from transformers import AttentionInterface  # noqa: F401 (transformers is importable)
    except ImportError:
        return [{"module": "", "type": "attention", "converted": "no", "why": "transformers is not importable"}]
    why = _not_dispatched(model)
    if why is None and not getattr(model, "_supports_sdpa", False):
        # ops_adv computes SDPA's attention: a family that does not declare SDPA equal to its own (BigBirdPegasus,
        # DeepSeek-V4, Gemma 2's softcap) keeps its implementation
        why = f"{type(model).__name__} does not support SDPA, which is what ops_adv's attention computes: left as it is"
    if why is not None:  # the masks transformers builds for "ops_adv" are SDPA's: its own attention would misread them
        return [{"module": "", "type": "attention", "converted": "no", "why": why}]
    model.__dict__["_ops_adv_attention"] = _register()
    before = config._attn_implementation
    for sub in model.modules():  # the implementation each module had: calls ops_adv does not understand run it
        if getattr(sub, "config", None) is not None and "_ops_adv_attn_original" not in sub.__dict__:
            sub.__dict__["_ops_adv_attn_original"] = getattr(sub.config, "_attn_implementation", None) or before
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
    for sub in model.modules():
        kw = _attention_keywords(type(sub))
        if kw:
            why = _refusal(sub, kw)
            if why is not None:  # every call would run the original: it always does, and the report says so
                sub.__dict__["_ops_adv_attn_refused"] = why
    return attention_rows(model)


def _not_dispatched(model: nn.Module) -> str | None:
    """Why the model's attention cannot become "ops_adv": an attention module (a class named *Attention) with no
    module under it that calls transformers' attention interface computes attention itself (Bloom, XGLM, MPT,
    GPT-Neo, ...), and would be handed masks made for another implementation. None when every one dispatches."""
    calls: dict[int, bool] = {}
    for m in reversed(list(model.modules())):  # children before parents
        calls[id(m)] = _attention_keywords(type(m)) is not None or any(calls.get(id(c), False) for c in m.children())
    if not any(calls.values()):
        return "its attention does not dispatch through transformers' AttentionInterface: left as it is"
    for name, m in model.named_modules():
        if type(m).__name__.endswith("Attention") and not calls[id(m)] and any(p.dim() == 2 for p in m.parameters()):
            return (f"{name} ({type(m).__name__}) computes its attention itself, not through transformers' "
                    "AttentionInterface: the model's attention is left as it is")
    return None


def attention_rows(model: nn.Module) -> list[dict[str, str]]:
    """What runs in each attention module of a converted transformers model: refused at conversion (with why),
    or the routes its calls took so far (ops_adv's attention, decode_attention, SDPA, the original)."""
    before = {sub.__dict__.get("_ops_adv_attn_original") for sub in model.modules()} - {None}
    rows, ours = [], 0
    for name, sub in model.named_modules():
        if _attention_keywords(type(sub)) is None or "_ops_adv_attn_original" not in sub.__dict__:
            continue
        orig = sub.__dict__["_ops_adv_attn_original"]
        refused = sub.__dict__.get("_ops_adv_attn_refused")
        seen = sub.__dict__.get("_ops_adv_routes") or {}
        if refused:
            rows.append({"module": name, "type": type(sub).__name__, "converted": "no",
                         "why": f"{refused}: its '{orig}' attention runs"})
        elif seen and set(seen) == {"original"}:
            rows.append({"module": name, "type": type(sub).__name__, "converted": "no",
                         "why": f"every call so far ({seen['original']}) passed keywords ops_adv does not compute: "
                                f"its '{orig}' attention ran"})
        elif seen and not set(seen) & {"ops_adv.attention", "decode_attention"}:
            rows.append({"module": name, "type": type(sub).__name__, "converted": "no",
                         "why": "every call so far ran transformers' SDPA or its own attention (masks, dropout, a "
                                "custom scale): " + ", ".join(f"{k} {v}" for k, v in sorted(seen.items()))})
        else:
            ours += 1
            if seen:
                rows.append({"module": name, "type": type(sub).__name__, "converted": "yes",
                             "why": "calls so far: " + ", ".join(f"{k} {v}" for k, v in sorted(seen.items()))})
    head = {"module": "", "type": "attention", "converted": "yes" if ours else "no",
            "why": (f"transformers attention '{', '.join(sorted(before))}' -> 'ops_adv' in {ours} module(s), decided "
                    "per call (decode steps with a static cache or grouped K/V heads run decode_attention; masks, "
                    "dropout, GQA prefill run SDPA; keywords it does not compute run the original)") if ours else
                   "no attention module runs ops_adv's attention (see the modules' rows)"}
    return [head] + rows


class _Routes(dict):
    """Route -> calls of one module in this process: copies and pickles start empty (they have run nothing)."""

    def __reduce__(self):
        return (_Routes, ())


_KW_CACHE: dict[type, dict | None] = {}
# Keywords of an attention call that are the call's tensors and flags, or decided per call.
_NAMED = frozenset({"attention_mask", "query", "key", "value", "dropout", "scaling", "is_causal", "sliding_window"})


def _attention_keywords(cls: type) -> dict | None:
    """The keywords (name -> expression) cls.forward passes to the attention function it gets from transformers'
    ALL_ATTENTION_FUNCTIONS, or None when it calls none (or its source is not readable)."""
    if cls in _KW_CACHE:
        return _KW_CACHE[cls]
    import ast
    import inspect
    import textwrap

    out = None
    try:
        fn = inspect.unwrap(cls.forward)
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError, AttributeError):
        tree = None
    if tree is not None and not cls.__module__.startswith("torch."):
        names = set()
        for n in ast.walk(tree):
            if isinstance(n, (ast.Assign, ast.AnnAssign)) and n.value is not None \
                    and any(isinstance(x, ast.Name) and x.id == "ALL_ATTENTION_FUNCTIONS" for x in ast.walk(n.value)):
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                    if isinstance(t, ast.Name):
                        names.add(t.id)
        for n in ast.walk(tree):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in names:
                out = out or {}
                out.update({k.arg: k.value for k in n.keywords if k.arg})
    _KW_CACHE[cls] = out
    return out


class _Unknown(Exception):
    pass


def _static(expr: Any, module: nn.Module) -> Any:
    """The value of `expr` (constants, self.<attr>..., getattr(..., "name", default), a if c else b) on `module`."""
    import ast

    if isinstance(expr, ast.Constant):
        return expr.value
    if isinstance(expr, ast.Name) and expr.id == "self":
        return module
    if isinstance(expr, ast.Attribute):
        obj = _static(expr.value, module)
        if not hasattr(obj, expr.attr):
            raise _Unknown
        return getattr(obj, expr.attr)
    if isinstance(expr, ast.IfExp):
        return _static(expr.body if _static(expr.test, module) else expr.orelse, module)
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "getattr" \
            and 2 <= len(expr.args) <= 3 and not expr.keywords:
        obj, name = _static(expr.args[0], module), _static(expr.args[1], module)
        return getattr(obj, name, _static(expr.args[2], module)) if len(expr.args) == 3 else getattr(obj, name)
    raise _Unknown


def _refusal(module: nn.Module, keywords: dict) -> str | None:
    """Why every call of `module`'s attention would run the original implementation, or None: a keyword that
    ops_adv does not compute, present on every call (Gemma 2's softcap, GPT-OSS's sinks, T5's position_bias)."""
    for k, expr in keywords.items():
        if k in _NAMED or k in _INERT:
            continue
        try:
            v = _static(expr, module)
        except _Unknown:
            if k in ("position_bias", "s_aux", "sinks"):  # computed in the forward and passed on every call
                return f"its attention is passed {k} (computed in its forward), which ops_adv does not compute"
            continue
        except Exception:
            continue
        if not _understood({k: v}, 0):
            shown = f"{type(v).__name__}" if isinstance(v, torch.Tensor) else repr(v)
            return f"its attention is passed {k}={shown}, which ops_adv does not compute"
    return None


# The last mask _decode_seq_lens read, eagerly, in this thread: (weakref to it, its version, shapes, thread, result).
# Every layer of a step gets the same mask object: the first computes seq_lens (1 to 4 small kernels), the others
# reuse them (a 32-layer step with left padding launched ~120 kernels fewer). A captured step does the same.
_SEQ_MEMO: list[Any] = [None]


def _decode_seq_lens(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None) -> tuple[bool, Any, Any]:
    if attention_mask is None or _is_compiling() or _tracing_state() is not None:
        return _seq_lens_of(query, key, attention_mask)
    at = (query.shape[0], query.shape[2], key.shape[2], threading.get_ident())
    memo = _SEQ_MEMO[0]
    if memo is not None and memo[0]() is attention_mask and memo[1] == attention_mask._version and memo[2] == at:
        return memo[3]
    res = _seq_lens_of(query, key, attention_mask)
    if isinstance(attention_mask, torch.Tensor):
        _SEQ_MEMO[0] = (weakref.ref(attention_mask), attention_mask._version, at, res) if res[0] else None
    return res


def _seq_lens_of(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None) -> tuple[bool, Any, Any]:
    """(usable, seq_lens, key_mask) for a decode call, read on the device (no host sync).

    Without a mask every key slot is valid (seq_lens None). With one of ops_adv's plain causal masks
    (marked by `_PREFIX_STRIDE`) the last query row allows slots [0, seq_len): its count is seq_len.
    With a causal mask and-ed with padding (`_PADDED_STRIDE`) the last query row is the key mask, and
    seq_len is one past its last allowed slot (query i then sees keys <= seq_len - Sq + i where the key
    mask allows). Any other mask (a caller's 4-D mask, sliding windows) cannot be told apart from these
    without a sync: SDPA then.
    """
    B, Sq, Skv = query.shape[0], query.shape[2], key.shape[2]
    if attention_mask is None:
        return Sq == Skv or Sq == 1, None, None  # SDPA's is_causal is top-left aligned: only equal lengths agree
    if attention_mask.dim() != 4 or tuple(attention_mask.shape[-2:]) != (Sq, Skv) \
            or attention_mask.shape[1] != 1 or attention_mask.stride(1) not in (_PREFIX_STRIDE, _PADDED_STRIDE) \
            or attention_mask.dtype != torch.bool or attention_mask.shape[0] not in (1, B):
        return False, None, None
    row = attention_mask[:, 0, -1, :]
    if attention_mask.stride(1) == _PREFIX_STRIDE:
        seq = row.sum(-1, dtype=torch.int32)
        return True, seq.expand(B).contiguous() if seq.shape[0] != B else seq, None
    seq = (row * torch.arange(1, Skv + 1, device=row.device, dtype=torch.int32)).amax(-1)
    if row.shape[0] != B:
        row, seq = row.expand(B, Skv), seq.expand(B).contiguous()
    return True, seq, row


# Keywords transformers passes to attention functions that change nothing in the attention itself.
_INERT = frozenset({"position_ids", "cache_position", "use_cache", "past_key_values", "past_key_value", "layer_idx",
                    "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "return_dict"})
# Keywords ops_adv understands when absent (None, 0, False): any other value runs the original implementation.
_ABSENT_OK = frozenset({"softcap", "s_aux", "position_bias", "head_mask", "output_attentions", "sinks"})


def _understood(kwargs: dict, Skv: int) -> bool:
    """Whether ops_adv computes what the model's own attention would with these extra keywords."""
    for k, v in kwargs.items():
        # None or False says nothing (BERT's encoder_hidden_states=None, MoE's output_router_logits=False)
        if k in _INERT or v is None or v is False or k in _ABSENT_OK and isinstance(v, (int, float)) and v == 0:
            continue
        # A window at least as long as the keys changes nothing (the mask carries it where it does).
        if k == "sliding_window" and (v is None or isinstance(v, int) and Skv <= v):
            continue
        return False
    return True


_ATTENTION_FUNCTIONS: Any = None  # transformers' registry, read once (an import per call cost ~1 µs)


def _load_attention_functions() -> None:
    global _ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    _ATTENTION_FUNCTIONS = ALL_ATTENTION_FUNCTIONS


def _original_attention(module: nn.Module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs):
    """The attention the module had before conversion: transformers' registered function, or for
    'eager' the modeling module's own eager_attention_forward (its mask made additive, as eager expects)."""
    impl = module.__dict__.get("_ops_adv_attn_original") or "sdpa"
    fn = None
    if impl != "eager" and impl != "ops_adv":
        fns = _ATTENTION_FUNCTIONS
        if fns is None:
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as fns
        fn = fns.get(impl)
    if fn is None:
        import sys

        fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if fn is None:
            from transformers.integrations.sdpa_attention import sdpa_attention_forward as fn
        else:
            attention_mask = _additive_mask(module, query, key, attention_mask, is_causal)
    if is_causal is not None:
        kwargs = dict(kwargs, is_causal=is_causal)
    return fn(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def _additive_mask(module, query, key, mask, is_causal):
    """ops_adv's masks are SDPA's (boolean, or None where is_causal says it all); eager adds a float mask."""
    Sq, Skv = query.shape[2], key.shape[2]
    if mask is None:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", False)
        if not causal or Sq == 1:
            return None
        # None stands for SDPA's is_causal, which is top-left aligned (a static cache's keys start at slot 0)
        mask = torch.ones(Sq, Skv, dtype=torch.bool, device=query.device).tril()[None, None]
    if mask.dtype == torch.bool:
        zero = torch.zeros((), dtype=query.dtype, device=query.device)
        mask = torch.where(mask, zero, torch.finfo(query.dtype).min)
    return mask


def hf_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """transformers' attention contract: (B, H, S, D) in, (B, S, H, D) out, as its SDPA integration does.

    Calls with keywords ops_adv does not fully understand (a position bias, soft-capping, attention
    sinks, a sliding window shorter than the keys, attention weights asked for, anything unknown) run
    the model's original implementation. A decode call (query length <= DECODE_MAX_QUERY, no dropout)
    whose cache holds more slots than its valid length, or whose K/V heads are grouped, runs ops_adv's
    decode_attention (GQA without copying K/V, seq_lens from the mask).
    """
    if _runs_own(query):  # nothing tuned for this device: the module's own attention, at the cost of one check
        seen = module.__dict__.get("_ops_adv_routes")
        if seen is None:
            seen = module.__dict__["_ops_adv_routes"] = _Routes()
        seen["original"] = seen.get("original", 0) + 1
        if ROUTE_LOG is not None:
            ROUTE_LOG.append("original")
        if _ATTENTION_FUNCTIONS is None:
            _load_attention_functions()
        return _original_attention(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    Hq, Hkv = query.shape[1], key.shape[1]
    Sq, Skv = query.shape[2], key.shape[2]
    causal_flag = is_causal if is_causal is not None else getattr(module, "is_causal", True)

    def log(route: str) -> None:
        if ROUTE_LOG is not None:
            ROUTE_LOG.append(route)
        if not torch.compiler.is_compiling():  # what explain_model reports: the routes calls took
            seen = module.__dict__.get("_ops_adv_routes")
            if seen is None:
                seen = module.__dict__["_ops_adv_routes"] = _Routes()
            seen[route] = seen.get(route, 0) + 1

    if module.__dict__.get("_ops_adv_attn_refused") or kwargs and not _understood(kwargs, Skv):
        log("original")
        return _original_attention(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs)
    kwargs = {k: v for k, v in kwargs.items() if k in _INERT}  # the absent ones say nothing
    plain = not dropout and query.dim() == 4 and key.shape[0] == query.shape[0]
    # A short grouped-head prefill (no mask, no cache before it) takes decode_attention only where that is tuned
    # here: its default cost 40 µs against SDPA's 18 µs a layer (Mixtral-tiny, (1, 16), 1 thread).
    prefill = attention_mask is None and Sq == Skv and Sq > 1
    if plain and Sq <= DECODE_MAX_QUERY and (attention_mask is not None or Hq != Hkv) and Hq % Hkv == 0 \
            and not (prefill and _vendor_only("decode_attention", str(query.device))):
        ok, seq_lens, key_mask = _decode_seq_lens(query, key, attention_mask)
        if ok:
            from ..ops.decode_attention import decode_attention  # read at call time: tests spy on it

            log("decode_attention")
            default = scaling is None or scaling == query.shape[-1] ** -0.5  # None takes the kernels' path
            out = decode_attention(query, key, value, seq_lens, causal=bool(causal_flag and Sq > 1),
                                   scale=None if default else scaling, key_mask=key_mask)
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


# --------------------------------------------------------------------------- generate()'s compile

# A converted module's forward lives on the instance, so Dynamo inlines nn.Module._call_impl for it and guards
# what that reads: the four hook dicts (which it does not guard for a module with its class's forward, per
# torch._dynamo.config.skip_nnmodule_hook_guards) and the functools.partial's parts. Checking them before every
# compiled call cost more than the original's whole guard set: a tiny 4-layer Llama, compiled with a backend that
# computes nothing, 100 µs a call against 63 µs, 21 µs for both with no guard checks (CPU, 1 thread).
_HOOK_DICTS = ("._forward_hooks", "._forward_pre_hooks", "._backward_hooks", "._backward_pre_hooks",
               "._forward_hooks_with_kwargs", "._forward_pre_hooks_with_kwargs")


class _GuardFilter(str):
    """A `guard_filter_fn` for torch.compile: keeps every guard except the ones conversion adds (a module's hook
    dicts, left unguarded for unconverted modules too, and the arguments of an instance forward's partial;
    the function it runs stays guarded). A str, so a GenerationConfig holding it still prints and compares
    (transformers writes its configs as JSON)."""

    def __call__(self, entries: list) -> list[bool]:
        keep = []
        for e in entries:
            n = e.name
            partial_part = ".forward." in n and not n.endswith(".forward.func")
            keep.append(not (n.endswith(_HOOK_DICTS) or partial_part))
        return keep


conversion_guard_filter = _GuardFilter("ops_adv.models.hf.conversion_guard_filter")


def compile_config(config: Any = None) -> Any:
    """transformers' CompileConfig for generate() on a converted model: `config` (default: transformers' own,
    Inductor with reduce-overhead's CUDA graphs) with `conversion_guard_filter`. torch.compile takes the filter
    in `options` only, and options exclude a mode, so the mode becomes its options (what Inductor does with
    it anyway). A config for another backend, or one with a filter of its own, comes back unchanged."""
    from transformers import CompileConfig

    config = config if config is not None else CompileConfig()
    d = config.to_dict()
    if d.get("backend", "inductor") != "inductor" or "guard_filter_fn" in (d.get("options") or {}):
        return config
    import torch._inductor

    mode, options = d.pop("mode", None), dict(d.pop("options", None) or {})
    options = {**(torch._inductor.list_mode_options(mode) if mode else {}), **options, "guard_filter_fn": conversion_guard_filter}
    out = CompileConfig(**d, mode=None, options=options)
    if getattr(config, "_compile_all_devices", None) is not None:
        out._compile_all_devices = config._compile_all_devices
    return out


def use_compile_config(model: nn.Module) -> list[dict[str, str]]:
    """Give a transformers model's generate() `compile_config`, unless it has a config of its own."""
    gc = getattr(model, "generation_config", None)
    if gc is None or not hasattr(gc, "compile_config"):
        return []
    row = {"module": "", "type": "generate() compile"}
    current = gc.compile_config
    if current is not None:
        ours = isinstance((getattr(current, "options", None) or {}).get("guard_filter_fn"), _GuardFilter)
        return [{**row, "converted": "yes" if ours else "no",
                 "why": "already set" if ours else "the model's own compile_config is kept (ops_adv.models.hf.compile_config(cfg) adds the guard filter)"}]
    try:
        gc.compile_config = compile_config()
    except Exception as e:  # a transformers without CompileConfig options: its default stays
        return [{**row, "converted": "no", "why": f"{type(e).__name__}: {e}"}]
    return [{**row, "converted": "yes",
             "why": "transformers' default compile without the guards conversion adds (hook dicts, forward partials)"}]


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
