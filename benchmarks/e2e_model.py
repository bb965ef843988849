#!/usr/bin/env python
"""End to end: models as their users run them, original and converted, eager, under CUDA graphs and compiled.

Each (model, case) runs in a child process of its own with a deadline (TorchBench's ModelTask idea): a
case that crashes its process (an illegal memory access, a hung compile) costs that case, not the run.
A variant that fails becomes a row with its error and the others go on; a variant that kills or
poisons its process is left out and the case is run again without it (--retries).

Models are built from configs with random weights (nothing is downloaded):
- llama-prefill / llama-decode: transformers' LlamaForCausalLM with Llama-3-8B dims (hidden 4096,
  intermediate 14336, 32/8 heads, head 128, vocab 128256), --layers of them (default 4). Prefill: the
  prompt's logits at B x S. Decode: a StaticCache (capacity = context + --decode-room) filled by a
  prefill of the context, then ONE decode step (a token per sequence) is timed, the cache's length
  put back before every step;
- qwen: Qwen2ForCausalLM with Qwen2-7B dims (3584, 18944, 28/4 heads, q/k/v bias): a prefill and a
  decode case;
- resnet: torchvision's ResNet-50, inference with NCHW and channels_last inputs, and a training step
  (forward, backward, SGD) with the gradients' relative error against eager.

Variants (--variants; the default is what is relevant to the case and device):
  eager, converted               the model, and ops_adv.convert_model of it
  eager+graph, converted+graph   the same captured in a torch.cuda.CUDAGraph (CUDA; not training)
  compile, compile(converted)    torch.compile(model), mode default
  compile-ro, compile-ro(converted)   mode="reduce-overhead" (CUDA graph trees; CUDA, decode by default)
Variants run in interleaved rounds after warm-up (compilation included in warm-up), so ratios within
one case come from one process and one period. Each case reports medians, speed against eager and
against compile, KL(eager || variant) of the float32 softmax, top-1 agreement with eager, which
implementation each op ran (ops_adv.profiler, one eager pass of the converted model) and PASS/MISS
against the targets of issue 20.

    python benchmarks/e2e_model.py --tiny --out DIR                       # CPU smoke run (minutes)
    OPS_ADV_TABLE=table.json python benchmarks/e2e_model.py --out DIR     # the H200 run
    python benchmarks/e2e_model.py --cases llama-decode --decode-batch 1,8 --out DIR
    python benchmarks/e2e_model.py --record-shapes shapes.json            # the problems, for opsadv-tune
    python benchmarks/e2e_model.py --merge A/e2e.json B/e2e.json --out DIR    # one report from split runs
"""
from __future__ import annotations

import argparse
import collections
import copy
import faulthandler
import inspect
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
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

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
GROUPS = ("llama-prefill", "llama-decode", "qwen", "resnet")
VARIANTS = ("eager", "converted", "eager+graph", "converted+graph", "compile", "compile(converted)",
            "compile-ro", "compile-ro(converted)")
# hidden, intermediate, heads, kv heads, vocab, qkv bias
SHAPES = {
    "llama": {"8b": (4096, 14336, 32, 8, 128256, False), "small": (256, 688, 8, 2, 2048, False),
              "tiny": (64, 128, 4, 2, 256, False)},
    "qwen": {"8b": (3584, 18944, 28, 4, 152064, True), "small": (224, 512, 7, 1, 2048, True),
             "tiny": (64, 128, 4, 1, 256, True)},
}
FATAL_EXIT = 3  # a child whose CUDA context is unusable after a variant failed
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.perf_counter() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def short_error(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:240] if text else ''}"


# --------------------------------------------------------------------------- variants


def source_of(v: str) -> str:
    return "converted" if "converted" in v else "eager"


def compile_mode(v: str) -> str | None:
    if not v.startswith("compile"):
        return None
    return "reduce-overhead" if v.startswith("compile-ro") else "default"


def is_graphed(v: str) -> bool:
    return v.endswith("+graph") or compile_mode(v) == "reduce-overhead"


def variants_for(kind: str, requested: str, dev: torch.device) -> list[str]:
    """The variants a case runs: the requested ones (a list, 'all' or 'default') that are relevant to it."""
    cuda = dev.type == "cuda"
    if requested == "all":
        want = list(VARIANTS)
    elif requested == "default":
        want = ["eager", "converted", "eager+graph", "converted+graph"]
        want += ["compile-ro", "compile-ro(converted)"] if kind == "decode" and cuda else ["compile", "compile(converted)"]
    else:
        want = [v.strip() for v in requested.split(",") if v.strip()]
    out = []
    for v in want:
        if (v.endswith("+graph") or compile_mode(v) == "reduce-overhead") and not cuda:
            continue  # CUDA graphs: CUDA only
        if kind == "training" and (v.endswith("+graph") or compile_mode(v) == "reduce-overhead"):
            continue  # a captured training step (optimizer included) is not measured here
        out.append(v)
    return ["eager"] + [v for v in dict.fromkeys(out) if v != "eager"]


# --------------------------------------------------------------------------- timing


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
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)


class Progress:
    """What the child is doing, appended as JSON lines: the parent reads it when the child dies."""

    def __init__(self, path: str | None) -> None:
        self.path = path

    def __call__(self, **event: Any) -> None:
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(event) + "\n")


def context_broken(dev: torch.device) -> bool:
    """True when the CUDA context is unusable (a sticky error such as an illegal memory access)."""
    if dev.type != "cuda":
        return False
    try:
        torch.cuda.synchronize(dev)
        torch.zeros(1, device=dev).add_(1).item()
        return False
    except Exception:  # noqa: BLE001
        return True


class Case:
    """One case's variants: their callables, warm-up, interleaved timing, outputs and errors."""

    def __init__(self, row: dict, dev: torch.device, progress: Progress, skip: dict[str, str]) -> None:
        self.row, self.dev, self.progress = row, dev, progress
        self.errors: dict[str, str] = dict(skip)
        self.fns: dict[str, Callable[[], Any]] = {}
        row["errors"] = self.errors

    def fail(self, v: str, phase: str, e: BaseException) -> None:
        if v == "eager":
            raise e
        self.errors[v] = f"{phase}: {short_error(e)}"
        log(f"  {self.row['case']} {v}: {self.errors[v]}")
        fatal = context_broken(self.dev)
        self.progress(event="fail", variant=v, phase=phase, error=self.errors[v], fatal=fatal)
        self.fns.pop(v, None)
        if fatal:  # nothing more can run in this process: the parent runs the case again without v
            log(f"  the CUDA context is unusable after {v}: leaving")
            sys.stderr.flush()
            os._exit(FATAL_EXIT)

    def add(self, v: str, make: Callable[[], Callable[[], Any]]) -> None:
        if v in self.errors:
            return
        self.progress(event="start", variant=v, phase="build")
        try:
            self.fns[v] = make()
            self.progress(event="end", variant=v, phase="build")
        except Exception as e:  # noqa: BLE001 - a row of its own
            self.fail(v, "build", e)

    def warm(self, prep: Callable[[], Any] | None, warmup: int) -> None:
        for v, fn in list(self.fns.items()):
            self.progress(event="start", variant=v, phase="warm-up")
            t0 = time.perf_counter()
            try:
                for _ in range(warmup):
                    if prep is not None:
                        prep()
                    fn()
                sync(self.dev)
            except Exception as e:  # noqa: BLE001
                self.fail(v, "warm-up", e)
                continue
            self.progress(event="end", variant=v, phase="warm-up")
            log(f"  {self.row['case']} {v}: warm-up {time.perf_counter() - t0:.1f} s")

    def time(self, prep: Callable[[], Any] | None, rounds: int, reps: int) -> dict[str, list[float]]:
        samples: dict[str, list[float]] = {v: [] for v in self.fns}
        for r in range(rounds):
            order = list(self.fns)
            for v in order[r % len(order):] + order[:r % len(order)]:  # rotate who goes first
                if v not in self.fns:
                    continue
                self.progress(event="start", variant=v, phase=f"timing round {r}")
                try:
                    samples[v] += [time_once(self.fns[v], prep, self.dev) for _ in range(reps)]
                except Exception as e:  # noqa: BLE001
                    self.fail(v, f"timing round {r}", e)
                    samples.pop(v, None)
        return {v: s for v, s in samples.items() if v in self.fns and s}

    def outputs(self, prep: Callable[[], Any] | None) -> dict[str, torch.Tensor]:
        outs = {}
        for v, fn in list(self.fns.items()):
            self.progress(event="start", variant=v, phase="output")
            try:
                if prep is not None:
                    prep()
                outs[v] = fn().float().clone()
            except Exception as e:  # noqa: BLE001
                self.fail(v, "output", e)
        return outs


def capture(fn: Callable[[], torch.Tensor], prep: Callable[[], Any] | None) -> Callable[[], torch.Tensor]:
    """fn captured in a CUDA graph (warmed up on a side stream first); replay returns the graph's output.

    The replay keeps fn and prep, and so everything they reach (the model, its cache, the input
    token), alive: a graph holds addresses, not tensors. decode_step.py dropped its 4-layer model
    once the 1-layer one was built; the 1-layer capture's empty_cache() gave the memory back to the
    driver, and the 4-layer replays read it (illegal address on the H200, or a device-side assert
    when freed input ids were reused and read as token ids).
    """
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            if prep is not None:
                prep()
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    if prep is not None:
        prep()
    with torch.cuda.graph(graph):
        out = fn()

    def replay() -> torch.Tensor:
        graph.replay()
        return out

    replay.graph = graph  # keep it alive
    replay.keep = (fn, prep)  # and what the graph reads (see above)
    return replay


class Models:
    """The original and converted model; compiled forwards made on first use (a copy each)."""

    def __init__(self, model: torch.nn.Module, variants: list[str], fullgraph: bool) -> None:
        self.base = {"eager": model}
        self.fullgraph = fullgraph
        if any("converted" in v for v in variants):
            self.base["converted"] = ops_adv.convert_model(copy.deepcopy(model))

    def get(self, v: str) -> Callable:
        mode = compile_mode(v)
        m = self.base[source_of(v)]
        if mode is None:
            return m
        # a copy of its own: compiling must not change the eager variants
        return torch.compile(copy.deepcopy(m), mode=None if mode == "default" else mode, dynamic=False,
                             fullgraph=self.fullgraph)


def summarise(row: dict, samples: dict[str, list[float]], outs: dict[str, torch.Tensor]) -> None:
    base = statistics.median(samples["eager"]) if "eager" in samples else None
    med = {v: statistics.median(s) for v, s in samples.items()}
    rows = {}
    for v, s in samples.items():
        ref_c = compile_ref(v, med)
        d = {"ms": med[v], "min_ms": min(s), "n": len(s), "vs_eager": base / med[v] if base else None,
             "vs_compile": med[ref_c] / med[v] if ref_c else None, "vs_compile_of": ref_c, "graph": is_graphed(v)}
        if "eager" in outs and v in outs:
            d.update(compare(outs["eager"], outs[v]))
        if row.get("layers") and row.get("head_ms"):
            hm = row["head_ms"]
            k = source_of(v) + ("+graph" if is_graphed(v) else "")
            d["ms_per_layer"] = (med[v] - hm.get(k, hm.get(source_of(v), 0.0))) / row["layers"]
        rows[v] = d
    row["variants"] = rows


def compile_ref(v: str, med: dict[str, float]) -> str | None:
    """The compile variant `v` is compared with: reduce-overhead for graphed variants when it ran."""
    order = ("compile-ro", "compile") if is_graphed(v) else ("compile", "compile-ro")
    return next((c for c in order if c in med), None)


def profile_converted(call: Callable[[], Any], prep: Callable[[], Any] | None) -> dict:
    """Which implementation each op ran (one eager pass of the converted model)."""
    import kernel_space

    with ops_adv.profiler.ProfileContext() as prof:
        if prep is not None:
            prep()
        call()
    ops = Counter((c["op"], c["impl"], c["source"]) for c in prof.calls)

    def vendor(op: str, impl: str) -> bool:
        try:
            return kernel_space.get_impl(op, impl).vendor
        except Exception:  # noqa: BLE001 - a plugin's impl that left
            return False

    return {"ops": [{"op": o, "impl": i, "source": s, "calls": n, "vendor": vendor(o, i)} for (o, i, s), n in sorted(ops.items())]}


def explain_summary(model: torch.nn.Module) -> dict:
    rep = ops_adv.explain_model(model)
    return {"converted": dict(Counter(r["type"] for r in rep if r["converted"] == "yes")),
            "not_converted": sorted({f"{r['type']}: {r['why']}" for r in rep if r["converted"] != "yes"})[:10]}


# --------------------------------------------------------------------------- decoders


def build_decoder(family: str, args: Any, dev: torch.device, dtype: torch.dtype, max_pos: int) -> torch.nn.Module:
    import transformers

    hidden, inter, heads, kv, vocab, bias = SHAPES[family][args.size]
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=args.layers,
                  num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=max_pos)
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


def head_times(models: Models, ids: torch.Tensor, dev: torch.device, reps: int) -> dict[str, float]:
    """ms of the part outside the decoder layers (embedding, final norm, lm_head) per model, also under a
    CUDA graph on CUDA; per-layer times subtract it."""
    out = {}
    for fam, m in models.base.items():
        inner = m.model

        def head(m=m, inner=inner) -> torch.Tensor:
            return m.lm_head(inner.norm(inner.embed_tokens(ids)))

        fns = {fam: head}
        if dev.type == "cuda":
            try:
                fns[fam + "+graph"] = capture(head, None)
            except Exception as e:  # noqa: BLE001 - the ungraphed time stays
                log(f"  head {fam}: capture failed ({type(e).__name__})")
        for k, fn in fns.items():
            fn()
            out[k] = statistics.median(time_once(fn, None, dev) for _ in range(reps))
    return out


def decoder_case(case: dict, args: Any, dev: torch.device, dtype: torch.dtype, progress: Progress, skip: dict) -> dict:
    family, kind, B = case["family"], case["kind"], case["B"]
    variants = variants_for(kind, args.variants, dev)
    max_pos = (case.get("ctx", 0) + args.decode_room) if kind == "decode" else case["S"]
    log(f"build {family} ({args.size}, {args.layers} layers, {dtype})")
    progress(event="start", variant="eager", phase="build model")
    models = Models(build_decoder(family, args, dev, dtype, max_pos + 64), variants, args.fullgraph)
    row = dict(case, layers=args.layers, variants_asked=variants)
    c = Case(row, dev, progress, skip)
    eager = models.base["eager"]
    vocab = eager.config.vocab_size
    prep: Callable[[], Any] | None = None
    if kind == "prefill":
        S = case["S"]
        ids = torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(B * 7919 + S)).to(dev)

        def call(m: Callable) -> Callable[[], torch.Tensor]:
            return lambda: m(ids).logits
        head_ids, reps, warmup = ids, 1, 2
    else:
        ctx = case["ctx"]
        g = torch.Generator().manual_seed(B * 131 + ctx)
        prompt = torch.randint(0, vocab, (B, ctx), generator=g).to(dev)
        tok = torch.randint(0, vocab, (B, 1), generator=g).to(dev)
        row["capacity"] = ctx + args.decode_room
        cache = static_cache(eager, B, row["capacity"], dev, dtype)
        kw = cache_kwarg(eager)
        keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(eager.forward).parameters else {}
        t0 = time.perf_counter()
        with torch.no_grad():
            eager(prompt, **{kw: cache}, **keep)
        sync(dev)
        log(f"  {row['case']}: cache filled by a prefill in {time.perf_counter() - t0:.1f} s")
        extra: dict[str, Any] = {}
        lengths = [layer.cumulative_length for layer in getattr(cache, "layers", []) if hasattr(layer, "cumulative_length")]
        if not lengths:  # transformers 4.x: the write position is an argument
            extra["cache_position"] = torch.tensor([ctx], device=dev)

        def prep() -> None:  # every timed step decodes token ctx+1 into the same slot
            for n in lengths:
                n.fill_(ctx)

        def call(m: Callable) -> Callable[[], torch.Tensor]:
            return lambda: m(tok, **{kw: cache}, **extra).logits
        head_ids, reps, warmup = tok, args.reps, 3
    with torch.no_grad():
        # eager first, then captures, compiles last: a compile that fails mid-trace cannot disturb a capture
        for v in sorted(variants, key=lambda v: (v.startswith("compile"), v.endswith("+graph"))):
            if v.endswith("+graph"):
                c.add(v, lambda v=v: capture(call(models.base[source_of(v)]), prep))
            else:
                c.add(v, lambda v=v: call(models.get(v)))
        c.warm(prep, warmup)
        samples = c.time(prep, args.rounds, reps)
        progress(event="start", variant="eager", phase="head and outputs")
        row["head_ms"] = head_times(models, head_ids, dev, 3 if kind == "prefill" else 10)
        outs = c.outputs(prep)
        summarise(row, samples, outs)
        if "converted" in models.base:
            progress(event="start", variant="converted", phase="profile")
            row["implementations"] = profile_converted(call(models.base["converted"]), prep)
            row["explain"] = explain_summary(models.base["converted"])
    return row


# --------------------------------------------------------------------------- ResNet-50


def resnet_case(case: dict, args: Any, dev: torch.device, dtype: torch.dtype, progress: Progress, skip: dict) -> dict:
    import torchvision

    torch.manual_seed(0)
    progress(event="start", variant="eager", phase="build model")
    base = getattr(torchvision.models, args.resnet)().to(dev, dtype).eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.image_batch, 3, args.image_size, args.image_size, generator=g).to(dev, dtype)
    cl = case.get("layout") == "channels_last" or (case["kind"] == "training" and dev.type == "cuda")
    if cl:
        base, x = base.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
    row = dict(case, case=case["case"] + (" channels_last" if cl and case["kind"] == "training" else ""))
    if case["kind"] == "training":
        return resnet_training(row, base, x, args, dev, progress, skip)
    variants = variants_for("inference", args.variants, dev)
    row["variants_asked"] = variants
    models = Models(base, variants, args.fullgraph)
    c = Case(row, dev, progress, skip)

    def call(m: Callable) -> Callable[[], torch.Tensor]:
        return lambda: m(x)

    with torch.no_grad():
        for v in sorted(variants, key=lambda v: (v.startswith("compile"), v.endswith("+graph"))):
            if v.endswith("+graph"):
                c.add(v, lambda v=v: capture(call(models.base[source_of(v)]), None))
            else:
                c.add(v, lambda v=v: call(models.get(v)))
        c.warm(None, 2)
        samples = c.time(None, args.rounds, 1)
        outs = c.outputs(None)
        summarise(row, samples, outs)
        if "converted" in models.base:
            progress(event="start", variant="converted", phase="profile")
            row["implementations"] = profile_converted(call(models.base["converted"]), None)
            row["explain"] = explain_summary(models.base["converted"])
    return row


def resnet_training(row: dict, base: torch.nn.Module, x: torch.Tensor, args: Any, dev: torch.device,
                    progress: Progress, skip: dict) -> dict:
    variants = variants_for("training", args.variants, dev)
    row["variants_asked"] = variants
    c = Case(row, dev, progress, skip)
    grads: dict[str, list[torch.Tensor]] = {}
    models: dict[str, torch.nn.Module] = {}
    for v in variants:
        def make(v: str = v) -> Callable[[], Any]:
            m = copy.deepcopy(base).train()
            if "converted" in v:
                m = ops_adv.convert_model(m)
            fwd = torch.compile(m, fullgraph=args.fullgraph) if v.startswith("compile") else m
            opt = torch.optim.SGD(m.parameters(), lr=1e-3)
            models[v] = m

            def step(update: bool = True) -> torch.Tensor:
                opt.zero_grad(set_to_none=True)
                loss = fwd(x).float().logsumexp(-1).mean()
                loss.backward()
                if update:
                    opt.step()
                return loss

            step(update=False)  # one step from the shared weights: its gradients are compared (and it compiles)
            grads[v] = [p.grad.detach().float().clone() for p in m.parameters()]
            return step

        c.add(v, make)
    errs = {v: max(float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in zip(gs, grads["eager"]))
            for v, gs in grads.items()}
    del grads
    c.warm(None, 1)
    samples = c.time(None, args.rounds, 1)
    summarise(row, samples, {})
    for v, e in errs.items():
        if v in row["variants"]:
            row["variants"][v]["grad_rel_err"] = e
    if "converted" in models:
        progress(event="start", variant="converted", phase="profile")
        row["implementations"] = profile_converted(lambda: models["converted"](x).sum().backward(), None)
    return row


# --------------------------------------------------------------------------- cases and processes


def plan(args: Any, groups: set[str]) -> list[dict]:
    cases = []
    if "llama-prefill" in groups:
        cases += [{"group": "llama-prefill", "family": "llama", "kind": "prefill", "B": B, "S": S,
                   "case": f"llama prefill B={B} S={S}"} for B, S in args.prefill]
    if "llama-decode" in groups:
        cases += [{"group": "llama-decode", "family": "llama", "kind": "decode", "B": B, "ctx": ctx,
                   "case": f"llama decode B={B} ctx={ctx}"} for ctx in args.contexts for B in args.decode_batch]
    if "qwen" in groups:
        (B, S), (Bd, ctx) = args.qwen_prefill, args.qwen_decode
        cases += [{"group": "qwen", "family": "qwen", "kind": "prefill", "B": B, "S": S, "case": f"qwen prefill B={B} S={S}"},
                  {"group": "qwen", "family": "qwen", "kind": "decode", "B": Bd, "ctx": ctx, "case": f"qwen decode B={Bd} ctx={ctx}"}]
    if "resnet" in groups:
        tag = f"B={args.image_batch} {args.image_size}px"
        cases += [{"group": "resnet", "kind": "inference", "layout": lay, "case": f"{args.resnet} inference {lay} {tag}"}
                  for lay in ("nchw", "channels_last")]
        cases.append({"group": "resnet", "kind": "training", "case": f"{args.resnet} training step {tag}"})
    return cases


def run_case(case: dict, args: Any, progress: Progress, skip: dict[str, str]) -> dict:
    dev = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    limit_recompiles()
    torch.manual_seed(0)
    if case["group"] == "resnet":
        row = resnet_case(case, args, dev, dtype, progress, skip)
    else:
        row = decoder_case(case, args, dev, dtype, progress, skip)
    if dev.type == "cuda":
        row["max_memory_gib"] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 1)
    return row


def arm_stack_dump(spec: dict) -> None:
    """A child stopped at its limit first prints every thread's stack to stderr: a hang says where it hangs
    (compile-ro(converted) at B=8 8k timed out in warm-up on the H200 with nothing more to go on)."""
    if spec.get("limit"):
        faulthandler.dump_traceback_later(max(1.0, spec["limit"] - 8), exit=False)


def hung_at(tail: list[str]) -> str:
    """The innermost frame of the main thread (listed last) in a stack dump within `tail`, or ''."""
    heads = [i for i, ln in enumerate(tail) if "(most recent call first)" in ln]
    if heads and heads[-1] + 1 < len(tail) and "File" in tail[heads[-1] + 1]:
        return tail[heads[-1] + 1].strip()[:240]
    return ""


def child_main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    arm_stack_dump(spec)
    args = argparse.Namespace(**spec["args"])
    args.prefill = [tuple(p) for p in args.prefill]
    args.qwen_prefill, args.qwen_decode = tuple(args.qwen_prefill), tuple(args.qwen_decode)
    row = run_case(spec["case"], args, Progress(spec["progress"]), spec["skip"])
    tmp = spec["result"] + ".tmp"
    Path(tmp).write_text(json.dumps(row))
    os.replace(tmp, spec["result"])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no teardown: a broken CUDA context or a Triton thread cannot hang the exit


def last_running(progress_path: Path) -> tuple[str | None, str | None, str | None]:
    """(variant, phase, error) of the last step the child started and did not end (fatal failures first)."""
    running: dict[str, str] = {}
    last = (None, None, None)
    if not progress_path.exists():
        return last
    for line in progress_path.read_text().splitlines():
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if ev.get("event") == "fail" and ev.get("fatal"):
            return ev["variant"], ev["phase"], ev["error"]
        if ev.get("event") == "start":
            last = (ev["variant"], ev["phase"], None)
        elif ev.get("event") in ("end", "fail"):
            last = (None, None, None)
    return last


class Child:
    """One case in a process of its own; its stderr streamed through with a tail kept."""

    current: "subprocess.Popen | None" = None

    @staticmethod
    def run(spec: dict, limit: float, script: str | None = None) -> tuple[int | None, list[str]]:
        """`script --child SPEC` (default: this file) under `limit` seconds: (exit code or None, stderr's tail)."""
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(dict(spec, limit=limit), f)
        tail: collections.deque[str] = collections.deque(maxlen=160)  # a stack dump's main thread (up to 100 frames) too
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        p = Child.current = subprocess.Popen([sys.executable, script or str(Path(__file__).resolve()), "--child", f.name],
                                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                             text=True, errors="replace", env=env, start_new_session=True)

        def pump() -> None:
            for line in p.stderr:
                tail.append(line.rstrip())
                sys.stderr.write("    " + line)
                sys.stderr.flush()

        t = threading.Thread(target=pump, daemon=True)
        t.start()
        try:
            rc: int | None = p.wait(timeout=max(1.0, limit))
        except subprocess.TimeoutExpired:
            rc = None
            Child.stop(p)
        finally:
            Child.current = None
            os.unlink(f.name)
        t.join(timeout=5)
        return rc, list(tail)

    @staticmethod
    def stop(p: "subprocess.Popen") -> None:
        """SIGTERM to the child's process group (its compile workers too), SIGKILL 10 s later."""
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                return
            try:
                p.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue


def isolated(case: dict, args: Any, work: Path, deadline: float | None) -> dict:
    """Run one case in a child process; a variant that kills it is left out and the case run again."""
    skip: dict[str, str] = {}
    key = "".join(ch if ch.isalnum() else "-" for ch in case["case"])
    why = "not run"
    for attempt in range(args.retries + 1):
        limit = args.case_timeout if deadline is None else min(args.case_timeout, deadline - time.monotonic())
        if limit < 20:
            why = f"{why}; not run again: no time left before the deadline" if attempt else "not run: no time left before the deadline"
            break
        progress, result = work / f"{key}.{attempt}.progress", work / f"{key}.{attempt}.json"
        spec = {"args": vars(args), "case": case, "skip": skip, "progress": str(progress), "result": str(result)}
        log(f"case {case['case']} (attempt {attempt + 1}, limit {limit:.0f} s)" + (f", without {sorted(skip)}" if skip else ""))
        t0 = time.monotonic()
        rc, tail = Child.run(spec, limit)
        if rc == 0 and result.exists():
            row = json.loads(result.read_text())
            row.update(attempts=attempt + 1, seconds=round(time.monotonic() - t0, 1))
            return row
        v, phase, err = last_running(progress)
        errline = next((ln.strip()[:240] for ln in reversed(tail) if "Error" in ln or "error:" in ln), "")
        how = f"timed out after {limit:.0f} s" if rc is None else f"process exited with {rc}"
        if rc is None and hung_at(tail):
            how += f", in {hung_at(tail)}"
        why = err or (f"{how}: {errline}" if errline else how)
        log(f"case {case['case']}: {why} (in {v or 'set-up'}{', ' + phase if phase else ''})")
        if v is None or v == "eager" or v in skip:
            break
        skip[v] = f"{phase}: {why}" if not err else err
    return dict(case, error=why, errors=skip, variants={}, attempts=attempt + 1)


# --------------------------------------------------------------------------- targets and report

# issue 20's targets; each a ratio of two variants in one case (speed of `v` over `against`)
def target_lines(rows: list[dict]) -> list[dict]:
    out: list[dict] = []

    def ratio(what: str, r: dict, v: str, against: str, need: float) -> None:
        a, b = r["variants"].get(v), r["variants"].get(against)
        if a is not None and b is not None:
            got = b["ms"] / a["ms"]
            out.append({"target": what, "case": r["case"], "ratio": got, "pass": got >= need})
        elif v in (r.get("errors") or {}) and b is not None:
            out.append({"target": what, "case": r["case"], "failed": r["errors"][v], "pass": False})

    for r in rows:
        kind = r.get("kind")
        for v, against in (("compile(converted)", "compile"), ("compile-ro(converted)", "compile-ro")):
            if kind == "decode" and r.get("B", 99) <= 8:
                ratio(f"{v} >= 1.15x {against}, decode B<=8", r, v, against, 1.15)
            elif kind in ("prefill", "inference", "training"):
                ratio(f"{v} >= 1.0x {against}, prefill and ResNet-50", r, v, against, 1.0)
        if r.get("implementations") and not any(o["source"] != "default" and not o["vendor"] for o in r["implementations"]["ops"]):
            r["nothing_tuned"] = True
            for v, against in (("converted", "eager"), ("converted+graph", "eager+graph"), ("compile(converted)", "compile"),
                               ("compile-ro(converted)", "compile-ro")):
                ratio(f"{v} >= 0.98x {against} where nothing is tuned", r, v, against, 0.98)
        floors = [r["variants"][c]["top1"] for c in ("compile", "compile-ro") if "top1" in r["variants"].get(c, {})]
        floor = min(floors) if floors else 0.999
        for v, d in r["variants"].items():
            if "converted" in v and "kl" in d:
                out.append({"target": f"KL < 0.01 and top-1 >= compile's: {v}", "case": r["case"], "kl": d["kl"],
                            "top1": d["top1"], "floor": floor, "floor_from": "compile" if floors else "none (0.999)",
                            "pass": d["kl"] < 0.01 and d["top1"] >= floor - 1e-9})
    return out


def fmt(d: dict, k: str, f: str) -> str:
    return f.format(d[k]) if d.get(k) is not None else "-"


def markdown(info: dict, rows: list[dict], targets: list[dict]) -> str:
    out = [f"# End to end: {info['device']}", "",
           ", ".join(f"{k}={v}" for k, v in info.items() if k != "device"), "",
           "Each case ran in a process of its own; its variants in interleaved rounds after warm-up. Times: median "
           "per call (decode: one step, the cache length put back before each), launch included. xeager, xcompile: speed "
           "against eager and against compile (reduce-overhead for graphed variants where it ran). KL: KL(eager || variant) "
           "of the float32 softmax, mean over positions; top-1: argmax agreement with eager (compile's own is the noise "
           "floor). ms/layer: (the call - embedding, final norm and lm_head timed alone) / layers. graph: ran under CUDA "
           "graphs (+graph: torch.cuda.CUDAGraph; -ro: mode=reduce-overhead).", ""]
    for group in GROUPS:
        rs = [r for r in rows if r["group"] == group]
        if not rs:
            continue
        out += [f"## {group}", "", "| case | variant | ms | ms/layer | xeager | xcompile | KL | top-1 | grad err | graph |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rs:
            if r.get("error"):
                out.append(f"| {r['case']} | (case) | not run: {r['error']} | | | | | | | |")
            for v, d in r["variants"].items():
                out.append(f"| {r['case']} | {v} | {d['ms']:.3f} | {fmt(d, 'ms_per_layer', '{:.3f}')} | "
                           f"{fmt(d, 'vs_eager', '{:.2f}')} | {fmt(d, 'vs_compile', '{:.2f}')} | {fmt(d, 'kl', '{:.1e}')} | "
                           f"{fmt(d, 'top1', '{:.2%}')} | {fmt(d, 'grad_rel_err', '{:.1e}')} | {'yes' if d.get('graph') else 'no'} |")
            for v, e in (r.get("errors") or {}).items():
                out.append(f"| {r['case']} | {v} | failed: {e.replace('|', '/')} | | | | | | | |")
        out.append("")
    passed = sum(t["pass"] for t in targets)
    out += [f"## Targets (issue 20): {passed} PASS, {len(targets) - passed} MISS", ""]
    for t in targets:
        mark = "PASS" if t["pass"] else "MISS"
        if "ratio" in t:
            out.append(f"- {mark} {t['target']} — {t['case']}: {t['ratio']:.2f}x")
        elif "failed" in t:
            out.append(f"- {mark} {t['target']} — {t['case']}: variant failed ({t['failed']})")
        else:
            out.append(f"- {mark} {t['target']} — {t['case']}: KL {t['kl']:.1e}, top-1 {t['top1']:.2%} "
                       f"(floor {t['floor']:.2%} from {t['floor_from']})")
    out += ["", "## Implementations (one eager pass of the converted model)", ""]
    for r in rows:
        imp = r.get("implementations")
        if imp:
            ops = ", ".join(f"{o['op']}:{o['impl']}({o['source']})x{o['calls']}" for o in imp["ops"]) or "no ops_adv op calls"
            out.append(f"- {r['case']}: {ops}" + ("; nothing tuned" if r.get("nothing_tuned") else ""))
    return "\n".join(out) + "\n"


def plot(rows: list[dict], path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no e2e.png"
    rows = [r for r in rows if r["variants"]]
    names = [v for v in dict.fromkeys(v for r in rows for v in r["variants"]) if v != "eager"]
    if not rows or not names:
        return "nothing to plot"
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


def write(out: Path | None, info: dict, rows: list[dict], final: bool = True) -> None:
    """e2e.json and e2e.md after every case (`final` False: no print, no plot), e2e.png at the end."""
    targets = target_lines(rows)
    md = markdown(info, rows, targets)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / "e2e.json.tmp"
        tmp.write_text(json.dumps({"info": info, "rows": rows, "targets": targets}, indent=1))
        os.replace(tmp, out / "e2e.json")
        (out / "e2e.md").write_text(md)
    if final:
        print(md)
        if out is not None:
            log(plot(rows, out / "e2e.png"))


# --------------------------------------------------------------------------- shapes for the tuner


def record_shapes(args: Any, groups: set[str], path: str) -> int:
    """The problems the converted models hit in the selected cases, as a shapes file for the tuner."""
    dev, dtype = torch.device(args.device), DTYPES[args.dtype]
    seen: dict[str, list[dict]] = {}

    def merge(rec: Any) -> None:
        for op, probs in rec.shapes().items():
            for p in probs:
                if p not in seen.setdefault(op, []):
                    seen[op].append(p)

    cases = plan(args, groups)
    with torch.no_grad():
        for family in ("llama", "qwen"):
            fam = [c for c in cases if c.get("family") == family]
            if not fam:
                continue
            top = max(c.get("ctx", 0) + args.decode_room if c["kind"] == "decode" else c["S"] for c in fam)
            model = ops_adv.convert_model(build_decoder(family, args, dev, dtype, top + 64))
            kw = cache_kwarg(model)
            for c in fam:
                B = c["B"]
                if c["kind"] == "prefill":
                    with ops_adv.record() as rec:
                        model(torch.zeros(B, c["S"], dtype=torch.long, device=dev))
                else:
                    cache = static_cache(model, B, c["ctx"] + args.decode_room, dev, dtype)
                    model(torch.zeros(B, c["ctx"], dtype=torch.long, device=dev), **{kw: cache}, logits_to_keep=1)
                    with ops_adv.record() as rec:
                        model(torch.zeros(B, 1, dtype=torch.long, device=dev), **{kw: cache})
                merge(rec)
            del model
        if "resnet" in groups:
            import torchvision

            model = ops_adv.convert_model(getattr(torchvision.models, args.resnet)().to(dev, dtype).eval())
            x = torch.randn(args.image_batch, 3, args.image_size, args.image_size, device=dev, dtype=dtype)
            for xi in (x, x.contiguous(memory_format=torch.channels_last)):
                with ops_adv.record() as rec:
                    model(xi)
                merge(rec)
    Path(path).write_text(json.dumps(seen, indent=1))
    return sum(len(v) for v in seen.values())


# --------------------------------------------------------------------------- main


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, set[str]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=DTYPES, help="default: bf16 on CUDA, fp32 on the CPU")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes, 1 layer, ResNet-18, every CPU variant: a smoke run")
    ap.add_argument("--cases", default="all", help=f"comma-separated groups: {', '.join(GROUPS)} (default: all)")
    ap.add_argument("--variants", default="default",
                    help=f"'default' (what is relevant to each case), 'all', or a comma-separated subset of {', '.join(VARIANTS)}")
    ap.add_argument("--fullgraph", action="store_true", help="compile with fullgraph=True (a graph break fails the variant)")
    ap.add_argument("--size", choices=("8b", "small", "tiny"), help="decoder shapes (default: 8b on CUDA, small on the CPU)")
    ap.add_argument("--layers", type=int, help="decoder layers (default 4 on CUDA, 2 on the CPU, 1 with --tiny)")
    ap.add_argument("--prefill", help="Llama prefill B:S pairs (default 1:2048,8:512; CPU 1:64)")
    ap.add_argument("--decode-batch", help="Llama decode batch sizes (default 1,8,32; CPU 1,2)")
    ap.add_argument("--contexts", help="Llama decode context lengths (default 1024,8192; CPU 32,64)")
    ap.add_argument("--decode-room", type=int, help="static cache slots beyond the context (default 256; CPU 16)")
    ap.add_argument("--qwen-prefill", help="Qwen prefill B:S (default 1:2048; CPU 1:64)")
    ap.add_argument("--qwen-decode", help="Qwen decode B:context (default 8:1024; CPU 2:32)")
    ap.add_argument("--resnet", default=None, help="torchvision model (default resnet50; resnet18 with --tiny)")
    ap.add_argument("--image-batch", type=int, help="ResNet batch (default 32; CPU 2)")
    ap.add_argument("--image-size", type=int, help="ResNet image side (default 224; CPU 32)")
    ap.add_argument("--rounds", type=int, help="interleaved rounds (default 7 on CUDA, 2 on the CPU)")
    ap.add_argument("--reps", type=int, help="decode steps timed per variant per round (default 10; CPU 2)")
    ap.add_argument("--case-timeout", type=float, help="seconds a case's process may run (default 300 on CUDA, 900 on the CPU)")
    ap.add_argument("--deadline-s", type=float, help="start no case after this many seconds; cut the running one there")
    ap.add_argument("--retries", type=int, default=2, help="runs of a case again without a variant that killed its process")
    ap.add_argument("--in-process", action="store_true", help="run the cases in this process (debugging)")
    ap.add_argument("--record-shapes", metavar="PATH", help="only write the problems the selected cases hit (for the tuner)")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="write one report from e2e.json files of split runs")
    ap.add_argument("--out", help="folder for e2e.json, e2e.md and e2e.png (rewritten after every case)")
    args = ap.parse_args(argv)
    if args.merge:
        if not args.out:
            ap.error("--merge needs --out")
        return args, set()
    gpu = args.device.startswith("cuda")
    if gpu and not torch.cuda.is_available():
        ap.error("--device cuda but torch sees no GPU: pass --device cpu (and --tiny for a smoke run)")
    tiny = args.tiny
    pairs = lambda s: [tuple(map(int, p.split(":"))) for p in s.split(",")]  # noqa: E731
    try:
        args.dtype = args.dtype or ("bf16" if gpu else "fp32")
        args.size = args.size or ("tiny" if tiny else "8b" if gpu else "small")
        args.layers = args.layers or (1 if tiny else 4 if gpu else 2)
        args.prefill = pairs(args.prefill or ("1:16" if tiny else "1:2048,8:512" if gpu else "1:64"))
        args.decode_batch = [int(b) for b in (args.decode_batch or ("1,8" if tiny else "1,8,32" if gpu else "1,2")).split(",")]
        args.contexts = [int(c) for c in (args.contexts or ("16" if tiny else "1024,8192" if gpu else "32,64")).split(",")]
        args.qwen_prefill = pairs(args.qwen_prefill or ("1:16" if tiny else "1:2048" if gpu else "1:64"))[0]
        args.qwen_decode = pairs(args.qwen_decode or ("8:16" if tiny else "8:1024" if gpu else "2:32"))[0]
    except ValueError:
        ap.error("--prefill/--qwen-* take B:S pairs, --decode-batch/--contexts integers")
    args.decode_room = args.decode_room if args.decode_room is not None else (8 if tiny else 256 if gpu else 16)
    args.resnet = args.resnet or ("resnet18" if tiny else "resnet50")
    args.image_batch = args.image_batch or (32 if gpu and not tiny else 2)  # training BatchNorm needs 2
    args.image_size = args.image_size or (32 if tiny or not gpu else 224)
    args.rounds = args.rounds or (2 if tiny else 7 if gpu else 2)
    args.reps = args.reps or (2 if tiny or not gpu else 10)
    args.case_timeout = args.case_timeout or (300.0 if gpu else 900.0)
    if args.variants not in ("default", "all"):
        bad = [v for v in args.variants.split(",") if v.strip() not in VARIANTS]
        if bad:
            ap.error(f"--variants: unknown {bad}; choose from {', '.join(VARIANTS)}, or default, all")
    elif tiny and args.variants == "default":
        args.variants = "all"
    groups = set(GROUPS) if args.cases == "all" else {c.strip() for c in args.cases.split(",") if c.strip()}
    if groups - set(GROUPS):
        ap.error(f"--cases: unknown {sorted(groups - set(GROUPS))}; choose from {', '.join(GROUPS)}")
    return args, groups


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child_main(argv[1])
    args, groups = parse(argv)
    if args.merge:
        try:
            parts = [json.loads(Path(p).read_text()) for p in args.merge]
        except (OSError, ValueError) as e:
            print(f"e2e_model: cannot read {e}", file=sys.stderr)
            return 2
        write(Path(args.out), dict(parts[0]["info"], merged=len(parts)), [r for p in parts for r in p["rows"]])
        return 0
    if args.record_shapes:
        limit_recompiles()
        n = record_shapes(args, groups, args.record_shapes)
        log(f"wrote {n} problems to {args.record_shapes}")
        return 0
    dev = torch.device(args.device)
    info = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or platform.machine(),
            "torch": torch.__version__, "transformers": __import__("transformers").__version__,
            "python": platform.python_version(), "dtype": args.dtype, "layers": args.layers, "size": args.size,
            "rounds": args.rounds, "decode_reps": args.reps, "decode_room": args.decode_room,
            "table": os.environ.get("OPS_ADV_TABLE"), "variants": args.variants, "fullgraph": args.fullgraph,
            "isolated": not args.in_process, "threads": torch.get_num_threads()}
    cases = plan(args, groups)
    log(f"{len(cases)} cases, variants {args.variants}")
    out = Path(args.out) if args.out else None
    deadline = time.monotonic() + args.deadline_s if args.deadline_s else None
    rows: list[dict] = []

    def on_term(*_: Any) -> None:  # `timeout` ends a run with SIGTERM: stop the child, report the cases done
        if Child.current is not None:
            Child.stop(Child.current)
        sys.exit(124)

    signal.signal(signal.SIGTERM, on_term)
    try:
        with tempfile.TemporaryDirectory(prefix="e2e-") as work:
            for case in cases:
                if args.in_process:
                    row = run_case(case, args, Progress(None), {})
                else:
                    row = isolated(case, args, Path(work), deadline)
                rows.append(row)
                info["seconds"] = round(time.perf_counter() - T0, 1)
                write(out, dict(info, partial=True), rows, final=False)
                log(f"case done: {row['case']}" + (f" ({row['error']})" if row.get("error") else ""))
    except BaseException as e:  # SIGTERM (SystemExit), ^C or an error: the report says the run was cut short
        info["stopped"] = short_error(e)
        raise
    finally:
        info["seconds"] = round(time.perf_counter() - T0, 1)
        write(out, info, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
