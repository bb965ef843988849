"""ops-adv runtime: dispatch each op to the implementation tuned for its problem and device.

Imports nothing of the tuning stack (ray, optuna, sqlalchemy, alembic, tuner, workers, db).
"""
from __future__ import annotations

import importlib as _importlib

import kernel_space as _ks
from kernel_space import NoImplementationError, OpsAdvError, UnknownOpError, register_impl

from . import _settings, debug, profiler
from ._benchmark import benchmark
from ._dispatch import dispatch, explain, load_table, misses, op_function, write_misses
from ._convert import convert_model, explain_model
from ._ops import attention, conv2d, gemm, layer_norm, linear, rms_norm, softmax
from . import _epilogue  # noqa: F401  (ops_adv::linear, which linear(..., activation=...) runs)
from ._decode import decode_attention
from ._fused import add_layer_norm, add_rms_norm, swiglu
from ._rope import apply_rotary_pos_emb, rope
from ._conv_fused import conv2d_bn_relu
from ._record import record, tune_for_hardware
from ._table import TableError

for _m in _settings.plugins():
    _importlib.import_module(_m)


def __getattr__(name: str):  # ops that plugins register
    if name in _ks.ops():
        return op_function(name)
    raise AttributeError(f"module 'ops_adv' has no attribute {name!r}")


__all__ = [
    "NoImplementationError",
    "OpsAdvError",
    "TableError",
    "UnknownOpError",
    "add_layer_norm",
    "add_rms_norm",
    "apply_rotary_pos_emb",
    "attention",
    "benchmark",
    "conv2d",
    "conv2d_bn_relu",
    "debug",
    "decode_attention",
    "convert_model",
    "dispatch",
    "explain",
    "explain_model",
    "gemm",
    "layer_norm",
    "linear",
    "load_table",
    "misses",
    "record",
    "op_function",
    "profiler",
    "register_impl",
    "rms_norm",
    "rope",
    "softmax",
    "swiglu",
    "tune_for_hardware",
    "write_misses",
]
