"""conv2d_bn_relu: the Triton epilogue under TRITON_INTERPRET=1, the vendors, the runtime op, and fuse_conv_bn_relu."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kernel_space import get_impl, get_op, impls, relative_error
from kernel_space.conv2d_bn_relu import ConvBnReluProblem
from ops_adv.models.conv_bn import ConvBNReLU, fuse_conv_bn_relu
from ops_adv.ops.conv2d_bn_relu import conv2d_bn_relu

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
P = ConvBnReluProblem
CASES = [
    P(2, 5, 7, 9, 11, 3, 3, 1, 1, 1),  # odd everything, partial tiles in M, N and K
    P(1, 6, 9, 8, 13, 3, 3, 2, 1, 1),  # stride 2 with padding
    P(2, 3, 6, 5, 7, 1, 1, 2, 0, 1, relu=False),  # 1x1 stride 2, conv + BN without ReLU
    P(1, 4, 7, 7, 9, 3, 3, 1, 2, 2, relu=False),  # dilation 2
]
CFG = dict(BLOCK_M=32, BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=2)


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])  # bf16 tl.dot is unsound under the interpreter
@pytest.mark.parametrize("caller", ["nchw", "nhwc"])
def test_triton_epilogue(caller, dtype):
    pytest.importorskip("triton")
    spec, impl = get_op("conv2d_bn_relu"), get_impl("conv2d_bn_relu", "triton_implicit_gemm")
    for case in CASES:
        problem = case._replace(layout=caller, dtype=dtype)
        args, attrs = spec.make_inputs(problem, DEVICE, seed=7)
        assert spec.signature(*args, **attrs) == tuple(problem)
        ref = spec.reference(*args, **attrs)
        assert (ref < 0).any() != problem.relu  # the inputs make ReLU matter
        for layout in ("nhwc", "nchw"):
            params = {**CFG, "layout": layout}
            assert impl.check(problem, params) is None, (problem, params)
            # Poison an output in the other memory format: the epilogue must honour strides and write everything.
            fmt = torch.contiguous_format if layout == "nhwc" else torch.channels_last
            out = torch.full(ref.shape, float("nan"), dtype=args[0].dtype, device=DEVICE).contiguous(memory_format=fmt)
            impl.fn(*args, **attrs, **params, out=out)
            err = relative_error(out, ref)
            assert err <= spec.tolerance(dtype), (problem, layout, err)
            if problem.relu:
                assert (out >= 0).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 tl.dot needs a GPU (the interpreter is unsound)")
def test_triton_epilogue_bf16_gpu():
    spec, impl = get_op("conv2d_bn_relu"), get_impl("conv2d_bn_relu", "triton_implicit_gemm")
    for problem in spec.default_problems("h200")[:3]:
        args, attrs = spec.make_inputs(problem, "cuda")
        out = impl.fn(*args, **attrs, **impl.default_params())
        assert relative_error(out, spec.reference(*args, **attrs)) <= spec.tolerance("bf16")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cudnn_convolution_relu needs CUDA")
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_cudnn_fused_vendor_gpu(dtype):
    spec = get_op("conv2d_bn_relu")
    for case in CASES[:2]:
        for lay in ("nchw", "nhwc"):
            problem = case._replace(layout=lay, dtype=dtype)
            args, attrs = spec.make_inputs(problem, "cuda")
            for name in ("cudnn_fused_nchw", "cudnn_fused_nhwc"):
                out = get_impl("conv2d_bn_relu", name).fn(*args, **attrs)
                assert relative_error(out, spec.reference(*args, **attrs)) <= spec.tolerance(dtype), (name, problem)
    assert "always applies ReLU" in get_impl("conv2d_bn_relu", "cudnn_fused_nhwc").why_not(CASES[2])


def test_conv2d_without_epilogue_is_unchanged():
    """conv2d's launch with HAS_BIAS/RELU off gives F.conv2d (no bias, negatives kept)."""
    pytest.importorskip("triton")
    spec = get_op("conv2d")
    problem = get_op("conv2d").problem(1, 5, 6, 7, 9, 3, 3, 2, 1, 1, "nhwc")
    args, attrs = spec.make_inputs(problem, DEVICE)
    y = get_impl("conv2d", "triton_implicit_gemm").fn(*args, **attrs, **{**CFG, "layout": "nchw"})
    assert (y < 0).any() and relative_error(y, spec.reference(*args, **attrs)) <= spec.tolerance("fp32")


def test_vendors_and_signatures():
    spec = get_op("conv2d_bn_relu")
    problems = spec.default_problems("cpu") + [c._replace(layout=lay) for c in CASES for lay in ("nchw", "nhwc")]
    vendors = [i for i in impls("conv2d_bn_relu", backend="cpu") if i.vendor]
    assert {i.name for i in vendors} == {"torch_conv_bias_relu", "cudnn_nchw", "cudnn_nhwc"}
    for problem in problems:
        args, attrs = spec.make_inputs(problem, "cpu", seed=1)
        assert spec.signature(*args, **attrs) == tuple(problem) and type(spec.signature(*args, **attrs)) is tuple
        ref = spec.reference(*args, **attrs)
        for impl in vendors:
            err = relative_error(impl.fn(*args, **attrs), ref)
            assert err <= spec.tolerance(problem.dtype), (impl.name, problem, err)
    args, attrs = spec.make_inputs(CASES[0], "cpu")
    assert get_impl("conv2d_bn_relu", "cudnn_nhwc").fn(*args, **attrs).is_contiguous(memory_format=torch.channels_last)


def test_every_gpu_problem_has_valid_triton_configs():
    impl = get_impl("conv2d_bn_relu", "triton_implicit_gemm")
    configs = list(impl.configs())
    for problem in get_op("conv2d_bn_relu").default_problems("h200"):
        assert impl.check(problem, impl.default_params()) is None, problem
        assert any(impl.check(problem, c) is None for c in configs), problem


# --------------------------------------------------------------------------- runtime op


@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("fmt", [torch.contiguous_format, torch.channels_last])
def test_op_eager_matches_torch(relu, fmt):
    x = torch.randn(2, 4, 9, 9).contiguous(memory_format=fmt)
    w, b = torch.randn(6, 4, 3, 3), torch.randn(6)
    want = F.conv2d(x, w, b, 2, 1)
    want = want.relu() if relu else want
    torch.testing.assert_close(conv2d_bn_relu(x, w, b, 2, 1, 1, relu), want)
    # non-square attributes run the composite
    torch.testing.assert_close(conv2d_bn_relu(x, w, b, (1, 2), (0, 1), 1, relu),
                               F.relu(F.conv2d(x, w, b, (1, 2), (0, 1))) if relu else F.conv2d(x, w, b, (1, 2), (0, 1)))


def test_op_under_grad_gives_torch_gradients():
    x = torch.randn(1, 2, 5, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 2, 3, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *t: conv2d_bn_relu(*t, 1, 1, 1, True), (x, w, b))
    y = conv2d_bn_relu(x, w, b, 1, 1)
    y.sum().backward()
    gx = x.grad.clone()
    x.grad = None
    F.relu(F.conv2d(x, w, b, 1, 1)).sum().backward()
    torch.testing.assert_close(gx, x.grad)


def test_op_under_compile_runs_the_custom_operator(monkeypatch):
    monkeypatch.setenv("OPS_ADV_COMPILE_OPERATORS", "1")  # else, with no kernel of ours tuned, torch's own ops trace
    x, w, b = torch.randn(2, 3, 8, 8), torch.randn(5, 3, 3, 3), torch.randn(5)
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    fn = torch.compile(lambda x: conv2d_bn_relu(x, w, b, 1, 1), backend=backend, fullgraph=True)
    torch.testing.assert_close(fn(x), F.relu(F.conv2d(x, w, b, 1, 1)))
    assert any("conv2d_bn_relu" in str(n.target) for n in graphs[0].graph.nodes)
    fn = torch.compile(lambda x: conv2d_bn_relu(x, w, b, 1, 1), backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(fn(x), F.relu(F.conv2d(x, w, b, 1, 1)))


# --------------------------------------------------------------------------- fuse_conv_bn_relu


def _randomize_bn(model: nn.Module) -> nn.Module:
    """Non-trivial running statistics and affine parameters, so that a wrong fold shows."""
    g = torch.Generator().manual_seed(0)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            n = m.num_features
            m.running_mean.copy_(torch.rand(n, generator=g) * 0.4 - 0.2)
            m.running_var.copy_(torch.rand(n, generator=g) * 1.5 + 0.5)
            if m.affine:
                m.weight.data.copy_(torch.rand(n, generator=g) + 0.5)
                m.bias.data.copy_(torch.rand(n, generator=g) * 0.4 - 0.2)
    return model


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True))
        self.conv = nn.Conv2d(8, 8, 3, padding=1)  # with a bias, then F.relu
        self.bn = nn.BatchNorm2d(8)
        self.grouped = nn.Conv2d(8, 8, 3, padding=1, groups=2)  # refused: groups
        self.gbn = nn.BatchNorm2d(8)
        self.tap = nn.Conv2d(8, 8, 1)  # refused: its output is also read by the residual add
        self.tbn = nn.BatchNorm2d(8)
        self.last = nn.Conv2d(8, 4, 1)
        self.lbn = nn.BatchNorm2d(4)  # fused without ReLU: its output feeds two readers
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        x = self.stem(x)
        x = F.relu(self.bn(self.conv(x)))
        x = self.gbn(self.grouped(x)).relu()
        t = self.tap(x)
        x = torch.relu(self.tbn(t) + t)
        y = self.lbn(self.last(x))
        y = torch.relu(y) + y
        return self.head(y.mean((2, 3)))


def _fused(model: nn.Module) -> tuple[nn.Module, list[dict]]:
    f = copy.deepcopy(model)
    return f, fuse_conv_bn_relu(f)


def test_small_cnn_fuses_what_its_structure_allows():
    model = _randomize_bn(SmallCNN()).eval()
    x = torch.randn(2, 3, 17, 15)
    f, report = _fused(model)
    assert all(set(r) == {"module", "type", "converted", "why"} for r in report)
    got = {r["module"]: r for r in report}
    assert set(got) == {"stem.0", "conv", "grouped", "tap", "last"}
    assert [m for m, r in got.items() if r["converted"] == "yes"] == ["stem.0", "conv", "last"]
    assert "groups" in got["grouped"]["why"] and "read elsewhere" in got["tap"]["why"]
    assert "-> ReLU" in got["conv"]["why"] and "ReLU not fused" in got["last"]["why"]
    sites = [m for g in _graphs(f) for m in g.modules() if isinstance(m, ConvBNReLU)]
    assert sorted(s.relu for s in sites) == [False, True, True]
    # the modules stay where they were: same keys, and a checkpoint of the original loads
    assert f.state_dict().keys() == model.state_dict().keys() and isinstance(f.stem[1], nn.BatchNorm2d)
    f.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(f(x), model(x), rtol=1e-4, atol=1e-5)
        cl = x.contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(f(cl), model(cl), rtol=1e-4, atol=1e-5)
    assert not any(r["converted"] == "yes" for r in fuse_conv_bn_relu(f))


def _graphs(model: nn.Module) -> list[nn.Module]:
    return [m.__dict__["_ops_adv_fused_graph"] for m in model.modules() if "_ops_adv_fused_graph" in m.__dict__]


def test_a_fused_model_trains_as_the_original_and_refolds_new_weights():
    model = _randomize_bn(SmallCNN()).eval()
    f, _ = _fused(model)
    x = torch.randn(4, 3, 16, 16)
    f.train(), model.train()
    torch.testing.assert_close(f(x), model(x))  # batch statistics, and the running stats update alike
    torch.testing.assert_close(f.stem[1].running_mean, model.stem[1].running_mean)
    with torch.no_grad():
        f.stem[0].weight.mul_(0.5)
        model.stem[0].weight.mul_(0.5)
    f.eval(), model.eval()
    with torch.no_grad():
        torch.testing.assert_close(f(x), model(x), rtol=1e-4, atol=1e-5)


def test_training_mode_model_is_left_unchanged():
    model = _randomize_bn(SmallCNN()).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = fuse_conv_bn_relu(model)
    assert len(report) == 1 and report[0]["converted"] == "no" and "training mode" in report[0]["why"]
    assert not _graphs(model)
    assert "forward" not in model.stem.__dict__ and model.state_dict().keys() == before.keys()


def test_sites_refused_for_their_semantics():
    """A BatchNorm left in training mode, one without running statistics, a conv subclass with its own
    forward, and hooks."""

    class MyConv(nn.Conv2d):
        def forward(self, x):
            return super().forward(x) * 2

    def block(track=True, conv=nn.Conv2d):
        return nn.Sequential(conv(3, 4, 3), nn.BatchNorm2d(4, track_running_stats=track), nn.ReLU())

    model = nn.Sequential(block(), block(track=False), block(conv=MyConv), block()).eval()
    model[0][1].train()
    model[3][1].register_forward_hook(lambda *a: None)
    report = fuse_conv_bn_relu(model)
    assert [r["converted"] for r in report] == ["no", "no", "no", "no"]
    assert "training mode" in report[0]["why"] and "running statistics" in report[1]["why"]
    assert "overrides Conv2d.forward" in report[2]["why"] and "hooks" in report[3]["why"]
    assert not _graphs(model)


def test_untraceable_forward_is_left_unchanged_with_a_reason():
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

        def forward(self, x):
            y = self.bn(self.conv(x))
            return y if y.sum() > 0 else -y  # data-dependent: torch.fx refuses

    model = Branchy().eval()
    report = fuse_conv_bn_relu(model)
    assert len(report) == 1 and report[0]["converted"] == "no" and "torch.fx cannot trace" in report[0]["why"]
    assert isinstance(model.conv, nn.Conv2d) and isinstance(model.bn, nn.BatchNorm2d)


def test_compiled_fused_model_on_cpu(monkeypatch):
    monkeypatch.setenv("OPS_ADV_COMPILE_OPERATORS", "1")  # else, with no kernel of ours tuned, torch's own ops trace
    model = _randomize_bn(SmallCNN()).eval()
    f, _ = _fused(model)
    x = torch.randn(2, 3, 16, 16)
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    with torch.no_grad():
        torch.testing.assert_close(torch.compile(f, backend=backend)(x), model(x), rtol=1e-4, atol=1e-5)
        assert sum("conv2d_bn_relu" in str(n.target) for g in graphs for n in g.graph.nodes) == 3
        # AOT autograd over the fake kernel (inductor passes too, in 60 s on this 2-core machine: too slow here)
        compiled = torch.compile(copy.deepcopy(f), backend="aot_eager")
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("arch, sites, with_relu", [("resnet18", 20, 9), ("resnet50", 53, 33)])
def test_torchvision_resnets(arch, sites, with_relu):
    """ResNet-18: stem + 2 per BasicBlock (8) + 3 downsamples = 20; the ReLU fuses after the stem and each
    first conv (9). ResNet-50: stem + 3 per Bottleneck (16) + 4 downsamples = 53; ReLU after the stem and
    the first two convs of each block (33); conv3 + bn3 feed the residual add, so no ReLU there."""
    tv = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = _randomize_bn(getattr(tv.models, arch)()).eval()
    f, report = _fused(model)
    assert sum(r["converted"] == "yes" for r in report) == sites == len(report)
    assert sum("-> ReLU" in r["why"] for r in report) == with_relu
    assert sum(isinstance(m, ConvBNReLU) for g in _graphs(f) for m in g.modules()) == sites
    assert f.state_dict().keys() == model.state_dict().keys()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        want = model(x)
        torch.testing.assert_close(f(x), want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
        cl = x.contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(f(cl), want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
