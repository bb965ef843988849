"""Measuring trials: correctness gate, timing and fault isolation, in Ray actors."""
from __future__ import annotations

from .measure import Bench, classify, fingerprint
from .timing import Timing, interleaved, time_fn

__all__ = ["Bench", "Timing", "classify", "fingerprint", "interleaved", "time_fn"]
