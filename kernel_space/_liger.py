"""Liger-Kernel's kernels as library candidates: thin adapters onto its public autograd Functions.

Each is registered with `requires=("liger_kernel",)` and the CUDA backend only, so a machine
without the library (or without a GPU) lists it with the reason instead of failing; its check
(`needs_attr`) imports the Liger module when a CUDA problem is first considered, so a release
lacking the kernel, or one that fails to import against this torch/Triton, is a reason as well.
`import kernel_space` imports nothing of liger_kernel.

The helpers every op's Liger candidate uses; the candidates themselves live in the package of
the op they serve (`rms_norm/liger.py`, `swiglu/liger.py`, ...):
`register_liger(op, name, check=needs_attr(module, attr))` and `liger_attr(module, attr)`.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable

from ._registry import Check, register_impl

# Below the torch vendor kernels (100): with no table, dispatch keeps torch's own kernel.
PRIORITY = 90
_attrs: dict[tuple[str, str], Any] = {}


def liger_attr(module: str, attr: str) -> Any:
    """`liger_kernel.<module>.<attr>`, imported on first use; an OpsAdvError naming the installed
    version when that release lacks it."""
    key = (module, attr)
    found = _attrs.get(key)
    if found is None:
        from ._registry import OpsAdvError

        mod = importlib.import_module(f"liger_kernel.{module}")
        found = getattr(mod, attr, None)
        if found is None:
            raise OpsAdvError(f"liger-kernel {liger_version()} has no {module}.{attr}; upgrade liger-kernel")
        _attrs[key] = found
    return found


_missing: dict[tuple[str, str], str | None] = {}


def missing(module: str, attr: str) -> str | None:
    """Why `liger_kernel.<module>.<attr>` cannot be used here (a failing import, an older release), or None."""
    key = (module, attr)
    if key not in _missing:
        try:
            mod = importlib.import_module(f"liger_kernel.{module}")
        except Exception as e:  # an install broken against this torch/triton is a reason, not a crash
            _missing[key] = f"liger_kernel.{module} fails to import ({type(e).__name__})"
        else:
            _missing[key] = None if getattr(mod, attr, None) is not None else \
                f"liger-kernel {liger_version()} has no {module}.{attr}"
    return _missing[key]


def has_liger_attr(module: str, attr: str) -> bool:
    return missing(module, attr) is None


def liger_version() -> str:
    import importlib.metadata as md

    try:
        return md.version("liger-kernel")
    except md.PackageNotFoundError:
        return "none"


def needs_attr(module: str, attr: str, then: Check | None = None) -> Check:
    """A check refusing every problem when `liger_kernel.<module>.<attr>` is unusable here, then `then`'s verdict."""

    def check(problem: Any, params: Any) -> str | None:
        why = missing(module, attr)
        if why is None and then is not None:
            return then(problem, params)
        return why

    return check


def register_liger(op: str, name: str, *, check: Check | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a Liger-Kernel candidate of `op`: a library vendor kernel, CUDA only. Give it a `check` made
    with `needs_attr` so that a release lacking the kernel, or failing to import, is a reason and not a crash."""
    return register_impl(op, name=name, priority=PRIORITY, backends=("cuda",), vendor=True, check=check,
                         requires=("liger_kernel",))
