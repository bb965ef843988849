"""The tuning database and exports hold up (issue 32): a database deleted or restarted under a tune, export write
errors, racing exports, deep JSON, odd SQLite paths, and the smaller edges of the command lines and the runtime."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from sqlalchemy.orm import Session

import db
import kernel_space
import ops_adv
from conftest import ROOT, cli, run_cli
from ops_adv import _table

PROB = {"K": 96, "M": 64, "N": 128, "dtype": "fp32", "trans_a": False, "trans_b": False}
PARAMS = {"block_m": 32, "block_n": 64, "block_k": 0}


def _fill(url: str, n: int = 1, start: int = 0) -> str:
    """`url`'s database with `n` more cpu gemm winners (problems M = 64 + start ...)."""
    version = kernel_space.get_impl("gemm", "cpu_blocked").version
    with Session(db.open_db(url)) as s:
        for i in range(start, start + n):
            p = db.Problem(op="gemm", key=json.dumps({**PROB, "M": 64 + i}, sort_keys=True))
            s.add(p)
            s.flush()
            s.add(db.Winner(device_class="cpu", problem_id=p.id, study=f"s{i}", impl="cpu_blocked", params=PARAMS,
                            kernel_version=version, median_ms=1.0, spread_ms=0.01, vendor_impl="torch_matmul",
                            vendor_ms=2.0, speedup=2.0, trials=4))
        s.commit()
    return url


@pytest.fixture
def tuned_db(tmp_path):
    return _fill(f"sqlite:///{tmp_path / 'tuning.db'}")


@pytest.fixture
def restore_table():
    yield
    ops_adv.load_table("")


def _one_error_line(p, rc: int = 2) -> str:
    err = p.stderr.strip()
    assert p.returncode == rc and len(err.splitlines()) == 1 and "Traceback" not in err, (p.returncode, err[-3000:])
    return err


def _leftovers(folder: Path) -> list[str]:
    return sorted(f.name for f in folder.iterdir() if f.name.endswith(".tmp"))


# ------------------------------------------------------------------------------------------ export write errors

@contextlib.contextmanager
def _read_only(path: Path):
    """`path` refuses writes for the block: immutable (chattr +i) as root, whom modes do not stop; else mode 0555."""
    if os.geteuid() == 0:
        if not shutil.which("chattr") or subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode:
            pytest.skip("root, and chattr +i does not work here: nothing can make a folder refuse root's writes")
        try:
            yield
        finally:
            subprocess.run(["chattr", "-i", str(path)], check=True)
    else:
        mode = path.stat().st_mode
        path.chmod(0o555 if path.is_dir() else 0o444)
        try:
            yield
        finally:
            path.chmod(mode)


@pytest.mark.parametrize("what", ["folder", "table"])
def test_export_into_a_read_only_folder_or_onto_an_immutable_table_is_one_line(tmp_path, tuned_db, what):
    out = tmp_path / "dist"
    assert cli("opsadv-export", "--device", "cpu", "--out", str(out), "--db", tuned_db).returncode == 0
    table = out / "opsadv-table.json"
    before = table.read_bytes()
    _fill(tuned_db, 1, start=1)  # a second winner: the new table would differ from the old
    with _read_only(out if what == "folder" else table):
        p = cli("opsadv-export", "--device", "cpu", "--out", str(out), "--db", tuned_db)
        err = _one_error_line(p)
        assert err.startswith(f"opsadv-export: error: cannot write {table}") and "unchanged" in err, err
        assert _leftovers(out) == []
    assert table.read_bytes() == before  # the old table is intact
    assert _table.read_file(str(table)).winners


_FULL_DISK = """
import os, resource, signal, sys
import tuner.export as export
_rows = export._rows
def rows(*a):  # once the winners are read, no file may grow past 100 bytes, as on a full disk
    out = _rows(*a)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
    resource.setrlimit(resource.RLIMIT_FSIZE, (100, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    return out
export._rows = rows
from tuner.cli import export_main
sys.exit(export_main(sys.argv[1:]))
"""


def test_export_on_a_full_disk_is_one_line_and_leaves_no_temporary_file(tmp_path, tuned_db):
    out = tmp_path / "dist"
    assert cli("opsadv-export", "--device", "cpu", "--out", str(out), "--db", tuned_db).returncode == 0
    before = (out / "opsadv-table.json").read_bytes()
    p = run_cli("-c", _FULL_DISK, "--device", "cpu", "--out", str(out), "--db", tuned_db)
    err = _one_error_line(p)
    assert "cannot write" in err and "File too large" in err and "free space" in err, err
    assert _leftovers(out) == [] and sorted(f.name for f in out.iterdir()) == ["Dockerfile.opsadv", "opsadv-table.json"]
    assert (out / "opsadv-table.json").read_bytes() == before


_INTERRUPT_WRITING = """
import os, signal, sys
_chmod = os.chmod
def chmod(*a, **k):  # Ctrl-C (or SIGTERM) once the table's temporary file is written
    _chmod(*a, **k)
    os.kill(os.getpid(), getattr(signal, os.environ["SIGNAL"]))
os.chmod = chmod
from tuner.cli import export_main
sys.exit(export_main(sys.argv[1:]))
"""

_INTERRUPT_IMPORTING = """
import importlib.abc, os, signal, sys
class CtrlC(importlib.abc.MetaPathFinder):  # Ctrl-C while torch loads (the slowest import of the command line)
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None
sys.meta_path.insert(0, CtrlC())
from tuner.cli import export_main
sys.exit(export_main(sys.argv[1:]))
"""


@pytest.mark.parametrize("when", ["writing", "importing", "terminated while writing"])
def test_ctrl_c_during_export_is_one_line_without_the_tuners_resume_message(tmp_path, tuned_db, when):
    out = tmp_path / "dist"
    p = run_cli("-c", _INTERRUPT_IMPORTING if when == "importing" else _INTERRUPT_WRITING,
                "--device", "cpu", "--out", str(out), "--db", tuned_db,
                env={"SIGNAL": "SIGTERM" if when.startswith("terminated") else "SIGINT"})
    err = _one_error_line(p, 130)
    assert err.startswith("opsadv-export: interrupted") and "resume" not in err and "trials" not in err, err
    assert not out.exists() or _leftovers(out) == []


def test_an_export_with_its_wheel_publishes_the_wheel_whole(tmp_path, tuned_db):
    out = tmp_path / "dist"
    out.mkdir()
    (out / "ops_adv-0.0.1-py3-none-any.whl").write_text("an old wheel")
    p = cli("opsadv-export", "--device", "cpu", "--out", str(out), "--db", tuned_db, "--wheel")
    assert p.returncode == 0, p.stderr
    wheels = sorted(out.glob("*.whl"))
    assert len(wheels) == 1 and wheels[0].name in (out / "Dockerfile.opsadv").read_text() and _leftovers(out) == []
    import zipfile

    assert zipfile.ZipFile(wheels[0]).testzip() is None


# ------------------------------------------------------------------------------------------ two exports, one folder

def test_two_exports_into_one_folder_never_share_a_temporary_file(tmp_path, monkeypatch):
    from tuner import export as export_module

    url = _fill(f"sqlite:///{tmp_path / 'tuning.db'}", 400)
    out = tmp_path / "dist"
    out.mkdir()
    real_replace, temps, errors = os.replace, [], []
    lock = threading.Lock()

    def replace(src, dst):  # the real rename, with its source noted
        with lock:
            temps.append(Path(src))
        return real_replace(src, dst)

    monkeypatch.setattr(export_module.os, "replace", replace)
    barrier = threading.Barrier(2)

    def one():
        try:
            for _ in range(6):
                barrier.wait()
                export_module.export("cpu", str(out), url)
        except BaseException as e:  # noqa: BLE001  (reported below)
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    tables = [t for t in temps if "opsadv-table" in t.name]
    assert len(tables) == 12 and len(set(tables)) == 12, tables  # each export its own temporary file ...
    assert all(t.parent == out for t in tables)  # ... in the folder it publishes to (one rename, same file system)
    assert _leftovers(out) == []
    assert len(_table.read_file(str(out / "opsadv-table.json")).winners) == 400


# ------------------------------------------------------------------------------------------ deep JSON

def _deep_table(path: Path, depth: int) -> Path:
    deep: object = 0
    for _ in range(depth):
        deep = [deep]
    winners = [{"op": "gemm", "problem": PROB, "impl": "torch_matmul", "params": {}, "note": deep}]
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, depth + 2000))
    try:
        data = {"format": _table.FORMAT, "format_version": _table.FORMAT_VERSION, "device_class": "cpu", "fingerprint": {},
                "winners": winners, "checksum": _table.checksum(winners)}
        path.write_text(json.dumps(data))
    finally:
        sys.setrecursionlimit(limit)
    return path


def _nested(depth: int, fn):
    """fn() called from `depth` frames down the stack (the runtime's first op may run deep in a model)."""
    return fn() if depth <= 0 else _nested(depth - 1, fn)


@pytest.mark.parametrize("depth", [40, 985, 5000])
def test_deep_json_is_one_table_error_for_the_runtime_check_and_sign(tmp_path, monkeypatch, restore_table, depth):
    path = _deep_table(tmp_path / "t.json", depth)
    lines = set()
    for key in (None, "k1"):
        env = {"OPS_ADV_TABLE_KEY": key} if key else {}
        if key:
            monkeypatch.setenv("OPS_ADV_TABLE_KEY", key)
        else:
            monkeypatch.delenv("OPS_ADV_TABLE_KEY", raising=False)
        for stack in (0, 800):  # the same answer however deep the caller's stack is
            with pytest.raises(_table.TableError) as e:
                _nested(stack, lambda: ops_adv.load_table(str(path)))
            lines.add(str(e.value))
        p = run_cli("-m", "ops_adv", "check", str(path), env={k: v for k, v in env.items()})
        lines.add(_one_error_line(p).removeprefix("ops_adv: error: "))
    p = run_cli("-m", "ops_adv", "sign", str(path), env={"OPS_ADV_TABLE_KEY": "k1"})
    lines.add(_one_error_line(p).removeprefix("ops_adv: error: "))
    assert lines == {f"tuned table {path} nests JSON more than {_table.MAX_DEPTH} levels deep, which no exported table "
                     f"does; export it again with opsadv-export"}, lines
    first_op = "import torch, ops_adv; ops_adv.gemm(torch.ones(64, 96), torch.ones(96, 128))"
    for key in ("", "k1"):  # a fresh process's first op, with and without a key
        p = run_cli("-c", first_op, env={"OPS_ADV_TABLE": str(path), "OPS_ADV_TABLE_KEY": key})
        assert p.returncode == 1 and p.stderr.strip().splitlines()[-1] == f"ops_adv._table.TableError: {lines.pop()}", p.stderr[-2000:]
        lines.add(p.stderr.strip().splitlines()[-1].removeprefix("ops_adv._table.TableError: "))


def test_a_table_as_deep_as_an_export_still_loads(tmp_path, tuned_db, restore_table):
    out = tmp_path / "dist"
    assert cli("opsadv-export", "--device", "cpu", "--out", str(out), "--db", tuned_db).returncode == 0
    assert ops_adv.load_table(str(out / "opsadv-table.json"))["cpu"]["gemm"]


# ------------------------------------------------------------------------------------------ SQLite paths with # % ?

@pytest.mark.parametrize("name", ["a#b.db", "a%41.db", "x?q.db", "p%3Fq#r%.db"])
def test_sqlite_paths_with_url_characters_open_exactly_that_file(tmp_path, monkeypatch, restore_table, name):
    folder = tmp_path / "d"
    folder.mkdir()
    path = folder / name
    p = cli("opsadv-db", "upgrade", str(path))
    assert p.returncode == 0, p.stderr
    assert sorted(f.name for f in folder.iterdir() if not f.name.endswith(("-wal", "-shm"))) == sorted([name, f"{name}.lock"] if
           (folder / f"{name}.lock").exists() else [name])
    _fill(db.normalize(str(path)))  # the URL the tuner makes of the path opens that file again
    with sqlite3.connect(path) as con:
        assert con.execute("select count(*) from opsadv_winners").fetchone() == (1,)
    p = cli("opsadv-export", "--device", "cpu", "--out", str(tmp_path / "out"), "--db", str(path))
    assert p.returncode == 0, p.stderr
    # the runtime reads the same file, given as OPS_ADV_DB or as a path in OPS_ADV_TABLE
    for var in ("OPS_ADV_DB", "OPS_ADV_TABLE"):
        monkeypatch.delenv("OPS_ADV_TABLE", raising=False)
        monkeypatch.delenv("OPS_ADV_TABLE_KEY", raising=False)
        monkeypatch.setenv(var, str(path))
        assert ops_adv.load_table()["cpu"]["gemm"], var
    assert sorted(f.name for f in folder.iterdir() if not f.name.endswith(("-wal", "-shm", ".lock"))) == [name]


# ------------------------------------------------------------------------------------------ runtime settings

def test_a_table_setting_that_names_no_file_is_an_error(monkeypatch, restore_table):
    for spec in (":", "::", " : "):
        monkeypatch.setenv("OPS_ADV_TABLE", spec)
        with pytest.raises(_table.TableError, match="names no file"):
            ops_adv.load_table()
    p = run_cli("-m", "ops_adv", "check", env={"OPS_ADV_TABLE": ":"})
    assert "names no file" in _one_error_line(p)


def test_tilde_is_expanded_in_the_runtimes_table_and_database_paths(tmp_path, tuned_db, monkeypatch, restore_table):
    out = tmp_path / "dist"
    assert cli("opsadv-export", "--device", "cpu", "--out", str(out), "--db", tuned_db).returncode == 0
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("OPS_ADV_TABLE_KEY", raising=False)
    for var, value in (("OPS_ADV_TABLE", "~/dist/opsadv-table.json"), ("OPS_ADV_TABLE", "~/tuning.db"),
                       ("OPS_ADV_DB", "~/tuning.db")):
        monkeypatch.delenv("OPS_ADV_TABLE", raising=False)
        monkeypatch.setenv(var, value)
        assert ops_adv.load_table()["cpu"]["gemm"], (var, value)


def test_tilde_in_an_sqlite_url_is_the_home_folder_for_the_tuner_and_the_runtime(tmp_path, monkeypatch, restore_table):
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    p = run_cli("-c", "import sys; from tuner.cli import db_main as m; sys.exit(m(sys.argv[1:]))", "upgrade",
                "sqlite:///~/u.db", env={"HOME": str(home)}, cwd=str(work))
    assert p.returncode == 0, p.stderr
    assert (home / "u.db").is_file() and list(work.iterdir()) == []  # no folder named ~ where it ran
    _fill(f"sqlite:///{home / 'u.db'}")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("OPS_ADV_TABLE", raising=False)
    monkeypatch.delenv("OPS_ADV_TABLE_KEY", raising=False)
    monkeypatch.setenv("OPS_ADV_DB", "sqlite:///~/u.db")
    assert ops_adv.load_table()["cpu"]["gemm"]


def test_a_folder_as_the_database_is_called_a_folder(tmp_path, monkeypatch, restore_table):
    monkeypatch.delenv("OPS_ADV_TABLE", raising=False)
    for value in (str(tmp_path), f"sqlite:///{tmp_path}"):
        monkeypatch.setenv("OPS_ADV_DB", value)
        with pytest.raises(_table.TableError) as e:
            ops_adv.load_table()
        assert "is a folder" in str(e.value) and "does not exist" not in str(e.value), str(e.value)


# ------------------------------------------------------------------------------------------ a database deleted mid-tune

def _tune(tmp_path: Path, url: str, *extra: str, problems: int = 1, env: dict | None = None) -> subprocess.Popen:
    shapes = tmp_path / "s.json"
    shapes.write_text(json.dumps({"gemm": [{"M": 64 + 8 * i, "N": 64, "K": 64} for i in range(problems)]}))
    code = "import sys; from tuner.cli import tune_main as m; sys.exit(m(sys.argv[1:]))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), **(env or {})}
    return subprocess.Popen([sys.executable, "-c", code, "--device", "cpu", "--ops", "gemm", "--shapes", str(shapes),
                             "--db", url, "--plugin", "plugins.slow", "--impls", "slow_matmul", "--progress", "plain", *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_for_trials(p: subprocess.Popen, path: Path, n: int) -> None:
    """Until the tune at `path` has stored `n` trials (read through a connection of our own, never creating the file)."""
    import time

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.5)
        try:
            with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as con:
                if con.execute("select count(*) from opsadv_trials").fetchone()[0] >= n:
                    return
        except sqlite3.Error:
            continue
    raise AssertionError(f"the tune stored fewer than {n} trials (rc {p.poll()})")


@contextlib.contextmanager
def _reaped(p: subprocess.Popen):
    try:
        yield p
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


@pytest.mark.ray
@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_database_file_deleted_mid_tune_fails_and_saves_what_it_wrote(tmp_path, how):
    path = tmp_path / "t.db"
    with _reaped(_tune(tmp_path, f"sqlite:///{path}", "--trials", "30")) as p:
        _wait_for_trials(p, path, 2)
        path.unlink()
        if how == "replaced":
            with contextlib.closing(sqlite3.connect(path)) as con:
                con.execute("create table other (x)")
        out, err = p.communicate(timeout=300)
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert p.returncode == 2 and "Traceback" not in err and len(errors) == 1, err[-3000:]
    rescued = Path(f"{path}.rescued")
    assert errors[0] == (f"opsadv-tune: error: the database file {path} was {how}{' by another file' if how == 'replaced' else ''} "
                         f"while opsadv-tune was writing to it; run 1's trials and winners were saved beside it as "
                         f"t.db.rescued: move that back to t.db and re-run the same command to resume"), errors[0]
    assert "done" not in out  # no results table: nothing is reported as tuned
    with Session(db.make_engine(f"sqlite:///{rescued}", must_exist=True)) as s:
        from sqlalchemy import func, select

        assert [r.status for r in s.scalars(select(db.Run))] == ["failed"]
        assert s.scalar(select(func.count()).select_from(db.Trial)) >= 2
        assert s.scalar(select(func.count()).select_from(db.models.Lease)) == 0
    if how == "replaced":
        with contextlib.closing(sqlite3.connect(path)) as con:  # the file put in its place is left alone
            assert [r[0] for r in con.execute("select name from sqlite_master")] == ["other"]
    else:
        assert not path.exists()  # no empty database made in its place


# ------------------------------------------------------------------------------------------ --timeout

@pytest.mark.ray
def test_a_timeout_that_leaves_problems_says_so_and_exits_3(tmp_path):
    path = tmp_path / "t.db"
    with _reaped(_tune(tmp_path, f"sqlite:///{path}", "--trials", "30", "--timeout", "1", problems=4)) as p:
        out, err = p.communicate(timeout=300)
    last = err.strip().splitlines()[-1]
    assert p.returncode == 3 and "Traceback" not in err, err[-3000:]
    assert last.startswith("opsadv-tune: stopped by --timeout 1 s with ") and "not started" in last, last
    assert last.endswith("re-run the same command to tune them (exit status 3)"), last
    with contextlib.closing(sqlite3.connect(path)) as con:
        assert con.execute("select status from opsadv_runs").fetchall() == [("interrupted",)]


# ------------------------------------------------------------------------------------------ PostgreSQL restarts mid-tune

def _pg_bin() -> Path | None:
    for d in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True) if Path("/usr/lib/postgresql").is_dir() else []:
        if (d / "initdb").exists() and (d / "pg_ctl").exists():
            return d
    found = shutil.which("pg_ctl")
    return Path(found).parent if found and shutil.which("initdb") else None


class _Server:
    """A PostgreSQL server of the test's own (initdb in a temporary folder, trust login, a free port), so that
    stopping it disturbs no other test or user of the machine's cluster. As root it runs as the postgres user."""

    def __init__(self, folder: Path) -> None:
        import socket
        import pwd

        self.bin = _pg_bin()
        self.dir = folder
        self.user: list[str] = []
        if os.geteuid() == 0:
            try:
                pwd.getpwnam("postgres")
            except KeyError:
                pytest.skip("running as root without a postgres user to run a server as")
            shutil.chown(folder, "postgres")
            self.user = ["runuser", "-u", "postgres", "--"]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self._run("initdb", "-D", str(folder / "data"), "-U", "opsadv", "--auth=trust", "-E", "UTF8")
        self.start()
        self.url = f"postgresql://opsadv@127.0.0.1:{self.port}/postgres"

    def _run(self, tool: str, *args: str) -> None:
        p = subprocess.run([*self.user, str(self.bin / tool), *args], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stdout + p.stderr

    def start(self) -> None:
        self._run("pg_ctl", "-D", str(self.dir / "data"), "-l", str(self.dir / "log"), "-w", "-o",
                  f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1", "start")

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.dir / "data"), "-m", "fast", "-w", "stop")


@pytest.fixture
def pg_server():
    import tempfile

    if _pg_bin() is None:
        pytest.skip("no PostgreSQL server binaries (initdb, pg_ctl)")
    folder = Path(tempfile.mkdtemp(prefix="opsadv-pg-"))
    server = None
    try:
        server = _Server(folder)
        yield server
    finally:
        if server is not None:
            with contextlib.suppress(Exception):
                server.stop()
        shutil.rmtree(folder, ignore_errors=True)


class _Lines:
    """A process's stderr, line by line as it comes, with a wait for a line that contains some text."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        self._new = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            with self._new:
                self.lines.append(line.rstrip("\n"))
                self._new.notify_all()
        with self._new:
            self.lines.append(None)  # end of stream
            self._new.notify_all()

    def wait_for(self, text: str, timeout: float = 300) -> str:
        with self._new:
            ok = self._new.wait_for(lambda: any(line is None or text in line for line in self.lines), timeout)
            hit = [line for line in self.lines if line is not None and text in line]
        assert ok and hit, f"no line with {text!r} in:\n" + "\n".join(filter(None, self.lines))[-3000:]
        return hit[0]

    def text(self) -> str:
        self._thread.join(60)
        return "\n".join(line for line in self.lines if line is not None)


def _pg_count(url: str, sql: str) -> int:
    import psycopg

    with psycopg.connect(url, connect_timeout=5) as con:
        return con.execute(sql).fetchone()[0]


def _wait_pg_trials(p, url: str, n: int) -> None:
    import time

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and p.poll() is None:
        time.sleep(0.5)
        try:
            if _pg_count(url, "select count(*) from opsadv_trials") >= n:
                return
        except Exception:
            continue
    raise AssertionError(f"the tune stored fewer than {n} trials (rc {p.poll()})")


@pytest.mark.postgres
@pytest.mark.ray
def test_a_postgres_restart_mid_tune_is_waited_out(tmp_path, pg_server):
    import time

    with _reaped(_tune(tmp_path, pg_server.url, "--trials", "12", problems=2)) as p:
        err = _Lines(p.stderr)
        _wait_pg_trials(p, pg_server.url, 3)
        pg_server.stop()
        time.sleep(15)  # the fault: a server down for 15 s, as a fleet database restarting
        pg_server.start()
        out = p.stdout.read()
        p.wait(300)
    text = err.text()
    assert p.returncode == 0 and "Traceback" not in text and "opsadv-tune: error" not in text, text[-3000:]
    assert "waiting up to 60 s for it (OPS_ADV_DB_RETRY_S)" in err.wait_for(f"the database {pg_server.url} is unavailable (")
    err.wait_for("the database is back after ")
    assert out.count("torch_matmul") >= 2  # the results table
    assert _pg_count(pg_server.url, "select count(*) from opsadv_winners") == 2
    assert _pg_count(pg_server.url, "select count(*) from opsadv_leases") == 0
    assert _pg_count(pg_server.url, "select count(*) from opsadv_runs where status = 'finished'") == 1


@pytest.mark.postgres
@pytest.mark.ray
def test_connections_terminated_mid_tune_are_reopened(tmp_path, pg_server):
    """pg_terminate_backend on every connection of the tune, again and again: each operation cut mid-way runs again."""
    import time

    import psycopg

    with _reaped(_tune(tmp_path, pg_server.url, "--trials", "12", problems=2)) as p:
        err = _Lines(p.stderr)
        _wait_pg_trials(p, pg_server.url, 2)
        killed = 0
        with psycopg.connect(pg_server.url, autocommit=True) as con:
            while p.poll() is None and _pg_count(pg_server.url, "select count(*) from opsadv_trials") < 12:
                killed += con.execute("select count(*) from (select pg_terminate_backend(pid) from pg_stat_activity "
                                      "where datname = 'postgres' and pid <> pg_backend_pid() "
                                      "and backend_type = 'client backend') t").fetchone()[0]
                time.sleep(0.3)
        out = p.stdout.read()
        p.wait(300)
    text = err.text()
    assert killed >= 3, killed
    assert p.returncode == 0 and "Traceback" not in text and "opsadv-tune: error" not in text, text[-3000:]
    assert _pg_count(pg_server.url, "select count(*) from opsadv_winners") == 2
    assert _pg_count(pg_server.url, "select count(*) from opsadv_leases") == 0
    assert out.count("torch_matmul") >= 2


@pytest.mark.postgres
@pytest.mark.ray
def test_a_postgres_outage_past_the_retry_window_is_one_line_and_the_run_marked_failed(tmp_path, pg_server):
    url = pg_server.url
    with _reaped(_tune(tmp_path, url, "--trials", "40", problems=2, env={"OPS_ADV_DB_RETRY_S": "10"})) as p:
        err = _Lines(p.stderr)
        _wait_pg_trials(p, url, 3)
        pg_server.stop()
        err.wait_for("waiting up to 10 s for it (OPS_ADV_DB_RETRY_S) to mark run")  # the first window is over
        pg_server.start()
        p.wait(300)
    text = err.text()
    errors = [line for line in text.splitlines() if line.startswith("opsadv-tune: error")]
    assert p.returncode == 2 and "Traceback" not in text and len(errors) == 1, text[-3000:]
    assert errors[0].startswith(f"opsadv-tune: error: writing to the database {url} failed: ") and \
        "the server went away" in errors[0] and errors[0].endswith("is marked failed"), errors[0]
    assert _pg_count(url, "select count(*) from opsadv_leases") == 0
    assert _pg_count(url, "select string_agg(status, ',' order by id) from opsadv_runs").endswith("failed")


# ------------------------------------------------------------------------------------------ a connection cut at each statement

SUGGEST, ASK, NEW_TRIAL = "tuner/study.py:_suggest", "study/study.py:ask", "_rdb/storage.py:_create_new_trial"


class _Cutter:
    """Terminates the PostgreSQL backend of an engine's connection just before one of its statements runs: the
    `at`-th statement since arm(), or the first whose SQL contains `text`; once per arm(). pg_terminate_backend
    waits (up to 10 s) until the backend is gone, so the statement always meets a dead connection."""

    def __init__(self, engine, url: str) -> None:
        import psycopg
        from sqlalchemy import event

        self.admin = psycopg.connect(url, autocommit=True)
        self.count, self.at, self.text, self.suggesting = 0, 0, None, False
        # (backend pid, statement, "folder/file.py:function" of each frame of its stack)
        self.cuts: list[tuple[int, str, frozenset[str]]] = []
        self.pids: list[int] = []  # the backend of every statement
        event.listen(engine, "before_cursor_execute", self._before)

    def arm(self, at: int = 0, text: str | None = None, suggesting: bool = False) -> None:
        """Cut the `at`-th statement from now, or the first with `text` in its SQL (`suggesting`: the first run by
        tuner.study._suggest)."""
        self.count, self.at, self.text, self.suggesting = 0, at, text, suggesting

    def _before(self, conn, cursor, statement, *_) -> None:
        import traceback

        pid = conn.connection.dbapi_connection.info.backend_pid
        self.pids.append(pid)
        self.count += 1
        if not ((self.at and self.count == self.at) or (self.text and self.text in statement)):
            return
        stack = frozenset(f"{Path(f.filename).parent.name}/{Path(f.filename).name}:{f.name}"
                          for f in traceback.extract_stack())
        if self.suggesting and SUGGEST not in stack:
            return
        self.at, self.text = 0, None
        self.admin.execute("select pg_terminate_backend(%s, 10000)", (pid,))
        self.cuts.append((pid, statement, stack))

    def close(self) -> None:
        self.admin.close()


def _cycling_sampler():
    """An optuna sampler whose every independent sample is the next choice in turn: a parameter sampled again comes
    out different."""
    import optuna

    class Cycling(optuna.samplers.BaseSampler):
        n = 0

        def infer_relative_search_space(self, study, trial):
            return {}

        def sample_relative(self, study, trial, search_space):
            return {}

        def sample_independent(self, study, trial, name, distribution):
            self.n += 1
            return distribution.choices[self.n % len(distribution.choices)]

    return Cycling()


def _bare_tuner(url: str, sampler=None):
    """A Tuner with just what _next_job and _told use (storage, Outage, run id) and one cpu_blocked gemm Task of 100
    valid configurations; no Ray, no opsadv schema. Returns the tuner, the task and the Outage's lines."""
    from collections import deque

    import optuna

    from db._engine import Outage
    from kernel_space import get_op
    from tuner.driver import Task, TuneOptions, Tuner
    from tuner.study import _sampler, narrow

    lines: list[str] = []
    t = Tuner(TuneOptions(device="cpu", problems=[], db_url=url))
    kw = {"connect_args": {"timeout": 30}} if url.startswith("sqlite") else {"pool_pre_ping": True}
    t.storage = optuna.storages.RDBStorage(db.normalize(url), engine_kwargs=kw)
    t.outage = Outage(url, lines.append, 30.0)
    t.outage.watch(t.storage.engine)
    t.run_id = 1
    problem = get_op("gemm").problem(M=512, N=512, K=512, dtype="fp32")
    impl = narrow(kernel_space.get_impl("gemm", "cpu_blocked"), problem, "cpu")
    study = optuna.create_study(study_name="cut", storage=t.storage, direction="minimize",
                                sampler=sampler or _sampler("tpe", 0))
    task = Task("gemm", problem, "cut", 1, study, [impl], deque(), deque(), budget=1000, space=100)
    task.checked_at = float("inf")  # its lease is held: _holds asks no lease table
    return t, task, lines


def _measured(t, task, value: float):
    """One round of the loop for `task`: _next_job asks and suggests a trial, which is then told `value` as a worker's
    ok result would be (nothing measured). (name, params, trial), or None when _next_job gives no job."""
    from tuner.study import _params_key
    from workers.measure import OK

    job = t._next_job(task, False)
    if job is None:
        return None
    _, _, name, params, trial = job[3]
    task.in_flight -= 1
    task.seen[_params_key(name, params)] = (OK, value)
    t._told(task, trial, OK, value)
    return name, params, trial


def _stored_as_measured(task, done) -> int:
    """Each trial of `done` is complete in the study with the parameters that were measured; every other trial is a
    complete repeat of a measured configuration (the sampler proposed it again), or an empty one left running by an
    ask cut after it created its trial (the ask runs again; the next run's resume fails such a trial). The number of
    those left running."""
    from optuna.trial import TrialState

    from tuner.study import REPEAT, _params_key

    trials = {t.number: t for t in task.study.get_trials(deepcopy=False)}
    for name, params, trial in done:
        stored = trials.pop(trial.number)
        assert stored.state == TrialState.COMPLETE and not stored.user_attrs.get(REPEAT), stored
        assert stored.params == {f"{name}.{k}": v for k, v in params.items()}, (stored.params, params)
    left = 0
    for t in trials.values():
        if t.state == TrialState.RUNNING and not t.params and not t.user_attrs:
            left += 1
            continue
        params = {k.split(".", 1)[1]: v for k, v in t.params.items()}
        assert t.state == TrialState.COMPLETE and t.user_attrs.get(REPEAT), t
        assert _params_key("cpu_blocked", params) in task.seen, t
    return left


@pytest.mark.postgres
def test_a_cut_at_any_statement_of_a_trial_is_ridden_out(pg_server):
    """Every statement a trial's round makes (ask, its attributes, suggesting its parameters, tell) meets a terminated
    backend in turn. Suggesting used to run outside the Outage: a cut in the sampler's trial loading (optuna catches it,
    warns "Falling back to a slower alternative", queries the dead session again and raises StorageInternalError over
    "Can't reconnect until invalid transaction is rolled back") ended the tune (the clean-clone CI run's failure)."""
    import logging

    t, task, lines = _bare_tuner(pg_server.url)
    cutter = _Cutter(t.storage.engine, pg_server.url)
    fallbacks: list[str] = []
    rdb_log = logging.getLogger("optuna.storages._rdb.storage")
    counted = lambda r: fallbacks.append(r.getMessage()) or True  # noqa: E731  (before the tuner's own filter)
    rdb_log.filters.insert(0, counted)
    shown: list[logging.LogRecord] = []
    catch = logging.Handler()
    catch.emit = shown.append
    rdb_log.addHandler(catch)
    try:
        cutter.arm()
        done = [_measured(t, task, 1.0)]  # the statements of one round, none cut
        n = cutter.count
        for k in range(1, n + 1):  # then the k-th statement of the next round is cut, for every k
            cutter.arm(at=k)
            done.append(_measured(t, task, 1.0 + k))
            assert done[-1] is not None
        # the CI run's path: the sampler's trial loading cut while suggesting, through optuna's fallback
        cutter.arm(text="FROM trial_user_attributes", suggesting=True)
        done.append(_measured(t, task, 50.0))
        assert done[-1] is not None
    finally:
        rdb_log.removeHandler(catch)
        rdb_log.filters.remove(counted)
        cutter.close()
    assert n >= 10 and len(cutter.cuts) >= n, (n, len(cutter.cuts))
    assert sum(SUGGEST in stack for *_, stack in cutter.cuts) >= 3, cutter.cuts  # suggesting was cut, several ways
    assert any(SUGGEST in stack and "FROM trial_user_attributes" in sql for _, sql, stack in cutter.cuts)
    assert fallbacks and not [r for r in shown if "Falling back" in r.getMessage()]  # optuna's warning is left out
    # one outage per cut, but for those optuna's trial creation rides out itself (it tries up to five times)
    starts = [line for line in lines if " is unavailable (" in line]
    assert len(starts) == sum(NEW_TRIAL not in stack for *_, stack in cutter.cuts) == \
        len([ln for ln in lines if "is back after" in ln]), lines
    assert all(line.endswith("waiting up to 30 s for it (OPS_ADV_DB_RETRY_S)") for line in starts), starts
    assert _stored_as_measured(task, done) <= sum(ASK in stack and NEW_TRIAL not in stack for *_, stack in cutter.cuts)


def test_a_parameter_stored_before_its_answer_was_lost_is_measured_as_stored(tmp_path, monkeypatch):
    """A parameter's write that reached the database, with the answer lost to a cut: optuna ignores a second write of
    the parameter, so the retry must take the stored value rather than sample another, or a configuration other
    than the stored one would be measured for the trial."""
    from sqlalchemy.exc import OperationalError

    t, task, lines = _bare_tuner(f"sqlite:///{tmp_path / 'lost.db'}", sampler=_cycling_sampler())
    first = _measured(t, task, 1.0)
    real = t.storage._set_trial_param
    lost: list[str] = []

    def stored_then_cut(trial_id, name, *args):
        real(trial_id, name, *args)
        if not lost:
            lost.append(name)
            raise OperationalError("COMMIT", {}, OSError("server closed the connection unexpectedly"),
                                   connection_invalidated=True)

    monkeypatch.setattr(t.storage, "_set_trial_param", stored_then_cut)
    second = _measured(t, task, 2.0)
    assert lost == ["cpu_blocked.block_m"] and len(lines) == 2, (lost, lines)
    _stored_as_measured(task, [first, second])


@pytest.mark.postgres
def test_a_cut_seen_again_through_optunas_fallback_is_transient_and_retried_on_a_new_connection(
        pg_server, tmp_path, monkeypatch):
    """The exact error of the CI run, produced for real: a backend terminated under optuna's trial loading, whose
    fallback query meets the invalidated connection (PendingRollbackError, code 8s2b) inside StorageInternalError.
    It is transient (with or without the original error in its chain), optuna's session is rolled back and closed
    (no scoped_session.remove() needed), and the Outage's retry runs on a new backend."""
    import logging

    import optuna
    from sqlalchemy import text
    from sqlalchemy.exc import IntegrityError, OperationalError, PendingRollbackError

    from db._engine import Outage, transient

    storage = optuna.storages.RDBStorage(db.normalize(pg_server.url), engine_kwargs={"pool_pre_ping": True})
    study = optuna.create_study(study_name="fallback", storage=storage)
    for i in range(3):
        trial = study.ask()
        trial.set_user_attr("i", i)
        study.tell(trial, float(i))
    sid = storage.get_study_id_from_name("fallback")
    rdb_log = logging.getLogger("optuna.storages._rdb.storage")
    monkeypatch.setattr(rdb_log, "filters", [])  # the tuner's filter, when a test made a Tuner, would hide the warning
    shown: list[str] = []
    catch = logging.Handler()
    catch.emit = lambda r: shown.append(r.getMessage())
    rdb_log.addHandler(catch)
    cutter = _Cutter(storage.engine, pg_server.url)
    try:
        cutter.arm(text="FROM trial_user_attributes")
        with pytest.raises(optuna.exceptions.StorageInternalError) as e:
            storage.get_all_trials(sid)
        cut_pid = cutter.cuts[0][0]
        assert len(shown) == 1 and "Falling back to a slower alternative" in shown[0], shown
        pending = e.value.__cause__
        assert isinstance(pending, PendingRollbackError) and pending.code == "8s2b", repr(pending)
        assert "Can't reconnect until invalid transaction is rolled back" in str(pending)
        assert isinstance(pending.__context__, OperationalError) and pending.__context__.connection_invalidated
        assert transient(e.value)
        assert not storage.scoped_session().in_transaction()  # rolled back and closed by optuna
        after = len(cutter.pids)
        assert [t.user_attrs["i"] for t in storage.get_all_trials(sid)] == [0, 1, 2]
        assert cut_pid not in cutter.pids[after:]  # a new backend
        pending.__context__ = pending.__cause__ = None  # without the cut in its chain, it is still one
        assert transient(e.value) and transient(pending)

        lines: list[str] = []  # through the Outage: one line when it starts, one when it ends, and the trials
        cutter.arm(text="FROM trial_user_attributes")
        trials = Outage(pg_server.url, lines.append, 30.0).run(storage.get_all_trials, sid)
        assert [t.user_attrs["i"] for t in trials] == [0, 1, 2] and len(cutter.cuts) == 2
        assert len(lines) == 2 and "is unavailable (" in lines[0] and "is back after" in lines[1], lines
    finally:
        rdb_log.removeHandler(catch)
        cutter.close()
    # a transaction pending rollback after a failed flush is no cut: waiting cannot cure it
    with Session(db.open_db(f"sqlite:///{tmp_path / 'flush.db'}")) as s:
        s.add_all([db.Problem(op="gemm", key="k"), db.Problem(op="gemm", key="k")])
        with pytest.raises(IntegrityError):
            s.flush()
        with pytest.raises(PendingRollbackError) as flush:
            s.execute(text("select 1"))
    assert flush.value.code != "8s2b" and not transient(flush.value), repr(flush.value)


# ------------------------------------------------------------------------------------------ which errors are waited out

def test_transient_database_errors_are_those_waiting_can_cure(tmp_path):
    from sqlalchemy import create_engine, text
    from sqlalchemy.exc import OperationalError

    from db._engine import transient

    path = tmp_path / "t.db"
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as holder:
        holder.execute("create table t (x)")
        holder.execute("begin exclusive")  # another process holds the write lock: busy, not broken
        with pytest.raises(OperationalError) as locked:
            with create_engine(f"sqlite:///{path}", connect_args={"timeout": 0}).begin() as c:
                c.execute(text("insert into t values (1)"))
        holder.execute("rollback")
    assert "locked" in str(locked.value) and transient(locked.value)
    with pytest.raises(OperationalError) as readonly:
        with create_engine(f"sqlite:///file:{path}?mode=ro&uri=true").begin() as c:
            c.execute(text("insert into t values (1)"))
    assert "readonly" in str(readonly.value) and not transient(readonly.value)  # waiting cannot make it writable
    import socket

    with socket.socket() as s:  # a port nothing listens on: a server restarting looks like this
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(OperationalError) as refused:
        create_engine(f"postgresql+psycopg://u@127.0.0.1:{port}/d").connect()
    assert transient(refused.value)
    assert not transient(ValueError("connection refused"))  # not a database error


@pytest.mark.skipif(not os.environ.get("OPS_ADV_TEST_PG_URL"), reason="no PostgreSQL (OPS_ADV_TEST_PG_URL)")
@pytest.mark.postgres
def test_a_refused_login_is_not_waited_out():
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import OperationalError

    from db._engine import transient

    url = make_url(db.normalize(os.environ["OPS_ADV_TEST_PG_URL"])).set(password="not-the-password")
    with pytest.raises(OperationalError) as e:
        create_engine(url).connect()
    assert not transient(e.value)


def test_the_retry_window_setting(monkeypatch):
    from ops_adv import _settings

    monkeypatch.delenv("OPS_ADV_DB_RETRY_S", raising=False)
    assert _settings.db_retry_s() == 60.0
    monkeypatch.setenv("OPS_ADV_DB_RETRY_S", "0")
    assert _settings.db_retry_s() == 0.0
    for bad in ("x", "-1", "inf", "nan"):
        monkeypatch.setenv("OPS_ADV_DB_RETRY_S", bad)
        with pytest.warns(RuntimeWarning, match="OPS_ADV_DB_RETRY_S"):
            assert _settings.db_retry_s() == 60.0
