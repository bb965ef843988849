"""Kernel versions hash what runs: kernel bodies, launch wrappers, spaces and checks; not comments,
docstrings, formatting, neighbours or where a helper lives."""
from __future__ import annotations

import importlib
import itertools
import os
import sys

import pytest

import kernel_space
from kernel_space import get_impl, get_op, impls, ops, unregister_impl
from kernel_space._version import impl_version

pytest.importorskip("triton")

HELPERS = '''
import triton
import triton.language as tl


@triton.jit
def _twice(x):
    return x * 2
'''

BASE = '''
"""A test implementation."""
import triton
import triton.language as tl

from kernel_space import register_impl

LIMIT = 16
_cache = {}


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def _kernel(X, Y, n, BLOCK: tl.constexpr):
    """Doubles X into Y."""
    offs = tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n)  # masked load
    tl.store(Y + offs, _twice(x), mask=offs < n)


def unrelated():
    return 1


def _check(p, c):
    if c["BLOCK"] < LIMIT:
        return "BLOCK too small"
    return None


@register_impl("softmax", name="versioned", backends=("cpu",), space={"BLOCK": (16, 32)}, check=_check)
def versioned(x, *, BLOCK=16):
    """Launch."""
    out = x.new_empty(x.shape)
    _kernel[(1,)](x, out, x.numel(), BLOCK=BLOCK)
    return out
'''

_counter = itertools.count()


def version_of(tmp_path, source: str, helpers: str = HELPERS) -> str:
    """Import `source` as a fresh module (helper in place, or from a sibling module) and return the version."""
    pkg = f"vt{next(_counter)}"
    d = tmp_path / pkg
    d.mkdir()
    (d / "__init__.py").write_text("")
    (d / "helpers.py").write_text(helpers)
    (d / "mod.py").write_text(source)
    sys.path.insert(0, str(tmp_path))
    try:
        importlib.import_module(f"{pkg}.mod")
        return impl_version(get_impl("softmax", "versioned"))
    finally:
        sys.path.remove(str(tmp_path))
        unregister_impl("softmax", "versioned")


CHANGED = {
    "kernel body": ("mask=offs < n)  # masked load", "mask=offs < n - 1)  # masked load"),
    "called jit function": ("return x * 2", "return x * 3"),
    "launch wrapper": ("_kernel[(1,)]", "_kernel[(2,)]"),
    "launch argument": ("x.numel(), BLOCK=BLOCK)", "x.numel() - 1, BLOCK=BLOCK)"),
    "space": ('space={"BLOCK": (16, 32)}', 'space={"BLOCK": (16, 64)}'),
    "space default": ('space={"BLOCK": (16, 32)}', 'space={"BLOCK": (32, 16)}'),
    "check": ('c["BLOCK"] < LIMIT', 'c["BLOCK"] <= LIMIT'),
    "constant the check reads": ("LIMIT = 16", "LIMIT = 32"),
}

UNCHANGED = {
    "comment": ("# masked load", "# loads under a mask, since n may be short"),
    "docstring edited": ('"""Doubles X into Y."""', '"""Writes 2·X to Y."""'),
    "docstring removed": ('    """Launch."""\n', ""),
    "module docstring": ('"""A test implementation."""', '"""Something else entirely."""'),
    "formatting": ("_kernel[(1,)](x, out, x.numel(), BLOCK=BLOCK)", "_kernel[(1,)](\n        x, out,\n        x.numel(),\n        BLOCK=BLOCK,\n    )"),
    "unrelated function changed": ("def unrelated():\n    return 1", "def unrelated():\n    return 2"),
    "unrelated function added": ("def unrelated():", "def another(a):\n    return a + 1\n\n\ndef unrelated():"),
    "registration priority": ('name="versioned", backends', 'name="versioned", priority=7, backends'),
    "new implementation beside it": (
        "def unrelated():",
        '@register_impl("softmax", name="versioned_two", backends=("cpu",))\n'
        "def versioned_two(x):\n    return _kernel\n\n\ndef unrelated():",
    ),
}


def _variant(change: tuple[str, str]) -> str:
    old, new = change
    assert old in BASE, old
    return BASE.replace(old, new)


@pytest.mark.parametrize("what", sorted(CHANGED))
def test_a_change_to_what_runs_changes_the_version(tmp_path, what):
    assert version_of(tmp_path, _variant(CHANGED[what])) != version_of(tmp_path, BASE)


@pytest.mark.parametrize("what", sorted(UNCHANGED))
def test_edits_that_change_nothing_that_runs_keep_the_version(tmp_path, what):
    try:
        assert version_of(tmp_path, _variant(UNCHANGED[what])) == version_of(tmp_path, BASE)
    finally:
        unregister_impl("softmax", "versioned_two")


def test_a_function_moved_within_its_module_keeps_the_version(tmp_path):
    check = BASE[BASE.index("def _check"):BASE.index("@register_impl")]
    moved = BASE.replace(check, "").replace("_cache = {}\n", "_cache = {}\n\n\n" + check)
    assert version_of(tmp_path, moved) == version_of(tmp_path, BASE)


def test_a_helper_moved_to_another_module_keeps_the_version(tmp_path):
    here = BASE[BASE.index("@triton.jit\ndef _twice"):BASE.index("@triton.jit\ndef _kernel")]
    moved = BASE.replace(here, "").replace("from kernel_space import register_impl", "from kernel_space import register_impl\n\nfrom .helpers import _twice")
    assert version_of(tmp_path, moved) == version_of(tmp_path, BASE)
    changed = HELPERS.replace("x * 2", "x * 5")
    assert version_of(tmp_path, moved, helpers=changed) != version_of(tmp_path, BASE)


def test_a_cache_filling_up_keeps_the_version(tmp_path):
    src = BASE.replace("out = x.new_empty(x.shape)", "out = _cache.setdefault(x.shape, x.new_empty(x.shape))")
    pkg_version = version_of(tmp_path, src)
    mod = sys.modules[[m for m in sys.modules if m.startswith("vt") and m.endswith(".mod")][-1]]
    mod._cache[(1, 2)] = object()
    mod._cache[(3,)] = object()
    sys.path.insert(0, str(tmp_path))
    try:
        importlib.reload(mod)  # registers again; the cache it holds was emptied by the reload
        mod._cache[(1, 2)] = object()
        assert impl_version(get_impl("softmax", "versioned")) == pkg_version
    finally:
        sys.path.remove(str(tmp_path))
        unregister_impl("softmax", "versioned")



def test_a_cache_of_plain_values_filling_up_keeps_the_version():
    """The Liger candidates' checks cache which Liger kernels import (`_liger._missing`: tuples to strings or
    None, plain data). The measuring process had filled it, the exporter had not, and the export of an H200
    tune refused every Liger winner as stale."""
    from kernel_space import _liger

    impl = get_impl("swiglu", "liger_swiglu")
    before = impl_version(impl)
    saved = dict(_liger._missing)
    try:
        _liger._missing[("ops.swiglu", "LigerSiLUMulFunction")] = None
        _liger._missing[("ops.rms_norm", "LigerRMSNormFunction")] = "liger_kernel.ops.rms_norm fails to import (ImportError)"
        assert impl_version(impl) == before
    finally:
        _liger._missing.clear()
        _liger._missing.update(saved)


_STABLE = """
from kernel_space import impls, ops
from kernel_space._version import impl_version
seen = {}
for op in ops():
    for impl in impls(op):
        v = impl_version(impl)
        assert v == impl.version == impl_version(impl), f"{op}/{impl.name}"
        assert v not in seen, f"{op}/{impl.name} shares a version with {seen.get(v)}"
        seen[v] = f"{op}/{impl.name}"
print(len(seen))
"""


def test_every_registered_version_is_distinct_and_stable():
    """In a process of its own: tests that patch a kernel module's helpers (to poison a workspace, say)
    would otherwise make a version cached meanwhile differ from one computed later."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _STABLE], capture_output=True, text=True, timeout=300,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 0, r.stderr[-2000:]
    assert int(r.stdout.strip()) > 40


def test_versions_reach_the_triton_kernels_they_launch():
    from kernel_space._version import reached

    names = {n for n, _ in reached(get_impl("gemm", "triton").fn, entry=True)}
    assert {"triton_gemm", "gemm", "_gemm_kernel", "_split_k_reduce"} <= names
    names = {n for n, _ in reached(get_impl("rms_norm", "triton_rms_norm").fn, entry=True)}
    assert {"launch", "norm_single", "norm_looped", "_single_tile", "_looped_tile", "row_offsets"} <= names
    # rms_norm's launch is layer_norm's: both implementations reach the same kernels but differ
    assert get_impl("rms_norm", "triton_rms_norm").version != get_impl("layer_norm", "triton_layer_norm").version


def test_the_op_packages_share_one_layout():
    import os

    root = os.path.dirname(kernel_space.__file__)
    for op in ops():
        if not get_op(op).problem.__module__.startswith("kernel_space."):
            continue  # a plugin's op (tests/plugins/*, imported by another test in this process)
        files = set(os.listdir(os.path.join(root, op)))
        assert {"__init__.py", "problem.py", "vendor.py", "triton.py", "_kernels.py"} <= files, op
        layout = {"__init__.py", "problem.py", "vendor.py", "triton.py", "_kernels.py", "cpu.py", "liger.py"}
        extra = {f for f in files if f.endswith(".py")} - layout
        assert not extra, f"{op} has files outside the layout: {extra}"
    assert any(i.backends == frozenset({"cpu"}) and not i.vendor for i in impls("gemm"))
