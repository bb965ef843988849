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
