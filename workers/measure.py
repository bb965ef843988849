"""Measuring one trial in this process: inputs, correctness gate, timing, a result record.

The gate calls a candidate twice on the same inputs, each time into fresh NaN-poisoned output,
and on CUDA also replays it from a CUDA graph twice: a kernel that keeps state between calls
(a buffer it expects to find zeroed, a counter) fails, so it can never be stored as a winner."""
from __future__ import annotations

import inspect
import time
import traceback
from typing import Any, Callable

import torch

import kernel_space
from kernel_space import get_impl, get_op, relative_error

from .timing import interleaved, time_fn

# Statuses a trial can end with; the tuner adds pruned, timeout and crashed.
OK, PRUNED, COMPILE_ERROR, OUT_OF_RESOURCES, WRONG_RESULT, RUNTIME_ERROR, TIMEOUT, CRASHED = (
    "ok", "pruned", "compile_error", "out_of_resources", "wrong_result", "runtime_error", "timeout", "crashed",
)
# "device-side assert triggered", not "device-side assert": torch ends every CUDA error with "Compile with
# `TORCH_USE_CUDA_DSA` to enable device-side assertions", so a vendor's failed capture ("operation failed") read as
# a fault and lost its timing (H100, torch 2.11)
_FATAL_CUDA = ("illegal memory access", "unspecified launch failure", "device-side assert triggered", "misaligned address")
# CUDA's words for a capture that a forbidden call invalidated; later calls of the process read the same error
_CAPTURE_CUDA = ("during capture", "when stream is capturing", "cudaErrorStreamCapture", "stream capture")
INPUT_SEED = 1234  # the inputs trials are checked and timed on


def context_alive(device: torch.device | str) -> bool:
    """Whether the device still runs work (a CUDA context a kernel broke does not); always True off CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
        torch.zeros(1, device=device).add_(1).item()
        return True
    except Exception:
        return False


def classify(exc: BaseException, device: torch.device | str | None = None, *, first_call: bool = False) -> tuple[str, bool]:
    """(status, context_lost) for an exception raised by a candidate.

    With `device`, a CUDA context is probed, so a lost one is seen whatever the message says.
    `first_call`: the exception came from the candidate's first call, where Triton's own
    exception types mean it did not compile.
    """
    name, module = type(exc).__name__, type(exc).__module__ or ""
    text = f"{name}: {exc}"
    low = text.lower()
    if any(s in text for s in _FATAL_CUDA + _CAPTURE_CUDA):
        return RUNTIME_ERROR, True
    lost = device is not None and not context_alive(device)
    if "OutOfResources" in name or "out of resource" in low:
        return OUT_OF_RESOURCES, lost
    if "Compil" in name or "CompilationError" in text or "ptxas" in low or (first_call and module.startswith("triton")):
        return COMPILE_ERROR, lost
    if isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in low:
        return OUT_OF_RESOURCES, lost
    return RUNTIME_ERROR, lost


def short_error(exc: BaseException, limit: int = 2000, lines: int | None = None) -> str:
    """The exception as text; with `lines`, its first non-empty lines joined on one line."""
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    if lines:
        text = " / ".join([ln.strip() for ln in text.splitlines() if ln.strip()][:lines])
    return text[:limit]


def takes_out(fn: Callable[..., Any]) -> bool:
    try:
        return "out" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _first(x: Any) -> Any:
    return x[0] if isinstance(x, (tuple, list)) and x else x


def check_output(
    fn: Callable[..., Any], args: tuple, attrs: dict, ref: Any, *, device: torch.device | str, out: bool = False,
    calls: int = 2,
) -> dict[str, Any]:
    """Worst relative error of `fn(*args, **attrs)` against `ref` over `calls` calls, output left
    unwritten showing as NaN.

    With `out`, `fn` also writes into a NaN-filled `out=` first (an `out=` it refuses is noted).
    On CUDA each result it allocates itself comes from a NaN-filled block of the caching
    allocator.  Exceptions from `fn` propagate.
    """
    device = torch.device(device)
    dtype = args[0].dtype if args and torch.is_tensor(args[0]) else torch.float32
    errs: list[float] = []
    rec: dict[str, Any] = {"poisoned_out": False}
    if out and torch.is_tensor(ref):
        poisoned = torch.full(ref.shape, float("nan"), dtype=dtype, device=device)
        try:
            res = fn(*args, out=poisoned, **attrs)
            _sync(device)
        except Exception as exc:
            if classify(exc)[1]:
                raise
            rec["note"] = f"out= rejected ({short_error(exc, 120, lines=2)}); checked without it"
        else:
            rec["poisoned_out"] = True
            errs.append(relative_error(poisoned, ref))
            if res is not None and res is not poisoned:
                errs.append(relative_error(_first(res), ref))
        del poisoned
    for _ in range(calls):  # a second call on the same inputs must agree: no state kept between calls
        if torch.is_tensor(ref) and device.type == "cuda" and dtype.is_floating_point:
            torch.full((ref.numel(),), float("nan"), dtype=dtype, device=device)  # freed at once, reused next
        res = fn(*args, **attrs)
        _sync(device)
        errs.append(relative_error(_first(res), ref))
        del res
    rec["rel_error"] = max(errs)
    return rec


def check_graph(fn: Callable[..., Any], args: tuple, attrs: dict, ref: Any, *, device: torch.device | str,
                replays: int = 2) -> dict[str, Any]:
    """`fn(*args, **attrs)` captured in a CUDA graph and replayed `replays` times, its output
    NaN-filled before each: {"graph_rel_error": worst error}, or {"graph_error": why capture failed,
    "context_lost": True}.

    A warm-up call on a side stream first (as torch.cuda.graph's recipe asks) keeps compilation
    and lazily created buffers out of the capture. A capture invalidated by a forbidden call (a
    host sync, say) leaves its error for later CUDA calls to read, and on the H200 (torch 2.11) the
    process then failed every later CUDA call, the exit of `torch.cuda.device` included: so the
    failure is returned with "context_lost", and the worker is replaced. A fault (illegal address, ...)
    is raised.
    """
    device = torch.device(device)
    stream = torch.cuda.current_stream(device)
    try:
        return _capture_and_replay(fn, args, attrs, ref, device, replays)
    except Exception as exc:
        if any(f in str(exc) for f in _FATAL_CUDA):
            raise
        try:
            # torch.cuda.graph's exit skips restoring the stream when capture_end raises
            torch.cuda.set_stream(stream)
            torch.cuda.synchronize(device)
        except Exception:
            pass
        return {"graph_error": short_error(exc, 300, lines=2), "context_lost": True}


def _capture_and_replay(fn: Callable[..., Any], args: tuple, attrs: dict, ref: Any, device: torch.device,
                        replays: int) -> dict[str, Any]:
    with torch.cuda.device(device):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(*args, **attrs)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            res = fn(*args, **attrs)
        out, errs = _first(res), []
        for _ in range(replays):
            if torch.is_tensor(out) and out.dtype.is_floating_point:
                out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            errs.append(relative_error(out, ref))
        del graph, res, out
    return {"graph_rel_error": max(errs)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


WARM_S = 0.25  # seconds a fresh worker runs its first candidate before timing it


class Bench:
    """Inputs and references per problem, kept while the same problem is measured."""

    def __init__(self, device: str, accuracy: float | None = 2.0, graphs: bool = True, warm_s: float = 0.0) -> None:
        self.device = torch.device(device)
        self.accuracy = accuracy  # a candidate's error may be at most this times the vendor kernel's (None: off)
        self.graphs = graphs  # on CUDA, also check each candidate replayed from a CUDA graph
        self._cache: dict[tuple, tuple] = {}
        self._vendor_err: dict[tuple, tuple[str, float] | None] = {}
        self._warm = warm_s <= 0  # a fresh worker (warm_s > 0) warms up for warm_s seconds before its first timing
        self.warm_s = warm_s

    def inputs(self, op: str, problem: Any, seed: int = INPUT_SEED) -> tuple:
        """(args, attrs, reference) for `problem`, built once per seed."""
        key = (op, tuple(problem), seed)
        hit = self._cache.get(key)
        if hit is None:
            if len(self._cache) >= 4:
                self.clear()
            spec = get_op(op)
            args, attrs = spec.make_inputs(problem, self.device, seed=seed)
            ref = spec.reference(*args, **attrs)
            hit = self._cache[key] = (args, attrs, ref)
        return hit

    def clear(self) -> None:
        """Drop the kept inputs and references."""
        self._cache.clear()
        self._vendor_err.clear()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def run(self, trial: dict[str, Any], *, budget_s: float = 0.5, reps: int = 25, warmup: int = 2) -> dict[str, Any]:
        """Check then time one candidate; every failure becomes a status, never an exception.

        The check holds the candidate's first calls (compilation included): its duration is
        `first_call_s`.  `budget_s`, `reps` and `warmup` go to time_fn.
        """
        result: dict[str, Any] = {"status": OK, "error": None, "context_lost": False}
        returned = 0  # the gate's calls that returned: an exception before any did means it did not compile

        def counted(*a: Any, **kw: Any) -> Any:
            nonlocal returned
            res = fn(*a, **kw)
            returned += 1
            return res

        try:
            spec, problem, impl, params, why = self._resolve(trial)
            if why:
                return {**result, "status": PRUNED, "error": why}
            args, attrs, _ = self.inputs(spec.name, problem)
            fn = impl.bind(params)
            t0 = time.perf_counter()
            result.update(self._gate(spec, problem, impl, counted, INPUT_SEED))
            returned += 1  # past the gate
            result["first_call_s"] = round(time.perf_counter() - t0, 3)
            if result["status"] != OK:
                return result
            if not self._warm:
                # A fresh worker's first timing ran 13.49 ms against 0.047 ms confirmed (CPU): two warm-up calls of a
                # fast kernel are microseconds, while thread pools, page faults and neighbours starting up settle in
                # a fraction of a second. Once per worker, then time_fn's count of warm-up calls.
                end = time.perf_counter() + self.warm_s
                while time.perf_counter() < end:
                    fn(*args, **attrs)
                _sync(self.device)
                self._warm = True
            t = time_fn(lambda: fn(*args, **attrs), device=self.device, budget_s=budget_s, reps=reps, warmup=warmup)
            result.update(t.as_dict())
            if self.graphs and self.device.type == "cuda" and not impl.graph_safe:
                # after timing: a failed capture leaves this process unable to run CUDA work (torch 2.11, H200)
                g_args, g_attrs, g_ref = self.inputs(spec.name, problem, INPUT_SEED)
                result.update(check_graph(fn, g_args, g_attrs, g_ref, device=self.device))
            return result
        except BaseException as exc:  # a candidate may raise anything; it is data, not a crash
            return {**result, **self._failure(exc, returned == 0)}

    def check(self, trial: dict[str, Any], *, seed: int = INPUT_SEED) -> dict[str, Any]:
        """The correctness gate of `run` alone, on the inputs of `seed`; never raises."""
        result: dict[str, Any] = {"status": OK, "error": None, "context_lost": False}
        try:
            spec, problem, impl, params, why = self._resolve(trial)
            if why:
                return {**result, "status": PRUNED, "error": why}
            return {**result, **self._gate(spec, problem, impl, impl.bind(params), seed)}
        except BaseException as exc:
            return {**result, **self._failure(exc, False)}

    def confirm(
        self, op: str, problem_data: dict, candidates: list[dict], *, rounds: int = 5, budget_s: float = 0.2,
        reps: int = 15, warmup: int = 2,
    ) -> dict[str, dict]:
        """Re-measure finalists interleaved; keyed by the candidate's 'key'."""
        spec = get_op(op)
        problem = spec.parse_problem(problem_data)
        args, attrs, _ = self.inputs(op, problem)
        fns = {c["key"]: (lambda f=get_impl(op, c["impl"]).bind(c.get("params") or {}): f(*args, **attrs)) for c in candidates}
        res = interleaved(fns, device=self.device, rounds=rounds, budget_s=budget_s, reps=reps, warmup=warmup)
        return {k: v.as_dict() for k, v in res.items()}

    def _resolve(self, trial: dict[str, Any]) -> tuple:
        """(spec, problem, impl, params, why the configuration cannot run or None)."""
        spec = get_op(trial["op"])
        problem = spec.parse_problem(trial["problem"])
        impl = get_impl(trial["op"], trial["impl"])
        params = trial.get("params") or {}
        return spec, problem, impl, params, impl.why_not(problem, params, kernel_space.backend_of(self.device))

    def _gate(self, spec: Any, problem: Any, impl: Any, fn: Callable[..., Any], seed: int) -> dict[str, Any]:
        args, attrs, ref = self.inputs(spec.name, problem, seed)
        res = check_output(fn, args, attrs, ref, device=self.device, out=takes_out(impl.fn))
        err, tol = res["rel_error"], spec.tolerance(problem.dtype)
        if err <= tol and self.graphs and self.device.type == "cuda" and impl.graph_safe:
            res.update(check_graph(fn, args, attrs, ref, device=self.device))
        if not err <= tol:
            res.update(status=WRONG_RESULT, error=f"relative error {err:.3g} > {tol:.3g}")
        elif "graph_error" in res and impl.graph_safe:
            res.update(status=RUNTIME_ERROR, error=f"declared graph-safe, but CUDA graph capture failed: {res['graph_error']}")
        elif not res.get("graph_rel_error", 0.0) <= tol:
            res.update(status=WRONG_RESULT, error=f"relative error {res['graph_rel_error']:.3g} > {tol:.3g} "
                                                  "replayed from a CUDA graph (state kept between calls?)")
        elif self.accuracy and not impl.vendor:
            ven = self.vendor_error(spec, problem, seed)
            if ven is not None:
                name, verr = ven
                floor = torch.finfo(args[0].dtype).eps / 16 if args and torch.is_tensor(args[0]) and args[0].dtype.is_floating_point else 0.0
                limit = self.accuracy * max(verr, floor)
                res["vendor_rel_error"] = verr
                if err > limit:
                    res.update(status=WRONG_RESULT, error=(
                        f"relative error {err:.3g} is {err / max(verr, 1e-300):.1f}x the vendor kernel's ({name}: {verr:.3g}); "
                        f"--accuracy allows {self.accuracy:g}x"))
        return res

    def vendor_error(self, spec: Any, problem: Any, seed: int) -> tuple[str, float] | None:
        """(name, relative error) of the vendor kernel the runtime falls back to, on the same inputs; None if none runs."""
        key = (spec.name, tuple(problem), seed)
        if key not in self._vendor_err:
            self._vendor_err[key] = None
            args, attrs, ref = self.inputs(spec.name, problem, seed)
            backend = kernel_space.backend_of(self.device)
            for v in kernel_space.impls(spec.name, backend=backend):
                if not v.vendor or v.why_not(problem, backend=backend) is not None:
                    continue
                try:
                    r = check_output(v.bind({}), args, attrs, ref, device=self.device, calls=1)
                except Exception:
                    continue
                self._vendor_err[key] = (v.name, r["rel_error"])
                break
        return self._vendor_err[key]

    def _failure(self, exc: BaseException, first_call: bool) -> dict[str, Any]:
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise exc
        status, lost = classify(exc, self.device, first_call=first_call)
        error = short_error(exc)
        if any(s in error for s in _CAPTURE_CUDA):  # however it got here, say what it was
            error = f"CUDA graph capture failed: {error}"
        return {"status": status, "error": error, "context_lost": lost}


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


def conditions(device: str) -> dict[str, Any]:
    """What a winner was measured under, beyond the kernel source: library versions, threads, clocks.

    Keys: threads, torch, triton, cuda, cudnn, cublas, driver, sm_clock_mhz, sm_clock_max_mhz, power_limit_w, ecc
    (None where unknown); never raises.
    """
    import importlib.metadata as md

    d = torch.device(device)
    c: dict[str, Any] = {"threads": torch.get_num_threads(), "torch": torch.__version__, "triton": None, "cuda": torch.version.cuda,
                         "cudnn": None, "cublas": None, "driver": None, "sm_clock_mhz": None, "sm_clock_max_mhz": None,
                         "power_limit_w": None, "ecc": None}
    try:
        import triton

        c["triton"] = triton.__version__
    except Exception:
        pass
    try:
        v = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        c["cudnn"] = str(v) if v is not None else None
    except Exception:
        pass
    for dist in ("nvidia-cublas-cu12", "nvidia-cublas-cu13", "nvidia-cublas"):
        try:
            c["cublas"] = md.version(dist)
            break
        except Exception:
            continue
    if d.type == "cuda":
        c.update(_gpu_state(d))
    else:  # not what a CPU kernel runs on: a new CUDA build must not stale CPU winners
        c.update(cuda=None, cudnn=None, cublas=None)
    return c


def _gpu_state(d: torch.device) -> dict[str, Any]:
    """Driver, SM clock (now and max), power limit and ECC of `d` from nvidia-smi; {} without it."""
    import subprocess

    try:
        uuid = str(torch.cuda.get_device_properties(d).uuid)
        ident = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
        q = "driver_version,clocks.sm,clocks.max.sm,power.limit,ecc.mode.current"
        out = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader,nounits", "-i", ident],
                             capture_output=True, text=True, timeout=10)
        if out.returncode != 0 or not out.stdout.strip():
            return {}
        vals = [v.strip() for v in out.stdout.strip().splitlines()[0].split(",")]
    except Exception:
        return {}

    def num(v: str) -> float | None:
        try:
            return float(v)
        except ValueError:
            return None

    driver, sm, sm_max, power, ecc = (vals + [""] * 5)[:5]
    return {"driver": driver or None, "sm_clock_mhz": num(sm), "sm_clock_max_mhz": num(sm_max), "power_limit_w": num(power),
            "ecc": ecc.lower() if ecc and ecc not in ("[N/A]", "N/A") else None}
