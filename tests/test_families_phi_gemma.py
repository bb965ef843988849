"""Phi-3 and Gemma blocks on the fused ops (issue 31): the (1 + weight) RMS norm variant of rms_norm and
add_rms_norm, GeGLU (GeLU-tanh gate) in swiglu, and converted Phi-3 / Gemma models against the originals."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import kernel_space
import ops_adv
from kernel_space import get_impl, get_op, relative_error

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _cfg(BLOCK_N, ROWS_PER_PROGRAM=1, PROGRAMS_PER_SM=0, num_warps=4, num_stages=1):
    return dict(BLOCK_N=BLOCK_N, ROWS_PER_PROGRAM=ROWS_PER_PROGRAM, PROGRAMS_PER_SM=PROGRAMS_PER_SM,
                num_warps=num_warps, num_stages=num_stages)


# single pass, multi-row, persistent (pipelined), looped over column blocks with a partial last block, looped persistent
NORM_CASES = {
    (1, 1000): [_cfg(0), _cfg(512, num_warps=1)],
    (7, 1000): [_cfg(0, ROWS_PER_PROGRAM=4, num_warps=8), _cfg(0, ROWS_PER_PROGRAM=2, PROGRAMS_PER_SM=1, num_stages=2),
                _cfg(512, ROWS_PER_PROGRAM=2, num_warps=2, num_stages=2), _cfg(512, PROGRAMS_PER_SM=2, num_warps=1)],
    (37, 129): [_cfg(0, num_warps=1), _cfg(0, ROWS_PER_PROGRAM=16, PROGRAMS_PER_SM=1, num_warps=4)],
}


def _gemma_norm(x, w, eps):
    """transformers' GemmaRMSNorm.forward, written out."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())).type_as(x)


@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm"])
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])  # the interpreter rounds bf16 its own way
def test_unit_offset_triton_matches_gemma_and_the_reference(op, dtype):
    pytest.importorskip("triton")
    spec, impl = get_op(op), get_impl(op, f"triton_{op}_unit_offset")
    vendor = get_impl(op, f"torch_{op}_unit_offset")
    for (rows, cols), cfgs in NORM_CASES.items():
        p = spec.problem(rows, cols, dtype, True)
        args, attrs = spec.make_inputs(p, DEVICE, seed=3)
        assert spec.signature(*args, **attrs) == tuple(p) and attrs["unit_offset"] is True
        ref = spec.reference(*args, **attrs)
        want = vendor.fn(*args, **attrs)
        x = args[0] + args[1] if op == "add_rms_norm" else args[0]
        torch.testing.assert_close(want[0] if op == "add_rms_norm" else want, _gemma_norm(x, args[-1], 1e-6), rtol=0, atol=0)
        for cfg in cfgs:
            assert impl.check(p, cfg) is None, (p, cfg)
            out = impl.fn(*args, **attrs, **cfg)
            if op == "add_rms_norm":
                assert torch.equal(out[1], want[1]), "the new residual is x + residual in x's dtype"
                out, w0 = out[0], want[0]
            else:
                w0 = want
            assert relative_error(out, ref) <= spec.tolerance(dtype), (p, cfg)
            torch.testing.assert_close(out, w0, rtol=2e-6, atol=2e-6 if dtype == "fp32" else 1e-3)


@pytest.mark.parametrize("merged", [False, True])
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_geglu_triton_matches_gelu_tanh_times_up(dtype, merged):
    pytest.importorskip("triton")
    spec, impl = get_op("swiglu"), get_impl("swiglu", "triton_geglu")
    ran = 0
    for rows, cols in [(1, 1000), (9, 333), (64, 96)]:
        p = spec.problem(rows, cols, merged, dtype, "gelu_tanh")
        args, attrs = spec.make_inputs(p, DEVICE, seed=5)
        assert spec.signature(*args, **attrs) == tuple(p)
        g, u = (args[0][..., :cols], args[0][..., cols:]) if merged else args
        want = F.gelu(g, approximate="tanh") * u
        torch.testing.assert_close(get_impl("swiglu", "torch_geglu").fn(*args, **attrs), want, rtol=0, atol=0)
        for cfg in [dict(BLOCK_N=1024, ROWS_PER_PROGRAM=1, num_warps=4), dict(BLOCK_N=128, ROWS_PER_PROGRAM=8, num_warps=1)]:
            if impl.check(p, cfg) is not None:
                continue
            y = impl.fn(*args, **attrs, **cfg)
            assert y.shape == (rows, cols) and relative_error(y, spec.reference(*args, **attrs)) <= spec.tolerance(dtype)
            ran += 1
    assert ran


def test_variants_have_their_own_implementations_and_old_problems_keep_theirs():
    """The plain problems' defaults and implementations are what they were (a table made before keys its winners
    the same way and runs the same kernels); the variants default to their own vendor composites."""
    for op, plain, variant, old, new in (
            ("rms_norm", (8, 64, "fp32"), (8, 64, "fp32", True), "torch_rms_norm", "torch_rms_norm_unit_offset"),
            ("add_rms_norm", (8, 64, "fp32"), (8, 64, "fp32", True), "torch_add_rms_norm", "torch_add_rms_norm_unit_offset"),
            ("swiglu", (8, 64, True, "fp32"), (8, 64, True, "fp32", "gelu_tanh"), "torch_swiglu", "torch_geglu")):
        spec = get_op(op)
        p = spec.parse_problem(dict(zip(spec.problem._fields, plain)))  # a table's problem written before the field
        assert p == spec.problem(*plain) and len(p) == len(plain) + 1
        assert kernel_space.choose_default(op, p, "cpu").name == old
        assert kernel_space.choose_default(op, spec.problem(*variant), "cpu").name == new
        for impl in kernel_space.impls(op):  # each variant implementation refuses the other problems
            if impl.name.endswith(("unit_offset", "geglu")):
                assert impl.check(p, impl.default_params()) is not None
    with pytest.raises(kernel_space.OpsAdvError, match="activation"):
        get_op("swiglu").parse_problem({"rows": 1, "cols": 2, "activation": "relu"})


def test_runtime_ops_compute_the_variants_eagerly_and_under_autograd():
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(3, 5, 32, generator=g), torch.randn(3, 5, 32, generator=g)
    w = (0.1 * torch.randn(32, generator=g)).requires_grad_()
    torch.testing.assert_close(ops_adv.rms_norm(x, w, 1e-6, unit_offset=True), _gemma_norm(x, w, 1e-6), rtol=0, atol=0)
    y, h = ops_adv.add_rms_norm(x, r, w, 1e-6, unit_offset=True)
    assert torch.equal(h, x + r)
    torch.testing.assert_close(y, _gemma_norm(x + r, w, 1e-6), rtol=0, atol=0)
    y.sum().backward()
    gw = w.grad.clone()
    w.grad = None
    _gemma_norm(x + r, w, 1e-6).sum().backward()
    torch.testing.assert_close(gw, w.grad)
    gu = torch.randn(4, 64, generator=g)
    torch.testing.assert_close(ops_adv.swiglu(gu, activation="gelu_tanh"),
                               F.gelu(gu[:, :32], approximate="tanh") * gu[:, 32:], rtol=0, atol=0)
    torch.testing.assert_close(ops_adv.swiglu(gu[:, :32], gu[:, 32:], activation="gelu_tanh"),
                               F.gelu(gu[:, :32], approximate="tanh") * gu[:, 32:], rtol=0, atol=0)
    with pytest.raises(ValueError, match="activation"):
        ops_adv.swiglu(gu, activation="relu")
    assert ops_adv.explain("swiglu", gu, activation="gelu_tanh")["impl"] == "torch_geglu"
    assert ops_adv.explain("rms_norm", x, w.detach(), 1e-6, unit_offset=True)["impl"] == "torch_rms_norm_unit_offset"


@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm", "swiglu"])
def test_custom_operators_backward_matches_torch(op):
    """The operators' own backward (what a tuned kernel's call under autograd runs) for the variants."""
    g = torch.Generator().manual_seed(1)
    x, r = torch.randn(6, 48, generator=g), torch.randn(6, 48, generator=g)
    w = 0.1 * torch.randn(48, generator=g)
    ins = [t.clone().requires_grad_() for t in (x, r, w)]
    ref = [t.clone().requires_grad_() for t in (x, r, w)]
    if op == "rms_norm":
        out, want = torch.ops.ops_adv.rms_norm(ins[0], ins[2], 1e-6, True), _gemma_norm(ref[0], ref[2], 1e-6)
    elif op == "add_rms_norm":
        out = torch.ops.ops_adv.add_rms_norm(ins[0], ins[1], ins[2], 1e-6, True)
        out = out[0] * 2 + out[1]
        h = ref[0] + ref[1]
        want = _gemma_norm(h, ref[2], 1e-6) * 2 + h
    else:
        out = torch.ops.ops_adv.swiglu(ins[0], ins[1], "gelu_tanh")
        want = F.gelu(ref[0], approximate="tanh") * ref[1]
    torch.testing.assert_close(out, want)
    go = torch.randn(out.shape, generator=g)
    out.backward(go)
    want.backward(go)
    for a, b in zip(ins, ref):
        if b.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5)
