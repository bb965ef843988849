"""Nothing tuned for the device: a converted model runs the original modules' code (issue 30's no-table cost).

`_dispatch.passthrough` holds where the loaded table has no winner for the device class, the vendor kernels are
the defaults and nothing records or counts calls; then converted Linear / norm layers, fused blocks, merged
projections, rope and attention run what the original model runs, after one check. The rest of the suite runs
with OPS_ADV_PASSTHROUGH=0 (conftest) to test the dispatch paths; here it is on, as users have it.
"""
from __future__ import annotations

import copy
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

import ops_adv  # noqa: E402
from ops_adv import _dispatch, _table  # noqa: E402
from ops_adv.models import hf as _convert  # noqa: E402


@pytest.fixture
def on(monkeypatch):
    monkeypatch.delenv("OPS_ADV_PASSTHROUGH", raising=False)
    ops_adv.load_table("")
    yield
    monkeypatch.setenv("OPS_ADV_PASSTHROUGH", "0")
    ops_adv.load_table("")


def _families():
    import transformers as tf

    tiny = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
    return {
        "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**tiny)),
        "mixtral": lambda: tf.MixtralForCausalLM(tf.MixtralConfig(**tiny, num_local_experts=4)),
        "opt": lambda: tf.OPTForCausalLM(tf.OPTConfig(vocab_size=128, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                                      num_attention_heads=4, max_position_embeddings=64,
                                                      word_embed_proj_dim=64)),
        "gpt_neox": lambda: tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                                                   num_hidden_layers=2, num_attention_heads=4,
                                                                   max_position_embeddings=64)),
        "bert": lambda: tf.BertForMaskedLM(tf.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2,
                                                         num_attention_heads=4, intermediate_size=128,
                                                         max_position_embeddings=64)),
    }


def _pair(family: str):
    torch.manual_seed(0)
    ref = _families()[family]().eval()
    return ref, ops_adv.convert_model(copy.deepcopy(ref))


@pytest.mark.parametrize("family", list(_families()))
def test_untuned_calls_are_the_original_model(on, family):
    ref, model = _pair(family)
    ids = torch.randint(1, 120, (2, 9), generator=torch.Generator().manual_seed(1))
    before = dict(ops_adv.misses())
    with torch.no_grad():
        want, got = ref(ids).logits, model(ids).logits
    assert torch.equal(got, want)  # the very same code ran: bit for bit
    assert dict(ops_adv.misses()) == before  # no call reached dispatch
    # training: the same loss and gradients, to every parameter
    ref.train(), model.train()
    for m in (ref, model):
        m.zero_grad()
        torch.manual_seed(5)  # the same dropout masks: the same code draws them in the same order
        m(ids, labels=ids).loss.backward()
    for (n, p), (_, q) in zip(ref.named_parameters(), model.named_parameters()):
        assert (p.grad is None) == (q.grad is None), n
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad), n


def test_generate_and_attention_routes(on):
    ref, model = _pair("llama")
    ids = torch.randint(1, 120, (2, 7), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, cache_implementation="static", pad_token_id=0)
    _convert.ROUTE_LOG = routes = []
    try:
        with torch.no_grad():
            got, want = model.generate(ids, **kw), ref.generate(ids, **kw)
    finally:
        _convert.ROUTE_LOG = None
    assert torch.equal(got, want)
    assert routes and set(routes) == {"original"}  # what explain_model reports as the routes calls took


def _cpu_table(tmp_path):
    import kernel_space

    prob = {"M": 64, "N": 128, "K": 96, "dtype": "fp32", "trans_a": False, "trans_b": False}
    w = [{"op": "gemm", "problem": prob, "impl": "cpu_blocked", "params": {"block_m": 32, "block_n": 64, "block_k": 0},
          "kernel_version": kernel_space.get_impl("gemm", "cpu_blocked").version, "median_ms": 1.0,
          "vendor_impl": "torch_matmul", "vendor_ms": 2.0, "speedup": 2.0}]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"format": _table.FORMAT, "format_version": _table.FORMAT_VERSION, "device_class": "cpu",
                                "fingerprint": {}, "winners": w, "checksum": _table.checksum(w)}))
    return str(path)


def test_a_table_census_or_switch_turns_it_off(on, tmp_path, monkeypatch):
    cpu = torch.device("cpu")
    assert _dispatch.passthrough(cpu)
    ref, model = _pair("llama")
    ids = torch.randint(1, 120, (1, 5), generator=torch.Generator().manual_seed(3))
    with ops_adv.census() as c:  # a census counts every call: they dispatch
        with torch.no_grad():
            model(ids)
    assert c.calls > 0 and _dispatch.passthrough(cpu)
    ops_adv.load_table(_cpu_table(tmp_path))  # a winner for this device class: every call dispatches
    assert not _dispatch.passthrough(cpu)
    before = sum(ops_adv.misses().values())
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=1e-4, atol=1e-5)
    assert sum(ops_adv.misses().values()) > before
    ops_adv.load_table("")
    assert _dispatch.passthrough(cpu)
    monkeypatch.setenv("OPS_ADV_PASSTHROUGH", "0")
    ops_adv.load_table("")
    assert not _dispatch.passthrough(cpu)


def _graph_ops(model, ids):
    """The call targets of the FX graphs torch.compile(fullgraph) makes of `model`, and its output."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")])
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, backend=backend, fullgraph=True)(ids).logits
    return graphs, out


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_compile_traces_the_original_model(on, family, monkeypatch):
    """Under torch.compile the check is made when the graph is traced: with nothing tuned the compiled graph is
    the original model's, op for op (Mixtral keeps transformers' experts implementation), and the model matches.
    OPS_ADV_COMPILE_OPERATORS=1 keeps ops-adv's operators there."""
    ref, model = _pair(family)
    ids = torch.randint(1, 120, (1, 6), generator=torch.Generator().manual_seed(4))
    want_ops, want = _graph_ops(ref, ids)
    got_ops, got = _graph_ops(model, ids)
    assert got_ops == want_ops
    assert not any("ops_adv" in t for g in got_ops for t in g)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("OPS_ADV_COMPILE_OPERATORS", "1")
    kept_ops, kept = _graph_ops(model, ids)
    assert any("ops_adv" in t for g in kept_ops for t in g)
    torch.testing.assert_close(kept, want, rtol=1e-4, atol=1e-4)
