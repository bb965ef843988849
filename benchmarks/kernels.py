#!/usr/bin/env python
"""Kernel benchmark: every registered op's tuned implementations against its vendor kernels.

One run measures the card's ceilings (device copy bandwidth, bf16 matmul peak), then for
each op and problem times every vendor candidate and a bounded sweep of each tuned
(Triton on CUDA) implementation's space, checks the winners against the op's reference on
fresh inputs, and writes DIR/<date>-<gpu>-kernels.json (everything) and .md (the table).
Candidates are checked and timed as the tuner does it (workers.measure.Bench); this file
keeps the problems, the sweep order, the targets and the report.

The sweep tries, in order: the default config, the correct winners of earlier problems of
the same implementation (warm start), then the rest of the space in a fixed shuffled order
(seed 0) -- all of it when at most --max-configs are valid, else the first --max-configs,
cut short when the problem's budget runs out.

    python benchmarks/kernels.py --out DIR [--ops gemm,attention] [--budget-s 12] [--quick]
    python benchmarks/kernels.py --device cpu --quick --out /tmp/kb      # smoke test

Time is bounded three ways: a per-problem sweep budget (--budget-s), a sweep budget shared
by all problems (--total-budget-s, split over the problems still to run, those with a target
weighing double, so time a fast problem leaves goes to later ones), and a deadline after
which remaining problems are skipped (--deadline-s).  Vendor timing and the correctness
checks (a few seconds a problem, mostly building inputs) come on top of the sweep budget.  On CUDA a hard watchdog (--hard-timeout-s) dumps the stack and
exits if a kernel hangs; the JSON and table are rewritten after every problem, so partial
results survive.
"""
from __future__ import annotations

import argparse
import datetime
import faulthandler
import gc
import json
import math
import platform
import random
import re
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import kernel_space  # noqa: E402
from kernel_space import get_op, impls  # noqa: E402
from workers.measure import CRASHED, OK, WRONG_RESULT, Bench, context_alive, short_error  # noqa: E402
from workers.timing import time_fn  # noqa: E402

NORM_OPS = ("layer_norm", "rms_norm", "softmax")  # always memory-bound
BIG_NORM_ELEMENTS = 8 << 20  # the bandwidth target applies from 8M elements (rows * cols)
MAX_SPACE_ENUMERATE = 50_000  # larger spaces are sampled point by point instead of listed
MAX_VENDOR_CONFIGS = 16
MAX_SEEDS = 8  # earlier problems' winners tried first (the most recent ones)
MAX_CHECKS = 8  # correctness checks of tuned candidates per problem (winner + fall-backs)
T0 = time.perf_counter()


def log(*a: Any) -> None:
    print(*a, flush=True)


def elapsed() -> float:
    return time.perf_counter() - T0


# --------------------------------------------------------------------------- formatting


def fmt_problem(p: Any) -> str:
    """Compact problem text: flags by name, strings bare, numbers left out at their default."""
    parts = []
    defaults = getattr(type(p), "_field_defaults", {})
    for k, v in p._asdict().items():
        if k in defaults and not isinstance(v, (bool, str)) and v == defaults[k]:
            continue
        if isinstance(v, bool):
            if v:
                parts.append(k)
        elif k == "dtype" or (isinstance(v, str) and k in defaults):
            parts.append(str(v))
        elif isinstance(v, tuple) and v and all(x == v[0] for x in v):
            parts.append(f"{k}={v[0]}")
        else:
            parts.append(f"{k}={v}")
    return ",".join(parts)


def fmt_cfg(c: dict | None, compact: bool = False) -> str:
    """k=v pairs; compact abbreviates multi-word keys to initials (BLOCK_M -> BM, num_warps -> nw)."""
    if not c:
        return "-"

    def key(k: str) -> str:
        return "".join(w[0] for w in k.split("_") if w) if compact and "_" in k else k

    return ",".join(f"{key(k)}={v}" for k, v in c.items())


def fmt_ms(ms: float | None) -> str:
    if ms is None:
        return "-"
    return f"{ms:.4f}" if ms < 1 else f"{ms:.3f}"


def short(e: BaseException) -> str:
    return short_error(e, 300, lines=3)  # Triton's first line is often a position


def jsonable(x: Any) -> Any:
    """Strict JSON: inf/nan become null, tuples lists, unknown objects their repr."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if x is None or isinstance(x, (bool, int, str)):
        return x
    return repr(x)


# --------------------------------------------------------------------------- device


def device_class(dev: torch.device) -> str:
    if dev.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(dev)
    try:
        from kernel_space._device import device_class_of

        return device_class_of(name)
    except ImportError:
        for cls in ("h200", "h100"):
            if cls in name.lower():
                return cls
        return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def device_info(dev: torch.device) -> dict:
    info: dict[str, Any] = {
        "type": dev.type,
        "class": device_class(dev),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "host_cpu": platform.processor() or platform.machine(),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception as e:  # triton missing is data, not a crash
        info["triton"] = None
        info["triton_error"] = short(e)
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        info.update(
            name=p.name,
            sm_count=p.multi_processor_count,
            capability=f"{p.major}.{p.minor}",
            memory_gib=round(p.total_memory / 2**30, 1),
            cudnn=torch.backends.cudnn.version(),
        )
    else:
        info.update(name="cpu", threads=torch.get_num_threads())
    return info


def measure_ceilings(dev: torch.device) -> dict:
    """Copy bandwidth (bytes read + written) and matmul peak, both medians via time_fn."""
    out: dict[str, Any] = {}
    if dev.type == "cuda":
        n_bytes, mm_n, mm_dtype = 2 << 30, 8192, torch.bfloat16
    else:
        n_bytes, mm_n, mm_dtype = 256 << 20, 2048, torch.float32
    try:
        src = torch.empty(n_bytes // 4, dtype=torch.int32, device=dev).fill_(1)
        dst = torch.empty_like(src)
        t = time_fn(lambda: dst.copy_(src), device=dev, warmup=3, reps=30, budget_s=2.0, flush_l2=False)
        out.update(copy_bytes=2 * n_bytes, copy_ms=t.median_ms, copy_gbps=2 * n_bytes / (t.median_ms * 1e-3) / 1e9)
        del src, dst
    except Exception as e:
        out["copy_error"] = short(e)
    try:
        g = torch.Generator(device=dev).manual_seed(0)
        a = torch.randn(mm_n, mm_n, device=dev, dtype=mm_dtype, generator=g)
        b = torch.randn(mm_n, mm_n, device=dev, dtype=mm_dtype, generator=g)
        t = time_fn(lambda: torch.matmul(a, b), device=dev, warmup=5, reps=30, budget_s=3.0, flush_l2=False)
        out.update(
            matmul_shape=[mm_n, mm_n, mm_n],
            matmul_dtype=str(mm_dtype).replace("torch.", ""),
            matmul_ms=t.median_ms,
            matmul_tflops=2 * mm_n**3 / (t.median_ms * 1e-3) / 1e12,
        )
        del a, b
    except Exception as e:
        out["matmul_error"] = short(e)
    if out.get("copy_gbps") and out.get("matmul_tflops"):
        out["ridge_flop_per_byte"] = out["matmul_tflops"] * 1e12 / (out["copy_gbps"] * 1e9)
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


# --------------------------------------------------------------------------- problems


def make_problem(spec: Any, values: dict, template: Any = None, from_template: bool = False) -> Any | None:
    """A problem from {field or (aliases...): value}; None when the op has no such field.

    Field names come from the op's NamedTuple at runtime; fields not given keep the
    problem's defaults (the template's where it has none, or always with from_template).
    """
    fields = spec.problem._fields
    kw = {}
    for key, v in values.items():
        names = key if isinstance(key, tuple) else (key,)
        hit = next((n for n in names if n in fields), None)
        if hit is None:
            return None
        if template is not None and isinstance(getattr(template, hit), tuple) and not isinstance(v, tuple):
            v = (v,) * len(getattr(template, hit))
        kw[hit] = v
    candidates = []
    if template is not None and from_template:
        candidates.append(template._replace(**kw))
    try:
        candidates.append(spec.problem(**kw))
    except TypeError:
        pass
    if template is not None and not from_template:
        candidates.append(template._replace(**kw))
    for p in candidates:
        try:
            return spec.parse_problem(p._asdict())
        except Exception:
            continue
    return None


def extra_problems(op: str, spec: Any, defaults: list) -> list:
    """The built-in suite beyond the op's defaults (GPU only); unknown fields skip a shape."""
    tmpl = defaults[0] if defaults else None
    wanted: list[tuple[dict, Any]] = []
    from_template = False
    if op == "gemm":
        shapes = [(m, 4096, 4096) for m in (1, 16, 32, 64)] + [
            (64, 14336, 4096),
            (1000, 1000, 1000),
            (4096, 4096, 4096),
            (4096, 14336, 4096),
        ]
        wanted = [({"M": m, "N": n, "K": k, "dtype": "bf16"}, tmpl) for m, n, k in shapes]
    elif op == "attention":
        have = {(p.Sq, p.Skv, p.D) for p in defaults if {"Sq", "Skv", "D"} <= set(p._fields)}
        for s in (512, 1024, 2048, 4096, 8192):
            if (s, s, 128) in have:
                continue
            b = max(1, 16384 // s)  # 16K tokens a batch
            wanted.append(({"B": b, "H": 32, "Sq": s, "Skv": s, "D": 128, "dtype": "bf16"}, tmpl))
    elif op in NORM_OPS:
        rows_f = next((f for f in ("rows", "M", "N") if f in spec.problem._fields), None)
        cols_f = next((f for f in ("cols", "hidden", "D") if f in spec.problem._fields), None)
        for cols in (4096, 8192, 16384):
            if rows_f and cols_f and any(
                getattr(d, cols_f) == cols and getattr(d, rows_f) * cols >= BIG_NORM_ELEMENTS for d in defaults
            ):
                continue  # the defaults already have a big problem of this width
            wanted.append(({("rows", "M", "N"): BIG_NORM_ELEMENTS // cols, ("cols", "hidden", "D"): cols, "dtype": "bf16"}, tmpl))
    elif op == "conv2d":
        # ResNet-50: stage 1 and stage 3 3x3, a 1x1 bottleneck reduction, the 7x7 stem.
        resnet = [
            (32, 64, 56, 64, 3, 1, 1),
            (32, 256, 14, 256, 3, 1, 1),
            (32, 256, 56, 64, 1, 1, 0),
            (32, 3, 224, 64, 7, 2, 3),
        ]
        layout_fields = [f for f in spec.problem._fields if "layout" in f.lower() or "format" in f.lower()]
        templates, from_template = [tmpl], True
        if layout_fields and defaults:
            lf = layout_fields[0]
            seen: dict[Any, Any] = {}
            for p in defaults:
                seen.setdefault(getattr(p, lf), p)
            templates = list(seen.values())
        for t in templates:
            for n, c, hw, k, r, stride, pad in resnet:
                v = {
                    ("N", "batch", "n"): n,
                    ("C", "in_channels", "c", "C_in"): c,
                    ("H", "h", "height"): hw,
                    ("W", "w", "width"): hw,
                    ("K", "out_channels", "k", "C_out"): k,
                    ("R", "kh", "kernel_h"): r,
                    ("S", "kw", "kernel_w"): r,
                    "stride": stride,
                    ("padding", "pad"): pad,
                    "dtype": "bf16",
                }
                wanted.append((v, t))
    # A conv the defaults already have at another batch, stride or layout adds little.
    same_conv = [f for f in ("C", "H", "W", "K", "R", "S") if f in spec.problem._fields] if op == "conv2d" else []
    out = []
    for values, t in wanted:
        p = make_problem(spec, values, t, from_template)
        if p is None:
            log(f"  note: {op}: extra shape {values} does not fit fields {spec.problem._fields}; skipped")
        elif not (same_conv and any(all(getattr(d, f) == getattr(p, f) for f in same_conv) for d in defaults)):
            out.append(p)
    return out


def problem_list(ops: list[str], dev_class: str, quick: bool, extras: bool) -> list[tuple[str, Any]]:
    """Problems round-robin over ops, so a deadline cuts every op a little, not one op whole."""
    per_op: dict[str, list] = {}
    for op in ops:
        spec = get_op(op)
        cls = dev_class if dev_class in ("cpu", "h100", "h200") else "h200"
        try:
            defaults = list(spec.default_problems(cls))
        except Exception as e:
            log(f"  note: {op}.default_problems({cls!r}) failed: {short(e)}")
            defaults = []
        probs: list = []
        for p in defaults + (extra_problems(op, spec, defaults) if extras and cls != "cpu" and not quick else []):
            if p not in probs:
                probs.append(p)
        per_op[op] = probs[:1] if quick else probs
    out = []
    for i in range(max((len(v) for v in per_op.values()), default=0)):
        for op in ops:
            if i < len(per_op[op]):
                out.append((op, per_op[op][i]))
    return out


# --------------------------------------------------------------------------- candidates


def measure(bench: Bench, op: str, problem: Any, impl: Any, params: dict, args: Any) -> dict:
    """One candidate measured as the tuner measures it: checked (its first call), then timed."""
    res = bench.run({"op": op, "problem": problem._asdict(), "impl": impl.name, "params": params},
                    budget_s=args.time_s, reps=args.reps, warmup=1)
    rec: dict[str, Any] = {"impl": impl.name, "vendor": impl.vendor, "config": dict(params),
                           "status": CRASHED if res["context_lost"] else res["status"]}
    for k in ("error", "first_call_s"):
        if res.get(k) is not None:
            rec[k] = res[k]
    if rec["status"] == OK:
        rec.update(ms=res["median_ms"], q25_ms=res["q25_ms"], q75_ms=res["q75_ms"], reps=res["reps"])
    if res.get("rel_error") is not None:
        rec["rel_err"] = res["rel_error"]
    return rec


def check(bench: Bench, op: str, problem: Any, r: dict, tol: float) -> dict:
    """The tuner's correctness gate on fresh inputs (seed 1), as the report's check record."""
    res = bench.check({"op": op, "problem": problem._asdict(), "impl": r["impl"], "params": r["config"]}, seed=1)
    c: dict[str, Any] = {"ok": res["status"] == OK, "rel_err": res.get("rel_error"), "tol": tol,
                         "poisoned_out": res.get("poisoned_out", False)}
    if res["status"] not in (OK, WRONG_RESULT):
        c.update(error=res["error"], kind=CRASHED if res["context_lost"] else res["status"])
    if res.get("note"):
        c["note"] = res["note"]
    return c


_ORDER_CACHE: dict[str, list[dict]] = {}


def config_order(impl: Any) -> list[dict]:
    """The space in a fixed order: the default config, then the rest shuffled (seed 0).

    The same order for every problem keeps the sampled configs overlapping across problems,
    so Triton's in-memory cache saves recompiling them.
    """
    if impl.name in _ORDER_CACHE:
        return _ORDER_CACHE[impl.name]
    size = math.prod(len(v) for v in impl.space.values()) if impl.space else 1
    rng = random.Random(0)
    if size <= MAX_SPACE_ENUMERATE:
        allc = list(impl.configs())
        rest = allc[1:]
        rng.shuffle(rest)
        order = allc[:1] + rest
    else:  # too big to list: sample points directly
        keys = list(impl.space)
        order, seen = [impl.default_params()], set()
        seen.add(repr(order[0]))
        for _ in range(5000):
            c = {k: rng.choice(tuple(impl.space[k])) for k in keys}
            if repr(c) not in seen:
                seen.add(repr(c))
                order.append(c)
    _ORDER_CACHE[impl.name] = order
    return order


# Correct winners of earlier problems, per implementation: tried right after the default
# config (warm start), and usually already compiled.
_WINNERS: dict[str, list[dict]] = {}


def remember_winners(recs: list[dict]) -> None:
    for r in recs:
        seen = _WINNERS.setdefault(r["impl"], [])
        if r["config"] not in seen:
            seen.append(r["config"])


def sweep_impl(bench: Bench, op: str, impl, problem, backend, args, deadline: float) -> tuple[list[dict], dict]:
    base = config_order(impl)
    seeds = [c for c in _WINNERS.get(impl.name, [])[-MAX_SEEDS:] if c != base[0]]
    order = base[:1] + seeds + [c for c in base[1:] if c not in seeds]
    valid, pruned, check_errors = [], 0, 0
    for c in order:
        try:
            why = impl.why_not(problem, c, backend)
        except Exception:
            why, check_errors = "check raised", check_errors + 1
        if why is None:
            valid.append(c)
        else:
            pruned += 1
    selected = valid[: args.max_configs]
    info: dict[str, Any] = {
        "space_size": math.prod(len(v) for v in impl.space.values()) if impl.space else 1,
        "listed": len(order),
        "valid": len(valid),
        "pruned": pruned,
        "check_errors": check_errors,
        "selected": len(selected),
        "sampled": len(valid) > len(selected),
        "budget_exhausted": False,
        "warm_start": sum(1 for c in selected if c in seeds),
        "version": impl.version,
    }
    recs = []
    t_start = time.perf_counter()
    for i, c in enumerate(selected):
        if i > 0 and time.perf_counter() > deadline:
            info["budget_exhausted"] = True
            break
        r = measure(bench, op, problem, impl, c, args)
        recs.append(r)
        if r["status"] == "crashed":
            break
    info["swept"] = len(recs)
    info["sweep_s"] = round(time.perf_counter() - t_start, 2)
    return recs, info


# --------------------------------------------------------------------------- metrics, targets


def perf(spec, problem, ms: float | None, ceil: dict, op: str) -> dict:
    if ms is None or ms <= 0:
        return {}
    try:
        flops, nbytes = float(spec.flops(problem)), float(spec.bytes_moved(problem))
    except Exception as e:
        return {"error": short(e)}
    s = ms * 1e-3
    d = {"tflops": flops / s / 1e12, "gbps": nbytes / s / 1e9}
    ai = flops / nbytes if nbytes else float("inf")
    ridge = ceil.get("ridge_flop_per_byte")
    memory = op in NORM_OPS or (ridge is not None and ai < ridge)
    d["intensity"] = ai
    d["bound"] = "memory" if memory else "compute"
    if memory and ceil.get("copy_gbps"):
        d["pct_ceiling"] = 100 * d["gbps"] / ceil["copy_gbps"]
    elif not memory and ceil.get("matmul_tflops"):
        d["pct_ceiling"] = 100 * d["tflops"] / ceil["matmul_tflops"]
    return d


def _f(p: Any, *names: str) -> Any:
    for n in names:
        if n in p._fields:
            return getattr(p, n)
    return None


def target(op: str, p: Any, spec: Any, row: dict) -> dict | None:
    """The issue's target for this problem, as data: name, need, value, met."""
    t_ms, v_ms = row.get("tuned_ms"), row.get("vendor_ms")
    dtype = _f(p, "dtype")

    def ratio_target(name: str, need: float) -> dict:
        if t_ms is None or v_ms is None:
            return {"name": name, "need": need, "value": None, "met": False,
                    "detail": "no correct " + ("Triton" if t_ms is None else "vendor") + " result"}
        r = v_ms / t_ms
        return {"name": name, "need": need, "value": r, "met": r >= need,
                "detail": f"{r:.2f}x vendor (need {need}x; {100 * (r / need - 1):+.0f}%)"}

    if op in NORM_OPS:
        rows, cols = _f(p, "rows", "M"), _f(p, "cols", "N", "hidden")
        n = rows * cols if rows and cols else math.prod(getattr(p, f) for f in spec.size_fields)
        if n < BIG_NORM_ELEMENTS:
            return None
        pct = (row.get("tuned_perf") or {}).get("pct_ceiling")
        if pct is None:
            return {"name": ">=85% copy BW", "need": 85.0, "value": None, "met": False, "detail": "no correct Triton result"}
        return {"name": ">=85% copy BW", "need": 85.0, "value": pct, "met": pct >= 85.0,
                "detail": f"{pct:.0f}% of copy BW ({pct - 85:+.0f} pts)"}
    if op == "gemm":
        M, N, K = _f(p, "M"), _f(p, "N"), _f(p, "K")
        if None in (M, N, K):
            return None
        if dtype == "bf16" and min(M, N, K) >= 4096:
            return ratio_target(">=0.95x cuBLAS", 0.95)
        if M <= 64 and min(N, K) >= 4096:
            return ratio_target(">=1.3x cuBLAS (decode)", 1.3)
        return None
    if op == "attention":
        D, sq, skv = _f(p, "D"), _f(p, "Sq"), _f(p, "Skv")
        if D == 128 and sq and skv and min(sq, skv) >= 2048:
            return ratio_target(">=0.75x best SDPA", 0.75)
        return None
    if op == "conv2d":
        # The path the sweep chose (tuned winner if it beat the vendors, else the best vendor)
        # re-timed against the best vendor path, interleaved; 2% is allowed for noise.
        chosen = row.get("chosen_ms")
        if chosen is None or v_ms is None:
            return {"name": "chosen <= best cuDNN", "need": 0.98, "value": None, "met": False, "detail": "no correct result"}
        r = v_ms / chosen
        return {"name": "chosen <= best cuDNN", "need": 0.98, "value": r, "met": r >= 0.98,
                "detail": f"chosen {row.get('chosen')} {r:.2f}x best vendor"}
    return None


# --------------------------------------------------------------------------- one problem


def bench_problem(bench: Bench, op: str, problem: Any, backend: str, args: Any, budget_s: float, ceil: dict) -> dict:
    spec = get_op(op)
    t_problem = time.perf_counter()
    row: dict[str, Any] = {"op": op, "problem": problem._asdict(), "problem_str": fmt_problem(problem), "budget_s": round(budget_s, 2)}
    failures: dict[str, int] = {}
    notes: list[str] = []
    all_impls = impls(op)
    vendors = [i for i in all_impls if i.vendor]
    tuned = [i for i in all_impls if not i.vendor]
    refused = {}  # vendors that refuse this problem, tuned impls that cannot run here
    for i in all_impls:
        if (i.vendor and backend in i.backends) or i.unavailable:
            try:
                why = i.why_not(problem, None, backend)
            except Exception as e:
                why = f"check raised {short(e)}"
            if why:
                refused[i.name] = why
    row["impl_refused"] = refused
    tuned = [i for i in tuned if backend in i.backends and not i.unavailable]
    row["tuned_impls"] = [i.name for i in tuned]

    try:
        bench.inputs(op, problem)  # the inputs every candidate is checked and timed on, and their reference
    except Exception as e:
        row.update(status="inputs_failed", error=short(e))
        return row

    # Vendors: every valid config (their spaces are tiny), no sweep budget.
    cands: list[dict] = []
    for impl in vendors:
        if backend not in impl.backends:
            continue
        n = 0
        for c in impl.configs():
            if n >= MAX_VENDOR_CONFIGS:
                break
            try:
                if impl.why_not(problem, c, backend) is not None:
                    continue
            except Exception:
                continue
            n += 1
            cands.append(measure(bench, op, problem, impl, c, args))

    # Tuned implementations: the budget is split over them as they go.
    impl_info: dict[str, dict] = {}
    start = time.perf_counter()
    for k, impl in enumerate(tuned):
        left = budget_s - (time.perf_counter() - start)
        deadline = time.perf_counter() + max(0.0, left) / (len(tuned) - k)
        recs, info = sweep_impl(bench, op, impl, problem, backend, args, deadline)
        cands += recs
        impl_info[impl.name] = info
        if info["pruned"]:
            failures["pruned"] = failures.get("pruned", 0) + info["pruned"]
    row["sweep_s"] = round(time.perf_counter() - start, 2)
    row["impls"] = impl_info

    def count(r: dict) -> None:  # vendor failures are kept apart from the tuned ones
        k = ("vendor_" if r["vendor"] else "") + r["status"]
        failures[k] = failures.get(k, 0) + 1

    for r in cands:
        if r["status"] != "ok":
            count(r)
    crashed = any(r["status"] == "crashed" for r in cands)

    # Correctness on fresh inputs: every vendor, and tuned configs fastest first until two
    # pass (the winner and a runner-up for the re-timing), so a wrong winner falls back.
    ok = sorted((r for r in cands if r["status"] == "ok"), key=lambda r: r["ms"])
    best_vendor = best_tuned = None
    passed_tuned: list[dict] = []
    if not crashed and ok:
        try:
            bench.inputs(op, problem, seed=1)
            unchecked = False
        except Exception as e:
            unchecked = True
            notes.append(f"reference failed, results unchecked: {short(e)}")
        if unchecked:
            row["unchecked"] = True
            best_vendor = next((r for r in ok if r["vendor"]), None)
            passed_tuned = [r for r in ok if not r["vendor"]][:2]
        else:
            tol = spec.tolerance(_f(problem, "dtype") or "fp32")
            n_checked = 0
            for r in ok:
                if not r["vendor"] and (len(passed_tuned) >= 2 or n_checked >= MAX_CHECKS):
                    continue
                res = r["check"] = check(bench, op, problem, r, tol)
                n_checked += not r["vendor"]
                if res["ok"]:
                    if r["vendor"]:
                        best_vendor = best_vendor or r
                    else:
                        passed_tuned.append(r)
                    continue
                r["status"] = res.get("kind", WRONG_RESULT)
                count(r)
                if r["status"] == "crashed":
                    crashed = True
                    break
        wrong = [r for r in ok if not r["vendor"] and r["status"] != "ok"]
        row["wrong_tuned"] = len(wrong)
        if wrong and (not passed_tuned or wrong[0]["ms"] < passed_tuned[0]["ms"]):
            notes.append(f"fastest tuned config {wrong[0]['impl']} {fmt_cfg(wrong[0]['config'])} failed the check "
                         f"({wrong[0]['status']}, rel_err {wrong[0]['check'].get('rel_err')}); fell back")

    # Final: best vendor and the two best correct tuned configs, re-timed interleaved.
    if not crashed:
        entries = ([best_vendor] if best_vendor else []) + passed_tuned[:2]
        if entries:
            try:
                tt = bench.confirm(op, problem._asdict(),
                                   [{"key": str(j), "impl": r["impl"], "params": r["config"]} for j, r in enumerate(entries)],
                                   rounds=args.rounds, budget_s=min(args.time_s, 0.15), reps=args.reps, warmup=1)
                for j, r in enumerate(entries):
                    r["final_ms"] = tt[str(j)]["median_ms"]
                    r["final"] = tt[str(j)]
            except Exception as e:
                notes.append(f"final re-timing failed: {short(e)}")
        if passed_tuned:
            best_tuned = min(passed_tuned, key=lambda r: r.get("final_ms", r["ms"]))
            if not row.get("unchecked"):
                remember_winners(passed_tuned)

    def ms_of(r: dict | None) -> float | None:
        return None if r is None else r.get("final_ms", r["ms"])

    row["vendor"] = None if best_vendor is None else {"impl": best_vendor["impl"], "config": best_vendor["config"]}
    row["vendor_ms"] = ms_of(best_vendor)
    row["tuned"] = None if best_tuned is None else {"impl": best_tuned["impl"], "config": best_tuned["config"],
                                                     "rel_err": best_tuned.get("check", {}).get("rel_err")}
    row["tuned_ms"] = ms_of(best_tuned)
    if row["vendor_ms"] and row["tuned_ms"]:
        row["speedup"] = row["vendor_ms"] / row["tuned_ms"]
    # What a tuner would pick from the sweep: the tuned winner if it beat the best vendor there.
    if best_tuned and (not best_vendor or best_tuned["ms"] < best_vendor["ms"]):
        row["chosen"], row["chosen_ms"] = best_tuned["impl"], ms_of(best_tuned)
    elif best_vendor:
        row["chosen"], row["chosen_ms"] = best_vendor["impl"], ms_of(best_vendor)
    row["vendor_perf"] = perf(spec, problem, row["vendor_ms"], ceil, op)
    row["tuned_perf"] = perf(spec, problem, row["tuned_ms"], ceil, op)
    row["target"] = target(op, problem, spec, row)
    row["failures"] = failures
    row["notes"] = notes
    row["candidates"] = cands
    row["crashed"] = crashed
    row["elapsed_s"] = round(time.perf_counter() - t_problem, 2)
    return row


# --------------------------------------------------------------------------- output


def md_table(rows: list[dict], tuned_label: str, compact: bool = False) -> str:
    head = f"| op | problem | best {tuned_label} config | {tuned_label} ms | best vendor | vendor ms | speedup | % ceiling ({tuned_label}/vendor) | target |"
    lines = [head, "|" + "---|" * 9]
    multi = {}
    for r in rows:
        multi[r["op"]] = max(multi.get(r["op"], 0), len(r.get("tuned_impls") or []))
    for r in sorted(rows, key=lambda r: r["op"]):
        t, v = r.get("tuned"), r.get("vendor")
        cfg = "-"
        if t:
            cfg = (t["impl"] + ": " if multi[r["op"]] > 1 else "") + fmt_cfg(t["config"], compact)
        elif r.get("tuned_impls"):
            cfg = "(no correct config)"
        if r.get("wrong_tuned"):
            cfg += f" [{r['wrong_tuned']} wrong]"
        if r.get("unchecked"):
            cfg += " [unchecked]"
        tp, vp = r.get("tuned_perf") or {}, r.get("vendor_perf") or {}
        pct = "-"
        if tp.get("pct_ceiling") is not None or vp.get("pct_ceiling") is not None:
            a = f"{tp['pct_ceiling']:.0f}" if tp.get("pct_ceiling") is not None else "-"
            b = f"{vp['pct_ceiling']:.0f}" if vp.get("pct_ceiling") is not None else "-"
            kind = (tp or vp).get("bound", "")
            pct = f"{a}/{b} {'bw' if kind == 'memory' else 'mm'}"
        tg = r.get("target")
        tgs = "-"
        if tg:
            val = tg.get("value")
            shown = tg.get("detail") if val is None else (f"{val:.0f}%" if "BW" in tg["name"] else f"{val:.2f}x")
            tgs = f"{'met' if tg['met'] else 'MISS'} {tg['name']} ({shown})"
        if r.get("status") or r.get("crashed"):
            tgs += f" [{r.get('status') or 'crashed'}]"
        sp = f"{r['speedup']:.2f}x" if r.get("speedup") else "-"
        lines.append(
            f"| {r['op']} | {r['problem_str']} | {cfg} | {fmt_ms(r.get('tuned_ms'))} | "
            f"{v['impl'] + ('(' + fmt_cfg(v['config'], compact) + ')' if v['config'] else '') if v else '-'} | "
            f"{fmt_ms(r.get('vendor_ms'))} | {sp} | {pct} | {tgs} |"
        )
    return "\n".join(lines)


def write_outputs(out_dir: Path, stem: str, report: dict, tuned_label: str) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    report["elapsed_s"] = round(elapsed(), 1)
    totals: dict[str, int] = {}
    for r in report["problems"]:
        for k, n in (r.get("failures") or {}).items():
            totals[k] = totals.get(k, 0) + n
    report["failures_total"] = totals
    tg = [r["target"] for r in report["problems"] if r.get("target")]
    report["targets_summary"] = {"checked": len(tg), "met": sum(t["met"] for t in tg)}
    jp, mp = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    tmp = jp.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(jsonable(report), indent=1))
    tmp.replace(jp)
    c = report["ceilings"]
    dev = report["device"]
    tf = c.get("matmul_tflops") or 0.0
    timer = "CUDA events, L2 flushed" if dev.get("type") == "cuda" else "host clock"
    head = [
        f"# Kernel benchmark {report['date']}, {dev.get('name')}",
        "",
        f"torch {dev.get('torch')}, triton {dev.get('triton')}, CUDA {dev.get('cuda')}, "
        f"{dev.get('sm_count', '-')} SMs. Ceilings measured in the same run: copy "
        f"{c.get('copy_gbps', 0):.0f} GB/s (read+write), {c.get('matmul_dtype', '')} matmul "
        f"{tf:.1f} TFLOP/s, ridge {c.get('ridge_flop_per_byte', 0):.0f} flop/B.".replace(f"{tf:.1f} TFLOP", f"{tf:.3g} TFLOP"),
        f"Targets met: {report['targets_summary']['met']}/{report['targets_summary']['checked']}. "
        f"Failures: {totals or 'none'}. Elapsed {report['elapsed_s']} s.",
        "",
        f"Times are medians ({timer}); the best vendor and the two best correct {tuned_label} configs are "
        "re-timed interleaved. % ceiling is of copy bandwidth (bw) or of the matmul peak (mm), chosen by "
        "arithmetic intensity against the ridge point. [n wrong]: that many of the fastest configs "
        "failed the correctness check on fresh inputs (the winner is the fastest that passed).",
        "",
        "",
    ]
    mp.write_text("\n".join(head) + md_table(report["problems"], tuned_label) + "\n")
    return jp, mp


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for <date>-<gpu>-kernels.json/.md")
    ap.add_argument("--ops", default="", help="comma-separated ops (default: every registered op)")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--budget-s", type=float, default=12.0, help="sweep budget per problem, seconds")
    ap.add_argument("--total-budget-s", type=float, default=240.0, help="sweep budget over all problems, seconds")
    ap.add_argument("--deadline-s", type=float, default=470.0, help="skip problems not started by then")
    ap.add_argument("--hard-timeout-s", type=float, default=560.0, help="CUDA watchdog: dump stacks and exit")
    ap.add_argument("--max-configs", type=int, default=40, help="configs per tuned impl and problem")
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions per candidate (at most)")
    ap.add_argument("--time-s", type=float, default=0.25, help="time_fn budget per candidate, seconds")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds when re-timing winners")
    ap.add_argument("--no-extras", action="store_true", help="only the ops' default problems")
    ap.add_argument("--quick", action="store_true", help="smoke test: 1 problem per op, few configs")
    args = ap.parse_args(argv)
    if args.quick:
        args.max_configs = min(args.max_configs, 3)
        args.budget_s = min(args.budget_s, 5.0)
        args.total_budget_s = min(args.total_budget_s, 60.0)
        args.reps = min(args.reps, 10)
        args.rounds = min(args.rounds, 2)

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        log("CUDA is not available; use --device cpu for a smoke test")
        return 2
    dev = torch.device(args.device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    backend = kernel_space.backend_of(dev)
    if dev.type == "cuda":
        faulthandler.dump_traceback_later(max(1.0, args.hard_timeout_s - elapsed()), exit=True)
        torch.backends.cudnn.benchmark = True  # the vendor conv baseline is cuDNN's best algorithm

    registered = kernel_space.ops()
    if args.ops:
        want = [o.strip() for o in args.ops.split(",") if o.strip()]
        for o in want:
            if o not in registered:
                log(f"note: op {o!r} is not registered (registered: {', '.join(registered)}); skipped")
        ops = [o for o in want if o in registered]
    else:
        ops = registered

    info = device_info(dev)
    gpu = info["class"]
    log(f"device {info['name']} ({gpu}), {info.get('sm_count', info.get('threads'))} "
        f"{'SMs' if dev.type == 'cuda' else 'threads'}, torch {info['torch']}, triton {info['triton']}, cuda {info['cuda']}")
    ceil = measure_ceilings(dev)
    log(f"ceilings: copy {ceil.get('copy_gbps', float('nan')):.0f} GB/s (rd+wr, {ceil.get('copy_bytes', 0) >> 20} MiB moved), "
        f"{ceil.get('matmul_dtype', '?')} matmul {ceil.get('matmul_shape')} {ceil.get('matmul_tflops', float('nan')):.1f} TFLOP/s, "
        f"ridge {ceil.get('ridge_flop_per_byte', float('nan')):.0f} flop/B  [{elapsed():.0f}s]")

    tuned_label = "Triton" if dev.type == "cuda" else "tuned"
    problems = problem_list(ops, gpu, args.quick, not args.no_extras)
    log(f"{len(problems)} problems over {', '.join(ops)}; sweep budget {args.budget_s:.0f}s/problem, "
        f"{args.total_budget_s:.0f}s total, deadline {args.deadline_s:.0f}s; per line: V best vendor ms | "
        f"impl valid/selected(s: sampled)/swept | T best correct {tuned_label} ms")
    for op in ops:
        for i in impls(op):
            if i.unavailable:
                log(f"note: {op}.{i.name} unavailable: {i.unavailable}")

    date = datetime.date.today().isoformat()
    stem = f"{date}-{gpu}-kernels"
    report: dict[str, Any] = {
        "schema": 1,
        "date": date,
        "argv": sys.argv,
        "settings": {k: v for k, v in vars(args).items()},
        "device": info,
        "torch_settings": {
            "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
            "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
            "cudnn_benchmark": torch.backends.cudnn.benchmark,
        },
        "ceilings": ceil,
        "ops": ops,
        "impl_versions": {op: {i.name: i.version for i in impls(op)} for op in ops},
        "problems": [],
        "skipped": [],
    }
    out_dir = Path(args.out)
    bench = Bench(str(dev))
    sweep_left = args.total_budget_s
    for n, (op, p) in enumerate(problems):
        if elapsed() > args.deadline_s:
            report["skipped"] = [{"op": o, "problem": q._asdict(), "why": "deadline"} for o, q in problems[n:]]
            log(f"deadline {args.deadline_s:.0f}s reached: {len(problems) - n} problems skipped")
            break
        weights = [weight(o, q) for o, q in problems[n:]]
        budget = max(0.0, min(args.budget_s, sweep_left * weights[0] / sum(weights)))
        try:
            row = bench_problem(bench, op, p, backend, args, budget, ceil)
        except Exception as e:  # a bug in one problem's bookkeeping must not lose the run
            row = {"op": op, "problem": p._asdict(), "problem_str": fmt_problem(p), "status": "benchmark_error",
                   "error": short(e)}
        sweep_left -= row.get("sweep_s", 0.0)
        report["problems"].append(row)
        bench.clear()
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        try:
            log(progress_line(n, len(problems), row))
            write_outputs(out_dir, stem, report, tuned_label)
        except Exception as e:  # reporting must not stop the measuring
            log(f"  (could not report {op} {fmt_problem(p)}: {short(e)})")
        if row.get("crashed") or (dev.type == "cuda" and not context_alive(dev)):
            report["skipped"] = [{"op": o, "problem": q._asdict(), "why": "CUDA context lost"} for o, q in problems[n + 1:]]
            log("CUDA context lost (a kernel crashed): stopping; results so far are written")
            break

    try:
        jp, mp = write_outputs(out_dir, stem, report, tuned_label)
    except Exception as e:
        jp = mp = f"(not written: {short(e)})"
    faulthandler.cancel_dump_traceback_later()
    c = ceil
    log("")
    log(f"ceilings: copy {c.get('copy_gbps', float('nan')):.0f} GB/s, {c.get('matmul_dtype', '')} matmul "
        f"{c.get('matmul_tflops', float('nan')):.1f} TFLOP/s; {info['name']}, {info.get('sm_count', '-')} SMs, "
        f"torch {info['torch']}, triton {info['triton']}")
    log(md_table(report["problems"], tuned_label, compact=True))
    ts = report["targets_summary"]
    log(f"targets met {ts['met']}/{ts['checked']}; failures {report['failures_total'] or 'none'}; "
        f"{len(report['skipped'])} skipped; {elapsed():.0f}s; wrote {jp} and {mp}")
    return 0


def weight(op: str, p: Any) -> float:
    """Share of the sweep budget: problems the issue sets a target for get twice as much."""
    try:
        return 2.0 if target(op, p, get_op(op), {}) else 1.0
    except Exception:
        return 1.0


def progress_line(n: int, total: int, r: dict) -> str:
    head = f"[{n + 1}/{total} {elapsed():.0f}s] {r['op']} {r['problem_str']}"
    if r.get("status"):
        return f"{head}: {r['status']} {r.get('error', '')}"
    v, t = r.get("vendor"), r.get("tuned")
    parts = [f"V {v['impl']} {fmt_ms(r.get('vendor_ms'))}" if v else "V -"]
    for name, i in (r.get("impls") or {}).items():
        parts.append(f"{name} {i['valid']}v/{i['selected']}{'s' if i['sampled'] else ''}/{i['swept']}"
                     f"{'(budget)' if i['budget_exhausted'] else ''}")
    parts.append(f"T {fmt_ms(r.get('tuned_ms'))}" if t else "T -")
    if r.get("speedup"):
        parts.append(f"{r['speedup']:.2f}x")
    fails = {k: n for k, n in (r.get("failures") or {}).items() if k != "pruned"}
    if fails:
        parts.append("fail " + ",".join(f"{k}:{n}" for k, n in fails.items()))
    tg = r.get("target")
    if tg:
        parts.append(("met" if tg["met"] else "MISS") + f" {tg['name']}")
    return head + ": " + " | ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
