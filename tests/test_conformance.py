"""A converted model is the same model (issue 19): what autograd, hooks, parametrizations, pickling,
quantize_dynamic, torch.func, jit, compile and export see is what they see on the original.

Every model is built tiny from its config (2 layers) and runs on the CPU, once with no table and once
with a table that forces ops_adv's own CPU kernels (cpu_blocked gemm, cpu_chunked attention) for every
problem the model meets (OPS_ADV_NEAREST large, so every shape maps)."""
from __future__ import annotations

import copy
import io
import itertools
import json
import multiprocessing
import pickle
import warnings

import pytest
import torch
import torch.nn as nn

import kernel_space
import ops_adv
from ops_adv.models import hf

transformers = pytest.importorskip("transformers")
torchvision = pytest.importorskip("torchvision")

TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)


def _hf(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=2,
                                                                     n_positions=64))
    if name == "bert":
        return transformers.BertModel(transformers.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2,
                                                              num_attention_heads=2, intermediate_size=64,
                                                              max_position_embeddings=64))
    if name == "t5":
        return transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=128, d_model=32, d_ff=64, num_layers=2, num_heads=2, d_kv=16, decoder_start_token_id=0))
    cfg = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig, "phi3": transformers.Phi3Config,
           "qwen3": transformers.Qwen3Config}[name](**TINY, **({"head_dim": 8} if name == "qwen3" else {}))
    return transformers.AutoModelForCausalLM.from_config(cfg)


def _tv(name: str) -> nn.Module:
    torch.manual_seed(0)
    m = getattr(torchvision.models, name)(num_classes=10)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # running statistics that are not the identity, so a wrong fold shows
        for bn in m.modules():
            if isinstance(bn, nn.BatchNorm2d):
                bn.running_mean.uniform_(-0.3, 0.3, generator=g)
                bn.running_var.uniform_(0.5, 1.5, generator=g)
    return m


CNNS = ["resnet18", "mobilenet_v3_small"]
LMS = ["gpt2", "bert", "t5", "mistral", "llama", "phi3", "qwen3"]
MODELS = CNNS + LMS


def build(name: str) -> nn.Module:
    return _tv(name) if name in CNNS else _hf(name)


def inputs(name: str) -> dict:
    g = torch.Generator().manual_seed(1)
    if name in CNNS:
        return {"x": torch.randn(2, 3, 32, 32, generator=g)}
    ids = torch.randint(1, 128, (2, 7), generator=g)
    if name == "t5":
        return {"input_ids": ids, "decoder_input_ids": torch.randint(1, 128, (2, 5), generator=g), "use_cache": False}
    return {"input_ids": ids, "use_cache": False}


def call(model: nn.Module, kw: dict) -> torch.Tensor:
    if "x" in kw:
        return model(kw["x"])
    out = model(**kw)
    if isinstance(out, torch.Tensor):
        return out
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _pair(name: str, train: bool = False, convert_in_train: bool | None = None):
    """(original, converted) in the same mode; the converted one converted in `convert_in_train` mode."""
    ref = build(name)
    ref.train(train if convert_in_train is None else convert_in_train)
    conv = ops_adv.convert_model(copy.deepcopy(ref))
    ref.train(train), conv.train(train)
    return ref, conv


def close(a, b, tol=1e-4):
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


# --------------------------------------------------------------------------- a table forcing ops_adv's CPU kernels


def _forced_table(path, problems) -> int:
    from ops_adv import _table

    winners, seen = [], set()
    for op, p in problems:
        impls = [i for i in kernel_space.impls(op) if not i.vendor and not i.unavailable and "cpu" in i.backends]
        pd = p._asdict()
        key = (op, json.dumps(pd, sort_keys=True, default=str))
        if key in seen:
            continue
        seen.add(key)
        for impl in impls:
            cfg = next((c for c in itertools.islice(impl.configs(), 2000) if impl.why_not(p, c, "cpu") is None), None)
            if cfg is not None:
                winners.append({"op": op, "problem": pd, "impl": impl.name, "params": cfg, "kernel_version": impl.version,
                                "median_ms": 1.0, "vendor_impl": "x", "vendor_ms": 2.0, "speedup": 2.0})
                break
    path.write_text(json.dumps({"format": _table.FORMAT, "format_version": _table.FORMAT_VERSION,
                                "device_class": "cpu", "fingerprint": {}, "winners": winners,
                                "checksum": _table.checksum(winners)}))
    return len(winners)


_PROBLEMS: list = []


@pytest.fixture(scope="module")
def all_problems():
    """The problems every model here meets (forward in eval and train mode), recorded once."""
    if not _PROBLEMS:
        with ops_adv.record() as rec:
            for name in MODELS:
                for train in (False, True):
                    _, conv = _pair(name, train)
                    call(conv, inputs(name)).float().sum().backward()
        _PROBLEMS.extend(rec.problems())
    return _PROBLEMS


@pytest.fixture(params=["no_table", "forced"])
def table(request, tmp_path, monkeypatch):
    if request.param == "no_table":
        ops_adv.load_table("")
        yield None
        return
    problems = request.getfixturevalue("all_problems")
    n = _forced_table(tmp_path / "forced.json", problems)
    impls = {w["impl"] for w in json.loads((tmp_path / "forced.json").read_text())["winners"]}
    assert {"cpu_blocked", "cpu_chunked"} <= impls, impls  # ops_adv's own gemm and attention, no vendor kernel
    monkeypatch.setenv("OPS_ADV_NEAREST", "1000000")
    ops_adv.load_table(str(tmp_path / "forced.json"))
    yield n
    ops_adv.load_table("")


# --------------------------------------------------------------------------- 1: folding never drops gradients


@pytest.mark.parametrize("name", CNNS)
def test_eval_mode_cnn_converted_as_constructed_gets_every_gradient(name):
    """Converted in train mode (as constructed), then .eval(): Conv->BN folding must not hide the convs'
    and BNs' parameters from autograd (frozen-BN fine-tuning, Grad-CAM, adversarial training)."""
    ref, conv = _pair(name, train=False, convert_in_train=True)
    x = inputs(name)["x"]
    for m in (ref, conv):
        m(x).square().mean().backward()
    for (n, p), q in zip(ref.named_parameters(), conv.parameters()):
        assert q.grad is not None, n
        close(q.grad, p.grad, 1e-4)
    before = [p.detach().clone() for p in conv.parameters()]
    torch.optim.SGD(conv.parameters(), lr=0.1).step()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    changed = [not torch.equal(a, p) for a, p in zip(before, conv.parameters())]
    assert sum(changed) > len(before) // 2  # 60 of ResNet-18's 62 stayed put before the fix
    for p, q in zip(ref.parameters(), conv.parameters()):
        close(q.detach(), p.detach(), 1e-5)
    # no grad wanted: the pairs fold again, and compute what the unconverted model does
    for p in conv.parameters():
        p.requires_grad_(False)
    with torch.no_grad():
        want = copy.deepcopy(conv)
        for m in want.modules():
            m.__dict__.pop("forward", None)
        close(conv(x), want(x))
    with torch.no_grad(), torch.profiler.profile() as prof:
        conv(x)
    bns = sum(isinstance(m, nn.BatchNorm2d) for m in conv.modules())
    ran = sum(e.name == "aten::batch_norm" for e in prof.events())
    assert ran < bns, "frozen parameters under no_grad: the pairs fold (where folding is the cheaper pass)"


def test_depthwise_convs_are_not_folded():
    model = ops_adv.convert_model(_tv("mobilenet_v3_small").train())
    rows = [r for r in ops_adv.explain_model(model) if r["type"] == "BatchNorm2d"]
    dw = [r for r in rows if "groups=" in r["why"]]
    assert dw and all(r["converted"] == "no" for r in dw)
    assert any(r["converted"] == "yes" for r in rows)
    for m in model.modules():
        if isinstance(m, nn.Conv2d) and m.groups != 1:
            assert "_ops_adv_bn" not in m.__dict__


# --------------------------------------------------------------------------- 3: hooks after conversion


@pytest.mark.parametrize("convert_in_train", [True, False], ids=["folded", "fused"])
def test_hooks_added_after_conversion_fire_and_see_the_original_tensors(convert_in_train):
    ref, conv = _pair("resnet18", train=False, convert_in_train=convert_in_train)
    x = inputs("resnet18")["x"]
    seen: dict = {"ref": {}, "conv": {}}
    for key, model in (("ref", ref), ("conv", conv)):
        for n, m in model.named_modules():
            if isinstance(m, (nn.Conv2d, nn.BatchNorm2d, nn.ReLU)):
                m.register_forward_hook(lambda mod, a, out, n=n, key=key: seen[key].setdefault(n, out.detach().clone()))
        with torch.no_grad():
            model(x)
    assert seen["conv"].keys() == seen["ref"].keys() and len(seen["ref"]) > 40
    for n, t in seen["ref"].items():
        close(seen["conv"][n], t)


def test_record_sees_a_conv_bn_relu_model_with_gradients():
    """issue 22 item 6: record() around a converted Conv2d -> BatchNorm2d -> ReLU saw no op ({})."""
    torch.manual_seed(0)
    model = ops_adv.convert_model(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()).eval())
    with ops_adv.record() as rec:
        model(torch.randn(2, 3, 8, 8)).sum().backward()
    assert "conv2d" in rec.shapes()
    with torch.no_grad(), ops_adv.record() as rec:
        model(torch.randn(2, 3, 8, 8))
    assert "conv2d_bn_relu" in rec.shapes()


# --------------------------------------------------------------------------- 2: attention keywords ops_adv does not understand


def test_t5_decoder_continuing_its_cache_with_several_tokens_matches():
    """T5's relative position bias: the decoder continuing its cache with 3 tokens (assisted decoding)."""
    ref, conv = _pair("t5")
    g = torch.Generator().manual_seed(3)
    src, first, more = (torch.randint(1, 128, s, generator=g) for s in ((2, 9), (2, 4), (2, 3)))
    outs = []
    hf.ROUTE_LOG = []
    try:
        for m in (ref, conv):
            with torch.no_grad():
                enc = m.get_encoder()(input_ids=src)
                out = m(encoder_outputs=enc, decoder_input_ids=first, use_cache=True)
                cache = getattr(out, "past_key_values", None) or getattr(out, "cache")
                outs.append(m(encoder_outputs=enc, decoder_input_ids=more, past_key_values=cache, use_cache=True).logits)
        routes = set(hf.ROUTE_LOG)
    finally:
        hf.ROUTE_LOG = None
    close(outs[1], outs[0])
    assert "original" in routes


def test_unknown_attention_keywords_run_the_original_implementation():
    """Gemma 2's soft-capping runs its eager attention (SDPA refuses softcap), not SDPA, and matches."""
    cfg = transformers.Gemma2Config(**TINY, head_dim=8)
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    conv = ops_adv.convert_model(copy.deepcopy(ref))
    ids = inputs("llama")["input_ids"]
    with torch.no_grad():
        close(conv(ids).logits, ref(ids).logits)
    from ops_adv.models.hf import _understood

    assert _understood({"position_ids": 1, "softcap": None, "sliding_window": 64}, Skv=64)
    assert not _understood({"softcap": 30.0}, 8) and not _understood({"position_bias": torch.zeros(1)}, 8)
    assert not _understood({"sliding_window": 4}, 8) and not _understood({"something_new": 1}, 8)


# --------------------------------------------------------------------------- 4: parametrizations, pruning, norms


class _LoRA(nn.Module):
    """A rank-2 delta on a weight of any shape (rows = output features)."""

    def __init__(self, shape: torch.Size, r: int = 2) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(5)
        out_f, in_f = shape[0], shape[1:].numel()
        self.a, self.b = nn.Parameter(torch.randn(out_f, r, generator=g)), nn.Parameter(torch.randn(r, in_f, generator=g))

    def forward(self, w):
        return w + 0.1 * (self.a @ self.b).view_as(w)


def _parametrize(kind: str, m: nn.Module) -> nn.Module:
    from torch.nn.utils import parametrizations, parametrize, prune

    if kind == "lora":
        parametrize.register_parametrization(m, "weight", _LoRA(m.weight.shape))
    elif kind == "prune":
        prune.l1_unstructured(m, "weight", amount=0.5)
    elif kind == "weight_norm":
        parametrizations.weight_norm(m)
    elif kind == "weight_norm_legacy":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            nn.utils.weight_norm(m)
    elif kind == "spectral_norm":
        parametrizations.spectral_norm(m)
    elif kind == "spectral_norm_legacy":
        nn.utils.spectral_norm(m)
    return m


@pytest.mark.parametrize("layer,kind", [(layer, kind) for layer in ("linear", "conv2d") for kind in (
    "lora", "prune", "weight_norm", "weight_norm_legacy", "spectral_norm", "spectral_norm_legacy")] + [("layer_norm", "shift")])
def test_parametrized_converted_layers_compute_what_torch_does(layer, kind):
    torch.manual_seed(0)
    make = {"linear": lambda: nn.Linear(8, 6), "conv2d": lambda: nn.Conv2d(3, 4, 3),
            "layer_norm": lambda: nn.LayerNorm(8)}[layer]
    x = torch.randn(2, 3, 5, 5) if layer == "conv2d" else torch.randn(3, 8)
    ref = make()
    conv = ops_adv.convert_model(copy.deepcopy(ref))
    assert "forward" in conv.__dict__
    if layer == "layer_norm":
        from torch.nn.utils import parametrize

        for m in (ref, conv):
            parametrize.register_parametrization(m, "weight", _Shift())
    else:
        torch.manual_seed(1)
        _parametrize(kind, ref)
        torch.manual_seed(1)
        _parametrize(kind, conv)
    got, want = conv(x), ref(x)
    close(got, want)
    got.square().sum().backward()
    want.square().sum().backward()
    for (n, p), q in zip(ref.named_parameters(), conv.parameters()):
        assert q.grad is not None, n
        close(q.grad, p.grad)


class _Shift(nn.Module):
    def forward(self, w):
        return w * 1.5 + 0.25


# --------------------------------------------------------------------------- 5: exact types (quantize_dynamic)


@pytest.mark.parametrize("name", ["llama", "bert", "resnet18"])
def test_converted_modules_keep_their_exact_types_and_quantize_dynamic_takes_them(name):
    ref, conv = _pair(name)
    assert [type(m) for m in conv.modules()] == [type(m) for m in ref.modules()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qref = torch.ao.quantization.quantize_dynamic(ref, {nn.Linear}, dtype=torch.qint8)
        qconv = torch.ao.quantization.quantize_dynamic(conv, {nn.Linear}, dtype=torch.qint8)
    n_linear = sum(type(m) is nn.Linear for m in ref.modules())
    quant = [m for m in qconv.modules() if isinstance(m, torch.ao.nn.quantized.dynamic.Linear)]
    assert n_linear and len(quant) == n_linear, quant
    assert not any(type(m) is nn.Linear for m in qconv.modules())
    kw = inputs(name)
    with torch.no_grad():  # folded BNs round differently, and a dynamically quantized input amplifies that
        close(call(qconv, kw), call(qref, kw), 3e-2 if name in CNNS else 1e-3)


# --------------------------------------------------------------------------- 7: pickling


@pytest.mark.parametrize("name", MODELS)
def test_a_converted_model_pickles_and_round_trips(name, tmp_path):
    ref, conv = _pair(name)
    kw = inputs(name)
    with torch.no_grad():
        want = call(ref, kw)
        close(call(conv, kw), want)
    torch.save(conv, tmp_path / "m.pt")
    back = torch.load(tmp_path / "m.pt", weights_only=False)
    assert [type(m) for m in back.modules()] == [type(m) for m in conv.modules()]
    assert sum("forward" in m.__dict__ for m in back.modules()) == sum("forward" in m.__dict__ for m in conv.modules())
    with torch.no_grad():
        close(call(back, kw), want)
    assert ops_adv.explain_model(back) == ops_adv.explain_model(conv)


def _load_and_run(blob: bytes) -> list:
    model, kw = pickle.loads(blob)
    with torch.no_grad():
        return call(model, kw).tolist()


def test_a_converted_model_pickles_into_another_process():
    """multiprocessing (spawn): the fused decoder blocks' forward is rebuilt in the child by name."""
    ref, conv = _pair("llama")
    kw = inputs("llama")
    blob = pickle.dumps((conv, kw))
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        got = torch.tensor(pool.apply(_load_and_run, (blob,)))
    with torch.no_grad():
        close(got, call(ref, kw))


# --------------------------------------------------------------------------- 8: jit


@pytest.mark.parametrize("convert_in_train", [True, False], ids=["folded", "fused"])
def test_jit_trace_of_a_converted_eval_resnet_passes_its_own_check(convert_in_train):
    ref, conv = _pair("resnet18", convert_in_train=convert_in_train)
    x = inputs("resnet18")["x"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(conv, x)  # check_trace=True: a second trace must take the same path
    with torch.no_grad():
        close(traced(x), ref(x))


def test_jit_script_of_a_converted_model_says_what_to_do():
    _, conv = _pair("resnet18")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        with pytest.raises(RuntimeError, match="script the model before ops_adv.convert_model") as e:
            torch.jit.script(conv)
    assert "\n" not in str(e.value)


# --------------------------------------------------------------------------- the conformance matrix: every model, both tables


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


@pytest.mark.parametrize("name", MODELS)
def test_outputs_gradients_and_hooks_match(name, table):
    """Eval outputs; parameter gradients in train and eval mode (same seed: dropout draws alike); forward
    hooks added after conversion on every layer conversion touches."""
    kw = inputs(name)
    for train in (False, True):
        ref, conv = _pair(name, train)
        for m in (ref, conv):
            torch.manual_seed(7)
            _loss(call(m, kw)).backward()
        for (n, p), q in zip(ref.named_parameters(), conv.parameters()):
            assert (q.grad is None) == (p.grad is None), (train, n)
            if p.grad is not None:
                close(q.grad, p.grad, 2e-4)
    seen: dict = {"ref": {}, "conv": {}}
    for key, model in (("ref", ref.eval()), ("conv", conv.eval())):
        for n, m in model.named_modules():
            if isinstance(m, (nn.Linear, nn.Conv2d, nn.BatchNorm2d, nn.LayerNorm)) or type(m).__name__ == "Conv1D":
                m.register_forward_hook(lambda mod, a, out, n=n, key=key: seen[key].setdefault(n, out.detach().clone()))
        with torch.no_grad():
            out = call(model, kw)
        seen[key][""] = out
    assert seen["conv"].keys() == seen["ref"].keys() and len(seen["ref"]) > 5
    for n, t in seen["ref"].items():
        close(seen["conv"][n], t, 2e-4)


@pytest.mark.parametrize("name", MODELS)
def test_lora_parametrization_pickling_and_torch_func(name, table, tmp_path):
    """A torch.save round trip, a LoRA delta on the first Linear (or conv), and torch.func.grad through
    functional_call of the parametrized model, against the original."""
    from torch.func import grad
    from torch.nn.utils import parametrize

    ref, conv = _pair(name)
    kw = inputs(name)
    torch.save(conv, tmp_path / "m.pt")
    with torch.no_grad():
        close(call(torch.load(tmp_path / "m.pt", weights_only=False), kw), call(ref, kw), 2e-4)
    target = next(n for n, m in ref.named_modules() if type(m) in (nn.Linear, nn.Conv2d))
    for m in (ref, conv):
        parametrize.register_parametrization(m.get_submodule(target), "weight", _LoRA(m.get_submodule(target).weight.shape))
    with torch.no_grad():
        want = call(ref, kw)
        close(call(conv, kw), want, 2e-4)
    grads = []
    for m in (ref, conv):
        params = {k: v.detach() for k, v in m.named_parameters()}
        grads.append(grad(lambda p: _loss(call_fn(m, p, kw)))(params))
    assert grads[0].keys() == grads[1].keys()
    for k in grads[0]:
        close(grads[1][k], grads[0][k], 2e-4)


def call_fn(model, params, kw):
    from torch.func import functional_call

    out = functional_call(model, params, args=(kw["x"],)) if "x" in kw else functional_call(model, params, (), kw)
    return out if isinstance(out, torch.Tensor) else (out.logits if hasattr(out, "logits") else out.last_hidden_state)


@pytest.mark.parametrize("name", MODELS)
def test_compile_and_export_match(name, table):
    """torch.compile (aot_eager, fullgraph: every original here compiles whole) and torch.export."""
    ref, conv = _pair(name)
    kw = inputs(name)
    torch._dynamo.reset()
    with torch.no_grad():
        want = call(ref, kw)
        close(call(torch.compile(conv, fullgraph=True, backend="aot_eager"), kw), want, 2e-4)
        ep = torch.export.export(conv, (kw["x"],)) if "x" in kw else torch.export.export(conv, (), kwargs=kw)
        close(call(ep.module(), kw), want, 2e-4)


# --------------------------------------------------------------------------- 10: explain_model


def test_explain_reports_gpt2_conv1d_meta_norms_and_no_container_noise():
    rows = ops_adv.explain_model(ops_adv.convert_model(_hf("gpt2").eval()))
    conv1d = [r for r in rows if r["type"] == "Conv1D"]
    assert len(conv1d) == 8 and all(r["converted"] == "yes" for r in conv1d)  # c_attn, c_proj, c_fc, mlp.c_proj × 2
    rows = ops_adv.explain_model(ops_adv.convert_model(_tv("mobilenet_v3_small").eval()))
    assert not [r for r in rows if r["type"] == "Conv2dNormActivation"]
    with torch.device("meta"):
        meta = _hf("llama")
    with pytest.warns(UserWarning, match="meta device"):
        rows = ops_adv.explain_model(ops_adv.convert_model(meta))
    assert any(r["converted"] == "no" and "meta device" in r["why"] for r in rows if "Norm" in r["type"])
