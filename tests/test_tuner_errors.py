"""Error states a new user hits, each one clear line and a correct run state (issue 22, item 5)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

import db
from conftest import ROOT
from tuner.cli import db_main, export_main, report_main, tune_main

PG_URL = os.environ.get("OPS_ADV_TEST_PG_URL")


def _one_line(capsys, rc: int) -> str:
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err.strip()


@pytest.mark.skipif(not PG_URL, reason="no PostgreSQL (OPS_ADV_TEST_PG_URL)")
@pytest.mark.postgres
def test_postgres_at_an_older_schema_names_the_database_and_hides_only_the_password(capsys):
    from sqlalchemy import MetaData
    from sqlalchemy.engine import make_url

    engine = db.make_engine(PG_URL)
    md = MetaData()
    md.reflect(engine)
    md.drop_all(engine)
    db.upgrade(engine, "0002")  # every existing fleet's database before this release
    engine.dispose()
    line = _one_line(capsys, report_main(["--device", "cpu", "--db", PG_URL]))
    u = make_url(PG_URL)
    assert f"@{u.host}{f':{u.port}' if u.port else ''}/" in line and "is at schema 0002" in line and "upgrade postgresql" in line, line
    assert "***://" not in line
    if u.password and u.password not in (u.username, u.database, u.host):
        assert u.password not in line


def test_a_libpq_key_value_string_is_refused_and_no_file_is_made(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    line = _one_line(capsys, tune_main(["--device", "cpu", "--ops", "gemm", "--db", "host=localhost dbname=x password=hunter2"]))
    assert "key=value" in line and "hunter2" not in line
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("main,args", [
    (report_main, ["--device", "cpu", "--db"]),
    (export_main, ["--device", "cpu", "--out", "dist", "--db"]),
    (db_main, ["current"]),
])
def test_read_only_commands_do_not_create_a_database(main, args, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    line = _one_line(capsys, main([*args, str(tmp_path / "tunnig.db")]))
    assert "no database at" in line and "tunnig.db" in line
    assert not (tmp_path / "tunnig.db").exists() and not (tmp_path / "dist").exists()


def test_db_upgrade_with_a_placeholder_makes_no_file(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    line = _one_line(capsys, db_main(["upgrade", "URL"]))  # README's `opsadv-db upgrade URL`, pasted as written
    assert "'URL' is neither a URL nor a path" in line
    assert os.listdir(tmp_path) == []
    assert db_main(["upgrade", "./tuning.db"]) == 0 and (tmp_path / "tuning.db").exists()  # a path is still a path


def test_cpu_on_a_cluster_without_workers_is_one_worker():
    from tuner.devices import check_device

    assert check_device("cpu", True).count() == 1  # was: "the Ray cluster has no None GPU"


@pytest.mark.ray
def test_sigterm_is_handled_like_ctrl_c(tmp_path):
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    shapes = tmp_path / "s.json"
    shapes.write_text(json.dumps({"gemm": [{"M": 64, "N": 64, "K": 64}]}))
    code = "import sys; from tuner.cli import tune_main as m; sys.exit(m(sys.argv[1:]))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    p = subprocess.Popen([sys.executable, "-c", code, "--device", "cpu", "--ops", "gemm", "--shapes", str(shapes), "--trials", "30",
                          "--db", url, "--plugin", "plugins.slow", "--impls", "slow_matmul", "--progress", "plain"],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            time.sleep(0.5)
            try:
                with Session(db.make_engine(url, must_exist=True)) as s:
                    if s.scalar(select(func.count()).select_from(db.Trial)) >= 2:
                        break
            except Exception:
                continue
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 130, err[-3000:]
    assert "re-run the same command to resume" in err and "Traceback" not in err and "SIGTERM" not in err, err[-3000:]
    with Session(db.make_engine(url)) as s:
        assert [r.status for r in s.scalars(select(db.Run))] == ["interrupted"]


@pytest.mark.parametrize("pw", ["s3cretPW", "a@s3cretPW", "s3cretPW%40x", "s3cretPW/x"])
def test_redact_hides_only_the_password_of_a_url_inside_prose(pw):
    from ops_adv._table import redact

    for url, shown in ((f"postgresql://me:{pw}@db.example:5432/tune", "postgresql://me:***@db.example:5432/tune"),
                       (f"postgresql://me:{pw}@[::1]/tune", "postgresql://me:***@[::1]/tune")):
        text = f"database {url} is at an older schema (0002); run: opsadv-db upgrade {url}"
        assert redact(text) == f"database {shown} is at an older schema (0002); run: opsadv-db upgrade {shown}"
        assert redact(redact(text)) == redact(text)  # a command line redacts the message again
    again = "database postgresql://me:***@h/d is at schema ab:cd@x; run opsadv-db upgrade"
    assert redact(again) == again
    # a single URL whose password holds a space is still hidden whole
    assert "s3cretPW" not in redact("postgresql://me:a s3cretPW@h/d") and "s3cretPW" not in redact("p g://me:a s3cretPW@h/d")
    assert "s3cretPW" not in redact("postgresql://me@h/d?sslmode=disable&password=a s3cretPW&x=1")


_FILL_DISK = """
import os, resource, signal, sys
import tuner.leases as leases
_start = leases.Leases.start
def start(self):  # once the run is recorded, no database file may grow past its size now (Ray's own files are spared)
    _start(self)
    db = os.environ["FULL_DB"]
    size = max([os.path.getsize(f) for f in (db, db + "-wal") if os.path.exists(f)] + [1 << 16]) + 4096
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG, as on a full disk
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
leases.Leases.start = start
from tuner.cli import tune_main
sys.exit(tune_main(sys.argv[1:]))
"""


@pytest.mark.ray
def test_a_full_disk_is_one_line_and_the_run_is_marked_failed(tmp_path):
    path = tmp_path / "db.sqlite"
    shapes = tmp_path / "s.json"
    shapes.write_text(json.dumps({"gemm": [{"M": 64, "N": 64, "K": 64}, {"M": 32, "N": 32, "K": 32}]}))
    env = {**os.environ, "FULL_DB": str(path), "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    p = subprocess.run([sys.executable, "-c", _FILL_DISK, "--device", "cpu", "--ops", "gemm", "--shapes", str(shapes),
                        "--trials", "4", "--db", f"sqlite:///{path}", "--impls", "torch_matmul", "--progress", "plain"],
                       env=env, capture_output=True, text=True, timeout=300)
    err = p.stderr
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert p.returncode == 2 and "Traceback" not in err and len(errors) == 1, err[-3000:]
    line = errors[0]
    assert line.startswith("opsadv-tune: error: writing to the database sqlite:///") and str(path) in line, line
    assert "disk is full" in line and "re-run the same command to resume" in line and "run 1 is marked failed" in line, line
    with Session(db.make_engine(f"sqlite:///{path}", must_exist=True)) as s:
        assert [r.status for r in s.scalars(select(db.Run))] == ["failed"]


def _live_descendants(root: int) -> dict[int, str]:
    """pid -> command of every live (not zombie) process below `root`."""
    kids: dict[int, list[int]] = {}
    state: dict[int, tuple[str, str]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    head, rest = f.read().rsplit(")", 1)
            except OSError:
                continue
            fields = rest.split()
            kids.setdefault(int(fields[1]), []).append(int(name))
            state[int(name)] = (fields[0], head.split("(", 1)[1])
    out, todo = {}, [root]
    while todo:
        for c in kids.get(todo.pop(), ()):
            todo.append(c)
            if state[c][0] not in "ZX":
                try:
                    with open(f"/proc/{c}/cmdline", "rb") as f:
                        out[c] = f.read().replace(b"\0", b" ").decode(errors="replace")[:200] or state[c][1]
                except OSError:
                    continue
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


@pytest.mark.ray
def test_a_killed_tuner_leaves_no_ray_process_behind(tmp_path):
    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    shapes = tmp_path / "s.json"
    shapes.write_text(json.dumps({"gemm": [{"M": 64, "N": 64, "K": 64}]}))
    code = "import sys; from tuner.cli import tune_main as m; sys.exit(m(sys.argv[1:]))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    p = subprocess.Popen([sys.executable, "-c", code, "--device", "cpu", "--ops", "gemm", "--shapes", str(shapes), "--trials", "30",
                          "--db", url, "--plugin", "plugins.slow", "--impls", "slow_matmul", "--progress", "plain"],
                         env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    ray_pids: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and p.poll() is None:  # the measuring actor runs: every agent has started
            time.sleep(0.5)
            ray_pids.update(_live_descendants(p.pid))
            if any("Measurer" in c for c in ray_pids.values()) and any("Agent" in c for c in ray_pids.values()):
                break
        assert any("raylet" in c for c in ray_pids.values()), ray_pids
        os.kill(p.pid, signal.SIGKILL)  # the tuner alone, as an OOM killer or a user would
        p.wait(30)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(q) for q in ray_pids):
            time.sleep(0.2)
        left = {q: c for q, c in ray_pids.items() if _alive(q)}
        assert not left, left
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        for q in ray_pids:  # this test's own processes only
            try:
                if _alive(q):
                    os.kill(q, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_fresh_workers_first_timing_is_warmed_up_by_time():
    """A kernel slow for its first 150 ms (a cold process: thread pools, page faults, neighbours starting) is timed at
    its settled speed in a fresh worker's first measurement, not at its cold one."""
    import kernel_space
    import torch

    from workers.measure import OK, WARM_S, Bench

    start: list[float] = []

    @kernel_space.register_impl("gemm", name="cold_start_matmul", priority=-1)
    def cold_start_matmul(a, b):
        start.append(start[0] if start else time.perf_counter())
        if time.perf_counter() - start[0] < 0.15:
            time.sleep(0.005)
        return torch.matmul(a, b)

    try:
        problem = {"M": 32, "N": 32, "K": 32, "dtype": "fp32", "trans_a": False, "trans_b": False}
        res = Bench("cpu", warm_s=WARM_S).run({"op": "gemm", "problem": problem, "impl": "cold_start_matmul", "params": {}}, budget_s=0.1)
        assert res["status"] == OK and res["median_ms"] < 2.0, res
    finally:
        kernel_space.unregister_impl("gemm", "cold_start_matmul")
