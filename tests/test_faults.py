"""Every fault class a kernel can cause is a recorded trial, and the run goes on."""
from __future__ import annotations

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

import db
import kernel_space
from kernel_space import get_op
from tuner import TuneOptions, Tuner

pytestmark = pytest.mark.ray


@pytest.fixture
def faulty():
    import importlib

    import plugins.faulty as mod

    importlib.reload(mod)  # registers them again when an earlier test removed them
    yield mod
    for name in mod.FAULTY:
        kernel_space.unregister_impl("gemm", name)


def test_wrong_exception_hang_and_crash_are_recorded(ray_session, sqlite_url, faulty):
    problem = get_op("gemm").problem(48, 48, 48)
    opts = TuneOptions(
        device="cpu", problems=[("gemm", problem)], db_url=sqlite_url, sampler="grid", trial_timeout_s=8,
        plugins=["plugins.faulty"], log=lambda s: None,
    )
    rows = Tuner(opts).run()
    assert len(rows) == 1 and rows[0]["impl"] not in faulty.FAULTY
    with Session(db.open_db(sqlite_url)) as s:
        trials = s.scalars(select(db.Trial)).all()
        run = s.scalars(select(db.Run)).one()
    by_impl: dict[str, list] = {}
    for t in trials:
        by_impl.setdefault(t.impl, []).append(t)
    expect = {"fault_wrong": "wrong_result", "fault_raise": "runtime_error", "fault_hang": "timeout", "fault_crash": "crashed"}
    for impl, status in expect.items():
        got = by_impl[impl]
        assert len(got) == 1, f"{impl} measured {len(got)} times"  # a crash is not retried
        assert got[0].status == status and got[0].error, (impl, got[0].status, got[0].error)
    assert "relative error" in by_impl["fault_wrong"][0].error
    assert "deliberate failure" in by_impl["fault_raise"][0].error
    # the good configurations after the faults were still measured, every one of them
    blocked = kernel_space.get_impl("gemm", "cpu_blocked")
    valid = sum(blocked.why_not(problem, c, "cpu") is None for c in blocked.configs())
    assert sum(t.status == "ok" for t in by_impl["cpu_blocked"]) == valid >= 4
    assert run.status == "finished"


def test_trial_classification():
    from workers.measure import classify

    assert classify(RuntimeError("CUDA error: an illegal memory access was encountered")) == ("runtime_error", True)
    assert classify(type("OutOfResources", (Exception,), {})("out of resource: shared memory")) == ("out_of_resources", False)
    assert classify(type("CompilationError", (Exception,), {})("bad")) == ("compile_error", False)
    assert classify(ValueError("x")) == ("runtime_error", False)


def test_compile_processes_leave_with_their_worker(tmp_path):
    # A timed-out worker is killed; its compile processes must not live on (each would hold a
    # CUDA context on a GPU). Here one is busy in a hanging 'compile' when its parent dies.
    import os
    import subprocess
    import sys
    import time

    script = tmp_path / "parent.py"
    script.write_text(
        "import os, sys, time\n"
        "from workers.compile_ahead import CompileAhead\n"
        "if __name__ == '__main__':\n"
        "    ca = CompileAhead('cpu', 1, sys.path, ['plugins.faulty'])\n"
        "    ca.submit({'op': 'gemm', 'problem': {'M': 8, 'N': 8, 'K': 8, 'dtype': 'fp32'}, 'impl': 'fault_hang', 'params': {'n': 1}})\n"
        "    time.sleep(8)\n"
        "    f = next(iter(ca.futures.values()))\n"
        "    assert f.running() and not f.done(), f\n"
        "    print(*[p.pid for p in ca.pool._processes.values()], flush=True)\n"
        "    os._exit(0)\n"
    )
    here = os.path.dirname(__file__)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(here), here])}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    pids = [int(p) for p in out.stdout.split()]
    assert pids, out.stderr

    def alive(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().split()[2] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 30
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in pids), "a compile process outlived its parent"
