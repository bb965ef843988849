"""Measuring one trial in this process: inputs, correctness gate, timing, a result record."""
from __future__ import annotations

import traceback
from typing import Any

import torch

import kernel_space
from kernel_space import get_impl, get_op, relative_error

from .timing import interleaved, time_fn

# Statuses a trial can end with; the tuner adds pruned, timeout and crashed.
OK, PRUNED, COMPILE_ERROR, OUT_OF_RESOURCES, WRONG_RESULT, RUNTIME_ERROR, TIMEOUT, CRASHED = (
    "ok", "pruned", "compile_error", "out_of_resources", "wrong_result", "runtime_error", "timeout", "crashed",
)
_FATAL_CUDA = ("illegal memory access", "unspecified launch failure", "device-side assert", "misaligned address")


def classify(exc: BaseException) -> tuple[str, bool]:
    """(status, context_lost) for an exception raised by a candidate."""
    text = f"{type(exc).__name__}: {exc}"
    name = type(exc).__name__
    if any(s in text for s in _FATAL_CUDA):
        return RUNTIME_ERROR, True
    if "OutOfResources" in name or "out of resource" in text.lower():
        return OUT_OF_RESOURCES, False
    if "CompilationError" in name or "CompileTimeAssertionFailure" in name or "PTXAS" in text:
        return COMPILE_ERROR, False
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return OUT_OF_RESOURCES, False
    return RUNTIME_ERROR, False


def _short(exc: BaseException, limit: int = 2000) -> str:
    lines = traceback.format_exception_only(type(exc), exc)
    return "".join(lines).strip()[:limit]


class Bench:
    """Inputs and references per problem, kept while the same problem is measured."""

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)
        self._cache: dict[tuple, tuple] = {}

    def inputs(self, op: str, problem: Any) -> tuple:
        key = (op, tuple(problem))
        hit = self._cache.get(key)
        if hit is None:
            if len(self._cache) >= 4:
                self._cache.clear()
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
            spec = get_op(op)
            args, attrs = spec.make_inputs(problem, self.device, seed=1234)
            ref = spec.reference(*args, **attrs)
            hit = self._cache[key] = (args, attrs, ref)
        return hit

    def run(self, trial: dict[str, Any], *, budget_s: float = 0.5, reps: int = 25) -> dict[str, Any]:
        """Check then time one candidate; every failure becomes a status, never an exception."""
        op, impl_name, params = trial["op"], trial["impl"], trial.get("params") or {}
        result: dict[str, Any] = {"status": OK, "error": None, "context_lost": False}
        try:
            spec = get_op(op)
            problem = spec.parse_problem(trial["problem"])
            impl = get_impl(op, impl_name)
            why = impl.why_not(problem, params, kernel_space.backend_of(self.device))
            if why:
                return {**result, "status": PRUNED, "error": why}
            args, attrs, ref = self.inputs(op, problem)
            fn = impl.bind(params)
            out = fn(*args, **attrs)
            self._sync()
            err = relative_error(out, ref)
            result["rel_error"] = err
            if not err <= spec.tolerance(problem.dtype):
                return {**result, "status": WRONG_RESULT, "error": f"relative error {err:.3g} > {spec.tolerance(problem.dtype):.3g}"}
            del out
            t = time_fn(lambda: fn(*args, **attrs), device=self.device, budget_s=budget_s, reps=reps)
            result.update(t.as_dict())
            return result
        except BaseException as exc:  # a candidate may raise anything; it is data, not a crash
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            status, lost = classify(exc)
            return {**result, "status": status, "error": _short(exc), "context_lost": lost}

    def confirm(self, op: str, problem_data: dict, candidates: list[dict], *, rounds: int = 5) -> dict[str, dict]:
        """Re-measure finalists interleaved; keyed by the candidate's 'key'."""
        spec = get_op(op)
        problem = spec.parse_problem(problem_data)
        args, attrs, _ = self.inputs(op, problem)
        fns = {c["key"]: (lambda f=get_impl(op, c["impl"]).bind(c.get("params") or {}): f(*args, **attrs)) for c in candidates}
        res = interleaved(fns, device=self.device, rounds=rounds, budget_s=0.2, reps=15)
        return {k: v.as_dict() for k, v in res.items()}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def fingerprint(device: str) -> dict[str, Any]:
    """Everything that decides whether a measurement still applies."""
    import platform

    d = torch.device(device)
    fp: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version()}
    try:
        import triton

        fp["triton"] = triton.__version__
    except ImportError:
        fp["triton"] = None
    if d.type == "cuda":
        props = torch.cuda.get_device_properties(d)
        fp.update(
            name=props.name,
            capability=f"{props.major}.{props.minor}",
            sms=props.multi_processor_count,
            memory_bytes=props.total_memory,
            cuda=torch.version.cuda,
            driver=_driver_version(),
        )
    else:
        import os

        fp.update(name=platform.processor() or platform.machine(), machine=platform.machine(), cpus=os.cpu_count())
    return fp


def _driver_version() -> str | None:
    try:
        import subprocess

        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except Exception:
        return None
