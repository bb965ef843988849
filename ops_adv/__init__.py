"""ops-adv runtime: dispatch each op to the implementation tuned for its problem and device.

Imports nothing of the tuning stack (ray, optuna, sqlalchemy, alembic, tuner, workers, db).
"""
from __future__ import annotations

import importlib as _importlib

import kernel_space as _ks
from kernel_space import NoImplementationError, OpsAdvError, UnknownOpError, register_impl

from . import _settings
from ._dispatch import dispatch, explain, load_table, misses, op_function, write_misses
from ._table import TableError

for _m in _settings.plugins():
    _importlib.import_module(_m)

gemm = op_function("gemm")
attention = op_function("attention")


def __getattr__(name: str):
    if name in _ks.ops():
        return op_function(name)
    raise AttributeError(f"module 'ops_adv' has no attribute {name!r}")


__all__ = [
    "NoImplementationError",
    "OpsAdvError",
    "TableError",
    "UnknownOpError",
    "attention",
    "dispatch",
    "explain",
    "gemm",
    "load_table",
    "misses",
    "register_impl",
    "write_misses",
]
