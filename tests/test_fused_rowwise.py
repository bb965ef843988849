"""add_rms_norm, add_layer_norm, swiglu: Triton kernels (interpreter on the CPU), vendors, runtime ops,
custom operators under torch.compile and autograd, Liger candidates, and the report's sources."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

import kernel_space as ks
from kernel_space import get_impl, get_op, impls, relative_error
from kernel_space._registry import SOURCES, source_of
from kernel_space.add_layer_norm import AddLayerNormProblem
from kernel_space.add_rms_norm import AddRmsNormProblem
from kernel_space.swiglu import SwigluProblem
from ops_adv import _dispatch
from ops_adv.models import hf as _hf
from ops_adv.ops import add_layer_norm as _add_ln, add_rms_norm as _add_rms, swiglu as _swiglu

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(DEVICE == "cpu", reason="needs a CUDA GPU")
DT = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
ADD = {"add_rms_norm": (AddRmsNormProblem, "triton_add_rms_norm"),
       "add_layer_norm": (AddLayerNormProblem, "triton_add_layer_norm")}


def _cfg(BLOCK_N, ROWS_PER_PROGRAM=1, PROGRAMS_PER_SM=0, num_warps=4, num_stages=1):
    return dict(BLOCK_N=BLOCK_N, ROWS_PER_PROGRAM=ROWS_PER_PROGRAM, PROGRAMS_PER_SM=PROGRAMS_PER_SM,
                num_warps=num_warps, num_stages=num_stages)


# (rows, cols) -> configs: single pass, multi-row, persistent (pipelined), looped over column blocks with a
# partial last block, looped and persistent. 1 row; cols never a power of two.
ADD_CASES = {
    (1, 1000): [_cfg(0), _cfg(512, num_warps=1)],
    (7, 1000): [_cfg(0, ROWS_PER_PROGRAM=4, num_warps=8), _cfg(0, ROWS_PER_PROGRAM=2, PROGRAMS_PER_SM=1, num_stages=2),
                _cfg(512, ROWS_PER_PROGRAM=2, num_warps=2, num_stages=2), _cfg(512, PROGRAMS_PER_SM=2, num_warps=1)],
    (37, 129): [_cfg(0, num_warps=1), _cfg(0, ROWS_PER_PROGRAM=16, PROGRAMS_PER_SM=1, num_warps=4)],
}


def _add_inputs(op, problem, seed=3):
    spec = get_op(op)
    args, attrs = spec.make_inputs(problem, DEVICE, seed=seed)
    assert tuple(spec.signature(*args, **attrs)) == tuple(problem)
    return spec, args, attrs


def _check_add(op, impl_name, problem, params):
    spec, args, attrs = _add_inputs(op, problem)
    impl = get_impl(op, impl_name)
    assert impl.check(problem, params) is None, (problem, params)
    y, h = impl.fn(*args, **attrs, **params)
    x, residual = args[:2]
    assert h.dtype == x.dtype and torch.equal(h, x + residual), "the new residual is x + residual in x's dtype"
    err = relative_error(y, spec.reference(*args, **attrs))
    assert err <= spec.tolerance(problem.dtype), (problem, params, err)
    vy, vh = get_impl(op, "torch_" + op).fn(*args, **attrs)  # the composite as torch computes it in this dtype
    assert torch.equal(vh, h)
    assert relative_error(y, vy) <= spec.tolerance(problem.dtype)


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("op", sorted(ADD))
def test_add_norm_triton(op, dtype):
    pytest.importorskip("triton")
    cls, name = ADD[op]
    for (rows, cols), configs in ADD_CASES.items():
        for params in configs:
            _check_add(op, name, cls(rows, cols, dtype), params)


@pytest.mark.parametrize("op", sorted(ADD))
def test_add_norm_triton_sampled_space(op):
    """A random sample of the valid points of the space (seeded), each against the reference."""
    pytest.importorskip("triton")
    cls, name = ADD[op]
    impl = get_impl(op, name)
    problem = cls(5, 300, "fp16")
    valid = [c for c in impl.configs() if impl.check(problem, c) is None]
    assert valid and len(valid) < len(list(impl.configs())), "the check prunes some points and keeps some"
    for params in random.Random(0).sample(valid, 4):
        _check_add(op, name, problem, params)


def test_add_norm_triton_leading_dims_and_strides():
    """3-D inputs, a residual that is a strided view, no bias: outputs shaped like x."""
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 96, generator=g).to(DEVICE, torch.float16)
    big = torch.randn(2, 3, 200, generator=g).to(DEVICE, torch.float16)
    residual = big[..., :96]
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(DEVICE, torch.float16)
    y, h = get_impl("add_layer_norm", "triton_add_layer_norm").fn(x, residual, w, None, 1e-5)
    assert y.shape == h.shape == x.shape and torch.equal(h, x + residual)
    assert relative_error(y, F.layer_norm((x + residual).double(), (96,), w.double())) < 5e-3
    y, h = get_impl("add_rms_norm", "triton_add_rms_norm").fn(x, residual, w, 1e-6, BLOCK_N=64, num_warps=1)
    assert torch.equal(h, x + residual)
    assert relative_error(y, get_op("add_rms_norm").reference(x, residual, w, 1e-6)) < 5e-3


SWIGLU_CASES = [(1, 1000), (9, 333), (64, 96)]
SWIGLU_CONFIGS = [dict(BLOCK_N=1024, ROWS_PER_PROGRAM=1, num_warps=4), dict(BLOCK_N=256, ROWS_PER_PROGRAM=2, num_warps=2),
                  dict(BLOCK_N=128, ROWS_PER_PROGRAM=8, num_warps=1)]


@pytest.mark.parametrize("merged", [False, True])
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_swiglu_triton(dtype, merged):
    pytest.importorskip("triton")
    spec, impl = get_op("swiglu"), get_impl("swiglu", "triton_swiglu")
    for rows, cols in SWIGLU_CASES:
        problem = SwigluProblem(rows, cols, merged, dtype)
        args, attrs = spec.make_inputs(problem, DEVICE, seed=5)
        assert tuple(spec.signature(*args)) == tuple(problem)
        ref = spec.reference(*args)
        composite = get_impl("swiglu", "torch_swiglu").fn(*args)
        ran = 0
        for params in SWIGLU_CONFIGS:
            if impl.check(problem, params) is not None:
                continue
            y = impl.fn(*args, **params)
            assert y.shape == (rows, cols) and y.dtype == DT[dtype]
            assert relative_error(y, ref) <= spec.tolerance(dtype), (problem, params)
            assert relative_error(y, composite) <= spec.tolerance(dtype), (problem, params)
            ran += 1
        assert ran, problem


def test_swiglu_check_and_leading_dims():
    impl = get_impl("swiglu", "triton_swiglu")
    assert "wider" in impl.check(SwigluProblem(4, 100), dict(BLOCK_N=1024, ROWS_PER_PROGRAM=1, num_warps=1))
    assert "exceeds" in impl.check(SwigluProblem(1, 4096), dict(BLOCK_N=1024, ROWS_PER_PROGRAM=2, num_warps=4))
    assert impl.check(SwigluProblem(4096, 14336, True, "bf16"), impl.default_params()) is None
    pytest.importorskip("triton")
    gu = torch.randn(2, 3, 2 * 80, dtype=torch.float16, device=DEVICE)
    y = impl.fn(gu, BLOCK_N=128, num_warps=1)
    assert y.shape == (2, 3, 80)
    assert relative_error(y, F.silu(gu[..., :80].double()) * gu[..., 80:].double()) < 5e-3


@pytest.mark.parametrize("op", ["add_rms_norm", "add_layer_norm", "swiglu"])
def test_vendors_and_default_problems(op):
    spec = get_op(op)
    for p in spec.default_problems("cpu")[:1]:
        args, attrs = spec.make_inputs(p, "cpu", seed=0)
        ref = spec.reference(*args, **attrs)
        out = get_impl(op, "torch_" + op).fn(*args, **attrs)
        out = out[0] if isinstance(out, tuple) else out
        assert relative_error(out, ref) <= spec.tolerance(p.dtype)
    for p in spec.default_problems("h200"):
        assert spec.parse_problem(p._asdict()) == p
        assert spec.bytes_moved(p) > 0 and spec.flops(p) > 0


# --------------------------------------------------------------------------- runtime ops


def _t(*shape, dtype=torch.float32, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).requires_grad_(requires_grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_runtime_ops_match_composite(dtype):
    x, r, w, b = _t(2, 5, 48, dtype=dtype), _t(2, 5, 48, dtype=dtype, seed=1), _t(48, dtype=dtype, seed=2), _t(48, dtype=dtype, seed=3)
    for eps in (None, 1e-5):
        y, h = _add_rms.add_rms_norm(x, r, w, eps)
        cy, ch = F.rms_norm(x + r, (48,), w, eps), x + r
        assert torch.equal(h, ch) and torch.allclose(y, cy, rtol=1e-2, atol=1e-2)
    y, h = _add_ln.add_layer_norm(x, r, w, b, 1e-5)
    assert torch.equal(h, x + r) and torch.allclose(y, F.layer_norm(x + r, (48,), w, b), rtol=1e-2, atol=1e-2)
    gu = _t(3, 4, 64, dtype=dtype)
    assert torch.allclose(_swiglu.swiglu(gu), F.silu(gu[..., :32]) * gu[..., 32:], rtol=1e-2, atol=1e-2)
    assert torch.allclose(_swiglu.swiglu(x, r), F.silu(x) * r, rtol=1e-2, atol=1e-2)
    assert _dispatch.explain("add_rms_norm", x, r, w)["impl"] == "torch_add_rms_norm"  # CPU: the composite


def test_runtime_fallbacks_keep_torch_semantics():
    x, w = _t(4, 16), _t(16, seed=2)
    r_bcast = _t(16, seed=1)  # broadcasts against x: torch's composite handles it
    y, h = _add_rms.add_rms_norm(x, r_bcast, w, 1e-6)
    assert torch.equal(h, x + r_bcast) and torch.allclose(y, F.rms_norm(x + r_bcast, (16,), w, 1e-6))
    r16 = _t(4, 16, dtype=torch.float16, seed=1)  # mixed dtypes promote as torch does
    y, h = _add_ln.add_layer_norm(x, r16, w)
    assert h.dtype == torch.float32 and torch.equal(h, x + r16)
    xd = _t(4, 16, dtype=torch.float64)  # float64: no kernel family, torch itself
    y, h = _add_rms.add_rms_norm(xd, xd, w.double())
    assert y.dtype == torch.float64 and torch.allclose(y, F.rms_norm(2 * xd, (16,), w.double()))
    y, h = _add_rms.add_rms_norm(x, x, None)  # no weight
    assert torch.allclose(y, F.rms_norm(2 * x, (16,)))
    assert _swiglu.swiglu(_t(0, 8)).shape == (0, 4)  # empty
    with pytest.raises(ValueError, match="even last dimension"):  # an odd merged width: no gate/up halves
        _swiglu.swiglu(_t(2, 7))
    with pytest.raises(RuntimeError):
        _add_rms.add_rms_norm(x, _t(4, 15), w)


def test_compile_fullgraph_cpu():
    def block(x, r, w, b, gu):
        y, h = _add_rms.add_rms_norm(x, r, w, 1e-6)
        z, h2 = _add_ln.add_layer_norm(y, h, w, b)
        return z + h2, _swiglu.swiglu(gu), _swiglu.swiglu(x, r)

    args = (_t(3, 32), _t(3, 32, seed=1), _t(32, seed=2), _t(32, seed=3), _t(3, 64, seed=4))
    eager = block(*args)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")(*args)
    for a, b in zip(eager, compiled):
        assert torch.allclose(a, b, atol=1e-6)
    # the custom operators are in the graph (not the composite)
    gm = torch.fx.symbolic_trace(lambda x, r, w: torch.ops.ops_adv.add_rms_norm(x, r, w, 1e-6))
    assert "ops_adv.add_rms_norm" in str(gm.graph)


def _grads(fn, inputs):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    g = torch.Generator().manual_seed(9)
    loss = sum((o * torch.randn(o.shape, generator=g).to(o.dtype)).sum() for o in outs)
    loss.backward()
    return [t.grad for t in leaves]


@pytest.mark.parametrize("case", ["add_rms_norm", "add_layer_norm", "swiglu", "swiglu_merged"])
def test_gradients_match_composite(case):
    """Gradients through the custom operators (fp32) against torch's composite in float64."""
    x, r, w, b = _t(3, 4, 40), _t(3, 4, 40, seed=1), 1 + 0.1 * _t(40, seed=2), _t(40, seed=3)
    if case == "add_rms_norm":
        ours, theirs, inputs = (lambda x, r, w: _add_rms.add_rms_norm(x, r, w, 1e-6)), \
            (lambda x, r, w: _add_rms._add_rms_composite(x, r, w, 1e-6)), (x, r, w)
    elif case == "add_layer_norm":
        ours, theirs, inputs = (lambda x, r, w, b: _add_ln.add_layer_norm(x, r, w, b)), \
            (lambda x, r, w, b: _add_ln._add_ln_composite(x, r, w, b, 1e-5)), (x, r, w, b)
    elif case == "swiglu":
        ours, theirs, inputs = _swiglu.swiglu, _swiglu._swiglu_composite, (x, r)
    else:
        ours, theirs, inputs = _swiglu.swiglu, (lambda gu: _swiglu._swiglu_composite(gu, None)), (_t(5, 64),)
    got = _grads(ours, inputs)
    want = _grads(theirs, [t.double() for t in inputs])
    for a, e in zip(got, want):
        assert a is not None and a.dtype == torch.float32
        assert relative_error(a, e) < 1e-5, case


def test_gradient_of_one_output_and_export():
    """Only the normed output (or only the residual) in the loss; torch.export keeps the custom operators."""
    x, r, w = _t(3, 24, requires_grad=True), _t(3, 24, seed=1, requires_grad=True), _t(24, seed=2, requires_grad=True)
    y, h = _add_rms.add_rms_norm(x, r, w, 1e-6)
    y.sum().backward()
    xc, rc, wc = (t.detach().double().requires_grad_() for t in (x, r, w))
    F.rms_norm(xc + rc, (24,), wc, 1e-6).sum().backward()
    assert relative_error(x.grad, xc.grad) < 1e-5 and relative_error(w.grad, wc.grad) < 1e-5
    x.grad = w.grad = None
    _, h = _add_ln.add_layer_norm(x, r, w)
    (3 * h).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0)) and torch.equal(w.grad, torch.zeros_like(w))

    class Block(torch.nn.Module):
        def forward(self, x, r, w, gu):
            y, h = _add_rms.add_rms_norm(x, r, w, 1e-6)
            return y + h, _swiglu.swiglu(gu)

    ep = torch.export.export(Block(), (x.detach(), r.detach(), w.detach(), _t(3, 16)))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert {"ops_adv.add_rms_norm.default", "ops_adv.swiglu.default"} <= targets


def test_gradcheck_custom_op_formula():
    """torch.autograd.gradcheck of the backward formulas in float64 (the operators' own autograd, called directly)."""
    x, r, w = _t(2, 6, dtype=torch.float64, requires_grad=True), _t(2, 6, dtype=torch.float64, seed=1, requires_grad=True), \
        _t(6, dtype=torch.float64, seed=2, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, r, w: torch.ops.ops_adv.add_rms_norm(x, r, w, 1e-6), (x, r, w))
    b = _t(6, dtype=torch.float64, seed=3, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, r, w, b: torch.ops.ops_adv.add_layer_norm(x, r, w, b, 1e-5), (x, r, w, b))
    assert torch.autograd.gradcheck(lambda g, u: torch.ops.ops_adv.swiglu(g, u), (x, r))
    assert torch.autograd.gradcheck(lambda gu: torch.ops.ops_adv.swiglu(gu, None), (torch.cat([x, r], -1).detach().requires_grad_(),))


class _SplitMLP(torch.nn.Module):
    def __init__(self, d, i):
        super().__init__()
        self.gate_proj, self.up_proj = torch.nn.Linear(d, i, bias=False), torch.nn.Linear(d, i, bias=False)
        self.down_proj, self.act_fn = torch.nn.Linear(i, d, bias=False), torch.nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class _MergedMLP(torch.nn.Module):
    def __init__(self, d, i):
        super().__init__()
        self.gate_up_proj, self.down_proj = torch.nn.Linear(d, 2 * i, bias=False), torch.nn.Linear(i, d, bias=False)
        self.activation_fn = torch.nn.SiLU()

    def forward(self, x):
        g, u = self.gate_up_proj(x).chunk(2, -1)
        return self.down_proj(self.activation_fn(g) * u)


@pytest.mark.parametrize("cls", [_SplitMLP, _MergedMLP])
def test_llama_mlp_forward(cls):
    torch.manual_seed(0)
    mlp = cls(16, 40)
    x = torch.randn(2, 3, 16)
    assert _hf.is_swiglu_mlp(mlp)
    with torch.no_grad():
        assert torch.allclose(_hf.llama_mlp_forward(mlp, x), mlp(x), atol=1e-5)
    with pytest.raises(TypeError, match="SiLU-gated"):
        _hf.llama_mlp_forward(torch.nn.Linear(4, 4), x)


# --------------------------------------------------------------------------- Liger candidates and sources

LIGER = {"rms_norm": "liger_rms_norm", "layer_norm": "liger_layer_norm", "swiglu": "liger_swiglu",
         "add_rms_norm": "liger_add_rms_norm"}


@pytest.mark.parametrize("op", sorted(LIGER))
def test_liger_candidates_registered_with_reason(op):
    impl = get_impl(op, LIGER[op])
    assert impl.requires == ("liger_kernel",) and impl.backends == {"cuda"} and source_of(impl) == "library"
    problem = get_op(op).problem._make(get_op(op).default_problems("cpu")[0])
    why = impl.why_not(problem, backend="cpu")
    assert why in ("liger_kernel not available", "no cpu backend")
    # on the CPU dispatch explains its choice without touching Liger
    args, attrs = get_op(op).make_inputs(problem, "cpu")
    assert _dispatch.explain(op, *args, **attrs)["impl"] == f"torch_{op}"
    assert {source_of(i) for i in impls(op)} <= set(SOURCES)


def test_liger_imports_when_installed():
    pytest.importorskip("liger_kernel")
    from kernel_space import _liger

    assert _liger.liger_version() != "none"
    assert _liger.has_liger_attr("ops.swiglu", "LigerSiLUMulFunction")
    assert not _liger.has_liger_attr("ops.swiglu", "NoSuchThing")
    assert "has no ops.swiglu.NoSuchThing" in _liger.missing("ops.swiglu", "NoSuchThing")
    assert "fails to import (ModuleNotFoundError)" in _liger.missing("ops.no_such_module", "X")
    check = _liger.needs_attr("ops.no_such_module", "X", then=lambda p, c: "never asked")
    assert "fails to import" in check(None, {})
    with pytest.raises(ks.OpsAdvError, match="upgrade liger-kernel"):
        _liger.liger_attr("ops.swiglu", "NoSuchThing")


def test_report_groups_winners_by_source():
    from tuner.report import format_markdown, format_table, summarize_sources

    rows = [
        {"op": "swiglu", "problem": {"rows": 8, "cols": 64, "merged": True, "dtype": "fp16"}, "impl": "torch_swiglu",
         "params": {}, "median_ms": 1.0, "vendor_impl": "torch_swiglu", "vendor_ms": 1.0, "speedup": 1.0},
        {"op": "rms_norm", "problem": {"rows": 8, "cols": 64, "dtype": "bf16"}, "impl": "liger_rms_norm", "params": {},
         "median_ms": 0.5, "vendor_impl": "torch_rms_norm", "vendor_ms": 0.6, "speedup": 1.2},
        {"op": "add_rms_norm", "problem": {"rows": 8, "cols": 64, "dtype": "bf16"}, "impl": "triton_add_rms_norm",
         "params": {"BLOCK_N": 0}, "median_ms": 0.5, "vendor_impl": "torch_add_rms_norm", "vendor_ms": 1.0, "speedup": 2.0},
        {"op": "gone", "problem": {}, "impl": "x", "params": None, "speedup": "?"},
    ]
    text = format_table(rows)
    body = [ln.split()[0] for ln in text.splitlines()[2:6]]
    assert body == ["ours", "library", "torch", "unknown"]
    summary = summarize_sources(rows)
    assert "ours: 1 problem (add_rms_norm), median speedup 2.00x" in summary
    assert "library: 1 problem (rms_norm), median speedup 1.20x" in summary and summary in text
    assert "| library | rms_norm |" in format_markdown(rows)


def test_report_lists_candidates_with_reasons():
    from tuner.report import format_candidates

    text = format_candidates(["add_rms_norm", "layer_norm"], "cpu")
    lines = {tuple(ln.split(None, 3)) for ln in text.splitlines()[2:]}
    assert ("add_rms_norm", "torch_add_rms_norm", "torch", "runs") in lines
    assert ("layer_norm", "triton_layer_norm", "ours", "needs cuda") in lines
    liger = [ln for ln in lines if ln[1] == "liger_add_rms_norm"]
    assert liger and liger[0][2] == "library" and liger[0][3] in ("needs cuda", "liger_kernel not available")


# --------------------------------------------------------------------------- GPU only (bf16, Liger running)


@gpu
@pytest.mark.parametrize("op", ["add_rms_norm", "add_layer_norm", "swiglu", "rms_norm", "layer_norm"])
def test_gpu_bf16_every_candidate(op):
    spec = get_op(op)
    for problem in ([spec.problem(3, 4096, "bf16"), spec.problem(2048, 3584, "bf16")] if op != "swiglu" else
                    [SwigluProblem(3, 14336, m, "bf16") for m in (False, True)] + [SwigluProblem(512, 18944, True, "bf16")]):
        args, attrs = spec.make_inputs(problem, "cuda", seed=2)
        ref = spec.reference(*args, **attrs)
        for impl in impls(op, backend="cuda"):
            if impl.why_not(problem, backend="cuda"):
                continue
            out = impl.fn(*args, **attrs)
            if isinstance(out, tuple):
                assert torch.equal(out[1], args[0] + args[1]), impl.name
                out = out[0]
            assert relative_error(out, ref) <= spec.tolerance("bf16"), (impl.name, problem)


@gpu
def test_gpu_bf16_runtime_ops():
    x, r = _t(4, 7, 4096, dtype=torch.bfloat16).cuda(), _t(4, 7, 4096, dtype=torch.bfloat16, seed=1).cuda()
    w = (1 + 0.1 * _t(4096, seed=2)).to(torch.bfloat16).cuda()
    y, h = _add_rms.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(h, x + r) and relative_error(y, F.rms_norm(x + r, (4096,), w, 1e-6)) < 2e-2
    gu = _t(4, 2 * 14336, dtype=torch.bfloat16).cuda()
    assert relative_error(_swiglu.swiglu(gu), F.silu(gu[..., :14336]) * gu[..., 14336:]) < 2e-2
    f = torch.compile(lambda a, b, c: _add_rms.add_rms_norm(a, b, c, 1e-6), fullgraph=True)
    y2, h2 = f(x, r, w)
    assert torch.equal(h2, h) and relative_error(y2, y) < 1e-2


def test_fused_ops_benchmark_smoke(tmp_path):
    """benchmarks/fused_ops.py end to end at tiny sizes (on the CPU the Triton and Liger candidates run through the
    interpreter, so the sweep, the interleaved timing, the ratios and the targets are all exercised)."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "fused_ops.py"
    spec = importlib.util.spec_from_file_location("fused_ops_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "f.json"
    device = "cuda" if DEVICE == "cuda" else "cpu"
    assert bench.main(["--device", device, "--quick", "--ops", "swiglu_merged", "--no-compile", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["copy_bw_bytes_per_s"] > 0 and len(data["results"]) == 2
    for r in data["results"]:
        assert "eager" in r["ms"] and "ours" in r["ms"] and r["ours_config"] and r["sweep"]
        assert set(r["targets"]) >= {"compile>=1.0", "liger>=1.0"} and r["ours_vs"]["eager"] > 0
