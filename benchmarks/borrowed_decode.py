#!/usr/bin/env python
"""A decode_attention winner borrowed from a near problem against the best configuration of the problem it
runs (issue 28, item 2), on the GPU.

For each problem (Llama-3-8B heads: 32 query over 8 K/V, D 128, bf16, a static cache with seq_lens as
generate() runs it: B 1 and 8, caches of 639 and 4223 slots, i.e. prompts 512 and 4096 + 128 new tokens)
every admitted configuration of a sweep (BLOCK_N x num_splits x warps x stages, whole query-head groups)
is timed under a CUDA graph over cold K/V caches (benchmarks/decode_attention.py's Timer), and the vendor
kernels beside them. Then, for each ordered pair (tuned at A, run at B): the best of A fitted to B by
`adapt` (what dispatch now runs), and as it was tuned (what it ran before), against B's best and
B's fastest vendor kernel.

    python benchmarks/borrowed_decode.py --out DIR          # writes DIR/borrowed_decode.{json,md}
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

SWEEP = {"BLOCK_N": (32, 64, 128), "num_splits": (1, 2, 4, 8, 16, 32, 64), "num_warps": (4, 8), "num_stages": (2, 3)}


def problems(batches, lengths):
    from kernel_space.decode_attention.problem import DecodeAttentionProblem as P

    return [P(B, 32, 8, 1, S, 128, True, False, "bf16") for B in batches for S in lengths]


def sweep(p, rounds: int = 15) -> dict:
    import torch

    import kernel_space
    from decode_attention import Timer, gpu_inputs, interleaved
    from kernel_space.decode_attention.triton import check

    impl = kernel_space.get_impl("decode_attention", "triton_decode")
    copies = max(1, min(16, (256 << 20) // (4 * p.B * p.Hkv * p.Skv * p.D)))
    inputs = []
    for i in range(copies):
        q, k, v = gpu_inputs(p, i)
        lens = torch.full((p.B,), p.Skv - 7, dtype=torch.int32, device="cuda")  # a cache not yet full
        inputs.append((q, k, v, lens))
    ref = kernel_space.get_op("decode_attention").reference(*inputs[0])
    configs = []
    for vals in itertools.product(*SWEEP.values()):
        c = dict(zip(SWEEP, vals), HEADS_PER_PROGRAM=0)
        if check(p, c) is None:
            configs.append(c)
    timers, keys = {}, {}
    for c in configs:
        fn = impl.bind(c)
        torch.testing.assert_close(fn(*inputs[0]).float(), ref.float(), atol=2e-2, rtol=2e-2)
        key = json.dumps(c, sort_keys=True)
        timers[key], keys[key] = Timer(fn, inputs, "cuda"), c
    vendors = {}
    for name in ("sdpa_cudnn", "sdpa_efficient", "sdpa_flash", "sdpa"):
        v = kernel_space.get_impl("decode_attention", name)
        if v.why_not(p, {}, "cuda") is None:
            try:
                timers[name] = Timer(v.bind({}), inputs, "cuda")
                vendors[name] = True
            except Exception as e:  # a backend that refuses this call at run time
                print(f"  {name}: {type(e).__name__}", flush=True)
    med = interleaved(timers, rounds)
    ours = {k: med[k] for k in keys}
    best = min(ours, key=ours.get)
    vbest = min(vendors, key=lambda n: med[n]) if vendors else None
    return {"problem": p._asdict(), "configs": [{"params": keys[k], "us": ours[k] * 1e6} for k in ours],
            "best": keys[best], "best_us": ours[best] * 1e6, "vendor": vbest, "vendor_us": med[vbest] * 1e6 if vbest else None}


def time_config(p, c) -> float:
    """One configuration's µs at p, from the sweep's rows (every adapted configuration is a point of the sweep)."""
    for row in p["configs"]:
        if row["params"] == c:
            return row["us"]
    return float("nan")


def pairs(rows: list[dict]) -> list[dict]:
    from kernel_space.decode_attention.problem import DecodeAttentionProblem as P
    from kernel_space.decode_attention.triton import adapt, check

    out = []
    for a, b in itertools.permutations(rows, 2):
        pa, pb = P(**a["problem"]), P(**b["problem"])
        fitted = adapt(pa, pb, a["best"])
        as_tuned = dict(a["best"]) if check(pb, a["best"]) is None else None
        t_fit = time_config(b, fitted)
        t_raw = time_config(b, as_tuned) if as_tuned else None
        out.append({"tuned_at": f"B={pa.B} Skv={pa.Skv}", "runs_at": f"B={pb.B} Skv={pb.Skv}", "fitted": fitted,
                    "fitted_us": t_fit, "as_tuned_us": t_raw, "best_us": b["best_us"], "vendor": b["vendor"],
                    "vendor_us": b["vendor_us"], "fitted_vs_best": t_fit / b["best_us"],
                    "as_tuned_vs_best": t_raw / b["best_us"] if t_raw else None,
                    "within_10pct": t_fit <= 1.10 * b["best_us"]})
    return out


def markdown(rows: list[dict], prs: list[dict]) -> str:
    lines = ["| problem | best config | best µs | vendor | vendor µs | best x vendor |", "|---|---|---|---|---|---|"]
    for r in rows:
        p = r["problem"]
        b = r["best"]
        lines.append(f"| B={p['B']} Skv={p['Skv']} | BLOCK_N {b['BLOCK_N']} splits {b['num_splits']} warps {b['num_warps']} "
                     f"stages {b['num_stages']} | {r['best_us']:.1f} | {r['vendor']} | {r['vendor_us']:.1f} | "
                     f"{r['vendor_us'] / r['best_us']:.2f}x |")
    lines += ["", "| tuned at | runs at | fitted splits | fitted / best | as tuned / best | fitted x vendor |", "|---|---|---|---|---|---|"]
    for q in prs:
        raw = f"{q['as_tuned_vs_best']:.2f}" if q["as_tuned_vs_best"] else "not admitted"
        lines.append(f"| {q['tuned_at']} | {q['runs_at']} | {q['fitted']['num_splits']} | {q['fitted_vs_best']:.2f} | {raw} | "
                     f"{q['vendor_us'] / q['fitted_us']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--lengths", default="639,4223")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    rows = []
    for p in problems([int(x) for x in args.batches.split(",")], [int(x) for x in args.lengths.split(",")]):
        rows.append(sweep(p, args.rounds))
        print(f"B={p.B} Skv={p.Skv}: best {rows[-1]['best']} {rows[-1]['best_us']:.1f} µs, "
              f"{rows[-1]['vendor']} {rows[-1]['vendor_us']:.1f} µs", flush=True)
    prs = pairs(rows)
    md = markdown(rows, prs)
    print(md)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "borrowed_decode.json").write_text(json.dumps({"problems": rows, "pairs": prs}, indent=1))
        (out / "borrowed_decode.md").write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
