"""convert_model on real models built from configs (random weights, nothing downloaded)."""
from __future__ import annotations

import copy

import pytest
import torch

import ops_adv

transformers = pytest.importorskip("transformers")


def _llama(layers: int = 2, kv_heads: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture
def no_table():
    ops_adv.load_table("")
    yield
    ops_adv.load_table("")


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_converted_llama_matches_and_keeps_its_checkpoint(no_table, kv_heads):
    ref = _llama(kv_heads=kv_heads)
    model = ops_adv.convert_model(copy.deepcopy(ref))
    report = ops_adv.explain_model(model)
    converted = {r["module"] for r in report if r["converted"] == "yes"}
    assert "model.layers.0.self_attn.q_proj" in converted and "model.layers.1.mlp.down_proj" in converted
    assert "model.layers.0.input_layernorm" in converted and "model.norm" in converted
    assert any(r["type"] == "attention" and r["converted"] == "yes" for r in report)
    assert list(model.state_dict()) == list(ref.state_dict())
    model.load_state_dict(ref.state_dict())  # a checkpoint of the original still loads
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), ops_adv.record() as rec:
        got, want = model(ids).logits, ref(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    ops = {op for op, _ in rec.problems()}
    assert {"gemm", "rms_norm"} <= ops
    if kv_heads == 4:  # grouped K/V heads run SDPA (no K/V copy)
        assert "attention" in ops
    prompt = ids[:1, :6]
    assert torch.equal(model.generate(prompt, max_new_tokens=10, do_sample=False),
                       ref.generate(prompt, max_new_tokens=10, do_sample=False))


def test_converted_llama_compiles_without_graph_breaks_and_trains(no_table):
    ref = _llama(kv_heads=4)
    model = ops_adv.convert_model(copy.deepcopy(ref)).train()
    ref.train()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(ids)
    assert explained.graph_break_count == 0, explained.break_reasons
    model(ids, labels=ids).loss.backward()
    ref(ids, labels=ids).loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5, msg=name)


def test_norms_are_recognised_by_what_they_do():
    class ScaledRMSNorm(torch.nn.Module):  # RMS norm under another name: converted
        def __init__(self, n):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(n) + 0.1 * torch.randn(n))
            self.variance_epsilon = 1e-6

        def forward(self, x):
            h = x.float()
            return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).to(x.dtype) * self.weight

    class OnePlusRMSNorm(ScaledRMSNorm):  # Gemma-style (1 + weight): not an RMS norm with this weight
        def forward(self, x):
            h = x.float()
            return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * (1 + self.weight)

    m = torch.nn.Sequential(ScaledRMSNorm(32), OnePlusRMSNorm(32), torch.nn.LayerNorm(32), torch.nn.RMSNorm(32))
    x = torch.randn(4, 32)
    want = m(x)
    ops_adv.convert_model(m)
    report = {r["module"]: r for r in ops_adv.explain_model(m)}
    assert report["0"]["converted"] == "yes"
    assert report["1"]["converted"] == "no" and "relative error" in report["1"]["why"]
    assert report["2"]["converted"] == "yes" and report["3"]["converted"] == "yes"
    torch.testing.assert_close(m(x), want, rtol=1e-5, atol=1e-5)


def test_converted_resnet50_matches():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    ref = torchvision.models.resnet50().eval()
    model = ops_adv.convert_model(copy.deepcopy(ref))
    convs = [r for r in ops_adv.explain_model(model) if r["type"] == "Conv2d"]
    assert len(convs) == 53 and all(r["converted"] == "yes" for r in convs)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad(), ops_adv.record() as rec:
        got = model(x)
        want = ref(x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # eval mode: a conv -> BN (-> ReLU) of ResNet-50 is one conv2d_bn_relu call where folding its weight costs
    # less than the BatchNorm pass (else conv2d, then the BatchNorm); state_dict kept
    assert {op for op, _ in rec.problems()} == {"conv2d_bn_relu", "conv2d", "gemm"}
    fused = [r for r in ops_adv.explain_model(model) if r["type"] == "Conv2d+BatchNorm2d"]
    assert len(fused) == 53 and all(r["converted"] == "yes" for r in fused)
    assert model.state_dict().keys() == ref.state_dict().keys()
    # channels_last stays channels_last, as with torch
    xl = x.contiguous(memory_format=torch.channels_last)
    model_cl = model.to(memory_format=torch.channels_last)
    with torch.no_grad():
        torch.testing.assert_close(model_cl(xl), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fuse", [False, True])
def test_batch_norms_fold_into_convs_in_eval_mode(fuse):
    """fuse=False: each BN folds into its conv2d call; fuse=True: conv -> BN (-> ReLU) is one conv2d_bn_relu."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    ref = torchvision.models.resnet18()
    with torch.no_grad():  # running statistics that are not the identity
        for m in ref.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    ref.eval()
    model = ops_adv.convert_model(copy.deepcopy(ref), fuse=fuse)
    folded = [r for r in ops_adv.explain_model(model) if r["type"] == ("Conv2d+BatchNorm2d" if fuse else "BatchNorm2d")]
    assert len(folded) == 20 and all(r["converted"] == "yes" for r in folded)
    assert list(model.state_dict()) == list(ref.state_dict())
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad(), ops_adv.record() as rec:
        got = model(x)
    torch.testing.assert_close(got, ref(x), rtol=1e-4, atol=1e-4)
    convs = [p for op, p in rec.problems() if op in ("conv2d_bn_relu", "conv2d")]
    assert len(convs) >= 10  # distinct problems: ResNet-18 repeats its shapes
    # sites fold where a pass over the weight costs less than the BatchNorm's over the output (the stem here)
    assert any(op == ("conv2d_bn_relu" if fuse else "conv2d") and p.K == 64 and p.R == 7 for op, p in rec.problems())
    # weights changed in place (a fine-tuning step, a loaded checkpoint) are folded again
    with torch.no_grad():
        model.bn1.running_mean.add_(0.3)
        ref.bn1.running_mean.add_(0.3)
        torch.testing.assert_close(model(x), ref(x), rtol=1e-4, atol=1e-4)
    # train mode runs conv and batch norm as before, batch statistics and all
    model.train()
    ref.train()
    torch.testing.assert_close(model(x), ref(x), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model.bn1.running_mean, ref.bn1.running_mean)
    # ... and the statistics that step updated (with no version bump) are folded again in eval mode
    model.eval()
    ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=1e-4, atol=1e-4)


@pytest.mark.ray
def test_tune_for_hardware_records_tunes_and_loads(ray_session, sqlite_url, tmp_path, no_table):
    class Small(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = torch.nn.Linear(64, 128)
            self.norm = torch.nn.RMSNorm(128)

        def forward(self, x):
            return self.norm(self.up(x))

    model = ops_adv.convert_model(Small().eval())
    x = torch.randn(4, 16, 64)
    shapes = tmp_path / "shapes.json"
    out = model.tune_for_hardware(device="cpu", example_inputs=(x,), trials=3, db=sqlite_url, shapes_path=str(shapes),
                                  measure_budget_s=0.05)
    assert out["problems"] == 2 and len(out["winners"]) == 2
    assert {r["op"] for r in out["winners"]} == {"gemm", "rms_norm"}
    # the winners are loaded: this forward's problems are now "tuned"
    assert ops_adv.explain("gemm", x.reshape(-1, 64), model.up.weight.t())["source"] == "tuned"
    assert ops_adv.explain("rms_norm", model.up(x), model.norm.weight)["source"] == "tuned"
    from tuner.problems import load_shapes

    assert len(load_shapes(str(shapes), ["gemm", "rms_norm"])) == 2


@pytest.mark.parametrize("fuse", [False, True])
def test_compiled_converted_resnet_has_no_graph_breaks(fuse):
    """The BatchNorm fold is cached at conversion, so torch.compile never reads data pointers (a graph break per conv)."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    ref = torchvision.models.resnet18().eval()
    model = ops_adv.convert_model(copy.deepcopy(ref), fuse=fuse)
    x = torch.randn(1, 3, 32, 32)
    torch._dynamo.reset()
    with torch.no_grad():
        e = torch._dynamo.explain(model)(x)
        assert e.graph_break_count == 0, [r.reason for r in e.break_reasons][:2]
        torch.testing.assert_close(torch.compile(model, backend="eager")(x), ref(x), rtol=1e-4, atol=1e-4)
