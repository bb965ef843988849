"""Converting never breaks or silently changes a model (issue 30).

Each test builds its model from a transformers (or torchvision) config with random weights, converts a copy
and compares it with the original: partial rotary embeddings, gated norms, hooks around conversion and
inside fused blocks, replaced modules, replicas, MoE experts, stale folds, pickled size, and what
`explain_model` reports."""
from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn as nn

import ops_adv

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)


def _lm(cfg) -> nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def _pair(cfg):
    ref = _lm(cfg)
    return ref, ops_adv.convert_model(copy.deepcopy(ref))


def _ids(b=2, s=9):
    return torch.randint(1, 120, (b, s), generator=torch.Generator().manual_seed(1))


def close(a, b, tol=1e-4):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def _rows(model, **match):
    return [r for r in ops_adv.explain_model(model) if all(r.get(k) == v for k, v in match.items())]


# --------------------------------------------------------------------------- conversion breaks the model

PARTIAL = {
    "gpt_neox": lambda: transformers.GPTNeoXConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                                   num_hidden_layers=2, num_attention_heads=4,
                                                   max_position_embeddings=64),  # rotary_pct 0.25
    "phi3_partial": lambda: transformers.Phi3Config(**TINY, partial_rotary_factor=0.75),  # Phi-4-mini's layout
}


@pytest.mark.parametrize("family", list(PARTIAL))
def test_partial_rotary_converts_and_matches_in_eval_train_and_generate(family):
    """Raised `The size of tensor a (16) must match the size of tensor b (4)` in every forward."""
    ref, conv = _pair(PARTIAL[family]())
    assert any("rope" in r["why"] for r in _rows(conv, converted="yes"))
    ids = _ids()
    with torch.no_grad():
        close(conv(ids).logits, ref(ids).logits)
    for m in (ref, conv):
        m.train()
        m(ids, labels=ids).loss.backward()
    for (n, p), q in zip(ref.named_parameters(), conv.parameters()):
        close(q.grad, p.grad, 1e-3)
    for m in (ref, conv):
        m.eval()
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(conv.generate(ids, **kw), ref.generate(ids, **kw))


@pytest.mark.parametrize("n_groups", [1, 8])
def test_gated_rms_norm_is_left_alone_with_the_reason(n_groups):
    """Mamba2's gated norm (forward(x, gate)) passed the probe with n_groups=1; every forward then raised
    `_library_rms_forward() takes 2 positional arguments but 3 were given`."""
    cfg = transformers.Mamba2Config(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16,
                                    state_size=16, n_groups=n_groups, expand=2, chunk_size=16)
    ref, conv = _pair(cfg)
    with torch.no_grad():
        close(conv(_ids()).logits, ref(_ids()).logits)
    gated = [r for r in ops_adv.explain_model(conv) if r["module"].endswith("mixer.norm")]
    assert gated and all(r["converted"] == "no" and "gate" in r["why"] for r in gated), gated


# --------------------------------------------------------------------------- hooks and replaced modules


def test_hooks_registered_before_conversion_never_see_probe_tensors():
    """convert_model's probes called the model's hooks with (3, 64) and (97,) random tensors."""
    model = _lm(transformers.LlamaConfig(**TINY))
    seen = []
    for m in model.modules():
        m.register_forward_pre_hook(lambda mod, args: seen.append(tuple(args[0].shape)))
    ops_adv.convert_model(model)
    assert seen == []


def _hook_all(model, names, log):
    for n in names:
        model.get_submodule(n).register_forward_hook(lambda m, a, out, n=n: log.setdefault(n, []).append(
            (a[0].detach().clone(), out.detach().clone())))


def test_hooks_after_conversion_inside_fused_blocks_fire_with_the_originals_values():
    """post_attention_layernorm (fused into add_rms_norm) and mlp.act_fn (fused into swiglu) never fired."""
    ref, conv = _pair(transformers.LlamaConfig(**TINY))
    names = ["model.layers.0.post_attention_layernorm", "model.layers.1.mlp.act_fn", "model.layers.1.input_layernorm"]
    logs: tuple[dict, dict] = ({}, {})
    for m, log in zip((ref, conv), logs):
        _hook_all(m, names, log)
    ids = _ids()
    with torch.no_grad():
        close(conv(ids).logits, ref(ids).logits)
    assert logs[0].keys() == logs[1].keys() == set(names)
    for n in names:
        assert len(logs[1][n]) == len(logs[0][n])
        for (a, o), (b, p) in zip(logs[1][n], logs[0][n]):
            close(a, b), close(o, p)


def test_a_norm_replaced_after_conversion_runs_as_the_new_module():
    """A LayerNorm put in place of a fused RMS norm was still computed as an RMS norm (diff 0.0165)."""
    ref, conv = _pair(transformers.LlamaConfig(**TINY))
    torch.manual_seed(3)
    ln = nn.LayerNorm(64)
    nn.init.normal_(ln.weight), nn.init.normal_(ln.bias)
    for m in (ref, conv):
        m.model.layers[0].post_attention_layernorm = copy.deepcopy(ln)
        m.model.layers[1].mlp.act_fn = nn.GELU()
    with torch.no_grad():
        close(conv(_ids()).logits, ref(_ids()).logits)


def test_gradient_checkpointing_still_checkpoints_fused_layers():
    """The fused decoder layer keeps transformers' checkpointing wrapper (it was stripped with the decorators)."""
    from torch.utils.checkpoint import checkpoint

    ref, conv = _pair(transformers.LlamaConfig(**TINY))
    counts = []
    for m in (ref, conv):
        m.gradient_checkpointing_enable()
        m.train()
        n = [0]

        def counted(fn, *args, n=n):
            n[0] += 1
            return checkpoint(fn, *args, use_reentrant=False)

        for layer in m.model.layers:
            layer._gradient_checkpointing_func = counted
        m(_ids(), labels=_ids()).loss.backward()
        counts.append(n[0])
    assert counts[1] == counts[0] == 2
    for p, q in zip(ref.parameters(), conv.parameters()):
        close(q.grad, p.grad, 1e-3)


# --------------------------------------------------------------------------- replicas


@pytest.mark.parametrize("layer", ["linear", "layer_norm", "rms_norm", "llama_layer"])
def test_a_replica_computes_with_its_own_weights(layer):
    """nn.parallel.replicate / DataParallel copies: zeroed replica weights still gave the original's output."""
    if layer == "llama_layer":
        model = _lm(transformers.LlamaConfig(**TINY))
        ref, conv = copy.deepcopy(model), ops_adv.convert_model(model)
        x = torch.randn(2, 5, 64)
        pos = ref.model.rotary_emb(x, torch.arange(5)[None])

        def run(m):
            out = m.model.layers[0](x, position_embeddings=pos)
            return out[0] if isinstance(out, tuple) else out
    else:
        torch.manual_seed(0)
        mod = {"linear": nn.Linear(8, 4), "layer_norm": nn.LayerNorm(8), "rms_norm": nn.RMSNorm(8)}[layer]
        ref, conv = nn.Sequential(copy.deepcopy(mod)), ops_adv.convert_model(nn.Sequential(mod))
        x = torch.randn(2, 8)

        def run(m):
            return m(x)

    replicas = []
    for m in (ref, conv):
        # what nn.parallel.replicate does on each device (it needs CUDA for its broadcast)
        copies = {id(s): s._replicate_for_data_parallel() for s in m.modules()}
        for s in m.modules():
            r = copies[id(s)]
            for k, c in s._modules.items():
                setattr(r, k, copies[id(c)])
            for k, p in s._parameters.items():
                if p is None:
                    r._parameters[k] = None
                else:
                    setattr(r, k, torch.zeros_like(p) + 0.5 * (k == "bias"))
        replicas.append(copies[id(m)])
    with torch.no_grad():
        want, got = run(replicas[0]), run(replicas[1])
        close(got, want)
        assert not torch.allclose(got, run(conv))


# --------------------------------------------------------------------------- MoE experts

MOE = {
    "mixtral": lambda: transformers.MixtralConfig(**TINY, num_local_experts=4),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**TINY, num_experts=4, moe_intermediate_size=32,
                                                    shared_expert_intermediate_size=64),
}


@pytest.mark.parametrize("family", list(MOE))
def test_moe_experts_keep_transformers_own_implementation(family):
    """The experts' decorator (transformers' experts interface: grouped_mm) was stripped by the swiglu rewrite:
    the eager per-expert loop ran, torch.export and compile(fullgraph=True) failed, 10-11 graph breaks.
    Since issue 31 the sparse block calls ops_adv.moe in the experts' place where the table has a tuned moe kernel
    (tests/test_moe_convert.py); the experts' own forward, decorator and all, stays transformers'."""
    ref, conv = _pair(MOE[family]())
    experts = [(n, m) for n, m in conv.named_modules() if n.endswith("mlp.experts")]
    assert experts and all("forward" not in m.__dict__ for _, m in experts)
    rows = {r["module"]: r for r in ops_adv.explain_model(conv)}
    assert all(rows[n]["converted"] == "no" and "transformers" in rows[n]["why"] for n, _ in experts), rows
    assert all(rows[n[: -len(".experts")]]["converted"] == "yes" and "-> moe" in rows[n[: -len(".experts")]]["why"]
               for n, _ in experts), rows
    ids = _ids()
    with torch.no_grad():
        want = ref(ids).logits
        close(conv(ids).logits, want)
        torch._dynamo.reset()
        close(torch.compile(conv, fullgraph=True, backend="eager")(ids).logits, want)


# --------------------------------------------------------------------------- folded Conv2d -> BatchNorm2d


def _resnet(train_bn_stats: bool = True) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 64, 64], depths=[1, 1, 1, 1],
                                    num_labels=10)
    m = transformers.ResNetForImageClassification(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # statistics that are not the identity, so a wrong or stale fold shows
        for bn in m.modules():
            if isinstance(bn, nn.BatchNorm2d):
                bn.running_mean.uniform_(-0.3, 0.3, generator=g)
                bn.running_var.uniform_(0.5, 1.5, generator=g)
    return m.eval()


def _img(n=2, s=64):
    return torch.randn(n, 3, s, s, generator=torch.Generator().manual_seed(2))


def _edit_through_data(model: nn.Module) -> None:
    """What EMA updates and weight surgery do: in-place edits that autograd's version counters do not see."""
    g = torch.Generator().manual_seed(5)
    for m in model.modules():
        for t in list(m._parameters.values()) + [m._buffers.get("running_mean"), m._buffers.get("running_var")]:
            if t is not None:
                t.data.mul_(torch.empty(t.shape).uniform_(0.5, 1.5, generator=g))


def test_folded_convs_follow_edits_through_data_in_eval():
    """A cached fold did not follow `.data` edits: max|diff| 2.69 against the plain model."""
    ref = _resnet()
    conv = ops_adv.convert_model(copy.deepcopy(ref))
    x = _img()
    with torch.no_grad():
        close(conv(x).logits, ref(x).logits)
        for m in (ref, conv):
            _edit_through_data(m)
        close(conv(x).logits, ref(x).logits)


def test_folded_convs_follow_edits_through_data_after_a_frozen_bn_no_grad_call():
    """Converted in train mode (folds decided per call), frozen parameters, a no_grad call, then `.data` edits."""
    ref = _resnet().train()
    conv = ops_adv.convert_model(copy.deepcopy(ref))
    x = _img()
    for m in (ref, conv):
        m.eval()
        m.requires_grad_(False)
    with torch.no_grad():
        conv(x)
    for m in (ref, conv):
        _edit_through_data(m)
    close(conv(x).logits, ref(x).logits)


def test_compiled_converted_model_follows_load_state_dict():
    """Compiled (inductor), then load_state_dict of other weights: the compiled graph used the cached fold
    (max|diff| 1.74 against a model with those weights)."""
    ref, other = _resnet(), _resnet()
    _edit_through_data(other)
    conv = ops_adv.convert_model(copy.deepcopy(ref))
    torch._dynamo.reset()
    compiled = torch.compile(conv)
    x = _img()
    with torch.no_grad():
        close(compiled(x).logits, ref(x).logits)
        conv.load_state_dict(other.state_dict())
        close(compiled(x).logits, other(x).logits)


def test_a_saved_converted_resnet_holds_no_second_copy_of_its_weights():
    """torch.save(model) of a converted ResNet-18 was 87.3 MiB against 44.7 MiB (a cached fold per conv)."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    ref = torchvision.models.resnet18(num_classes=10).eval()
    conv = ops_adv.convert_model(copy.deepcopy(ref))
    with torch.no_grad():
        conv(torch.randn(1, 3, 224, 224))
    sizes = []
    for m in (ref, conv):
        buf = io.BytesIO()
        torch.save(m, buf)
        sizes.append(buf.tell())
    assert sizes[1] < sizes[0] * 1.02, sizes
    held = {t.untyped_storage().data_ptr() for m in conv.modules() for t in m.__dict__.values()
            if isinstance(t, torch.Tensor)}
    extra = [v for m in conv.modules() for k, v in m.__dict__.items() if k.startswith("_ops_adv_fold")]
    assert not extra and not held


# --------------------------------------------------------------------------- explain_model says what runs

EXPLAIN = {
    "bert": lambda: transformers.BertModel(transformers.BertConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=64)),
    "mixtral": lambda: transformers.AutoModelForCausalLM.from_config(MOE["mixtral"]()),
    "qwen2_moe": lambda: transformers.AutoModelForCausalLM.from_config(MOE["qwen2_moe"]()),
    "gemma2": lambda: transformers.AutoModelForCausalLM.from_config(transformers.Gemma2Config(**TINY, head_dim=16)),
    "t5": lambda: transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=128, d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16, decoder_start_token_id=0)),
}


@pytest.mark.parametrize("family", list(EXPLAIN))
def test_explain_model_reports_the_attention_that_runs(family):
    """BERT (encoder_hidden_states=None), Mixtral / Qwen2-MoE (output_router_logits=False) went back to the
    original attention on every call; Gemma 2 (softcap) and T5 (position_bias) always do. All were reported
    converted."""
    from ops_adv.models import hf

    torch.manual_seed(0)
    ref = EXPLAIN[family]().eval()
    conv = ops_adv.convert_model(copy.deepcopy(ref))
    ids = _ids(2, 7)
    kw = {"input_ids": ids, **({"decoder_input_ids": ids[:, :5]} if family == "t5" else {})}
    hf.ROUTE_LOG = []
    try:
        with torch.no_grad():
            got = conv(**kw)
        routes = set(hf.ROUTE_LOG)
    finally:
        hf.ROUTE_LOG = None
    with torch.no_grad():
        want = ref(**kw)
    close(got[0], want[0])
    head = _rows(conv, module="", type="attention")[0]
    if family == "gemma2":  # softcap: not an SDPA family (transformers 5.25), or refused per module (5.17)
        assert routes <= {"original"} and head["converted"] == "no", head
        why = " ".join(r["why"] for r in ops_adv.explain_model(conv) if r["converted"] == "no")
        assert "SDPA" in head["why"] or "softcap" in why, why
    elif family == "t5":
        assert routes == {"original"}
        assert head["converted"] == "no"
        rows = [r for r in ops_adv.explain_model(conv) if "Attention" in r["type"] and r["converted"] == "no"]
        assert rows and all("position_bias" in r["why"] for r in rows), rows
    else:
        assert "original" not in routes and routes, routes
        # ops_adv's own routes make it converted; SDPA alone (a grouped prefill, untuned) is reported as such
        assert head["converted"] == ("yes" if routes & {"ops_adv.attention", "decode_attention"} else "no"), routes
        if family == "bert":
            assert routes == {"ops_adv.attention"}


def test_explain_model_does_not_list_layers_that_are_never_called():
    """torchvision Swin's attention passes attn.qkv.weight / proj.weight to a function: reported converted."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    ref = torchvision.models.swin_t(num_classes=10).eval()
    conv = ops_adv.convert_model(copy.deepcopy(ref))
    rows = {r["module"]: r for r in ops_adv.explain_model(conv)}
    for n in ("features.1.0.attn.qkv", "features.1.0.attn.proj"):
        assert rows[n]["converted"] == "no" and "never called" in rows[n]["why"], rows[n]
    assert rows["features.1.0.mlp.0"]["converted"] == "yes"
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        close(conv(x), ref(x))


@pytest.mark.parametrize("family", ["bloom", "xglm", "mpt", "gpt_neo"])
def test_attention_that_does_not_dispatch_through_transformers_is_left_alone(family):
    """Bloom, XGLM, MPT, GPT-Neo compute attention themselves: switching the model to 'ops_adv' gave them SDPA
    masks (logits off by 0.016-0.47, MPT raised AttributeError)."""
    cfgs = {
        "bloom": lambda: transformers.BloomConfig(vocab_size=128, hidden_size=64, n_layer=2, n_head=4),
        "xglm": lambda: transformers.XGLMConfig(vocab_size=128, d_model=64, num_layers=2, attention_heads=4,
                                                ffn_dim=128, max_position_embeddings=64),
        "mpt": lambda: transformers.MptConfig(vocab_size=128, d_model=64, n_layers=2, n_heads=4, max_seq_len=64),
        "gpt_neo": lambda: transformers.GPTNeoConfig(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4,
                                                     attention_types=[[["global", "local"], 1]],
                                                     max_position_embeddings=64),
    }
    ref, conv = _pair(cfgs[family]())
    ids = _ids()
    with torch.no_grad():
        close(conv(ids).logits, ref(ids).logits)
    head = _rows(conv, module="", type="attention")[0]
    assert head["converted"] == "no", head
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(conv.generate(ids, **kw), ref.generate(ids, **kw))
