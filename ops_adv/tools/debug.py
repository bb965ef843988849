"""Finding where a model first produces NaN or Inf: `ops_adv.debug.check_nan(model, *inputs)`."""
from __future__ import annotations

from typing import Any, Callable

from .. import _dispatch


def _nonfinite(x: Any) -> bool:
    import torch

    if isinstance(x, torch.Tensor):
        return x.is_floating_point() and x.numel() > 0 and not bool(torch.isfinite(x).all())
    if isinstance(x, (tuple, list)):
        return any(_nonfinite(v) for v in x)
    if isinstance(x, dict):
        return any(_nonfinite(v) for v in x.values())
    for name in ("logits", "last_hidden_state"):  # model output classes
        if hasattr(x, name):
            return _nonfinite(getattr(x, name))
    return False


def check_nan(model: Any, *inputs: Any, **kw_inputs: Any) -> dict[str, Any] | None:
    """Run `model` once and name the first module (innermost, in execution order) and the first
    ops-adv op call whose output holds NaN or Inf while its inputs did not. None when all is finite."""
    import torch

    found: dict[str, Any] = {}
    hooks = []

    def module_hook(name: str) -> Callable[..., None]:
        def hook(mod: Any, args: Any, out: Any) -> None:
            if "module" not in found and _nonfinite(out) and not _nonfinite(args):
                found["module"] = name or type(mod).__name__
                found["module_type"] = type(mod).__name__
        return hook

    def wrap(op: str, problem: Any, impl: str, source: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            if "op" not in found and _nonfinite(out) and not _nonfinite(args):
                found.update(op=op, impl=impl, source=source, problem=problem._asdict())
            return out
        return run

    for name, mod in model.named_modules():
        hooks.append(mod.register_forward_hook(module_hook(name)))
    _dispatch.add_wrapper(wrap)
    try:
        with torch.no_grad():
            model(*inputs, **kw_inputs)
    finally:
        _dispatch.remove_wrapper(wrap)
        for h in hooks:
            h.remove()
    return found or None
