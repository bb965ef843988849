"""layer_norm, rms_norm, softmax and conv2d: Triton kernels under TRITON_INTERPRET=1, vendors, signatures, checks."""
from __future__ import annotations

import pytest
import torch

from kernel_space import get_impl, get_op, impls, relative_error
from kernel_space.conv2d import Conv2dProblem
from kernel_space.layer_norm import LayerNormProblem
from kernel_space.rms_norm import RmsNormProblem
from kernel_space.softmax import SoftmaxProblem

ROWWISE = {"layer_norm": LayerNormProblem, "rms_norm": RmsNormProblem, "softmax": SoftmaxProblem}
# Triton kernels run on the GPU where there is one, else on the CPU under the interpreter.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON = {"layer_norm": "triton_layer_norm", "rms_norm": "triton_rms_norm", "softmax": "triton_softmax"}


def _cfg(BLOCK_N, ROWS_PER_PROGRAM=1, PROGRAMS_PER_SM=0, num_warps=4, num_stages=1):
    return dict(BLOCK_N=BLOCK_N, ROWS_PER_PROGRAM=ROWS_PER_PROGRAM, PROGRAMS_PER_SM=PROGRAMS_PER_SM,
                num_warps=num_warps, num_stages=num_stages)


# (rows, cols) -> configs: single pass, multi-row, persistent, looped over column blocks (partial last block).
ROWWISE_CASES = {
    (7, 1000): [
        _cfg(0),
        _cfg(0, ROWS_PER_PROGRAM=4, num_warps=8),
        _cfg(0, ROWS_PER_PROGRAM=2, PROGRAMS_PER_SM=1, num_stages=2),
        _cfg(512, ROWS_PER_PROGRAM=2, num_warps=2, num_stages=2),
        _cfg(512, ROWS_PER_PROGRAM=1, PROGRAMS_PER_SM=2, num_warps=1),
    ],
    (3, 129): [_cfg(0, num_warps=1), _cfg(0, ROWS_PER_PROGRAM=4, num_warps=2)],
}


def _run_checked(op: str, impl_name: str, problem, params: dict):
    spec, impl = get_op(op), get_impl(op, impl_name)
    assert impl.check(problem, params) is None, (problem, params)
    args, attrs = spec.make_inputs(problem, DEVICE, seed=3)
    assert tuple(spec.signature(*args, **attrs)) == tuple(problem)
    ref = spec.reference(*args, **attrs)
    out = torch.full(ref.shape, float("nan"), dtype=args[0].dtype, device=DEVICE)
    got = impl.fn(*args, **attrs, **params, out=out)
    assert got is out
    err = relative_error(out, ref)
    assert err <= spec.tolerance(problem.dtype), (problem, params, err)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("op", sorted(ROWWISE))
def test_rowwise_triton(op, dtype):
    pytest.importorskip("triton")
    for (rows, cols), configs in ROWWISE_CASES.items():
        for params in configs:
            _run_checked(op, TRITON[op], ROWWISE[op](rows, cols, dtype), params)


def test_layer_norm_triton_without_bias_and_leading_dims():
    pytest.importorskip("triton")
    spec = get_op("layer_norm")
    x = torch.randn(2, 3, 200, device=DEVICE)
    w, b = torch.randn(200, device=DEVICE), torch.randn(200, device=DEVICE)
    assert spec.signature(x, w, None) == (6, 200, "fp32")
    fn = get_impl("layer_norm", "triton_layer_norm").fn
    for bias in (None, b):
        out = torch.full_like(x, float("nan"))
        fn(x, w, bias, 1e-5, **_cfg(128, ROWS_PER_PROGRAM=2, num_warps=1), out=out)
        assert relative_error(out, spec.reference(x, w, bias, 1e-5)) < 1e-5


CONV_CASES = [
    Conv2dProblem(2, 8, 9, 7, 24, 3, 3, 1, 1, 1),  # odd H/W, K not a multiple of BLOCK_N
    Conv2dProblem(2, 16, 9, 9, 32, 3, 3, 2, 1, 1),  # stride 2 with padding
    Conv2dProblem(1, 24, 5, 6, 40, 1, 1, 1, 0, 1),  # 1x1, C not a multiple of BLOCK_K
    Conv2dProblem(2, 8, 7, 7, 24, 1, 1, 2, 0, 1),  # 1x1 stride 2
    Conv2dProblem(1, 8, 8, 8, 32, 3, 3, 1, 2, 2),  # dilation 2
]
CONV_CFG = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=16, num_warps=4, num_stages=2)


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])  # bf16 tl.dot is unsound under the interpreter
@pytest.mark.parametrize("caller", ["nchw", "nhwc"])
def test_conv2d_triton(caller, dtype):
    pytest.importorskip("triton")
    spec, impl = get_op("conv2d"), get_impl("conv2d", "triton_implicit_gemm")
    for case in CONV_CASES:
        problem = case._replace(layout=caller, dtype=dtype)
        for layout in ("nhwc", "nchw"):
            params = {**CONV_CFG, "layout": layout}
            assert impl.check(problem, params) is None, (problem, params)
            args, attrs = spec.make_inputs(problem, DEVICE, seed=5)
            assert spec.signature(*args, **attrs) == tuple(problem)
            ref = spec.reference(*args, **attrs)
            # Poison an output whose memory format differs from the kernel's: strides must be honoured.
            fmt = torch.contiguous_format if layout == "nhwc" else torch.channels_last
            out = torch.full(ref.shape, float("nan"), dtype=args[0].dtype, device=DEVICE).contiguous(memory_format=fmt)
            impl.fn(*args, **attrs, **params, out=out)
            err = relative_error(out, ref)
            assert err <= spec.tolerance(dtype), (problem, layout, err)


def test_conv2d_triton_default_output_format():
    pytest.importorskip("triton")
    spec, fn = get_op("conv2d"), get_impl("conv2d", "triton_implicit_gemm").fn
    problem = Conv2dProblem(1, 16, 6, 6, 32, 3, 3, 1, 1, 1, "nchw")
    args, attrs = spec.make_inputs(problem, DEVICE)
    y = fn(*args, **attrs, **{**CONV_CFG, "layout": "nhwc"})
    assert y.is_contiguous(memory_format=torch.channels_last)
    assert relative_error(y, spec.reference(*args, **attrs)) <= spec.tolerance("fp32")


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "softmax", "conv2d"])
def test_vendors_and_signatures(op):
    spec = get_op(op)
    problems = spec.default_problems("cpu")
    if op == "conv2d":
        problems += [p._replace(layout=lay) for p in CONV_CASES for lay in ("nchw", "nhwc")]
    for problem in problems:
        args, attrs = spec.make_inputs(problem, "cpu", seed=1)
        assert spec.signature(*args, **attrs) == tuple(problem)
        assert type(spec.signature(*args, **attrs)) is tuple
        ref = spec.reference(*args, **attrs)
        vendors = [i for i in impls(op, backend="cpu") if i.vendor]
        assert vendors
        for impl in vendors:
            assert impl.why_not(problem, backend="cpu") is None
            err = relative_error(impl.fn(*args, **attrs), ref)
            assert err <= spec.tolerance(problem.dtype), (impl.name, problem, err)


def test_conv2d_vendor_formats():
    spec = get_op("conv2d")
    problem = Conv2dProblem(2, 8, 9, 9, 16, 3, 3, 2, 1, 1, "nchw")
    args, attrs = spec.make_inputs(problem, "cpu")
    assert get_impl("conv2d", "cudnn_nhwc").fn(*args, **attrs).is_contiguous(memory_format=torch.channels_last)
    args, attrs = spec.make_inputs(problem._replace(layout="nhwc"), "cpu")
    assert get_impl("conv2d", "cudnn_nchw").fn(*args, **attrs).is_contiguous()


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "softmax", "conv2d"])
def test_every_gpu_problem_has_valid_configs(op):
    """check() runs on the whole space without error, and leaves configs for every GPU problem."""
    impl = next(i for i in impls(op, backend="cuda") if not i.vendor)
    configs = list(impl.configs())
    for problem in get_op(op).default_problems("h100"):
        assert impl.check(problem, impl.default_params()) is None, problem
        valid = [c for c in configs if impl.check(problem, c) is None]
        assert valid, problem
        assert len(valid) < len(configs), problem  # something is always pruned


@pytest.mark.parametrize(
    "params, reason",
    [
        (_cfg(4096), "BLOCK_N 0 is that single pass"),
        (_cfg(0, ROWS_PER_PROGRAM=16), "exceeds the 8 rows"),
        (_cfg(512, num_warps=32), "under 16 bytes"),
        (_cfg(0, ROWS_PER_PROGRAM=8, num_warps=4), "registers"),
        (_cfg(0, num_stages=3), "single-pass"),
        (_cfg(0, PROGRAMS_PER_SM=8, num_warps=16), "do not fit"),
        (_cfg(0, ROWS_PER_PROGRAM=8, PROGRAMS_PER_SM=1, num_warps=32, num_stages=3), "shared memory"),
    ],
)
def test_rowwise_check_rejects(params, reason):
    why = get_impl("softmax", "triton_softmax").check(SoftmaxProblem(8, 4096, "fp32"), params)
    assert why is not None and reason in why, why


@pytest.mark.parametrize(
    "problem, changes, reason",
    [
        (Conv2dProblem(32, 64, 56, 56, 64, 3, 3, 1, 1), {"BLOCK_N": 256}, "output channels"),
        (Conv2dProblem(32, 16, 56, 56, 64, 3, 3, 1, 1), {"BLOCK_N": 64}, "input channels"),
        (Conv2dProblem(1, 64, 4, 4, 64, 1, 1), {"BLOCK_M": 256, "BLOCK_N": 64}, "output pixels"),
        (Conv2dProblem(32, 256, 56, 56, 256, 3, 3, dtype="bf16"), {"BLOCK_M": 256, "BLOCK_N": 256, "BLOCK_K": 128},
         "shared memory"),
        (Conv2dProblem(32, 256, 56, 56, 256, 3, 3, dtype="bf16"),
         {"BLOCK_M": 256, "BLOCK_N": 256, "num_warps": 4, "num_stages": 2}, "accumulator"),
        (Conv2dProblem(32, 64, 7, 7, 128, 1, 1, dtype="bf16"), {"num_stages": 4}, "reduction steps"),
        (Conv2dProblem(32, 64, 56, 56, 64, 3, 3, dtype="bf16"), {"layout": "nchw", "BLOCK_M": 256, "BLOCK_N": 64},
         "element by element"),
        (Conv2dProblem(1, 8, 2, 2, 8, 3, 3), {}, "does not fit"),
        (Conv2dProblem(4096, 256, 56, 56, 256, 3, 3, 1, 1), {}, "64-bit"),
    ],
)
def test_conv2d_check_rejects(problem, changes, reason):
    impl = get_impl("conv2d", "triton_implicit_gemm")
    why = impl.check(problem, {**impl.default_params(), **changes})
    assert why is not None and reason in why, why
