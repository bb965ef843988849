"""The runtime takes torch's own argument lists (F.rms_norm, F.layer_norm, F.conv2d, SDPA, softmax), in the
op functions and in explain() and benchmark(); the short norm forms (x, weight, ...) keep working."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

import kernel_space
import ops_adv
from kernel_space import OpsAdvError
from ops_adv import _table

torch.manual_seed(0)
X = torch.randn(4, 6, 32)
W = torch.rand(32) + 0.5
B = torch.randn(32)
IMG = torch.randn(2, 3, 9, 9)
CW = torch.randn(8, 3, 3, 3)
CB = torch.randn(8)
GW = torch.randn(6, 1, 3, 3)  # groups=3


def _winner(op: str, problem: dict, impl: str, params: dict) -> dict:
    return {"op": op, "problem": problem, "impl": impl, "params": params,
            "kernel_version": kernel_space.get_impl(op, impl).version, "median_ms": 1.0, "vendor_impl": "x",
            "vendor_ms": 2.0, "speedup": 2.0}


@pytest.fixture
def tuned(tmp_path):
    """A table holding this file's norm and conv problems exactly (tuned vendor rows: the CPU has no others)."""
    winners = [
        _winner("rms_norm", {"rows": 24, "cols": 32, "dtype": "fp32"}, "torch_rms_norm", {}),
        _winner("layer_norm", {"rows": 24, "cols": 32, "dtype": "fp32"}, "torch_layer_norm", {}),
        _winner("conv2d", {"N": 2, "C": 3, "H": 9, "W": 9, "K": 8, "R": 3, "S": 3, "stride": 1, "padding": 1,
                           "dilation": 1, "layout": "nchw", "dtype": "fp32"}, "cudnn_nchw", {}),
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"format": _table.FORMAT, "format_version": _table.FORMAT_VERSION, "device_class": "cpu",
                                "fingerprint": {}, "winners": winners, "checksum": _table.checksum(winners)}))
    ops_adv.load_table(str(path))
    yield
    ops_adv.load_table("")


@pytest.mark.parametrize("call", [
    lambda: (ops_adv.rms_norm(X, (32,), W), F.rms_norm(X, (32,), W)),
    lambda: (ops_adv.rms_norm(X, [32], W, 1e-3), F.rms_norm(X, [32], W, 1e-3)),
    lambda: (ops_adv.rms_norm(X, (32,), weight=W, eps=1e-3), F.rms_norm(X, (32,), weight=W, eps=1e-3)),
    lambda: (ops_adv.rms_norm(X, X.shape[-1:], W), F.rms_norm(X, X.shape[-1:], W)),
    lambda: (ops_adv.rms_norm(X, (32,)), F.rms_norm(X, (32,))),  # no weight
    lambda: (ops_adv.rms_norm(X, (6, 32), torch.ones(6, 32)), F.rms_norm(X, (6, 32), torch.ones(6, 32))),
    lambda: (ops_adv.rms_norm(X, W), F.rms_norm(X, (32,), W)),  # short forms
    lambda: (ops_adv.rms_norm(X, W, 1e-3), F.rms_norm(X, (32,), W, 1e-3)),
    lambda: (ops_adv.rms_norm(X, W, eps=1e-3), F.rms_norm(X, (32,), W, 1e-3)),
    lambda: (ops_adv.rms_norm(X, weight=W), F.rms_norm(X, (32,), W)),
], ids=lambda f: "")
def test_rms_norm_takes_torchs_arguments(tuned, call):
    ours, ref = call()
    torch.testing.assert_close(ours, ref)


@pytest.mark.parametrize("call", [
    lambda: (ops_adv.layer_norm(X, (32,), W, B, 1e-3), F.layer_norm(X, (32,), W, B, 1e-3)),
    lambda: (ops_adv.layer_norm(X, [32], W), F.layer_norm(X, [32], W)),
    lambda: (ops_adv.layer_norm(X, (32,), weight=W, bias=B, eps=1e-3), F.layer_norm(X, (32,), W, B, 1e-3)),
    lambda: (ops_adv.layer_norm(X, (32,)), F.layer_norm(X, (32,))),
    lambda: (ops_adv.layer_norm(X, (6, 32)), F.layer_norm(X, (6, 32))),
    lambda: (ops_adv.layer_norm(X, W, B), F.layer_norm(X, (32,), W, B)),  # short forms
    lambda: (ops_adv.layer_norm(X, W, B, 1e-3), F.layer_norm(X, (32,), W, B, 1e-3)),
    lambda: (ops_adv.layer_norm(X, W, None, 1e-3), F.layer_norm(X, (32,), W, None, 1e-3)),
    lambda: (ops_adv.layer_norm(X, W, bias=B), F.layer_norm(X, (32,), W, B)),
    lambda: (ops_adv.layer_norm(X, W, B, eps=1e-3), F.layer_norm(X, (32,), W, B, 1e-3)),
], ids=lambda f: "")
def test_layer_norm_takes_torchs_arguments(tuned, call):
    ours, ref = call()
    torch.testing.assert_close(ours, ref)


def test_norm_shape_errors_are_torchs():
    for ours, ref in ((lambda: ops_adv.rms_norm(X, (31,), W), lambda: F.rms_norm(X, (31,), W)),
                      (lambda: ops_adv.layer_norm(X, (31,), W), lambda: F.layer_norm(X, (31,), W)),
                      (lambda: ops_adv.rms_norm(X, 32, W), lambda: F.rms_norm(X, 32, W)),  # an int: torch refuses it
                      (lambda: ops_adv.layer_norm(X, 32, W), lambda: F.layer_norm(X, 32, W))):
        with pytest.raises((RuntimeError, TypeError)) as want:
            ref()
        with pytest.raises(want.type) as got:
            ours()
        assert str(got.value) == str(want.value)


@pytest.mark.parametrize("call", [
    lambda f: f(IMG, CW, CB, 1, 1, 1, 1),
    lambda f: f(IMG, CW, CB, padding=1),
    lambda f: f(IMG, CW, bias=CB, stride=2, padding=(1, 1)),
    lambda f: f(IMG, CW, None, 1, 1),
    lambda f: f(IMG, CW, padding="same"),
    lambda f: f(IMG, GW, None, 1, 1, 1, 3),
], ids=lambda f: "")
def test_conv2d_takes_torchs_arguments(tuned, call):
    torch.testing.assert_close(call(ops_adv.conv2d), call(F.conv2d))


def test_explain_takes_torchs_arguments(tuned):
    d = ops_adv.explain("conv2d", IMG, CW, CB, padding=1)  # the bias is not the stride
    assert (d["impl"], d["source"], d["problem"]["stride"], d["problem"]["padding"]) == ("cudnn_nchw", "tuned", 1, 1)
    assert ops_adv.explain("conv2d", IMG, CW, CB, 1, 1)["source"] == "tuned"
    assert ops_adv.explain("conv2d", IMG, CW, bias=CB, padding=1)["source"] == "tuned"
    assert ops_adv.explain("conv2d", IMG, CW, padding=1)["source"] == "tuned"  # the kernels' own form
    assert ops_adv.explain("conv2d", IMG, CW, CB, padding=1, groups=1)["source"] == "tuned"
    assert ops_adv.explain("conv2d", IMG, GW, None, 1, 1, 1, 3)["source"] == "torch"
    for args in ((X, (32,), W), (X, [32], W, 1e-3), (X, W), (X, W, 1e-5)):
        d = ops_adv.explain("rms_norm", *args)
        assert (d["source"], d["problem"]) == ("tuned", {"rows": 24, "cols": 32, "dtype": "fp32"}), args
    assert ops_adv.explain("rms_norm", X, (6, 32), torch.ones(6, 32))["source"] == "torch"
    for args in ((X, (32,), W, B, 1e-3), (X, (32,), W), (X, W, B), (X, W, B, 1e-5)):
        assert ops_adv.explain("layer_norm", *args)["source"] == "tuned", args
    assert ops_adv.explain("layer_norm", X, (32,), weight=W, bias=B)["source"] == "tuned"
    q = torch.randn(1, 2, 8, 16)
    assert ops_adv.explain("attention", q, q, q, is_causal=True)["problem"]["causal"] is True
    assert ops_adv.explain("attention", q, q, q, causal=True)["problem"]["causal"] is True
    assert ops_adv.explain("attention", q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.bool))["source"] == "torch"
    assert ops_adv.explain("softmax", X, -1)["problem"]["rows"] == 24
    assert ops_adv.explain("softmax", X, 0)["source"] == "torch"


def test_benchmark_takes_torchs_arguments(tuned):
    rows = ops_adv.benchmark("conv2d", IMG, CW, CB, padding=1, reps=2)
    assert [r["impl"] for r in rows if r["chosen"]] == ["cudnn_nchw"]
    assert all(r["status"] == "ok" for r in rows if r["ms"] is not None)
    rows = ops_adv.benchmark("rms_norm", X, (32,), W, 1e-3, reps=2)
    assert [r["impl"] for r in rows if r["chosen"]] == ["torch_rms_norm"]
    assert next(r for r in rows if r["impl"] == "torch_rms_norm")["status"] == "ok"
    rows = ops_adv.benchmark("layer_norm", X, (32,), W, B, reps=2)
    assert next(r for r in rows if r["impl"] == "torch_layer_norm")["status"] == "ok"
    with pytest.raises(OpsAdvError, match="no conv2d kernel covers this call"):
        ops_adv.benchmark("conv2d", IMG, GW, None, 1, 1, 1, 3)
