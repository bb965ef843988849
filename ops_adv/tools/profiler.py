"""Which implementation each op call ran, why, and how fast: `with ProfileContext() as prof: ...; print(prof)`."""
from __future__ import annotations

import time
from typing import Any, Callable

import torch

from kernel_space import get_op

from .. import _dispatch

# Dense peaks per device class: (bf16/fp16 tensor TFLOP/s, fp32 TFLOP/s, HBM TB/s), from vendor data sheets.
PEAKS: dict[str, tuple[float, float, float]] = {
    "h200": (989.0, 67.0, 4.8),
    "h100": (989.0, 67.0, 3.35),
    "a100": (312.0, 19.5, 2.0),
}


class ProfileContext:
    """Records every ops-adv op call inside the block: op, problem, implementation, source (tuned,
    nearest, default), time, FLOPs, bytes and the share of the device's peak where it is known.

    Each call is synchronised to be timed, so a profiled run is slower than a plain one.
    """

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __enter__(self) -> "ProfileContext":
        # One bound method, kept: `self._wrap` makes a new object at each access, and a profiler that
        # stayed installed after its block synchronised inside later CUDA graph captures (issue 20).
        self._installed = self._wrap
        _dispatch.add_wrapper(self._installed)
        return self

    def __exit__(self, *exc: Any) -> None:
        _dispatch.remove_wrapper(self._installed)

    def _wrap(self, op: str, problem: Any, impl: str, source: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        spec = get_op(op)
        flops, nbytes = spec.flops(problem), spec.bytes_moved(problem)

        def run(*args: Any, **kwargs: Any) -> Any:
            dev = next((a.device for a in args if hasattr(a, "device")), None)
            if getattr(dev, "type", None) == "cuda" and torch.cuda.is_current_stream_capturing():
                return fn(*args, **kwargs)  # no timing (it synchronises) inside a CUDA graph capture
            sync = _sync_for(dev)
            sync()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            sync()
            s = time.perf_counter() - t0
            self.calls.append({"op": op, "problem": problem._asdict(), "impl": impl, "source": source, "ms": s * 1e3,
                               "flops": flops, "bytes": nbytes, "tflops": flops / s / 1e12 if s else None,
                               "tb_per_s": nbytes / s / 1e12 if s else None,
                               "peak_pct": _peak_pct(dev, problem, flops, nbytes, s)})
            return out

        return run

    def table(self) -> str:
        rows = ["op | implementation | source | ms | TFLOP/s | TB/s | % of peak | problem", "---|---|---|---|---|---|---|---"]
        for c in self.calls:
            pct = f"{c['peak_pct']:.0f}" if c["peak_pct"] is not None else "-"
            prob = ",".join(f"{k}={v}" for k, v in c["problem"].items())
            rows.append(f"{c['op']} | {c['impl']} | {c['source']} | {c['ms']:.4f} | {c['tflops']:.3g} | {c['tb_per_s']:.3g} | {pct} | {prob}")
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.table()


def _sync_for(dev: Any) -> Callable[[], None]:
    if dev is not None and getattr(dev, "type", "cpu") == "cuda":
        import torch

        return lambda: torch.cuda.synchronize(dev)
    return lambda: None


def _peak_pct(dev: Any, problem: Any, flops: float, nbytes: float, s: float) -> float | None:
    """Percent of the roofline bound (compute or bandwidth, whichever binds) this call reached."""
    if dev is None or getattr(dev, "type", "cpu") != "cuda" or not s:
        return None
    cls = _dispatch._device_class(dev)
    peak = PEAKS.get(cls)
    if peak is None:
        return None
    tflops = peak[1] if getattr(problem, "dtype", "") == "fp32" else peak[0]
    bound_s = max(flops / (tflops * 1e12), nbytes / (peak[2] * 1e12))
    return 100.0 * bound_s / s
