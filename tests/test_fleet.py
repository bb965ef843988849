"""Several opsadv-tune processes on one database (SQLite, and PostgreSQL when OPS_ADV_TEST_PG_URL is set): leases,
nothing tuned twice, exact trial counts, one winner per problem, a killed run taken over and marked interrupted."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import optuna
import pytest
from sqlalchemy import MetaData, select
from sqlalchemy.orm import Session

import db
from conftest import ROOT, counted
from kernel_space import get_op, impls

pytestmark = pytest.mark.ray

SHAPES = [{"M": 64 + 16 * i, "N": 96, "K": 80, "dtype": "fp32"} for i in range(4)]
TRIALS = 4


def _spawn(url: str, shapes: str, trials: int = TRIALS, env: dict | None = None) -> subprocess.Popen:
    code = "import sys; from tuner.cli import tune_main as m; sys.exit(m(sys.argv[1:]))"
    e = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), **(env or {})}
    args = [sys.executable, "-c", code, "--device", "cpu", "--ops", "gemm", "--shapes", shapes, "--trials", str(trials),
            "--db", url, "--progress", "plain"]
    # own session: a kill takes the run's local Ray processes with it
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e, start_new_session=True)


def _wait(p: subprocess.Popen, timeout: float = 400) -> tuple[int, str, str]:
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"opsadv-tune did not finish in {timeout} s: {err[-2000:]}")
    return p.returncode, out, err


def _shapes(tmp_path) -> str:
    path = tmp_path / "shapes.json"
    path.write_text(json.dumps({"gemm": SHAPES}))
    return str(path)


def _expected(shape: dict) -> int:
    p = get_op("gemm").problem(shape["M"], shape["N"], shape["K"], shape["dtype"])
    valid = sum(i.why_not(p, c, "cpu") is None for i in impls("gemm", backend="cpu") if not i.vendor for c in i.configs())
    return min(TRIALS, valid)


def _check(url: str) -> dict:
    """Exact counts: per problem one winner, one study, trials from one run only, counted Optuna trials = the budget."""
    engine = db.open_db(url, migrate=False)
    storage = optuna.storages.RDBStorage(db.normalize(url))
    with Session(engine) as s:
        winners = s.scalars(select(db.Winner)).all()
        trials = s.scalars(select(db.Trial)).all()
        runs = {r.id: r for r in s.scalars(select(db.Run))}
        assert not s.scalars(select(db.models.Lease)).all()  # every lease released
    assert len(winners) == len(SHAPES) and len({w.problem_id for w in winners}) == len(SHAPES)
    by_study: dict[str, list] = {}
    for t in trials:
        by_study.setdefault(t.study, []).append(t)
    assert len(by_study) == len(SHAPES)
    for name, rows in by_study.items():
        assert sum(r.impl == "torch_matmul" for r in rows) == 1, name  # the vendor baseline measured once
        keys = [json.dumps([r.impl, sorted(r.params.items())]) for r in rows]
        assert len(keys) == len(set(keys)), name  # no configuration measured twice
        study = optuna.load_study(study_name=name, storage=storage)
        shape = json.loads(study.user_attrs["problem"] and json.dumps(study.user_attrs["problem"]))
        n = sum(counted(t) for t in study.get_trials(deepcopy=False))
        assert n == _expected(shape), (name, n)
        assert all(t.state != optuna.trial.TrialState.RUNNING for t in study.get_trials(deepcopy=False))
    storage.engine.dispose() if hasattr(storage, "engine") else None
    return {"runs": runs, "by_study": by_study}


def _fleet(url: str, tmp_path, n: int) -> dict:
    shapes = _shapes(tmp_path)
    procs = [_spawn(url, shapes) for _ in range(n)]
    results = [_wait(p) for p in procs]
    for rc, out, err in results:
        assert rc == 0 and "Traceback" not in err, err[-3000:]
    info = _check(url)
    assert len(info["runs"]) == n and all(r.status == "finished" for r in info["runs"].values())
    for rows in info["by_study"].values():
        assert len({r.run_id for r in rows}) == 1  # each problem tuned by one run only
    return info


def test_two_tuners_share_a_sqlite_database(tmp_path):
    _fleet(f"sqlite:///{tmp_path / 'fleet.db'}", tmp_path, 2)


PG_URL = os.environ.get("OPS_ADV_TEST_PG_URL")


@pytest.mark.postgres
@pytest.mark.skipif(not PG_URL, reason="no PostgreSQL: set OPS_ADV_TEST_PG_URL=postgresql://USER@HOST/DB to run these")
def test_two_tuners_on_a_fresh_postgres_database(tmp_path):
    engine = db.make_engine(PG_URL)
    md = MetaData()
    md.reflect(engine)
    md.drop_all(engine)  # fresh: both processes find no schema and would create it at once
    engine.dispose()
    _fleet(PG_URL, tmp_path, 2)


def test_a_killed_run_is_taken_over_and_marked_interrupted(tmp_path):
    url = f"sqlite:///{tmp_path / 'fleet.db'}"
    shapes = _shapes(tmp_path)
    first = _spawn(url, shapes)
    engine = None
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # until it holds leases and has measured a tuned configuration
        time.sleep(0.5)
        if first.poll() is not None:
            pytest.fail(f"the first run ended before it was killed: {first.communicate()[1][-2000:]}")
        if engine is None and os.path.exists(tmp_path / "fleet.db"):
            try:
                engine = db.open_db(url, migrate=False)
            except Exception:
                continue
        if engine is not None:
            try:
                with Session(engine) as s:
                    if s.scalars(select(db.Trial).where(db.Trial.impl != "torch_matmul", db.Trial.status == "ok")).first():
                        break
            except Exception:
                continue
    os.killpg(first.pid, signal.SIGKILL)  # the process and its Ray instance, as a lost machine
    first.communicate()
    with Session(engine) as s:
        assert s.scalars(select(db.Run)).one().status == "running"
        assert s.scalars(select(db.models.Lease)).all()
    engine.dispose()
    rc, out, err = _wait(_spawn(url, shapes))
    assert rc == 0 and "Traceback" not in err, err[-3000:]
    assert "marked 1 run(s) whose process is gone as interrupted" in err
    info = _check(url)
    statuses = sorted(r.status for r in info["runs"].values())
    assert statuses == ["finished", "interrupted"]


def test_resume_and_reap_touch_only_dead_runs(tmp_path):
    import socket
    from collections import deque

    from tuner import TuneOptions, Tuner
    from tuner.driver import RUN_ATTR, Task

    url = f"sqlite:///{tmp_path / 't.db'}"
    engine = db.open_db(url)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    now = db.models.utcnow()
    with Session(engine) as s:
        live = db.Run(device_class="cpu", command="x", sampler="tpe", host=socket.gethostname(), pid=os.getpid(), heartbeat_at=now)
        dead = db.Run(device_class="cpu", command="x", sampler="tpe", host=socket.gethostname(), pid=gone.pid, heartbeat_at=now)
        s.add_all([live, dead])
        s.commit()
        live_id, dead_id = live.id, dead.id
    study = optuna.create_study(study_name="s", storage=db.normalize(url))
    for rid in (live_id, dead_id):
        study.ask().set_user_attr(RUN_ATTR, rid)
    t = Tuner(TuneOptions(device="cpu", problems=[], db_url=url, log=lambda s: None))
    from tuner.leases import Leases

    t.engine, t.run_id = engine, -1
    t.leases = Leases(engine, "cpu", -1, t.log)
    task = Task("gemm", get_op("gemm").problem(32, 32, 32), "s", 1, study, [], deque(), deque(), budget=4)
    t._resume(task, [])
    states = {tr.user_attrs[RUN_ATTR]: tr.state for tr in study.get_trials(deepcopy=False)}
    assert states == {live_id: optuna.trial.TrialState.RUNNING, dead_id: optuna.trial.TrialState.FAIL}
    assert task.asked == 1
    t.leases.reap()
    with Session(engine) as s:
        assert s.get(db.Run, live_id).status == "running" and s.get(db.Run, dead_id).status == "interrupted"
