"""`ops_adv.benchmark(op, *tensors)`: every candidate on these very inputs, as a table."""
from __future__ import annotations

import statistics
import time
from typing import Any

from kernel_space import OpsAdvError, backend_of, get_impl, get_op, impls, relative_error

from .. import _dispatch


class BenchmarkResult(list):
    """Rows of {impl, params, status, ms, rel_error, speedup vs the vendor kernel, chosen}; printed as a table."""

    def __str__(self) -> str:
        out = ["implementation | params | status | ms | rel. error | vs vendor | dispatch picks", "---|---|---|---|---|---|---"]
        for r in self:
            ms = f"{r['ms']:.4f}" if r.get("ms") is not None else "-"
            err = f"{r['rel_error']:.2g}" if r.get("rel_error") is not None else "-"
            sp = f"{r['speedup']:.2f}x" if r.get("speedup") else "-"
            out.append(f"{r['impl']} | {r['params'] or ''} | {r['status']} | {ms} | {err} | {sp} | {'<-' if r['chosen'] else ''}")
        return "\n".join(out)


def benchmark(op: str, *args: Any, reps: int = 20, **kwargs: Any) -> BenchmarkResult:
    """Time every implementation of `op` that runs on these inputs' device (default parameters, and the
    table's parameters where it holds this problem), check each against the op's reference, and mark
    the one dispatch picks. Implementations that cannot run say why. The arguments are `ops_adv.<op>`'s."""
    spec = get_op(op)
    mapped = _dispatch.kernel_args(op, args, kwargs)
    if mapped is None:
        raise OpsAdvError(f"benchmark: no {op} kernel covers this call (ops_adv.{op} runs torch's own function for it)")
    tensors, attrs = mapped
    problem_t = _dispatch.signature_of(op)(*tensors, **attrs)
    problem = spec.problem._make(problem_t)
    dev = tensors[0].device
    backend = backend_of(dev)
    chosen = _dispatch.decision(op, tensors, attrs)
    ref = spec.reference(*tensors, **attrs)
    tol = spec.tolerance(problem.dtype)
    candidates = [(i, i.default_params()) for i in impls(op)]
    if chosen["params"] and (chosen["impl"], chosen["params"]) not in [(i.name, p) for i, p in candidates]:
        candidates.insert(0, (get_impl(op, chosen["impl"]), chosen["params"]))
    rows = BenchmarkResult()
    for impl, params in candidates:
        row: dict[str, Any] = {"impl": impl.name, "params": params, "vendor": impl.vendor, "ms": None, "rel_error": None,
                               "chosen": impl.name == chosen["impl"] and params == chosen["params"]}
        why = impl.why_not(problem, params, backend)
        if why:
            rows.append({**row, "status": f"refused: {why}"})
            continue
        fn = impl.bind(params)
        try:
            out = fn(*tensors, **attrs)
            err = relative_error(_first(out), _first(ref))  # ops with several outputs: the reference covers the first
            row.update(rel_error=err, ms=_time(lambda: fn(*tensors, **attrs), dev, reps))
            row["status"] = "ok" if err <= tol else f"wrong result (tolerance {tol:g})"
        except Exception as e:  # a candidate's failure is a row, not an exception
            row["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        rows.append(row)
    vendor = min((r["ms"] for r in rows if r["vendor"] and r["ms"] is not None), default=None)
    for r in rows:
        r["speedup"] = vendor / r["ms"] if vendor and r["ms"] else None
    return rows


def _time(fn: Any, dev: Any, reps: int) -> float:
    """Median ms of `reps` calls after two warm-ups (CUDA events on a GPU)."""
    import torch

    for _ in range(2):
        fn()
    samples = []
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def _first(x: Any) -> Any:
    return x[0] if isinstance(x, (tuple, list)) and x else x
