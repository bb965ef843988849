"""Converted models compile whole and train as torch does: graph breaks (torch._dynamo.explain) and the
loss and gradients of a converted Llama (GQA, fused blocks) and ResNet-50 (conv+BN+ReLU) against the originals, on the CPU.

Run: python benchmarks/convert_checks.py
"""
import os
import sys

# This folder holds kernels.py, which would shadow the `kernels` package transformers imports.
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
sys.path.insert(0, os.path.dirname(_here))

import copy, torch, torchvision, transformers, ops_adv  # noqa: E401,E402
torch.manual_seed(0)
res = {}
# Llama (GQA) converted: fused blocks, ops_adv attention
cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=101, max_position_embeddings=64)
ref = transformers.LlamaForCausalLM(cfg).eval()
conv = ops_adv.convert_model(copy.deepcopy(ref))
ids = torch.randint(0, 101, (2, 9))
torch._dynamo.reset()
with torch.no_grad():
    e = torch._dynamo.explain(conv)(ids)
res["llama graphs/breaks"] = (e.graph_count, e.graph_break_count, [r.reason[:120] for r in e.break_reasons[:2]])
# backward: converted llama in train mode vs original
ref.train(); conv.train()
l1 = ref(ids, labels=ids).loss; l1.backward()
l2 = conv(ids, labels=ids).loss; l2.backward()
err = max(((p2.grad - p1.grad).norm() / p1.grad.norm().clamp_min(1e-30)).item()
          for (n, p1), (_, p2) in zip(ref.named_parameters(), conv.named_parameters()) if p1.grad is not None)
res["llama loss diff, max grad rel err"] = (abs(l1.item() - l2.item()), err)
# ResNet-50 eval (fused conv+bn+relu) and train backward
m = torchvision.models.resnet50().eval()
c = ops_adv.convert_model(copy.deepcopy(m))
x = torch.randn(2, 3, 64, 64)
torch._dynamo.reset()
with torch.no_grad():
    e = torch._dynamo.explain(c)(x)
res["resnet50 eval graphs/breaks"] = (e.graph_count, e.graph_break_count, [r.reason[:120] for r in e.break_reasons[:2]])
m.train(); c.train()
y1 = m(x).square().mean(); y1.backward()
y2 = c(x).square().mean(); y2.backward()
err = max(((p2.grad - p1.grad).norm() / p1.grad.norm().clamp_min(1e-30)).item()
          for (n, p1), (_, p2) in zip(m.named_parameters(), c.named_parameters()) if p1.grad is not None)
res["resnet50 train loss diff, max grad rel err"] = (abs(y1.item() - y2.item()), err)
torch._dynamo.reset()
e = torch._dynamo.explain(c)(x)
res["resnet50 train graphs/breaks"] = (e.graph_count, e.graph_break_count, [r.reason[:120] for r in e.break_reasons[:2]])
for k, v in res.items(): print(k, v)
