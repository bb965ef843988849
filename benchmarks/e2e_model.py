#!/usr/bin/env python
"""End to end: models as their users run them, eager, converted, compiled and compiled-converted.

Models are built from configs with random weights (nothing is downloaded):
- llama-prefill / llama-decode: transformers' LlamaForCausalLM with a Llama-3-8B config (hidden 4096,
  intermediate 14336, 32/8 heads, head 128, vocab 128256), --layers of them (default 4). Prefill:
  the prompt's logits at B x S. Decode: a StaticCache (capacity = context + --decode-room) filled by a
  prefill of the context, then ONE decode step (a token per sequence) is timed, the cache's length
  put back before every step;
- qwen: Qwen2ForCausalLM with a Qwen2-7B config (3584, 18944, 28/4 heads, q/k/v bias): one prefill and
  one decode case, to show the path is not Llama-only;
- resnet: torchvision's ResNet-50, inference with NCHW and channels_last callers, and a training step
  (forward, backward, SGD) with the gradients' relative error of converted against eager.

Variants: eager, converted (ops_adv.convert_model), compile (torch.compile(model)), compile(converted).
Decode steps run under CUDA graphs wherever they can: compiled variants use mode="reduce-overhead",
and the eager variants are also captured in a torch.cuda.CUDAGraph ("eager+graph", "converted+graph").
Prefill and ResNet are compute-bound and compile with the default mode. Variants run in interleaved
rounds after warm-up (compilation included in warm-up); each case reports medians, speed against eager
and against compile, KL(eager || variant) of the float32 softmax and top-1 agreement, and the
implementation each op ran (ops_adv.profiler, one eager pass of the converted model).

    python benchmarks/e2e_model.py --device cpu --out DIR            # small shapes, a smoke run
    OPS_ADV_TABLE=table.json python benchmarks/e2e_model.py --out DIR  # the H200 run (~8 min)
    python benchmarks/e2e_model.py --cases llama-decode --out DIR     # one group of cases
    python benchmarks/e2e_model.py --merge A/e2e.json B/e2e.json --out DIR   # one report from split runs
"""
from __future__ import annotations

import argparse
import copy
import inspect
import json
import os
import platform
import signal
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
# benchmarks/kernels.py would shadow the `kernels` package transformers imports
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "benchmarks"]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import ops_adv  # noqa: E402
from ops_adv import _convert  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
GROUPS = ("llama-prefill", "llama-decode", "qwen", "resnet")
VARIANTS = ("eager", "converted", "compile", "compile(converted)")
# hidden, intermediate, heads, kv heads, vocab, qkv bias
SHAPES = {
    "llama": {"8b": (4096, 14336, 32, 8, 128256, False), "small": (256, 688, 8, 2, 2048, False)},
    "qwen": {"8b": (3584, 18944, 28, 4, 152064, True), "small": (224, 512, 7, 1, 2048, True)},
}
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.perf_counter() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_once(fn: Callable[[], Any], prep: Callable[[], Any] | None, dev: torch.device) -> float:
    """ms of one call, from an idle device to its end (launch time included)."""
    if prep is not None:
        prep()
    sync(dev)
    if dev.type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def compare(ref: torch.Tensor, out: torch.Tensor) -> dict:
    """KL(ref || out) of the float32 softmax, mean over positions, and top-1 agreement (chunked)."""
    ref, out = ref.reshape(-1, ref.shape[-1]), out.reshape(-1, out.shape[-1])
    kl_sum, agree = 0.0, 0
    for i in range(0, ref.shape[0], 512):
        p = torch.log_softmax(ref[i:i + 512].float(), -1)
        q = torch.log_softmax(out[i:i + 512].float(), -1)
        kl_sum += float((p.exp() * (p - q)).sum(-1).sum())
        agree += int((p.argmax(-1) == q.argmax(-1)).sum())
    n = ref.shape[0]
    return {"kl": max(0.0, kl_sum / n), "top1": agree / n, "positions": n}  # max: float error around 0


def limit_recompiles() -> None:
    # Every case is a new static shape of the same forward: let each keep its own compiled graph.
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 512)
    if hasattr(torch._dynamo.config, "accumulated_cache_size_limit"):
        torch._dynamo.config.accumulated_cache_size_limit = 4096
    if hasattr(torch._dynamo.config, "accumulated_recompile_limit"):
        torch._dynamo.config.accumulated_recompile_limit = 4096


class Models:
    """One model's variants; compiled forwards are made per compile mode on first use."""

    def __init__(self, model: torch.nn.Module, variants: list[str]) -> None:
        self.variants = variants
        self.base = {"eager": model}
        if any("converted" in v for v in variants):
            self.base["converted"] = ops_adv.convert_model(copy.deepcopy(model))
        self._compiled: dict[tuple[str, str], Callable] = {}
        self._copies: dict[str, torch.nn.Module] = {}

    def get(self, v: str, mode: str | None) -> Callable:
        if not v.startswith("compile"):
            return self.base[v]
        key = (v, mode or "default")
        if key not in self._compiled:
            src = "converted" if "converted" in v else "eager"
            m = self._copies.get(src)
            if m is None:  # a copy of its own: compiling must not change the eager variants
                m = self._copies[src] = copy.deepcopy(self.base[src])
            self._compiled[key] = torch.compile(m, mode=mode, dynamic=False)  # hooks included
        return self._compiled[key]


def run_variants(case: str, fns: dict[str, Callable[[], Any]], prep: Callable[[], Any] | None, dev: torch.device,
                 rounds: int, reps: int, warmup: int, errors: dict[str, str] | None = None) -> dict[str, list[float]]:
    """Warm-up (compiles) then interleaved rounds. A variant other than eager that fails its warm-up is
    dropped from `fns` and its error put in `errors`: one broken variant must not end the run."""
    for v, fn in list(fns.items()):
        t0 = time.perf_counter()
        try:
            for _ in range(warmup):
                if prep is not None:
                    prep()
                fn()
            sync(dev)
        except Exception as e:
            if v == "eager" or errors is None:
                raise
            errors[v] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            log(f"  {case} {v}: failed in warm-up: {errors[v]}")
            del fns[v]
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            continue
        log(f"  {case} {v}: warm-up {time.perf_counter() - t0:.1f} s")
    samples: dict[str, list[float]] = {v: [] for v in fns}
    order = list(fns)
    for r in range(rounds):
        for v in order[r % len(order):] + order[:r % len(order)]:  # rotate who goes first
            samples[v] += [time_once(fns[v], prep, dev) for _ in range(reps)]
    return samples


def summarise(case: dict, samples: dict[str, list[float]], outs: dict[str, torch.Tensor | None]) -> dict:
    base = statistics.median(samples["eager"]) if "eager" in samples else None
    comp = {"compile": statistics.median(samples["compile"])} if "compile" in samples else {}
    rows = {}
    for v, s in samples.items():
        med = statistics.median(s)
        ref_c = comp.get("compile")
        row = {"ms": med, "min_ms": min(s), "n": len(s), "vs_eager": base / med if base else None,
               "vs_compile": ref_c / med if ref_c else None}
        if "eager" in outs and outs.get(v) is not None and outs["eager"] is not None:
            row.update(compare(outs["eager"], outs[v]))
        if case.get("layers"):
            hm, k = case.get("head_ms") or {}, head_of(v)
            head = hm.get(k, hm.get(k.replace("+graph", ""), 0.0))
            row["ms_per_layer"] = (med - head) / case["layers"]
        rows[v] = row
    case["variants"] = rows
    return case


def head_of(v: str) -> str:
    """Which head-only measurement a variant's per-layer time subtracts (compiled decode: the graphed one)."""
    fam = "converted" if "converted" in v else "eager"
    graphed = v.endswith("+graph") or v.startswith("compile")
    return fam + "+graph" if graphed else fam


def head_times(models: Models, ids: torch.Tensor, dev: torch.device, reps: int) -> dict[str, float]:
    """ms of the part outside the decoder layers (embedding, final norm, lm_head) per eager/converted model,
    also under a CUDA graph on CUDA; per-layer times subtract it."""
    out = {}
    for fam, m in models.base.items():
        inner = m.model

        def head(m=m, inner=inner) -> torch.Tensor:
            return m.lm_head(inner.norm(inner.embed_tokens(ids)))

        fns = {fam: head}
        if dev.type == "cuda":
            try:
                fns[fam + "+graph"] = capture(head, lambda: None)
            except Exception as e:  # noqa: BLE001 - reported, the ungraphed time stays
                log(f"  head {fam}: capture failed ({type(e).__name__})")
        for k, fn in fns.items():
            fn()
            out[k] = statistics.median(time_once(fn, None, dev) for _ in range(reps))
    return out


def profile_converted(call: Callable[[], Any], prep: Callable[[], Any] | None) -> dict:
    """Which implementation each op ran (one eager pass of the converted model) and where attention went."""
    from ops_adv.profiler import ProfileContext

    _convert.ROUTE_LOG = routes = []
    try:
        with ProfileContext() as prof:
            if prep is not None:
                prep()
            call()
    finally:
        _convert.ROUTE_LOG = None
    ops = Counter((c["op"], c["impl"], c["source"]) for c in prof.calls)
    return {"ops": [{"op": o, "impl": i, "source": s, "calls": n} for (o, i, s), n in sorted(ops.items())],
            "attention_routes": dict(Counter(routes))}


def explain_summary(model: torch.nn.Module) -> dict:
    rep = ops_adv.explain_model(model)
    return {"converted": dict(Counter(r["type"] for r in rep if r["converted"] == "yes")),
            "not_converted": sorted({f"{r['type']}: {r['why']}" for r in rep if r["converted"] != "yes"})[:10]}


# --------------------------------------------------------------------------- decoders


def build_decoder(family: str, args: Any, dev: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    import transformers

    hidden, inter, heads, kv, vocab, bias = SHAPES[family][args.size]
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=args.layers,
                  num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=max(args.contexts) + 4096)
    if family == "llama":
        cfg = transformers.LlamaConfig(**common, rms_norm_eps=1e-5, attn_implementation="sdpa")
        cls = transformers.LlamaForCausalLM
    else:
        cfg = transformers.Qwen2Config(**common, rms_norm_eps=1e-6, use_sliding_window=False, attn_implementation="sdpa")
        cls = transformers.Qwen2ForCausalLM
    torch.manual_seed(0)
    with torch.device(dev):
        model = cls(cfg)
    return model.to(dtype).eval()


def cache_kwarg(model: torch.nn.Module) -> str:
    inner = getattr(model, "model", model)
    return "cache" if "cache" in inspect.signature(inner.forward).parameters else "past_key_values"


def static_cache(model: torch.nn.Module, batch: int, capacity: int, dev: torch.device, dtype: torch.dtype):
    from transformers import StaticCache

    params = inspect.signature(StaticCache.__init__).parameters
    if "max_batch_size" in params:  # transformers 4.x
        return StaticCache(config=model.config, max_batch_size=batch, max_cache_len=capacity, device=dev, dtype=dtype)
    return StaticCache(config=model.config, max_cache_len=capacity)


def prefill_case(family: str, models: Models, B: int, S: int, args: Any, dev: torch.device) -> dict:
    vocab = models.base["eager"].config.vocab_size
    ids = torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(B * 7919 + S)).to(dev)
    fns = {v: (lambda m=models.get(v, None): m(ids).logits) for v in models.variants}
    case = {"group": f"{family}-prefill", "case": f"{family} prefill B={B} S={S}", "family": family, "kind": "prefill",
            "B": B, "S": S, "layers": args.layers, "graphs": {v: False for v in fns}}
    case["graph_errors"] = {}
    samples = run_variants(case["case"], fns, None, dev, args.rounds, 1, 2, case["graph_errors"])
    case["head_ms"] = head_times(models, ids, dev, 3)
    outs = {v: fn().float().cpu() if dev.type == "cpu" else fn().clone() for v, fn in fns.items()}
    summarise(case, samples, outs)
    if "converted" in models.base:
        case["implementations"] = profile_converted(lambda: models.base["converted"](ids), None)
    return case


def decode_case(family: str, models: Models, B: int, ctx: int, args: Any, dev: torch.device, dtype: torch.dtype) -> dict:
    eager = models.base["eager"]
    vocab = eager.config.vocab_size
    g = torch.Generator().manual_seed(B * 131 + ctx)
    prompt = torch.randint(0, vocab, (B, ctx), generator=g).to(dev)
    tok = torch.randint(0, vocab, (B, 1), generator=g).to(dev)
    capacity = ctx + args.decode_room
    cache = static_cache(eager, B, capacity, dev, dtype)
    kw = cache_kwarg(eager)
    t0 = time.perf_counter()
    eager(prompt, **{kw: cache}, **({"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(eager.forward).parameters else {}))
    sync(dev)
    log(f"  {family} decode B={B} ctx={ctx}: cache filled by a prefill in {time.perf_counter() - t0:.1f} s")
    extra: dict[str, Any] = {}
    lengths = [layer.cumulative_length for layer in getattr(cache, "layers", []) if hasattr(layer, "cumulative_length")]
    if not lengths:  # transformers 4.x: the write position is an argument
        extra["cache_position"] = torch.tensor([ctx], device=dev)

    def prep() -> None:  # every timed step decodes token ctx+1 into the same slot
        for n in lengths:
            n.fill_(ctx)

    def step(m: Callable) -> Callable[[], torch.Tensor]:
        return lambda: m(tok, **{kw: cache}, **extra).logits

    fns = {v: step(models.get(v, "reduce-overhead" if dev.type == "cuda" else None)) for v in models.variants}
    graphs = {v: v.startswith("compile") and dev.type == "cuda" for v in fns}
    errors = {}
    if dev.type == "cuda" and args.graphs:
        for v in [v for v in models.variants if not v.startswith("compile")]:
            try:
                fns[f"{v}+graph"] = capture(step(models.base[v]), prep)
                graphs[f"{v}+graph"] = True
            except Exception as e:  # not capturable: reported, the eager variant stays
                errors[f"{v}+graph"] = f"{type(e).__name__}: {str(e)[:200]}"
                log(f"  {v}+graph: capture failed: {errors[f'{v}+graph']}")
                torch.cuda.synchronize()
    case = {"group": f"{family}-decode", "case": f"{family} decode B={B} ctx={ctx}", "family": family, "kind": "decode",
            "B": B, "ctx": ctx, "capacity": capacity, "layers": args.layers, "graphs": graphs, "graph_errors": errors}
    skips = cudagraph_skips()
    samples = run_variants(case["case"], fns, prep, dev, args.rounds, args.reps, 3, errors)
    case["head_ms"] = head_times(models, tok, dev, 10)
    if cudagraph_skips() > skips:  # inductor fell back to no graphs for some compiled graph: say so
        case["graph_errors"]["compiled"] = "inductor skipped CUDA graphs for a graph (see the log's 'skipping cudagraphs')"
        for v in fns:
            if v.startswith("compile"):
                graphs[v] = False
    outs = {}
    for v, fn in fns.items():
        prep()
        outs[v] = fn().float().clone()
    summarise(case, samples, outs)
    if "converted" in models.base:
        case["implementations"] = profile_converted(step(models.base["converted"]), prep)
    del fns, cache
    return case


def cudagraph_skips() -> int:
    try:
        from torch._dynamo.utils import counters

        return int(sum(counters["inductor"].get(k, 0) for k in ("cudagraph_skips",)))
    except Exception:
        return 0


def capture(fn: Callable[[], torch.Tensor], prep: Callable[[], Any]) -> Callable[[], torch.Tensor]:
    """fn captured in a CUDA graph (warmed up on a side stream first); replay returns the graph's output."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            prep()
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    prep()
    with torch.cuda.graph(graph):
        out = fn()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    replay.graph = graph  # keep it alive
    return replay


def decoder_cases(family: str, args: Any, dev: torch.device, dtype: torch.dtype, groups: set[str],
                  done: Callable[[dict], None]) -> None:
    """Runs the family's cases, handing each to `done` as it ends (a killed run keeps the finished ones)."""
    log(f"build {family} ({args.size}, {args.layers} layers, {dtype})")
    models = Models(build_decoder(family, args, dev, dtype), args.variants)
    explain = explain_summary(models.base["converted"]) if "converted" in models.base else None

    def add(row: dict) -> None:
        if explain is not None:
            row["explain"] = explain
        done(row)

    with torch.no_grad():
        if family == "llama":
            if "llama-prefill" in groups:
                for B, S in args.prefill:
                    add(prefill_case(family, models, B, S, args, dev))
            if "llama-decode" in groups:
                for ctx in args.contexts:
                    for B in args.decode_batch:
                        add(decode_case(family, models, B, ctx, args, dev, dtype))
        else:
            B, S = args.qwen_prefill
            add(prefill_case(family, models, B, S, args, dev))
            B, ctx = args.qwen_decode
            add(decode_case(family, models, B, ctx, args, dev, dtype))


# --------------------------------------------------------------------------- ResNet-50


def resnet_cases(args: Any, dev: torch.device, dtype: torch.dtype, done: Callable[[dict], None]) -> None:
    import torchvision

    torch.manual_seed(0)
    base = torchvision.models.resnet50().to(dev, dtype).eval()
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(args.image_batch, 3, args.image_size, args.image_size, generator=g).to(dev, dtype)
    cl = torch.channels_last
    for layout in ("nchw", "channels_last"):
        model = copy.deepcopy(base).to(memory_format=cl) if layout == "channels_last" else base
        x = x0.contiguous(memory_format=cl) if layout == "channels_last" else x0
        models = Models(model, args.variants)
        fns = {v: (lambda m=models.get(v, None): m(x)) for v in models.variants}
        case = {"group": "resnet", "case": f"resnet50 inference {layout} B={args.image_batch} {args.image_size}px",
                "kind": "inference", "layout": layout, "graphs": {v: False for v in fns}}
        with torch.no_grad():
            case["graph_errors"] = {}
            samples = run_variants(case["case"], fns, None, dev, args.rounds, 1, 2, case["graph_errors"])
            outs = {v: fn().float().clone() for v, fn in fns.items()}
            summarise(case, samples, outs)
            if "converted" in models.base:
                case["implementations"] = profile_converted(lambda: models.base["converted"](x), None)
                case["explain"] = explain_summary(models.base["converted"])
        done(case)
        del models, fns
    done(resnet_training(base, x0, args, dev))


def resnet_training(base: torch.nn.Module, x0: torch.Tensor, args: Any, dev: torch.device) -> dict:
    cl = dev.type == "cuda"  # channels_last on CUDA, as training scripts run it
    x = x0.contiguous(memory_format=torch.channels_last) if cl else x0
    steps, grads, failed = {}, {}, {}
    for v in args.variants:
        m = copy.deepcopy(base).train()
        if cl:
            m = m.to(memory_format=torch.channels_last)
        if "converted" in v:
            m = ops_adv.convert_model(m)
        fwd = torch.compile(m) if v.startswith("compile") else m
        opt = torch.optim.SGD(m.parameters(), lr=1e-3)

        def step(fwd=fwd, opt=opt, update=True):
            opt.zero_grad(set_to_none=True)
            loss = fwd(x).float().logsumexp(-1).mean()
            loss.backward()
            if update:
                opt.step()
            return loss

        t0 = time.perf_counter()
        try:
            step(update=False)  # one step from the shared weights: its gradients are compared (and it compiles)
        except Exception as e:
            if v == "eager":
                raise
            failed[v] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            log(f"  resnet50 training {v}: failed: {failed[v]}")
            continue
        log(f"  resnet50 training {v}: first step {time.perf_counter() - t0:.1f} s")
        grads[v] = [p.grad.detach().float().clone() for p in m.parameters()]
        steps[v] = step
    errs = {}
    for v, gs in grads.items():
        errs[v] = max(float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in zip(gs, grads["eager"]))
    del grads
    case = {"group": "resnet", "case": f"resnet50 training step B={args.image_batch} {args.image_size}px"
            f"{' channels_last' if cl else ''}", "kind": "training", "graphs": {v: False for v in steps}, "graph_errors": failed}
    samples = run_variants(case["case"], steps, None, dev, args.rounds, 1, 1, failed)
    summarise(case, samples, {})
    for v, e in errs.items():
        if v in case["variants"]:
            case["variants"][v]["grad_rel_err"] = e
    return case


# --------------------------------------------------------------------------- report

TARGETS = [  # (what, group kinds, variant, against, ratio, applies)
    ("compile(converted) >= 1.15x compile(model), Llama decode B<=8", "llama-decode", "compile(converted)", "compile", 1.15,
     lambda r: r.get("B", 99) <= 8),
    ("compile(converted) >= 1.05x compile(model), Llama prefill", "llama-prefill", "compile(converted)", "compile", 1.05,
     lambda r: True),
    ("converted >= 1.3x eager, Llama decode B<=8", "llama-decode", "converted", "eager", 1.3, lambda r: r.get("B", 99) <= 8),
    ("converted+graph >= 1.3x eager+graph, Llama decode B<=8 (same target, both under CUDA graphs)", "llama-decode",
     "converted+graph", "eager+graph", 1.3, lambda r: r.get("B", 99) <= 8),
    ("converted >= 1.15x eager, Llama prefill", "llama-prefill", "converted", "eager", 1.15, lambda r: True),
    ("converted >= 1.1x eager, ResNet-50 inference", "resnet", "converted", "eager", 1.1, lambda r: r["kind"] == "inference"),
    ("converted >= 1.0x eager, ResNet-50 training", "resnet", "converted", "eager", 1.0, lambda r: r["kind"] == "training"),
]


def target_lines(rows: list[dict]) -> list[dict]:
    out = []
    for what, group, v, against, ratio, applies in TARGETS:
        for r in rows:
            if r["group"] != group or not applies(r):
                continue
            a, b = r["variants"].get(v), r["variants"].get(against)
            if a is None or b is None:
                continue
            got = b["ms"] / a["ms"]
            out.append({"target": what, "case": r["case"], "ratio": got, "pass": got >= ratio})
    for r in rows:
        if r.get("family") is None:
            continue
        for v in ("converted", "converted+graph", "compile(converted)"):
            d = r["variants"].get(v)
            if d is None or "kl" not in d:
                continue
            ok = d["kl"] < 0.01 and d["top1"] >= 0.999
            out.append({"target": f"KL < 0.01 and top-1 >= 99.9%: {v}", "case": r["case"], "kl": d["kl"], "top1": d["top1"],
                        "noise_floor_top1": r["variants"].get("compile", {}).get("top1"), "pass": ok})
    return out


def markdown(info: dict, rows: list[dict], targets: list[dict]) -> str:
    out = [f"# End to end: {info['device']}", "",
           ", ".join(f"{k}={v}" for k, v in info.items() if k != "device"), "",
           "Times: median per call (decode: one step, cache length put back before each), launch included; "
           "L2 not flushed (weights are far larger than L2). xeager, xcompile: speed against those variants. "
           "KL: KL(eager || variant) of the float32 softmax, mean over positions; top-1: argmax agreement with eager "
           "(compile's own agreement is the bf16 noise floor). ms/layer: (the call - embedding, final norm and lm_head "
           "timed alone, under a CUDA graph for graphed and compiled variants) / layers. graph: ran under CUDA graphs (compiled decode: mode=reduce-overhead; +graph: torch.cuda.CUDAGraph).", ""]
    for group in GROUPS:
        rs = [r for r in rows if r["group"] == group or r["group"].startswith(group)]
        if group == "qwen":
            rs = [r for r in rows if r.get("family") == "qwen"]
        if not rs:
            continue
        out += [f"## {group}", "", "| case | variant | ms | ms/layer | xeager | xcompile | KL | top-1 | grad err | graph |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rs:
            for v, d in r["variants"].items():
                f = lambda k, fmt: fmt.format(d[k]) if d.get(k) is not None else "-"  # noqa: E731
                out.append(f"| {r['case']} | {v} | {d['ms']:.3f} | {f('ms_per_layer', '{:.3f}')} | {f('vs_eager', '{:.2f}')} | "
                           f"{f('vs_compile', '{:.2f}')} | {f('kl', '{:.1e}')} | {f('top1', '{:.2%}')} | "
                           f"{f('grad_rel_err', '{:.1e}')} | {'yes' if r['graphs'].get(v) else 'no'} |")
            for v, e in (r.get("graph_errors") or {}).items():
                out.append(f"| {r['case']} | {v} | not run: {e} | | | | | | | |")
        out.append("")
    out += ["## Targets", ""]
    for t in targets:
        mark = "PASS" if t["pass"] else "MISS"
        if "ratio" in t:
            out.append(f"- {mark} {t['target']} — {t['case']}: {t['ratio']:.2f}x")
        else:
            floor = f"; compile(model) top-1 {t['noise_floor_top1']:.2%}" if t.get("noise_floor_top1") is not None else ""
            out.append(f"- {mark} {t['target']} — {t['case']}: KL {t['kl']:.1e}, top-1 {t['top1']:.2%}{floor}")
    out += ["", "## Implementations (one eager pass of the converted model)", ""]
    for r in rows:
        imp = r.get("implementations")
        if not imp:
            continue
        ops = ", ".join(f"{o['op']}:{o['impl']}({o['source']})x{o['calls']}" for o in imp["ops"]) or "no ops_adv op calls"
        routes = ", ".join(f"{k} x{n}" for k, n in imp["attention_routes"].items())
        out.append(f"- {r['case']}: {ops}" + (f"; attention: {routes}" if routes else ""))
    return "\n".join(out) + "\n"


def plot(rows: list[dict], path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no e2e.png"
    names = [v for v in dict.fromkeys(v for r in rows for v in r["variants"]) if v != "eager"]
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.9), 4.5))
    w = 0.8 / max(1, len(names))
    for i, v in enumerate(names):
        xs = [j + i * w for j, r in enumerate(rows) if v in r["variants"]]
        ys = [r["variants"][v]["vs_eager"] for r in rows if v in r["variants"]]
        ax.bar(xs, ys, w, label=v)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(rows))])
    ax.set_xticklabels([r["case"] for r in rows], rotation=35, ha="right", fontsize=7)
    ax.set_ylabel("speed vs eager (x)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"


def write(out: Path, info: dict, rows: list[dict], final: bool = True) -> None:
    """e2e.json and e2e.md (after every case, `final` False: no print, no plot), e2e.png at the end."""
    targets = target_lines(rows)
    md = markdown(info, rows, targets)
    out.mkdir(parents=True, exist_ok=True)
    (out / "e2e.json").write_text(json.dumps({"info": info, "rows": rows, "targets": targets}, indent=1))
    (out / "e2e.md").write_text(md)
    if final:
        print(md)
        log(plot(rows, out / "e2e.png"))


# --------------------------------------------------------------------------- main


def record_shapes(args: Any, dev: torch.device, dtype: torch.dtype, groups: set[str], path: str) -> int:
    """The problems the converted models hit in the selected cases, as a shapes file for the tuner."""
    seen: dict[str, list[dict]] = {}

    def merge(rec: Any) -> None:
        for op, probs in rec.shapes().items():
            for p in probs:
                if p not in seen.setdefault(op, []):
                    seen[op].append(p)

    with torch.no_grad():
        for family in [f for f in ("llama", "qwen") if any(g.startswith(f) for g in groups)]:
            model = ops_adv.convert_model(build_decoder(family, args, dev, dtype))
            kw = cache_kwarg(model)
            prefill = args.prefill if family == "llama" else [args.qwen_prefill]
            decode = [(B, c) for c in args.contexts for B in args.decode_batch] if family == "llama" else [args.qwen_decode]
            if family == "llama" and "llama-prefill" not in groups:
                prefill = []
            if family == "llama" and "llama-decode" not in groups:
                decode = []
            for B, S in prefill:
                with ops_adv.record() as rec:
                    model(torch.zeros(B, S, dtype=torch.long, device=dev))
                merge(rec)
            for B, ctx in decode:
                cache = static_cache(model, B, ctx + args.decode_room, dev, dtype)
                model(torch.zeros(B, ctx, dtype=torch.long, device=dev), **{kw: cache}, logits_to_keep=1)
                with ops_adv.record() as rec:
                    model(torch.zeros(B, 1, dtype=torch.long, device=dev), **{kw: cache})
                merge(rec)
            del model
        if "resnet" in groups:
            import torchvision

            model = ops_adv.convert_model(torchvision.models.resnet50().to(dev, dtype).eval())
            x = torch.randn(args.image_batch, 3, args.image_size, args.image_size, device=dev, dtype=dtype)
            for xi in (x, x.contiguous(memory_format=torch.channels_last)):
                with ops_adv.record() as rec:
                    model(xi)
                merge(rec)
    Path(path).write_text(json.dumps(seen, indent=1))
    return sum(len(v) for v in seen.values())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=DTYPES, help="default: bf16 on CUDA, fp32 on the CPU")
    ap.add_argument("--cases", default="all", help=f"comma-separated groups: {', '.join(GROUPS)} (default: all)")
    ap.add_argument("--models", help="older spelling: llama, resnet50 (llama = llama-prefill,llama-decode)")
    ap.add_argument("--variants", help=f"comma-separated of {', '.join(VARIANTS)} (default: all on CUDA; eager,converted on the CPU)")
    ap.add_argument("--size", choices=("8b", "small"), help="decoder shapes (default: 8b on CUDA, small on the CPU)")
    ap.add_argument("--layers", type=int, help="decoder layers (default 4 on CUDA, 2 on the CPU)")
    ap.add_argument("--prefill", help="Llama prefill B:S pairs (default 1:2048,8:512; CPU 1:64)")
    ap.add_argument("--decode-batch", help="Llama decode batch sizes (default 1,8,32; CPU 1,2)")
    ap.add_argument("--contexts", help="Llama decode context lengths (default 1024,8192; CPU 32,64)")
    ap.add_argument("--prompt-len", type=int, help="older spelling of a single --contexts value")
    ap.add_argument("--decode-room", type=int, help="static cache slots beyond the context (default 256; CPU 16)")
    ap.add_argument("--qwen-prefill", help="Qwen prefill B:S (default 1:2048; CPU 1:64)")
    ap.add_argument("--qwen-decode", help="Qwen decode B:context (default 8:1024; CPU 2:32)")
    ap.add_argument("--image-batch", type=int, help="ResNet-50 batch (default 32; CPU 2)")
    ap.add_argument("--image-size", type=int, help="ResNet-50 image side (default 224; CPU 32)")
    ap.add_argument("--rounds", type=int, help="interleaved rounds (default 7 on CUDA, 2 on the CPU)")
    ap.add_argument("--reps", type=int, help="decode steps timed per variant per round (default 10; CPU 2)")
    ap.add_argument("--new-tokens", type=int, help="older spelling of --reps")
    ap.add_argument("--no-graphs", dest="graphs", action="store_false", help="no eager+graph/converted+graph variants")
    ap.add_argument("--record-shapes", metavar="PATH", help="only write the problems the selected cases hit (for the tuner)")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="write one report from e2e.json files of split runs")
    ap.add_argument("--out", help="folder for e2e.json, e2e.md and e2e.png")
    args = ap.parse_args(argv)
    if args.merge:
        if not args.out:
            ap.error("--merge needs --out")
        parts = [json.loads(Path(p).read_text()) for p in args.merge]
        info = dict(parts[0]["info"], merged=len(parts))
        write(Path(args.out), info, [r for p in parts for r in p["rows"]])
        return 0
    dev = torch.device(args.device)
    gpu = dev.type == "cuda"
    if gpu and not torch.cuda.is_available():
        ap.error("--device cuda but torch sees no GPU: pass --device cpu for the small smoke run")
    dtype = DTYPES[args.dtype or ("bf16" if gpu else "fp32")]
    pairs = lambda s: [tuple(map(int, p.split(":"))) for p in s.split(",")]  # noqa: E731
    args.size = args.size or ("8b" if gpu else "small")
    args.layers = args.layers or (4 if gpu else 2)
    args.prefill = pairs(args.prefill or ("1:2048,8:512" if gpu else "1:64"))
    args.decode_batch = [int(b) for b in (args.decode_batch or ("1,8,32" if gpu else "1,2")).split(",")]
    args.contexts = [args.prompt_len] if args.prompt_len else [int(c) for c in (args.contexts or ("1024,8192" if gpu else "32,64")).split(",")]
    args.decode_room = args.decode_room if args.decode_room is not None else (256 if gpu else 16)
    args.qwen_prefill = pairs(args.qwen_prefill or ("1:2048" if gpu else "1:64"))[0]
    args.qwen_decode = pairs(args.qwen_decode or ("8:1024" if gpu else "2:32"))[0]
    args.image_batch = args.image_batch or (32 if gpu else 2)
    args.image_size = args.image_size or (224 if gpu else 32)
    args.rounds = args.rounds or (7 if gpu else 2)
    args.reps = args.reps or args.new_tokens or (10 if gpu else 2)
    args.variants = [v.strip() for v in (args.variants or (",".join(VARIANTS) if gpu else "eager,converted")).split(",")]
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad or "eager" not in args.variants:
        ap.error(f"--variants: unknown {bad}, or eager missing (every ratio is against it); choose from {', '.join(VARIANTS)}")
    if args.models:
        m = {"llama": "llama-prefill,llama-decode", "resnet50": "resnet", "resnet": "resnet", "qwen": "qwen"}
        args.cases = ",".join(m.get(x.strip(), x.strip()) for x in args.models.split(","))
    groups = set(GROUPS) if args.cases == "all" else {c.strip() for c in args.cases.split(",") if c.strip()}
    if groups - set(GROUPS):
        ap.error(f"--cases: unknown {sorted(groups - set(GROUPS))}; choose from {', '.join(GROUPS)}")
    limit_recompiles()
    if args.record_shapes:
        n = record_shapes(args, dev, dtype, groups, args.record_shapes)
        log(f"wrote {n} problems to {args.record_shapes}")
        return 0
    info = {"device": torch.cuda.get_device_name(dev) if gpu else platform.processor() or platform.machine(),
            "torch": torch.__version__, "transformers": __import__("transformers").__version__, "python": platform.python_version(),
            "dtype": str(dtype).replace("torch.", ""), "layers": args.layers, "size": args.size, "rounds": args.rounds,
            "decode_reps": args.reps, "decode_room": args.decode_room, "table": os.environ.get("OPS_ADV_TABLE"),
            "threads": torch.get_num_threads(), "compile_modes": "decode: reduce-overhead (CUDA graphs); prefill, ResNet: default"}
    log(f"cases {sorted(groups)}, variants {args.variants}")
    rows: list[dict] = []

    def done(row: dict) -> None:
        rows.append(row)
        info["seconds"] = round(time.perf_counter() - T0, 1)
        if args.out:
            write(Path(args.out), dict(info, partial=True), rows, final=False)
        log(f"case done: {row['case']}")

    # `timeout` ends a run with SIGTERM: leave through the finally below (the report of the cases done)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    try:
        if groups & {"llama-prefill", "llama-decode"}:
            decoder_cases("llama", args, dev, dtype, groups, done)
            torch._dynamo.reset()
        if "qwen" in groups:
            decoder_cases("qwen", args, dev, dtype, groups, done)
            torch._dynamo.reset()
        if "resnet" in groups:
            log("build resnet50")
            resnet_cases(args, dev, dtype, done)
    except BaseException as e:  # SIGTERM (SystemExit), ^C or an error: the report says the run was cut short
        info["stopped"] = f"{type(e).__name__}: {str(e)[:200]}"
        raise
    finally:
        if gpu:
            info["max_memory_gib"] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 1)
        info["seconds"] = round(time.perf_counter() - T0, 1)
        if args.out:
            write(Path(args.out), info, rows)
        else:
            print(markdown(info, rows, target_lines(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
