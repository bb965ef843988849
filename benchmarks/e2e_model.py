#!/usr/bin/env python
"""End to end: a model as its user runs it, eager, converted, compiled and compiled-converted.

Models are built from configs with random weights (nothing is downloaded):
- a Llama-style decoder from transformers: prefill (B x S tokens) and decode with a KV cache
  (greedy generate of --new-tokens after a --prompt-len prompt; per new token);
- torchvision's ResNet-50: inference, and one training step (forward, backward, SGD).

Each case runs the four variants interleaved for --rounds rounds after warm-up (compilation
included in warm-up) and reports the median per variant, its speed against eager, and the KL
divergence of the variant's logits from eager's (the seeds ask < 0.01).

    python benchmarks/e2e_model.py --device cpu --out DIR             # small shapes for a CPU
    OPS_ADV_TABLE=table.json python benchmarks/e2e_model.py --device cuda --size 8b --dtype bf16
"""
from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import ops_adv  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
LLAMA = {  # (hidden, intermediate, layers, heads, kv heads, vocab)
    "small": (256, 688, 2, 4, 4, 2048),
    "small-gqa": (256, 688, 2, 8, 2, 2048),
    "8b": (4096, 14336, 4, 32, 8, 128256),
}


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(fn: Callable[[], Any], dev: torch.device) -> float:
    sync(dev)
    t0 = time.perf_counter()
    fn()
    sync(dev)
    return (time.perf_counter() - t0) * 1e3


def kl(ref: torch.Tensor, out: torch.Tensor) -> float:
    p = torch.log_softmax(ref.float().reshape(-1, ref.shape[-1]), -1)
    q = torch.log_softmax(out.float().reshape(-1, out.shape[-1]), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def variants(model: torch.nn.Module, dynamic: bool | None) -> dict[str, torch.nn.Module]:
    """Compiled variants compile `forward` on a copy, so `generate()` runs the compiled forward too."""
    converted = ops_adv.convert_model(copy.deepcopy(model))
    out = {"eager": model, "converted": converted}
    for name, m in (("compile", model), ("compile(converted)", converted)):
        c = copy.deepcopy(m) if name == "compile" else ops_adv.convert_model(copy.deepcopy(model))
        c.forward = torch.compile(c.forward, dynamic=dynamic)
        out[name] = c
    return out


def run_case(name: str, calls: dict[str, Callable[[], Any]], logits: dict[str, Callable[[], torch.Tensor]],
             dev: torch.device, rounds: int, warmup: int, per: int = 1) -> dict:
    for v, fn in calls.items():
        t0 = time.perf_counter()
        for _ in range(warmup):
            fn()
        sync(dev)
        print(f"  {name} {v}: warm-up {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    samples: dict[str, list[float]] = {v: [] for v in calls}
    for _ in range(rounds):
        for v, fn in calls.items():
            samples[v].append(timed(fn, dev) / per)
    ref = logits["eager"]() if logits else None
    row = {"case": name, "variants": {}}
    base = statistics.median(samples["eager"])
    for v in calls:
        med = statistics.median(samples[v])
        row["variants"][v] = {"ms": med, "speedup": base / med, "samples": samples[v],
                              "kl": kl(ref, logits[v]()) if logits else None}
    return row


def llama_cases(args: Any, dev: torch.device, dtype: torch.dtype) -> list[dict]:
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, layers, heads, kv, vocab = LLAMA[args.size]
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=8192)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(dev, dtype).eval()
    vs = variants(model, dynamic=None)
    rows = []
    g = torch.Generator(device="cpu").manual_seed(0)
    for B, S in args.prefill:
        ids = torch.randint(0, vocab, (B, S), generator=g).to(dev)

        def call(m=None, ids=ids):
            with torch.no_grad():
                return m(ids).logits

        calls = {v: (lambda m=m, ids=ids: call(m, ids)) for v, m in vs.items()}
        rows.append(run_case(f"llama-{args.size} prefill B={B} S={S}", calls, calls, dev, args.rounds, 2))
    for B in args.decode_batch:
        ids = torch.randint(0, vocab, (B, args.prompt_len), generator=g).to(dev)
        n = args.new_tokens

        def gen(m, ids=ids, n=n):
            with torch.no_grad():
                return m.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

        calls = {v: (lambda m=m: gen(m)) for v, m in vs.items()}
        row = run_case(f"llama-{args.size} decode B={B} prompt={args.prompt_len} (+{n} tokens, ms/token)", calls, {}, dev,
                       args.rounds, 1, per=n)
        ref = gen(vs["eager"])
        for v, m in vs.items():
            row["variants"][v]["same_tokens"] = bool(torch.equal(gen(m), ref))
        rows.append(row)
    return rows


def resnet_cases(args: Any, dev: torch.device, dtype: torch.dtype) -> list[dict]:
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet50().to(dev, dtype).eval()
    if dev.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
    x = torch.randn(args.image_batch, 3, args.image_size, args.image_size, device=dev, dtype=dtype)
    if dev.type == "cuda":
        x = x.contiguous(memory_format=torch.channels_last)
    vs = variants(model, dynamic=False)

    def infer(m):
        with torch.no_grad():
            return m(x)

    calls = {v: (lambda m=m: infer(m)) for v, m in vs.items()}
    rows = [run_case(f"resnet50 inference B={args.image_batch} {args.image_size}px", calls, calls, dev, args.rounds, 2)]
    train = {}
    for v, m in vs.items():
        tm = (ops_adv.convert_model(copy.deepcopy(model)) if "converted" in v else copy.deepcopy(model)).train()
        opt = torch.optim.SGD(tm.parameters(), lr=1e-3)
        fwd = torch.compile(tm) if v.startswith("compile") else tm

        def step(fwd=fwd, opt=opt):
            opt.zero_grad(set_to_none=True)
            loss = fwd(x).float().logsumexp(-1).mean()
            loss.backward()
            opt.step()
            return loss

        train[v] = step
    rows.append(run_case(f"resnet50 training step B={args.image_batch} {args.image_size}px", train, {}, dev, args.rounds, 2))
    return rows


def markdown(rows: list[dict]) -> str:
    names = list(rows[0]["variants"]) if rows else []
    out = ["| case | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for r in rows:
        cells = []
        for v in names:
            d = r["variants"][v]
            cell = f"{d['ms']:.2f} ms ({d['speedup']:.2f}x)"
            if d.get("kl") is not None:
                cell += f", KL {d['kl']:.1e}"
            if d.get("same_tokens") is False:
                cell += ", other tokens"
            cells.append(cell)
        out.append(f"| {r['case']} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=DTYPES, help="default: bf16 on CUDA, fp32 on the CPU")
    ap.add_argument("--models", default="llama,resnet50")
    ap.add_argument("--size", choices=LLAMA, default=None, help="Llama shape (default: 8b on CUDA, small on the CPU)")
    ap.add_argument("--prefill", default=None, help="B:S pairs, comma-separated (default: 1:2048,8:512 on CUDA; 1:128 on CPU)")
    ap.add_argument("--decode-batch", default=None, help="batch sizes for decode (default: 1,32 on CUDA; 1 on CPU)")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--image-batch", type=int, default=None)
    ap.add_argument("--image-size", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", help="folder for e2e.json and e2e.md")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    gpu = dev.type == "cuda"
    dtype = DTYPES[args.dtype or ("bf16" if gpu else "fp32")]
    args.size = args.size or ("8b" if gpu else "small")
    args.prefill = [tuple(map(int, p.split(":"))) for p in (args.prefill or ("1:2048,8:512" if gpu else "1:128")).split(",")]
    args.decode_batch = [int(b) for b in (args.decode_batch or ("1,32" if gpu else "1")).split(",")]
    args.prompt_len = args.prompt_len or (512 if gpu else 32)
    args.new_tokens = args.new_tokens or (32 if gpu else 8)
    args.image_batch = args.image_batch or (32 if gpu else 2)
    args.image_size = args.image_size or (224 if gpu else 112)
    rows = []
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    if "llama" in models:
        rows += llama_cases(args, dev, dtype)
    if "resnet50" in models:
        rows += resnet_cases(args, dev, dtype)
    info = {"device": torch.cuda.get_device_name(dev) if gpu else platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version(),
            "dtype": str(dtype), "table": __import__("os").environ.get("OPS_ADV_TABLE"), "rounds": args.rounds}
    md = f"{info}\n\n" + markdown(rows)
    print(md)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "e2e.json").write_text(json.dumps({"info": info, "rows": rows}, indent=1))
        (out / "e2e.md").write_text(md + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
