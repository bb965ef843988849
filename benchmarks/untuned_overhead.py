"""Converted / original forward time with no table (issue 30: target <= 1.02, i.e. >= 0.98x the speed).

Tiny models from configs (random weights), 1 thread, eval and no_grad; each round times the original and the
converted model back to back (order alternating), and the result is the median of the per-round ratios.

    python benchmarks/untuned_overhead.py [--rounds 200]
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch

# this folder's kernels.py would shadow the `kernels` package transformers imports; the checkout's ops_adv, not an
# installed one, is what runs
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _models():
    import transformers as tf

    tiny = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
    yield "mixtral (1, 16)", tf.AutoModelForCausalLM.from_config(tf.MixtralConfig(**tiny, num_local_experts=4)), (1, 16)
    yield "opt (1, 16)", tf.AutoModelForCausalLM.from_config(tf.OPTConfig(
        vocab_size=128, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, word_embed_proj_dim=64)), (1, 16)
    yield "bert B=1 S=16", tf.BertModel(tf.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                                                      num_attention_heads=4, intermediate_size=128,
                                                      max_position_embeddings=64)), (1, 16)
    yield "llama (4, 128)", tf.AutoModelForCausalLM.from_config(tf.LlamaConfig(**{**tiny, "max_position_embeddings": 256})), (4, 128)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(1)
    import ops_adv

    ops_adv.load_table("")
    for name, ref, shape in _models():
        torch.manual_seed(0)
        ref.eval()
        conv = ops_adv.convert_model(copy.deepcopy(ref))
        ids = torch.randint(1, 120, shape, generator=torch.Generator().manual_seed(1))
        ratios = []
        with torch.no_grad():
            for m in (ref, conv) * 5:
                m(ids)
            for r in range(args.rounds):
                t = {}
                for m in ((ref, conv) if r % 2 else (conv, ref)):
                    t0 = time.perf_counter()
                    m(ids)
                    t[id(m)] = time.perf_counter() - t0
                ratios.append(t[id(conv)] / t[id(ref)])
        print(f"{name:16s} converted/original {statistics.median(ratios):.3f} "
              f"(quartiles {statistics.quantiles(ratios, n=4)[0]:.3f}-{statistics.quantiles(ratios, n=4)[2]:.3f})",
              flush=True)


if __name__ == "__main__":
    main()
