"""How many op calls ran a tuned winner, a borrowed one or the default: `with ops_adv.census() as c: ...; print(c)`.

Unlike the profiler it does not synchronise: a call costs one counter increment. It counts calls that
reach dispatch, so eager ones (and opaque operators run by a compiled graph that is not a CUDA graph);
a CUDA graph's replays run no Python and are not counted.
"""
from __future__ import annotations

from .._dispatch import SOURCES, Census

__all__ = ["SOURCES", "Census", "census"]


def census() -> Census:
    """A context manager counting the op calls inside it by op, implementation and source."""
    return Census()
