#!/usr/bin/env python
"""One converted Llama decode step at B=8, captured in a CUDA graph and replayed: the case that
`compute-sanitizer --tool memcheck` runs over (bash benchmarks/gpu.sh sanitize).

    compute-sanitizer --tool memcheck python benchmarks/sanitize_decode.py [--batch 8] [--size medium]

A LlamaConfig with random weights (medium: hidden 2048, 16/4 heads of 128, 2 layers; tiny: hidden 64)
is converted with ops_adv.convert_model and decodes one token per sequence from a StaticCache filled
to --context. Kernels (--kernels): `ours` puts ops-adv's own first valid implementation and config
on every problem the step meets (a table file through ops_adv.load_table), so the Triton kernels run
under memcheck; `table` keeps OPS_ADV_TABLE; `default` runs every op's default. The step is run
eagerly, then captured (after a side-stream warm-up unless --no-warmup) and replayed --replays
times; each replay must match the eager step. Exit 1 on a mismatch.
"""
from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# this folder holds kernels.py, which would shadow the `kernels` package transformers imports
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

import ops_adv  # noqa: E402

SIZES = {  # hidden, intermediate, heads, kv heads, layers, vocab
    "tiny": (64, 128, 4, 2, 1, 256),
    "medium": (2048, 5632, 16, 4, 2, 32000),
}


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", choices=SIZES, default="medium")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=1000, help="tokens in the cache before the step (default 1000)")
    ap.add_argument("--kernels", choices=("ours", "table", "default"),
                    help="default: table when OPS_ADV_TABLE is set, else ours")
    ap.add_argument("--replays", type=int, default=3)
    ap.add_argument("--no-warmup", dest="warmup", action="store_false", help="capture right after the eager step")
    ap.add_argument("--out", help="JSON summary")
    args = ap.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    if args.device.startswith("cuda") and not cuda:
        ap.error("no CUDA device")
    dtype = torch.bfloat16 if cuda else torch.float32
    hidden, inter, heads, kv, layers, vocab = SIZES[args.size]
    capacity = args.context + 64
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=capacity)
    torch.manual_seed(0)
    with torch.device(dev):
        model = ops_adv.convert_model(LlamaForCausalLM(cfg).to(dtype).eval())
    if "max_batch_size" in inspect.signature(StaticCache.__init__).parameters:  # transformers 4.x
        cache = StaticCache(config=cfg, max_batch_size=args.batch, max_cache_len=capacity, device=dev, dtype=dtype)
    else:
        cache = StaticCache(config=cfg, max_cache_len=capacity)
    kw = "cache" if "cache" in inspect.signature(model.model.forward).parameters else "past_key_values"
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab, (args.batch, args.context), generator=g).to(dev)
    tok = torch.randint(0, vocab, (args.batch, 1), generator=g).to(dev)
    summary: dict = {"device": torch.cuda.get_device_name(dev) if cuda else "cpu", "torch": torch.__version__,
                     "size": args.size, "batch": args.batch, "context": args.context, "capacity": capacity}
    with torch.no_grad():
        model(prompt, **{kw: cache}, logits_to_keep=1)
        lengths = [layer.cumulative_length for layer in getattr(cache, "layers", []) if hasattr(layer, "cumulative_length")]
        extra = {} if lengths else {"cache_position": torch.tensor([args.context], device=dev)}

        def reset() -> None:
            for n in lengths:
                n.fill_(args.context)

        def step() -> torch.Tensor:
            return model(tok, **{kw: cache}, **extra).logits

        kernels = args.kernels or ("table" if os.environ.get("OPS_ADV_TABLE") else "ours")
        if kernels == "default":
            ops_adv.load_table("")
        elif kernels == "ours":
            tf = load("table_file")
            with ops_adv.record() as rec:
                reset()
                step()
            winners, backend = [], "cuda" if cuda else "cpu"
            for op, probs in rec.shapes().items():
                for p in probs:
                    pick = tf.first_ours(op, p, backend)
                    if pick is not None:
                        winners.append(tf.winner(op, p, *pick))
            path = os.path.join(tempfile.mkdtemp(), "ours.json")
            ops_adv.load_table(tf.write(path, winners, tf.device_class(dev)))
            summary["forced"] = [f"{w['op']}:{w['impl']} {w['params']}" for w in winners]
        summary["kernels"] = kernels
        reset()
        ref = step().float().clone()
        with ops_adv.profiler.ProfileContext() as prof:
            reset()
            step()
        summary["ran"] = sorted({f"{c['op']}:{c['impl']}({c['source']})" for c in prof.calls})
        print("ran:", ", ".join(summary["ran"]), flush=True)
        if not cuda:
            print("no CUDA: the eager step only", flush=True)
            return 0
        if args.warmup:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    reset()
                    step()
            torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        reset()
        t0 = time.perf_counter()
        with torch.cuda.graph(graph):
            out = step()
        torch.cuda.synchronize()
        summary["capture_s"] = round(time.perf_counter() - t0, 3)
        diffs = []
        for _ in range(args.replays):
            reset()
            graph.replay()
            torch.cuda.synchronize()
            diffs.append(float((out.float() - ref).abs().max()))
        scale = float(ref.abs().max())
        summary["replay_max_abs_diff"] = diffs
        summary["ok"] = all(d <= 2e-2 * max(scale, 1.0) for d in diffs)
    print(json.dumps(summary, indent=1), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
