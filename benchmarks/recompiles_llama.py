#!/usr/bin/env python
"""Why a compiled, converted Llama recompiles during decode: greedy generate with TORCH_LOGS=recompiles.

    TORCH_LOGS=recompiles python benchmarks/recompiles_llama.py [--size 8b] [--converted]
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import ops_adv  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_model import LLAMA  # noqa: E402

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
m = LlamaForCausalLM(cfg).to(dev, torch.bfloat16).eval()
if args.converted:
    m = ops_adv.convert_model(m)
m.forward = torch.compile(m.forward)
ids = torch.randint(0, vocab, (1, 512), device=dev)
with torch.no_grad():
    m.generate(ids, max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False, pad_token_id=0)
print("done")
