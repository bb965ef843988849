#!/usr/bin/env python
"""Where generate()'s time to first token goes, original against converted (issue 28's TTFT target).

decode_step.py times the first token as a whole generate(max_new_tokens=1). This builds the same model
(Llama-3-8B dims, --layers, bf16), with transformers' compile config as generate uses it on CUDA, and for
each variant in its own process (--variant, or all of them one after the other):

  - the median wall time of generate(max_new_tokens=1) over --reps, after --warmup calls;
  - the same call's prefill forward alone (model(ids, mask, static cache, logits_to_keep=1)), timed the same way;
  - torch.profiler over one generate: CUDA kernel time summed, the wall time, and the kernels by total time;
  - cProfile's top host functions of one generate (by their own time);
  - with a table, the census of op calls of one generate by op, implementation and source;
  - with --new N (> 1): the decode steps of generate(max_new_tokens=N): wall time a step ((N-token generate -
    1-token generate) / (N - 1)), CUDA kernel time a step (the same difference, from the profiler), and cProfile's
    top host functions of that generate. Where the wall time a step exceeds the kernel time, the host (generate's
    loop, the graphs' input copies) or gaps between kernels bound the step.

    python benchmarks/ttft_profile.py --batch 1 --prompt 512 --table T.json --out DIR
"""
from __future__ import annotations

import argparse
import cProfile
import importlib.util
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "benchmarks"]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

VARIANTS = ("original", "converted")


def _e2e():
    spec = importlib.util.spec_from_file_location("e2e_model", ROOT / "benchmarks" / "e2e_model.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["e2e_model"] = mod
    spec.loader.exec_module(mod)
    return mod


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def run_variant(args: argparse.Namespace) -> dict:
    import ops_adv

    e2e = _e2e()
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    B, S = args.batch, args.prompt
    m = e2e.build_decoder("llama", argparse.Namespace(size=args.size, layers=args.layers), dev, dtype, S + 256)
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = 0
    if args.variant == "converted":
        m = ops_adv.convert_model(m)
    g = torch.Generator().manual_seed(B * 17 + S)
    ids = torch.randint(1, m.config.vocab_size, (B, S), generator=g).to(dev)
    mask = torch.ones(B, S, dtype=torch.long, device=dev)
    kw = dict(cache_implementation="static", max_new_tokens=1, do_sample=False, pad_token_id=0)
    if dev.type != "cuda":
        kw["disable_compile"] = True

    def gen():
        return m.generate(ids, attention_mask=mask, **kw)

    cache = e2e.static_cache(m, B, S + 1, dev, dtype)
    ckw = e2e.cache_kwarg(m)

    def prefill():
        for layer in getattr(cache, "layers", []):  # a fresh cache each call, as generate's
            if hasattr(layer, "reset"):
                layer.reset()
        return m(ids, attention_mask=mask, **{ckw: cache}, logits_to_keep=1)

    res: dict = {"variant": args.variant, "batch": B, "prompt": S, "layers": args.layers}
    with torch.no_grad():
        for name, fn in (("generate_1", gen), ("prefill", prefill)):
            for _ in range(args.warmup):
                fn()
            ts = []
            for _ in range(args.reps):
                _sync(dev)
                t0 = time.perf_counter()
                fn()
                _sync(dev)
                ts.append(time.perf_counter() - t0)
            res[f"{name}_ms"] = statistics.median(ts) * 1e3
            res[f"{name}_min_ms"] = min(ts) * 1e3
        if args.table or args.variant == "converted":
            from ops_adv.tools.census import census

            with census() as c:
                gen()
            res["census"] = str(c)
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        _sync(dev)
        t0 = time.perf_counter()
        with torch.profiler.profile(activities=acts) as prof:
            gen()
            _sync(dev)
        res["profiled_wall_ms"] = (time.perf_counter() - t0) * 1e3
        kernels: dict[str, list[float]] = {}
        for ev in prof.events():
            if dev.type == "cuda" and ev.device_type == torch.autograd.DeviceType.CUDA:
                kernels.setdefault(ev.name[:90], []).append(ev.device_time / 1e3)
        res["kernel_ms"] = sum(sum(v) for v in kernels.values())
        res["kernels"] = sum(len(v) for v in kernels.values())
        res["top_kernels"] = sorted(([k, len(v), sum(v)] for k, v in kernels.items()), key=lambda r: -r[2])[:args.top]
        pr = cProfile.Profile()
        _sync(dev)
        pr.enable()
        gen()
        _sync(dev)
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(args.top)
        res["host_profile"] = s.getvalue()
        if args.new > 1:
            kwn = dict(kw, max_new_tokens=args.new)
            for _ in range(2):
                m.generate(ids, attention_mask=mask, **kwn)  # compiles or captures
            ts = []
            for _ in range(args.reps):
                _sync(dev)
                t0 = time.perf_counter()
                m.generate(ids, attention_mask=mask, **kwn)
                _sync(dev)
                ts.append(time.perf_counter() - t0)
            res["step_ms"] = (statistics.median(ts) * 1e3 - res["generate_1_ms"]) / (args.new - 1)
            with torch.profiler.profile(activities=acts) as prof:
                m.generate(ids, attention_mask=mask, **kwn)
                _sync(dev)
            k = [ev.device_time / 1e3 for ev in prof.events()
                 if dev.type == "cuda" and ev.device_type == torch.autograd.DeviceType.CUDA]
            res["step_kernel_ms"] = (sum(k) - res["kernel_ms"]) / (args.new - 1)
            res["step_kernels"] = (len(k) - res["kernels"]) / (args.new - 1)
            pr = cProfile.Profile()
            _sync(dev)
            pr.enable()
            m.generate(ids, attention_mask=mask, **kwn)
            _sync(dev)
            pr.disable()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(args.top)
            res["decode_host_profile"] = s.getvalue()
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", default="8b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--new", type=int, default=0, help="also profile the decode steps of generate(max_new_tokens=NEW)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--table", help="the tuned table the converted variant loads (OPS_ADV_TABLE)")
    ap.add_argument("--variant", choices=VARIANTS, help="one variant, in this process (default: each in its own)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.variant:
        print(json.dumps(run_variant(args), default=str))
        return 0
    rows = []
    for v in VARIANTS:
        cmd = [sys.executable, __file__, "--variant", v] + [a for a in (argv if argv is not None else sys.argv[1:])]
        env = dict(os.environ, **({"OPS_ADV_TABLE": args.table} if args.table and v == "converted" else {}))
        if v == "original":
            env.pop("OPS_ADV_TABLE", None)
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        line = (p.stdout.strip().splitlines() or [""])[-1]
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            r = {"variant": v, "error": (p.stderr.strip().splitlines() or ["?"])[-1][:300]}
        rows.append(r)
        print(f"== {v}: " + (r.get("error") or f"generate(1) {r['generate_1_ms']:.2f} ms (min {r['generate_1_min_ms']:.2f}), "
                              f"prefill {r['prefill_ms']:.2f} ms, profiled wall {r['profiled_wall_ms']:.2f} ms, "
                              f"{r['kernels']} kernels {r['kernel_ms']:.2f} ms"), flush=True)
        if r.get("step_ms"):
            print(f"   decode: {r['step_ms']:.3f} ms a step (wall), {r['step_kernel_ms']:.3f} ms of kernels a step, "
                  f"{r['step_kernels']:.1f} kernels a step")
        for k in r.get("top_kernels", [])[:args.top]:
            print(f"   {k[2]:8.3f} ms {k[1]:5d}x  {k[0]}")
        if r.get("census"):
            print(r["census"])
        for key in ("host_profile", "decode_host_profile"):
            if r.get(key):
                print(f"   {key}:")
                print("\n".join(r[key].splitlines()[:args.top + 12]))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"ttft-B{args.batch}-p{args.prompt}.json").write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
