"""A tuner paused past its lease (Ctrl-Z, SIGSTOP, a paused VM) and taken over by another stops writing that problem,
says so in one line, and goes on with the rest (issue 22, item 3)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

import db
from conftest import ROOT

pytestmark = pytest.mark.ray

LEASE_S = 3


def _spawn(url: str, shapes: str) -> subprocess.Popen:
    code = "import sys; from tuner.cli import tune_main as m; sys.exit(m(sys.argv[1:]))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), "OPS_ADV_LEASE_S": str(LEASE_S)}
    args = [sys.executable, "-c", code, "--device", "cpu", "--ops", "gemm", "--shapes", shapes, "--trials", "5", "--db", url,
            "--progress", "plain", "--plugin", "plugins.slow", "--impls", "slow_matmul", "--measure-budget", "0.2"]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)


def _until(what, timeout: float = 120.0, every: float = 0.2):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = what()
        if got:
            return got
        time.sleep(every)
    pytest.fail(f"timed out waiting for {what.__doc__}")


def _finish(p: subprocess.Popen, timeout: float = 400) -> tuple[int, str]:
    try:
        _, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        _, err = p.communicate()
        pytest.fail(f"opsadv-tune did not finish: {err[-2000:]}")
    return p.returncode, err


def test_a_tuner_paused_past_its_lease_leaves_the_problem_to_the_one_that_took_it(tmp_path):
    url = f"sqlite:///{tmp_path / 'fleet.db'}"
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps({"gemm": [{"M": 32, "N": 48, "K": 40, "dtype": "fp32"},
                                           {"M": 48, "N": 48, "K": 40, "dtype": "fp32"}]}))
    a = _spawn(url, str(shapes))
    try:
        def a_measures():
            """tuner A to store a trial of slow_matmul"""
            if not os.path.exists(tmp_path / "fleet.db"):
                return False
            try:
                with Session(db.make_engine(url)) as s:
                    return s.scalars(select(db.Trial).where(db.Trial.impl == "slow_matmul")).first() is not None
            except Exception:
                return False

        _until(a_measures)
        os.kill(a.pid, signal.SIGSTOP)  # the driver only: its Ray worker finishes the trial in flight meanwhile
        time.sleep(LEASE_S + 1.5)
        b = _spawn(url, str(shapes))
        engine = db.make_engine(url)

        def b_took_over():
            """tuner B to hold a lease A held (A's run marked interrupted is not enough: A's heartbeat may
            renew a lease B has not claimed yet, and then A rightly keeps that problem)"""
            from db.models import Lease

            with Session(engine) as s:
                runs = s.scalars(select(db.Run).order_by(db.Run.id)).all()
                if len(runs) != 2 or runs[0].status != "interrupted":
                    return False
                return s.scalars(select(Lease).where(Lease.run_id == runs[1].id)).first() is not None

        try:  # B starts a Ray of its own: under a loaded CI run (a third Ray, the session's, beside) that took over 120 s once
            _until(b_took_over, timeout=300)
        except pytest.fail.Exception as e:
            os.killpg(b.pid, signal.SIGKILL)
            pytest.fail(f"{e}\ntuner B's stderr:\n{b.communicate()[1][-3000:]}")
        os.kill(a.pid, signal.SIGCONT)
        rc_b, err_b = _finish(b)
        rc_a, err_a = _finish(a)
    finally:
        for p in (a,):
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
    assert rc_b == 0 and "Traceback" not in err_b, err_b[-3000:]
    assert "UpdateFinishedTrialError" not in err_a and "Traceback" not in err_a, err_a[-3000:]
    lost = [line for line in err_a.splitlines() if "its lease passed to another tuner" in line]
    assert lost and all(len(line) < 300 for line in lost), err_a[-3000:]
    assert rc_a == 0, err_a[-3000:]
    with Session(db.make_engine(url)) as s:
        runs = s.scalars(select(db.Run).order_by(db.Run.id)).all()
        trials = s.scalars(select(db.Trial)).all()
        assert [r.status for r in runs][1] == "finished"
        assert len({w.problem_id for w in s.scalars(select(db.Winner))}) == 2
    keys = [(t.study, json.dumps([t.impl, sorted(t.params.items())])) for t in trials]
    assert len(keys) == len(set(keys))  # no configuration written twice, by either tuner
