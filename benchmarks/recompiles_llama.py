#!/usr/bin/env python
"""Why a compiled, converted Llama recompiles during decode: greedy generate with TORCH_LOGS=recompiles.

    TORCH_LOGS=recompiles python benchmarks/recompiles_llama.py [--size 8b] [--converted]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# this folder holds kernels.py, which would shadow the `kernels` package transformers imports
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

import ops_adv  # noqa: E402

# hidden, intermediate, layers, heads, kv heads, vocab
LLAMA = {"8b": (4096, 14336, 4, 32, 8, 128256), "small": (256, 688, 2, 8, 2, 2048)}

ap = argparse.ArgumentParser()
ap.add_argument("--size", default="8b", choices=LLAMA)
ap.add_argument("--converted", action="store_true")
ap.add_argument("--tokens", type=int, default=12)
args = ap.parse_args()
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

hidden, inter, layers, heads, kv, vocab = LLAMA[args.size]
torch.manual_seed(0)
dev = "cuda" if torch.cuda.is_available() else "cpu"
cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv)
m = LlamaForCausalLM(cfg).to(dev, torch.bfloat16 if dev == "cuda" else torch.float32).eval()
if args.converted:
    m = ops_adv.convert_model(m)
m.forward = torch.compile(m.forward)
ids = torch.randint(0, vocab, (1, 512 if dev == "cuda" else 32), device=dev)
with torch.no_grad():
    m.generate(ids, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False, pad_token_id=0)
print("done")
