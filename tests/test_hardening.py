"""Issue 14, items 3-5: passwords never leave the URL, tables are validated, every bad state is one line and exit 2."""
from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import threading
from contextlib import closing

import pytest
import torch

import db
import kernel_space
import ops_adv
from conftest import run_cli
from ops_adv import _table
from ops_adv.__main__ import main as check_main
from tuner.cli import db_main, export_main, report_main, tune_main

MARK = "Zq7marker9pw"
PG_URL = os.environ.get("OPS_ADV_TEST_PG_URL")


def _one_line_exit_2(rc, err: str, want: str = "") -> str:
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    assert want in lines[0], err
    return lines[0]


def _call(main, *argv, capsys):
    try:
        rc = main(list(argv))
    except SystemExit as e:  # argparse
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


# -- item 3: passwords ----------------------------------------------------------------------------

SPELLINGS = [
    f"postgresql://me:{MARK}@127.0.0.1:1/d",
    f"postgresql://:{MARK}@127.0.0.1:1/d",  # empty user
    f"postgresql://me:a@{MARK}@127.0.0.1:1/d",  # @ in the password
    f"postgresql://me:{MARK}%40x@127.0.0.1:1/d",  # percent-encoded
    f"postgresql://me:{MARK}/x@127.0.0.1:1/d",  # / in the password
    f"postgresql://me@127.0.0.1:1/d?password={MARK}",
    f"postgresql://127.0.0.1:1/d?sslmode=disable&password={MARK}",
    f"postgresql://me@127.0.0.1:1/d?pass%77ord={MARK}",
    f"postgresql+psycopg://me:{MARK}@127.0.0.1:1/d",
    f"postgres://me:{MARK}@127.0.0.1:1/d",
]


@pytest.mark.parametrize("url", SPELLINGS)
def test_redact_hides_every_spelling(url):
    r = _table.redact(url)
    assert MARK not in r and "***" in r
    assert db.redact(url) == r  # one redact()
    assert MARK not in _table.redact(f"failed for 'x' host=h password={MARK} port=1")
    kept = _table.redact(f"cannot reach {url}: {MARK.replace('q', 'Q')}")
    assert MARK not in kept and MARK.replace("q", "Q") in kept  # other text is kept


def test_redact_keeps_what_is_not_a_secret():
    assert _table.redact("sqlite:////x/y.db") == "sqlite:////x/y.db"
    assert _table.redact("sqlite:////x/a:b@c/y.db") == "sqlite:////x/a:b@c/y.db"
    assert _table.redact("postgresql://me@h:5432/d?sslmode=require") == "postgresql://me@h:5432/d?sslmode=require"
    assert _table.redact("postgresql://me:pw@h/d") == "postgresql://me:***@h/d"


@pytest.mark.parametrize("url", SPELLINGS)
def test_every_cli_error_path_hides_the_password(url, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    for main, argv in (
        (db_main, ["upgrade", url]), (db_main, ["current", url]),
        (export_main, ["--device", "cpu", "--out", str(tmp_path / "o"), "--db", url]),
        (report_main, ["--device", "cpu", "--db", url]),
        (tune_main, ["--device", "cpu", "--ops", "gemm", "--db", url, "--workers", "-1"]),
        (tune_main, ["--device", "cpu", "--ops", "gemm", f"--db={url}", "--timeout", "nan"]),
        (tune_main, ["--device", "cpu", "--ops", "gemm", "--db", url.replace(":1/", ":x1/")]),
        (tune_main, ["--device", "cpu", "--ops", "gemm", "--workers", url]),  # argparse echoes the value
    ):
        rc, out, err = _call(main, *argv, capsys=capsys)
        assert MARK not in out + err, (argv, err)
        _one_line_exit_2(rc, err)


def test_runtime_messages_hide_the_password(monkeypatch):
    for url in (f"mysql://me:{MARK}@h/d", f"postgresql://me:a@{MARK}@127.0.0.1:1/d", f"postgresql://me@127.0.0.1:1/d?password={MARK}"):
        with pytest.raises(ops_adv.TableError) as e:
            ops_adv.load_table(url)
        assert MARK not in str(e.value) and "\n" not in str(e.value)
    monkeypatch.setenv("OPS_ADV_TABLE", f"ftp://me:{MARK}@h/t.json")
    r = run_cli("-m", "ops_adv", "check")
    assert MARK not in r.stdout + r.stderr
    _one_line_exit_2(r.returncode, r.stderr, "neither a table file")
    ops_adv.load_table("")


@pytest.mark.skipif(not PG_URL, reason="no PostgreSQL (OPS_ADV_TEST_PG_URL)")
def test_libpq_error_text_hides_the_password(capsys):
    from sqlalchemy.engine import make_url

    u = make_url(PG_URL)
    for url in (
        f"postgresql://{u.username}:{MARK}@{u.host}:{u.port or 5432}/{u.database}",  # wrong password: the server answers
        f"postgresql://{u.username}@{u.host}:{u.port or 5432}/{u.database}?password={MARK}",
        f"postgresql://{u.username}:{MARK}@{u.host}:{u.port or 5432}/{u.database}?options=-c%20search_path%3D{MARK}",
    ):
        rc, out, err = _call(db_main, "current", url, capsys=capsys)
        assert MARK not in out + err, err
        _one_line_exit_2(rc, err, "check the user name and password")


def test_stored_command_is_redacted():
    from tuner.cli import _command

    for url in SPELLINGS:
        for argv in (["--db", url], [f"--db={url}"]):
            cmd = _command(["--device", "cpu", *argv])
            assert MARK not in cmd and cmd.startswith("opsadv-tune --device cpu ") and "***" in cmd


@pytest.mark.ray
def test_marker_password_appears_in_no_stream_database_or_exported_file(ray_session, tmp_path, capfd):
    """A real tune and export with the password in the URL: grep stdout, stderr, the database and the files."""
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps({"gemm": [{"M": 32, "N": 32, "K": 32}]}))
    dbfile = tmp_path / "tuning.db"
    url = f"sqlite:///{dbfile}?password={MARK}"
    assert tune_main(["--device", "cpu", "--ops", "gemm", "--shapes", str(shapes), "--trials", "2", "--db", url, "--progress", "plain"]) == 0
    assert export_main(["--device", "cpu", "--out", str(tmp_path / "dist"), "--db", url]) == 0
    assert report_main(["--device", "cpu", "--db", url, "--markdown", str(tmp_path / "r.md")]) == 0
    assert db_main(["upgrade", url]) == 0
    out, err = capfd.readouterr()
    assert MARK not in out + err
    con = sqlite3.connect(dbfile)
    (command,) = con.execute("select command from opsadv_runs").fetchone()
    con.close()
    assert "password=***" in command and MARK not in command
    for f in tmp_path.rglob("*"):
        if f.is_file():
            assert MARK.encode() not in f.read_bytes(), f


# -- item 4: tables ---------------------------------------------------------------------------------

PROB = {"M": 64, "N": 128, "K": 96, "dtype": "fp32", "trans_a": False, "trans_b": False}


def _winner(params, impl="cpu_blocked", **extra):
    return {"op": "gemm", "problem": dict(PROB), "impl": impl, "params": params,
            "kernel_version": kernel_space.get_impl("gemm", impl).version, "median_ms": 1.0,
            "vendor_impl": "torch_matmul", "vendor_ms": 2.0, "speedup": 2.0, **extra}


def _write(path, winners, **extra):
    data = {"format": _table.FORMAT, "format_version": _table.FORMAT_VERSION, "device_class": "cpu", "fingerprint": {},
            "winners": winners, "checksum": _table.checksum(winners), **extra}
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def restore_table():
    yield
    ops_adv.load_table("")


GOOD = {"block_m": 32, "block_n": 64, "block_k": 0}


@pytest.mark.parametrize("params,why", [
    ({"block_m": 32, "block_n": 64, "block_k": -64}, "block_k=-64 is not one of"),
    ({"block_m": 32, "block_n": 64, "block_k": True}, "block_k=True is not one of"),
    ({"block_m": 32, "block_n": 64, "block_k": 64.0}, "is not one of"),
    ({"block_m": 32, "block_n": 64}, "missing block_k"),
    ({**GOOD, "evil": 1}, "unknown evil"),
    ({"block_m": "32", "block_n": 64, "block_k": 0}, "block_m='32'"),
])
def test_edited_winner_with_recomputed_checksum_is_refused_and_calls_fall_back(tmp_path, restore_table, params, why, capsys):
    path = _write(tmp_path / "t.json", [_winner(params)])
    with pytest.warns(_table.RefusedWinners, match=why) as rec:
        ops_adv.load_table(str(path))
    msg = str(rec[0].message)
    assert str(path) in msg and "\n" not in msg and "fall back" in msg
    a, b = torch.randn(64, 96), torch.randn(96, 128)
    assert ops_adv.explain("gemm", a, b)["source"] == "default"
    torch.testing.assert_close(ops_adv.gemm(a, b), a @ b)
    rc, out, err = _call(check_main, "check", str(path), capsys=capsys)
    assert rc == 1 and why.split("=")[0] in err and "Traceback" not in err, err


def test_winner_refused_by_its_check(tmp_path, restore_table):
    impl = kernel_space.get_impl("gemm", "cpu_blocked")
    from kernel_space.gemm import GemmProblem

    p = GemmProblem(**PROB)
    bad = next((c for c in impl.configs() if impl.why_not(p, c, "cpu")), None)
    if bad is None:
        pytest.skip("every point of cpu_blocked's space is valid for this problem")
    path = _write(tmp_path / "t.json", [_winner(bad)])
    with pytest.warns(_table.RefusedWinners, match="refused"):
        ops_adv.load_table(str(path))
    assert ops_adv.explain("gemm", torch.randn(64, 96), torch.randn(96, 128))["source"] == "default"


def test_valid_table_loads_and_check_passes(tmp_path, restore_table):
    path = _write(tmp_path / "t.json", [_winner(GOOD)])
    r = run_cli("-W", "error", "-m", "ops_adv", "check", str(path))
    assert r.returncode == 0 and "cpu gemm: 1 tuned problem(s)" in r.stdout, r.stderr


@pytest.mark.parametrize("mutate,want", [
    (lambda d: d["winners"].__setitem__(0, "x"), "winner 0 is not an object"),
    (lambda d: d["winners"][0].pop("params"), "winner 0 has no params"),
    (lambda d: d["winners"][0].__setitem__("problem", [1, 2]), "winner 0 has no problem"),
    (lambda d: d["winners"][0].__setitem__("op", 7), "winner 0 has no op"),
    (lambda d: d["winners"][0].__setitem__("conditions", "fast"), "conditions must be an object"),
    (lambda d: d.__setitem__("device_class", None), "no device_class"),
    (lambda d: d.__setitem__("fingerprint", [1]), "fingerprint must be an object"),
    (lambda d: d.__setitem__("winners", {"a": 1}), "checksum"),
])
def test_structurally_broken_table_is_one_line_table_error(tmp_path, mutate, want, capsys):
    d = {"format": _table.FORMAT, "format_version": 1, "device_class": "cpu", "fingerprint": {}, "winners": [_winner(GOOD)]}
    mutate(d)
    try:
        d["checksum"] = _table.checksum(d["winners"])
    except Exception:
        d["checksum"] = "0"
    path = tmp_path / "t.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ops_adv.TableError, match=want) as e:
        ops_adv.load_table(str(path))
    assert "\n" not in str(e.value)
    rc, out, err = _call(check_main, "check", str(path), capsys=capsys)
    _one_line_exit_2(rc, err, want)
    ops_adv.load_table("")


def test_table_of_non_regular_file_is_refused():
    with pytest.raises(ops_adv.TableError, match="not a regular file"):
        ops_adv.load_table("/dev/zero")
    ops_adv.load_table("")


def test_signed_tables(tmp_path, monkeypatch, restore_table, capsys):
    path = _write(tmp_path / "t.json", [_winner(GOOD)])
    monkeypatch.setenv("OPS_ADV_TABLE_KEY", "k1")
    with pytest.raises(ops_adv.TableError, match="not signed"):
        ops_adv.load_table(str(path))
    rc, out, err = _call(check_main, "sign", str(path), capsys=capsys)
    assert rc == 0, err
    assert ops_adv.load_table(str(path))["cpu"]["gemm"]
    # an edit with a recomputed checksum passes the checksum, not the signature
    d = json.loads(path.read_text())
    d["winners"][0]["median_ms"] = 0.001
    d["checksum"] = _table.checksum(d["winners"])
    os.chmod(path, 0o644)
    path.write_text(json.dumps(d))
    with pytest.raises(ops_adv.TableError, match="signed with another key or changed"):
        ops_adv.load_table(str(path))
    monkeypatch.delenv("OPS_ADV_TABLE_KEY")
    assert ops_adv.load_table(str(path))["cpu"]["gemm"]  # without a key only the checksum is checked
    rc, out, err = _call(check_main, "sign", str(path), capsys=capsys)
    _one_line_exit_2(rc, err, "OPS_ADV_TABLE_KEY")


def test_conditions_drift_warns_once_and_tables_without_them_load(tmp_path, restore_table):
    here = {"threads": torch.get_num_threads(), "torch": torch.__version__}
    path = _write(tmp_path / "t.json", [_winner(GOOD, conditions=dict(here, cudnn=None, driver="x"))])
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ops_adv.load_table(str(path))
        _write(tmp_path / "plain.json", [_winner(GOOD)])
        ops_adv.load_table(str(tmp_path / "plain.json"))
    other = [_winner(GOOD, conditions={"threads": here["threads"] + 3, "torch": "1.0.0"}),
             _winner(GOOD, conditions={"threads": here["threads"] + 3, "torch": "1.0.0"}, problem={**PROB, "M": 32})]
    path = _write(tmp_path / "o.json", other)
    with pytest.warns(RuntimeWarning, match="measured with") as rec:
        ops_adv.load_table(str(path))
    drift = [w for w in rec if "measured with" in str(w.message)]
    assert len(drift) == 1 and f"threads {here['threads'] + 3} (this process: {here['threads']})" in str(drift[0].message)
    assert "torch 1.0.0" in str(drift[0].message)
    assert ops_adv.explain("gemm", torch.randn(64, 96), torch.randn(96, 128))["source"] == "tuned"  # still used


# -- item 5: database states -------------------------------------------------------------------------

def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else ""


def _states(tmp_path):
    notdb = tmp_path / "notdb.db"
    notdb.write_bytes(b"this is not an sqlite file\n" * 100)
    newer = tmp_path / "newer.db"
    db.open_db(f"sqlite:///{newer}").dispose()
    with closing(sqlite3.connect(newer)) as c, c:
        c.execute("update opsadv_alembic_version set version_num = 'fff999'")
    nover = tmp_path / "nover.db"
    db.open_db(f"sqlite:///{nover}").dispose()
    with closing(sqlite3.connect(nover)) as c, c:
        c.execute("drop table opsadv_alembic_version")
    ro = tmp_path / "ro.db"
    db.open_db(f"sqlite:///{ro}").dispose()
    return {
        "not a database": (notdb, f"sqlite:///{notdb}", "is not an SQLite database"),
        "newer schema": (newer, f"sqlite:///{newer}", "newer than this ops-adv"),
        "no version table": (nover, f"sqlite:///{nover}", "no opsadv_alembic_version table"),
        "read-only": (ro, f"sqlite:///file:{ro}?mode=ro&uri=true", "is read-only"),
        "a folder": (tmp_path, f"sqlite:///{tmp_path}", "is not a file"),
        "port": (None, "postgresql://me@127.0.0.1:5x432/d", "port is not a number"),
    }


def test_every_database_state_is_one_line_with_the_fix_and_leaves_it_alone(tmp_path, capsys):
    for name, (path, url, want) in _states(tmp_path).items():
        before = _digest(path) if path and path.is_file() else None
        for main, argv in (
            (db_main, ["upgrade", url]),
            (tune_main, ["--device", "cpu", "--ops", "gemm", "--db", url, "--trials", "1"]),
            (export_main, ["--device", "cpu", "--out", str(tmp_path / "dist"), "--db", url]),
        ):
            if main is not tune_main and name == "read-only":
                continue  # reading it, or an upgrade with nothing to do, is fine
            rc, out, err = _call(main, *argv, capsys=capsys)
            assert rc == 2, (name, argv, out, err)
            line = _one_line_exit_2(rc, err, want)
            assert "server is running" not in line, line
            if name in ("newer schema", "no version table"):
                assert "opsadv-db upgrade" not in line, line  # an upgrade cannot fix these
        if before is not None:
            assert _digest(path) == before, name


@pytest.mark.skipif(not PG_URL, reason="no PostgreSQL (OPS_ADV_TEST_PG_URL)")
def test_read_only_postgres_is_not_server_not_running(capsys):
    url = PG_URL + ("&" if "?" in PG_URL else "?") + "options=-c%20default_transaction_read_only%3Don"
    engine = db.make_engine(PG_URL)
    head = db.current(engine) == db.head()
    engine.dispose()
    if not head:
        pytest.skip("the test database is not at head (another test owns it)")
    rc, out, err = _call(tune_main, "--device", "cpu", "--ops", "gemm", "--db", url, "--trials", "1", capsys=capsys)
    line = _one_line_exit_2(rc, err, "is read-only")
    assert "server is running" not in line


def test_stale_schema_still_advises_upgrade(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'old.db'}"
    db.make_engine(url).dispose()
    rc, out, err = _call(export_main, "--device", "cpu", "--out", str(tmp_path / "d"), "--db", url, capsys=capsys)
    _one_line_exit_2(rc, err, "opsadv-db upgrade")
    db.make_engine(f"sqlite:///{tmp_path / 'x' / 'n.db'}").dispose()  # an empty database: no schema yet
    rc, out, err = _call(db_main, "current", f"sqlite:///{tmp_path / 'x' / 'n.db'}", capsys=capsys)
    assert rc == 0 and out.startswith("none")


# -- item 5: CLI arguments --------------------------------------------------------------------------

@pytest.mark.parametrize("args,want", [
    (["--workers", "-1"], "--workers -1"),
    (["--workers", "0"], "--workers 0"),
    (["--seed", "-1"], "--seed -1"),
    (["--trial-timeout", "-1"], "--trial-timeout"),
    (["--timeout", "-1"], "--timeout"),
    (["--timeout", "nan"], "--timeout nan"),
    (["--timeout", "inf"], "--timeout inf"),
    (["--measure-budget", "0"], "--measure-budget"),
    (["--compile-workers", "-2"], "--compile-workers"),
    (["--trials", "0"], "--trials 0"),
    (["--threads", "0"], "--threads 0"),
    (["--accuracy", "nan"], "--accuracy nan"),
    (["--accuracy", "0.5"], "--accuracy 0.5"),
    (["--workers", "many"], "invalid int value"),
    (["--impls", "nope"], "no implementation nope"),
    (["--device", "xyz"], "unknown device"),
    (["--device", "h200"], "needs an NVIDIA GPU") if not torch.cuda.is_available() else (["--device", "xyz2"], "unknown device"),
    (["--bogus"], "unrecognized arguments"),
    ([], ""),  # --device given twice below is fine; a missing --ops is one line
])
def test_bad_arguments_are_refused_before_the_database_exists(tmp_path, capsys, monkeypatch, args, want):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    dbfile = tmp_path / "t.db"
    argv = ["--device", "cpu", "--ops", "gemm", "--db", f"sqlite:///{dbfile}", *args] if args else ["--device", "cpu"]
    rc, out, err = _call(tune_main, *argv, capsys=capsys)
    _one_line_exit_2(rc, err, want)
    assert not dbfile.exists() and not (tmp_path / "xdg").exists()


def test_report_plot_into_a_missing_folder_is_one_line(tmp_path, capsys):
    path = _write(tmp_path / "t.json", [_winner(GOOD)])
    for flag in ("--plot", "--markdown"):
        rc, out, err = _call(report_main, "--device", "cpu", "--table", str(path), flag, "/missing/dir/p.png", capsys=capsys)
        _one_line_exit_2(rc, err, "/missing/dir does not exist")
    rc, out, err = _call(report_main, "--device", "cpu", "--table", str(path), "--plot", str(tmp_path / "p.xyz"), capsys=capsys)
    _one_line_exit_2(rc, err, "cannot write the plot")
    rc, out, err = _call(report_main, "--device", "cpu", "--table", str(path), "--plot", str(tmp_path / "p.png"), capsys=capsys)
    assert rc == 0 and (tmp_path / "p.png").stat().st_size > 0


# -- item 5: shapes files ---------------------------------------------------------------------------

def _shapes(path, *, ops=("gemm",)):
    from tuner.problems import load_shapes

    return load_shapes(str(path), list(ops))


def _refused(path, want):
    from tuner.problems import ShapesFileError

    with pytest.raises(ShapesFileError, match=want) as e:
        _shapes(path)
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 400, msg
    return msg


def test_yaml_alias_bomb_is_refused_quickly_with_a_short_message(tmp_path):
    lines = ['a: &a ["x","x","x","x","x","x","x","x","x"]']
    for prev, cur in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{cur}: &{cur} [" + ",".join([f"*{prev}"] * 9) + "]")
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\n")
    assert path.stat().st_size < 500
    _refused(path, "expands to more than")
    (tmp_path / "self.yaml").write_text("a: &a [*a]\n")
    _refused(tmp_path / "self.yaml", "refers to itself")
    (tmp_path / "deep.yaml").write_text("gemm: " + "[" * 60 + "]" * 60 + "\n")
    _refused(tmp_path / "deep.yaml", "nested deeper")
    (tmp_path / "deep.json").write_text("[" * 100000 + "]" * 100000)
    _refused(tmp_path / "deep.json", "nested")


def test_yaml_aliases_within_limits_still_work(tmp_path):
    path = tmp_path / "s.yml"
    path.write_text("base: &b {N: 64, K: 64, dtype: bf16}\n"
                    "gemm:\n  - {<<: *b, M: 16}\n  - {<<: *b, M: 32}\n")
    path.write_text(path.read_text().replace("base: &b", "x-base: &b"))
    from tuner.problems import ShapesFileError

    with pytest.raises(ShapesFileError, match="unknown op"):
        _shapes(path)
    path.write_text("- &p {op: gemm, M: 16, N: 64, K: 64}\n- {<<: *p, M: 32}\n")
    assert [p.M for _, p in _shapes(path)] == [16, 32]


def test_dev_zero_fifo_and_folder_are_refused_without_reading(tmp_path):
    _refused("/dev/zero", "not a regular file")
    fifo = tmp_path / "f.yaml"
    os.mkfifo(fifo)
    done = []
    t = threading.Thread(target=lambda: done.append(_refused(fifo, "not a regular file")), daemon=True)
    t.start()
    t.join(30)
    assert done, "reading a FIFO blocked"
    _refused(tmp_path, "not a regular file")


def test_size_limit_and_non_utf8(tmp_path, monkeypatch):
    from tuner import problems

    monkeypatch.setattr(problems, "MAX_BYTES", 1000)
    big = tmp_path / "big.json"
    big.write_text(json.dumps({"gemm": [{"M": 16, "N": 16, "K": 16}] * 100}))
    _refused(big, "larger than")
    bad = tmp_path / "bad.json"
    bad.write_bytes(b'{"gemm": [{"M": 16, "N": 16, "K": 16, "dtype": "\xff\xfe"}]}')
    _refused(bad, "not UTF-8")


def test_messages_never_echo_a_large_value(tmp_path):
    for name, text in (
        ("a.json", json.dumps({"gemm": [{"M": "x" * 100000, "N": 1, "K": 1}]})),
        ("b.json", json.dumps({"gemm": [{"M": 1, "N": 1, "K": 1, "y" * 100000: 1}]})),
        ("c.json", json.dumps([["x" * 100000]])),
        ("d.json", json.dumps({"g" * 100000: []})),
        ("e.json", json.dumps({"gemm": ["x" * 100000]})),
        ("f.json", "{" + "x" * 100000),
        ("g.yaml", "gemm: [{M: 1, N: 1, K: 1, 5: 2}]\n"),
    ):
        (tmp_path / name).write_text(text)
        _refused(tmp_path / name, "shapes file")


def test_duplicates_are_merged_and_uppercase_yaml_is_yaml(tmp_path, capsys):
    path = tmp_path / "S.YAML"
    path.write_text("gemm:\n  - {M: 64, N: 64, K: 64}\n  - {M: 64, N: 64, K: 64, dtype: float32}\n  - {M: 32, N: 64, K: 64}\n"
                    "attention:\n  - {B: 1, H: 2, Sq: 64, Skv: 64, D: 32}\n")
    got = _shapes(path, ops=("gemm", "attention"))
    assert [(op, tuple(p)[:3]) for op, p in got] == [("gemm", (64, 64, 64)), ("gemm", (32, 64, 64)), ("attention", (1, 2, 64))]
    rc, out, err = _call(tune_main, "--device", "cpu", "--ops", "gemm", "--shapes", "/dev/zero", capsys=capsys)
    _one_line_exit_2(rc, err, "not a regular file")


def test_sqlite_lock_file_name_never_holds_the_query(tmp_path):
    from tuner.driver import schema_lock

    url = f"sqlite:///{tmp_path / 'tuning.db'}?password=SeCrEtMaRkEr"
    with schema_lock(url):
        pass
    assert not [p for p in tmp_path.iterdir() if "SeCrEtMaRkEr" in p.name]


# --------------------------------------------------------------------------- issue 22: signing and settings, every source

def _winner_db(path) -> str:
    """A tuning database holding one gemm winner (the tables the runtime's query reads)."""
    with closing(sqlite3.connect(path)) as con, con:
        con.execute("create table opsadv_problems (id integer primary key, op text, key text)")
        con.execute("create table opsadv_winners (problem_id integer, device_class text, impl text, params text, "
                    "kernel_version text, median_ms real, vendor_impl text, vendor_ms real, speedup real)")
        con.execute("insert into opsadv_problems values (1, 'gemm', ?)", (json.dumps(PROB),))
        con.execute("insert into opsadv_winners values (1, 'cpu', 'cpu_blocked', ?, ?, 1.0, 'torch_matmul', 2.0, 2.0)",
                    (json.dumps(GOOD), kernel_space.get_impl("gemm", "cpu_blocked").version))
    return str(path)


def _source(a=None, b=None) -> str:
    a = torch.randn(PROB["M"], PROB["K"]) if a is None else a
    b = torch.randn(PROB["K"], PROB["N"]) if b is None else b
    return ops_adv.explain("gemm", a, b)["source"]


@pytest.mark.parametrize("how", ["OPS_ADV_TABLE", "OPS_ADV_DB", "OPS_ADV_DB bare path", "OPS_ADV_TABLE bare path"])
def test_database_tables_with_a_key_are_refused_with_one_warning(tmp_path, monkeypatch, restore_table, how):
    path = _winner_db(tmp_path / "tuning.db")
    var = how.split()[0]
    monkeypatch.delenv("OPS_ADV_TABLE", raising=False)
    monkeypatch.setenv(var, path if "bare" in how else f"sqlite:///{path}")
    ops_adv.load_table()
    assert _source() == "tuned"  # no key: the database's winners are used
    monkeypatch.setenv("OPS_ADV_TABLE_KEY", "k1")
    with pytest.warns(_table.UnsignedSource) as seen:
        assert ops_adv.load_table() == {}
    assert len(seen) == 1
    msg = str(seen[0].message)
    assert "OPS_ADV_TABLE_KEY" in msg and "python -m ops_adv sign" in msg and "\n" not in msg
    assert _source() == "default"  # the vendor kernels run


def test_bare_path_db_is_sqlite_not_json(tmp_path, monkeypatch, restore_table):
    monkeypatch.delenv("OPS_ADV_TABLE", raising=False)
    monkeypatch.delenv("OPS_ADV_TABLE_KEY", raising=False)
    monkeypatch.setenv("OPS_ADV_DB", str(tmp_path / "missing.db"))
    with pytest.raises(ops_adv.TableError) as e:
        ops_adv.load_table()
    assert "does not exist" in str(e.value) and "JSON" not in str(e.value)
    monkeypatch.chdir(tmp_path)
    _winner_db(tmp_path / "here.db")
    monkeypatch.setenv("OPS_ADV_DB", "here.db")  # relative, as the tuner takes it
    assert ops_adv.load_table()["cpu"]["gemm"]


def test_non_ascii_signature_and_non_utf8_key_are_one_line(tmp_path, monkeypatch, restore_table):
    path = _write(tmp_path / "t.json", [_winner(GOOD)], signature="é" * 64)
    monkeypatch.setenv("OPS_ADV_TABLE_KEY", "k1")
    with pytest.raises(ops_adv.TableError, match="signed with another key or changed") as e:
        ops_adv.load_table(str(path))
    assert "\n" not in str(e.value)
    key = os.fsdecode(b"k\xff\xfe")  # undecodable bytes in the environment
    monkeypatch.setenv("OPS_ADV_TABLE_KEY", key)
    with pytest.raises(ops_adv.TableError, match="signed with another key or changed"):
        ops_adv.load_table(str(path))
    d = json.loads(path.read_text())
    d["signature"] = _table.signature(d, key)
    path.write_text(json.dumps(d))
    assert ops_adv.load_table(str(path))["cpu"]["gemm"]


@pytest.mark.parametrize("value", ["abc", "-1", "nan", "1,5"])
def test_bad_nearest_is_one_warning_and_the_default(tmp_path, monkeypatch, restore_table, value):
    from ops_adv import _settings

    monkeypatch.setenv("OPS_ADV_NEAREST", value)
    monkeypatch.setattr(_settings, "_nearest_seen", (None, _settings.NEAREST_DEFAULT))
    ops_adv.load_table(str(_write(tmp_path / "t.json", [_winner(GOOD)])))
    near = torch.randn(PROB["M"] + 8, PROB["K"])  # within the default distance
    with pytest.warns(RuntimeWarning, match="OPS_ADV_NEAREST") as seen:
        assert _source(a=near) == "nearest"
        assert _source(a=torch.randn(PROB["M"] + 9, PROB["K"])) == "nearest"
    assert len([w for w in seen if "OPS_ADV_NEAREST" in str(w.message)]) == 1
    assert "\n" not in str(seen[0].message)
