#!/usr/bin/env python
"""rope on the GPU: ours (Triton, best of a small sweep) against the eager torch composite,
torch.compile of it and Liger-Kernel's rope, at Llama-3-8B / Mistral-7B / Qwen2-7B head shapes.

q and k are what Llama's attention hands to apply_rotary_pos_emb: q_proj's output viewed as
(B, S, H, D) and transposed to (B, H, S, D); cos/sin (1, S, D) as LlamaRotaryEmbedding returns them.
Out of place: composite, torch.compile(composite), ours (`out` fresh). In place: Liger (it
rotates the transposed view in place) against ours with out=(q, k).

Timing: up to 2048 tokens, CUDA graphs of 20 calls (launch overhead out; L2 warm, as q and k are
just after q_proj); above, stream launches with a 256 MB L2 flush before each (workers.timing).
Candidates alternate over --rounds rounds; medians. Copy bandwidth: a 2 GB device copy
(bytes read + written); "BW %" is rope's bytes (q, k read and written, cos/sin half rows) over it,
from L2-flushed timing (at <= 2048 tokens also measured flushed for that column).

    python benchmarks/rope.py --out benchmarks/results/rope.json          # GPU, < 3 min
    python benchmarks/rope.py --device cpu --quick --out /tmp/rope.json    # smoke test (interpreter)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Llama-3-8B and Mistral-7B share their head shapes: measured once
MODELS = {"llama3-8b/mistral-7b": (32, 8, 128), "qwen2-7b": (28, 4, 128)}
TOKENS = (1, 8, 32, 2048, 8192, 16384)
GRAPH_MAX_TOKENS = 2048
CALLS_PER_GRAPH = 20
T0 = time.perf_counter()

# The sweep: (BLOCK_T, BLOCK_H, SPLIT_HEADS, num_warps); configs the check refuses are skipped.
SWEEP_DECODE = [(1, 1, True, 1), (1, 2, True, 1), (1, 4, True, 1), (1, 8, True, 2), (1, 8, True, 4), (2, 4, True, 2),
                (1, 16, True, 4), (1, 8, False, 4), (1, 32, False, 8), (4, 8, True, 4), (8, 8, True, 4)]
SWEEP_PREFILL = [(1, 8, False, 4), (2, 8, False, 4), (4, 8, False, 4), (1, 16, False, 4), (2, 16, False, 8),
                 (4, 4, False, 4), (1, 32, False, 8), (2, 4, True, 4), (4, 8, True, 4), (8, 8, True, 8),
                 (1, 8, True, 2), (2, 8, False, 2), (8, 4, False, 4), (16, 2, False, 4)]


def log(*a) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s]", *a, flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--quick", action="store_true", help="one model, two token counts")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--deadline-s", type=float, default=130.0,
                    help="skip the problems left after this many seconds (the JSON is rewritten after every problem)")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton loads
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu --quick for the smoke test", file=sys.stderr)
        return 2
    dev = torch.device(args.device)
    models = dict(list(MODELS.items())[:1]) if args.quick else MODELS
    tokens = (1, 5) if args.device == "cpu" else ((8, 2048) if args.quick else TOKENS)
    if args.device == "cpu":
        models = {"tiny": (4, 2, 64)}
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32

    info = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "dtype": str(dtype).replace("torch.", ""), "calls_per_graph": CALLS_PER_GRAPH}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    info["copy_gbps"] = copy_bandwidth(torch, dev)
    log(f"{info['device']}: copy bandwidth {info['copy_gbps']:.0f} GB/s")
    rows, skipped = [], []
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for model, (hq, hkv, d) in models.items():
        for t in tokens:
            if time.perf_counter() - T0 > args.deadline_s:
                skipped.append(f"{model} T={t}")
                continue
            try:
                rows.append(bench_one(torch, dev, dtype, model, t, hq, hkv, d, args.rounds, info["copy_gbps"]))
            except Exception as e:  # one problem's failure is reported; the others still run
                log(f"{model} T={t}: {type(e).__name__}: {str(e)[:200]}")
                info.setdefault("errors", []).append(f"{model} T={t}: {type(e).__name__}: {str(e)[:200]}")
            Path(args.out).write_text(json.dumps({"info": info, "rows": rows, "skipped": skipped}, indent=1))
    if skipped:
        log(f"skipped past --deadline-s {args.deadline_s:g}: {', '.join(skipped)}")
    print()
    if dev.type == "cpu":
        print("CPU smoke test: Triton runs in its interpreter; the timings and targets say nothing here.")
    print(table(rows))
    Path(args.out).write_text(json.dumps({"info": info, "rows": rows, "skipped": skipped, "table": table(rows)}, indent=1))
    log(f"wrote {args.out}")
    return 0


def copy_bandwidth(torch, dev) -> float:
    from workers.timing import time_fn

    n = (2 << 30) if dev.type == "cuda" else (64 << 20)
    src = torch.ones(n // 4, dtype=torch.int32, device=dev)
    dst = torch.empty_like(src)
    t = time_fn(lambda: dst.copy_(src), device=dev, warmup=3, reps=20, budget_s=2.0, flush_l2=False)
    return 2 * n / (t.median_ms * 1e-3) / 1e9


def graph_ms(torch, fn, replays: int = 5) -> float:
    """Per-call time of `fn` replayed from a CUDA graph of CALLS_PER_GRAPH calls (median of replays)."""
    return graph_sampler(torch, fn, replays)()


def graph_sampler(torch, fn, replays: int = 5):
    """`fn` captured once in a CUDA graph of CALLS_PER_GRAPH calls; returns a function giving its per-call
    ms (median of `replays` replays). Captured once per candidate, not per round: every capture
    synchronizes and empties the allocator's cache (torch < 2.9 also ran gc.collect(), ~0.1-0.3 s)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(CALLS_PER_GRAPH):
            fn()
    g.replay()
    torch.cuda.synchronize()

    def sample() -> float:
        out = []
        for _ in range(replays):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            g.replay()
            e1.record()
            torch.cuda.synchronize()
            out.append(e0.elapsed_time(e1) / CALLS_PER_GRAPH)
        return statistics.median(out)

    sample.graph = g  # kept alive with the sampler
    return sample


def stream_ms(torch, dev, fn, budget_s: float = 0.1) -> float:
    from workers.timing import time_fn

    if dev.type == "cpu":  # the smoke test: the interpreter takes seconds a call
        return time_fn(fn, device=dev, warmup=1, reps=1, min_reps=1, budget_s=0).median_ms
    return time_fn(fn, device=dev, warmup=2, reps=25, budget_s=budget_s, flush_l2=True).median_ms


def bench_one(torch, dev, dtype, model: str, T: int, Hq: int, Hkv: int, D: int, rounds: int, copy_gbps: float) -> dict:
    from kernel_space import get_impl, relative_error
    from kernel_space.rope.problem import RopeProblem, bytes_moved, reference
    from kernel_space.rope.vendor import composite

    triton_rope = get_impl("rope", "triton_rope")
    code = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    p = RopeProblem(T, Hq, Hkv, D, False, False, code)
    g = torch.Generator().manual_seed(0)
    B, S = 1, T
    # q_proj's output (B, S, H, D), transposed as Llama's attention does
    q0 = torch.randn(B, S, Hq, D, generator=g).to(dev, dtype)
    k0 = torch.randn(B, S, Hkv, D, generator=g).to(dev, dtype)
    pos = torch.arange(S, dtype=torch.float64) + 17
    a = pos[:, None] * 500000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    a = torch.cat([a, a], -1)[None]
    cos, sin = a.cos().to(dev, dtype), a.sin().to(dev, dtype)
    q, k = q0.transpose(1, 2), k0.transpose(1, 2)  # (B, H, S, D) views
    qw, kw = q0.clone(), k0.clone()  # in-place work buffers
    qwt, kwt = qw.transpose(1, 2), kw.transpose(1, 2)
    c4, s4 = cos.unsqueeze(1), sin.unsqueeze(1)

    def eager():
        return composite(q, c4, s4, False), composite(k, c4, s4, False)

    compiled_fn = None
    if dev.type == "cuda":
        import torch._dynamo

        for knob in ("recompile_limit", "cache_size_limit"):  # one compiled graph per shape
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, max(getattr(torch._dynamo.config, knob), 64))
        compiled_fn = torch.compile(lambda q, k, c, s: (composite(q, c, s, False), composite(k, c, s, False)), dynamic=False)

    def ours_fn(cfg, inplace=False):
        f = triton_rope.bind(cfg)
        if inplace:
            return lambda: f(qw, kw, cos, sin, out=(qw, kw))
        return lambda: f(q0, k0, cos, sin, out=(torch.empty_like(q0), torch.empty_like(k0)))

    use_graph = dev.type == "cuda" and T <= GRAPH_MAX_TOKENS
    # sampler(fn): a function giving one sample of fn's ms (graph: captured once, replayed per sample)
    sampler = (lambda fn: graph_sampler(torch, fn)) if use_graph else (lambda fn: lambda: stream_ms(torch, dev, fn))
    timer = lambda fn: sampler(fn)()  # noqa: E731

    # correctness of what we time (fresh outputs, against the fp32 reference)
    ref = reference(q0, k0, cos, sin)
    row = {"model": model, "tokens": T, "Hq": Hq, "Hkv": Hkv, "D": D, "dtype": code, "graph": use_graph,
           "bytes": bytes_moved(p)}

    # sweep ours (out of place), then the best config in place too
    sweep = SWEEP_DECODE if T < GRAPH_MAX_TOKENS else SWEEP_PREFILL
    cfgs = [dict(zip(("BLOCK_T", "BLOCK_H", "SPLIT_HEADS", "num_warps"), c)) for c in sweep]
    cfgs = [c for c in cfgs if triton_rope.why_not(p, c, dev.type if dev.type == "cuda" else None) is None]
    if dev.type == "cpu":
        cfgs = cfgs[:2]
    swept = []
    for c in cfgs:
        qo, ko = torch.empty_like(q0), torch.empty_like(k0)
        try:  # a config that fails to compile or launch is recorded, not fatal
            triton_rope.bind(c)(q0, k0, cos, sin, out=(qo, ko))
            err = relative_error(torch.cat([qo, ko], -2), ref)
            if not err < 2e-2:
                swept.append({"config": c, "error": err})
                continue
            swept.append({"config": c, "ms": timer(ours_fn(c)), "rel_error": err})
        except Exception as e:
            swept.append({"config": c, "error": f"{type(e).__name__}: {str(e)[:200]}"})
    good = [s for s in swept if "ms" in s]
    if not good:
        raise RuntimeError(f"no config of the sweep ran: {swept[:3]}")
    best = min(good, key=lambda s: s["ms"])["config"]
    row["sweep"] = swept
    row["ours_config"] = best

    cands = {"eager": eager, "ours": ours_fn(best), "ours_inplace": ours_fn(best, True)}
    if compiled_fn is not None:
        try:
            compiled_fn(q, k, c4, s4)
            cands["compile"] = lambda: compiled_fn(q, k, c4, s4)
        except Exception as e:  # recorded, not fatal
            row["compile_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    try:
        from liger_kernel.ops.rope import LigerRopeFunction

        LigerRopeFunction.apply(qwt, kwt, cos, sin, None, 1)
        cands["liger_inplace"] = lambda: LigerRopeFunction.apply(qwt, kwt, cos, sin, None, 1)
    except Exception as e:
        row["liger_error"] = f"{type(e).__name__}: {str(e)[:120]}"
    samplers = {}
    for n, fn in list(cands.items()):
        try:
            samplers[n] = sampler(fn)
        except Exception as e:  # a candidate that cannot be timed (e.g. not capturable) is recorded, not fatal
            row[f"{n}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            del cands[n]
    per = {n: [] for n in samplers}
    for _ in range(rounds if dev.type == "cuda" else 1):
        for n, smp in samplers.items():
            per[n].append(smp())
    del samplers
    ms = {n: statistics.median(v) for n, v in per.items()}
    row["ms"] = ms
    if use_graph:  # bandwidth from L2-flushed launches, as for the larger problems
        row["ours_flushed_ms"] = stream_ms(torch, dev, cands["ours"])
    flushed = row.get("ours_flushed_ms", ms["ours"])
    row["ours_gbps"] = row["bytes"] / (flushed * 1e-3) / 1e9
    row["bw_frac"] = row["ours_gbps"] / copy_gbps
    row["x_eager"] = ms["eager"] / ms["ours"]
    if "compile" in ms:
        row["x_compile"] = ms["compile"] / ms["ours"]
    if "liger_inplace" in ms:
        row["x_liger"] = ms["liger_inplace"] / ms["ours_inplace"]
    log(f"{model} T={T}: " + ", ".join(f"{n} {v * 1e3:.1f} us" for n, v in ms.items()) + f"; ours {best}")
    return row


def table(rows: list[dict]) -> str:
    head = ("| model | tokens | timing | eager µs | compile µs | liger (in place) µs | ours µs | ours in place µs "
            "| × eager | × compile | × liger | ours BW % copy | ours config (T, H, split, warps) | targets |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        ms = r["ms"]
        f = lambda n: f"{ms[n] * 1e3:.1f}" if n in ms else "—"  # noqa: E731
        x = lambda k: f"{r[k]:.2f}" if k in r else "—"  # noqa: E731
        c = r["ours_config"]
        miss = []
        if r["tokens"] >= 2048:
            if r["bw_frac"] < 0.9:
                miss.append("BW<90%")
            if r["x_eager"] < 1.2:
                miss.append("eager<1.2x")
        if r.get("x_compile", 9) < 1.0:
            miss.append("compile<1x")
        if r.get("x_liger", 9) < 1.0:
            miss.append("liger<1x")
        out.append(
            f"| {r['model']} | {r['tokens']} | {'graph' if r['graph'] else 'flushed'} | {f('eager')} | {f('compile')} "
            f"| {f('liger_inplace')} | {f('ours')} | {f('ours_inplace')} | {x('x_eager')} | {x('x_compile')} | {x('x_liger')} "
            f"| {100 * r['bw_frac']:.0f} | {c['BLOCK_T']}, {c['BLOCK_H']}, {int(c['SPLIT_HEADS'])}, {c['num_warps']} "
            f"| {'met' if not miss else ', '.join(miss)} |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
