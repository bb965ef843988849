"""The linear op (x @ W.T + b, then an activation): its implementations against the reference, and
the runtime `ops_adv.ops.linear.linear_fused` against F.linear + torch's activation (eager, fallbacks,
custom operator, autograd, torch.compile)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernel_space import get_impl, get_op, relative_error
from kernel_space.linear import ACTIVATIONS, LinearProblem, activate
from ops_adv import _dispatch
from ops_adv.ops.linear import linear_fused as linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SPEC = get_op("linear")


def _check_impl(name: str, problem: LinearProblem, params: dict | None = None) -> None:
    impl = get_impl("linear", name)
    config = {**impl.default_params(), **(params or {})}
    assert impl.check is None or impl.check(problem, config) is None, impl.check(problem, config)
    args, attrs = SPEC.make_inputs(problem, DEVICE, seed=0)
    ref = SPEC.reference(*args, **attrs)
    out = impl.bind(config)(*args, **attrs)
    err = relative_error(out, ref)
    assert err <= SPEC.tolerance(problem.dtype), f"{name} {problem}: relative error {err:.3g}"


def test_signature_equals_the_problem():
    p = LinearProblem(6, 40, 24, True, "silu", "fp16")
    args, attrs = SPEC.make_inputs(p, "cpu")
    assert SPEC.signature(*args, **attrs) == tuple(p)
    assert SPEC.parse_problem(p._asdict()) == p
    with pytest.raises(Exception, match="activation"):
        SPEC.parse_problem({**p._asdict(), "activation": "tanh"})


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("bias", [False, True])
def test_vendor_candidates(activation, bias):
    p = LinearProblem(9, 20, 16, bias, activation, "fp32")
    _check_impl("torch_linear", p)
    backend = "cuda" if DEVICE == "cuda" else "cpu"
    name = "torch_addmm_activation" if backend == "cuda" else "torch_addmm_activation_cpu"
    why = get_impl("linear", name).why_not(p, backend=backend)
    supported = ("relu", "gelu_tanh") if backend == "cuda" else ("relu", "gelu")
    assert (why is None) == (bias and activation in supported), why
    if why is None:
        _check_impl(name, p)


TRITON_DTYPES = [
    "fp16",
    "fp32",
    pytest.param("bf16", marks=pytest.mark.skipif(DEVICE == "cpu", reason="the Triton interpreter multiplies bf16 dot operands as raw bits")),
]


@pytest.mark.parametrize("dtype", TRITON_DTYPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_triton_candidates(dtype, activation):
    pytest.importorskip("triton")
    p = LinearProblem(5, 33, 40, activation != "none", activation, dtype)
    _check_impl("triton", p, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 1, "num_warps": 4, "num_stages": 2})
    _check_impl("triton_splitk_decode", p, {"BLOCK_N": 16, "BLOCK_K": 16, "SPLIT_K": 2, "num_warps": 2, "num_stages": 2})


@pytest.mark.parametrize("activation", ["gelu", "silu"])
def test_tma_candidate(activation):
    pytest.importorskip("triton")
    from kernel_space.gemm.triton import _tma_supported

    if _tma_supported():
        pytest.skip(_tma_supported())
    p = LinearProblem(72, 40, 24, True, activation, "fp16")
    _check_impl("triton_tma", p, {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 4, "num_warps": 4,
                                  "num_stages": 2, "FLATTEN": False})


def test_decode_candidate_refuses_prefill():
    why = get_impl("linear", "triton_splitk_decode").check(LinearProblem(128, 4096, 4096, True, "silu", "bf16"),
                                                           get_impl("linear", "triton_splitk_decode").default_params())
    assert "M <= 64" in why


def _expected(x, w, b, act):
    return activate(F.linear(x, w, b), "none" if act is None else act)


@pytest.mark.parametrize("activation", [None, *ACTIVATIONS])
@pytest.mark.parametrize("shape", [(5, 16), (2, 3, 16), (2, 1, 2, 16)])
def test_runtime_matches_torch(activation, shape):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g)
    w = torch.randn(24, 16, generator=g)
    for b in (None, torch.randn(24, generator=g)):
        got = linear(x, w, b, activation)
        want = _expected(x, w, b, activation)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want)
    M = x.numel() // 16
    key = ((M, 24, 16, True, "none" if activation is None else activation, "fp32"), x.device)
    assert key in _dispatch.cache_for("linear")  # the eager path went through the table


def test_runtime_falls_back_to_torch():
    x = torch.randn(3, 16)
    w = torch.randn(8, 16)
    b = torch.randn(8)
    torch.testing.assert_close(linear(x[0], w, b, "relu"), F.relu(F.linear(x[0], w, b)))  # 1-D x
    torch.testing.assert_close(linear(x, w.t().contiguous().t(), b), F.linear(x, w, b))  # non-contiguous weight
    torch.testing.assert_close(linear(x, w, b[:1], "silu"), F.silu(F.linear(x, w, b[:1])))  # broadcast bias
    assert linear(x[:0], w, b).shape == (0, 8)
    torch.testing.assert_close(linear(x.double(), w.double(), None, "gelu_tanh"),
                               F.gelu(F.linear(x.double(), w.double()), approximate="tanh"))  # float64: torch itself


@pytest.mark.parametrize(
    "args",
    [
        lambda: (torch.randn(3, 16), torch.randn(8, 16, dtype=torch.float16), None),  # mixed dtypes
        lambda: (torch.randn(3, 16), torch.randn(8, 15), None),  # mismatched K
        lambda: (torch.randn(3, 16), torch.randn(8, 16), torch.randn(7)),  # mismatched bias
        lambda: (torch.randn(3, 16), torch.randn(8, 16), torch.randn(8, dtype=torch.float16)),  # bias dtype
    ],
)
def test_runtime_raises_torchs_error(args):
    x, w, b = args()
    with pytest.raises(RuntimeError) as theirs:
        F.linear(x, w, b)
    with pytest.raises(RuntimeError) as ours:
        linear(x, w, b, "relu")
    assert str(ours.value) == str(theirs.value)


def test_unknown_activation():
    with pytest.raises(ValueError, match="activation 'tanh' is not one of"):
        linear(torch.randn(2, 4), torch.randn(3, 4), None, "tanh")


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gradients_match_torch(activation):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 16, generator=g, requires_grad=True)
    w = torch.randn(8, 16, generator=g, requires_grad=True)
    b = torch.randn(8, generator=g, requires_grad=True)
    gy = torch.randn(2, 3, 8, generator=g)
    ours = torch.autograd.grad(linear(x, w, b, activation), (x, w, b), gy)
    theirs = torch.autograd.grad(_expected(x, w, b, activation), (x, w, b), gy)
    for a, t in zip(ours, theirs):
        torch.testing.assert_close(a, t)


def test_custom_operator_registration():
    x, w, b = torch.randn(4, 16), torch.randn(8, 16), torch.randn(8)
    torch.library.opcheck(torch.ops.ops_adv.linear.default, (x, w, b, "gelu"))
    torch.library.opcheck(torch.ops.ops_adv.linear.default, (x.view(2, 2, 16), w, None, "none"))


def test_torch_compile_fullgraph():
    x, w, b = torch.randn(2, 3, 16), torch.randn(8, 16), torch.randn(8)

    def mlp(x):
        return linear(x * 2.0, w, b, "silu") + 1.0

    compiled = torch.compile(mlp, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), F.silu(F.linear(x * 2.0, w, b)) + 1.0)


# --------------------------------------------------------------------------- ops_adv.linear without an activation

import json  # noqa: E402

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import ops_adv  # noqa: E402
from ops_adv import _table  # noqa: E402


class _AtenCalls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def _gemm_table(path, impl: str, params: dict) -> str:
    winners = [{"op": "gemm", "problem": {"M": 16, "N": 32, "K": 64, "dtype": dt, "trans_a": False, "trans_b": True},
                "impl": impl, "params": params, "kernel_version": get_impl("gemm", impl).version, "median_ms": 1.0,
                "vendor_impl": "torch_matmul", "vendor_ms": 2.0, "speedup": 2.0} for dt in ("fp32", "bf16")]
    path.write_text(json.dumps({"format": _table.FORMAT, "format_version": _table.FORMAT_VERSION, "device_class": "cpu",
                                "fingerprint": {}, "winners": winners, "checksum": _table.checksum(winners)}))
    return str(path)


@pytest.mark.parametrize("table", ["empty", "vendor"])
def test_linear_with_bias_is_one_addmm_when_the_vendor_runs(tmp_path, table):
    """The vendor choice runs F.linear itself: one addmm, the bias rounded once (bf16 bit for bit)."""
    ops_adv.load_table("" if table == "empty" else _gemm_table(tmp_path / "t.json", "torch_matmul", {}))
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(16, 64, generator=g).bfloat16()
        w, b = torch.randn(32, 64, generator=g).bfloat16(), torch.randn(32, generator=g).bfloat16()
        with torch.no_grad():
            ops_adv.linear(x, w, b)  # resolves the problem
            with _AtenCalls() as calls:
                y = ops_adv.linear(x, w, b)
        assert calls.ops == ["t", "addmm"]  # F.linear's own decomposition, nothing else
        assert torch.equal(y, F.linear(x, w, b))
        x3 = torch.randn(2, 3, 64, generator=g).bfloat16()  # 3-D x and 1 row
        for xx in (x3, x3[0, :1]):
            assert torch.equal(ops_adv.linear(xx, w, b), F.linear(xx, w, b))
        xg = x.float().requires_grad_()  # autograd: torch's own graph
        assert torch.equal(ops_adv.linear(xg, w.float(), b.float()), F.linear(xg, w.float(), b.float()))
        assert ops_adv.linear(xg, w.float(), b.float()).grad_fn.name() == "AddmmBackward0"
    finally:
        ops_adv.load_table("")


def test_linear_runs_a_tuned_gemm_kernel_then_the_bias(tmp_path):
    ops_adv.load_table(_gemm_table(tmp_path / "t.json", "cpu_blocked", {"block_m": 32, "block_n": 32, "block_k": 0}))
    try:
        g = torch.Generator().manual_seed(1)
        x, w, b = torch.randn(2, 8, 64, generator=g), torch.randn(32, 64, generator=g), torch.randn(32, generator=g)
        with torch.no_grad(), ops_adv.profiler.ProfileContext() as prof:
            y = ops_adv.linear(x, w, b)
        assert [(c["op"], c["impl"], c["source"]) for c in prof.calls] == [("gemm", "cpu_blocked", "tuned")]
        torch.testing.assert_close(y, F.linear(x, w, b))
        torch.testing.assert_close(ops_adv.linear(x[0], w, b), F.linear(x[0], w, b))
        torch.testing.assert_close(ops_adv.linear(x[0, 0], w, None), F.linear(x[0, 0], w))  # 1-D x
        torch.testing.assert_close(ops_adv.linear(x.transpose(0, 1), w, b), F.linear(x.transpose(0, 1), w, b))
    finally:
        ops_adv.load_table("")


def test_linear_vendor_calls_are_profiled_and_counted_as_misses():
    ops_adv.load_table("")
    x, w, b = torch.randn(5, 24), torch.randn(12, 24), torch.randn(12)
    key = ("gemm", (5, 12, 24, "fp32", False, True))
    before = ops_adv.misses().get(key, 0)
    with torch.no_grad(), ops_adv.profiler.ProfileContext() as prof:
        ops_adv.linear(x, w, b)
    assert [(c["op"], c["impl"], c["source"]) for c in prof.calls] == [("gemm", "torch_matmul", "default")]
    with torch.no_grad():
        for _ in range(3):
            ops_adv.linear(x, w, b)
    assert ops_adv.misses()[key] == before + 4
