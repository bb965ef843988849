"""decode_attention on the H200: each SDPA backend against the Triton flash-decoding kernel.

Llama-3-8B / Mistral-7B (32 query heads over 8 K/V heads; the two share every attention shape,
so they are measured once) and Qwen2-7B (28 over 4), D 128, bf16, Sq 1 (and a few Sq 4 causal
rows), B 1/4/8/32 x Skv 1k/4k/16k/64k. Every candidate is checked against the reference (or, past
10 GB of K/V, against the flash backend) before it is timed.

Timing: CUDA graphs of calls over `copies` independent K/V caches, so that L2 is cold for every
call (a model's layers each read their own cache; 50 MB of L2 would otherwise hold the small
caches); median of interleaved rounds. Copy bandwidth is measured in the same run (a 1 GiB
device-to-device copy, read + write bytes / time) and each kernel's K/V read rate is reported
as a fraction of it.

    python benchmarks/decode_attention.py --out benchmarks/results/decode_attention_h200.json
    python benchmarks/decode_attention.py --device cpu --quick      # smoke run (Triton interpreter)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODELS = {"llama3-8b/mistral-7b": (32, 8, 128), "qwen2-7b": (28, 4, 128)}
BATCHES = (1, 4, 8, 32)
LENGTHS = (1024, 4096, 16384, 65536)
MAX_KV_BYTES = 20e9
L2_COLD_BYTES = 256 << 20  # K/V footprint of one graph: 5x the H200's 50 MB L2
# The Triton sweep: tiles that compile without spills on sm_90 (see triton.check), times the
# numbers of splits that give the grid about 0.5-4 waves of the 132 SMs.
TILES = ({"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}, {"BLOCK_N": 64, "num_warps": 8, "num_stages": 3},
         {"BLOCK_N": 128, "num_warps": 8, "num_stages": 2})
VENDORS = ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_math")


def problems(quick: bool, device: str):
    from kernel_space.decode_attention import DecodeAttentionProblem as P

    if device == "cpu":
        return [("tiny", P(2, 8, 2, 1, 200, 32, True, False, "fp16")), ("tiny", P(2, 8, 2, 4, 150, 32, False, True, "fp16"))]
    out = []
    for name, (hq, hkv, d) in MODELS.items():
        for b in BATCHES[:2] if quick else BATCHES:
            for s in LENGTHS[:2] if quick else LENGTHS:
                p = P(b, hq, hkv, 1, s, d, False, False, "bf16")
                if 2 * b * hkv * s * d * 2 <= MAX_KV_BYTES:
                    out.append((name, p))
        for b, s in ((8, 4096), (8, 16384)) if not quick else ((4, 4096),):
            out.append((name, P(b, hq, hkv, 4, s, d, False, True, "bf16")))
    return out


def kv_bytes(p) -> int:
    return 2 * p.B * p.Hkv * p.Skv * p.D * 2 if p.dtype != "fp32" else 2 * p.B * p.Hkv * p.Skv * p.D * 4


def triton_configs(p, sms: int):
    from kernel_space.decode_attention.triton import check

    programs = p.B * p.Hkv  # HEADS_PER_PROGRAM 0: one program per K/V head and split
    want = max(1, sms // programs)
    for tile in TILES:
        configs = [{**tile, "num_splits": s, "HEADS_PER_PROGRAM": 0} for s in (64, 32, 16, 8, 4, 2, 1)]
        valid = [c for c in configs if check(p, c) is None]
        near = [c for c in valid if want / 4 <= c["num_splits"] <= 4 * want]
        yield from near or valid[:1]  # else the most splits the keys allow


def gpu_inputs(p, seed: int):
    """q, k, v drawn on the device (make_inputs draws on the CPU: tens of seconds for 8 GB of K/V)."""
    import torch

    from kernel_space._common import DTYPES

    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    dt = DTYPES[p.dtype]
    q = torch.randn((p.B, p.Hq, p.Sq, p.D), generator=g, device="cuda", dtype=dt)
    k = torch.randn((p.B, p.Hkv, p.Skv, p.D), generator=g, device="cuda", dtype=dt)
    v = torch.randn((p.B, p.Hkv, p.Skv, p.D), generator=g, device="cuda", dtype=dt)
    return (q, k, v)


def copy_bandwidth(device) -> float:
    """Device-to-device copy, bytes read + written per second (median of 10)."""
    import torch

    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del src, dst
    return 2 * n / statistics.median(times)


class Timer:
    """One candidate over `copies` K/V caches, captured in a CUDA graph (eager on the CPU)."""

    def __init__(self, fn, inputs, device: str) -> None:
        import torch

        self.device = device
        self.calls = [lambda a=a: fn(*a) for a in inputs]
        if device == "cpu":
            self.graph = None
            return
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for c in self.calls:  # warm-up (compilation, cuDNN plans) outside the capture
                c()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            for c in self.calls:
                c()
        torch.cuda.synchronize()

    def once(self) -> float:
        """Seconds per call, from one replay of the whole graph."""
        import torch

        if self.graph is None:
            t0 = time.perf_counter()
            for c in self.calls:
                c()
            return (time.perf_counter() - t0) / len(self.calls)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        self.graph.replay()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3 / len(self.calls)


def interleaved(timers: dict, rounds: int) -> dict:
    samples = {k: [] for k in timers}
    for _ in range(rounds):
        for k, t in timers.items():
            samples[k].append(t.once())
    return {k: statistics.median(v) for k, v in samples.items()}


def bench_problem(name, p, device, copy_bw, rounds: int) -> dict:
    import torch

    from kernel_space import get_impl, get_op, relative_error

    spec = get_op("decode_attention")
    kvb = kv_bytes(p)
    copies = 1 if device == "cpu" else max(1, min(32, math.ceil(L2_COLD_BYTES / kvb)))
    inputs = [spec.make_inputs(p, device, seed=i)[0] if device == "cpu" else gpu_inputs(p, i) for i in range(copies)]
    attrs = {"causal": p.causal}
    # fp32 reference: ~2x the K/V bytes more memory (<= 20 GB); flash as the reference only past 10 GB,
    # where a refused flash would leave the other candidates unchecked
    if kvb <= 10e9 or device == "cpu":
        ref, ref_name = spec.reference(*inputs[0], **attrs), "reference"
    else:
        ref, ref_name = None, "sdpa_flash"
    tol = spec.tolerance(p.dtype)
    row = {"model": name, "problem": p._asdict(), "kv_bytes": kvb, "copies": copies, "vendors": {}, "triton": {}}

    def admit(label, fn) -> "Timer | None":
        nonlocal ref
        try:
            out = fn(*inputs[0])
            if ref is None and label == ref_name:
                ref = out.float()
            err = relative_error(out, ref) if ref is not None else None
            if err is not None and err > tol:
                return f"wrong result ({err:.2g} > {tol:g})"
            return Timer(fn, inputs, device)
        except Exception as e:  # a backend refusing the call is a result, not a crash
            return f"error: {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"

    timers, why = {}, None
    backend = "cpu" if device == "cpu" else "cuda"
    for v in VENDORS if device != "cpu" else ("sdpa",):
        impl = get_impl("decode_attention", v)
        why = impl.why_not(p, {}, backend)
        if why is None and v == "sdpa_math" and kvb > 2e9:
            why = "skipped: over 2 GB of K/V (math repeats K/V per query head)"
        if why is None:
            why = admit(v, lambda *a, f=impl.fn: f(*a, **attrs))
        if isinstance(why, Timer):
            timers[v] = why
        else:
            row["vendors"][v] = {"status": why}
    impl = get_impl("decode_attention", "triton_decode")
    configs = list(triton_configs(p, 132)) if device != "cpu" else [
        {"BLOCK_N": 32, "num_warps": 4, "num_stages": 1, "num_splits": 1, "HEADS_PER_PROGRAM": 0},
        {"BLOCK_N": 32, "num_warps": 4, "num_stages": 1, "num_splits": 4, "HEADS_PER_PROGRAM": 0}]
    t = None
    for i, c in enumerate(configs):
        t = admit(f"triton{i}", lambda *a, f=impl.bind(c): f(*a, **attrs))
        if isinstance(t, Timer):
            timers[f"triton{i}"] = t
        else:
            row["triton"][json.dumps(c)] = {"status": t}
    row["checked_against"] = ref_name if ref is not None else None  # None: nothing checked the candidates
    med = interleaved(timers, rounds)
    for k, s in med.items():
        entry = {"status": "ok", "us": s * 1e6, "kv_GBps": kvb / s / 1e9}
        if k.startswith("triton"):
            row["triton"][json.dumps(configs[int(k[6:])])] = entry
        else:
            row["vendors"][k] = entry
    ok_v = {k: v["us"] for k, v in row["vendors"].items() if v["status"] == "ok"}
    ok_t = {k: v["us"] for k, v in row["triton"].items() if v["status"] == "ok"}
    if ok_v:
        row["best_vendor"] = min(ok_v, key=ok_v.get)
    if ok_t:
        best = min(ok_t, key=ok_t.get)
        row["best_triton"] = {"config": json.loads(best), "us": ok_t[best]}
        if copy_bw:
            row["copy_fraction"] = kvb / (ok_t[best] / 1e6) / copy_bw
        if ok_v:
            row["speedup_vs_best_sdpa"] = ok_v[row["best_vendor"]] / ok_t[best]
    inputs = timers = why = t = None  # the graphs and their K/V copies: freed before the next problem's
    if device != "cpu":
        torch.cuda.empty_cache()
    return row


def fmt(row) -> str:
    p = row["problem"]
    cols = []
    for v in VENDORS + ("sdpa",):
        e = row["vendors"].get(v)
        if e is not None:
            cols.append(f"{v.replace('sdpa_', '')}={e['us']:.1f}" if e["status"] == "ok" else f"{v.replace('sdpa_', '')}=n/a")
    bt = row.get("best_triton")
    tri = f"triton={bt['us']:.1f} (BN{bt['config']['BLOCK_N']} w{bt['config']['num_warps']} s{bt['config']['num_stages']} "\
          f"splits{bt['config']['num_splits']})" if bt else "triton=n/a"
    ratio = f"{row['speedup_vs_best_sdpa']:.2f}x" if "speedup_vs_best_sdpa" in row else "-"
    frac = f"{100 * row['copy_fraction']:.0f}%" if "copy_fraction" in row else "-"
    return (f"{row['model']:<21} B={p['B']:<3} Skv={p['Skv']:<6} Sq={p['Sq']}{'c' if p['causal'] else ' '} | "
            f"{' '.join(cols)} | {tri} | vs best SDPA {ratio} | copy bw {frac}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="a few shapes only")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds per problem (median)")
    ap.add_argument("--out", help="write the results as JSON here (rewritten after every problem)")
    ap.add_argument("--deadline-s", type=float, default=170.0,
                    help="skip the problems left after this many seconds (one problem takes ~1-10 s)")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are decorated
    import torch

    if args.device != "cpu" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu --quick for a smoke run")
        return 0
    import kernel_space  # noqa: F401

    t0 = time.perf_counter()
    copy_bw = copy_bandwidth(args.device) if args.device != "cpu" else None
    dev_name = torch.cuda.get_device_name() if args.device != "cpu" else "cpu"
    print(f"decode_attention on {dev_name}; torch {torch.__version__}; times in µs per call, CUDA graphs over "
          f"enough K/V copies to keep L2 cold (>= {L2_COLD_BYTES >> 20} MiB a graph)"
          + (f"; copy bandwidth {copy_bw / 1e12:.2f} TB/s (read+write)" if copy_bw else ""))
    rows, skipped = [], []
    meta = {"device": dev_name, "torch": torch.__version__, "copy_bandwidth_Bps": copy_bw,
            "l2": f"cold: each graph reads >= {L2_COLD_BYTES >> 20} MiB of distinct K/V caches"}

    def write(summary=None) -> None:
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows, "skipped": skipped}, indent=1))

    for name, p in problems(args.quick, args.device):
        if time.perf_counter() - t0 > args.deadline_s:
            skipped.append({"model": name, "problem": p._asdict()})
            continue
        try:
            row = bench_problem(name, p, args.device, copy_bw, 1 if args.device == "cpu" else args.rounds)
        except Exception as e:  # one problem's failure (out of memory, ...) is reported; the others still run
            print(f"{name} {tuple(p)}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            skipped.append({"model": name, "problem": p._asdict(), "error": f"{type(e).__name__}: {str(e)[:200]}"})
            if args.device != "cpu":
                torch.cuda.empty_cache()
            continue
        rows.append(row)
        print(fmt(row), flush=True)
        write()
    if skipped:
        print(f"skipped {len(skipped)} problems (past --deadline-s {args.deadline_s:g}, or failed)")
    # the targets of issue 11
    fast = [r for r in rows if r["problem"]["B"] <= 8 and 1024 <= r["problem"]["Skv"] <= 16384 and "speedup_vs_best_sdpa" in r]
    bw = [r for r in rows if r["problem"]["Skv"] >= 4096 and "copy_fraction" in r]
    summary = {
        "speedup_target": ">= 2x best SDPA at B <= 8, Skv 1k-16k",
        "speedup_met": f"{sum(r['speedup_vs_best_sdpa'] >= 2 for r in fast)}/{len(fast)}",
        "speedup_min": min((r["speedup_vs_best_sdpa"] for r in fast), default=None),
        "bandwidth_target": ">= 80% of copy bandwidth at Skv >= 4k",
        "bandwidth_met": f"{sum(r['copy_fraction'] >= 0.8 for r in bw)}/{len(bw)}",
        "bandwidth_min": min((r["copy_fraction"] for r in bw), default=None),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(summary))
    write(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
