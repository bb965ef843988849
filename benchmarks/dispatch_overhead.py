#!/usr/bin/env python
"""Eager dispatch overhead: `ops_adv.<op>` against the direct torch call, per call.

For gemm, linear, conv2d (1x1 channels_last and 3x3 NCHW), rms_norm and attention, the direct torch
call and the ops-adv call alternate in interleaved rounds (each sample: a burst of calls, then a
device sync; per call), under each table:
  empty    no table: every op runs its default (the vendor kernel)
  vendor   a table whose winner for each problem is the vendor kernel (a tuned hit that runs torch's own)
  given    --table PATH, when passed (e.g. a tuned table)
and reports min and median of the extra µs per call and the speed ratio (direct / ops-adv). On CUDA the
sizes are decode and ResNet shapes (gemm M=1 N=6144 K=4096 bf16, ...); on the CPU, small fp32 ones.
Also: the first call of an untuned gemm shape with 20 000 winners loaded (nearest search).

    python benchmarks/dispatch_overhead.py [--device cuda] [--table T.json] [--out R.json]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import kernel_space  # noqa: E402
import ops_adv  # noqa: E402

_spec = importlib.util.spec_from_file_location("table_file", HERE / "table_file.py")
table_file = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(table_file)


def cases(dev: torch.device) -> list[tuple[str, str, Callable, Callable]]:
    """(name, problem text, direct call, ops-adv call)."""
    cuda = dev.type == "cuda"
    dt = torch.bfloat16 if cuda else torch.float32
    r = lambda *s, **kw: torch.randn(*s, device=dev, dtype=dt, **kw)  # noqa: E731
    M, N, K = (1, 6144, 4096) if cuda else (16, 32, 64)
    a, b = r(M, K), r(K, N)
    x, w = r(M, K), r(N, K)
    rows, cols = (8, 4096) if cuda else (16, 64)
    xn, wn = r(rows, cols), r(cols)
    B, H, S, D = (1, 32, 128, 128) if cuda else (1, 1, 8, 16)
    q, k, v = r(B, H, S, D), r(B, H, S, D), r(B, H, S, D)
    out = [
        ("gemm", f"M={M} N={N} K={K}", lambda: torch.matmul(a, b), lambda: ops_adv.gemm(a, b)),
        ("linear", f"x {M}x{K}, W {N}x{K}", lambda: F.linear(x, w), lambda: ops_adv.linear(x, w)),
    ]
    for kk, fmt, pad in ((1, torch.channels_last, 0), (3, torch.contiguous_format, 1)):
        n, c, hw, o = (1, 256, 56, 64) if cuda else (1, 8, 8, 8)
        xc = r(n, c, hw, hw).contiguous(memory_format=fmt)
        wc = r(o, c, kk, kk).contiguous(memory_format=fmt)
        lay = "NHWC" if fmt is torch.channels_last else "NCHW"
        out.append(("conv2d", f"{kk}x{kk} {lay} {n}x{c}x{hw}x{hw} -> {o}",
                    lambda xc=xc, wc=wc, pad=pad: F.conv2d(xc, wc, None, 1, pad),
                    lambda xc=xc, wc=wc, pad=pad: ops_adv.conv2d(xc, wc, None, 1, pad)))
    out += [
        ("rms_norm", f"{rows}x{cols}", lambda: F.rms_norm(xn, (cols,), wn, 1e-6), lambda: ops_adv.rms_norm(xn, wn, 1e-6)),
        ("attention", f"B={B} H={H} S={S} D={D} causal",
         lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), lambda: ops_adv.attention(q, k, v, is_causal=True)),
    ]
    return out


def vendor_table(calls: list[Callable], dev: torch.device, path: str) -> str:
    """A table whose winner for every problem the calls meet is the vendor kernel dispatch would run."""
    backend = kernel_space.backend_of(dev)
    ops_adv.load_table("")
    with ops_adv.record() as rec:
        for c in calls:
            c()
    winners = []
    for op, probs in rec.shapes().items():
        for p in probs:
            parsed = kernel_space.get_op(op).parse_problem(p)
            impl = next(i for i in kernel_space.impls(op, backend=backend) if i.vendor and i.why_not(parsed, None, backend) is None)
            winners.append(table_file.winner(op, p, impl.name))
    return table_file.write(path, winners, table_file.device_class(dev))


def ran(call: Callable) -> str:
    """Which implementation(s) one call ran, and from where (tuned, nearest, default)."""
    with ops_adv.profiler.ProfileContext() as prof:
        call()
    return ", ".join(sorted({f"{c['op']}:{c['impl']}({c['source']})" for c in prof.calls})) or "torch (no op call)"


def per_call_us(fn: Callable, n: int, dev: torch.device) -> float:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return (time.perf_counter() - t0) / n * 1e6


def interleaved(fns: dict[str, Callable], dev: torch.device, rounds: int, budget_s: float) -> dict[str, list[float]]:
    """Samples of µs per call, the callables alternating (who goes first rotates) for `rounds` rounds."""
    for f in fns.values():
        f()
    probe = min(per_call_us(f, 3, dev) for f in fns.values())
    n = max(5, min(5000, int(budget_s / rounds / len(fns) / max(probe, 0.5) * 1e6)))
    names = list(fns)
    out: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            out[k].append(per_call_us(fns[k], n, dev))
    return out


def first_call_with_many_winners(dev: torch.device, n: int = 20000, log_uniform: bool = True, samples: int = 200) -> float:
    """Median µs of ops_adv.explain for a gemm shape the table lacks (the nearest search), `n` winners loaded.

    Sizes are log-uniform over 1..8192 (a table spread over octaves), or uniform, which puts three
    quarters of the winners within one octave of a typical query (the search's worst case).
    """
    rng = random.Random(0)

    def size() -> int:
        return max(1, round(2 ** rng.uniform(0, 13))) if log_uniform else rng.randint(1, 8192)

    impl = "torch_matmul"
    fields = kernel_space.get_op("gemm").problem._fields
    winners, seen = [], set()
    base = table_file.winner("gemm", dict(zip(fields, (8, 8, 8, "fp32", False, False))), impl)
    while len(winners) < n:
        p = (size(), size(), size(), "fp32", False, False)
        if p not in seen:
            seen.add(p)
            winners.append(dict(base, problem=dict(zip(fields, p))))
    with tempfile.TemporaryDirectory() as d:
        ops_adv.load_table(table_file.write(os.path.join(d, "many.json"), winners, table_file.device_class("cpu")))
    times = []
    for _ in range(samples):
        m, nn, k = size(), size(), size()
        a, b = torch.empty(m, k), torch.empty(k, nn)  # never touched: no pages committed
        t0 = time.perf_counter()
        ops_adv.explain("gemm", a, b)
        times.append(time.perf_counter() - t0)
    ops_adv.load_table("")
    return statistics.median(times) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--table", help="also measure with this tuned table")
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--budget-s", type=float, default=2.0, help="seconds of timing per case and table")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (default 1: the least-disturbed figure)")
    ap.add_argument("--no-first-call", dest="first_call", action="store_false")
    ap.add_argument("--out", help="JSON results")
    args = ap.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device")
    if args.table and not os.path.isfile(args.table):
        ap.error(f"--table {args.table}: no such file")
    torch.set_num_threads(args.threads)
    cs = cases(dev)
    tmp = tempfile.mkdtemp()
    tables = {"empty": "", "vendor": vendor_table([c[3] for c in cs], dev, os.path.join(tmp, "vendor.json"))}
    if args.table:
        tables["given"] = args.table
    results = []
    for name, prob, direct, ours in cs:
        row: dict[str, Any] = {"op": name, "problem": prob}
        for tname, path in tables.items():
            ops_adv.load_table(path)
            s = interleaved({"direct": direct, "ops_adv": ours}, dev, args.rounds, args.budget_s)
            d, o = s["direct"], s["ops_adv"]
            row[tname] = {"ran": ran(ours), "direct_min_us": min(d), "direct_med_us": statistics.median(d),
                          "extra_min_us": min(o) - min(d), "extra_med_us": statistics.median(o) - statistics.median(d),
                          "ratio_med": statistics.median(d) / statistics.median(o)}
        results.append(row)
    ops_adv.load_table("")
    info = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"CPU, {os.cpu_count()} cores, {args.threads} thread(s)",
            "torch": torch.__version__, "python": platform.python_version(), "rounds": args.rounds,
            "date": time.strftime("%Y-%m-%d")}
    if args.first_call:
        info["first_call_20000_winners_us"] = {"log_uniform": first_call_with_many_winners(dev),
                                               "dense": first_call_with_many_winners(dev, log_uniform=False)}
    print(f"{info['device']}, torch {info['torch']}, python {info['python']}; {args.rounds} interleaved rounds; "
          "+µs: ops_adv.<op> over the direct torch call per call (min / median), x: direct/ops_adv (median)")
    head = f"{'op':10} {'problem':32} {'direct µs':>10}"
    for t in tables:
        head += f" | {t + ' +µs min/med':>22} {'x':>5}"
    print(head)
    for row in results:
        line = f"{row['op']:10} {row['problem']:32} {row['empty']['direct_med_us']:10.2f}"
        for t in tables:
            d = row[t]
            line += f" | {d['extra_min_us']:+10.2f} /{d['extra_med_us']:+9.2f} {d['ratio_med']:5.2f}"
        print(line)
    for t in tables:
        print(f"ran with the {t} table: " + "; ".join(f"{r['op']} {r['problem']}: {r[t]['ran']}" for r in results))
    if args.first_call:
        f = info["first_call_20000_winners_us"]
        print(f"first call of an untuned gemm shape with 20 000 winners loaded (ops_adv.explain, nearest search, median of 200): "
              f"{f['log_uniform']:.1f} µs with sizes log-uniform over 1..8192, {f['dense']:.1f} µs uniform (dense in the top octaves)")
    if args.out:
        Path(args.out).write_text(json.dumps({"info": info, "rows": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
