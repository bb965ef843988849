"""Liger-Kernel's kernels as library candidates: thin adapters onto its public autograd Functions.

Each is registered with `requires=("liger_kernel",)` and the CUDA backend only, so a machine
without the library (or without a GPU) lists it with the reason instead of failing; its check
(`needs_attr`) imports the Liger module when a CUDA problem is first considered, so a release
lacking the kernel, or one that fails to import against this torch/Triton, is a reason as well.
`import kernel_space` imports nothing of liger_kernel.

Other op packages (rope, ...) add their Liger candidates with the same helpers:
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


# --------------------------------------------------------------------------- adapters


def rms_norm(x, weight, eps: float = 1e-6):
    # casting_mode "llama": statistics in fp32, normalised x cast to the input dtype, then times weight (HF Llama)
    return liger_attr("ops.rms_norm", "LigerRMSNormFunction").apply(x, weight, eps, 0.0, "llama", False)


def layer_norm(x, weight, bias=None, eps: float = 1e-5):
    if bias is None:
        bias = weight.new_zeros(weight.shape)
    return liger_attr("ops.layer_norm", "LigerLayerNormFunction").apply(x, weight, bias, eps)


def add_rms_norm(x, residual, weight, eps: float = 1e-6):
    y, h = liger_attr("ops.fused_add_rms_norm", "LigerFusedAddRMSNormFunction").apply(
        x, residual, weight, eps, 0.0, "llama", False)
    return y, h


def swiglu(gate, up=None):
    if up is None:  # one [..., 2I] tensor: gate then up
        return liger_attr("ops.swiglu", "LigerFusedGateUpSiLUMulFunction").apply(gate.contiguous())
    # its kernel walks gate, up and out with one row stride: contiguous operands
    return liger_attr("ops.swiglu", "LigerSiLUMulFunction").apply(gate.contiguous(), up.contiguous())


def register_norms() -> None:
    """Liger candidates of the plain norms (their packages are imported here: they do not import this module)."""
    from . import layer_norm as _ln, rms_norm as _rn  # noqa: F401  (their ops must exist first)

    register_liger("rms_norm", "liger_rms_norm", check=needs_attr("ops.rms_norm", "LigerRMSNormFunction"))(rms_norm)
    register_liger("layer_norm", "liger_layer_norm",
                   check=needs_attr("ops.layer_norm", "LigerLayerNormFunction"))(layer_norm)


register_norms()
