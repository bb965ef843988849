"""Migrations and a short tune against PostgreSQL (OPS_ADV_TEST_PG_URL; CI starts a server)."""
from __future__ import annotations

import os

import pytest
from sqlalchemy import inspect, select
from sqlalchemy.orm import Session

import db
from kernel_space import get_op

PG_URL = os.environ.get("OPS_ADV_TEST_PG_URL")

if not PG_URL:
    if os.environ.get("CI") == "true":
        raise RuntimeError("CI=true but OPS_ADV_TEST_PG_URL is unset: .ci/run must start PostgreSQL and export it")
    pytestmark = pytest.mark.skip(reason="no PostgreSQL: set OPS_ADV_TEST_PG_URL=postgresql://USER@HOST/DB to run these")
else:
    pytestmark = pytest.mark.postgres


@pytest.fixture
def pg_url():
    """A clean schema for each test: drop every table left by an earlier one."""
    engine = db.make_engine(PG_URL)
    from sqlalchemy import MetaData

    md = MetaData()
    md.reflect(engine)
    md.drop_all(engine)
    engine.dispose()
    return PG_URL


def test_migrations_on_postgres(pg_url):
    engine = db.open_db(pg_url)
    assert db.current(engine) == db.head()
    names = set(inspect(engine).get_table_names())
    assert {"opsadv_trials", "opsadv_winners", "opsadv_alembic_version"} <= names


@pytest.mark.ray
def test_short_tune_on_postgres(ray_session, pg_url):
    from tuner import TuneOptions, Tuner

    problems = [("gemm", get_op("gemm").problem(64, 96, 64)), ("attention", get_op("attention").problem(1, 2, 32, 48, 16))]
    rows = Tuner(TuneOptions(device="cpu", problems=problems, db_url=pg_url, trials=5, log=lambda s: None)).run()
    assert len(rows) == 2
    engine = db.open_db(pg_url, migrate=False)
    with Session(engine) as s:
        assert len(s.scalars(select(db.Winner)).all()) == 2
        assert len(s.scalars(select(db.Trial)).all()) >= 4
    names = set(inspect(engine).get_table_names())
    assert "studies" in names  # Optuna's storage lives beside ours
    from ops_adv import _table

    tables = _table.read_database(pg_url)  # the runtime can read a fleet database too
    assert sum(len(t.winners) for t in tables) == 2
