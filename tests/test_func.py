"""torch.func transforms (grad, jacrev, vmap, per-sample gradients) over ops_adv calls, with and
without a table whose winners are not the default: under a transform torch's own function runs."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, jacrev, vmap

import kernel_space
import ops_adv
from ops_adv import _table


def _winner(op: str, problem: dict, impl: str, params: dict) -> dict:
    return {"op": op, "problem": problem, "impl": impl, "params": params,
            "kernel_version": kernel_space.get_impl(op, impl).version, "median_ms": 1.0, "vendor_impl": "x",
            "vendor_ms": 2.0, "speedup": 2.0}


def _rows(op: str, impl: str) -> dict:
    return _winner(op, {"rows": 32, "cols": 16, "dtype": "fp32"}, impl, {})


@pytest.fixture(params=["table", "no_table"])
def table(request, tmp_path, monkeypatch):
    """A table whose winners apply to every call here (CPU kernels of ops-adv, tuned vendor rows), or none."""
    if request.param == "no_table":
        ops_adv.load_table("")
        yield False
        return
    winners = [
        _winner("gemm", {"M": 16, "N": 16, "K": 16, "dtype": "fp32", "trans_a": False, "trans_b": tb}, "cpu_blocked",
                {"block_m": 32, "block_n": 32, "block_k": 0}) for tb in (False, True)
    ] + [
        _winner("attention", {"B": 2, "H": 2, "Sq": 8, "Skv": 8, "D": 16, "causal": c, "dtype": "fp32"}, "cpu_chunked",
                {"block_q": 16, "block_kv": 0}) for c in (False, True)
    ] + [_rows("rms_norm", "torch_rms_norm"), _rows("layer_norm", "torch_layer_norm"), _rows("softmax", "torch_softmax")]
    path = tmp_path / "forced.json"
    path.write_text(json.dumps({"format": _table.FORMAT, "format_version": _table.FORMAT_VERSION, "device_class": "cpu",
                                "fingerprint": {}, "winners": winners, "checksum": _table.checksum(winners)}))
    monkeypatch.setenv("OPS_ADV_NEAREST", "1000")
    ops_adv.load_table(str(path))
    yield True
    ops_adv.load_table("")


torch.manual_seed(0)
X, W, B = torch.randn(6, 16), torch.randn(16, 16), torch.randn(16)
G = torch.rand(16) + 0.5
Q = torch.randn(2, 2, 8, 16)

# name -> (ops_adv function of one tensor, torch's, the tensor)
CASES = {
    "gemm": (lambda a: ops_adv.gemm(a, W), lambda a: a @ W, X),
    "linear": (lambda w: ops_adv.linear(X, w, B), lambda w: F.linear(X, w, B), W),
    "linear_x": (lambda x: ops_adv.linear(x, W, B), lambda x: F.linear(x, W, B), X),
    "linear_relu": (lambda x: ops_adv.linear(x, W, B, "relu"), lambda x: F.relu(F.linear(x, W, B)), X),
    "rms_norm": (lambda x: ops_adv.rms_norm(x, (16,), G), lambda x: F.rms_norm(x, (16,), G), X),
    "layer_norm": (lambda x: ops_adv.layer_norm(x, (16,), G, B), lambda x: F.layer_norm(x, (16,), G, B), X),
    "softmax": (lambda x: ops_adv.softmax(x, -1), lambda x: torch.softmax(x, -1), X),
    "attention": (lambda q: ops_adv.attention(q, q, q, is_causal=True),
                  lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True), Q),
}


def test_the_table_applies(table):
    """The transforms below meet the table's kernels, not the default (what used to fail)."""
    if not table:
        pytest.skip("no table")
    assert ops_adv.explain("gemm", X, W)["impl"] == "cpu_blocked"
    assert ops_adv.explain("gemm", X, W.t())["impl"] == "cpu_blocked"
    assert ops_adv.explain("attention", Q, Q, Q, is_causal=True)["impl"] == "cpu_chunked"
    assert ops_adv.explain("rms_norm", X, G)["source"] == "nearest"
    assert ops_adv.explain("layer_norm", X, G)["source"] == "nearest"
    assert ops_adv.explain("softmax", X)["source"] == "nearest"


@pytest.mark.parametrize("name", sorted(CASES))
def test_grad(table, name):
    ours, ref, t = CASES[name]
    torch.testing.assert_close(grad(lambda t: (ours(t) ** 2).sum())(t), grad(lambda t: (ref(t) ** 2).sum())(t))


@pytest.mark.parametrize("name", sorted(CASES))
def test_jacrev(table, name):
    ours, ref, t = CASES[name]
    torch.testing.assert_close(jacrev(ours)(t), jacrev(ref)(t))


@pytest.mark.parametrize("name", sorted(CASES))
def test_vmap(table, name):
    ours, ref, t = CASES[name]
    batch = torch.stack([t, 2 * t, t - 1])
    torch.testing.assert_close(vmap(ours)(batch), vmap(ref)(batch))


def test_per_sample_gradients(table):
    """vmap(grad(...)): a gradient per example, of a linear + rms_norm + softmax model."""
    def loss(ours):
        def f(w, x):
            if ours:
                h = ops_adv.rms_norm(ops_adv.linear(x[None], w, B), G)
                return ops_adv.softmax(h, -1)[0, 0].log()
            h = F.rms_norm(F.linear(x[None], w, B), (16,), G)
            return torch.softmax(h, -1)[0, 0].log()
        return f

    ours = vmap(grad(loss(True)), in_dims=(None, 0))(W, X)
    ref = vmap(grad(loss(False)), in_dims=(None, 0))(W, X)
    assert ours.shape == (6, 16, 16)
    torch.testing.assert_close(ours, ref)


def test_eager_still_runs_the_table_after_a_transform(table):
    """The transform check is per call: outside one, the table's kernel runs again."""
    vmap(CASES["gemm"][0])(torch.stack([X, X]))
    with ops_adv.profiler.ProfileContext() as prof:
        ops_adv.gemm(X, W)
    assert [c["impl"] for c in prof.calls] == (["cpu_blocked"] if table else ["torch_matmul"])
