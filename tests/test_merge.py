"""Merged projections (ops_adv.models.merge): q/k/v and gate/up of a converted block as one gemm, the
weights held once, and the model the same in every other respect."""
from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.nn as nn

import ops_adv
from ops_adv._dispatch import start_recording, stop_recording

transformers = pytest.importorskip("transformers")


def _tiny(family: str = "Llama", **extra):
    cfg = getattr(transformers, f"{family}Config")(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=101,
                                                   max_position_embeddings=64, **extra)
    torch.manual_seed(0)
    return getattr(transformers, f"{family}ForCausalLM")(cfg).eval()


IDS = torch.randint(0, 101, (2, 9), generator=torch.Generator().manual_seed(1))


def _storages(model: nn.Module) -> int:
    """Bytes of the distinct storages behind the parameters."""
    seen = {}
    for p in model.parameters():
        s = p.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _gemms(model: nn.Module) -> set[tuple[int, int]]:
    """(N, K) of the gemm problems a no-grad forward runs."""
    seen = start_recording()
    try:
        with torch.no_grad():
            model(IDS)
    finally:
        stop_recording(seen)
    return {(k[1][1], k[1][2]) for k in seen if k[0] == "gemm"}


@pytest.mark.parametrize("family", ["Llama", "Qwen2", "Qwen3"])
def test_projections_run_as_one_gemm_with_the_same_logits_and_memory(family):
    model = _tiny(family)
    with torch.no_grad():
        want = model(IDS).logits
    before = _storages(model)
    conv = ops_adv.convert_model(copy.deepcopy(model))
    why = {r["module"]: r["why"] for r in ops_adv.explain_model(conv)}
    assert "q_proj, k_proj, v_proj -> one gemm (merged weights)" in why["model.layers.0.self_attn"]
    assert "act_fn(gate_proj) * up_proj -> one gemm (merged weights), swiglu" in why["model.layers.1.mlp"]
    a = conv.model.layers[0].self_attn
    assert a.q_proj.weight.untyped_storage().data_ptr() == a.v_proj.weight.untyped_storage().data_ptr()
    assert _storages(conv) == before  # the weights are held once
    q, k = a.q_proj.weight.shape[0], a.k_proj.weight.shape[0]
    assert _gemms(conv) >= {(q + 2 * k, 64), (2 * 96, 64)}
    assert not _gemms(conv) & {(k, 64), (96, 64)}  # no separate k, v, gate or up projection ran
    with torch.no_grad():
        got = conv(IDS).logits
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert conv.state_dict().keys() == model.state_dict().keys()
    for key, v in model.state_dict().items():
        torch.testing.assert_close(conv.state_dict()[key], v, atol=0, rtol=0)


def test_the_model_follows_every_way_its_weights_change():
    """Weights replaced, edited in place, loaded, moved: the converted model computes what the original does."""
    model = _tiny()
    conv = ops_adv.convert_model(copy.deepcopy(model))

    def same():
        with torch.no_grad():
            torch.testing.assert_close(conv(IDS).logits, model(IDS).logits, atol=2e-5, rtol=2e-5)

    for m in (model, conv):  # in place, through .data (EMA, weight surgery)
        m.model.layers[0].self_attn.k_proj.weight.data.mul_(3)
        m.model.layers[1].mlp.up_proj.weight.data[5:9] = 0.5
    same()
    g = torch.Generator().manual_seed(7)
    for m in (model, conv):  # a new tensor put in place of one parameter: that layer no longer sits with the others
        m.model.layers[0].self_attn.v_proj.weight.data = torch.randn(32, 64, generator=g)
        g.manual_seed(7)
    same()
    other = _tiny()
    for p in other.parameters():
        p.data.normal_(generator=g)
    sd = other.state_dict()
    model.load_state_dict(sd)
    conv.load_state_dict(sd)
    same()
    model.load_state_dict(_tiny().state_dict(), assign=True)
    conv.load_state_dict(_tiny().state_dict(), assign=True)
    same()
    model.double()
    conv.double()  # a dtype or device change merges the weights again
    a = conv.model.layers[1].self_attn
    assert a.q_proj.weight.dtype == torch.float64
    assert a.q_proj.weight.untyped_storage().data_ptr() == a.v_proj.weight.untyped_storage().data_ptr()
    with torch.no_grad():
        torch.testing.assert_close(conv(IDS).logits, model(IDS).logits)
    conv.to(torch.float64)  # a no-op move keeps it as it is
    assert a.q_proj.weight.untyped_storage().data_ptr() == a.v_proj.weight.untyped_storage().data_ptr()


def test_training_gives_every_projection_its_own_gradient():
    model = _tiny().train()
    conv = ops_adv.convert_model(copy.deepcopy(model))
    for m in (model, conv):
        m(IDS, labels=IDS).loss.backward()
    got = dict(conv.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name].grad, p.grad, atol=1e-5, rtol=1e-4, msg=name)
    opt = torch.optim.SGD(conv.parameters(), lr=0.1)  # an optimizer step writes into the merged rows
    opt.step()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    conv.eval(), model.eval()
    with torch.no_grad():
        torch.testing.assert_close(conv(IDS).logits, model(IDS).logits, atol=2e-5, rtol=2e-5)


def test_a_hooked_projection_sees_the_originals_values():
    model = _tiny()
    conv = ops_adv.convert_model(copy.deepcopy(model))
    seen = {}
    for tag, m in (("want", model), ("got", conv)):
        m.model.layers[1].self_attn.k_proj.register_forward_hook(lambda mod, i, o, tag=tag: seen.__setitem__(tag, o))
        m.model.layers[1].mlp.up_proj.register_forward_hook(
            lambda mod, i, o, tag=tag: seen.__setitem__(tag + "_up", o * 2))  # a hook's return replaces the output
        with torch.no_grad():
            seen[tag + "_logits"] = m(IDS).logits
    torch.testing.assert_close(seen["got"], seen["want"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(seen["got_logits"], seen["want_logits"], atol=2e-5, rtol=2e-5)


def test_saving_and_loading_keep_the_weights_and_their_size(tmp_path):
    model = _tiny()
    conv = ops_adv.convert_model(copy.deepcopy(model))
    with torch.no_grad():
        want = model(IDS).logits
    conv.save_pretrained(tmp_path / "hf")  # safetensors: views of one storage, saved as separate tensors
    back = type(model).from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(IDS).logits, want, atol=2e-5, rtol=2e-5)
    sizes = {}
    for tag, m in (("model", model), ("conv", conv)):
        buf = io.BytesIO()
        torch.save(m.state_dict(), buf)
        sizes[tag] = len(buf.getvalue())
        sizes[tag + "_pickle"] = len(pickle.dumps(m))
    assert sizes["conv"] <= sizes["model"] * 1.01
    # pickle writes a view's whole storage: each merged parameter is pickled with its own rows only
    assert sizes["conv_pickle"] <= sizes["model_pickle"] * 1.05
    loaded = pickle.loads(pickle.dumps(conv))
    assert _storages(loaded) <= _storages(model) * 1.01
    with torch.no_grad():
        torch.testing.assert_close(loaded(IDS).logits, want, atol=2e-5, rtol=2e-5)
    assert copy.copy(conv.model.layers[0].self_attn.q_proj).weight is not None


def test_compiled_converted_model_runs_the_merged_operator():
    model = _tiny()
    conv = ops_adv.convert_model(copy.deepcopy(model))
    with torch.no_grad():
        want = model(IDS).logits
        got = torch.compile(conv, backend="aot_eager", fullgraph=True)(IDS).logits
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    # the side-by-side test runs when the operator runs: a weight replaced after compiling is followed
    g = torch.Generator().manual_seed(3)
    new = torch.randn(32, 64, generator=g)
    model.model.layers[0].self_attn.k_proj.weight.data = new.clone()
    conv.model.layers[0].self_attn.k_proj.weight.data = new.clone()
    with torch.no_grad():  # an exported inference graph: no parameter needs its gradient
        ex = torch.export.export(conv, (IDS,), kwargs={"use_cache": False})
        assert any("ops_adv.project" in str(n.target) for n in ex.graph.nodes)
        torch.testing.assert_close(ex.module()(IDS, use_cache=False).logits, model(IDS, use_cache=False).logits,
                                   atol=2e-5, rtol=2e-5)


class _Cond(nn.Module):
    """A projection evaluated only on one branch must not run unconditionally."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.calls = 0
        self.b.register_forward_pre_hook(lambda *_: setattr(self, "calls", self.calls + 1))

    def forward(self, x, flag: bool = False):
        p = self.a(x)
        q = self.b(x) if flag else x
        return p + q


class _Reassigns(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        p = self.a(x)
        x = self.b(x)
        q = self.c(x)
        return p + q


def test_only_unconditional_projections_of_one_input_are_grouped():
    for cls in (_Cond, _Reassigns):
        torch.manual_seed(0)
        m = cls().eval()
        x = torch.randn(3, 8)
        with torch.no_grad():
            want = m(x)
        ops_adv.convert_model(m)
        why = " ".join(r["why"] for r in ops_adv.explain_model(m))
        with torch.no_grad():
            torch.testing.assert_close(m(x), want)
        assert "one gemm" not in why  # b runs on one branch only; c reads the x that b's statement assigns
        if cls is _Cond:
            assert m.calls == 0
