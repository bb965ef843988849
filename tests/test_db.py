"""Migrations, schema checks and coexistence with Optuna's tables."""
from __future__ import annotations

import pytest
from sqlalchemy import inspect

import db
from conftest import cli


def test_upgrade_creates_prefixed_tables_and_own_version_table(sqlite_url):
    engine = db.open_db(sqlite_url)
    names = set(inspect(engine).get_table_names())
    assert {"opsadv_devices", "opsadv_problems", "opsadv_runs", "opsadv_trials", "opsadv_winners", "opsadv_alembic_version"} <= names
    assert "alembic_version" not in names
    assert db.current(engine) == db.head()


def test_optuna_storage_shares_the_database(sqlite_url):
    import optuna

    engine = db.open_db(sqlite_url)
    storage = optuna.storages.RDBStorage(sqlite_url)
    study = optuna.create_study(storage=storage, study_name="s")
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    names = set(inspect(engine).get_table_names())
    assert "studies" in names and "opsadv_winners" in names
    db.upgrade(engine)  # ours stays at head; optuna's tables are left alone
    assert db.current(engine) == db.head()
    assert len(optuna.load_study(study_name="s", storage=storage).trials) == 2


def test_stale_schema_is_refused_with_the_fix(sqlite_url):
    engine = db.make_engine(sqlite_url)
    with pytest.raises(db.DatabaseError, match="opsadv-db upgrade"):
        db.check_schema(engine, sqlite_url)


def test_opsadv_db_cli(sqlite_url):
    r = cli("opsadv-db", "current", sqlite_url)  # only reads: a path with no database is an error, and stays empty
    assert r.returncode == 2 and "no database at" in r.stderr, r.stderr
    r = cli("opsadv-db", "upgrade", sqlite_url)
    assert r.returncode == 0 and db.head() in r.stdout, r.stderr
    r = cli("opsadv-db", "current", sqlite_url)
    assert r.stdout.strip() == f"{db.head()} (head)"


def test_redact_hides_passwords():
    assert db.redact("postgresql://u:s3cret@h:5432/d") == "postgresql://u:***@h:5432/d"
    assert db.redact("sqlite:////x/y.db") == "sqlite:////x/y.db"


def test_unreachable_database_is_one_line_without_password():
    r = cli("opsadv-db", "upgrade", "postgresql://me:hunter2@127.0.0.1:1/nodb")
    assert r.returncode == 2
    assert "hunter2" not in r.stderr + r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot reach database" in lines[0] and "me:***@" in lines[0], r.stderr
