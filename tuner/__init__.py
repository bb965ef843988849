"""The tuning service: CLIs, problem sets, Optuna studies over Ray workers, winners, export."""
from __future__ import annotations

from .driver import TuneOptions, Tuner

__all__ = ["TuneOptions", "Tuner"]
