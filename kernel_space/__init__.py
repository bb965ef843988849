"""Every op ops-adv tunes: problem signatures, references, implementations and their spaces.

One package per op (`gemm/`, `attention/`, ...), each with the same files: `problem.py`
(signature, inputs, reference), `vendor.py` (the vendor kernels), `cpu.py` (CPU variants,
where the op has any), `triton.py` (space, validity check, launch wrapper) and `_kernels.py`
(the `@triton.jit` code and its launch, imported on the first call). Shared pieces live here:
the registry, kernel versions, device classes, dtype helpers, Hopper budgets, row-wise scaffolding.
"""
from __future__ import annotations

from ._registry import (
    Impl,
    NoImplementationError,
    OpSpec,
    OpsAdvError,
    UnknownOpError,
    backend_of,
    choose_default,
    get_impl,
    get_op,
    impls,
    ops,
    problem_distance,
    problem_key,
    register_impl,
    register_op,
    register_triton,
    register_vendor,
    unregister_impl,
)
from ._common import relative_error

def _register_ops() -> None:
    """Import every op package (a subpackage not named with a leading underscore): each registers itself."""
    import importlib
    import pkgutil

    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.ispkg and not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")


_register_ops()

__all__ = [
    "Impl",
    "NoImplementationError",
    "OpSpec",
    "OpsAdvError",
    "UnknownOpError",
    "backend_of",
    "choose_default",
    "get_impl",
    "get_op",
    "impls",
    "ops",
    "problem_distance",
    "problem_key",
    "register_impl",
    "register_op",
    "register_triton",
    "register_vendor",
    "relative_error",
    "unregister_impl",
]
