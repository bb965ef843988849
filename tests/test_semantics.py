"""Same semantics as torch whatever the table holds: PyTorch's OpInfo samples and property tests,
with a table that forces ops-adv's own CPU kernels wherever they can run."""
from __future__ import annotations

import itertools
import json

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kernel_space
import ops_adv
from ops_adv import _table

pytest.importorskip("expecttest")  # torch's OpInfo database needs it
from torch.testing._internal.common_methods_invocations import op_db  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Parameters valid for every problem: these candidates then stand in for every problem of their op.
FORCE = {"gemm": ("cpu_blocked", {"block_m": 32, "block_n": 32, "block_k": 0}),
         "attention": ("cpu_chunked", {"block_q": 16, "block_kv": 0})}


def _forcing_winners() -> list[dict]:
    out = []
    for dtype, ta, tb in itertools.product(DTYPES, (False, True), (False, True)):
        out.append({"op": "gemm", "problem": {"M": 64, "N": 64, "K": 64, "dtype": dtype, "trans_a": ta, "trans_b": tb}})
    for dtype, causal in itertools.product(DTYPES, (False, True)):
        out.append({"op": "attention", "problem": {"B": 2, "H": 2, "Sq": 64, "Skv": 64, "D": 64, "causal": causal, "dtype": dtype}})
    for w in out:
        impl, params = FORCE[w["op"]]
        w.update(impl=impl, params=params, kernel_version=kernel_space.get_impl(w["op"], impl).version, median_ms=1.0,
                 vendor_impl="x", vendor_ms=2.0, speedup=2.0)
    return out


@pytest.fixture(scope="module")
def forced(tmp_path_factory):
    winners = _forcing_winners()
    path = tmp_path_factory.mktemp("forced") / "t.json"
    path.write_text(json.dumps({"format": _table.FORMAT, "format_version": _table.FORMAT_VERSION, "device_class": "cpu",
                                "fingerprint": {}, "winners": winners, "checksum": _table.checksum(winners)}))
    mp = pytest.MonkeyPatch()
    mp.setenv("OPS_ADV_NEAREST", "1e9")
    ops_adv.load_table(str(path))
    yield
    mp.undo()
    ops_adv.load_table("")


def _same(ours, theirs) -> None:
    """Both raise the same kind of error, or both return close results of the same dtype and shape.
    Both draw from the same random state (dropout)."""
    try:
        torch.manual_seed(0)
        want = theirs()
    except Exception as e:  # torch refuses: so must we, with the same kind of error
        with pytest.raises(type(e)):
            ours()
        return
    torch.manual_seed(0)
    got = ours()
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype in (torch.float32, torch.float64) or not want.is_floating_point():
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, equal_nan=True)
    else:  # 16-bit: the tolerance the tuner holds every kernel to (relative L2 error), NaN where torch has NaN
        assert torch.equal(got.isnan(), want.isnan())
        ok = ~want.isnan()
        assert kernel_space.relative_error(got[ok], want[ok]) <= 2e-2


def _samples(name: str, dtype: torch.dtype, variant: str = ""):
    (info,) = [o for o in op_db if o.name == name and o.variant_test_name == variant]
    return list(info.sample_inputs("cpu", dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_opinfo_matmul_linear_softmax_sdpa_conv2d(forced, dtype):
    calls = 0
    for s in _samples("matmul", dtype):
        _same(lambda: ops_adv.gemm(s.input, *s.args, **s.kwargs), lambda: torch.matmul(s.input, *s.args, **s.kwargs))
        calls += 1
    for s in _samples("nn.functional.linear", dtype):
        _same(lambda: ops_adv.linear(s.input, *s.args, **s.kwargs), lambda: F.linear(s.input, *s.args, **s.kwargs))
        calls += 1
    for variant in ("", "with_dtype"):
        for s in _samples("softmax", dtype, variant):
            _same(lambda: ops_adv.softmax(s.input, *s.args, **s.kwargs), lambda: torch.softmax(s.input, *s.args, **s.kwargs))
            calls += 1
    for s in _samples("nn.functional.scaled_dot_product_attention", dtype):
        _same(lambda: ops_adv.attention(s.input, *s.args, **s.kwargs),
              lambda: F.scaled_dot_product_attention(s.input, *s.args, **s.kwargs))
        calls += 1
    for s in _samples("nn.functional.conv2d", dtype):
        _same(lambda: ops_adv.conv2d(s.input, *s.args, **s.kwargs), lambda: F.conv2d(s.input, *s.args, **s.kwargs))
        calls += 1
    assert calls > 80
    assert ops_adv.explain("gemm", torch.randn(8, 8, dtype=dtype), torch.randn(8, 8, dtype=dtype))["impl"] == "cpu_blocked"


def _module_for(kind: str, s):
    """A converted nn.LayerNorm / nn.RMSNorm holding the sample's normalized_shape, weight, bias and eps."""
    shape = s.args[0]
    weight = s.args[1] if len(s.args) > 1 else s.kwargs.get("weight")
    bias = s.args[2] if len(s.args) > 2 else s.kwargs.get("bias")
    eps = s.kwargs.get("eps", s.args[3] if len(s.args) > 3 else None)
    if kind == "layer_norm":
        m = torch.nn.LayerNorm(shape, eps=1e-5 if eps is None else eps, elementwise_affine=weight is not None,
                               bias=bias is not None, dtype=s.input.dtype)
    else:
        m = torch.nn.RMSNorm(shape, eps=eps, elementwise_affine=weight is not None, dtype=s.input.dtype)
    with torch.no_grad():
        if weight is not None:
            m.weight.copy_(weight)
        if bias is not None:
            m.bias.copy_(bias)
    return ops_adv.convert_model(m), (weight, bias, eps)


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_opinfo_norms_through_converted_modules(forced, kind, dtype):
    for s in _samples(f"nn.functional.{kind}", dtype):
        m, (weight, bias, eps) = _module_for(kind, s)
        if kind == "layer_norm":
            ref = lambda: F.layer_norm(s.input, s.args[0], weight, bias, 1e-5 if eps is None else eps)  # noqa: E731
        else:
            ref = lambda: F.rms_norm(s.input, s.args[0], weight, eps)  # noqa: E731
        with torch.no_grad():
            _same(lambda: m(s.input), ref)


# ----------------------------------------------------------------------------- properties

dims = st.integers(0, 40)
dtypes = st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64])


def _matrix(rows: int, cols: int, dtype, transposed: bool, strided: bool, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (cols, rows) if transposed else (rows, cols)
    if strided:  # every other column of a wider matrix
        t = torch.randn(shape[0], shape[1] * 2, generator=g).to(dtype)[:, ::2]
    else:
        t = torch.randn(*shape, generator=g).to(dtype)
    return t.t() if transposed else t


FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FAST
@given(M=dims, N=dims, K=dims, dtype=dtypes, ta=st.booleans(), tb=st.booleans(), sa=st.booleans(), sb=st.booleans(),
       seed=st.integers(0, 100))
def test_gemm_is_matmul(forced, M, N, K, dtype, ta, tb, sa, sb, seed):
    a = _matrix(M, K, dtype, ta, sa, seed)
    b = _matrix(K, N, dtype, tb, sb, seed + 1)
    _same(lambda: ops_adv.gemm(a, b), lambda: torch.matmul(a, b))


@FAST
@given(lead=st.lists(st.integers(0, 6), max_size=2), cols=dims, dtype=dtypes, seed=st.integers(0, 100))
def test_rowwise_ops_are_torchs(forced, lead, cols, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, cols, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(cols, generator=g)).to(dtype)
    b = (0.1 * torch.randn(cols, generator=g)).to(dtype)
    _same(lambda: ops_adv.softmax(x), lambda: torch.softmax(x, -1))
    _same(lambda: ops_adv.rms_norm(x, w), lambda: F.rms_norm(x, (cols,), w))
    _same(lambda: ops_adv.layer_norm(x, w, b), lambda: F.layer_norm(x, (cols,), w, b))


@FAST
@given(B=st.integers(0, 3), H=st.integers(0, 3), Sq=st.integers(0, 24), Skv=st.integers(0, 24), D=st.sampled_from([0, 8, 16]),
       causal=st.booleans(), dtype=dtypes, seed=st.integers(0, 100))
def test_attention_is_sdpa(forced, B, H, Sq, Skv, D, causal, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Sq, D, generator=g).to(dtype)
    k = torch.randn(B, H, Skv, D, generator=g).to(dtype)
    v = torch.randn(B, H, Skv, D, generator=g).to(dtype)
    _same(lambda: ops_adv.attention(q, k, v, is_causal=causal), lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
