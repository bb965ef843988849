#!/usr/bin/env python
"""A Llama-3-8B-class decode step against the HBM bound, and tokens/s of `generate()` (issue 21).

Models are transformers' LlamaForCausalLM built from a config with random weights (nothing is downloaded):
Llama-3-8B dims (hidden 4096, intermediate 14336, 32 query / 8 K/V heads, head 128, vocab 128256), --layers
of them (default 4; --tiny: e2e_model's tiny dims, 2 layers, for a CPU smoke run). bf16 on CUDA.

Parts (--parts), each job (a case and a variant) in a child process of its own with a deadline (e2e_model's
helpers); a job that fails or kills its process is a row with its error and the run goes on:
- bandwidth: the card's copy bandwidth in this run (a device-to-device copy of --copy-gib, CUDA events, best
  of 10); read + written bytes / time.
- layer: one decode step at B x context (--batches x --contexts) from a StaticCache filled by a prefill,
  the cache's length put back before every step. Per-layer time = (step of the --layers model - step of a
  1-layer model) / (layers - 1): the two models are timed in one process, interleaved, so the embedding,
  final norm, lm_head, the launch of a graph and any other per-step cost cancel (subtracting a separately
  timed head would subtract a 1 GB lm_head measured out of context). Bound per layer = (one layer's
  weight bytes + the K/V bytes it reads, 2 x B x (context + 1) x kv_heads x head_dim x 2) / copy
  bandwidth; share of the bound = bound / per-layer time. Variants: eager, converted
  (ops_adv.convert_model), eager+graph, converted+graph (torch.cuda.CUDAGraph), compile-ro,
  compile-ro(converted) (torch.compile mode="reduce-overhead"); graphs and reduce-overhead's graphs on
  CUDA only (on the CPU compile-ro compiles without them).
- generate: model.generate(cache_implementation="static", max_new_tokens=--new-tokens, do_sample=False)
  from a --prompt-token prompt at --gen-batches, with an all-ones mask and with left padding (row i has
  1 + (15 + 37 i) % (prompt / 2 - 1) pad tokens: 16, 53, 90, ... of 512): original, converted, and each with transformers' own compile of the
  forward (generation_config.compile_config, default: CompileConfig(), mode reduce-overhead; without it
  disable_compile=True). tokens/s = B x new tokens / generate's time; ms/step = (time of new tokens -
  time of 1 token) / (new tokens - 1). Greedy agreement: tokens equal to the original's at the same
  position (mean over rows) and the shortest common prefix; compile's own agreement is the floor.

    python benchmarks/decode_step.py --tiny --out DIR                        # CPU smoke (a few minutes)
    python benchmarks/decode_step.py --table table.json --out DIR            # the H200 run
    python benchmarks/decode_step.py --parts generate --gen-batches 1 --out DIR
    python benchmarks/decode_step.py --merge A/decode_step.json B/decode_step.json --out DIR
Writes DIR/decode_step.json and .md after every job, DIR/decode_step.png (share of the bound) at the end.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
# benchmarks/kernels.py would shadow the `kernels` package transformers imports
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "benchmarks"]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import ops_adv  # noqa: E402


def _load_e2e() -> Any:
    spec = importlib.util.spec_from_file_location("e2e_model", ROOT / "benchmarks" / "e2e_model.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["e2e_model"] = mod
    spec.loader.exec_module(mod)
    return mod


e2e = _load_e2e()
log, short_error, time_once, sync = e2e.log, e2e.short_error, e2e.time_once, e2e.sync

PARTS = ("bandwidth", "layer", "generate")
LAYER_VARIANTS = ("eager", "converted", "eager+graph", "converted+graph", "compile-ro", "compile-ro(converted)",
                  "compile-cg(converted)")
# compile-cg: torch.compile's "cudagraphs" backend (AOT graphs captured in CUDA graphs, no Inductor)
GEN_VARIANTS = ("original", "converted", "compile", "compile(converted)", "compile-dynamo(converted)",
                "compile-graphs(converted)", "compile-cg(converted)")
# compile(converted): generate's compile path on a converted model as users get it (ops-adv's decode graphs where
# a table is loaded, else torch.compile); -dynamo: OPS_ADV_GENERATE_GRAPHS=0 (torch.compile); -graphs: =1
MASKS = ("ones", "left-pad")
TARGET_SHARE, TARGET_VS_RO, TARGET_GEN = 0.75, 1.5, 1.5  # issue 21
TARGET_GEN_B1 = 1.3  # issue 28: generate tok/s at B=1 (1.5x at B=8)


# --------------------------------------------------------------------------- child jobs


def build(args: Any, layers: int, dev: torch.device, max_pos: int) -> torch.nn.Module:
    return e2e.build_decoder("llama", argparse.Namespace(size=args.size, layers=layers), dev, e2e.DTYPES[args.dtype], max_pos)


def job_bandwidth(job: dict, args: Any, progress: Any) -> dict:
    """Copy bandwidth: (read + written bytes) / time of a device-to-device copy, best of 10."""
    dev = torch.device(args.device)
    n = int(args.copy_gib * 2**30) // 2
    a = torch.ones(n, dtype=torch.bfloat16, device=dev)
    b = torch.empty_like(a)
    ts = []
    for i in range(13):
        b.copy_(a)  # the first 3: warm-up
        if i >= 3:
            ts.append(time_once(lambda: b.copy_(a), None, dev) / 1e3)
    return {"copy_bytes": 2 * n, "bandwidth_Bps": 2 * 2 * n / min(ts), "median_Bps": 2 * 2 * n / statistics.median(ts)}


def decode_setup(m: torch.nn.Module, B: int, ctx: int, cap: int, dev: torch.device, dtype: torch.dtype, seed: int):
    """A StaticCache of `cap` slots filled by a prefill of `ctx` tokens; (step fn maker, prep that puts the length back)."""
    g = torch.Generator().manual_seed(seed)
    vocab = m.config.vocab_size
    prompt = torch.randint(0, vocab, (B, ctx), generator=g).to(dev)
    tok = torch.randint(0, vocab, (B, 1), generator=g).to(dev)
    cache = e2e.static_cache(m, B, cap, dev, dtype)
    kw = e2e.cache_kwarg(m)
    with torch.no_grad():
        m(prompt, **{kw: cache}, logits_to_keep=1)
    lengths = [layer.cumulative_length for layer in getattr(cache, "layers", []) if hasattr(layer, "cumulative_length")]
    extra = {} if lengths else {"cache_position": torch.tensor([ctx], device=dev)}

    def prep() -> None:
        for n in lengths:
            n.fill_(ctx)

    def step(fwd: Callable) -> Callable[[], torch.Tensor]:
        return lambda: fwd(tok, **{kw: cache}, **extra).logits

    return step, prep


def job_layer(job: dict, args: Any, progress: Any) -> dict:
    dev, dtype = torch.device(args.device), e2e.DTYPES[args.dtype]
    B, ctx, v = job["B"], job["ctx"], job["variant"]
    cap = ctx + args.decode_room
    res: dict[str, Any] = {}
    fns: dict[int, Callable[[], torch.Tensor]] = {}
    preps: dict[int, Callable[[], None]] = {}
    ro = e2e.compile_mode(v) == "reduce-overhead" or v.startswith("compile-cg")
    with torch.no_grad():
        for n in (args.layers, 1):
            progress(event="start", variant=v, phase=f"build {n} layers")
            m = build(args, n, dev, cap + 64)
            if n == args.layers:
                layer = m.model.layers[0]
                c = m.config
                hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
                res["weight_bytes_per_layer"] = sum(p.numel() * p.element_size() for p in layer.parameters())
                res["kv_bytes_per_layer"] = 2 * B * (ctx + 1) * c.num_key_value_heads * hd * torch.finfo(dtype).bits // 8
            step, prep = decode_setup(m, B, ctx, cap, dev, dtype, seed=B * 131 + ctx)  # the cache: filled by the original
            if "converted" in v:
                m = ops_adv.convert_model(m)
            if v.endswith("+graph"):
                progress(event="start", variant=v, phase=f"capture {n} layers")
                fns[n] = e2e.capture(step(m), prep)
            elif v.startswith("compile-cg"):
                fns[n] = step(torch.compile(m, backend="cudagraphs", dynamic=False, fullgraph=args.fullgraph))
            elif ro:
                fns[n] = step(torch.compile(m, mode="reduce-overhead", dynamic=False, fullgraph=args.fullgraph))
            else:
                fns[n] = step(m)
            if ro:  # a new cudagraph-trees step per call (the outputs of the last one are not kept)
                preps[n] = lambda p=prep: (torch.compiler.cudagraph_mark_step_begin(), p())
            else:
                preps[n] = prep
        t0 = time.perf_counter()
        for n, fn in fns.items():
            progress(event="start", variant=v, phase=f"warm-up {n} layers")
            for _ in range(args.warmup):
                preps[n]()
                fn()
        sync(dev)
        res["warmup_s"] = time.perf_counter() - t0
        samples: dict[int, list[float]] = {n: [] for n in fns}
        order = list(fns)
        for r in range(args.rounds):  # interleaved, who goes first rotates
            progress(event="start", variant=v, phase=f"timing round {r}")
            for n in order[r % 2:] + order[:r % 2]:
                samples[n] += [time_once(fns[n], preps[n], dev) for _ in range(args.reps)]
        med = {n: statistics.median(s) for n, s in samples.items()}
        preps[args.layers]()
        top1 = fns[args.layers]()[:, -1].argmax(-1).tolist()
    res.update(step_ms=med[args.layers], step1_ms=med[1], samples=sum(len(s) for s in samples.values()),
               ms_per_layer=(med[args.layers] - med[1]) / (args.layers - 1), top1=top1)
    return res


def left_pad_mask(B: int, S: int, dev: torch.device) -> torch.Tensor:
    mask = torch.ones(B, S, dtype=torch.long, device=dev)
    for i in range(B):
        mask[i, :1 + (15 + 37 * i) % max(1, S // 2 - 1)] = 0  # 1 to S/2 - 1 pad tokens, different per row
    return mask


def job_generate(job: dict, args: Any, progress: Any) -> dict:
    from transformers import CompileConfig

    dev = torch.device(args.device)
    B, v = job["B"], job["variant"]
    S, new = args.prompt_tokens, args.new_tokens
    progress(event="start", variant=v, phase="build")
    m = build(args, args.layers, dev, S + new + 64)
    m.generation_config.eos_token_id = None  # every row makes `new` tokens
    m.generation_config.pad_token_id = 0
    if "graphs" in v or "dynamo" in v:
        os.environ["OPS_ADV_GENERATE_GRAPHS"] = "1" if "graphs" in v else "0"  # this job's own process
    if "converted" in v:
        m = ops_adv.convert_model(m)
    kw: dict[str, Any] = dict(cache_implementation="static", max_new_tokens=new, do_sample=False, pad_token_id=0)
    compiled = v.startswith("compile")
    if v.startswith("compile-cg"):
        kw["compile_config"] = CompileConfig(fullgraph=args.fullgraph, backend="cudagraphs" if dev.type == "cuda" else "eager",
                                             mode=None)
        kw["compile_config"]._compile_all_devices = dev.type != "cuda" or None
    elif compiled and (args.fullgraph or dev.type != "cuda"):  # on CUDA, by default: transformers' own default config
        cc = CompileConfig(fullgraph=args.fullgraph)
        if dev.type != "cuda":
            cc._compile_all_devices = True  # transformers compiles on CUDA-like devices only unless told
        kw["compile_config"] = cc
    elif not compiled:
        kw["disable_compile"] = True
    g = torch.Generator().manual_seed(B * 17 + S)
    ids = torch.randint(1, m.config.vocab_size, (B, S), generator=g).to(dev)
    masks = {"ones": torch.ones(B, S, dtype=torch.long, device=dev), "left-pad": left_pad_mask(B, S, dev)}
    res: dict[str, Any] = {"masks": {}}

    def gen(mask: torch.Tensor, n: int) -> torch.Tensor:
        return m.generate(ids.masked_fill(mask == 0, 0), attention_mask=mask, **dict(kw, max_new_tokens=n))

    def timed(mask: torch.Tensor, n: int) -> tuple[float, torch.Tensor]:
        sync(dev)
        t0 = time.perf_counter()
        out = gen(mask, n)
        sync(dev)
        return time.perf_counter() - t0, out

    with torch.no_grad():
        for name, mask in masks.items():
            progress(event="start", variant=v, phase=f"warm-up {name}")
            t0 = time.perf_counter()
            for _ in range(args.gen_warmup):
                gen(mask, new)  # compiles (and records the graphs) in the first call(s)
            warm = time.perf_counter() - t0
            progress(event="start", variant=v, phase=f"timing {name}")
            full, one, toks = [], [], None
            for _ in range(args.gen_reps):
                t, out = timed(mask, new)
                full.append(t)
                toks = out[:, S:].tolist() if toks is None else toks
                one.append(timed(mask, 1)[0])
            tf, t1 = statistics.median(full), statistics.median(one)
            res["masks"][name] = {"s": tf, "tokens_per_s": B * new / tf, "ms_per_step": (tf - t1) / (new - 1) * 1e3,
                                  "first_token_s": t1, "warmup_s": warm, "tokens": toks}
        runner = m.__dict__.get("_ops_adv_decode_graphs")
        res["decode_graphs"] = None if runner is None else {
            "graphs": sum(e.graph is not None for e in runner.entries.values()),
            "failed": [e.failed for e in runner.entries.values() if e.failed]}
        # generate really compiled the forward, or ran ops-adv's decode graphs (or did neither)
        res["compiled"] = hasattr(m, "_compiled_call") or bool(res["decode_graphs"] and res["decode_graphs"]["graphs"])
        from torch._dynamo.utils import counters  # graphs compiled (1 per decode shape; more is a recompile) and breaks

        res["dynamo_graphs"] = counters["stats"].get("unique_graphs", 0)
        res["graph_breaks"] = sum(counters["graph_break"].values())
        cc = getattr(m, "_last_compile_config", None)
        res["compile_config"] = cc.to_dict() if res["compiled"] and hasattr(cc, "to_dict") else None
        if v == "converted":  # which implementation each op ran in a short generate, per mask
            res["implementations"] = {}
            for name, mask in masks.items():
                progress(event="start", variant=v, phase=f"profile {name}")
                with ops_adv.profiler.ProfileContext() as prof:
                    gen(mask, 3)
                ops: dict[str, int] = {}
                for c in prof.calls:
                    k = f"{c['op']}:{c['impl']}"
                    ops[k] = ops.get(k, 0) + 1
                res["implementations"][name] = ops
    return res


JOBS = {"bandwidth": job_bandwidth, "layer": job_layer, "generate": job_generate}


def child_main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    e2e.arm_stack_dump(spec)
    args = argparse.Namespace(**spec["args"])
    e2e.limit_recompiles()
    torch.manual_seed(0)
    job = spec["job"]
    res = JOBS[job["part"]](job, args, e2e.Progress(spec["progress"]))
    if args.device.startswith("cuda"):
        res["max_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    tmp = spec["result"] + ".tmp"
    Path(tmp).write_text(json.dumps(res))
    os.replace(tmp, spec["result"])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no teardown: a broken CUDA context or a Triton thread cannot hang the exit


# --------------------------------------------------------------------------- parent


def plan(args: Any) -> list[dict]:
    jobs: list[dict] = []
    if "bandwidth" in args.parts:
        jobs.append({"part": "bandwidth", "case": "copy bandwidth", "variant": "-"})
    if "layer" in args.parts:
        jobs += [{"part": "layer", "B": B, "ctx": ctx, "case": f"B={B} ctx={ctx}", "variant": v}
                 for ctx in args.contexts for B in args.batches for v in args.layer_variants]
    if "generate" in args.parts:
        jobs += [{"part": "generate", "B": B, "case": f"generate B={B}", "variant": v}
                 for B in args.gen_batches for v in args.gen_variants]
    return jobs


def run_job(job: dict, args: Any, work: Path, deadline: float | None) -> dict:
    row = dict(job)
    if args.in_process:
        try:
            row.update(JOBS[job["part"]](job, args, e2e.Progress(None)))
        except Exception as e:  # noqa: BLE001
            row["error"] = short_error(e)
        return row
    limit = args.case_timeout if deadline is None else min(args.case_timeout, deadline - time.monotonic())
    if limit < 20:
        row["error"] = "not run: no time left before the deadline"
        return row
    key = "".join(ch if ch.isalnum() else "-" for ch in f"{job['part']}-{job['case']}-{job['variant']}")
    progress, result = work / f"{key}.progress", work / f"{key}.json"
    spec = {"args": vars(args), "job": job, "progress": str(progress), "result": str(result)}
    log(f"{job['part']} {job['case']} {job['variant']} (limit {limit:.0f} s)")
    t0 = time.monotonic()
    rc, tail = e2e.Child.run(spec, limit, script=str(Path(__file__).resolve()))
    row["seconds"] = round(time.monotonic() - t0, 1)
    if rc == 0 and result.exists():
        row.update(json.loads(result.read_text()))
        return row
    _, phase, err = e2e.last_running(progress)
    errline = next((ln.strip()[:240] for ln in reversed(tail) if "Error" in ln or "error:" in ln), "")
    how = f"timed out after {limit:.0f} s" if rc is None else f"process exited with {rc}"
    if rc is None and e2e.hung_at(tail):
        how += f", in {e2e.hung_at(tail)}"
    row["error"] = (f"{phase}: " if phase else "") + (err or (f"{how}: {errline}" if errline else how))
    log(f"  failed: {row['error']}")
    return row


def summarise(rows: list[dict]) -> tuple[list[dict], float | None]:
    """Bounds, shares, ratios and token agreement from the rows (in place); the targets of issue 21."""
    bw = next((r["bandwidth_Bps"] for r in rows if r["part"] == "bandwidth" and "bandwidth_Bps" in r), None)
    layer = {(r["case"], r["variant"]): r for r in rows if r["part"] == "layer" and "ms_per_layer" in r}
    for (case, v), r in layer.items():
        if bw:
            r["bound_ms"] = (r["weight_bytes_per_layer"] + r["kv_bytes_per_layer"]) / bw * 1e3
            r["share"] = r["bound_ms"] / r["ms_per_layer"] if r["ms_per_layer"] > 0 else None
        ro = layer.get((case, "compile-ro"))
        r["vs_ro"] = ro["ms_per_layer"] / r["ms_per_layer"] if ro and r["ms_per_layer"] > 0 else None
        ref = layer.get((case, "eager"))
        if ref and r.get("top1"):
            r["top1_vs_eager"] = sum(a == b for a, b in zip(ref["top1"], r["top1"])) / len(r["top1"])
    gen = {(r["case"], r["variant"]): r for r in rows if r["part"] == "generate" and "masks" in r}
    for (case, v), r in gen.items():
        ref, comp = gen.get((case, "original")), gen.get((case, "compile"))
        for mk, d in r["masks"].items():
            if ref and mk in ref["masks"]:
                pairs = list(zip(ref["masks"][mk]["tokens"], d["tokens"]))
                d["agree"] = statistics.mean(sum(a == b for a, b in zip(x, y)) for x, y in pairs)
                d["prefix"] = min(next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in pairs)
            if comp and mk in comp["masks"]:
                d["vs_compile"] = d["tokens_per_s"] / comp["masks"][mk]["tokens_per_s"]
    targets = []
    ours = ("converted", "converted+graph", "compile-ro(converted)", "compile-cg(converted)")
    for case in dict.fromkeys(c for c, _ in layer):
        got = [layer[(case, v)] for v in ours if (case, v) in layer]
        best = min(got, key=lambda r: r["ms_per_layer"], default=None)
        if best is None:
            continue
        if best.get("share") is not None:
            targets.append({"target": f">= {TARGET_SHARE:.0%} of the HBM bound per layer (best ops-adv variant)", "case": case,
                            "variant": best["variant"], "value": best["share"], "pass": best["share"] >= TARGET_SHARE})
        if best.get("vs_ro") is not None:
            targets.append({"target": f">= {TARGET_VS_RO}x compile-ro per layer", "case": case, "variant": best["variant"],
                            "value": best["vs_ro"], "pass": best["vs_ro"] >= TARGET_VS_RO})
    for (case, v), r in gen.items():
        floor = gen.get((case, "compile"))
        for mk, d in r["masks"].items():
            if "converted" in v and d.get("agree") is not None and floor and floor["masks"].get(mk, {}).get("agree") is not None:
                f = floor["masks"][mk]["agree"]
                targets.append({"target": "greedy tokens agree with the original's at least as compile's own do",
                                "case": f"{case} {mk}", "variant": v, "value": d["agree"], "floor": f, "pass": d["agree"] >= f})
        if v in ("converted", "compile(converted)", "compile-dynamo(converted)", "compile-graphs(converted)", "compile-cg(converted)"):
            want = TARGET_GEN_B1 if r.get("B") == 1 else TARGET_GEN
            for mk, d in r["masks"].items():
                if d.get("vs_compile") is not None:
                    targets.append({"target": f"generate tok/s >= {want}x compiled original", "case": f"{case} {mk}",
                                    "variant": v, "value": d["vs_compile"], "pass": d["vs_compile"] >= want})
                if floor and mk in floor["masks"] and d.get("first_token_s"):
                    ttft = floor["masks"][mk]["first_token_s"] / d["first_token_s"]
                    d["ttft_vs_compile"] = ttft
                    targets.append({"target": "time to first token >= 1.0x the compiled original's", "case": f"{case} {mk}",
                                    "variant": v, "value": ttft, "pass": ttft >= 1.0})
    return targets, bw


def fmt(x: Any, f: str) -> str:
    return f.format(x) if x is not None else "-"


def markdown(info: dict, rows: list[dict]) -> str:
    targets, bw = summarise(rows)
    out = [f"# Decode step against the HBM bound: {info['device']}", "",
           ", ".join(f"{k}={v}" for k, v in info.items() if k != "device"), "",
           f"Copy bandwidth {fmt(bw and bw / 1e12, '{:.2f}')} TB/s (read + written bytes / time of a device-to-device copy, best "
           "of 10). Layer rows (one decode step at B x context): ms = the step of the whole model; ms/layer = (that - the "
           "step of a 1-layer model) / (layers - 1); bound = (one layer's weights + the K/V it reads) / copy bandwidth; "
           "share = bound / ms/layer; xRO = compile-ro's ms/layer / this one's; top-1: the step's argmax against eager. "
           "Generate rows: ms = per decode step, tok/s = B x new tokens / generate's time, xRO = tok/s against the "
           "original's generate with transformers' compile (reduce-overhead); agree = tokens equal to the original's "
           "of each row's new tokens (mean), prefix = shortest common prefix; compile's own is the floor.", "",
           "| case | variant | ms | ms/layer | bound ms | share of bound | xRO | tok/s | agree (prefix) / top-1 | note |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        note = f"failed: {r['error']}".replace("|", "/") if r.get("error") else ""
        if r["part"] == "bandwidth":
            if note:
                out.append(f"| {r['case']} | - | | | | | | | | {note} |")
            continue
        if r["part"] == "layer":
            out.append(f"| {r['case']} | {r['variant']} | {fmt(r.get('step_ms'), '{:.3f}')} | {fmt(r.get('ms_per_layer'), '{:.4f}')} | "
                       f"{fmt(r.get('bound_ms'), '{:.4f}')} | {fmt(r.get('share'), '{:.1%}')} | {fmt(r.get('vs_ro'), '{:.2f}')} | | "
                       f"{fmt(r.get('top1_vs_eager'), 'top-1 {:.0%}')} | {note} |")
            continue
        if "masks" not in r:
            out.append(f"| {r['case']} | {r['variant']} | | | | | | | | {note} |")
            continue
        for mk, d in r["masks"].items():
            agree = f"{d['agree']:.1f} ({d['prefix']}) / {len(d['tokens'][0])}" if "agree" in d else "-"
            extra = "" if r.get("compiled") == r["variant"].startswith("compile") else \
                f"generate {'compiled' if r.get('compiled') else 'did not compile'} the forward"
            if r.get("decode_graphs"):
                dg = r["decode_graphs"]
                extra = (extra + "; " if extra else "") + f"ops-adv decode graphs {dg['graphs']}" + \
                    (f", capture failed: {dg['failed'][0]}" if dg["failed"] else "")
            if r.get("compiled"):
                extra = (extra + "; " if extra else "") + f"{r.get('dynamo_graphs')} graphs, {r.get('graph_breaks')} breaks, " \
                    f"TTFT {d.get('first_token_s', 0) * 1e3:.0f} ms" + (f" ({d['ttft_vs_compile']:.2f}x)" if d.get("ttft_vs_compile") else "")
            out.append(f"| {r['case']} {mk} | {r['variant']} | {d['ms_per_step']:.3f} | | | | {fmt(d.get('vs_compile'), '{:.2f}')} | "
                       f"{d['tokens_per_s']:.0f} | {agree} | {extra or note} |")
    passed = sum(t["pass"] for t in targets)
    out += ["", f"Targets (issues 21, 28): {passed} PASS, {len(targets) - passed} MISS", ""]
    out += [f"- {'PASS' if t['pass'] else 'MISS'} {t['target']} — {t['case']}, {t['variant']}: "
            + (f"{t['value']:.1%}" if "bound" in t["target"] else f"{t['value']:.1f} tokens (floor {t['floor']:.1f})"
               if "floor" in t else f"{t['value']:.2f}x") for t in targets]
    imps = [(r["case"], mk, ops) for r in rows for mk, ops in (r.get("implementations") or {}).items()]
    if imps:
        out += ["", "Ops in a short converted generate (op:implementation x calls):", ""]
        out += [f"- {case} {mk}: " + (", ".join(f"{k} x{n}" for k, n in ops.items()) or "no ops_adv op calls") for case, mk, ops in imps]
    return "\n".join(out) + "\n"


def plot(rows: list[dict], path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    layer = [r for r in rows if r["part"] == "layer" and r.get("share") is not None]
    cases = list(dict.fromkeys(r["case"] for r in layer))
    names = list(dict.fromkeys(r["variant"] for r in layer))
    if not cases:
        return "no share of the bound to plot"
    fig, ax = plt.subplots(figsize=(max(7, 1.6 * len(cases)), 4.2))
    w = 0.8 / len(names)
    for i, v in enumerate(names):
        pts = [(j, r["share"]) for j, c in enumerate(cases) for r in layer if r["case"] == c and r["variant"] == v]
        ax.bar([j + i * w for j, _ in pts], [100 * s for _, s in pts], w, label=v)
    ax.axhline(100 * TARGET_SHARE, color="k", lw=0.8, ls="--", label=f"target {TARGET_SHARE:.0%}")
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(cases))])
    ax.set_xticklabels(cases)
    ax.set_ylabel("share of the HBM bound per layer (%)")
    ax.set_title("decode step per layer: bound / time (higher is better)", fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"


def write(out: Path | None, info: dict, rows: list[dict], final: bool = True) -> None:
    md = markdown(info, rows)  # also fills in bounds and shares
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / "decode_step.json.tmp"
        tmp.write_text(json.dumps({"info": info, "rows": rows}, indent=1))
        os.replace(tmp, out / "decode_step.json")
        (out / "decode_step.md").write_text(md)
    if final:
        print(md)
        if out is not None:
            log(plot(rows, out / "decode_step.png"))


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny dims, 2 layers, short prompt and contexts: a CPU smoke run")
    ap.add_argument("--layers", type=int, help="decoder layers, at least 2 (default 4; --tiny 2)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated: {', '.join(PARTS)} (default: all)")
    ap.add_argument("--batches", help="layer part: batch sizes (default 1,8; --tiny 1)")
    ap.add_argument("--contexts", help="layer part: context lengths (default 1024,8192; --tiny 16)")
    ap.add_argument("--layer-variants", help=f"default: {', '.join(LAYER_VARIANTS)} (graphs on CUDA only)")
    ap.add_argument("--gen-batches", help="generate part: batch sizes (default 1,8; --tiny 2)")
    ap.add_argument("--gen-variants", help=f"default: {', '.join(GEN_VARIANTS)}")
    ap.add_argument("--prompt-tokens", type=int, help="generate: prompt length (default 512; --tiny 16)")
    ap.add_argument("--new-tokens", type=int, help="generate: new tokens (default 128; --tiny 8)")
    ap.add_argument("--decode-room", type=int, help="layer part: static cache slots beyond the context (default 128; --tiny 8)")
    ap.add_argument("--copy-gib", type=float, help="bandwidth: GiB copied (default 2; CPU 0.25)")
    ap.add_argument("--rounds", type=int, help="layer: interleaved rounds (default 7; CPU 2)")
    ap.add_argument("--reps", type=int, help="layer: steps timed per model per round (default 10; CPU 2)")
    ap.add_argument("--warmup", type=int, default=3, help="layer: untimed steps per model (compiles and captures)")
    ap.add_argument("--gen-reps", type=int, help="generate: timed calls per mask (default 3; CPU 1)")
    ap.add_argument("--gen-warmup", type=int, help="generate: untimed calls per mask (default 2; CPU 1)")
    ap.add_argument("--fullgraph", action="store_true", help="compile with fullgraph=True (a graph break fails the variant)")
    ap.add_argument("--table", help="tuned table for ops_adv (default: OPS_ADV_TABLE)")
    ap.add_argument("--case-timeout", type=float, help="seconds a job's process may run (default 180 on CUDA, 600 on the CPU)")
    ap.add_argument("--deadline-s", type=float, help="start no job after this many seconds; cut the running one there")
    ap.add_argument("--in-process", action="store_true", help="run the jobs in this process (debugging)")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="one report from decode_step.json files of split runs")
    ap.add_argument("--out", help="folder for decode_step.json, .md (rewritten after every job) and .png")
    args = ap.parse_args(argv)
    if args.merge:
        if not args.out:
            ap.error("--merge needs --out")
        return args
    gpu = args.device.startswith("cuda")
    if gpu and not torch.cuda.is_available():
        ap.error("--device cuda but torch sees no GPU: pass --device cpu (and --tiny for a smoke run)")
    if args.table:
        if not Path(args.table).is_file():
            ap.error(f"--table {args.table}: no such file")
        os.environ["OPS_ADV_TABLE"] = str(Path(args.table).resolve())  # the children inherit it
    tiny = args.tiny
    ints = lambda s: [int(x) for x in s.split(",") if x.strip()]  # noqa: E731
    try:
        args.batches = ints(args.batches or ("1" if tiny else "1,8"))
        args.contexts = ints(args.contexts or ("16" if tiny else "1024,8192"))
        args.gen_batches = ints(args.gen_batches or ("2" if tiny else "1,8"))
    except ValueError:
        ap.error("--batches, --contexts and --gen-batches take comma-separated integers")
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if set(args.parts) - set(PARTS):
        ap.error(f"--parts: unknown {sorted(set(args.parts) - set(PARTS))}; choose from {', '.join(PARTS)}")
    if "layer" in args.parts and "bandwidth" not in args.parts:
        log("layer part without the bandwidth part: no bound, no share (merge with a run that measured it)")
    args.layer_variants = [v.strip() for v in (args.layer_variants or ",".join(LAYER_VARIANTS)).split(",") if v.strip()]
    args.gen_variants = [v.strip() for v in (args.gen_variants or ",".join(GEN_VARIANTS)).split(",") if v.strip()]
    for given, known, flag in ((args.layer_variants, LAYER_VARIANTS, "--layer-variants"), (args.gen_variants, GEN_VARIANTS, "--gen-variants")):
        if set(given) - set(known):
            ap.error(f"{flag}: unknown {sorted(set(given) - set(known))}; choose from {', '.join(known)}")
    if not gpu:
        args.layer_variants = [v for v in args.layer_variants if not v.endswith("+graph")]  # CUDA graphs: CUDA only
    args.dtype = "bf16" if gpu else "fp32"
    args.size = "tiny" if tiny else "8b"
    args.layers = args.layers or (2 if tiny else 4)
    if args.layers < 2:
        ap.error("--layers must be at least 2 (per-layer time is the difference to a 1-layer model)")
    args.prompt_tokens = args.prompt_tokens or (16 if tiny else 512)
    args.new_tokens = args.new_tokens or (8 if tiny else 128)
    if args.new_tokens < 2:
        ap.error("--new-tokens must be at least 2")
    args.decode_room = args.decode_room if args.decode_room is not None else (8 if tiny else 128)
    args.copy_gib = args.copy_gib or (2.0 if gpu else 0.25)
    args.rounds = args.rounds or (7 if gpu else 2)
    args.reps = args.reps or (10 if gpu else 2)
    args.gen_reps = args.gen_reps or (3 if gpu else 1)
    args.gen_warmup = args.gen_warmup or (2 if gpu else 1)
    args.case_timeout = args.case_timeout or (180.0 if gpu else 600.0)
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child_main(argv[1])
    args = parse(argv)
    if args.merge:
        try:
            parts = [json.loads(Path(p).read_text()) for p in args.merge]
        except (OSError, ValueError) as e:
            print(f"decode_step: cannot read {e}", file=sys.stderr)
            return 2
        write(Path(args.out), dict(parts[0]["info"], merged=len(parts)), [r for p in parts for r in p["rows"]])
        return 0
    dev = torch.device(args.device)
    info = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or platform.machine(),
            "torch": torch.__version__, "transformers": __import__("transformers").__version__, "dtype": args.dtype,
            "size": args.size, "layers": args.layers, "rounds": args.rounds, "reps": args.reps,
            "prompt": args.prompt_tokens, "new_tokens": args.new_tokens, "table": os.environ.get("OPS_ADV_TABLE"),
            "fullgraph": args.fullgraph, "isolated": not args.in_process}
    jobs = plan(args)
    log(f"{len(jobs)} jobs: {', '.join(args.parts)}")
    out = Path(args.out) if args.out else None
    deadline = time.monotonic() + args.deadline_s if args.deadline_s else None
    rows: list[dict] = []

    def on_term(*_: Any) -> None:  # `timeout` ends a run with SIGTERM: stop the child, report the jobs done
        if e2e.Child.current is not None:
            e2e.Child.stop(e2e.Child.current)
        sys.exit(124)

    signal.signal(signal.SIGTERM, on_term)
    try:
        with tempfile.TemporaryDirectory(prefix="decode-step-") as work:
            for job in jobs:
                rows.append(run_job(job, args, Path(work), deadline))
                info["seconds"] = round(time.perf_counter() - e2e.T0, 1)
                write(out, dict(info, partial=True), rows, final=False)
    except BaseException as e:  # SIGTERM (SystemExit), ^C or an error: the report says the run was cut short
        info["stopped"] = short_error(e)
        raise
    finally:
        info["seconds"] = round(time.perf_counter() - e2e.T0, 1)
        write(out, info, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
