"""Every Triton kernel of every op builds for sm_90, without a GPU.

TRITON_INTERPRET=1 accepts code the real compiler rejects (tl.dot under 16 rows, dtype mismatches,
non-constexpr shapes, bad TMA descriptors). tests/_sm90_build.py, run in one subprocess without the
interpreter, calls each Triton implementation's wrapper through the registry on meta tensors
(default and H200 problems; default parameters and seeded random valid ones), records each
`kernel[grid](...)` through Triton's own argument binder for a CUDA target instead of launching,
and compiles each distinct specialisation for sm_90. Registers and spill (stack) bytes are printed
with -s, not asserted: the checks' register estimates are calibrated elsewhere.

SM90_MAX_BUILDS (default 8 distinct kernels an implementation, about 100 s here) sets the depth.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kernel_space as ks

ROOT = Path(__file__).resolve().parents[1]
HELPER = ROOT / "tests" / "_sm90_build.py"
MAX_BUILDS = int(os.environ.get("SM90_MAX_BUILDS", "8"))
# Our Triton implementations, as tests/_sm90_build.py selects them (CUDA, requires triton, not a vendor library).
IMPLS = [f"{op}/{i.name}" for op in ks.ops() for i in ks.impls(op)
         if "cuda" in i.backends and "triton" in i.requires and not i.vendor]
# "op/impl" -> text of a known sm_90 build error: xfail while it fails with that text, fail once it builds.
KNOWN_FAILURES: dict[str, str] = {}


def _helper(*args: str):
    """tests/_sm90_build.py's JSON, run without the interpreter; skips where triton cannot build for CUDA."""
    triton = pytest.importorskip("triton")
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    missing = [t for t in ("ptxas", "cuobjdump") if not (bin_dir / t).exists()]
    if missing:
        pytest.skip(f"triton's NVIDIA backend lacks {', '.join(missing)} in {bin_dir}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(HELPER), *args], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=900)
    assert r.returncode == 0, f"{HELPER.name} {' '.join(args)} failed:\n{r.stderr[-4000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def report():
    return _helper("--max-builds", str(MAX_BUILDS))


def test_harness_catches_what_the_interpreter_accepts():
    """Triton's binder gives the signature (a multiple of 16 stays i32, tagged divisible), and a kernel with
    a runtime tl.arange bound, which the interpreter runs, fails to build."""
    good, bad = _helper("--selftest")
    assert good["signature"] == {"X": "*fp32", "Y": "*fp32", "n": "i32", "BLOCK": "constexpr"}
    assert good["ok"] and good["stack"] == 0, good
    assert not bad["ok"] and "arange's arguments must be of type tl.constexpr" in bad["error"], bad


def _describe(b: dict) -> str:
    res = f"regs {b.get('regs')}, stack {b.get('stack')} B" if b["ok"] else b["error"]
    return (f"  {b['kernel']} warps={b['num_warps']} stages={b['num_stages']} {b['constexprs']}\n"
            f"    for {b['problem']} {b['params']}: {res}")


@pytest.mark.parametrize("name", IMPLS)
def test_builds_for_sm90(report, name):
    entry = report[name]
    lines = [f"{name}: {entry['cases']} wrapper calls, {len(entry['builds'])} kernels built"
             f" ({entry['skipped_builds']} more distinct ones not built)"]
    lines += [_describe(b) for b in entry["builds"]]
    print("\n".join(lines))
    wrapper = [f"  {w['problem']} {w['params']}: {w['error']}\n{w.get('where', '')}" for w in entry["wrapper_failures"]]
    assert not wrapper, f"{name}: the wrapper failed before launching:\n" + "\n".join(wrapper)
    assert entry["builds"], f"{name}: no configuration of its space reached a kernel launch"
    failed = [_describe(b) for b in entry["builds"] if not b["ok"]]
    if name in KNOWN_FAILURES:
        assert failed, f"{name} builds now: remove it from KNOWN_FAILURES"
        if all(KNOWN_FAILURES[name] in f for f in failed):
            pytest.xfail(KNOWN_FAILURES[name])
    assert not failed, f"{name}: kernels that do not build for sm_90:\n" + "\n".join(failed)


def test_every_triton_impl_is_covered(report):
    """The table (with -s), and every Triton implementation of every op was called and built."""
    rows = [("op", "impl", "configs", "kernels built", "failures", "max regs", "max spill B")]
    for name, e in report.items():
        b = e["builds"]
        rows.append((*name.split("/"), str(e["cases"]), str(sum(x["ok"] for x in b)),
                     str(len(e["wrapper_failures"]) + sum(not x["ok"] for x in b)),
                     str(max((x.get("regs") or 0 for x in b), default=0)),
                     str(max((x.get("stack") or 0 for x in b), default=0))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print("\n" + "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows))
    assert sorted(report) == sorted(IMPLS)
    assert all(report[n]["cases"] > 0 for n in IMPLS), [n for n in IMPLS if not report[n]["cases"]]
