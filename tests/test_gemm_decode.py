"""gemm's split-K decode kernel and the fused epilogue of both gemm kernels, against the references.

Without a GPU the kernels run under TRITON_INTERPRET=1 (set by conftest) on tiny problems;
bf16 only on CUDA (the interpreter multiplies bf16 dot operands as raw bits).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernel_space import get_impl, get_op, relative_error
from kernel_space.gemm import GemmProblem
from kernel_space.linear import ACTIVATIONS, activate

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [
    "fp16",
    "fp32",
    pytest.param("bf16", marks=pytest.mark.skipif(DEVICE == "cpu", reason="the Triton interpreter multiplies bf16 dot operands as raw bits")),
]
DECODE = {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 1, "num_warps": 2, "num_stages": 2}


@pytest.fixture
def poisoned_workspace(monkeypatch):
    """Split-K partials start as NaN: a partial the reduction reads but nobody wrote shows."""
    from kernel_space.gemm import _kernels as kmod

    monkeypatch.setattr(kmod, "_new_workspace", lambda s, device: torch.full(s, float("nan"), dtype=torch.float32, device=device))
    return kmod


def _decode(problem: GemmProblem, params: dict, calls: int = 1) -> None:
    impl = get_impl("gemm", "triton_splitk_decode")
    config = {**impl.default_params(), **params}
    assert impl.check(problem, config) is None, impl.check(problem, config)
    spec = get_op("gemm")
    (a, b), _ = spec.make_inputs(problem, DEVICE, seed=0)
    ref = spec.reference(a, b)
    for _ in range(calls):  # a counter left non-zero by the first call would skip the second's reduction
        out = torch.full(ref.shape, float("nan"), dtype=a.dtype, device=DEVICE)
        assert impl.fn(a, b, **config, out=out) is out
        err = relative_error(out, ref)
        assert err <= spec.tolerance(problem.dtype), f"{problem} {config}: relative error {err:.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "M, N, K, params",
    [
        (1, 33, 100, {"SPLIT_K": 4}),  # K: 3 whole tiles + a partial one, N odd (a wrapped edge tile)
        (5, 64, 96, {}),  # one split
        (16, 47, 70, {"SPLIT_K": 3, "BLOCK_K": 16}),  # the partial K tile lands on the last split
        (64, 40, 256, {"SPLIT_K": 8, "BLOCK_N": 32, "num_warps": 4}),  # many splits, M = 64
        (3, 24, 40, {"SPLIT_K": 2, "BLOCK_K": 16}),  # strides and N multiples of 8, not 16: the hinted path
    ],
)
def test_decode_matches_reference(dtype, M, N, K, params, poisoned_workspace):
    _decode(GemmProblem(M, N, K, dtype, False, True), {**DECODE, **params}, calls=2)


def test_decode_not_transposed_and_buffers_left_zero(poisoned_workspace):
    _decode(GemmProblem(4, 50, 64, "fp32", False, False), {**DECODE, "SPLIT_K": 2}, calls=3)
    assert poisoned_workspace._zeroed
    for buf in poisoned_workspace._zeroed.values():
        assert float(buf.abs().sum()) == 0  # the tile counters were reset by the last program


def test_atomic_reduce_is_gone():
    """fp32 atomic split-K was wrong after CUDA graph replays on the H200: out of the space, refused if asked for."""
    for name in ("gemm", "linear"):
        assert "REDUCE" not in get_impl(name, "triton_splitk_decode").space
    a, b = torch.randn(2, 64, device=DEVICE), torch.randn(64, 48, device=DEVICE)
    with pytest.raises(ValueError, match="only 'partials'"):
        get_impl("gemm", "triton_splitk_decode").fn(a, b, **{**DECODE, "SPLIT_K": 2, "REDUCE": "atomic"})


def test_decode_partials_are_reproducible():
    impl = get_impl("gemm", "triton_splitk_decode")
    (a, b), _ = get_op("gemm").make_inputs(GemmProblem(3, 40, 256, "fp32", False, True), DEVICE, seed=3)
    f = impl.bind({**DECODE, "SPLIT_K": 8})
    assert torch.equal(f(a, b), f(a, b))


def test_decode_allocates_output():
    impl = get_impl("gemm", "triton_splitk_decode")
    a = torch.randn(2, 64, device=DEVICE)
    b = torch.randn(48, 64, device=DEVICE).t()
    out = impl.fn(a, b, **{**impl.default_params(), **DECODE, "SPLIT_K": 2})
    assert out.shape == (2, 48) and out.dtype == a.dtype
    assert relative_error(out, a.double() @ b.double()) < 2e-3


@pytest.mark.parametrize(
    "problem, params, reason",
    [
        (GemmProblem(65, 4096, 4096, "bf16", False, True), {}, "M <= 64"),
        (GemmProblem(1, 4096, 256, "bf16", False, True), {"BLOCK_K": 128, "SPLIT_K": 4}, "without a K tile"),
        (GemmProblem(1, 128256, 4096, "bf16", False, True), {"BLOCK_N": 64, "SPLIT_K": 2}, "fill the GPU"),
        (GemmProblem(1, 8, 4096, "bf16", False, True), {"BLOCK_N": 64}, "BLOCK_N 64 is larger"),
        (GemmProblem(64, 4096, 4096, "fp32", False, True), {"BLOCK_N": 128, "BLOCK_K": 512, "num_stages": 6}, "shared memory"),
    ],
)
def test_decode_check_refuses_with_a_reason(problem, params, reason):
    impl = get_impl("gemm", "triton_splitk_decode")
    why = impl.check(problem, {**impl.default_params(), **params})
    assert why is not None and reason in why


def test_decode_default_config_fits_llama_decode_weights():
    impl = get_impl("gemm", "triton_splitk_decode")
    for N, K in ((4096, 4096), (6144, 4096), (1024, 4096), (14336, 4096), (4096, 14336)):
        for M in (1, 16, 64):
            assert impl.check(GemmProblem(M, N, K, "bf16", False, True), impl.default_params()) is None


def test_stride_scale_proves_only_true_alignment():
    from kernel_space.gemm import _kernels as kmod

    assert kmod._stride_scale(1000, 8) == 8  # 3000x5000x1000 bf16: rows of A are 16-byte aligned
    assert kmod._stride_scale(5000, 8) == 8
    assert kmod._stride_scale(4096, 8) == 1  # Triton specialises multiples of 16 itself
    assert kmod._stride_scale(1, 8) == 1 and kmod._stride_scale(1002, 8) == 1
    assert kmod._row_vec(5000, 8) == 8 and kmod._row_vec(5001, 8) == 1 and kmod._row_vec(4096, 8) == 1


def _epilogue_case(dtype: str, M: int, N: int, K: int, has_bias: bool, activation: str):
    g = torch.Generator().manual_seed(1)
    dt = {"fp16": torch.float16, "fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    x = torch.randn(M, K, generator=g).to(DEVICE, dt)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(DEVICE, dt)
    b = (torch.randn(N, generator=g) * 0.5).to(DEVICE, dt) if has_bias else None
    ref = activate(F.linear(x.double(), w.double(), None if b is None else b.double()), activation)
    return x, w, b, ref


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("has_bias", [False, True])
def test_epilogue_in_both_kernels(dtype, activation, has_bias, poisoned_workspace):
    x, w, b, ref = _epilogue_case(dtype, 7, 37, 50, has_bias, activation)
    tol = get_op("gemm").tolerance(dtype)
    tiled = get_impl("gemm", "triton").fn
    decode = get_impl("gemm", "triton_splitk_decode").fn
    small = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 1, "num_warps": 4, "num_stages": 2}
    outs = {
        "tiled": tiled(x, w.t(), **small, bias=b, activation=activation),
        "tiled split-K": tiled(x, w.t(), **{**small, "SPLIT_K": 2}, bias=b, activation=activation),
        "decode": decode(x, w.t(), **{**DECODE, "SPLIT_K": 1}, bias=b, activation=activation),
        "decode split-K": decode(x, w.t(), **{**DECODE, "SPLIT_K": 2}, bias=b, activation=activation),
    }
    for name, out in outs.items():
        assert relative_error(out, ref) <= tol, f"{name} {activation} bias={has_bias}: {relative_error(out, ref):.3g}"


def test_unknown_activation_is_refused():
    x = torch.randn(2, 32, device=DEVICE)
    with pytest.raises(ValueError, match="activation 'tanh' is not one of"):
        get_impl("gemm", "triton_splitk_decode").fn(x, torch.randn(32, 16, device=DEVICE), activation="tanh")


def _skip_without_tma():
    from kernel_space.gemm.triton import _tma_supported

    if _tma_supported():
        pytest.skip(_tma_supported())


TMA = {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 4, "num_warps": 4, "num_stages": 2, "FLATTEN": True}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("trans_a, trans_b", [(False, False), (False, True), (True, True)])
def test_tma_persistent_matches_reference(dtype, trans_a, trans_b):
    # 3x3 output tiles over 4 programs (the interpreter's "SM count"): programs take 2 or 3 tiles;
    # M, N, K not multiples of their tiles: TMA zero-fills the edges.
    problem = GemmProblem(136, 72, 40, dtype, trans_a, trans_b)
    impl = get_impl("gemm", "triton_tma")
    _skip_without_tma()
    assert impl.check(problem, TMA) is None, impl.check(problem, TMA)
    spec = get_op("gemm")
    (a, b), _ = spec.make_inputs(problem, DEVICE, seed=0)
    out = torch.full((136, 72), float("nan"), dtype=a.dtype, device=DEVICE)
    assert impl.fn(a, b, **TMA, out=out) is out
    assert relative_error(out, spec.reference(a, b)) <= spec.tolerance(dtype)


def test_tma_epilogue_and_untma_layout_fallback():
    _skip_without_tma()
    x, w, b, ref = _epilogue_case("fp16", 80, 40, 24, True, "gelu_tanh")
    tma = get_impl("gemm", "triton_tma").fn
    assert relative_error(tma(x, w.t(), **TMA, bias=b, activation="gelu_tanh"), ref) <= 5e-3
    wide = torch.zeros(40, 27, dtype=w.dtype, device=DEVICE)
    wide[:, :24] = w  # rows of 54 bytes: no TMA descriptor, the pointer kernel runs
    assert relative_error(tma(x, wide[:, :24].t(), **TMA, bias=b, activation="gelu_tanh"), ref) <= 5e-3


def test_tma_check_refuses_with_a_reason():
    impl = get_impl("gemm", "triton_tma")
    assert "16 TMA needs" in impl.check(GemmProblem(3000, 5001, 1000, "bf16"), impl.default_params())
    assert "decode" in impl.check(GemmProblem(64, 4096, 4096, "bf16"), {**impl.default_params(), "BLOCK_M": 64})
    assert "shared memory" in impl.check(GemmProblem(4096, 4096, 4096, "fp32"), {**impl.default_params(), "BLOCK_K": 128, "num_stages": 5})
    _skip_without_tma()
    assert impl.check(GemmProblem(3000, 5000, 1000, "bf16"), impl.default_params()) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name, M, params", [
    ("triton_splitk_decode", 8, {"BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 8, "num_warps": 4, "num_stages": 4}),
    ("triton_gemv_decode", 1, {}),  # its default: four splits
])
def test_decode_in_a_cuda_graph(name, M, params):
    """Replays reuse the cached tile counters: each must leave them zero for the next."""
    impl = get_impl("gemm", name)
    spec = get_op("gemm")
    problem = GemmProblem(M, 4096, 4096, "bf16", False, True)
    (a, b), _ = spec.make_inputs(problem, "cuda", seed=0)
    f = impl.bind({**impl.default_params(), **params})
    f(a, b)  # compile and allocate outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = f(a, b)
    ref = spec.reference(a, b)
    for _ in range(3):
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert relative_error(out, ref) <= spec.tolerance("bf16")




@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name, M, params", [
    ("triton_splitk_decode", 8, {"BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 8, "num_warps": 4, "num_stages": 4}),
    ("triton_gemv_decode", 1, {}),
])
@pytest.mark.parametrize("first_call", ["recording", "capture"])
def test_counters_first_made_under_reduce_overhead_or_a_capture_belong_to_no_pool(name, M, params, first_call, monkeypatch):
    """The tile counters are made on a launch's first call: inside reduce-overhead's warm-up (whose thread
    allocates from the cudagraph pool), or inside a capture. They must not come from the pool: torch 2.11
    refused a tuned decode step ("tensor(s) in the cudagraph pool not tracked as outputs")."""
    from kernel_space.gemm import _kernels as kmod

    impl, spec = get_impl("gemm", name), get_op("gemm")
    (a, b), _ = spec.make_inputs(GemmProblem(M, 4096, 4096, "bf16", False, True), "cuda", seed=0)
    f = impl.bind({**impl.default_params(), **params})
    ref = spec.reference(a, b)
    f(a, b)  # Triton's compile, outside
    torch.cuda.synchronize()
    monkeypatch.setattr(kmod, "_zeroed", {})  # no counters: the next call makes them
    if first_call == "capture":
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = f(a, b)
        outs = []
        for _ in range(3):
            out.fill_(float("nan"))
            g.replay()
            outs.append(out.clone())
    else:
        @torch.library.custom_op(f"opsadv_test_counters::{name}", mutates_args=())
        def kernel(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return f(x, w)

        @kernel.register_fake
        def _(x, w):
            return x.new_empty(x.shape[0], w.shape[1])

        step = torch.compile(lambda x, w: kernel(x, w) * 1, mode="reduce-overhead")
        outs = [step(a, b).clone() for _ in range(4)]  # warm-up, record, replays
    torch.cuda.synchronize()
    for out in outs:
        assert relative_error(out, ref) <= spec.tolerance("bf16")
    for buf in kmod._zeroed.values():
        assert float(buf.abs().sum()) == 0
# --------------------------------------------------------------------------- the one-row gemv kernel

GEMV = {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": 1, "num_warps": 2, "num_stages": 2}


@pytest.mark.parametrize("dtype", ["fp16", "fp32", "bf16"])  # no tl.dot: the interpreter's bf16 is right here
@pytest.mark.parametrize("N, K, trans_b, params", [
    (33, 100, True, {"SPLIT_K": 4}),  # K: 3 whole tiles + a partial one, N odd (a wrapped edge tile)
    (64, 96, True, {}),  # one split
    (47, 70, True, {"SPLIT_K": 3, "BLOCK_K": 16}),  # the partial K tile lands on the last split
    (50, 64, False, {"SPLIT_K": 2}),  # b (K, N) contiguous, not a weight's transpose
])
def test_gemv_matches_reference_and_leaves_counters_zero(dtype, N, K, trans_b, params, poisoned_workspace):
    impl = get_impl("gemm", "triton_gemv_decode")
    problem, config = GemmProblem(1, N, K, dtype, False, trans_b), {**GEMV, **params}
    assert impl.check(problem, config) is None, impl.check(problem, config)
    spec = get_op("gemm")
    (a, b), _ = spec.make_inputs(problem, DEVICE, seed=0)
    ref = spec.reference(a, b)
    for _ in range(3):  # a counter left non-zero by one call would skip the next call's reduction
        out = torch.full(ref.shape, float("nan"), dtype=a.dtype, device=DEVICE)
        assert impl.fn(a, b, **config, out=out) is out
        assert relative_error(out, ref) <= spec.tolerance(dtype), (problem, config)
    for buf in poisoned_workspace._zeroed.values():
        assert float(buf.abs().sum()) == 0


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_gemv_linear_epilogue(activation, poisoned_workspace):
    impl = get_impl("linear", "triton_gemv_decode")
    g = torch.Generator().manual_seed(0)
    x, w, bias = (torch.randn(s, generator=g).to(DEVICE) for s in ((1, 48), (40, 48), (40,)))
    for split in (1, 2):
        got = impl.fn(x, w, bias, activation, **{**GEMV, "SPLIT_K": split})
        assert relative_error(got, activate(F.linear(x.double(), w.double(), bias.double()), activation)) <= 2e-3


def test_gemv_check_refuses_with_a_reason():
    impl = get_impl("gemm", "triton_gemv_decode")
    full = impl.default_params()
    assert "one row" in impl.check(GemmProblem(2, 4096, 4096, "bf16", False, True), full)
    assert "registers" in impl.check(GemmProblem(1, 4096, 4096, "bf16", False, True), {**full, "BLOCK_N": 128, "BLOCK_K": 512})
    assert "SPLIT_K 16" in impl.check(GemmProblem(1, 64, 256, "fp32", False, True), {**full, "BLOCK_K": 256, "SPLIT_K": 16})
    for n, k in ((4096, 4096), (6144, 4096), (4096, 14336), (28672, 4096)):  # Llama-3-8B's layer at B=1
        assert impl.check(GemmProblem(1, n, k, "bf16", False, True), full) is None
    assert "fill the GPU" in impl.check(GemmProblem(1, 128256, 4096, "bf16", False, True), full)  # lm_head: one split
    assert impl.check(GemmProblem(1, 128256, 4096, "bf16", False, True), {**full, "SPLIT_K": 1}) is None
    with pytest.raises(ValueError, match="one row"):
        impl.fn(torch.randn(2, 8, device=DEVICE), torch.randn(8, 16, device=DEVICE))
