"""ops-adv runtime: dispatch each op to the implementation tuned for its problem and device.

Imports nothing of the tuning stack (ray, optuna, sqlalchemy, alembic, tuner, workers, db).
"""
from __future__ import annotations

import importlib as _importlib
import sys as _sys

import kernel_space as _ks
from kernel_space import NoImplementationError, OpsAdvError, UnknownOpError, register_impl

from . import _settings
from ._dispatch import dispatch, explain, load_table, misses, op_function, write_misses
from ._table import TableError
from .ops.gemm import gemm
from .ops.linear import linear
from .ops.attention import attention
from .ops.decode_attention import decode_attention
from .ops.layer_norm import layer_norm
from .ops.rms_norm import rms_norm
from .ops.softmax import softmax
from .ops.conv2d import conv2d
from .ops.add_rms_norm import add_rms_norm
from .ops.add_layer_norm import add_layer_norm
from .ops.swiglu import swiglu
from .ops.moe import moe
from .ops.rope import apply_rotary_pos_emb, rope
from .ops.conv2d_bn_relu import conv2d_bn_relu
from .models.convert import convert_model, explain_model
from .models.record import record, tune_for_hardware
from .tools import debug, profiler
from .tools.benchmark import benchmark
from .tools.census import census

# `ops_adv.debug` and `ops_adv.profiler` are the tools' modules, also as import paths (`from ops_adv.profiler import ...`)
_sys.modules[__name__ + ".debug"], _sys.modules[__name__ + ".profiler"] = debug, profiler

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
    "census",
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
    "moe",
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
