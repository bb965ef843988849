"""Decode with a static KV cache through convert_model: same tokens, same logits, decode_attention hit."""
from __future__ import annotations

import copy
import importlib.util
import inspect

import pytest
import torch

import ops_adv
from ops_adv.models import hf as _convert

transformers = pytest.importorskip("transformers")


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


def _static_cache(model, batch: int, capacity: int):
    from transformers import StaticCache

    params = inspect.signature(StaticCache.__init__).parameters
    if "max_batch_size" in params:  # transformers 4.x
        return StaticCache(config=model.config, max_batch_size=batch, max_cache_len=capacity, dtype=torch.float32)
    return StaticCache(config=model.config, max_cache_len=capacity)


def _greedy(model, prompt: torch.Tensor, steps: int, capacity: int):
    """Prefill the prompt into a static cache, then `steps` one-token decode steps; tokens and step logits."""
    cache = _static_cache(model, prompt.shape[0], capacity)
    name = "cache" if "cache" in inspect.signature(model.model.forward).parameters else "past_key_values"
    tokens, logits = [], []
    with torch.no_grad():
        out = model(prompt, **{name: cache})
        nxt = out.logits[:, -1:].argmax(-1)
        pos = prompt.shape[1]
        for _ in range(steps):
            tokens.append(nxt)
            kw = {name: cache}
            if "cache_position" in inspect.signature(model.forward).parameters:  # transformers 4.x
                kw["cache_position"] = torch.tensor([pos])
            out = model(nxt, **kw)
            logits.append(out.logits[:, -1])
            nxt = out.logits[:, -1:].argmax(-1)
            pos += 1
    return torch.cat(tokens, 1), torch.stack(logits, 1)


@pytest.fixture
def no_table():
    ops_adv.load_table("")
    yield
    ops_adv.load_table("")


@pytest.mark.parametrize("batch", [1, 3])
def test_static_cache_decode_matches_eager_and_runs_decode_attention(no_table, batch):
    ref = _llama()
    model = ops_adv.convert_model(copy.deepcopy(ref))
    prompt = torch.randint(0, 256, (batch, 11), generator=torch.Generator().manual_seed(batch))
    want_tokens, want_logits = _greedy(ref, prompt, 8, capacity=40)  # capacity > valid length
    _convert.ROUTE_LOG = routes = []
    try:
        got_tokens, got_logits = _greedy(model, prompt, 8, capacity=40)
    finally:
        _convert.ROUTE_LOG = None
    assert torch.equal(got_tokens, want_tokens)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4)
    layers = model.config.num_hidden_layers
    decode_routes = routes[layers:]  # the prefill's calls come first
    assert len(decode_routes) == 8 * layers
    assert all(r.startswith("decode_attention") or r == "sdpa (decode_attention not installed)" for r in decode_routes), \
        set(decode_routes)
    if importlib.util.find_spec("ops_adv.ops.decode_attention") is None:
        pytest.skip("ops_adv.ops.decode_attention is not there yet: decode steps ran SDPA (tokens and logits checked)")
    assert decode_routes == ["decode_attention"] * len(decode_routes)


def test_decode_steps_call_decode_attention_with_valid_lengths(no_table, monkeypatch):
    """The kernel entry point itself is called, with seq_lens equal to the filled length (no host sync needed)."""
    decode = pytest.importorskip("ops_adv.ops.decode_attention")
    seen = []
    real = decode.decode_attention

    def spy(q, k, v, seq_lens=None, **kw):
        seen.append((q.shape[2], k.shape[2], None if seq_lens is None else seq_lens.tolist(), kw.get("causal")))
        return real(q, k, v, seq_lens, **kw)

    monkeypatch.setattr(decode, "decode_attention", spy)
    model = ops_adv.convert_model(_llama())
    prompt = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(7))
    _greedy(model, prompt, 3, capacity=16)
    layers = model.config.num_hidden_layers
    assert [s[2] for s in seen] == [[6, 6]] * layers + [[7, 7]] * layers + [[8, 8]] * layers
    assert all(s[0] == 1 and s[1] == 16 and s[3] is False for s in seen)


def test_padding_masks_run_decode_attention_with_a_key_mask(no_table, monkeypatch):
    """A 2-D padding mask (left padding, and a hole further on) reaches decode_attention as a key mask of the
    keys it hides; the tokens equal eager's."""
    from ops_adv.ops import decode_attention as mod

    ref = _llama()
    model = ops_adv.convert_model(copy.deepcopy(ref))
    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, :2] = 0  # left padding
    mask[1, 3] = 0  # a hole: a mask is not always a range
    seen, real = [], mod.decode_attention

    def spy(q, k, v, seq_lens=None, **kw):
        seen.append(kw["key_mask"][:, :6].tolist())
        return real(q, k, v, seq_lens, **kw)

    monkeypatch.setattr(mod, "decode_attention", spy)
    _convert.ROUTE_LOG = routes = []
    try:
        with torch.no_grad():
            got = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, cache_implementation="static")
    finally:
        _convert.ROUTE_LOG = None
    with torch.no_grad():
        want = ref.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, cache_implementation="static")
    assert torch.equal(got, want)
    layers = model.config.num_hidden_layers
    assert routes[layers:] == ["decode_attention"] * (3 * layers)  # after the prefill, every decode step
    assert seen and all(s == mask.bool().tolist() for s in seen)
