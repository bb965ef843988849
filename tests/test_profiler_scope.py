"""A profiler, a debug check or a recording is gone once its block ends: nothing of it runs in later
calls (a profiler left installed synchronised inside every later CUDA graph capture)."""
from __future__ import annotations

import torch

import ops_adv
from ops_adv import _dispatch


def test_profile_context_leaves_no_wrapper_behind():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    ops_adv.load_table("")
    before = list(_dispatch._wrappers)
    with ops_adv.profiler.ProfileContext() as prof:
        ops_adv.gemm(a, b)
    assert len(prof.calls) == 1
    assert _dispatch._wrappers == before
    ops_adv.gemm(a, b)
    ops_adv.gemm(torch.randn(9, 16), b)  # a problem resolved after the block
    assert len(prof.calls) == 1


def test_nested_profiles_remove_only_their_own():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    with ops_adv.profiler.ProfileContext() as outer:
        with ops_adv.profiler.ProfileContext() as inner:
            ops_adv.gemm(a, b)
        ops_adv.gemm(a, b)
    ops_adv.gemm(a, b)
    assert (len(inner.calls), len(outer.calls)) == (1, 2)
    assert _dispatch._wrappers == []
