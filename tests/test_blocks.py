"""convert_model's block fusion: residual add + RMS norm, SiLU gate * up, rotary embedding."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import ops_adv
from ops_adv.models import blocks as _blocks

transformers = pytest.importorskip("transformers")


def _tiny(cls_name: str, **extra):
    cfg_cls = getattr(transformers, cls_name.replace("ForCausalLM", "Config"))
    cfg = cfg_cls(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=101, max_position_embeddings=64, **extra)
    torch.manual_seed(0)
    return getattr(transformers, cls_name)(cfg).eval()


@pytest.mark.parametrize("family", ["LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"])
def test_decoder_blocks_fuse_and_keep_their_logits(family):
    model = _tiny(family)
    ids = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
    conv = ops_adv.convert_model(copy.deepcopy(model))
    fused = {r["module"]: r["why"] for r in ops_adv.explain_model(conv) if r["why"].startswith("fused")}
    assert "add_rms_norm" in fused["model.layers.0"] and "add_rms_norm" in fused["model.layers.1"]
    assert "swiglu" in fused["model.layers.0.mlp"]
    assert "rope" in fused["model.layers.1.self_attn"]
    with torch.no_grad():
        got = conv(ids).logits
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    # the converted model's state is the original's, key for key
    assert conv.state_dict().keys() == model.state_dict().keys()


def test_fused_ops_run_in_a_converted_block():
    model = _tiny("LlamaForCausalLM")
    conv = ops_adv.convert_model(model)
    ids = torch.randint(0, 101, (1, 5))
    with ops_adv.profiler.ProfileContext() as prof, torch.no_grad():
        conv(ids)
    ops = {c["op"] for c in prof.calls}
    assert {"add_rms_norm", "swiglu", "rope"} <= ops, ops


class _PostNormBlock(nn.Module):
    """add then LayerNorm: not an RMS norm, so not fused."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, h):
        residual = h
        h = self.lin(h)
        h = residual + h
        residual = h
        h = self.norm(h)
        return h + residual


class _SuperBlock(nn.Sequential):
    def forward(self, x):
        return super().forward(x) * 2


def test_blocks_that_do_not_match_stay_as_they_are():
    block = _PostNormBlock()
    new, done, why = _blocks.rewrite_forward(block, lambda m: isinstance(m, nn.RMSNorm))
    assert new is None and done == [] and "no residual-add" in why
    sb = _SuperBlock(nn.Linear(4, 4))
    new, _, why = _blocks.rewrite_forward(sb, lambda m: True)
    assert new is None and "closes over" in why
    x = torch.randn(3, 8)
    conv = ops_adv.convert_model(copy.deepcopy(block))
    torch.testing.assert_close(conv(x), block(x))
    assert not any(r["why"].startswith("fused") for r in ops_adv.explain_model(conv))


def test_a_gate_that_is_not_silu_is_not_fused():
    model = _tiny("LlamaForCausalLM", hidden_act="gelu")
    conv = ops_adv.convert_model(model)
    mlp = [r for r in ops_adv.explain_model(conv) if r["module"] == "model.layers.0.mlp"]
    assert not mlp or "swiglu" not in mlp[0]["why"]


def test_compiled_converted_llama_matches_eager():
    model = _tiny("LlamaForCausalLM")
    ids = torch.randint(0, 101, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(ids).logits
        got = torch.compile(ops_adv.convert_model(copy.deepcopy(model)))(ids).logits
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
