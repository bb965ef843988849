"""Dispatch: signature, one dict lookup, call.  Everything slower happens once per new problem."""
from __future__ import annotations

import bisect
import json
import threading
import warnings
from typing import Any, Callable

from kernel_space import OpsAdvError, backend_of, choose_default, get_impl, get_op
from kernel_space._device import device_class_of

from . import _settings, _table

_lock = threading.Lock()
_tuned: dict[str, dict[str, dict[tuple, dict]]] | None = None  # device class -> op -> problem tuple -> winner
_decisions: dict[tuple, tuple[str, dict, str]] = {}  # (op, device class, problem) -> (impl, params, source)
_misses: dict[tuple[str, tuple], int] = {}
_classes: dict[Any, str] = {}
_caches: dict[str, dict] = {}  # op -> {(problem tuple, device): bound callable}
_indexes: dict[tuple[str, str], dict] = {}  # (device class, op) -> nearest-search index, built on first need
_recording: list[dict[tuple[str, tuple], None]] = []  # open record() blocks: problems resolved while open
_wrappers: list[Callable[..., Callable[..., Any]]] = []  # open profilers / NaN checks: wrap(op, problem, impl, source, fn)
# Resolved problems kept at most (all ops together): past it the caches and decisions start again, so a
# stream of new shapes costs memory no more than this (a resolution is a few µs; a hit never checks).
MAX_PROBLEMS = 4096
_epoch = [0]  # bumped whenever resolved calls may resolve differently (a table loaded, caches emptied, wrappers)


def _reset_resolved() -> None:
    """Empty the per-op caches (callers hold _lock): calls resolve again, and graphs captured from them are stale."""
    for c in _caches.values():
        c.clear()
    _passthrough.clear()
    _epoch[0] += 1


def epoch() -> int:
    """A number that changes whenever a call may resolve to another implementation than before (CUDA graphs
    captured from resolved calls are stale then)."""
    return _epoch[0]


def observed() -> bool:
    """Whether every call must reach dispatch now: a record(), census() or profiler block is open."""
    return bool(_recording or _wrappers)


# (device class, op) pairs whose table holds a winner that is not a vendor kernel. Under torch.compile an
# op with none runs torch's own function, which Inductor can fuse with its neighbours (an opaque custom
# operator cost compile(converted) 0.88-0.90x of compile on the H200 with vendor-only tables).
_ours: set[tuple[str, str]] = set()


# device class -> whether converted modules run their own forward there (see passthrough); emptied with the caches
_passthrough: dict[str, bool] = {}


def passthrough(device) -> bool:
    """Whether a converted module may run the original module's forward on `device`: the loaded table holds
    no winner at all for its device class (so every call would run a vendor kernel, torch's own function),
    no ops-adv implementation outranks the vendor kernels as a default, and nothing watches the calls
    (record(), census(), profilers); OPS_ADV_PASSTHROUGH=0 turns it off. Then conversion costs one check where
    nothing is tuned: the dispatch that would choose the vendor kernel (3-9 µs a call on the CPU) is skipped.
    Misses are not counted then; `ops_adv.record()` collects a model's problems."""
    if _recording or _wrappers:
        return False
    dc = _classes.get(device)
    p = _passthrough.get(dc) if dc is not None else None
    if p is None:
        if _tuned is None:
            load_table()
        dc = _device_class(device)
        p = _passthrough[dc] = _settings.passthrough() and not _tuned.get(dc) and _vendor_defaults(backend_of(device))
    return p


def _vendor_defaults(backend: str) -> bool:
    """Whether, on `backend`, every op's default is a vendor kernel (no other implementation outranks them)."""
    from kernel_space._registry import _IMPLS

    for found in _IMPLS.values():
        here = [i for i in found.values() if backend in i.backends]
        vendor = [i.priority for i in here if i.vendor]
        if not vendor or any(not i.vendor and i.priority >= min(vendor) for i in here):
            return False
    return True


def vendor_only(op: str, device) -> bool:
    """Whether every call of `op` on `device` runs a vendor kernel or torch's own (no ops-adv kernel tuned)."""
    if _tuned is None:
        load_table()
    return (_device_class(device), op) not in _ours


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


def load_table(spec: str | None = None, *, any_device: bool = False) -> dict[str, dict[str, dict[tuple, dict]]]:
    """Read the tuned table (OPS_ADV_TABLE, else OPS_ADV_DB) into memory, replacing any loaded before.

    `any_device` accepts a table for a device class this machine lacks (to check it, not to run it).
    """
    global _tuned
    spec = spec if spec is not None else (_settings.table_path() or _settings.db_url())
    tuned: dict[str, dict[str, dict[tuple, dict]]] = {}
    if spec:
        here = _machine_classes()
        for table in _table.load(spec):
            if table.device_class not in here and "://" not in table.source and not any_device:
                raise _table.TableError(
                    f"tuned table {table.source} is for {table.device_class}, but this machine has {', '.join(sorted(here))}; "
                    f"export a table for this device (opsadv-export --device ...) or unset OPS_ADV_TABLE"
                )
            stale, refused, drift = 0, [], {}
            backend = "cpu" if table.device_class == "cpu" else "cuda"
            for w in table.winners:
                try:
                    spec_ = get_op(w["op"])
                    problem = tuple(spec_.parse_problem(w["problem"]))
                    hash(problem)
                    impl = get_impl(w["op"], w["impl"])
                except OpsAdvError:
                    stale += 1
                    continue
                except Exception:  # a problem no parse can read (types the table should never hold)
                    refused.append(f"{_table.short(w['op'], 30)} {_table.short(w['impl'], 30)}: problem {_table.short(w['problem'])} is malformed")
                    continue
                if w.get("kernel_version") and w["kernel_version"] != impl.version:
                    stale += 1
                    continue
                why = _refusal(impl, spec_.problem._make(problem), w["params"], backend)
                if why:
                    refused.append(f"{w['op']} {w['impl']} {_table.short(w['params'], 80)}: {why}")
                    continue
                _drift(w.get("conditions"), table.device_class, drift)
                tuned.setdefault(table.device_class, {}).setdefault(w["op"], {})[problem] = w
            where = _table.redact(table.source)
            if stale:
                warnings.warn(
                    f"{stale} winner(s) in {where} were tuned for kernels that changed or are missing; "
                    f"they are not used (re-tune with opsadv-tune)",
                    _table.RefusedWinners,
                    stacklevel=2,
                )
            if refused:
                warnings.warn(
                    f"{len(refused)} winner(s) in {where} are refused, their calls fall back: "
                    + "; ".join(refused[:3]) + (" ..." if len(refused) > 3 else ""),
                    _table.RefusedWinners,
                    stacklevel=2,
                )
            if drift:
                warnings.warn(
                    f"winners in {where} were measured with "
                    + ", ".join(f"{k} {'/'.join(sorted(v)[:3])} (this process: {h})" for k, (v, h) in sorted(drift.items()))
                    + "; they are used but may be slower here; re-measure with opsadv-tune --revalidate",
                    RuntimeWarning,
                    stacklevel=2,
                )
    ours = {(dc, op) for dc, ops in tuned.items() for op, ws in ops.items()
            if any(not get_impl(op, w["impl"]).vendor for w in ws.values())}
    with _lock:
        _tuned = tuned
        _ours.clear()
        _ours.update(ours)
        _decisions.clear()
        _indexes.clear()
        _reset_resolved()
    return tuned


def _refusal(impl, problem, params: dict, backend: str) -> str | None:
    """Why a table's `params` cannot be used for `problem`: not a point of the space, or refused by the check."""
    space = impl.space
    if set(params) != set(space):
        extra, missing = sorted(map(str, set(params) - set(space))), sorted(set(space) - set(params))
        return "parameters " + "; ".join(
            ([f"unknown {', '.join(extra)[:60]}"] if extra else []) + ([f"missing {', '.join(missing)}"] if missing else [])
        )
    for k, v in params.items():
        if not any(type(v) is type(c) and v == c for c in space[k]):
            return f"{k}={_table.short(v, 30)} is not one of {_table.short(list(space[k]), 60)}"
    if backend not in impl.backends:
        return f"{impl.name} has no {backend} backend"
    if impl.check is None:
        return None
    try:
        return impl.check(problem, params)
    except Exception as e:
        return f"its check fails ({type(e).__name__})"


_HERE: dict[str, str] | None = None


def _conditions_here() -> dict[str, str]:
    global _HERE
    if _HERE is None:
        import importlib.metadata as md

        import torch

        here = {"torch": torch.__version__.split("+")[0], "cuda": str(torch.version.cuda)}
        try:
            here["triton"] = md.version("triton")
        except md.PackageNotFoundError:
            here["triton"] = "none"
        _HERE = here
    import torch

    return {**_HERE, "threads": str(torch.get_num_threads())}


def _drift(cond, device_class: str, out: dict) -> None:
    """Collect, per condition, the values a winner was measured with that differ from this process's."""
    if not isinstance(cond, dict):
        return
    here = _conditions_here()
    keys = ("threads", "torch", "triton") if device_class == "cpu" else ("torch", "triton", "cuda")
    for k in keys:
        v = cond.get(k)
        if v is None or isinstance(v, (dict, list)):
            continue
        v = str(v).split("+")[0] if k == "torch" else str(v)
        if v != here[k]:
            out.setdefault(k, (set(), here[k]))[0].add(v[:20])


def cache_for(op: str) -> dict:
    """The dict `lookup` caches `op`'s resolved implementations in, keyed by (problem, device); emptied, never replaced."""
    return _caches.setdefault(op, {})


def lookup(op: str, problem: tuple, device) -> Callable[..., Any]:
    """The implementation bound to its parameters for `problem` on `device` (resolved once, then a dict hit)."""
    cache = _caches.get(op)
    if cache is None:
        cache = _caches.setdefault(op, {})
    fn = cache.get((problem, device))
    if fn is None:
        fn = _resolve(op, problem, device)
    return fn


def _resolve(op: str, problem: tuple, device) -> Callable[..., Any]:
    if _tuned is None:
        load_table()
    if len(_decisions) >= MAX_PROBLEMS:
        forget_resolved()
    spec = get_op(op)
    dc = _device_class(device)
    backend = backend_of(device)
    table = _tuned.get(dc, {}).get(op, {})
    p = spec.problem._make(problem)
    bucketed = spec.bucket(problem)  # what the table and tuning know streaming dims by
    source, w = "tuned", table.get(problem) or table.get(bucketed)
    if w is None:
        source, w = "nearest", _nearest(spec, problem, (dc, op), table)
    twin = spec.twin(problem) if w is None and table else None
    if twin is not None:
        source, w = "twin", table.get(twin) or table.get(spec.bucket(twin)) or _nearest(spec, twin, (dc, op), table)
    impl = None
    if w is not None:
        cand, params = get_impl(op, w["impl"]), w["params"]
        if source != "tuned" and not cand.vendor:
            params = _borrowed(spec, cand, w, p)
        if params is not None and cand.why_not(p, params, backend) is None:
            impl = cand
    if impl is None:
        source, impl = "default", choose_default(op, p, backend)
        params = impl.default_params()
    _decisions[(op, dc, problem)] = (impl.name, dict(params), source)
    for seen in _recording:
        seen[(op, bucketed)] = None
    fn = impl.bind(params)
    if source != "tuned":
        fn = _counting(fn, (op, bucketed), impl.vendor)
    for wrap in _wrappers:
        fn = wrap(op, p, impl.name, source, fn)
    _caches[op][(problem, device)] = fn
    return fn


# A winner of ours is borrowed for another problem only when it beat the vendor by this much on its own:
# a narrow win there says nothing of a problem it was never measured on.
BORROW_MIN_SPEEDUP = 1.1


def _borrowed(spec, impl, w: dict, p) -> dict | None:
    """A near problem's winner `w` fitted to `p` (the implementation's `adapt`), or None when it won too
    narrowly to be trusted away from its own problem."""
    speedup = w.get("speedup")
    if isinstance(speedup, (int, float)) and speedup < BORROW_MIN_SPEEDUP:
        return None
    if impl.adapt is None:
        return w["params"]
    try:
        tuned = spec.parse_problem(w["problem"]) if isinstance(w["problem"], dict) else spec.problem._make(w["problem"])
        params = impl.adapt(tuned, p, w["params"])
    except Exception:  # a problem the adapter cannot read: the parameters as tuned
        return w["params"]
    return params if impl.why_not(p, params) is None else w["params"]


def forget_resolved() -> None:
    """Empty the caches and decisions (they fill again as calls come)."""
    with _lock:
        _decisions.clear()
        _reset_resolved()


def bounded(cache: dict) -> dict:
    """`cache` (one of cache_for's), emptied first when it holds MAX_PROBLEMS entries: for callers that fill their own."""
    if len(cache) >= MAX_PROBLEMS:
        cache.clear()
    return cache


def decided(op: str, problem: tuple, device) -> tuple[str, dict, str]:
    """(implementation, parameters, source) that `op` runs for `problem` on `device` (resolved if new)."""
    key = (op, _device_class(device), problem)
    d = _decisions.get(key)
    if d is None or (problem, device) not in _caches.get(op, ()):
        lookup(op, problem, device)
        d = _decisions[key]
    return d


def stand_in(op: str, problem: tuple, device, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` standing in for `op`'s implementation for `problem` (a caller's equivalent of a vendor kernel):
    counted as a miss and wrapped (profilers, NaN checks) as `lookup`'s own would be."""
    impl, _params, source = decided(op, problem, device)
    spec = get_op(op)
    if source != "tuned":
        fn = _counting(fn, (op, spec.bucket(problem)))
    for wrap in _wrappers:
        fn = wrap(op, spec.problem._make(problem), impl, source, fn)
    return fn


def runs_default(op: str, problem: tuple, device) -> bool:
    """Whether `op` runs its default implementation for `problem` on `device` (nothing tuned or near
    applies): then a call that needs autograd can be torch's own function, graph and all."""
    if (problem, device) not in _caches.get(op, ()):
        lookup(op, problem, device)
    return _decisions[(op, _device_class(device), problem)][2] == "default"


def add_wrapper(wrap: Callable[..., Callable[..., Any]]) -> None:
    """Wrap every implementation resolved from now on (caches are emptied so known problems resolve again)."""
    with _lock:
        _wrappers.append(wrap)
        _reset_resolved()


def remove_wrapper(wrap: Callable[..., Callable[..., Any]]) -> None:
    with _lock:
        _wrappers[:] = [w for w in _wrappers if w != wrap]  # ==: bound methods are equal, not identical
        _reset_resolved()


def start_recording() -> dict[tuple[str, tuple], None]:
    """Record every problem resolved from now on (caches are emptied so known problems resolve again)."""
    seen: dict[tuple[str, tuple], None] = {}
    with _lock:
        _recording.append(seen)
        _reset_resolved()
    return seen


def stop_recording(seen: dict) -> None:
    with _lock:
        _recording[:] = [r for r in _recording if r is not seen]


def _counting(fn: Callable[..., Any], key: tuple[str, tuple], vendor: bool = False) -> Callable[..., Any]:
    """`fn`, counting each call as a miss (the table did not hold this problem). For a vendor kernel the result
    carries `vendor_miss`: an op may call it and run torch's own function on the caller's tensors instead, the same
    math without adapting them to the kernel's form (rope on the CPU: half the time, issue 30)."""
    _misses.setdefault(key, 0)

    def run(*args: Any, **kwargs: Any) -> Any:
        _misses[key] = _misses.get(key, 0) + 1
        return fn(*args, **kwargs)

    if vendor:
        def miss() -> None:
            _misses[key] = _misses.get(key, 0) + 1

        run.vendor_miss = miss
    return run


def _nearest(spec, problem: tuple, where: tuple[str, str], table: dict[tuple, dict]) -> dict | None:
    """The tuned problem closest to `problem` (Σ |log2 size ratio| within OPS_ADV_NEAREST) with the same
    non-size fields: a bisect along the first size field, then one vectorised distance over that window."""
    if not table:
        return None
    import math

    import torch

    index = _indexes.get(where)
    if index is None:
        index = _indexes[where] = _build_index(spec, table)
    sizes = [i for i, f in enumerate(spec.problem._fields) if f in spec.size_fields]
    if any(problem[i] <= 0 for i in sizes):
        return None
    group = index.get(tuple(v for i, v in enumerate(problem) if i not in sizes))
    if group is None:
        return None
    logs, first, winners = group
    # Only entries within the limit along the first size field can be within it overall: a
    # bisect over that field (sorted) bounds the slice the vectorised distance runs over.
    limit = _settings.nearest_max_distance()
    q0 = math.log2(problem[sizes[0]])
    lo, hi = bisect.bisect_left(first, q0 - limit - 1e-6), bisect.bisect_right(first, q0 + limit + 1e-6)
    if lo >= hi:
        return None
    q = torch.tensor([[math.log2(problem[i]) for i in sizes]], dtype=torch.float32)
    d = torch.cdist(logs[lo:hi], q, p=1.0)[:, 0]  # one op: 26 µs over 3000 entries, 2x the per-field form
    best = int(torch.argmin(d))
    return winners[lo + best] if float(d[best]) <= limit + 1e-6 else None


def _build_index(spec, table: dict[tuple, dict]) -> dict[tuple, tuple[Any, list[dict]]]:
    import math

    import torch

    sizes = [i for i, f in enumerate(spec.problem._fields) if f in spec.size_fields]
    groups: dict[tuple, tuple[list, list]] = {}
    for prob, w in table.items():
        key = tuple(v for i, v in enumerate(prob) if i not in sizes)
        logs, ws = groups.setdefault(key, ([], []))
        logs.append([math.log2(prob[i]) for i in sizes])
        ws.append(w)
    out = {}
    for k, (logs, ws) in groups.items():
        order = sorted(range(len(ws)), key=lambda j: logs[j][0])
        t = torch.tensor([logs[j] for j in order], dtype=torch.float32)
        out[k] = (t, [logs[j][0] for j in order], [ws[j] for j in order])
    return out


def _generic(op: str) -> Callable[..., Any]:
    """An op with no function in `ops_adv.ops` (a plugin's): signature, lookup, call."""
    signature = get_op(op).signature

    def run(*tensors: Any, **attrs: Any) -> Any:
        return lookup(op, signature(*tensors, **attrs), tensors[0].device)(*tensors, **attrs)

    run.__name__ = run.__qualname__ = op
    return run


# op -> the function `ops_adv.<op>`: each module of `ops_adv.ops` registers its own; other ops get _generic.
# An op that routes to another (linear to gemm) calls it through here, so no op module imports another.
_OP_FUNCS: dict[str, Callable[..., Any]] = {}
# op -> its function's arguments as the kernels take them (None: no kernel covers the call), for explain and
# benchmark; ops whose function takes what the kernels take have none.
_KERNEL_ARGS: dict[str, Callable[..., Any]] = {}
_SIGNATURES: dict[str, Callable[..., tuple]] = {}  # op -> the problem as its function keys it, where not the spec's


def register_function(op: str, fn: Callable[..., Any], kernel_args: Callable[..., Any] | None = None,
                      signature: Callable[..., tuple] | None = None) -> None:
    """Make `fn` the function that `ops_adv.<op>`, `op_function(op)` and `dispatch(op, ...)` run;
    `kernel_args(*args, **kwargs)` maps its arguments (torch's) to the kernels' ((tensors), {attrs}), or None;
    `signature(*tensors, **attrs)` is the problem as `fn` keys it (default: the op spec's)."""
    _OP_FUNCS[op] = fn
    if kernel_args is not None:
        _KERNEL_ARGS[op] = kernel_args
    if signature is not None:
        _SIGNATURES[op] = signature


def signature_of(op: str) -> Callable[..., tuple]:
    """The problem signature dispatch keys `op` by."""
    sig = _SIGNATURES.get(op)
    return sig if sig is not None else get_op(op).signature


def kernel_args(op: str, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """`ops_adv.<op>(*args, **kwargs)`'s arguments as the kernels take them, or None where torch's function runs."""
    get_op(op)  # an unknown op: one clear error
    adapt = _KERNEL_ARGS.get(op)
    if adapt is None:
        return tuple(args), dict(kwargs)
    try:
        return adapt(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"{op}: {e}") from None


def op_function(op: str) -> Callable[..., Any]:
    """The function `ops_adv.<op>` for `op`."""
    fn = _OP_FUNCS.get(op)
    if fn is None:
        fn = _OP_FUNCS[op] = _generic(op)
    return fn


def dispatch(op: str, *tensors: Any, **attrs: Any) -> Any:
    """Run `op` on `tensors` with the tuned implementation for their problem and device."""
    fn = _OP_FUNCS.get(op)
    if fn is None:
        fn = op_function(op)
    return fn(*tensors, **attrs)


def explain(op: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Which implementation and parameters dispatch picks for `ops_adv.<op>(*args, **kwargs)`, and why
    (source "torch": no kernel covers the call, torch's own function runs it)."""
    mapped = kernel_args(op, args, kwargs)
    if mapped is None:
        return {"op": op, "problem": None, "impl": None, "params": None, "source": "torch"}
    return decision(op, *mapped)


def decision(op: str, tensors: tuple, attrs: dict) -> dict[str, Any]:
    """explain() for arguments already in the kernels' form."""
    spec = get_op(op)
    problem = signature_of(op)(*tensors, **attrs)
    device = tensors[0].device
    if (problem, device) not in _caches.setdefault(op, {}):
        _resolve(op, problem, device)
    impl, params, source = _decisions[(op, _device_class(device), problem)]
    return {"op": op, "problem": spec.problem._make(problem)._asdict(), "impl": impl, "params": params, "source": source}


def misses() -> dict[tuple[str, tuple], int]:
    """Problems dispatched without a tuned winner (streaming dims bucketed), with how many calls each had."""
    return dict(_misses)


def write_misses(path: str, *, top: int | None = None) -> int:
    """Write the problems dispatched without a tuned winner (streaming dims bucketed) as a shapes file for
    `opsadv-tune --shapes`, the costliest first (calls x FLOPs), at most `top`; returns how many."""
    ranked = sorted(_misses.items(), key=lambda kv: -kv[1] * get_op(kv[0][0]).flops(get_op(kv[0][0]).problem._make(kv[0][1])))
    out: dict[str, list[dict]] = {}
    for (op, problem), _calls in ranked[:top]:
        out.setdefault(op, []).append(get_op(op).problem._make(problem)._asdict())
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    return sum(len(v) for v in out.values())


# --------------------------------------------------------------------------- census (ops_adv.census)

SOURCES = ("tuned", "nearest", "twin", "default")


class Census:
    """Calls per (op, implementation, source) inside the block; source is where the implementation came
    from: `tuned` (the table's winner for this problem), `nearest` (a close problem's winner), `twin` (the
    winner of the same problem without a flag such as decode_attention's key mask), `default` (nothing
    tuned applies: the highest-priority implementation, normally the vendor's)."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str, str], int] = {}
        self.problems: dict[tuple[str, str, str], set] = {}

    def __enter__(self) -> "Census":
        self._installed = self._wrap  # one bound method: removed by equality on exit
        add_wrapper(self._installed)
        return self

    def __exit__(self, *exc: Any) -> None:
        remove_wrapper(self._installed)

    def _wrap(self, op: str, problem: Any, impl: str, source: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        key = (op, impl, source)
        counts = self.counts
        counts.setdefault(key, 0)
        self.problems.setdefault(key, set()).add(tuple(problem))

        def run(*args: Any, **kwargs: Any) -> Any:
            counts[key] += 1
            return fn(*args, **kwargs)

        return run

    @property
    def calls(self) -> int:
        return sum(self.counts.values())

    def by_source(self) -> dict[str, int]:
        """{source: calls} over every op, each source present (0 where none)."""
        out = dict.fromkeys(SOURCES, 0)
        for (_op, _impl, source), n in self.counts.items():
            out[source] = out.get(source, 0) + n
        return out

    def by_op(self) -> dict[str, dict[str, int]]:
        """{op: {source: calls}}."""
        out: dict[str, dict[str, int]] = {}
        for (op, _impl, source), n in self.counts.items():
            d = out.setdefault(op, dict.fromkeys(SOURCES, 0))
            d[source] = d.get(source, 0) + n
        return out

    def rows(self) -> list[dict[str, Any]]:
        return [{"op": op, "impl": impl, "source": source, "calls": n, "problems": len(self.problems[(op, impl, source)])}
                for (op, impl, source), n in sorted(self.counts.items(), key=lambda kv: (kv[0][0], -kv[1]))]

    def __str__(self) -> str:
        total = self.calls
        src = self.by_source()
        head = f"{total} op calls: " + ", ".join(
            f"{s} {n} ({n / total:.0%})" if total else f"{s} 0" for s, n in src.items())
        lines = [head, f"{'op':<18} {'implementation':<24} {'source':<8} {'calls':>7} {'problems':>8}"]
        lines += [f"{r['op']:<18} {r['impl']:<24} {r['source']:<8} {r['calls']:>7} {r['problems']:>8}" for r in self.rows()]
        return "\n".join(lines)
