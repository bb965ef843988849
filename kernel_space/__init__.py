"""Every op ops-adv tunes: problem signatures, references, implementations and their spaces."""
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
    unregister_impl,
)
from ._common import relative_error
from . import gemm, attention  # noqa: F401  (registers the ops)
from . import norm, softmax, conv2d  # noqa: F401
from . import gemm_triton, attention_triton  # noqa: F401

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
    "relative_error",
    "unregister_impl",
]
