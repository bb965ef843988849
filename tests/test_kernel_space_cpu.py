"""CPU implementations against the reference, and problem signatures."""
from __future__ import annotations

import itertools

import pytest

import kernel_space
from kernel_space import OpsAdvError, get_op, impls, relative_error


def _cases(op):
    spec = get_op(op)
    for problem in spec.default_problems("cpu")[:2]:
        for impl in impls(op, backend="cpu"):
            configs = [c for c in impl.configs() if impl.why_not(problem, c, "cpu") is None]
            for cfg in configs[:: max(1, len(configs) // 4)][:5]:
                yield pytest.param(op, problem, impl.name, cfg, id=f"{op}-{impl.name}-{'-'.join(map(str, cfg.values()))}")


@pytest.mark.parametrize("op,problem,impl,cfg", list(itertools.chain(_cases("gemm"), _cases("attention"))))
def test_cpu_impl_matches_reference(op, problem, impl, cfg):
    spec = get_op(op)
    args, attrs = spec.make_inputs(problem, "cpu", seed=7)
    assert spec.signature(*args, **attrs) == problem
    out = kernel_space.get_impl(op, impl).bind(cfg)(*args, **attrs)
    assert relative_error(out, spec.reference(*args, **attrs)) < 1e-5


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,skv", [(37, 37), (20, 53), (53, 20)])
def test_chunked_attention_odd_sizes(sq, skv, causal):
    spec = get_op("attention")
    p = spec.problem(2, 3, sq, skv, 16, causal, "fp32")
    args, attrs = spec.make_inputs(p, "cpu", seed=3)
    out = kernel_space.get_impl("attention", "cpu_chunked").bind({"block_q": 16, "block_kv": 16})(*args, **attrs)
    assert relative_error(out, spec.reference(*args, **attrs)) < 1e-5
    assert relative_error(kernel_space.get_impl("attention", "sdpa").fn(*args, **attrs), spec.reference(*args, **attrs)) < 1e-5


def test_parameters_change_what_runs():
    spec = get_op("gemm")
    p = spec.problem(128, 128, 256)
    impl = kernel_space.get_impl("gemm", "cpu_blocked")
    assert impl.why_not(p, {"block_m": 512, "block_n": 128, "block_k": 0}) is not None
    assert impl.why_not(p, {"block_m": 64, "block_n": 64, "block_k": 64}) is None
    assert len(list(impl.configs())) >= 100


@pytest.mark.parametrize(
    "data,msg",
    [({"M": 4, "N": 4}, "missing K"), ({"M": 4, "N": 4, "K": 0}, "positive integer"), ({"M": 4, "N": 4, "K": 4, "dtype": "fp8"}, "must be one of"),
     ({"M": 4, "N": 4, "K": 4, "x": 1}, "unknown x")],
)
def test_parse_problem_rejects_bad_fields(data, msg):
    with pytest.raises(OpsAdvError, match=msg):
        get_op("gemm").parse_problem(data)


def test_device_names_normalise():
    from kernel_space._device import device_class_of

    assert device_class_of("NVIDIA H200") == "h200"
    assert device_class_of("NVIDIA H200 NVL") == "h200"
    assert device_class_of("NVIDIA H100 80GB HBM3") == "h100"
    assert device_class_of("NVIDIA A100-SXM4-80GB") == "a100"
    assert device_class_of("cpu") == "cpu"
