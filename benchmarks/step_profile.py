#!/usr/bin/env python
"""Where a decode step's time goes: the CUDA kernels of one step, per variant (issues 28 and 29).

A Llama-3-8B-dims decoder (--layers, default 2) at B x context from a filled StaticCache, as
decode_step.py's layer part builds it; each variant in this process, one after the other:
compile-ro (the original under torch.compile reduce-overhead), eager+graph, converted+graph (our own CUDA
graph of the converted model), compile-ro(converted), compile-cg(converted) (torch.compile's cudagraphs
backend); a compiled variant named with "/noguards" (compile-ro(converted)/noguards) is timed with Dynamo's
guard checks skipped after its warm-up, which sizes their host cost. For each: the step's time (CUDA events over graph replays, median), then torch.profiler over
--steps steps: kernels a step, the sum of their times a step (what is left of the step is idle time
between kernels), and the kernels by total time, grouped by name. Per layer = (step - head) / layers is
not computed here: the kernels are listed whole.

    python benchmarks/step_profile.py --batch 1 --context 1024 --table T.json --out DIR
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "benchmarks"]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

VARIANTS = ("compile-ro", "eager+graph", "converted+graph", "compile-ro(converted)", "compile-cg(converted)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--table")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.table:
        os.environ["OPS_ADV_TABLE"] = str(Path(args.table).resolve())
    import ops_adv
    import decode_step as ds  # noqa: F401  (benchmarks on the path below)

    e2e = ds.e2e
    dev, dtype = torch.device("cuda"), torch.bfloat16
    B, ctx = args.batch, args.context
    cap = ctx + 128
    ns = argparse.Namespace(size="8b", layers=args.layers, dtype="bf16")
    results = {}
    from torch._dynamo.utils import counters

    for v in [x.strip() for x in args.variants.split(",") if x.strip()]:
        torch._dynamo.reset()
        counters.clear()
        # "<compiled variant>/noguards": timed with Dynamo's guard checks skipped (warm-up ran them), to size their cost
        v, noguards = (v[: -len("/noguards")], True) if v.endswith("/noguards") else (v, False)
        with torch.no_grad():
            m = ds.build(ns, args.layers, dev, cap + 64)
            step, prep = ds.decode_setup(m, B, ctx, cap, dev, dtype, seed=B * 131 + ctx)
            if "converted" in v:
                m = ops_adv.convert_model(m)
            ro = v.startswith("compile")
            if v.endswith("+graph"):
                fn = e2e.capture(step(m), prep)
            elif v.startswith("compile-cg"):
                fn = step(torch.compile(m, backend="cudagraphs", dynamic=False))
            else:
                fn = step(torch.compile(m, mode="reduce-overhead", dynamic=False))
            pre = (lambda p=prep: (torch.compiler.cudagraph_mark_step_begin(), p())) if ro else prep
            for _ in range(5):
                pre()
                fn()
            torch.cuda.synchronize()
            if noguards:
                torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
                v += "/noguards"
            times = [e2e.time_once(fn, pre, dev) for _ in range(30)]
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                for _ in range(args.steps):
                    pre()
                    fn()
                torch.cuda.synchronize()
        kernels: dict[str, list[float]] = {}
        for evt in prof.events():
            if evt.device_type == torch.autograd.DeviceType.CUDA and evt.name and not evt.name.startswith("Memcpy") \
                    and evt.name != "Memset (Device)":
                kernels.setdefault(evt.name, []).append(evt.device_time if hasattr(evt, "device_time") else evt.cuda_time)
        n = sum(len(x) for x in kernels.values()) / args.steps
        total = sum(sum(x) for x in kernels.values()) / args.steps
        rows = sorted(((k, len(x) / args.steps, sum(x) / args.steps, statistics.mean(x)) for k, x in kernels.items()),
                      key=lambda r: -r[2])
        step_us = statistics.median(times) * 1e3
        # reduce-overhead that skipped its CUDA graphs runs Inductor's kernels one launch each (TORCH_LOGS=perf_hints says why)
        skips = int(counters["inductor"].get("cudagraph_skips", 0))
        results[v] = {"step_us": step_us, "kernels_per_step": n, "kernel_us_per_step": total, "idle_us": step_us - total,
                      "cudagraph_skips": skips,
                      "top": [{"kernel": k[:140], "per_step": c, "us_per_step": t, "us_each": e} for k, c, t, e in rows[:args.top]]}
        print(f"\n== {v}: step {step_us:.1f} µs, {n:.0f} kernels a step, kernel time {total:.1f} µs, idle {step_us - total:.1f} µs"
              f"{f', CUDA graphs skipped {skips}x' if skips else ''}", flush=True)
        for k, c, t, e in rows[:args.top]:
            print(f"  {t:8.1f} µs/step  {c:5.1f} x {e:7.2f} µs  {k[:110]}")
        if noguards:
            torch.compiler.set_stance("default", skip_guard_eval_unsafe=False)
        del fn, m, step, prep, prof
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"step_profile_B{B}_ctx{ctx}.json").write_text(json.dumps(
            {"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "benchmarks"))
    sys.exit(main())
