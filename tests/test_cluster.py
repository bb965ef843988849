"""Losing a Ray node mid-run: its trial is measured again on a surviving worker; nothing is lost or mis-recorded.

A real two-node cluster on 127.0.0.1 (a head and a second node, one CPU each, so one measuring actor lands on
each), the tuner in its own process joined to it, and the second node killed outright mid-run, as a machine
that drops off the network would be: its raylet and every process it started.  The nodes are told apart by
the process session each `ray start` began, so nothing else on the machine is touched (never `ray stop`).
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

import db
from conftest import ROOT, counted

pytestmark = pytest.mark.ray

RAY = str(Path(sys.executable).with_name("ray"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _processes() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, session id) of every process on the machine."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp session ...
        out[int(d)] = (int(fields[1]), int(fields[3]))
    return out


def _kill_session(sid: int) -> list[int]:
    """SIGKILL every process of a `ray start` session and everything they started, raylet first; the pids."""
    procs = _processes()
    pids = {p for p, (_, s) in procs.items() if s == sid}
    grew = True
    while grew:  # workers put themselves in their own process group: follow parents too
        more = {p for p, (pp, _) in procs.items() if pp in pids} - pids
        pids |= more
        grew = bool(more)

    def cmd(p: int) -> str:
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    for p in sorted(pids, key=lambda p: "raylet" not in cmd(p)):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return sorted(pids)


@dataclass
class Cluster:
    address: str
    env: dict
    root: str
    sessions: dict  # node name -> session id of its `ray start`

    def add_node(self, name: str, *args: str, cpus: int = 1) -> None:
        """`ray start` one more node in a session of its own; the first one added is the head."""
        cmd = [
            RAY, "start", *(args or ("--address", self.address)), "--node-ip-address", "127.0.0.1", "--num-cpus", str(cpus),
            "--num-gpus", "0", "--temp-dir", os.path.join(self.root, name), "--disable-usage-stats",
            "--dashboard-agent-listen-port", str(_free_port()),
        ]
        p = subprocess.Popen(cmd, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.sessions[name] = p.pid  # a new session: its id is the `ray start` pid, inherited by what it starts
        out, _ = p.communicate(timeout=120)
        if p.returncode != 0:
            pytest.fail(f"`{' '.join(cmd)}` failed:\n{out[-3000:]}")

    def kill_node(self, name: str) -> list[int]:
        return _kill_session(self.sessions.pop(name))


@pytest.fixture
def cluster(request):
    """A head and a second node on 127.0.0.1, one CPU each (the head: as many as an indirect parameter says);
    every process of it is killed afterwards."""
    root = tempfile.mkdtemp(prefix="oa-")  # short: Ray's socket paths live under the temp dir
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",  # explicit on every process: Ray's default depends on its version and ~/.ray
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
        "RAY_USAGE_STATS_ENABLED": "0",
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
    }
    env.pop("RAY_ADDRESS", None)
    port = _free_port()
    c = Cluster(f"127.0.0.1:{port}", env, root, {})
    try:
        c.add_node("head", "--head", "--port", str(port), "--include-dashboard", "false", "--dashboard-port", str(_free_port()),
                   cpus=getattr(request, "param", 1))
        c.add_node("node2")
        yield c
    finally:
        for name in list(c.sessions):
            c.kill_node(name)
        shutil.rmtree(root, ignore_errors=True)


def _count(url: str, model, **where) -> int:
    with Session(db.open_db(url)) as s:
        return s.scalar(select(func.count()).select_from(model).filter_by(**where))


def _start_tune(cluster: Cluster, tmp_path: Path, problems: list[dict], trials: int, workers: int, slow: bool = False):
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps({"gemm": problems}))
    args = ["--device", "cpu", "--ops", "gemm", "--shapes", str(shapes), "--trials", str(trials), "--workers", str(workers),
            "--ray-address", cluster.address, "--db", url]
    if slow:  # trials of ~0.5 s each, so the run is surely still going when a node is stopped
        args += ["--plugin", "plugins.slow", "--impls", "slow_matmul"]
    code = "import sys; from tuner.cli import tune_main as m; sys.exit(m(sys.argv[1:]))"
    with open(tmp_path / "tune.out", "w") as out, open(tmp_path / "tune.err", "w") as err:
        p = subprocess.Popen([sys.executable, "-c", code, *args], env=cluster.env, stdout=out, stderr=err, start_new_session=True)
    return p, url, lambda: (tmp_path / "tune.err").read_text()


def _wait_for_trials(p: subprocess.Popen, url: str, log, n: int) -> int:
    deadline = time.time() + 120
    stored = 0
    while time.time() < deadline and p.poll() is None:
        time.sleep(0.5)
        try:
            stored = _count(url, db.Trial)
        except Exception:  # the tuner has not created the tables yet
            continue
        if stored >= n:
            break
    assert stored >= n, f"{stored} trials stored within 2 minutes:\n{log()[-3000:]}"
    return stored


def _stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def _stop_node_mid_run(cluster: Cluster, p: subprocess.Popen, url: str, log, n: int, before=None) -> int:
    """Once `n` trials are stored (and after `before()`), stop node2 while the run goes on; wait for the run."""
    try:
        stored = _wait_for_trials(p, url, log, n)
        if before is not None:
            before()
        assert p.poll() is None, f"the run ended before the node could be stopped:\n{log()[-3000:]}"
        assert cluster.kill_node("node2")
        p.wait(timeout=240)
    finally:
        _stop(p)
    return stored


@pytest.mark.parametrize("spare", [False, True], ids=["no-room", "spare-node"])
def test_node_loss_mid_run_loses_and_misrecords_nothing(cluster, tmp_path, spare):
    """no-room: the lost worker is not replaced, the run ends on the head's worker alone;
    spare-node: a third node joins mid-run and the lost worker is started again there."""
    problems = [{"M": 64, "N": 64, "K": 64}, {"M": 96, "N": 64, "K": 128}]
    trials = 24
    p, url, log = _start_tune(cluster, tmp_path, problems, trials, workers=2, slow=True)
    # both workers are placed by the time trials are stored (one CPU per node): node3 is free for a replacement
    _stop_node_mid_run(cluster, p, url, log, 4, before=(lambda: cluster.add_node("node3")) if spare else None)
    text = log()
    assert p.returncode == 0, text[-4000:]
    # the loss happened mid-run, was told from a crash, and the lost job ran again
    expect = "replaced on node" if spare else "no node has room for another, going on with 1 worker(s)"
    assert "lost with its node" in text and expect in text and "job again" in text, text[-4000:]

    import optuna

    with Session(db.open_db(url)) as s:
        rows = s.scalars(select(db.Trial)).all()
        run = s.scalars(select(db.Run)).one()
        winners = s.scalar(select(func.count()).select_from(db.Winner))
    assert run.status == "finished"
    assert winners == len(problems)
    assert not [r for r in rows if r.status in ("crashed", "timeout")], [(r.impl, r.status, r.error) for r in rows]
    studies = {r.study for r in rows}
    assert len(studies) == len(problems)
    for name in studies:
        study = optuna.load_study(study_name=name, storage=url)
        assert sum(counted(t) for t in study.trials) == trials  # invalid ones are free
        assert all(t.state.is_finished() for t in study.trials), [t.state for t in study.trials]
        numbers = [r.optuna_number for r in rows if r.study == name and r.optuna_number is not None]
        assert len(numbers) == len(set(numbers))  # each Optuna trial recorded once, the lost attempt never


@pytest.mark.parametrize("cluster", [0], ids=["head-without-cpus"], indirect=True)
def test_losing_every_worker_node_ends_the_run_with_one_line(cluster, tmp_path):
    p, url, log = _start_tune(cluster, tmp_path, [{"M": 64, "N": 64, "K": 64}], 40, workers=1, slow=True)
    stored = _stop_node_mid_run(cluster, p, url, log, 2)
    text = log()
    assert p.returncode == 2, text[-4000:]
    assert "opsadv-tune: error: every measuring worker's node left the Ray cluster" in text and "Traceback" not in text, text[-4000:]
    with Session(db.open_db(url)) as s:
        rows = s.scalars(select(db.Trial)).all()
        run = s.scalars(select(db.Run)).one()
    assert run.status == "failed" and len(rows) >= stored  # what was measured stays
    assert not [r for r in rows if r.status in ("crashed", "timeout")], [(r.impl, r.status, r.error) for r in rows]
