"""Deliberately faulty CUDA gemm kernels: one writes far out of bounds, one never ends.

Registered only when imported as a tuner plugin (the GPU run in benchmarks/gpu_tune_run.sh).
"""
from __future__ import annotations

import torch

from kernel_space import register_impl


def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def oob(out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + offs + (1 << 36), tl.zeros((BLOCK,), tl.float32))  # 256 GiB past the end

    @triton.jit
    def spin(flag_ptr, BLOCK: tl.constexpr):
        i = 0
        while tl.load(flag_ptr) >= 0:  # the flag is never negative: this never returns
            i += 1
        tl.store(flag_ptr, i)

    return oob, spin


@register_impl("gemm", name="fault_oob", priority=1, backends=("cuda",), space={"BLOCK": (128,)}, requires=("triton",))
def fault_oob(a, b, *, BLOCK=128):
    oob, _ = _kernels()
    out = torch.empty((a.shape[0], b.shape[1]), dtype=torch.float32, device=a.device)
    oob[(4,)](out, out.numel(), BLOCK=BLOCK)
    torch.cuda.synchronize()
    return out


@register_impl("gemm", name="fault_spin", priority=1, backends=("cuda",), space={"BLOCK": (128,)}, requires=("triton",))
def fault_spin(a, b, *, BLOCK=128):
    _, spin = _kernels()
    flag = torch.zeros(1, dtype=torch.int32, device=a.device)
    spin[(1,)](flag, BLOCK=BLOCK)
    torch.cuda.synchronize()
    return torch.matmul(a, b)
