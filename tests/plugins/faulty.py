"""Deliberately faulty gemm implementations: each fault class a tuner must survive.

Registered only when a test imports this module (as a tuner plugin).
"""
from __future__ import annotations

import os
import time

import torch

from kernel_space import register_impl

FAULTY = ("fault_wrong", "fault_raise", "fault_hang", "fault_crash")


@register_impl("gemm", name="fault_wrong", priority=1, space={"scale": (2.0,)})
def fault_wrong(a, b, *, scale=2.0):
    return torch.matmul(a, b) * scale


@register_impl("gemm", name="fault_raise", priority=1, space={"n": (1,)})
def fault_raise(a, b, *, n=1):
    raise RuntimeError("deliberate failure in fault_raise")


@register_impl("gemm", name="fault_hang", priority=1, space={"n": (1,)})
def fault_hang(a, b, *, n=1):
    time.sleep(3600)


@register_impl("gemm", name="fault_crash", priority=1, space={"n": (1,)})
def fault_crash(a, b, *, n=1):
    os._exit(139)  # what a segfault in native code looks like to the worker
