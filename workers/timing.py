"""Timing one callable the way a tuner can trust: warm-up, L2 flush, device events, median."""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

# Larger than any current GPU's L2 (H200: 60 MB); writing it evicts the inputs between reps.
_L2_FLUSH_BYTES = 256 << 20
_flush_buffers: dict[Any, torch.Tensor] = {}


@dataclass(frozen=True)
class Timing:
    median_ms: float
    q25_ms: float
    q75_ms: float
    reps: int

    @property
    def spread_ms(self) -> float:
        """Interquartile range: the noise a difference must exceed to count."""
        return self.q75_ms - self.q25_ms

    def as_dict(self) -> dict[str, float]:
        d = asdict(self)
        d["spread_ms"] = self.spread_ms
        return d


def _summary(samples: list[float]) -> Timing:
    samples = sorted(samples)
    if len(samples) >= 4:
        q = statistics.quantiles(samples, n=4, method="inclusive")
        q25, q75 = q[0], q[2]
    else:
        q25, q75 = samples[0], samples[-1]
    return Timing(statistics.median(samples), q25, q75, len(samples))


def _flush(device: torch.device) -> None:
    buf = _flush_buffers.get(device)
    if buf is None:
        buf = _flush_buffers[device] = torch.empty(_L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    buf.zero_()


def time_fn(
    fn: Callable[[], Any],
    *,
    device: torch.device | str = "cpu",
    warmup: int = 2,
    reps: int = 25,
    min_reps: int = 5,
    budget_s: float = 0.5,
    flush_l2: bool = True,
) -> Timing:
    """Median time of `fn()` in milliseconds over up to `reps` repetitions within about `budget_s`.

    On CUDA each repetition is timed with its own pair of events after an L2 flush; on
    the CPU with perf_counter.  Warm-up runs keep compilation and first-touch out.
    """
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        deadline = time.perf_counter() + budget_s
        events = []
        for i in range(reps):
            if flush_l2:
                _flush(device)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
            if i + 1 >= min_reps and i % 5 == 4:
                torch.cuda.synchronize(device)
                if time.perf_counter() > deadline:
                    break
        torch.cuda.synchronize(device)
        samples = [s.elapsed_time(e) for s, e in events]
    else:
        deadline = time.perf_counter() + budget_s
        for i in range(reps):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
            if i + 1 >= min_reps and time.perf_counter() > deadline:
                break
    return _summary(samples)


def interleaved(
    fns: dict[str, Callable[[], Any]], *, device: torch.device | str = "cpu", rounds: int = 5, **kw: Any
) -> dict[str, Timing]:
    """Time several candidates in alternating rounds so drift (clocks, heat, neighbours) hits all alike."""
    per: dict[str, list[Timing]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            per[name].append(time_fn(fn, device=device, **kw))
    out = {}
    for name, ts in per.items():
        meds = [t.median_ms for t in ts]
        out[name] = Timing(
            statistics.median(meds),
            statistics.median(t.q25_ms for t in ts),
            statistics.median(t.q75_ms for t in ts),
            sum(t.reps for t in ts),
        )
    return out
