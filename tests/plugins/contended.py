"""A matmul op whose vendor kernel runs on the one CPU a test contends (issue 30: the contended 231x "winner").

`contended_mm` multiplies two n x n matrices. Its vendor kernel `pinned_matmul` is one product, its
thread moved onto CONTENDED (the last CPU this process may use) for the call; the tuned kernel
`repeated_matmul` computes the same product `products` times (3 to 8) on the other CPUs, so it is
truly 3 to 8 times slower than the vendor. A test that starts busy processes on CONTENDED after the
vendor's search measurement makes its final re-measurement slow by real contention (the busy processes
take the CPU's time slices), while the tuned kernel runs beside them: a tuner that trusts the contended
time stores a tuned "winner" that is really slower than the vendor.

Measure with one torch thread (`threads=1`) so each product stays on the thread that called it.
Registered only when a test imports this module (as a tuner plugin, in the driver and the workers).
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch

from kernel_space import register_impl, register_vendor
from kernel_space._common import DTYPE_CODE, generator, randn
from kernel_space._registry import define_op

CPUS = sorted(os.sched_getaffinity(0))
CONTENDED = CPUS[-1]  # the vendor's CPU, the one the test fills with busy processes
OTHERS = set(CPUS[:-1]) or {CONTENDED}


class ContendedProblem(NamedTuple):
    n: int
    dtype: str = "fp32"


def _signature(a: torch.Tensor, b: torch.Tensor) -> tuple:
    return (a.shape[0], DTYPE_CODE[a.dtype])


def _make_inputs(p: ContendedProblem, device, seed: int = 0):
    g = generator(seed)
    return (randn((p.n, p.n), p.dtype, device, g), randn((p.n, p.n), p.dtype, device, g)), {}


def _reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.double() @ b.double()


define_op("contended_mm", ContendedProblem, _signature, _make_inputs, _reference, size_fields=("n",),
          flops=lambda p: 2.0 * p.n ** 3, bytes_moved=lambda p: 12.0 * p.n * p.n,
          default_problems=lambda device_class: [ContendedProblem(512)])


@register_vendor("contended_mm", "pinned_matmul", backends=("cpu",))
def pinned_matmul(a, b):
    os.sched_setaffinity(0, {CONTENDED})  # this thread only (Linux): the product runs where the test contends
    return torch.mm(a, b)


@register_impl("contended_mm", name="repeated_matmul", priority=1, space={"products": (3, 4, 5, 6, 7, 8)})
def repeated_matmul(a, b, *, products=3):
    os.sched_setaffinity(0, OTHERS)
    for _ in range(products - 1):
        torch.mm(a, b)
    return torch.mm(a, b)
