"""A production install: the runtime alone (no extras) in a fresh venv uses an exported table."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from ops_adv import _table

pytestmark = pytest.mark.slow


def test_runtime_without_extras_dispatches_exported_winners(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    # the same torch as here, so the install takes no large download; no extras: no ray, optuna, sqlalchemy
    cons = tmp_path / "constraints.txt"
    cons.write_text(f"torch=={torch.__version__.split('+')[0]}\n")
    r = subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "-c", str(cons), str(ROOT)],
        capture_output=True, text=True, timeout=1500, cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    import kernel_space

    params = {"block_m": 32, "block_n": 64, "block_k": 0}
    w = {"op": "gemm", "problem": {"M": 64, "N": 128, "K": 96, "dtype": "fp32", "trans_a": False, "trans_b": False},
         "impl": "cpu_blocked", "params": params, "kernel_version": kernel_space.get_impl("gemm", "cpu_blocked").version,
         "median_ms": 1.0, "vendor_impl": "torch_matmul", "vendor_ms": 2.0, "speedup": 2.0}
    table = tmp_path / "opsadv-table.json"
    table.write_text(json.dumps({"format": _table.FORMAT, "format_version": _table.FORMAT_VERSION, "device_class": "cpu",
                                 "fingerprint": {}, "winners": [w], "checksum": _table.checksum([w])}))
    code = (
        "import importlib.util as u, json, sys, torch, ops_adv; "
        "a, b = torch.randn(64, 96), torch.randn(96, 128); "
        "assert torch.allclose(ops_adv.gemm(a, b), a @ b, atol=1e-4); "
        "print(json.dumps({'explain': ops_adv.explain('gemm', a, b), "
        "'missing': [m for m in ('ray', 'optuna', 'sqlalchemy', 'alembic') if u.find_spec(m) is None], "
        "'file': ops_adv.__file__, "
        "'migrations': __import__('os').listdir(__import__('os').path.join(u.find_spec('db').submodule_search_locations[0], 'migrations', 'versions'))}))"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([str(py), "-c", code], capture_output=True, text=True, env={**env, "OPS_ADV_TABLE": str(table)}, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["explain"]["source"] == "tuned" and out["explain"]["params"] == params
    assert sorted(out["missing"]) == ["alembic", "optuna", "ray", "sqlalchemy"]
    assert str(venv) in out["file"]  # the installed copy, not this checkout
    assert "0001_initial_schema.py" in out["migrations"]  # an installed ops-adv can migrate without a checkout
