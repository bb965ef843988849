from __future__ import annotations

import os

# Triton kernels run on the CPU through the interpreter when no GPU is present.  The
# variable is read when a kernel is decorated, so it must be set before kernel modules load.
try:
    import torch

    _has_cuda = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _has_cuda = False
if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The suite tests the dispatch paths converted models take whenever a table is loaded, with or without one:
# with nothing tuned they would otherwise run the original modules (tests/test_passthrough.py tests that).
os.environ.setdefault("OPS_ADV_PASSTHROUGH", "0")

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # tests/plugins is importable by the tuner and its workers


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for the whole session; the tuner reuses it instead of starting its own."""
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture
def sqlite_url(tmp_path):
    return f"sqlite:///{tmp_path / 'tuning.db'}"


def run_cli(*args: str, env: dict | None = None, timeout: float = 600, cwd=None):
    """Run a command line with the tests' interpreter; returns CompletedProcess."""
    import os
    import signal
    import subprocess

    path = [str(ROOT), str(ROOT / "tests"), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    e = {**os.environ, "PYTHONPATH": os.pathsep.join(path), **(env or {})}
    # SIGINT as a terminal user's process has it: a launcher's `cmd &` leaves it ignored, and a child inherits that
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=e, timeout=timeout, cwd=cwd,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


_ENTRY = {"opsadv-tune": "tune_main", "opsadv-export": "export_main", "opsadv-db": "db_main", "opsadv-report": "report_main"}


def cli(name: str, *args: str, env: dict | None = None, timeout: float = 600):
    """Run one of the project's command lines (as its console script would) in a subprocess."""
    code = f"import sys; from tuner.cli import {_ENTRY[name]} as m; sys.exit(m(sys.argv[1:]))"
    return run_cli("-c", code, *args, env=env, timeout=timeout)


def counted(trial) -> bool:
    """An Optuna trial that counts against --trials: neither invalid (pruned) nor a repeated proposal."""
    import optuna

    from tuner.driver import REPEAT

    return trial.state != optuna.trial.TrialState.PRUNED and not trial.user_attrs.get(REPEAT)
