"""Dispatch: signature, one dict lookup, call.  Everything slower happens once per new problem."""
from __future__ import annotations

import json
import threading
import warnings
from typing import Any, Callable

from kernel_space import OpsAdvError, backend_of, choose_default, get_impl, get_op, problem_distance
from kernel_space._device import device_class_of

from . import _settings, _table

_lock = threading.Lock()
_tuned: dict[str, dict[str, dict[tuple, dict]]] | None = None  # device class -> op -> problem tuple -> winner
_decisions: dict[tuple, tuple[str, dict, str]] = {}  # (op, device class, problem) -> (impl, params, source)
_misses: dict[tuple[str, tuple], int] = {}
_classes: dict[Any, str] = {}
_caches: dict[str, dict] = {}  # op -> {(problem tuple, device): bound callable}


def _device_class(device) -> str:
    dc = _classes.get(device)
    if dc is None:
        if device.type == "cpu":
            dc = "cpu"
        else:
            import torch

            dc = device_class_of(torch.cuda.get_device_name(device))
        _classes[device] = dc
    return dc


def _machine_classes() -> set[str]:
    found = {"cpu"}
    try:
        import torch

        if torch.cuda.is_available():
            found |= {device_class_of(torch.cuda.get_device_name(i)) for i in range(torch.cuda.device_count())}
    except Exception:
        pass
    return found


def load_table(spec: str | None = None) -> dict[str, dict[str, dict[tuple, dict]]]:
    """Read the tuned table (OPS_ADV_TABLE, else OPS_ADV_DB) into memory, replacing any loaded before."""
    global _tuned
    spec = spec if spec is not None else (_settings.table_path() or _settings.db_url())
    tuned: dict[str, dict[str, dict[tuple, dict]]] = {}
    if spec:
        here = _machine_classes()
        for table in _table.load(spec):
            if table.device_class not in here and "://" not in table.source:
                raise _table.TableError(
                    f"tuned table {table.source} is for {table.device_class}, but this machine has {', '.join(sorted(here))}; "
                    f"export a table for this device (opsadv-export --device ...) or unset OPS_ADV_TABLE"
                )
            stale = 0
            for w in table.winners:
                try:
                    spec_ = get_op(w["op"])
                    problem = tuple(spec_.parse_problem(w["problem"]))
                    impl = get_impl(w["op"], w["impl"])
                except OpsAdvError:
                    stale += 1
                    continue
                if w.get("kernel_version") and w["kernel_version"] != impl.version:
                    stale += 1
                    continue
                tuned.setdefault(table.device_class, {}).setdefault(w["op"], {})[problem] = w
            if stale:
                warnings.warn(
                    f"{stale} winner(s) in {_table.redact(table.source)} were tuned for kernels that changed or are missing; "
                    f"they are not used (re-tune with opsadv-tune)",
                    RuntimeWarning,
                    stacklevel=2,
                )
    with _lock:
        _tuned = tuned
        _decisions.clear()
        for c in _caches.values():
            c.clear()
    return tuned


def _resolve(op: str, problem: tuple, device) -> Callable[..., Any]:
    if _tuned is None:
        load_table()
    spec = get_op(op)
    dc = _device_class(device)
    backend = backend_of(device)
    table = _tuned.get(dc, {}).get(op, {})
    p = spec.problem._make(problem)
    source, w = "tuned", table.get(problem)
    if w is None:
        _misses[(op, problem)] = _misses.get((op, problem), 0) + 1
        source, w = "nearest", _nearest(spec, problem, table)
    impl = None
    if w is not None:
        cand = get_impl(op, w["impl"])
        if cand.why_not(p, w["params"], backend) is None:
            impl, params = cand, w["params"]
    if impl is None:
        source, impl = "default", choose_default(op, p, backend)
        params = impl.default_params()
    _decisions[(op, dc, problem)] = (impl.name, dict(params), source)
    fn = impl.bind(params)
    _caches[op][(problem, device)] = fn
    return fn


def _nearest(spec, problem: tuple, table: dict[tuple, dict]) -> dict | None:
    limit = _settings.nearest_max_distance()
    best, best_d = None, None
    for other, w in table.items():
        d = problem_distance(spec, problem, other)
        if d is not None and d <= limit and (best_d is None or d < best_d):
            best, best_d = w, d
    return best


def _make_op(op: str) -> Callable[..., Any]:
    spec = get_op(op)
    signature = spec.signature
    cache = _caches.setdefault(op, {})

    def run(*tensors: Any, **attrs: Any) -> Any:
        problem = signature(*tensors, **attrs)
        device = tensors[0].device
        fn = cache.get((problem, device))
        if fn is None:
            fn = _resolve(op, problem, device)
        return fn(*tensors, **attrs)

    run.__name__ = op
    run.__qualname__ = op
    run.__doc__ = f"Run {op} with the tuned implementation for this problem and device (see ops_adv.explain)."
    return run


_OP_FUNCS: dict[str, Callable[..., Any]] = {}


def op_function(op: str) -> Callable[..., Any]:
    fn = _OP_FUNCS.get(op)
    if fn is None:
        fn = _OP_FUNCS[op] = _make_op(op)
    return fn


def dispatch(op: str, *tensors: Any, **attrs: Any) -> Any:
    """Run `op` on `tensors` with the tuned implementation for their problem and device."""
    fn = _OP_FUNCS.get(op)
    if fn is None:
        fn = op_function(op)
    return fn(*tensors, **attrs)


def explain(op: str, *tensors: Any, **attrs: Any) -> dict[str, Any]:
    """Which implementation and parameters dispatch picks for these tensors, and why."""
    spec = get_op(op)
    problem = spec.signature(*tensors, **attrs)
    device = tensors[0].device
    if (problem, device) not in _caches.setdefault(op, {}):
        _resolve(op, problem, device)
    impl, params, source = _decisions[(op, _device_class(device), problem)]
    return {"op": op, "problem": spec.problem._make(problem)._asdict(), "impl": impl, "params": params, "source": source}


def misses() -> dict[tuple[str, tuple], int]:
    """Problems dispatched that the table did not hold exactly, with how often they were resolved."""
    return dict(_misses)


def write_misses(path: str) -> int:
    """Write missed problems as a shapes file for `opsadv-tune --shapes`; returns how many."""
    out: dict[str, list[dict]] = {}
    for op, problem in _misses:
        out.setdefault(op, []).append(get_op(op).problem._make(problem)._asdict())
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    return sum(len(v) for v in out.values())
