"""convert_model works inside a default-device context (`with torch.device(...)`), as models are
often built: its probes make their inputs on the CPU explicitly."""
from __future__ import annotations

import copy

import pytest
import torch

import ops_adv

transformers = pytest.importorskip("transformers")


def test_convert_inside_a_default_device_context():
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (1, 6))
    with torch.no_grad():
        want = model(ids).logits
        with torch.device("meta"):  # any default device other than the weights' own
            conv = ops_adv.convert_model(copy.deepcopy(model))
        got = conv(ids).logits
    assert any(r["converted"] == "yes" and "RMS" in r["type"] for r in ops_adv.explain_model(conv))
    torch.testing.assert_close(got, want)
