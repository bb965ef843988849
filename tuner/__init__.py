"""The tuning service: CLIs, problem sets, Optuna studies over Ray workers, winners, export."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .driver import TuneOptions, Tuner

__all__ = ["TuneOptions", "Tuner"]


def __getattr__(name: str):
    # Loaded on first use: the command lines import tuner.cli, and a Ctrl-C while torch, Ray and Optuna load is then
    # inside their own handler (one line), not a traceback from this package's import.
    if name in __all__:
        from . import driver

        return getattr(driver, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
