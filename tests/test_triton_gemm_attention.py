"""Triton gemm and flash attention against the op references.

Without a GPU the kernels run under TRITON_INTERPRET=1 (set by conftest), on small
problems and tiles, so that every mask and edge path is taken in a few seconds.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernel_space import get_impl, get_op, relative_error
from kernel_space.attention import AttentionProblem
from kernel_space.gemm import GemmProblem

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [
    "fp16",
    "fp32",
    pytest.param(
        "bf16",
        marks=pytest.mark.skipif(DEVICE == "cpu", reason="the Triton interpreter multiplies bf16 dot operands as raw bits"),
    ),
]


def _run(op: str, impl_name: str, problem, params: dict, *, poison: bool = True) -> float:
    """Relative error of the implementation on `problem`; with `poison`, into a NaN-filled `out`."""
    impl = get_impl(op, impl_name)
    config = {**impl.default_params(), **params}
    assert impl.check(problem, config) is None, impl.check(problem, config)
    spec = get_op(op)
    args, attrs = spec.make_inputs(problem, DEVICE, seed=0)
    ref = spec.reference(*args, **attrs)
    if poison:
        out = torch.full(ref.shape, float("nan"), dtype=args[0].dtype, device=DEVICE)
        assert impl.fn(*args, **attrs, **config, out=out) is out
    else:
        out = impl.bind(config)(*args, **attrs)
    err = relative_error(out, ref)  # inf where any element was left unwritten (NaN)
    assert err <= spec.tolerance(problem.dtype), f"{problem} {config}: relative error {err:.3g}"
    return err


SMALL = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 1, "num_warps": 4, "num_stages": 2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape, params",
    [
        ((33, 47, 29, False, False), {}),  # nothing divides: masked K, wrapped M and N
        ((33, 47, 29, True, False), {"BLOCK_N": 64}),
        ((40, 70, 64, False, True), {"BLOCK_M": 32, "GROUP_M": 1}),  # K divides: unmasked loop
        ((70, 50, 32, True, True), {"GROUP_M": 4}),  # 5 rows of tiles: one full group, one partial
        ((17, 130, 64, False, False), {"SPLIT_K": 2}),
        ((17, 130, 150, False, True), {"SPLIT_K": 4}),  # 5 K tiles over 4 splits, last one partial
        ((1, 64, 96, False, True), {"SPLIT_K": 2, "num_warps": 2}),  # decode row
    ],
)
def test_gemm(dtype, shape, params, monkeypatch):
    M, N, K, ta, tb = shape
    if params.get("SPLIT_K", 1) > 1:  # poison the split-K workspace too
        from kernel_space.gemm import _kernels as kmod

        monkeypatch.setattr(
            kmod, "_new_workspace", lambda s, device: torch.full(s, float("nan"), dtype=torch.float32, device=device)
        )
    _run("gemm", "triton", GemmProblem(M, N, K, dtype, ta, tb), {**SMALL, **params})


def test_gemm_allocates_output():
    _run("gemm", "triton", GemmProblem(20, 36, 40, "fp16"), SMALL, poison=False)


TINY = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 1, "num_stages": 2, "streams": 1}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "shape, params",
    [
        ((2, 2, 37, 37, 64), {}),
        ((1, 2, 20, 53, 64), {"BLOCK_N": 32}),  # Sq < Skv
        ((1, 2, 53, 20, 64), {"BLOCK_M": 32, "num_warps": 2}),  # Sq > Skv: late rows see every key
        ((3, 1, 33, 40, 16), {"streams": 2}),  # small D; batches split 1 + 2
        ((1, 2, 29, 31, 24), {}),  # D padded to 32
    ],
)
def test_attention(dtype, causal, shape, params):
    B, H, Sq, Skv, D = shape
    _run("attention", "triton_flash", AttentionProblem(B, H, Sq, Skv, D, causal, dtype), {**TINY, **params})


def test_attention_strided_inputs():
    """(B, S, H, D) storage seen as (B, H, S, D), and a fresh output."""
    impl = get_impl("attention", "triton_flash")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, 3, 32, generator=g).to(DEVICE).transpose(1, 2) for n in (24, 40, 40))
    out = impl.bind({**impl.default_params(), **TINY})(q, k, v, causal=True)
    ref = get_op("attention").reference(q, k, v, causal=True)
    assert relative_error(out, ref) <= get_op("attention").tolerance("fp32")


def test_checks_reject_oversize_shared_memory():
    gemm = get_impl("gemm", "triton")
    big = {**gemm.default_params(), "BLOCK_N": 256, "BLOCK_K": 128, "num_stages": 4}
    assert "shared memory" in gemm.check(GemmProblem(4096, 4096, 4096, "bf16"), big)
    assert gemm.check(GemmProblem(4096, 4096, 4096, "bf16"), {**big, "BLOCK_K": 64, "num_stages": 3}) is None

    attn = get_impl("attention", "triton_flash")
    p = AttentionProblem(4, 32, 2048, 2048, 256, True, "bf16")
    assert "shared memory" in attn.check(p, {**attn.default_params(), "BLOCK_N": 128, "num_stages": 4})
    assert attn.check(p, {**attn.default_params(), "num_stages": 2}) is None


def test_checks_prune_configs_that_do_not_fit_the_problem():
    gemm = get_impl("gemm", "triton")
    cfg = {**gemm.default_params(), "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "GROUP_M": 1, "num_warps": 4}
    decode = GemmProblem(1, 4096, 4096, "bf16")
    assert gemm.check(decode, {**cfg, "SPLIT_K": 8}) is None
    assert "larger than M" in gemm.check(decode, {**cfg, "BLOCK_M": 32})
    assert "per split" in gemm.check(GemmProblem(1, 4096, 1024, "bf16"), {**cfg, "SPLIT_K": 8})
    assert "SPLIT_K" in gemm.check(GemmProblem(4096, 4096, 4096, "bf16"), {**gemm.default_params(), "SPLIT_K": 2})
    assert "GROUP_M" in gemm.check(decode, {**cfg, "GROUP_M": 8})
    assert "registers" in gemm.check(GemmProblem(4096, 4096, 4096, "bf16"), {**gemm.default_params(), "BLOCK_N": 256, "num_warps": 4})

    attn = get_impl("attention", "triton_flash")
    assert "streams" in attn.check(AttentionProblem(1, 32, 2048, 2048, 128, dtype="bf16"), {**attn.default_params(), "streams": 2})
    assert "larger than Sq" in attn.check(AttentionProblem(4, 32, 64, 2048, 128, dtype="bf16"), attn.default_params())
    assert "head dim" in attn.check(AttentionProblem(4, 32, 64, 64, 512, dtype="bf16"), attn.default_params())


def test_import_does_not_load_triton():
    code = "import sys, kernel_space; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])
