"""On a CUDA GPU: the ops with Triton winners forced compose with torch.compile, CUDA graphs and
autograd, and a converted bf16 Llama matches the original."""
from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F

import kernel_space
import ops_adv
from ops_adv import _table

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TRITON = {
    "gemm": ("triton", {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 1, "num_warps": 4, "num_stages": 3, "SPLIT_K": 1}),
    "attention": ("triton_flash", {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 2, "num_stages": 2, "streams": 1}),
    "layer_norm": ("triton_layer_norm", {"BLOCK_N": 0, "ROWS_PER_PROGRAM": 8, "PROGRAMS_PER_SM": 0, "num_warps": 1, "num_stages": 1}),
    "rms_norm": ("triton_rms_norm", {"BLOCK_N": 0, "ROWS_PER_PROGRAM": 8, "PROGRAMS_PER_SM": 0, "num_warps": 1, "num_stages": 1}),
    "softmax": ("triton_softmax", {"BLOCK_N": 0, "ROWS_PER_PROGRAM": 8, "PROGRAMS_PER_SM": 0, "num_warps": 1, "num_stages": 1}),
}
PROBLEMS = {
    "gemm": [{"M": 64, "N": 64, "K": 64, "dtype": "bf16", "trans_a": False, "trans_b": tb} for tb in (False, True)],
    "attention": [{"B": 2, "H": 2, "Sq": 64, "Skv": 64, "D": 64, "causal": c, "dtype": "bf16"} for c in (False, True)],
    "layer_norm": [{"rows": 128, "cols": 64, "dtype": "bf16"}],
    "rms_norm": [{"rows": 128, "cols": 64, "dtype": "bf16"}],
    "softmax": [{"rows": 128, "cols": 64, "dtype": "bf16"}],
}


@pytest.fixture
def triton_table(tmp_path, monkeypatch):
    from kernel_space._device import local_device_class

    winners = []
    for op, problems in PROBLEMS.items():
        impl, params = TRITON[op]
        for p in problems:
            winners.append({"op": op, "problem": p, "impl": impl, "params": params,
                            "kernel_version": kernel_space.get_impl(op, impl).version, "median_ms": 1.0,
                            "vendor_impl": "x", "vendor_ms": 2.0, "speedup": 2.0})
    path = tmp_path / "triton.json"
    path.write_text(json.dumps({"format": _table.FORMAT, "format_version": _table.FORMAT_VERSION,
                                "device_class": local_device_class(), "fingerprint": {}, "winners": winners,
                                "checksum": _table.checksum(winners)}))
    monkeypatch.setenv("OPS_ADV_NEAREST", "1000")
    ops_adv.load_table(str(path))
    yield
    ops_adv.load_table("")


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(64, 64)
        self.w = torch.nn.Parameter(torch.ones(64) + 0.1 * torch.randn(64))
        self.b = torch.nn.Parameter(0.1 * torch.randn(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = ops_adv.layer_norm(x, self.w, self.b)
        h = ops_adv.rms_norm(ops_adv.linear(h, self.lin.weight, self.lin.bias), self.w, 1e-6)
        B, S, _ = h.shape
        q = h.view(B, S, 2, 32).transpose(1, 2).contiguous()
        q = torch.cat([q, q], -1)  # D = 64
        a = ops_adv.attention(q, q, q, is_causal=True)[..., :32].transpose(1, 2).reshape(B, S, 64)
        return ops_adv.softmax(ops_adv.gemm(a.reshape(-1, 64), self.lin.weight.t()))


def _reference(m: Block, x: torch.Tensor) -> torch.Tensor:
    h = F.layer_norm(x, (64,), m.w, m.b)
    h = F.rms_norm(F.linear(h, m.lin.weight, m.lin.bias), (64,), m.w, 1e-6)
    B, S, _ = h.shape
    q = h.view(B, S, 2, 32).transpose(1, 2).contiguous()
    q = torch.cat([q, q], -1)
    a = F.scaled_dot_product_attention(q, q, q, is_causal=True)[..., :32].transpose(1, 2).reshape(B, S, 64)
    return torch.softmax(a.reshape(-1, 64) @ m.lin.weight.t(), -1)


def _model():
    torch.manual_seed(0)
    return Block().to("cuda", torch.bfloat16).eval()


def _x(B=2, S=64, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(B, S, 64, device="cuda", dtype=torch.bfloat16, generator=g)


def test_triton_winners_are_used_and_correct(triton_table):
    m, x = _model(), _x()
    for op, args in (("gemm", (x.reshape(-1, 64), m.lin.weight.t())), ("rms_norm", (x, m.w)), ("softmax", (x,))):
        assert ops_adv.explain(op, *args)["impl"] == TRITON[op][0]
    with torch.no_grad():
        torch.testing.assert_close(m(x), _reference(m, x), rtol=2e-2, atol=2e-2)


def test_compile_fullgraph_and_cuda_graphs(triton_table):
    m = _model()
    torch._dynamo.reset()
    assert torch._dynamo.explain(m)(_x()).graph_break_count == 0
    compiled = torch.compile(m, fullgraph=True)
    with torch.no_grad():
        for S in (64, 96, 64):
            x = _x(S=S, seed=S)
            torch.testing.assert_close(compiled(x), _reference(m, x), rtol=2e-2, atol=2e-2)
        # capture the eager model (Triton winners) in a CUDA graph and replay it on new data
        static = _x(seed=5)
        m(static)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = m(static)
        for seed in (6, 7):
            static.copy_(_x(seed=seed))
            graph.replay()
            torch.testing.assert_close(out, _reference(m, static), rtol=2e-2, atol=2e-2)


def test_backward_on_the_gpu(triton_table):
    m = _model().float()
    x = _x().float().requires_grad_()
    m(x).square().sum().backward()
    got = [x.grad.clone()] + [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    x2 = x.detach().clone().requires_grad_()
    _reference(m, x2).square().sum().backward()
    for g, r in zip(got, [x2.grad] + [p.grad for p in m.parameters()]):
        torch.testing.assert_close(g, r, rtol=2e-2, atol=1e-3)


def test_converted_bf16_llama_matches():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512)
    ref = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    model = ops_adv.convert_model(copy.deepcopy(ref))
    ids = torch.randint(0, 512, (2, 128), device="cuda")
    with torch.no_grad():
        p = torch.log_softmax(ref(ids).logits.float(), -1)
        q = torch.log_softmax(model(ids).logits.float(), -1)
    kl = (p.exp() * (p - q)).sum(-1).mean().item()
    assert kl < 0.01, kl
